"""The `cpu` hardware profile: measured on this machine, the way the CPU runtime uses it (and
calibrate_gpu: a datasheet GPU profile with the per-layer / per-pass seconds measured on one GPU).

    prof, raw = calibrate_cpu()      # ~75 s (3 repeats, medians); cpu_profile() caches it

The CPU runtime runs one single-threaded gloo process per rank, often more ranks than cores. Like
ReaL's profiler, which times layers on the real hardware, this times the runtime's own engines
(real_py.engines.Engine) and transports, in 2n spawned ranks (n = cores, even, at most 4) and
two phases:

A. uncontended: n busy ranks, one per core (the others wait in a barrier):
   - matmul FLOP/s and memcpy bandwidth per process; gloo bandwidth of 32 MiB messages, pairs of
     ranks at once;
   - fixed per-layer and per-pass seconds of a small calibration model's inference, generation
     and train steps at 1 and 5 layers (each rank its own single-rank engine): the slope over
     layers is the per-layer cost, the rest the per-pass cost, after subtracting the roofline
     compute;
   - the same lm engine on tp=2 pairs: its extra seconds per layer are two all-reduces as the
     engines issue them (the collective latency), its extra fixed seconds the tensor-parallel
     head's; the lm engine on pp=2 pairs gives the latency of a message between stages (a hop or
     the last stage's broadcast, `p2p_lat_ratio`);
B. contended: the tp=2 engines on every pair of the 2n ranks (2 per core when n = cores): how
   much the collective latency grows when busy ranks share cores (`lat_contention`; processor
   work grows with the number of busy ranks per core, `shared_cores`); a small all-reduce over
   all 2n ranks against one over pairs: how the latency grows with a collective's ranks
   (`coll_lat_growth`, gloo's ring takes 2 (n - 1) steps); the pp=2 engines on every pair at
   once (as many working stages as cores) against phase A's pairs (half as many): how long each
   message between stages waits when replicas of a pipeline share the cores, although no more of
   their stages work than there are cores (`pipe_wait_lat`); and a real Reallocator
   over DistTransport on all 2n ranks (tp2 x pp -> dp, as a training -> generation move) minus
   its planned transfer time: the fixed cost per reallocation.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import torch
import torch.distributed as dist

from ..engines import Engine, OptimConfig
from ..layout import Layout
from ..parallel import ParallelGroups
from ..realloc.plan import plan_realloc
from ..realloc.reallocator import Reallocator
from ..realloc.shard import ModelShard
from ..realloc.transports.dist import DistTransport
from ..rlhf import ppo
from ..rlhf.models import init_weights
from ..search.costmodel import HEAD_COLLS, Workload, fwd_flops
from ..search.hardware import PROFILES, HardwareProfile
from ..search.realloc_cost import transfer_time
from ..spec import ModelConfig, model_spec
from ..testing import run_distributed

G = (2, 10)
"""The two generation lengths per calibration rank (the decode step is their difference)."""
LAYERS = (1, 5)
"""Layer counts of the calibration model: the per-layer cost is the least-squares slope over them,
the fixed cost the mean of what is left at each count."""
PP_LAYERS = 4
"""Layers of the pp=2 calibration engine (2 per stage)."""
@dataclass(frozen=True)
class Setup:
    """What the calibration engines run: a model shape (its layer count varies, LAYERS) and dtype
    and the data of one pass per rank, `rows` sequences of `seq` tokens for inference and
    generation (prompts of `prompt` tokens), `train_rows` for a train step.

    The default is a small model, so that dispatch costs dominate. `for_job` takes the job's own
    actor shape and pass sizes instead, as ReaL profiles the model it plans for: a fixed
    calibration model carries its own size into every estimate (its train step costs about twice
    the default job's shape per layer at the same rows and tokens:
    bench/results/calibration_shape_cpu2_20261204.md). Scored side by side on the same
    measurements (`bench_estimator.py --calibrate-on job --compare`), the job's setup fits the
    single-rank train steps but estimates the other calls worse: it has the rows of a one-replica
    call, so it charges the ranks of dp > 1 plans for rows they do not hold. The small model is
    the default."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    vocab_size: int = 128
    dtype: str = "float32"
    rows: int = 2
    train_rows: int = 2
    seq: int = 24
    prompt: int = 8

    def __post_init__(self):
        if not 1 <= self.prompt < self.seq:
            raise ValueError(f"Setup: need 1 <= prompt ({self.prompt}) < seq ({self.seq})")
        if min(self.rows, self.train_rows) < 1:
            raise ValueError(f"Setup: rows={self.rows} and train_rows={self.train_rows} must be >= 1")

    def config(self, layers: int, head: str = "lm") -> ModelConfig:
        shape = {k: v for k, v in asdict(self).items() if k not in ("rows", "train_rows", "seq", "prompt")}
        return ModelConfig(**shape, max_position_embeddings=max(64, self.seq, self.prompt + G[1]),
                           num_hidden_layers=layers, head=head)

    @classmethod
    def for_job(cls, model: ModelConfig, batch_rows: int, train_rows: int, seq: int, prompt: int) -> "Setup":
        """The job's model shape (attention and MLP sizes, vocabulary) and dtype, with its per-rank
        rows of an inference / generation pass and of a train step, its sequence and prompt lengths."""
        return cls(hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
                   num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_key_value_heads,
                   vocab_size=model.vocab_size, dtype=model.dtype, rows=batch_rows, train_rows=train_rows, seq=seq, prompt=prompt)

    @classmethod
    def for_workload(cls, model: ModelConfig, wl: Workload) -> "Setup":
        """for_job with one replica's passes of `wl` as the runtime runs them: the whole batch per
        inference / generation pass, one micro-batch of a mini-batch per train pass."""
        return cls.for_job(model, batch_rows=wl.batch_size,
                           train_rows=max(1, wl.batch_size // (wl.ppo_minibatches * wl.micro_batches)),
                           seq=wl.seq_len, prompt=wl.prompt_len)


DEFAULT = Setup()


def _timed(fns: dict, reps: int, group=None, sync=None) -> dict[str, float]:
    """Median seconds of each function over `reps` runs (what the runtime's per-step medians
    see). The functions take turns, so a drift of the machine's speed (other jobs, clocks) hits
    all of them alike instead of biasing the differences fitted below; the ranks of `group`
    (default: the world) start every run together. `sync` (e.g. torch.cuda.synchronize) runs
    after each function, inside its time."""
    for fn in fns.values():
        fn()
    ts = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def _inputs(cal: Setup, rank: int, rows: int, device="cpu"):
    tok = torch.randint(1, cal.vocab_size, (rows, cal.seq), generator=torch.Generator().manual_seed(rank))
    return tok.to(device), torch.full((rows,), cal.seq, device=device)


def _engine(cal: Setup, layout, groups, rank: int, layers: int, head: str = "lm", train: bool = False,
            device="cpu"):
    cfg = cal.config(layers, head)
    shard = ModelShard.from_full(model_spec(cfg), layout, rank, init_weights(cfg, 0), device)
    return Engine(cfg, layout, groups, shard, optim=OptimConfig(lr=1e-5) if train else None)


def _generate(cal: Setup, eng, tok, n: int):
    """tok on the CPU, as the runtime's data store hands prompts to generate()."""
    b = tok.shape[0]
    return eng.generate(tok[:, :cal.prompt], torch.full((b,), cal.prompt), torch.arange(b), max_new_tokens=n,
                        greedy=False)


def _ppo_loss(cal: Setup, head: str, tok):
    """The runtime's train-step loss (real_py.rlhf.calls): clipped policy loss with entropy and
    clip-fraction read-outs (lm head) or clipped value loss (value head), over random targets."""
    g, d, (b, t) = torch.Generator().manual_seed(7), tok.device, tok.shape
    n = t - 1  # log-probs of tokens 1..t-1; values of positions 0..t-2
    mask = ppo.response_mask(torch.full((b,), cal.prompt, device=d), torch.full((b,), t, device=d), t)
    old, adv = (torch.randn(b, n, generator=g) - 3.0).to(d), torch.randn(b, n, generator=g).to(d)

    def loss_fn(out, data):
        if head == "lm":
            loss, nclip = ppo.policy_loss(out["logprobs"], old, adv, mask, 0.2)
            float(nclip), float((out["entropy"].detach() * mask).sum()), float(mask.sum())
        else:
            loss, nclip = ppo.value_loss(out["values"][:, :-1], old, adv, mask, 0.2)
            float(nclip), float(mask.sum())
        return loss / float(mask.sum())

    return loss_fn


def _single_rank_costs(cal: Setup, rank: int, g, busy, reps: int, device="cpu") -> dict:
    """Inference, train steps (lm and value heads) and generation of this rank's own engine."""
    tok, lengths = _inputs(cal, rank, cal.rows, device)
    ttok, tlengths = _inputs(cal, rank, cal.train_rows, device)
    prompts = tok.cpu()
    fns = {}
    for head in ("lm", "value"):
        loss = _ppo_loss(cal, head, ttok)
        for L in LAYERS:
            eng = _engine(cal, g.layout, g, rank, L, head, train=True, device=device)
            fns[f"{head}_inf_{L}"] = lambda eng=eng: eng.inference(tok, lengths)
            fns[f"{head}_train_{L}"] = lambda eng=eng, loss=loss, head=head: eng.train_step(
                loss, {"tokens": ttok, "lengths": tlengths}, with_entropy=head == "lm")
            if head == "lm":
                for n in G:
                    fns[f"gen{n}_{L}"] = lambda eng=eng, n=n: _generate(cal, eng, prompts, n)
    return _timed(fns, reps, busy, sync=torch.cuda.synchronize if torch.device(device).type == "cuda" else None)


def _pair_costs(cal: Setup, rank: int, pg, busy, reps: int, prefix: str, layers, train: bool) -> dict:
    """The lm engine on this rank's pair (tp=2 or pp=2 groups `pg`): inference, generation and
    optionally a train step, for each layer count."""
    tok, lengths = _inputs(cal, rank, cal.rows)
    ttok, tlengths = _inputs(cal, rank, cal.train_rows)
    fns = {}
    for L in layers:
        eng = _engine(cal, pg.layout, pg, rank, L, train=train)
        fns[f"{prefix}_inf_{L}"] = lambda eng=eng: eng.inference(tok, lengths)
        if train:
            fns[f"{prefix}_train_{L}"] = lambda eng=eng, loss=_ppo_loss(cal, "lm", ttok): eng.train_step(
                loss, {"tokens": ttok, "lengths": tlengths}, with_entropy=True)
        for n in G:
            fns[f"{prefix}_gen{n}_{L}"] = lambda eng=eng, n=n: _generate(cal, eng, tok, n)
    return _timed(fns, reps, busy)


def _link_bandwidth(rank: int, pair, reps: int) -> dict:
    """gloo bandwidth of 32 MiB messages, every pair of ranks sending at once (latencies come
    from the engines, see _fit)."""
    big = torch.zeros(32 << 18)

    def send():
        (dist.send if rank % 2 == 0 else dist.recv)(big, rank ^ 1)

    seconds = _timed({"send": send}, max(3, reps // 3), pair)["send"]
    return {"bw_bytes_per_s": big.numel() * 4 / seconds}


def _coll_growth(rank: int, pair, reps: int) -> dict:
    """Seconds of a small all-reduce (the size of a loss or token count) over all ranks and over
    this rank's pair, every rank busy in both (every pair at once): how a collective's latency
    grows with its ranks (`coll_lat_growth`)."""
    x, n = torch.zeros(8, dtype=torch.float64), 10  # n back to back per timing: the steady rate

    def world():
        for _ in range(n):
            dist.all_reduce(x)

    def pairs():
        for _ in range(n):
            dist.all_reduce(x, group=pair)

    return {f"allreduce_{k}_s": v / n for k, v in _timed({"world": world, "pair": pairs}, reps).items()}


def _realloc_plan(world: int, cal: Setup = DEFAULT):
    """The calibration reallocation: the calibration model from tp=2 x pp=world/2 (a training
    layout) to dp=world (a generation layout) on every rank, busy at once as in the runtime."""
    spec = model_spec(cal.config(4))
    ranks = tuple(range(world))
    return plan_realloc(spec, Layout(tp=2, pp=world // 2, ranks=ranks), Layout(dp=world, ranks=ranks),
                        ranks_per_node=world)


def _realloc_cost(cal: Setup, rank: int, transport, n: int, busy, reps: int) -> dict:
    plan = _realloc_plan(n, cal)
    realloc = Reallocator(plan, transport)
    a = ModelShard.from_full(plan.model, plan.src, rank, init_weights(cal.config(4), 0))
    b = ModelShard.empty(plan.model, plan.dst, rank)
    return {"realloc_s": _timed({"realloc": lambda: realloc.run(a, b)}, reps, busy)["realloc"]}


def _roofline(busy) -> dict:
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    dist.barrier(group=busy)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        a @ b
        reps += 1
    flops = 2 * n ** 3 * reps / (time.perf_counter() - t0)
    src = np.ones(32 << 20, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    dist.barrier(group=busy)
    t0 = time.perf_counter()
    for _ in range(4):
        np.copyto(dst, src)
    # Bytes read + written, like the GPU HBM figures.
    return {"matmul_flops": flops, "memcpy_bytes_per_s": 2 * 4 * src.nbytes / (time.perf_counter() - t0)}


def _worker(rank: int, world: int, n: int, reps: int, cal: Setup = DEFAULT) -> dict:
    """Phase A on ranks 0..n-1 (one per core), phase B on all `world` = 2n ranks."""
    # Groups first, every rank, same order (new_group is collective over the world).
    busy = dist.new_group(list(range(n)))
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    singles = [ParallelGroups(Layout(ranks=(r,))) for r in range(n)]
    tp2 = [ParallelGroups(Layout(tp=2, ranks=(r, r + 1))) for r in range(0, world, 2)]
    pp2 = [ParallelGroups(Layout(pp=2, ranks=(r, r + 1))) for r in range(0, world, 2)]
    out = {}
    if rank < n:  # phase A: one busy rank per core
        out |= _roofline(busy)
        out |= _link_bandwidth(rank, pairs[rank // 2], reps)
        out |= _single_rank_costs(cal, rank, singles[rank], busy, reps)
        out |= _pair_costs(cal, rank, tp2[rank // 2], busy, reps, "tp2", LAYERS, train=True)
        out |= _pair_costs(cal, rank, pp2[rank // 2], busy, reps, "pp2", (PP_LAYERS,), train=False)
    dist.barrier()
    # Phase B: every pair at once, two busy ranks per core; a reallocation over every rank.
    out |= _pair_costs(cal, rank, tp2[rank // 2], None, reps, "tp2busy", LAYERS, train=False)
    out |= _pair_costs(cal, rank, pp2[rank // 2], None, reps, "pp2busy", (PP_LAYERS,), train=False)
    out |= _coll_growth(rank, pairs[rank // 2], reps)
    out |= _realloc_cost(cal, rank, DistTransport(dist.group.WORLD, timeout=60), world, None, reps)
    return out


def _fit_line(points: dict) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through {x: y}."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def _decode_slope(raw: dict, prefix: str) -> tuple[float, float]:
    """(per layer, per step) of a decode step: generate(n) = prefill + (n - 1) decode steps;
    the decode FLOPs are negligible here."""
    lo, hi = G
    step = {L: (raw[f"{prefix}gen{hi}_{L}"] - raw[f"{prefix}gen{lo}_{L}"]) / (hi - lo) for L in LAYERS}
    per_layer = max(_fit_line(step)[0], 0.0)
    return per_layer, max(statistics.mean(step[L] - L * per_layer for L in LAYERS), 0.0)


def _fit_single(raw: dict, flops: float, cal: Setup = DEFAULT) -> dict:
    """The one-rank fields (per-layer and per-pass seconds of inference, train steps and decode
    steps) from the engine timings (slope over LAYERS), after removing the calibration model's
    roofline compute (FLOPs at `flops` per second)."""

    def net(key: str, L: int, passes: int, head: str = "lm") -> float:
        """The timing minus the roofline FLOPs of its passes (of the model with that head). The
        optimizer's modelled memory traffic is not subtracted: on these small layers the update
        costs dispatch, not bandwidth, and subtracting it makes the estimates of the default
        job's train calls 15-35% too fast (bench_estimator)."""
        rows = cal.train_rows if passes == 3 else cal.rows
        return max(raw[key] - passes * fwd_flops(model_spec(cal.config(L, head)), rows * cal.seq, cal.seq / 2) / flops, 0.0)

    def line(prefix: str, passes: int) -> tuple[float, float, float]:
        """(per layer, per pass of the lm head, per pass of the value head). The layers are the
        same under both heads: one slope, averaged over them; each head's fixed part is what is
        left of its timings at both layer counts (the lm head's log-probs and entropy over the
        vocabulary cost more than a value head's one output per token)."""
        t = {(h, L): net(f"{h}_{prefix}_{L}", L, passes, h) for h in ("lm", "value") for L in LAYERS}
        per_layer = max(statistics.mean(_fit_line({L: t[h, L] for L in LAYERS})[0] for h in ("lm", "value")), 0.0)
        fixed = [max(statistics.mean(t[h, L] - L * per_layer for L in LAYERS), 0.0) for h in ("lm", "value")]
        return per_layer, fixed[0], fixed[1]

    layer, head, value_head = line("inf", 1)
    train_layer, train, value_train = line("train", 3)
    decode_layer, decode = _decode_slope(raw, "")
    return {"layer_lat": layer, "head_lat": head, "value_head_lat": value_head, "train_layer_lat": train_layer,
            "train_lat": train, "value_train_lat": value_train, "decode_layer_lat": decode_layer, "decode_lat": decode}


def _pipe_wait(raw: dict) -> float:
    """Phase B's pp=2 engines on every pair at once (one working stage per pair, as many as cores)
    against phase A's pairs (half as many): the extra seconds of an inference pass and of a
    decode step, each with two hand-overs between the stages (the activation hop and the last
    stage's broadcast), per hand-over; their mean, in [0, one uncontended pp=2 inference pass]
    (a longer wait per message would be a disturbed calibration). The decode step is left out
    when a difference of generation timings drowns in noise (<= 0). 0 for recorded calibrations
    without these timings.

    A wait per hand-over rather than a stretch of the whole pass (busy / alone - 1): a woken stage
    waits for a core once per hand-over, however much work its stage then does, and a stretch
    measured on these short passes over-charges the longer train steps of a dp2 x pp2 plan
    (bench/results/estimator_rescore_cpu2_20261205.md)."""
    Lp, (lo, hi) = PP_LAYERS, G
    if f"pp2busy_inf_{Lp}" not in raw:
        return 0.0
    extra = [raw[f"pp2busy_inf_{Lp}"] - raw[f"pp2_inf_{Lp}"]]
    step, busy_step = ((raw[f"{k}_gen{hi}_{Lp}"] - raw[f"{k}_gen{lo}_{Lp}"]) / (hi - lo) for k in ("pp2", "pp2busy"))
    if step > 0 and busy_step > 0:
        extra.append(busy_step - step)
    return min(max(statistics.mean(extra) / 2, 0.0), raw[f"pp2_inf_{Lp}"])


def _fit(raw: dict, prof_kw: dict, cal: Setup = DEFAULT) -> dict:
    """_fit_single's fields, and the collective, contention and pipeline fields of phases A and B."""
    single = _fit_single(raw, prof_kw["peak_flops"] * prof_kw["flops_eff"], cal)
    decode_layer, decode = single["decode_layer_lat"], single["decode_lat"]
    lo, hi = G
    tp_decode_layer, tp_decode = _decode_slope(raw, "tp2_")
    busy_decode_layer, _ = _decode_slope(raw, "tp2busy_")
    slope, fixed = {}, {}
    for k in ("lm_inf", "tp2_inf", "lm_train", "tp2_train", "tp2busy_inf"):
        slope[k], fixed[k] = _fit_line({L: raw[f"{k}_{L}"] for L in LAYERS})
    # The tp=2 engine's extra seconds per layer over the same lm engine on one rank are its
    # collectives: 2 all-reduces per layer in inference and decode steps, 4 in a train step
    # (forward and backward). One latency, least squares over the three.
    extra = [(2, slope["tp2_inf"] - slope["lm_inf"]), (2, tp_decode_layer - decode_layer),
             (4, slope["tp2_train"] - slope["lm_train"])]
    coll = max(sum(n * e for n, e in extra) / sum(n * n for n, _ in extra), 1e-6)
    # Phase B: with c busy ranks per core the per-layer work takes c times as long; the rest of
    # the growth of the tp=2 slope is the collective latency's.
    c = prof_kw["shared_cores"] and max(1.0, raw["ranks"] / prof_kw["shared_cores"])  # phase B
    busy_coll = statistics.mean([slope["tp2busy_inf"] - c * slope["lm_inf"],
                                 busy_decode_layer - c * decode_layer]) / 2
    lat_contention = max((busy_coll / coll - 1.0) / (c - 1.0), 0.0) if c > 1 else 0.0
    # The pp=2 engine (PP_LAYERS layers) over the same layers on one rank: per inference pass one
    # activation hop and one result broadcast, per decode step one hop and one token broadcast.
    Lp = PP_LAYERS
    pp_step = (raw[f"pp2_gen{hi}_{Lp}"] - raw[f"pp2_gen{lo}_{Lp}"]) / (hi - lo)
    pp_extra = statistics.mean([raw[f"pp2_inf_{Lp}"] - (fixed["lm_inf"] + Lp * slope["lm_inf"]),
                                pp_step - (decode + Lp * decode_layer)])
    # Both are point-to-point messages (a broadcast over two ranks is one send): half each.
    p2p_ratio = max(pp_extra / 2, 0.01 * coll) / coll
    # Phase B: a collective over all ranks against one over pairs, both with every rank busy.
    growth = max((raw["allreduce_world_s"] / raw["allreduce_pair_s"] - 1.0) / (raw["ranks"] - 2), 0.0)
    # What tensor parallelism adds outside the layers beyond the collectives the cost model
    # counts (HEAD_COLLS per pass, one all-gather per decode step): gathers of Python objects,
    # masking and slicing of the vocab-parallel head.
    return single | {
        "intra_lat": coll, "lat_contention": lat_contention, "p2p_lat_ratio": p2p_ratio, "coll_lat_growth": growth,
        "pipe_wait_lat": _pipe_wait(raw) if c > 1 else 0.0,
        "tp_head_lat": max(fixed["tp2_inf"] - fixed["lm_inf"] - HEAD_COLLS * coll, 0.0),
        "tp_train_lat": max(fixed["tp2_train"] - fixed["lm_train"] - 2 * HEAD_COLLS * coll, 0.0),
        "tp_decode_lat": max(tp_decode - decode - coll, 0.0)}


def calibrate_cpu(reps: int = 25, repeats: int = 3, setup: Setup = DEFAULT):
    """Measure this machine (phases A and B of the module docstring) `repeats` times with the
    calibration engines of `setup`; returns (profile, raw): every field of the profile is its
    median over the repeats (each fitted from one whole measurement), raw holds each repeat's
    measurements and the setup.

    On a shared machine one calibration moves with the other tenants (a fitted latency moved 0.01-0.97 between
    calibrations minutes apart; bench_estimator); the median of three is what the estimator uses."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    raws = [_calibrate_once(reps, setup) for _ in range(repeats)]
    return profile_from_raw(raws, setup), {"repeats": raws, "setup": asdict(setup)}


def profile_from_raw(raws: list[dict], cal: Setup = DEFAULT) -> HardwareProfile:
    """The `cpu` profile of recorded calibrations (calibrate_cpu's raw["repeats"]): each fitted
    alone, every field the median; `bench_estimator.py --rescore --refit` fits a recorded run's
    calibrations with this code. (A fit of the engines' own FLOP rate from passes at 1x and 4x
    the rows measures worse on the same measurements than the matmul roofline used here:
    bench/results/calibration_rate_ab_cpu2_20261204.md.)"""
    profs = [_profile(raw, cal) for raw in raws]
    kw = {}
    for f in fields(HardwareProfile):
        vals = [getattr(p, f.name) for p in profs]
        kw[f.name] = statistics.median(vals) if isinstance(vals[0], float) else vals[0]
    return HardwareProfile(**kw)


def _calibrate_once(reps: int, cal: Setup = DEFAULT) -> dict:
    """One calibration's raw measurements (the slowest rank's figure of each)."""
    cores = os.cpu_count() or 1
    n = min(max(2, cores // 2 * 2), 4)  # phase A ranks: pairs, one per core, at most 4
    res = run_distributed(_worker, 2 * n, n, reps, cal, timeout=600)
    # Slowest rank for times, slowest rank's rate for rates: what a synchronous runtime sees.
    raw = {k: (min if k.endswith("per_s") or k == "matmul_flops" else max)(r[k] for r in res if k in r)
           for k in res[0]}
    raw |= {"ranks": 2 * n, "cpus": cores, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        raw["mem_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        raw["mem_bytes"] = 8e9
    return raw


def _profile(raw: dict, cal: Setup = DEFAULT) -> HardwareProfile:
    """The profile fitted from one calibration's raw measurements."""
    # Efficiency factors are 1: the measured numbers already are what the runtime achieves.
    # All ranks share one machine (one "node" of up to 64 ranks; intra == inter).
    kw = dict(name="cpu", peak_flops=raw["matmul_flops"], flops_eff=1.0, hbm_bw=raw["memcpy_bytes_per_s"],
              hbm_eff=1.0, intra_bw=raw["bw_bytes_per_s"], inter_bw=raw["bw_bytes_per_s"],
              mem_bytes=float(raw["mem_bytes"]), mem_usable=0.5, ranks_per_node=64, shared_cores=raw["cpus"])
    kw |= _fit(raw, kw, cal)
    kw["inter_lat"] = kw["intra_lat"]
    # transfer_time scales (transfer + realloc_lat) by the contention of the plan's ranks.
    plan = _realloc_plan(raw["ranks"], cal)
    kw["realloc_lat"] = max(raw["realloc_s"] / HardwareProfile(**kw).contention(raw["ranks"])
                            - transfer_time(plan, HardwareProfile(**kw | {"shared_cores": 0})), 0.0)
    return HardwareProfile(**kw)


def calibrate_gpu(base: str = "h200", reps: int = 25, repeats: int = 3, device=None, setup: Setup = DEFAULT):
    """The datasheet profile `base` (real_py.search.hardware.PROFILES) with this GPU's fixed
    seconds per layer and per pass (kernel launches and host dispatch, which the datasheet
    profiles leave at zero): the calibration model's engines of phase A, one rank on one GPU,
    each field the median of `repeats` fits. Returns (profile named "<base>_cal", raw). Runs in
    this process when torch.distributed is initialized with one rank (any backend), else in one
    spawned NCCL rank.
    Collective and pipeline fields stay the datasheet's: one GPU has no peer to time them."""
    if base not in PROFILES:
        raise ValueError(f"base={base!r}; allowed: {sorted(PROFILES)}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(f"calibrate_gpu times one rank; the initialized world has {dist.get_world_size()}")
        raws = [_gpu_costs(0, 1, reps, device, setup) for _ in range(repeats)]
    else:
        backend = "gloo" if device is not None and torch.device(device).type == "cpu" else "nccl"
        raws = [run_distributed(_gpu_costs, 1, reps, device, setup, timeout=600, backend=backend)[0]
                for _ in range(repeats)]
    prof = PROFILES[base]
    fits = [_fit_single(raw, prof.flops, setup) for raw in raws]
    kw = {k: statistics.median(f[k] for f in fits) for k in fits[0]}
    return replace(prof, name=f"{base}_cal", **kw), {"repeats": raws, "setup": asdict(setup)}


def _gpu_costs(rank: int, world: int, reps: int, device=None, cal: Setup = DEFAULT) -> dict:
    """Phase A's single-rank timings on `device` (default: the current CUDA device; "cpu" runs
    the same code on the processor, a dry run of calibrate_gpu)."""
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # set_device needs an index
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    out = _single_rank_costs(cal, rank, ParallelGroups(Layout(ranks=(rank,))), None, reps, device=dev)
    return out | {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                  "date": time.strftime("%Y-%m-%d %H:%M:%S")}
