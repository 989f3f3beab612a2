"""The Layout: dp x tp x pp (and the expert axes ep x etp) over an explicit list of global ranks,
with its pipeline partition rule and dp sharding; a rank's coordinates and the rank at given
coordinates.

A rank's position in a layout is (dp_idx, tp_idx, pp_idx); `order` says which axis varies
fastest when walking `ranks` (default "tp-dp-pp": tp fastest, then dp, then pp).
"""

from __future__ import annotations

import functools
import numbers
import re
from dataclasses import dataclass
from typing import Any, cast

_AXES = ("tp", "dp", "pp")
DP_SHARD = ("none", "dim0", "flat")
MAX_RANKS = 1 << 20
"""Global ranks must be below this: the planner's tables grow with the largest rank."""


def _short(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_ranks(ranks) -> None:
    """ValueError naming the first entry of Layout.ranks that is not a rank in [0, MAX_RANKS)."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(
            f"Layout.ranks must be a sequence of global ranks (ints), got "
            f"{type(ranks).__name__} {_short(ranks)}"
        )
    for i, r in enumerate(ranks):
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise ValueError(
                f"Layout.ranks[{i}]={r!r} ({type(r).__name__}); every rank must be an int"
            )
        if not 0 <= int(r) < MAX_RANKS:
            raise ValueError(
                f"Layout.ranks[{i}]={r} is outside [0, {MAX_RANKS}); global ranks are "
                "non-negative and below 2**20"
            )


PARTITIONS = ("params", "layers")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    # Typed as the tuple it always is once built: __post_init__ replaces the None default (and
    # any sequence passed) with a tuple, so readers of layout.ranks need no None check.
    ranks: tuple[int, ...] = cast("tuple[int, ...]", None)
    """Global ranks, walked in `order`; None (the default) means range(dp * tp * pp)."""
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
    """Expert parallel: each MoE layer's experts split by index over ep ranks (expert_shard_layout
    in real_py.layout.shards; moved by real_py.realloc.moe_plan)."""
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
            raise ValueError(
                f"Layout.order={self.order!r}; allowed: a permutation of tp-dp-pp "
                "such as 'tp-dp-pp' or 'tp-pp-dp'"
            )
        n = self.dp * self.tp * self.pp
        if n > MAX_RANKS:  # checked before any per-rank tuple is built
            raise ValueError(
                f"Layout dp{self.dp}tp{self.tp}pp{self.pp} needs {n} ranks, more than "
                f"the {MAX_RANKS} global ranks real_py plans for"
            )
        ranks = tuple(range(n)) if self.ranks is None else tuple(int(r) for r in self.ranks)
        if len(ranks) != n:
            raise ValueError(
                f"Layout dp{self.dp}tp{self.tp}pp{self.pp} needs {n} ranks, got "
                f"{len(ranks)}: {list(ranks)[:16]}"
            )
        if len(set(ranks)) != n:
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise ValueError(
                f"Layout ranks contain duplicates {dup}: each global rank may appear once"
            )
        object.__setattr__(self, "ranks", ranks)
        if self.partition not in PARTITIONS:
            raise ValueError(f"Layout.partition={self.partition!r}; allowed: {PARTITIONS}")
        if self.layers_per_stage is not None:
            lps = tuple(int(x) for x in self.layers_per_stage)
            if len(lps) != self.pp or min(lps) < 1:
                raise ValueError(
                    f"layers_per_stage={lps} must have pp={self.pp} entries, each >= 1"
                )
            object.__setattr__(self, "layers_per_stage", lps)
        if self.dp_shard not in DP_SHARD:
            raise ValueError(f"Layout.dp_shard={self.dp_shard!r}; allowed: {DP_SHARD}")
        if self.dp == 1:
            object.__setattr__(self, "dp_shard", "none")
        if (self.dp * self.tp) % (self.ep * self.etp):
            raise ValueError(
                f"Layout ep{self.ep} x etp{self.etp} = {self.ep * self.etp} expert ranks "
                f"must divide the {self.dp * self.tp} (dp x tp) ranks of each pipeline "
                f"stage of {self}"
            )
        if (self.ep > 1 or self.etp > 1) and self.dp_shard != "none":
            raise ValueError(
                f"Layout {self}: expert layouts (ep, etp) with dp_shard="
                f"{self.dp_shard!r} are not supported; use dp_shard='none'"
            )
        if self.layers_per_stage is not None:  # an explicit split leaves no rule to choose
            object.__setattr__(self, "partition", "params")

    @classmethod
    def parse(cls, text: str, **kwargs) -> Layout:
        """'dp2,tp4,pp1' (any order, separators optional, missing axes default to 1); a token
        'dim0' or 'flat' (e.g. 'dp4,tp2,dim0', the form str() writes: 'dp4tp2pp1-dim0') sets
        dp_shard."""
        shard = re.findall(r"dim0|flat", text)
        axes = re.sub(r"dim0|flat", "", text)
        pairs = re.findall(r"(etp|ep|dp|tp|pp)\s*=?\s*(\d+)", axes)
        found = dict(pairs)
        repeated = sorted({k for k, _ in pairs if sum(a == k for a, _ in pairs) > 1})
        if repeated:
            raise ValueError(
                f"cannot parse layout {text!r}: axis {', '.join(repeated)} given more "
                "than once; give each of dp, tp, pp, ep, etp at most once, e.g. 'dp2,tp4'"
            )
        rest = re.sub(r"(etp|ep|dp|tp|pp)\s*=?\s*\d+|[\s,x_-]", "", axes)
        if not found or rest or len(shard) > 1:
            raise ValueError(
                f"cannot parse layout {text!r}; expected e.g. 'dp2,tp4,pp1', "
                "'dp4,tp2,dim0' (dp sharding: dim0 or flat) or 'dp4,tp2,ep8,etp1' "
                "(experts)"
            )
        if shard:
            kwargs.setdefault("dp_shard", shard[0])
        sizes: dict[str, Any] = {k: int(v) for k, v in found.items()}  # axis sizes only
        return cls(**sizes, **kwargs)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        shard = "" if self.dp_shard == "none" else f"-{self.dp_shard}"
        experts = (f"ep{self.ep}" if self.ep > 1 else "") + (
            f"etp{self.etp}" if self.etp > 1 else ""
        )
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
        return [
            [[self.rank(d, t, p) for t in range(self.tp)] for d in range(self.dp)]
            for p in range(self.pp)
        ]


@functools.lru_cache(maxsize=256)
def _coords_table(layout: Layout) -> dict[int, tuple[int, int, int]]:
    return {
        layout.rank(d, t, p): (d, t, p)
        for p in range(layout.pp)
        for d in range(layout.dp)
        for t in range(layout.tp)
    }
