"""Embedding API for existing trainers: reallocate from/to per-rank dicts of local tensors or flat
buffers, and build a Layout from a torch DeviceMesh.

    realloc = Reallocator(plan, DistTransport(group), bucket_bytes=...)   # once per plan
    new_params = reallocate_params(realloc, local_params)   # name -> local tensor, or None
    new_flat = reallocate_flat(realloc, src_flat)            # flat shard buffer, or None
    layout = layout_from_device_mesh(mesh)                   # mesh dims named dp / tp / pp

`local_params` holds exactly the tensors real_py.realloc.shard.ModelShard.params() would hold for
this rank in the plan's source layout (Megatron-style: TP-sliced local shapes, fused q|k|v and
gate|up, vocab rows padded to a multiple of tp, this pipeline stage's parameters only, a tied
embedding copy on the last stage). The result is the same for the destination layout, as views
into one fresh flat buffer (so it can be handed to a model without copies). In a dp-sharded
layout (Layout.dp_shard) each tensor is this rank's piece: FSDP2's DTensor.to_local() for
"dim0", a 1-D (possibly empty) range of the flat shard for "flat".
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping

import torch

from ..layout import (
    Layout,
    dp_shard_layout,
    require_layout,
    require_spec,
    shard_layout,
    stage_layer_ranges,
)
from ..realloc.reallocator import Reallocator, new_destination
from ..realloc.shard import ModelShard
from ..spec import torch_dtype

_ROLES = ("dp", "tp", "pp")
_MESH_ROLES = _ROLES + ("dp_shard",)


def shard_from_params(
    model, layout: Layout, rank: int, params: Mapping[str, torch.Tensor], device=None
) -> ModelShard:
    """Copy a rank's local tensors (name -> tensor) into a new flat shard buffer.

    Raises ValueError naming the parameter on a missing/extra name, a wrong local shape or dtype.
    """
    require_spec(model)
    require_layout(layout)
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping name -> local tensor (e.g. dict(model.named_parameters())), "
            f"got {type(params).__name__}"
        )
    coords = layout.coords(rank)
    if coords is None:
        raise ValueError(f"rank {rank} is not in layout {layout}")
    entries = shard_layout(model, layout, coords[2]).entries
    # Local shapes: the TP-local tensor, or this dp replica's piece in a dp-sharded layout
    # (FSDP2: the DTensor's to_local(); ZeRO-3 / flat: a 1-D range, maybe empty).
    shapes = (
        {e.param.name: e.local_shape for e in entries}
        if layout.dp_shard == "none"
        else {
            x.param.name: x.shape
            for x in dp_shard_layout(model, layout, coords[2], coords[0]).pieces
        }
    )
    want = {e.param.name for e in entries}
    missing, extra = sorted(want - params.keys()), sorted(params.keys() - want)
    if missing or extra:
        lo, hi = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)[
            coords[2]
        ]
        split = (
            f"layers_per_stage={layout.layers_per_stage}"
            if layout.layers_per_stage
            else f"partition={layout.partition!r}"
        )
        raise ValueError(
            f"rank {rank} ({layout}, stage {coords[2]}): parameter dict does not match "
            f"the stage's parameters: missing {missing[:5]}, unexpected {extra[:5]}; "
            f"the stage holds layers {lo}..{hi - 1} under the pipeline split {split} "
            "(Megatron-core splits by layer count: Layout(partition='layers'))"
        )
    dtype = torch_dtype(model.dtype)
    for e in entries:
        t = params[e.param.name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"params[{e.param.name!r}] must be a torch.Tensor, got {type(t).__name__}"
            )
        if t.is_meta:
            raise ValueError(
                f"params[{e.param.name!r}] is a meta tensor (no data); materialize the "
                "model (e.g. to_empty + load) before reallocating it"
            )
        if tuple(t.shape) != shapes[e.param.name]:
            raise ValueError(
                f"{e.param.name}: local shape {tuple(t.shape)} on rank {rank}, but "
                f"{layout} tp rank {coords[1]}"
                + (f" dp rank {coords[0]} (its dp piece)" if layout.dp_shard != "none" else "")
                + f" holds {shapes[e.param.name]}"
            )
        if t.dtype != dtype:
            raise ValueError(
                f"{e.param.name}: dtype {t.dtype}, the model spec says {dtype}; cast "
                "the model first (reallocation moves raw bytes)"
            )
    if device is None:
        device = params[entries[0].param.name].device
    shard = ModelShard.empty(model, layout, rank, device=device)
    views = shard.params()
    with torch.no_grad():
        for name, v in views.items():
            v.copy_(params[name])
    return shard


def reallocate_params(
    realloc: Reallocator,
    params: Mapping[str, torch.Tensor] | None,
    *,
    device=None,
    check: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor] | None:
    """Move local tensors from the plan's source layout to its destination layout.

    params: this rank's source tensors, None if the rank holds no source shard. Returns this
    rank's destination tensors (views of one flat buffer, stored as plan.dst_model says), None
    if it holds no destination shard. Collective: every rank of the transport's group calls it.
    check: full reference tensors by project name (e.g. the checkpoint the trainer loaded);
    before anything moves, this rank's fused (q|k|v, gate|up) and vocab tensors are compared
    with the slices the source spec says they are (real_py.interop.adapters.check_against_full), and
    a storage-order mismatch raises ValueError naming the tensor (reported to the other ranks, which
    then fail at once naming this rank).
    """
    _require_realloc(realloc)
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping name -> local tensor or None, got "
            f"{type(params).__name__}; pass dict(zip(names, tensors))"
        )
    plan, rank = realloc.plan, realloc.rank
    src = None
    with _tell_peers(realloc):
        if params is not None:
            if rank not in plan.src.ranks:
                raise ValueError(
                    f"rank {rank} is not in the source layout {plan.src} but passed params"
                )
            if check is not None:
                from .adapters import check_against_full

                check_against_full(plan.model, plan.src, rank, params, check)
            src = shard_from_params(plan.model, plan.src, rank, params, device)
            device = device or src.flat.device
        dst = new_destination(plan, rank, device=device or "cpu")
    realloc.run(src, dst)
    return None if dst is None else dst.params()


def reallocate_flat(
    realloc: Reallocator, src_flat: torch.Tensor | None, dst_flat: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Move one flat shard buffer (the ModelShard.flat layout) to the destination layout.

    dst_flat: a zeroed buffer to fill (reused across calls), or None to allocate one.
    """
    _require_realloc(realloc)
    plan, rank = realloc.plan, realloc.rank
    with _tell_peers(realloc):
        try:
            src = None if src_flat is None else ModelShard(plan.model, plan.src, rank, src_flat)
        except (TypeError, ValueError) as e:
            raise type(e)(f"src_flat: {e}") from None
        if rank not in plan.dst.ranks:
            if dst_flat is not None:
                raise ValueError(
                    f"rank {rank} is not in the destination layout {plan.dst} but passed dst_flat"
                )
            dst = None
        elif dst_flat is None:
            dst = new_destination(
                plan, rank, device=src_flat.device if src_flat is not None else "cpu"
            )
        else:
            dst = ModelShard(plan.dst_model, plan.dst, rank, dst_flat)
    realloc.run(src, dst)
    return None if dst is None else dst.flat


