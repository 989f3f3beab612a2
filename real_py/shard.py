"""Shard buffers: one flat tensor per (model, layout, rank) with named parameter views.

Views alias the flat buffer, so models can wrap them in nn.Parameter without copies and the
reallocator writes straight into what the model reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .layout import Layout, ShardLayout, check_fits, shard_layout
from .spec import ModelSpec, ParamSpec, torch_dtype


def tp_slice(p: ParamSpec, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s piece of a full tensor (vocab rows zero-padded); a new tensor."""
    if p.tp.kind == "replicated":
        return full.clone()
    d = p.tp.dim
    if p.tp.kind == "vocab":
        size = full.shape[d]
        local = p.local_shape(tp)[d]
        lo, hi = min(size, tp_rank * local), min(size, (tp_rank + 1) * local)
        shape = list(full.shape)
        shape[d] = local
        out = full.new_zeros(shape)
        out.narrow(d, 0, hi - lo).copy_(full.narrow(d, lo, hi - lo))
        return out
    # Blocked storage is the grouped one with one group per TP rank.
    groups = p.tp.groups or tp
    per_rank = groups // tp
    chunks = [blk.chunk(groups, d) for blk in full.split(list(p.blocks), d)]
    pieces = [c[j] for j in range(tp_rank * per_rank, (tp_rank + 1) * per_rank) for c in chunks]
    return torch.cat(pieces, d)


class ModelShard:
    """One rank's shard: `flat` [numel] of the model dtype, and `params()` name -> view."""

    def __init__(self, model: ModelSpec, layout: Layout, rank: int, flat: torch.Tensor):
        coords = layout.coords(rank)
        if coords is None:
            raise ValueError(f"rank {rank} is not in layout {layout} (ranks {list(layout.ranks)[:16]})")
        self.model, self.layout, self.rank = model, layout, rank
        self.dp_rank, self.tp_rank, self.stage = coords
        self.shard_layout: ShardLayout = shard_layout(model, layout, self.stage)
        want = torch_dtype(model.dtype)
        if flat.dim() != 1 or flat.numel() != self.shard_layout.numel or flat.dtype != want:
            raise ValueError(f"flat buffer for {model.name} {layout} rank {rank} must be 1-D "
                             f"{want} of {self.shard_layout.numel} elements, got "
                             f"{tuple(flat.shape)} {flat.dtype}")
        if not flat.is_contiguous():
            raise ValueError("flat buffer must be contiguous")
        self.flat = flat

    @classmethod
    def empty(cls, model: ModelSpec, layout: Layout, rank: int, device="cpu") -> "ModelShard":
        """A zeroed shard ready to receive (padding must be zero, so zeros, not empty)."""
        check_fits(model, layout)
        stage = layout.coords(rank)
        if stage is None:
            raise ValueError(f"rank {rank} is not in layout {layout}")
        n = shard_layout(model, layout, stage[2]).numel
        return cls(model, layout, rank, torch.zeros(n, dtype=torch_dtype(model.dtype), device=device))

    @classmethod
    def from_full(cls, model: ModelSpec, layout: Layout, rank: int,
                  state_dict: Mapping[str, torch.Tensor], device="cpu") -> "ModelShard":
        """Slice full tensors (name -> global tensor) into this rank's shard."""
        shard = cls.empty(model, layout, rank, device)
        for e in shard.shard_layout.entries:
            p = e.param
            if p.name not in state_dict:
                raise ValueError(f"state dict has no {p.name} (needed by {layout} rank {rank})")
            full = state_dict[p.name]
            if tuple(full.shape) != p.shape:
                raise ValueError(f"{p.name}: state dict shape {tuple(full.shape)} != spec {p.shape}")
            shard.view(p.name).copy_(tp_slice(p, full.to(shard.flat.dtype), layout.tp, shard.tp_rank))
        return shard

    def view(self, name: str) -> torch.Tensor:
        e = self.shard_layout.entry(name)
        return self.flat[e.offset:e.offset + e.numel].view(e.local_shape)

    def params(self) -> dict[str, torch.Tensor]:
        """name -> view into `flat` with the local (TP-sliced) shape, in forward key order."""
        return {e.param.name: self.flat[e.offset:e.offset + e.numel].view(e.local_shape)
                for e in self.shard_layout.entries}

    def __repr__(self) -> str:
        return (f"ModelShard({self.model.name}, {self.layout}, rank={self.rank}, stage={self.stage}, "
                f"tp_rank={self.tp_rank}, numel={self.flat.numel()})")


def gather_full(model: ModelSpec, shards: Iterable[ModelShard]) -> dict[str, torch.Tensor]:
    """Reassemble full tensors from shards covering every (stage, tp rank) of one layout."""
    out: dict[str, torch.Tensor] = {}
    by_param: dict[str, dict[int, torch.Tensor]] = {}
    layout = None
    for s in shards:
        layout = layout or s.layout
        for name, v in s.params().items():
            by_param.setdefault(name, {})[s.tp_rank] = v
    for p in model.params:
        pieces = by_param.get(p.name, {})
        if layout is None or len(pieces) != layout.tp:
            raise ValueError(f"gather_full: {p.name} has pieces from tp ranks {sorted(pieces)}, "
                             f"need all of range({layout.tp if layout else '?'})")
        if p.tp.kind == "replicated":
            out[p.name] = pieces[0].clone()
            continue
        d = p.tp.dim
        ordered = [pieces[k] for k in range(layout.tp)]
        if p.tp.kind == "vocab":
            out[p.name] = torch.cat(ordered, d).narrow(d, 0, p.shape[d]).clone()
        else:
            groups = p.tp.groups or layout.tp
            nb = len(p.blocks)
            # pieces[g * nb + j]: group g's share of block j (ranks hold consecutive groups).
            pieces = [x for t in ordered
                      for x in t.split([b // groups for b in p.blocks] * (groups // layout.tp), d)]
            blocks = [torch.cat([pieces[g * nb + j] for g in range(groups)], d) for j in range(nb)]
            out[p.name] = torch.cat(blocks, d)
    return out
