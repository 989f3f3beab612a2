"""Runtime estimator vs the PPO runtime: measured and estimated seconds per iteration, per plan.

    python bench/bench_estimator.py [--steps 10] [--warmup 2] [--rounds 3] [--search-budget 10]
    python bench/bench_estimator.py --rescore bench/results/estimator_<...>.json [--refit]
    python bench/bench_estimator.py --pool <run>.json [<run>.json ...]   # runs pooled as measured

Per round: calibrates the `cpu` hardware profile (refresh=True, the small calibration model), then
for six execution plans of the default PPO job (tiny random-init models, 4 gloo ranks, batch 8,
prompts padded to 8 tokens, 12 new tokens, 2 PPO epochs x 2 mini-batches) runs `python -m real_py
train` (median over the steps after the warm-up) and asks `estimate()` for the same plan, models
and workload. One plan is the one `plan_search(..., hardware=<that profile>, num_gpus=4)` finds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import yaml  # noqa: E402
from timing import hardware_tag, write_results  # noqa: E402

from real_py.calibrate import DEFAULT, cpu_profile, profile_from_raw  # noqa: E402
from real_py.calibrate import profiles as profiles_module  # noqa: E402
from real_py.dataflow.execplan import ExecutionPlan  # noqa: E402
from real_py.rlhf import config as CF  # noqa: E402
from real_py.search import Workload, estimate, plan_search  # noqa: E402
from real_py.search.costmodel import HOST_BOUND  # noqa: E402
from real_py.search.hardware import HardwareProfile  # noqa: E402

CALLS = ("actor_gen", "ref_inf", "rew_inf", "critic_inf", "actor_train", "critic_train")
PROFILE_KEYS = (
    "intra_lat lat_contention coll_lat_growth p2p_lat_ratio layer_lat head_lat value_head_lat "
    "value_train_lat decode_layer_lat decode_lat train_layer_lat train_lat tp_head_lat "
    "tp_train_lat tp_decode_lat realloc_lat pipe_wait_lat"
).split()


def _all(dp: int, tp: int, pp: int) -> dict:
    """Every call on ranks 0-3 with one layout."""
    return {
        "world_size": 4,
        "calls": {n: {"ranks": [0, 1, 2, 3], "dp": dp, "tp": tp, "pp": pp} for n in CALLS},
    }


PLANS = {
    "default": CF.DEFAULT_PLAN,
    "all dp1tp2pp2": _all(1, 2, 2),
    "all dp2tp2pp1": _all(2, 2, 1),
    "all dp2tp1pp2": _all(2, 1, 2),
    "all dp4tp1pp1": _all(4, 1, 1),
}


def run_train(plan: dict | None, steps: int, tmp: str, name: str) -> list[dict]:
    """`python -m real_py train` on the default config with `plan`; the per-step records of its
    metrics.jsonl."""
    cfg = os.path.join(tmp, f"{name}.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump(
            {"steps": steps, "save_every": 0, "allow_idle_ranks": True}
            | ({"plan": plan} if plan else {}),
            f,
        )
    out = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "real_py", "train", "--config", cfg, "--out-dir", out]
    subprocess.run(cmd + ["--no-progress"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def job():
    """The default train config's models and the estimator's Workload for the same data."""
    cfg = CF.from_dict({})
    models = cfg.model_configs()
    p = cfg.ppo
    # The runtime pads prompts to max_prompt_len and always generates max_new_tokens (no eos);
    # one train call is ppo_epochs x mini_batches optimizer steps of ppo.micro_batches micro-batches
    # each, a forward-only pass is whole: the runtime's counts (runtime_micro_batches), so
    # the estimator never pipelines a pass over more micro-batches than the runtime runs.
    wl = Workload(
        batch_size=cfg.data.batch_size,
        prompt_len=cfg.data.max_prompt_len,
        gen_len=cfg.generation.max_new_tokens,
        ppo_epochs=p.ppo_epochs,
        ppo_minibatches=p.mini_batches,
        micro_batches=p.micro_batches,
        runtime_micro_batches=True,
    )
    return cfg, models["actor"], models["critic"], wl


RAW: dict[int, dict[str, list]] = {}
"""round -> calibration setup -> calibrate_cpu's raw repeats of that round (recorded in the
JSON)."""


def measure_round(rnd: int, args, tmp: str) -> tuple[list[dict], object, float]:
    """Calibrate, search, then measure and estimate every plan; one row per plan."""
    cfg, actor, critic, wl = job()
    dtype = actor.dtype
    hw = cpu_profile(refresh=True, setup=DEFAULT)
    with open(profiles_module._cache_path()) as f:  # the raw measurements, for --rescore --refit
        RAW[rnd] = {"default": json.load(f)["measured"]["repeats"]}
    found = plan_search(
        actor,
        critic,
        num_gpus=4,
        hardware=hw,
        workload=wl,
        dtype=dtype,
        time_budget=args.search_budget,
        seed=0,
    )
    plans = dict(PLANS, searched=found.plan.to_json())
    rows, med = [], (lambda xs: statistics.median(xs) if xs else 0.0)
    for i, (name, plan) in enumerate(plans.items()):
        CF.validate(CF.from_dict({"plan": plan, "allow_idle_ranks": True}), 4)
        recs = run_train(plan, args.steps, tmp, f"r{rnd}p{i}")[args.warmup :]
        est = estimate(
            ExecutionPlan.from_json(plan), actor, critic, hardware=hw, workload=wl, dtype=dtype
        )
        meas = med([r["seconds"] for r in recs])
        row = {
            "round": rnd,
            "plan": name,
            "measured s": meas,
            "estimated s": est["iter_time"],
            "rel err": (est["iter_time"] - meas) / meas,
        }
        row["calls meas s"] = {c: med([r["calls"][c] for r in recs]) for c in CALLS}
        for c, m in row["calls meas s"].items():
            row[f"{c} meas/est s"] = f"{m:.4f}/{est['calls'][c]['seconds']:.4f}"
        for m in ("actor", "critic"):
            row[f"realloc {m} meas s"] = med([r["realloc_seconds"].get(m, 0.0) for r in recs])
        row["realloc est s"] = sum(est["realloc_seconds"].values())
        row["call meas/est pairs"] = [
            [m, e] for _, m, e in _call_pairs(row, row["calls meas s"], est)
        ]
        call_errs = [e for _, e in _call_errors(row, row["calls meas s"], est)]
        row["call rel errs"] = [round(x, 3) for x in call_errs]
        row["median call |rel err|"] = med([abs(x) for x in call_errs])
        # Which estimate terms carry the plan: processor work (FLOPs, memory reads, optimizer,
        # per-layer and per-pass overheads) vs waiting on messages (tp/dp/pp), over all calls.
        comp = sum(
            v for c in CALLS for k, v in est["calls"][c]["breakdown"].items() if k in HOST_BOUND
        )
        every = sum(est["calls"][c]["alone"] for c in CALLS)
        row["est host s"], row["est comm s"] = comp, every - comp
        row["layouts"] = "; ".join(f"{c}={est['calls'][c]['layout']}" for c in CALLS)
        row["plan_json"] = plan
        row["breakdown"] = {
            c: {k: round(v, 6) for k, v in est["calls"][c]["breakdown"].items()} for c in CALLS
        }
        rows.append(row)
        print(
            f"round {rnd} {name}: measured {meas:.3f} s, estimated {est['iter_time']:.3f} s",
            flush=True,
        )
    return rows, hw, found.iter_time


def _call_pairs(row: dict, meas: dict, est: dict) -> list[tuple[str, float, float]]:
    """(call, measured s, estimated s) of a row's calls, plus the reallocation of a plan that
    moves weights (one more "call")."""
    out = [(c, m, est["calls"][c]["seconds"]) for c, m in meas.items()]
    meas_re = row["realloc actor meas s"] + row["realloc critic meas s"]
    if meas_re > 0:
        out.append(("realloc", meas_re, sum(est["realloc_seconds"].values())))
    return out


def _call_errors(row: dict, meas: dict, est: dict) -> list[tuple[str, float]]:
    """(call, relative error) of `est` against a row's measured calls `meas` (_call_pairs)."""
    return [(c, (e - m) / m) for c, m, e in _call_pairs(row, meas, est)]


