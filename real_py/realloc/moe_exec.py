"""Executing an MoE reallocation on one rank: `MoeReallocator(plan, transport).run(...)`.

    r = MoeReallocator(plan_moe_realloc(model, src, dst), transport, bucket_bytes=256 << 20)
    stats = r.run(src_shard, src_experts, dst_shard, dst_experts)   # None where the rank holds none

The parts of the plan (moe_plan.py) run as ONE schedule: every part the rank takes part in is a
lane of the round loop (rounds.py), with rounds of MoePlan.part_round_elems and relabelled by
MoePlan.round_shift; merged round r posts round r of every such part in one transport.start. Each
rank derives its lanes alone (rank_schedule per part, C++), and MoePlan.transfers() is the same
schedule for the cluster simulator.

Memory bound: part p's rounds hold round_elems * w_p // M_p elements (MoePlan.part_round_elems:
w_p its parameter count, M_p the largest sum of w over the parts any of its ranks sends, or
receives, in), so a merged round never carries more than one round's budget per rank and
direction, and the staging buffer stays within bucket_bytes (two halves with pipelining), as
for one plan. The number of merged rounds is that of the longest part.

Buffers: no copies. The dense part runs on the rank's ModelShard buffers themselves (the dense
spec lays out the same flat buffer: shard layouts skip expert tensors). An expert part's spec
orders a rank's expert tensors by (expert range, layer) or stacks them, its ExpertShard orders
them by layer, so its rank schedule is re-addressed once, at construction (`readdress`): each descriptor's own-side
offsets move tensor by tensor into the ExpertShard buffer, cut where they cross tensors that
moved apart; a direct piece that is no longer one run there is staged on that end (the peer
may still move it directly). Expert parts keep their direct pieces in their rounds (each end
decides alone how it moves its side of a piece; only the dense part's go out at the start).

One pass (one_pass=None: on for addressable transports without verify, as for the Reallocator):
every chunk a rank receives, in every part, with its descriptors moved into the sender's and this
rank's ExpertShard buffers where the part is an expert part (`_segments` of the sender, computed
here from the layouts alone), and every local copy, make ONE compiled copy (direct.py) over the
senders' dense and expert source buffers: one launch per rank and move, no staging.

Every world rank constructs the MoeReallocator (setup is collective, once per part) and calls
run() for every MoePlan in the same order.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from ..layout import Layout, expert_shard_layout, shard_layout
from ..spec import ModelSpec
from .moe_plan import MoePart, MoePlan
from .rank_schedule import RankSchedule, rank_schedule
from .direct import DirectRunner, Entry, plan_tag, schedule_readers
from .reallocator import (DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_MIN_BYTES, check_flat, resolve_one_pass, run_ranks,
                          schedule_bytes)
from .rounds import Lane, RoundOptions, RoundRunner
from .shard import ExpertShard, ModelShard
from .transports.base import Transport
from .transports.inprocess import InProcessHub


class MoeReallocator:
    def __init__(self, plan: MoePlan, transport: Transport, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 pipeline: bool | None = None, verify: bool = False,
                 direct_min_bytes: int | None = DEFAULT_DIRECT_MIN_BYTES, one_pass: bool | None = None,
                 inflight: int | None = None, merge: bool | None = None):
        """Options as Reallocator's; the bucket bounds the staging of all parts together."""
        if not isinstance(plan, MoePlan):
            raise TypeError(f"plan must be a MoePlan (plan_moe_realloc), got {type(plan).__name__}")
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a real_py Transport (DistTransport, InProcessHub."
                            f"transport(rank), ...), got {type(transport).__name__}")
        self.plan, self.transport, self.rank = plan, transport, transport.rank
        self.opts = RoundOptions.resolve(transport, plan.model.element_size, plan.model.dtype,
                                         bucket_bytes=bucket_bytes, pipeline=pipeline, verify=verify,
                                         direct_min_bytes=direct_min_bytes, inflight=inflight, merge=merge)
        sizes = plan.part_round_elems(self.opts.round_elems)
        self.one_pass = resolve_one_pass(transport, one_pass, verify)
        entries, readers = [], set()
        lanes = []
        self.lane_parts: list[int] = []
        """Index in plan.parts of each lane (the parts this rank sends or receives in)."""
        for part in plan.parts:
            transport.setup(part.plan)  # collective: every rank, every part, in part order
        try:  # this rank alone from here: a failure is told to the peers, which then stop waiting
            for p, part in enumerate(plan.parts):
                if self.rank not in part.plan.src.ranks and self.rank not in part.plan.dst.ranks:
                    continue
                rs = rank_schedule(part.plan, self.rank, sizes[p], self.opts.direct_min_elems)
                if self.one_pass:
                    entries += self._entries(p, rs)
                    readers |= schedule_readers(rs)
                if part.experts is not None:
                    q = part.plan
                    segs = [_segments(part, lay, spec, full, self.rank) if self.rank in lay.ranks
                            else None for lay, spec, full in ((q.src, plan.model, plan.src),
                                                               (q.dst, plan.dst_model, plan.dst))]
                    rs = readdress(rs, *segs)
                lanes.append(Lane(rs, plan.round_shift(p, rs.num_rounds), part.label,
                                  direct_first=part.experts is None))
                self.lane_parts.append(p)
        except Exception as e:
            transport.fail(f"building the rank schedule of rank {self.rank}", f"{type(e).__name__}: {e}"[:1000])
            raise
        if self.one_pass:
            self.runner = DirectRunner(transport, plan_tag(plan), entries, readers, plan.model.element_size,
                                       buf_ids=self.lane_parts)
        else:
            self.runner = RoundRunner(transport, lanes, self.opts)
        # Schedules kept for the byte counts either way.
        self.schedules = [lane.schedule for lane in lanes]
        self._bytes: dict | None = None

    def _entries(self, p: int, rs: RankSchedule) -> list[Entry]:
        """One-pass entries of part p: its received chunks and local copies, expert parts'
        descriptors moved into the sender's and this rank's ExpertShard buffers."""
        part = self.plan.parts[p]
        local, chunks = rs.local, [(c.sender, c.descs) for rr in rs.rounds for c in rr.recvs]
        if part.experts is not None:
            q, model = part.plan, self.plan.model
            segs = lambda lay, full, r: _segments(part, lay, model, full, r)  # noqa: E731
            mine = segs(q.dst, self.plan.dst, self.rank) if self.rank in q.dst.ranks else None
            theirs = {s: segs(q.src, self.plan.src, s) for s in {s for s, _ in chunks}}
            chunks = [(s, _move(_move(d, 0, theirs[s]), 1, mine)) for s, d in chunks]
            if len(local):
                local = _move(_move(local, 0, segs(q.src, self.plan.src, self.rank)), 1, mine)
        out = [Entry(self.rank, p, p, local)] if len(local) else []
        return out + [Entry(s, p, p, d) for s, d in chunks]

    @property
    def staging(self):
        return getattr(self.runner, "staging", None)

    def run(self, src: ModelShard | None, src_experts: ExpertShard | None,
            dst: ModelShard | None, dst_experts: ExpertShard | None, *,
            free_source: bool = False) -> dict:
        """Move this rank's share of every part; stats as Reallocator.run's, over all parts.
        free_source=True releases the storage of both source buffers once every round of this
        rank completed (never on failure)."""
        t0 = time.perf_counter()
        bufs, check = self._inputs(src, src_experts, dst, dst_experts)
        stats = self.runner.run(bufs, check)
        return self._done((src, src_experts), free_source, stats, t0)

    def _inputs(self, src, src_experts, dst, dst_experts):
        """(bufs, check): check() validates the shards and fills bufs, one (source, destination)
        flat pair per lane."""
        bufs: list[tuple] = []

        def check():
            for side, shard, experts in (("source", src, src_experts),
                                         ("destination", dst, dst_experts)):
                if (shard is None) != (experts is None):
                    raise ValueError(f"rank {self.rank}: the {side} needs both its ModelShard and "
                                     f"its ExpertShard (or neither), got {shard!r} and {experts!r}")
                self._check_side(shard, experts, side)
            flats = [x.flat for x in (src, src_experts, dst, dst_experts) if x is not None]
            if len({f.device for f in flats}) > 1:
                raise ValueError(f"rank {self.rank}: buffers on {sorted({str(f.device) for f in flats})}: "
                                 "move them so all four share a device")
            for p in self.lane_parts:
                part = self.plan.parts[p]
                q = part.plan
                if part.experts is None:  # the dense spec addresses the ModelShards' own buffers
                    s = ModelShard(q.model, q.src, self.rank, src.flat) if src is not None else None
                    d = ModelShard(q.dst_model, q.dst, self.rank, dst.flat) if dst is not None else None
                    bufs.append((s.flat if s is not None else None, d.flat if d is not None else None))
                else:  # expert parts address the ExpertShards (readdress)
                    bufs.append((src_experts.flat if src_experts is not None else None,
                                 dst_experts.flat if dst_experts is not None else None))

        return bufs, check

    def _done(self, src, free_source: bool, stats: dict, t0: float) -> dict:
        shard, experts = src
        if free_source and shard is not None:
            # Every send of this rank completed (waited in run), so nothing reads them any more.
            shard.flat.untyped_storage().resize_(0)
            experts.flat.untyped_storage().resize_(0)
        if self._bytes is None:  # counted once: a replayed move does no work per chunk
            self._bytes = schedule_bytes(self.schedules, self.plan.model.element_size)
        return {"rank": self.rank, **self._bytes,
                **stats, "parts": len(self.plan.parts), "lanes": len(self.schedules),
                "seconds": time.perf_counter() - t0}

    def _check_side(self, shard: ModelShard | None, experts: ExpertShard | None, side: str) -> None:
        """Both buffers of one side belong to the plan's model, layout and this rank, with storage."""
        layout = self.plan.src if side == "source" else self.plan.dst
        holds = self.rank in layout.ranks
        if shard is None and experts is None:
            if holds:
                raise ValueError(f"rank {self.rank} is in the {side} layout {layout} but passed no {side} "
                                 "ModelShard and ExpertShard")
            return
        if not holds:
            raise ValueError(f"rank {self.rank} is not in the {side} layout {layout} but passed {side} shards")
        want = self.plan.model if side == "source" else self.plan.dst_model
        for what, x, cls in (("ModelShard", shard, ModelShard), ("ExpertShard", experts, ExpertShard)):
            if not isinstance(x, cls):
                raise TypeError(f"{side} {what} expected, got {type(x).__name__}")
            if x.model != want or x.layout != layout or x.rank != self.rank:
                raise ValueError(f"{side} {what} is for {x.model.name} {x.layout} rank {x.rank}; the "
                                 f"plan's {side} is {want.name} {layout} on this rank {self.rank}")
            check_flat(x, side, "shard" if cls is ModelShard else "expert shard")
            flat = x.flat
            if flat.untyped_storage().nbytes() < (flat.storage_offset() + flat.numel()) * flat.element_size():
                raise ValueError(f"{side} {what} of rank {self.rank} ({layout}) has no storage behind "
                                 "its buffer: it was freed (free_source=True) or offloaded "
                                 "(HostOffload); reload it before reallocating")


