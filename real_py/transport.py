"""Transports move the chunks of one bucket round between ranks.

The reallocator calls `start(sends, recvs, step) -> Handle` once per round on every participating
rank, then `handle.wait()`; a transport posts all of the round's sends and receives together (so
no order can deadlock). `exchange` is start + wait. At most one round is in flight per rank, so
packing round i+1 overlaps the network part of round i. Every wait has a timeout; errors name
this rank, the peer and the step. `setup(plan)` runs once per plan on EVERY rank of the
transport's group (collective setup such as broadcast subgroups); `fail(step, why)` tells the
other ranks that this one gave up, so they stop waiting on it.

Several chunks may travel between the same pair of ranks in one round (a message cut in pieces,
big contiguous pieces sent on their own). Both ends list a round's chunks in the schedule's one
global order, so a transport that matches messages by order per pair must post them in list
order: the in-process transport numbers them per (sender, receiver); gloo and NCCL p2p match in
posting order per peer (DistTransport, CupyNcclTransport post `sends` / `recvs` in list order);
DistTransport's broadcasts are issued sorted by (sender, receivers), then list index.

This module holds the interface and the in-process transport, which runs all ranks of a plan
inside one process (one thread per rank, a message is a copy): the same reallocator code path as
the distributed transports, fast enough to test thousands of layout pairs.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Sequence

import torch

Sends = Sequence[tuple[tuple[int, ...], torch.Tensor]]
"""(receivers, tensor) per outgoing chunk; several receivers for a broadcast."""
Recvs = Sequence[tuple[int, torch.Tensor, tuple[int, ...]]]
"""(sender, tensor to fill, all receivers of the chunk) per incoming chunk."""


class TransferError(RuntimeError):
    """A transfer step failed or timed out; the message names the rank, the peer and the step."""


class Handle:
    """A round in flight; `wait()` returns when it completed or raises TransferError."""

    def wait(self) -> None:
        pass


DONE = Handle()


class Transport(abc.ABC):
    """Interface: `rank`, `start(...) -> Handle` or `exchange(...)` (implement at least one),
    optional `setup(plan)`, `fail(step, why)`, `close()`."""

    rank: int
    name = "transport"
    asynchronous = False
    """True when start() returns before the round completed (then double buffering pays off)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.start is Transport.start and cls.exchange is Transport.exchange:
            raise TypeError(f"{cls.__name__} must implement start() or exchange()")

    def start(self, sends: Sends, recvs: Recvs, step: str) -> Handle:
        """Post every send and receive of one round; the handle's wait() completes them.

        Default: a blocking exchange (no overlap), for transports without async sends."""
        self.exchange(sends, recvs, step)
        return DONE

    def exchange(self, sends: Sends, recvs: Recvs, step: str) -> None:
        """Post every send and receive of one round, return when all completed."""
        self.start(sends, recvs, step).wait()

    def setup(self, plan) -> None:
        """Collective per-plan setup; called by every rank of the group with the same plan."""

    def fail(self, step: str, why: str) -> None:
        """This rank gave up during `step`; tell the peers (best effort)."""

    def close(self) -> None:
        pass


class InProcessHub:
    """Mailboxes shared by the in-process transports of one simulated world."""

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self._cv = threading.Condition()
        self._box: dict[tuple, torch.Tensor] = {}
        self._taken: set[tuple] = set()
        self._failed: dict[int, str] = {}

    def transport(self, rank: int) -> "InProcessTransport":
        return InProcessTransport(self, rank)

    def fail(self, rank: int, why: str) -> None:
        """Mark `rank` as failed: every rank waiting on it raises instead of waiting."""
        with self._cv:
            self._failed[rank] = why
            self._cv.notify_all()

    def run(self, plan, srcs: dict, dsts: dict, **realloc_kwargs) -> dict[int, dict]:
        """Run `plan` on every rank in its own thread; srcs/dsts map rank -> ModelShard.

        Returns rank -> the reallocator's stats. Raises the first rank's error (by rank order)
        after every thread has finished.
        """
        from .reallocator import Reallocator

        results, errors = {}, {}

        def work(rank):
            try:
                r = Reallocator(plan, self.transport(rank), **realloc_kwargs)
                results[rank] = r.run(srcs.get(rank), dsts.get(rank))
            except BaseException as e:  # noqa: BLE001 - re-raised below with the rank
                errors[rank] = e
                self.fail(rank, f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(r,), name=f"rank{r}") for r in plan.ranks()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            rank = min(errors)
            raise errors[rank]
        return results

    def _wait(self, cond, rank: int, peer: int, step: str, what: str):
        deadline = time.monotonic() + self.timeout
        while not cond():
            if peer in self._failed:
                raise TransferError(f"rank {rank}: peer rank {peer} failed during {step} "
                                    f"({self._failed[peer]}) while waiting to {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"rank {rank}: timed out after {self.timeout:.0f} s in {step} "
                                    f"waiting to {what} peer rank {peer}")
            self._cv.wait(min(left, 1.0))


class InProcessTransport(Transport):
    name = "inprocess"

    def __init__(self, hub: InProcessHub, rank: int):
        self.hub, self.rank = hub, rank

    def fail(self, step: str, why: str) -> None:
        self.hub.fail(self.rank, f"{step}: {why}")

    def exchange(self, sends: Sends, recvs: Recvs, step: str) -> None:
        hub, seq = self.hub, {}
        posted = []
        with hub._cv:
            for receivers, t in sends:
                for r in receivers:
                    key = (self.rank, r, step, seq.setdefault(("to", r), 0))
                    seq[("to", r)] += 1
                    hub._box[key] = t
                    posted.append(key)
            hub._cv.notify_all()
        for sender, buf, *_ in recvs:
            key = (sender, self.rank, step, seq.setdefault(("from", sender), 0))
            seq[("from", sender)] += 1
            with hub._cv:
                hub._wait(lambda: key in hub._box, self.rank, sender, step, "receive from")
                src = hub._box.pop(key)
            if src.numel() != buf.numel():
                raise TransferError(f"rank {self.rank}: {step}: chunk from rank {sender} has "
                                    f"{src.numel()} elements, expected {buf.numel()}")
            buf.copy_(src)
            with hub._cv:
                hub._taken.add(key)
                hub._cv.notify_all()
        with hub._cv:
            for key in posted:
                hub._wait(lambda: key in hub._taken, self.rank, key[1], step, "deliver to")
                hub._taken.discard(key)