SHORT_S = 0.005
"""Calls measured shorter than this (1-5 ms: inference on a few rows, reallocations) are where a
rank's wait for a core on the shared VM is a large part of the call (see docs/known_gaps.md)."""


def size_split(pairs: list[tuple[float, float]]) -> str:
    """Supplementary to the per-call median (the goal): of (measured, estimated) seconds, the
    misestimated share of the measured time (sum |est - meas| / sum meas) and the median relative
    error of calls at least and under SHORT_S long."""
    med = lambda xs: f"{statistics.median(xs):.3f} ({len(xs)} calls)" if xs else "-"
    rel = [(m, abs(e - m) / m) for m, e in pairs]
    return (
        "time-weighted |rel err| "
        f"{sum(abs(e - m) for m, e in pairs) / sum(m for m, _ in pairs):.3f}; median |rel err| of "
        f"calls >= {SHORT_S * 1e3:g} ms {med([r for m, r in rel if m >= SHORT_S])}, of shorter "
        f"ones {med([r for m, r in rel if m < SHORT_S])}"
    )


def rescore(path: str, refit: bool = False) -> None:
    """Re-estimate a recorded run's plans with this code's cost model and the run's own
    calibrated profiles (refit: fitted anew by this code from the run's raw calibrations,
    calibrate.profile_from_raw): a cost-model change scored on the same measurements. Prints the
    medians and each (plan, call)'s errors by round (call ITERATION: the whole iteration)."""
    with open(path) as f:
        data = json.load(f)
    _, actor, critic, wl = job()
    known = {f.name for f in fields(HardwareProfile)}  # fields of a replaced cost model dropped
    profiles = {
        int(k): HardwareProfile(**{f: x for f, x in v.items() if f in known})
        for k, v in data["extra"]["profiles"].items()
    }
    if refit:
        raws = data["extra"]["calibration_raw"]
        profiles = {int(r): profile_from_raw(v["default"], DEFAULT) for r, v in raws.items()}
    it_errs, call_errs, per, pairs = [], [], {}, []
    for r in data["rows"]:
        plan, hw = ExecutionPlan.from_json(r["plan_json"]), profiles[r["round"]]
        est = estimate(plan, actor, critic, hardware=hw, workload=wl, dtype=actor.dtype)
        it_errs.append(abs(est["iter_time"] - r["measured s"]) / r["measured s"])
        per.setdefault((r["plan"], "ITERATION"), []).append(
            (est["iter_time"] - r["measured s"]) / r["measured s"]
        )
        for c, m, e in _call_pairs(r, r["calls meas s"], est):
            call_errs.append(abs(e - m) / m)
            per.setdefault((r["plan"], c), []).append((e - m) / m)
            pairs.append((m, e))
    print(
        f"{path} (measured at {data['environment'].get('git_commit')}), re-estimated with this "
        f"code: median |rel err| per iteration {statistics.median(it_errs):.3f} over "
        f"{len(it_errs)} rows, per call {statistics.median(call_errs):.3f} over {len(call_errs)} "
        f"calls and reallocations; {size_split(pairs)}"
    )
    for (plan, c), errs in sorted(per.items()):
        print(f"  {plan:14s} {c:13s} " + " ".join(f"{x:+.2f}" for x in errs))


