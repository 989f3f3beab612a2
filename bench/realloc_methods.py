"""The redistribution methods bench_realloc.py compares, each over real_py's shard buffers.

Every method reads a source ModelShard and writes a destination ModelShard of the same rank;
`setup` work (plans, process groups, meshes, scratch buffers) happens in the constructor and is
not timed; `run()` is the timed transfer. `recv_bytes` is what this rank receives over the
network per run under the method's own scheme (over-sending shows up there).

  NaiveAllGather  every source TP piece is broadcast to every rank, each rank assembles the
                  full tensor and slices its part (the verl / OpenRLHF approach)
  DTensorMethod   torch.distributed.tensor redistribute per tensor (per fused block), where
                  source and destination fit one device mesh
  RealPy          real_py's Reallocator over a torch.distributed transport
  GlooFloor       not a method: the plan's messages alone over gloo (the floor for all;
                  real_py.benchmark.PlanMessages, as `python -m real_py bench` times it)
  GlooFloorLocal  not a method: the floor plus the plan's rank-local elements as one contiguous copy
  (Megatron-core lives in realloc_mcore.py.)
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from real_py.benchmark import PlanMessages
from real_py.layout import param_stages
from real_py.realloc.shard import tp_slice


def _holds(model, layout, rank, p) -> bool:
    c = layout.coords(rank)
    return c is not None and c[2] in param_stages(model, layout, p)


def assemble_full(p, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Full tensor from the TP pieces of every TP rank (inverse of tp_slice)."""
    if p.tp.kind == "replicated":
        return pieces[0]
    d = p.tp.dim
    if p.tp.kind == "vocab":
        return torch.cat(pieces, d).narrow(d, 0, p.shape[d])
    if len(pieces) == 1:
        return pieces[0]
    tp = len(pieces)
    split = [list(t.split([b // tp for b in p.blocks], d)) for t in pieces]
    return torch.cat([split[k][j] for j in range(len(p.blocks)) for k in range(tp)], d)


class NaiveAllGather:
    name = "naive all-gather + slice"

    def __init__(self, model, src, dst, src_shard, dst_shard):
        self.model, self.src, self.dst = model, src, dst
        self.src_shard, self.dst_shard = src_shard, dst_shard
        self.rank = dist.get_rank()
        # One scratch buffer for the largest parameter's pieces, reused: the baseline pays for
        # communication and slicing, not for page faults.
        biggest = max(math.prod(p.local_shape(src.tp)) for p in model.params)
        self.scratch = torch.empty(
            biggest * src.tp,
            dtype=src_shard.flat.dtype if src_shard is not None else dst_shard.flat.dtype,
        )
        self.steps = []
        self.recv_bytes = 0
        es = model.element_size
        for i, p in enumerate(model.params):
            stage = param_stages(model, src, p)[0]
            replica = i % src.dp  # alternate source replicas so no single rank sends everything
            senders = [src.rank(replica, k, stage) for k in range(src.tp)]
            self.steps.append((p, senders, _holds(model, dst, self.rank, p)))
            n = math.prod(p.local_shape(src.tp))
            self.recv_bytes += sum(n * es for s in senders if s != self.rank)

    def run(self) -> None:
        for p, senders, wanted in self.steps:
            shape = p.local_shape(self.src.tp)
            n = math.prod(shape)
            pieces = []
            for k, sender in enumerate(senders):
                if sender == self.rank:
                    buf = self.src_shard.view(p.name)
                else:
                    buf = self.scratch[k * n : (k + 1) * n].view(shape)
                dist.broadcast(buf, src=sender)
                pieces.append(buf)
            if wanted:
                full = assemble_full(p, pieces)
                self.dst_shard.view(p.name).copy_(
                    tp_slice(p, full, self.dst.tp, self.dst_shard.tp_rank)
                )


def dtensor_why_not(src, dst) -> str | None:
    """Why DTensor redistribute cannot express src -> dst here, or None."""
    if src.ranks != dst.ranks:
        return "source and destination use different ranks (cross-mesh moves are not supported)"
    if src.pp != 1 or dst.pp != 1:
        return (
            f"pipeline stages ({src} -> {dst}): a stage's parameters live on a sub-mesh and move "
            "to another mesh; DTensor: 'Cross device mesh comm not supported yet'"
        )
    big, small = max(src.tp, dst.tp), min(src.tp, dst.tp)
    if small not in (1, big):
        return f"tp {src.tp} -> {dst.tp} needs two different 2-D meshes"
    if src.order != dst.order:
        return "different rank orders need two meshes"
    return None


class DTensorMethod:
    name = "DTensor redistribute"

    def __init__(self, model, src, dst, src_shard, dst_shard):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        why = dtensor_why_not(src, dst)
        if why:
            raise ValueError(why)
        self.DTensor, self.Replicate = DTensor, Replicate
        world = src.world
        T = max(src.tp, dst.tp)
        # Layout rank = tp + T * dp (order tp-dp-pp), so the (dp, tp) mesh is arange reshaped.
        grid = torch.tensor([src.ranks[i] for i in range(world)]).reshape(world // T, T)
        self.mesh = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp"))
        self.moves = []  # (src piece, dst piece, src placements, dst placements)
        self.recv_bytes = 0
        es = model.element_size
        for p in model.params:
            d = p.tp.dim
            blocks = p.blocks if p.tp.kind != "replicated" else (0,)
            off_s = off_d = 0
            for b in blocks:
                pieces, places = [], []
                for lay, shard in ((src, src_shard), (dst, dst_shard)):
                    sharded = p.tp.kind != "replicated" and lay.tp > 1
                    places.append([Replicate(), Shard(d) if sharded else Replicate()])
                    view = shard.view(p.name)
                    pieces.append(
                        view.narrow(d, (off_s if lay is src else off_d), b // lay.tp)
                        if p.tp.kind != "replicated"
                        else view
                    )
                if p.tp.kind != "replicated":
                    off_s, off_d = off_s + b // src.tp, off_d + b // dst.tp
                    if src.tp > dst.tp:
                        self.recv_bytes += pieces[0].numel() * (src.tp - 1) * es
                self.moves.append((pieces[0], pieces[1], places[0], places[1]))

    def run(self) -> None:
        for s_piece, d_piece, s_place, d_place in self.moves:
            t = self.DTensor.from_local(s_piece, self.mesh, s_place, run_check=False)
            d_piece.copy_(t.redistribute(self.mesh, d_place).to_local())


class RealPy:
    name = "real_py"

    def __init__(self, model, src, dst, src_shard, dst_shard, transport, **realloc_kw):
        """realloc_kw: Reallocator options (direct_min_bytes=0: the all-staged reference row)."""
        from real_py.realloc.plan import plan_realloc
        from real_py.realloc.reallocator import Reallocator

        self.plan = plan_realloc(model, src, dst)
        self.realloc = Reallocator(self.plan, transport, **realloc_kw)
        self.src_shard, self.dst_shard = src_shard, dst_shard
        self.recv_bytes = self.plan.per_rank_bytes().get(dist.get_rank(), {"recv": 0})["recv"]
        self.last_stats: dict = {}

    def run(self) -> None:
        self.last_stats = self.realloc.run(self.src_shard, self.dst_shard)

    def profile(self) -> dict:
        """One run's phases on this rank, as the Reallocator reports them: seconds in local
        copies, pack, posting the transfers, waiting for them, unpack, the rest (Python), and
        per round [index, pack, post, wait, unpack]."""
        t0 = time.perf_counter()
        self.run()
        total = time.perf_counter() - t0
        acc = dict(self.last_stats["phases"])
        acc["python_other"] = total - sum(acc.values())
        acc["total"] = total
        acc["rounds"] = len(self.realloc.rounds)
        acc["per_round"] = self.last_stats["per_round"]
        return acc


class GlooFloor(PlanMessages):
    """Not a method: the plan's messages alone over gloo (real_py.benchmark.PlanMessages), the
    floor for any exact method."""

    name = "gloo floor"

    def __init__(self, plan, dtype):
        super().__init__(plan, dist.get_rank(), dtype)


class GlooFloorLocal(GlooFloor):
    """Not a method either: the gloo floor's batch plus, while it is in flight, this rank's
    elements that stay on it (the plan's local copies) as ONE contiguous copy between
    preallocated buffers. Every exact method that keeps its source intact moves these elements
    from the source buffer to the destination buffer somehow; one contiguous copy is the cheapest
    way. So this is the floor of an exact reallocation on this machine, where gloo's transfers
    and memory copies share the same cores."""

    name = "gloo floor + local copies"

    def __init__(self, plan, dtype):
        super().__init__(plan, dtype)
        n = plan.for_rank(dist.get_rank()).local_numel
        self.local = (torch.ones(n, dtype=dtype), torch.empty(n, dtype=dtype)) if n else None

    def run(self) -> None:
        works = self.start()
        if self.local is not None:
            self.local[1].copy_(self.local[0])
        for w in works:
            w.wait()


__all__ = [
    "NaiveAllGather",
    "DTensorMethod",
    "RealPy",
    "GlooFloor",
    "GlooFloorLocal",
    "dtensor_why_not",
    "assemble_full",
]
