"""train_step: 1F1B pipeline schedule, bucketed DP all-reduce, global-norm clipping, flat AdamW.

Gradients live in one flat buffer shaped like the shard (each Parameter's .grad is a view of it;
autograd accumulates into an existing .grad in place), so the DP all-reduce is a few large
bucketed collectives over that buffer, launched from post-accumulate-grad hooks during the last
micro-batch's backward so they overlap the rest of it, and AdamW runs elementwise on flat buffers
(param, grad, exp_avg, exp_avg_sq). On CUDA that is one pass of torch's fused AdamW kernel
(torch._fused_adamw_, what torch.optim.AdamW(fused=True) runs) over the flat buffers, with the
clipping factor applied inside it (its grad_scale); on CPU torch.optim.AdamW's single-tensor
update op by op (exactly, so the CPU tests compare with it). The global gradient norm is one
fp64 norm per contiguous run of counted gradients (buffers.sum_of_squares; an fp32 norm over a
run of millions of elements is off by 1e-5 to 1e-3), their squares summed over TP and PP.
Padding (alignment gaps, vocab padding rows) has zero gradient and stays zero.

On CUDA (tp == 1, no experts) the decoder layers and the final norm run through torch.compile
(engines/compiled.py: one compilation for every layer and micro-batch shape; Engine(compile_train=
False) or REAL_PY_COMPILE_TRAIN=0 turns it off); CPU steps stay eager.

Objective: the step minimizes the SUM of loss_fn over every micro-batch of every DP rank
(gradients are summed over DP, not averaged); normalize inside loss_fn (e.g. divide by the
global token count) to get a mean.

Mixed precision: when the shard's dtype is not fp32 (bf16), forward, backward and the
activations run in that dtype and autograd accumulates bf16 gradients into the flat `grad`
buffer; the Trainer keeps an fp32 master copy of the shard (`master`), fp32 Adam states and an
fp32 reduction buffer (`red`). Each DP bucket (and the tied embedding) is converted to fp32
before its all-reduce, so gradient REDUCTION, the norm, clipping and AdamW are all fp32; after
the update the master is rounded into `shard.flat` (what a reallocation moves). The master and
Adam states live with this engine (the train layout) and never move. With an fp32 shard `red`
is `grad` and `master` is None: no extra memory, the same code path as before.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .buffers import init_optim_buffers, sum_of_squares
from .compiled import TrainCalls, backend_of
from .moe_train import ExpertBuffers, RouterLosses
from .pipeline import P2P, split_micro_batches


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-5
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    """Decoupled weight decay applied to every parameter."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (over TP, PP, DP; replicated params once); <= 0 disables."""
    bucket_numel: int = 1 << 22
    """Elements per DP all-reduce bucket."""

    def __post_init__(self):
        if self.lr < 0 or self.eps <= 0 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(
                f"OptimConfig: need lr >= 0, eps > 0, betas in [0, 1); got lr={self.lr}, "
                f"eps={self.eps}, betas={self.betas}"
            )
        if self.bucket_numel < 1:
            raise ValueError(f"OptimConfig.bucket_numel={self.bucket_numel} must be >= 1")


