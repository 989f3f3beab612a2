"""`python -m real_py train` with generation.engine: vllm, as a user runs it (the shipped copy-task
config, 4 gloo ranks under the launcher): a job killed between checkpoints resumes to the same
step as an uninterrupted one (vLLM restarted, the actor's weights moved into it again from the
checkpoint), and `export: hf` writes a checkpoint transformers loads, equal to the trained actor.
A failure points to real_py/cli/train.py, real_py/rlhf/runtime.py (_start_vllm) or
real_py/vllm/rollout.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import vllm_cases  # noqa: F401 - skips without vLLM (fails under make test-vllm)

pytestmark = [pytest.mark.dist, pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "copy_task", "grpo_vllm.yaml")


def _train(out, *args) -> list[dict]:
    r = subprocess.run([sys.executable, "-m", "real_py", "train", "--config", CONFIG, "--out-dir", str(out),
                        "--no-progress", "--timeout", "120", "data.batch_size=32", "ppo.group_size=4", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_resume_and_export_with_vllm_generation(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    a, b = tmp_path / "a", tmp_path / "b"
    ma = _train(a, "steps=3", "save_every=0", "export=hf")
    mb = _train(b, "steps=2", "save_every=2")
    assert [m["step"] for m in mb] == [1, 2]
    mb = _train(b, "--resume", "steps=3", "export=hf")
    assert [m["step"] for m in mb] == [1, 2, 3]
    # Step 3 after the resume: vLLM started again, the checkpoint's actor moved into it, the same
    # seeded samples, so the same rewards, gap and losses as without the interruption.
    assert mb[2]["metrics"] == ma[2]["metrics"], (mb[2]["metrics"], ma[2]["metrics"])
    assert mb[2]["metrics"]["rollout_logp_diff"] < 1e-5

    # The exports of both runs are the same trained actor, bit for bit, and transformers loads it.
    def tensors(run):
        d = run / "hf" / "actor"
        return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(str(d / f)).items()}

    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and ta
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    hf = AutoModelForCausalLM.from_pretrained(str(b / "hf" / "actor"), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([[3, 5, 7, 9, 11, 2, 4]])).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == 16
