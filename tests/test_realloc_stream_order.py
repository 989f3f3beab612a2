"""Checks the round loop of stream-ordered transports (NCCL) on the code path gloo can run:
DistTransport(stream_ordered=True) completes rounds with Handle.order() and watches them at the
end, messages merged per peer and round (merge=True, direct pieces packed in), 1-3 rounds in
flight; bit for bit against tests/support/oracle.py, the staging bound, a silent peer named within
the timeout. The in-process tests count the merged messages.

A failure points to real_py/realloc/rounds.py (inflight slots, order / watch), round_layout.py
(merged layouts: both ends must derive the same messages) or transports/dist.py (order()).
NCCL between GPUs never ran here (docs/gpu.md); on NCCL order() only orders the current stream.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
from support.dist_cases import check_transfer, named_pairs, random_case
from support.oracle import oracle_flat, random_full, tiny_spec

from real_py import ModelShard, plan_realloc
from real_py.realloc.reallocator import Reallocator
from real_py.realloc.transports import InProcessHub, InProcessTransport, TransferError
from real_py.realloc.transports.dist import DistTransport
from real_py.testing import run_distributed


def _gloo_ordered(rank: int, world: int) -> int:
    t = DistTransport(dist.group.WORLD, timeout=30, stream_ordered=True)
    assert t.stream_ordered
    n = 0
    for i, (name, model, src, dst) in enumerate(named_pairs(world)):
        full = random_full(model, i)
        for j, (mode, bucket, inflight, merge) in enumerate(
            (
                ("p2p", 4096, 3, True),
                ("broadcast", 1 << 14, 2, True),
                ("p2p", 2048, 3, False),
                ("p2p", 1 << 20, 1, True),
            )
        ):
            r = check_transfer(
                t,
                rank,
                model,
                src,
                dst,
                full,
                mode=mode,
                bucket=bucket,
                what=name,
                inflight=inflight,
                merge=merge,
                verify=j == 1,
                direct_min_bytes=(0, 64)[j % 2],
            )
            n += 1
            del r
    rng = random.Random(50 + world)
    for i in range(40):
        model, full, src, dst, plan, _, _ = random_case(rng, i)
        if max(plan.ranks()) >= world:
            continue
        check_transfer(
            t,
            rank,
            model,
            src,
            dst,
            full,
            mode=("p2p", "broadcast")[i % 2],
            bucket=rng.choice([512, 4096]),
            inflight=rng.choice([2, 3]),
            merge=True,
        )
        n += 1
    return n


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_stream_ordered_rounds(world):
    counts = run_distributed(_gloo_ordered, world, timeout=600)
    assert len(set(counts)) == 1 and counts[0] > 0


def _silent_peer(rank: int, world: int) -> str:
    model = tiny_spec()
    full = random_full(model, 0)
    from real_py import Layout

    src, dst = Layout.parse("tp2"), Layout.parse("dp2")
    plan = plan_realloc(model, src, dst)
    t = DistTransport(dist.group.WORLD, timeout=3, stream_ordered=True)
    r = Reallocator(plan, t, bucket_bytes=1 << 12, merge=True, inflight=3)
    if rank == 1:
        time.sleep(8)  # never posts within rank 0's timeout
        return ""
    t0 = time.monotonic()
    try:
        r.run(ModelShard.from_full(model, src, 0, full), ModelShard.empty(model, dst, 0))
    except TransferError as e:
        return f"{time.monotonic() - t0:.1f}|{e}"
    return "no error"


@pytest.mark.dist
def test_gloo_stream_ordered_timeout_names_peer():
    out = run_distributed(_silent_peer, 2, timeout=60)[0]
    secs, msg = out.split("|", 1)
    assert float(secs) < 10, out
    assert (
        msg.startswith("rank 0: round 0/") and "peer rank 1" in msg and "timed out after 3 s" in msg
    ), msg


class _Count(InProcessTransport):
    def __init__(self, hub, rank, log):
        super().__init__(hub, rank)
        self.log = log

    def exchange(self, sends, recvs, step):
        self.log.append((self.rank, step, [r for r, _ in sends], [(s, r) for s, _, r in recvs]))
        super().exchange(sends, recvs, step)


def test_merged_messages_one_per_peer_and_round():
    rng = random.Random(4)
    for i in range(40):
        model, full, src, dst, plan, srcs, dsts = random_case(rng, i)
        hub, log = InProcessHub(timeout=20), []
        import threading

        def go(r):
            Reallocator(
                plan,
                _Count(hub, r, log),
                bucket_bytes=2048,
                one_pass=False,
                merge=True,
                inflight=3,
                pipeline=True,
            ).run(srcs.get(r), dsts.get(r))

        ts = [threading.Thread(target=go, args=(r,)) for r in plan.ranks()]
        [t.start() for t in ts]
        [t.join() for t in ts]
        for r in dst.ranks:
            assert torch.equal(dsts[r].flat, oracle_flat(model, dst, r, full)), (i, r)
        for rank, step, to, frm in log:
            assert len(to) == len(set(to)), (i, rank, step, to)  # one send per receiver set
            assert len(frm) == len(set(frm)), (
                i,
                rank,
                step,
                frm,
            )  # one receive per (sender, receivers)


def test_staged_options_checked():
    model = tiny_spec()
    from real_py import Layout

    plan = plan_realloc(model, Layout.parse("tp2"), Layout.parse("dp2"))
    with pytest.raises(ValueError, match=r"inflight=4: 1, 2 or 3"):
        Reallocator(plan, InProcessHub().transport(0), one_pass=False, inflight=4)
    r = Reallocator(
        plan,
        InProcessHub().transport(0),
        one_pass=False,
        pipeline=True,
        inflight=3,
        bucket_bytes=3000,
    )
    assert r.opts.inflight == 3 and r.opts.round_elems == 3000 // 4 // 3
