"""Cluster simulator (real_py/realloc/simulate.py): hand-computed cases, the lower bound, bad input.

A failure points to simulate() (link mapping, round replay) or schedule_transfers (chunk table
from the C++ per-rank schedule with rank -1).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.dist_cases import SPECS, named_pairs
from support.schedule_oracle import Schedule

from real_py import Layout, plan_realloc
from real_py.realloc.simulate import (
    CLUSTERS,
    Cluster,
    Transfers,
    broadcast_per_node,
    schedule_transfers,
    simulate,
)

GB = 1e9


def transfers(rows):
    """rows: (round, sender, receivers, bytes)."""
    ptr = np.cumsum([0] + [len(r[2]) for r in rows])
    return Transfers(
        np.array([r[0] for r in rows]),
        np.array([r[1] for r in rows]),
        ptr,
        np.array([x for r in rows for x in r[2]]),
        np.array([r[3] for r in rows]),
    )


def test_two_nodes_one_message():
    c = Cluster(
        "t", nodes=2, gpus_per_node=2, nvlink_GBps=100, nics_per_node=1, nic_GBps=10, latency_s=1e-3
    )
    res = simulate(transfers([(0, 0, [2], 5 * GB)]), c)
    assert res.seconds == pytest.approx(0.5 + 1e-3)
    assert res.lower_bound == pytest.approx(0.5) and res.nic_bound == pytest.approx(0.5)
    assert res.nvlink_bound == 0 and "NIC 0 of node 0 (egress)" == res.bottleneck


def test_one_nic_shared_by_two_messages():
    # GPUs 0 and 1 of node 0 share its one NIC; each sends 2 GB to a GPU of node 1.
    c = Cluster(
        "t", nodes=2, gpus_per_node=2, nvlink_GBps=100, nics_per_node=1, nic_GBps=10, latency_s=1e-3
    )
    res = simulate(transfers([(0, 0, [2], 2 * GB), (0, 1, [3], 2 * GB)]), c)
    assert res.seconds == pytest.approx(0.4 + 1e-3)
    # Two NICs per node: each message has its own, half the time.
    c2 = Cluster(
        "t", nodes=2, gpus_per_node=2, nvlink_GBps=100, nics_per_node=2, nic_GBps=10, latency_s=1e-3
    )
    assert simulate(
        transfers([(0, 0, [2], 2 * GB), (0, 1, [3], 2 * GB)]), c2
    ).seconds == pytest.approx(0.2 + 1e-3)


def test_rounds_in_sequence_and_nvlink():
    c = Cluster(
        "t", nodes=1, gpus_per_node=4, nvlink_GBps=100, nics_per_node=1, nic_GBps=10, latency_s=0
    )
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
    c = Cluster(
        "t", nodes=4, gpus_per_node=2, nvlink_GBps=20, nics_per_node=1, nic_GBps=2, latency_s=1e-6
    )
    for mode in ("p2p", "broadcast"):
        plan = plan_realloc(model, src, dst, mode=mode, ranks_per_node=2)
        for round_elems in (64, 1 << 20):
            t = schedule_transfers(plan, round_elems)
            # The chunk table is the global Schedule's, chunk for chunk (sizes, peers, rounds).
            glob = Schedule(plan, round_elems, 0)
            want = [
                (k, ch.sender, ch.receivers, ch.numel * model.element_size)
                for k, chunks in enumerate(glob.rounds)
                for ch in chunks
            ]
            got = [
                (
                    int(t.round[i]),
                    int(t.sender[i]),
                    tuple(t.receivers[t.recv_ptr[i] : t.recv_ptr[i + 1]].tolist()),
                    int(t.nbytes[i]),
                )
                for i in range(len(t.round))
            ]
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


def _replay_numpy(u, v, l1, l2, nb, bounds, bw, w, latency):
    """Reference for the C++ round replay (the numpy loop that simulate() replaced): per round,
    links start at the latest of their free time and their hops' ranks' ready times, carry their
    round's bytes over their bandwidth plus the latency, and a hop's ranks are ready when its slower
    link is done."""
    ready, link_free = np.zeros(w), np.zeros(len(bw))
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        if a == b:
            continue
        ku, kv, kl1, kl2, kb = u[a:b], v[a:b], l1[a:b], l2[a:b], nb[a:b]
        start = np.maximum(ready[ku], ready[kv])
        links = np.concatenate((kl1, kl2))
        s = link_free.copy()
        np.maximum.at(s, links, np.concatenate((start, start)))
        load = np.zeros(len(bw))
        np.add.at(load, links, np.concatenate((kb, kb)).astype(np.float64))
        used = np.unique(links)
        link_free[used] = s[used] + load[used] / bw[used] + latency
        end = np.maximum(link_free[kl1], link_free[kl2])
        np.maximum.at(ready, ku, end)
        np.maximum.at(ready, kv, end)
    return float(ready.max()) if len(nb) else 0.0


@pytest.mark.parametrize("seed", range(6))
def test_round_replay_matches_numpy_reference(seed):
    """The C++ replay (csrc/planner/replay.cpp) gives the reference's seconds bit for bit on
    random hops: shared links, empty rounds, uneven bandwidths."""
    from real_py import _C

    rng = np.random.default_rng(seed)
    w, rounds, hops = int(rng.integers(2, 17)), int(rng.integers(1, 12)), int(rng.integers(1, 200))
    nlinks = 2 * w + 4
    rnd = np.sort(rng.integers(0, rounds, hops))
    u = rng.integers(0, w, hops)
    v = (u + rng.integers(1, w, hops)) % w
    l1 = np.where(rng.random(hops) < 0.5, u, 2 * w + rng.integers(0, 2, hops))  # egress links
    l2 = np.where(l1 < w, w + v, 2 * w + 2 + rng.integers(0, 2, hops))  # ingress links
    nb = rng.integers(1, 1 << 30, hops).astype(np.float64)
    bw = rng.uniform(1e9, 5e11, nlinks)
    bounds = np.searchsorted(rnd, np.arange(rounds + 1))
    got = _C.replay_rounds(u, v, l1, l2, nb, bounds, bw, w, 1e-5)
    assert got == _replay_numpy(u, v, l1, l2, nb, bounds, bw, w, 1e-5) and got > 0
    assert (
        _C.replay_rounds(u[:0], v[:0], l1[:0], l2[:0], nb[:0], np.zeros(1, np.int64), bw, w, 1e-5)
        == 0.0
    )


def test_round_replay_bad_input():
    from real_py import _C

    one = np.zeros(1, np.int64)
    bw = np.ones(4)
    with pytest.raises(ValueError, match="one entry per hop"):
        _C.replay_rounds(
            one, one, one, np.zeros(2, np.int64), np.ones(1), np.array([0, 1]), bw, 2, 0.0
        )
    with pytest.raises(ValueError, match="bounds"):
        _C.replay_rounds(one, one + 1, one, one + 2, np.ones(1), np.array([0, 2]), bw, 2, 0.0)
    with pytest.raises(ValueError, match="not decrease"):  # refused before reading hop 1..4
        _C.replay_rounds(one, one + 1, one, one + 2, np.ones(1), np.array([0, 5, 1]), bw, 2, 0.0)
    with pytest.raises(ValueError, match="num_ranks"):
        _C.replay_rounds(one, one + 1, one, one + 2, np.ones(1), np.array([0, 1]), bw, -1, 0.0)
    with pytest.raises(IndexError, match="link 9"):
        _C.replay_rounds(one, one + 1, one + 9, one + 2, np.ones(1), np.array([0, 1]), bw, 2, 0.0)
    with pytest.raises(IndexError, match="rank 5"):
        _C.replay_rounds(one + 5, one + 1, one, one + 2, np.ones(1), np.array([0, 1]), bw, 2, 0.0)
