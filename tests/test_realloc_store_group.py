"""TransferGroup (a gloo group on a store of its own, as the vLLM backend builds it) carries exact
reallocations through DistTransport, and a member that refuses or dies is named to every other.
A failure points to real_py/realloc/transports/store_group.py or DistTransport's bare-group path."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
from support.oracle import oracle_flat, random_full, tiny_spec

from real_py import Layout, ModelShard, plan_realloc
from real_py.realloc import DistTransport, Reallocator
from real_py.realloc.transports.store_group import TransferGroup, publish_ready, wait_ready
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _member(rank, world, port, refuse, die, late=-1):
    """Each process joins the transfer group beside its own default group (run_distributed's)."""
    group = TransferGroup.connect("127.0.0.1", port, rank, world, timeout_s=20)
    publish_ready(group, "ValueError: not this model" if rank == refuse else None)
    if rank == late:  # reads the refusal after the refuser and the store's host have
        time.sleep(2.0)
    try:
        wait_ready(group, f"member {rank}")
    except RuntimeError as e:
        return str(e)
    group = group.build()
    model = tiny_spec(tied=True, vocab=53)
    src, dst = Layout.parse("tp2", ranks=(0, 1)), Layout.parse("dp1,tp1,pp2", ranks=(2, 1))
    plan = plan_realloc(model, src, dst)
    full = random_full(model, seed=3)
    transport = DistTransport(group.pg, timeout=20, store=group.store)
    realloc = Reallocator(plan, transport, bucket_bytes=4096)
    s = ModelShard.from_full(model, src, rank, full) if rank in src.ranks else None
    d = ModelShard.empty(model, dst, rank) if rank in dst.ranks else None
    if rank == die:
        os._exit(1)
    try:
        realloc.run(s, d)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if d is not None:
        assert torch.equal(d.flat, oracle_flat(model, dst, rank, full))
    group.close()
    return "ok"


def test_store_group_moves_exactly_beside_each_default_group():
    out = run_distributed(_member, 3, _free_port(), -1, -1, timeout=120)
    assert out == ["ok"] * 3


def test_a_member_that_refuses_is_named_to_every_member():
    """Member 1 comes late: the store's host (member 0) must wait for it to read the reason."""
    out = run_distributed(_member, 3, _free_port(), 2, -1, 1, timeout=120)
    assert all("member 2 refused: ValueError: not this model" in o for o in out), out


def test_a_member_that_dies_is_named_by_its_peers():
    """Member 2 (it sends to 1 and receives from 0) dies before its move; member 0 hosts the
    store, as trainer rank 0 does for the vLLM backend."""
    out = run_distributed(_member, 3, _free_port(), -1, 2, timeout=120, allow_exit=(2,))
    assert out[2] is None
    assert all("rank 2" in o for o in out[:2]), out


@pytest.mark.cuda
def test_store_group_over_nccl_between_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (NCCL does not run two ranks on one device)")
    out = run_distributed(_nccl_member, 2, _free_port(), timeout=180)
    assert out == ["ok", "ok"]


def _nccl_member(rank, world, port):
    torch.cuda.set_device(rank)
    group = TransferGroup.connect("127.0.0.1", port, rank, world, timeout_s=60)
    publish_ready(group, None)
    wait_ready(group, f"member {rank}")
    group = group.build("nccl")
    model = tiny_spec(tied=True, vocab=53)
    src, dst = Layout.parse("tp1", ranks=(0,)), Layout.parse("tp1", ranks=(1,))
    plan = plan_realloc(model, src, dst)
    full = random_full(model, seed=3)
    realloc = Reallocator(plan, DistTransport(group.pg, timeout=60, store=group.store))
    s = ModelShard.from_full(model, src, 0, full, device="cuda") if rank == 0 else None
    d = ModelShard.empty(model, dst, 1, device="cuda") if rank == 1 else None
    realloc.run(s, d)
    if d is not None:
        assert torch.equal(d.flat.cpu(), oracle_flat(model, dst, 1, full))
    return "ok"
