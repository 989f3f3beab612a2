"""Shard buffers: one flat tensor per (model, layout, rank) with named parameter views.

Views alias the flat buffer, so models can wrap them in nn.Parameter without copies and the
reallocator writes straight into what the model reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..layout import (
    DpShardLayout,
    Layout,
    ShardLayout,
    check_fits,
    dp_shard_layout,
    expert_shard_layout,
    require_layout,
    require_spec,
    shard_layout,
)
from ..spec import ModelSpec, ParamSpec, torch_dtype


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
    if p.tp.replicate_units:
        return torch.cat(
            [
                blk.chunk(n, d)[tp_rank // (tp // n)] if n < tp else blk.chunk(tp, d)[tp_rank]
                for blk, n in zip(full.split(list(p.blocks), d), _unit_counts(p))
            ],
            d,
        )
    # Blocked storage is the grouped one with one group per TP rank.
    groups = p.tp.groups or tp
    per_rank = groups // tp
    chunks = [blk.chunk(groups, d) for blk in full.split(list(p.blocks), d)]
    pieces = [c[j] for j in range(tp_rank * per_rank, (tp_rank + 1) * per_rank) for c in chunks]
    return torch.cat(pieces, d)


def _unit_counts(p: ParamSpec) -> list[int]:
    return [n for _, n in p.tp.units]


def _full_tensor(
    state_dict: Mapping[str, torch.Tensor], p: ParamSpec, layout: Layout, rank: int
) -> torch.Tensor:
    """state_dict[p.name], checked against the spec's shape (from_full of either shard kind)."""
    if p.name not in state_dict:
        raise ValueError(f"state dict has no {p.name} (needed by {layout} rank {rank})")
    full = state_dict[p.name]
    if tuple(full.shape) != p.shape:
        raise ValueError(f"{p.name}: state dict shape {tuple(full.shape)} != spec {p.shape}")
    return full


class ModelShard:
    """One rank's shard: `flat` [numel] of the model dtype, and `params()` name -> view.

    In a dp-sharded layout (Layout.dp_shard "dim0" / "flat") the rank holds its dp piece of the
    (stage, tp rank) shard: `dp_layout` describes the buffer and `params()` maps every name of
    the stage to the held piece (FSDP2: the local rows; ZeRO / flat: a 1-D range, maybe empty).
    """

    def __init__(self, model: ModelSpec, layout: Layout, rank: int, flat: torch.Tensor):
        require_spec(model)
        require_layout(layout)
        if not isinstance(flat, torch.Tensor):
            raise TypeError(
                f"flat must be a 1-D torch.Tensor (the shard's flat buffer), got "
                f"{type(flat).__name__}"
            )
        coords = layout.coords(rank)
        if coords is None:
            raise ValueError(
                f"rank {rank} is not in layout {layout} (ranks {list(layout.ranks)[:16]})"
            )
        self.model, self.layout, self.rank = model, layout, rank
        self.dp_rank, self.tp_rank, self.stage = coords
        self.shard_layout: ShardLayout = shard_layout(model, layout, self.stage)
        self.dp_layout: DpShardLayout | None = (
            None
            if layout.dp_shard == "none"
            else dp_shard_layout(model, layout, self.stage, self.dp_rank)
        )
        numel = self.flat_numel
        want = torch_dtype(model.dtype)
        if flat.dim() != 1 or flat.numel() != numel or flat.dtype != want:
            raise ValueError(
                f"flat buffer for {model.name} {layout} rank {rank} must be 1-D "
                f"{want} of {numel} elements, got "
                f"{tuple(flat.shape)} {flat.dtype}"
            )
        if not flat.is_contiguous():
            raise ValueError(
                f"flat buffer for {model.name} {layout} rank {rank} must be contiguous, got "
                f"stride {flat.stride()}; pass flat.contiguous() (views alias the buffer)"
            )
        self.flat = flat

    @property
    def flat_numel(self) -> int:
        """Elements the layout puts in `flat` (the dp piece's in a dp-sharded layout)."""
        return (self.dp_layout or self.shard_layout).numel

    @classmethod
    def empty(cls, model: ModelSpec, layout: Layout, rank: int, device="cpu") -> ModelShard:
        """A zeroed shard ready to receive (padding must be zero, so zeros, not empty)."""
        check_fits(model, layout)
        coords = layout.coords(rank)
        if coords is None:
            raise ValueError(f"rank {rank} is not in layout {layout}")
        n = (
            shard_layout(model, layout, coords[2])
            if layout.dp_shard == "none"
            else dp_shard_layout(model, layout, coords[2], coords[0])
        ).numel
        return cls(
            model, layout, rank, torch.zeros(n, dtype=torch_dtype(model.dtype), device=device)
        )

    @classmethod
    def from_full(
        cls,
        model: ModelSpec,
        layout: Layout,
        rank: int,
        state_dict: Mapping[str, torch.Tensor],
        device="cpu",
    ) -> ModelShard:
        """Slice full tensors (name -> global tensor) into this rank's shard."""
        shard = cls.empty(model, layout, rank, device)
        for e in shard.shard_layout.entries:
            p = e.param
            full = _full_tensor(state_dict, p, layout, rank)
            local = tp_slice(p, full.to(shard.flat.dtype), layout.tp, shard.tp_rank)
            if shard.dp_layout is not None:
                piece = shard.dp_layout.piece(p.name)
                local = local.reshape(-1)[piece.lo : piece.hi].view(piece.shape)
            shard.view(p.name).copy_(local)
        return shard

    def view(self, name: str) -> torch.Tensor:
        if self.dp_layout is not None:
            piece = self.dp_layout.piece(name)
            return self.flat[piece.offset : piece.offset + piece.numel].view(piece.shape)
        e = self.shard_layout.entry(name)
        return self.flat[e.offset : e.offset + e.numel].view(e.local_shape)

    def params(self) -> dict[str, torch.Tensor]:
        """name -> view into `flat` with the local (TP-sliced) shape, in forward key order (the
        held piece's shape in a dp-sharded layout)."""
        if self.dp_layout is not None:
            return {
                e.param.name: self.flat[e.offset : e.offset + e.numel].view(e.shape)
                for e in self.dp_layout.pieces
            }
        return {
            e.param.name: self.flat[e.offset : e.offset + e.numel].view(e.local_shape)
            for e in self.shard_layout.entries
        }

    def __repr__(self) -> str:
        return (
            f"ModelShard({self.model.name}, {self.layout}, rank={self.rank}, stage={self.stage}, "
            f"tp_rank={self.tp_rank}, numel={self.flat.numel()})"
        )


