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
from dataclasses import asdict, replace

import numpy as np
import torch
import torch.distributed as dist

from ..engines import Engine, OptimConfig
from ..launch.spawn import spawn_ranks
from ..layout import Layout
from ..parallel import ParallelGroups
from ..realloc.reallocator import Reallocator
from ..realloc.shard import ModelShard
from ..realloc.transports.dist import DistTransport
from ..rlhf import ppo
from ..rlhf.models import init_weights
from ..search.hardware import PROFILES
from ..spec import model_spec
from .fit import fit_single, profile_from_raw
from .setup import DEFAULT, LAYERS, PP_LAYERS, G, Setup, realloc_plan

__all__ = ["calibrate_cpu", "calibrate_gpu", "profile_from_raw", "Setup", "DEFAULT"]


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
    tok = torch.randint(
        1, cal.vocab_size, (rows, cal.seq), generator=torch.Generator().manual_seed(rank)
    )
    return tok.to(device), torch.full((rows,), cal.seq, device=device)


def _engine(
    cal: Setup,
    layout,
    groups,
    rank: int,
    layers: int,
    head: str = "lm",
    train: bool = False,
    device="cpu",
):
    cfg = cal.config(layers, head)
    shard = ModelShard.from_full(model_spec(cfg), layout, rank, init_weights(cfg, 0), device)
    return Engine(cfg, layout, groups, shard, optim=OptimConfig(lr=1e-5) if train else None)


def _generate(cal: Setup, eng, tok, n: int):
    """tok on the CPU, as the runtime's data store hands prompts to generate()."""
    b = tok.shape[0]
    return eng.generate(
        tok[:, : cal.prompt],
        torch.full((b,), cal.prompt),
        torch.arange(b),
        max_new_tokens=n,
        greedy=False,
    )


def _ppo_loss(cal: Setup, head: str, tok):
    """The runtime's train-step loss (real_py.rlhf.calls): clipped policy loss with entropy and
    clip-fraction read-outs (lm head) or clipped value loss (value head), over random targets."""
    g, d, (b, t) = torch.Generator().manual_seed(7), tok.device, tok.shape
    n = t - 1  # log-probs of tokens 1..t-1; values of positions 0..t-2
    mask = ppo.response_mask(
        torch.full((b,), cal.prompt, device=d), torch.full((b,), t, device=d), t
    )
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
                loss, {"tokens": ttok, "lengths": tlengths}, with_entropy=head == "lm"
            )
            if head == "lm":
                for n in G:
                    fns[f"gen{n}_{L}"] = lambda eng=eng, n=n: _generate(cal, eng, prompts, n)
    return _timed(
        fns,
        reps,
        busy,
        sync=torch.cuda.synchronize if torch.device(device).type == "cuda" else None,
    )


def _pair_costs(
    cal: Setup, rank: int, pg, busy, reps: int, prefix: str, layers, train: bool
) -> dict:
    """The lm engine on this rank's pair (tp=2 or pp=2 groups `pg`): inference, generation and
    optionally a train step, for each layer count."""
    tok, lengths = _inputs(cal, rank, cal.rows)
    ttok, tlengths = _inputs(cal, rank, cal.train_rows)
    fns = {}
    for L in layers:
        eng = _engine(cal, pg.layout, pg, rank, L, train=train)
        fns[f"{prefix}_inf_{L}"] = lambda eng=eng: eng.inference(tok, lengths)
        if train:
            fns[f"{prefix}_train_{L}"] = lambda eng=eng, loss=_ppo_loss(cal, "lm", ttok): (
                eng.train_step(loss, {"tokens": ttok, "lengths": tlengths}, with_entropy=True)
            )
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

    return {
        f"allreduce_{k}_s": v / n for k, v in _timed({"world": world, "pair": pairs}, reps).items()
    }


def _realloc_cost(cal: Setup, rank: int, transport, n: int, busy, reps: int) -> dict:
    plan = realloc_plan(n, cal)
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
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)
    src = np.ones(32 << 20, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    dist.barrier(group=busy)
    t0 = time.perf_counter()
    for _ in range(4):
        np.copyto(dst, src)
    # Bytes read + written, like the GPU HBM figures.
    return {
        "matmul_flops": flops,
        "memcpy_bytes_per_s": 2 * 4 * src.nbytes / (time.perf_counter() - t0),
    }


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


def calibrate_cpu(reps: int = 25, repeats: int = 3, setup: Setup = DEFAULT):
    """Measure this machine (phases A and B of the module docstring) `repeats` times with the
    calibration engines of `setup`; returns (profile, raw): every field of the profile is its
    median over the repeats (each fitted from one whole measurement), raw holds each repeat's
    measurements and the setup.

    On a shared machine one calibration moves with the other tenants (a fitted latency moved
    0.01-0.97 between calibrations minutes apart; bench_estimator); the median of three is what the
    estimator uses."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    raws = [_calibrate_once(reps, setup) for _ in range(repeats)]
    return profile_from_raw(raws, setup), {"repeats": raws, "setup": asdict(setup)}


def _calibrate_once(reps: int, cal: Setup = DEFAULT) -> dict:
    """One calibration's raw measurements (the slowest rank's figure of each)."""
    cores = os.cpu_count() or 1
    n = min(max(2, cores // 2 * 2), 4)  # phase A ranks: pairs, one per core, at most 4
    res = spawn_ranks(_worker, 2 * n, n, reps, cal, timeout=600)
    # Slowest rank for times, slowest rank's rate for rates: what a synchronous runtime sees.
    raw = {
        k: (min if k.endswith("per_s") or k == "matmul_flops" else max)(r[k] for r in res if k in r)
        for k in res[0]
    }
    raw |= {"ranks": 2 * n, "cpus": cores, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        raw["mem_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        raw["mem_bytes"] = 8e9
    return raw


def calibrate_gpu(
    base: str = "h200", reps: int = 25, repeats: int = 3, device=None, setup: Setup = DEFAULT
):
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
            raise ValueError(
                f"calibrate_gpu times one rank; the initialized world has {dist.get_world_size()}"
            )
        raws = [_gpu_costs(0, 1, reps, device, setup) for _ in range(repeats)]
    else:
        backend = "gloo" if device is not None and torch.device(device).type == "cpu" else "nccl"
        raws = [
            spawn_ranks(_gpu_costs, 1, reps, device, setup, timeout=600, backend=backend)[0]
            for _ in range(repeats)
        ]
    prof = PROFILES[base]
    fits = [fit_single(raw, prof.flops, setup) for raw in raws]
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
    out = _single_rank_costs(
        cal, rank, ParallelGroups(Layout(ranks=(rank,))), None, reps, device=dev
    )
    return out | {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
