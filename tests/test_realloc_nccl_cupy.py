"""Checks the cupy-NCCL transport: self-sends at world size 1, a 2-GPU reallocation against the
oracle, and a missing peer timing out; plus the clear error where cupy is absent (CPU).

A failure points to real_py/realloc/transports/nccl.py (group calls, unique-id exchange, timeouts).
"""

from __future__ import annotations

import datetime
import importlib.util
import socket

import pytest
import torch
from support.dist_cases import BIAS, TIED, random_full
from support.oracle import oracle_flat

from real_py import Layout, ModelShard, plan_realloc
from real_py.realloc.reallocator import Reallocator
from real_py.realloc.transports.base import TransferError
from real_py.realloc.transports.nccl import CupyNcclTransport
from real_py.testing import run_distributed

HAS_CUPY = importlib.util.find_spec("cupy") is not None
needs_cupy = pytest.mark.skipif(not HAS_CUPY, reason="needs cupy")


def _store(world: int = 1):
    from torch.distributed import TCPStore

    with socket.socket() as s:  # one process: no race between picking and binding the port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStore(
        "127.0.0.1", port, world, is_master=True, timeout=datetime.timedelta(seconds=30)
    )


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed")
def test_without_cupy_the_error_says_what_to_install():
    with pytest.raises(RuntimeError, match=r"CupyNcclTransport needs cupy with NCCL \(pip install"):
        CupyNcclTransport(0, 1, None)


@pytest.mark.cuda
@needs_cupy
def test_self_sends_in_one_group_call():
    """World size 1: sends to self and receives from self in one round, several dtypes."""
    t = CupyNcclTransport(0, 1, _store(), timeout=30)
    g = torch.Generator(device="cuda").manual_seed(0)
    srcs = [
        torch.randn(n, device="cuda", generator=g).to(dt)
        for n, dt in ((1, torch.float32), (1000, torch.bfloat16), (4099, torch.float64))
    ]
    dsts = [torch.empty_like(x) for x in srcs]
    h = t.start([((0,), x) for x in srcs], [(0, y, (0,)) for y in dsts], "round 0/1")
    h.wait()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(srcs, dsts))
    assert t.sent_bytes == t.received_bytes == sum(x.numel() * x.element_size() for x in srcs)
    t.close()


@pytest.mark.cuda
@needs_cupy
def test_local_plan_on_gpu():
    """World size 1 through the reallocator (local copies only) on the GPU."""
    full = random_full(TIED, 0)
    layout = Layout.parse("tp1")
    t = CupyNcclTransport(0, 1, _store(), timeout=30)
    plan = plan_realloc(TIED, layout, layout)
    src = ModelShard.from_full(TIED, layout, 0, full, device="cuda")
    dst = ModelShard.empty(TIED, layout, 0, device="cuda")
    Reallocator(plan, t).run(src, dst)
    assert torch.equal(dst.flat.cpu(), oracle_flat(TIED, layout, 0, full))


def _two_gpus(rank: int, world: int) -> str:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.distributed_c10d._get_default_store()  # any Store works; this one is at hand
    t = CupyNcclTransport(rank, world, store, timeout=20)
    for model, a, b in ((BIAS, "tp2", "dp2"), (TIED, "pp2", "tp2")):
        src, dst = Layout.parse(a), Layout.parse(b)
        full = random_full(model, 1)
        for mode in ("p2p", "broadcast"):
            s = ModelShard.from_full(model, src, rank, full, device="cuda")
            d = ModelShard.empty(model, dst, rank, device="cuda")
            Reallocator(
                plan_realloc(model, src, dst, mode=mode), t, bucket_bytes=4096, verify=True
            ).run(s, d)
            assert torch.equal(d.flat.cpu(), oracle_flat(model, dst, rank, full)), (a, b, mode)
    # Rank 1 never posts its side: rank 0 times out naming it and the round.
    t2 = CupyNcclTransport(rank, world, store, timeout=2, key="real_py/nccl_uid_2")
    if rank == 1:
        dist.barrier()
        return ""
    x = torch.zeros(10, device="cuda")
    with pytest.raises(
        TransferError,
        match=r"rank 0: round 0/1: timed out after 2 s waiting for "
        r"peer ranks \[1\]",
    ):
        t2.start([], [(1, x, (0,))], "round 0/1").wait()
    dist.barrier()
    return "ok"


@pytest.mark.dist
@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUPY and torch.cuda.device_count() >= 2), reason="needs 2 GPUs")
def test_two_gpu_reallocation_and_timeout():
    assert run_distributed(_two_gpus, 2, timeout=180)[0] == "ok"
