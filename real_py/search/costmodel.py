"""Runtime and memory of one PPO call on one (mesh, dp, tp, pp), in SECONDS and BYTES.

Each formula is a sum of roofline terms (time = work / achieved rate):
  compute    FLOPs / (peak * flops_eff), FLOPs = 2 * matmul params per token + 4 * L * ctx * nh * hd
             (attention scores and values) per token; backward = 2x forward.
  decode     per generated token: max(compute, (weights / tp + KV cache / (tp * pp)) / HBM);
             with pp stages each reading its weights once per micro-batch and pp micro-batches,
             pipelining does not reduce the weight reads of a decode step.
  tp         ring all-reduce: lat_n + 2 (n-1)/n * bytes / bw, lat_n the profile's collective latency
             grown for n ranks (HardwareProfile.coll_lat); 2 per layer forward, 4 forward+backward,
             plus small ones per pass outside the layers: HEAD_COLLS with an lm head (vocab-parallel
             embedding and log-probs), VALUE_HEAD_COLLS with a value head (embedding only).
  pp         bubble factor (m + pp - 1) / m over m micro-batches, plus (m + pp - 2) activation
             hops on the critical path (point-to-point messages, as is the last stage's
             broadcast of results or tokens: HardwareProfile.p2p_lat_ratio); m is the cheapest
             count from ceil(tokens / micro_tokens) up to 4 * pp, or the runtime's own count
             (Workload.runtime_micro_batches), so more work never costs less
             (tests/test_search_monotone.py).
  dp         one gradient all-reduce per optimizer step (no overlap with backward assumed), plus
             the small loss / token-count / grad-norm collectives of the step.
  optimizer  Adam with fp32 master/m/v distributed over dp: (24 + 3 * param bytes) per param / HBM.
  overhead   fixed seconds per layer and per pass of one micro-batch (host-side op dispatch);
             measured for the `cpu` profile, zero for GPUs (launches overlap device work).
  sharing    ranks sharing cores (`cpu` profile): processor terms x busy ranks / cores, message
             waits x HardwareProfile.lat_slowdown (see calibrate/measure.py); an inference call
             without collectives (dp only) counts one busy rank (its ranks run their shares apart);
             dp > 1 replicas of a pipeline on more ranks than cores: + pipe_wait_lat per message
             between stages (their stages hand over out of step).
             Calls on disjoint ranks share the cores too: the simulators stretch a call by the
             working ranks of the calls it overlaps (simulate.py).
The collective's bandwidth is intra-node when the group's ranks share a node, else inter-node.
Ranks are walked tp fastest, then dp, then pp (Layout's default order), so tp groups are
contiguous and a group of n ranks with stride s shares a node iff s * n <= ranks_per_node.

One file past 400 lines: call_time sums the roofline terms listed above and call_memory the same
call's bytes, both from the same Workload, Mesh and parameter counts, so the formulas above are
checked against the code in this one file.
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
    """Optimizer steps per PPO epoch (each epoch splits the batch into this many mini-batches)."""
    ppo_epochs: int = 1
    """Passes over the batch per train call."""
    micro_tokens: int = 16384
    """Tokens per micro-batch of a forward/backward pass (per dp replica)."""
    micro_batches: int = 1
    """Micro-batches per train mini-batch (ppo.micro_batches): a feasibility rule (at least that
    many rows per mini-batch and dp replica), and the count itself with runtime_micro_batches."""
    group_size: int = 1
    """GRPO group size (ppo.group_size); 1 for PPO."""
    runtime_micro_batches: bool = False
    """True: every pass has the micro-batch count real_py's runtime gives it, `micro_batches` per
    train mini-batch and one per forward-only pass (inference; generation's prefill and scoring),
    and micro_tokens is not used. False: the cheapest count from ceil(tokens / micro_tokens) up to
    4 * pp, a runtime that picks its count per pass (ReaL's pipelined passes). With pp > 1 the
    two differ by the pipeline bubble: (m + pp - 1) / m at the runtime's m (often 1)."""

    def __post_init__(self):
        for f in (
            "batch_size",
            "prompt_len",
            "gen_len",
            "ppo_minibatches",
            "ppo_epochs",
            "micro_tokens",
            "micro_batches",
            "group_size",
        ):
            if getattr(self, f) < 1:
                raise ValueError(f"Workload.{f}={getattr(self, f)} must be >= 1")

    def fixed_micro_batches(self, train: bool) -> int | None:
        """The runtime's micro-batch count for a train or a forward-only pass, or None when the
        count follows micro_tokens (runtime_micro_batches False)."""
        if not self.runtime_micro_batches:
            return None
        return self.micro_batches if train else 1

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len


@dataclass(frozen=True, slots=True)
class Mesh:
    """A contiguous block of global ranks: an aligned power-of-two block inside one node, or whole
    nodes."""

    start: int
    size: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))

    def nodes(self, ranks_per_node: int) -> range:
        return range(
            self.start // ranks_per_node, (self.start + self.size - 1) // ranks_per_node + 1
        )


