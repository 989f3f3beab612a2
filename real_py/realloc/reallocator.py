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
rank_schedule.py. The staging bound below holds either way; direct chunks count towards the
per-round element budget like staged ones, so the data in flight per rank stays bounded too.

Pipelining (pipeline=True; the default for asynchronous transports such as DistTransport, a
blocking one gains nothing from it): the staging buffer holds `inflight` slots (2 by default,
3 allowed); round i+1 is packed into one slot while the rounds before it are on the wire, and a
round is unpacked once it completed. Rounds are sized to bucket / inflight, so the staging
buffer never exceeds `bucket_bytes` in total: peak extra memory = staging + the destination
shard. merge (default: on for NCCL): one message per peer and round (rounds.py).

verify=True: the sender computes an int64 checksum of every chunk's raw bytes before sending and
ships it with the chunk (same receivers, same round); the receiver recomputes it after receiving
and raises TransferError naming the chunk, the peer and the round on a mismatch.

One pass (one_pass=None: on when the transport is addressable, i.e. in-process threads or CUDA
IPC, and verify is off): every message goes straight from the sender's source shard into the
receiver's destination shard, all of a rank's messages and local copies in ONE compiled copy
(direct.py: one kernel launch per rank and move on a GPU, one C++ call on a CPU), no staging,
no round loop. one_pass=False keeps the staged round loop on any transport.

Compiled once, replayed: the schedule, the compiled copies (descriptor tables on the device) and
the staging buffer live as long as the Reallocator; `run()` again does the host work of one call
(publish buffers, one launch, wait for readers on one pass). `InProcessMove` (inprocess_move.py)
does the same for a whole in-process world: its ranks' Reallocators and worker threads are
built once.