@contextlib.contextmanager
def _tell_peers(realloc: Reallocator):
    """A rank that rejects its own input before the transfer tells its peers (transport.fail),
    so they stop waiting for it at once, naming it and the reason."""
    try:
        yield
    except Exception as e:
        realloc.transport.fail("input check", f"{type(e).__name__}: {e}"[:1000])
        raise


def _require_realloc(realloc) -> None:
    if not isinstance(realloc, Reallocator):
        raise TypeError(
            f"realloc must be a Reallocator(plan_realloc(model, src, dst), transport), got "
            f"{type(realloc).__name__}"
        )


def layout_from_device_mesh(
    mesh,
    axes: Mapping[str, str] | None = None,
    *,
    layers_per_stage: tuple[int, ...] | None = None,
    dp_shard: str | None = None,
) -> Layout:
    """The Layout a torch DeviceMesh describes (global ranks, axis order from the mesh).

    axes: mesh dim name -> "dp" | "tp" | "pp" | "dp_shard"; default: the mesh dims named dp, tp,
    pp, dp_shard. "dp_shard" is a dp axis over which parameters are sharded (an FSDP2
    fully_shard mesh, e.g. ("dp_shard", "tp"), or a 1-D FSDP mesh passed with
    axes={name: "dp_shard"}). A mesh dim without a role must have size 1. The mesh's last dim
    varies fastest along its ranks, which becomes the Layout's `order`. Ranks are placed as torch
    numbers them, not by their position in the mesh: along each mesh dim torch gives a rank its
    process-group rank (the dim's ranks sorted), and FSDP2 / DTensor shard by that number, so
    DeviceMesh("cpu", [1, 0]) means rank 0 holds dp piece 0. A mesh whose per-dim numbering is
    not a grid (two ranks at one position) is refused.
    dp_shard: "dim0" (FSDP2, per-parameter Shard(0)) or "flat" (ZeRO-3 / FSDP1); default "dim0"
    for a "dp_shard" dim, "none" for a "dp" dim. Raises ValueError saying why the two cannot agree.
    """
    names = mesh.mesh_dim_names
    shape = tuple(mesh.mesh.shape)
    if names is None:
        raise ValueError(
            f"DeviceMesh of shape {shape} has no mesh_dim_names; name its dims "
            "(e.g. ('pp', 'dp', 'tp')) so each maps to dp, tp or pp"
        )
    axes = dict(axes) if axes is not None else {n: n for n in names if n in _MESH_ROLES}
    for dim, given in axes.items():
        if dim not in names:
            raise ValueError(f"axes names mesh dim {dim!r}, the mesh has dims {list(names)}")
        if given not in _MESH_ROLES:
            raise ValueError(f"axes[{dim!r}]={given!r}; allowed roles: {_MESH_ROLES}")
    # A size-1 dim plays no role (e.g. dp_replicate=1 of an HSDP mesh that only shards).
    size_of = dict(zip(names, shape))
    axes = {d: r for d, r in axes.items() if size_of[d] > 1 or r not in ("dp", "dp_shard")}
    roles = ["dp" if r == "dp_shard" else r for r in axes.values()]
    dup = sorted({r for r in roles if roles.count(r) > 1})
    if dup:
        raise ValueError(
            f"roles {dup} are given to several mesh dims ({axes}); a Layout has one "
            "dim per role (flatten the mesh dims first; HSDP, dp replicate x dp shard, "
            "is not a Layout)"
        )
    if dp_shard is None:
        dp_shard = "dim0" if "dp_shard" in axes.values() else "none"
    axes = {d: "dp" if r == "dp_shard" else r for d, r in axes.items()}
    sizes = {r: 1 for r in _ROLES}
    fastest_first = []
    for name, size in reversed(list(zip(names, shape))):
        role = axes.get(name)
        if role is None:
            if size != 1:
                raise ValueError(
                    f"mesh dim {name!r} of size {size} is not mapped to dp, tp or pp; "
                    f"a reallocation layout has only those axes (pass axes=...)"
                )
            continue
        sizes[role] = size
        if size > 1:
            fastest_first.append(role)
    # Only axes longer than 1 fix the order; prefer the default order among those consistent.
    order = next(
        "-".join(p)
        for p in itertools.permutations(("tp", "dp", "pp"))
        if [a for a in p if a in fastest_first] == fastest_first
    )
    ranks = _torch_rank_order(mesh.mesh, names)
    return Layout(
        dp=sizes["dp"],
        tp=sizes["tp"],
        pp=sizes["pp"],
        ranks=ranks,
        order=order,
        layers_per_stage=layers_per_stage,
        dp_shard=dp_shard,
    )


