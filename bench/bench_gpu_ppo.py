"""One PPO iteration of a 1.1B-parameter actor and critic on one device: seconds and peak memory
per call.

The real runtime (real_py.rlhf.runtime.Runtime) in a one-rank world (NCCL on CUDA, gloo on CPU),
every call on dp1tp1pp1 (one GPU: nothing to reallocate), bf16 parameters with fp32 master weights
and Adam states, random-init models (actor and reference: the TinyLlama-1.1B shape; critic and
reward model: the same shape with a value head). Runs --iters iterations and reports each one:
seconds per call (generate includes the old log-probs pass), peak GPU memory per call
(torch.cuda.max_memory_allocated, reset before each call), iteration seconds and the metrics.
The first iteration includes CUDA / cuBLAS warm-up and the decode step's compilation; the last is
the steady state. Against an earlier report of the same hardware and sizes (the
newest earlier bench/results/ppo_<hw>_<date>.json) the last iteration's seconds and peak memory
per call are compared (speed-up = earlier seconds / these seconds; the train-step goal is >= 1.5x
for actor_train and critic_train of the 1.1B iteration). Sizes: 32 prompts of 128 tokens, 128 new
tokens (--small: 4, 8, 8).

Estimator check (on one GPU): the last iteration's seconds per call against
real_py.search.estimate() for the same plan, models and workload, with the datasheet profile
(this GPU's own, h100 / h200 / a100, else h200) and with that profile calibrated on this GPU by
calibrate_gpu twice: <profile>_cal on the small calibration model (calibrate.DEFAULT),
<profile>_caljob on this job's own actor shape, dtype and pass sizes (Setup.for_job, as ReaL
profiles the model it plans for).

    python bench/bench_gpu_ppo.py --device cuda
    python bench/bench_gpu_ppo.py --device cpu --small
    python bench/bench_gpu_ppo.py --rescore bench/results/ppo_h200_<date>.json   # no device
Writes <out-dir>/ppo_<hw>_<date>.{json,md}; --rescore <out-dir>/ppo_rescore_<hw>_<date>.{json,md}.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from bench_generate import BIG, SMALL, one_rank_world
from timing import bench_parser, hardware_tag, markdown_table, write_results

from real_py.calibrate import DEFAULT, Setup, calibrate_gpu
from real_py.device import resolve_device
from real_py.rlhf import config as CF
from real_py.rlhf.runtime import Runtime
from real_py.search import Workload, estimate
from real_py.search.hardware import PROFILES, HardwareProfile
from real_py.spec import model_spec


def train_config(device: str, small: bool) -> CF.TrainConfig:
    model = SMALL if small else BIG
    batch, prompt, new = (4, 8, 8) if small else (32, 128, 128)
    d = {
        "actor": dict(model),
        "critic": dict(model),
        "precision": "bf16",
        "device": device,
        "data": {
            "batch_size": batch,
            "num_prompts": 4 * batch,
            "min_prompt_len": prompt // 2,
            "max_prompt_len": prompt,
        },
        "generation": {"max_new_tokens": new},
        "ppo": {"ppo_epochs": 1, "mini_batches": 2, "micro_batches": 2},
        "save_every": 0,
    }
    cfg = CF.from_dict(d)
    cfg.plan = CF.single_process_plan(cfg.graph())
    return cfg


def datasheet_profile(device: str) -> str:
    """The PROFILES entry of this device's GPU (hardware_tag: "h100", "h200", ...); h200 where
    there is none (a CPU dry run, another GPU)."""
    tag = hardware_tag(device)
    return tag if tag in PROFILES else "h200"


def workload(cfg: CF.TrainConfig) -> Workload:
    """The estimator's Workload for the runtime's data: prompts padded to max_prompt_len, always
    max_new_tokens new tokens, and the runtime's micro-batch counts (runtime_micro_batches):
    micro_batches per train mini-batch, forward-only passes whole (counts that followed
    micro_tokens, a mini-batch's tokens / micro_batches, charged the forward-only passes 2-4
    passes' fixed costs for the runtime's one: bench/results/gpu_check_h200_20261204.md)."""
    p, d = cfg.ppo, cfg.data
    return Workload(
        batch_size=d.batch_size,
        prompt_len=d.max_prompt_len,
        gen_len=cfg.generation.max_new_tokens,
        ppo_epochs=p.ppo_epochs,
        ppo_minibatches=p.mini_batches,
        micro_batches=p.micro_batches,
        runtime_micro_batches=True,
    )


def estimator_rows(cfg, plan, models, measured: dict, profiles: dict, iteration: float) -> list:
    """One row per call: measured seconds (last iteration) and each profile's estimate, and a
    last row "(iteration)": the measured `iteration` seconds against the estimated iter_time."""
    wl = workload(cfg)
    est = {
        name: estimate(
            plan, models["actor"], models["critic"], hardware=hw, workload=wl, dtype="bfloat16"
        )
        for name, hw in profiles.items()
    }
    items = [
        (call, m, {n: e["calls"][call]["seconds"] for n, e in est.items()})
        for call, m in measured.items()
    ]
    items.append(("(iteration)", iteration, {n: e["iter_time"] for n, e in est.items()}))
    rows = []
    for call, m, e in items:
        row = {"call": call, "measured s": m}
        for name, sec in e.items():
            row[f"{name} est s"] = sec
            row[f"{name} rel err"] = (sec - m) / m
        rows.append(row)
    return rows


def estimator_notes(extra: dict, profile: str, table: bool = True) -> str:
    """The estimator table (unless `table` is False) and its median |rel err| per profile (also
    stored in extra)."""
    calls = [r for r in extra["estimator"] if r["call"] != "(iteration)"]
    errs = {n: statistics.median(abs(r[f"{n} rel err"]) for r in calls) for n in extra["profiles"]}
    extra["median_call_abs_rel_err"] = errs
    cal = [
        f"{k}: {extra[f'calibration_seconds_{k}']:.0f} s"
        + (
            f", FAILED: {extra[f'calibration_error_{k}']}"
            if f"calibration_error_{k}" in extra
            else ""
        )
        for k in ("cal", "caljob")
        if f"calibration_seconds_{k}" in extra
    ]
    head = (
        "\n\nEstimator, last iteration (measured s / estimated s per profile; "
        "rel err = (est - meas) / meas):\n\n"
        + markdown_table(extra["estimator"], list(extra["estimator"][0]))
    )
    return (
        (head if table else "")
        + "\n\nmedian |rel err| per call (the iteration row aside): "
        + ", ".join(f"{k} {v:.3f}" for k, v in errs.items())
        + f". {profile}_cal / {profile}_caljob: the {profile} datasheet profile with "
        "per-layer / per-pass seconds calibrated on this device with the small calibration model / "
        f"with this job's actor shape, dtype and pass sizes ({'; '.join(cal) or 'not recorded'})."
    )


def compile_states(rt) -> dict:
    """Per model: the train step's compiled layers (backend, ran, failure) and each decode
    state's (backend, compiled run, failed backend, captured spans)."""
    out = {}
    for m, e in rt.models.engines.items():
        if e is None:
            continue
        t = e._trainer
        out[m] = {
            "train": None
            if t is None or t.calls is None
            else [t.calls.backend, t.calls.ok, t.calls.failed],
            "decode": [
                [s.backend, s.compiled_ok, s.backend_failed, sorted(s.graphs)]
                for s in getattr(e, "_decode_states", {}).values()
            ],
        }
    return out


