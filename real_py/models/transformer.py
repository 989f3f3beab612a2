"""One pipeline stage of a LLaMA / Qwen2-style decoder whose parameters are shard views.

    model = StageModel(config, shard, tp_group)
    h = model(x, positions)            # x: tokens [B, T] (first stage) or hidden [B, T, H]
    out = model.head(h)                # last stage: local logits [B, T, V/tp] or values [B, T]

Every parameter is an nn.Parameter wrapping a view of `shard.flat` (no copy), so a reallocation
that writes into the flat buffer changes what the next forward reads. Module names mirror the
ModelSpec names (layers.3.self_attn.qkv_proj.weight ...); `model.shard_params` maps every shard
name to its Parameter, including the tied embedding copy on the last stage.
Numerics follow transformers' LlamaForCausalLM: RMSNorm in fp32, rotate-half RoPE with fp32
frequencies (rope_scaling as transformers, rope.py), repeat-interleaved KV heads, SDPA with scale
1/sqrt(head_dim); layers with a sliding window (Mistral, Qwen2) see keys q - window < k <= q;
lookups of pad_token_id add no gradient to its embedding row (nn.Embedding's padding_idx).
MoE layers (config.is_moe_layer) run moe.MoEBlock instead of the MLP: StageModel(config, shard,
tp_group, experts=ExpertShard, ep_group=...) with the expert Parameters in `expert_params`.

One file past 400 lines: RMSNorm, Attention, DecoderLayer and StageModel are one forward pass whose
numerics are checked against transformers as a whole, with every Parameter a view of shard.flat; the
parts that stand alone are already in mlp.py, moe.py, rope.py and tp.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from ..layout import stage_layer_ranges
from ..realloc.shard import ExpertShard, ModelShard
from ..spec import ModelConfig
from .mlp import MLP
from .moe import EPInfo, MoEBlock
from .rope import rope_cos_sin_scaled, window_mask
from .tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    sum_over_tp,
)
from .tp import _size as tp_size


class RMSNorm(nn.Module):
    """tp_group: the norm is applied to a TP rank's own heads only (Qwen3's per-head q/k norm), so
    its replicated weight's gradient is the sum over the TP group (copy_to_tp on the weight)."""

    def __init__(self, weight: nn.Parameter, eps: float, tp_group=None, plus_one: bool = False):
        super().__init__()
        self.weight, self.eps, self.tp_group, self.plus_one = weight, eps, tp_group, plus_one
        self.single = tp_size(tp_group) == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight if self.single else copy_to_tp(self.weight, self.tp_group)
        if self.plus_one:  # Gemma: (x * (1 + w)) in fp32, then the input dtype
            return (xf * (1.0 + w.float())).to(x.dtype)
        return w * xf.to(x.dtype)


