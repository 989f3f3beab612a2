"""Checks the CUDA IPC transport (real_py/realloc/transports/ipc.py): 2-4 processes on ONE GPU, each
rank's shards in its own process, moves in one pass from the mapped peers' buffers, bit for bit
against tests/support/oracle.py, replayed with the same buffers (mapped once) and with new ones, a
rank that fails named by its peers. GPU tests are marked cuda (tests/conftest.py skips them without
a GPU); the rest runs anywhere.

A failure points to ipc.py (handles, events, store keys) or the one-pass runner (direct.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.oracle import oracle_flat, random_full, tiny_spec

from real_py import Layout, ModelShard, plan_realloc
from real_py.realloc.reallocator import Reallocator, resolve_one_pass
from real_py.realloc.transports import IpcTransport, TransferError
from real_py.testing import run_distributed

PAIRS = [("tp2", "dp2"), ("tp4", "tp2,pp2"), ("tp2,pp2", "dp4"), ("dp2,tp2", "tp4"), ("tp4", "tp1")]


def _ipc_moves(rank: int, world: int) -> int:
    torch.cuda.set_device(0)
    t = IpcTransport(dist.group.WORLD, timeout=60)
    done = 0
    for i, (a, b) in enumerate(PAIRS):
        model = tiny_spec(
            layers=4, vocab=101, dtype=("bfloat16", "float32")[i % 2], bias=i % 2 == 1
        )
        full = random_full(model, i)
        src, dst = Layout.parse(a), Layout.parse(b)
        if max(src.world, dst.world) > world:
            continue
        plan = plan_realloc(model, src, dst)
        realloc = Reallocator(plan, t)
        assert realloc.one_pass
        s = (
            ModelShard.from_full(model, src, rank, full, device="cuda")
            if rank in src.ranks
            else None
        )
        before = s.flat.clone() if s is not None else None
        for call in range(3):
            if call == 2 and s is not None:  # new source buffers: published and mapped again
                s = ModelShard(model, src, rank, s.flat.clone())
            d = ModelShard.empty(model, dst, rank, device="cuda") if rank in dst.ranks else None
            realloc.run(s, d)
            torch.cuda.synchronize()
            if d is not None:
                assert torch.equal(d.flat.cpu(), oracle_flat(model, dst, rank, full)), (
                    a,
                    b,
                    rank,
                    call,
                )
            dist.barrier()
        if s is not None:
            assert torch.equal(s.flat, before), f"{a}->{b}: source of rank {rank} modified"
        done += 1
    return done


def _ipc_failure(rank: int, world: int) -> str:
    torch.cuda.set_device(0)
    model = tiny_spec()
    full = random_full(model, 1)
    src, dst = Layout.parse("tp2"), Layout.parse("tp1", ranks=(2,))
    plan = plan_realloc(model, src, dst)
    t = IpcTransport(dist.group.WORLD, timeout=30)
    s = (
        ModelShard.from_full(model, src, 0 if rank == 1 else rank, full, device="cuda")
        if rank < 2
        else None
    )
    d = ModelShard.empty(model, dst, rank, device="cuda") if rank == 2 else None
    try:
        Reallocator(plan, t).run(s, d)
    except (TransferError, ValueError) as e:
        return str(e)
    return ""


@pytest.mark.cuda
@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_ipc_moves_on_one_gpu(world):
    assert (
        run_distributed(_ipc_moves, world, timeout=300)
        == [sum(max(Layout.parse(a).world, Layout.parse(b).world) <= world for a, b in PAIRS)]
        * world
    )


@pytest.mark.cuda
@pytest.mark.dist
def test_ipc_failing_rank_is_named():
    errors = run_distributed(_ipc_failure, 3, timeout=120)
    assert "source shard belongs to rank 0, this is rank 1" in errors[1]
    assert errors[2].startswith("rank 2: peer rank 1 failed during one-pass copy"), errors[2]


def test_ipc_is_one_pass_only():
    """No GPU needed: the transport's contract as the Reallocator reads it."""
    assert IpcTransport.addressable and IpcTransport.one_pass_only
    fake = IpcTransport.__new__(IpcTransport)
    assert resolve_one_pass(fake, None, False)
    with pytest.raises(ValueError, match=r"IpcTransport moves in one pass only; verify=True"):
        resolve_one_pass(fake, None, True)
    with pytest.raises(ValueError, match=r"one pass only"):
        resolve_one_pass(fake, False, False)
