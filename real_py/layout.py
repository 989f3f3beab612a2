"""Parallel layouts (dp, tp, pp over an explicit list of global ranks) and shard flat-buffer layouts.

A rank's position in a layout is (dp_idx, tp_idx, pp_idx); `order` says which axis varies
fastest when walking `ranks` (default "tp-dp-pp": tp fastest, then dp, then pp). The shard of
(pp stage s, tp rank k) is one flat buffer holding the stage's parameters in forward key order,
each a contiguous range starting on an ALIGN_BYTES boundary; every dp replica holds the same
shard. Padding between parameters and vocab padding rows are zero and never transferred.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .spec import ALIGN_BYTES, ModelSpec, ParamSpec

_AXES = ("tp", "dp", "pp")
PARTITIONS = ("params", "layers")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ranks: tuple[int, ...] | None = None
    """Global ranks, walked in `order`; None means range(dp * tp * pp)."""
    order: str = "tp-dp-pp"
    """Axes from fastest- to slowest-varying along `ranks`, a permutation of tp, dp, pp."""
    layers_per_stage: tuple[int, ...] | None = None
    """Explicit pipeline partition (one count per stage); None: the `partition` rule."""
    partition: str = "params"
    """Default pipeline split when layers_per_stage is None: "params" (contiguous stages
    minimizing the largest stage's parameter count) or "layers" (num_layers / pp each, as
    Megatron-core splits; pp must divide num_layers)."""

    def __post_init__(self):
        for axis in _AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{axis}={v!r} must be a positive int")
        if sorted(self.order.split("-")) != sorted(_AXES):
            raise ValueError(f"Layout.order={self.order!r}; allowed: a permutation of tp-dp-pp "
                             "such as 'tp-dp-pp' or 'tp-pp-dp'")
        n = self.dp * self.tp * self.pp
        ranks = tuple(range(n)) if self.ranks is None else tuple(int(r) for r in self.ranks)
        if len(ranks) != n:
            raise ValueError(f"Layout dp{self.dp}tp{self.tp}pp{self.pp} needs {n} ranks, got "
                             f"{len(ranks)}: {list(ranks)[:16]}")
        if len(set(ranks)) != n:
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise ValueError(f"Layout ranks contain duplicates {dup}: each global rank may appear once")
        if min(ranks) < 0:
            raise ValueError(f"Layout ranks must be non-negative, got {min(ranks)}")
        object.__setattr__(self, "ranks", ranks)
        if self.partition not in PARTITIONS:
            raise ValueError(f"Layout.partition={self.partition!r}; allowed: {PARTITIONS}")
        if self.layers_per_stage is not None:
            lps = tuple(int(x) for x in self.layers_per_stage)
            if len(lps) != self.pp or min(lps) < 1:
                raise ValueError(f"layers_per_stage={lps} must have pp={self.pp} entries, each >= 1")
            object.__setattr__(self, "layers_per_stage", lps)

    @classmethod
    def parse(cls, text: str, **kwargs) -> "Layout":
        """'dp2,tp4,pp1' (any order, separators optional, missing axes default to 1)."""
        found = dict(re.findall(r"(dp|tp|pp)\s*=?\s*(\d+)", text))
        rest = re.sub(r"(dp|tp|pp)\s*=?\s*\d+|[\s,x_-]", "", text)
        if not found or rest:
            raise ValueError(f"cannot parse layout {text!r}; expected e.g. 'dp2,tp4,pp1'")
        return cls(**{k: int(v) for k, v in found.items()}, **kwargs)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"dp{self.dp}tp{self.tp}pp{self.pp}"

    def rank(self, dp: int, tp: int, pp: int) -> int:
        """Global rank at position (dp_idx, tp_idx, pp_idx)."""
        idx, scale = 0, 1
        for axis in self.order.split("-"):
            idx += {"tp": tp, "dp": dp, "pp": pp}[axis] * scale
            scale *= getattr(self, axis)
        return self.ranks[idx]

    def coords(self, rank: int) -> tuple[int, int, int] | None:
        """(dp_idx, tp_idx, pp_idx) of a global rank, or None if the rank is not in this layout."""
        return _coords_table(self).get(rank)

    def grid(self) -> list[list[list[int]]]:
        """grid[pp][dp][tp] -> global rank."""
        return [[[self.rank(d, t, p) for t in range(self.tp)] for d in range(self.dp)]
                for p in range(self.pp)]


@functools.lru_cache(maxsize=256)
def _coords_table(layout: Layout) -> dict[int, tuple[int, int, int]]:
    return {layout.rank(d, t, p): (d, t, p)
            for p in range(layout.pp) for d in range(layout.dp) for t in range(layout.tp)}


def check_fits(model: ModelSpec, layout: Layout) -> None:
    """Raise ValueError when the layout cannot hold the model (tp, pp, explicit partition)."""
    model.check_tp(layout.tp)
    if layout.pp > model.num_layers:
        raise ValueError(f"pp={layout.pp} exceeds num_layers={model.num_layers} of {model.name}; "
                         f"pick pp in 1..{model.num_layers}")
    if layout.layers_per_stage is not None and sum(layout.layers_per_stage) != model.num_layers:
        raise ValueError(f"layers_per_stage={layout.layers_per_stage} sums to "
                         f"{sum(layout.layers_per_stage)}, but {model.name} has {model.num_layers} layers")
    if layout.layers_per_stage is None and layout.partition == "layers" and model.num_layers % layout.pp:
        raise ValueError(f"partition='layers' needs pp={layout.pp} to divide num_layers="
                         f"{model.num_layers} of {model.name}; give layers_per_stage=... instead")


@functools.lru_cache(maxsize=256)
def stage_layer_ranges(model: ModelSpec, pp: int, layers_per_stage: tuple[int, ...] | None = None,
                       partition: str = "params") -> tuple[tuple[int, int], ...]:
    """[lo, hi) layer range per pipeline stage.

    Default (partition "params"): contiguous ranges minimizing the largest stage's parameter
    count, counting the embedding on the first stage and final norm + head (+ tied embedding
    copy) on the last. partition "layers": num_layers / pp layers per stage (Megatron-core).
    """
    L = model.num_layers
    if layers_per_stage is None and partition == "layers":
        layers_per_stage = (L // pp,) * pp
    if layers_per_stage is None:
        layers_per_stage = _balanced_partition(model, pp)
    bounds, lo = [], 0
    for n in layers_per_stage:
        bounds.append((lo, lo + n))
        lo += n
    assert lo == L, (layers_per_stage, L)
    return tuple(bounds)


def _balanced_partition(model: ModelSpec, pp: int) -> tuple[int, ...]:
    L = model.num_layers
    layer_cost = [0] * L
    first = last = 0
    for p in model.params:
        if p.owner == "layer":
            layer_cost[p.layer] += p.numel
        elif p.owner == "embed":
            first += p.numel
            if p.tied_to_head and pp > 1:
                last += p.numel
        else:
            last += p.numel
    prefix = [0]
    for c in layer_cost:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    # best[s][i]: minimal max-cost of putting layers [0, i) on stages [0, s]; choice for backtrack.
    best = [[INF] * (L + 1) for _ in range(pp)]
    choice = [[0] * (L + 1) for _ in range(pp)]
    for i in range(1, L + 1):
        best[0][i] = prefix[i] + first + (last if pp == 1 else 0)
    for s in range(1, pp):
        extra = last if s == pp - 1 else 0
        for i in range(s + 1, L + 1):
            for a in range(s, i):
                v = max(best[s - 1][a], prefix[i] - prefix[a] + extra)
                if v < best[s][i]:
                    best[s][i], choice[s][i] = v, a
    counts, i = [], L
    for s in range(pp - 1, 0, -1):
        a = choice[s][i]
        counts.append(i - a)
        i = a
    counts.append(i)
    return tuple(reversed(counts))


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
    """Flat-buffer layout of one (pp stage, tp rank) shard; identical for every tp rank of a stage."""

    entries: tuple[ShardEntry, ...]
    numel: int
    """Flat buffer length in elements, alignment padding included."""

    def entry(self, name: str) -> ShardEntry:
        for e in self.entries:
            if e.param.name == name:
                return e
        raise KeyError(name)


def param_stages(model: ModelSpec, layout: Layout, p: ParamSpec) -> tuple[int, ...]:
    """Pipeline stages holding parameter p (two for a tied embedding when pp > 1)."""
    ranges = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)
    last = layout.pp - 1
    if p.owner == "layer":
        return tuple(s for s, (lo, hi) in enumerate(ranges) if lo <= p.layer < hi)
    if p.owner == "embed":
        return (0, last) if p.tied_to_head and last > 0 else (0,)
    return (last,)


def shard_layout(model: ModelSpec, layout: Layout, stage: int) -> ShardLayout:
    """Flat-buffer layout of stage `stage` (forward key order; a tied embedding copy goes last)."""
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage={stage} outside [0, {layout.pp}) for layout {layout}")
    # Cached on what the shard depends on (not dp or ranks): planning many placements of the
    # same strategy (the plan search) otherwise rebuilt it each time (~200 ms for 70B).
    return _shard_layout(model, Layout(tp=layout.tp, pp=layout.pp, layers_per_stage=layout.layers_per_stage,
                                       partition=layout.partition), stage)


@functools.lru_cache(maxsize=1024)
def _shard_layout(model: ModelSpec, layout: Layout, stage: int) -> ShardLayout:
    check_fits(model, layout)
    align = max(1, ALIGN_BYTES // model.element_size)
    head_copy = []
    ordered = []
    for p in model.params:
        if stage in param_stages(model, layout, p):
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
