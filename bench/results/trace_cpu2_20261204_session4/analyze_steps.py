import json, sys
T = {r: [json.loads(l) for l in open(f"/tmp/trace/rank{r}.jsonl")] for r in range(4)}
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
