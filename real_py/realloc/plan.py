"""Python front of the C++ transfer planner: `plan_realloc(model, src, dst) -> ReallocPlan`.

The plan is data (int64 arrays); executing it is a loop over it (see reallocator.py).
Descriptors are [num_descs, 6] int64 in elements: (src_off, dst_off, len, n, src_stride,
dst_stride), n runs of len elements. A message's descriptors read the sender's source flat
buffer and write every receiver's destination flat buffer; its packed form is the runs
concatenated in descriptor order.

One file past 400 lines: ReallocPlan (the descriptor arrays and their per-rank views) and
plan_realloc's cached calls into the C++ planner (_plan_cached, the layout arrays) are the two sides
of the descriptor format above and change with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..layout import Layout, check_fits, dp_shard_layout, require_layout, require_spec, shard_layout
from ..spec import ModelSpec

MODES = ("p2p", "broadcast")
_KIND = {"replicated": 0, "split": 1, "vocab": 2}


@dataclass(frozen=True, slots=True)
class Message:
    """One message as seen by one rank: peers are the receivers (send) or the sender (recv)."""

    peers: tuple[int, ...]
    numel: int
    descs: np.ndarray
    """[k, 6] int64 in flat-buffer coordinates (sender's source -> receiver's destination)."""

    def pack_descs(self) -> np.ndarray:
        """[k, 6]: source flat buffer -> packed buffer (runs concatenated)."""
        return _to_packed(self.descs, side="pack")

    def unpack_descs(self) -> np.ndarray:
        """[k, 6]: packed buffer -> destination flat buffer."""
        return _to_packed(self.descs, side="unpack")


def _to_packed(descs: np.ndarray, side: str) -> np.ndarray:
    out = descs.copy()
    sizes = descs[:, 2] * descs[:, 3]
    packed = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(descs) else np.zeros(0, np.int64)
    if side == "pack":
        out[:, 1], out[:, 5] = packed, descs[:, 2]
    else:
        out[:, 0], out[:, 4] = packed, descs[:, 2]
    return out


@dataclass(frozen=True, slots=True)
class RankPlan:
    rank: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    local: np.ndarray
    """[k, 6] descriptors copying this rank's source shard into its destination shard."""

    @property
    def local_numel(self) -> int:
        return int((self.local[:, 2] * self.local[:, 3]).sum())


_GLOBAL = ("descs", "msg_desc_ptr", "local_rank", "local_desc_ptr", "local_numel")
_TABLE = ("msg_sender", "msg_recv_ptr", "msg_receivers", "msg_numel")


