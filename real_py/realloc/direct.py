"""One-pass moves on addressable transports (in-process threads, CUDA IPC on one node).

    entries = schedule_entries(rank_schedule(plan, rank, ...))     # what this rank receives
    runner = DirectRunner(transport, plan_tag(plan), entries, schedule_readers(schedule), es)
    stats = runner.run({0: (src_flat, dst_flat)}, check)            # per call: one copy

When a rank can read its peers' source buffers, a message needs no staging and no second copy:
the planner's descriptors of a chunk already map the SENDER's source flat buffer to the
RECEIVER's destination flat buffer (pack and unpack descriptors are both derived from them), so
they compose the sender's pack and the receiver's unpack into one strided copy. A rank gathers
every chunk it receives, of every round, plus its local copies, into one CopyPlan (ops.py:
descriptors over several source buffers, one per (sender, buffer id), compiled once into work
items kept on the device) and runs it as ONE call per move (one kernel launch on a GPU, one C++
call on a CPU). No staging, so no memory bound applies: the extra memory is the item table.

A call: publish this rank's source buffers and collect its senders' (transport.share: on a GPU
with an event each, which the reader's stream waits on), copy, then tell the senders this rank
is done and wait until every reader of this rank's source is done (transport.release), so the
source stays intact, and may be freed, only after every reader finished. Never writes a source.
The phases are also callable one by one (`begin`, `copy`, `end`), so one thread can run every
rank of a process without blocking (InProcessMove(threads=False), reallocator.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from ..ops import CopyPlan
from .rank_schedule import RankSchedule
from .transports.base import Transport

STEP = "one-pass copy"
_CPU_COPY = threading.Lock()
"""One CPU copy at a time in a process: each already runs on every core (at::parallel_for), so
rank threads copying at once would only oversubscribe the cores."""


@dataclass(frozen=True, slots=True)
class Entry:
    sender: int
    src_buf: int
    """Buffer id on the sender (0 for a lone plan; the part index of an MoE plan)."""
    dst_buf: int
    """Buffer id on this rank."""
    descs: np.ndarray
    """[k, 6] elements: the sender's source flat buffer -> this rank's destination flat buffer."""


def schedule_entries(schedule: RankSchedule, buf: int = 0) -> list[Entry]:
    """This rank's local copies and every chunk it receives, in every round (direct and staged
    chunks alike), as one-pass entries on buffer id `buf`."""
    out = [Entry(schedule.rank, buf, buf, schedule.local)] if len(schedule.local) else []
    out += [Entry(c.sender, buf, buf, c.descs) for rr in schedule.rounds for c in rr.recvs]
    return out


def schedule_readers(schedule: RankSchedule) -> set[int]:
    """Ranks that read this rank's source buffers (receivers of its chunks)."""
    return {r for rr in schedule.rounds for c in rr.sends for r in c.receivers}


def plan_tag(plan) -> str:
    """Names a plan's moves alike on every rank (the transports number the moves of a tag)."""
    mode = getattr(plan, "mode", "moe")  # a MoePlan has parts, not one mode
    src = f"{plan.src}{list(plan.src.ranks)}"
    dst = f"{plan.dst}{list(plan.dst.ranks)}"
    return f"{plan.model.name}:{src}->{dst}:{mode}"


