"""The global bucket schedule, the oracle of tests/test_realloc_rank_schedule.py and the other
schedule tests: cut a plan's messages into chunks and chunks into rounds of bounded size.

Every rank replays the same schedule, so the two ends of a chunk agree on its round, its slot and
its descriptors without talking; a chunk list is cut from the plan alone, by a deterministic rule,
and each chunk, in the plan's message order, goes to the earliest round where its sender can
send and all its receivers can receive it (half a bucket per rank, round and direction). The rule
needs only every message's chunk sizes, which is how real_py/realloc/rank_schedule.py derives one
rank's rounds in C++ without the other ranks' descriptors (what the Reallocator runs); this global
version, every rank's rounds at once, is the reference the tests compare it with.

Direct chunks: with `direct_min_elems` > 0, every descriptor of a message that is ONE contiguous
run on both sides (n == 1, or src_stride == dst_stride == len) and holds at least
`direct_min_elems` elements becomes its own chunk(s), sent from the source shard buffer and
received into the destination buffer without staging; the other descriptors of the message, in
their order, are cut into staged chunks as before. A message that is one run as a whole always
goes direct (any size); 0 or None turns the splitting off.

Bounds, per rank and round: the elements it sends stay within `bucket_elems // 2`, and so do
those it receives (staged or direct), so together they stay within `bucket_elems` (so at most that
much data is in flight per rank and round), hence its staging buffer (staged chunks only) never
exceeds `bucket_elems` either. The NUMBER of chunks (messages) per round has no separate cap: a
message with k direct pieces travels in at most k + 1 more chunks than without splitting, and a
direct chunk holds >= direct_min_elems elements unless it is the tail of a piece cut at the round
limit.
"""

from __future__ import annotations

import numpy as np

from real_py.realloc.plan import ReallocPlan, _to_packed
from real_py.realloc.rank_schedule import Chunk, RankRound


def split_descs(descs: np.ndarray, lo: int, hi: int, ends: np.ndarray | None = None) -> np.ndarray:
    """Descriptors covering packed elements [lo, hi) of `descs` (runs concatenated in order).

    ends: np.cumsum of the descriptors' sizes, when the caller already has it.
    """
    sizes = descs[:, 2] * descs[:, 3]
    if ends is None:
        ends = np.cumsum(sizes)
    starts = ends - sizes
    out = []
    for i in range(int(np.searchsorted(ends, lo, side="right")), len(descs)):
        s, e = int(starts[i]), int(ends[i])
        if s >= hi:
            break
        so, do, ln, n, ss, ds = (int(x) for x in descs[i])
        a, b = max(lo, s) - s, min(hi, e) - s  # element range inside this descriptor
        if a == 0 and b == e - s:
            out.append((so, do, ln, n, ss, ds))
            continue
        r0, c0 = divmod(a, ln)
        r1, c1 = divmod(b, ln)
        if r0 == r1:  # inside one run
            out.append((so + r0 * ss + c0, do + r0 * ds + c0, c1 - c0, 1, c1 - c0, c1 - c0))
            continue
        if c0:
            out.append((so + r0 * ss + c0, do + r0 * ds + c0, ln - c0, 1, ln - c0, ln - c0))
            r0 += 1
        if r1 > r0:
            full = (so + r0 * ss, do + r0 * ds, ln, r1 - r0, ss, ds)
            out.append(full if r1 - r0 > 1 else (full[0], full[1], ln, 1, ln, ln))
        if c1:
            out.append((so + r1 * ss, do + r1 * ds, c1, 1, c1, c1))
    return np.array(out, dtype=np.int64).reshape(-1, 6)


