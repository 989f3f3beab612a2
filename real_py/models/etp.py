"""Expert tensor parallelism (etp > 1): the collectives that let each etp rank apply its piece of
every expert to the rows of its whole etp group (Megatron-core's etp all-gather / reduce-scatter
around the expert all-to-all).

    rows, sizes = gather_etp_rows(x, group)     # every etp rank's rows, in group-rank order
    y = reduce_scatter_etp_rows(partial, sizes, group)   # sum of the pieces' partial outputs,
                                                         # own rows

An expert's output is a sum over its intermediate dim, so the pieces' partial outputs add up to it:
each etp rank computes its partial for all gathered rows and the sums come back to the rows'
owner. Row counts may differ between the ranks (exchanged first, rows padded to the largest).
Autograd: the gather's backward sums the gradients over the group and keeps the own rows; the
reduce-scatter's backward gathers the rows' gradients to every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _sizes(n: int, group, device) -> list[int]:
    t = torch.tensor([n], dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return [int(p) for p in parts]


def _gather(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    m = max(sizes)
    pad = x.new_zeros((m,) + tuple(x.shape[1:]))
    pad[: x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(parts, pad.contiguous(), group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def _own(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    r = dist.get_rank(group)
    lo = sum(sizes[:r])
    return x[lo : lo + sizes[r]]


def _sum_own(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return _own(x, sizes, group).contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _sum_own(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _sum_own(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.sizes, ctx.group), None, None


def gather_etp_rows(x: torch.Tensor, group) -> tuple[torch.Tensor, list[int]]:
    """(rows of every rank of the etp group, concatenated in group-rank order; the row counts)."""
    sizes = _sizes(x.shape[0], group, x.device)
    return _Gather.apply(x, sizes, group), sizes


def gather_etp_plain(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """gather_etp_rows for tensors without gradient (chosen experts)."""
    return _gather(x, sizes, group)


def reduce_scatter_etp_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """The sum over the etp group of x (rows of the whole group), this rank's rows of it."""
    return _ReduceScatter.apply(x, sizes, group)
