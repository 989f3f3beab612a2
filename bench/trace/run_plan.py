"""Run `python -m real_py train` (default config, 8 steps) with one of bench_estimator's plans, for a
trace hook to record: a bench/trace/<hook>/ folder on PYTHONPATH reaches every rank.

    mkdir -p /tmp/trace && TRACE_DIR=/tmp/trace PYTHONPATH=bench/trace/steps \
        .venv/bin/python bench/trace/run_plan.py "all dp4tp1pp1"

Plans: the names of bench_estimator.PLANS ("default", "all dp1tp2pp2", "all dp2tp2pp1",
"all dp2tp1pp2", "all dp4tp1pp1"). Report: bench/results/trace_cpu2_20261204.md.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_estimator import PLANS  # noqa: E402
from bench_rlhf import run  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in PLANS:
        raise SystemExit(f"usage: run_plan.py PLAN; PLAN one of {sorted(PLANS)}")
    with tempfile.TemporaryDirectory() as tmp:
        run(PLANS[sys.argv[1]], 8, tmp, "t")
