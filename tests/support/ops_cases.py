"""Shared pieces of the pack / unpack op tests (tests/test_ops.py on CPU, tests/test_ops_cuda.py on
a GPU): a per-run slicing reference, random bytes and descriptors, the named samples, one checked
call, and a rejected call that must leave its destination untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from real_py.ops import descs_tensor

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64]


def reference_copy(src: torch.Tensor, descs: np.ndarray, dst: torch.Tensor) -> None:
    """The oracle: one slice assignment per run, in descriptor order."""
    for so, do, ln, n, ss, ds in descs.tolist():
        for i in range(n):
            dst[do + i * ds : do + i * ds + ln] = src[so + i * ss : so + i * ss + ln]


def random_bytes(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """numel elements with random bit patterns (NaN payloads included: compared as bytes)."""
    es = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * es,), dtype=torch.uint8, generator=gen).view(dtype)


def random_descs(
    rng: np.random.Generator, k: int, max_len: int, max_n: int, src_overlap: bool = True
) -> tuple[np.ndarray, int, int]:
    """k descriptors with disjoint destination runs (placed with gaps, shuffled) and sources at
    random offsets, strides in [0, 2*len] when src_overlap (overlapping reads). Returns
    (descs, src_numel, dst_numel)."""
    rows, cursor, src_need = [], 0, 1
    for _ in range(k):
        ln, n = int(rng.integers(0, max_len + 1)), int(rng.integers(0, max_n + 1))
        ds = ln + int(rng.integers(0, 8))
        ss = int(rng.integers(0, 2 * ln + 1)) if src_overlap else ln + int(rng.integers(0, 8))
        do = cursor + int(rng.integers(0, 8))
        so = int(rng.integers(0, 64))
        rows.append((so, do, ln, n, ss, ds))
        if ln and n:
            cursor = do + (n - 1) * ds + ln
            src_need = max(src_need, so + (n - 1) * ss + ln)
    rng.shuffle(rows)
    return np.array(rows, np.int64).reshape(-1, 6), src_need + int(rng.integers(0, 5)), cursor + 3


def _pack_style(descs: np.ndarray) -> np.ndarray:
    """The same runs written back to back into a packed buffer (pack's destination)."""
    out = descs.copy()
    sizes = descs[:, 2] * descs[:, 3]
    out[:, 1] = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(descs) else []
    out[:, 5] = descs[:, 2]
    return out


def samples() -> list[tuple[str, np.ndarray, int, int]]:
    """(id, descs, src_numel, dst_numel): empty, single, many, overlapping, uneven, long."""
    rng = np.random.default_rng(1234)
    out = [
        ("no-descs", np.zeros((0, 6), np.int64), 5, 5),
        ("empty-runs", np.array([[0, 0, 0, 4, 1, 1], [3, 2, 5, 0, 0, 0]], np.int64), 8, 8),
        ("single", np.array([[3, 1, 17, 1, 0, 0]], np.int64), 40, 20),
        ("single-strided", np.array([[1, 2, 7, 9, 11, 8]], np.int64), 100, 80),
        (
            "overlap-reads",
            np.array([[0, 0, 16, 12, 3, 16], [5, 200, 9, 4, 0, 9]], np.int64),
            60,
            240,
        ),
        ("long-run", np.array([[7, 3, 300_001, 1, 0, 0]], np.int64), 300_010, 300_005),
        ("many-short", np.array([[1, 0, 5, 20_000, 6, 5]], np.int64), 120_010, 100_000),
    ]
    for j in range(6):
        d, s, t = random_descs(rng, k=int(rng.integers(1, 40)), max_len=300, max_n=30)
        out.append((f"random{j}", d, s, t))
    # The CUDA op passes up to 64 non-empty descriptors by value, more through a device buffer:
    # both sides of the boundary, and many.
    for k in (64, 65):
        out.append(
            (
                f"descs{k}",
                np.array([[3 * i, 2 * i, 2, 1, 0, 0] for i in range(k)], np.int64),
                3 * k,
                2 * k,
            )
        )
    # 70 descriptors of which 6 are empty: 64 non-empty ones, passed by value after the compaction
    d = np.array([[3 * i, 2 * i, 2 if i % 12 else 0, 1, 0, 0] for i in range(70)], np.int64)
    assert (d[:, 2] * d[:, 3] > 0).sum() == 64
    out.append(("descs70-6empty", d, 3 * 70, 2 * 70))
    d, s, t = random_descs(rng, k=300, max_len=300, max_n=30)
    out.append(("random-many", d, s, t))
    d, s, t = random_descs(rng, k=3, max_len=70_000, max_n=6, src_overlap=False)
    out.append(("random-long", d, s, t))
    out.append(("random-packed", _pack_style(d), s, int((d[:, 2] * d[:, 3]).sum())))
    return out


SAMPLES = samples()


def check_op(op, descs: np.ndarray, src_numel: int, dst_numel: int, dtype, device: str, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = random_bytes(src_numel, dtype, gen)
    dst = random_bytes(dst_numel, dtype, gen)
    want = dst.clone()
    reference_copy(src, descs, want)
    got = dst.to(device)
    op(src.to(device), descs_tensor(descs), got)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def assert_rejected(op, src, descs, dst, match):
    before = dst.clone()
    with pytest.raises(ValueError, match=match):
        op(src, descs, dst)
    # Bytes, not values: random bytes hold NaNs, and NaN != NaN.
    assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8)), (
        "a rejected call wrote to its destination"
    )