def _segments(part: MoePart, part_layout: Layout, model: ModelSpec, layout: Layout,
              rank: int) -> np.ndarray:
    """[k, 3] (start, end, shift): elements [start, end) of `rank`'s flat buffer of an expert
    part sit at + shift in its ExpertShard buffer (consecutive tensors with one shift merged).
    A stacked tensor's local piece is the rank's ep group's experts, one after the other."""
    _, tp_rank, stage = part_layout.coords(rank)
    _, ep_rank, _, estage = layout.expert_coords(rank)
    where = {e.param.name: e.offset for e in expert_shard_layout(model, layout, estage, ep_rank).entries}
    segs: list[list[int]] = []
    for e in shard_layout(part.plan.model, part_layout, stage).entries:
        names = (e.param.name,)
        if part.pieces is not None:
            every = part.pieces[e.param.name]
            k = len(every) // part_layout.tp
            names = every[tp_rank * k:(tp_rank + 1) * k]
        n = e.numel // len(names)
        for i, name in enumerate(names):
            start, shift = e.offset + i * n, where[name] - e.offset - i * n
            if segs and segs[-1][2] == shift and segs[-1][1] == start:
                segs[-1][1] = start + n
            else:
                segs.append([start, start + n, shift])
    return np.array(segs, np.int64).reshape(-1, 3)


