"""The mixture-of-experts block of Qwen3-MoE, Qwen2-MoE and Mixtral, with dropless expert
parallelism.

    block = MoEBlock(config, dense_params, expert_params, "layers.3.mlp.", tp_group, ep)
    y = block(x)                          # x, y [B, T, H]; block.router: this forward's routing

Routing as transformers: logits = x W_gate^T in the activation dtype, softmax in fp32, top-k
(renormalised with norm_topk_prob; Mixtral always), the weights cast back to the activation dtype;
each chosen expert's SwiGLU output times its weight, summed per token; Qwen2-MoE adds the shared
expert times sigmoid(x W_shared_gate^T). No capacity, no dropped tokens.

Tokens and TP: the TP ranks of a (dp, pp) position hold the same tokens, so each TP rank
routes and dispatches only its block of ceil(n / tp) rows (scatter_rows_to_tp), and the routed
outputs are gathered back over TP (gather_rows_from_tp; backward: each rank's block of the
replicated gradient). Every token is then computed once, by exactly one rank of the stage, which
is the same sum as transformers': no de-duplication or partial-sum reduction is needed. The
router weight is replicated; its gradient is summed over TP (copy_to_tp) since each TP rank saw
only its rows. The shared expert is an ordinary TP-split MLP on all rows.

Experts (EP): the ep ranks of an ep group (ParallelGroups.ep_group: same expert-dp, etp and
stage) hold experts [g E/ep, (g + 1) E/ep) each; a rank's (token, expert) pairs go to the expert's
owner by all_to_all_single (the per-expert counts first, then the rows), each owner runs its local
experts on what it received, and a second all-to-all returns the outputs in the order they were
sent; the sender combines them with its routing weights. Backward is the same exchange reversed.
ep=1: the same loop over the experts, locally. The expert weights are Parameters on views of the
rank's ExpertShard (per-expert fused gate|up [2Im, H] and down [H, Im], the spec's stored form).

Expert pieces (etp > 1): each expert's gate|up rows and down columns are split over the etp
ranks (ParallelGroups.etp_group); every etp rank gathers the routed rows (and their choices and
weights) of its whole etp group, dispatches them over its ep group to its pieces, and the partial
outputs (an expert's output is a sum over its intermediate dim) are summed back to each row's
owner (etp.py), as Megatron-core's etp all-gather / reduce-scatter around the all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from ..spec import ModelConfig
from .etp import gather_etp_plain, gather_etp_rows, reduce_scatter_etp_rows
from .mlp import ACTS, MLP
from .tp import copy_to_tp, gather_rows_from_tp, scatter_rows_to_tp


@dataclass
class EPInfo:
    """Where this rank sits for expert parallelism: ep size, its ep index, and the ep index of
    each rank of ep_group in group-rank order (group ranks follow sorted global ranks)."""

    ep: int = 1
    ep_rank: int = 0
    group: object = None
    group_ep: tuple[int, ...] = (0,)
    etp_group: object = None
    """etp > 1: the ranks holding the other pieces of this rank's experts
    (same expert-dp, ep, stage)."""


@dataclass
class RouterRecord:
    """One MoE layer's routing of this rank's rows [lo, hi) of the flattened [B * T] tokens."""

    logits: torch.Tensor
    """[n, E] router logits (activation dtype), with autograd."""
    probs: torch.Tensor
    """[n, E] fp32 softmax, with autograd."""
    experts: torch.Tensor
    """[n, k] chosen experts."""
    lo: int
    hi: int


def _exchange(x: torch.Tensor, out_splits: list, in_splits: list, group, what: str) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    try:
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    except RuntimeError as e:  # the group's timeout (ParallelGroups timeout_s) ends a lost peer
        raise RuntimeError(
            f"rank {dist.get_rank()}: MoE all-to-all ({what}) over the ep group failed: {e}"
        ) from e
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, what):
        ctx.splits, ctx.group, ctx.what = (out_splits, in_splits), group, what
        return _exchange(x, out_splits, in_splits, group, what)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return (
            _exchange(grad, in_splits, out_splits, ctx.group, ctx.what + " backward"),
            None,
            None,
            None,
            None,
        )


class MoEBlock(nn.Module):
    def __init__(self, c: ModelConfig, p: dict, experts: dict, pre: str, tp_group, ep: EPInfo):
        super().__init__()
        self.E, self.k, self.norm_topk = c.num_experts, c.num_experts_per_tok, c.norm_topk_prob
        self.tp_group, self.ep, self.layer = tp_group, ep, pre
        self.gate = p[pre + "gate.weight"]
        self.shared_expert = (
            MLP(p, pre + "shared_expert.", tp_group, c.hidden_act)
            if c.shared_expert_intermediate_size
            else None
        )
        self.shared_expert_gate = p.get(pre + "shared_expert_gate.weight")
        self.per = self.E // ep.ep
        lo = ep.ep_rank * self.per
        names = [f"{pre}experts.{j}." for j in range(lo, lo + self.per)]
        missing = [n for n in names if n + "gate_up_proj.weight" not in experts]
        if missing:
            raise ValueError(
                f"{pre}: the expert shard has no {missing[0]}gate_up_proj.weight (ep rank "
                f"{ep.ep_rank} of {ep.ep} holds experts [{lo}, {lo + self.per}))"
            )
        self.gate_up = nn.ParameterList([experts[n + "gate_up_proj.weight"] for n in names])
        self.down = nn.ParameterList([experts[n + "down_proj.weight"] for n in names])
        self.act = ACTS[c.hidden_act]
        self.router: RouterRecord | None = None
        # ep index -> the group rank (in ep.group) of the rank holding those experts
        self._dest = (
            torch.tensor([ep.group_ep.index(g) for g in range(ep.ep)]) if ep.ep > 1 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        xs, lo, hi = scatter_rows_to_tp(flat, self.tp_group)
        logits = functional.linear(xs, copy_to_tp(self.gate, self.tp_group))
        probs = torch.softmax(logits, -1, dtype=torch.float)
        w, chosen = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        self.router = RouterRecord(logits, probs, chosen, lo, hi)
        w = w.to(x.dtype)
        if self.ep.etp_group is None:
            routed = self._routed(xs, chosen, w)
        else:  # etp > 1: this rank's expert pieces on the rows of its whole etp group (etp.py)
            xg, sizes = gather_etp_rows(xs, self.ep.etp_group)
            part = self._routed(
                xg,
                gather_etp_plain(chosen, sizes, self.ep.etp_group),
                gather_etp_rows(w, self.ep.etp_group)[0],
            )
            routed = reduce_scatter_etp_rows(part, sizes, self.ep.etp_group)
        y = gather_rows_from_tp(routed, flat.shape[0], self.tp_group)
        if self.shared_expert is not None:
            s = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(functional.linear(flat, self.shared_expert_gate)) * s
            y = y + s
        return y.view(B, T, H)

    def _experts(self, rows: torch.Tensor, counts: list) -> torch.Tensor:
        """rows grouped by local expert (counts[j] rows for expert j) -> their outputs, same order.
        Experts with no rows still run (on zero rows), so every expert weight gets a gradient."""
        outs = []
        for j, r in enumerate(rows.split(counts)):
            gate, up = functional.linear(r, self.gate_up[j]).chunk(2, -1)
            outs.append(functional.linear(self.act(gate) * up, self.down[j]))
        return torch.cat(outs)

    def _routed(self, xs: torch.Tensor, chosen: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n, H = xs.shape
        e = chosen.reshape(-1)
        tok = torch.arange(n, device=xs.device).repeat_interleave(self.k)
        if self.ep.ep == 1:
            order = torch.argsort(e, stable=True)
            ys = self._experts(xs[tok[order]], torch.bincount(e, minlength=self.E).tolist())
        else:
            ys, order = self._dispatch(xs, e, tok)
        out = xs.new_zeros(n, H)
        return out.index_add(0, tok[order], ys * w.reshape(-1)[order].unsqueeze(-1))

    def _dispatch(self, xs: torch.Tensor, e: torch.Tensor, tok: torch.Tensor):
        """All-to-all over the ep group: rows to their experts' owners and the outputs back.
        Returns (outputs of the (token, expert) pairs in `order`, order)."""
        ep, per, grp = self.ep.ep, self.per, self.ep.group
        dest = self._dest.to(e.device)[e // per]  # group rank owning each pair
        order = torch.argsort(dest * self.E + e, stable=True)  # by owner, then expert
        counts = torch.bincount(e, minlength=self.E).view(ep, per)  # [ep index, local expert]
        send = counts[list(self.ep.group_ep)].contiguous()  # rows in group-rank order
        recv = _exchange(send.view(-1), [per] * ep, [per] * ep, grp, f"{self.layer} counts").view(
            ep, per
        )
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        got = _AllToAll.apply(xs[tok[order]], out_splits, in_splits, grp, f"{self.layer} tokens")
        # received: per source group rank, per local expert; regroup by local expert
        local = (
            torch.arange(per, device=xs.device)
            .repeat(ep)
            .repeat_interleave(recv.view(-1).to(xs.device))
        )
        perm = torch.argsort(local, stable=True)
        ys = self._experts(got[perm], recv.sum(0).tolist())
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return _AllToAll.apply(ys[back], in_splits, out_splits, grp, f"{self.layer} outputs"), order


def router_records(model: nn.Module) -> list[RouterRecord]:
    """The routing of the last forward of every MoE layer of `model` (layer order)."""
    return [m.router for m in model.modules() if isinstance(m, MoEBlock) and m.router is not None]


def _token_weights(rec: RouterRecord, token_mask: torch.Tensor | None) -> torch.Tensor:
    n = rec.hi - rec.lo
    if token_mask is None:
        return torch.ones(n, device=rec.probs.device)
    return token_mask.reshape(-1)[rec.lo : rec.hi].to(rec.probs.device, torch.float32)


def load_balancing_loss(
    records: list[RouterRecord],
    num_experts: int,
    top_k: int,
    token_mask: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """transformers' load_balancing_loss_func over the tokens and MoE layers in `records`:
    E * sum_e f_e P_e, f_e = share of (token, layer) routings choosing e (summed over the k
    slots), P_e = mean router probability of e, both over the unmasked tokens of every layer.
    token_mask: [B, T] (1 = counts; transformers' attention_mask), None = all tokens.

    group: the ranks whose tokens / layers together form the batch (dp, the TP row blocks, pp
    stages). f and the token count are summed over it (no gradient; f is piecewise constant), and
    the result is this rank's term E * sum_e f_e * (its P sums) / N, whose sum over the group is the
    loss over all the group's tokens, with exact gradients on every rank."""
    dev = records[0].probs.device if records else "cpu"
    counts = torch.zeros(num_experts + 1, device=dev)
    psum = torch.zeros(num_experts, device=dev)
    for rec in records:
        m = _token_weights(rec, token_mask)
        counts[:num_experts] += (
            functional.one_hot(rec.experts, num_experts).float() * m[:, None, None]
        ).sum((0, 1))
        counts[num_experts] += m.sum()
        psum = psum + (rec.probs * m[:, None]).sum(0)
    if group is not None:
        dist.all_reduce(counts, group=group)
    n = counts[num_experts].clamp(min=1.0)
    return num_experts * ((counts[:num_experts] / n) * (psum / n)).sum()


def router_z_loss(
    records: list[RouterRecord], token_mask: torch.Tensor | None = None, group=None
) -> torch.Tensor:
    """ST-MoE router z-loss: mean over (token, layer) of logsumexp(router logits)^2 (fp32); with
    `group` this rank's share of the mean over the group's tokens (sums to it over the group)."""
    dev = records[0].probs.device if records else "cpu"
    total = torch.zeros((), device=dev)
    n = torch.zeros(1, device=dev)
    for rec in records:
        m = _token_weights(rec, token_mask)
        total = total + (torch.logsumexp(rec.logits.float(), -1).pow(2) * m).sum()
        n += m.sum()
    if group is not None:
        dist.all_reduce(n, group=group)
    return total / n.clamp(min=1.0)[0]


def expert_token_counts(
    records: list[RouterRecord], num_experts: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[moe layers, E] int64: (token, slot) routings to each expert in this rank's rows (for
    logging; sum over the ranks of a batch for its totals)."""
    rows = []
    for rec in records:
        keep = _token_weights(rec, token_mask) > 0
        rows.append(torch.bincount(rec.experts[keep].reshape(-1), minlength=num_experts))
    return torch.stack(rows) if rows else torch.zeros(0, num_experts, dtype=torch.int64)
