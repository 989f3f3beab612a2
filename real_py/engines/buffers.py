"""Optimizer state of one flat parameter buffer, shared by the dense Trainer and the MoE expert
buffers (real_py/engines/train.py, moe_train.py)."""

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
