"""The expert side of a train step (MoE models): expert gradients, their reduction and AdamW
buffers, and the router losses of each micro-batch.

Expert gradients live in one flat buffer shaped like the rank's ExpertShard (each expert
Parameter's .grad a view of it), fp32 master and Adam states as the dense shard's (train.py).
They are summed over the expert-dp group (the ranks holding the same experts; with ep=1 every
dp x tp rank of the stage), matching the dense rule "gradients summed over DP": every token of
the step reaches an expert through exactly one rank of its ep group. In the global norm each
expert piece counts once (the expert-dp replica 0 adds its squares, summed over the layout).

Router losses, per micro-batch and pipeline stage, added to that stage's backward:
  aux_coef * load_balancing_loss  transformers' formula over the micro-batch's tokens (every dp
                                  replica's micro-batch i) and every MoE layer of the model: the
                                  expert shares f are summed over the layout group, each rank
                                  differentiates its own probability sums (models/moe.py).
  z_coef * router_z_loss          mean over the same (token, layer) pairs.
With one micro-batch per dp rank this is transformers' aux_loss of the whole batch; with more,
the sum over micro-batches of the formula on each (as Megatron-core applies it per micro-batch).
Padding (positions >= lengths) is masked out as transformers' attention_mask does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models import expert_token_counts, load_balancing_loss, router_records, router_z_loss
from .buffers import init_optim_buffers, sum_of_squares


class ExpertBuffers:
    def __init__(self, engine):
        ex = engine.experts
        flat = ex.flat
        self.engine, self.flat = engine, flat
        init_optim_buffers(self, flat)
        for e in ex.shard_layout.entries:
            engine.model.expert_params[e.param.name].grad = self.grad[
                e.offset : e.offset + e.numel
            ].view(e.local_shape)
        self.counted = ex.edp_rank == 0

    def check_in_place(self):
        for e in self.engine.experts.shard_layout.entries:
            grad = self.engine.model.expert_params[e.param.name].grad
            assert grad is not None and grad.data_ptr() == self.grad[e.offset :].data_ptr(), (
                f"{e.param.name}: autograd replaced the expert gradient view"
            )

    def reduce(self):
        if self.red is not self.grad:
            self.red.copy_(self.grad)
        if self.engine.groups.edp_group is not None:
            dist.all_reduce(self.red, group=self.engine.groups.edp_group)

    def squares(self) -> torch.Tensor:
        """Sum of squares of every expert gradient of the layout (collective over it)."""
        sq = sum_of_squares(self.red, [(0, self.red.numel())] if self.counted else [])
        if self.engine.groups.layout_group is not None:
            dist.all_reduce(sq, group=self.engine.groups.layout_group)
        return sq


class RouterLosses:
    """Adds the router losses of each micro-batch to its stage's backward and keeps their sums."""

    def __init__(self, engine, aux_coef: float, z_coef: float):
        self.engine, self.aux_coef, self.z_coef = engine, aux_coef, z_coef
        self.aux = self.z = 0.0
        self.counts = None  # [this stage's MoE layers, E], summed over micro-batches

    def __call__(self, mb) -> torch.Tensor | None:
        """This rank's router-loss term of micro-batch `mb` (after its forward), or None."""
        eng = self.engine
        c, group = eng.config, eng.groups.layout_group
        recs = router_records(eng.model)
        n = mb.data["tokens"].shape[1]
        mask = torch.arange(n, device=eng.device) < mb.data["lengths"].unsqueeze(1)
        counts = expert_token_counts(recs, c.num_experts, mask).cpu()
        self.counts = counts if self.counts is None else self.counts + counts
        term = None
        # every rank of the layout joins the count all-reduces,
        # whether its stage has MoE layers or not
        aux = load_balancing_loss(recs, c.num_experts, c.num_experts_per_tok, mask, group)
        self.aux += float(aux.detach())
        if self.aux_coef:
            term = self.aux_coef * aux
        if self.z_coef:
            z = router_z_loss(recs, mask, group)
            self.z += float(z.detach())
            term = self.z_coef * z if term is None else term + self.z_coef * z
        if term is not None and not term.requires_grad:  # a stage without MoE layers
            term = None
        return term

    def stats(self) -> dict:
        """aux_loss / z_loss (summed over micro-batches and ranks), expert_counts [layers, E] of
        the layout's tokens (each MoE layer once), all on every rank."""
        g, dev = self.engine.groups, self.engine.device
        vals = torch.tensor([self.aux, self.z], dtype=torch.float64, device=dev)
        c = self.engine.config
        layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
        counts = torch.zeros(len(layers), c.num_experts, dtype=torch.int64, device=dev)
        mine = [
            layers.index(i)
            for i in range(self.engine.model.lo, self.engine.model.hi)
            if i in layers
        ]
        if self.counts is not None and len(mine):
            counts[mine] = self.counts.to(dev)
        if g.layout_group is not None:
            dist.all_reduce(vals, group=g.layout_group)
            dist.all_reduce(counts, group=g.layout_group)
        # counts: every TP row block and dp replica once; the z-loss terms sum to the mean
        return {
            "aux_loss": vals[0].item(),
            "z_loss": vals[1].item() if self.z_coef else 0.0,
            "expert_counts": counts.cpu(),
        }
