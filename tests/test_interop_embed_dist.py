"""Checks the trainer embedding API (dicts of local tensors, flat buffers) and the DeviceMesh ->
Layout conversion, on 4 spawned gloo ranks with real DeviceMeshes, plus input validation.

A failure points to real_py/interop/embed.py; reallocation results are compared with
tests/support/oracle.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.dist_cases import BIAS, TIED, random_full
from support.oracle import oracle_flat

from real_py import Layout, shard_layout
from real_py.interop.embed import (
    layout_from_device_mesh,
    reallocate_flat,
    reallocate_params,
    shard_from_params,
)
from real_py.realloc.plan import plan_realloc
from real_py.realloc.reallocator import Reallocator
from real_py.realloc.transports.dist import DistTransport
from real_py.testing import run_distributed


def trainer_params(model, layout: Layout, rank: int, full: dict) -> dict:
    """What a Megatron-style trainer holds on `rank`: separate tensors per local parameter,
    cut from the oracle's flat buffer (index math, not real_py.realloc.shard)."""
    _, _, stage = layout.coords(rank)
    flat = oracle_flat(model, layout, rank, full)
    return {
        e.param.name: flat[e.offset : e.offset + e.numel].view(e.local_shape).clone()
        for e in shard_layout(model, layout, stage).entries
    }


def _embed(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = layout_from_device_mesh(mesh)
    assert a == Layout.parse("dp2,tp2"), a
    assert a.coords(rank)[:2] == (mesh.get_local_rank("dp"), mesh.get_local_rank("tp"))
    # Transposed rank grid, pp varying fastest: the Layout must follow the mesh, not rank order.
    mesh_b = DeviceMesh(
        "cpu", torch.arange(4).view(2, 2).t().contiguous(), mesh_dim_names=("tp", "pp")
    )
    b = layout_from_device_mesh(mesh_b)
    assert (b.dp, b.tp, b.pp) == (1, 2, 2) and b.order.index("pp") < b.order.index("tp"), b
    assert b.grid() == [[[0, 1]], [[2, 3]]], b.grid()  # grid[pp][dp][tp] = mesh[tp][pp]
    assert b.coords(rank)[1:] == (mesh_b.get_local_rank("tp"), mesh_b.get_local_rank("pp"))
    mesh_c = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "cp"))
    with pytest.raises(ValueError, match=r"mesh dim 'cp' of size 2 is not mapped to dp, tp or pp"):
        layout_from_device_mesh(mesh_c)
    c = layout_from_device_mesh(mesh_c, {"data": "pp", "cp": "tp"})
    assert c == Layout.parse("tp2,pp2"), c
    out["layouts"] = (str(a), str(b), str(c))

    t = DistTransport(dist.group.WORLD, timeout=30)
    for model, src, dst in ((TIED, a, b), (BIAS, b, c), (TIED, c, a)):
        full = random_full(model, 11)
        r = Reallocator(plan_realloc(model, src, dst, mode="broadcast"), t, bucket_bytes=4096)
        got = reallocate_params(r, trainer_params(model, src, rank, full))
        want = trainer_params(model, dst, rank, full)
        assert list(got) == list(want), f"{src}->{dst}: names/order differ"
        for name, v in want.items():
            assert torch.equal(got[name], v), f"{src}->{dst} rank {rank}: {name} differs"
        flat = reallocate_flat(r, oracle_flat(model, src, rank, full))
        assert torch.equal(flat, oracle_flat(model, dst, rank, full))
        flat.fill_(0)
        assert reallocate_flat(r, oracle_flat(model, src, rank, full), flat) is flat
        assert torch.equal(flat, oracle_flat(model, dst, rank, full))
    # Ranks outside one side: the destination lives on ranks 2, 3 only.
    d = Layout.parse("tp2", ranks=(2, 3))
    r = Reallocator(plan_realloc(BIAS, c, d), t, bucket_bytes=4096)
    full = random_full(BIAS, 12)
    got = reallocate_params(r, trainer_params(BIAS, c, rank, full))
    assert (got is None) == (rank < 2)
    if got is not None:
        assert all(torch.equal(got[k], v) for k, v in trainer_params(BIAS, d, rank, full).items())
    return out


@pytest.mark.dist
def test_dict_flat_and_device_mesh():
    out = run_distributed(_embed, 4, timeout=180)
    assert out[0]["layouts"] == ("dp2tp2pp1", "dp1tp2pp2", "dp1tp2pp2")


def test_params_dict_validation():
    full = random_full(TIED, 0)
    layout = Layout.parse("tp2,pp2")
    params = trainer_params(TIED, layout, 3, full)
    name = next(k for k, v in params.items() if v.dim() == 2)
    with pytest.raises(ValueError, match=r"missing \['" + name.replace(".", r"\.")):
        shard_from_params(TIED, layout, 3, {k: v for k, v in params.items() if k != name})
    bad = dict(params, **{name: params[name].reshape(-1)})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r": local shape .* holds"):
        shard_from_params(TIED, layout, 3, bad)
    bad = dict(params, **{name: params[name].double()})
    with pytest.raises(ValueError, match=r"dtype torch.float64, the model spec says torch.float32"):
        shard_from_params(TIED, layout, 3, bad)
    shard = shard_from_params(TIED, layout, 3, params)
    assert torch.equal(shard.flat, oracle_flat(TIED, layout, 3, full))


class _Mesh:
    """Stand-in with DeviceMesh's two attributes, for error paths that need no process group."""

    def __init__(self, mesh, names):
        self.mesh, self.mesh_dim_names = mesh, names


def test_device_mesh_mismatch_errors():
    with pytest.raises(ValueError, match=r"has no mesh_dim_names"):
        layout_from_device_mesh(_Mesh(torch.arange(4).view(2, 2), None))
    m = _Mesh(torch.arange(4).view(2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"roles \['tp'\] are given to several mesh dims"):
        layout_from_device_mesh(m, {"dp": "tp", "tp": "tp"})
    with pytest.raises(ValueError, match=r"axes names mesh dim 'x'"):
        layout_from_device_mesh(m, {"x": "tp"})
    with pytest.raises(ValueError, match=r"axes\['dp'\]='ep'; allowed roles"):
        layout_from_device_mesh(m, {"dp": "ep"})
    one = layout_from_device_mesh(_Mesh(torch.arange(4).view(1, 4, 1), ("ep", "tp", "pp")))
    assert one == Layout.parse("tp4"), one
