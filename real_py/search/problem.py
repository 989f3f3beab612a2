"""A search problem: per PPO call, its candidate options with precomputed costs and memory.

`Problem` turns (models, hardware, cluster size, workload) into the tables the C++ search
indexes: per call a [num_options, 9] float64 array (start, size, dp, tp, pp, seconds,
persistent bytes, transient bytes, weight-copy bytes), the graph (deps, bytes per edge, which
layout holds each trainable model's weights) and a reallocation-cost callback (exact planner,
cached). Every memory-feasible strategy of each (call, mesh) is a candidate unless `per_mesh`
prunes them to that many fastest; layouts given in `extra` are always kept (memory permitting or
not: the plan-level check decides), meshes smaller than `min_mesh_size` are skipped, and `fixed`
replaces the candidates by exactly one layout per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..dataflow.execplan import ExecutionPlan
from ..dataflow.rules import call_rule_errors, vllm_layout_errors
from ..layout import Layout
from .costmodel import Mesh, Workload, call_memory, call_time
from .graph import PPO_GRAPH, PPOModels, cluster_meshes, dep_bytes, strategies
from .hardware import HardwareProfile
from .realloc_cost import ReallocCost

GiB = float(1 << 30)
LayoutKey = tuple  # (Mesh, dp, tp, pp)


@dataclass(frozen=True, slots=True)
class Option:
    mesh: Mesh
    dp: int
    tp: int
    pp: int
    time: float
    """Seconds."""
    persist: float
    transient: float
    weights: float
    """Bytes per device."""
    breakdown: dict = field(compare=False, hash=False, default_factory=dict)
    busy: float = field(default=1.0, compare=False, hash=False)
    """Ranks whose core sharing `time` includes (costmodel "busy")."""
    working: float = field(default=1.0, compare=False, hash=False)
    """Ranks computing at once, which slow calls beside this one on shared cores."""

    @property
    def key(self) -> LayoutKey:
        return (self.mesh, self.dp, self.tp, self.pp)

    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, ranks=self.mesh.ranks)

    def __str__(self) -> str:
        start, end = self.mesh.start, self.mesh.start + self.mesh.size
        return f"dp{self.dp}tp{self.tp}pp{self.pp}@[{start},{end})"


class Problem:
    def __init__(
        self,
        models: PPOModels,
        hw: HardwareProfile,
        num_gpus: int,
        wl: Workload,
        *,
        iters: int = 3,
        per_mesh: int | None = None,
        min_mesh_size: int = 1,
        extra: dict | None = None,
        fixed: dict | None = None,
        realloc: ReallocCost | None = None,
        graph: tuple | None = None,
        grouped: bool = False,
        staleness: int = 0,
        vllm_call: str | None = None,
    ):
        if per_mesh is not None and per_mesh < 1:
            raise ValueError(f"per_mesh must be None (no pruning) or >= 1, got {per_mesh}")
        if staleness < 0:
            raise ValueError(f"max_staleness={staleness} must be >= 0 (0: synchronous)")
        self.models, self.hw, self.num_gpus, self.wl, self.iters = models, hw, num_gpus, wl, iters
        self.staleness = staleness
        """Asynchronous RL bound k (async.max_staleness) the simulators place the steps with."""
        self.calls = PPO_GRAPH if graph is None else graph
        self.grouped = grouped
        """The algorithm samples ppo.group_size rows per prompt (its actor update needs whole
        groups)."""
        self.vllm_call = vllm_call
        """The call that generates on vLLM (generation.engine: vllm), else None: its candidates are
        the layouts vLLM can run (dataflow.rules.vllm_layout_errors); its cost is the built-in
        engine's (no vLLM cost model)."""
        self.names = [c.name for c in self.calls]
        self.rpn = min(hw.ranks_per_node, num_gpus)
        self.realloc_cost = realloc or ReallocCost(hw)
        self._memo: dict = {}
        self.options: list[list[Option]] = []
        self.excluded: dict[int, dict[str, str]] = {}
        """{mesh size: {call: why no layout of that size is a candidate}}."""
        extra = extra or {}
        for call in self.calls:
            if fixed is not None:
                if call.name not in fixed:
                    raise ValueError(
                        f"plan has no layout for call {call.name}; calls: {self.names}"
                    )
                errs = self._rule_errors(call, fixed[call.name][1], fixed[call.name])
                if (
                    errs
                ):  # a plan the trainer refuses has no meaningful estimate (dataflow/rules.py)
                    raise ValueError("plan breaks a batch rule: " + "; ".join(errs))
                self.options.append([self._option(call, *fixed[call.name])])
                continue
            self.options.append(
                self._candidates(call, per_mesh, min_mesh_size, extra.get(call.name, ()))
            )
        self.index = [{o.key: i for i, o in enumerate(opts)} for opts in self.options]
        self._evaluator = None

    def _option(self, call, mesh: Mesh, dp: int, tp: int, pp: int) -> Option:
        model = self.models.of(call.model)
        in_node = mesh.size <= self.rpn and mesh.start % self.rpn + mesh.size <= self.rpn
        key = (call.kind, call.model, mesh.size, in_node, dp, tp, pp)
        hit = self._memo.get(key)
        if hit is None:
            t = call_time(call.kind, model, mesh, dp, tp, pp, self.hw, self.wl)
            m = call_memory(call.kind, model, dp, tp, pp, self.wl)
            persist = m["persist"] + (
                m["weights"] if call.kind != "train" and call.weight_src is None else 0.0
            )
            hit = self._memo[key] = (t, persist, m["transient"], m["weights"])
        t, persist, transient, weights = hit
        return Option(
            mesh, dp, tp, pp, t["total"], persist, transient, weights, t, t["busy"], t["working"]
        )

    def _rule_errors(self, call, dp: int, layout: tuple | None = None) -> list[str]:
        """Why the trainer would refuse `call` at data-parallel degree dp; with layout (mesh, dp,
        tp, pp), also why vLLM could not run it when it is the vLLM call."""
        wl = self.wl
        grpo_actor = self.grouped and call.kind == "train" and call.model == "actor"
        errs = call_rule_errors(
            call.name,
            call.kind == "train",
            grpo_actor,
            dp,
            wl.batch_size,
            wl.ppo_minibatches,
            wl.micro_batches,
            wl.group_size,
        )
        if layout is not None and call.name == self.vllm_call:
            mesh, dp, tp, pp = layout
            errs += [
                f"call {call.name} on vLLM: {e}"
                for e in vllm_layout_errors(
                    Layout(dp=dp, tp=tp, pp=pp, ranks=mesh.ranks),
                    self.num_gpus,
                    self.models.of(call.model).config,
                )
            ]
        return errs

    def _candidates(self, call, per_mesh, min_mesh_size, extra) -> list[Option]:
        model = self.models.of(call.model)
        limit = self.hw.mem_limit
        out, smallest, refused, least = [], None, {}, {}
        for mesh in cluster_meshes(self.num_gpus, self.rpn):
            if mesh.size < min_mesh_size:
                continue
            opts = []
            for dp, tp, pp in strategies(model, mesh.size, self.rpn, self.wl):
                errs = self._rule_errors(call, dp, (mesh, dp, tp, pp))
                if errs:  # the trainer would refuse it (dataflow/rules.py)
                    refused.setdefault(mesh.size, errs[0])
                    continue
                o = self._option(call, mesh, dp, tp, pp)
                need = o.persist + o.transient
                if smallest is None or need < smallest[0]:
                    smallest = (need, o)
                if mesh.size not in least or need < least[mesh.size][0]:
                    least[mesh.size] = (need, o)
                if need <= limit:
                    opts.append(o)
            if (
                not opts
            ):  # why this mesh size has no candidate for this call (for the no-plan error)
                self.excluded.setdefault(mesh.size, {}).setdefault(
                    call.name,
                    (
                        f"memory, needs {least[mesh.size][0] / GiB:.1f} GiB ({least[mesh.size][1]})"
                        if mesh.size in least
                        else refused.get(mesh.size, "no strategy")
                    ),
                )
            opts.sort(key=lambda o: o.time)
            out += opts if per_mesh is None else opts[:per_mesh]
        have = {o.key for o in out}
        for key in extra:
            if key not in have and not self._rule_errors(call, key[1], key):
                out.append(self._option(call, *key))
                have.add(key)
        if not out and smallest is None and refused:
            raise ValueError(
                f"no layout of call {call.name} meets the batch rules; per mesh size: "
                + "; ".join(f"{k} devices: {v}" for k, v in sorted(refused.items()))
            )
        if not out:
            need, o = smallest if smallest else (float("inf"), None)
            raise ValueError(
                f"no layout of call {call.name} ({model.name}, {call.kind}) fits {self.hw.name} "
                f"memory ({limit / GiB:.1f} GiB usable per device) on {self.num_gpus} devices: "
                f"the smallest per-device need is {need / GiB:.1f} GiB ({o}); use more devices "
                "or a larger-memory profile; per mesh size: "
                + "; ".join(
                    f"{k} devices: "
                    + (
                        f"memory, needs {least[k][0] / GiB:.1f} GiB ({least[k][1]})"
                        if k in least
                        else refused[k]
                    )
                    for k in sorted(set(least) | set(refused))
                )
            )
        return out

    # --- tables for C++ -------------------------------------------------------------------
    def graph_dict(self) -> dict:
        pos = {n: i for i, n in enumerate(self.names)}
        return {
            "num_gpus": self.num_gpus,
            "ranks_per_node": self.rpn,
            "options": [
                np.array(
                    [
                        [
                            o.mesh.start,
                            o.mesh.size,
                            o.dp,
                            o.tp,
                            o.pp,
                            o.time,
                            o.persist,
                            o.transient,
                            o.weights,
                        ]
                        for o in opts
                    ],
                    np.float64,
                )
                for opts in self.options
            ],
            "weight_src": [pos[c.weight_src] if c.weight_src else -1 for c in self.calls],
            "deps": [[pos[d] for d in c.deps] for c in self.calls],
            "dep_bytes": [[dep_bytes(d, c.name, self.wl) for d in c.deps] for c in self.calls],
            "intra_bw": self.hw.intra_bw,
            "inter_bw": self.hw.inter_bw,
            "intra_lat": self.hw.intra_lat,
            "inter_lat": self.hw.inter_lat,
            "mem_limit": self.hw.mem_limit,
            "iters": self.iters,
            "staleness": getattr(self, "staleness", 0),
            "trains": [c.kind == "train" for c in self.calls],
            "shared_cores": float(getattr(self.hw, "shared_cores", 0)),
            "busy": [
                np.array([[o.busy, o.working] for o in opts], np.float64).reshape(-1, 2)
                for opts in self.options
            ],
        }

    def realloc_time(self, call: int, src: int, dst: int) -> float:
        """Seconds to move call's model from option src of its weight_src call to option dst."""
        c = self.calls[call]
        w = self.names.index(c.weight_src)
        a, b = self.options[w][src], self.options[call][dst]
        return self.realloc_cost.time(self.models.of(c.model), a.key, b.key)

    def evaluator(self):
        if self._evaluator is None:
            from ..ops import extension

            self._evaluator = extension().SearchEvaluator(self.graph_dict(), self.realloc_time)
        return self._evaluator

    # --- plans ------------------------------------------------------------------------------
    def choice(self, layouts: dict) -> list[int]:
        """Option indices of {call: (mesh, dp, tp, pp)}; every layout must be a candidate."""
        out = []
        for i, name in enumerate(self.names):
            key = layouts[name]
            if key not in self.index[i]:
                raise ValueError(f"call {name}: layout {key} is not among the candidates")
            out.append(self.index[i][key])
        return out

    def layouts(self, choice) -> dict:
        return {name: self.options[i][o].key for i, (name, o) in enumerate(zip(self.names, choice))}

    def execution_plan(self, choice) -> ExecutionPlan:
        return ExecutionPlan(
            world_size=self.num_gpus,
            ranks_per_node=self.rpn,
            calls={
                n: self.options[i][o].layout() for i, (n, o) in enumerate(zip(self.names, choice))
            },
        )


def layouts_from_plan(plan: ExecutionPlan) -> dict:
    """{call: (mesh, dp, tp, pp)}; each call's ranks must be one contiguous block."""
    out = {}
    for name, l in plan.calls.items():
        r = l.ranks
        if list(r) != list(range(r[0], r[0] + len(r))):
            raise ValueError(
                f"call {name}: ranks {list(r)[:8]}... are not one contiguous block; the "
                "estimator models contiguous meshes only"
            )
        out[name] = (Mesh(r[0], len(r)), l.dp, l.tp, l.pp)
    return out
