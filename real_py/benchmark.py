"""What every benchmark result records, the slowest rank's time of a distributed step, the test
pattern a moved tensor is checked against, and the floor of a plan's messages: the helpers
`python -m real_py bench` and the scripts in bench/ share.

    git_commit()        "1a2b3c4", "1a2b3c4+dirty" when tracked files differ from HEAD, or "unknown"
    cpu_model()         the processor's model name (/proc/cpuinfo), or platform.processor()
    environment()       versions, machine and date (UTC) of this run, for a results file
    slowest_rank(s)     the largest of every rank's `s` (an all-reduce MAX)
    timed_slowest(fn)   seconds of fn() on the slowest rank, all ranks starting together
    pattern(i, p)       parameter i's full test tensor; a rank's expected piece is tp_slice of it
    PlanMessages(plan)  a plan's messages alone between preallocated buffers (the floor)

A bottom layer: nothing from real_py is imported (a plan and a parameter spec are read through
their attributes); torch and numpy only inside the functions.
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
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, cwd=where, timeout=10
            ).stdout.strip()

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
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda,
        "git_commit": git_commit(),
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


def pattern(index: int, p, *, bits: int = 24, dtype=None, device=None):
    """Parameter `index`'s full test tensor [*p.shape] as `dtype` (default p.dtype): flat element
    i is (i * 40503 + (index + 1) * 7919) mod 2**bits.

    40503 is odd, so i -> i * 40503 mod 2**bits is a bijection: no two elements within 2**bits of
    each other share a value and a misplaced element is caught. bits=24 gives integers exact in
    fp32; bits=15 with dtype=torch.int16 fits any 2-byte dtype compared as bits. A rank's expected
    piece is real_py.realloc.shard.tp_slice of this tensor (vocab padding rows zero): the same
    slicing the tests' oracle uses, independent of the planner.
    p: a ParamSpec (numel, shape, dtype)."""
    import torch

    v = torch.arange(p.numel, dtype=torch.int64, device=device)
    v.mul_(40503).add_((index + 1) * 7919).bitwise_and_((1 << bits) - 1)
    return v.to(dtype if dtype is not None else getattr(torch, p.dtype)).view(p.shape)


class PlanMessages:
    """A plan's messages alone on this rank: every send and receive between preallocated buffers
    (a broadcast message: one send per receiver), posted as one batch_isend_irecv, with no packing,
    no local copies and no rounds. Its time is what moving exactly these bytes costs over the
    process group here: the floor of any exact method (the measured peak of `python -m real_py
    bench`, the gloo floor rows of bench/bench_realloc.py).

        floor = PlanMessages(plan, rank, torch.bfloat16, device)
        floor.run()                       # or: works = floor.start(); ...; wait on each

    plan: a realloc Plan (for_rank(rank).sends / .recvs, each message with numel and peers).
    recv_bytes: what this rank receives per run."""

    def __init__(self, plan, rank: int, dtype, device=None):
        import torch
        import torch.distributed as dist

        mine = plan.for_rank(rank)
        self.ops = []
        for m in mine.sends:
            buf = torch.ones(m.numel, dtype=dtype, device=device)
            self.ops += [dist.P2POp(dist.isend, buf, peer) for peer in m.peers]
        for m in mine.recvs:
            buf = torch.empty(m.numel, dtype=dtype, device=device)
            self.ops.append(dist.P2POp(dist.irecv, buf, m.peers[0]))
        self.recv_bytes = (
            sum(m.numel for m in mine.recvs) * torch.empty(0, dtype=dtype).element_size()
        )

    def start(self) -> list:
        """Post every message; the works to wait on."""
        import torch.distributed as dist

        return dist.batch_isend_irecv(self.ops) if self.ops else []

    def run(self) -> None:
        for w in self.start():
            w.wait()


__all__ = [
    "PlanMessages",
    "cpu_model",
    "environment",
    "git_commit",
    "pattern",
    "slowest_rank",
    "timed_slowest",
]
