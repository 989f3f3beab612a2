"""Reallocation of mixture-of-experts models: `plan_moe_realloc(model, src, dst) -> MoePlan`.

An MoE layout (Layout.ep, Layout.etp) holds two kinds of shards per rank: the dense shard
(every non-expert parameter, today's (dp, tp, pp) rules) and the expert shard of its
(stage, ep rank): experts [g E/ep, (g + 1) E/ep), each tensor cut by etp (layout.
expert_shard_layout). The plan is a few ordinary C++ plans (parts):

  dense part      plan_realloc(dense spec, src without ep, dst without ep)
  expert part(s)  plan_realloc(expert_spec, expert_layout(src), expert_layout(dst))

Cut the experts into the ranges both sides' ep groups cut them into. expert_spec's "layers" are
(range j, layer l), range-major: so the experts an ep group holds in one pipeline stage are one
contiguous range of layers (one stage) whenever the group holds one range or the stage holds
every layer; expert_layout makes those (group, stage) cells the stages of an ordinary layout
dp=edp, tp=etp over the cells' ranks. When that holds on both sides (every pp=1 side, and every
side whose ep groups are the ranges themselves: ep8 -> etp8, ep32 x pp8 -> etp16), ONE expert part
moves all experts of all layers. Otherwise (a pipelined side whose ep groups hold several ranges),
with whole experts on both sides (etp = 1) one part still moves them all: stacked_expert_spec
stacks each layer's experts into [E 2I, H] and [E H, I] tensors split on dim 0 with tp = ep
(stacked_layout), so any two stage splits meet as in a dense plan; with etp > 1 there is one
expert part per window of layers cut by both sides' stage boundaries.

Each part is an exact C++ plan (2-D strided descriptors, byte-minimal); the parts move disjoint
parameters, and every expert tensor's source and destination ranks are those of its layout, so
the union is exact and its network bytes equal the minimum (tests check it against an oracle
count). One expert part also lets the C++ schedule place all expert chunks together.

Storage forms: per-expert HF tensors (experts.{j}.gate_proj / up_proj / down_proj) and the
stacked grouped-GEMM tensors ([E_local, 2I/etp, H] gate|up, [E_local, H, I/etp] down) are two
views of the same expert-shard bytes (spec order puts a layer's gate|up pieces, then its down
pieces, one expert after the other; `expert_views`), so choosing a form per side costs nothing.

Execution (executor.Executor; moe_exec.MoeReallocator): the parts run as one schedule, merged
round r = round r of each part (rotated by round_shift), each part with rounds of
part_round_elems, so a merged round holds at most one round's budget per rank and direction.
MoePlan.transfers() is that schedule for the cluster simulator; sequential_transfers() the parts one
after the other (the comparison).

One file past 400 lines: expert_spec / expert_layout, the stacked form, the layer windows and
MoePlan's merged rounds are the steps of the one argument above that the parts' union is exact, and
plan_moe_realloc chooses among them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..layout import (
    Layout,
    check_fits,
    expert_shard_layout,
    require_layout,
    require_spec,
    stage_layer_ranges,
)
from ..spec import ALIGN_BYTES, ModelSpec, ParamSpec, TPRule
from .plan import ReallocPlan, plan_realloc
from .simulate import Transfers, schedule_transfers


@dataclass(frozen=True, slots=True)
class MoePart:
    label: str
    """"dense" or "experts of layers [a, b)"."""
    plan: ReallocPlan
    experts: tuple[int, int] | None
    """[0, num_experts) for an expert part (its spec holds every expert of its layers), None
    for the dense part."""
    pieces: dict[str, tuple[str, ...]] | None = None
    """A stacked part's tensors: stacked name -> the model's expert tensors in it, in order."""


def dense_spec(model: ModelSpec) -> ModelSpec:
    """The model without its expert tensors (router, shared expert and attention included)."""
    return ModelSpec(
        name=f"{model.name}.dense",
        params=tuple(p for p in model.params if p.expert < 0),
        num_layers=model.num_layers,
        config=model.config,
    )


def _expert_ranges(model: ModelSpec, src: Layout, dst: Layout) -> list[tuple[int, int]]:
    """The expert ranges cut by both sides' ep groups, in expert order."""
    E = model.num_experts
    cuts = sorted(
        {k * E // src.ep for k in range(src.ep + 1)} | {k * E // dst.ep for k in range(dst.ep + 1)}
    )
    return list(zip(cuts, cuts[1:]))


def expert_spec(
    model: ModelSpec, ranges: list[tuple[int, int]], window: tuple[int, int]
) -> ModelSpec:
    """The expert tensors of layers [wl, wh) as an ordinary spec (etp is its tp) whose "layers"
    are (expert range j, layer l) in that order: layer j (wh - wl) + l - wl holds layer l's
    experts of ranges[j]. An ep group's experts of one pipeline stage are then a contiguous
    range of layers, i.e. a pipeline stage of `expert_layout`."""
    wl, wh = window
    params = tuple(
        replace(p, expert=-1, layer=j * (wh - wl) + p.layer - wl)
        for j, (lo, hi) in enumerate(ranges)
        for p in model.params
        if lo <= p.expert < hi and wl <= p.layer < wh
    )
    return ModelSpec(
        name=f"{model.name}.experts[layers {wl}:{wh}]",
        params=params,
        num_layers=len(ranges) * (wh - wl),
        config=model.config,
    )


def expert_layout(
    model: ModelSpec, layout: Layout, ranges: list[tuple[int, int]], window: tuple[int, int]
) -> Layout:
    """`layout`'s expert ranks as a layout of expert_spec(model, ranges, window): one stage per
    (ep group g, pipeline stage s meeting the window), in that order, over the ranks of (g, s)
    walked (expert-dp, etp): dp=edp, tp=etp. Needs each such stage to be one contiguous range of
    the spec's layers: g holds one of the ranges, or s covers the whole window."""
    wl, wh = window
    per = model.num_experts // layout.ep
    ranks, layers = [], []
    for g in range(layout.ep):
        js = [j for j, (lo, hi) in enumerate(ranges) if g * per <= lo and hi <= (g + 1) * per]
        for s, (lo, hi) in enumerate(
            stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)
        ):
            n = min(hi, wh) - max(lo, wl)
            if n <= 0:
                continue
            if len(js) > 1 and n != wh - wl:
                raise ValueError(
                    f"{layout}: ep group {g} stage {s} is not one range of layers of "
                    f"the expert spec of layers [{wl}, {wh})"
                )
            layers.append(len(js) * n)
            ranks += [
                layout.expert_rank(d, g, t, s) for d in range(layout.edp) for t in range(layout.etp)
            ]
    return Layout(
        dp=layout.edp,
        tp=layout.etp,
        pp=len(layers),
        ranks=tuple(ranks),
        layers_per_stage=tuple(layers),
    )


