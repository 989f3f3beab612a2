"""Executing an MoE reallocation on one rank: `MoeReallocator(plan, transport).run(...)`.

    r = MoeReallocator(plan_moe_realloc(model, src, dst), transport)
    stats = r.run(src_shard, src_experts, dst_shard, dst_experts)   # None where the rank holds none

The dense part runs on the rank's ModelShard buffers themselves (the dense spec lays out the same
flat buffer: shard layouts skip expert tensors). Each expert part (one pair of source and
destination ep groups, experts [a, b)) runs on a part-sized shard that is filled from the
source ExpertShard's views by name before and emptied into the destination ExpertShard's views
after: one copy of the expert bytes on each side, because an expert part's tensors are not one
contiguous range of the rank's expert buffer (moe_plan.py, "not done yet"). Every world rank
calls run() for every MoePlan in the same order, as for a ReallocPlan.
"""

from __future__ import annotations

import time

from .moe_plan import MoePlan
from .reallocator import Reallocator
from .shard import ExpertShard, ModelShard


class MoeReallocator:
    def __init__(self, plan: MoePlan, transport, **kw):
        if not isinstance(plan, MoePlan):
            raise TypeError(f"plan must be a MoePlan (plan_moe_realloc), got {type(plan).__name__}")
        self.plan, self.rank = plan, transport.rank
        self.parts = [(part, Reallocator(part.plan, transport, **kw)) for part in plan.parts]

    def run(self, src: ModelShard | None, src_experts: ExpertShard | None,
            dst: ModelShard | None, dst_experts: ExpertShard | None) -> dict:
        """Move this rank's share of every part; stats as Reallocator.run's, summed over parts."""
        for side, shard, experts in (("source", src, src_experts), ("destination", dst, dst_experts)):
            if (shard is None) != (experts is None):
                raise ValueError(f"rank {self.rank}: the {side} needs both its ModelShard and its "
                                 f"ExpertShard (or neither), got {shard!r} and {experts!r}")
        t0 = time.perf_counter()
        total = {"rank": self.rank, "sent_bytes": 0, "received_bytes": 0, "local_bytes": 0, "rounds": 0,
                 "staging_bytes": 0, "phases": {}, "per_round": [], "parts": len(self.parts)}
        for part, r in self.parts:
            p = part.plan
            if part.experts is None:
                s = ModelShard(p.model, p.src, self.rank, src.flat) if src is not None else None
                d = ModelShard(p.model, p.dst, self.rank, dst.flat) if dst is not None else None
            else:
                s = d = None
                if self.rank in p.src.ranks:
                    s = ModelShard.empty(p.model, p.src, self.rank, src_experts.flat.device)
                    for name, v in s.params().items():
                        v.copy_(src_experts.view(name))
                if self.rank in p.dst.ranks:
                    d = ModelShard.empty(p.model, p.dst, self.rank, dst_experts.flat.device)
            st = r.run(s, d)
            if part.experts is not None and d is not None:
                for name, v in d.params().items():
                    dst_experts.view(name).copy_(v)
            for k in ("sent_bytes", "received_bytes", "local_bytes", "rounds", "staging_bytes"):
                total[k] += st[k]
            for k, v in st["phases"].items():
                total["phases"][k] = total["phases"].get(k, 0.0) + v
            total["per_round"] += st["per_round"]
        total["seconds"] = time.perf_counter() - t0
        return total


__all__ = ["MoeReallocator"]
