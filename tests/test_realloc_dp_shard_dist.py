"""Checks dp-sharded layouts over 4 gloo ranks: DistTransport transfers, FSDP2 DTensor Shard(0)
agreement, device meshes.

A failure points to the dp planner (csrc/planner/dp_shard.cpp), real_py/layout/dp_shard.py
dp_shard_layout (if the DTensor comparison fails, our dim0 rule departs from FSDP2's), or
real_py/interop/embed.py layout_from_device_mesh / shard_from_params.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.dist_cases import check_transfer
from support.oracle import oracle_flat, random_full, tiny_spec

from real_py import Layout, ModelShard, plan_realloc
from real_py.interop.embed import layout_from_device_mesh, reallocate_params
from real_py.realloc.reallocator import Reallocator
from real_py.realloc.transports.dist import DistTransport
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

TIED, BIAS, BF16 = (
    tiny_spec(tied=True),
    tiny_spec(bias=True),
    tiny_spec(tied=True, layers=3, vocab=97, dtype="bfloat16"),
)


def L(text, ranks=None):
    return Layout.parse(text, ranks=None if ranks is None else tuple(ranks))


PAIRS = [
    ("fsdp2 dp4-dim0 -> tp2pp2", TIED, L("dp4,dim0"), L("tp2,pp2")),
    ("tp2pp2 -> zero3 dp2tp2-flat", BIAS, L("tp2,pp2"), L("dp2,tp2,flat")),
    ("dp2tp2-dim0 -> dp2tp2-flat", BF16, L("dp2,tp2,dim0"), L("dp2,tp2,flat", (3, 2, 1, 0))),
    ("flat dp3 -> dim0 dp2 tp2 padded vocab", BF16, L("dp3,flat", (1, 2, 3)), L("dp2,tp2,dim0")),
    ("dim0 dp2pp2 tied -> dp4", TIED, L("dp2,pp2,dim0"), L("dp4")),
]


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    t = DistTransport(dist.group.WORLD, timeout=30)
    done = {"transfers": 0, "dtensor_params": 0}
    for i, (name, model, src, dst) in enumerate(PAIRS):
        full = random_full(model, i)
        for mode, bucket, verify in (("p2p", 4096, False), ("broadcast", 1 << 16, i % 2 == 0)):
            check_transfer(
                t, rank, model, src, dst, full, mode=mode, bucket=bucket, verify=verify, what=name
            )
            done["transfers"] += 1
    # An FSDP2-style mesh: dp_shard x tp. Our dim0 pieces must be what DTensor Shard(0) holds.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    layout = layout_from_device_mesh(mesh)
    assert layout == Layout(dp=2, tp=2, dp_shard="dim0"), layout
    full = random_full(TIED, 9)
    d, k, _ = layout.coords(rank)
    whole = ModelShard.from_full(TIED, Layout(tp=2), k, full)  # this tp rank's local tensors
    fsdp_local = {}
    for name, v in whole.params().items():
        fsdp_local[name] = distribute_tensor(v, mesh["dp_shard"], [Shard(0)]).to_local()
        done["dtensor_params"] += 1
    mine = ModelShard.from_full(TIED, layout, rank, full).params()
    for name, v in fsdp_local.items():
        assert torch.equal(mine[name], v), (
            f"rank {rank} {name}: dim0 piece {tuple(mine[name].shape)} "
            f"!= DTensor Shard(0) local {tuple(v.shape)}"
        )
    # A trainer hands its FSDP2 local shards (DTensor.to_local()) straight to the reallocation.
    gen = L("tp2,pp2")
    r = Reallocator(plan_realloc(TIED, layout, gen), t, bucket_bytes=1 << 14)
    got = reallocate_params(r, fsdp_local)
    want = ModelShard(TIED, gen, rank, oracle_flat(TIED, gen, rank, full)).params()
    assert all(torch.equal(got[n], want[n]) for n in want), f"rank {rank}: FSDP2 -> tp2pp2 differs"
    back = Reallocator(plan_realloc(TIED, gen, layout), t, bucket_bytes=1 << 14)
    again = reallocate_params(back, got)
    assert all(torch.equal(again[n], fsdp_local[n]) for n in fsdp_local), f"rank {rank}: round trip"
    _unsorted_meshes(rank, t)
    return done


def _unsorted_meshes(rank, t):
    """fully_shard on a mesh listing its ranks out of order: FSDP2 shards by process-group rank
    (torch sorts a dim's ranks), not by mesh position; the layout must follow it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    full = random_full(TIED, 11)
    whole = ModelShard.from_full(TIED, Layout(), 0, full).params()
    mod = torch.nn.Module()
    for i, v in enumerate(whole.values()):
        mod.register_parameter(f"p{i}", torch.nn.Parameter(v.clone()))
    mesh = DeviceMesh("cpu", [3, 1, 0, 2], mesh_dim_names=("dp_shard",))
    fully_shard(mod, mesh=mesh)
    fsdp_local = {n: getattr(mod, f"p{i}").to_local().detach() for i, n in enumerate(whole)}
    layout = layout_from_device_mesh(mesh)
    assert layout == Layout(dp=4, dp_shard="dim0"), layout
    gen = L("tp2,pp2")
    got = reallocate_params(
        Reallocator(plan_realloc(TIED, layout, gen), t, bucket_bytes=1 << 14), fsdp_local
    )
    want = ModelShard(TIED, gen, rank, oracle_flat(TIED, gen, rank, full)).params()
    assert all(torch.equal(got[n], want[n]) for n in want), (
        f"rank {rank}: FSDP2 on mesh [3, 1, 0, 2] differs"
    )
    # Rank 1 hands over a wrong-size tensor: it refuses before the transfer and tells its peers,
    # which fail at once naming it (timeout 60 s; a fresh group, its receives are abandoned).
    import time

    from real_py.realloc.transports import TransferError

    t1 = DistTransport(dist.new_group(list(range(4))), timeout=60)
    if rank != 1:  # rank 1 reports before its peers have set up: they still read its report
        time.sleep(3)
    r = Reallocator(plan_realloc(TIED, layout, gen), t1, bucket_bytes=1 << 14)
    bad_local = (
        dict(fsdp_local, **{"norm.weight": fsdp_local["norm.weight"][:-1]})
        if rank == 1
        else fsdp_local
    )
    t0 = time.monotonic()
    try:
        reallocate_params(r, bad_local)
    except (TransferError, ValueError) as e:
        msg, took = str(e), time.monotonic() - t0
    else:
        raise AssertionError(f"rank {rank}: a peer's bad input went unnoticed")
    if rank == 1:
        assert msg.startswith("norm.weight: local shape"), msg
    else:
        assert "rank 1 failed in input check: ValueError: norm.weight: local shape" in msg, msg
        assert took < 20, f"rank {rank} learnt of rank 1's bad input after {took:.1f} s"
    print(f"rank {rank}: bad-input detection {took:.2f} s", flush=True)
    # A 2-D mesh whose per-dim numbering is no grid (ranks 2 and 3 would share a position).
    bad = DeviceMesh("cpu", [[0, 3], [2, 1]], mesh_dim_names=("dp_shard", "tp"))
    try:
        layout_from_device_mesh(bad)
    except ValueError as e:
        assert (
            "DeviceMesh [[0, 3], [2, 1]] (dims ['dp_shard', 'tp']): torch numbers the ranks"
            in str(e)
        ), e
    else:
        raise AssertionError("mesh [[0, 3], [2, 1]] was accepted")


def test_dp_sharded_pairs_on_four_ranks():
    out = run_distributed(_worker, 4, timeout=150)
    assert out[0] == {"transfers": 2 * len(PAIRS), "dtensor_params": len(TIED.params)}, out[0]