class DirectRunner:
    def __init__(
        self,
        transport: Transport,
        tag: str,
        entries: list[Entry],
        readers,
        element_size: int,
        buf_ids=None,
    ):
        """buf_ids: the buffer id of each position of run()'s `bufs` list (default 0, 1, ...)."""
        if not transport.addressable:
            raise ValueError(
                f"{type(transport).__name__} cannot address its peers' buffers; one-pass "
                "moves need an addressable transport (in-process, CUDA IPC)"
            )
        self.transport, self.rank, self.tag = transport, transport.rank, tag
        self.element_size = element_size
        entries = [e for e in entries if len(e.descs)]
        self.src_keys = sorted({(e.sender, e.src_buf) for e in entries})
        """(sender, its buffer id) of each source buffer the copy reads, in CopyPlan order."""
        self.dst_bufs = sorted({e.dst_buf for e in entries})
        col = {k: i for i, k in enumerate(self.src_keys)}
        dcol = {b: i for i, b in enumerate(self.dst_bufs)}
        rows = [
            np.hstack(
                [e.descs, np.tile([col[(e.sender, e.src_buf)], dcol[e.dst_buf]], (len(e.descs), 1))]
            )
            for e in entries
        ]
        self.rows = np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 8), np.int64)
        self.peers = sorted({e.sender for e in entries} - {self.rank})
        self.readers = sorted(set(readers) - {self.rank})
        self.numel = int((self.rows[:, 2] * self.rows[:, 3]).sum())
        self.buf_ids = None if buf_ids is None else list(buf_ids)
        self._plans: dict = {}
        self._state = None

    def plan(self, device) -> CopyPlan:
        """The compiled copy on `device` (built on first use, then reused by every call)."""
        key = str(device)
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = CopyPlan(self.rows, self.element_size, device=device)
        return p

    @property
    def table_bytes(self) -> int:
        return sum(p.table_bytes for p in self._plans.values())

    def run(self, bufs, check=None) -> dict:
        """Move this rank's share; bufs: {buffer id: (source flat or None, destination flat or
        None)} (a list: ids 0, 1, ...). Returns stats (see `end`)."""
        self.begin(bufs, check)
        self.copy()
        return self.end()

    def begin(self, bufs, check=None) -> None:
        """Check the input, publish this rank's source buffers."""
        clock = time.perf_counter
        self._state = st = {
            "t0": clock(),
            "share": 0.0,
            "copy": 0.0,
            "release": 0.0,
            "step": "input check",
        }
        try:
            if check is not None:
                check()
            bufs = (
                dict(bufs)
                if isinstance(bufs, dict)
                else dict(zip(self.buf_ids or range(len(bufs)), bufs))
            )
            st["bufs"] = bufs
            st["step"] = STEP
            t = clock()
            sources = {b: s for b, (s, _) in bufs.items() if s is not None}
            st["seq"] = self.transport.publish_sources(STEP, self.tag, sources, len(self.readers))
            st["share"] += clock() - t
        except BaseException as e:
            self._report(e)
            raise

    def copy(self) -> None:
        """Collect the senders' buffers, run the one compiled copy, tell the senders this
        rank's reads are issued."""
        st, clock = self._state, time.perf_counter
        try:
            t = clock()
            peers = self.transport.peer_sources(STEP, self.tag, st["seq"], self.peers)
            st["share"] += clock() - t
            bufs = st["bufs"]
            srcs = [bufs[b][0] if r == self.rank else peers[r][b] for r, b in self.src_keys]
            dsts = [bufs[b][1] for b in self.dst_bufs]
            if self.src_keys:
                plan = self.plan(dsts[0].device)
                if plan.device.type == "cpu":
                    with _CPU_COPY:  # the copy's time, not the wait for the lock
                        t = clock()
                        plan.run(srcs, dsts)
                        st["copy"] = clock() - t
                else:
                    t = clock()
                    plan.run(srcs, dsts)
                    st["copy"] = clock() - t
            t = clock()
            self.transport.finish_reads(STEP, self.tag, st["seq"], dsts, self.peers)
            st["release"] += clock() - t
        except BaseException as e:
            self._report(e)
            raise

    def end(self) -> dict:
        """Return once this rank's readers are done.
        Stats: rounds (1: one pass), staging_bytes (0), phases as the round loop's ("unpack":
        the one copy, "post": sharing buffers, "wait": waiting for readers) and per_round."""
        st, clock = self._state, time.perf_counter
        try:
            t = clock()
            self.transport.wait_readers(STEP, self.tag, st["seq"], self.readers)
            st["release"] += clock() - t
        except BaseException as e:
            self._report(e)
            raise
        self._state = None
        phases = {
            "local": 0.0,
            "pack": 0.0,
            "post": st["share"],
            "wait": st["release"],
            "unpack": st["copy"],
        }
        return {
            "rounds": 1,
            "staging_bytes": 0,
            "one_pass": True,
            "copy_table_bytes": self.table_bytes,
            "phases": phases,
            "per_round": [[0, 0.0, st["share"], st["release"], st["copy"]]],
            "elapsed": clock() - st["t0"],
        }

    def _report(self, e: BaseException) -> None:
        step = self._state["step"] if self._state else STEP
        if not getattr(e, "reported", False):
            self.transport.fail(step, f"{type(e).__name__}: {e}"[:1000])


__all__ = ["DirectRunner", "Entry", "plan_tag", "schedule_entries", "schedule_readers"]