def pool(paths: list[str]) -> None:
    """Recorded runs of one cost model pooled as measured (no re-estimate): each run's and the
    pooled median |rel err| per iteration and per call (the rows' own errors, as each run's notes
    give them), then the median signed error of each (plan, call) over every round of every run,
    what is left systematic, largest under-estimates first."""
    it_all, call_all, per = [], [], {}
    print(
        "| run | commit | iterations | median iteration abs rel err | calls | "
        "median call abs rel err |"
    )
    print("|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        missing = {
            k
            for r in data["rows"]
            for k in ("rel err", "calls meas s", "call rel errs")
            if k not in r
        }
        if missing:
            raise SystemExit(
                f"--pool {path}: its rows lack {sorted(missing)} (older bench_estimator runs do "
                "not record them; --rescore re-estimates those)"
            )
        its, calls = [abs(r["rel err"]) for r in data["rows"]], []
        for r in data["rows"]:
            # _call_pairs' order; realloc only if measured
            names = list(r["calls meas s"]) + ["realloc"]
            for c, x in zip(names, r["call rel errs"]):
                calls.append(abs(x))
                per.setdefault((r["plan"], c), []).append(x)
        it_all += its
        call_all += calls
        print(
            f"| {os.path.basename(path)} | {data['environment'].get('git_commit')} | {len(its)} | "
            f"{statistics.median(its):.3f} | {len(calls)} | {statistics.median(calls):.3f} |"
        )
    print(
        f"| pooled | | {len(it_all)} | {statistics.median(it_all):.3f} | {len(call_all)} | "
        f"{statistics.median(call_all):.3f} |"
    )
    print(
        "\n| plan | call | n | median signed rel err (estimated - measured) / measured |\n"
        "|---|---|---|---|"
    )
    for (plan, c), errs in sorted(per.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"| {plan} | {c} | {len(errs)} | {statistics.median(errs):+.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--search-budget", type=float, default=10.0)
    ap.add_argument(
        "--rescore",
        metavar="JSON",
        help="re-estimate a recorded estimator_*.json with this "
        "code's cost model and the run's profiles (no measurement)",
    )
    ap.add_argument(
        "--refit",
        action="store_true",
        help="with --rescore: fit the profiles anew with this code "
        "from the file's raw calibrations",
    )
    ap.add_argument(
        "--pool",
        nargs="+",
        metavar="JSON",
        help="pool recorded estimator_*.json runs as measured "
        "(no re-estimate): per-run and pooled medians, each (plan, call)'s median signed error",
    )
    args = ap.parse_args()
    if args.pool:
        return pool(args.pool)
    if args.rescore:
        return rescore(args.rescore, args.refit)
    rows, profiles, med = [], [], statistics.median
    _, actor, _, wl = job()
    saved = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(1, args.rounds + 1):
            r, hw, found = measure_round(rnd, args, tmp)
            rows += r
            saved[rnd] = asdict(hw)
            profiles.append(
                f"round {rnd}: "
                + ", ".join(f"{k}={getattr(hw, k):.3g}" for k in PROFILE_KEYS)
                + f"; searched plan estimated {found:.4f} s"
            )
    per_round = {
        rnd: med([abs(r["rel err"]) for r in rows if r["round"] == rnd])
        for rnd in range(1, args.rounds + 1)
    }
    errs = [abs(r["rel err"]) for r in rows]
    call_errs = [abs(x) for r in rows for x in r["call rel errs"]]
    split = size_split([tuple(p) for r in rows for p in r["call meas/est pairs"]])
    in_json_only = "breakdown|layouts|call rel errs|plan_json|calls meas s|call meas/est pairs"
    cols = [c for c in rows[0] if c not in in_json_only.split("|")]
    write_results(
        "estimator",
        hardware_tag("cpu"),
        rows,
        columns=cols + ["layouts"],
        title="Runtime estimator vs PPO runtime, 4 gloo ranks (cpu2)",
        notes=f"Measured: median over steps {args.warmup + 1}..{args.steps} of `python -m real_py "
        "train` (default config with each plan; a call's seconds run from its last rank's start "
        "to its last rank's end; a dp-only rollout call's, whose ranks never wait for each other, "
        "are its longest rank's own run). Estimated: `estimate()` with the `cpu` profile "
        "calibrated at the start of the same round (real_py/calibrate/measure.py) and Workload "
        f"{wl}. Median |rel err| over all {len(rows)} rows (iterations) {med(errs):.3f} (target <= "
        f"0.10); median |rel err| per call over all {len(call_errs)} calls and reallocations "
        f"{med(call_errs):.3f} (target <= 0.15); supplementary: {split}; iteration error per round "
        + ", ".join(f"{k}: {v:.2f}" for k, v in per_round.items())
        + f"; max {max(errs):.2f}. Searched plan: plan_search time_budget {args.search_budget} "
        f"s on the round's profile. Profiles: " + " | ".join(profiles) + ". Per-call estimate "
        "breakdowns are in the JSON.",
        extra={
            "profiles": saved,
            "calibrate_on": "default",
            "calibration_raw": RAW,
            "setup": asdict(DEFAULT),
        },
    )


if __name__ == "__main__":
    main()
