"""The pipeline partition: which layers each stage of a layout holds (`stage_layer_ranges`:
balanced by parameter count, Megatron-core's even split, or explicit) and which stages hold a
parameter (`param_stages`)."""

from __future__ import annotations

import functools

from ..spec import ModelSpec, ParamSpec
from .grid import Layout


@functools.lru_cache(maxsize=256)
def stage_layer_ranges(
    model: ModelSpec,
    pp: int,
    layers_per_stage: tuple[int, ...] | None = None,
    partition: str = "params",
) -> tuple[tuple[int, int], ...]:
    """[lo, hi) layer range per pipeline stage.

    Default (partition "params"): contiguous ranges minimizing the largest stage's parameter
    count, counting the embedding on the first stage and final norm + head (+ tied embedding
    copy) on the last. partition "layers": num_layers / pp layers per stage (Megatron-core).
    """
    L = model.num_layers
    if layers_per_stage is None and partition == "layers":
        if L % pp:
            raise ValueError(
                f"partition='layers' needs pp={pp} to divide num_layers={L} of "
                f"{model.name}; give layers_per_stage=... instead"
            )
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


def param_stages(model: ModelSpec, layout: Layout, p: ParamSpec) -> tuple[int, ...]:
    """Pipeline stages holding parameter p (two for a tied embedding when pp > 1)."""
    ranges = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)
    last = layout.pp - 1
    if p.owner == "layer":
        return tuple(s for s, (lo, hi) in enumerate(ranges) if lo <= p.layer < hi)
    if p.owner == "embed":
        return (0, last) if p.tied_to_head and last > 0 else (0,)
    return (last,)
