"""Asynchronous RL state: the bounded queue of generated batches, weight versions, row ledger,
and the per-version check of behaviour log-probs (async.check_versions).

Execution (runtime.Runtime.iteration in async mode), with k = async.max_staleness >= 1 and s
the step:

    version of the actor weights = train steps applied so far = s at the start of step s
    rollout calls of batch s + k   (weights of version s, reallocated train -> gen layout)
      || train calls of batch s    (queued; generated with version max(0, s - k))

Every rank walks the rollout calls first, then the train calls, in the global order. On a plan
where generation and training ranks are disjoint, the train ranks only send the weights (the
reallocation) and post their receives of the new batch's rows before training; the generation
ranks then generate while the train ranks train, and the step ends when both are done (the
metrics all-reduce). A batch's rows enter the queue when their pushes completed; the queue holds
at most k batches, so a batch is trained exactly once, at most k versions after the weights that
generated it. The first step fills the queue synchronously with the current weights (prologue);
a checkpoint saves every rank's queued rows, versions and ledger, so a resume continues with the
same queue (a checkpoint without them refills it by a prologue). Rows over the bound (none by
construction; the rule guards a plan change or a resume) are masked out of the loss and counted as
dropped.

With async.overlap_realloc, `Prefetch` double-buffers the actor's weights: the next version
moves to the generation layout in a receive thread while this step generates (async.interrupt:
a generation may switch to it mid-rollout, `Prefetch.swap_hook`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engines import Engine
from ..realloc.shard import ModelShard
from .config.schema import AsyncConfig
from .models import Models
from .observe import Event, Realloc, StepRecord
from .rows import Store


class AsyncState:
    def __init__(self, k: int, B: int, keep_versions: bool):
        self.k, self.B = k, B
        self.queue: deque = deque()  # (batch step, Store, version that generated it)
        self.version = 0  # actor train steps applied
        self.generated = self.trained = self.dropped = 0
        self.keep_versions = keep_versions
        self.snapshots: dict[int, torch.Tensor] = {}  # version -> this rank's home actor shard

    def snapshot(self, engine) -> None:
        """Keep this rank's actor home shard of the current version (async.check_versions)."""
        if not self.keep_versions or engine is None:
            return
        self.snapshots[self.version] = engine.shard.flat.detach().clone()
        for v in [v for v in self.snapshots if v < self.version - self.k]:
            del self.snapshots[v]

    def state_dict(self) -> dict:
        """This rank's queue (the rows of each queued batch it holds: every key of its Store),
        versions and ledger, for the checkpoint's rank file (tensors and ints only)."""
        return {
            "k": self.k,
            "queue": [{"batch": b, "version": v, "data": dict(st.data)} for b, st, v in self.queue],
            "counts": [self.generated, self.trained, self.dropped],
            "snapshots": dict(self.snapshots),
        }

    def load_state_dict(self, state: dict, schema: dict, where: str) -> None:
        if state["k"] != self.k:
            raise ValueError(
                f"{where}: saved with async.max_staleness={state['k']}, the config has "
                f"{self.k}; resume with the same bound"
            )
        self.queue.clear()
        for q in state["queue"]:
            st = Store(schema, self.B)
            for key, t in q["data"].items():
                if key not in st.data or st.data[key].shape != t.shape:
                    raise ValueError(
                        f"{where}: queued batch {q['batch']} key {key!r} of shape "
                        f"{tuple(t.shape)} does not match this run's rows"
                    )
                st.data[key].copy_(t)
            self.queue.append((int(q["batch"]), st, int(q["version"])))
        self.generated, self.trained, self.dropped = (int(x) for x in state["counts"])
        self.snapshots = {int(v): t.clone() for v, t in state["snapshots"].items()}

    def ledger(self) -> dict[str, float]:
        return {
            "rows_generated": float(self.generated),
            "rows_trained": float(self.trained),
            "rows_dropped": float(self.dropped),
            "rows_queued": float(len(self.queue) * self.B),
        }


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_seconds(events, first, second) -> float:
    """Seconds during which some rank ran an event named in `first` while some rank ran one in
    `second` (events: (rank, name, start, end), wall clock of one machine)."""
    u1 = _union([(a, b) for _, n, a, b in events if n in first])
    u2 = _union([(a, b) for _, n, a, b in events if n in second])
    total = 0.0
    for a, b in u1:
        for c, d in u2:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def version_mask(
    versions: torch.Tensor, mask: torch.Tensor, current: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """versions, mask [b, N] -> (mask of the rows within the bound, [b] bool rows dropped): a row
    with any response token older than current - k is dropped as a whole."""
    old = ((versions < current - k) & (mask > 0)).any(1)
    return mask * (~old).float().unsqueeze(1), old


def staleness(versions: torch.Tensor, mask: torch.Tensor, current: int) -> tuple[float, float]:
    """(sum over response tokens of current - version, number of response tokens)."""
    return float(((current - versions) * mask).sum()), float(mask.sum())


def prefetch_calls(graph, plan, home: dict[str, str]) -> list[str]:
    """The actor's rollout calls whose weights can move during generation (double buffer):
    all on ranks disjoint from the actor's train ranks, and no other model reallocated for a
    rollout call (the receive thread would share the reallocation group with it). home: model ->
    the call whose layout holds its weights (Models.home)."""
    if "actor" not in home:
        return []
    src = set(plan.calls[home["actor"]].ranks)
    calls = []
    for n in graph.order:
        c = graph.calls[n]
        h = home.get(c.model)
        if c.trains or h is None or plan.calls[n] == plan.calls[h]:
            continue
        if c.model != "actor" or src & set(plan.calls[n].ranks):
            return []
        calls.append(n)
    return calls


@dataclass
class SwapHook:
    """Prefetch.swap_hook's answer: the callback that lets one generate call switch to the next
    actor version mid-rollout, and what it did."""

    # engines.generate's `swap`: asked before each decode step; True when it has just replaced
    # the weights (at most once per call)
    swap: Callable[[int], bool]
    # decode step from which the new weights generate; None while the old ones do
    at: int | None = None
    # the replaced flat weights, kept for the behaviour log-probs of the tokens sampled before `at`
    old: torch.Tensor | None = None


class Prefetch:
    """The double buffer of async.overlap_realloc for `calls` (prefetch_calls). In a step that
    arms it, the generation ranks start receiving the next actor version in a thread right after
    the last of `calls` took its weights (engine_for), so the receive runs under this step's
    generation; the train ranks send that version after their train calls (send), which then
    joins the thread. The next step's rollout calls run on the moved weights (engine_for)."""

    def __init__(
        self,
        calls: list[str],
        models: Models,
        plan,
        *,
        rank: int,
        device: torch.device,
        timeout_s: float,
    ):
        self.calls, self.models, self.rank = calls, models, rank
        self.device, self.timeout_s = device, timeout_s
        self.receivers = set().union(*(plan.calls[n].ranks for n in calls))
        self.senders = set(plan.calls[models.home["actor"]].ranks)
        self.ready: dict[
            str, Engine | None
        ] = {}  # call -> engine (None off the receivers): moved ahead
        self.used: list[str] = []  # calls of this step that ran on moved-ahead weights
        self.armed: int | None = None  # the step whose receive starts after calls[-1]
        self.thread: tuple[threading.Thread, dict] | None = None  # the receive in flight, its box

    def engine_for(self, call: str) -> tuple[Engine | None, dict | None]:
        """Models.engine_for, or the weights moved ahead for `call` (no reallocation stats);
        starts the receive thread after the armed step's last prefetched call."""
        if call in self.ready:
            engine, stats = self.ready.pop(call), None
            self.used.append(call)
        else:
            engine, stats = self.models.engine_for(call)
        if self.armed is not None and call == self.calls[-1]:
            step, self.armed = self.armed, None
            self._start(step)
        return engine, stats

    def _start(self, step: int) -> None:
        """Generation ranks: begin receiving the next version in a thread (during this step's
        generation); the train ranks send it after their train calls."""
        if self.rank not in self.receivers:
            return
        box: dict = {}

        def recv():
            try:
                if self.device.type == "cuda":
                    # The current CUDA device is per thread: this one's must be the rank's.
                    torch.cuda.set_device(self.device)
                for n in self.calls:
                    t0 = time.time()
                    eng, stats = self.models.engine_for(n)
                    box[n] = (eng, stats, t0, time.time())
            except BaseException as e:  # re-raised by the main thread at the join
                box["error"] = e

        th = threading.Thread(target=recv, name=f"realloc-prefetch-{step}", daemon=True)
        th.start()
        self.thread = (th, box)

    def send(self, step: int, rec: StepRecord) -> None:
        """Train ranks: send the new version to the generation layout (after the train calls);
        generation ranks: wait for the receive thread."""
        self.armed = None
        for n in self.calls:
            if self.rank in self.senders:
                t0 = time.time()
                try:
                    _, stats = self.models.engine_for(n)
                except Exception as e:
                    raise RuntimeError(
                        f"rank {self.rank}, step {step}: sending the next actor "
                        f"weights for {n}: {type(e).__name__}: {e}"
                    ) from e
                rec.reallocs.append(
                    Realloc("actor", n, stats["start"], stats["end"], stats["sent_bytes"])
                )
                rec.events.append(Event(self.rank, "realloc:" + n, t0, time.time()))
            self.ready[n] = None
        if self.thread is not None:
            self._join(step, rec)

    def _join(self, step: int, rec: StepRecord) -> None:
        th, box = self.thread
        self.thread = None
        th.join(self.timeout_s)
        if th.is_alive():
            raise RuntimeError(
                f"rank {self.rank}, step {step}: receiving the next actor weights "
                f"({self.calls}) did not finish within {self.timeout_s:.0f} s"
            )
        if "error" in box:
            e = box["error"]
            raise RuntimeError(
                f"rank {self.rank}, step {step}: receiving the next actor weights: "
                f"{type(e).__name__}: {e}"
            ) from e
        for n in self.calls:
            # The receive thread's interval includes waiting for the train step to end: kept as
            # its own event, not as reallocation time (the senders' interval is the transfer).
            eng, stats, t0, t1 = box[n]
            rec.events.append(Event(self.rank, "recv_thread:" + n, t0, t1))
            self.ready[n] = eng

    def swap_hook(self, call, g, engine, ac: AsyncConfig) -> SwapHook | None:
        """The SwapHook for engines.generate when the call may pick up the next version
        mid-rollout (async.interrupt, a receive thread running for this call), else None. The
        ranks of the replica agree (MIN over TP, then PP) before swapping, so they swap at the
        same step."""
        if not ac.interrupt or self.thread is None or call.name not in self.calls:
            return None
        thread, box = self.thread
        timeout_s, device = self.timeout_s, self.device

        def swap(step: int) -> bool:
            if hook.at is not None:
                return False  # one new version per step
            if ac.interrupt_wait_step is not None:
                if step != ac.interrupt_wait_step:
                    return False
                thread.join(timeout_s)
                if thread.is_alive():
                    raise RuntimeError(
                        f"rank {dist.get_rank()}: interrupt at decode step {step} of {call.name}: "
                        f"the next weights did not arrive within {timeout_s:.0f} s"
                    )
            ready = torch.tensor([1 if call.name in box else 0], device=device)
            for grp, size in ((g.tp_group, g.tp_size), (g.pp_group, g.pp_size)):
                if size > 1:
                    dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=grp)
            if not int(ready.item()):
                return False
            hook.old = engine.shard.flat.clone()
            engine.shard.flat.copy_(box[call.name][0].shard.flat)
            hook.at = step
            return True

        hook = SwapHook(swap)
        return hook


