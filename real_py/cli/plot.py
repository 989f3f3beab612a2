"""`python -m real_py plot runs/train [--out curves.png]`: reward, KL, entropy and step time of a
run (from its metrics.jsonl) as one PNG (default <run>/curves.png)."""

from __future__ import annotations

import os

PANELS = (
    ("reward", "reward"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("seconds", "seconds per step"),
)


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot a run's reward / KL / entropy / step time as a PNG")
    p.add_argument("run", help="run directory of `train` (its out_dir, holding metrics.jsonl)")
    p.add_argument("--out", help="PNG path (default: <run>/curves.png)")


def plot_run(run: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..rlhf.observe import read_metrics, summarize

    recs = read_metrics(run)
    steps = [r["step"] for r in recs]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (key, title) in zip(axes, PANELS):
        ys = [
            r["seconds"] if key == "seconds" else r["metrics"].get(key, float("nan")) for r in recs
        ]
        ax.plot(steps, ys, marker="." if len(steps) < 50 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    s = summarize(recs)
    fig.suptitle(
        f"{run}: reward {s['reward_first']:.3g} -> {s['reward_last']:.3g} "
        f"(first / last {s['window']} steps), {s['seconds_per_step']:.2f} s/step"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def run(args) -> int:
    out = args.out or os.path.join(args.run, "curves.png")
    plot_run(args.run, out)
    print(f"wrote {out}")
    return 0
