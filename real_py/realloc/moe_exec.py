"""Executing an MoE reallocation on one rank: `MoeReallocator(plan, transport).run(...)`.

    r = MoeReallocator(plan_moe_realloc(model, src, dst), transport, bucket_bytes=256 << 20)
    stats = r.run(src_shard, src_experts, dst_shard, dst_experts)   # None where the rank holds none

The parts of the plan (moe_plan.py) run as ONE schedule: every part the rank takes part in is a
lane of the round loop (rounds.py), with rounds of MoePlan.part_round_elems and relabelled by
MoePlan.round_shift; merged round r posts round r of every such part in one transport.start. Each
rank derives its lanes alone (rank_schedule per part, C++), and MoePlan.transfers() is the same
schedule for the cluster simulator.

Memory bound: part p's rounds hold round_elems * w_p // M_p elements (MoePlan.part_round_elems:
w_p its parameter count, M_p the largest sum of w over the parts any of its ranks sends, or
receives, in), so a merged round never carries more than one round's budget per rank and
direction, and the staging buffer stays within bucket_bytes (two halves with pipelining), as
for one plan. The number of merged rounds is that of the longest part.

Buffers: the dense part runs on the rank's ModelShard buffers themselves (the dense spec lays out
the same flat buffer: shard layouts skip expert tensors). Each expert part runs on a part-sized
buffer filled from the source ExpertShard's views by name before and emptied into the
destination ExpertShard's views after: one copy of the expert bytes on each side, because the
part's spec orders a rank's expert tensors by (expert range, layer), the expert shard by layer. Every world rank constructs the MoeReallocator
(setup is collective, once per part) and calls run() for every MoePlan in the same order.
"""

from __future__ import annotations

import time

from .moe_plan import MoePlan
from .rank_schedule import rank_schedule
from .reallocator import DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_MIN_BYTES, run_ranks, schedule_bytes
from .rounds import Lane, RoundOptions, RoundRunner
from .shard import ExpertShard, ModelShard
from .transports.base import Transport
from .transports.inprocess import InProcessHub


