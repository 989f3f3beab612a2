"""Parallel layouts (dp, tp, pp over an explicit list of global ranks) and shard flat-buffer layouts.

A rank's position in a layout is (dp_idx, tp_idx, pp_idx); `order` says which axis varies
fastest when walking `ranks` (default "tp-dp-pp": tp fastest, then dp, then pp). The shard of
(pp stage s, tp rank k) is one flat buffer holding the stage's parameters in forward key order,
each a contiguous range starting on an ALIGN_BYTES boundary; every dp replica holds the same
shard. Padding between parameters and vocab padding rows are zero and never transferred.

With `dp_shard` "dim0" (FSDP2) or "flat" (ZeRO-3 / FSDP1) the dp replicas of a (stage, tp rank)
each hold 1/dp of that shard instead (dp_shard_layout); such layouts are reallocation sources
and destinations for trainers (real_py.interop.embed), not layouts the engines run on.
"""

from __future__ import annotations

import functools
import numbers
import re
from dataclasses import dataclass

from .spec import ALIGN_BYTES, ModelSpec, ParamSpec

_AXES = ("tp", "dp", "pp")
DP_SHARD = ("none", "dim0", "flat")
MAX_RANKS = 1 << 20
"""Global ranks must be below this: the planner's tables grow with the largest rank."""


def require_spec(model, arg: str = "model") -> None:
    """TypeError unless `model` is a ModelSpec (a ModelConfig or a name is a common slip)."""
    if not isinstance(model, ModelSpec):
        hint = (" (build one with real_py.model_spec(config))"
                if type(model).__name__ == "ModelConfig" or isinstance(model, str) else "")
        raise TypeError(f"{arg} must be a real_py.ModelSpec{hint}, got {type(model).__name__} "
                        f"{_short(model)}")


def require_layout(layout, arg: str = "layout") -> None:
    """TypeError unless `layout` is a Layout (parse strings with Layout.parse('dp2,tp2'))."""
    if not isinstance(layout, Layout):
        hint = " (parse a string with real_py.Layout.parse)" if isinstance(layout, str) else ""
        raise TypeError(f"{arg} must be a real_py.Layout{hint}, got {type(layout).__name__} "
                        f"{_short(layout)}")