def stacked_expert_spec(model: ModelSpec) -> tuple[ModelSpec, dict[str, tuple[str, ...]]]:
    """Every MoE layer's experts as two stacked tensors, gate|up [E 2I, H] and down [E H, I],
    split on dim 0 like a tp rule: over tp = ep, a rank's piece is its ep group's experts whole.
    Valid where etp = 1 on both sides; (spec, stacked name -> expert tensor names)."""
    groups: dict[tuple[int, str], list] = {}
    for p in model.params:
        if p.expert >= 0:
            kind = "gate_up_proj" if p.name.endswith("gate_up_proj.weight") else "down_proj"
            groups.setdefault((p.layer, kind), []).append(p)
    params, pieces = [], {}
    for (layer, kind), ps in groups.items():
        ps.sort(key=lambda p: p.expert)
        name = f"layers.{layer}.mlp.experts.{kind}.stacked"
        shape = (len(ps) * ps[0].shape[0],) + tuple(ps[0].shape[1:])
        params.append(
            ParamSpec(
                name=name,
                shape=shape,
                dtype=ps[0].dtype,
                owner="layer",
                layer=layer,
                tp=TPRule(kind="split", dim=0),
            )
        )
        pieces[name] = tuple(p.name for p in ps)
    return ModelSpec(
        name=f"{model.name}.experts.stacked",
        params=tuple(params),
        num_layers=model.num_layers,
        config=model.config,
    ), pieces


def stacked_layout(model: ModelSpec, layout: Layout) -> Layout:
    """`layout`'s expert ranks (etp = 1) as a layout of stacked_expert_spec: tp = ep (rank of ep
    group g is tp rank g), dp = edp, the model's own stage split."""
    ranges = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)
    ranks = [
        layout.expert_rank(d, g, 0, s)
        for s in range(layout.pp)
        for d in range(layout.edp)
        for g in range(layout.ep)
    ]
    return Layout(
        dp=layout.edp,
        tp=layout.ep,
        pp=layout.pp,
        ranks=tuple(ranks),
        layers_per_stage=tuple(hi - lo for lo, hi in ranges),
    )


