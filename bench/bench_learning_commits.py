"""Does the shipped copy-task GRPO learn as fast on one checkout of real_py as on another?

    .venv/bin/python bench/bench_learning_commits.py --checkouts /path/a /path/b [--seeds 1 .. 8]

Each checkout (a git worktree with its extension built in place) runs its own
`configs/copy_task/grpo.yaml` (4 gloo ranks, 60 steps) for every seed, checkouts alternating
seed by seed. A row per checkout: the mean reward of the last 10 steps over seeds (mean, std,
min, max) and Welch's t statistic of each checkout against the first. The sampler's random
stream may differ between checkouts, so seed s of one is not paired with seed s of another: the
comparison is between the distributions over seeds.
Writes bench/results/learning_commits_cpu2_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from timing import hardware_tag, write_results

LAST = 10


def run(checkout: str, seed: int, steps: int, out: str) -> list[float]:
    cmd = [sys.executable, "-m", "real_py", "train", "--config", "configs/copy_task/grpo.yaml"]
    cmd += ["--out-dir", out, "--no-progress", f"seed={seed}", f"steps={steps}"]
    env = dict(os.environ, PYTHONPATH=checkout)
    p = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{checkout}: {' '.join(cmd)} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["metrics"]["reward"] for line in f]


def commit_of(checkout: str) -> str:
    return subprocess.run(
        ["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def welch_t(a: list[float], b: list[float]) -> float:
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    return (statistics.fmean(a) - statistics.fmean(b)) / ((va + vb) ** 0.5 or float("inf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkouts", nargs="+", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    last = {c: [] for c in args.checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for i, c in enumerate(args.checkouts):
                r = run(c, seed, args.steps, os.path.join(tmp, f"{i}_{seed}"))
                last[c].append(statistics.fmean(r[-LAST:]))
                print(commit_of(c), seed, f"{last[c][-1]:.3f}", flush=True)
    first = last[args.checkouts[0]]
    rows = []
    for c in args.checkouts:
        v = last[c]
        rows.append(
            {
                "checkout": commit_of(c),
                "seeds": len(v),
                f"reward last {LAST}, mean": statistics.fmean(v),
                "std": statistics.stdev(v),
                "min": min(v),
                "max": max(v),
                "per seed": " ".join(f"{x:.3f}" for x in v),
                "Welch t vs first": welch_t(v, first) if v is not first else 0.0,
            }
        )
    note = (
        f"configs/copy_task/grpo.yaml of each checkout, {args.steps} steps, seeds {args.seeds}; "
        f"per seed the mean reward of the last {LAST} steps. |t| above about 2.1 (8 + 8 seeds) "
        "would say the means differ at 5%."
    )
    paths = write_results(
        "learning_commits",
        hardware_tag("cpu"),
        rows,
        columns=list(rows[0]),
        notes=note,
        title="Copy-task GRPO learning, checkout against checkout",
    )
    print(*paths)


if __name__ == "__main__":
    main()