def async_report(
    events, rollout: set[str], train: set[str], prologue_s: float, wait_s: float
) -> dict[str, float]:
    """The step's "async" figures from every rank's events: the prologue's and the wait for the
    new batch's rows' seconds, and overlaps of rollout calls, train calls and reallocations."""
    rea = {"realloc:" + n for n in rollout}
    return {
        "prologue_seconds": prologue_s,
        "wait_rows_seconds": wait_s,
        # seconds in which a rollout call ran while a train call ran (any ranks)
        "overlap_seconds": overlap_seconds(events, rollout, train),
        # seconds of rollout-side reallocation during which a rollout call ran
        # (double buffer: the receive runs under generation; without it only
        # the senders' wait for completion can overlap generation)
        "realloc_hidden_seconds": overlap_seconds(events, rea, rollout),
        # wall seconds in which some rank reallocated for a rollout call
        "realloc_seconds": overlap_seconds(events, rea, rea),
    }


def version_errors(
    st: AsyncState, cfg, spec, g, engine, d: dict, mask: torch.Tensor
) -> tuple[float, float, float]:
    """Recompute the behaviour log-probs of the batch with the weights of each row's recorded
    version (this rank's kept shard of it, in the train layout) and with the newest weights.
    Returns (sum |old_logp - logp(recorded version)|, sum |old_logp - logp(newest)|, tokens).
    Collective over the train call's group (every rank of it runs the same rows)."""
    ver = torch.where(mask > 0, d["versions"], torch.full_like(d["versions"], -1))
    err = torch.zeros_like(mask)
    for v in sorted(set(ver.unique().tolist()) - {-1}):
        if v not in st.snapshots:
            raise RuntimeError(
                f"async.check_versions: no kept weights of version {v} (have "
                f"{sorted(st.snapshots)}) on rank {dist.get_rank()}"
            )
        shard = ModelShard(spec, g.layout, dist.get_rank(), st.snapshots[v])
        eng = Engine(cfg, g.layout, g, shard)
        eng.logit_temperature = engine.logit_temperature
        lp = eng.inference(d["tokens"], d["lengths"])["logprobs"]
        sel = (ver == v).float()
        err += (lp - d["old_logp"]).abs() * sel
    newest = engine.inference(d["tokens"], d["lengths"])["logprobs"]
    err_new = (newest - d["old_logp"]).abs() * mask
    return float(err.sum()), float(err_new.sum()), float(mask.sum())


__all__ = [
    "AsyncState",
    "Prefetch",
    "prefetch_calls",
    "async_report",
    "overlap_seconds",
    "version_mask",
    "staleness",
    "version_errors",
]
