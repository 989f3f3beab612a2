"""What one rank does in one merged round, laid out once per schedule (rounds.py replays it).

    lay = layout_round(items, merge=..., direct_apart={lanes})   # items: [(lane index, RankRound)]
    lay.pack / lay.unpack    [k, 8] CopyPlan rows (ops.py): lane buffers <-> the staging half
    lay.sends / lay.recvs    the round's messages, in the order both ends derive alone
    lay.staged               staging elements the round needs

Staging offsets count from the start of the round's staging half; lanes sit one after the other.
Buffer ids in the rows: the staging half is buffer 0 on its side, lane i's flat buffer is
buffer i on the other, so ONE compiled copy packs (or unpacks) every lane of the round.

merge=False: one message per chunk, at the staging slot the C++ schedule gave it; a direct
chunk (slot -1) is sent from / received into the lane's own buffer (or left out when its lane
is in `direct_apart`: the runner posts those at the start).
merge=True (the default on stream-ordered transports, NCCL): per lane, every chunk of the round
with the same ends (sender, receivers), staged or direct, is packed into ONE message: chunks
grouped in the order their groups first appear (both ends list a round's chunks in one global
order, so both derive the same groups, in the same order, with the same order inside each),
laid out back to back. Direct
chunks are staged then; they already count towards the round's element budget, so the staging
bound holds. A round then posts one send per receiver set and one receive per sender.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Msg:
    lane: int
    peers: tuple[int, ...]
    """Receivers (a send) or (sender,) (a receive)."""
    receivers: tuple[int, ...]
    off: int
    """Staging offset from the round's base, or the lane buffer's offset when `direct`."""
    numel: int
    direct: bool
    chunks: tuple = ()
    """The schedule's chunks in this message (names them in checksum errors)."""


@dataclass(slots=True)
class RoundLayout:
    pack: np.ndarray
    unpack: np.ndarray
    sends: list[Msg] = field(default_factory=list)
    recvs: list[Msg] = field(default_factory=list)
    staged: int = 0


def _rows(descs: np.ndarray, buf_col: int, buf: int, shift_col: int, shift) -> np.ndarray:
    """[k, 6] descriptors -> [k, 8] rows: staging buffer 0 on one side, lane `buf` on the other,
    column `shift_col` (the staging side) plus `shift` (a scalar or per row)."""
    out = np.zeros((len(descs), 8), np.int64)
    out[:, :6] = descs
    out[:, shift_col] += shift
    out[:, 6 + buf_col] = buf
    return out


def _remap(descs: np.ndarray, col: int, old: list[int], new: list[int]) -> np.ndarray:
    """Column `col` (staging offsets) of descriptors moved chunk by chunk from slots `old` to
    `new` (descriptors never straddle chunks)."""
    if not len(descs):
        return descs
    order = np.argsort(old)
    olds, news = np.asarray(old)[order], np.asarray(new)[order]
    i = np.searchsorted(olds, descs[:, col], side="right") - 1
    out = descs.copy()
    out[:, col] += news[i] - olds[i]
    return out


def layout_round(items, *, merge: bool, direct_apart=frozenset()) -> RoundLayout:
    """items: [(lane index, RankRound)] of one merged round, in lane order; direct_apart: lanes
    whose direct chunks are posted apart (left out here)."""
    pack, unpack, sends, recvs, base = [], [], [], [], 0
    for li, rr in items:
        if not merge:
            pack.append(_rows(rr.pack_descs, 0, li, 1, base))
            unpack.append(_rows(rr.unpack_descs, 1, li, 0, base))
            for c, slot in zip(rr.sends, rr.send_slots):
                if slot < 0 and li in direct_apart:
                    continue
                d = slot < 0
                sends.append(
                    Msg(
                        li,
                        c.receivers,
                        c.receivers,
                        int(c.descs[0, 0]) if d else base + slot,
                        c.numel,
                        d,
                        (c,),
                    )
                )
            for c, slot in zip(rr.recvs, rr.recv_slots):
                if slot < 0 and li in direct_apart:
                    continue
                d = slot < 0
                recvs.append(
                    Msg(
                        li,
                        (c.sender,),
                        c.receivers,
                        int(c.descs[0, 1]) if d else base + slot,
                        c.numel,
                        d,
                        (c,),
                    )
                )
            base += rr.staging_numel
            continue
        off = base
        for chunks, slots, side in ((rr.sends, rr.send_slots, 0), (rr.recvs, rr.recv_slots, 1)):
            groups: dict[tuple, list] = {}
            for c, slot in zip(chunks, slots):  # by both ends: (sender, receivers)
                groups.setdefault((c.sender, c.receivers), []).append((c, slot))
            old, new, direct_rows = [], [], []
            for peers, members in groups.items():
                start = off
                for c, slot in members:
                    if slot >= 0:
                        old.append(slot)
                        new.append(off)
                    else:  # a direct chunk: one run, staged here
                        row = [0, 0, c.numel, 1, c.numel, c.numel]
                        row[side] = int(c.descs[0, side])
                        row[1 - side] = off
                        direct_rows.append(row)
                    off += c.numel
                sender, receivers = peers
                msg = Msg(
                    li,
                    receivers if side == 0 else (sender,),
                    receivers,
                    start,
                    off - start,
                    False,
                    tuple(c for c, _ in members),
                )
                (sends if side == 0 else recvs).append(msg)
            src = rr.pack_descs if side == 0 else rr.unpack_descs
            moved = _remap(src, 1 - side, old, new)
            rows = np.concatenate([moved, np.array(direct_rows, np.int64).reshape(-1, 6)])
            (pack if side == 0 else unpack).append(_rows(rows, side, li, 1 - side, 0))
        base = off
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros((0, 8), np.int64)
    return RoundLayout(cat(pack), cat(unpack), sends, recvs, base)


def direct_messages(merged, lanes) -> tuple[list[Msg], list[Msg]]:
    """Every direct chunk of every round (merged round order, then lane order), for a runner that
    posts them all at the start (merge=False on an asynchronous transport without verify)."""
    sends, recvs = [], []
    for _, items in merged:
        for li, rr in items:
            if not lanes[li].direct_first:
                continue
            sends += [
                Msg(li, c.receivers, c.receivers, int(c.descs[0, 0]), c.numel, True, (c,))
                for c, s in zip(rr.sends, rr.send_slots)
                if s < 0
            ]
            recvs += [
                Msg(li, (c.sender,), c.receivers, int(c.descs[0, 1]), c.numel, True, (c,))
                for c, s in zip(rr.recvs, rr.recv_slots)
                if s < 0
            ]
    return sends, recvs


__all__ = ["Msg", "RoundLayout", "direct_messages", "layout_round"]
