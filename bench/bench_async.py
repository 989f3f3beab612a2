"""Async RL vs sync on the same plan, generation and training on disjoint ranks.

    python bench/bench_async.py [--steps 20] [--max-new-tokens 96] [--min-new-tokens N]
                                [--learn-steps 30] [--k 1] [--repeats 3]

Runs `python -m real_py train` on the copy task (configs/copy_task/grpo.yaml, 4 gloo ranks) with
the plan below (rollout calls on ranks 2, 3; the actor's training on ranks 0, 1, dp 2: its
weights move to the other two ranks after every step), once synchronous and once with
async.max_staleness=k and the decoupled loss. Long responses make generation the slower side:
generation.min_new_tokens (default: the whole budget) keeps the EOS from ending them early, as
responses of long-reasoning RL run to thousands of tokens; the reward reads only the first
response character. Writes bench/results/async_cpu2_<date>.{json,md,png}: seconds per step,
reward per window and against wall-clock, the overlap of rollout calls with train calls, and the
share of the actor's reallocation (train -> generation layout) hidden under generation.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import yaml
from timing import environment, hardware_tag, write_results

from real_py.rlhf.config import read_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = {
    "world_size": 4,
    "calls": {
        "actor_gen": {"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1},
        "ref_inf": {"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1},
        "rew_inf": {"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1},
        "actor_train": {"ranks": [0, 1], "dp": 2, "tp": 1, "pp": 1},
    },
}
WINDOW = 5
ROLLOUT = ("actor_gen", "ref_inf", "rew_inf")  # the calls on the generation ranks


def run(
    tmp: str, name: str, steps: int, new_tokens: int, k: int, min_tokens: int = 0
) -> list[dict]:
    # read_yaml: the shipped config's relative paths resolved against its folder (absolute here)
    cfg = read_yaml(os.path.join(ROOT, "configs", "copy_task", "grpo.yaml"))
    cfg.update(steps=steps, plan=PLAN, out_dir=os.path.join(tmp, name))
    cfg["generation"] = dict(
        cfg["generation"], max_new_tokens=new_tokens, min_new_tokens=min_tokens
    )
    # Longer responses than the shipped config's position table holds (generation made the
    # slower side): the actor's table grows to fit prompt + response.
    need = cfg["data"]["max_prompt_len"] + new_tokens
    cfg["actor"] = dict(
        cfg["actor"], max_position_embeddings=max(cfg["actor"]["max_position_embeddings"], need)
    )
    if k:
        cfg["async"] = {"max_staleness": k, "overlap_realloc": True}
        cfg["ppo"] = dict(cfg["ppo"], decoupled=True)
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    done = subprocess.run(
        [sys.executable, "-m", "real_py", "train", "--config", path, "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(
            f"run {name} exited {done.returncode}; its stderr ends:\n{done.stderr[-3000:]}"
        )
    with open(os.path.join(tmp, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def measure(
    tmp: str, setting: str, steps: int, new_tokens: int, k: int, repeats: int, min_tokens: int = 0
):
    """Rows (sync, async) of one setting, each mode `repeats` runs (alternating), and the curves."""
    modes = (("sync", 0), (f"async k={k}", k))
    recs_of = {name: [] for name, _ in modes}
    for rep in range(repeats):
        for name, kk in modes:
            tag = f"{setting}_{name.replace(' ', '_').replace('=', '')}_{rep}"
            recs_of[name].append(run(tmp, tag, steps, new_tokens, kk, min_tokens))
    rows, curves = [], {}
    for name, kk in modes:
        runs_ = recs_of[name]
        after = [x for recs in runs_ for x in recs[1:]]  # every step but each run's first
        med = lambda f: statistics.median(f(x) for x in after)
        per_run = [statistics.median(x["seconds"] for x in recs[1:]) for recs in runs_]
        rew = [[x["metrics"]["reward"] for x in recs] for recs in runs_]
        row = {
            "setting": setting,
            "mode": name,
            "runs x steps": f"{len(runs_)} x {steps}",
            "s/step (median)": med(lambda x: x["seconds"]),
            "s/step per run": " / ".join(f"{v:.3f}" for v in per_run),
            "actor_gen s": med(lambda x: x["calls"].get("actor_gen", 0.0)),
            "rollout side s": med(lambda x: sum(x["calls"].get(c, 0.0) for c in ROLLOUT)),
            "actor_train s": med(lambda x: x["calls"].get("actor_train", 0.0)),
            "actor realloc s": med(lambda x: x["realloc_seconds"].get("actor", 0.0)),
            f"reward 1-{WINDOW}": statistics.fmean(v for r in rew for v in r[:WINDOW]),
            f"reward last {WINDOW}": statistics.fmean(v for r in rew for v in r[-WINDOW:]),
            "wall s (mean)": statistics.fmean(sum(x["seconds"] for x in recs) for recs in runs_),
        }
        if kk:
            a = [x["async"] for x in after]
            row["gen||train overlap s"] = statistics.median(x["overlap_seconds"] for x in a)
            hidden = sum(x["realloc_hidden_seconds"] for x in a)
            total = sum(x["realloc_seconds"] for x in a)
            row["realloc hidden share"] = hidden / total if total else 0.0
            row["staleness"] = statistics.fmean(x["metrics"]["staleness"] for x in after)
        rows.append(row)
        curves[f"{setting} {name}"] = [
            {
                "reward": [x["metrics"]["reward"] for x in recs],
                "wall": [sum(x["seconds"] for x in recs[: i + 1]) for i in range(len(recs))],
            }
            for recs in runs_
        ]
        print(row, flush=True)
    return rows, curves


def plot(jpath: str) -> str | None:
    """Reward against wall-clock seconds of every run in the result `jpath` (its extra.curves),
    one panel per setting; written beside it as .png. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    with open(jpath) as f:
        curves = json.load(f)["extra"]["curves"]
    settings = list(
        dict.fromkeys(k.rsplit(" ", 2)[0] if "async" in k else k.rsplit(" ", 1)[0] for k in curves)
    )
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4))
    for ax, setting in zip(list(axes) if len(settings) > 1 else [axes], settings):
        for name, runs in curves.items():
            if not name.startswith(setting + " "):
                continue
            mode = name[len(setting) + 1 :]
            for i, c in enumerate(runs):
                ax.plot(
                    c["wall"],
                    c["reward"],
                    color="C1" if "async" in mode else "C0",
                    alpha=0.8,
                    label=mode if i == 0 else None,
                )
        ax.set_xlabel("wall-clock s")
        ax.set_ylabel("batch mean reward")
        ax.set_title(f"{setting}: reward vs wall-clock")
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.splitext(jpath)[0] + ".png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20, help="steps of the speed setting")
    ap.add_argument(
        "--max-new-tokens", type=int, default=96, help="response budget of the speed setting"
    )
    ap.add_argument(
        "--min-new-tokens",
        type=int,
        default=None,
        help="generation.min_new_tokens of the speed setting (default: --max-new-tokens)",
    )
    ap.add_argument(
        "--learn-steps", type=int, default=30, help="steps of the learning setting (2 new tokens)"
    )
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs per mode, alternating (machine noise)"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lo = args.max_new_tokens if args.min_new_tokens is None else args.min_new_tokens
        rows, curves = measure(
            tmp,
            f"speed ({lo}-{args.max_new_tokens} tokens)",
            args.steps,
            args.max_new_tokens,
            args.k,
            args.repeats,
            lo,
        )
        lrows, lcurves = measure(tmp, "learning (2 tokens)", args.learn_steps, 2, args.k, 1)
    speed = rows[0]["s/step (median)"] / rows[1]["s/step (median)"]
    rows += lrows
    curves |= lcurves
    cols = list(dict.fromkeys(c for row in rows for c in row))
    jpath, mpath = write_results(
        "async",
        hardware_tag("cpu"),
        rows,
        columns=cols,
        title=(
            f"Async RL (k={args.k}, decoupled GRPO) vs sync, copy task, gen ranks 2-3 / "
            "train ranks 0-1"
        ),
        notes=(
            f"Speed setting, sync / async median s/step: {speed:.2f}. Each mode of the speed "
            f"setting {args.repeats} runs (alternating), medians over every step but each run's "
            "first; the learning setting is the shipped copy-task config (2 new tokens), one run "
            "per mode. Per-step reward and wall-clock of every run in the JSON (extra.curves). "
            "Same plan both ways (rollout calls on ranks 2, 3 dp 2; actor_train on ranks 0, 1 dp "
            f"2); seed 1, batch 64; speed setting responses of {lo}-{args.max_new_tokens} tokens "
            "(generation.min_new_tokens), so generation (with the reference inference on its "
            "ranks) is the slower side. Sync: generation waits for the train step and vice versa. "
            "Async: the rollout of batch s+k runs while batch s trains, the step costs about "
            "max(gen, train) + what of the weight transfer is not hidden. 'realloc hidden share': "
            "share of the wall seconds of rollout-side reallocation during which a rollout call "
            "ran (async.overlap_realloc: the generation ranks receive version s+1 in a thread "
            "during generation). CPU: 2 shared cores run 4 ranks (and other agents' jobs), so in "
            "async mode the two sides compete for the same cores: overlap gains at most the core "
            "time sync mode leaves idle, call times of the async rows are inflated by that "
            "contention, and the ratio moves with the machine's load (it is no estimate of a GPU "
            "cluster's). What carries over to a GPU cluster: the schedule (which calls overlap, "
            "that the transfer runs under generation, staleness and row accounting); what does "
            "not: any ratio of times. On GPUs each side has its own devices, so the step tends to "
            "max(gen, train) + unhidden transfer instead of gen + train + transfer."
        ),
        extra={"curves": curves, "speedup_speed_setting": speed, "date": environment()["date_utc"]},
    )
    print(jpath, mpath, plot(str(jpath)) or "")


if __name__ == "__main__":
    main()
