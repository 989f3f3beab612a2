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
from dataclasses import dataclass

import numpy as np
import torch

from ..ops import CopyPlan
from .rank_schedule import RankSchedule
from .round_layout import direct_messages, layout_round
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
    """Elements per round (bucket / inflight): the per-rank budget is half of it per direction
    (rank_schedule.py)."""
    pipeline: bool
    verify: bool
    direct_first: bool
    direct_min_elems: int
    inflight: int = 1
    """Staging slots: rounds packed or on the wire at once (1: no pipelining)."""
    merge: bool = False
    """One message per peer and round, direct pieces included (round_layout.py)."""

    @classmethod
    def resolve(cls, transport: Transport, element_size: int, dtype, *, bucket_bytes: int,
                pipeline: bool | None, verify: bool, direct_min_bytes: int | None,
                inflight: int | None = None, merge: bool | None = None) -> RoundOptions:
        if bucket_bytes < 2 * element_size:
            raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than two elements of {dtype}")
        if direct_min_bytes is not None and direct_min_bytes < 0:
            raise ValueError(f"direct_min_bytes={direct_min_bytes} must be >= 0 (0 or None: send "
                             "every piece of a mixed message through staging)")
        if inflight is not None and inflight not in (1, 2, 3):
            raise ValueError(f"inflight={inflight}: 1, 2 or 3 rounds in flight")
        bucket_elems = bucket_bytes // element_size
        if pipeline is None:
            pipeline = transport.asynchronous
        slots = (inflight or 2) if pipeline else 1
        # Slots of at least two elements each, else a single buffer without overlap.
        while slots > 1 and bucket_elems // slots < 2:
            slots -= 1
        if merge is None:
            merge = getattr(transport, "stream_ordered", False)
        # An asynchronous transport posts every direct piece at the start (they use no
        # staging); with verify=True (or merged messages) they stay in their rounds.
        direct_first = transport.asynchronous and not verify and not merge
        # Rounded up to whole elements, so a tiny positive threshold never turns the feature off.
        return cls(bucket_elems // slots, slots > 1, verify, direct_first,
                   -(-(direct_min_bytes or 0) // element_size), slots, bool(merge))


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
        apart = frozenset(li for li, lane in enumerate(lanes) if lane.direct_first) if opts.direct_first else frozenset()
        self.layouts = [(k, layout_round(items, merge=opts.merge, direct_apart=apart)) for k, items in self.merged]
        self.direct = direct_messages(self.merged, lanes) if apart else ([], [])
        self.half = max((lay.staged for _, lay in self.layouts), default=0)
        self.local = np.concatenate([np.hstack([lane.schedule.local, np.full((len(lane.schedule.local), 2), li)])
                                     for li, lane in enumerate(lanes)] or [np.zeros((0, 8), np.int64)])
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
        if (self.staging is None or self.staging.device != like.device
                or self.staging.dtype != like.dtype):
            self.staging = torch.empty(self.opts.inflight * self.half, dtype=like.dtype, device=like.device)
        return self.staging

    def run(self, bufs: list[tuple], check=None) -> dict:
        """Move every lane's share; bufs[i] = (source flat or None, destination flat or None) of
        lane i. check(): input validation, run inside the error reporting (a rank that rejects
        its input tells its peers at once). Returns stats: rounds, staging_bytes, "phases"
        (seconds in local copies, pack, post, wait, unpack) and "per_round" ([merged round,
        pack, post, wait, unpack] seconds; round -1: the direct pieces, posted at once)."""
        clock, opts = time.perf_counter, self.opts
        ordered = getattr(self.transport, "stream_ordered", False)
        per_round = {k: [k, 0.0, 0.0, 0.0, 0.0] for k, _ in self.layouts}
        local_s = 0.0
        like = None
        step = "input check"
        watch: list = []  # stream-ordered: every handle, waited on the host at the end
        try:
            if check is not None:
                check()  # may fill `bufs`
            like = next((b for pair in bufs for b in pair if b is not None), None)
            srcs, dsts = [b[0] for b in bufs], [b[1] for b in bufs]

            def local_copies():
                # Run while transfers are in flight (disjoint destination ranges: each element
                # comes either from this rank's source or from a peer).
                nonlocal local_s
                t = clock()
                if len(self.local):
                    self._plan(("local",), self.local, like).run(srcs, dsts)
                local_s += clock() - t

            def complete(p):
                handle, k, lay, staging, step_k, recvs = p
                t = clock()
                if ordered:
                    handle.order()
                    watch.append((handle, step_k))
                else:
                    handle.wait()
                per_round[k][3] += clock() - t
                t = clock()
                self._finish(k, lay, staging, recvs, step_k, dsts, like)
                per_round[k][4] += clock() - t

            direct = None
            if self.direct[0] or self.direct[1]:
                # Pieces sent straight from / into the buffers need no staging, so the memory
                # bound does not hold them to their rounds: post them all now (both ends derive
                # the same order) and wait for them at the end.
                step = "direct pieces of every round"
                t = clock()
                sends, recvs = self._tensors(self.direct[0], self.direct[1], srcs, dsts, None)
                direct = (self.transport.start(sends, recvs, step), step)
                per_round[-1] = [-1, 0.0, clock() - t, 0.0, 0.0]
            if direct is not None or not self.layouts:
                step = "local copies"
                local_copies()
            pending, posted = [], 0
            for k, lay in self.layouts:
                step = cur = self._step(k)
                row = per_round[k]
                if not lay.sends and not lay.recvs:  # only direct pieces, posted above
                    continue
                t = clock()
                slot = posted % opts.inflight
                staging = None
                if lay.staged:
                    staging = self._staging(like)[slot * self.half:(slot + 1) * self.half]
                    if len(lay.pack):
                        self._plan(("pack", k), lay.pack, like).run(srcs, [staging])
                sends, recvs = self._tensors(lay.sends, lay.recvs, srcs, dsts, staging)
                row[1] += clock() - t
                posted += 1
                t = clock()
                handle = self.transport.start(sends, recvs, cur)
                row[2] += clock() - t
                if posted == 1 and direct is None:
                    step = "local copies"
                    local_copies()
                pending.append((handle, k, lay, staging, cur, recvs))
                while len(pending) >= opts.inflight:
                    step = pending[0][4]
                    complete(pending.pop(0))
            while pending:
                step = pending[0][4]
                complete(pending.pop(0))
            if direct is not None:
                step = direct[1]
                t = clock()
                (direct[0].order if ordered else direct[0].wait)()
                if ordered:
                    watch.append((direct[0], step))
                per_round[-1][3] += clock() - t
            for handle, step_k in watch:  # the host's only waits: timeouts and failures
                step = step_k
                handle.wait()
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

    def _tensors(self, sends, recvs, srcs, dsts, staging):
        """The transport's (receivers, tensor) / (sender, tensor, receivers) lists of messages:
        slices of the staging half or, for direct pieces, of the lane buffers; checksums
        (verify) after the data, in the same order."""
        out_s = [(m.receivers, (srcs[m.lane] if m.direct else staging)[m.off:m.off + m.numel]) for m in sends]
        out_r = [(m.peers[0], (dsts[m.lane] if m.direct else staging)[m.off:m.off + m.numel], m.receivers)
                 for m in recvs]
        if self.opts.verify and (out_s or out_r):
            out_s += [(r, checksum(t)) for r, t in out_s]
            out_r += [(s, torch.empty(1, dtype=torch.int64, device=t.device), r) for s, t, r in out_r]
        return out_s, out_r

    def _finish(self, k, lay, staging, recvs, step, dsts, like) -> None:
        if self.opts.verify:
            n = len(recvs) // 2
            for j, ((sender, data, _), (_, want, _)) in enumerate(zip(recvs[:n], recvs[n:])):
                got = checksum(data)
                if not torch.equal(got, want):
                    m = lay.recvs[j]
                    name = self.lanes[m.lane].name
                    what = (f"plan message {m.chunks[0].msg}" if len(m.chunks) == 1
                            else f"plan messages {sorted({c.msg for c in m.chunks})}")
                    raise TransferError(
                        f"rank {self.rank}: {step}: checksum mismatch on chunk {j} of the round "
                        f"({name + ', ' if name else ''}{what}, {m.numel} elements) "
                        f"from peer rank {sender}: sender computed {int(want.item())}, received "
                        f"data gives {int(got.item())}")
        if len(lay.unpack):
            self._plan(("unpack", k), lay.unpack, like).run([staging], dsts)


__all__ = ["RoundRunner", "RoundOptions", "Lane", "checksum"]
