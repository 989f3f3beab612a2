"""Dp-sharded layouts: with `Layout.dp_shard` "dim0" (FSDP2) or "flat" (ZeRO-3 / FSDP1) each dp
replica of a (stage, tp rank) holds 1/dp of that shard (`dp_shard_layout`). Such layouts are
reallocation sources and destinations for trainers (real_py.interop.embed), not layouts the
engines run on."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..spec import ALIGN_BYTES, ModelSpec, ParamSpec
from .grid import Layout
from .shards import shard_layout


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