def _windows(model: ModelSpec, src: Layout, dst: Layout, ranges) -> list[tuple[int, int]]:
    """Layer windows of the expert parts: all layers at once when each side has one pipeline
    stage or one expert range per ep group; else the layer ranges cut by both sides' stages."""
    L = model.num_layers
    if all(x.pp == 1 or x.ep == len(ranges) for x in (src, dst)):
        return [(0, L)]
    cuts = {L}
    for x in (src, dst):
        cuts |= {lo for lo, _ in stage_layer_ranges(model, x.pp, x.layers_per_stage, x.partition)}
    bounds = sorted(cuts)
    return list(zip(bounds, bounds[1:]))


def _dense_layout(model: ModelSpec, layout: Layout) -> Layout:
    """The layout without expert axes, with the full model's pipeline split made explicit: the
    dense spec alone would balance its stages differently (it lacks the expert tensors), and the
    dense part must address the same shard buffers as the model's own ModelShards."""
    ranges = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)
    return replace(layout, ep=1, etp=1, layers_per_stage=tuple(hi - lo for lo, hi in ranges))


class MoePlan:
    """The parts of an MoE reallocation (dense part first), their byte totals and the merged
    schedule's rule (part_round_elems, round_shift, transfers)."""

    def __init__(
        self,
        model: ModelSpec,
        src: Layout,
        dst: Layout,
        parts: list[MoePart],
        dst_model: ModelSpec | None = None,
    ):
        self.model, self.src, self.dst, self.parts = model, src, dst, tuple(parts)
        self.dst_model: ModelSpec = dst_model or model
        """The destination side's spec: `model` up to the dense tensors' storage format."""

    def summary(self) -> dict:
        keys = ("total_bytes", "network_bytes", "local_bytes", "min_network_bytes", "num_messages")
        sums = {k: 0 for k in keys}
        ingress: dict[int, int] = {}
        egress: dict[int, int] = {}
        for part in self.parts:
            s = part.plan.summary()
            for k in keys:
                sums[k] += s[k]
            for r, v in s["per_rank"].items():
                ingress[r] = ingress.get(r, 0) + v["recv"]
                egress[r] = egress.get(r, 0) + v["send"]
        return {
            "model": self.model.name,
            "src": str(self.src),
            "dst": str(self.dst),
            "parts": len(self.parts),
            **sums,
            "max_ingress_bytes": max(ingress.values(), default=0),
            "max_egress_bytes": max(egress.values(), default=0),
        }

    def part_round_elems(self, round_elems: int) -> list[int]:
        """Round size (elements) of each part when the parts run as one schedule.

        With w_p = part p's parameter count, S_x (R_x) = the sum of w over the parts whose
        source (destination) layout holds rank x, and M_p = the largest S_x over p's source
        ranks and R_x over its destination ranks, part p gets round_elems * w_p // M_p. A rank
        sends only in parts whose source layout holds it, so in a merged round it sends at most
        the sum over those parts of round_elems * w_p / M_p / 2 <= round_elems * (sum of their
        w_p) / S_x / 2 = round_elems / 2 elements, and receives as much: one round's budget per
        direction, as for a single plan, so the staging bound (bucket_bytes) holds for the
        merged rounds. Budgets in proportion to size let big and small parts finish together.
        From the specs and layouts alone: the same on every rank, without any schedule."""
        w = [part.plan.model.numel for part in self.parts]
        sends: dict[int, int] = {}
        recvs: dict[int, int] = {}
        for part, wp in zip(self.parts, w):
            for r in part.plan.src.ranks:
                sends[r] = sends.get(r, 0) + wp
            for r in part.plan.dst.ranks:
                recvs[r] = recvs.get(r, 0) + wp
        out = []
        for part, wp in zip(self.parts, w):
            m = max(
                [sends[r] for r in part.plan.src.ranks] + [recvs[r] for r in part.plan.dst.ranks]
            )
            n = round_elems * wp // m
            if n < 2:
                raise ValueError(
                    f"{self!r}: rounds of {round_elems} elements leave part {part.label} "
                    f"({wp} of {m} parameters on its busiest rank) under 2 elements; "
                    "use a larger bucket_bytes"
                )
            out.append(n)
        return out

    def round_shift(self, p: int, num_rounds: int) -> int:
        """Part p's round i runs in merged round (i + shift) % num_rounds: the j-th of n expert
        parts starts j / n of the way into its rounds (the dense part unshifted), so expert
        parts that list their messages in the same receiver order do not all load the same
        receivers in the same round. A rotation of [0, num_rounds): one round of the part per
        merged round, as the budget of part_round_elems needs."""
        n = sum(part.experts is not None for part in self.parts)
        j = sum(part.experts is not None for part in self.parts[:p])
        return j * num_rounds // n if self.parts[p].experts is not None and num_rounds else 0

    def transfers(self, round_elems: int | None = None, direct_min_elems: int = 0) -> Transfers:
        """The merged schedule MoeReallocator runs, as chunks for the cluster simulator: part
        p's schedule with rounds of part_round_elems (sizes from C++, the rule rank_schedule
        derives per rank), its round i in merged round (i + round_shift) % its rounds.
        round_elems default: the executor's (256 MiB bucket, pipelined). direct_min_elems: the
        executor's direct_min_bytes in elements (its default is DEFAULT_DIRECT_MIN_BYTES; 0 here,
        as there: off)."""
        if round_elems is None:
            round_elems = (256 << 20) // self.model.element_size // 2
        ts = [
            schedule_transfers(part.plan, n, direct_min_elems)
            for part, n in zip(self.parts, self.part_round_elems(round_elems))
        ]
        rounds = np.concatenate(
            [
                (t.round + self.round_shift(p, t.num_rounds)) % max(t.num_rounds, 1)
                for p, t in enumerate(ts)
            ]
            + [np.zeros(0, np.int64)]
        )
        return _union(ts, rounds, "real_py MoE schedule (parts merged by round)")

    def sequential_transfers(
        self, round_elems: int | None = None, direct_min_elems: int = 0
    ) -> Transfers:
        """The parts one after the other, each with a whole round's budget (how MoeReallocator
        ran them before the merged schedule; kept as the comparison column of the bench)."""
        ts = [schedule_transfers(p.plan, round_elems, direct_min_elems) for p in self.parts]
        offs = np.cumsum([0] + [t.num_rounds for t in ts[:-1]])
        return _union(
            ts,
            np.concatenate([t.round + o for t, o in zip(ts, offs)] + [np.zeros(0, np.int64)]),
            "real_py MoE parts in sequence",
        )

    def __repr__(self) -> str:
        return f"MoePlan({self.model.name}, {self.src} -> {self.dst}, {len(self.parts)} parts)"


