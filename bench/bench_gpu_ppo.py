"""One PPO iteration of a 1.1B-parameter actor and critic on one device: seconds and peak memory per call.

The real runtime (real_py.rlhf.runtime.Runtime) in a one-rank world (NCCL on CUDA, gloo on CPU),
every call on dp1tp1pp1 (one GPU: nothing to reallocate), bf16 parameters with fp32 master weights
and Adam states, random-init models (actor and reference: the TinyLlama-1.1B shape; critic and
reward model: the same shape with a value head). Runs --iters iterations and reports each one:
seconds per call (generate includes the old log-probs pass), peak GPU memory per call
(torch.cuda.max_memory_allocated, reset before each call), iteration seconds and the metrics.
The first iteration includes CUDA / cuBLAS warm-up; the last is the steady state.

Estimator check (issue 25, on one GPU): the last iteration's seconds per call against
real_py.search.estimate() for the same plan, models and workload, with the datasheet profile
(--profile, default h200) and with that profile calibrated on this GPU by calibrate_gpu twice:
<profile>_cal on the small calibration model (calibrate.DEFAULT), <profile>_caljob on this job's own
actor shape, dtype and pass sizes (Setup.for_job, as ReaL profiles the model it plans for). Skip
with --no-estimate.

    python bench/bench_gpu_ppo.py --device cuda
    python bench/bench_gpu_ppo.py --device cpu --small
Writes <out-dir>/gpu_ppo_<hw>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from bench_generate import BIG, SMALL, one_rank_world  # noqa: E402
from timing import hardware_tag, markdown_table, write_results  # noqa: E402

from real_py.device import resolve_device  # noqa: E402
from real_py.rlhf import config as CF  # noqa: E402
from real_py.rlhf.runtime import Runtime  # noqa: E402
from real_py.search import Workload, estimate  # noqa: E402
from real_py.search.calibrate import DEFAULT, Setup, calibrate_gpu  # noqa: E402
from real_py.search.hardware import PROFILES  # noqa: E402
from real_py.spec import model_spec  # noqa: E402


def train_config(device: str, small: bool, batch: int, prompt: int, new: int) -> CF.TrainConfig:
    model = SMALL if small else BIG
    d = {"actor": dict(model), "critic": dict(model), "precision": "bf16", "device": device,
         "data": {"batch_size": batch, "num_prompts": 4 * batch, "min_prompt_len": prompt // 2,
                  "max_prompt_len": prompt},
         "generation": {"max_new_tokens": new},
         "ppo": {"ppo_epochs": 1, "mini_batches": 2, "micro_batches": 2}, "save_every": 0}
    cfg = CF.from_dict(d)
    cfg.plan = CF.single_process_plan(cfg.graph())
    return cfg


def workload(cfg: CF.TrainConfig) -> Workload:
    """The estimator's Workload for the runtime's data: prompts padded to max_prompt_len, always
    max_new_tokens new tokens, each mini-batch cut into micro_batches micro-batches."""
    p, d = cfg.ppo, cfg.data
    rows = d.batch_size // p.mini_batches
    tokens = rows * (d.max_prompt_len + cfg.generation.max_new_tokens)
    return Workload(batch_size=d.batch_size, prompt_len=d.max_prompt_len, gen_len=cfg.generation.max_new_tokens,
                    ppo_epochs=p.ppo_epochs, ppo_minibatches=p.mini_batches, micro_batches=p.micro_batches,
                    micro_tokens=max(1, tokens // p.micro_batches))


def estimator_rows(cfg, plan, models, measured: dict, profiles: dict) -> list[dict]:
    """One row per call: measured seconds (last iteration) and each profile's estimate."""
    wl = workload(cfg)
    est = {name: estimate(plan, models["actor"], models["critic"], hardware=hw, workload=wl, dtype="bfloat16")
           for name, hw in profiles.items()}
    rows = []
    for call, m in measured.items():
        row = {"call": call, "measured s": m}
        for name, e in est.items():
            row[f"{name} est s"] = e["calls"][call]["seconds"]
            row[f"{name} rel err"] = (e["calls"][call]["seconds"] - m) / m
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny models and sizes (smoke run)")
    ap.add_argument("--batch", type=int, default=None, help="prompts per iteration (default 32; small 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (small 8)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (small 8)")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/results)")
    ap.add_argument("--profile", default="h200", choices=sorted(PROFILES), help="datasheet profile to check")
    ap.add_argument("--no-estimate", action="store_true", help="skip the estimator check")
    ap.add_argument("--cal-reps", type=int, default=10, help="timed runs per calibration function")
    args = ap.parse_args(argv)
    if args.iters < 1:
        ap.error(f"--iters {args.iters}: need at least 1")
    small = args.small
    cfg = train_config(args.device, small, args.batch or (4 if small else 32),
                       args.prompt_len or (8 if small else 128), args.new_tokens or (8 if small else 128))
    dev = resolve_device(args.device)
    rows, extra = [], {}
    with one_rank_world(dev):
        plan, graph, models = CF.validate(cfg, 1)
        t0 = time.perf_counter()
        rt = Runtime(cfg, plan, graph, models, timeout_s=600)
        extra["setup_seconds"] = time.perf_counter() - t0
        extra["params"] = {m: model_spec(c).numel for m, c in models.items()}
        for step in range(args.iters):
            t0 = time.perf_counter()
            out = rt.iteration(step)
            seconds = time.perf_counter() - t0
            for call, sec in out["calls"].items():
                rows.append({"iteration": step, "call": call, "seconds": sec,
                             "peak GiB": out["peak_mem_mib"].get(call, 0.0) / 1024})
            rows.append({"iteration": step, "call": "(iteration)", "seconds": seconds,
                         "peak GiB": max(out["peak_mem_mib"].values(), default=0.0) / 1024})
            extra[f"metrics_{step}"] = out["metrics"]
            last = out["calls"]
            print(f"iteration {step}: {seconds:.2f} s; calls "
                  + ", ".join(f"{k} {v:.2f}s" for k, v in out["calls"].items())
                  + "; peak MiB " + str({k: round(v) for k, v in out["peak_mem_mib"].items()}), flush=True)
        if not args.no_estimate:
            # In this one-rank world, after the job: the job's memory is still held, as in a
            # run that calibrates beside its models.
            profiles = {args.profile: PROFILES[args.profile]}
            wl = workload(cfg)
            setups = {"cal": DEFAULT,
                      "caljob": Setup.for_job(models["actor"], batch_rows=wl.batch_size,
                                              train_rows=wl.batch_size // wl.ppo_minibatches,
                                              seq=wl.prompt_len + wl.gen_len, prompt=wl.prompt_len)}
            for suffix, setup in setups.items():
                name, t0 = f"{args.profile}_{suffix}", time.perf_counter()
                try:
                    cal, raw = calibrate_gpu(args.profile, reps=args.cal_reps, repeats=3, device=dev, setup=setup)
                    profiles[name] = replace(cal, name=name)
                    extra[f"calibration_raw_{suffix}"] = raw
                except Exception as e:  # noqa: BLE001 - the other profiles still run; the error is recorded
                    extra[f"calibration_error_{suffix}"] = f"{type(e).__name__}: {e}"
                    print(f"calibration {name} failed:", extra[f"calibration_error_{suffix}"], flush=True)
                extra[f"calibration_seconds_{suffix}"] = time.perf_counter() - t0
            extra["profiles"] = {k: asdict(v) for k, v in profiles.items()}
            est_rows = estimator_rows(cfg, plan, models, last, profiles)
            extra["estimator"] = est_rows
            for r in est_rows:
                print("estimate", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    extra["config"] = CF.to_dict(cfg)
    notes_est = ""
    if "estimator" in extra:
        errs = {name: statistics.median(abs(r[f"{name} rel err"]) for r in extra["estimator"])
                for name in extra["profiles"]}
        extra["median_call_abs_rel_err"] = errs
        notes_est = ("\n\nEstimator, last iteration (measured s / estimated s per profile; rel err = (est - meas) / meas):\n\n"
                     + markdown_table(extra["estimator"], list(extra["estimator"][0]))
                     + "\n\nmedian |rel err| per call: " + ", ".join(f"{k} {v:.3f}" for k, v in errs.items())
                     + f". {args.profile}_cal / {args.profile}_caljob: the {args.profile} datasheet profile with "
                       "per-layer / per-pass seconds calibrated on this device with the small calibration model / "
                       "with this job's actor shape, dtype and pass sizes ("
                     + "; ".join(f"{k}: {extra[f'calibration_seconds_{k}']:.0f} s"
                                 + (f", FAILED: {extra[f'calibration_error_{k}']}" if f"calibration_error_{k}" in extra else "")
                                 for k in ("cal", "caljob")) + ").")
    paths = write_results("gpu_ppo", hardware_tag(args.device) + ("_small" if small else ""), rows,
                          columns=["iteration", "call", "seconds", "peak GiB"],
                          title=f"one PPO iteration, {'tiny' if small else '1.1B'} bf16 actor + critic, "
                                f"one {args.device} device",
                          notes="seconds: wall time of each call (generate includes the old log-probs "
                                "pass); peak GiB: torch.cuda.max_memory_allocated during the call "
                                "(0 on CPU). Iteration 0 includes warm-up." + notes_est,
                          extra=extra, out_dir=args.out_dir)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