The source shard is only read; `run(..., free_source=True)` releases its storage after every
round of this rank completed and (one pass) every reader finished with it (never on failure).
"""

from __future__ import annotations

import threading
import time

from .direct import DirectRunner, plan_tag, schedule_entries, schedule_readers
from .plan import ReallocPlan
from .rank_schedule import RankSchedule, rank_schedule
from .rounds import Lane, RoundOptions, RoundRunner, checksum
from .shard import ModelShard
from .transports.base import Transport
from .transports.inprocess import InProcessHub

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_DIRECT_MIN_BYTES = 256 << 10
"""Smallest contiguous piece sent without staging inside a mixed message (measured on gloo:
below a few hundred KiB the extra message costs about what the saved copies gain)."""


class Reallocator:
    def __init__(self, plan: ReallocPlan, transport: Transport, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, pipeline: bool | None = None,
                 verify: bool = False, direct_min_bytes: int | None = DEFAULT_DIRECT_MIN_BYTES,
                 one_pass: bool | None = None, inflight: int | None = None, merge: bool | None = None):
        if not isinstance(plan, ReallocPlan):
            raise TypeError(f"plan must be a ReallocPlan from real_py.plan_realloc(model, src, dst), "
                            f"got {type(plan).__name__}")
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a real_py Transport (DistTransport, InProcessHub."
                            f"transport(rank), ...), got {type(transport).__name__}")
        self.plan, self.transport, self.rank = plan, transport, transport.rank
        self.bucket_bytes, self.verify = bucket_bytes, verify
        self.opts = RoundOptions.resolve(transport, plan.element_size, plan.model.dtype,
                                         bucket_bytes=bucket_bytes, pipeline=pipeline,
                                         verify=verify, direct_min_bytes=direct_min_bytes,
                                         inflight=inflight, merge=merge)
        self.pipeline, self.round_elems = self.opts.pipeline, self.opts.round_elems
        # This rank's rounds only (C++; tests/support/schedule_oracle.py derives every rank's at once).
        self.schedule: RankSchedule = rank_schedule(plan, self.rank, self.round_elems,
                                                    self.opts.direct_min_elems)
        self.rounds = self.schedule.rounds
        self.one_pass = resolve_one_pass(transport, one_pass, verify)
        if self.one_pass:
            self.runner = DirectRunner(transport, plan_tag(plan), schedule_entries(self.schedule),
                                       schedule_readers(self.schedule), plan.element_size)
        else:
            self.runner = RoundRunner(transport, [Lane(self.schedule)], self.opts,
                                      total=self.schedule.num_rounds)
        self._bytes: dict | None = None
        transport.setup(plan)

    @property
    def staging(self):
        """The one staging buffer this rank allocated (None until a round needs it, and always
        on one pass); with pipelining, `inflight` slots. Its size is the peak extra memory."""
        return getattr(self.runner, "staging", None)

    def run(self, src: ModelShard | None, dst: ModelShard | None, *,
            free_source: bool = False) -> dict:
        """Move this rank's part of the plan; returns stats: bytes, rounds, seconds, "phases"
        (seconds in local copies, pack, post, wait, unpack) and "per_round" ([round index, pack,
        post, wait, unpack] seconds of each of this rank's rounds)."""
        t0 = time.perf_counter()
        bufs, check = self._inputs(src, dst)
        stats = self.runner.run(bufs, check)
        return self._done(src, free_source, stats, t0)

    def _inputs(self, src, dst):
        def check():
            check_shard(self.plan, self.rank, src, "source")
            check_shard(self.plan, self.rank, dst, "destination")
            if src is not None and dst is not None and src.flat.device != dst.flat.device:
                raise ValueError(f"source shard on {src.flat.device}, destination on {dst.flat.device}: "
                                 "move one so both sides share a device")

        # A non-shard passes no buffer here: check() names it (TypeError) inside the runner,
        # which reports the failure to the peers.
        flat = lambda s: s.flat if isinstance(s, ModelShard) else None  # noqa: E731
        return [(flat(src), flat(dst))], check

    def _done(self, src, free_source: bool, stats: dict, t0: float) -> dict:
        es = self.plan.element_size
        if free_source and src is not None:
            # Every send of this rank completed (waited above), so nothing reads it any more.
            src.flat.untyped_storage().resize_(0)
        if self._bytes is None:  # counted once: a replayed move does no work per chunk
            self._bytes = schedule_bytes([self.schedule], es)
        return {"rank": self.rank, **self._bytes, **stats,
                "seconds": time.perf_counter() - t0}


def resolve_one_pass(transport: Transport, one_pass: bool | None, verify: bool) -> bool:
    """one_pass None: on for addressable transports without verify; True where it cannot run:
    ValueError naming why."""
    if getattr(transport, "one_pass_only", False) and (verify or one_pass is False):
        raise ValueError(f"{type(transport).__name__} moves in one pass only; verify=True and one_pass=False "
                         "need a transport with a wire (DistTransport)")
    if one_pass is None:
        return transport.addressable and not verify
    if one_pass and not transport.addressable:
        raise ValueError(f"one_pass=True needs a transport that addresses its peers' buffers "
                         f"(in-process, CUDA IPC); {type(transport).__name__} does not")
    if one_pass and verify:
        raise ValueError("verify=True checksums chunks on the wire, and one_pass=True has none; "
                         "pass one_pass=False to verify")
    return bool(one_pass)


def schedule_bytes(schedules: list[RankSchedule], element_size: int) -> dict:
    """Bytes this rank sends, receives over the network and copies locally in `schedules`."""
    return {"sent_bytes": sum(c.numel for s in schedules for rr in s.rounds for c in rr.sends) * element_size,
            "received_bytes": sum(c.numel for s in schedules for rr in s.rounds
                                  for c in rr.recvs) * element_size,
            "local_bytes": sum(s.local_numel for s in schedules) * element_size}


def check_shard(plan: ReallocPlan, rank: int, shard: ModelShard | None, side: str) -> None:
    """ValueError / TypeError unless `shard` is `rank`'s `side` ("source" / "destination")
    shard of `plan` (None exactly when the rank is not in that layout), with live storage."""
    layout = plan.src if side == "source" else plan.dst
    holds = rank in layout.ranks
    if shard is not None and not isinstance(shard, ModelShard):
        raise TypeError(f"{side} shard must be a ModelShard or None, got {type(shard).__name__}")
    if shard is None:
        if holds:
            raise ValueError(f"rank {rank} is in the {side} layout {layout} but passed no "
                             f"{side} shard")
        return
    if not holds:
        raise ValueError(f"rank {rank} is not in the {side} layout {layout} but passed a "
                         f"{side} shard")
    want = plan.model if side == "source" else plan.dst_model
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
    if shard.rank != rank:
        raise ValueError(f"{side} shard belongs to rank {shard.rank}, this is rank {rank}")
    # The kernels read raw pointers: a buffer whose storage was released (free_source=True, an
    # offloaded shard) or shrunk under its view would be read or written out of bounds.
    flat = shard.flat
    need = (flat.storage_offset() + flat.numel()) * flat.element_size()
    if flat.untyped_storage().nbytes() < need:
        raise ValueError(f"{side} shard of rank {rank} ({shard.model.name}, {layout}) has "
                         f"{flat.untyped_storage().nbytes()} bytes of storage behind a {need}-byte "
                         "buffer: it was freed (free_source=True) or offloaded (HostOffload); "
                         "reload it before reallocating")



def new_destination(plan: ReallocPlan, rank: int, device="cpu") -> ModelShard | None:
    """An empty destination shard for `rank` (None if the rank is not in the destination)."""
    if rank not in plan.dst.ranks:
        return None
    return ModelShard.empty(plan.dst_model, plan.dst, rank, device=device)


__all__ = ["Reallocator", "new_destination", "checksum", "check_shard", "schedule_bytes", "DEFAULT_BUCKET_BYTES",
           "DEFAULT_DIRECT_MIN_BYTES"]


def run_in_process(hub: InProcessHub, plan: ReallocPlan, srcs: dict, dsts: dict,
                   **realloc_kwargs) -> dict[int, dict]:
    """Run `plan` on every rank of `hub` in its own thread; srcs/dsts map rank -> ModelShard.

    Returns rank -> the reallocator's stats. Raises the first rank's error (by rank order)
    after every thread has finished. Builds everything per call; `InProcessMove` keeps it."""
    return run_ranks(hub, plan.ranks(), lambda rank: Reallocator(plan, hub.transport(rank), **realloc_kwargs)
                     .run(srcs.get(rank), dsts.get(rank)))


def run_ranks(hub: InProcessHub | None, ranks, work) -> dict:
    """work(rank) for every rank, each in its own thread; rank -> its result. A rank that raises
    is marked failed on the hub, if any (its peers stop waiting for it); the lowest failed rank's
    error is raised after every thread has finished."""
    results, errors = {}, {}

    def one(rank):
        try:
            results[rank] = work(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below with the rank
            errors[rank] = e
            if hub is not None:
                hub.fail(rank, f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(r,), name=f"rank{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[min(errors)]
    return results
