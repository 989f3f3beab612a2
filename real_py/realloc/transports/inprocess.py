"""The in-process transport: all ranks of a plan inside one process (one thread per rank, a message
is a copy). The same reallocator code path as the distributed transports, fast enough to test
thousands of layout pairs; `real_py.realloc.reallocator.run_in_process` runs a plan on it.
"""

from __future__ import annotations

import threading
import time

import torch

from .base import Recvs, Sends, TransferError, Transport


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
