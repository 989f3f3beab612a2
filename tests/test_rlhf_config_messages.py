# Checks that configs which fail, or run other than their author expects, say so before launch with the cause and a fix that works: a causal-LM reward_path or critic_path, keys the algorithm cannot use (critic_path with a critic-free algorithm: refused), keys the reward kind ignores, more ranks than cores or GPUs, and the legend of the step line's kl.
# A failure points to real_py/rlhf/config/checks.py (_check_checkpoints, notes, KL_LEGEND) or real_py/cli/train.py (_config, _before_launch).
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
    assert f"reward_path='{lm}' is not a reward model: it has no value head 'score.weight'" in msg, msg
    assert "critic_init gives only the critic a fresh head" in msg and "reward: {kind: function" in msg, msg
    # Following the old hint (critic_init) is refused naming why it cannot help.
    with pytest.raises(ValueError, match="it applies to the critic only, never to reward_path"):
        CF.from_dict({"reward_path": lm, "critic_init": "zero"})
    # The fix the message names works: a reward function instead of the causal LM.
    CF.validate(CF.from_dict({"reward": {"kind": "rule"}}), 4)


def test_causal_lm_critic_path_suggests_critic_init(lm):
    with pytest.raises(ValueError, match=r"critic_path='.*lm' has no value head 'score.weight' .*set critic_init: zero"):
        CF.validate(CF.from_dict({"critic_path": lm}), 4)
    CF.validate(CF.from_dict({"critic_path": lm, "critic_init": "zero"}), 4)   # the suggestion works


@pytest.mark.parametrize("algo", ["grpo", "rloo", "remax"])
def test_critic_keys_with_a_critic_free_algorithm_are_refused(lm, algo):
    base = {"algo": algo, "reward": {"kind": "rule"}}
    for keys, named in (({"critic_path": lm}, f"critic_path='{lm}'"),
                        ({"critic_path": lm, "critic_init": "zero"}, f"critic_path='{lm}'"),
                        ({"critic_init": "normal"}, "critic_init='normal'")):
        with pytest.raises(ValueError) as e:
            CF.from_dict({**base, **keys})
        key = named.split("=")[0]
        assert str(e.value) == (f"config {named} but algo='{algo}' has no critic (critic-free): remove "
                                f"{key}, or use algo: ppo to train a critic"), str(e.value)
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
    notes = CF.notes(CF.from_dict({"algo": "grpo", "reward": {"kind": "rule"}, "reward_path": lm,
                                   "device": "cpu"}), 8)
    text = "\n".join(notes)
    assert f"reward_path='{lm}' is ignored: reward.kind='rule' scores without a reward model" in text
    assert ("the plan has 8 ranks with calls but this machine gives this process 2 CPU cores: ranks share cores and the "
            "run will be slow (calls running side by side stretch by up to 4x)") in text
    assert "python -m real_py search --gpus 2 --hardware cpu" in text
    assert CF.notes(CF.from_dict({"device": "cpu"}), 2) == []


def test_launcher_prints_warnings_and_the_kl_legend(lm, tmp_path, capsys, no_launch):
    assert main(["train", "algo=grpo", "reward={kind: rule}", f"reward_path={lm}",
                 "--out-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"warning: reward_path='{lm}' is ignored: reward.kind='rule'" in out, out
    assert "step lines: kl = the k1 estimate of KL(actor || reference), sum over each response's tokens" in out
    assert "can be negative" in out


def test_local_cuda_job_with_more_ranks_than_gpus_is_refused(tmp_path, capsys, monkeypatch, no_launch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as e:
        main(["train", "device=cuda", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "the execution plan has 4 ranks but this node has 2 GPUs: a local launch runs one rank per GPU" in err


def test_models_over_host_memory_are_refused_before_launch(tmp_path, capsys, monkeypatch, no_launch):
    """A 7B-shaped actor on the default 4-rank CPU plan: its train copy with Adam states and the
    dp4 generation copies cannot fit; refused naming the need per model, not killed mid-start-up."""
    from real_py.rlhf.config import checks

    monkeypatch.setattr(checks, "_available_bytes", lambda: 16 << 30)
    big = ("{hidden_size: 4096, intermediate_size: 11008, num_hidden_layers: 32, num_attention_heads: 32, "
           "num_key_value_heads: 32, vocab_size: 32000}")
    (tmp_path / "c.yaml").write_text(f"actor: {big}\ncritic: {{vocab_size: 32000}}\n")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(tmp_path / "c.yaml"), "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "the models need at least 251.1 GiB of memory on this machine (actor 200.8, ref 50.2" in err, err
    assert "but 16.0 GiB is available; use smaller models" in err, err
    CF.validate(CF.from_dict({}), 4)   # the default job fits


def _vllm(plan_calls=None, **kw):
    calls = {"actor_gen": {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "pp": 1},
             "ref_inf": {"ranks": [0, 1], "dp": 2, "tp": 1, "pp": 1},
             "rew_inf": {"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1},
             "actor_train": {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "pp": 1}}
    calls.update(plan_calls or {})
    gen = kw.pop("generation", {})
    return CF.from_dict({"algo": "grpo", "reward": {"kind": "rule"}, "data": {"batch_size": 16},
                         "ppo": {"group_size": 4, **kw.pop("ppo", {})}, "generation": {"engine": "vllm", **gen},
                         "plan": {"world_size": 4, "calls": calls}, **kw})


@pytest.mark.parametrize("gen, why", [
    ({"ranks": [0, 1, 2, 3], "dp": 2, "tp": 1, "pp": 2}, "pp=2: vLLM generation runs dp x tp"),
    ({"ranks": [0, 1], "dp": 1, "tp": 2, "pp": 1}, "vLLM generation uses every rank of the world"),
    ({"ranks": [1, 0, 3, 2], "dp": 2, "tp": 2, "pp": 1}, "vLLM generation uses every rank of the world"),
])
def test_vllm_generation_layouts_vllm_cannot_run_are_refused_before_launch(gen, why):
    cfg = _vllm({"actor_gen": gen}, allow_idle_ranks=True)
    with pytest.raises(ValueError, match="generation.engine: vllm cannot run actor_gen") as e:
        CF.validate(cfg, 4)
    assert why in str(e.value), str(e.value)


def test_vllm_generation_adds_the_trainer_recompute_and_refuses_async_and_tis_without_it():
    cfg = _vllm()
    g, plan = cfg.graph(), cfg.execution_plan()
    assert g.order[:2] == ("actor_gen", "actor_logp") and g.calls["actor_gen"].writes[-1] == "rollout_logp"
    assert plan.calls["actor_logp"] == plan.calls["actor_train"]   # no reallocation for the recompute
    with pytest.raises(ValueError, match="asynchronous RL with vLLM generation is not implemented"):
        CF.validate(_vllm(**{"async": {"max_staleness": 1}}), 4)
    with pytest.raises(ValueError, match=r"ppo.tis_cap=2.0 needs generation.engine: vllm"):
        CF.validate(CF.from_dict({"ppo": {"tis_cap": 2.0}, "reward": {"kind": "rule"}}), 4)


def test_vllm_generation_without_vllm_names_the_venv():
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ValueError, match=r"vLLM is not installed in this Python; `make vllm-venv`"):
        CF.validate(_vllm(), 4)
