"""The torch.distributed calls inside given runtime calls of one step, per rank (start+duration ms
from the call's first start), from bench/trace/collectives' records ($COUNT_DIR, default /tmp/count).

    COUNT_DIR=/tmp/count .venv/bin/python bench/trace/analyze_collectives.py 5 ref_inf,rew_inf,critic_inf
"""
import json, glob, os, sys
step = int(sys.argv[1]); calls = sys.argv[2].split(",")
logs = {}
for p in glob.glob(os.path.join(os.environ.get("COUNT_DIR", "/tmp/count"), "r*.json")):
    L = json.load(open(p))
    ev = [x for x in L if x[2] == "EVENTS"]
    rank = ev[0][3][0][0] if ev and ev[0][3] else None
    logs[rank] = L
for c in calls:
    rows = {r: [x for x in L if x[0] == step and x[1] == c] for r, L in logs.items()}
    ev = {r: [e for x in L if x[0] == step and x[2] == "EVENTS" for e in x[3] if e[1] == c] for r, L in logs.items()}
    base = min(x[3] for r in rows for x in rows[r] if x[2] == "CALL")
    print(c)
    for r in sorted(rows):
        e = ev[r][0] if ev[r] else None
        s = f"  r{r} work {(e[2]-base)*1e3:6.2f}-{(e[3]-base)*1e3:6.2f} |" if e else f"  r{r} |"
        for x in rows[r]:
            if x[2] != "CALL":
                s += f" {x[2][:6]} {(x[3]-base)*1e3:.1f}+{(x[4]-x[3])*1e3:.1f}"
        print(s)