def _arch(model: ModelSpec):
    c = model.config
    if c is None:
        raise ValueError(f"model {model.name} has no config; the cost model needs its shape")
    return c


def matmul_params(model: ModelSpec) -> int:
    """Parameters that take part in matmuls (the input embedding is a lookup)."""
    emb = model.param("embed_tokens.weight").numel
    tied = (
        model.config is not None and model.config.tie_word_embeddings and model.config.head == "lm"
    )
    return model.numel - (0 if tied else emb)


def fwd_flops(model: ModelSpec, tokens: float, ctx: float) -> float:
    """Forward FLOPs of `tokens` tokens attending to `ctx` tokens each on average."""
    c = _arch(model)
    return tokens * (
        2 * matmul_params(model)
        + 4 * c.num_hidden_layers * ctx * c.num_attention_heads * c.head_dim
    )


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


HOST_BOUND = ("prefill", "decode", "score", "compute", "optimizer", "overhead")
"""Terms that take processor time (scaled by HardwareProfile.contention); the rest wait on
messages (scaled by HardwareProfile.lat_slowdown)."""
HEAD_COLLS = 4
"""Tensor-parallel collectives per pass outside the layers: the vocab-parallel embedding and the
log-prob reductions of the vocab-parallel head (max, log-sum-exp, target logit)."""
VALUE_HEAD_COLLS = 1
"""The same for a value head: the embedding's all-reduce only (the [H] -> 1 head is replicated
and reduces nothing over tp; models/transformer.py StageModel.head)."""


def _pipeline(pp: int, tokens: float, micro_tokens: int) -> tuple[int, float]:
    """(micro-batches, bubble factor) of a pass over `tokens` tokens per dp replica."""
    m = max(1, math.ceil(tokens / micro_tokens))
    return m, (m + pp - 1) / m


