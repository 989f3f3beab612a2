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

Addressable transports (`addressable = True`: in-process threads, CUDA IPC between processes of
one node) let a rank read its peers' source buffers: the Reallocator then moves every message in
one pass (realloc/direct.py: one compiled copy per rank from the senders' source shards straight
into its destination shard, no staging). They add, per move of a plan (its `tag`):
`publish_sources(step, tag, sources, readers) -> move number`, `peer_sources(step, tag, n,
peers) -> {peer: its buffers}`, `finish_reads(step, tag, n, used, peers)` (this rank's reads are
issued) and `wait_readers(step, tag, n, readers)` (return once every reader of this rank's source
finished), with the same timeouts and rank-naming errors as the rounds.

This module holds the interface; the implementations are `inprocess.py`, `dist.py` (torch.
distributed: gloo, NCCL), `nccl.py` (NCCL through cupy) and `ipc.py` (CUDA IPC on one node).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

Sends = Sequence[tuple[tuple[int, ...], torch.Tensor]]
"""(receivers, tensor) per outgoing chunk; several receivers for a broadcast."""
Recvs = Sequence[tuple[int, torch.Tensor, tuple[int, ...]]]
"""(sender, tensor to fill, all receivers of the chunk) per incoming chunk."""


class TransferError(RuntimeError):
    """A transfer step failed or timed out; the message names the rank, the peer and the step."""

    reported: bool = False
    """True once the transport reported it to its peers (the executor does not report it again)."""


class Handle:
    """A round in flight; `wait()` returns when it completed or raises TransferError.
    `order()`: on a stream-ordered transport, make the current CUDA stream wait for the round
    (the host does not wait; `wait()` later watches it against its deadline); elsewhere the
    same as wait()."""

    def wait(self) -> None:
        pass

    def order(self) -> None:
        self.wait()


DONE = Handle()


class Transport(abc.ABC):
    """Interface: `rank`, `start(...) -> Handle` or `exchange(...)` (implement at least one),
    optional `setup(plan)`, `fail(step, why)`, `close()`."""

    rank: int
    name = "transport"
    asynchronous = False
    """True when start() returns before the round completed (then double buffering pays off)."""
    addressable = False
    """True when the one-pass methods below exist: peers' buffers are readable from this rank."""
    stream_ordered = False
    """True when a round's completion can be ordered on the device (Handle.order: NCCL), so the
    round loop never waits on the host between rounds (rounds.py)."""

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
