"""Reallocation time from the exact transfer planner's schedule, replayed by the cluster simulator.

The planner (real_py.plan_realloc, p2p mode, ranks_per_node given so it prefers same-node
senders) gives the messages; their bucket schedule (the Reallocator's rounds) is replayed by
real_py.realloc.simulate on the profile's topology (NVLink intra_bw per GPU, one NIC of
inter_bw per GPU, the p2p latency per round), so the search charges the figure the simulator
reports; plus the slowest rank's local copy (read + write at memory bandwidth) and the
profile's fixed `realloc_lat`. Costs are cached per (model, src layout, dst
layout) after moving both meshes to a canonical position: whole-node shifts, and closing the
gap between two meshes on different nodes, change no rank's byte counts or link classes.
"""

from __future__ import annotations

import numpy as np

from ..layout import Layout
from ..realloc.plan import plan_realloc
from ..realloc.reallocator import DEFAULT_BUCKET_BYTES
from ..realloc.simulate import Cluster, schedule_transfers, simulate
from ..spec import ModelSpec
from .costmodel import Mesh
from .hardware import HardwareProfile


def canonical_meshes(a: Mesh, b: Mesh, rpn: int) -> tuple[Mesh, Mesh]:
    """Equivalent placement of two meshes: lowest node first, no empty nodes between them."""
    shift = min(a.start, b.start) // rpn * rpn
    a, b = Mesh(a.start - shift, a.size), Mesh(b.start - shift, b.size)
    first, second = (a, b) if a.start <= b.start else (b, a)
    first_last_node = (first.start + first.size - 1) // rpn
    if second.start // rpn > first_last_node + 1:
        moved = Mesh((first_last_node + 1) * rpn + second.start % rpn, second.size)
        a, b = (first, moved) if first is a else (moved, first)
    return a, b


class ReallocCost:
    """Seconds to move a model between two layouts on a given hardware profile (cached)."""

    def __init__(self, hw: HardwareProfile):
        self.hw = hw
        self.rpn = hw.ranks_per_node
        self._cache: dict[tuple, float] = {}
        self.planner_calls = 0

    def time(
        self, model: ModelSpec, src: tuple[Mesh, int, int, int], dst: tuple[Mesh, int, int, int]
    ) -> float:
        """src/dst: (mesh, dp, tp, pp). Zero when the layouts are identical."""
        if src == dst:
            return 0.0
        sm, dm = canonical_meshes(src[0], dst[0], self.rpn)
        key = (model, sm, src[1:], dm, dst[1:])
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._compute(model, sm, src[1:], dm, dst[1:])
        return hit

    def _compute(self, model, sm, s, dm, d) -> float:
        self.planner_calls += 1
        src = Layout(dp=s[0], tp=s[1], pp=s[2], ranks=sm.ranks)
        dst = Layout(dp=d[0], tp=d[1], pp=d[2], ranks=dm.ranks)
        plan = plan_realloc(model, src, dst, mode="p2p", ranks_per_node=self.rpn)
        return transfer_time(plan, self.hw)


def transfer_time(plan, hw: HardwareProfile) -> float:
    """A plan's time on `hw`: its schedule (the Reallocator's default bucket) replayed by the
    cluster simulator (real_py.realloc.simulate; one NIC of inter_bw per GPU, NVLink intra_bw,
    the p2p latency per round), plus the slowest rank's local copy (read + write at memory
    bandwidth) and the profile's fixed `realloc_lat`, scaled by core contention."""
    rpn, es = hw.ranks_per_node, plan.element_size
    world = max(plan.ranks()) + 1
    if not world:
        return 0.0
    senders = np.repeat(plan.msg_sender, np.diff(plan.msg_recv_ptr))
    inter = (senders // rpn != plan.msg_receivers // rpn).any()
    lat = (hw.inter_lat if inter else hw.intra_lat) * hw.p2p_lat_ratio
    cluster = Cluster(
        hw.name, -(-world // rpn), rpn, hw.intra_bw / 1e9, rpn, hw.inter_bw / 1e9, lat
    )
    net = simulate(schedule_transfers(plan, DEFAULT_BUCKET_BYTES // es // 2), cluster).seconds
    local = np.zeros(world)
    np.add.at(local, plan.local_rank, plan.local_numel.astype(np.float64) * es)
    return (net + float(2 * local.max()) / hw.mem_bw + hw.realloc_lat) * hw.contention(
        len(plan.ranks())
    )