def call_time(
    kind: str,
    model: ModelSpec,
    mesh: Mesh,
    dp: int,
    tp: int,
    pp: int,
    hw: HardwareProfile,
    wl: Workload,
) -> dict[str, float]:
    """Seconds per term and "total" for one call (all sequences of one iteration).

    Terms: roofline compute ("prefill", "decode", "score", "compute", "optimizer"), collectives
    ("*_tp", "*_pp", "tp", "dp", "pp"), and "overhead": the profile's fixed seconds per
    layer and per pass (op dispatch), zero on the GPU profiles. Not terms: "busy" and
    "working" ranks (core sharing, below; the simulators use them for calls side by side).
    A generate call also scores its sequences with one forward pass ("score"), as the runtime
    does to get the old log-probs.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {KINDS}")
    if dp * tp * pp != mesh.size:
        raise ValueError(f"dp{dp}tp{tp}pp{pp} needs {dp * tp * pp} ranks, mesh has {mesh.size}")
    c = _arch(model)
    es, H, L = model.element_size, c.hidden_size, c.num_hidden_layers
    tp_bw, tp_lat = group_link(hw, mesh, 1, tp)
    dp_bw, dp_lat = group_link(hw, mesh, tp, dp)
    pp_bw, pp_link_lat = group_link(hw, mesh, tp * dp, pp)
    pp_lat = pp_link_lat * hw.p2p_lat_ratio  # pipeline hops are point-to-point messages
    # A collective's latency over n ranks (HardwareProfile.coll_lat_growth: a ring's steps).
    tp_lat, dp_lat, pp_coll_lat = (
        hw.coll_lat(tp_lat, tp),
        hw.coll_lat(dp_lat, dp),
        hw.coll_lat(pp_link_lat, pp),
    )
    # The last stage's broadcast of results (inference) or new tokens (decode steps) carries no
    # reduction: over a pair of stages it is one message, a hop's latency, grown for more stages.
    pp_bcast_lat = hw.coll_lat(pp_lat, pp)
    # Replicas of a pipeline on shared cores hand over out of step: every hand-over between
    # stages (hop, the last stage's broadcast) waits HardwareProfile.pipe_wait_lat more (a woken
    # stage finds its core taken). Measured with as many working stages as cores, it is added
    # after the core sharing's stretch below, not stretched by it; the stage groups' small
    # all-reduces after the flush (train) are not hand-overs: every rank is busy then.
    wait = (
        hw.pipe_wait_lat
        if dp > 1 and pp > 1 and hw.shared_cores and hw.shared_cores < mesh.size
        else 0.0
    )
    waited: dict[str, float] = {}  # term -> its seconds of pipe waits (added after the stretch)
    out: dict[str, float] = {}
    seqs = wl.batch_size / dp
    S = wl.seq_len
    pass_tokens = seqs * S / (wl.ppo_minibatches if kind == "train" else 1)  # per replica and pass

    def forward(tok: float, ctx: float, train: bool) -> tuple[int, dict[str, float]]:
        """(micro-batches, seconds per term) of one pass over tok tokens per replica, with the
        cheapest micro-batch count.

        The count is a choice: at least m0 = ceil(tok / micro_tokens) (memory), and more up
        to 4 * pp. Taking the cheapest keeps the cost monotone in tok: with a fixed count every term
        grows with tok, and a larger tok only removes choices. With the smallest count alone, a
        pass just over micro_tokens splits in two and its bubble falls from pp to (pp + 1) / 2, so
        longer generations would be estimated faster.
        """
        fixed = wl.fixed_micro_batches(train)
        if fixed is not None:  # the runtime's count: every term grows with tok
            return fixed, _pass(tok, ctx, train, fixed)
        m0 = _pipeline(pp, tok, wl.micro_tokens)[0]
        best = (m0, _pass(tok, ctx, train, m0))
        if pp > 1:  # with one stage, more micro-batches only add latency and overhead
            # Counts up to 4 * pp: past that the bubble is within (pp - 1) / (4 * pp) of none.
            # The choice set [m0, max(m0, 4 pp)] only shrinks as tok grows.
            for m in range(m0 + 1, 4 * pp + 1):
                cand = _pass(tok, ctx, train, m)
                if sum(cand.values()) < sum(best[1].values()):
                    best = (m, cand)
        return best

    def _pass(tok: float, ctx: float, train: bool, m: int) -> dict[str, float]:
        bubble = (m + pp - 1) / m
        passes = 3 if train else 1
        k = 2 if train else 1  # forward only, or forward + backward
        # Per layer: 2 all-reduces of the hidden states per direction, on the critical path of
        # every micro-batch; the head's reductions carry a few floats per token (latency only).
        # A value head adds neither the log-prob reductions nor the vocab-parallel head's host
        # work (tp_*_lat, calibrated on lm engines) to a tensor-parallel pass.
        lm = c.head == "lm"
        head_host = (hw.tp_train_lat if train else hw.tp_head_lat) if lm else 0.0
        head_colls = HEAD_COLLS if lm else VALUE_HEAD_COLLS
        tp_t = (
            (
                k
                * 2
                * L
                / pp
                * bubble
                * (m * tp_lat + allreduce_time(tok * H * es, tp, tp_bw, 0.0))
                + m * (k * head_colls * tp_lat + head_host)
            )
            if tp > 1
            else 0.0
        )
        hops = k * (m + pp - 2) if pp > 1 else 0
        layer = hw.train_layer_lat if train else hw.layer_lat
        head = hw.pass_lat(c.head, train)
        return {
            "compute": passes * fwd_flops(model, tok, ctx) / (tp * pp) / hw.flops * bubble,
            "tp": tp_t,
            "pp": hops * (pp_lat + tok / m * H * es / pp_bw),
            "pp_wait": hops * wait,
            "overhead": m * (bubble * L / pp * layer + head),
        }

    if kind == "generate":
        P, G = wl.prompt_len, wl.gen_len
        pre = forward(seqs * P, P / 2, False)[1]
        waited["prefill_pp"] = pre["pp_wait"]
        out["prefill"], out["prefill_tp"], out["prefill_pp"] = pre["compute"], pre["tp"], pre["pp"]
        ctx = P + G / 2
        step_flops = fwd_flops(model, seqs, ctx) / (tp * pp)
        weights = model.numel * es / tp
        kv = seqs * ctx * L * 2 * c.num_key_value_heads * c.head_dim * es / (tp * pp)
        step = max(step_flops / hw.flops, (weights + kv) / hw.mem_bw)
        # Per step: 2 all-reduces per layer and one logits all-gather (tp); an activation hop
        # between stages and the new tokens broadcast from the last stage (pp). Stages run one
        # after another.
        step_tp = (
            2 * L * allreduce_time(seqs / pp * H * es, tp, tp_bw, tp_lat)
            + tp_lat
            + hw.tp_decode_lat
            if tp > 1
            else 0.0
        )
        step_pp = (pp - 1) * (pp_lat + seqs * H * es / pp_bw) + pp_bcast_lat if pp > 1 else 0.0
        out["decode"] = G * step
        out["decode_tp"] = G * step_tp
        out["decode_pp"] = G * step_pp
        score = forward(seqs * S, S / 2, False)[1]
        waited["score_pp"] = score["pp_wait"]
        waited["decode_pp"] = G * pp * wait  # per step pp - 1 hops and the tokens' broadcast
        out["score"], out["score_tp"], out["score_pp"] = score["compute"], score["tp"], score["pp"]
        out["overhead"] = (
            pre["overhead"] + score["overhead"] + G * (L * hw.decode_layer_lat + hw.decode_lat)
        )
    else:
        steps = wl.ppo_epochs * wl.ppo_minibatches if kind == "train" else 1
        pass_m, f = forward(pass_tokens, S / 2, kind == "train")
        waited["pp"] = steps * f.pop("pp_wait")
        for k, v in f.items():
            out[k] = steps * v
        if kind == "train":
            local = model.numel / (tp * pp)
            # Small collectives per optimizer step: grad-norm (tp, pp), loss and token count (dp).
            small = (
                (tp_lat if tp > 1 else 0.0)
                + (2 * pp_coll_lat if pp > 1 else 0.0)
                + (2 * dp_lat if dp > 1 else 0.0)
            )
            out["dp"] = steps * (allreduce_time(local * es, dp, dp_bw, dp_lat) + small)
            out["optimizer"] = steps * local / dp * (24 + 3 * es) / hw.mem_bw
        elif pp > 1:
            out["pp"] += pp_bcast_lat  # results broadcast from the last stage
            waited["pp"] += wait
    # Ranks sharing cores (the cpu profile): the busy ones share them, which stretches what the
    # processors do and, less, the wait for a message (a peer may wait for a core). Pipeline
    # stages are busy together only with several micro-batches in flight; a decode step runs
    # its stages one after another.
    # An inference call on dp replicas alone (tp = pp = 1) has no collective: its ranks never
    # wait for each other, so each runs its share when it gets there. After a generation call
    # (whose ranks end apart: the contended ones later) the shares of a short call do not overlap,
    # and each rank mostly runs its share alone (measured: 4 ranks, dp4 on 2 cores: ref /
    # reward / critic inference of 1-2 ms each, several ms apart per rank, in an instrumented
    # bench_estimator run); the runtime times such a call by its longest rank's own run
    # (rlhf.observe.sync_free_calls). Its peers do not stretch its work. A rule for calls short
    # against that skew: a long one's shares would overlap (not modelled; it still counts as
    # `working` beside other calls).
    sync_free = kind == "inference" and tp == 1 and pp == 1
    working = dp * tp * (1 if kind == "generate" else min(pp, pass_m))  # ranks computing at once
    busy = 1 if sync_free else working
    slow, lat_slow = hw.contention(busy), hw.lat_slowdown(busy)
    out = {k: v * (slow if k in HOST_BOUND else lat_slow) for k, v in out.items()}
    # After the pipeline flush every stage reduces its gradients and steps at the same time.
    for k, f in (("dp", hw.lat_slowdown), ("optimizer", hw.contention)):
        if k in out:
            out[k] *= f(mesh.size) / f(busy)
    for k, v in waited.items():
        if v:
            out[k] += v
    out["total"] = sum(out.values())
    # Not terms: the ranks whose sharing of cores is in this call's time ("busy"), and those
    # computing at once that slow other calls running beside it on the same cores ("working").
    out["busy"], out["working"] = float(busy), float(working)
    return out


def call_memory(
    kind: str, model: ModelSpec, dp: int, tp: int, pp: int, wl: Workload
) -> dict[str, float]:
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
        m = wl.fixed_micro_batches(True) or max(1, math.ceil(tok / wl.micro_tokens))
        mb = tok / m if wl.runtime_micro_batches else min(tok, wl.micro_tokens)
        act = min(pp, m) * mb * (L / pp) * H * 17 * es / tp + mb * vocab_out * 4 / tp
        return {"persist": local * (2 * es + 12 / dp), "transient": act, "weights": weights}
    tok = seqs * wl.seq_len
    mb = tok if wl.runtime_micro_batches else min(tok, wl.micro_tokens)
    forward = mb * H * 8 * es / tp + mb * vocab_out * 4 / tp  # a forward-only pass's activations
    if kind == "generate":
        # Decoding holds the KV cache; the scoring pass after it (the old log-probs) holds a
        # forward pass's activations instead.
        kv = seqs * wl.seq_len * (L / pp) * 2 * c.num_key_value_heads * c.head_dim * es / tp
        return {
            "persist": 0.0,
            "transient": max(kv + seqs * vocab_out * 4 / tp, forward),
            "weights": weights,
        }
    return {"persist": 0.0, "transient": forward, "weights": weights}
