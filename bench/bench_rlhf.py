"""PPO iteration on 4 gloo ranks: per-call seconds, reallocation seconds and bytes, step time.

    python bench/bench_rlhf.py [--steps 12] [--warmup 2]

Runs `python -m real_py train` (the embedded default: tiny random-init models, 4 local gloo
ranks) three times: with the default execution plan (actor trains on dp1tp2pp2, generates on
dp4tp1pp1; critic, ref and reward on their own meshes), the same with `offload_frozen: true`
(ref and reward weights in host buffers between their calls), and with every call on dp1tp2pp2
of ranks 0-3 (one layout, nothing reallocated). Reports medians over the steps after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import yaml

from timing import hardware_tag, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_LAYOUT = {"world_size": 4, "calls": {n: {"ranks": [0, 1, 2, 3], "dp": 1, "tp": 2, "pp": 2} for n in
                                         ("actor_gen", "ref_inf", "rew_inf", "critic_inf", "actor_train",
                                          "critic_train")}}


def run(plan: dict | None, steps: int, tmp: str, name: str, **options) -> list[dict]:
    """`python -m real_py train` on the default config with `plan` and extra config `options`;
    the per-step records of its metrics.jsonl."""
    cfg = os.path.join(tmp, f"{name}.yaml")
    with open(cfg, "w") as f:
        yaml.safe_dump({"steps": steps, "save_every": 0, "allow_idle_ranks": True}
                       | ({"plan": plan} if plan else {}) | options, f)
    out = os.path.join(tmp, name)
    subprocess.run([sys.executable, "-m", "real_py", "train", "--config", cfg, "--out-dir", out,
                    "--no-progress"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = (("default plan", None, {}), ("default plan, offload_frozen", None, {"offload_frozen": True}),
                ("one layout dp1tp2pp2", ONE_LAYOUT, {}))
        for i, (name, plan, options) in enumerate(runs):
            recs = run(plan, args.steps, tmp, f"run{i}", **options)[args.warmup:]
            med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
            row = {"plan": name, "step s": med([r["seconds"] for r in recs])}
            for call in recs[0]["calls"]:
                row[call + " s"] = med([r["calls"][call] for r in recs])
            for m in ("actor", "critic"):
                row[f"realloc {m} s"] = med([r["realloc_seconds"].get(m, 0.0) for r in recs])
            row["realloc MiB/iter"] = med([r["realloc_bytes"] for r in recs]) / 2**20
            row["data KiB/iter"] = med([r["data_bytes"] for r in recs]) / 2**10
            for m in ("ref", "reward"):
                row[f"offload {m} ms"] = med([r["offload_seconds"].get(m, 0.0) for r in recs]) * 1e3
            row["offload MiB/iter"] = med([r["offload_bytes"] for r in recs]) / 2**20
            rows.append(row)
    cols = list(rows[0])
    write_results("rlhf", hardware_tag("cpu"), rows, columns=cols, title="PPO iteration, 4 gloo ranks (cpu2)",
                  notes=f"Medians over steps {args.warmup + 1}..{args.steps} of `python -m real_py train` "
                        "(embedded default config: actor/ref 4 layers hidden 64, critic/reward 2 layers, "
                        "batch 8, 12 new tokens, 2 PPO epochs x 2 mini-batches). Per-call seconds are the "
                        "slowest rank's; the machine is shared, so expect +-30%. offload: reload before "
                        "plus offload after the frozen model's call, slowest rank; on CPU the host buffer "
                        "and the working buffer are the same memory, so this measures the mechanism only.")


if __name__ == "__main__":
    main()
