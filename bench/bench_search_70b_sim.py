"""The 70B actor + 70B critic search on 128 H100 (gen 384) with the simulator-based reallocation
cost (real_py/search/realloc_cost.py): the search's time per iteration against the symmetric and
heuristic plans, the first iteration's reallocation seconds and the planner calls the cost took.
The simulator cost is plan_search's default now, so bench_search.py's row for this setting runs
the same search (with its own budget). Estimates, not measurements.

    python bench/bench_search_70b_sim.py [--budget 60]

Writes bench/results/search70b_sim_cpu2_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from real_py.search import Workload, plan_search

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_search import layouts_text  # noqa: E402
from timing import hardware_tag, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=60.0)
    args = ap.parse_args()
    rows = []
    for gen in (384,):
        t0 = time.perf_counter()
        res = plan_search("llama2-70b", "llama2-70b", num_gpus=128, hardware="h100",
                          workload=Workload(batch_size=512, prompt_len=128, gen_len=gen),
                          time_budget=args.budget, chains=4, seed=0)
        sim = res.simulate()
        realloc = sum(e.end - e.start for e in sim.events if e.realloc and e.iter == 0)
        sym, heu = res.baselines["symmetric"], res.baselines["heuristic"]
        rows.append({"gen_len": gen, "search_s_per_iter": res.iter_time,
                     "symmetric_s_per_iter": sym.iter_time, "heuristic_s_per_iter": heu.iter_time,
                     "speedup_vs_heuristic": heu.iter_time / res.iter_time,
                     "realloc_s_first_iter": realloc, "planner_calls": res.stats["planner_calls"],
                     "plan": layouts_text(res.problem, res.choice),
                     "wall_s": time.perf_counter() - t0})
        print(rows[-1], flush=True)
    write_results("search70b_sim", hardware_tag("cpu"), rows,
                  columns=["gen_len", "search_s_per_iter", "symmetric_s_per_iter", "heuristic_s_per_iter",
                           "speedup_vs_heuristic", "realloc_s_first_iter", "planner_calls", "plan", "wall_s"],
                  title="70B + 70B on 128 H100, reallocation cost from the cluster simulator (estimates)",
                  notes=f"Search budget {args.budget} s, 4 chains, seed 0. Estimates of the runtime model "
                        "(H100 profile), not measurements.")


if __name__ == "__main__":
    main()
