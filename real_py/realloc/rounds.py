"""One rank's round loop, shared by every executor: pack -> transport -> unpack, per round.

    runner = RoundRunner(transport, [lane, ...], opts)      # opts: RoundOptions
    stats = runner.run([(src_flat, dst_flat), ...], check=...)

A lane is one plan's share of this rank's rounds (its RankSchedule, rank_schedule.py) on its own
pair of flat buffers; the Reallocator runs one lane, the MoeReallocator one lane per part of an
MoE plan that the rank takes part in. Merged round r is every lane's round r, relabelled by the
lane's `shift` (round i of a lane with n rounds is merged round (i + shift) % n, a bijection of
[0, n), so a lane still has at most one round in any merged round). All of a merged round's
messages go out in ONE transport.start call, listed lane by lane (lane order, then the lane's own
chunk order) with the checksums after all data: both ends of a chunk derive the same list order
alone, which is what the transports' per-pair matching needs (transports/base.py).

Staging: a merged round's lanes sit one after the other in a staging half (each lane's packed
descriptors address its own segment from 0); with pipelining (pack round r+1 while round r is on
the wire), two halves. So the staging buffer is 2 x the largest merged round's staged elements:
within `bucket_bytes` whenever the lanes' round sizes add up to at most one round's budget per
rank and direction (one lane: the Reallocator's bound; several: moe_plan.part_round_elems).

Direct pieces (one contiguous run on both sides) are sent from / received into the lanes' own
buffers; an asynchronous transport without verify posts them all at the start in one call
(merged round order, then lane order), as they need no staging. verify=True: an int64 checksum
per data chunk travels after the round's data; a mismatch names the rank, the round, the lane's
chunk and the peer. Errors are reported to the peers (transport.fail) with the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import ops
from .rank_schedule import RankSchedule
from .transports.base import TransferError, Transport


def checksum(t: torch.Tensor) -> torch.Tensor:
    """[1] int64 checksum of a 1-D tensor's raw bytes (position-weighted, wrapping sums).

    Computed the same way on both ends of a chunk; a flipped or moved byte changes it. Depends
    only on the bytes, not on where they sit: a chunk of any dtype may start at any byte offset
    of its buffer (a bf16 piece at an odd element), and the two ends' offsets differ."""
    b = t.reshape(-1).contiguous().view(torch.uint8)
    if b.numel() % 4 == 0 and b.storage_offset() % 4:
        b = b.clone()  # the int32 view needs a 4-byte aligned start; a copy starts at 0
    words = b.view(torch.int32) if b.numel() % 4 == 0 else b
    w = words.to(torch.int64)
    pos = torch.arange(1, w.numel() + 1, dtype=torch.int64, device=w.device)
    return (w.sum() + (w * pos).sum() * 1000003).reshape(1)