class Trainer:
    def __init__(self, engine, optim: OptimConfig | None):
        self.engine, self.cfg = engine, optim or OptimConfig()
        shard = engine.shard
        flat = shard.flat
        init_optim_buffers(self, flat)
        self.num_steps = 0
        g = engine.groups
        self.counted = []  # (offset, numel) of gradients counted once in the global norm
        for e in shard.shard_layout.entries:
            param = engine.model.shard_params[e.param.name]
            param.grad = self.grad[e.offset : e.offset + e.numel].view(e.local_shape)
            replicated = e.param.tp.kind == "replicated"
            head_copy = e.param.owner == "embed" and shard.stage != 0
            if not (replicated and g.tp_rank > 0) and not head_copy:
                self.counted.append((e.offset, e.numel))
        self.spans = _merge_spans(self.counted, shard.shard_layout.entries)
        self.embed_entry = next(
            (e for e in shard.shard_layout.entries if e.param.owner == "embed"), None
        )
        self._setup_buckets()
        self.experts = (
            ExpertBuffers(engine) if getattr(engine, "experts", None) is not None else None
        )
        # the layers' forward and backward through torch.compile (fused RMSNorm, RoPE, SwiGLU and
        # residual adds): by default on CUDA with tp == 1 (no TP collective inside a layer) and
        # without experts (the routing reads counts on the host)
        backend = backend_of(
            getattr(engine, "compile_train", None),
            "REAL_PY_COMPILE_TRAIN",
            engine.device.type == "cuda" and g.tp_size == 1 and not engine.config.num_experts,
        )
        self.calls = TrainCalls(backend) if backend else None

    def _setup_buckets(self):
        """DP buckets: contiguous flat ranges in reverse forward order (the order backward makes
        gradients). The embedding stays out: it is reduced last, after the tied-copy sum."""
        self.buckets, self.bucket_of, names, lo, hi = [], {}, [], None, None
        for e in reversed(self.engine.shard.shard_layout.entries):
            if e.param.owner == "embed":
                continue
            names.append(e.param.name)
            lo, hi = e.offset, hi if hi is not None else e.offset + e.numel
            if hi - lo >= self.cfg.bucket_numel:
                self.buckets.append((lo, hi, names))
                names, hi = [], None
        if names:
            self.buckets.append((lo, hi, names))
        for i, (_, _, ns) in enumerate(self.buckets):
            for n in ns:
                self.bucket_of[n] = i
                self.engine.model.shard_params[n].register_post_accumulate_grad_hook(
                    lambda p, n=n: self._grad_ready(n)
                )
        self._overlap, self._works, self.buckets_in_backward = False, [], 0

    def _grad_ready(self, name: str):
        """Post-accumulate hook: during the last backward, launch full buckets in index order
        (the same order on every DP rank, so the collectives pair up)."""
        if not self._overlap:
            return
        self._pending[self.bucket_of[name]] -= 1
        self._launch(lambda i: self._pending[i] == 0)

    def _launch(self, ready):
        g = self.engine.groups
        while self._next < len(self.buckets) and ready(self._next):
            lo, hi, _ = self.buckets[self._next]
            self._works.append(dist.all_reduce(self._fp32(lo, hi), group=g.dp_group, async_op=True))
            self._next += 1

    def _fp32(self, lo: int, hi: int) -> torch.Tensor:
        """red[lo:hi] holding grad[lo:hi] in fp32 (a no-op view for an fp32 shard)."""
        if self.red is not self.grad:
            self.red[lo:hi].copy_(self.grad[lo:hi])
        return self.red[lo:hi]

    def step(
        self,
        loss_fn,
        batch: dict,
        micro_batches: int,
        with_entropy: bool = False,
        lr: float | None = None,
        moe_aux_coef: float | None = None,
        moe_z_coef: float = 0.0,
    ) -> dict:
        """lr: the learning rate of this and later steps (a schedule's value); None: unchanged.
        MoE models: moe_aux_coef (None: the config's router_aux_loss_coef) and moe_z_coef weigh the
        router losses added to every micro-batch's backward (moe_train.py)."""
        eng, g = self.engine, self.engine.groups
        self._router = None
        if eng.config.num_experts:
            aux = eng.config.router_aux_loss_coef if moe_aux_coef is None else moe_aux_coef
            self._router = RouterLosses(eng, float(aux), float(moe_z_coef))
        if lr is not None:
            if not lr >= 0:
                raise ValueError(f"train_step: lr={lr} must be >= 0")
            self.cfg.lr = lr
        dev = eng.device
        batch = {k: v.to(dev) for k, v in batch.items()}
        mbs = split_micro_batches(batch, micro_batches)
        self.grad.zero_()
        if self.experts is not None:
            self.experts.grad.zero_()
        losses = self._one_f_one_b(loss_fn, mbs, with_entropy)
        self._check_grads_in_place()
        self._reduce_grads()
        norm = self._global_norm()
        cfg = self.cfg
        clip = min(1.0, cfg.max_grad_norm / (norm + 1e-6)) if cfg.max_grad_norm > 0 else 1.0
        self._adamw(clip)
        # the micro-batch losses stayed on the device (no wait per micro-batch): summed here
        total = torch.stack(losses).double().sum().reshape(1) if losses else None
        loss = (
            total.to(dev)
            if g.is_last_stage and total is not None
            else torch.zeros(1, dtype=torch.float64, device=dev)
        )
        if g.dp_size > 1:
            dist.all_reduce(loss, group=g.dp_group)
        eng._bcast_from_last(loss)
        out = {
            "loss": loss.item(),
            "grad_norm": norm,
            "lr": cfg.lr,
            "step": self.num_steps,
            "micro_batches": len(mbs),
            "dp_buckets": len(self.buckets) if g.dp_size > 1 else 0,
            "dp_buckets_in_backward": self.buckets_in_backward,
        }
        if self._router is not None:  # "loss" is loss_fn's sum; the router losses come on their own
            out.update(self._router.stats())
        return out

    def _one_f_one_b(self, loss_fn, mbs, with_entropy):
        eng, g, model = self.engine, self.engine.groups, self.engine.model
        p2p, H = P2P(g, eng.device), eng.config.hidden_size
        inputs, outputs, losses = deque(), deque(), []
        M = len(mbs)
        warmup = min(g.pp_size - g.stage - 1, M)

        def forward(mb):
            tok = mb.data["tokens"]
            b, n = tok.shape
            if g.is_first_stage:
                x = tok
            else:
                x = p2p.recv((b, n, H), eng.dtype, g.prev_rank).requires_grad_()
            h = model(
                x,
                torch.arange(n, device=eng.device).expand(b, n),
                run=self.calls.run if self.calls is not None else None,
            )
            extra = None
            if g.is_last_stage:
                out = loss_fn(eng.head_outputs(h, tok, with_entropy), mb.data)
                loss = out[0] if isinstance(out, tuple) else out
                if loss.dim() != 0:
                    raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
                losses.append(loss.detach().reshape(()))
                y = loss
                if self._router is not None:
                    extra = self._router(mb)
                    y = y if extra is None else y + extra
                    extra = None
            else:
                p2p.send(h, g.next_rank)
                y = h
                if self._router is not None:  # after the send: the layout-wide count all-reduce
                    extra = self._router(mb)  # waits for the later stages' forward of mb
            inputs.append(None if g.is_first_stage else x)
            outputs.append((y, extra))

        done = [0]

        def backward():
            done[0] += 1
            if done[0] == M and g.dp_size > 1:
                self._overlap, self._next, self._works = True, 0, []
                self._pending = [len(ns) for _, _, ns in self.buckets]
            x, (y, extra) = inputs.popleft(), outputs.popleft()
            if g.is_last_stage:
                y.backward()
            else:
                grad = p2p.recv(y.shape, y.dtype, g.next_rank)
                if extra is None:
                    torch.autograd.backward(y, grad)
                else:
                    torch.autograd.backward([y, extra], [grad, torch.ones_like(extra)])
            if x is not None:
                p2p.send(x.grad, g.prev_rank)

        for i in range(warmup):
            forward(mbs[i])
        for i in range(warmup, M):
            forward(mbs[i])
            backward()
        for _ in range(warmup):
            backward()
        p2p.flush()
        return losses

    def _check_grads_in_place(self):
        for e in self.engine.shard.shard_layout.entries:
            grad = self.engine.model.shard_params[e.param.name].grad
            assert grad is not None and grad.data_ptr() == self.grad[e.offset :].data_ptr(), (
                f"{e.param.name}: autograd replaced the flat-buffer gradient view"
            )
        if self.experts is not None:
            self.experts.check_in_place()

    def _reduce_grads(self):
        g = self.engine.groups
        e = self.embed_entry
        if g.dp_size == 1 and self.red is not self.grad:
            self.red.copy_(self.grad)  # no DP buckets: convert the whole buffer at once
        embed = self._fp32(e.offset, e.offset + e.numel) if e is not None else None
        if embed is not None and e.param.tied_to_head and g.tied_group is not None:
            dist.all_reduce(embed, group=g.tied_group)
        if g.dp_size > 1:
            self._overlap = False
            self.buckets_in_backward = self._next
            self._launch(lambda i: True)  # buckets whose params got no gradient this step
            if embed is not None:
                self._works.append(dist.all_reduce(embed, group=g.dp_group, async_op=True))
            for w in self._works:
                w.wait()
            self._works = []
        if self.experts is not None:
            self.experts.reduce()

    def _global_norm(self) -> float:
        g = self.engine.groups
        sq = sum_of_squares(self.red, self.spans)
        for group, size in ((g.tp_group, g.tp_size), (g.pp_group, g.pp_size)):
            if size > 1:
                dist.all_reduce(sq, group=group)
        if self.experts is not None:
            sq += self.experts.squares()
        return math.sqrt(sq.item())

    @torch.no_grad()
    def _adamw(self, clip: float = 1.0):
        """One AdamW step of every flat buffer with gradients multiplied by `clip`."""
        self.num_steps += 1
        sets = [(self.engine.shard.flat, self)]
        if self.experts is not None:
            sets.append((self.engine.experts.flat, self.experts))
        for flat, b in sets:
            p = flat if b.master is None else b.master
            if p.device.type == "cuda" and p.numel():
                self._adamw_fused(p, b, clip)
            else:
                if clip != 1.0:
                    b.red.mul_(clip)
                self._adamw_flat(p, b.red, b.exp_avg, b.exp_avg_sq)
            if b.master is not None:
                flat.copy_(b.master)  # round to the shard dtype (bf16)

    def _adamw_flat(self, p, grad, exp_avg, exp_avg_sq):
        """torch.optim.AdamW's single-tensor update (foreach=False), op for op."""
        cfg = self.cfg
        b1, b2 = cfg.betas
        p.mul_(1 - cfg.lr * cfg.weight_decay)
        exp_avg.lerp_(grad, 1 - b1)
        exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        step_size = cfg.lr / (1 - b1**self.num_steps)
        denom = exp_avg_sq.sqrt().div_(math.sqrt(1 - b2**self.num_steps)).add_(cfg.eps)
        p.addcdiv_(exp_avg, denom, value=-step_size)

    def _adamw_fused(self, p, b, clip: float):
        """torch._fused_adamw_ over the flat buffers cut into pieces of at most FUSED_PIECE
        elements (views): one multi-tensor launch, no temporaries. The clip factor enters as
        grad_scale = 1 / clip (the kernel divides the gradients by it, in place)."""
        cfg = self.cfg
        n = p.numel()
        cuts = [(lo, min(n, lo + FUSED_PIECE)) for lo in range(0, n, FUSED_PIECE)]
        pieces = [[t[lo:hi] for lo, hi in cuts] for t in (p, b.red, b.exp_avg, b.exp_avg_sq)]
        step = torch.full((), float(self.num_steps), dtype=torch.float32, device=p.device)
        scale = (
            None
            if clip == 1.0
            else torch.full((), 1.0 / clip, dtype=torch.float32, device=p.device)
        )
        torch._fused_adamw_(
            *pieces,
            [],
            [step] * len(cuts),
            lr=cfg.lr,
            beta1=cfg.betas[0],
            beta2=cfg.betas[1],
            weight_decay=cfg.weight_decay,
            eps=cfg.eps,
            amsgrad=False,
            maximize=False,
            grad_scale=scale,
            found_inf=None,
        )


FUSED_PIECE = 1 << 28
"""Elements per tensor handed to the fused AdamW kernel (a flat buffer is cut into views)."""


def _merge_spans(counted: list[tuple[int, int]], entries) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) runs of the flat buffer covering the counted (offset, numel) ranges,
    with the alignment gaps between consecutive counted entries (zero gradients) included and
    every uncounted entry left out."""
    starts = sorted((e.offset, e.offset + e.numel) for e in entries)
    counted_set = set(counted)
    spans: list[list[int]] = []
    prev_counted = False
    for lo, hi in starts:
        if (lo, hi - lo) in counted_set:
            if spans and prev_counted:
                spans[-1][1] = hi
            else:
                spans.append([lo, hi])
            prev_counted = True
        else:
            prev_counted = False
    return [(lo, hi) for lo, hi in spans if hi > lo]