def find_baseline(hw: str, out_dir: str | None) -> Path | None:
    """The newest ppo_<hw>_<yyyymmdd>.json in the results folder from before today."""
    folder = Path(out_dir) if out_dir else Path(__file__).resolve().parent / "results"
    today = time.strftime("%Y%m%d", time.gmtime())
    found = sorted(
        p
        for p in folder.glob(f"ppo_{hw}_*.json")
        if p.stem.rsplit("_", 1)[-1].isdigit() and p.stem.rsplit("_", 1)[-1] < today
    )
    if not found and out_dir:  # gpu_check writes elsewhere: the committed reports
        return find_baseline(hw, None)
    return found[-1] if found else None


def _common(old, now) -> bool:
    """Equal on the keys both sides have (dicts), else equal."""
    if isinstance(old, dict) and isinstance(now, dict):
        return all(old[k] == now[k] for k in old.keys() & now.keys())
    return old == now


def baseline_rows(path: Path, cfg, rows: list[dict]) -> tuple[list[dict], str]:
    """Per call of the last iteration: earlier / now seconds and peak GiB, and the speed-up."""
    rec = json.loads(Path(path).read_text())
    old_cfg = rec.get("extra", {}).get("config", {})
    now_cfg = CF.to_dict(cfg)
    # the keys both configs have (a field added since leaves the earlier run comparable)
    same = all(
        _common(old_cfg.get(k), now_cfg.get(k))
        for k in ("actor", "critic", "data", "generation", "ppo", "precision")
    )
    last_old = max(r["iteration"] for r in rec["rows"])
    last_new = max(r["iteration"] for r in rows)
    old = {r["call"]: r for r in rec["rows"] if r["iteration"] == last_old}
    out = []
    for r in (r for r in rows if r["iteration"] == last_new):
        o = old.get(r["call"])
        if o is None:
            continue
        out.append(
            {
                "call": r["call"],
                "earlier s": o["seconds"],
                "now s": r["seconds"],
                "speed-up": o["seconds"] / r["seconds"] if r["seconds"] else float("nan"),
                "earlier peak GiB": o.get("peak GiB", 0.0),
                "now peak GiB": r.get("peak GiB", 0.0),
            }
        )
    note = (
        f"\n\nAgainst {Path(path).name} (git {rec.get('environment', {}).get('git_commit')}, "
        f"{'same' if same else 'DIFFERENT'} models and sizes), last iteration of each:\n\n"
        + markdown_table(
            out, ["call", "earlier s", "now s", "speed-up", "earlier peak GiB", "now peak GiB"]
        )
    )
    return out, note


