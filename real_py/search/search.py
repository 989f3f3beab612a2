"""Plan search entry points: `plan_search` (annealing in C++), the two baselines, `estimate`.

Baselines, evaluated with the same estimator:
- symmetric: every call on all devices with one (dp, tp, pp) valid for all four models
  (what Megatron-based systems such as DeepSpeed-Chat/OpenRLHF colocated do); the fastest
  feasible one. No reallocation is ever needed.
- heuristic (ReaL-style hand tuning): training keeps the symmetric best layout; then, one call
  at a time in graph order, generation and each inference call move to the fastest layout
  on all devices with pp = 1 (any dp x tp; pipelining hurts decoding), the actor and critic
  weights being reallocated there. It is what an engineer tuning each call's (dp, tp) by hand
  on a colocated cluster does, and is never slower than the symmetric plan.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from ..dataflow.execplan import BatchSettings, ExecutionPlan
from ..dataflow.graph import GROUPED
from .costmodel import Mesh, Workload
from .graph import PPO_GRAPH, PPOModels, ppo_models, sampling_call, search_graph, strategies
from .hardware import HardwareProfile, get_profile
from .problem import GiB, Problem, layouts_from_plan
from .simulate import SimResult, simulate


@dataclass(slots=True)
class Baseline:
    name: str
    layouts: dict | None
    iter_time: float
    peak_mem: float


@dataclass(slots=True)
class SearchResult:
    plan: ExecutionPlan
    iter_time: float
    """Estimated seconds per PPO iteration."""
    choice: list
    problem: Problem
    baselines: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    staleness: int = 0
    """async.max_staleness to run the plan with (0: synchronous); see plan_search."""

    def simulate(self) -> SimResult:
        return simulate(self.problem, self.choice, staleness=self.staleness)


def _full(models: PPOModels, hw, n, wl, graph=PPO_GRAPH):
    """(dp, tp, pp) on all n devices valid for every model of the graph, and the ones per model."""
    rpn = min(hw.ranks_per_node, n)
    per_model = {r: strategies(models.of(r), n, rpn, wl) for r in sorted({c.model for c in graph})}
    common = sorted(set.intersection(*(set(v) for v in per_model.values())))
    return common, per_model


def baseline_layouts(models, hw, n, wl, graph=PPO_GRAPH) -> dict:
    """Every layout a baseline may use, per call (added to the search's candidates)."""
    common, per_model = _full(models, hw, n, wl, graph)
    full = Mesh(0, n)
    out = {}
    for c in graph:
        keys = {(full,) + s for s in common}
        if c.kind != "train":
            keys |= {(full,) + s for s in per_model[c.model] if s[2] == 1}
        out[c.name] = sorted(keys, key=lambda k: k[1:])
    return out


def symmetric_baseline(prob: Problem) -> Baseline:
    common, _ = _full(prob.models, prob.hw, prob.num_gpus, prob.wl, prob.calls)
    ev, full = prob.evaluator(), Mesh(0, prob.num_gpus)
    best = Baseline("symmetric", None, math.inf, math.inf)
    least_mem = math.inf
    for s in common:
        layouts = {name: (full,) + s for name in prob.names}
        if any(layouts[n] not in prob.index[i] for i, n in enumerate(prob.names)):
            continue  # breaks a batch rule for some call (dataflow/rules.py)
        r = ev.simulate(prob.choice(layouts))
        least_mem = min(least_mem, r["peak_mem"])
        if r["iter_time"] < best.iter_time:
            best = Baseline("symmetric", layouts, r["iter_time"], r["peak_mem"])
    best.peak_mem = best.peak_mem if best.layouts else least_mem
    return best


def heuristic_baseline(prob: Problem, sym: Baseline) -> Baseline:
    if sym.layouts is None:
        return Baseline("heuristic", None, math.inf, sym.peak_mem)
    ev, full = prob.evaluator(), Mesh(0, prob.num_gpus)
    layouts = dict(sym.layouts)
    r = ev.simulate(prob.choice(layouts))
    # Greedy, one call at a time in graph order: the fastest full-cluster pp=1 layout.
    for c in prob.calls:
        if c.kind == "train":
            continue
        for key in prob.index[prob.names.index(c.name)]:
            if key[0] != full or key[3] != 1:
                continue
            trial = dict(layouts, **{c.name: key})
            rt = ev.simulate(prob.choice(trial))
            if rt["iter_time"] < r["iter_time"]:
                layouts, r = trial, rt
    return Baseline("heuristic", layouts, r["iter_time"], r["peak_mem"])


def _excluded_text(prob: Problem) -> str:
    """Per mesh size, the first call (graph order) that has no layout of that size, and why."""
    parts = []
    for size in sorted(prob.excluded):
        why = prob.excluded[size]
        name = next(n for n in prob.names if n in why)
        parts.append(f"{size} devices: call {name}: {why[name]}")
    return "per mesh size: " + (
        "; ".join(parts)
        if parts
        else "every size has a layout for every call; their combination exceeds memory"
    )


def plan_search(
    actor,
    critic=None,
    *,
    num_gpus: int,
    hardware: str | HardwareProfile = "h100",
    workload: Workload | None = None,
    time_budget: float = 30.0,
    chains: int = 4,
    seed: int = 0,
    max_steps: int = 0,
    t_start: float = 0.1,
    t_end: float = 0.001,
    restart_steps: int = 100_000,
    per_mesh: int | None = None,
    iters: int = 3,
    dtype: str = "bfloat16",
    models: PPOModels | None = None,
    algo: str = "ppo",
    max_staleness: int = 0,
    engine: str = "builtin",
    vllm_logp: str = "recompute",
) -> SearchResult:
    """Search an execution plan for `algo`'s dataflow graph (PPO by default; the critic-free
    algorithms have no critic calls). time_budget: seconds for everything (tables included).
    per_mesh: keep only that many fastest strategies per (call, mesh) (default: every
    memory-feasible one, so the optimum found is that of the whole plan space).

    hardware: a HardwareProfile, or the name of a fixed one (hardware.PROFILES); a measured
    profile (`cpu`) comes from real_py.calibrate.resolve_profile: the search never calibrates.

    engine: the runtime's generation.engine. "vllm": the actor's sampling call gets only the
    layouts vLLM can run inside the ranks (every rank, tp fastest, pp 1, vLLM's head rule) and
    the graph gains the recompute call actor_logp (not with vllm_logp="rollout": the run's
    generation.vllm_logp); the sampling call is costed as the built-in engine (no vLLM cost model
    yet), and a mixture-of-experts actor has no candidate (refused).

    max_staleness: the asynchronous RL bound k the run allows (async.max_staleness). With k >= 1
    plans are scored in async mode (a step costs about the slower of the rollout and train sides
    plus the weight transfer, not their sum: simulate.py), and the result's `staleness` is the
    smallest k' <= k at which the plan found reaches its time: 0 when running it asynchronously
    gains nothing (e.g. generation and training on the same devices), so the search chooses
    between the two modes. stats["sync_iter_time"] is the same plan run synchronously."""
    t0 = time.perf_counter()
    hw = get_profile(hardware) if isinstance(hardware, str) else hardware
    wl = workload or Workload()
    models = models or ppo_models(actor, critic, dtype)
    graph = search_graph(algo, engine, vllm_logp)
    prob = Problem(
        models,
        hw,
        num_gpus,
        wl,
        iters=iters,
        per_mesh=per_mesh,
        graph=graph,
        grouped=algo in GROUPED,
        extra=baseline_layouts(models, hw, num_gpus, wl, graph),
        staleness=max_staleness,
        vllm_call=sampling_call(algo) if engine == "vllm" else None,
    )
    sym = symmetric_baseline(prob)
    heu = heuristic_baseline(prob, sym)
    t_tables = time.perf_counter() - t0
    init = [prob.choice(b.layouts) for b in (heu, sym) if b.layouts and math.isfinite(b.iter_time)]
    left = max(0.5, time_budget - t_tables)
    ev = prob.evaluator()
    res = ev.anneal(
        chains=chains,
        time_budget=left,
        max_steps=max_steps,
        t_start=t_start,
        t_end=t_end,
        seed=seed,
        init=init,
        restart_steps=restart_steps,
    )
    if not math.isfinite(res["best_cost"]):
        raise ValueError(
            f"no feasible plan for {models.actor.name} actor + {models.critic.name} critic on "
            f"{num_gpus} {hw.name} devices ({hw.mem_limit / GiB:.1f} GiB usable each): the "
            f"smallest per-device memory need of a plan spreading every call over all devices is "
            f"{sym.peak_mem / GiB:.1f} GiB; " + _excluded_text(prob)
        )
    chains_out = res["chains"]
    for st in chains_out:
        st["acceptance"] = st["accepted"] / max(1, st["steps"])
    best = _idle_ranks_last(prob, list(res["best"]), res["best_cost"], max_staleness)
    # The mode: the smallest staleness at which the plan reaches its (async) time.
    times = [simulate(prob, best, staleness=k).iter_time for k in range(max_staleness + 1)]
    chosen = next(k for k, t in enumerate(times) if t <= res["best_cost"] * (1 + 1e-9) + 1e-12)
    stats = {
        "seconds_total": time.perf_counter() - t0,
        "seconds_tables": t_tables,
        "seconds_anneal": res["seconds"],
        "options": [len(o) for o in prob.options],
        "planner_calls": prob.realloc_cost.planner_calls,
        "realloc_pairs": res["realloc_calls"],
        "chains": chains_out,
        "sync_iter_time": times[0],
    }
    plan = prob.execution_plan(best)
    # A plan may use fewer ranks than it was searched for (spreading its calls further did not
    # lower the estimate): it records them, so the trainer runs it as returned. It records the
    # batch settings too: the trainer refuses to run it for other batches.
    searched_for = BatchSettings(
        batch_size=wl.batch_size,
        mini_batches=wl.ppo_minibatches,
        micro_batches=wl.micro_batches,
        ppo_epochs=wl.ppo_epochs,
        group_size=wl.group_size if algo in GROUPED else 1,
    )
    plan = dataclasses.replace(
        plan, idle_ranks=tuple(plan.uncovered_ranks()), searched_for=searched_for
    )
    stats["idle_ranks"] = list(plan.idle_ranks)
    return SearchResult(
        plan,
        res["best_cost"],
        best,
        prob,
        {"symmetric": sym, "heuristic": heu},
        stats,
        staleness=chosen,
    )


def _idle_ranks_last(prob: Problem, best: list, cost: float, staleness: int) -> list:
    """`best` with its ranks relabelled so that ranks it leaves idle come last (a one-node plan
    using 3 of 4 ranks runs on ranks 0-2, not 1-3), when a relabelling keeps every call a
    candidate (r -> r XOR c maps aligned blocks onto aligned blocks) and its estimate; else
    `best` unchanged."""
    n = prob.num_gpus
    keys = prob.layouts(best)
    used = {r for k in keys.values() for r in k[0].ranks}
    if len(used) == n or n > prob.rpn:
        return best

    def idle_after(c):
        return sorted((r ^ c for r in range(n) if r not in used), reverse=True)

    for c in sorted(
        (c for c in range(n) if all(r ^ c < n for r in range(n))), key=idle_after, reverse=True
    ):
        if c == 0:
            return best
        moved = {
            name: (Mesh(min(r ^ c for r in k[0].ranks), k[0].size),) + tuple(k[1:])
            for name, k in keys.items()
        }
        try:
            choice = prob.choice(moved)
        except ValueError:
            continue
        if simulate(prob, choice, staleness=staleness).iter_time <= cost * (1 + 1e-9) + 1e-12:
            return choice
    return best


def estimate(
    plan: ExecutionPlan,
    actor,
    critic=None,
    *,
    hardware: str | HardwareProfile = "h100",
    workload: Workload | None = None,
    iters: int = 3,
    dtype: str = "bfloat16",
    models: PPOModels | None = None,
    algo: str = "ppo",
    max_staleness: int = 0,
    engine: str = "builtin",
    vllm_logp: str = "recompute",
) -> dict:
    """Estimated seconds per iteration of a given plan, with per-call and reallocation times;
    max_staleness >= 1: run in async mode with that bound (async.max_staleness).

    For the PPO runtime: pass its ExecutionPlan, the model presets/configs, the workload it
    runs, hardware=real_py.calibrate.resolve_profile("cpu") (calibrated on this machine) and the
    dtype of its parameters. hardware as in plan_search.
    A plan that breaks a batch rule (dataflow/rules.py) is refused with a ValueError naming
    the call and the rule: the trainer would not run it.
    """
    hw = get_profile(hardware) if isinstance(hardware, str) else hardware
    wl = workload or Workload()
    models = models or ppo_models(actor, critic, dtype)
    prob = Problem(
        models,
        hw,
        plan.world_size,
        wl,
        iters=iters,
        fixed=layouts_from_plan(plan),
        graph=search_graph(algo, engine, vllm_logp),
        grouped=algo in GROUPED,
        staleness=max_staleness,
        vllm_call=sampling_call(algo) if engine == "vllm" else None,
    )
    r = simulate(prob, [0] * len(prob.calls))
    # A call's seconds in the timeline of the last simulated step: its own time, stretched by the
    # calls beside it when ranks share cores (simulate.py); "alone": without them.
    last = max((e.iter for e in r.events), default=0)
    span = {e.call: e.end - e.start for e in r.events if not e.realloc and e.iter == last}
    calls = {
        name: {
            "seconds": span.get(name, prob.options[i][0].time),
            "alone": prob.options[i][0].time,
            "breakdown": prob.options[i][0].breakdown,
            "layout": str(prob.options[i][0]),
        }
        for i, name in enumerate(prob.names)
    }
    reallocs = {e.call: e.end - e.start for e in r.events if e.realloc and e.iter == 0}
    return {
        "iter_time": r.iter_time,
        "makespan": r.makespan,
        "peak_mem_bytes": r.peak_mem,
        "feasible": not r.infeasible,
        "calls": calls,
        "realloc_seconds": reallocs,
        "events": r.events,
    }
