# Every plan plan_search returns passes the trainer's batch rules: the rules are
# declared once in real_py/dataflow/rules.py, asked by rlhf/config/checks.py validate and by the
# search's candidate options (search/problem.py). A failure points to one of those three.
import math
import random

import pytest

from real_py.dataflow.rules import call_rule_errors
from real_py.rlhf import config as CF
from real_py.search import Workload, plan_search
from real_py.search.graph import PPO_GRAPH
from real_py.search.hardware import HardwareProfile

pytestmark = pytest.mark.timeout(600)
TRAINS = {c.name: c.kind == "train" for c in PPO_GRAPH}


def _check(plan, wl):
    for name, layout in plan.calls.items():
        errs = call_rule_errors(
            name,
            TRAINS[name],
            False,
            layout.dp,
            wl.batch_size,
            wl.ppo_minibatches,
            wl.micro_batches,
            wl.group_size,
        )
        assert not errs, f"{wl}: {errs}"


def test_known_h100_failure_now_valid():
    wl = Workload(batch_size=100, gen_len=512, ppo_minibatches=4)
    res = plan_search(
        "llama2-7b", "llama2-7b", num_gpus=8, hardware="h100", workload=wl, time_budget=2, chains=1
    )
    assert math.isfinite(res.iter_time)
    _check(res.plan, wl)


@pytest.mark.parametrize("seed", range(4))
def test_random_settings_every_plan_passes_the_rules(seed):
    rng = random.Random(seed)
    wl = Workload(
        batch_size=rng.choice([24, 36, 48, 60, 100, 120]),
        gen_len=rng.choice([128, 512]),
        ppo_minibatches=rng.choice([1, 2, 3, 4]),
        micro_batches=rng.choice([1, 2]),
    )
    gpus = rng.choice([4, 8])
    res = plan_search(
        "llama2-7b",
        "llama2-7b",
        num_gpus=gpus,
        hardware="h100",
        workload=wl,
        time_budget=1,
        chains=1,
    )
    _check(res.plan, wl)


@pytest.mark.parametrize("batch,mini", [(12, 4), (8, 2), (12, 3)])
def test_tiny_cpu_searched_plan_validates(tmp_path, batch, mini):
    cfg = CF.from_dict({"data": {"batch_size": batch}, "ppo": {"mini_batches": mini}})
    models = cfg.model_configs()
    p = cfg.ppo
    wl = Workload(
        batch_size=batch,
        prompt_len=cfg.data.max_prompt_len,
        gen_len=cfg.generation.max_new_tokens,
        ppo_epochs=p.ppo_epochs,
        ppo_minibatches=p.mini_batches,
        micro_batches=p.micro_batches,
    )
    hw = HardwareProfile(
        name="lat",
        flops_eff=1.0,
        hbm_eff=1.0,
        mem_bytes=8e9,
        mem_usable=0.5,
        ranks_per_node=64,
        peak_flops=20e9,
        hbm_bw=10e9,
        intra_bw=1e9,
        inter_bw=1e9,
        intra_lat=2e-3,
        inter_lat=2e-3,
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
    path = tmp_path / "plan.json"
    res.plan.save(str(path))
    cfg2 = CF.from_dict(
        {"data": {"batch_size": batch}, "ppo": {"mini_batches": mini}, "plan": {"path": str(path)}}
    )
    CF.validate(
        cfg2, 4
    )  # raises ValueError if the trainer would refuse the plan (idle ranks included)


def test_no_plan_names_the_rule_per_mesh_size():
    with pytest.raises(
        ValueError, match=r"meets the batch rules.*1 devices: .*ppo.mini_batches=4.*4 devices: "
    ):
        plan_search(
            "llama2-7b",
            "llama2-7b",
            num_gpus=4,
            hardware="h100",
            workload=Workload(batch_size=6, ppo_minibatches=4),
            time_budget=1,
            chains=1,
        )


def test_estimate_refuses_a_plan_that_breaks_a_rule_naming_it():
    from real_py.dataflow.execplan import ExecutionPlan
    from real_py.layout import Layout
    from real_py.search import estimate

    lay = Layout(dp=4, tp=1, pp=1, ranks=(0, 1, 2, 3))
    plan = ExecutionPlan(world_size=4, ranks_per_node=4, calls={c.name: lay for c in PPO_GRAPH})
    # 6 rows over dp=4 breaks the divisibility rule for every call; the first named is the first
    # call.
    with pytest.raises(
        ValueError,
        match=r"breaks a batch rule: call actor_gen: dp=4 does not divide data.batch_size=6",
    ):
        estimate(plan, "llama2-7b", "llama2-7b", workload=Workload(batch_size=6))
    ok = estimate(
        plan, "llama2-7b", "llama2-7b", workload=Workload(batch_size=8, ppo_minibatches=2)
    )
    assert all(math.isfinite(c["seconds"]) and c["seconds"] > 0 for c in ok["calls"].values())


def _bench_settings():
    import os
    import sys

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    )
    import bench_search

    return bench_search.settings(False)


