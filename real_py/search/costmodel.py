"""Runtime and memory of one PPO call on one (mesh, dp, tp, pp), in SECONDS and BYTES.

Each formula is a sum of roofline terms (time = work / achieved rate):
  compute    FLOPs / (peak * flops_eff), FLOPs = 2 * matmul params per token + 4 * L * ctx * nh * hd
             (attention scores and values) per token; backward = 2x forward.
  decode     per generated token: max(compute, (weights / tp + KV cache / (tp * pp)) / HBM);
             with pp stages each reading its weights once per micro-batch and pp micro-batches,
             pipelining does not reduce the weight reads of a decode step.
  tp         ring all-reduce: lat + 2 (n-1)/n * bytes / bw; 2 per layer forward, 4 forward+backward.
  pp         bubble factor (m + pp - 1) / m over m micro-batches, plus (m + pp - 2) activation
             hops on the critical path.
  dp         one gradient all-reduce per optimizer step (no overlap with backward assumed).
  optimizer  Adam with fp32 master/m/v distributed over dp: (24 + 3 * param bytes) per param / HBM.
The collective's bandwidth is intra-node when the group's ranks share a node, else inter-node.
Ranks are walked tp fastest, then dp, then pp (Layout's default order), so tp groups are
contiguous and a group of n ranks with stride s shares a node iff s * n <= ranks_per_node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..spec import ModelSpec
from .hardware import HardwareProfile

KINDS = ("generate", "inference", "train")


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """One PPO iteration's data."""

    batch_size: int = 512
    """Prompts per iteration (each produces one sequence)."""
    prompt_len: int = 128
    gen_len: int = 384
    ppo_minibatches: int = 4
    """Optimizer steps per train call (one PPO epoch split into this many mini-batches)."""
    micro_tokens: int = 16384
    """Tokens per micro-batch of a forward/backward pass (per dp replica)."""

    def __post_init__(self):
        for f in ("batch_size", "prompt_len", "gen_len", "ppo_minibatches", "micro_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"Workload.{f}={getattr(self, f)} must be >= 1")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len


@dataclass(frozen=True, slots=True)
class Mesh:
    """A contiguous block of global ranks: an aligned power-of-two block inside one node, or whole nodes."""

    start: int
    size: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))

    def nodes(self, ranks_per_node: int) -> range:
        return range(self.start // ranks_per_node, (self.start + self.size - 1) // ranks_per_node + 1)


def _arch(model: ModelSpec):
    c = model.config
    if c is None:
        raise ValueError(f"model {model.name} has no config; the cost model needs its shape")
    return c


def matmul_params(model: ModelSpec) -> int:
    """Parameters that take part in matmuls (the input embedding is a lookup)."""
    emb = model.param("embed_tokens.weight").numel
    tied = model.config is not None and model.config.tie_word_embeddings and model.config.head == "lm"
    return model.numel - (0 if tied else emb)


def fwd_flops(model: ModelSpec, tokens: float, ctx: float) -> float:
    """Forward FLOPs of `tokens` tokens attending to `ctx` tokens each on average."""
    c = _arch(model)
    return tokens * (2 * matmul_params(model) + 4 * c.num_hidden_layers * ctx * c.num_attention_heads * c.head_dim)


def allreduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce of nbytes over n ranks."""
    if n <= 1:
        return 0.0
    return lat + 2 * (n - 1) / n * nbytes / bw


def group_link(hw: HardwareProfile, mesh: Mesh, stride: int, n: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group of n ranks with the given stride inside the mesh."""
    rpn = hw.ranks_per_node
    if n <= 1 or mesh.size <= rpn and (mesh.start % rpn) + mesh.size <= rpn or stride * n <= rpn:
        return hw.intra_bw, hw.intra_lat
    return hw.inter_bw, hw.inter_lat


def _pipeline(pp: int, tokens: float, micro_tokens: int) -> tuple[int, float]:
    """(micro-batches, bubble factor) of a pass over `tokens` tokens per dp replica."""
    m = max(1, math.ceil(tokens / micro_tokens))
    return m, (m + pp - 1) / m


def call_time(kind: str, model: ModelSpec, mesh: Mesh, dp: int, tp: int, pp: int,
              hw: HardwareProfile, wl: Workload) -> dict[str, float]:
    """Seconds per term and "total" for one call (all sequences of one iteration)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {KINDS}")
    if dp * tp * pp != mesh.size:
        raise ValueError(f"dp{dp}tp{tp}pp{pp} needs {dp * tp * pp} ranks, mesh has {mesh.size}")
    c = _arch(model)
    es, H, L = model.element_size, c.hidden_size, c.num_hidden_layers
    tp_bw, tp_lat = group_link(hw, mesh, 1, tp)
    dp_bw, dp_lat = group_link(hw, mesh, tp, dp)
    pp_bw, pp_lat = group_link(hw, mesh, tp * dp, pp)
    out: dict[str, float] = {}
    seqs = wl.batch_size / dp
    if kind == "generate":
        P, G = wl.prompt_len, wl.gen_len
        tok = seqs * P
        m, bubble = _pipeline(pp, tok, wl.micro_tokens)
        out["prefill"] = fwd_flops(model, tok, P / 2) / (tp * pp) / hw.flops * bubble
        out["prefill_tp"] = 2 * L / pp * (m * tp_lat + allreduce_time(tok * H * es, tp, tp_bw, 0.0)) * bubble \
            if tp > 1 else 0.0
        ctx = P + G / 2
        step_flops = fwd_flops(model, seqs, ctx) / (tp * pp)
        weights = model.numel * es / tp
        kv = seqs * ctx * L * 2 * c.num_key_value_heads * c.head_dim * es / (tp * pp)
        step = max(step_flops / hw.flops, (weights + kv) / hw.mem_bw)
        step_tp = 2 * L * allreduce_time(seqs / pp * H * es, tp, tp_bw, tp_lat)
        step_pp = pp * (pp_lat + seqs / pp * H * es / pp_bw) if pp > 1 else 0.0
        out["decode"] = G * step
        out["decode_tp"] = G * step_tp
        out["decode_pp"] = G * step_pp
    else:
        S = wl.seq_len
        steps = wl.ppo_minibatches if kind == "train" else 1
        tok = seqs * S / steps
        m, bubble = _pipeline(pp, tok, wl.micro_tokens)
        passes = 3 if kind == "train" else 1
        ar_per_layer = 2 * passes if kind == "train" else 2
        compute = passes * fwd_flops(model, tok, S / 2) / (tp * pp) / hw.flops
        tp_t = ar_per_layer * L / pp * (m * tp_lat + allreduce_time(tok * H * es, tp, tp_bw, 0.0)) \
            if tp > 1 else 0.0
        hops = (2 if kind == "train" else 1) * (m + pp - 2) if pp > 1 else 0
        out["compute"] = steps * compute * bubble
        out["tp"] = steps * tp_t * bubble
        out["pp"] = steps * hops * (pp_lat + tok / m * H * es / pp_bw)
        if kind == "train":
            local = model.numel / (tp * pp)
            out["dp"] = steps * allreduce_time(local * es, dp, dp_bw, dp_lat)
            out["optimizer"] = steps * local / dp * (24 + 3 * es) / hw.mem_bw
    out["total"] = sum(out.values())
    return out


def call_memory(kind: str, model: ModelSpec, dp: int, tp: int, pp: int, wl: Workload) -> dict[str, float]:
    """Bytes per device: "persist" (kept all iteration on this layout), "transient" (during the
    call), "weights" (one copy of the parameters in this layout, transient when reallocated here).

    train: weights + grads in the model dtype, fp32 master/m/v distributed over dp; activations
    of min(pp, m) micro-batches in flight (1F1B), 17 * dtype bytes per hidden element per layer
    (Korthikanti et al. with flash attention), plus fp32 logits of one micro-batch.
    generate: KV cache of all sequences at full length plus fp32 logits of one step.
    inference: one micro-batch's hidden states (8 copies) plus fp32 logits.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {KINDS}")
    c = _arch(model)
    es, H, L, V = model.element_size, c.hidden_size, c.num_hidden_layers, c.vocab_size
    vocab_out = V if c.head == "lm" else 1
    local = model.numel / (tp * pp)
    weights = local * es
    seqs = wl.batch_size / dp
    if kind == "train":
        tok = seqs * wl.seq_len / wl.ppo_minibatches
        mb = min(tok, wl.micro_tokens)
        m = max(1, math.ceil(tok / wl.micro_tokens))
        act = min(pp, m) * mb * (L / pp) * H * 17 * es / tp + mb * vocab_out * 4 / tp
        return {"persist": local * (2 * es + 12 / dp), "transient": act, "weights": weights}
    if kind == "generate":
        kv = seqs * wl.seq_len * (L / pp) * 2 * c.num_key_value_heads * c.head_dim * es / tp
        return {"persist": 0.0, "transient": kv + seqs * vocab_out * 4 / tp, "weights": weights}
    tok = seqs * wl.seq_len
    mb = min(tok, wl.micro_tokens)
    return {"persist": 0.0, "transient": mb * H * 8 * es / tp + mb * vocab_out * 4 / tp, "weights": weights}