def _union(ts: list[Transfers], rounds: np.ndarray, label: str) -> Transfers:
    """The chunks of `ts` with the given rounds (concatenated in part order), sorted by round,
    stably: within a round, part order and then each part's own chunk order."""
    order = np.argsort(rounds, kind="stable")
    counts = np.concatenate([np.diff(t.recv_ptr) for t in ts] + [np.zeros(0, np.int64)])
    ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    receivers = np.concatenate([t.receivers for t in ts] + [np.zeros(0, np.int64)]).astype(np.int64)
    new_ptr = np.concatenate(([0], np.cumsum(counts[order]))).astype(np.int64)
    idx = np.repeat(ptr[:-1][order] - new_ptr[:-1], counts[order]) + np.arange(new_ptr[-1])
    return Transfers(
        rounds[order].astype(np.int64),
        np.concatenate([t.sender for t in ts] + [np.zeros(0, np.int64)])[order].astype(np.int64),
        new_ptr,
        receivers[idx.astype(np.int64)],
        np.concatenate([t.nbytes for t in ts] + [np.zeros(0, np.int64)])[order].astype(np.int64),
        label=label,
    )


def plan_moe_realloc(
    model: ModelSpec,
    src: Layout,
    dst: Layout,
    *,
    mode: str = "p2p",
    ranks_per_node: int = 0,
    dst_model: ModelSpec | None = None,
) -> MoePlan:
    """Exact, byte-minimal plan moving an MoE `model` from `src` to `dst` (module docstring).
    dst_model: the destination's spec, `model` up to the storage format of its dense tensors
    (vocab padding, fused q|k|v order, replicated kv heads: vLLM's live format); the experts'
    storage is the same on both sides."""
    require_spec(model)
    require_layout(src, "src")
    require_layout(dst, "dst")
    if not model.num_experts:
        raise ValueError(f"{model.name} has no experts; use plan_realloc")
    if dst_model is None or dst_model == model:
        dst_model = model
    else:
        require_spec(dst_model, "dst_model")
        model.check_compatible(dst_model, storage=True)
        if [p for p in model.params if p.expert >= 0] != [
            p for p in dst_model.params if p.expert >= 0
        ]:
            raise ValueError(
                f"{model.name} -> {dst_model.name}: the expert tensors differ in storage; "
                "only dense tensors may change format in an MoE plan"
            )
    for side, spec, layout in (("src", model, src), ("dst", dst_model, dst)):
        if layout.dp_shard != "none":
            raise ValueError(f"{side} layout {layout}: dp-sharded MoE layouts are not supported")
        try:
            check_fits(spec, layout)
        except ValueError as e:
            raise ValueError(f"{side} layout {layout}: {e}") from None
    parts = [
        MoePart(
            "dense",
            plan_realloc(
                dense_spec(model),
                _dense_layout(model, src),
                _dense_layout(dst_model, dst),
                dst_model=dense_spec(dst_model),
                mode=mode,
                ranks_per_node=ranks_per_node,
            ),
            None,
        )
    ]
    ranges = _expert_ranges(model, src, dst)
    windows = _windows(model, src, dst, ranges)
    if len(windows) > 1 and src.etp == dst.etp == 1:
        # Stages cross expert ranges on some side; whole experts (etp 1 on both sides) let one
        # plan move them all anyway, with ep as the tp of stacked tensors.
        spec, pieces = stacked_expert_spec(model)
        plan = plan_realloc(
            spec,
            stacked_layout(model, src),
            stacked_layout(model, dst),
            mode=mode,
            ranks_per_node=ranks_per_node,
        )
        parts.append(MoePart("experts stacked", plan, (0, model.num_experts), pieces))
        windows = []
    for wl, wh in windows:
        spec = expert_spec(model, ranges, (wl, wh))
        if not spec.params:  # layers without experts (mlp_only_layers)
            continue
        plan = plan_realloc(
            spec,
            expert_layout(model, src, ranges, (wl, wh)),
            expert_layout(model, dst, ranges, (wl, wh)),
            mode=mode,
            ranks_per_node=ranks_per_node,
        )
        parts.append(MoePart(f"experts of layers [{wl}, {wh})", plan, (0, model.num_experts)))
    return MoePlan(model, src, dst, parts, dst_model=dst_model)