class ExpertShard:
    """One rank's expert shard of an MoE layout: `flat` laid out by layout.expert_shard_layout
    (experts [ep_rank E/ep, (ep_rank + 1) E/ep) of the stage's MoE layers, each tensor's etp piece),
    `params()` name -> view (spec names layers.i.mlp.experts.j.{gate_up_proj, down_proj}.weight).
    Each etp rank holds its own piece; the expert-dp replicas hold identical shards."""

    def __init__(self, model: ModelSpec, layout: Layout, rank: int, flat: torch.Tensor):
        require_spec(model)
        require_layout(layout)
        if not model.num_experts:
            raise ValueError(f"ExpertShard: {model.name} has no experts (num_experts=0)")
        coords = layout.expert_coords(rank)
        if coords is None:
            raise ValueError(
                f"rank {rank} is not in layout {layout} (ranks {list(layout.ranks)[:16]})"
            )
        self.model, self.layout, self.rank = model, layout, rank
        self.edp_rank, self.ep_rank, self.etp_rank, self.stage = coords
        self.shard_layout: ShardLayout = expert_shard_layout(
            model, layout, self.stage, self.ep_rank
        )
        want = torch_dtype(model.dtype)
        if (
            not isinstance(flat, torch.Tensor)
            or flat.dim() != 1
            or flat.numel() != self.shard_layout.numel
            or flat.dtype != want
            or not flat.is_contiguous()
        ):
            got = (
                f"{tuple(flat.shape)} {flat.dtype}"
                if isinstance(flat, torch.Tensor)
                else type(flat).__name__
            )
            raise ValueError(
                f"expert flat buffer for {model.name} {layout} rank {rank} must be a contiguous "
                f"1-D {want} tensor of {self.shard_layout.numel} elements, got {got}"
            )
        self.flat = flat

    @property
    def flat_numel(self) -> int:
        """Elements the layout puts in `flat`."""
        return self.shard_layout.numel

    @classmethod
    def empty(cls, model: ModelSpec, layout: Layout, rank: int, device="cpu") -> ExpertShard:
        check_fits(model, layout)
        coords = layout.expert_coords(rank)
        if coords is None:
            raise ValueError(f"rank {rank} is not in layout {layout}")
        n = expert_shard_layout(model, layout, coords[3], coords[1]).numel
        return cls(
            model, layout, rank, torch.zeros(n, dtype=torch_dtype(model.dtype), device=device)
        )

    @classmethod
    def from_full(
        cls,
        model: ModelSpec,
        layout: Layout,
        rank: int,
        state_dict: Mapping[str, torch.Tensor],
        device="cpu",
    ) -> ExpertShard:
        """Slice full expert tensors (spec names) into this rank's expert shard."""
        shard = cls.empty(model, layout, rank, device)
        for e in shard.shard_layout.entries:
            p = e.param
            full = _full_tensor(state_dict, p, layout, rank)
            shard.view(p.name).copy_(
                tp_slice(p, full.to(shard.flat.dtype), layout.etp, shard.etp_rank)
            )
        return shard

    def view(self, name: str) -> torch.Tensor:
        e = self.shard_layout.entry(name)
        return self.flat[e.offset : e.offset + e.numel].view(e.local_shape)

    def params(self) -> dict[str, torch.Tensor]:
        return {
            e.param.name: self.flat[e.offset : e.offset + e.numel].view(e.local_shape)
            for e in self.shard_layout.entries
        }

    def __repr__(self) -> str:
        return (
            f"ExpertShard({self.model.name}, {self.layout}, rank={self.rank}, stage={self.stage}, "
            f"ep_rank={self.ep_rank}, etp_rank={self.etp_rank}, numel={self.flat.numel()})"
        )


