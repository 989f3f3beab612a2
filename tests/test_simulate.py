"""Cluster simulator (real_py/realloc/simulate.py): hand-computed cases, the lower bound, bad input.

A failure points to simulate() (link mapping, round replay) or schedule_transfers (chunk table
from the C++ per-rank schedule with rank -1).
"""

from __future__ import annotations

import numpy as np
import pytest

from real_py import Layout, plan_realloc
from real_py.realloc.schedule import Schedule
from real_py.realloc.simulate import (CLUSTERS, Cluster, Transfers, broadcast_per_node,
                                      schedule_transfers, simulate)

from dist_cases import SPECS, named_pairs

GB = 1e9


def transfers(rows):
    """rows: (round, sender, receivers, bytes)."""
    ptr = np.cumsum([0] + [len(r[2]) for r in rows])
    return Transfers(np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), ptr,
                     np.array([x for r in rows for x in r[2]]), np.array([r[3] for r in rows]))


def test_two_nodes_one_message():
    c = Cluster("t", nodes=2, gpus_per_node=2, nvlink_GBps=100, nics_per_node=1, nic_GBps=10,
                latency_s=1e-3)
    res = simulate(transfers([(0, 0, [2], 5 * GB)]), c)
    assert res.seconds == pytest.approx(0.5 + 1e-3)
    assert res.lower_bound == pytest.approx(0.5) and res.nic_bound == pytest.approx(0.5)
    assert res.nvlink_bound == 0 and "NIC 0 of node 0 (egress)" == res.bottleneck


def test_one_nic_shared_by_two_messages():
    # GPUs 0 and 1 of node 0 share its one NIC; each sends 2 GB to a GPU of node 1.
    c = Cluster("t", nodes=2, gpus_per_node=2, nvlink_GBps=100, nics_per_node=1, nic_GBps=10,
                latency_s=1e-3)
    res = simulate(transfers([(0, 0, [2], 2 * GB), (0, 1, [3], 2 * GB)]), c)
    assert res.seconds == pytest.approx(0.4 + 1e-3)
    # Two NICs per node: each message has its own, half the time.
    c2 = Cluster("t", nodes=2, gpus_per_node=2, nvlink_GBps=100, nics_per_node=2, nic_GBps=10,
                 latency_s=1e-3)
    assert simulate(transfers([(0, 0, [2], 2 * GB), (0, 1, [3], 2 * GB)]), c2).seconds == \
        pytest.approx(0.2 + 1e-3)


def test_rounds_in_sequence_and_nvlink():
    c = Cluster("t", nodes=1, gpus_per_node=4, nvlink_GBps=100, nics_per_node=1, nic_GBps=10,
                latency_s=0)
    # Round 0: 0 -> 1 (1 GB at 100 GB/s: 10 ms). Round 1: 1 -> 2 and 3 -> 0 both wait for their
    # ranks' round 0 (ranks 1 and 0: done at 10 ms): 1 -> 2 ends at 20 ms, 3 -> 0 (3 GB) at 40 ms.
    res = simulate(transfers([(0, 0, [1], GB), (1, 1, [2], GB), (1, 3, [0], 3 * GB)]), c)
    assert res.seconds == pytest.approx(0.04)
    assert res.nvlink_bound == pytest.approx(0.03) and res.nic_bound == 0
    assert res.bottleneck == "NVLink egress of GPU 3"
    # Without the round-0 dependency (3 -> 2 in round 0 too), 3 -> 0 alone sets the time.
    res = simulate(transfers([(0, 0, [1], GB), (0, 3, [2], 3 * GB)]), c)
    assert res.seconds == pytest.approx(0.03) == res.lower_bound


@pytest.mark.parametrize("case", named_pairs(8), ids=lambda c: c[0])
def test_never_below_the_bound(case):
    _, model, src, dst = case
    c = Cluster("t", nodes=4, gpus_per_node=2, nvlink_GBps=20, nics_per_node=1, nic_GBps=2,
                latency_s=1e-6)
    for mode in ("p2p", "broadcast"):
        plan = plan_realloc(model, src, dst, mode=mode, ranks_per_node=2)
        for round_elems in (64, 1 << 20):
            t = schedule_transfers(plan, round_elems)
            # The chunk table is the global Schedule's, chunk for chunk (sizes, peers, rounds).
            glob = Schedule(plan, round_elems, 0)
            want = [(k, ch.sender, ch.receivers, ch.numel * model.element_size)
                    for k, chunks in enumerate(glob.rounds) for ch in chunks]
            got = [(int(t.round[i]), int(t.sender[i]),
                    tuple(t.receivers[t.recv_ptr[i]:t.recv_ptr[i + 1]].tolist()), int(t.nbytes[i]))
                   for i in range(len(t.round))]
            assert sorted(got) == sorted(want)
            res = simulate(t, c)
            assert res.seconds >= res.lower_bound - 1e-12
            base = simulate(broadcast_per_node(plan, c), c)
            assert base.seconds >= base.lower_bound - 1e-12


def test_bad_input():
    with pytest.raises(ValueError, match="nics_per_node"):
        Cluster("x", 1, 8, 450, 0, 50)
    with pytest.raises(ValueError, match="nic_GBps"):
        Cluster("x", 1, 8, 450, 8, 0)
    c = CLUSTERS["dgx-h100"]  # one node, 8 GPUs
    plan = plan_realloc(SPECS[0], Layout.parse("tp2"), Layout.parse("dp2", ranks=(8, 9)))
    with pytest.raises(ValueError, match="has 8 GPUs"):
        simulate(schedule_transfers(plan), c)
