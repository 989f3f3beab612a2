"""Pool bench_estimator.py runs of one code version: per-run and pooled median |rel err| per
iteration and per call (reallocations included, as bench_estimator scores them), and the median
signed error per (plan, call) over all runs (what is left systematic).

    python bench/results/estimator_cpu2_20261205_final/pool.py bench/results/estimator_cpu2_20261205_commit{a84a9d8,49f7ad4_run?}.json
"""

import collections
import json
import statistics as st
import sys

CALLS = ("actor_gen", "ref_inf", "rew_inf", "critic_inf", "actor_train", "critic_train", "realloc")


def entries(path):
    rows = json.load(open(path))["rows"]
    iters = [abs(r["estimated s"] - r["measured s"]) / r["measured s"] for r in rows]
    calls = []
    for r in rows:
        for name, (m, e) in zip(CALLS, r["call meas/est pairs"]):
            if name == "realloc" and m == 0:  # no reallocation in this plan
                continue
            calls.append(((r["plan"], name), (e - m) / m))
    return iters, calls


def main(paths):
    all_it, all_calls = [], []
    print("| run | iterations | median iteration abs rel err | calls | median call abs rel err |")
    print("|---|---|---|---|---|")
    for p in paths:
        it, calls = entries(p)
        all_it += it
        all_calls += calls
        print(f"| {p.rsplit('/', 1)[-1]} | {len(it)} | {st.median(it):.3f} | {len(calls)} | "
              f"{st.median(abs(e) for _, e in calls):.3f} |")
    print(f"| pooled | {len(all_it)} | {st.median(all_it):.3f} | {len(all_calls)} | "
          f"{st.median(abs(e) for _, e in all_calls):.3f} |")
    groups = collections.defaultdict(list)
    for k, e in all_calls:
        groups[k].append(e)
    print("\n| plan | call | n | median signed rel err (estimated - measured) / measured |")
    print("|---|---|---|---|")
    for (plan, name), v in sorted(groups.items(), key=lambda kv: st.median(kv[1])):
        print(f"| {plan} | {name} | {len(v)} | {st.median(v):+.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