def gather_full(model: ModelSpec, shards: Iterable[ModelShard]) -> dict[str, torch.Tensor]:
    """Reassemble full tensors from shards covering every (stage, tp rank) of one layout
    (every (stage, tp rank, dp rank) of a dp-sharded layout)."""
    out: dict[str, torch.Tensor] = {}
    by_param: dict[str, dict[int, torch.Tensor]] = {}
    layout = None
    shards = list(shards)
    if shards and shards[0].layout.dp_shard != "none":
        shards = _undo_dp_sharding(model, shards)
    for s in shards:
        layout = layout or s.layout
        for name, v in s.params().items():
            by_param.setdefault(name, {})[s.tp_rank] = v
    for p in model.params:
        pieces = by_param.get(p.name, {})
        if layout is None or len(pieces) != layout.tp:
            raise ValueError(
                f"gather_full: {p.name} has pieces from tp ranks {sorted(pieces)}, "
                f"need all of range({layout.tp if layout else '?'})"
            )
        if p.tp.kind == "replicated":
            out[p.name] = pieces[0].clone()
            continue
        d = p.tp.dim
        ordered = [pieces[k] for k in range(layout.tp)]
        if p.tp.kind == "vocab":
            out[p.name] = torch.cat(ordered, d).narrow(d, 0, p.shape[d]).clone()
        elif p.tp.replicate_units:
            # A replicated block's unit u is read from the first of its tp / n holders.
            tp = layout.tp
            split = [
                t.split([b // min(tp, n) for b, n in zip(p.blocks, _unit_counts(p))], d)
                for t in ordered
            ]
            out[p.name] = torch.cat(
                [
                    split[k][j]
                    for j, n in enumerate(_unit_counts(p))
                    for k in (range(0, tp, tp // n) if n < tp else range(tp))
                ],
                d,
            )
        else:
            groups = p.tp.groups or layout.tp
            nb = len(p.blocks)
            # shares[g * nb + j]: group g's share of block j (ranks hold consecutive groups).
            shares = [
                x
                for t in ordered
                for x in t.split([b // groups for b in p.blocks] * (groups // layout.tp), d)
            ]
            blocks = [torch.cat([shares[g * nb + j] for g in range(groups)], d) for j in range(nb)]
            out[p.name] = torch.cat(blocks, d)
    return out


def _undo_dp_sharding(model: ModelSpec, shards: list[ModelShard]) -> list[ModelShard]:
    """dp-sharded shards -> one whole (stage, tp rank) shard each, in the layout without dp."""
    layout = shards[0].layout
    by_pos: dict[tuple[int, int], dict[int, ModelShard]] = {}
    for s in shards:
        by_pos.setdefault((s.stage, s.tp_rank), {})[s.dp_rank] = s
    plain = Layout(
        tp=layout.tp,
        pp=layout.pp,
        layers_per_stage=layout.layers_per_stage,
        partition=layout.partition,
    )
    out = []
    for (stage, k), reps in sorted(by_pos.items()):
        if sorted(reps) != list(range(layout.dp)):
            raise ValueError(
                f"gather_full: stage {stage} tp rank {k} of {layout} has pieces from dp "
                f"ranks {sorted(reps)}, need all of range({layout.dp})"
            )
        whole = ModelShard.empty(
            model, plain, plain.rank(0, k, stage), device=shards[0].flat.device
        )
        for name, v in whole.params().items():
            v.view(-1).copy_(torch.cat([reps[d].view(name).reshape(-1) for d in range(layout.dp)]))
        out.append(whole)
    return out
