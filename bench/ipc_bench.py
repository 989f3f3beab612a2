"""The CUDA IPC rows of bench_gpu_realloc.py: every rank its own process on ONE GPU.

Each process holds only its own shards (onedevice.Shards with ranks=[rank]), builds its
Reallocator (MoeReallocator) on an IpcTransport over a gloo group (control only) and runs the
move in one pass: its one compiled copy reads the senders' buffers through CUDA IPC. A move's
time is the slowest rank's (a barrier, every rank times its own call after a device sync, the
maximum over ranks), median over repeats after one untimed call, which is checked against the
slices of the full tensors on every rank. Extra memory: the sum over ranks of the peak
allocated during the moves beyond the rank's own shards (peer buffers are mapped, not allocated;
the checks' temporaries are left out).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from onedevice import Shards, check, fill

from real_py.benchmark import slowest_rank
from real_py.realloc.moe_exec import MoeReallocator
from real_py.realloc.moe_plan import plan_moe_realloc
from real_py.realloc.reallocator import Reallocator
from real_py.realloc.transports import IpcTransport
from real_py.testing import run_distributed


def _worker(rank: int, world: int, model, src, dst, repeats: int) -> dict:
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    t = IpcTransport(dist.group.WORLD, timeout=600)
    s = Shards(model, src, dev, ranks=[rank])
    d = Shards(model, dst, dev, ranks=[rank])
    fill(s)
    own = s.nbytes() + d.nbytes()
    moe = bool(model.num_experts)
    if moe:
        x = MoeReallocator(plan_moe_realloc(model, src, dst), t)
        args = (s.dense.get(rank), s.experts.get(rank), d.dense.get(rank), d.experts.get(rank))
    else:
        from real_py import plan_realloc

        x = Reallocator(plan_realloc(model, src, dst), t)
        args = (s.dense.get(rank), d.dense.get(rank))
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    x.run(*args)
    torch.cuda.synchronize(dev)
    extra = torch.cuda.max_memory_allocated(dev) - base  # the first call builds the copy tables
    ok = check(d)
    torch.cuda.reset_peak_memory_stats(dev)  # not the check's full pattern tensors
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        x.run(*args)
        torch.cuda.synchronize(dev)
        times.append(slowest_rank(time.perf_counter() - t0))
    extra = max(extra, torch.cuda.max_memory_allocated(dev) - base)
    ok = ok and check(d)
    return {"times": times, "ok": ok, "extra": extra, "own": own, "nbytes": d.nbytes()}


def ipc_rows(
    name, model, src, dst, repeats: int, goal: float, ref: float, small: bool
) -> list[dict]:
    world = max(max(src.ranks), max(dst.ranks)) + 1
    out = run_distributed(_worker, world, model, src, dst, repeats, timeout=900, pg_timeout=600)
    med = statistics.median(out[0]["times"])
    nbytes = sum(o["nbytes"] for o in out)
    gbps = nbytes / med / 1e9
    row = {
        "pair": name,
        "model": model.name,
        "GiB moved": nbytes / 2**30,
        "method": f"CUDA IPC, {world} processes",
        "seconds": med,
        "GB/s": gbps,
        "ref GB/s": ref,
        "vs ref": gbps / ref,
        "goal": goal,
        "met": "yes" if gbps / ref >= goal else "NO",
        "bit-exact": all(o["ok"] for o in out),
        "extra MiB": sum(o["extra"] for o in out) / 2**20,
        "extra how": "measured (sum over ranks)",
    }
    print(row, flush=True)
    return [row]
