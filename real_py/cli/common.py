"""Argument parsing shared by the `python -m real_py` commands: model names and rank lists."""

from __future__ import annotations

import json
import os

from ..spec import PRESETS, ModelConfig, preset


def model_config(text: str, flag: str, **overrides) -> ModelConfig:
    """A preset name or a path to an HF config.json / checkpoint directory; ValueError listing
    the presets when it is neither."""
    if text in PRESETS:
        return preset(text, **overrides)
    if not os.path.exists(text):
        raise ValueError(f"{flag} {text!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                         "HF config.json or checkpoint directory")
    try:
        return ModelConfig.from_hf(text, **overrides)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {text!r}: not a readable HF config ({type(e).__name__}: {e})") from None


def ranks(text: str | None, flag: str) -> tuple[int, ...] | None:
    """'0,1,2' -> (0, 1, 2); None -> None."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated non-negative integers, e.g. 0,1,2,3") from None


def launch_torchrun(nproc: int, argv: list[str], env: dict, what: str) -> int:
    """(`bench`; `train` runs torchrun's elastic agent itself, in its launcher: cli/job.py.)
    Run `python -m real_py <argv>` as ranks 0..nproc-1 of a single-node job under
    `torch.distributed.run --standalone` (torchrun: its c10d rendezvous, its worker monitoring:
    the first failing rank stops the others) and return the job's exit code.

    torchrun writes a torchelastic_* directory per job into TMPDIR and leaves it behind: the job
    gets a private TMPDIR that is removed afterwards. The rendezvous stores are torchrun's own
    TCPStores, which listen on every interface (only a socket bound before a store is created
    restricts it, and torchrun's backends take none; `train`'s launcher binds its own, cli/agent.py);
    on a shared host, firewall their ports or run the job in a network namespace. For several nodes run torchrun yourself (docs/running.md)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    tmp = tempfile.mkdtemp(prefix="real_py_job_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "real_py"] + argv
    print(f"launching {nproc} local {what}: {' '.join(cmd[1:])}", flush=True)
    try:
        return subprocess.call(cmd, env=dict(env, TMPDIR=tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
