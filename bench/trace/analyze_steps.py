"""Each rank's step entry and call spans from bench/trace/steps' records ($TRACE_DIR, default
/tmp/trace; 4 ranks, steps 2-7 of an 8-step run), ms from the step's first entry.

    TRACE_DIR=/tmp/trace .venv/bin/python bench/trace/analyze_steps.py
"""
import json, os
T = {r: [json.loads(l) for l in open(os.path.join(os.environ.get("TRACE_DIR", "/tmp/trace"), f"rank{r}.jsonl"))] for r in range(4)}
for s in range(2, 8):
    base = min(T[r][s]["in"] for r in range(4))
    print(f"step {s}: iteration in " + " ".join(f"r{r}:{(T[r][s]['in']-base)*1e3:5.1f}" for r in range(4)),
          " prev out " + " ".join(f"r{r}:{(T[r][s-1]['out']-base)*1e3:6.1f}" for r in range(4)))
    calls = {}
    for r in range(4):
        for _, name, a, b in T[r][s]["events"]:
            calls.setdefault(name, {})[r] = (a - base, b - base)
    for name, d in calls.items():
        print(f"   {name:13s} " + " ".join(f"r{r}:{a*1e3:6.1f}-{b*1e3:6.1f}" for r, (a, b) in sorted(d.items())))
