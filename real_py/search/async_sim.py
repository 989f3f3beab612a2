"""Asynchronous RL in the plan simulator (issue 22 item 4, first part): the iteration time of a
plan when the runtime runs with async.max_staleness = k (real_py/rlhf/asyncrl.py).

Same task rules as simulate.simulate (devices, dependencies, data transfers, memory), placed in
the runtime's async order: a prologue of rollouts 0 .. k-1 with the initial weights, then per
step s the rollout calls of batch s + k (their reallocation reads the weights trained by step
s - 1, occupying both layouts as the runtime's transfer at the step's start does) followed by
the train calls of batch s. With generation and training on disjoint devices the steady-state
step is max(rollout side, train side) + reallocation instead of their sum. k = 0 is
simulate.simulate itself. Not yet used by the annealer (csrc/search) nor by `plan_search`: a
caller compares `simulate_async(prob, choice, k)` with `simulate(prob, choice)` for a plan.
"""

from __future__ import annotations

from .simulate import Event, SimResult, _transfer, simulate


def simulate_async(prob, choice, k: int, iters: int | None = None) -> SimResult:
    """prob: a Problem; choice: one option index per call; k >= 0 the staleness bound. Returns
    the SimResult of `iters` steps after the prologue (iter_time = steady-state seconds per step)."""
    from .graph import dep_bytes

    if k < 0:
        raise ValueError(f"max_staleness k={k} must be >= 0")
    first = simulate(prob, choice, 1 if k else iters)
    if k == 0 or first.infeasible:
        return first
    iters = prob.iters if iters is None else iters
    calls, n = prob.calls, len(prob.calls)
    pos = {c.name: i for i, c in enumerate(calls)}
    opts = [prob.options[i][choice[i]] for i in range(n)]
    wsrc = [pos[c.weight_src] if c.weight_src else -1 for c in calls]
    copy = [w >= 0 and opts[w].key != opts[c].key for c, w in enumerate(wsrc)]
    roll = [c for c in range(n) if calls[c].kind != "train"]
    train = [c for c in range(n) if calls[c].kind == "train"]
    free = [0.0] * prob.num_gpus
    trained: dict[int, list[float]] = {-1: [0.0] * n}   # step -> end of its train calls
    ends: dict[int, list[float]] = {}                    # batch -> end of every call
    events: list[Event] = []

    def occupy(o, t):
        return max([t] + free[o.mesh.start:o.mesh.start + o.mesh.size])

    def release(o, t):
        free[o.mesh.start:o.mesh.start + o.mesh.size] = [t] * o.mesh.size

    def place(b: int, cs: list[int], wts: list[float], step: int) -> None:
        end = ends.setdefault(b, [0.0] * n)
        rend = {}
        for c in cs:
            if not copy[c]:
                continue
            w = wsrc[c]
            start = occupy(opts[c], occupy(opts[w], wts[w]))
            rend[c] = start + prob.realloc_time(c, choice[w], choice[c])
            release(opts[w], rend[c])
            release(opts[c], rend[c])
            ranks = tuple(sorted({(o.mesh.start, o.mesh.start + o.mesh.size) for o in (opts[w], opts[c])}))
            events.append(Event(ranks, start, rend[c], f"realloc {calls[c].model}", calls[c].name, step, True))
        for c in cs:
            o, w = opts[c], wsrc[c]
            ready = rend[c] if c in rend else (wts[w] if w >= 0 else 0.0)
            for d in calls[c].deps:
                i = pos[d]
                ready = max(ready, end[i] + _transfer(opts[i], o, dep_bytes(d, calls[c].name, prob.wl), prob))
            start = occupy(o, ready)
            end[c] = start + o.time
            release(o, end[c])
            events.append(Event(((o.mesh.start, o.mesh.start + o.mesh.size),), start, end[c],
                                calls[c].name, calls[c].name, step, False))

    for b in range(k):                                   # prologue: initial weights
        place(b, roll, trained[-1], -1)
    t0 = max((e.end for e in events), default=0.0)
    for s in range(iters):
        place(s + k, roll, trained[s - 1], s)            # weights of version s (trained by step s-1)
        place(s, train, trained[s - 1], s)
        trained[s] = list(ends[s])
    makespan = max(e.end for e in events)
    return SimResult((makespan - t0) / iters, makespan, first.peak_mem, "", events)


__all__ = ["simulate_async"]
