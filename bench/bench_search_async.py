"""Estimated step time of the searched plan, synchronous vs asynchronous RL.

For each setting, `plan_search` runs twice with the same budget and seed: max_staleness=0 (the
synchronous iteration) and max_staleness=k (plans scored in async mode: the rollout calls of
batch s + k overlap the train calls of batch s, real_py/search/simulate.py). The async search
reports the staleness it chooses: the smallest k' <= k at which its plan reaches its time (0: the
plan gains nothing from running asynchronously, e.g. everything colocated). Every number is an
ESTIMATE of the runtime model on H100 profiles, not a measurement.

    python bench/bench_search_async.py [--budget 10] [--k 1]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timing import hardware_tag, write_results

from real_py.search import Workload, plan_search
from real_py.search.plot import plot_timeline

# (algo, actor, critic, gpus, workload): GRPO and PPO on 7B with short and long responses, few
# and many prompts, one and four epochs of training.
SETTINGS = [
    ("grpo", "llama2-7b", None, 16, Workload(batch_size=512, gen_len=384)),
    ("grpo", "llama2-7b", None, 16, Workload(batch_size=256, gen_len=1024)),
    (
        "grpo",
        "llama2-7b",
        None,
        16,
        Workload(batch_size=64, gen_len=2048, ppo_epochs=4, ppo_minibatches=4),
    ),
    (
        "grpo",
        "llama2-7b",
        None,
        16,
        Workload(batch_size=32, gen_len=1024, ppo_epochs=4, ppo_minibatches=2),
    ),
    ("ppo", "llama2-7b", "llama2-7b", 16, Workload(batch_size=64, gen_len=2048, ppo_epochs=4)),
    ("ppo", "llama2-13b", "llama2-7b", 32, Workload(batch_size=128, gen_len=2048, ppo_epochs=2)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=10.0, help="search seconds per run")
    ap.add_argument("--k", type=int, default=1, help="max_staleness allowed in the async search")
    args = ap.parse_args()
    rows, best = [], None
    for algo, actor, critic, n, wl in SETTINGS:
        kw = dict(
            num_gpus=n,
            hardware="h100",
            workload=wl,
            time_budget=args.budget,
            chains=4,
            seed=0,
            algo=algo,
        )
        sync = plan_search(actor, critic, **kw)
        asy = plan_search(actor, critic, **kw, max_staleness=args.k)
        gain = sync.iter_time / asy.iter_time
        rows.append(
            {
                "algo": algo,
                "actor": actor,
                "critic": critic or "-",
                "gpus": n,
                "batch": wl.batch_size,
                "gen": wl.gen_len,
                "epochs": wl.ppo_epochs,
                "sync s": sync.iter_time,
                "async s": asy.iter_time,
                "gain": gain,
                "chosen staleness": asy.staleness,
                "async plan run sync s": asy.stats["sync_iter_time"],
                "async layouts": ", ".join(
                    f"{c}={l.dp}x{l.tp}x{l.pp}@{l.ranks[0]}+{len(l.ranks)}"
                    for c, l in asy.plan.calls.items()
                ),
            }
        )
        print(
            f"{algo} {actor} {n} gpus batch {wl.batch_size} gen {wl.gen_len}: sync "
            f"{sync.iter_time:.3f} s, async {asy.iter_time:.3f} s (k={asy.staleness}), {gain:.2f}x",
            flush=True,
        )
        if best is None or gain > best[0]:
            best = (gain, asy, algo, actor, n, wl)
    gain, asy, algo, actor, n, wl = best
    jpath, _ = write_results(
        "search_async",
        hardware_tag("cpu"),
        rows,
        columns=list(rows[0]),
        title="Searched plan, synchronous vs asynchronous RL (estimates, H100 profile)",
        notes=f"plan_search time_budget {args.budget} s, 4 chains, seed 0, per setting: once with "
        f"max_staleness=0, once with max_staleness={args.k}. `gain` = sync / async estimated "
        "seconds per step; `chosen staleness` 0 means the async search's plan gains nothing "
        "from overlap (it then runs synchronously); `async plan run sync s` is that plan "
        "without overlap. Timeline of the largest gain: the .png of the same name. "
        "Estimates of the runtime model, not measurements.",
    )
    png = jpath.with_suffix(".png")
    plot_timeline(
        asy.simulate().events,
        n,
        str(png),
        f"{algo} {actor}, {n} x h100, batch {wl.batch_size}, gen {wl.gen_len}: async "
        f"k={asy.staleness} {asy.iter_time:.2f} s/step (sync search {asy.iter_time * gain:.2f})",
    )


if __name__ == "__main__":
    main()
