"""`python -m real_py train` with generation.engine: vllm, as a user runs it (the shipped copy-task
config, 4 gloo ranks under the launcher): a job killed between checkpoints resumes to the same
step as an uninterrupted one (vLLM restarted, the actor's weights moved into it again from the
checkpoint), and `export: hf` writes a checkpoint transformers loads, equal to the trained actor.
The launcher, killed, takes vLLM with it (vLLM runs inside the ranks).
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
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "real_py",
            "train",
            "--config",
            CONFIG,
            "--out-dir",
            str(out),
            "--no-progress",
            "--timeout",
            "120",
            "data.batch_size=32",
            "ppo.group_size=4",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
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
        return {
            k: v
            for f in sorted(os.listdir(d))
            if f.endswith(".safetensors")
            for k, v in load_file(str(d / f)).items()
        }

    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and ta
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    hf = AutoModelForCausalLM.from_pretrained(str(b / "hf" / "actor"), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([[3, 5, 7, 9, 11, 2, 4]])).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == 16


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (walking /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killing_the_launcher_ends_every_vllm_process(tmp_path):
    """vLLM lives inside the ranks (external_launcher, no engine-core process): while the job
    generates, the launcher's descendants are its 4 ranks, each holding vLLM, and a resource
    tracker; after a SIGKILL of the launcher (no handler runs) every one of them is gone
    within 60 s."""
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "real_py",
            "train",
            "--config",
            CONFIG,
            "--out-dir",
            str(out),
            "--no-progress",
            "--timeout",
            "120",
            "steps=1000",
            "data.batch_size=32",
            "ppo.group_size=4",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 400
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, f"the job ended before step 2 (exit {proc.returncode})"
            assert time.monotonic() < deadline, "no step 2 within 400 s"
            time.sleep(0.5)
        job = _descendants(proc.pid)
        cmdlines, maps = {}, {}
        for pid in job:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdlines[pid] = f.read().replace(b"\0", b" ").decode()
            with open(f"/proc/{pid}/maps") as f:
                maps[pid] = "/vllm/" in f.read()
        ranks = [p for p in job if "real_py train" in cmdlines[p]]
        # the ranks hold vLLM; besides them only multiprocessing's resource tracker, no engine core
        assert len(ranks) == 4 and all(maps[p] for p in ranks), (cmdlines, maps)
        assert all("resource_tracker" in cmdlines[p] for p in job if p not in ranks), cmdlines
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in job) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p for p in job if _alive(p)], (
            "outlived the killed launcher",
            {p: cmdlines[p] for p in job if _alive(p)},
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: one session
        except ProcessLookupError:
            pass
        proc.wait(10)
