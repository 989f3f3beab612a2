"""Executes a transfer plan: local copies, then per round pack -> transport -> unpack.

    Reallocator(plan, transport, bucket_bytes=256 << 20).run(src_shard, dst_shard)

A rank passes None for a side it does not hold (both None: nothing to do, but every rank of the
transport's group must still construct the Reallocator, since `transport.setup(plan)` may be
collective). Local pieces go straight from the source buffer to the destination buffer; a chunk
that is one contiguous run is sent from / received into the shard buffers directly; everything
else goes through one staging buffer allocated once and reused across calls.

direct_min_bytes (default 256 KiB; 0 or None: off): inside a message that also holds strided
pieces, every piece that is one contiguous run on both sides and at least this big travels as its
own chunk without staging (no pack/unpack copy, one more message per piece); see
real_py/realloc/schedule.py. The staging bound below holds either way; direct chunks count towards the
per-round element budget like staged ones, so the data in flight per rank stays bounded too.

Double buffering (pipeline=True; the default for asynchronous transports such as DistTransport,
a blocking one like the in-process transport gains nothing from it): the staging buffer holds
two halves; round i+1 is packed into one half while round i is on the wire in the other, and
round i is unpacked while round i+1 is on the wire. Rounds are sized to half a bucket, so the staging buffer never exceeds
`bucket_bytes` in total: peak extra memory = staging + the destination shard.

verify=True: the sender computes an int64 checksum of every chunk's raw bytes before sending and
ships it with the chunk (same receivers, same round); the receiver recomputes it after receiving
and raises TransferError naming the chunk, the peer and the round on a mismatch.

The source shard is only read; `run(..., free_source=True)` releases its storage after every
round of this rank completed (never on failure).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from .. import ops
from .plan import ReallocPlan
from .rank_schedule import RankSchedule, rank_schedule
from .shard import ModelShard
from .transports.base import TransferError, Transport
from .transports.inprocess import InProcessHub

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_DIRECT_MIN_BYTES = 256 << 10
"""Smallest contiguous piece sent without staging inside a mixed message (measured on gloo:
below a few hundred KiB the extra message costs about what the saved copies gain)."""


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


class Reallocator:
    def __init__(self, plan: ReallocPlan, transport: Transport, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, pipeline: bool | None = None,
                 verify: bool = False, direct_min_bytes: int | None = DEFAULT_DIRECT_MIN_BYTES):
        if not isinstance(plan, ReallocPlan):
            raise TypeError(f"plan must be a ReallocPlan from real_py.plan_realloc(model, src, dst), "
                            f"got {type(plan).__name__}")
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a real_py Transport (DistTransport, InProcessHub."
                            f"transport(rank), ...), got {type(transport).__name__}")
        if bucket_bytes < 2 * plan.element_size:
            raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than two elements of "
                             f"{plan.model.dtype}")
        if direct_min_bytes is not None and direct_min_bytes < 0:
            raise ValueError(f"direct_min_bytes={direct_min_bytes} must be >= 0 (0 or None: send "
                             "every piece of a mixed message through staging)")
        self.plan, self.transport, self.rank = plan, transport, transport.rank
        self.bucket_bytes, self.verify = bucket_bytes, verify
        bucket_elems = bucket_bytes // plan.element_size
        # Two halves of at least two elements each, else a single buffer without overlap.
        if pipeline is None:
            pipeline = transport.asynchronous
        self.pipeline = pipeline and bucket_elems // 2 >= 2
        # An asynchronous transport posts every direct piece at the start (they use no
        # staging); with verify=True they stay in their rounds, beside their checksums.
        self.direct_first = transport.asynchronous and not verify
        self.round_elems = bucket_elems // 2 if self.pipeline else bucket_elems
        # Rounded up to whole elements, so a tiny positive threshold never turns the feature off.
        es = plan.element_size
        self.direct_min_elems = -(-(direct_min_bytes or 0) // es)
        # This rank's rounds only (C++; the same rounds as schedule.Schedule(...).for_rank).
        self.schedule: RankSchedule = rank_schedule(plan, self.rank, self.round_elems,
                                                    self.direct_min_elems)
        self.rounds = self.schedule.rounds
        self._descs: dict[tuple[int, str], torch.Tensor] = {}
        self.staging: torch.Tensor | None = None
        """The one staging buffer this rank allocated (None until a round needs it); with
        pipelining, two halves of `half` elements. Its size is the peak extra memory."""
        self.half = max((r.staging_numel for r in self.rounds), default=0)
        transport.setup(plan)

    def _check(self, shard: ModelShard | None, side: str) -> None:
        layout = self.plan.src if side == "source" else self.plan.dst
        holds = self.rank in layout.ranks
        if shard is not None and not isinstance(shard, ModelShard):
            raise TypeError(f"{side} shard must be a ModelShard or None, got {type(shard).__name__}")
        if shard is None:
            if holds:
                raise ValueError(f"rank {self.rank} is in the {side} layout {layout} but passed no "
                                 f"{side} shard")
            return
        if not holds:
            raise ValueError(f"rank {self.rank} is not in the {side} layout {layout} but passed a "
                             f"{side} shard")
        want = self.plan.model if side == "source" else self.plan.dst_model
        if shard.model != want and shard.model.name == want.name:
            try:  # same name, different model: say which parameter differs
                want.check_compatible(shard.model)
            except ValueError as e:
                raise ValueError(f"{side} shard's model {shard.model.name} is not the plan's {side} "
                                 f"model of the same name: {e}") from None
            raise ValueError(f"{side} shard's model {shard.model.name} differs from the plan's {side} "
                             f"model of the same name (num_layers {shard.model.num_layers} vs "
                             f"{want.num_layers}, parameter order, or storage format such as qkv_layout)")
        if shard.model != want:
            raise ValueError(f"{side} shard was built for model {shard.model.name}, the plan is "
                             f"for {want.name} on the {side} side")
        if shard.layout != layout:
            raise ValueError(f"{side} shard was built for layout {shard.layout}, the plan's "
                             f"{side} layout is {layout}")
        if shard.rank != self.rank:
            raise ValueError(f"{side} shard belongs to rank {shard.rank}, this is rank {self.rank}")
        # The kernels read raw pointers: a buffer whose storage was released (free_source=True, an
        # offloaded shard) or shrunk under its view would be read or written out of bounds.
        flat = shard.flat
        need = (flat.storage_offset() + flat.numel()) * flat.element_size()
        if flat.untyped_storage().nbytes() < need:
            raise ValueError(f"{side} shard of rank {self.rank} ({shard.model.name}, {layout}) has "
                             f"{flat.untyped_storage().nbytes()} bytes of storage behind a {need}-byte "
                             "buffer: it was freed (free_source=True) or offloaded (HostOffload); "
                             "reload it before reallocating")

    def _tensor(self, arr: np.ndarray, key: tuple[int, str]) -> torch.Tensor:
        t = self._descs.get(key)
        if t is None:
            t = self._descs[key] = ops.descs_tensor(arr)
        return t

    def _staging_half(self, i: int, like: torch.Tensor) -> torch.Tensor:
        halves = 2 if self.pipeline else 1
        if (self.staging is None or self.staging.device != like.device
                or self.staging.dtype != like.dtype):
            self.staging = torch.empty(halves * self.half, dtype=like.dtype, device=like.device)
        k = i % halves
        return self.staging[k * self.half:(k + 1) * self.half]

    def run(self, src: ModelShard | None, dst: ModelShard | None, *,
            free_source: bool = False) -> dict:
        """Move this rank's part of the plan; returns stats: bytes, rounds, seconds, "phases"
        (seconds in local copies, pack, post, wait, unpack) and "per_round" ([round index, pack,
        post, wait, unpack] seconds of each of this rank's rounds)."""
        t0 = time.perf_counter()
        mine = self.schedule
        es = self.plan.element_size
        sent = sum(c.numel for rr in self.rounds for c in rr.sends) * es
        received = sum(c.numel for rr in self.rounds for c in rr.recvs) * es
        total = self.schedule.num_rounds
        # Inside the try: a rank that rejects its own input tells its peers (transport.fail), so
        # they stop waiting for it at once and name it, instead of timing out.
        step = "input check"
        try:
            self._check(src, "source")
            self._check(dst, "destination")
            if src is not None and dst is not None and src.flat.device != dst.flat.device:
                raise ValueError(f"source shard on {src.flat.device}, destination on {dst.flat.device}: "
                                 "move one so both sides share a device")
            step = "local copies"
            clock = time.perf_counter
            # Seconds per phase and per round [index, pack, post, wait, unpack] (host time: on
            # CUDA, pack / unpack are asynchronous launches and their work shows up in `wait`);
            # round -1: the direct pieces of every round, posted at once.
            per_round = {rr.index: [rr.index, 0.0, 0.0, 0.0, 0.0] for rr in self.rounds}
            local_s = 0.0

            def local_copies():
                # Run while transfers are in flight (disjoint destination ranges: each element
                # comes either from this rank's source or from a peer).
                nonlocal local_s
                t = clock()
                if len(mine.local):
                    ops.unpack(src.flat, self._tensor(mine.local, (-1, "local")), dst.flat)
                local_s = clock() - t

            direct = None
            if self.direct_first:
                # Pieces sent straight from / into the shard buffers need no staging, so the
                # memory bound does not hold them to their rounds: post them all now, in round
                # order (both ends derive the same order), and wait for them at the end.
                step = f"direct pieces of rounds 0-{total - 1}"
                t = clock()
                sends, recvs = self._direct_messages(src, dst)
                if sends or recvs:
                    direct = (self.transport.start(sends, recvs, step), step)
                    per_round[-1] = [-1, 0.0, clock() - t, 0.0, 0.0]
            if direct is not None or not self.rounds:
                step = "local copies"
                local_copies()
            pending, posted = None, 0
            for rr in self.rounds:
                step = cur = f"round {rr.index}/{total}"
                row = per_round[rr.index]
                t = clock()
                staging = self._staging_half(posted, (src or dst).flat) if rr.staging_numel else None
                if len(rr.pack_descs):
                    ops.pack(src.flat, self._tensor(rr.pack_descs, (rr.index, "pack")), staging)
                sends, recvs = self._messages(rr, src, dst, staging)
                row[1] += clock() - t
                if not sends and not recvs:  # only direct pieces, posted above
                    continue
                posted += 1
                if pending is not None:
                    step = pending[4]
                    t = clock()
                    pending[0].wait()
                    per_round[pending[1].index][3] += clock() - t
                step = cur
                t = clock()
                handle = self.transport.start(sends, recvs, step)
                row[2] += clock() - t
                if posted == 1 and direct is None:
                    step = "local copies"
                    local_copies()
                    step = cur
                if pending is not None:
                    step = pending[4]
                    t = clock()
                    self._finish(*pending[1:], dst)
                    per_round[pending[1].index][4] += clock() - t
                pending = (handle, rr, staging, recvs, cur)
                if not self.pipeline:  # one staging buffer: finish before the next pack
                    t = clock()
                    handle.wait()
                    row[3] += clock() - t
                    t = clock()
                    self._finish(rr, staging, recvs, cur, dst)
                    row[4] += clock() - t
                    pending = None
            if pending is not None:
                step = pending[4]
                t = clock()
                pending[0].wait()
                per_round[pending[1].index][3] += clock() - t
                t = clock()
                self._finish(*pending[1:], dst)
                per_round[pending[1].index][4] += clock() - t
            if direct is not None:
                step = direct[1]
                t = clock()
                direct[0].wait()
                per_round[-1][3] += clock() - t
        except BaseException as e:
            if not getattr(e, "reported", False):  # the transport's own errors are reported
                self.transport.fail(step, f"{type(e).__name__}: {e}"[:1000])
            raise
        if free_source and src is not None:
            # Every send of this rank completed (waited above), so nothing reads it any more.
            src.flat.untyped_storage().resize_(0)
        return {"rank": self.rank, "sent_bytes": sent, "received_bytes": received,
                "local_bytes": mine.local_numel * es, "rounds": len(self.rounds),
                "staging_bytes": 0 if self.staging is None else self.staging.numel() * es,
                "seconds": time.perf_counter() - t0,
                "phases": {"local": local_s,
                           **{k: sum(r[j] for r in per_round.values())
                              for j, k in enumerate(("pack", "post", "wait", "unpack"), 1)}},
                "per_round": sorted(per_round.values())}

    def _direct_messages(self, src, dst):
        """Every round's direct pieces (slot -1 on both ends of a chunk: one contiguous run in
        source and destination), in round order."""
        sends, recvs = [], []
        for rr in self.rounds:
            for c, slot in zip(rr.sends, rr.send_slots):
                if slot < 0:
                    off = int(c.descs[0, 0])
                    sends.append((c.receivers, src.flat[off:off + c.numel]))
            for c, slot in zip(rr.recvs, rr.recv_slots):
                if slot < 0:
                    off = int(c.descs[0, 1])
                    recvs.append((c.sender, dst.flat[off:off + c.numel], c.receivers))
        return sends, recvs

    def _messages(self, rr, src, dst, staging):
        sends, recvs = [], []
        for c, slot in zip(rr.sends, rr.send_slots):
            if slot < 0 and self.direct_first:
                continue
            if slot < 0:
                off = int(c.descs[0, 0])
                sends.append((c.receivers, src.flat[off:off + c.numel]))
            else:
                sends.append((c.receivers, staging[slot:slot + c.numel]))
        for c, slot in zip(rr.recvs, rr.recv_slots):
            if slot < 0 and self.direct_first:
                continue
            if slot < 0:
                off = int(c.descs[0, 1])
                recvs.append((c.sender, dst.flat[off:off + c.numel], c.receivers))
            else:
                recvs.append((c.sender, staging[slot:slot + c.numel], c.receivers))
        if self.verify:
            # Checksums travel as extra one-element messages after the data, same peers.
            sends += [(r, checksum(t)) for r, t in sends]
            recvs += [(s, torch.empty(1, dtype=torch.int64, device=t.device), r)
                      for s, t, r in recvs]
        return sends, recvs

    def _finish(self, rr, staging, recvs, step, dst) -> None:
        if self.verify:
            n = len(recvs) // 2
            for j, ((sender, data, _), (_, want, _)) in enumerate(zip(recvs[:n], recvs[n:])):
                got = checksum(data)
                if not torch.equal(got, want):
                    c = rr.recvs[j]
                    raise TransferError(
                        f"rank {self.rank}: {step}: checksum mismatch on chunk {j} of the round "
                        f"(plan message {c.msg}, {c.numel} elements) from peer rank {sender}: "
                        f"sender computed {int(want.item())}, received data gives {int(got.item())}")
        if len(rr.unpack_descs):
            ops.unpack(staging, self._tensor(rr.unpack_descs, (rr.index, "unpack")), dst.flat)


def new_destination(plan: ReallocPlan, rank: int, device="cpu") -> ModelShard | None:
    """An empty destination shard for `rank` (None if the rank is not in the destination)."""
    if rank not in plan.dst.ranks:
        return None
    return ModelShard.empty(plan.dst_model, plan.dst, rank, device=device)


__all__ = ["Reallocator", "new_destination", "checksum", "DEFAULT_BUCKET_BYTES",
           "DEFAULT_DIRECT_MIN_BYTES"]


def run_in_process(hub: InProcessHub, plan: ReallocPlan, srcs: dict, dsts: dict,
                   **realloc_kwargs) -> dict[int, dict]:
    """Run `plan` on every rank of `hub` in its own thread; srcs/dsts map rank -> ModelShard.

    Returns rank -> the reallocator's stats. Raises the first rank's error (by rank order)
    after every thread has finished.
    """
    results, errors = {}, {}

    def work(rank):
        try:
            r = Reallocator(plan, hub.transport(rank), **realloc_kwargs)
            results[rank] = r.run(srcs.get(rank), dsts.get(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below with the rank
            errors[rank] = e
            hub.fail(rank, f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(r,), name=f"rank{r}") for r in plan.ranks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[min(errors)]
    return results
