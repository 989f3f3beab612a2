"""Trace hook (this folder on PYTHONPATH, TRACE_DIR set): each rank appends one JSON line per
iteration to $TRACE_DIR/rank<r>.jsonl: its entry and exit time and its own (call, start, end)
events. Read by bench/trace/analyze_steps.py; run through bench/trace/run_plan.py."""
import os, json, time
if os.environ.get("TRACE_DIR"):
    try:
        import real_py.rlhf.runtime as R
        _orig = R.Runtime.iteration
        def iteration(self, step):
            t_in = time.time()
            out = _orig(self, step)
            t_out = time.time()
            mine = [e for e in out["events"] if e[0] == self.rank]
            with open(os.path.join(os.environ["TRACE_DIR"], f"rank{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "in": t_in, "out": t_out, "events": mine}) + "\n")
            return out
        R.Runtime.iteration = iteration
    except Exception as e:
        print("tracehook failed", e)
