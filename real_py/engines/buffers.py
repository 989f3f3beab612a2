"""Optimizer state of one flat parameter buffer and the fp64 sum of squares of its gradient
runs, shared by the dense Trainer and the MoE expert buffers (real_py/engines/train.py,
moe_train.py)."""

from __future__ import annotations

import torch


def init_optim_buffers(obj, flat: torch.Tensor) -> None:
    """Set obj.grad (model dtype), obj.master (fp32 master weights; None for an fp32 buffer: it is
    its own master), obj.red (the fp32 gradients that get reduced: the low-precision grad
    converted bucket by bucket, or grad itself in fp32) and Adam's obj.exp_avg / exp_avg_sq for
    one flat parameter buffer (the dense shard, or an MoE rank's expert shard)."""
    obj.grad = torch.zeros_like(flat)
    lowp = flat.dtype != torch.float32
    obj.master = flat.float() if lowp else None
    obj.red = torch.zeros_like(flat, dtype=torch.float32) if lowp else obj.grad
    obj.exp_avg = torch.zeros_like(flat, dtype=torch.float32)
    obj.exp_avg_sq = torch.zeros_like(flat, dtype=torch.float32)


SQUARES_PIECE = 1 << 22
"""Elements per piece of a gradient run whose sum of squares is taken (bounds a CPU fp64 copy to
32 MiB)."""


def sum_of_squares(buf: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Sum of squares of buf[lo:hi] over the [lo, hi) spans, as a [1] float64 tensor on buf's
    device, accumulated in fp64: one fp32 norm over a long run (torch's CPU kernel accumulates
    sequentially in fp32) is off by 1e-5 relative at a million elements and 1e-3 at fifty
    million. With dtype float64 torch's CPU path takes each piece's norm over an fp64 copy of
    it (hence the pieces); on CUDA it stays one multi-tensor launch (not yet run on a GPU)."""
    pieces = [
        buf[lo : min(hi, lo + SQUARES_PIECE)]
        for start, hi in spans
        for lo in range(start, hi, SQUARES_PIECE)
    ]
    if not pieces:
        return torch.zeros(1, dtype=torch.float64, device=buf.device)
    return torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).pow(2).sum().reshape(1)
