"""One rank's rounds, derived in C++ without the other ranks' descriptors.

    rs = rank_schedule(plan, rank, round_elems, direct_min_elems)
    rs.rounds      # [RankRound], the same objects Schedule(plan, ...).for_rank(rank) gives
    rs.local       # [k, 6] local-copy descriptors of this rank

The rule is schedule.py's, chunk for chunk (tests/test_rank_schedule.py checks it against the
global Schedule): the C++ planner runs its usual loop but keeps each message it is not part of
as sizes only (numel, descriptor count, sizes of its big one-run descriptors), which is all the
frontier fill needs to place every chunk; so sender and receivers of a chunk compute the same
round, slot and descriptors without talking. Time: one planner pass plus one pass over every
message's chunk sizes; memory: this rank's descriptors plus a few integers per plan message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan import ReallocPlan
from .schedule import Chunk, RankRound


@dataclass(frozen=True, slots=True)
class RankSchedule:
    rank: int
    num_rounds: int
    """Rounds of the whole schedule (this rank takes part in len(rounds) of them)."""
    rounds: tuple[RankRound, ...]
    local: np.ndarray
    summary_messages: int
    """Plan messages this rank knows by size only (not its own)."""
    held_bytes: int = 0
    """Peak bytes of the C++ side's data for this rank (size summaries, own descriptors, output);
    compare ReallocPlan.global_bytes() for the whole plan."""

    @property
    def local_numel(self) -> int:
        return int((self.local[:, 2] * self.local[:, 3]).sum())


def rank_schedule(plan: ReallocPlan, rank: int, round_elems: int,
                  direct_min_elems: int | None = None) -> RankSchedule:
    """`rank`'s rounds of Schedule(plan, round_elems, direct_min_elems), built for it alone."""
    if round_elems < 2:
        raise ValueError(f"bucket of {round_elems} elements is too small; need >= 2")
    if direct_min_elems is not None and direct_min_elems < 0:
        raise ValueError(f"direct_min_elems={direct_min_elems} must be >= 0 (0 or None: off)")
    if rank < 0:
        raise ValueError(f"rank {rank} must be >= 0")
    a = plan.rank_arrays(rank, round_elems, direct_min_elems or 0)
    # Python ints and per-message (sender, receivers) looked up once: numpy scalar indexing per
    # chunk was most of this function's time.
    rp, recv, sender = a["msg_recv_ptr"], a["msg_receivers"], a["msg_sender"]
    cmsg, cnumel = a["chunk_msg"].tolist(), a["chunk_numel"].tolist()
    cside, cslot, cptr = a["chunk_side"].tolist(), a["chunk_slot"].tolist(), a["chunk_desc_ptr"].tolist()
    cdescs = a["chunk_descs"]
    ends = {m: (int(sender[m]), tuple(recv[rp[m]:rp[m + 1]].tolist())) for m in set(cmsg)}
    chunks = [Chunk(m, *ends[m], n, cdescs[lo:hi])
              for m, n, lo, hi in zip(cmsg, cnumel, cptr, cptr[1:])]
    rounds = []
    ch, pk, up = a["round_chunk_ptr"].tolist(), a["round_pack_ptr"].tolist(), a["round_unpack_ptr"].tolist()
    pack, unpack, staging = a["pack_descs"], a["unpack_descs"], a["round_staging"].tolist()
    for j, k in enumerate(a["round_index"].tolist()):
        # A round's chunks are its sends, then its receives (C++ order).
        lo, hi = ch[j], ch[j + 1]
        mid = lo
        while mid < hi and cside[mid] == 0:
            mid += 1
        rounds.append(RankRound(
            k, tuple(chunks[lo:mid]), tuple(chunks[mid:hi]),
            pack[pk[j]:pk[j + 1]], unpack[up[j]:up[j + 1]],
            tuple(cslot[lo:mid]), tuple(cslot[mid:hi]), staging[j]))
    return RankSchedule(rank, int(a["num_rounds"]), tuple(rounds), a["local"],
                        int(a["summary_count"]), int(a["held_bytes"]))


__all__ = ["RankSchedule", "rank_schedule"]