def rescore(path: str, out_dir: str | None) -> None:
    """Re-estimate a recorded run (its measurements, config and calibrated profiles) with this
    tree's estimator and workload(); no device needed. Writes ppo_rescore_<hw>_<date>."""
    rec = json.loads(Path(path).read_text())
    extra = {
        k: v
        for k, v in rec["extra"].items()
        if k.startswith("calibration_seconds") or k == "profiles"
    }
    conf = dict(rec["extra"]["config"], device="cpu")  # estimates do not depend on the device
    cfg = CF.from_dict(conf)
    plan, _, models = CF.validate(cfg, 1)
    last = max(r["iteration"] for r in rec["rows"])
    measured = {r["call"]: r["seconds"] for r in rec["rows"] if r["iteration"] == last}
    iteration = measured.pop("(iteration)")
    # fields of replaced models dropped
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    profiles = {
        k: HardwareProfile(**{f: x for f, x in v.items() if f in known})
        for k, v in extra["profiles"].items()
    }
    extra["estimator"] = estimator_rows(cfg, plan, models, measured, profiles, iteration)
    extra["rescored"] = {
        "file": Path(path).name,
        "recorded_git_commit": rec["environment"].get("git_commit"),
    }
    base = next(k for k in profiles if "_" not in k)
    hw = Path(path).stem.rsplit("_", 1)[0].split("ppo_", 1)[-1]  # [gpu_]ppo_<hw>_<yyyymmdd>
    paths = write_results(
        "ppo_rescore",
        hw,
        extra["estimator"],
        columns=list(extra["estimator"][0]),
        title=f"estimator re-scored on the recorded run {Path(path).name}",
        notes=f"Measured seconds, config and calibrated profiles from {path} (recorded at "
        f"{rec['environment'].get('date_utc')}); estimates from this tree."
        + estimator_notes(extra, base, table=False),
        extra=extra,
        out_dir=out_dir,
    )
    print("wrote", *paths)


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument(
        "--rescore", metavar="JSON", help="re-estimate a recorded ppo_*.json (no device; no run)"
    )
    args = ap.parse_args(argv)
    if args.rescore:
        return rescore(args.rescore, args.out_dir)
    if args.iters < 1:
        ap.error(f"--iters {args.iters}: need at least 1")
    small = args.small
    cfg = train_config(args.device, small)
    dev = resolve_device(args.device)
    profile = datasheet_profile(args.device)
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
            peak = out["peak_mem_mib"]
            peak_all = {**peak, "(iteration)": max(peak.values(), default=0.0)}
            for call, sec in {**out["calls"], "(iteration)": seconds}.items():
                gib = peak_all.get(call, 0.0) / 1024
                rows.append({"iteration": step, "call": call, "seconds": sec, "peak GiB": gib})
            extra[f"metrics_{step}"] = out["metrics"]
            last = out["calls"]
            print(
                f"iteration {step}: {seconds:.2f} s; calls "
                + ", ".join(f"{k} {v:.2f}s" for k, v in out["calls"].items())
                + "; peak MiB "
                + str({k: round(v) for k, v in out["peak_mem_mib"].items()}),
                flush=True,
            )
        extra["compiled"] = compile_states(rt)
        print("compiled:", extra["compiled"], flush=True)
        report(args, cfg, rows, extra, profile)
        # In this one-rank world, after the job: the job's memory is still held, as in a run
        # that calibrates beside its models. caljob trains one runtime micro-batch (8 rows).
        profiles = {profile: PROFILES[profile]}
        setups = {"cal": DEFAULT, "caljob": Setup.for_workload(models["actor"], workload(cfg))}
        for suffix, setup in setups.items():
            name, t0 = f"{profile}_{suffix}", time.perf_counter()
            reps, repeats = (2, 1) if small else (10, 3)
            try:
                cal, raw = calibrate_gpu(
                    profile, reps=reps, repeats=repeats, device=dev, setup=setup
                )
                profiles[name] = replace(cal, name=name)
                extra[f"calibration_raw_{suffix}"] = raw
            except Exception as e:
                extra[f"calibration_error_{suffix}"] = f"{type(e).__name__}: {e}"
                print(
                    f"calibration {name} failed:", extra[f"calibration_error_{suffix}"], flush=True
                )
            extra[f"calibration_seconds_{suffix}"] = time.perf_counter() - t0
        extra["profiles"] = {k: asdict(v) for k, v in profiles.items()}
        extra["estimator"] = estimator_rows(cfg, plan, models, last, profiles, seconds)
        for r in extra["estimator"]:
            est = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
            print("estimate", est, flush=True)
    extra["complete"] = True
    report(args, cfg, rows, extra, profile)


