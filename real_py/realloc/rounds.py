"""One rank's round loop (the executor's staged path): pack -> transport -> unpack, per round.

    runner = RoundRunner(transport, [lane, ...], opts)      # opts: options.ResolvedOptions
    stats = runner.run([(src_flat, dst_flat), ...], check=...)

A lane is one plan's share of this rank's rounds (its RankSchedule, rank_schedule.py) on its own
pair of flat buffers: the executor (executor.py) runs one lane per part of the plan that the
rank takes part in (a dense plan: one). Merged round r is every lane's round r, relabelled by the
lane's `shift` (round i of a lane with n rounds is merged round (i + shift) % n, a bijection of
[0, n), so a lane still has at most one round in any merged round). All of a merged round's
messages go out in ONE transport.start call, listed lane by lane (lane order, then the lane's own
chunk order) with the checksums after all data: both ends of a chunk derive the same list order
alone, which is what the transports' per-pair matching needs (transports/base.py).

Compiled once: each merged round's layout (round_layout.py: staging offsets, messages) is built
at construction, and its pack and unpack are each ONE compiled copy over every lane
(ops.CopyPlan, descriptor tables kept on the device, built on the first run),
so a round costs one pack launch, one post and one unpack launch.

Staging: `inflight` slots (1 without pipelining, 2 by default, 3 allowed), each holding one
merged round's staged elements; round r+inflight-1 is packed while the rounds before it are on
the wire, and a round is unpacked once it completed. Rounds are sized to bucket / inflight, so
the staging buffer stays within `bucket_bytes`.

Stream-ordered transports (NCCL: DistTransport on a NCCL group, CupyNcclTransport): completing a
round is `handle.order()`: the current stream waits for the round's communication, and the
unpack follows on that stream, so the host never waits for the device between rounds; it only
watches for timeouts at the end (`handle.wait()` on every round, each against its own deadline).
Elsewhere (gloo, in-process) completing a round is the blocking `handle.wait()`.

Direct pieces (one contiguous run on both sides) are sent from / received into the lanes' own
buffers; an asynchronous transport without verify posts them all at the start in one call
(merged round order, then lane order), as they need no staging. merge=True (the default on
stream-ordered transports) packs every chunk of a round between the same two ends into one
message instead, direct pieces included (round_layout.py): one send per peer and round.
verify=True: an int64 checksum per message travels after the round's data; a mismatch names the
rank, the round, the lane's chunks and the peer. Errors are reported to the peers
(transport.fail) with the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops import CopyPlan
from .options import ResolvedOptions, RoundOptions
from .rank_schedule import RankSchedule
from .round_layout import RoundLayout, direct_messages, layout_round
from .transports.base import Handle, TransferError, Transport


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
class Lane:
    schedule: RankSchedule
    shift: int = 0
    """Round i of this lane runs in merged round (i + shift) % schedule.num_rounds."""
    name: str = ""
    """Named in checksum errors ("" for a lone plan)."""
    direct_first: bool = True
    """Whether this lane's direct pieces may be posted at the start (ResolvedOptions.direct_first);
    False keeps them in their rounds, where each end may stage its side of a piece on its own
    (expert_readdress.readdress): both ends of a chunk read the same lane flag, so they agree."""


@dataclass(slots=True)
class RoundTimes:
    """Seconds one merged round spent in each phase on this rank (round -1: the direct pieces)."""

    round: int
    pack: float = 0.0
    post: float = 0.0
    wait: float = 0.0
    unpack: float = 0.0


@dataclass(slots=True, kw_only=True)
class Posted:
    """A posted round (or the direct pieces, layout None), until it is completed."""

    handle: Handle
    round: int
    step: str
    """Named in errors: "round i/total", "merged round i" or "direct pieces of every round"."""
    layout: RoundLayout | None = None
    staging: torch.Tensor | None = None
    """The staging slot the round was packed into (None: nothing staged)."""
    recvs: list = field(default_factory=list)
    """The transport's receive list: data, then checksums (verify)."""


@dataclass(slots=True)
class Call:
    """One run() call's state: the buffers, timings, and the step named if it fails."""

    times: dict[int, RoundTimes]
    srcs: list = field(default_factory=list)
    dsts: list = field(default_factory=list)
    like: torch.Tensor | None = None
    """The first buffer passed: device and dtype of the staging buffer and the copies."""
    step: str = "input check"
    posted: int = 0
    """Rounds posted so far (round-robin over the staging slots)."""
    local_s: float = 0.0
    watch: list[Posted] = field(default_factory=list)
    """Stream-ordered transports: every completed handle, waited on the host at the end."""


