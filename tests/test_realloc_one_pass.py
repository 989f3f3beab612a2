"""Checks one-pass moves (real_py/realloc/direct.py) and compiled in-process moves (InProcessMove):
every rank's messages straight from the senders' source shards into its destination shard in one
compiled copy, bit for bit against tests/support/oracle.py, replayed, sources untouched.

A failure points to direct.py (entries, buffer keys), the in-process transport's publish /
release slots (transports/inprocess.py), InProcessMove (inprocess_move.py), the executor
(executor.py) or the copy plans (real_py/ops.py, csrc/ops/).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from support.oracle import data_mask, oracle_flat, random_full, random_layout, tiny_spec

from real_py import Layout, ModelShard, plan_realloc
from real_py.realloc.inprocess_move import InProcessMove
from real_py.realloc.reallocator import Reallocator, run_in_process
from real_py.realloc.transports import InProcessHub, TransferError, Transport

SPECS = [
    tiny_spec(tied=True),
    tiny_spec(bias=True),
    tiny_spec(layers=3, vocab=97, dtype="bfloat16"),
    tiny_spec(layers=2, vocab=53, dtype="float16"),
]


def case(rng, i, device="cpu"):
    model = SPECS[i % len(SPECS)]
    full = random_full(model, i)
    src, dst = random_layout(rng, 8, model.num_layers), random_layout(rng, 8, model.num_layers)
    plan = plan_realloc(model, src, dst, mode=("p2p", "broadcast")[i % 2])
    srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
    if device != "cpu":
        srcs = {r: ModelShard(model, src, r, s.flat.to(device)) for r, s in srcs.items()}
    return model, full, src, dst, plan, srcs


def check(model, full, dst, dsts, tag):
    for r in dst.ranks:
        assert torch.equal(dsts[r].flat.cpu(), oracle_flat(model, dst, r, full)), f"{tag}: rank {r}"


@pytest.mark.parametrize("threads", [True, False])
def test_compiled_move_replays_bitwise(threads):
    """Random pairs: one InProcessMove per pair, run three times into fresh and reused shards."""
    rng = random.Random(31)
    for i in range(120):
        model, full, src, dst, plan, srcs = case(rng, i)
        before = {r: s.flat.clone() for r, s in srcs.items()}
        with InProcessMove(InProcessHub(timeout=20), plan, threads=threads) as move:
            for k in range(3):
                dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
                if k == 2:  # stale data where the move writes
                    for r, d in dsts.items():
                        d.flat[data_mask(model, dst, r)] = 3
                stats = move.run(srcs, dsts)
                check(model, full, dst, dsts, f"pair {i} {src}->{dst} call {k}")
            plans = {r: dict(x.runner._plans) for r, x in move.reallocs.items()}
            move.run(srcs, dsts)
            assert all(plans[r] == x.runner._plans for r, x in move.reallocs.items()), (
                "copy rebuilt"
            )
        for r, s in srcs.items():
            assert torch.equal(s.flat, before[r]), f"pair {i}: source of rank {r} modified"
        want = plan.per_rank_bytes()
        for r, st in stats.items():
            assert st["one_pass"] and st["staging_bytes"] == 0 and st["rounds"] == 1
            assert (st["sent_bytes"], st["received_bytes"]) == (want[r]["send"], want[r]["recv"])


def test_one_pass_free_source_waits_for_readers():
    rng = random.Random(5)
    for i in range(30):
        model, full, src, dst, plan, srcs = case(rng, i)
        srcs = {r: ModelShard(model, src, r, s.flat.clone()) for r, s in srcs.items()}
        dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
        kept = {r: s for r, s in srcs.items() if r in dst.ranks}  # a rank in both keeps its source
        with InProcessMove(InProcessHub(timeout=20), plan) as move:
            move.run(
                {r: s for r, s in srcs.items() if r not in kept} | kept, dsts, free_source=True
            )
        check(model, full, dst, dsts, f"pair {i}")
        assert all(s.flat.untyped_storage().nbytes() == 0 for s in srcs.values())


def test_failing_rank_named_by_its_peers():
    model = SPECS[0]
    full = random_full(model, 2)
    src, dst = Layout.parse("tp2"), Layout.parse("tp1", ranks=(2,))
    plan = plan_realloc(model, src, dst)
    srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
    wrong = {0: srcs[0], 1: ModelShard.from_full(model, src, 0, full)}  # rank 1 gets rank 0's shard
    errors = {}

    def work(r, hub):
        try:
            Reallocator(plan, hub.transport(r)).run(
                wrong.get(r), ModelShard.empty(model, dst, r) if r == 2 else None
            )
        except (TransferError, ValueError) as e:
            errors[r] = str(e)

    hub = InProcessHub(timeout=20)
    ts = [threading.Thread(target=work, args=(r, hub)) for r in (0, 1, 2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert "source shard belongs to rank 0, this is rank 1" in errors[1]
    assert errors[2].startswith(
        "rank 2: peer rank 1 failed during one-pass copy (input check: ValueError: "
        "source shard belongs to rank 0"
    ), errors[2]


def test_one_pass_options_checked():
    model = SPECS[0]
    plan = plan_realloc(model, Layout.parse("tp2"), Layout.parse("dp2"))
    with pytest.raises(
        ValueError, match=r"verify=True checksums chunks on the wire.*one_pass=False"
    ):
        Reallocator(plan, InProcessHub().transport(0), verify=True, one_pass=True)

    class Wire(Transport):
        def exchange(self, sends, recvs, step):
            pass

    t = Wire()
    t.rank = 0
    with pytest.raises(
        ValueError, match=r"one_pass=True needs a transport that addresses its peers"
    ):
        Reallocator(plan, t, one_pass=True)
    assert (
        not Reallocator(plan, t).one_pass
        and Reallocator(plan, InProcessHub().transport(0)).one_pass
    )
    with pytest.raises(ValueError, match=r"threads=False\) runs one-pass moves only"):
        InProcessMove(InProcessHub(), plan, threads=False, verify=True)


def test_run_in_process_matches_staged():
    """run_in_process (one pass by default) and the staged round loop give the same shards."""
    rng = random.Random(8)
    for i in range(40):
        model, full, src, dst, plan, srcs = case(rng, i)
        got = {}
        for one_pass in (True, False):
            dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
            run_in_process(
                InProcessHub(timeout=20), plan, srcs, dsts, one_pass=one_pass, bucket_bytes=4096
            )
            got[one_pass] = dsts
        for r in dst.ranks:
            assert torch.equal(got[True][r].flat, got[False][r].flat), (i, r)


@pytest.mark.parametrize("threads", [True, False])
def test_compiled_moe_move(threads):
    """An MoE plan's dense and expert parts in one compiled copy per rank, replayed."""
    from real_py import model_spec
    from real_py.realloc import ExpertShard, plan_moe_realloc

    model = model_spec("moe-tiny")
    full = random_full(model, 3)
    for a, b in (("dp4,ep4", "tp4,etp4"), ("dp2,tp2,etp2", "dp4,ep2"), ("tp2,pp2", "dp4,ep4")):
        src, dst = Layout.parse(a), Layout.parse(b)
        plan = plan_moe_realloc(model, src, dst)
        srcs = {
            r: (
                ModelShard.from_full(model, src, r, full),
                ExpertShard.from_full(model, src, r, full),
            )
            for r in src.ranks
        }
        with InProcessMove(InProcessHub(timeout=20), plan, threads=threads) as move:
            for _ in range(2):
                dsts = {
                    r: (ModelShard.empty(model, dst, r), ExpertShard.empty(model, dst, r))
                    for r in dst.ranks
                }
                stats = move.run(srcs, dsts)
                for r, (d, e) in dsts.items():
                    assert torch.equal(d.flat, ModelShard.from_full(model, dst, r, full).flat), (
                        a,
                        b,
                        r,
                    )
                    assert torch.equal(e.flat, ExpertShard.from_full(model, dst, r, full).flat), (
                        a,
                        b,
                        r,
                    )
        assert all(st["one_pass"] for st in stats.values())


@pytest.mark.cuda
@pytest.mark.parametrize("threads", [True, False])
def test_compiled_move_cuda(threads):
    rng = random.Random(13)
    for i in range(20):
        model, full, src, dst, plan, srcs = case(rng, i, device="cuda")
        with InProcessMove(InProcessHub(timeout=60), plan, threads=threads) as move:
            for _ in range(2):
                dsts = {r: ModelShard.empty(model, dst, r, device="cuda") for r in dst.ranks}
                move.run(srcs, dsts)
                torch.cuda.synchronize()
                check(model, full, dst, dsts, f"pair {i} {src}->{dst}")
