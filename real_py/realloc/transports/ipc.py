"""CUDA IPC transport: ranks in processes of one node read their peers' shard buffers directly.

    dist.init_process_group("gloo", ...)                 # any group: it only carries control
    t = IpcTransport(dist.group.WORLD, timeout=60.0)
    Reallocator(plan, t).run(src_shard_on_gpu, dst_shard_on_gpu)    # one pass (realloc/direct.py)

Beside DistTransport for ranks that share a node (GPUs of one machine, or several processes on
one GPU; a peer on another GPU is read over NVLink / PCIe, the copy enabling peer access on
first use): instead of sending, every rank maps its senders' source buffers into its own address
space and runs its one compiled copy from them (one kernel launch per rank and move; no staging,
no second copy, no network). Buffers are shared with torch's CUDA IPC (torch.multiprocessing's
reduce_tensor: cudaIpcGetMemHandle on the producer, a cached cudaIpcOpenMemHandle on the
consumer, with torch's reference counting keeping a block alive while a peer maps it); the
handles travel through the c10d store of the process group once per buffer: a later move with
the same buffers sends only a CUDA event, so each peer's buffers are mapped once.

Order, all on streams (the host only watches the store for timeouts and failure reports):
  publish   record an interprocess event on this rank's current stream (the source is ready)
  read      each reader's stream waits on its senders' events, then its copy runs; it records a
            "done" event on its stream and publishes it
  release   each sender's stream waits on its readers' "done" events: nothing this rank does to
            its source later on that stream (a write, freeing it) runs before every reader
            finished; the source is never written by the move.
Timeouts and errors as DistTransport: a wait past `timeout` raises TransferError naming this
rank, the peer and the step; `fail(step, why)` files a report that peers waiting on this rank
read within a fraction of a second and raise with (naming it and its reason).

One pass only: verify=True and one_pass=False need a transport with a wire (DistTransport). The
store keeps one small "done" key per rank and move (the source keys are deleted once read).
Needs a CUDA GPU; imports and constructs nowhere else (tests/test_realloc_ipc.py, marked cuda:
several processes on ONE GPU; the cross-GPU path has not run).
"""

from __future__ import annotations

import datetime
import pickle
import time

import torch
import torch.distributed as dist

from .base import Recvs, Sends, TransferError, Transport

POLL_S = 0.2
"""Store waits are cut into slices this long, between which failure reports are read."""


