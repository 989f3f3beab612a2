"""Executes a transfer plan: local copies, then per round pack -> transport -> unpack.

    Reallocator(plan, transport, bucket_bytes=256 << 20).run(src_shard, dst_shard)

A rank passes None for a side it does not hold (both None: nothing to do). Local pieces go
straight from the source buffer to the destination buffer; a chunk that is one contiguous run is
sent from / received into the shard buffers directly; everything else goes through one staging
buffer of at most `bucket_bytes`, allocated once and reused across calls. The source shard is
only read.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from . import ops
from .plan import ReallocPlan
from .schedule import Schedule
from .shard import ModelShard
from .transport import Transport

DEFAULT_BUCKET_BYTES = 256 << 20


def _schedule(plan: ReallocPlan, bucket_elems: int) -> Schedule:
    cache = plan.__dict__.setdefault("_schedules", {})
    if bucket_elems not in cache:
        cache[bucket_elems] = Schedule(plan, bucket_elems)
    return cache[bucket_elems]


class Reallocator:
    def __init__(self, plan: ReallocPlan, transport: Transport, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if bucket_bytes < 2 * plan.element_size:
            raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than two elements of "
                             f"{plan.model.dtype}")
        self.plan, self.transport, self.rank = plan, transport, transport.rank
        self.bucket_bytes = bucket_bytes
        self.schedule = _schedule(plan, bucket_bytes // plan.element_size)
        self.rounds = self.schedule.for_rank(self.rank)
        self._descs: dict[tuple[int, str], torch.Tensor] = {}
        self.staging: torch.Tensor | None = None
        """The one staging buffer this rank allocated (None until a round needs it)."""

    def _check(self, shard: ModelShard | None, side: str) -> None:
        layout = self.plan.src if side == "source" else self.plan.dst
        holds = self.rank in layout.ranks
        if shard is None:
            if holds:
                raise ValueError(f"rank {self.rank} is in the {side} layout {layout} but passed no "
                                 f"{side} shard")
            return
        if not holds:
            raise ValueError(f"rank {self.rank} is not in the {side} layout {layout} but passed a "
                             f"{side} shard")
        if shard.model != self.plan.model:
            raise ValueError(f"{side} shard was built for model {shard.model.name}, the plan is for "
                             f"{self.plan.model.name}")
        if shard.layout != layout:
            raise ValueError(f"{side} shard was built for layout {shard.layout}, the plan's "
                             f"{side} layout is {layout}")
        if shard.rank != self.rank:
            raise ValueError(f"{side} shard belongs to rank {shard.rank}, this is rank {self.rank}")

    def _tensor(self, arr: np.ndarray, key: tuple[int, str]) -> torch.Tensor:
        t = self._descs.get(key)
        if t is None:
            t = self._descs[key] = ops.descs_tensor(arr)
        return t

    def _staging(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        if self.staging is None or self.staging.numel() < numel or self.staging.device != like.device:
            need = max(r.staging_numel for r in self.rounds)
            self.staging = torch.empty(need, dtype=like.dtype, device=like.device)
        return self.staging

    def run(self, src: ModelShard | None, dst: ModelShard | None) -> dict:
        """Move this rank's part of the plan; returns stats (bytes, rounds, seconds)."""
        self._check(src, "source")
        self._check(dst, "destination")
        if src is not None and dst is not None and src.flat.device != dst.flat.device:
            raise ValueError(f"source shard on {src.flat.device}, destination on {dst.flat.device}: "
                             "move one so both sides share a device")
        t0 = time.perf_counter()
        mine = self.plan.for_rank(self.rank)
        if len(mine.local):
            ops.unpack(src.flat, self._tensor(mine.local, (-1, "local")), dst.flat)
        sent = received = 0
        es = self.plan.element_size
        for rr in self.rounds:
            like = (src or dst).flat
            staging = self._staging(rr.staging_numel, like) if rr.staging_numel else None
            if len(rr.pack_descs):
                ops.pack(src.flat, self._tensor(rr.pack_descs, (rr.index, "pack")), staging)
            sends = []
            for c, slot in zip(rr.sends, rr.send_slots):
                if slot < 0:
                    off = int(c.descs[0, 0])
                    sends.append((c.receivers, src.flat[off:off + c.numel]))
                else:
                    sends.append((c.receivers, staging[slot:slot + c.numel]))
                sent += c.numel * es
            recvs = []
            for c, slot in zip(rr.recvs, rr.recv_slots):
                if slot < 0:
                    off = int(c.descs[0, 1])
                    recvs.append((c.sender, dst.flat[off:off + c.numel]))
                else:
                    recvs.append((c.sender, staging[slot:slot + c.numel]))
                received += c.numel * es
            self.transport.exchange(sends, recvs, step=f"round {rr.index}/{len(self.schedule.rounds)}")
            if len(rr.unpack_descs):
                ops.unpack(staging, self._tensor(rr.unpack_descs, (rr.index, "unpack")), dst.flat)
        return {"rank": self.rank, "sent_bytes": sent, "received_bytes": received,
                "local_bytes": mine.local_numel * es, "rounds": len(self.rounds),
                "staging_bytes": 0 if self.staging is None else self.staging.numel() * es,
                "seconds": time.perf_counter() - t0}


def new_destination(plan: ReallocPlan, rank: int, device="cpu") -> ModelShard | None:
    """An empty destination shard for `rank` (None if the rank is not in the destination)."""
    if rank not in plan.dst.ranks:
        return None
    return ModelShard.empty(plan.model, plan.dst, rank, device=device)


__all__ = ["Reallocator", "new_destination", "DEFAULT_BUCKET_BYTES"]
