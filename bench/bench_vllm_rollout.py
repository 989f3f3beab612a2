"""The runtime generating with vLLM against the built-in engine, on the copy task (CPU, 4 gloo
ranks).

    .venv-vllm/bin/python bench/bench_vllm_rollout.py [--seeds 1 2 3] [--steps 60]

Runs `python -m real_py train --config configs/copy_task/{grpo,ppo}_vllm.yaml` with
generation.engine = builtin and vllm (the same actor, prompts, reward and plan; only the engine
of actor_gen differs), for each seed, plus one vLLM run per algorithm with truncated importance
sampling (ppo.tis_cap=2). Writes bench/results/vllm_learning_cpu2_<date>.{json,md,png}: per run
the mean reward of the first 5 and last 10 steps, the median seconds per step and the mean
rollout log-prob gap (vLLM's log-prob of each sampled token against the trainer's recompute);
per (algo, engine) the mean and spread over seeds; the curves (mean over seeds) as a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from timing import RESULTS, environment, hardware_tag, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST, LAST = 5, 10


def run(
    algo: str, engine: str, seed: int, steps: int, tmp: str, extra: list[str]
) -> tuple[list[dict], float]:
    out = os.path.join(tmp, f"{algo}_{engine}_{seed}_{len(extra)}")
    cmd = [
        sys.executable,
        "-m",
        "real_py",
        "train",
        "--config",
        os.path.join("configs", "copy_task", f"{algo}_vllm.yaml"),
        "--out-dir",
        out,
        "--no-progress",
        f"generation.engine={engine}",
        f"seed={seed}",
        f"steps={steps}",
        *extra,
    ]
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    rows, curves, t_all = [], {}, time.time()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [
            (a, e, s, []) for a in ("grpo", "ppo") for s in args.seeds for e in ("builtin", "vllm")
        ]
        jobs += [(a, "vllm", args.seeds[0], ["ppo.tis_cap=2.0"]) for a in ("grpo", "ppo")]
        for algo, engine, seed, extra in jobs:
            recs, wall = run(algo, engine, seed, args.steps, tmp, extra)
            r = [x["metrics"]["reward"] for x in recs]
            gap = [x["metrics"].get("rollout_logp_diff") for x in recs]
            variant = engine + (" +tis_cap 2" if extra else "")
            curves.setdefault(f"{algo} {variant}", []).append(r)
            rows.append(
                {
                    "algo": algo,
                    "engine": variant,
                    "seed": seed,
                    "steps": len(r),
                    f"reward 1-{FIRST}": statistics.fmean(r[:FIRST]),
                    f"reward last {LAST}": statistics.fmean(r[-LAST:]),
                    "s/step": statistics.median(x["seconds"] for x in recs),
                    "run_s": wall,
                    "rollout_logp_diff": statistics.fmean(g for g in gap if g is not None)
                    if gap[0] is not None
                    else "-",
                    "rollout_kl": statistics.fmean(x["metrics"]["rollout_kl"] for x in recs)
                    if "rollout_kl" in recs[0]["metrics"]
                    else "-",
                    "tis_capped_frac": statistics.fmean(
                        x["metrics"]["tis_capped_frac"] for x in recs
                    )
                    if "tis_capped_frac" in recs[0]["metrics"]
                    else "-",
                }
            )
            print(rows[-1], flush=True)
    summary = []
    for algo in ("grpo", "ppo"):
        for engine in ("builtin", "vllm"):
            last = [
                row[f"reward last {LAST}"]
                for row in rows
                if row["algo"] == algo and row["engine"] == engine
            ]
            sec = [row["s/step"] for row in rows if row["algo"] == algo and row["engine"] == engine]
            summary.append(
                {
                    "algo": algo,
                    "engine": engine,
                    "seeds": len(last),
                    f"reward last {LAST}, mean": statistics.fmean(last),
                    "min": min(last),
                    "max": max(last),
                    "std": statistics.stdev(last) if len(last) > 1 else 0.0,
                    "s/step, median of runs": statistics.median(sec),
                }
            )
    verdicts = []
    for algo in ("grpo", "ppo"):
        b, v = (
            next(x for x in summary if x["algo"] == algo and x["engine"] == e)
            for e in ("builtin", "vllm")
        )
        d = v[f"reward last {LAST}, mean"] - b[f"reward last {LAST}, mean"]
        se = ((b["std"] ** 2 + v["std"] ** 2) / max(b["seeds"], 1)) ** 0.5
        verdicts.append(
            f"{algo}: vLLM - built-in = {d:+.3f} in the mean reward of the last {LAST} steps "
            f"(standard error of the difference {se:.3f} over {b['seeds']} seeds): "
            + (
                "within noise (|difference| <= 2 standard errors)"
                if abs(d) <= 2 * se + 1e-12
                else "OUTSIDE 2 standard errors"
            )
        )
    cols = list(dict.fromkeys(k for row in rows for k in row))
    scols = list(dict.fromkeys(k for row in summary for k in row))
    from timing import markdown_table

    notes = "\n\n".join(
        [
            "Summary over seeds (the +tis_cap rows are single runs, kept out of it):",
            markdown_table(summary, scols),
            "Verdict: " + "; ".join(verdicts) + ".",
            (
                "Task: configs/copy_task/{grpo,ppo}_vllm.yaml (the copy task's actor with 2 "
                f"heads of 32 dims, which vLLM's CPU attention runs; {args.steps} steps, batch 64, "
                "2 new tokens, sampling at temperature 1). Both engines generate on dp4 x tp1 "
                "from the same actor train layout (GRPO dp2,tp2; PPO tp2,pp2): with vLLM the "
                "weights move into vLLM's live format every step and old_logp is recomputed by "
                "actor_logp on the train layout; with the built-in engine they move into its dp4 "
                "layout and old_logp comes from the generation call. The two engines draw their "
                "samples from different random streams (vLLM's per-request generator, the "
                "built-in inverse-CDF uniforms), so a seed gives each engine other samples: the "
                "comparison is over seeds, not paired. rollout_logp_diff: mean over steps of the "
                "token mean |old_logp - rollout_logp| (fp32 on CPU: both compute the same "
                "function, so it is rounding only); rollout_kl: k3 of KL(pi_vllm || pi_train). "
                "s/step: median wall seconds per step on 2 shared CPU cores (vLLM's start-up is "
                f"in run_s only). Whole benchmark {time.time() - t_all:.0f} s."
            ),
        ]
    )
    jpath, mpath = write_results(
        "vllm_learning",
        hardware_tag("cpu"),
        rows,
        columns=cols,
        title="Copy task with vLLM generation against the built-in engine (4 gloo ranks, CPU)",
        notes=notes,
        extra={"curves": curves, "summary": summary},
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, algo in zip(axes, ("grpo", "ppo")):
            for name, runs in curves.items():
                if not name.startswith(algo + " ") or "tis" in name:
                    continue
                n = min(len(x) for x in runs)
                mean = [statistics.fmean(x[i] for x in runs) for i in range(n)]
                ax.plot(
                    range(1, n + 1),
                    mean,
                    label=f"{name.split(' ', 1)[1]} (mean of {len(runs)} seeds)",
                )
            ax.set_title(f"copy task, {algo.upper()}")
            ax.set_xlabel("step")
            ax.set_ylabel("mean reward")
            ax.set_ylim(0, 1.05)
            ax.legend(fontsize=8)
        fig.tight_layout()
        png = RESULTS / (jpath.stem + ".png")
        fig.savefig(png, dpi=100)
        print(png)
    except ImportError:
        pass
    print(jpath, mpath, environment()["date_utc"])


if __name__ == "__main__":
    main()
