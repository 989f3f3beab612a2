"""Planning cost per rank, 16 ... 1024 ranks: plan + own schedule, and memory, per rank.

    python bench/bench_plan.py [--repeats 3] [--max-ranks 1024] [--note TEXT]

For every pair: the global plan (C++ `_C.plan`, every rank's descriptors; what each rank built
before per-rank schedules) and, for three sample ranks (first, middle, last), a cold per-rank
plan + schedule (plan_realloc with every cache cleared, then rank_schedule with the
Reallocator's defaults: 256 MiB bucket, pipelined, 256 KiB direct pieces). Memory: the C++
side's peak bytes for one rank (RankSchedule.held_bytes) against the global arrays' bytes, and
the Python allocations of the per-rank path (tracemalloc peak). Times are wall clock; the
process CPU time of the slowest rank is recorded beside them (rank_cpu_ms), since on a shared
machine other jobs' time slices land in the wall times. Goals: plan + own
schedule <= 50 ms per rank for 70B pairs, <= 0.5 s for 405B at 512 and 1024 ranks.
Writes bench/results/plan_cpu2_<date>.{json,md}. The machine is shared: timings are noisy.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc

from real_py import Layout, model_spec, plan_realloc
from real_py.layout import grid, shards, stages
from real_py.realloc import plan as plan_mod
from real_py.realloc.rank_schedule import rank_schedule
from real_py.spec.config import preset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import hardware_tag, write_results

BUCKET_BYTES, DIRECT_MIN_BYTES = 256 << 20, 256 << 10

# (model preset, src, dst, mode, ranks_per_node)
PAIRS = [
    ("llama2-7b", "dp2,tp4,pp2", "dp8,tp2,pp1", "p2p", 8),
    ("llama2-70b", "dp1,tp8,pp8", "dp2,tp4,pp8", "p2p", 8),
    ("llama2-70b", "dp4,tp4,pp4", "dp8,tp8,pp1", "p2p", 8),
    ("llama2-70b", "dp2,tp8,pp8", "dp16,tp8,pp1", "p2p", 8),
    ("llama2-70b", "dp1,tp8,pp16", "dp32,tp4,pp1", "p2p", 0),
    ("llama2-70b", "dp4,tp4,pp8", "dp8,tp2,pp8", "p2p", 0),
    ("llama2-70b", "dp2,tp8,pp8", "dp2,tp8,pp8", "p2p", 0),
    ("llama2-70b", "dp2,tp8,pp8", "dp16,tp8,pp1", "broadcast", 0),
    ("llama2-70b", "dp1,tp8,pp16", "dp32,tp4,pp1", "p2p", 8),
    ("llama3.1-405b", "dp2,tp8,pp16", "dp32,tp8,pp1", "p2p", 8),
    ("llama3.1-405b", "dp4,tp8,pp16", "dp64,tp8,pp1", "p2p", 8),
    ("llama3.1-405b", "dp8,tp8,pp16", "dp128,tp8,pp1", "p2p", 8),
]


def spec(name: str):
    dtype = "bfloat16" if "405b" in name else "float16"
    return model_spec(preset(name, dtype=dtype), name)


def clear_caches():
    plan_mod._plan_cached.cache_clear()
    shards._shard_layout.cache_clear()
    shards._fits.cache_clear()
    stages.stage_layer_ranges.cache_clear()
    grid._coords_table.cache_clear()


def one_rank(model, src, dst, mode, rpn, rank, trace=False):
    """Cold plan + schedule of one rank; with trace=True (not timed: tracemalloc slows Python
    down several times) the Python peak allocation instead."""
    clear_caches()
    # A garbage collection owed by earlier allocations (torch's import, the previous pair) would
    # otherwise land in whichever call crosses the threshold: ~80 ms in the first timed call of
    # a fresh process here. Collect first, as timeit disables the collector while timing.
    gc.collect()
    if trace:
        tracemalloc.start()
    c0, t0 = time.process_time(), time.perf_counter()
    plan = plan_realloc(model, src, dst, mode=mode, ranks_per_node=rpn)
    t1 = time.perf_counter()
    es = model.element_size
    rs = rank_schedule(plan, rank, BUCKET_BYTES // es // 2, -(-DIRECT_MIN_BYTES // es))
    t2, c2 = time.perf_counter(), time.process_time()
    py_peak = tracemalloc.get_traced_memory()[1] if trace else 0
    if trace:
        tracemalloc.stop()
    assert not plan.built
    return plan, rs, t1 - t0, t2 - t1, py_peak, c2 - c0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-ranks", type=int, default=1024)
    ap.add_argument(
        "--note",
        default="",
        help="appended to the results' notes (e.g. the load the run shared the machine with)",
    )
    args = ap.parse_args()
    rows = []
    for name, src_s, dst_s, mode, rpn in PAIRS:
        model, src, dst = spec(name), Layout.parse(src_s), Layout.parse(dst_s)
        world = max(max(src.ranks), max(dst.ranks)) + 1
        if world > args.max_ranks:
            continue
        worst = None
        for rank in (0, world // 2 + 3, world - 1):
            runs = [one_rank(model, src, dst, mode, rpn, rank) for _ in range(args.repeats)]
            plan_s = statistics.median(r[2] for r in runs)
            sched_s = statistics.median(r[3] for r in runs)
            cpu_s = statistics.median(r[5] for r in runs)
            plan, rs = runs[-1][0], runs[-1][1]
            py_peak = one_rank(model, src, dst, mode, rpn, rank, trace=True)[4]
            cand = (plan_s + sched_s, plan_s, sched_s, rank, rs, py_peak, cpu_s)
            if worst is None or cand[0] > worst[0]:
                worst = cand
        total, plan_s, sched_s, rank, rs, py_peak, cpu_s = worst
        t0 = time.perf_counter()
        global_bytes = plan.global_bytes()  # builds the global arrays (C++ _C.plan)
        global_s = time.perf_counter() - t0
        goal = 0.5 if "405b" in name else 0.05
        rows.append(
            {
                "model": name,
                "ranks": world,
                "src": src_s,
                "dst": dst_s,
                "mode": mode,
                "ranks_per_node": rpn,
                "worst_rank": rank,
                "rank_plan_ms": plan_s * 1e3,
                "rank_schedule_ms": sched_s * 1e3,
                "rank_total_ms": total * 1e3,
                "rank_cpu_ms": cpu_s * 1e3,
                "goal_ms": goal * 1e3,
                "rank_cpp_MiB": rs.held_bytes / 2**20,
                "rank_python_peak_MiB": py_peak / 2**20,
                "global_plan_ms": global_s * 1e3,
                "global_arrays_MiB": global_bytes / 2**20,
                "num_messages": plan.num_messages,
                "num_descs": int(len(plan.descs)),
                "rank_rounds": len(rs.rounds),
                "num_rounds": rs.num_rounds,
                "rank_chunks": sum(len(r.sends) + len(r.recvs) for r in rs.rounds),
            }
        )
        r = rows[-1]
        print(
            f"{name:14} {world:5d} {src_s:>13} -> {dst_s:<14} {mode:9} rpn={rpn}: rank {rank} "
            f"plan {r['rank_plan_ms']:6.1f} + sched {r['rank_schedule_ms']:6.1f} ms "
            f"(goal {r['goal_ms']:.0f}); C++ {r['rank_cpp_MiB']:.1f} MiB vs global "
            f"{r['global_arrays_MiB']:.1f} MiB; {r['num_messages']} msgs {r['num_descs']} descs",
            flush=True,
        )
    cols = (
        "model ranks src dst mode ranks_per_node worst_rank rank_plan_ms rank_schedule_ms "
        "rank_total_ms rank_cpu_ms goal_ms rank_cpp_MiB rank_python_peak_MiB global_arrays_MiB "
        "global_plan_ms num_messages num_descs rank_rounds num_rounds"
    ).split()
    paths = write_results(
        "plan",
        hardware_tag("cpu"),
        rows,
        columns=cols,
        title="Per-rank plan + schedule, 16 ... 1024 ranks (fp16 7B/70B, bf16 405B)",
        notes="Per rank: cold plan_realloc (every cache cleared) + rank_schedule (C++) for the "
        "first, a middle and the last rank; the slowest of the three, median of "
        f"{args.repeats} repeats. rank_cpp_MiB: the C++ side's peak data for that rank "
        "(size summaries of every message + its own descriptors + output); "
        "global_arrays_MiB: the whole plan's arrays, which every rank held before. "
        "rank_cpu_ms: the process CPU time of the same rank's plan + schedule (median): "
        "what the other jobs' time slices do not inflate, unlike the wall times. "
        "Shared 2-core machine (4-5 agents): timings are noisy."
        + (f" {args.note}" if args.note else ""),
    )
    print("wrote", *paths)


if __name__ == "__main__":
    main()
