# Checks bench/bench_trl.py: real_py's and TRL's sides are configured with the same work (prompts,
# group size, lengths, learning rate, steps, KL, clip, micro-batches), the shared reward function,
# and a tiny CPU run of the script (real_py's side through `python -m real_py train`; TRL's side
# only where trl is installed). Never timed.
# A failure points to bench/bench_trl.py (setup, real_py_config, trl_args) or to the train CLI /
# GRPO config keys it writes (real_py/rlhf/config).
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_trl", ROOT / "bench" / "bench_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("small", [True, False])
def test_both_sides_configured_with_the_same_work(tmp_path, small):
    B = _bench()
    s = B.setup(small)
    ours = B.work_of_real_py(B.real_py_config(s, "ckpt", str(tmp_path / "r"), "cuda"))
    theirs = B.work_of_trl(B.trl_args(s, str(tmp_path / "t"), "cuda"), s["prompts_file"])
    assert ours == theirs
    want = {
        "prompts_file": s["prompts_file"],
        "prompts_per_step": s["prompts_per_step"],
        "group": s["group"],
        "new_tokens": (s["new_tokens"], s["new_tokens"]),
        "lr": s["lr"],
        "steps": s["steps"],
        "kl": s["kl"],
        "clip": s["clip"],
        "shuffle": False,
        "optimizer_steps_per_step": 1,
        "micro": s["micro"],
        "max_grad_norm": s["max_grad_norm"],
    }
    assert ours == want
    # the real_py config is a valid training config
    from real_py.rlhf import config as CF

    d = B.real_py_config(
        s, s["tokenizer"], str(tmp_path / "r"), "cpu"
    )  # a directory with a tokenizer
    d.pop("actor_path")
    cfg = CF.from_dict(d)
    assert cfg.algo == "grpo" and cfg.group_size() == s["group"]


def test_reward_is_the_fraction_of_the_last_digit():
    B = _bench()
    assert B.reward(["123", "45"], ["3a33", ""], answer=["3", "5"]) == [0.75, 0.0]
    assert B.reward(prompts=["71"], completions=["1x"], completion_ids=[[1, 2]]) == [0.5]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_tiny_run_on_cpu(tmp_path):
    B = _bench()
    rc = B.main(["--device", "cpu", "--small", "--out-dir", str(tmp_path), "--trl-timeout", "240"])
    assert rc == 0
    rep = json.loads(next(tmp_path.glob("trl_*_small_*.json")).read_text())
    ours = [r for r in rep["rows"] if r["side"] == "real_py"]
    assert [r["step"] for r in ours] == [1, 2]
    assert all(0.0 <= r["reward"] <= 1.0 and r["response_length"] == 8 for r in ours)
    if importlib.util.find_spec("trl") is None:
        assert "trl cannot be imported" in rep["extra"]["trl_skipped"]
    else:
        theirs = [r for r in rep["rows"] if r["side"] == "trl"]
        assert [r["step"] for r in theirs] == [1, 2], rep["extra"].get("trl")