class Schedule:
    """Rounds of chunks for a plan and a bucket size (elements)."""

    def __init__(self, plan: ReallocPlan, bucket_elems: int, direct_min_elems: int | None = None):
        if bucket_elems < 2:
            raise ValueError(f"bucket of {bucket_elems} elements is too small; need >= 2")
        if direct_min_elems is not None and direct_min_elems < 0:
            raise ValueError(f"direct_min_elems={direct_min_elems} must be >= 0 (0 or None: off)")
        self.plan, self.bucket_elems = plan, bucket_elems
        self.direct_min_elems = direct_min_elems or 0
        # A chunk counts once for its sender and once for each receiver: half a bucket each
        # lets a rank send one chunk and receive one in the same round.
        limit = max(1, bucket_elems // 2)
        chunks = []
        for m in range(plan.num_messages):
            sender, receivers = int(plan.msg_sender[m]), plan.receivers(m)
            for part, numel in _split_message(
                plan.message_descs(m), int(plan.msg_numel[m]), self.direct_min_elems, limit
            ):
                chunks.append(Chunk(m, sender, receivers, numel, part))
        # Earliest fit: a chunk goes to the earliest round where its sender can still send it
        # and every receiver can still receive it, each side holding at most half a bucket per
        # rank and round (full duplex: a round's egress and ingress are both bounded, so a
        # round never loads one direction of a link with the whole bucket); rounds left partly
        # empty by earlier chunks are filled later. first[(side, r)]: rank r's earliest round
        # whose side (0 send, 1 receive) is not full.
        first: dict[tuple[int, int], int] = {}
        used: dict[tuple[int, int, int], int] = {}
        self.rounds: list[list[Chunk]] = []
        for c in chunks:
            ends = ((0, c.sender),) + tuple((1, r) for r in c.receivers)
            k = max(first.get(e, 0) for e in ends)
            while any(used.get(e + (k,), 0) + c.numel > limit for e in ends):
                k += 1
            while len(self.rounds) <= k:
                self.rounds.append([])
            self.rounds[k].append(c)
            for e in ends:
                used[e + (k,)] = used.get(e + (k,), 0) + c.numel
                while used.get(e + (first.get(e, 0),), 0) >= limit:
                    first[e] = first.get(e, 0) + 1
        self._per_rank: dict[int, list[RankRound]] = {}

    def for_rank(self, rank: int) -> list[RankRound]:
        """This rank's rounds (only those it takes part in), in global round order."""
        if not self._per_rank:
            by_rank: dict[int, dict[int, tuple[list, list]]] = {}
            for k, chunks in enumerate(self.rounds):
                for c in chunks:
                    by_rank.setdefault(c.sender, {}).setdefault(k, ([], []))[0].append(c)
                    for r in c.receivers:
                        by_rank.setdefault(r, {}).setdefault(k, ([], []))[1].append(c)
            self._per_rank = {
                r: [_rank_round(k, tuple(s), tuple(v)) for k, (s, v) in rounds.items()]
                for r, rounds in by_rank.items()
            }
        return self._per_rank.get(rank, [])


def _cut(descs: np.ndarray, total: int, limit: int) -> list[tuple[np.ndarray, int]]:
    """`descs` (holding `total` elements) cut into (descs, numel) pieces of <= `limit` elements."""
    if total <= limit:
        return [(descs, total)]
    ends = np.cumsum(descs[:, 2] * descs[:, 3])
    return [
        (split_descs(descs, lo, min(total, lo + limit), ends), min(total, lo + limit) - lo)
        for lo in range(0, total, limit)
    ]


def _split_message(
    descs: np.ndarray, total: int, direct_min: int, limit: int
) -> list[tuple[np.ndarray, int]]:
    """One message's chunk descriptors: big one-run descriptors alone (direct), the rest staged.

    Order: the staged remainder's chunks first, then the direct pieces in descriptor order; only
    the plan is read, so every rank derives the same list."""
    if direct_min <= 0 or len(descs) <= 1:
        return _cut(descs, total, limit)
    sizes = descs[:, 2] * descs[:, 3]
    one_run = (descs[:, 3] == 1) | ((descs[:, 4] == descs[:, 2]) & (descs[:, 5] == descs[:, 2]))
    big = one_run & (sizes >= direct_min)
    if not big.any():
        return _cut(descs, total, limit)
    rest = descs[~big]
    out = _cut(rest, int(sizes[~big].sum()), limit) if len(rest) else []
    for so, do, ln, n, _, _ in descs[big].tolist():
        run = ln * n  # normalized to n == 1, so Chunk.contiguous sees one run
        out += _cut(np.array([[so, do, run, 1, run, run]], dtype=np.int64), run, limit)
    return out


def _place(chunks: tuple[Chunk, ...], side: str, off: int) -> tuple[list, list, int]:
    """Staging slots and packed descriptors for one side; contiguous chunks skip staging (-1)."""
    col = 1 if side == "pack" else 0  # the descriptor column that addresses the staging buffer
    descs, slots = [], []
    for c in chunks:
        if c.contiguous:
            slots.append(-1)
            continue
        d = _to_packed(c.descs, side)
        d[:, col] += off
        descs.append(d)
        slots.append(off)
        off += c.numel
    return descs, slots, off


def _rank_round(k: int, sends: tuple[Chunk, ...], recvs: tuple[Chunk, ...]) -> RankRound:
    pack, send_slots, off = _place(sends, "pack", 0)
    unpack, recv_slots, off = _place(recvs, "unpack", off)
    empty = np.zeros((0, 6), np.int64)
    return RankRound(
        k,
        sends,
        recvs,
        np.concatenate(pack) if pack else empty,
        np.concatenate(unpack) if unpack else empty,
        tuple(send_slots),
        tuple(recv_slots),
        off,
    )
