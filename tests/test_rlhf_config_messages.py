# Checks that configs which fail, or run other than their author expects, say so before launch with
# the cause and a fix that works: a causal-LM reward_path or critic_path, keys the algorithm cannot
# use (critic_path with a critic-free algorithm: refused), keys the reward kind ignores, a searched
# plan run with other batch settings than it was searched for, more ranks than cores or GPUs, and
# the legend of the step line's kl.
# A failure points to real_py/rlhf/config/ (files.py check_checkpoints, checks.py
# _check_searched_for, notes.py, host_memory.py), real_py/dataflow/execplan.py (searched_for) or
# real_py/cli/train.py (_config, _before_launch).
import os

import pytest
import torch

from real_py.cli import main
from real_py.cli import train as cli_train
from real_py.interop.hf import save_hf
from real_py.rlhf import config as CF
from real_py.rlhf.models import init_weights


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A causal-LM HF checkpoint of the default actor's shape (no value head)."""
    path = str(tmp_path_factory.mktemp("ckpt") / "lm")
    a = CF.from_dict({}).model_configs()["actor"]
    save_hf(path, a, init_weights(a, 1))
    return path


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(cli_train, "_launch", lambda args, world: 0)


def test_causal_lm_reward_path_names_the_real_fix(lm):
    with pytest.raises(ValueError) as e:
        CF.validate(CF.from_dict({"reward_path": lm}), 4)
    msg = str(e.value)
    assert (
        f"reward_path='{lm}' is not a reward model: it has no value head 'score.weight'" in msg
    ), msg
    assert (
        "critic_init gives only the critic a fresh head" in msg and "reward: {kind: function" in msg
    ), msg
    # Following the old hint (critic_init) is refused naming why it cannot help.
    with pytest.raises(ValueError, match="it applies to the critic only, never to reward_path"):
        CF.from_dict({"reward_path": lm, "critic_init": "zero"})
    # The fix the message names works: a reward function instead of the causal LM.
    CF.validate(CF.from_dict({"reward": {"kind": "rule"}}), 4)


def test_causal_lm_critic_path_suggests_critic_init(lm):
    with pytest.raises(
        ValueError,
        match=r"critic_path='.*lm' has no value head 'score.weight' .*set critic_init: zero",
    ):
        CF.validate(CF.from_dict({"critic_path": lm}), 4)
    CF.validate(CF.from_dict({"critic_path": lm, "critic_init": "zero"}), 4)  # the suggestion works


@pytest.mark.parametrize("algo", ["grpo", "rloo", "remax"])
def test_critic_keys_with_a_critic_free_algorithm_are_refused(lm, algo):
    base = {"algo": algo, "reward": {"kind": "rule"}}
    for keys, named in (
        ({"critic_path": lm}, f"critic_path='{lm}'"),
        ({"critic_path": lm, "critic_init": "zero"}, f"critic_path='{lm}'"),
        ({"critic_init": "normal"}, "critic_init='normal'"),
    ):
        with pytest.raises(ValueError) as e:
            CF.from_dict({**base, **keys})
        key = named.split("=")[0]
        assert str(e.value) == (
            f"config {named} but algo='{algo}' has no critic (critic-free): remove "
            f"{key}, or use algo: ppo to train a critic"
        ), str(e.value)
    # The fixes the message names work: without the critic keys, or PPO with them.
    CF.validate(CF.from_dict(base), 4)
    CF.validate(CF.from_dict({**base, "algo": "ppo", "critic_path": lm, "critic_init": "zero"}), 4)


