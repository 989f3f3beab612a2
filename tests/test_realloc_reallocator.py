"""Checks the reallocator end to end with the in-process transport (all ranks in one process).

A failure points to the bucket schedule (real_py/realloc/rank_schedule.py;
tests/support/schedule_oracle.py), staging/direct-send handling in real_py/realloc/reallocator.py,
the ops, or the in-process transport; the oracle is tests/support/oracle.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from support.oracle import oracle_flat, random_full, random_layout, tiny_spec
from support.schedule_oracle import Schedule, split_descs

from real_py import Layout, ModelShard, gather_full, plan_realloc
from real_py.realloc.reallocator import Reallocator, run_in_process
from real_py.realloc.transports import InProcessHub, TransferError

SPECS = [
    tiny_spec(tied=True),
    tiny_spec(bias=True),
    tiny_spec(head="value"),
    tiny_spec(tied=True, layers=3, vocab=97, dtype="bfloat16"),
    tiny_spec(layers=2, vocab=53, dtype="float64"),
    tiny_spec(layers=2, dtype="float16"),
]


def realloc(model, src, dst, srcs, *, mode="p2p", bucket_bytes=1 << 20, one_pass=None):
    plan = plan_realloc(model, src, dst, mode=mode)
    dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
    stats = run_in_process(
        InProcessHub(timeout=20), plan, srcs, dsts, bucket_bytes=bucket_bytes, one_pass=one_pass
    )
    for r, s in stats.items():
        assert s["staging_bytes"] <= bucket_bytes, (
            f"rank {r} staged {s['staging_bytes']} > {bucket_bytes}"
        )
    return dsts


def test_random_pairs_bitwise():
    """1000 seeded random (src, dst) pairs, both modes, buckets 512 B to 1 MiB (8 B: next test);
    one pair in three through the staged round loop, the others in one pass (direct.py)."""
    rng = random.Random(7)
    for i in range(1000):
        model = SPECS[i % len(SPECS)]
        full = random_full(model, i)
        src = random_layout(rng, 8, model.num_layers)
        dst = random_layout(rng, 8, model.num_layers)
        srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
        before = {r: s.flat.clone() for r, s in srcs.items()}
        bucket = rng.choice([512, 1 << 12, 1 << 16, 1 << 20])
        dsts = realloc(
            model,
            src,
            dst,
            srcs,
            mode=("p2p", "broadcast")[i % 2],
            bucket_bytes=bucket,
            one_pass=i % 3 != 0,
        )
        for r in dst.ranks:
            assert torch.equal(dsts[r].flat, oracle_flat(model, dst, r, full)), (
                f"pair {i} {src}->{dst} bucket {bucket}: rank {r} differs from the oracle"
            )
        for r, s in srcs.items():
            assert torch.equal(s.flat, before[r]), (
                f"pair {i}: source shard of rank {r} was modified"
            )


def test_round_trip_restores_source():
    rng = random.Random(11)
    for i in range(60):
        model = SPECS[i % len(SPECS)]
        full = random_full(model, i)
        a = random_layout(rng, 8, model.num_layers)
        b = random_layout(rng, 8, model.num_layers)
        srcs = {r: ModelShard.from_full(model, a, r, full) for r in a.ranks}
        mid = realloc(model, a, b, srcs, bucket_bytes=rng.choice([256, 1 << 16]))
        back = realloc(model, b, a, mid, mode="broadcast", bucket_bytes=rng.choice([256, 1 << 16]))
        for r in a.ranks:
            assert torch.equal(back[r].flat, srcs[r].flat), f"round trip {a}->{b}->{a}: rank {r}"
        assert all(
            torch.equal(full[k], v)
            for k, v in gather_full(
                model, [back[r] for r in a.ranks if a.coords(r)[0] == 0]
            ).items()
        )


def test_bucket_size_does_not_change_result():
    model = SPECS[0]
    full = random_full(model, 3)
    src, dst = Layout.parse("dp2,tp3,pp1"), Layout.parse("dp1,tp2,pp3", ranks=range(2, 8))
    srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
    results = [realloc(model, src, dst, srcs, bucket_bytes=b) for b in (8, 100, 4096, 1 << 30)]
    for r in dst.ranks:
        assert all(torch.equal(results[0][r].flat, x[r].flat) for x in results[1:])


def test_staging_allocated_once_and_bounded():
    model = SPECS[1]
    full = random_full(model, 5)
    src, dst = Layout.parse("dp1,tp2,pp2"), Layout.parse("dp2,tp3,pp1", ranks=range(4, 10))
    plan = plan_realloc(model, src, dst)
    srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
    hub = InProcessHub(timeout=20)
    # The staged round loop (one pass, the in-process default, stages nothing).
    reallocs = {
        r: Reallocator(plan, hub.transport(r), bucket_bytes=1024, one_pass=False)
        for r in plan.ranks()
    }
    dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
    import threading

    def go():
        threads = [
            threading.Thread(target=lambda r=r: reallocs[r].run(srcs.get(r), dsts.get(r)))
            for r in reallocs
        ]
        [t.start() for t in threads]
        [t.join() for t in threads]

    go()
    buffers = {r: x.staging for r, x in reallocs.items() if x.staging is not None}
    assert buffers and all(b.numel() * b.element_size() <= 1024 for b in buffers.values())
    go()  # second call reuses the same buffers
    assert all(reallocs[r].staging is b for r, b in buffers.items())
    for r in dst.ranks:
        assert torch.equal(dsts[r].flat, oracle_flat(model, dst, r, full))


def test_split_descs_covers_ranges_exactly():
    """Chunking a message at arbitrary element boundaries keeps every element exactly once."""
    import numpy as np

    rng = random.Random(2)
    for _ in range(200):
        descs, off = [], 0
        for _ in range(rng.randint(1, 5)):
            ln, n = rng.randint(1, 7), rng.randint(1, 5)
            stride = ln + rng.randint(0, 3)
            descs.append((off, 1000 + off, ln, n, stride, stride + 1))
            off += n * stride + 5
        descs = np.array(descs, np.int64)
        total = int((descs[:, 2] * descs[:, 3]).sum())

        def elems(d):
            return [
                (so + i * ss + e, do + i * ds + e)
                for so, do, ln, n, ss, ds in d.tolist()
                for i in range(n)
                for e in range(ln)
            ]

        cuts = sorted({0, total, *rng.sample(range(total + 1), min(total, 4))})
        pieces = [elems(split_descs(descs, a, b)) for a, b in zip(cuts, cuts[1:])]
        assert [p for piece in pieces for p in piece] == elems(descs)


def test_schedule_rounds_respect_bucket():
    model = SPECS[0]
    plan = plan_realloc(
        model, Layout.parse("dp1,tp1,pp2"), Layout.parse("dp3,tp2,pp1", ranks=range(2, 8))
    )
    sched = Schedule(plan, 200)
    for chunks in sched.rounds:
        load = {}
        for c in chunks:
            for r in (c.sender,) + c.receivers:
                load[r] = load.get(r, 0) + c.numel
        assert max(load.values()) <= 200


# ---------------------------------------------------------------------------- bad input


def _setup():
    model = SPECS[0]
    full = random_full(model, 0)
    src, dst = Layout.parse("dp1,tp2,pp1"), Layout.parse("dp1,tp1,pp2", ranks=(1, 2))
    plan = plan_realloc(model, src, dst)
    return model, full, src, dst, plan


def test_shard_for_other_layout_rejected_before_writing():
    model, full, src, dst, plan = _setup()
    hub = InProcessHub(timeout=5)
    wrong = ModelShard.from_full(model, Layout.parse("dp1,tp1,pp2", ranks=(1, 9)), 1, full)
    dst_shard = ModelShard.empty(model, dst, 1)
    dst_shard.flat.fill_(7)
    with pytest.raises(
        ValueError,
        match=r"source shard was built for layout dp1tp1pp2, the plan's "
        r"source layout is dp1tp2pp1",
    ):
        Reallocator(plan, hub.transport(1)).run(wrong, dst_shard)
    assert bool((dst_shard.flat == 7).all()), "destination written despite failed validation"


def test_shard_for_other_model_rejected():
    model, full, src, dst, plan = _setup()
    other = SPECS[1]
    shard = ModelShard.from_full(other, src, 0, random_full(other, 0))
    with pytest.raises(
        ValueError,
        match=r"source shard was built for model tiny-bias-lm, the plan is "
        r"for tiny-tied-lm",
    ):
        Reallocator(plan, InProcessHub().transport(0)).run(shard, None)


def test_missing_or_unexpected_shard():
    model, full, src, dst, plan = _setup()
    with pytest.raises(
        ValueError, match=r"rank 0 is in the source layout dp1tp2pp1 but passed no source"
    ):
        Reallocator(plan, InProcessHub().transport(0)).run(None, None)
    shard = ModelShard.empty(model, dst, 2)
    with pytest.raises(
        ValueError, match=r"rank 0 is not in the destination layout .* but passed a"
    ):
        Reallocator(plan, InProcessHub().transport(0)).run(
            ModelShard.from_full(model, src, 0, full), shard
        )


def test_wrong_rank_shard():
    model, full, src, dst, plan = _setup()
    with pytest.raises(ValueError, match=r"source shard belongs to rank 1, this is rank 0"):
        Reallocator(plan, InProcessHub().transport(0)).run(
            ModelShard.from_full(model, src, 1, full), None
        )


def test_dead_peer_fails_fast_naming_it():
    """A rank that never shows up: its peers raise within the timeout, naming it and the step."""
    model, full, src, dst, plan = _setup()
    hub = InProcessHub(timeout=1.0)
    dst_shard = ModelShard.empty(model, dst, 2)
    with pytest.raises(
        TransferError,
        match=r"rank 2: timed out after 1 s in round 0/\d+ waiting to "
        r"receive from peer rank [01]",
    ):
        Reallocator(plan, hub.transport(2), one_pass=False).run(None, dst_shard)
    with pytest.raises(
        TransferError,
        match=r"rank 2: timed out after 1 s in one-pass copy waiting to "
        r"read the source buffers of peer rank [01]",
    ):
        Reallocator(plan, InProcessHub(timeout=1.0).transport(2)).run(None, dst_shard)


def test_bucket_too_small():
    model, full, src, dst, plan = _setup()
    with pytest.raises(ValueError, match=r"bucket_bytes=4 is smaller than two elements"):
        Reallocator(plan, InProcessHub().transport(0), bucket_bytes=4)


@pytest.mark.parametrize("pipeline", [True, False])
def test_stats_phases_per_round(pipeline):
    """run() reports seconds per phase and per round: one row per round of the rank, phases
    non-negative, their sum within the run's seconds; pack / unpack time where rounds stage."""
    model = SPECS[1]
    full = random_full(model, 6)
    src, dst = Layout.parse("dp1,tp2,pp2"), Layout.parse("dp2,tp3,pp1", ranks=range(4, 10))
    plan = plan_realloc(model, src, dst)
    srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
    dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
    stats = run_in_process(
        InProcessHub(timeout=20),
        plan,
        srcs,
        dsts,
        bucket_bytes=2048,
        direct_min_bytes=0,
        pipeline=pipeline,
        one_pass=False,
    )
    for r, st in stats.items():
        assert [row[0] for row in st["per_round"]] == sorted({row[0] for row in st["per_round"]})
        assert len(st["per_round"]) == st["rounds"] > 0, (r, st["rounds"])
        assert set(st["phases"]) == {"local", "pack", "post", "wait", "unpack"}
        assert all(v >= 0 for v in st["phases"].values())
        assert sum(st["phases"].values()) <= st["seconds"]
        for j, k in enumerate(("pack", "post", "wait", "unpack"), 1):
            assert abs(sum(row[j] for row in st["per_round"]) - st["phases"][k]) < 1e-9
    assert any(st["phases"]["pack"] > 0 for r, st in stats.items() if r in src.ranks)
    assert any(st["phases"]["unpack"] > 0 for r, st in stats.items() if r in dst.ranks)
    for r in dst.ranks:
        assert torch.equal(dsts[r].flat, oracle_flat(model, dst, r, full))