def _short(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_ranks(ranks) -> None:
    """ValueError naming the first entry of Layout.ranks that is not a rank in [0, MAX_RANKS)."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"Layout.ranks must be a sequence of global ranks (ints), got "
                        f"{type(ranks).__name__} {_short(ranks)}")
    for i, r in enumerate(ranks):
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise ValueError(f"Layout.ranks[{i}]={r!r} ({type(r).__name__}); every rank must be an int")
        if not 0 <= r < MAX_RANKS:
            raise ValueError(f"Layout.ranks[{i}]={r} is outside [0, {MAX_RANKS}); global ranks are "
                             "non-negative and below 2**20")


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
    dp_shard: str = "none"
    """Data-parallel sharding of each (stage, tp rank) shard over the dp replicas: "none" (every
    replica holds the whole shard), "dim0" (FSDP2: each parameter's local tensor chunked along
    dim 0 with torch.chunk semantics, padded storage) or "flat" (ZeRO-3 / FSDP1: the shard's flat
    buffer split evenly). See dp_shard_layout. dp=1 normalizes to "none"."""
    ep: int = 1
    """Expert parallel: each MoE layer's experts split by index over ep ranks (real_py.layout_moe)."""
    etp: int = 1
    """Expert tensor parallel: each expert's tensors split over etp ranks. Experts are folded
    over the (dp, tp) ranks of each pipeline stage as (etp fastest, then ep, then expert-dp),
    as Megatron-core's parallel folding; ep * etp must divide dp * tp."""
    partition: str = "params"
    """Default pipeline split when layers_per_stage is None: "params" (contiguous stages
    minimizing the largest stage's parameter count) or "layers" (num_layers / pp each, as
    Megatron-core splits; pp must divide num_layers)."""

    def __post_init__(self):
        for axis in _AXES + ("ep", "etp"):
            v = getattr(self, axis)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Layout.{axis}={v!r} must be a positive int")
        if self.ranks is not None:
            _check_ranks(self.ranks)
        if not isinstance(self.order, str) or sorted(self.order.split("-")) != sorted(_AXES):
            raise ValueError(f"Layout.order={self.order!r}; allowed: a permutation of tp-dp-pp "
                             "such as 'tp-dp-pp' or 'tp-pp-dp'")
        n = self.dp * self.tp * self.pp
        if n > MAX_RANKS:  # checked before any per-rank tuple is built
            raise ValueError(f"Layout dp{self.dp}tp{self.tp}pp{self.pp} needs {n} ranks, more than "
                             f"the {MAX_RANKS} global ranks real_py plans for")
        ranks = tuple(range(n)) if self.ranks is None else tuple(int(r) for r in self.ranks)
        if len(ranks) != n:
            raise ValueError(f"Layout dp{self.dp}tp{self.tp}pp{self.pp} needs {n} ranks, got "
                             f"{len(ranks)}: {list(ranks)[:16]}")
        if len(set(ranks)) != n:
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise ValueError(f"Layout ranks contain duplicates {dup}: each global rank may appear once")
        object.__setattr__(self, "ranks", ranks)
        if self.partition not in PARTITIONS:
            raise ValueError(f"Layout.partition={self.partition!r}; allowed: {PARTITIONS}")
        if self.layers_per_stage is not None:
            lps = tuple(int(x) for x in self.layers_per_stage)
            if len(lps) != self.pp or min(lps) < 1:
                raise ValueError(f"layers_per_stage={lps} must have pp={self.pp} entries, each >= 1")
            object.__setattr__(self, "layers_per_stage", lps)
        if self.dp_shard not in DP_SHARD:
            raise ValueError(f"Layout.dp_shard={self.dp_shard!r}; allowed: {DP_SHARD}")
        if self.dp == 1:
            object.__setattr__(self, "dp_shard", "none")
        if (self.dp * self.tp) % (self.ep * self.etp):
            raise ValueError(f"Layout ep{self.ep} x etp{self.etp} = {self.ep * self.etp} expert ranks "
                             f"must divide the {self.dp * self.tp} (dp x tp) ranks of each pipeline "
                             f"stage of {self}")
        if (self.ep > 1 or self.etp > 1) and self.dp_shard != "none":
            raise ValueError(f"Layout {self}: expert layouts (ep, etp) with dp_shard="
                             f"{self.dp_shard!r} are not supported; use dp_shard='none'")
        if self.layers_per_stage is not None:  # an explicit split leaves no rule to choose
            object.__setattr__(self, "partition", "params")

    @classmethod
    def parse(cls, text: str, **kwargs) -> "Layout":
        """'dp2,tp4,pp1' (any order, separators optional, missing axes default to 1); a token
        'dim0' or 'flat' (e.g. 'dp4,tp2,dim0', the form str() writes: 'dp4tp2pp1-dim0') sets
        dp_shard."""
        shard = re.findall(r"dim0|flat", text)
        axes = re.sub(r"dim0|flat", "", text)
        pairs = re.findall(r"(etp|ep|dp|tp|pp)\s*=?\s*(\d+)", axes)
        found = dict(pairs)
        repeated = sorted({k for k, _ in pairs if sum(a == k for a, _ in pairs) > 1})
        if repeated:
            raise ValueError(f"cannot parse layout {text!r}: axis {', '.join(repeated)} given more "
                             "than once; give each of dp, tp, pp, ep, etp at most once, e.g. 'dp2,tp4'")
        rest = re.sub(r"(etp|ep|dp|tp|pp)\s*=?\s*\d+|[\s,x_-]", "", axes)
        if not found or rest or len(shard) > 1:
            raise ValueError(f"cannot parse layout {text!r}; expected e.g. 'dp2,tp4,pp1', "
                             "'dp4,tp2,dim0' (dp sharding: dim0 or flat) or 'dp4,tp2,ep8,etp1' "
                             "(experts)")
        if shard:
            kwargs.setdefault("dp_shard", shard[0])
        return cls(**{k: int(v) for k, v in found.items()}, **kwargs)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        shard = "" if self.dp_shard == "none" else f"-{self.dp_shard}"
        experts = (f"ep{self.ep}" if self.ep > 1 else "") + (f"etp{self.etp}" if self.etp > 1 else "")
        return f"dp{self.dp}tp{self.tp}pp{self.pp}{experts}{shard}"

    @property
    def edp(self) -> int:
        """Expert data parallel: replicas of each expert piece per stage, dp * tp / (ep * etp)."""
        return self.dp * self.tp // (self.ep * self.etp)

    def expert_coords(self, rank: int) -> tuple[int, int, int, int] | None:
        """(edp_idx, ep_idx, etp_idx, pp_idx) of a global rank (parallel folding: the stage's
        ranks walked tp fastest then dp, cut etp fastest, then ep, then expert-dp)."""
        c = self.coords(rank)
        if c is None:
            return None
        d, t, p = c
        i = d * self.tp + t
        return i // (self.etp * self.ep), (i // self.etp) % self.ep, i % self.etp, p

    def expert_rank(self, edp: int, ep: int, etp: int, pp: int) -> int:
        """Global rank at expert position (edp_idx, ep_idx, etp_idx, pp_idx)."""
        i = (edp * self.ep + ep) * self.etp + etp
        return self.rank(i // self.tp, i % self.tp, pp)

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
    require_spec(model)
    require_layout(layout)
    model.check_tp(layout.tp)
    check_experts(model, layout)
    if layout.pp > model.num_layers:
        raise ValueError(f"pp={layout.pp} exceeds num_layers={model.num_layers} of {model.name}; "
                         f"pick pp in 1..{model.num_layers}")
    if layout.layers_per_stage is not None and sum(layout.layers_per_stage) != model.num_layers:
        raise ValueError(f"layers_per_stage={layout.layers_per_stage} sums to "
                         f"{sum(layout.layers_per_stage)}, but {model.name} has {model.num_layers} layers")
    if layout.layers_per_stage is None and layout.partition == "layers" and model.num_layers % layout.pp:
        raise ValueError(f"partition='layers' needs pp={layout.pp} to divide num_layers="
                         f"{model.num_layers} of {model.name}; give layers_per_stage=... instead")


def check_experts(model: ModelSpec, layout: Layout) -> None:
    """ValueError naming the field when ep / etp cannot split the model's experts."""
    experts = model.num_experts
    if not experts:
        if layout.ep > 1 or layout.etp > 1:
            raise ValueError(f"layout {layout} sets ep={layout.ep}, etp={layout.etp}, but {model.name} "
                             "has no experts (num_experts=0); drop ep/etp")
        return
    if experts % layout.ep:
        raise ValueError(f"ep={layout.ep} does not divide num_experts={experts} of {model.name}")
    for p in model.params:
        if p.expert >= 0:
            why = p.tp_error(layout.etp)
            if why:
                raise ValueError(f"etp={layout.etp}: {why} of {p.name}")
            break


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
        if L % pp:
            raise ValueError(f"partition='layers' needs pp={pp} to divide num_layers={L} of "
                             f"{model.name}; give layers_per_stage=... instead")
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
        prev, row, pick = best[s - 1], best[s], choice[s]
        for i in range(s + 1, L + 1):
            # Last stage's first layer a, from i - 1 down: its cost only grows, so stop once it
            # alone exceeds the best found; "<=" keeps the smallest a among equal optima.
            # (Locals, no max(): this loop is most of a cold plan's layout time at pp=16.)
            top, best_v, best_a = prefix[i] + extra, row[i], pick[i]
            for a in range(i - 1, s - 1, -1):
                seg = top - prefix[a]
                if seg > best_v:
                    break
                v = prev[a]
                if v < seg:
                    v = seg
                if v <= best_v:
                    best_v, best_a = v, a
            row[i], pick[i] = best_v, best_a
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
    require_spec(model)
    require_layout(layout)
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage={stage} outside [0, {layout.pp}) for layout {layout}")
    # Cached on what the shard depends on (not dp or ranks): planning many placements of the
    # same strategy (the plan search) otherwise rebuilt it each time (~200 ms for 70B).
    return _shard_layout(model, Layout(tp=layout.tp, pp=layout.pp, layers_per_stage=layout.layers_per_stage,
                                       partition=layout.partition), stage)


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
        raise ValueError(f"stage={stage}, ep_rank={ep_rank} outside pp={layout.pp}, ep={layout.ep} "
                         f"of layout {layout}")
    return _expert_shard_layout(model, Layout(tp=layout.tp, dp=layout.dp, pp=layout.pp, ep=layout.ep,
                                              etp=layout.etp, layers_per_stage=layout.layers_per_stage,
                                              partition=layout.partition), stage, ep_rank)


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


@dataclass(frozen=True, slots=True)
class DpPiece:
    """What a dp-sharded rank holds of one parameter: elements [lo, hi) of the (TP-local)
    tensor, counted row-major, stored contiguously at `offset` of the rank's flat buffer."""

    param: ParamSpec
    offset: int
    lo: int
    hi: int
    shape: tuple[int, ...]
    """Shape of the held piece: dim0 -> (rows, *local_shape[1:]); flat -> (hi - lo,)."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class DpShardLayout:
    """Flat-buffer layout of one dp replica's piece of a (stage, tp rank) shard."""

    pieces: tuple[DpPiece, ...]
    numel: int
    """Buffer length in elements (FSDP2 per-parameter padding / ZeRO even split included)."""

    def piece(self, name: str) -> DpPiece:
        for e in self.pieces:
            if e.param.name == name:
                return e
        raise KeyError(name)


@functools.lru_cache(maxsize=1024)
def dp_shard_layout(model: ModelSpec, layout: Layout, stage: int, dp_rank: int) -> DpShardLayout:
    """The buffer of dp replica `dp_rank` of `stage` in a dp-sharded layout.

    dim0 (FSDP2 fully_shard): each parameter's local tensor of R rows is cut like
      torch.chunk(t, dp, 0): c = ceil(R / dp) rows per piece, replica d holds rows
      [min(R, d c), min(R, (d + 1) c)) (the last pieces may be short or empty); every piece has
      storage for c rows (zero padding), aligned like shard entries, in the shard's entry order.
    flat (ZeRO-3 / FSDP1): the shard's flat buffer (shard_layout, N elements) is split into
      dp pieces of c = ceil(N / dp) elements; replica d holds [d c, (d + 1) c), the last one
      zero-padded; each parameter's piece is its part of that range (often empty, may cut rows).
    """
    if layout.dp_shard == "none":
        raise ValueError(f"layout {layout} is not dp-sharded (dp_shard='none'); use shard_layout")
    if not 0 <= dp_rank < layout.dp:
        raise ValueError(f"dp_rank={dp_rank} outside [0, {layout.dp}) for layout {layout}")
    sl = shard_layout(model, layout, stage)
    dp, pieces = layout.dp, []
    if layout.dp_shard == "dim0":
        align = max(1, ALIGN_BYTES // model.element_size)
        off = 0
        for e in sl.entries:
            rows = e.local_shape[0]
            row = e.numel // rows
            c = -(-rows // dp)
            lo, hi = min(rows, dp_rank * c), min(rows, (dp_rank + 1) * c)
            pieces.append(DpPiece(e.param, off, lo * row, hi * row, (hi - lo,) + e.local_shape[1:]))
            off = -(-(off + c * row) // align) * align
        return DpShardLayout(tuple(pieces), off)
    c = -(-sl.numel // dp)
    start, end = dp_rank * c, (dp_rank + 1) * c
    for e in sl.entries:
        lo, hi = max(start, e.offset), min(end, e.offset + e.numel)
        if hi > lo:
            pieces.append(DpPiece(e.param, lo - start, lo - e.offset, hi - e.offset, (hi - lo,)))
        else:
            pieces.append(DpPiece(e.param, 0, 0, 0, (0,)))
    return DpShardLayout(tuple(pieces), c)
