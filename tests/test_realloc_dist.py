"""Checks distributed reallocation over gloo (DistTransport) on 2, 4 and 8 spawned ranks.

A failure points to real_py/realloc/transports/dist.py (p2p batches, broadcast subgroups, byte
counts) or the reallocator's pipelined rounds; results are compared with the index oracle
(tests/support/oracle.py).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from support.dist_cases import SPECS, check_transfer, named_pairs, random_full
from support.oracle import random_layout

from real_py.realloc.transports.dist import DistTransport
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

NAMED_RUNS = (("p2p", 4096), ("p2p", 1 << 20), ("broadcast", 4096), ("broadcast", 1 << 20))
RANDOM_BUCKETS = (1 << 13, 1 << 16, 1 << 20)


def _named_and_random(rank: int, world: int, num_random: int) -> dict:
    t = DistTransport(dist.group.WORLD, timeout=30)
    done = {"named": 0, "random": 0, "round_trips": 0}
    for i, (name, model, src, dst) in enumerate(named_pairs(world)):
        full = random_full(model, i)
        for mode, bucket in NAMED_RUNS:
            check_transfer(t, rank, model, src, dst, full, mode=mode, bucket=bucket, what=name)
            done["named"] += 1
        # Round trip A -> B -> A, bitwise, B's shards as the source of the way back.
        mid = check_transfer(t, rank, model, src, dst, full, mode="p2p", bucket=4096, what=name)
        check_transfer(
            t,
            rank,
            model,
            dst,
            src,
            full,
            mode="broadcast",
            bucket=1 << 16,
            src_shard=mid,
            what=name + " (back)",
        )
        done["round_trips"] += 1
    rng = random.Random(1000 + world)
    for i in range(num_random):
        model = SPECS[i % len(SPECS)]
        full = random_full(model, 100 + i)
        src = random_layout(rng, world, model.num_layers, max_ranks=world)
        dst = random_layout(rng, world, model.num_layers, max_ranks=world)
        mode = ("p2p", "broadcast")[i % 2]
        bucket = rng.choice(RANDOM_BUCKETS)
        verify = i % 7 == 3
        what = f"random pair {i}"
        mid = check_transfer(
            t, rank, model, src, dst, full, mode=mode, bucket=bucket, verify=verify, what=what
        )
        if i % 4 == 0:
            check_transfer(
                t,
                rank,
                model,
                dst,
                src,
                full,
                mode=mode,
                bucket=bucket,
                src_shard=mid,
                what=what + " (back)",
            )
            done["round_trips"] += 1
        done["random"] += 1
    return done


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layout_pairs_bitwise(world):
    """Named table + 100 random pairs per world size, both modes, several buckets."""
    out = run_distributed(_named_and_random, world, 100, timeout=240)
    assert all(o == out[0] for o in out)
    assert out[0]["random"] == 100 and out[0]["named"] == len(NAMED_RUNS) * len(named_pairs(world))


def _nccl(rank: int, world: int) -> int:
    torch.cuda.set_device(rank)
    t = DistTransport(dist.new_group(backend="nccl"), timeout=60)
    n = 0
    for i, (name, model, src, dst) in enumerate(named_pairs(world)):
        full = random_full(model, i)
        for mode, bucket in NAMED_RUNS:
            check_transfer(
                t,
                rank,
                model,
                src,
                dst,
                full,
                mode=mode,
                bucket=bucket,
                verify=bucket > 4096,
                what=name,
                device="cuda",
            )
            n += 1
    return n


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank; needs 2")
def test_nccl_named_pairs():
    """The same transport over an NCCL group (one batch_isend_irecv = one NCCL group call)."""
    world = min(torch.cuda.device_count(), 8)
    world = 4 if world >= 4 else 2
    assert run_distributed(_nccl, world, timeout=300)[0] == len(NAMED_RUNS) * len(
        named_pairs(world)
    )
