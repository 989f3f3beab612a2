"""One rank's rounds, derived in C++ without the other ranks' descriptors.

    rs = rank_schedule(plan, rank, round_elems, direct_min_elems)
    rs.rounds      # [RankRound]: this rank's rounds, in global round order
    rs.local       # [k, 6] local-copy descriptors of this rank

The rule (every rank replays the same bucket schedule, so the two ends of a chunk agree on its
round, its slot and its descriptors): a plan's messages are cut into chunks, big one-run
descriptors alone (direct: sent from the source buffer, received into the destination, no
staging), and each chunk, in the plan's message order, goes to the earliest round where its
sender can send it and all its receivers can receive it, each side holding at most half a bucket
per rank and round. tests/support/schedule_oracle.py is that rule written globally in Python (every
rank's rounds at once); tests/test_realloc_rank_schedule.py checks this module against it chunk for
chunk. The C++ planner runs its usual loop but keeps each message it is not part of
as sizes only (numel, descriptor count, sizes of its big one-run descriptors), which is all the
frontier fill needs to place every chunk; so sender and receivers of a chunk compute the same
round, slot and descriptors without talking. Time: one planner pass plus one pass over every
message's chunk sizes; memory: this rank's descriptors plus a few integers per plan message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan import ReallocPlan


@dataclass(frozen=True, slots=True)
class Chunk:
    msg: int
    """Index of the plan message this chunk belongs to."""
    sender: int
    receivers: tuple[int, ...]
    numel: int
    descs: np.ndarray
    """[k, 6] flat-buffer descriptors (sender's source -> receivers' destination) of this chunk."""

    @property
    def contiguous(self) -> bool:
        """One run on both sides: sent from / received into the shard buffers without staging."""
        return len(self.descs) == 1 and _one_run(self.descs[0])


def _one_run(d) -> bool:
    """A descriptor whose n runs are back to back on both sides: one contiguous run."""
    return int(d[3]) == 1 or (int(d[4]) == int(d[2]) and int(d[5]) == int(d[2]))


@dataclass(frozen=True, slots=True)
class RankRound:
    """What one rank does in one round: pack sends into staging, exchange, unpack receives."""

    index: int
    sends: tuple[Chunk, ...]
    recvs: tuple[Chunk, ...]
    pack_descs: np.ndarray
    """[k, 6] source flat -> staging, for the non-contiguous sends (staging offsets from 0)."""
    unpack_descs: np.ndarray
    """[k, 6] staging -> destination flat, for the non-contiguous receives."""
    send_slots: tuple[int, ...]
    """Staging offset of each send (-1: sent straight from the source buffer)."""
    recv_slots: tuple[int, ...]
    """Staging offset of each receive (-1: received straight into the destination buffer)."""
    staging_numel: int


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


def rank_schedule(
    plan: ReallocPlan, rank: int, round_elems: int, direct_min_elems: int | None = None
) -> RankSchedule:
    """`rank`'s rounds of the bucket schedule of `plan` (round_elems per rank and round, half each
    way; direct_min_elems: the smallest one-run descriptor sent unstaged, 0 or None: off), built
    for it alone."""
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
    cside, cslot, cptr = (
        a["chunk_side"].tolist(),
        a["chunk_slot"].tolist(),
        a["chunk_desc_ptr"].tolist(),
    )
    cdescs = a["chunk_descs"]
    ends = {m: (int(sender[m]), tuple(recv[rp[m] : rp[m + 1]].tolist())) for m in set(cmsg)}
    chunks = [
        Chunk(m, *ends[m], n, cdescs[lo:hi]) for m, n, lo, hi in zip(cmsg, cnumel, cptr, cptr[1:])
    ]
    rounds = []
    ch, pk, up = (
        a["round_chunk_ptr"].tolist(),
        a["round_pack_ptr"].tolist(),
        a["round_unpack_ptr"].tolist(),
    )
    pack, unpack, staging = a["pack_descs"], a["unpack_descs"], a["round_staging"].tolist()
    for j, k in enumerate(a["round_index"].tolist()):
        # A round's chunks are its sends, then its receives (C++ order).
        lo, hi = ch[j], ch[j + 1]
        mid = lo
        while mid < hi and cside[mid] == 0:
            mid += 1
        rounds.append(
            RankRound(
                k,
                tuple(chunks[lo:mid]),
                tuple(chunks[mid:hi]),
                pack[pk[j] : pk[j + 1]],
                unpack[up[j] : up[j + 1]],
                tuple(cslot[lo:mid]),
                tuple(cslot[mid:hi]),
                staging[j],
            )
        )
    return RankSchedule(
        rank,
        int(a["num_rounds"]),
        tuple(rounds),
        a["local"],
        int(a["summary_count"]),
        int(a["held_bytes"]),
    )


__all__ = ["Chunk", "RankRound", "RankSchedule", "rank_schedule"]