def test_launcher_refuses_critic_path_with_grpo_before_launch(lm, tmp_path, capsys, no_launch):
    with pytest.raises(SystemExit) as e:
        main(["train", "algo=grpo", f"critic_path={lm}", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert f"critic_path='{lm}' but algo='grpo' has no critic (critic-free)" in err, err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_ignored_keys_and_ranks_over_cores_are_warned(lm, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    notes = CF.notes(
        CF.from_dict(
            {"algo": "grpo", "reward": {"kind": "rule"}, "reward_path": lm, "device": "cpu"}
        ),
        8,
    )
    text = "\n".join(notes)
    assert (
        f"reward_path='{lm}' is ignored: reward.kind='rule' scores without a reward model" in text
    )
    assert (
        "the plan has 8 ranks with calls but this machine gives this process 2 CPU cores: "
        "ranks share cores and the run will be slow "
        "(calls running side by side stretch by up to 4x)"
    ) in text
    assert "python -m real_py search --gpus 2 --hardware cpu" in text
    assert CF.notes(CF.from_dict({"device": "cpu"}), 2) == []


@pytest.fixture(scope="module")
def searched_plan(tmp_path_factory):
    """A GRPO plan searched for the tiny models at 8 rows, 2 mini-batches, 2 epochs, groups of 2."""
    from real_py.search import Workload, plan_search

    models = CF.from_dict({"algo": "grpo", "reward": {"kind": "rule"}}).model_configs()
    wl = Workload(
        batch_size=8, prompt_len=8, gen_len=12, ppo_minibatches=2, ppo_epochs=2, group_size=2
    )
    res = plan_search(
        models["actor"],
        models["critic"],
        num_gpus=4,
        hardware="h100",
        workload=wl,
        dtype=models["actor"].dtype,
        time_budget=1.0,
        algo="grpo",
    )
    path = str(tmp_path_factory.mktemp("plan") / "plan.json")
    res.plan.save(path)
    return path


def test_searched_plan_records_its_batch_settings_and_other_ones_are_refused(
    searched_plan, tmp_path, capsys, no_launch
):
    from real_py.dataflow.execplan import BatchSettings, ExecutionPlan

    plan = ExecutionPlan.from_json(searched_plan)
    assert plan.searched_for == BatchSettings(
        batch_size=8, mini_batches=2, micro_batches=1, ppo_epochs=2, group_size=2
    )
    base = {
        "algo": "grpo",
        "reward": {"kind": "rule"},
        "plan": {"path": searched_plan},
        "data": {"batch_size": 8},
        "ppo": {"mini_batches": 2, "ppo_epochs": 2, "group_size": 2},
    }
    CF.validate(CF.from_dict(base), 4)  # the settings it was searched for
    # Each setting on its own, then two at once: named with the search flag that fixes it.
    for over, named, flag in (
        ({"data": {"batch_size": 16}}, "data.batch_size=16 (searched for 8)", "--batch-size 16"),
        (
            {"ppo": {"mini_batches": 1}},
            "ppo.mini_batches=1 (searched for 2)",
            "--ppo-minibatches 1",
        ),
        (
            {"ppo": {"micro_batches": 2}},
            "ppo.micro_batches=2 (searched for 1)",
            "--micro-batches 2",
        ),
        ({"ppo": {"ppo_epochs": 1}}, "ppo.ppo_epochs=1 (searched for 2)", "--ppo-epochs 1"),
        ({"ppo": {"group_size": 4}}, "ppo.group_size=4 (searched for 2)", "--group-size 4"),
        (
            {"data": {"batch_size": 16}, "ppo": {"group_size": 4}},
            "data.batch_size=16 (searched for 8), ppo.group_size=4 (searched for 2)",
            "--batch-size 16 --group-size 4",
        ),
    ):
        d = {
            **base,
            "data": {**base["data"], **over.get("data", {})},
            "ppo": {**base["ppo"], **over.get("ppo", {})},
        }
        with pytest.raises(ValueError) as e:
            CF.validate(CF.from_dict(d), 4)
        msg = str(e.value)
        assert (
            f"execution plan plan.path='{searched_plan}' was searched for other batch settings "
            f"than the config's: {named}; "
        ) in msg, msg
        assert f"Search again with {flag}, or set" in msg, msg
    # Inline in the config (the JSON pasted under plan:) it is checked the same way.
    inline = dict(base, plan=plan.to_json(), data={"batch_size": 16})
    with pytest.raises(
        ValueError, match=r"the execution plan under plan: was searched for .*data.batch_size=16"
    ):
        CF.validate(CF.from_dict(inline), 4)
    # The launcher refuses it before launch, in one line.
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train",
                "algo=grpo",
                "reward={kind: rule}",
                f"plan.path={searched_plan}",
                "data.batch_size=16",
                "--out-dir",
                str(tmp_path / "run"),
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "other batch settings than the config's: data.batch_size=16 (searched for 8); " in err, (
        err
    )


def test_plan_without_or_with_a_malformed_searched_for(searched_plan):
    from real_py.dataflow.execplan import ExecutionPlan

    data = ExecutionPlan.from_json(searched_plan).to_json()
    # A plan written by hand (no searched_for) runs with any batch settings its rules allow.
    bare = {k: v for k, v in data.items() if k != "searched_for"}
    assert ExecutionPlan.from_json(bare).searched_for is None
    CF.validate(
        CF.from_dict(
            {"algo": "grpo", "reward": {"kind": "rule"}, "plan": bare, "data": {"batch_size": 16}}
        ),
        4,
    )
    with pytest.raises(
        ValueError,
        match=r"searched_for=\{'batch_size': 8\} must map exactly batch_size, "
        "mini_batches, micro_batches, ppo_epochs, group_size",
    ):
        ExecutionPlan.from_json(dict(data, searched_for={"batch_size": 8}))
    with pytest.raises(ValueError, match=r"searched_for.ppo_epochs=0 must be an integer >= 1"):
        ExecutionPlan.from_json(dict(data, searched_for=dict(data["searched_for"], ppo_epochs=0)))


def test_launcher_prints_warnings_and_the_kl_legend(lm, tmp_path, capsys, no_launch):
    assert (
        main(
            [
                "train",
                "algo=grpo",
                "reward={kind: rule}",
                f"reward_path={lm}",
                "--out-dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"warning: reward_path='{lm}' is ignored: reward.kind='rule'" in out, out
    assert (
        "step lines: kl = the k1 estimate of KL(actor || reference), "
        "sum over each response's tokens" in out
    )
    assert "can be negative" in out


def test_local_cuda_job_with_more_ranks_than_gpus_is_refused(
    tmp_path, capsys, monkeypatch, no_launch
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as e:
        main(["train", "device=cuda", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert (
        "the execution plan has 4 ranks but this node has 2 GPUs: "
        "a local launch runs one rank per GPU" in err
    )


def test_models_over_host_memory_are_refused_before_launch(
    tmp_path, capsys, monkeypatch, no_launch
):
    """A 7B-shaped actor on the default 4-rank CPU plan: its train copy with Adam states and the
    dp4 generation copies cannot fit; refused naming the need per model, not killed mid-start-up."""
    from real_py.rlhf.config import host_memory

    monkeypatch.setattr(host_memory, "available_bytes", lambda: 16 << 30)
    big = (
        "{hidden_size: 4096, intermediate_size: 11008, num_hidden_layers: 32, "
        "num_attention_heads: 32, num_key_value_heads: 32, vocab_size: 32000}"
    )
    (tmp_path / "c.yaml").write_text(f"actor: {big}\ncritic: {{vocab_size: 32000}}\n")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(tmp_path / "c.yaml"), "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert (
        "the models need at least 251.6 GiB of memory on this machine (actor 200.8, ref 50.2" in err
    ), err
    assert "but 16.0 GiB is available; use smaller models" in err, err
    CF.validate(CF.from_dict({}), 4)  # the default job fits


def _vllm(plan_calls=None, **kw):
    calls = {
        "actor_gen": {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "pp": 1},
        "ref_inf": {"ranks": [0, 1], "dp": 2, "tp": 1, "pp": 1},
        "rew_inf": {"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1},
        "actor_train": {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "pp": 1},
    }
    calls.update(plan_calls or {})
    gen = kw.pop("generation", {})
    return CF.from_dict(
        {
            "algo": "grpo",
            "reward": {"kind": "rule"},
            "data": {"batch_size": 16},
            "ppo": {"group_size": 4, **kw.pop("ppo", {})},
            "generation": {"engine": "vllm", **gen},
            "plan": {"world_size": 4, "calls": calls},
            **kw,
        }
    )


@pytest.mark.parametrize(
    "gen, why",
    [
        ({"ranks": [0, 1, 2, 3], "dp": 2, "tp": 1, "pp": 2}, "pp=2: vLLM generation runs dp x tp"),
        (
            {"ranks": [0, 1], "dp": 1, "tp": 2, "pp": 1},
            "vLLM generation uses every rank of the world",
        ),
        (
            {"ranks": [1, 0, 3, 2], "dp": 2, "tp": 2, "pp": 1},
            "vLLM generation uses every rank of the world",
        ),
    ],
)
def test_vllm_generation_layouts_vllm_cannot_run_are_refused_before_launch(gen, why):
    cfg = _vllm({"actor_gen": gen}, allow_idle_ranks=True)
    with pytest.raises(ValueError, match="generation.engine: vllm cannot run actor_gen") as e:
        CF.validate(cfg, 4)
    assert why in str(e.value), str(e.value)


def test_a_searched_plan_vllm_cannot_run_is_refused_before_launch(tmp_path):
    # `search` without --engine vllm may place the sampling call on part of the world; train with
    # generation.engine: vllm refuses that plan file by name, before any rank starts.
    from real_py.dataflow.execplan import ExecutionPlan
    from real_py.layout import Layout

    half, world = (
        Layout(dp=2, tp=1, pp=1, ranks=(0, 1)),
        Layout(dp=2, tp=2, pp=1, ranks=(0, 1, 2, 3)),
    )
    ExecutionPlan(
        world_size=4,
        ranks_per_node=4,
        calls={
            "actor_gen": half,
            "ref_inf": half,
            "rew_inf": Layout(dp=2, tp=1, pp=1, ranks=(2, 3)),
            "actor_train": world,
        },
    ).save(str(tmp_path / "plan.json"))
    cfg = CF.from_dict(
        {
            "algo": "grpo",
            "reward": {"kind": "rule"},
            "data": {"batch_size": 16},
            "ppo": {"group_size": 4},
            "generation": {"engine": "vllm"},
            "plan": {"path": str(tmp_path / "plan.json")},
        }
    )
    with pytest.raises(
        ValueError, match=r"generation.engine: vllm cannot run actor_gen .*uses every rank"
    ):
        CF.validate(cfg, 4)


def test_vllm_generation_adds_the_trainer_recompute_and_refuses_async_and_tis_without_it():
    cfg = _vllm()
    g, plan = cfg.graph(), cfg.execution_plan()
    assert (
        g.order[:2] == ("actor_gen", "actor_logp")
        and g.calls["actor_gen"].writes[-1] == "rollout_logp"
    )
    assert (
        plan.calls["actor_logp"] == plan.calls["actor_train"]
    )  # no reallocation for the recompute
    with pytest.raises(ValueError, match="asynchronous RL with vLLM generation is not implemented"):
        CF.validate(_vllm(**{"async": {"max_staleness": 1}}), 4)
    with pytest.raises(ValueError, match=r"ppo.tis_cap=2.0 needs generation.engine: vllm"):
        CF.validate(CF.from_dict({"ppo": {"tis_cap": 2.0}, "reward": {"kind": "rule"}}), 4)


def test_vllm_logp_rollout_drops_the_recompute_and_refuses_what_needs_it(tmp_path):
    cfg = _vllm(generation={"vllm_logp": "rollout"})
    g, plan = cfg.graph(), cfg.execution_plan()
    assert "actor_logp" not in g.calls and "actor_logp" not in plan.calls
    assert g.calls["actor_gen"].writes[-1] == "old_logp"  # vLLM's log-probs are old_logp
    assert "rollout_logp" not in g.calls["actor_train"].reads
    with pytest.raises(ValueError, match=r"ppo.tis_cap=2.0 with generation.vllm_logp: rollout"):
        CF.validate(_vllm(generation={"vllm_logp": "rollout"}, ppo={"tis_cap": 2.0}), 4)
    with pytest.raises(ValueError, match=r"vllm_logp='rollout' needs generation.engine: vllm"):
        CF.validate(
            CF.from_dict({"generation": {"vllm_logp": "rollout"}, "reward": {"kind": "rule"}}), 4
        )
    # vLLM's log-probs of a truncated distribution as old_logp: said before launch
    assert not [n for n in CF.notes(cfg, 4) if "vllm_logp" in n]
    cut = _vllm(generation={"vllm_logp": "rollout", "top_p": 0.9})
    assert [n for n in CF.notes(cut, 4) if "vllm_logp: rollout with top_p=0.9: " in n]
    floor = _vllm(generation={"vllm_logp": "rollout", "min_new_tokens": 2, "top_k": 5})
    assert [n for n in CF.notes(floor, 4) if "rollout with top_k=5, min_new_tokens=2: " in n]
    greedy = {"vllm_logp": "rollout", "greedy": True, "top_p": 0.9}  # vLLM drops top-p there
    assert not [n for n in CF.notes(_vllm(generation=greedy), 4) if "vllm_logp" in n]
    with pytest.raises(ValueError, match=r"greedy: true and temperature=0.7: greedy vLLM returns"):
        CF.validate(_vllm(generation={**greedy, "temperature": 0.7}), 4)
    # a plan searched for the recompute (it places actor_logp) names the way out
    _vllm().execution_plan().save(str(tmp_path / "plan.json"))
    cfg = _vllm(generation={"vllm_logp": "rollout"})
    cfg.plan = {"path": str(tmp_path / "plan.json")}
    with pytest.raises(ValueError, match=r"unknown calls \['actor_logp'\].*--vllm-logp rollout"):
        CF.validate(cfg, 4)


def test_vllm_generation_without_vllm_names_the_venv():
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ValueError, match=r"vLLM is not installed in this Python; `make vllm-venv`"):
        CF.validate(_vllm(), 4)