@pytest.mark.parametrize("i", range(18))
def test_every_bench_search_setting_returns_a_plan_that_passes_the_rules(i):
    # The settings of bench/bench_search.py, searched briefly: the rules hold for any plan returned,
    # whatever the budget, since rule-breaking layouts are never candidates.
    settings = _bench_settings()
    assert len(settings) == 18, "bench/bench_search.py settings changed: update the range"
    _theme, actor, critic, n, wl = settings[i]
    res = plan_search(
        actor, critic, num_gpus=n, hardware="h100", workload=wl, time_budget=0.5, chains=1
    )
    _check(res.plan, wl)


def test_no_plan_for_memory_names_the_need_per_mesh_size():
    # 70B actor + 70B critic on 2 H100s: no layout fits; each mesh size is named with its need.
    with pytest.raises(
        ValueError,
        match=r"per mesh size: 1 devices: call actor_gen: memory, needs [0-9.]+ GiB .*; "
        r"2 devices: call \w+: memory, needs",
    ):
        plan_search(
            "llama2-70b", "llama2-70b", num_gpus=2, hardware="h100", time_budget=1, chains=1
        )


@pytest.mark.dist
@pytest.mark.timeout(500)
def test_cpu_searched_plan_trains_two_steps_through_the_cli(tmp_path):
    # A 4-rank CPU setting (batch 12, mini_batches 4): the searched plan file goes
    # through `python -m real_py train plan.path=FILE` on 4 gloo ranks and runs two steps.
    import json
    import os
    import subprocess
    import sys

    over = {
        "data": {"batch_size": 12},
        "ppo": {"mini_batches": 4, "ppo_epochs": 1},
        "generation": {"max_new_tokens": 6},
    }
    cfg = CF.from_dict(over)
    models = cfg.model_configs()
    p = cfg.ppo
    wl = Workload(
        batch_size=12,
        prompt_len=cfg.data.max_prompt_len,
        gen_len=6,
        ppo_epochs=1,
        ppo_minibatches=4,
        micro_batches=p.micro_batches,
    )
    hw = HardwareProfile(
        name="lat",
        flops_eff=1.0,
        hbm_eff=1.0,
        mem_bytes=8e9,
        mem_usable=0.5,
        ranks_per_node=64,
        peak_flops=20e9,
        hbm_bw=10e9,
        intra_bw=1e9,
        inter_bw=1e9,
        intra_lat=2e-3,
        inter_lat=2e-3,
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
    path = tmp_path / "plan.json"
    res.plan.save(str(path))
    out = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "real_py",
            "train",
            "data.batch_size=12",
            "ppo.mini_batches=4",
            "ppo.ppo_epochs=1",
            "generation.max_new_tokens=6",
            f"plan.path={path}",
            "steps=2",
            "save_every=0",
            "--out-dir",
            str(out),
            "--no-progress",
            "--timeout",
            "120",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=450,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert len(rows) == 2, rows


@pytest.mark.dist
@pytest.mark.timeout(500)
def test_searched_plan_with_idle_ranks_trains_as_returned(tmp_path):
    """The README's own-model flow: a 2-layer Qwen3 actor (hidden 64, vocab 64) and a LLaMA reward
    model written with transformers, `search --model <dir> --critic <dir> --gpus 4 --hardware cpu
    --out plan.json`, then `train` with `plan: {path: plan.json}` and nothing else about the plan.
    The cpu profile is a fixed one placed in REAL_PY_CACHE (no calibration), with collectives so
    slow that the best plan keeps every call on one rank: the search says which ranks it left idle
    and why, records them in the plan, and train runs the plan as returned."""
    import dataclasses
    import json
    import os
    import platform
    import subprocess
    import sys

    import torch
    import transformers as T

    from real_py.calibrate.measure import DEFAULT
    from real_py.calibrate.profiles import CACHE_VERSION

    torch.manual_seed(0)
    T.Qwen3ForCausalLM(
        T.Qwen3Config(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=2,
            vocab_size=64,
            max_position_embeddings=64,
        )
    ).save_pretrained(tmp_path / "actor")
    T.LlamaForSequenceClassification(
        T.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=64,
            max_position_embeddings=64,
            num_labels=1,
            pad_token_id=0,
        )
    ).save_pretrained(tmp_path / "rm")
    hw = HardwareProfile(
        name="slow-links",
        flops_eff=1.0,
        hbm_eff=1.0,
        mem_bytes=8e9,
        mem_usable=0.5,
        ranks_per_node=64,
        peak_flops=20e9,
        hbm_bw=10e9,
        intra_bw=1e9,
        inter_bw=1e9,
        intra_lat=0.5,
        inter_lat=0.5,
    )
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cpu_profile.json").write_text(
        json.dumps(
            {
                "machine": platform.node(),
                "version": CACHE_VERSION,
                "setup": dataclasses.asdict(DEFAULT),
                "measured": {},
                "profile": dataclasses.asdict(hw),
            }
        )
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, REAL_PY_CACHE=str(cache))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "real_py",
            "search",
            "--model",
            str(tmp_path / "actor"),
            "--critic",
            str(tmp_path / "rm"),
            "--gpus",
            "4",
            "--hardware",
            "cpu",
            "--batch-size",
            "8",
            "--prompt-len",
            "8",
            "--gen-len",
            "4",
            "--ppo-minibatches",
            "2",
            "--ppo-epochs",
            "2",
            "--time-budget",
            "2",
            "--out",
            str(tmp_path / "plan.json"),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    used = sorted({x for c in plan["calls"].values() for x in c["ranks"]})
    assert plan["world_size"] == 4 and used == [0] and plan["idle_ranks"] == [1, 2, 3], plan
    assert (
        "ranks [1, 2, 3] of 4 left idle: spreading the calls over them did not lower the estimate"
        in r.stdout
    )
    # The user's config names the checkpoints and the plan file (relative to the config's folder).
    (tmp_path / "cfg.yaml").write_text(
        "actor_path: actor\ncritic_path: rm\nreward_path: rm\n"
        "data: {batch_size: 8}\ngeneration: {max_new_tokens: 4}\n"
        "plan: {path: plan.json}\nsteps: 2\nsave_every: 0\n"
    )
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "real_py",
            "train",
            "--config",
            str(tmp_path / "cfg.yaml"),
            "--out-dir",
            str(out),
            "--no-progress",
            "--timeout",
            "120",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (
        "leaves ranks [1, 2, 3] of 4 without a call (recorded in the plan's idle_ranks" in r.stdout
    )
    rows = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert len(rows) == 2, rows