class ReallocPlan:
    """An exact transfer plan. Identical on every rank that computes it with the same inputs.

    The global arrays (every message's descriptors, every rank's local copies) are built on
    first use. A rank that only needs its own part calls `rank_arrays` (via
    rank_schedule.rank_schedule / the Reallocator): the C++ planner then keeps other ranks'
    messages as sizes only, and the message table (senders, receivers, sizes; no descriptors)
    comes from that call. `built` says whether the global arrays exist."""

    def __init__(
        self,
        model: ModelSpec,
        src: Layout,
        dst: Layout,
        mode: str,
        arrays: dict | None,
        dst_model: ModelSpec | None = None,
        inputs: tuple | None = None,
    ):
        self.model, self.src, self.dst, self.mode = model, src, dst, mode
        self.dst_model: ModelSpec = dst_model or model
        """The destination side's spec: `model` up to storage format (qkv_layout, ...)."""
        if arrays is None and inputs is None:
            raise ValueError("ReallocPlan needs its arrays or the planner inputs to build them")
        self._inputs = inputs
        self._arrays: dict | None = None
        self._table: dict | None = None
        self._rank_cache: dict[tuple, dict] = {}
        if arrays is not None:
            self._set_arrays(arrays)
        self._rank_plans: dict[int, RankPlan] = {}

    def _set_arrays(self, arrays: dict) -> None:
        for a in arrays.values():
            a.setflags(write=False)
        self._arrays = arrays
        self._table = {k: arrays[k] for k in _TABLE}

    @property
    def built(self) -> bool:
        """Whether the global arrays (every rank's descriptors) have been built."""
        return self._arrays is not None

    def _global_arrays(self) -> dict:
        arrays = self._arrays
        if arrays is None:
            from ..ops import extension

            assert self._inputs is not None, "__init__ needs arrays or inputs"
            arrays = extension().plan(*self._inputs)
            self._set_arrays(arrays)
        return arrays

    def _global(self, name: str) -> np.ndarray:
        return self._global_arrays()[name]

    def _msg_table(self, name: str) -> np.ndarray:
        return self._table[name] if self._table is not None else self._global(name)

    descs = property(lambda self: self._global("descs"))
    msg_desc_ptr = property(lambda self: self._global("msg_desc_ptr"))
    local_rank = property(lambda self: self._global("local_rank"))
    local_desc_ptr = property(lambda self: self._global("local_desc_ptr"))
    local_numel = property(lambda self: self._global("local_numel"))
    msg_sender = property(lambda self: self._msg_table("msg_sender"))
    msg_recv_ptr = property(lambda self: self._msg_table("msg_recv_ptr"))
    msg_receivers = property(lambda self: self._msg_table("msg_receivers"))
    msg_numel = property(lambda self: self._msg_table("msg_numel"))

    def global_bytes(self) -> int:
        """Bytes of the global arrays (builds them): what every rank held before per-rank plans."""
        return sum(a.nbytes for a in self._global_arrays().values())

    def rank_arrays(self, rank: int, round_elems: int, direct_min_elems: int) -> dict:
        """One rank's chunks, rounds, pack/unpack and local descriptors (C++, cached) and the
        global message table, without building any other rank's descriptors. rank -1: no
        rank's descriptors, every chunk's (msg, round, numel) instead (all_* arrays)."""
        key = (rank, round_elems, direct_min_elems)
        hit = self._rank_cache.get(key)
        if hit is None:
            from ..ops import extension

            if self._inputs is None:
                raise ValueError(
                    "this ReallocPlan was built from arrays; per-rank schedules need "
                    "a plan from plan_realloc"
                )
            hit = extension().plan_rank(*self._inputs, rank, round_elems, direct_min_elems)
            for a in hit.values():
                if isinstance(a, np.ndarray):
                    a.setflags(write=False)
            if self._table is None:
                self._table = {k: hit[k] for k in _TABLE}
            self._rank_cache[key] = hit
        return hit

    @property
    def num_messages(self) -> int:
        return len(self.msg_sender)

    @property
    def element_size(self) -> int:
        return self.model.element_size

    def receivers(self, m: int) -> tuple[int, ...]:
        return tuple(
            int(r) for r in self.msg_receivers[self.msg_recv_ptr[m] : self.msg_recv_ptr[m + 1]]
        )

    def message_descs(self, m: int) -> np.ndarray:
        return self.descs[self.msg_desc_ptr[m] : self.msg_desc_ptr[m + 1]]

    def ranks(self) -> list[int]:
        """Every global rank that takes part (either layout)."""
        return sorted(set(self.src.ranks) | set(self.dst.ranks))

    def for_rank(self, rank: int) -> RankPlan:
        """This rank's sends, receives and local copies, in the plan's global message order."""
        if rank not in self._rank_plans:
            sends, recvs = [], []
            for m in range(self.num_messages):
                receivers = self.receivers(m)
                sender = int(self.msg_sender[m])
                if sender == rank:
                    sends.append(Message(receivers, int(self.msg_numel[m]), self.message_descs(m)))
                if rank in receivers:
                    recvs.append(Message((sender,), int(self.msg_numel[m]), self.message_descs(m)))
            hit = np.nonzero(self.local_rank == rank)[0]
            local = (
                self.descs[self.local_desc_ptr[hit[0]] : self.local_desc_ptr[hit[0] + 1]]
                if len(hit)
                else np.zeros((0, 6), np.int64)
            )
            self._rank_plans[rank] = RankPlan(rank, tuple(sends), tuple(recvs), local)
        return self._rank_plans[rank]

    def per_rank_bytes(self) -> dict[int, dict[str, int]]:
        """rank -> {send, recv, local} bytes (a broadcast counts once for its sender)."""
        es = self.element_size
        out = {r: {"send": 0, "recv": 0, "local": 0} for r in self.ranks()}
        for m in range(self.num_messages):
            n = int(self.msg_numel[m]) * es
            out[int(self.msg_sender[m])]["send"] += n
            for r in self.receivers(m):
                out[r]["recv"] += n
        for r, n in zip(self.local_rank.tolist(), self.local_numel.tolist()):
            out[r]["local"] += n * es
        return out

    def summary(self) -> dict:
        """Bytes, messages, per-rank ingress/egress and the theoretical minimum network bytes."""
        es = self.element_size
        per_rank = self.per_rank_bytes()
        recv_counts = np.diff(self.msg_recv_ptr)
        network = int((self.msg_numel * recv_counts).sum()) * es
        local = int(self.local_numel.sum()) * es
        dst_data = sum(_shard_data_numel(self.dst_model, self.dst, r) for r in self.dst.ranks) * es
        return {
            "model": self.model.name,
            "src": str(self.src),
            "dst": str(self.dst),
            "mode": self.mode,
            "dtype": self.model.dtype,
            "total_bytes": network + local,
            "network_bytes": network,
            "local_bytes": local,
            "min_network_bytes": dst_data - local,
            "num_messages": self.num_messages,
            "num_descs": int(len(self.descs)),
            "max_ingress_bytes": max((v["recv"] for v in per_rank.values()), default=0),
            "max_egress_bytes": max((v["send"] for v in per_rank.values()), default=0),
            "per_rank": per_rank,
        }

    def describe(self, max_ranks: int = 16) -> str:
        """Readable summary: totals, then per-rank send/receive bytes."""
        s = self.summary()
        gib = 1 << 30
        lines = [
            f"plan {s['model']}: {s['src']} -> {s['dst']} ({s['mode']}, {s['dtype']})",
            f"  total {s['total_bytes'] / gib:.3f} GiB = network {s['network_bytes'] / gib:.3f} GiB"
            f" + local {s['local_bytes'] / gib:.3f} GiB",
            f"  theoretical minimum network {s['min_network_bytes'] / gib:.3f} GiB"
            f" ({'met' if s['min_network_bytes'] == s['network_bytes'] else 'NOT met'})",
            f"  {s['num_messages']} messages, {s['num_descs']} descriptors",
            f"  largest ingress {s['max_ingress_bytes'] / gib:.3f} GiB, largest egress "
            f"{s['max_egress_bytes'] / gib:.3f} GiB (transfer-time lower bound = max / link GB/s)",
            "  rank      send GiB   recv GiB  local GiB",
        ]
        for i, (r, v) in enumerate(sorted(s["per_rank"].items())):
            if i == max_ranks:
                lines.append(f"  ... {len(s['per_rank']) - max_ranks} more ranks")
                break
            lines.append(
                f"  {r:4d}  {v['send'] / gib:10.3f} {v['recv'] / gib:10.3f} "
                f"{v['local'] / gib:10.3f}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ReallocPlan({self.model.name}, {self.src} -> {self.dst}, {self.mode}, "
            f"{self.num_messages} msgs)"
        )


