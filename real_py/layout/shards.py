"""Flat-buffer layouts of shards: the (pp stage, tp rank) shard every dp replica of a layout
holds (`shard_layout`: the stage's parameters in forward key order, each a contiguous range
starting on an ALIGN_BYTES boundary; a tied embedding copy last) and the expert shard of
(stage, ep rank) in an MoE layout (`expert_shard_layout`). Padding between parameters and vocab
padding rows are zero and never transferred."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..spec import ALIGN_BYTES, ModelSpec, ParamSpec
from .fits import check_fits, require_layout, require_spec
from .grid import Layout
from .stages import param_stages, stage_layer_ranges


@dataclass(frozen=True, slots=True)
class ShardEntry:
    param: ParamSpec
    offset: int
    """Start of the parameter in the shard's flat buffer, in elements."""
    local_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Flat-buffer layout of one (pp stage, tp rank) shard; identical for every tp rank of a
    stage."""

    entries: tuple[ShardEntry, ...]
    numel: int
    """Flat buffer length in elements, alignment padding included."""

    def entry(self, name: str) -> ShardEntry:
        for e in self.entries:
            if e.param.name == name:
                return e
        raise KeyError(name)


def shard_layout(model: ModelSpec, layout: Layout, stage: int) -> ShardLayout:
    """Flat-buffer layout of stage `stage` (forward key order; a tied embedding copy goes last)."""
    require_spec(model)
    require_layout(layout)
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage={stage} outside [0, {layout.pp}) for layout {layout}")
    # Cached on what the shard depends on (not dp or ranks): planning many placements of the
    # same strategy (the plan search) otherwise rebuilt it each time (~200 ms for 70B).
    return _shard_layout(
        model,
        Layout(
            tp=layout.tp,
            pp=layout.pp,
            layers_per_stage=layout.layers_per_stage,
            partition=layout.partition,
        ),
        stage,
    )


@functools.lru_cache(maxsize=256)
def _fits(model: ModelSpec, layout: Layout) -> None:
    """check_fits, once per (model, layout) rather than once per stage (it asks every
    parameter; for pp=16 the per-stage calls were half of a cold plan_realloc). A failing
    check raises and is not cached."""
    check_fits(model, layout)


@functools.lru_cache(maxsize=1024)
def _shard_layout(model: ModelSpec, layout: Layout, stage: int) -> ShardLayout:
    _fits(model, layout)
    align = max(1, ALIGN_BYTES // model.element_size)
    head_copy = []
    ordered = []
    # param_stages inlined for this one stage (it runs for every parameter of every stage).
    lo, hi = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)[stage]
    last = layout.pp - 1
    for p in model.params:
        if p.expert >= 0:  # expert tensors live in expert shards (expert_shard_layout)
            continue
        if p.owner == "layer":
            held = lo <= p.layer < hi
        elif p.owner == "embed":
            held = stage == 0 or (stage == last and p.tied_to_head)
        else:
            held = stage == last
        if held:
            if p.owner == "embed" and stage != 0:
                head_copy.append(p)
            else:
                ordered.append(p)
    entries, off = [], 0
    for p in ordered + head_copy:
        ls = p.local_shape(layout.tp)
        e = ShardEntry(p, off, ls)
        entries.append(e)
        off = -(-(off + e.numel) // align) * align
    return ShardLayout(tuple(entries), off)


def expert_shard_layout(model: ModelSpec, layout: Layout, stage: int, ep_rank: int) -> ShardLayout:
    """Flat-buffer layout of the expert shard of (stage, ep_rank): the experts
    [ep_rank E/ep, (ep_rank + 1) E/ep) of the stage's MoE layers, each expert tensor's etp piece,
    in spec order (per layer: every local expert's gate_up, then every local expert's down, so
    the stacked [E/ep, 2I/etp, H] and [E/ep, H, I/etp] views are contiguous when each piece is a
    multiple of ALIGN_BYTES). Identical on the etp ranks and expert-dp replicas."""
    require_spec(model)
    require_layout(layout)
    if not 0 <= stage < layout.pp or not 0 <= ep_rank < layout.ep:
        raise ValueError(
            f"stage={stage}, ep_rank={ep_rank} outside pp={layout.pp}, ep={layout.ep} "
            f"of layout {layout}"
        )
    return _expert_shard_layout(
        model,
        Layout(
            tp=layout.tp,
            dp=layout.dp,
            pp=layout.pp,
            ep=layout.ep,
            etp=layout.etp,
            layers_per_stage=layout.layers_per_stage,
            partition=layout.partition,
        ),
        stage,
        ep_rank,
    )


@functools.lru_cache(maxsize=1024)
def _expert_shard_layout(model: ModelSpec, layout: Layout, stage: int, ep_rank: int) -> ShardLayout:
    _fits(model, layout)
    align = max(1, ALIGN_BYTES // model.element_size)
    per = model.num_experts // layout.ep
    lo, hi = ep_rank * per, (ep_rank + 1) * per
    entries, off = [], 0
    for p in model.params:
        if p.expert >= 0 and lo <= p.expert < hi and stage in param_stages(model, layout, p):
            e = ShardEntry(p, off, p.local_shape(layout.etp))
            entries.append(e)
            off = -(-(off + e.numel) // align) * align
    return ShardLayout(tuple(entries), off)
