"""Every rank of a plan in this process, compiled once and replayed: `InProcessMove`.

    move = InProcessMove(InProcessHub(), plan)     # a ReallocPlan or a MoePlan
    move.run(srcs, dsts)                           # rank -> stats; again with minimal host work
    move.close()                                   # or: with InProcessMove(...) as move:

srcs / dsts map rank -> ModelShard (a ReallocPlan) or rank -> (ModelShard, ExpertShard) (a
MoePlan), as run_in_process takes them. Built once: every rank's
Executor (executor.py): its schedule, its compiled copy (descriptor tables on the device,
one pass) or staging buffer (rounds), and, with threads=True, one worker thread per rank that
lives until close(). A call hands each worker its shards and collects the stats: no plan, no
schedule, no descriptor upload, no thread start.

threads=False (one pass only): the calling thread runs the phases of every rank in turn:
every rank publishes its sources and checks its input, then every rank issues its one copy,
then every rank waits for its readers (which have all issued theirs by then): one copy per
receiving rank and nothing else, no thread switch. On a GPU every copy then goes onto the
calling thread's current stream, in rank order.

A failed call marks its rank failed on the hub (its peers stop waiting and name it); build a new
move, with a new hub, after a failure.
"""

from __future__ import annotations

import queue
import threading
import time

from .direct import DirectRunner
from .executor import Executor, plan_ranks, shards_of
from .transports.inprocess import InProcessHub


class InProcessMove:
    def __init__(self, hub: InProcessHub, plan, *, threads: bool = True, **knobs):
        """knobs: MoveOptions fields (options.py)."""
        self.hub, self.plan, self.threads = hub, plan, threads
        self.ranks = plan_ranks(plan)
        self.reallocs = {r: Executor(plan, hub.transport(r), **knobs) for r in self.ranks}
        if not threads and not all(x.one_pass for x in self.reallocs.values()):
            raise ValueError(
                "InProcessMove(threads=False) runs one-pass moves only "
                "(no verify, no one_pass=False)"
            )
        self._jobs: dict[int, queue.SimpleQueue] = {}
        self._workers: list[threading.Thread] = []
        if threads:
            for r in self.ranks:
                q = self._jobs[r] = queue.SimpleQueue()
                t = threading.Thread(target=self._work, args=(q,), name=f"rank{r}", daemon=True)
                t.start()
                self._workers.append(t)

    def _work(self, q: queue.SimpleQueue) -> None:
        while (job := q.get()) is not None:
            self._one(*job)
            job = None  # a worker waiting for its next job holds no shard of the last one

    def _one(self, rank: int, fn, out: queue.SimpleQueue) -> None:
        try:
            value = fn()
        except BaseException as e:
            # Marked failed at once, so its peers stop waiting for it.
            self.hub.fail(rank, f"{type(e).__name__}: {e}")
            out.put((rank, False, e))
        else:
            out.put((rank, True, value))

    def run(self, srcs: dict, dsts: dict, *, free_source: bool = False) -> dict[int, dict]:
        """rank -> stats of one move; raises the lowest failed rank's error after every rank
        finished."""
        if not self.threads:
            return self._run_phased(srcs, dsts, free_source)
        if not self._workers:
            raise RuntimeError("InProcessMove was closed")
        out: queue.SimpleQueue = queue.SimpleQueue()
        for r in self.ranks:
            x, args = self.reallocs[r], shards_of(self.plan, srcs, dsts, r)
            self._jobs[r].put((r, lambda x=x, a=args: x.move(*a, free_source=free_source), out))
        results: dict[int, dict] = {}
        errors: dict[int, BaseException] = {}
        for _ in self.ranks:
            r, ok, value = out.get()
            (results if ok else errors)[r] = value
        if errors:
            raise errors[min(errors)]
        return results

    def _run_phased(self, srcs, dsts, free_source) -> dict[int, dict]:
        t0 = time.perf_counter()
        # threads=False is refused at construction unless every move is one pass (DirectRunner)
        runners = {r: self.reallocs[r].runner for r in self.ranks}
        direct = {r: x for r, x in runners.items() if isinstance(x, DirectRunner)}
        assert len(direct) == len(runners), "phased run of a move that is not one pass"
        try:
            for r in self.ranks:
                bufs, check = self.reallocs[r].inputs(*shards_of(self.plan, srcs, dsts, r))
                direct[r].begin(bufs, check)
            for r in self.ranks:
                direct[r].copy()
            stats = {r: direct[r].end() for r in self.ranks}
        except BaseException as e:
            for r in self.ranks:
                self.hub.fail(r, f"{type(e).__name__} in this thread's move: {e}")
            raise
        return {
            r: self.reallocs[r].done(
                shards_of(self.plan, srcs, dsts, r)[0], free_source, stats[r], t0
            )
            for r in self.ranks
        }

    def close(self) -> None:
        for q in self._jobs.values():
            q.put(None)
        for t in self._workers:
            t.join()
        self._jobs, self._workers = {}, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["InProcessMove"]
