"""The self-consistency figures of ../estimator_rescore_cpu2_20261205_pipewait.md: each recorded raw
calibration of the seven runs fitted alone, the model asked for that calibration's own pp=2
inference pass (phase A: one pipeline on 2 cores; phase B: two), measured / estimated, median.
Run from the repository root: python bench/results/estimator_rescore_cpu2_20261205_pipewait/selfcheck.py"""
import json, statistics
from real_py.search.calibrate import DEFAULT as cal, _profile
from real_py.search.costmodel import call_time, Workload, Mesh
from real_py.spec import model_spec

RUNS = "80e8251 0e1a257 40e1330 cc63b6c 2b7d73d 731026a 673d535".split()
one = Workload(batch_size=cal.rows, prompt_len=cal.prompt, gen_len=cal.seq - cal.prompt, ppo_minibatches=1, runtime_micro_batches=True)
two = Workload(batch_size=2 * cal.rows, prompt_len=cal.prompt, gen_len=cal.seq - cal.prompt, ppo_minibatches=1, runtime_micro_batches=True)
m4 = model_spec(cal.config(4))
a, b = [], []
for h in RUNS:
    d = json.load(open(f"bench/results/estimator_cpu2_20261204_commit{h}.json"))
    for v in d["extra"]["calibration_raw"].values():
        for raw in v["default"]:
            hw = _profile(raw, cal)
            a.append(raw["pp2_inf_4"] / call_time("inference", m4, Mesh(0, 2), 1, 1, 2, hw, one)["total"])
            b.append(raw["pp2busy_inf_4"] / call_time("inference", m4, Mesh(0, 4), 2, 1, 2, hw, two)["total"])
print(f"{len(a)} calibrations; pp=2 inference measured/estimated, median: phase A {statistics.median(a):.3f}, phase B {statistics.median(b):.3f}")