def _move(descs: np.ndarray, col: int, segs: np.ndarray | None) -> np.ndarray:
    """`descs` with column `col` (0: source side, 1: destination side) moved into the expert
    shard by `segs`; a descriptor whose runs cross segments is cut (rows of runs inside one
    segment, and runs cut at segment ends), the other column following element for element."""
    if segs is None or len(descs) == 0:
        return descs
    lo = descs[:, col]
    hi = lo + (descs[:, 3] - 1) * descs[:, 4 + col] + descs[:, 2]
    i = np.searchsorted(segs[:, 0], lo, side="right") - 1
    inside = hi <= segs[i, 1]
    out = descs[inside].copy()
    out[:, col] += segs[i[inside], 2]
    cut = [out]
    for row in descs[~inside].tolist():
        cut.append(np.array(_cut(row, col, segs), np.int64).reshape(-1, 6))
    return np.concatenate(cut)


def _cut(row: list[int], col: int, segs: np.ndarray) -> list[tuple]:
    other = 1 - col
    so, oo, ln, n, st, ost = row[col], row[other], row[2], row[3], row[4 + col], row[4 + other]
    out, r = [], 0

    def seg(x):
        k = int(np.searchsorted(segs[:, 0], x, side="right")) - 1
        if k < 0 or x >= segs[k, 1]:
            raise RuntimeError(f"descriptor element {x} outside every tensor of the part")
        return k

    def put(a, b, length, runs, sa, sb):  # (this column, other column, ...) back in column order
        out.append((a, b, length, runs, sa, sb) if col == 0 else (b, a, length, runs, sb, sa))

    while r < n:
        a = so + r * st
        k = seg(a)
        end, shift = int(segs[k, 1]), int(segs[k, 2])
        if a + ln <= end:  # runs r .. rb - 1 all inside segment k
            rb = n if n == 1 or st <= 0 else min(n, (end - ln - so) // st + 1)
            put(a + shift, oo + r * ost, ln, rb - r, st, ost)
            r = rb
            continue
        pos = 0
        while pos < ln:  # one run across segments: cut at their ends
            k = seg(a + pos)
            m = min(ln - pos, int(segs[k, 1]) - (a + pos))
            put(a + pos + int(segs[k, 2]), oo + r * ost + pos, m, 1, m, m)
            pos += m
        r += 1
    return out


def readdress(rs: RankSchedule, src_segs, dst_segs) -> RankSchedule:
    """An expert part's rank schedule addressing the rank's ExpertShard buffers instead of the
    part's own flat buffers: the source column of local copies, packs and direct sends, the
    destination column of local copies, unpacks and direct receives (what the round loop
    reads). A direct chunk no longer one run there is staged on this end instead (its peer may
    still send / receive it directly: only sizes and order must agree); its round's staging
    grows by at most its size, within the round's budget, so the staging bound holds."""
    rounds = []
    for rr in rs.rounds:
        pack, unpack = [_move(rr.pack_descs, 0, src_segs)], [_move(rr.unpack_descs, 1, dst_segs)]
        off, sends, recvs = rr.staging_numel, [], []
        send_slots, recv_slots = list(rr.send_slots), list(rr.recv_slots)
        for chunks, slots, col, segs, acc, keep in ((rr.sends, send_slots, 0, src_segs, pack, sends),
                                                    (rr.recvs, recv_slots, 1, dst_segs, unpack, recvs)):
            for j, c in enumerate(chunks):
                if slots[j] >= 0:
                    keep.append(c)
                    continue
                moved = _move(c.descs, col, segs)
                if len(moved) == 1:
                    keep.append(replace(c, descs=moved))
                    continue
                # Staged on this end: own side as cut above, the staging side at off + position.
                one = np.array([[0, 0, c.numel, 1, c.numel, c.numel]], np.int64)
                one[0, col] = int(c.descs[0, col])
                rows = _move(one, col, segs)
                rows[:, 1 - col] += off
                acc.append(rows)
                slots[j], off = off, off + c.numel
                keep.append(c)
        rounds.append(replace(rr, pack_descs=np.concatenate(pack), unpack_descs=np.concatenate(unpack),
                              sends=tuple(sends), recvs=tuple(recvs), send_slots=tuple(send_slots),
                              recv_slots=tuple(recv_slots), staging_numel=off))
    local = _move(_move(rs.local, 0, src_segs), 1, dst_segs)
    return replace(rs, rounds=tuple(rounds), local=local)


def run_moe_in_process(hub: InProcessHub, plan: MoePlan, srcs: dict, dsts: dict,
                       **realloc_kwargs) -> dict[int, dict]:
    """Run `plan` on every rank of `hub` in its own thread; srcs / dsts map rank ->
    (ModelShard, ExpertShard). Returns rank -> stats; raises the lowest rank's error after
    every thread finished."""
    ranks = sorted({r for part in plan.parts for r in part.plan.src.ranks + part.plan.dst.ranks})
    return run_ranks(hub, ranks, lambda rank: MoeReallocator(plan, hub.transport(rank), **realloc_kwargs)
                     .run(*srcs.get(rank, (None, None)), *dsts.get(rank, (None, None))))


__all__ = ["MoeReallocator", "run_moe_in_process"]
