"""Helpers of bench_gpu_realloc.py: every rank's shards on one device, filled and checked tensor by
tensor against slices of full tensors, and the gather-and-slice baseline.

    shards = Shards(model, layout, device)            # every rank's ModelShard (+ ExpertShard)
    fill(shards)                                      # sources: slices of pattern(p) per tensor
    check(dst_shards) -> bool                         # destinations == slices of pattern(p)
    GatherSlice(src_shards, dst_shards).run()         # the baseline method

Oracle: parameter i's full tensor is real_py.benchmark.pattern(i) with 15 bits, stored as int16
bits (any dtype of 2 bytes; compared as bits, so NaN patterns compare too); it never repeats
within 32K elements, so a misplaced element is caught. A rank's expected piece is tp_slice
(real_py/realloc/shard.py, the same slicing the tests' oracle uses) of that full tensor:
independent of the planner. Done one tensor at a time, so the check needs the largest tensor's
memory, not the model's.

GatherSlice, the method the peers use (gather each tensor whole, then slice what each
destination needs): per tensor, its pieces from one replica of the source layout are
concatenated into one full tensor (torch.cat with out=, the blocked / grouped rules of
gather_full), then each destination piece is written with one copy_ or cat(out=) into the
destination view: two copies per byte, one tensor of extra memory at a time.
"""

from __future__ import annotations

import torch

from real_py.benchmark import pattern
from real_py.layout import Layout
from real_py.realloc.shard import ExpertShard, ModelShard, tp_slice
from real_py.spec import ModelSpec


class Shards:
    """Every rank's shards of `layout` on `device` (or those of `ranks`: one process's own, for
    CUDA IPC): {rank: ModelShard}, and {rank: ExpertShard} for an MoE model.
    pieces(name) -> [(tp size, tp rank, replica, view)]."""

    def __init__(self, model: ModelSpec, layout: Layout, device, ranks=None):
        self.model, self.layout = model, layout
        ranks = [r for r in layout.ranks if ranks is None or r in ranks]
        self.dense = {r: ModelShard.empty(model, layout, r, device) for r in ranks}
        self.experts = (
            {r: ExpertShard.empty(model, layout, r, device) for r in ranks}
            if model.num_experts
            else {}
        )
        self.device = torch.device(device)
        self.index = {p.name: i for i, p in enumerate(model.params)}
        self.spec = {p.name: p for p in model.params}
        self._pieces: dict[str, list] = {}
        for r, s in self.dense.items():
            dp, k, _ = layout.coords(r)
            for name, v in s.params().items():
                self._pieces.setdefault(name, []).append((layout.tp, k, dp, v))
        for e in self.experts.values():
            for ent in e.shard_layout.entries:
                self._pieces.setdefault(ent.param.name, []).append(
                    (layout.etp, e.etp_rank, e.edp_rank, e.view(ent.param.name))
                )
                self.spec.setdefault(ent.param.name, ent.param)
        for name in self._pieces:
            self.index.setdefault(name, len(self.index))

    def pieces(self, name: str) -> list:
        return self._pieces.get(name, [])

    def names(self) -> list[str]:
        return sorted(self._pieces, key=self.index.__getitem__)

    def flats(self, rank: int):
        """(dense flat, expert flat or None) of a rank."""
        e = self.experts.get(rank)
        return self.dense[rank].flat, (e.flat if e is not None else None)

    def nbytes(self) -> int:
        return sum(
            s.flat.numel() * s.flat.element_size()
            for s in (*self.dense.values(), *self.experts.values())
        )


def fill(shards: Shards) -> None:
    for name in shards.names():
        p = shards.spec[name]
        full = pattern(shards.index[name], p, bits=15, dtype=torch.int16, device=shards.device)
        for tp, k, _, v in shards.pieces(name):
            v.view(torch.int16).copy_(tp_slice(p, full, tp, k))


def check(shards: Shards) -> bool:
    """Every piece of every tensor equals the slice of its full pattern tensor (bits)."""
    for name in shards.names():
        p = shards.spec[name]
        full = pattern(shards.index[name], p, bits=15, dtype=torch.int16, device=shards.device)
        for tp, k, _, v in shards.pieces(name):
            if not torch.equal(v.view(torch.int16), tp_slice(p, full, tp, k)):
                return False
    return True


class GatherSlice:
    """The baseline: per tensor, gather it whole from one source replica, slice every
    destination piece out of it."""

    def __init__(self, src: Shards, dst: Shards):
        self.src, self.dst = src, dst
        self.jobs = []
        for name in dst.names():
            p = src.spec[name]
            pieces = sorted((k, v) for tp, k, rep, v in src.pieces(name) if rep == 0)
            tp = next(t for t, _, _, _ in src.pieces(name))
            self.jobs.append((p, tp, [v for _, v in pieces], dst.pieces(name)))
        self.extra_bytes = (
            max(p.numel for p, *_ in self.jobs) * next(iter(src.dense.values())).flat.element_size()
        )

    def run(self) -> None:
        for p, tp, pieces, outs in self.jobs:
            full = gather(p, pieces, tp)
            for tp_d, k, _, view in outs:
                write_slice(p, full, tp_d, k, view)


def gather(p, pieces: list[torch.Tensor], tp: int) -> torch.Tensor:
    """The full tensor from its tp pieces (gather_full's rules, one tensor)."""
    if p.tp.kind == "replicated" or tp == 1:
        whole = pieces[0]
        return whole if p.tp.kind != "vocab" else whole.narrow(p.tp.dim, 0, p.shape[p.tp.dim])
    d = p.tp.dim
    if p.tp.kind == "vocab":
        shape = list(pieces[0].shape)
        shape[d] *= tp
        out = torch.cat(pieces, d, out=pieces[0].new_empty(shape))
        return out.narrow(d, 0, p.shape[d])
    groups = p.tp.groups or tp
    nb = len(p.blocks)
    if nb == 1 and groups == tp:
        return torch.cat(pieces, d, out=pieces[0].new_empty(p.shape))
    parts = [
        x for t in pieces for x in t.split([b // groups for b in p.blocks] * (groups // tp), d)
    ]
    return torch.cat(
        [parts[g * nb + j] for j in range(nb) for g in range(groups)],
        d,
        out=pieces[0].new_empty(p.shape),
    )


def write_slice(p, full: torch.Tensor, tp: int, k: int, view: torch.Tensor) -> None:
    """view <- tp rank k's piece of full (vocab padding rows zero), without a temporary where the
    piece is one slice."""
    if p.tp.kind == "replicated" or (tp == 1 and p.tp.kind != "vocab"):
        view.copy_(full)
        return
    d = p.tp.dim
    if p.tp.kind == "vocab":
        local = view.shape[d]
        lo, hi = min(full.shape[d], k * local), min(full.shape[d], (k + 1) * local)
        view.narrow(d, 0, hi - lo).copy_(full.narrow(d, lo, hi - lo))
        if hi - lo < local:
            view.narrow(d, hi - lo, local - (hi - lo)).zero_()
        return
    groups = p.tp.groups or tp
    per = groups // tp
    if len(p.blocks) == 1 and per == 1:
        view.copy_(full.chunk(tp, d)[k])
        return
    chunks = [blk.chunk(groups, d) for blk in full.split(list(p.blocks), d)]
    torch.cat([c[j] for j in range(k * per, (k + 1) * per) for c in chunks], d, out=view)
