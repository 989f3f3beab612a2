"""Rank 0's per-step logging cost alone: RunLog.log (metrics.jsonl + TensorBoard scalars) on a
record the size of the default job's, 20 steps (bench/results/trace_cpu2_20261204.md).

    .venv/bin/python bench/tools/runlog_cost.py
"""
import tempfile, time
from real_py.rlhf.observe import RunLog
log = RunLog(tempfile.mkdtemp(), wandb=None, config={})
rec = {"step": 1, "seconds": 0.2, "metrics": {f"m{i}": 0.1 * i for i in range(30)}, "calls": {f"c{i}": 0.01 for i in range(6)},
       "realloc_seconds": {"actor": 0.01}, "realloc_bytes": 100, "offload_seconds": {}, "offload_bytes": 0, "data_bytes": 10, "peak_mem_mib": {}}
ts = []
for s in range(20):
    rec["step"] = s + 1
    t = time.perf_counter(); log.log(rec); ts.append(time.perf_counter() - t)
print("RunLog.log ms per step:", " ".join(f"{x * 1e3:.2f}" for x in ts))
