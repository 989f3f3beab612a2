"""Learning curves of the copy task (configs/copy_task): PPO and GRPO, full length, 4 gloo ranks.

    python bench/bench_learning.py
    python bench/bench_learning.py --recipes [--steps 30]     # the recipe axis

Runs `python -m real_py train --config configs/copy_task/{ppo,grpo}.yaml` (prompt file, local
tokenizer, reward function; seed 1) and writes bench/results/learning_cpu2_<date>.{json,md}
(mean reward per window of 5 steps, seconds per step) and a PNG of the per-step reward.
--recipes runs PPO, GRPO and every configs/recipes/*.yaml (the same task) and writes
learning_recipes_cpu2_<date>.{json,md,png}: reward per step and seconds per step of each.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from timing import RESULTS, environment, hardware_tag, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 5


def run(algo: str, tmp: str, config: str | None = None, steps: int | None = None) -> list[dict]:
    out = os.path.join(tmp, algo)
    config = config or os.path.join("configs", "copy_task", f"{algo}.yaml")
    cmd = [sys.executable, "-m", "real_py", "train", "--config", config, "--out-dir", out]
    cmd += ["--no-progress"] + (["--steps", str(steps)] if steps else [])
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def recipes(steps: int) -> None:
    """Every recipe on the copy task for `steps` steps: one table, one PNG."""
    configs = {
        "ppo": os.path.join("configs", "copy_task", "ppo.yaml"),
        "grpo": os.path.join("configs", "copy_task", "grpo.yaml"),
    }
    rdir = os.path.join(ROOT, "configs", "recipes")
    configs |= {
        f[:-5]: os.path.join("configs", "recipes", f)
        for f in sorted(os.listdir(rdir))
        if f.endswith(".yaml")
    }
    curves, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in configs.items():
            recs = run(name, tmp, path, steps)
            r = [x["metrics"]["reward"] for x in recs]
            sec = [x["seconds"] for x in recs]
            curves[name] = {
                "reward": r,
                "seconds": sec,
                "gen_rounds": [x["metrics"].get("gen_rounds") for x in recs],
            }
            rows.append(
                {
                    "recipe": name,
                    "config": path,
                    "steps": len(r),
                    f"reward 1-{WINDOW}": statistics.fmean(r[:WINDOW]),
                    f"reward last {WINDOW}": statistics.fmean(r[-WINDOW:]),
                    "best step >= 0.8": next((i + 1 for i, x in enumerate(r) if x >= 0.8), "-"),
                    "s/step": statistics.median(sec),
                }
            )
            print(rows[-1], flush=True)
    cols = list(dict.fromkeys(k for row in rows for k in row))
    jpath, mpath = write_results(
        "learning_recipes",
        hardware_tag("cpu"),
        rows,
        columns=cols,
        title=(
            f"Copy task, every recipe: mean reward of the first and last {WINDOW} steps, "
            "4 gloo ranks"
        ),
        notes=(
            "Same task, actor and seed (1) for all; each recipe's own config "
            "(configs/recipes/<name>.yaml, copy_task/{ppo,grpo}.yaml), steps overridden by "
            "--steps. 'best step >= 0.8': first step whose batch reward reaches 0.8. s/step: "
            "median wall seconds per step on 2 shared CPU cores (DAPO's includes its refill "
            "generation rounds; ReMax's its greedy generation)."
        ),
        extra={"curves": curves},
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
        for name, c in curves.items():
            ax.plot(range(1, len(c["reward"]) + 1), c["reward"], label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.set_ylim(0, 1.05)
        ax.set_title("copy task, 4 gloo ranks (CPU)")
        ax.legend(fontsize=7)
        names = list(curves)
        bx.barh(names, [statistics.median(curves[n]["seconds"]) for n in names])
        bx.set_xlabel("median s/step")
        fig.tight_layout()
        png = RESULTS / (jpath.stem + ".png")
        fig.savefig(png, dpi=100)
        print(png)
    except ImportError:
        pass
    print(jpath, mpath, environment()["date_utc"])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--recipes", action="store_true", help="every recipe (configs/recipes) on the copy task"
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="steps per recipe (default: each config's)"
    )
    args = ap.parse_args()
    if args.recipes:
        return recipes(args.steps)
    curves, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ("ppo", "grpo"):
            recs = run(algo, tmp)
            r = [x["metrics"]["reward"] for x in recs]
            curves[algo] = {
                "reward": r,
                "kl": [x["metrics"]["kl"] for x in recs],
                "seconds": [x["seconds"] for x in recs],
            }
            row = {
                "algo": algo,
                "steps": len(r),
                "s/step": statistics.median(curves[algo]["seconds"]),
            }
            for lo in range(0, len(r), WINDOW * 2):
                row[f"steps {lo + 1}-{lo + WINDOW}"] = statistics.fmean(r[lo : lo + WINDOW])
            rows.append(row)
    cols = list(dict.fromkeys(k for row in rows for k in row))
    jpath, mpath = write_results(
        "learning",
        hardware_tag("cpu"),
        rows,
        columns=cols,
        title="Copy task (configs/copy_task): mean reward per 5-step window, 4 gloo ranks",
        notes=(
            "Reward 1 when the response starts with the prompt's last digit (random policy: "
            "about 0.1-0.2). Actor: 2 layers, hidden 64, tied embeddings, vocab 16 (the task's "
            "character tokenizer), random init, seed 1; batch 64 prompts-or-samples per step, "
            "2 new tokens, lr 3e-3. GRPO: groups of 8, KL in the loss. s/step: median wall seconds "
            "per step on a shared machine."
        ),
        extra={"curves": curves},
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for algo, c in curves.items():
            ax.plot(range(1, len(c["reward"]) + 1), c["reward"], label=algo.upper())
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.set_title("copy task, 4 gloo ranks (CPU)")
        ax.set_ylim(0, 1.05)
        ax.legend()
        fig.tight_layout()
        png = RESULTS / (jpath.stem + ".png")
        fig.savefig(png, dpi=100)
        print(png)
    except ImportError:
        pass
    print(jpath, mpath, environment()["date_utc"])


if __name__ == "__main__":
    main()
