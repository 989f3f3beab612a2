"""What every benchmark result records, and the slowest rank's time of a distributed step: the
helpers `python -m real_py bench` and the scripts in bench/ share.

    git_commit()        "1a2b3c4", "1a2b3c4+dirty" when tracked files differ from HEAD, or "unknown"
    cpu_model()         the processor's model name (/proc/cpuinfo), or platform.processor()
    environment()       versions, machine and date (UTC) of this run, for a results file
    slowest_rank(s)     the largest of every rank's `s` (an all-reduce MAX)
    timed_slowest(fn)   seconds of fn() on the slowest rank, all ranks starting together

A bottom layer: nothing from real_py is imported; torch and numpy only inside the functions.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from pathlib import Path


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """HEAD's short hash of the checkout holding `cwd` (default: this package's directory), with
    "+dirty" when tracked files differ from it (the run did not measure that commit's code alone);
    "unknown" outside a git checkout or without git. REAL_PY_GIT_COMMIT in the environment wins:
    a copy of the tree on another machine (a lent GPU's) may carry a stale .git, so the command
    that sends it names the commit it sends."""
    if os.environ.get("REAL_PY_GIT_COMMIT"):
        return os.environ["REAL_PY_GIT_COMMIT"]
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=where,
                                  timeout=10).stdout.strip()

        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return "unknown"
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    """The processor's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """Versions, machine and date (UTC) of this run: the header of a results file."""
    import numpy
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
        "cuda": torch.version.cuda, "git_commit": git_commit(),
        "machine": f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB",
        "torch_threads": torch.get_num_threads(),
        "load_avg_1_5_15min": [round(x, 1) for x in os.getloadavg()],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def slowest_rank(seconds: float, device=None, group=None) -> float:
    """The largest `seconds` over the ranks of `group` (default: the world); every rank calls it.
    device: where the all-reduce's tensor lives (a CUDA device under NCCL; None: the CPU)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def timed_slowest(fn, device=None, *, barrier_after: bool = False) -> float:
    """Seconds of fn() on the slowest rank: a barrier, then each rank times its own call (after a
    CUDA synchronize when `device` is a CUDA device; after a second barrier with barrier_after,
    so that every rank's time also covers waiting for the others), then slowest_rank."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    if barrier_after:
        dist.barrier()
    return slowest_rank(time.perf_counter() - t0, device)


__all__ = ["cpu_model", "environment", "git_commit", "slowest_rank", "timed_slowest"]
