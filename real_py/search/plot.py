"""Timeline picture of a simulated plan: one row per device, a bar per call and per reallocation."""

from __future__ import annotations

COLORS = {
    "actor_gen": "#4C72B0",
    "ref_inf": "#55A868",
    "rew_inf": "#C44E52",
    "critic_inf": "#8172B2",
    "actor_train": "#CCB974",
    "critic_train": "#64B5CD",
    "actor_greedy": "#DA8BC3",
}


def plot_timeline(events, num_gpus: int, path: str, title: str = "") -> None:
    """events: simulate.Event list; writes a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    height = max(2.5, min(0.28 * num_gpus + 1.5, 11))
    span = max((e.end for e in events), default=1.0)
    fig, ax = plt.subplots(figsize=(13, height))
    for e in events:
        color = "#999999" if e.realloc else COLORS.get(e.call, "#333333")
        for lo, hi in e.ranks:
            ax.broken_barh(
                [(e.start, e.end - e.start)],
                (lo, hi - lo),
                facecolors=color,
                edgecolors="black",
                linewidth=0.4,
                hatch="//" if e.realloc else None,
            )
            # Label only bars wide and tall enough to hold the text.
            if e.end - e.start > 0.045 * span and hi - lo >= max(1, num_gpus // 16):
                short = ("R:" + e.label.split()[-1]) if e.realloc else e.call.replace("_", " ")
                ax.text(
                    e.start + (e.end - e.start) / 2,
                    (lo + hi) / 2,
                    short,
                    ha="center",
                    va="center",
                    fontsize=7,
                    clip_on=True,
                )
    ax.set_xlim(0, span * 1.01)
    ax.set_ylim(num_gpus, 0)
    step = max(1, num_gpus // 16)
    ax.set_yticks([r + 0.5 for r in range(0, num_gpus, step)])
    ax.set_yticklabels([f"gpu {r}" for r in range(0, num_gpus, step)], fontsize=7)
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    present = {e.call for e in events if not e.realloc}
    handles = [
        Patch(facecolor=c, edgecolor="black", label=n) for n, c in COLORS.items() if n in present
    ]
    handles.append(Patch(facecolor="#999999", hatch="//", edgecolor="black", label="reallocation"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=7, fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
