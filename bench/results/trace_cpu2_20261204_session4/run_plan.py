import sys, os, json, tempfile
sys.path.insert(0, "bench")
from bench_estimator import _all, run, PLANS
import bench_rlhf
plan = PLANS[sys.argv[1]]
with tempfile.TemporaryDirectory() as tmp:
    recs = run(plan, 8, tmp, "t")
