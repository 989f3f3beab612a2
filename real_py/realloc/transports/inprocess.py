"""The in-process transport: all ranks of a plan inside one process (one thread per rank).

Two ways to move data, the same reallocator code above both:
  one pass (addressable)  every rank sees its peers' source buffers (`publish_sources`,
                          `peer_sources`), so a receiver copies each message straight from the
                          sender's source shard into its destination shard with one compiled
                          copy (realloc/direct.py); `wait_readers` returns once every reader of
                          this rank's source is done with it
  rounds (exchange)       a message is handed over as a tensor and copied by the receiver
                          (verify=True, and one_pass=False: the staged round loop of rounds.py)
Ranks wait on per-message slots, each with its own event, never on one shared condition; a rank
that fails (`fail`) wakes exactly the ranks waiting on it. `real_py.realloc.reallocator.
run_in_process` runs a plan on it; `InProcessMove` keeps the ranks' workers across calls.
"""

from __future__ import annotations

import threading

import torch

from .base import Recvs, Sends, TransferError, Transport


class _Slot:
    __slots__ = ("event", "value", "left")

    def __init__(self):
        self.event, self.value, self.left = threading.Event(), None, 0


class InProcessHub:
    """Slots shared by the in-process transports of one simulated world."""

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._slots: dict[tuple, _Slot] = {}
        self._failed: dict[int, str] = {}
        self._waiting: dict[int, set] = {}
        self._seq: dict[tuple, int] = {}

    def transport(self, rank: int) -> InProcessTransport:
        return InProcessTransport(self, rank)

    def fail(self, rank: int, why: str) -> None:
        """Mark `rank` as failed: every rank waiting on it raises instead of waiting."""
        with self._lock:
            self._failed[rank] = why
            waiting = list(self._waiting.pop(rank, ()))
        for ev in waiting:
            ev.set()

    def _slot(self, key) -> _Slot:
        with self._lock:
            s = self._slots.get(key)
            if s is None:
                s = self._slots[key] = _Slot()
            return s

    def _put(self, key, value, readers: int = 1) -> None:
        """Publish `value` under `key` for `readers` gets (the slot goes after the last)."""
        s = self._slot(key)
        s.value, s.left = value, readers
        s.event.set()

    def _get(self, key, rank: int, peer: int, step: str, what: str):
        """The value `peer` publishes under `key`; raises naming the peer if it failed or the
        hub's timeout passes first."""
        s = self._slot(key)
        if not s.event.is_set():
            with self._lock:
                failed = peer in self._failed
                if not failed:
                    self._waiting.setdefault(peer, set()).add(s.event)
            if not failed and not s.event.wait(self.timeout):
                raise TransferError(
                    f"rank {rank}: timed out after {self.timeout:.0f} s in {step} "
                    f"waiting to {what} peer rank {peer}"
                )
            with self._lock:
                self._waiting.get(peer, set()).discard(s.event)
        with self._lock:
            if key not in self._slots or self._slots[key] is not s or s.left == 0:
                # Woken by the peer's failure, not by its value.
                why = self._failed.get(peer, "no value")
                raise TransferError(
                    f"rank {rank}: peer rank {peer} failed during {step} ({why}) "
                    f"while waiting to {what} it"
                )
            s.left -= 1
            if s.left == 0:
                del self._slots[key]
            return s.value

    def _next(self, tag: str, rank: int) -> int:
        with self._lock:
            k = self._seq.get((tag, rank), 0)
            self._seq[(tag, rank)] = k + 1
            return k


class InProcessTransport(Transport):
    name = "inprocess"
    addressable = True

    def __init__(self, hub: InProcessHub, rank: int):
        self.hub, self.rank = hub, rank

    def fail(self, step: str, why: str) -> None:
        self.hub.fail(self.rank, f"{step}: {why}")

    # ------------------------------------------------------------------ one pass

    def publish_sources(self, step: str, tag: str, sources: dict, readers: int) -> int:
        """Publish this rank's source buffers ({buffer id: flat tensor}) for the next move of
        `tag`, read by `readers` ranks; returns the move's number. On a GPU they travel with an
        event recorded on this rank's current stream (readers' streams wait on it)."""
        seq = self.hub._next(tag, self.rank)
        if readers:
            self.hub._put(
                ("src", tag, seq, self.rank), (sources, _record(sources.values())), readers
            )
        return seq

    def peer_sources(self, step: str, tag: str, seq: int, peers) -> dict:
        """{peer: its published buffers} for every rank in `peers` (waits for them)."""
        out = {}
        for p in peers:
            bufs, event = self.hub._get(
                ("src", tag, seq, p), self.rank, p, step, "read the source buffers of"
            )
            _wait(event)
            out[p] = bufs
        return out

    def finish_reads(self, step: str, tag: str, seq: int, used, peers) -> None:
        """This rank issued every read of the buffers of `peers`; `used`: the tensors it wrote
        (on a GPU, a completion event is recorded on their device's current stream)."""
        if peers:
            self.hub._put(("done", tag, seq, self.rank), _record(used), len(peers))

    def wait_readers(self, step: str, tag: str, seq: int, readers) -> None:
        """Return once every rank in `readers` finished reading this rank's buffers (on a GPU:
        their completion ordered on this rank's current stream, no host wait on the device)."""
        for r in readers:
            _wait(
                self.hub._get(
                    ("done", tag, seq, r), self.rank, r, step, "see the end of the reads of"
                )
            )

    # ------------------------------------------------------------------ rounds

    def exchange(self, sends: Sends, recvs: Recvs, step: str) -> None:
        hub = self.hub
        seq: dict[tuple[str, int], int] = {}  # (direction, peer) -> messages so far
        posted = []
        for receivers, t in sends:
            for r in receivers:
                n = seq[("to", r)] = seq.get(("to", r), -1) + 1
                key = (self.rank, r, step, n)
                hub._put(("msg",) + key, t)
                posted.append(key)
        for sender, buf, *_ in recvs:
            n = seq[("from", sender)] = seq.get(("from", sender), -1) + 1
            key = (sender, self.rank, step, n)
            src = hub._get(("msg",) + key, self.rank, sender, step, "receive from")
            if src.numel() != buf.numel():
                raise TransferError(
                    f"rank {self.rank}: {step}: chunk from rank {sender} has "
                    f"{src.numel()} elements, expected {buf.numel()}"
                )
            buf.copy_(src)
            hub._put(("ack",) + key, True)
        for key in posted:
            hub._get(("ack",) + key, self.rank, key[1], step, "deliver to")


def _record(tensors):
    """(device, CUDA event recorded on its current stream) for the first CUDA tensor; None on
    the CPU, where every copy has completed when its call returns."""
    t = next((x for x in tensors if x is not None and x.is_cuda), None)
    if t is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return t.device, event


def _wait(recorded) -> None:
    """Order this thread's current stream after a `_record`ed event (no host wait)."""
    if recorded is not None:
        device, event = recorded
        torch.cuda.current_stream(device).wait_event(event)