def report(args, cfg, rows: list[dict], extra: dict, profile: str) -> None:
    """Write the report: once after the iterations (so a step cut during the calibrations still
    leaves the per-call figures) and again with the estimator."""
    extra["config"] = CF.to_dict(cfg)
    notes_est = estimator_notes(extra, profile) if "estimator" in extra else ""
    small = args.small
    hw = hardware_tag(args.device, small)
    base = find_baseline(hw, args.out_dir)
    if base is not None:
        try:
            extra["baseline"], note = baseline_rows(base, cfg, rows)
            extra["baseline_file"] = base.name
            notes_est = note + notes_est
            if extra.get("complete"):
                print(note, flush=True)
        except (KeyError, ValueError, TypeError) as e:
            print(f"baseline {base}: not comparable ({type(e).__name__}: {e})", flush=True)
    if not extra.get("complete"):
        notes_est += (
            "\n\nPARTIAL: written after the iterations; the estimator check had not run yet."
        )
    paths = write_results(
        "ppo",
        hw,
        rows,
        columns=["iteration", "call", "seconds", "peak GiB"],
        title=f"one PPO iteration, {'tiny' if small else '1.1B'} bf16 actor + critic, "
        f"one {args.device} device",
        notes="seconds: wall time of each call (generate includes the old log-probs "
        "pass); peak GiB: torch.cuda.max_memory_allocated during the call "
        "(0 on CPU). Iteration 0 includes warm-up and compilation (decode step and "
        "train layers, torch.compile on CUDA)." + notes_est,
        extra=extra,
        out_dir=args.out_dir,
    )
    if extra.get("complete"):
        print("wrote", *paths)


if __name__ == "__main__":
    main()
