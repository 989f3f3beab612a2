"""Executing an MoE reallocation on one rank: `MoeReallocator(plan, transport).run(...)`.

    r = MoeReallocator(plan_moe_realloc(model, src, dst), transport, bucket_bytes=256 << 20)
    stats = r.run(src_shard, src_experts, dst_shard, dst_experts)   # None where the rank holds none

The one executor (executor.py) with a MoePlan's argument shapes: every part of the plan
(moe_plan.py) that the rank takes part in is a lane of the same schedule, with rounds of
MoePlan.part_round_elems and relabelled by MoePlan.round_shift; merged round r posts round r of
every such part in one transport.start. Each rank derives its lanes alone (rank_schedule per
part, C++), and MoePlan.transfers() is the same schedule for the cluster simulator.

Memory bound: part p's rounds hold round_elems * w_p // M_p elements (MoePlan.part_round_elems:
w_p its parameter count, M_p the largest sum of w over the parts any of its ranks sends, or
receives, in), so a merged round never carries more than one round's budget per rank and
direction, and the staging buffer stays within bucket_bytes (two halves with pipelining), as
for one plan. The number of merged rounds is that of the longest part.

Buffers: no copies. The dense part runs on the rank's ModelShard buffers themselves (the dense
spec lays out the same flat buffer: shard layouts skip expert tensors). An expert part's spec
orders a rank's expert tensors by (expert range, layer) or stacks them, its ExpertShard orders
them by layer, so its rank schedule is re-addressed once, at construction (expert_readdress.py):
each descriptor's own-side offsets move tensor by tensor into the ExpertShard buffer, cut where
they cross tensors that moved apart; a direct piece that is no longer one run there is staged on
that end (the peer may still move it directly). Expert parts keep their direct pieces in their
rounds (each end decides alone how it moves its side of a piece; only the dense part's go out at
the start).

One pass (one_pass=None: on for addressable transports without verify, as for the Reallocator):
every chunk a rank receives, in every part, with its descriptors moved into the sender's and this
rank's ExpertShard buffers where the part is an expert part (the sender's segments computed here
from the layouts alone), and every local copy, make ONE compiled copy (direct.py) over the
senders' dense and expert source buffers: one launch per rank and move, no staging.

Every world rank constructs the MoeReallocator (setup is collective, once per part) and calls
run() for every MoePlan in the same order.
"""

from __future__ import annotations

from .executor import Executor, run_in_process
from .expert_readdress import readdress
from .moe_plan import MoePlan
from .options import MoveOptions
from .shard import ExpertShard, ModelShard
from .transports.base import Transport


class MoeReallocator(Executor):
    def __init__(
        self, plan: MoePlan, transport: Transport, *, options: MoveOptions | None = None, **knobs
    ):
        """knobs: MoveOptions fields, as Reallocator's; the bucket bounds the staging of all parts
        together."""
        if not isinstance(plan, MoePlan):
            raise TypeError(f"plan must be a MoePlan (plan_moe_realloc), got {type(plan).__name__}")
        super().__init__(plan, transport, options=options, **knobs)

    def run(
        self,
        src: ModelShard | None,
        src_experts: ExpertShard | None,
        dst: ModelShard | None,
        dst_experts: ExpertShard | None,
        *,
        free_source: bool = False,
    ) -> dict:
        """Move this rank's share of every part; stats as Reallocator.run's, over all parts.
        free_source=True releases the storage of both source buffers once every round of this
        rank completed (never on failure)."""
        return self.move((src, src_experts), (dst, dst_experts), free_source=free_source)


run_moe_in_process = run_in_process
"""run_in_process takes a MoePlan: srcs / dsts map rank -> (ModelShard, ExpertShard)."""

__all__ = ["MoeReallocator", "readdress", "run_moe_in_process"]