class MoeReallocator:
    def __init__(self, plan: MoePlan, transport: Transport, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 pipeline: bool | None = None, verify: bool = False,
                 direct_min_bytes: int | None = DEFAULT_DIRECT_MIN_BYTES):
        """Options as Reallocator's; the bucket bounds the staging of all parts together."""
        if not isinstance(plan, MoePlan):
            raise TypeError(f"plan must be a MoePlan (plan_moe_realloc), got {type(plan).__name__}")
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a real_py Transport (DistTransport, InProcessHub."
                            f"transport(rank), ...), got {type(transport).__name__}")
        self.plan, self.transport, self.rank = plan, transport, transport.rank
        self.opts = RoundOptions.resolve(transport, plan.model.element_size, plan.model.dtype,
                                         bucket_bytes=bucket_bytes, pipeline=pipeline, verify=verify,
                                         direct_min_bytes=direct_min_bytes)
        sizes = plan.part_round_elems(self.opts.round_elems)
        lanes = []
        self.lane_parts: list[int] = []
        """Index in plan.parts of each lane (the parts this rank sends or receives in)."""
        for p, part in enumerate(plan.parts):
            transport.setup(part.plan)  # collective: every rank, every part, in part order
            if self.rank not in part.plan.src.ranks and self.rank not in part.plan.dst.ranks:
                continue
            rs = rank_schedule(part.plan, self.rank, sizes[p], self.opts.direct_min_elems)
            lanes.append(Lane(rs, plan.round_shift(p, rs.num_rounds), part.label))
            self.lane_parts.append(p)
        self.runner = RoundRunner(transport, lanes, self.opts)

    @property
    def staging(self):
        return self.runner.staging

    def run(self, src: ModelShard | None, src_experts: ExpertShard | None,
            dst: ModelShard | None, dst_experts: ExpertShard | None, *,
            free_source: bool = False) -> dict:
        """Move this rank's share of every part; stats as Reallocator.run's, over all parts.
        free_source=True releases the storage of both source buffers once every round of this
        rank completed (never on failure)."""
        t0 = time.perf_counter()
        bufs: list[tuple] = []
        outs = []  # (part-sized destination shard, lane's part) to empty after the rounds

        def check():
            for side, shard, experts in (("source", src, src_experts),
                                         ("destination", dst, dst_experts)):
                if (shard is None) != (experts is None):
                    raise ValueError(f"rank {self.rank}: the {side} needs both its ModelShard and "
                                     f"its ExpertShard (or neither), got {shard!r} and {experts!r}")
                self._check_side(shard, experts, side)
            flats = [x.flat for x in (src, src_experts, dst, dst_experts) if x is not None]
            if len({f.device for f in flats}) > 1:
                raise ValueError(f"rank {self.rank}: buffers on {sorted({str(f.device) for f in flats})}: "
                                 "move them so all four share a device")
            for p in self.lane_parts:
                part = self.plan.parts[p]
                q = part.plan
                if part.experts is None:  # the dense spec addresses the ModelShards' own buffers
                    s = ModelShard(q.model, q.src, self.rank, src.flat) if src is not None else None
                    d = ModelShard(q.model, q.dst, self.rank, dst.flat) if dst is not None else None
                else:
                    s = d = None
                    if self.rank in q.src.ranks:
                        s = ModelShard.empty(q.model, q.src, self.rank, src_experts.flat.device)
                        for name, v in s.params().items():
                            v.copy_(src_experts.view(name))
                    if self.rank in q.dst.ranks:
                        d = ModelShard.empty(q.model, q.dst, self.rank, dst_experts.flat.device)
                        outs.append(d)
                bufs.append((s.flat if s is not None else None, d.flat if d is not None else None))

        stats = self.runner.run(bufs, check)
        for d in outs:
            for name, v in d.params().items():
                dst_experts.view(name).copy_(v)
        if free_source and src is not None:
            # Every send of this rank completed (waited in run), so nothing reads them any more.
            src.flat.untyped_storage().resize_(0)
            src_experts.flat.untyped_storage().resize_(0)
        return {"rank": self.rank, **schedule_bytes([lane.schedule for lane in self.runner.lanes],
                                                    self.plan.model.element_size),
                **stats, "parts": len(self.plan.parts), "lanes": len(self.runner.lanes),
                "seconds": time.perf_counter() - t0}

    def _check_side(self, shard: ModelShard | None, experts: ExpertShard | None, side: str) -> None:
        """Both buffers of one side belong to the plan's model, layout and this rank, with storage."""
        layout = self.plan.src if side == "source" else self.plan.dst
        for what, x, cls in (("ModelShard", shard, ModelShard), ("ExpertShard", experts, ExpertShard)):
            if x is None:
                continue
            if not isinstance(x, cls):
                raise TypeError(f"{side} {what} expected, got {type(x).__name__}")
            if x.model != self.plan.model or x.layout != layout or x.rank != self.rank:
                raise ValueError(f"{side} {what} is for {x.model.name} {x.layout} rank {x.rank}; the "
                                 f"plan's {side} is {self.plan.model.name} {layout} on this rank {self.rank}")
            flat = x.flat
            if flat.untyped_storage().nbytes() < (flat.storage_offset() + flat.numel()) * flat.element_size():
                raise ValueError(f"{side} {what} of rank {self.rank} ({layout}) has no storage behind "
                                 "its buffer: it was freed (free_source=True) or offloaded "
                                 "(HostOffload); reload it before reallocating")


def run_moe_in_process(hub: InProcessHub, plan: MoePlan, srcs: dict, dsts: dict,
                       **realloc_kwargs) -> dict[int, dict]:
    """Run `plan` on every rank of `hub` in its own thread; srcs / dsts map rank ->
    (ModelShard, ExpertShard). Returns rank -> stats; raises the lowest rank's error after
    every thread finished."""
    ranks = sorted({r for part in plan.parts for r in part.plan.src.ranks + part.plan.dst.ranks})
    return run_ranks(hub, ranks, lambda rank: MoeReallocator(plan, hub.transport(rank), **realloc_kwargs)
                     .run(*srcs.get(rank, (None, None)), *dsts.get(rank, (None, None))))


__all__ = ["MoeReallocator", "run_moe_in_process"]
