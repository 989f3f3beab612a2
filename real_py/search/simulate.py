"""Python simulator of one or more PPO iterations: the same rules as csrc/search/simulate.cpp,
plus a timeline of events for pictures and debugging.

Rules (seconds, bytes):
- Memory: per device, the persistent bytes of every chosen option on it (training state,
  frozen weights) plus the largest transient bytes of any call on it (activations, KV cache,
  and a reallocated weight copy when the call's layout differs from its weights' training
  layout) must fit the usable memory; otherwise the plan is infeasible (time = inf).
- Per iteration, tasks are placed in a fixed order: first the reallocation of each call whose
  layout differs from its training layout (it reads the previous iteration's trained weights
  and occupies the devices of both layouts), then the calls in graph order. A task starts when
  its inputs are ready (dependencies ended + data transfer) and all of its devices are free.
  Calls on disjoint meshes therefore overlap; calls sharing a device are serialized.
- Ranks sharing cores (HardwareProfile.shared_cores, the `cpu` profile): calls on disjoint ranks
  overlap in the timeline but not on the cores. A call's time includes the sharing among its own
  busy ranks (costmodel); placed beside calls already placed, it is stretched by
  contention(busy + w) / contention(busy), w = their working ranks averaged over its interval.
  (Calls placed earlier are not stretched back: the first-order effect, in placement order.)
- Iteration time = makespan of `iters` iterations / iters.
- Asynchronous RL (staleness k >= 1, real_py/rlhf/asyncrl.py): a prologue places the rollout
  calls of batches 0 .. k-1 with the initial weights; step s then places the rollout calls of
  batch s + k (their reallocation reads the weights trained by step s - 1, occupying both
  layouts as the runtime's transfer at the step's start does) before the train calls of batch
  s. With generation and training on disjoint devices the steady-state step is max(rollout
  side, train side) + reallocation instead of their sum. Iteration time = (makespan - end of
  the prologue) / iters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Event:
    ranks: tuple[tuple[int, int], ...]
    """Device ranges [lo, hi) the task occupies."""
    start: float
    end: float
    label: str
    call: str
    iter: int
    realloc: bool


@dataclass(slots=True)
class SimResult:
    iter_time: float
    makespan: float
    peak_mem: float
    infeasible: str = ""
    events: list[Event] = field(default_factory=list)


def _transfer(a, b, nbytes, prob) -> float:
    if a.mesh.start == b.mesh.start and a.mesh.size == b.mesh.size:
        return 0.0
    rpn, hw = prob.rpn, prob.hw
    lo = min(a.mesh.start, b.mesh.start)
    hi = max(a.mesh.start + a.mesh.size, b.mesh.start + b.mesh.size) - 1
    one = lo // rpn == hi // rpn
    bw, lat = (hw.intra_bw, hw.intra_lat) if one else (hw.inter_bw, hw.inter_lat)
    return lat + nbytes / (bw * float(min(a.mesh.size, b.mesh.size)))


def simulate(prob, choice, iters: int | None = None, staleness: int | None = None) -> SimResult:
    """prob: a Problem; choice: one option index per call; staleness: the async RL bound k
    (default: prob.staleness, else 0). iter_time: seconds per step after the prologue."""
    from .graph import dep_bytes

    iters = prob.iters if iters is None else iters
    k = getattr(prob, "staleness", 0) if staleness is None else staleness
    if k < 0:
        raise ValueError(f"max_staleness k={k} must be >= 0")
    calls, n = prob.calls, len(prob.calls)
    pos = {c.name: i for i, c in enumerate(calls)}
    opts = [prob.options[i][choice[i]] for i in range(n)]
    wsrc = [pos[c.weight_src] if c.weight_src else -1 for c in calls]
    copy = [w >= 0 and opts[w].key != opts[c].key for c, w in enumerate(wsrc)]
    persist = [0.0] * prob.num_gpus
    transient = [0.0] * prob.num_gpus
    for c, o in enumerate(opts):
        tr = o.transient + (o.weights if copy[c] else 0.0)
        for r in o.mesh.ranks:
            persist[r] += o.persist
            transient[r] = max(transient[r], tr)
    peak = max(p + t for p, t in zip(persist, transient))
    if peak > prob.hw.mem_limit:
        return SimResult(math.inf, math.inf, peak, "memory")
    free = [0.0] * prob.num_gpus
    ends = [[0.0] * n for _ in range(iters + k)]  # batch -> end of every call
    initial = [0.0] * n
    events: list[Event] = []
    cores = getattr(prob.hw, "shared_cores", 0)  # 0: every device its own processor
    placed: list[tuple[float, float, float]] = []  # (start, end, working ranks) of placed calls

    def stretched(o, start: float) -> float:
        """o's seconds from `start`, beside the calls already placed (shared cores)."""
        if not cores or o.time <= 0:
            return o.time
        end = start + o.time
        w = sum(wk * max(0.0, min(end, e) - max(start, s)) for s, e, wk in placed) / o.time
        return o.time * max(1.0, (o.busy + w) / cores) / max(1.0, o.busy / cores)

    def occupy(o, t):
        return max([t] + free[o.mesh.start : o.mesh.start + o.mesh.size])

    def release(o, t):
        free[o.mesh.start : o.mesh.start + o.mesh.size] = [t] * o.mesh.size

    def place(b: int, cs: list[int], wts: list[float], step: int) -> None:
        """Reallocations of `cs` (reading the weights `wts`), then the calls of `cs`, of batch b."""
        end, rend = ends[b], {}
        for c in cs:
            if not copy[c]:
                continue
            w = wsrc[c]
            start = occupy(opts[c], occupy(opts[w], wts[w]))
            rend[c] = start + prob.realloc_time(c, choice[w], choice[c])
            release(opts[w], rend[c])
            release(opts[c], rend[c])
            ranks = tuple(
                sorted({(o.mesh.start, o.mesh.start + o.mesh.size) for o in (opts[w], opts[c])})
            )
            events.append(
                Event(ranks, start, rend[c], f"realloc {calls[c].model}", calls[c].name, step, True)
            )
        for c in cs:
            o, w = opts[c], wsrc[c]
            ready = rend[c] if c in rend else (wts[w] if w >= 0 else 0.0)
            for d in calls[c].deps:
                i = pos[d]
                ready = max(
                    ready,
                    end[i] + _transfer(opts[i], o, dep_bytes(d, calls[c].name, prob.wl), prob),
                )
            start = occupy(o, ready)
            end[c] = start + stretched(o, start)
            placed.append((start, end[c], o.working))
            release(o, end[c])
            events.append(
                Event(
                    ((o.mesh.start, o.mesh.start + o.mesh.size),),
                    start,
                    end[c],
                    calls[c].name,
                    calls[c].name,
                    step,
                    False,
                )
            )

    every = list(range(n))
    roll = [c for c in every if calls[c].kind != "train"]
    train = [c for c in every if calls[c].kind == "train"]
    for b in range(k):  # async prologue: the initial weights
        place(b, roll, initial, -1)
    t0 = max((e.end for e in events), default=0.0)
    for s in range(iters):
        wts = ends[s - 1] if s else initial  # weights trained by step s - 1
        if k == 0:
            place(s, every, wts, s)
        else:
            place(s + k, roll, wts, s)  # batch s + k generates while ...
            place(s, train, wts, s)  # ... batch s trains
    makespan = max((e.end for e in events), default=0.0)
    return SimResult((makespan - t0) / iters, makespan, peak, "", events)