class IpcTransport(Transport):
    name = "cuda-ipc"
    addressable = True
    one_pass_only = True

    def __init__(self, group, *, timeout: float = 60.0, store=None, prefix: str = "real_py/ipc"):
        if group is None:
            raise ValueError(
                "IpcTransport needs an explicit process group "
                "(dist.group.WORLD for the default one)"
            )
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        self.group, self.timeout = group, float(timeout)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.prefix = f"{prefix}/{getattr(group, 'group_name', 'group')}"
        self._seq: dict[str, int] = {}
        self._sent: dict[str, tuple] = {}  # tag -> data pointers of the last published buffers
        self._mapped: dict[tuple, dict] = {}  # (tag, peer) -> its mapped buffers
        self._events: dict[tuple, list] = {}  # (tag, move) -> events peers open by handle

    def setup(self, plan) -> None:
        for r in plan.ranks():
            if not 0 <= r < self.world:
                raise ValueError(f"plan uses rank {r}, but the group has {self.world} ranks")

    def exchange(self, sends: Sends, recvs: Recvs, step: str) -> None:
        raise ValueError(
            "IpcTransport moves in one pass only; verify=True and one_pass=False need "
            "a transport with a wire (DistTransport over NCCL)"
        )

    # ------------------------------------------------------------------ one pass

    def publish_sources(self, step: str, tag: str, sources: dict, readers: int) -> int:
        from torch.multiprocessing.reductions import reduce_tensor

        seq = self._seq[tag] = self._seq.get(tag, -1) + 1
        # Events of move seq - 2 and older: every peer opened them before this move could start
        # (a peer publishes move seq - 1 only after its release of seq - 2).
        self._events.pop((tag, seq - 2), None)
        if not readers:
            return seq
        ptrs = tuple((b, t.data_ptr(), t.numel()) for b, t in sorted(sources.items()))
        fresh = self._sent.get(tag) != ptrs
        bufs = {b: reduce_tensor(t) for b, t in sources.items()} if fresh else None
        self._sent[tag] = ptrs
        device = next(iter(sources.values())).device
        event = self._event(tag, seq, device)
        self.store.set(
            self._key(tag, seq, "src", self.rank),
            pickle.dumps((bufs, event.ipc_handle(), device.index)),  # type: ignore[arg-type]
        )  # Store.set takes bytes as well as str (torch's stub names str only)
        return seq

    def peer_sources(self, step: str, tag: str, seq: int, peers) -> dict:
        out = {}
        device = torch.device("cuda", torch.cuda.current_device())
        for p in peers:
            bufs, handle, index = pickle.loads(
                self._get(self._key(tag, seq, "src", p), step, p, "read the source buffers of")
            )
            if bufs is not None:  # new buffers: map them (torch caches the mapping per block)
                self._mapped[(tag, p)] = {b: fn(*args) for b, (fn, args) in bufs.items()}
            elif (tag, p) not in self._mapped:
                raise TransferError(
                    f"rank {self.rank}: {step}: peer rank {p} reused buffers this rank never mapped"
                )
            # The event lives on the sender's GPU; this rank's stream waits on it (across GPUs).
            event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), handle)
            torch.cuda.current_stream(device).wait_event(event)
            out[p] = self._mapped[(tag, p)]
        return out

    def finish_reads(self, step: str, tag: str, seq: int, used, peers) -> None:
        if peers:
            device = next(
                (t.device for t in used if t is not None),
                torch.device("cuda", torch.cuda.current_device()),
            )
            done = (self._event(tag, seq, device).ipc_handle(), device.index)
            # Store.set takes bytes as well as str (torch's stub names str only)
            self.store.set(self._key(tag, seq, "done", self.rank), pickle.dumps(done))  # type: ignore[arg-type]

    def wait_readers(self, step: str, tag: str, seq: int, readers) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        for r in readers:
            handle, index = pickle.loads(
                self._get(self._key(tag, seq, "done", r), step, r, "see the end of the reads of")
            )
            event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), handle)
            torch.cuda.current_stream(device).wait_event(event)
        if readers:  # every reader fetched it
            self.store.delete_key(self._key(tag, seq, "src", self.rank))

    # ------------------------------------------------------------------ failures

    def fail(self, step: str, why: str) -> None:
        try:
            self.store.set(
                f"{self.prefix}/fail/{self.rank}", f"rank {self.rank} in {step}: {why}"[:2000]
            )
        except Exception:
            pass

    def _event(self, tag: str, seq: int, device) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
        event.record(torch.cuda.current_stream(device))
        self._events.setdefault((tag, seq), []).append(event)  # peers open it by handle: kept alive
        return event

    def _key(self, tag: str, seq: int, what: str, rank: int) -> str:
        return f"{self.prefix}/{tag}/{seq}/{what}/{rank}"

    def _get(self, key: str, step: str, peer: int, what: str) -> bytes:
        """The store value at `key`, published by `peer`; TransferError naming the peer if it
        reported a failure or `timeout` passed."""
        deadline = time.monotonic() + self.timeout
        fail_key = f"{self.prefix}/fail/{peer}"
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=POLL_S))
                return self.store.get(key)
            except RuntimeError:  # DistStoreError on a slice's timeout
                pass
            if self.store.check([fail_key]):
                why = self.store.get(fail_key).decode(errors="replace")
                raise TransferError(
                    f"rank {self.rank}: peer rank {peer} failed during {step} ({why}) "
                    f"while waiting to {what} it"
                )
            if time.monotonic() > deadline:
                raise TransferError(
                    f"rank {self.rank}: timed out after {self.timeout:g} s in {step} "
                    f"waiting to {what} peer rank {peer}"
                )


__all__ = ["IpcTransport"]
