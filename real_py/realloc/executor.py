"""One rank's share of a move, for a dense plan and an MoE plan alike: `Executor`.

    ex = Executor(plan, transport, bucket_bytes=256 << 20)      # a ReallocPlan or a MoePlan
    stats = ex.move((src_shard, src_experts), (dst_shard, dst_experts))   # None where not held
    run_in_process(InProcessHub(), plan, srcs, dsts)            # every rank as a thread

A plan is a list of parts, each an ordinary ReallocPlan on its own layouts: a ReallocPlan is one
dense part, a MoePlan (moe_plan.py) a dense part plus expert parts. Every part this rank takes
part in is a lane: its rank schedule (rank_schedule.py, C++) on one pair of buffers, the
ModelShards' flat buffers (a dense part) or the ExpertShards' (an expert part, its descriptors
re-addressed into them once: expert_readdress.py). The lanes run either

  in one pass (addressable transports; direct.py): every chunk the rank receives, in every lane
  and round, plus its local copies, as ONE compiled copy from the senders' buffers, or
  in rounds (rounds.py): merged round r is round r of every lane (expert lanes rotated apart by
  MoePlan.round_shift), packed, posted in one transport.start, and unpacked as one copy each.

Options (options.py) are resolved once for the transport. The lanes' round sizes keep the
staging bound for the parts together (MoePlan.part_round_elems: a merged round carries at most
one round's budget per rank and direction). Every rank of the transport's group constructs the
Executor (`transport.setup` is collective, once per part, in part order) and runs every plan in
the same order; a rank that fails while building its lanes, or on its inputs, tells its peers.

Compiled once, replayed: schedules, compiled copies (descriptor tables on the device) and the
staging buffer live as long as the Executor; `move()` again does one call's host work. The
source shards are only read; `free_source=True` releases their storage once every round of this
rank completed and (one pass) every reader finished (never on failure).

`Reallocator` (a ReallocPlan: `run(src, dst)`) and `MoeReallocator` (a MoePlan: `run(src,
src_experts, dst, dst_experts)`) are this executor with their plan's argument shapes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch

from ..spec import torch_dtype
from .direct import DirectRunner, Entry, plan_tag, schedule_readers
from .expert_readdress import expert_segments, move_column, readdress
from .moe_plan import MoePart, MoePlan
from .options import MoveOptions, ResolvedOptions
from .plan import ReallocPlan
from .rank_schedule import RankSchedule, rank_schedule
from .rounds import Lane, RoundRunner
from .shard import ExpertShard, ModelShard
from .transports.base import Transport
from .transports.inprocess import InProcessHub


class Executor:
    def __init__(
        self,
        plan: ReallocPlan | MoePlan,
        transport: Transport,
        *,
        options: MoveOptions | None = None,
        **knobs,
    ):
        """options: a MoveOptions; knobs: its fields as keywords (bucket_bytes=..., verify=...),
        on top of `options` where both are given."""
        if not isinstance(plan, (ReallocPlan, MoePlan)):
            raise TypeError(
                f"plan must be a ReallocPlan from real_py.plan_realloc(model, src, dst) or a "
                f"MoePlan from plan_moe_realloc, got {type(plan).__name__}"
            )
        if not isinstance(transport, Transport):
            raise TypeError(
                f"transport must be a real_py Transport (DistTransport, InProcessHub."
                f"transport(rank), ...), got {type(transport).__name__}"
            )
        self.options = MoveOptions(**knobs) if options is None else replace(options, **knobs)
        self.plan, self.transport, self.rank = plan, transport, transport.rank
        self.moe = isinstance(plan, MoePlan)
        self.opts: ResolvedOptions = self.options.resolve(
            transport, plan.model.element_size, plan.model.dtype
        )
        self.one_pass = self.opts.one_pass
        self.parts: tuple[MoePart, ...]
        if isinstance(plan, MoePlan):
            self.parts = plan.parts
            sizes = plan.part_round_elems(self.opts.round_elems)
        else:
            self.parts = (MoePart(label="", plan=plan, experts=None),)
            sizes = [self.opts.round_elems]
        for part in self.parts:
            transport.setup(part.plan)  # collective: every rank, every part, in part order
        lanes, entries, readers = [], [], set()
        self.lane_parts: list[int] = []
        """Index in self.parts of each lane (the parts this rank sends or receives in; a dense
        plan's one part always)."""
        try:  # this rank alone from here: a failure is told to the peers, which then stop waiting
            for p, part in enumerate(self.parts):
                if self.moe and self.rank not in part.plan.src.ranks + part.plan.dst.ranks:
                    continue
                rs = rank_schedule(part.plan, self.rank, sizes[p], self.opts.direct_min_elems)
                if self.one_pass:
                    entries += self._entries(p, rs)
                    readers |= schedule_readers(rs)
                if part.experts is not None:
                    rs = readdress(
                        rs,
                        *(
                            self._segments(part, side, self.rank)
                            if self.rank in lay.ranks
                            else None
                            for side, lay in ((0, part.plan.src), (1, part.plan.dst))
                        ),
                    )
                shift = plan.round_shift(p, rs.num_rounds) if isinstance(plan, MoePlan) else 0
                lanes.append(Lane(rs, shift, part.label, direct_first=part.experts is None))
                self.lane_parts.append(p)
        except Exception as e:
            transport.fail(
                f"building the rank schedule of rank {self.rank}", f"{type(e).__name__}: {e}"[:1000]
            )
            raise
        self.schedules: list[RankSchedule] = [lane.schedule for lane in lanes]
        self.runner: DirectRunner | RoundRunner
        if self.one_pass:
            self.runner = DirectRunner(
                transport,
                plan_tag(plan),
                entries,
                readers,
                plan.model.element_size,
                buf_ids=self.lane_parts,
            )
        else:
            # A dense plan's round count is known on every rank: steps read "round i/total".
            total = None if self.moe else self.schedules[0].num_rounds
            self.runner = RoundRunner(transport, lanes, self.opts, total=total)
        self._bytes: dict | None = None

    def _segments(self, part: MoePart, side: int, rank: int):
        """expert_segments of `rank` on one side (0: source, 1: destination) of an expert part."""
        q = part.plan
        if side == 0:
            return expert_segments(part, q.src, self.plan.model, self.plan.src, rank)
        return expert_segments(part, q.dst, self.plan.dst_model, self.plan.dst, rank)

    def _entries(self, p: int, rs: RankSchedule) -> list[Entry]:
        """One-pass entries of part p: its received chunks and local copies, an expert part's
        descriptors moved into the sender's and this rank's ExpertShard buffers."""
        part = self.parts[p]
        local, chunks = rs.local, [(c.sender, c.descs) for rr in rs.rounds for c in rr.recvs]
        if part.experts is not None:
            mine = self._segments(part, 1, self.rank) if self.rank in part.plan.dst.ranks else None
            theirs = {s: self._segments(part, 0, s) for s in {s for s, _ in chunks}}
            chunks = [(s, move_column(move_column(d, 0, theirs[s]), 1, mine)) for s, d in chunks]
            if len(local):
                local = move_column(
                    move_column(local, 0, self._segments(part, 0, self.rank)), 1, mine
                )
        out = [Entry(self.rank, p, p, local)] if len(local) else []
        return out + [Entry(s, p, p, d) for s, d in chunks]

    @property
    def staging(self):
        """The one staging buffer this rank allocated (None until a round needs it, and always
        on one pass); with pipelining, `inflight` slots. Its size is the peak extra memory."""
        return getattr(self.runner, "staging", None)

    def move(self, src: tuple, dst: tuple, *, free_source: bool = False) -> dict:
        """Move this rank's share of every lane; src / dst: (ModelShard or None, ExpertShard or
        None), experts only for a MoePlan. Returns stats: bytes, rounds, seconds, "phases"
        (seconds in local copies, pack, post, wait, unpack), "per_round" ([round index, pack,
        post, wait, unpack] seconds of each of this rank's rounds), parts, lanes."""
        t0 = time.perf_counter()
        bufs, check = self.inputs(src, dst)
        stats = self.runner.run(bufs, check)
        return self.done(src, free_source, stats, t0)

    def inputs(self, src: tuple, dst: tuple):
        """(bufs, check): check() validates the shards and fills bufs, one (source flat or None,
        destination flat or None) pair per lane. Run inside the runner, which reports a failure
        to the peers."""
        bufs: list[tuple] = []

        def check():
            for side, (shard, experts) in (("source", src), ("destination", dst)):
                if self.moe and (shard is None) != (experts is None):
                    raise ValueError(
                        f"rank {self.rank}: the {side} needs both its ModelShard and "
                        f"its ExpertShard (or neither), got {shard!r} and {experts!r}"
                    )
                check_shard(self.plan, self.rank, shard, side)
                if self.moe:
                    check_shard(self.plan, self.rank, experts, side, kind=ExpertShard)
            devices = sorted({str(x.flat.device) for x in (*src, *dst) if x is not None})
            if len(devices) > 1:
                raise ValueError(
                    f"rank {self.rank}: buffers on {devices}: move them so the source and the "
                    "destination share a device"
                )
            for p in (
                self.lane_parts
            ):  # dense parts address the ModelShards, expert parts the ExpertShards
                held = int(self.parts[p].experts is not None)
                bufs.append(
                    tuple(None if pair[held] is None else pair[held].flat for pair in (src, dst))
                )

        return bufs, check

    def done(self, src: tuple, free_source: bool, stats: dict, t0: float) -> dict:
        """The stats of a move whose runner returned `stats`; frees the sources if asked."""
        if free_source:
            # Every send of this rank completed (waited in run), so nothing reads them any more.
            for shard in src:
                if shard is not None:
                    shard.flat.untyped_storage().resize_(0)
        if self._bytes is None:  # counted once: a replayed move does no work per chunk
            self._bytes = schedule_bytes(self.schedules, self.plan.model.element_size)
        return {
            "rank": self.rank,
            **self._bytes,
            **stats,
            "parts": len(self.parts),
            "lanes": len(self.schedules),
            "seconds": time.perf_counter() - t0,
        }


def shards_of(plan, srcs: dict, dsts: dict, rank: int) -> tuple[tuple, tuple]:
    """`rank`'s (source, destination) pairs for Executor.move from rank -> ModelShard maps (a
    ReallocPlan) or rank -> (ModelShard, ExpertShard) maps (a MoePlan)."""
    if isinstance(plan, MoePlan):
        return srcs.get(rank, (None, None)), dsts.get(rank, (None, None))
    return (srcs.get(rank), None), (dsts.get(rank), None)


def plan_ranks(plan) -> list[int]:
    """Every rank a ReallocPlan or MoePlan moves data from or to, ascending."""
    if isinstance(plan, MoePlan):
        return sorted({r for part in plan.parts for r in part.plan.src.ranks + part.plan.dst.ranks})
    return plan.ranks()


def run_in_process(
    hub: InProcessHub, plan: ReallocPlan | MoePlan, srcs: dict, dsts: dict, **knobs
) -> dict[int, dict]:
    """Run `plan` on every rank of `hub` in its own thread; srcs / dsts map rank -> ModelShard
    (a ReallocPlan) or rank -> (ModelShard, ExpertShard) (a MoePlan); knobs: MoveOptions fields.

    Returns rank -> the executor's stats. Raises the first rank's error (by rank order) after
    every thread has finished. Builds everything per call; `InProcessMove` keeps it."""
    return run_ranks(
        hub,
        plan_ranks(plan),
        lambda rank: Executor(plan, hub.transport(rank), **knobs).move(
            *shards_of(plan, srcs, dsts, rank)
        ),
    )


def run_ranks(hub: InProcessHub | None, ranks, work) -> dict:
    """work(rank) for every rank, each in its own thread; rank -> its result. A rank that raises
    is marked failed on the hub, if any (its peers stop waiting for it); the lowest failed rank's
    error is raised after every thread has finished."""
    results, errors = {}, {}

    def one(rank):
        try:
            results[rank] = work(rank)
        except BaseException as e:
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


def schedule_bytes(schedules: list[RankSchedule], element_size: int) -> dict:
    """Bytes this rank sends, receives over the network and copies locally in `schedules`."""
    return {
        "sent_bytes": sum(c.numel for s in schedules for rr in s.rounds for c in rr.sends)
        * element_size,
        "received_bytes": sum(c.numel for s in schedules for rr in s.rounds for c in rr.recvs)
        * element_size,
        "local_bytes": sum(s.local_numel for s in schedules) * element_size,
    }


def check_shard(plan: ReallocPlan | MoePlan, rank: int, shard, side: str, kind=ModelShard) -> None:
    """ValueError / TypeError unless `shard` is `rank`'s `side` ("source" / "destination")
    shard of `plan` (None exactly when the rank is not in that layout), of `kind` (ModelShard,
    or ExpertShard for a MoePlan's experts), with its flat buffer as built and live storage."""
    layout = plan.src if side == "source" else plan.dst
    what = "shard" if kind is ModelShard else "expert shard"
    holds = rank in layout.ranks
    if shard is not None and not isinstance(shard, kind):
        raise TypeError(
            f"{side} {what} must be a {kind.__name__} or None, got {type(shard).__name__}"
        )
    if shard is None:
        if holds:
            raise ValueError(
                f"rank {rank} is in the {side} layout {layout} but passed no {side} {what}"
            )
        return
    if not holds:
        raise ValueError(
            f"rank {rank} is not in the {side} layout {layout} but passed a {side} {what}"
        )
    want = plan.model if side == "source" else plan.dst_model
    if shard.model != want and shard.model.name == want.name:
        try:  # same name, different model: say which parameter differs
            want.check_compatible(shard.model)
        except ValueError as e:
            raise ValueError(
                f"{side} {what}'s model {shard.model.name} is not the plan's {side} "
                f"model of the same name: {e}"
            ) from None
        raise ValueError(
            f"{side} {what}'s model {shard.model.name} differs from the plan's {side} "
            f"model of the same name (num_layers {shard.model.num_layers} vs "
            f"{want.num_layers}, parameter order, or storage format such as qkv_layout)"
        )
    if shard.model != want:
        raise ValueError(
            f"{side} {what} was built for model {shard.model.name}, the plan is "
            f"for {want.name} on the {side} side"
        )
    if shard.layout != layout:
        raise ValueError(
            f"{side} {what} was built for layout {shard.layout}, the plan's "
            f"{side} layout is {layout}"
        )
    if shard.rank != rank:
        raise ValueError(f"{side} {what} belongs to rank {shard.rank}, this is rank {rank}")
    # The compiled copies address bytes at element offsets of the plan's dtype: a buffer
    # assigned to `flat` after construction in another dtype or size would be read as the wrong
    # values, or fail deep in the copy without naming the shard.
    flat, dtype, numel = shard.flat, torch_dtype(want.dtype), shard.flat_numel
    if not (
        isinstance(flat, torch.Tensor)
        and flat.dim() == 1
        and flat.dtype == dtype
        and flat.numel() == numel
        and flat.is_contiguous()
    ):
        got = (
            f"{tuple(flat.shape)} {flat.dtype}{'' if flat.is_contiguous() else ' non-contiguous'}"
            if isinstance(flat, torch.Tensor)
            else type(flat).__name__
        )
        raise ValueError(
            f"{side} {what} of rank {rank} ({want.name}, {layout}): its flat buffer is "
            f"{got}; the plan needs a 1-D contiguous {dtype} buffer of {numel} elements "
            f"({numel * want.element_size} bytes): was `flat` replaced after the shard was "
            f"built? Build a new {kind.__name__} around the buffer instead"
        )
    # The kernels read raw pointers: a buffer whose storage was released (free_source=True, an
    # offloaded shard) or shrunk under its view would be read or written out of bounds.
    need = (flat.storage_offset() + flat.numel()) * flat.element_size()
    if flat.untyped_storage().nbytes() < need:
        raise ValueError(
            f"{side} {what} of rank {rank} ({shard.model.name}, {layout}) has "
            f"{flat.untyped_storage().nbytes()} bytes of storage behind a {need}-byte "
            "buffer: it was freed (free_source=True) or offloaded (HostOffload); "
            "reload it before reallocating"
        )


__all__ = [
    "Executor",
    "check_shard",
    "plan_ranks",
    "run_in_process",
    "run_ranks",
    "schedule_bytes",
    "shards_of",
]
