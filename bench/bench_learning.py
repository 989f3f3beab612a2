"""Learning curves of the copy task (configs/copy_task): PPO and GRPO, full length, 4 gloo ranks.

    python bench/bench_learning.py

Runs `python -m real_py train --config configs/copy_task/{ppo,grpo}.yaml` (prompt file, local
tokenizer, reward function; seed 1) and writes bench/results/learning_cpu2_<date>.{json,md}
(mean reward per window of 5 steps, seconds per step) and a PNG of the per-step reward.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from timing import RESULTS, environment, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 5


def run(algo: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, algo)
    subprocess.run([sys.executable, "-m", "real_py", "train", "--config",
                    os.path.join("configs", "copy_task", f"{algo}.yaml"), "--out-dir", out, "--no-progress"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    curves, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ("ppo", "grpo"):
            recs = run(algo, tmp)
            r = [x["metrics"]["reward"] for x in recs]
            curves[algo] = {"reward": r, "kl": [x["metrics"]["kl"] for x in recs],
                            "seconds": [x["seconds"] for x in recs]}
            row = {"algo": algo, "steps": len(r), "s/step": statistics.median(curves[algo]["seconds"])}
            for lo in range(0, len(r), WINDOW * 2):
                row[f"steps {lo + 1}-{lo + WINDOW}"] = statistics.fmean(r[lo:lo + WINDOW])
            rows.append(row)
    cols = list(dict.fromkeys(k for row in rows for k in row))
    jpath, mpath = write_results(
        "learning", "cpu2", rows, columns=cols,
        title="Copy task (configs/copy_task): mean reward per 5-step window, 4 gloo ranks",
        notes=("Reward 1 when the response starts with the prompt's last digit (random policy: "
               "about 0.1-0.2). Actor: 2 layers, hidden 64, tied embeddings, vocab 16 (the task's "
               "character tokenizer), random init, seed 1; batch 64 prompts-or-samples per step, "
               "2 new tokens, lr 3e-3. GRPO: groups of 8, KL in the loss. s/step: median wall seconds "
               "per step on a shared machine."),
        extra={"curves": curves})
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
