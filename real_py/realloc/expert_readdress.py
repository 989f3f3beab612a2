"""Expert parts addressed in the ExpertShard buffers: descriptors moved tensor by tensor.

    segs = expert_segments(part, part_layout, model, layout, rank)   # [k, 3] (start, end, shift)
    rs = readdress(rank_schedule(part.plan, rank, ...), src_segs, dst_segs)

An expert part's spec (moe_plan.py) orders a rank's expert tensors by (expert range, layer) or
stacks them; the rank's ExpertShard orders them by layer. The planner's descriptors address the
part's own flat buffer, so each descriptor's offsets on one side move into the ExpertShard
buffer, cut where their runs cross tensors that moved apart (`move_column`); `readdress` does
so for a whole rank schedule (the round loop), and the one-pass executor for the chunks a rank
receives (reallocator.py). Computed once, at construction.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..layout import Layout, expert_shard_layout, shard_layout
from ..spec import ModelSpec
from .moe_plan import MoePart
from .rank_schedule import RankSchedule


def expert_segments(
    part: MoePart, part_layout: Layout, model: ModelSpec, layout: Layout, rank: int
) -> np.ndarray:
    """[k, 3] (start, end, shift): elements [start, end) of `rank`'s flat buffer of an expert
    part sit at + shift in its ExpertShard buffer (consecutive tensors with one shift merged).
    A stacked tensor's local piece is the rank's ep group's experts, one after the other."""
    _, tp_rank, stage = part_layout.coords(rank)
    _, ep_rank, _, estage = layout.expert_coords(rank)
    where = {
        e.param.name: e.offset for e in expert_shard_layout(model, layout, estage, ep_rank).entries
    }
    segs: list[list[int]] = []
    for e in shard_layout(part.plan.model, part_layout, stage).entries:
        names = (e.param.name,)
        if part.pieces is not None:
            every = part.pieces[e.param.name]
            k = len(every) // part_layout.tp
            names = every[tp_rank * k : (tp_rank + 1) * k]
        n = e.numel // len(names)
        for i, name in enumerate(names):
            start, shift = e.offset + i * n, where[name] - e.offset - i * n
            if segs and segs[-1][2] == shift and segs[-1][1] == start:
                segs[-1][1] = start + n
            else:
                segs.append([start, start + n, shift])
    return np.array(segs, np.int64).reshape(-1, 3)


def move_column(descs: np.ndarray, col: int, segs: np.ndarray | None) -> np.ndarray:
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
        pack, unpack = (
            [move_column(rr.pack_descs, 0, src_segs)],
            [move_column(rr.unpack_descs, 1, dst_segs)],
        )
        off, sends, recvs = rr.staging_numel, [], []
        send_slots, recv_slots = list(rr.send_slots), list(rr.recv_slots)
        for chunks, slots, col, segs, acc, keep in (
            (rr.sends, send_slots, 0, src_segs, pack, sends),
            (rr.recvs, recv_slots, 1, dst_segs, unpack, recvs),
        ):
            for j, c in enumerate(chunks):
                if slots[j] >= 0:
                    keep.append(c)
                    continue
                moved = move_column(c.descs, col, segs)
                if len(moved) == 1:
                    keep.append(replace(c, descs=moved))
                    continue
                # Staged on this end: own side as cut above, the staging side at off + position.
                one = np.array([[0, 0, c.numel, 1, c.numel, c.numel]], np.int64)
                one[0, col] = int(c.descs[0, col])
                rows = move_column(one, col, segs)
                rows[:, 1 - col] += off
                acc.append(rows)
                slots[j], off = off, off + c.numel
                keep.append(c)
        rounds.append(
            replace(
                rr,
                pack_descs=np.concatenate(pack),
                unpack_descs=np.concatenate(unpack),
                sends=tuple(sends),
                recvs=tuple(recvs),
                send_slots=tuple(send_slots),
                recv_slots=tuple(recv_slots),
                staging_numel=off,
            )
        )
    local = move_column(move_column(rs.local, 0, src_segs), 1, dst_segs)
    return replace(rs, rounds=tuple(rounds), local=local)


__all__ = ["expert_segments", "move_column", "readdress"]
