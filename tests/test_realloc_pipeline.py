"""Checks the reallocator's double-buffered path (pipeline=True) and verify=True in one process
(in-process transport): random pairs against the oracle, staging bound, a corrupted chunk.

A failure points to the pipelined round loop, checksum exchange or staging halves in
real_py/realloc/reallocator.py (the distributed transports run the same loop, see
tests/test_dist_*.py).
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from support.dist_cases import random_case
from support.oracle import oracle_flat, random_full, tiny_spec

from real_py import Layout, ModelShard, plan_realloc
from real_py.realloc.reallocator import Reallocator, checksum, run_in_process
from real_py.realloc.transports import InProcessHub, InProcessTransport, TransferError

SPECS = [tiny_spec(tied=True), tiny_spec(bias=True, dtype="bfloat16"), tiny_spec(head="value")]


def test_pipelined_verified_random_pairs():
    rng = random.Random(5)
    for i in range(120):
        model, full, src, dst, plan, srcs, dsts = random_case(rng, i, SPECS)
        bucket = rng.choice([1024, 1 << 14, 1 << 20])
        stats = run_in_process(
            InProcessHub(timeout=20),
            plan,
            srcs,
            dsts,
            bucket_bytes=bucket,
            pipeline=True,
            verify=True,
        )
        for r in dst.ranks:
            assert torch.equal(dsts[r].flat, oracle_flat(model, dst, r, full)), f"pair {i} rank {r}"
        for r, s in stats.items():
            assert s["staging_bytes"] <= bucket, f"pair {i}: rank {r} staged {s['staging_bytes']}"


class _Flip(InProcessTransport):
    """Flips one bit of the first chunk received in round `at` (corruption in flight)."""

    def __init__(self, hub, rank, at):
        super().__init__(hub, rank)
        self.at, self.i = at, 0

    def exchange(self, sends, recvs, step):
        super().exchange(sends, recvs, step)
        if self.i == self.at and recvs:
            recvs[0][1].view(torch.uint8)[0] ^= 4
        self.i += 1


def test_verify_names_chunk_peer_and_round():
    model = SPECS[0]
    full = random_full(model, 1)
    src, dst = Layout.parse("tp2"), Layout.parse("tp1", ranks=(2,))
    plan = plan_realloc(model, src, dst)
    hub = InProcessHub(timeout=5)
    import threading

    errors = {}

    def work(r, transport):
        try:
            s = ModelShard.from_full(model, src, r, full) if r in src.ranks else None
            d = ModelShard.empty(model, dst, r) if r in dst.ranks else None
            Reallocator(plan, transport, bucket_bytes=4096, pipeline=True, verify=True).run(s, d)
        except TransferError as e:
            errors[r] = str(e)

    ts = [
        threading.Thread(target=work, args=(r, _Flip(hub, r, 2) if r == 2 else hub.transport(r)))
        for r in (0, 1, 2)
    ]
    [t.start() for t in ts]
    [t.join() for t in ts]
    # Rank 2 finds the mismatch; its senders, still sending later rounds, fail naming it.
    assert re.match(
        r"rank 2: round \d+/\d+: checksum mismatch on chunk 0 .* from peer rank [01]:", errors[2]
    ), errors[2]
    assert all(
        re.match(r"rank \d: peer rank 2 failed during round ", errors[r]) for r in errors if r != 2
    ), errors
    with pytest.raises(ValueError, match="bucket_bytes=4 is smaller"):
        Reallocator(plan, hub.transport(0), bucket_bytes=4, pipeline=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.float64])
def test_checksum_any_dtype_any_offset(dtype):
    # The same bytes give the same checksum wherever they start in their buffer (the two ends
    # of a chunk hold it at different offsets), and a changed byte changes it.
    g = torch.Generator().manual_seed(3)
    base = torch.randint(-100, 100, (64,), generator=g).to(dtype)
    for off in range(0, 7):
        for n in (1, 2, 3, 4, 8, 13):
            piece = base[off : off + n]
            want = checksum(piece.clone())
            assert torch.equal(checksum(piece), want), (dtype, off, n)
            moved = torch.zeros(n + 5, dtype=dtype)
            moved[3 : 3 + n] = piece
            assert torch.equal(checksum(moved[3 : 3 + n]), want), (dtype, off, n)
            bad = piece.clone()
            bad.view(torch.uint8)[-1] ^= 1
            assert not torch.equal(checksum(bad), want), (dtype, off, n)


def test_verified_half_precision_chunks_at_odd_offsets():
    # A flat dp shard splits the buffer at any element, so bf16/fp16 chunks start at odd element
    # offsets (byte offsets not divisible by 4) on the sending and the receiving side.
    pairs = [
        ("dp3,flat", "tp2"),
        ("tp2,pp2", "dp3,flat"),
        ("dp3,flat", "dp2,flat"),
        ("tp1", "dp3,flat"),
    ]
    for dtype in ("bfloat16", "float16"):
        model = tiny_spec(vocab=101, dtype=dtype, bias=True)
        full = random_full(model, 2)
        for a, b in pairs:
            for direct in (None, 2):
                src, dst = Layout.parse(a), Layout.parse(b)
                dst = Layout.parse(b, ranks=tuple(range(8 - dst.world, 8)))
                plan = plan_realloc(model, src, dst)
                srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
                dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
                run_in_process(
                    InProcessHub(timeout=20),
                    plan,
                    srcs,
                    dsts,
                    bucket_bytes=1 << 14,
                    verify=True,
                    direct_min_bytes=direct,
                )
                for r in dst.ranks:
                    assert torch.equal(dsts[r].flat, oracle_flat(model, dst, r, full)), (
                        dtype,
                        a,
                        b,
                        r,
                    )