class WholeRMSNorm(nn.Module):
    """OLMo 2's q/k norm over a whole projection of which this TP rank holds `local / full`: the
    mean of squares sums over the TP group; the weight is this rank's split piece."""

    def __init__(self, weight: nn.Parameter, eps: float, full: int, tp_group):
        super().__init__()
        self.weight, self.eps, self.full, self.tp_group = weight, eps, full, tp_group
        self.single = tp_size(tp_group) == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sq = xf.pow(2).sum(-1, keepdim=True)
        ms = (sq if self.single else sum_over_tp(sq, self.tp_group)) / self.full
        return (self.weight * (xf * torch.rsqrt(ms + self.eps))).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, T, hd]; cos, sin [B, T, hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Preallocated keys/values of one layer: [B, n_kv_local, max_len, hd]."""

    def __init__(self, batch: int, num_kv: int, max_len: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, num_kv, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        lo, hi = self.length, self.length + k.shape[2]
        if hi > self.k.shape[2]:
            raise RuntimeError(f"KV cache overflow: {hi} > max_len {self.k.shape[2]}")
        self.k[:, :, lo:hi] = k
        self.v[:, :, lo:hi] = v
        self.length = hi
        return self.k[:, :, :hi], self.v[:, :, :hi]


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, p: dict, pre: str, tp: int, group):
        super().__init__()
        if (
            c.num_key_value_heads < tp
        ):  # only a kv_head_replicas spec gets here (TPRule.replicate_units)
            raise ValueError(
                f"tp={tp} exceeds num_key_value_heads={c.num_key_value_heads}: replicated kv "
                "heads (kv_head_replicas, vLLM's storage) are a reallocation format; "
                "real_py's models need tp <= num_key_value_heads"
            )
        self.qkv_proj = ColumnParallelLinear(
            p[pre + "qkv_proj.weight"], p.get(pre + "qkv_proj.bias"), group
        )
        self.o_proj = RowParallelLinear(p[pre + "o_proj.weight"], group, p.get(pre + "o_proj.bias"))
        self.nh, self.nkv, self.hd = (
            c.num_attention_heads // tp,
            c.num_key_value_heads // tp,
            c.head_dim,
        )
        self.q_norm = self.k_norm = self.whole_q_norm = self.whole_k_norm = None
        if c.qk_norm and c.qk_norm_whole:
            self.whole_q_norm = WholeRMSNorm(
                p[pre + "q_norm.weight"], c.rms_norm_eps, c.num_attention_heads * c.head_dim, group
            )
            self.whole_k_norm = WholeRMSNorm(
                p[pre + "k_norm.weight"], c.rms_norm_eps, c.num_key_value_heads * c.head_dim, group
            )
        elif c.qk_norm:
            self.q_norm = RMSNorm(p[pre + "q_norm.weight"], c.rms_norm_eps, group, c.norm_plus_one)
            self.k_norm = RMSNorm(p[pre + "k_norm.weight"], c.rms_norm_eps, group, c.norm_plus_one)
        self.scale = c.query_pre_attn_scalar**-0.5 if c.query_pre_attn_scalar else None
        self.softcap = c.attn_logit_softcapping

    def forward(self, x, cos, sin, mask, cache: KVCache | None):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(
            [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1
        )
        if (
            self.whole_q_norm is not None
        ):  # OLMo 2: over the whole projection, before the head split
            q, k = self.whole_q_norm(q), self.whole_k_norm(k)
        q, k = q.view(B, T, self.nh, self.hd), k.view(B, T, self.nkv, self.hd)
        if self.q_norm is not None:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
        if self.nkv != self.nh and T == 1 and not self.softcap:
            # A decode step: the g = nh / nkv query heads of each KV head attend as g query rows
            # of that head (a [B, 1, 1, Tk] mask broadcasts over them), instead of copying the
            # whole cache g times. On the H200 the copies cost ~1.2 ms of a 1.1B model's ~7 ms
            # decode step at batch 32 (bench/results/profile_h200_20261204.md).
            g = self.nh // self.nkv
            out = functional.scaled_dot_product_attention(
                q.reshape(B, self.nkv, g, self.hd), k, v, attn_mask=mask, scale=self.scale
            )
            return self.o_proj(out.reshape(B, T, self.nh * self.hd))
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        if self.softcap:
            out = _softcapped_attention(q, k, v, mask, self.scale, self.softcap)
        else:
            causal = False
            if mask is None and T > 1:  # a branch: under torch.compile T may be symbolic
                causal = True
            out = functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


def _softcapped_attention(q, k, v, mask, scale, cap):
    """transformers' eager attention with Gemma 2's logit soft-capping: scores * scale, then
    cap * tanh(scores / cap), masked, softmax in fp32, back to q's dtype. q [B, n, T, hd],
    k/v [B, n, T_kv, hd]; mask None (causal, queries at the last T slots) or bool
    (True = attend)."""
    T, Tk = q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * (
        scale if scale is not None else q.shape[-1] ** -0.5
    )
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        c: ModelConfig,
        p: dict,
        i: int,
        tp: int,
        group,
        experts: dict | None = None,
        ep: EPInfo | None = None,
    ):
        super().__init__()
        pre = f"layers.{i}."
        self.norm_after, self.sandwich = c.norm_after, c.sandwich_norm
        norm = lambda n: RMSNorm(p[pre + n + ".weight"], c.rms_norm_eps, plus_one=c.norm_plus_one)
        if not c.norm_after:
            self.input_layernorm = norm("input_layernorm")
        self.self_attn = Attention(c, p, pre + "self_attn.", tp, group)
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.mlp = (
            MoEBlock(c, p, experts, pre + "mlp.", group, ep)
            if c.is_moe_layer(i)
            else MLP(p, pre + "mlp.", group, c.hidden_act)
        )
        if c.sandwich_norm:
            self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        if c.norm_after or c.sandwich_norm:
            self.post_feedforward_layernorm = norm("post_feedforward_layernorm")

    def forward(self, h, cos, sin, mask, cache):
        if self.sandwich:  # Gemma 2/3: norms on both sides of each sublayer
            h = h + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(h), cos, sin, mask, cache)
            )
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.norm_after:  # OLMo 2: norm the sublayer outputs, not their inputs
            h = h + self.post_attention_layernorm(self.self_attn(h, cos, sin, mask, cache))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class StageModel(nn.Module):
    """Layers [lo, hi) of one pipeline stage, plus the embedding (first) and norm + head (last)."""

    def __init__(
        self,
        config: ModelConfig,
        shard: ModelShard,
        tp_group=None,
        experts: ExpertShard | None = None,
        ep_group=None,
        etp_group=None,
    ):
        super().__init__()
        layout = shard.layout
        ep = _ep_info(config, shard, experts, ep_group, etp_group)
        self.config, self.tp_group, self.tp_rank, self.tp = (
            config,
            tp_group,
            shard.tp_rank,
            layout.tp,
        )
        self.is_first, self.is_last = shard.stage == 0, shard.stage == layout.pp - 1
        self.lo, self.hi = stage_layer_ranges(
            shard.model, layout.pp, layout.layers_per_stage, layout.partition
        )[shard.stage]
        p = {name: nn.Parameter(view) for name, view in shard.params().items()}
        self.shard_params = p
        # MoE: Parameters on views of the expert shard (their own buffer, not shard.flat)
        self.expert_params = (
            {name: nn.Parameter(view) for name, view in experts.params().items()}
            if experts is not None
            else {}
        )
        # Gemma 3: sliding layers rotate with plain RoPE of base rope_local_base_freq
        self.local_rope = (
            replace(config, rope_theta=config.rope_local_base_freq, rope_scaling=None)
            if config.rope_local_base_freq
            else None
        )
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(
                p["embed_tokens.weight"], tp_group, shard.tp_rank, config.padding_row
            )
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(config, p, i, layout.tp, tp_group, self.expert_params, ep)
                for i in range(self.lo, self.hi)
            }
        )
        if self.is_last:
            self.norm = RMSNorm(
                p["norm.weight"], config.rms_norm_eps, plus_one=config.norm_plus_one
            )
            if config.head == "value":
                self.head_weight = p["value_head.weight"]
            else:
                self.head_weight = p.get("lm_head.weight", p.get("embed_tokens.weight"))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        caches: list | None = None,
        run=None,
    ) -> torch.Tensor:
        """x: tokens [B, T] int64 (first stage) or hidden [B, T, H]; positions [B, T];
        mask: None (causal) or bool [B, 1, T, T_kv] (True = attend). Returns hidden [B, T, H].
        run: None, or (layer_fn, norm_fn) called as layer_fn(layer, h, cos, sin, mask, cache) and
        norm_fn(norm, h) in place of the modules' own calls (the decode step's compiled versions,
        engines/decode.py); the same maths."""
        h = self.embed_tokens(x) if self.is_first else x
        if (
            self.is_first and self.config.norm_plus_one
        ):  # Gemma: sqrt(H) rounded to the embedding dtype
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        cos, sin = rope_cos_sin_scaled(self.config, positions, h.dtype)
        local = (
            rope_cos_sin_scaled(self.local_rope, positions, h.dtype)
            if self.local_rope
            else (cos, sin)
        )
        windowed = self._window_mask(mask, h.shape[1], caches)
        for j, (i, layer) in enumerate(self.layers.items()):
            slides = self.config.uses_window(int(i))
            m = windowed if windowed is not None and slides else mask
            cs = local if slides else (cos, sin)
            cache = caches[j] if caches is not None else None
            h = layer(h, *cs, m, cache) if run is None else run[0](layer, h, *cs, m, cache)
        if not self.is_last:
            return h
        return self.norm(h) if run is None else run[1](self.norm, h)

    def _window_mask(self, mask, T: int, caches) -> torch.Tensor | None:
        """`mask` (None = causal) narrowed to the sliding window, for the layers that use one:
        bool [T, T_kv] or [B, 1, T, T_kv]; None if no local layer has a window."""
        c = self.config
        if not c.sliding_window or not any(c.uses_window(i) for i in range(self.lo, self.hi)):
            return None
        start = caches[0].length if caches else 0  # slots already in the cache
        dev = mask.device if mask is not None else next(iter(self.shard_params.values())).device
        keep = window_mask(
            torch.arange(start, start + T, device=dev),
            torch.arange(start + T, device=dev),
            c.sliding_window,
        )
        return keep if mask is None else mask & keep

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Last stage: local logits [B, T, V_local] (lm) or values [B, T] (value head)."""
        if self.config.head == "value":
            return functional.linear(h, self.head_weight).squeeze(-1)
        logits = functional.linear(copy_to_tp(h, self.tp_group), self.head_weight)
        cap = self.config.final_logit_softcapping
        return (
            torch.tanh(logits / cap) * cap if cap else logits
        )  # elementwise: fine on a vocab slice

    def new_caches(self, batch: int, max_len: int) -> list:
        """One KVCache per local layer."""
        c, w = self.config, next(iter(self.shard_params.values()))
        return [
            KVCache(batch, c.num_key_value_heads // self.tp, max_len, c.head_dim, w.dtype, w.device)
            for _ in range(self.hi - self.lo)
        ]


def _ep_info(
    c: ModelConfig, shard: ModelShard, experts: ExpertShard | None, ep_group, etp_group=None
) -> EPInfo | None:
    """Checks the expert shard and ep group of an MoE model; None for a dense one."""
    layout = shard.layout
    if not c.num_experts:
        if experts is not None:
            raise ValueError(
                f"StageModel: experts given but ModelConfig.num_experts=0 ({shard.model.name})"
            )
        return None
    if experts is None:
        raise ValueError(
            f"StageModel: {shard.model.name} has {c.num_experts} experts per MoE layer; pass "
            "experts=ExpertShard(...) of the same layout and rank (load_hf_experts)"
        )
    if experts.layout != layout or experts.rank != shard.rank:
        raise ValueError(
            f"StageModel: expert shard {experts} is not of layout {layout} rank {shard.rank}"
        )
    if layout.etp > 1:
        if etp_group is None:
            raise ValueError(
                f"StageModel: layout {layout} has etp={layout.etp}; pass etp_group "
                "(ParallelGroups(layout).etp_group)"
            )
        members = dist.get_process_group_ranks(etp_group)
        want = {
            layout.expert_rank(experts.edp_rank, experts.ep_rank, t, shard.stage)
            for t in range(layout.etp)
        }
        if set(members) != want:
            raise ValueError(
                f"StageModel: etp_group ranks {members} are not the etp group {sorted(want)} of "
                f"rank {shard.rank} in {layout}"
            )
    if layout.ep == 1:
        return EPInfo(etp_group=etp_group)
    if ep_group is None:
        raise ValueError(
            f"StageModel: layout {layout} has ep={layout.ep}; pass ep_group "
            "(ParallelGroups(layout).ep_group)"
        )
    members = dist.get_process_group_ranks(ep_group)
    group_ep = tuple(layout.expert_coords(r)[1] for r in members)
    if sorted(group_ep) != list(range(layout.ep)) or shard.rank not in members:
        raise ValueError(
            f"StageModel: ep_group ranks {members} are not an ep group of {layout} holding rank "
            f"{shard.rank}"
        )
    return EPInfo(layout.ep, experts.ep_rank, ep_group, group_ep, etp_group)