class RoundRunner:
    def __init__(
        self,
        transport: Transport,
        lanes: list[Lane],
        opts: ResolvedOptions,
        total: int | None = None,
    ):
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
        apart = (
            frozenset(li for li, lane in enumerate(lanes) if lane.direct_first)
            if opts.direct_first
            else frozenset()
        )
        self.layouts = [
            (k, layout_round(items, merge=opts.merge, direct_apart=apart))
            for k, items in self.merged
        ]
        self.direct = direct_messages(self.merged, lanes) if apart else ([], [])
        self.half = max((lay.staged for _, lay in self.layouts), default=0)
        self.local = np.concatenate(
            [
                np.hstack([lane.schedule.local, np.full((len(lane.schedule.local), 2), li)])
                for li, lane in enumerate(lanes)
            ]
            or [np.zeros((0, 8), np.int64)]
        )
        self.staging: torch.Tensor | None = None
        self._plans: dict[tuple, CopyPlan] = {}

    def _plan(self, key: tuple, rows: np.ndarray, like) -> CopyPlan:
        """The compiled copy of `rows` on `like`'s device (built on first use; staging offsets
        count from the slot passed at run time, so one plan serves every slot)."""
        full = (key, str(like.device))
        p = self._plans.get(full)
        if p is None:
            p = self._plans[full] = CopyPlan(rows, like.element_size(), device=like.device)
        return p

    def _step(self, k: int) -> str:
        return f"round {k}/{self.total}" if self.total is not None else f"merged round {k}"

    def _staging(self, like: torch.Tensor) -> torch.Tensor:
        if (
            self.staging is None
            or self.staging.device != like.device
            or self.staging.dtype != like.dtype
        ):
            self.staging = torch.empty(
                self.opts.inflight * self.half, dtype=like.dtype, device=like.device
            )
        return self.staging

    def run(self, bufs: list[tuple], check=None) -> dict:
        """Move every lane's share; bufs[i] = (source flat or None, destination flat or None) of
        lane i. check(): input validation, run inside the error reporting (a rank that rejects
        its input tells its peers at once). Returns stats: rounds, staging_bytes, "phases"
        (seconds in local copies, pack, post, wait, unpack) and "per_round" ([merged round,
        pack, post, wait, unpack] seconds; round -1: the direct pieces, posted at once)."""
        call = Call(times={k: RoundTimes(k) for k, _ in self.layouts})
        try:
            if check is not None:
                check()  # may fill `bufs`
            call.srcs, call.dsts = [b[0] for b in bufs], [b[1] for b in bufs]
            call.like = next((b for pair in bufs for b in pair if b is not None), None)
            direct = self._post_direct(call) if self.direct[0] or self.direct[1] else None
            if direct is not None or not self.layouts:
                self._local_copies(call)
            pending: list[Posted] = []
            for k, lay in self.layouts:
                if not lay.sends and not lay.recvs:  # only direct pieces, posted above
                    continue
                pending.append(self._post_round(call, k, lay))
                if call.posted == 1 and direct is None:
                    # Run while the first round is in flight (disjoint destination ranges: each
                    # element comes either from this rank's source or from a peer).
                    self._local_copies(call)
                while len(pending) >= self.opts.inflight:
                    self._complete(call, pending.pop(0))
            while pending:
                self._complete(call, pending.pop(0))
            if direct is not None:
                self._complete(call, direct)
            for posted in call.watch:  # the host's only waits: timeouts and failures
                call.step = posted.step
                posted.handle.wait()
        except BaseException as e:
            if not getattr(e, "reported", False):  # the transport's own errors are reported
                self.transport.fail(call.step, f"{type(e).__name__}: {e}"[:1000])
            raise
        es = call.like.element_size() if call.like is not None else 0
        times = sorted(call.times.values(), key=lambda x: x.round)
        return {
            "rounds": len(self.merged),
            "staging_bytes": 0 if self.staging is None else self.staging.numel() * es,
            "phases": {
                "local": call.local_s,
                **{
                    phase: sum(getattr(x, phase) for x in times)
                    for phase in ("pack", "post", "wait", "unpack")
                },
            },
            "per_round": [[x.round, x.pack, x.post, x.wait, x.unpack] for x in times],
        }

    def _local_copies(self, call: Call) -> None:
        call.step = "local copies"
        t = time.perf_counter()
        if len(self.local):
            self._plan(("local",), self.local, call.like).run(call.srcs, call.dsts)
        call.local_s += time.perf_counter() - t

    def _post_direct(self, call: Call) -> Posted:
        """Post every direct piece of every round at once: sent straight from / into the
        buffers, they need no staging, so the memory bound does not hold them to their rounds
        (both ends derive the same order); completed after the rounds."""
        call.step = "direct pieces of every round"
        t = time.perf_counter()
        sends, recvs = self._tensors(self.direct[0], self.direct[1], call.srcs, call.dsts, None)
        handle = self.transport.start(sends, recvs, call.step)
        call.times[-1] = RoundTimes(-1, post=time.perf_counter() - t)
        return Posted(handle=handle, round=-1, step=call.step)

    def _post_round(self, call: Call, k: int, lay: RoundLayout) -> Posted:
        """Pack merged round k into the next staging slot and post its messages."""
        clock, row = time.perf_counter, call.times[k]
        call.step = self._step(k)
        t = clock()
        staging = None
        if lay.staged:
            slot = call.posted % self.opts.inflight
            staging = self._staging(call.like)[slot * self.half : (slot + 1) * self.half]
            if len(lay.pack):
                self._plan(("pack", k), lay.pack, call.like).run(call.srcs, [staging])
        sends, recvs = self._tensors(lay.sends, lay.recvs, call.srcs, call.dsts, staging)
        row.pack += clock() - t
        call.posted += 1
        t = clock()
        handle = self.transport.start(sends, recvs, call.step)
        row.post += clock() - t
        return Posted(
            handle=handle, round=k, step=call.step, layout=lay, staging=staging, recvs=recvs
        )

    def _complete(self, call: Call, posted: Posted) -> None:
        """Complete a posted round (stream-ordered: order the current stream after it and watch
        it at the end; else wait), then check and unpack it (not the direct pieces: they landed
        in place)."""
        clock, row = time.perf_counter, call.times[posted.round]
        call.step = posted.step
        t = clock()
        if getattr(self.transport, "stream_ordered", False):
            posted.handle.order()
            call.watch.append(posted)
        else:
            posted.handle.wait()
        row.wait += clock() - t
        if posted.layout is not None:
            t = clock()
            self._finish(posted, call.dsts, call.like)
            row.unpack += clock() - t

    def _tensors(self, sends, recvs, srcs, dsts, staging):
        """The transport's (receivers, tensor) / (sender, tensor, receivers) lists of messages:
        slices of the staging half or, for direct pieces, of the lane buffers; checksums
        (verify) after the data, in the same order."""
        out_s = [
            (m.receivers, (srcs[m.lane] if m.direct else staging)[m.off : m.off + m.numel])
            for m in sends
        ]
        out_r = [
            (
                m.peers[0],
                (dsts[m.lane] if m.direct else staging)[m.off : m.off + m.numel],
                m.receivers,
            )
            for m in recvs
        ]
        if self.opts.verify and (out_s or out_r):
            out_s += [(r, checksum(t)) for r, t in out_s]
            out_r += [
                (s, torch.empty(1, dtype=torch.int64, device=t.device), r) for s, t, r in out_r
            ]
        return out_s, out_r

    def _finish(self, posted: Posted, dsts, like) -> None:
        """Check a completed round's checksums (verify) and unpack it."""
        k, lay, recvs, step = posted.round, posted.layout, posted.recvs, posted.step
        if self.opts.verify:
            n = len(recvs) // 2
            for j, ((sender, data, _), (_, want, _)) in enumerate(zip(recvs[:n], recvs[n:])):
                got = checksum(data)
                if not torch.equal(got, want):
                    m = lay.recvs[j]
                    name = self.lanes[m.lane].name
                    what = (
                        f"plan message {m.chunks[0].msg}"
                        if len(m.chunks) == 1
                        else f"plan messages {sorted({c.msg for c in m.chunks})}"
                    )
                    raise TransferError(
                        f"rank {self.rank}: {step}: checksum mismatch on chunk {j} of the round "
                        f"({name + ', ' if name else ''}{what}, {m.numel} elements) "
                        f"from peer rank {sender}: sender computed {int(want.item())}, received "
                        f"data gives {int(got.item())}"
                    )
        if len(lay.unpack):
            self._plan(("unpack", k), lay.unpack, like).run([posted.staging], dsts)


__all__ = ["RoundRunner", "RoundOptions", "Lane", "checksum"]
