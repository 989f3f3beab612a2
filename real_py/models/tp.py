"""Tensor-parallel building blocks with autograd-correct collectives (Megatron f/g operators).

  copy_to_tp      forward identity,   backward all-reduce  (entry of a column-parallel region)
  reduce_from_tp  forward all-reduce, backward identity    (exit of a row-parallel region)

Every TP rank computes the same loss from the same replicated activations, so the backward of
reduce_from_tp is the identity on each rank, and copy_to_tp sums the contributions that each
rank's local weight piece made to a replicated input.
A None group or a group of one rank makes both operators the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Sum of per-rank partial values that each rank then uses only for its own shard of a
    tensor (OLMo 2's whole-projection RMS): all-reduce forward and backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _SumOverTP.apply(x, group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(
    x: torch.Tensor, group, tp_ranks: tuple[int, ...], dim: int = -1
) -> torch.Tensor:
    """Concatenate the TP pieces along `dim` in TP order (no autograd; generation and tests).

    tp_ranks: global ranks in TP order. new_group numbers a group's ranks in sorted global order,
    which differs from TP order when a layout lists its ranks in another order.
    """
    n = _size(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    by_rank = dict(zip(dist.get_process_group_ranks(group), parts))
    return torch.cat([by_rank[r] for r in tp_ranks], dim)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T (+ b_local); W_local: [out/tp, in] (fused blocks already per-rank)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group
        self.single = _size(group) == 1  # read once: no collective query per forward (or per trace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(
            x if self.single else _CopyToTP.apply(x, self.group), self.weight, self.bias
        )


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) (+ b); W_local: [out, in/tp], x_local: [..., in/tp]; the
    bias is replicated and added once, after the reduction."""

    def __init__(self, weight: nn.Parameter, group, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.group, self.bias = weight, group, bias
        self.single = _size(group) == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = functional.linear(x, self.weight)
        y = y if self.single else _ReduceFromTP.apply(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank * V_local, (tp_rank + 1) * V_local) of the (zero-padded) table per rank.

    padding_row: a global row (the pad token) whose lookups add no gradient, as transformers'
    nn.Embedding(padding_idx=pad_token_id) in every supported family; the forward still reads it.
    """

    def __init__(self, weight: nn.Parameter, group, tp_rank: int, padding_row: int | None = None):
        super().__init__()
        self.weight, self.group = weight, group
        self.lo = tp_rank * weight.shape[0]
        local = None if padding_row is None else padding_row - self.lo
        self.padding_idx = local if local is not None and 0 <= local < weight.shape[0] else None
        self.single = _size(group) == 1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.single:
            return functional.embedding(tokens, self.weight, self.padding_idx)
        local = tokens - self.lo
        outside = (local < 0) | (local >= self.weight.shape[0])
        # outside tokens read row 0 and are zeroed below, so they add no gradient to it either
        out = functional.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


def _rows_of(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of n that group rank `rank` of `size` takes: ceil(n / size) each, the last
    ranks short or empty."""
    c = -(-n // size)
    return min(n, rank * c), min(n, (rank + 1) * c)


def _all_gather_rows(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """The group ranks' row blocks (rank order, each at most ceil(n / size) rows) as one
    [n, ...]."""
    size = dist.get_world_size(group)
    c = -(-n // size)
    pad = x.new_zeros((c,) + tuple(x.shape[1:]))
    pad[: x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in range(size)]
    dist.all_gather(parts, pad, group=group)
    sizes = [hi - lo for lo, hi in (_rows_of(n, size, r) for r in range(size))]
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


class _ScatterRows(torch.autograd.Function):
    """Forward: this rank's block of rows of a TP-replicated tensor; backward: the blocks'
    gradients gathered, so every rank again holds the whole (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        lo, hi = _rows_of(x.shape[0], dist.get_world_size(group), dist.get_rank(group))
        return x[lo:hi].clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.contiguous(), ctx.n, ctx.group), None


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's block of rows, concatenated (replicated result); backward: this
    rank's block of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, n, group):
        ctx.lo, ctx.hi = _rows_of(n, dist.get_world_size(group), dist.get_rank(group))
        return _all_gather_rows(x.contiguous(), n, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.lo : ctx.hi].contiguous(), None, None


def scatter_rows_to_tp(x: torch.Tensor, group) -> tuple[torch.Tensor, int, int]:
    """(rows [lo, hi) of the TP-replicated x [n, ...] that this TP rank computes, lo, hi); blocks of
    ceil(n / tp) rows by rank in the group. The whole x on a group of one."""
    if _size(group) == 1:
        return x, 0, x.shape[0]
    lo, hi = _rows_of(x.shape[0], dist.get_world_size(group), dist.get_rank(group))
    return _ScatterRows.apply(x, group), lo, hi


def gather_rows_from_tp(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """Inverse of scatter_rows_to_tp: the [n, ...] tensor of every rank's rows, on every rank."""
    return x if _size(group) == 1 else _GatherRows.apply(x, n, group)