def _shard_data_numel(model: ModelSpec, layout: Layout, rank: int) -> int:
    """Data elements of a rank's shard (vocab and alignment padding excluded)."""
    coords = layout.coords(rank)
    assert coords is not None, f"rank {rank} is not in {layout}; callers pass its own ranks"
    d, k, stage = coords
    total = 0
    entries = shard_layout(model, layout, stage).entries
    # Local flat range held of each entry: all of it, or this dp replica's piece (same order).
    held_ranges = (
        [(0, e.numel) for e in entries]
        if layout.dp_shard == "none"
        else [(x.lo, x.hi) for x in dp_shard_layout(model, layout, stage, d).pieces]
    )
    for e, (lo, hi) in zip(entries, held_ranges):
        p = e.param
        if p.tp.kind == "vocab":
            # Vocab splits dim 0, so the data are the first `held` local rows.
            rows, ext = p.shape[p.tp.dim], e.local_shape[p.tp.dim]
            held = min(rows, (k + 1) * ext) - min(rows, k * ext)
            total += max(0, min(hi, held * (p.numel // rows)) - lo)
        else:
            total += hi - lo
    return total


def plan_realloc(
    model: ModelSpec,
    src: Layout,
    dst: Layout,
    *,
    mode: str = "p2p",
    dst_model: ModelSpec | None = None,
    ranks_per_node: int = 0,
    min_split_bytes: int = 1 << 20,
) -> ReallocPlan:
    """The exact plan moving `model` from layout `src` to layout `dst` (cached on its inputs).

    mode: "p2p" (one sender per receiver and piece) or "broadcast" (one sender per piece and set
    of receivers with identical needs). dst_model: the destination side's spec, checked for
    agreement with `model`; it may differ in storage format (ModelConfig.qkv_layout,
    gate_up_layout, vocab_pad_multiple, kv_head_replicas), which the plan converts exactly, on
    dp-sharded sides too (FSDP2 / ZeRO-3 straight into vLLM's format). ranks_per_node: prefer
    same-node senders and balance across nodes.
    """
    require_spec(model)
    require_layout(src, "src")
    require_layout(dst, "dst")
    if dst_model is not None:
        require_spec(dst_model, "dst_model")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {MODES}")
    if model.num_experts:
        raise ValueError(
            f"{model.name} has {model.num_experts} experts per MoE layer: plan it with "
            "real_py.realloc.moe_plan.plan_moe_realloc (dense and expert parts)"
        )
    if ranks_per_node < 0:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 0")
    if dst_model is not None and dst_model != model:
        model.check_compatible(dst_model, storage=True)
    else:
        dst_model = model
    return _plan_cached(model, dst_model, src, dst, mode, ranks_per_node, min_split_bytes)


@functools.lru_cache(maxsize=64)
def _plan_cached(model, dst_model, src, dst, mode, ranks_per_node, min_split_bytes) -> ReallocPlan:
    for side, spec, layout in (("src", model, src), ("dst", dst_model, dst)):
        try:
            check_fits(spec, layout)
        except ValueError as e:
            raise ValueError(f"{side} layout {layout}: {e}") from None
    geom = np.array([p.geometry() + (_KIND[p.tp.kind],) for p in model.params], np.int64).reshape(
        -1, 4
    )
    blocks = [p.blocks if p.tp.kind == "split" else () for p in model.params]
    block_ptr = np.concatenate(([0], np.cumsum([len(b) for b in blocks]))).astype(np.int64)
    # [num_blocks, 2]: (size, unit count; 0 when the rule names no units), the counts for
    # replicate_units formats (units are logical: equal on both sides, check_compatible).
    flat_blocks = np.array(
        [
            (b, p.tp.units[i][1] if p.tp.units else 0)
            for p, bs in zip(model.params, blocks)
            for i, b in enumerate(bs)
        ],
        np.int64,
    ).reshape(-1, 2)
    inputs = (
        geom,
        block_ptr,
        flat_blocks,
        _layout_arrays(model, src),
        _layout_arrays(dst_model, dst, order=model),
        MODES.index(mode),
        ranks_per_node,
        max(1, min_split_bytes // model.element_size),
    )
    # Nothing is planned yet: the global arrays on first use, or one rank's part (rank_arrays).
    return ReallocPlan(model, src, dst, mode, None, dst_model, inputs=inputs)


def _layout_arrays(model: ModelSpec, layout: Layout, order: ModelSpec | None = None) -> dict:
    """One side for the C++ planner; parameters are indexed in `order`'s order (default model's).
    Cached: the plan search prices thousands of layout pairs that share their layouts (one side
    of a 128-rank 70B layout ~1 ms here); the arrays are read-only, as the planner reads them.
    Not dp-sharded layouts, whose (lo, hi, offset) per entry and replica reach megabytes (~17 MB
    for a 700-parameter model at dp=1024): cached, they could hold gigabytes."""
    if order == model:
        order = None  # one cache entry whichever side the layout is on
    if layout.dp_shard != "none":
        return _build_layout_arrays(model, layout, order)
    return _cached_layout_arrays(model, layout, order)


@functools.lru_cache(maxsize=512)
def _cached_layout_arrays(model: ModelSpec, layout: Layout, order: ModelSpec | None) -> dict:
    return _build_layout_arrays(model, layout, order)


def _build_layout_arrays(model: ModelSpec, layout: Layout, order: ModelSpec | None) -> dict:
    index = {p.name: i for i, p in enumerate((order or model).params)}
    by_index = sorted(model.params, key=lambda p: index[p.name])
    ep, es, eo = [], [], []
    for s in range(layout.pp):
        for e in shard_layout(model, layout, s).entries:
            ep.append(index[e.param.name])
            es.append(s)
            eo.append(e.offset)
    out = {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        "grid": np.array(layout.grid(), np.int64).reshape(-1),
        "entry_param": np.array(ep, np.int64),
        "entry_stage": np.array(es, np.int64),
        "entry_offset": np.array(eo, np.int64),
        "param_groups": np.array([p.tp.groups for p in by_index], np.int64),
        "param_vocab_multiple": np.array([p.tp.vocab_multiple for p in by_index], np.int64),
        "param_replicate_units": np.array([int(p.tp.replicate_units) for p in by_index], np.int64),
    }
    if layout.dp_shard != "none":
        # [num_entries, dp, 3]: (lo, hi, offset) of each dp replica's piece of each entry.
        ranges = []
        for s in range(layout.pp):
            by_dp = [dp_shard_layout(model, layout, s, d).pieces for d in range(layout.dp)]
            for pieces in zip(*by_dp):  # one entry of the stage, every dp replica
                ranges += [(x.lo, x.hi, x.offset) for x in pieces]
        out["entry_range"] = np.array(ranges, np.int64).reshape(-1)
    for v in out.values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    return out


__all__ = ["plan_realloc", "ReallocPlan", "RankPlan", "Message", "MODES"]
