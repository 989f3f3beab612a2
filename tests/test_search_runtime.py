# Checks that the PPO runtime runs a plan found by plan_search: search a plan for the default train
# config's tiny models on 4 CPU ranks, write plan.json, run one training iteration with
# `plan: {path: plan.json}` on 4 gloo ranks, compare the runtime's per-call layouts with the
# searched plan's.
# A failure points to real_py/search (a plan the runtime cannot run: meshes, strategies, JSON) or to
# real_py/rlhf/config/ / runtime.py (loading a plan from a file, building the call groups).
"""The search uses fixed hand-written CPU profiles, not the calibrated `cpu` one: the test must
not depend on this machine's speed or write the profile cache. Two profiles, two kinds of plan:
with gloo-like latency (ms per message) the search puts every call on rank 0 and leaves ranks
1-3 idle; with cheap communication and slow compute it spreads every call over all 4 ranks."""

import json
import math

import pytest

from real_py.dataflow.execplan import ExecutionPlan
from real_py.rlhf import config as CF
from real_py.rlhf.runtime import Runtime
from real_py.search import Workload, plan_search
from real_py.search.hardware import HardwareProfile
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

PROFILES = {
    "latency-bound": dict(
        peak_flops=20e9, hbm_bw=10e9, intra_bw=1e9, inter_bw=1e9, intra_lat=2e-3, inter_lat=2e-3
    ),
    "compute-bound": dict(
        peak_flops=1e8, hbm_bw=1e12, intra_bw=1e11, inter_bw=1e11, intra_lat=1e-6, inter_lat=1e-6
    ),
}


def _worker(rank, world, cases):
    out = {}
    for name, cfg_dict in cases.items():
        cfg = CF.from_dict(cfg_dict)
        plan, graph, models = CF.validate(cfg, world)
        rt = Runtime(cfg, plan, graph, models, timeout_s=60)
        it = rt.iteration(0)
        it.pop("store", None)
        layouts = {n: rt.groups[n].layout for n in graph.order}
        out[name] = {"layouts": layouts, "calls": it["calls"], "metrics": it["metrics"]}
    return out


@pytest.mark.timeout(120)
def test_runtime_runs_searched_plan(tmp_path):
    cfg = CF.from_dict({})
    models = cfg.model_configs()
    p = cfg.ppo
    wl = Workload(
        batch_size=cfg.data.batch_size,
        prompt_len=cfg.data.max_prompt_len,
        gen_len=cfg.generation.max_new_tokens,
        ppo_epochs=p.ppo_epochs,
        ppo_minibatches=p.mini_batches,
    )
    searched, cases = {}, {}
    for name, kw in PROFILES.items():
        hw = HardwareProfile(
            name=name,
            flops_eff=1.0,
            hbm_eff=1.0,
            mem_bytes=8e9,
            mem_usable=0.5,
            ranks_per_node=64,
            **kw,
        )
        res = plan_search(
            models["actor"],
            models["critic"],
            num_gpus=4,
            hardware=hw,
            workload=wl,
            dtype=models["actor"].dtype,
            time_budget=1.0,
            seed=0,
        )
        assert math.isfinite(res.iter_time), name
        path = tmp_path / f"{name}.json"
        res.plan.save(str(path))
        assert ExecutionPlan.from_json(json.loads(path.read_text())).calls == res.plan.calls, name
        searched[name] = res.plan
        cases[name] = {
            "steps": 1,
            "save_every": 0,
            "plan": {"path": str(path)},
            "allow_idle_ranks": True,
        }
    out = run_distributed(_worker, 4, cases, timeout=90)
    for rank, per in enumerate(out):
        for name, plan in searched.items():
            r = per[name]
            assert r["layouts"] == plan.calls, (
                f"{name}, rank {rank}: runtime layouts differ from the searched plan"
            )
            assert set(r["calls"]) == set(plan.calls), (
                f"{name}, rank {rank}: calls run {sorted(r['calls'])}"
            )
            assert r["metrics"] and all(math.isfinite(v) for v in r["metrics"].values()), (
                f"{name}, rank {rank}: metrics {r['metrics']}"
            )
