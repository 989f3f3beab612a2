"""Checks direct (unstaged) sends of big contiguous pieces inside mixed messages: which chunks go
direct, staging shrinks, results bit for bit against tests/support/oracle.py, in-process and over
gloo.

A failure points to the message splitting in the C++ per-rank schedule
(real_py/realloc/rank_schedule.py, csrc/planner/rank_schedule.cpp) or its oracle
tests/support/schedule_oracle.py (_split_message, Chunk.contiguous) or the direct-send slices in
real_py/realloc/reallocator.py; byte counts point to the transports.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from support.dist_cases import SPECS, L, check_transfer, named_pairs, random_case
from support.oracle import oracle_flat, random_full
from support.schedule_oracle import Schedule

from real_py import ModelConfig, ModelShard, model_spec, plan_realloc
from real_py.realloc.reallocator import DEFAULT_DIRECT_MIN_BYTES, Reallocator, run_in_process
from real_py.realloc.transports import InProcessHub
from real_py.testing import run_distributed

# Pieces of 64K-256K fp32 elements (256 KiB - 1 MiB): the default threshold splits some of them.
MID = model_spec(
    ModelConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        num_hidden_layers=2,
    ),
    "mid",
)
THRESHOLDS = (None, 0, 1, 64, 4096, DEFAULT_DIRECT_MIN_BYTES)


def expected_direct_elems(plan, min_elems: int) -> int:
    """Elements that must go direct when no message is cut, from the plan's descriptors alone:
    one-run descriptors >= min_elems, plus what is left of a message if that is one one-run
    descriptor (a whole one-run message included)."""
    total = 0
    for m in range(plan.num_messages):
        rest = []
        for _so, _do, ln, n, ss, ds in plan.message_descs(m).tolist():
            one_run = n == 1 or (ss == ln and ds == ln)
            if one_run and min_elems > 0 and ln * n >= min_elems:
                total += ln * n
            else:
                rest.append((ln, n, one_run))
        if len(rest) == 1 and rest[0][2]:
            total += rest[0][0] * rest[0][1]
    return total


def min_elems(nbytes, es: int) -> int:
    return -(-(nbytes or 0) // es)


def test_direct_chunks_counted_and_staging_drops():
    """Large bucket (no message cut): direct elements == the plan's big one-run pieces exactly;
    a smaller threshold never stages more, and staging per round is only the staged chunks."""
    for i, (name, model, src, dst) in enumerate(named_pairs(8)):
        plan = plan_realloc(model, src, dst)
        staged_before = None
        # Off first, then from big to tiny: staging must never grow.
        for t in (None, 0, DEFAULT_DIRECT_MIN_BYTES, 4096, 64, 1):
            k = min_elems(t, plan.element_size)
            s = Schedule(plan, 1 << 30, k)
            chunks = [c for r in s.rounds for c in r]
            direct = sum(c.numel for c in chunks if c.contiguous)
            assert direct == expected_direct_elems(plan, k), f"{name} threshold {t}"
            assert sum(c.numel for c in chunks) == int(plan.msg_numel.sum()), f"{name} {t}"
            staged = sum(c.numel for c in chunks if not c.contiguous)
            if staged_before is not None:
                assert staged <= staged_before, f"{name}: threshold {t} stages more"
            staged_before = staged
            for r in plan.ranks():
                for rr in s.for_rank(r):
                    want = sum(c.numel for c in rr.sends + rr.recvs if not c.contiguous)
                    assert rr.staging_numel == want <= s.bucket_elems, f"{name} rank {r} {t}"
        if i == 0:  # tp2 -> dp2: strided and contiguous pieces in one message
            off = Schedule(plan, 1 << 30, 0)
            on = Schedule(plan, 1 << 30, 1)
            n_off = sum(c.contiguous for r in off.rounds for c in r)
            n_on = sum(c.contiguous for r in on.rounds for c in r)
            assert n_on > n_off and staged_before < int(plan.msg_numel.sum())


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_inprocess_bitwise_with_thresholds(threshold):
    """Random pairs, both modes, small and large buckets (direct pieces cut across rounds)."""
    rng = random.Random(21)
    for i in range(50):
        model, full, src, dst, plan, srcs, dsts = random_case(rng, i)
        before = {r: s.flat.clone() for r, s in srcs.items()}
        bucket = rng.choice([256, 4096, 1 << 20])
        stats = run_in_process(
            InProcessHub(timeout=20),
            plan,
            srcs,
            dsts,
            bucket_bytes=bucket,
            pipeline=i % 3 == 0,
            verify=i % 5 == 0,
            direct_min_bytes=threshold,
        )
        tag = f"pair {i} {src}->{dst} bucket {bucket} threshold {threshold}"
        for r in dst.ranks:
            assert torch.equal(dsts[r].flat, oracle_flat(model, dst, r, full)), f"{tag}: rank {r}"
        for r, s in srcs.items():
            assert torch.equal(s.flat, before[r]), f"{tag}: source of rank {r} modified"
        want = plan.per_rank_bytes()
        for r, s in stats.items():
            assert s["staging_bytes"] <= bucket, f"{tag}: rank {r} staged {s['staging_bytes']}"
            assert (s["sent_bytes"], s["received_bytes"]) == (want[r]["send"], want[r]["recv"]), tag


def test_default_threshold_on_mid_model():
    """256 KiB pieces exist in MID: the default splits them out, results stay exact."""
    full = random_full(MID, 3)
    src, dst = L("dp2,tp2"), L("dp4")
    plan = plan_realloc(MID, src, dst)
    staged = {}
    for t in (0, DEFAULT_DIRECT_MIN_BYTES):
        srcs = {r: ModelShard.from_full(MID, src, r, full) for r in src.ranks}
        dsts = {r: ModelShard.empty(MID, dst, r) for r in dst.ranks}
        stats = run_in_process(
            InProcessHub(timeout=60),
            plan,
            srcs,
            dsts,
            bucket_bytes=4 << 20,
            direct_min_bytes=t,
            one_pass=False,
        )
        for r in dst.ranks:
            assert torch.equal(dsts[r].flat, oracle_flat(MID, dst, r, full)), f"threshold {t} {r}"
        staged[t] = sum(s["staging_bytes"] for s in stats.values())
    s = Schedule(plan, 1 << 30, DEFAULT_DIRECT_MIN_BYTES // 4)
    big = [c for r in s.rounds for c in r if c.contiguous and len(plan.message_descs(c.msg)) > 1]
    assert big and all(c.numel * 4 >= DEFAULT_DIRECT_MIN_BYTES for c in big)
    assert staged[DEFAULT_DIRECT_MIN_BYTES] < staged[0], staged


def test_negative_threshold_rejected():
    model = SPECS[0]
    plan = plan_realloc(model, L("tp2"), L("dp2"))
    with pytest.raises(ValueError, match="direct_min_bytes=-1"):
        Reallocator(plan, InProcessHub().transport(0), direct_min_bytes=-1)
    with pytest.raises(ValueError, match="direct_min_elems=-2"):
        Schedule(plan, 1024, -2)


def _gloo(rank: int, world: int) -> dict:
    """Named pairs at 3 thresholds and the MID model at the default, in one spawn."""
    t = dist.group.WORLD
    from real_py.realloc.transports.dist import DistTransport

    tr = DistTransport(t, timeout=60)
    done = Counter()
    for i, (name, model, src, dst) in enumerate(named_pairs(world)):
        full = random_full(model, i)
        for j, threshold in enumerate((0, 1, 64)):
            mode, bucket = ("p2p", 4096) if j != 1 else ("broadcast", 1 << 20)
            check_transfer(
                tr,
                rank,
                model,
                src,
                dst,
                full,
                mode=mode,
                bucket=bucket,
                verify=j == 2,
                direct_min_bytes=threshold,
                what=name,
            )
            plan = plan_realloc(model, src, dst, mode=mode)
            es = plan.element_size
            s = Schedule(plan, bucket // es // 2, min_elems(threshold, es))
            per_pair = Counter(
                (k, c.sender, c.receivers) for k, r in enumerate(s.rounds) for c in r
            )
            done[f"direct@{threshold}"] += sum(c.contiguous for r in s.rounds for c in r)
            done[f"multi@{threshold}"] += sum(v > 1 for v in per_pair.values())
    full = random_full(MID, 5)
    for src, dst in ((L("dp2,tp2"), L("dp4")), (L("tp2,pp2"), L("dp2,tp2"))):
        check_transfer(tr, rank, MID, src, dst, full, mode="p2p", bucket=4 << 20, what="mid")
        done["mid"] += 1
    return dict(done)


@pytest.mark.dist
def test_gloo_thresholds_bitwise():
    """4 gloo ranks: oracle, source intact, actual bytes == plan bytes (check_transfer)."""
    out = run_distributed(_gloo, 4, timeout=300)
    assert all(o == out[0] for o in out)
    d = out[0]
    assert d["mid"] == 2
    # Same bucket and mode: a small threshold adds direct chunks, and so messages per pair and
    # round; the 1 MiB-bucket broadcast runs still have several chunks per pair in a round.
    assert d["direct@64"] > d["direct@0"] and d["multi@64"] > d["multi@0"], d
    assert d["direct@1"] > 0 and d["multi@1"] > 0, d