@dataclass(frozen=True, slots=True)
class RoundOptions:
    """The Reallocator's bucket options resolved for one transport and element size."""

    round_elems: int
    """Elements per round (bucket / 2 with pipelining): the per-rank budget is half of it per
    direction (rank_schedule.py)."""
    pipeline: bool
    verify: bool
    direct_first: bool
    direct_min_elems: int

    @classmethod
    def resolve(cls, transport: Transport, element_size: int, dtype, *, bucket_bytes: int,
                pipeline: bool | None, verify: bool, direct_min_bytes: int | None) -> RoundOptions:
        if bucket_bytes < 2 * element_size:
            raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than two elements of {dtype}")
        if direct_min_bytes is not None and direct_min_bytes < 0:
            raise ValueError(f"direct_min_bytes={direct_min_bytes} must be >= 0 (0 or None: send "
                             "every piece of a mixed message through staging)")
        bucket_elems = bucket_bytes // element_size
        if pipeline is None:
            pipeline = transport.asynchronous
        # Two halves of at least two elements each, else a single buffer without overlap.
        pipeline = pipeline and bucket_elems // 2 >= 2
        # An asynchronous transport posts every direct piece at the start (they use no
        # staging); with verify=True they stay in their rounds, beside their checksums.
        direct_first = transport.asynchronous and not verify
        # Rounded up to whole elements, so a tiny positive threshold never turns the feature off.
        return cls(bucket_elems // 2 if pipeline else bucket_elems, pipeline, verify, direct_first,
                   -(-(direct_min_bytes or 0) // element_size))


@dataclass(frozen=True, slots=True)
class Lane:
    schedule: RankSchedule
    shift: int = 0
    """Round i of this lane runs in merged round (i + shift) % schedule.num_rounds."""
    name: str = ""
    """Named in checksum errors ("" for a lone plan)."""
    direct_first: bool = True
    """Whether this lane's direct pieces may be posted at the start (RoundOptions.direct_first);
    False keeps them in their rounds, where each end may stage its side of a piece on its own
    (moe_exec.readdress): both ends of a chunk read the same lane flag, so they agree."""


class RoundRunner:
    def __init__(self, transport: Transport, lanes: list[Lane], opts: RoundOptions,
                 total: int | None = None):
        """total: the number of merged rounds, when every rank knows it (named in steps as
        "round i/total"; it must be the same on both ends of a message)."""
        self.transport, self.rank, self.lanes, self.opts = transport, transport.rank, lanes, opts
        self.total = total
        merged: dict[int, list] = {}
        for li, lane in enumerate(lanes):
            n = lane.schedule.num_rounds
            for rr in lane.schedule.rounds:
                merged.setdefault((rr.index + lane.shift) % n, []).append((li, rr))
        self.merged = sorted(merged.items())
        """[(merged round, [(lane index, RankRound), ...] in lane order)] of this rank."""
        self.half = max((sum(rr.staging_numel for _, rr in rs) for _, rs in self.merged), default=0)
        self.staging: torch.Tensor | None = None
        self._descs: dict[tuple, torch.Tensor] = {}

    def _tensor(self, arr: np.ndarray, key: tuple) -> torch.Tensor:
        t = self._descs.get(key)
        if t is None:
            t = self._descs[key] = ops.descs_tensor(arr)
        return t

    def _step(self, k: int) -> str:
        return f"round {k}/{self.total}" if self.total is not None else f"merged round {k}"

    def _staging_half(self, i: int, like: torch.Tensor) -> torch.Tensor:
        halves = 2 if self.opts.pipeline else 1
        if (self.staging is None or self.staging.device != like.device
                or self.staging.dtype != like.dtype):
            self.staging = torch.empty(halves * self.half, dtype=like.dtype, device=like.device)
        k = i % halves
        return self.staging[k * self.half:(k + 1) * self.half]

    def run(self, bufs: list[tuple], check=None) -> dict:
        """Move every lane's share; bufs[i] = (source flat or None, destination flat or None) of
        lane i. check(): input validation, run inside the error reporting (a rank that rejects
        its input tells its peers at once). Returns stats: rounds, staging_bytes, "phases"
        (seconds in local copies, pack, post, wait, unpack) and "per_round" ([merged round,
        pack, post, wait, unpack] seconds; round -1: the direct pieces, posted at once)."""
        clock, opts = time.perf_counter, self.opts
        per_round = {k: [k, 0.0, 0.0, 0.0, 0.0] for k, _ in self.merged}
        local_s = 0.0
        like = None
        step = "input check"
        try:
            if check is not None:
                check()  # may fill `bufs`
            like = next((b for pair in bufs for b in pair if b is not None), None)

            def local_copies():
                # Run while transfers are in flight (disjoint destination ranges: each element
                # comes either from this rank's source or from a peer).
                nonlocal local_s
                t = clock()
                for li, lane in enumerate(self.lanes):
                    if len(lane.schedule.local):
                        src, dst = bufs[li]
                        ops.unpack(src, self._tensor(lane.schedule.local, (li, -1, "local")), dst)
                local_s += clock() - t

            direct = None
            if opts.direct_first:
                # Pieces sent straight from / into the buffers need no staging, so the memory
                # bound does not hold them to their rounds: post them all now (both ends derive
                # the same order) and wait for them at the end.
                step = "direct pieces of every round"
                t = clock()
                sends, recvs = self._messages([(li, rr, None) for _, rs in self.merged for li, rr in rs
                                               if self.lanes[li].direct_first], bufs, direct_only=True)
                if sends or recvs:
                    direct = (self.transport.start(sends, recvs, step), step)
                    per_round[-1] = [-1, 0.0, clock() - t, 0.0, 0.0]
            if direct is not None or not self.merged:
                step = "local copies"
                local_copies()
            pending, posted = None, 0
            for k, rs in self.merged:
                step = cur = self._step(k)
                row = per_round[k]
                t = clock()
                staged = sum(rr.staging_numel for _, rr in rs)
                staging = self._staging_half(posted, like) if staged else None
                items, off = [], 0
                for li, rr in rs:
                    seg = staging[off:off + rr.staging_numel] if rr.staging_numel else None
                    off += rr.staging_numel
                    if len(rr.pack_descs):
                        ops.pack(bufs[li][0], self._tensor(rr.pack_descs, (li, rr.index, "pack")), seg)
                    items.append((li, rr, seg))
                sends, recvs, chunks = self._messages(items, bufs)
                row[1] += clock() - t
                if not sends and not recvs:  # only direct pieces, posted above
                    continue
                posted += 1
                if pending is not None:
                    step = pending[3]
                    t = clock()
                    pending[0].wait()
                    per_round[pending[4]][3] += clock() - t
                step = cur
                t = clock()
                handle = self.transport.start(sends, recvs, step)
                row[2] += clock() - t
                if posted == 1 and direct is None:
                    step = "local copies"
                    local_copies()
                    step = cur
                if pending is not None:
                    step = pending[3]
                    t = clock()
                    self._finish(*pending[1:4], bufs)
                    per_round[pending[4]][4] += clock() - t
                pending = (handle, items, (recvs, chunks), cur, k)
                if not opts.pipeline:  # one staging buffer: finish before the next pack
                    t = clock()
                    handle.wait()
                    row[3] += clock() - t
                    t = clock()
                    self._finish(*pending[1:4], bufs)
                    row[4] += clock() - t
                    pending = None
            if pending is not None:
                step = pending[3]
                t = clock()
                pending[0].wait()
                per_round[pending[4]][3] += clock() - t
                t = clock()
                self._finish(*pending[1:4], bufs)
                per_round[pending[4]][4] += clock() - t
            if direct is not None:
                step = direct[1]
                t = clock()
                direct[0].wait()
                per_round[-1][3] += clock() - t
        except BaseException as e:
            if not getattr(e, "reported", False):  # the transport's own errors are reported
                self.transport.fail(step, f"{type(e).__name__}: {e}"[:1000])
            raise
        es = like.element_size() if like is not None else 0
        return {"rounds": len(self.merged),
                "staging_bytes": 0 if self.staging is None else self.staging.numel() * es,
                "phases": {"local": local_s,
                           **{k: sum(r[j] for r in per_round.values())
                              for j, k in enumerate(("pack", "post", "wait", "unpack"), 1)}},
                "per_round": sorted(per_round.values())}

    def _messages(self, items, bufs, direct_only: bool = False):
        """Sends and receives of `items` ([(lane, RankRound, staging segment)]), lane by lane;
        direct pieces (slot -1) are left out when posted at the start, and are the only ones
        taken with direct_only. Checksums (verify) follow all the data, in the same order."""
        sends, recvs, chunks = [], [], []
        for li, rr, seg in items:
            src, dst = bufs[li]
            skip_direct = self.opts.direct_first and self.lanes[li].direct_first and not direct_only
            for c, slot in zip(rr.sends, rr.send_slots):
                if (slot < 0 and skip_direct) or (slot >= 0 and direct_only):
                    continue
                if slot < 0:
                    off = int(c.descs[0, 0])
                    sends.append((c.receivers, src[off:off + c.numel]))
                else:
                    sends.append((c.receivers, seg[slot:slot + c.numel]))
            for c, slot in zip(rr.recvs, rr.recv_slots):
                if (slot < 0 and skip_direct) or (slot >= 0 and direct_only):
                    continue
                if slot < 0:
                    off = int(c.descs[0, 1])
                    recvs.append((c.sender, dst[off:off + c.numel], c.receivers))
                else:
                    recvs.append((c.sender, seg[slot:slot + c.numel], c.receivers))
                chunks.append((li, c))
        if direct_only:
            return sends, recvs
        if self.opts.verify:
            # Checksums travel as extra one-element messages after the data, same peers.
            sends += [(r, checksum(t)) for r, t in sends]
            recvs += [(s, torch.empty(1, dtype=torch.int64, device=t.device), r)
                      for s, t, r in recvs]
        return sends, recvs, chunks

    def _finish(self, items, received, step, bufs) -> None:
        recvs, chunks = received
        if self.opts.verify:
            n = len(recvs) // 2
            for j, ((sender, data, _), (_, want, _)) in enumerate(zip(recvs[:n], recvs[n:])):
                got = checksum(data)
                if not torch.equal(got, want):
                    li, c = chunks[j]
                    name = self.lanes[li].name
                    raise TransferError(
                        f"rank {self.rank}: {step}: checksum mismatch on chunk {j} of the round "
                        f"({name + ', ' if name else ''}plan message {c.msg}, {c.numel} elements) "
                        f"from peer rank {sender}: sender computed {int(want.item())}, received "
                        f"data gives {int(got.item())}")
        for li, rr, seg in items:
            if len(rr.unpack_descs):
                ops.unpack(seg, self._tensor(rr.unpack_descs, (li, rr.index, "unpack")), bufs[li][1])


__all__ = ["RoundRunner", "RoundOptions", "Lane", "checksum"]
