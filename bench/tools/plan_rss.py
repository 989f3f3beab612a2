"""Resident memory of one rank's plan + own schedule, measured in a fresh process per case.

    python bench/tools/plan_rss.py [--cases 405b-1024,70b-128]

bench/bench_plan.py reports the C++ arrays a rank keeps (RankSchedule.held_bytes) and the Python
allocations (tracemalloc peak); this tool measures what the operating system sees: each case runs
in a new interpreter that imports everything, resets the peak RSS (/proc/self/clear_refs, "5"),
then builds one rank's cold plan + schedule exactly as bench_plan.one_rank does and reads
/proc/self/status: VmHWM - VmRSS before = the peak growth while building; VmRSS after, with the
plan and schedule alive, then with only the schedule (resident: glibc keeps freed blocks), then
after malloc_trim(0) (what is live), then with nothing kept. Prints one JSON line per case and a
table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {
    "70b-128": ("llama2-70b", "dp1,tp8,pp16", "dp32,tp4,pp1", "p2p", 8, 67),
    "405b-512": ("llama3.1-405b", "dp4,tp8,pp16", "dp64,tp8,pp1", "p2p", 8, 259),
    "405b-1024": ("llama3.1-405b", "dp8,tp8,pp16", "dp128,tp8,pp1", "p2p", 8, 1023),
}


def _status() -> dict:
    with open("/proc/self/status") as f:
        return {
            k: int(v.split()[0]) * 1024
            for k, v in (line.split(":", 1) for line in f)
            if k in ("VmRSS", "VmHWM")
        }


def _one(case: str) -> dict:
    import gc

    sys.path.insert(0, os.path.dirname(HERE))
    import bench_plan as B

    from real_py import Layout

    name, src_s, dst_s, mode, rpn, rank = CASES[case]
    model, src, dst = B.spec(name), Layout.parse(src_s), Layout.parse(dst_s)
    B.clear_caches()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status()
    plan, rs, *_ = B.one_rank(model, src, dst, mode, rpn, rank)
    after = _status()
    held = rs.held_bytes
    B.clear_caches()
    del plan
    gc.collect()
    only_schedule = _status()
    # Freed memory the allocator keeps for reuse stays resident: hand it back to measure what is
    # live.
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    trimmed = _status()
    del rs
    gc.collect()
    libc.malloc_trim(0)
    none = _status()
    MiB = 2**20
    return {
        "case": case,
        "model": name,
        "src": src_s,
        "dst": dst_s,
        "rank": rank,
        "peak_growth_MiB": (after["VmHWM"] - before["VmRSS"]) / MiB,
        "kept_with_plan_MiB": (after["VmRSS"] - before["VmRSS"]) / MiB,
        "kept_schedule_only_MiB": (only_schedule["VmRSS"] - before["VmRSS"]) / MiB,
        "live_schedule_MiB": (trimmed["VmRSS"] - before["VmRSS"]) / MiB,
        "after_all_freed_MiB": (none["VmRSS"] - before["VmRSS"]) / MiB,
        "cpp_held_MiB": held / MiB,
        "baseline_rss_MiB": before["VmRSS"] / MiB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per case")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one)))
        return
    rows = []
    for case in args.cases.split(","):
        for _ in range(args.repeats):
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", case],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    sys.path.insert(0, os.path.dirname(HERE))
    from timing import hardware_tag, write_results

    cols = [
        "case",
        "model",
        "src",
        "dst",
        "rank",
        "peak_growth_MiB",
        "kept_with_plan_MiB",
        "kept_schedule_only_MiB",
        "live_schedule_MiB",
        "after_all_freed_MiB",
        "cpp_held_MiB",
        "baseline_rss_MiB",
    ]
    paths = write_results(
        "plan_rss",
        hardware_tag("cpu"),
        rows,
        columns=cols,
        title="Resident memory of one rank's cold plan + own schedule (fresh process per row)",
        notes="peak_growth_MiB: VmHWM after the build minus VmRSS before it (peak reset with "
        "/proc/self/clear_refs); kept_with_plan_MiB / kept_schedule_only_MiB: VmRSS growth with "
        "the plan and schedule alive / with the schedule only (glibc keeps freed blocks resident); "
        "live_schedule_MiB: the same after malloc_trim(0), i.e. what the rank really keeps; "
        "after_all_freed_MiB: nothing kept, after malloc_trim (import-time caches). cpp_held_MiB: "
        "RankSchedule.held_bytes, the C++ side's own peak accounting that bench_plan.py reports "
        "(rank_cpp_MiB). Each case in a new interpreter, as bench_plan.one_rank builds it.",
    )
    print("wrote", *paths)
    print(
        "| case | rank | peak RSS growth MiB | resident after (plan + schedule) MiB | "
        "resident, schedule only MiB | schedule only, after malloc_trim MiB | "
        "all freed + trim MiB | C++ held MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['rank']} | {r['peak_growth_MiB']:.1f} | "
            f"{r['kept_with_plan_MiB']:.1f} | {r['kept_schedule_only_MiB']:.1f} | "
            f"{r['live_schedule_MiB']:.1f} | {r['after_all_freed_MiB']:.1f} | "
            f"{r['cpp_held_MiB']:.2f} |"
        )


if __name__ == "__main__":
    main()