def expert_views(
    model: ModelSpec, layout: Layout, rank: int, flat, form: str = "per_expert"
) -> dict:
    """Named views of `rank`'s expert shard `flat` (layout.expert_shard_layout) in a storage form.

    per_expert: HF names layers.i.mlp.experts.j.{gate_proj, up_proj, down_proj}.weight (etp pieces).
    mixtral: Mixtral's layers.i.block_sparse_moe.experts.j.{w1 (gate), w3 (up), w2 (down)}.weight.
    stacked: layers.i.mlp.experts.{gate_up_proj [E_local, 2I/etp, H], down_proj [E_local, H, I/etp]}
    (ValueError when alignment padding separates experts: a piece not a multiple of ALIGN_BYTES).
    """
    if form not in ("per_expert", "mixtral", "stacked"):
        raise ValueError(f"form={form!r}; allowed: 'per_expert', 'mixtral', 'stacked'")
    coords = layout.expert_coords(rank)
    if coords is None:
        raise ValueError(f"rank {rank} is not in the layout {layout}")
    _, ep_rank, _, stage = coords
    sl = expert_shard_layout(model, layout, stage, ep_rank)
    out = {}
    if form != "stacked":
        gate, up, down = (
            ("w1", "w3", "w2") if form == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        )
        for e in sl.entries:
            v = flat[e.offset : e.offset + e.numel].view(e.local_shape)
            base = e.param.name.removesuffix(".weight")
            if form == "mixtral":
                base = base.replace(".mlp.experts.", ".block_sparse_moe.experts.", 1)
            if base.endswith("gate_up_proj"):
                half = e.local_shape[0] // 2
                stem = base.removesuffix("gate_up_proj")
                out[f"{stem}{gate}.weight"], out[f"{stem}{up}.weight"] = v[:half], v[half:]
            else:
                out[f"{base.removesuffix('down_proj')}{down}.weight"] = v
        return out
    groups: dict[str, list] = {}
    for e in sl.entries:
        pre, _, rest = e.param.name.partition(".mlp.experts.")
        groups.setdefault(f"{pre}.mlp.experts.{rest.split('.', 1)[1]}", []).append(e)
    for name, es in groups.items():
        first = es[0]
        if len(es) > 1 and (first.numel * model.element_size) % ALIGN_BYTES:
            raise ValueError(
                f"{name}: one expert's piece {first.local_shape} is "
                f"{first.numel * model.element_size} bytes, not a multiple of "
                f"{ALIGN_BYTES}: padding separates the experts, no stacked view"
            )
        out[name] = flat[first.offset : first.offset + first.numel * len(es)].view(
            (len(es),) + first.local_shape
        )
    return out


__all__ = [
    "plan_moe_realloc",
    "MoePlan",
    "MoePart",
    "dense_spec",
    "expert_spec",
    "expert_layout",
    "expert_views",
]
