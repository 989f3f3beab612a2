"""Executes a dense transfer plan on one rank: `Reallocator(plan, transport).run(src, dst)`.

    Reallocator(plan, transport, bucket_bytes=256 << 20).run(src_shard, dst_shard)

The one executor (executor.py) with a ReallocPlan's argument shapes: the plan is its one lane.
Options are MoveOptions' fields as keywords (options.py: what each does and how they interact;
most callers set bucket_bytes at most). A rank passes None for a side it does not hold (both
None: nothing to do, but every rank of the transport's group must still construct the
Reallocator, since `transport.setup(plan)` may be collective).

On an addressable transport (in-process threads, CUDA IPC) a move is one pass: every message
straight from the sender's source shard into the receiver's destination shard, all of a rank's
messages and local copies in ONE compiled copy (direct.py). Elsewhere it runs the round loop
(rounds.py): local pieces go straight from the source buffer to the destination buffer, a chunk
that is one contiguous run is sent from / received into the shard buffers directly, everything
else goes through one staging buffer of at most `bucket_bytes`, allocated once and reused; peak
extra memory = staging + the destination shard.

`InProcessMove` (inprocess_move.py) keeps a whole in-process world's executors and worker
threads across calls; `run_in_process` builds them per call.
"""

from __future__ import annotations

from .executor import Executor, check_shard, run_in_process, run_ranks, schedule_bytes
from .options import DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_MIN_BYTES, MoveOptions, resolve_one_pass
from .plan import ReallocPlan
from .rank_schedule import RankSchedule
from .rounds import checksum
from .shard import ModelShard
from .transports.base import Transport


class Reallocator(Executor):
    plan: ReallocPlan
    """The dense plan __init__ accepts (Executor's plan, narrowed: no MoePlan here)."""

    def __init__(
        self,
        plan: ReallocPlan,
        transport: Transport,
        *,
        options: MoveOptions | None = None,
        **knobs,
    ):
        """knobs: MoveOptions fields (bucket_bytes, pipeline, inflight, merge, direct_min_bytes,
        verify, one_pass), on top of `options` where both are given."""
        if not isinstance(plan, ReallocPlan):
            raise TypeError(
                f"plan must be a ReallocPlan from real_py.plan_realloc(model, src, dst), "
                f"got {type(plan).__name__}"
            )
        super().__init__(plan, transport, options=options, **knobs)
        self.schedule: RankSchedule = self.schedules[0]
        """This rank's rounds only (C++; tests/support/schedule_oracle.py derives every rank's at
        once)."""
        self.rounds = self.schedule.rounds

    @property
    def bucket_bytes(self) -> int:
        return self.options.bucket_bytes

    @property
    def verify(self) -> bool:
        return self.opts.verify

    @property
    def pipeline(self) -> bool:
        return self.opts.pipeline

    @property
    def round_elems(self) -> int:
        return self.opts.round_elems

    def run(
        self, src: ModelShard | None, dst: ModelShard | None, *, free_source: bool = False
    ) -> dict:
        """Move this rank's part of the plan; returns stats (Executor.move)."""
        return self.move((src, None), (dst, None), free_source=free_source)


def new_destination(plan: ReallocPlan, rank: int, device="cpu") -> ModelShard | None:
    """An empty destination shard for `rank` (None if the rank is not in the destination)."""
    if rank not in plan.dst.ranks:
        return None
    return ModelShard.empty(plan.dst_model, plan.dst, rank, device=device)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_MIN_BYTES",
    "MoveOptions",
    "Reallocator",
    "check_shard",
    "checksum",
    "new_destination",
    "resolve_one_pass",
    "run_in_process",
    "run_ranks",
    "schedule_bytes",
]
