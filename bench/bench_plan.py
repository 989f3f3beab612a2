"""Planning time and plan size for the LLaMA-2-70B shape on 128 ranks (issue goal: < 0.5 s each).

    python bench/bench_plan.py [--repeats 5]

Times a cold plan (every cache cleared: shard layouts, stage partition, plan) and reports plan
size and bytes. Writes bench/results/plan_cpu2_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from real_py import Layout, model_spec, plan_realloc
from real_py import layout as layout_mod
from real_py.realloc import plan as plan_mod

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import write_results  # noqa: E402

PAIRS = [
    ("dp2,tp8,pp8", "dp16,tp8,pp1", "p2p", 0),
    ("dp1,tp8,pp16", "dp32,tp4,pp1", "p2p", 0),
    ("dp4,tp4,pp8", "dp8,tp2,pp8", "p2p", 0),
    ("dp2,tp8,pp8", "dp2,tp8,pp8", "p2p", 0),
    ("dp2,tp8,pp8", "dp16,tp8,pp1", "broadcast", 0),
    ("dp1,tp8,pp16", "dp32,tp4,pp1", "p2p", 8),
]


def clear_caches():
    plan_mod._plan_cached.cache_clear()
    layout_mod._shard_layout.cache_clear()
    layout_mod.stage_layer_ranges.cache_clear()
    layout_mod._coords_table.cache_clear()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = model_spec("llama2-70b")
    rows = []
    for src_s, dst_s, mode, rpn in PAIRS:
        src, dst = Layout.parse(src_s), Layout.parse(dst_s)
        times = []
        for _ in range(args.repeats):
            clear_caches()
            t0 = time.perf_counter()
            plan = plan_realloc(model, src, dst, mode=mode, ranks_per_node=rpn)
            times.append(time.perf_counter() - t0)
        s = plan.summary()
        rows.append({
            "src": src_s, "dst": dst_s, "mode": mode, "ranks_per_node": rpn,
            "plan_seconds_median": statistics.median(times), "plan_seconds_max": max(times),
            "num_messages": s["num_messages"], "num_descs": s["num_descs"],
            "network_GiB": s["network_bytes"] / 2**30, "min_network_GiB": s["min_network_bytes"] / 2**30,
            "local_GiB": s["local_bytes"] / 2**30,
            "max_ingress_GiB": s["max_ingress_bytes"] / 2**30,
            "max_egress_GiB": s["max_egress_bytes"] / 2**30,
            "goal_seconds": 0.5,
        })
        r = rows[-1]
        print(f"{src_s:>13} -> {dst_s:<13} {mode:9} rpn={rpn}: {r['plan_seconds_median'] * 1e3:7.1f} ms "
              f"{r['num_messages']:6d} msgs {r['num_descs']:7d} descs, network {r['network_GiB']:.1f} GiB "
              f"(min {r['min_network_GiB']:.1f})")
    cols = ["src", "dst", "mode", "ranks_per_node", "plan_seconds_median", "num_messages", "num_descs",
            "network_GiB", "min_network_GiB", "max_ingress_GiB", "max_egress_GiB"]
    paths = write_results("plan", "cpu2", rows, columns=cols,
                          title="Planning time, LLaMA-2-70B (fp32 spec) on 128 ranks",
                          notes="Cold planning: all caches cleared before each repeat; median of "
                                f"{args.repeats}. Goal: < 0.5 s per pair.")
    print("wrote", *paths)


if __name__ == "__main__":
    main()