def _torch_rank_order(arr: torch.Tensor, names) -> tuple[int, ...]:
    """The mesh's ranks in row-major order of the positions torch uses: along every dim, the
    index of the rank among the sorted ranks of its slice (its process-group rank there)."""
    shape = tuple(arr.shape)
    pos: dict[int, list[int]] = {int(r): [0] * len(shape) for r in arr.reshape(-1).tolist()}
    for dim, size in enumerate(shape):
        for row in arr.movedim(dim, -1).reshape(-1, size).tolist():
            for i, r in enumerate(sorted(row)):
                pos[int(r)][dim] = i
    at: dict[tuple[int, ...], int] = {}
    for r, p in pos.items():
        if tuple(p) in at:
            raise ValueError(
                f"DeviceMesh {arr.tolist()} (dims {list(names)}): torch numbers the ranks of each "
                "mesh dim by process-group rank (the dim's ranks sorted), and FSDP2 / DTensor "
                f"shard by that number; on this mesh it puts ranks {at[tuple(p)]} and {r} both at "
                f"position {tuple(p)}, so the mesh describes no consistent layout. Build the mesh "
                "with each dim's ranks in ascending order (e.g. init_device_mesh)"
            )
        at[tuple(p)] = r
    return tuple(at[p] for p in itertools.product(*(range(n) for n in shape)))


__all__ = ["shard_from_params", "reallocate_params", "reallocate_flat", "layout_from_device_mesh"]
