# Every plan plan_search returns passes the trainer's batch rules (issue 25 item 1): the rules are
# declared once in real_py/rlhf/plan_rules.py, asked by rlhf/config/checks.py validate and by the
# search's candidate options (search/problem.py). A failure points to one of those three.
import math
import random

import pytest

from real_py.rlhf import config as CF
from real_py.rlhf.plan_rules import call_rule_errors
from real_py.search import Workload, plan_search
from real_py.search.graph import PPO_GRAPH
from real_py.search.hardware import HardwareProfile

pytestmark = pytest.mark.timeout(600)
TRAINS = {c.name: c.kind == "train" for c in PPO_GRAPH}


def _check(plan, wl):
    for name, layout in plan.calls.items():
        errs = call_rule_errors(name, TRAINS[name], False, layout.dp, wl.batch_size, wl.ppo_minibatches,
                                wl.micro_batches, wl.group_size)
        assert not errs, f"{wl}: {errs}"


def test_known_h100_failure_now_valid():
    wl = Workload(batch_size=100, gen_len=512, ppo_minibatches=4)
    res = plan_search("llama2-7b", "llama2-7b", num_gpus=8, hardware="h100", workload=wl, time_budget=2, chains=1)
    assert math.isfinite(res.iter_time)
    _check(res.plan, wl)


@pytest.mark.parametrize("seed", range(4))
def test_random_settings_every_plan_passes_the_rules(seed):
    rng = random.Random(seed)
    wl = Workload(batch_size=rng.choice([24, 36, 48, 60, 100, 120]), gen_len=rng.choice([128, 512]),
                  ppo_minibatches=rng.choice([1, 2, 3, 4]), micro_batches=rng.choice([1, 2]))
    gpus = rng.choice([4, 8])
    res = plan_search("llama2-7b", "llama2-7b", num_gpus=gpus, hardware="h100", workload=wl, time_budget=1, chains=1)
    _check(res.plan, wl)


@pytest.mark.parametrize("batch,mini", [(12, 4), (8, 2), (12, 3)])
def test_tiny_cpu_searched_plan_validates(tmp_path, batch, mini):
    cfg = CF.from_dict({"data": {"batch_size": batch}, "ppo": {"mini_batches": mini}})
    models = cfg.model_configs()
    p = cfg.ppo
    wl = Workload(batch_size=batch, prompt_len=cfg.data.max_prompt_len, gen_len=cfg.generation.max_new_tokens,
                  ppo_epochs=p.ppo_epochs, ppo_minibatches=p.mini_batches, micro_batches=p.micro_batches)
    hw = HardwareProfile(name="lat", flops_eff=1.0, hbm_eff=1.0, mem_bytes=8e9, mem_usable=0.5, ranks_per_node=64,
                         peak_flops=20e9, hbm_bw=10e9, intra_bw=1e9, inter_bw=1e9, intra_lat=2e-3, inter_lat=2e-3)
    res = plan_search(models["actor"], models["critic"], num_gpus=4, hardware=hw, workload=wl,
                      dtype=models["actor"].dtype, time_budget=1.0, seed=0)
    path = tmp_path / "plan.json"
    res.plan.save(str(path))
    cfg2 = CF.from_dict({"data": {"batch_size": batch}, "ppo": {"mini_batches": mini},
                         "plan": {"path": str(path)}, "allow_idle_ranks": True})
    CF.validate(cfg2, 4)  # raises ValueError if the trainer would refuse the plan


def test_no_plan_names_the_rule_per_mesh_size():
    with pytest.raises(ValueError, match=r"meets the batch rules.*1 devices: .*ppo.mini_batches=4.*4 devices: "):
        plan_search("llama2-7b", "llama2-7b", num_gpus=4, hardware="h100",
                    workload=Workload(batch_size=6, ppo_minibatches=4), time_budget=1, chains=1)


def test_every_bench_setting_returns_a_valid_plan():
    """Every setting of bench/bench_search.py (standard and long-context, 8-128 GPUs): the
    searched plan passes the rules the trainer enforces (short budget: feasibility, not quality)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_search

    for theme, actor, critic, n, wl in bench_search.settings(quick=False):
        res = plan_search(actor, critic, num_gpus=n, hardware="h100", workload=wl, time_budget=0.5,
                          chains=1, seed=0, per_mesh=2)
        assert math.isfinite(res.iter_time), (theme, actor, critic, n)
        _check(res.plan, wl)


def test_searched_cpu_plan_runs_two_steps(tmp_path):
    """The 4-rank CPU setting with batch 12 and mini_batches 4 (refused by the trainer before
    issue 25): its searched plan runs two steps through `python -m real_py train`."""
    import json
    import subprocess
    import sys

    batch, mini = 12, 4
    cfg = CF.from_dict({"data": {"batch_size": batch}, "ppo": {"mini_batches": mini}})
    models, p = cfg.model_configs(), cfg.ppo
    wl = Workload(batch_size=batch, prompt_len=cfg.data.max_prompt_len, gen_len=cfg.generation.max_new_tokens,
                  ppo_epochs=p.ppo_epochs, ppo_minibatches=p.mini_batches, micro_batches=p.micro_batches)
    res = plan_search(models["actor"], models["critic"], num_gpus=4, hardware="cpu", workload=wl,
                      dtype=models["actor"].dtype, time_budget=2.0, seed=0)
    plan = tmp_path / "plan.json"
    res.plan.save(str(plan))
    root = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "real_py", "train", "--out-dir", str(tmp_path / "run"),
                          "--no-progress", "--timeout", "120", "steps=2", "save_every=0",
                          f"data.batch_size={batch}", f"ppo.mini_batches={mini}", f"plan.path={plan}",
                          "allow_idle_ranks=true"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2], steps
