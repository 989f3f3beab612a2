"""cupy-NCCL transport: reallocation between jobs that share no torch process group.

    store = torch.distributed.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0))
    t = CupyNcclTransport(rank, world_size, store, timeout=60.0)   # or CupyNcclTransport.from_tcp
    Reallocator(plan, t, bucket_bytes=...).run(src_shard_on_gpu, dst_shard_on_gpu)

A trainer and an inference engine each have their own torch.distributed world (or none); they
meet in one NCCL communicator built from `cupy.cuda.nccl`, whose unique id rank 0 publishes in
a torch.distributed Store (a TCPStore bound to 127.0.0.1 by default, see `from_tcp`). Plan
ranks are ranks of this communicator.

Each round's sends and receives go inside one NCCL group call (groupStart/groupEnd) on the
transport's own communication stream, which first waits for torch's current stream (the packs
before it), as raw bytes (any dtype). Stream-ordered: `Handle.order()` makes the current stream
wait for the round's event (the unpack follows on it; no host wait), `Handle.wait()` watches it
on the host against the deadline. A chunk with several receivers (broadcast-mode
plans) is sent to each receiver inside the same group call: one communicator has no subgroups,
so `sent_bytes` then counts every copy. `Handle.wait()` polls a CUDA event against the round's
deadline and NCCL's async error state; on a timeout or error the communicator is aborted and a
TransferError names this rank, the peers and the round.

cupy is imported lazily, so CPU installs never need it (pip install cupy-cuda13x on GPUs).
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import torch

from .base import Handle, Recvs, Sends, TransferError, Transport


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError(
            "CupyNcclTransport needs cupy with NCCL (pip install cupy-cuda13x, or "
            f"the cupy build matching your CUDA): {e}"
        ) from e
    return nccl


class CupyNcclTransport(Transport):
    name = "cupy-nccl"
    asynchronous = True
    stream_ordered = True

    def __init__(
        self,
        rank: int,
        world_size: int,
        store,
        *,
        timeout: float = 60.0,
        key: str = "real_py/nccl_unique_id",
        device: int | None = None,
    ):
        """rank / world_size: this process's place in the new communicator. store: any
        torch.distributed Store every member can reach. key: the store key of the unique id
        (use a distinct key per communicator). device: CUDA device index (default: current)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside [0, world_size={world_size})")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        nccl = _nccl()
        self._lib, self.rank, self.world, self.timeout = nccl, rank, world_size, float(timeout)
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.sent_bytes = self.received_bytes = 0
        self._broken: str | None = None
        if rank == 0:
            uid = nccl.get_unique_id()  # cupy >= 14: bytes; older: a tuple of signed chars
            store.set(key, json.dumps({"id": list(uid), "bytes": isinstance(uid, bytes)}))
        else:
            store.wait([key], datetime.timedelta(seconds=self.timeout))
        shared = json.loads(store.get(key))
        uid = bytes(shared["id"]) if shared["bytes"] else tuple(shared["id"])
        # ncclCommInitRank blocks until every rank joined; run it in a thread so a missing
        # rank is a TransferError after `timeout` instead of a hang.
        box = {}

        def init():
            try:
                with torch.cuda.device(self.device):
                    box["comm"] = nccl.NcclCommunicator(world_size, uid, rank)
            except BaseException as e:
                box["error"] = e

        th = threading.Thread(target=init, daemon=True, name=f"nccl-init-rank{rank}")
        th.start()
        th.join(self.timeout)
        if "comm" not in box:
            why = box.get("error", f"not every rank joined within {self.timeout:g} s")
            raise TransferError(
                f"rank {rank}: NCCL communicator init ({world_size} ranks, store "
                f"key {key!r}) failed: {why}"
            )
        self.comm = box["comm"]
        self.stream = torch.cuda.Stream(self.device)
        """The communication stream: rounds run here, ordered after the current stream."""

    @classmethod
    def from_tcp(
        cls,
        rank: int,
        world_size: int,
        *,
        port: int,
        host: str = "127.0.0.1",
        timeout: float = 60.0,
        **kwargs,
    ) -> CupyNcclTransport:
        """Rank 0 hosts a TCPStore on host:port (loopback by default) for the id exchange."""
        from torch.distributed import TCPStore

        store = TCPStore(
            host,
            port,
            world_size,
            is_master=(rank == 0),
            timeout=datetime.timedelta(seconds=timeout),
        )
        return cls(rank, world_size, store, timeout=timeout, **kwargs)

    def start(self, sends: Sends, recvs: Recvs, step: str) -> Handle:
        if self._broken:
            raise TransferError(
                f"rank {self.rank}: {step}: communicator was aborted earlier "
                f"({self._broken}); build a new transport"
            )
        nccl, peers = self._lib, set()
        for _, t in sends:
            self._check(t, step)
        for _, t, _ in recvs:
            self._check(t, step)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the packs (and anything else) posted before
        for _, t in sends:
            t.record_stream(self.stream)  # the caching allocator: in use until this stream is done
        for _, t, _ in recvs:
            t.record_stream(self.stream)
        stream = self.stream.cuda_stream
        nccl.groupStart()
        try:
            for receivers, t in sends:
                n = t.numel() * t.element_size()
                for r in receivers:
                    self.comm.send(t.data_ptr(), n, nccl.NCCL_UINT8, r, stream)
                    self.sent_bytes += n
                    peers.add(r)
            for sender, t, _ in recvs:
                n = t.numel() * t.element_size()
                self.comm.recv(t.data_ptr(), n, nccl.NCCL_UINT8, sender, stream)
                self.received_bytes += n
                peers.add(sender)
        finally:
            nccl.groupEnd()
        event = torch.cuda.Event()
        event.record(self.stream)
        return _NcclHandle(self, event, sorted(peers), step)

    def _check(self, t: torch.Tensor, step: str) -> None:
        if not t.is_cuda or t.device.index != self.device or not t.is_contiguous():
            raise ValueError(
                f"rank {self.rank}: {step}: NCCL needs contiguous tensors on cuda:"
                f"{self.device}, got {t.device} (contiguous={t.is_contiguous()})"
            )

    def _abort(self, why: str) -> None:
        self._broken = why
        try:
            self.comm.abort()
        except Exception:
            pass

    def close(self) -> None:
        if not self._broken and getattr(self, "comm", None) is not None:
            self.comm.destroy()
            self.comm = None


class _NcclHandle(Handle):
    def __init__(self, t: CupyNcclTransport, event, peers: list[int], step: str):
        self.t, self.event, self.peers, self.step = t, event, peers, step
        self.deadline = time.monotonic() + t.timeout

    def order(self) -> None:
        self.deadline = time.monotonic() + self.t.timeout  # watched from here by wait()
        torch.cuda.current_stream(self.t.device).wait_event(self.event)

    def wait(self) -> None:
        t, sleep = self.t, 0.0
        while not self.event.query():
            try:
                t.comm.check_async_error()
            except Exception as e:
                t._abort(str(e))
                raise TransferError(
                    f"rank {t.rank}: {self.step}: NCCL error with peer ranks {self.peers}: {e}"
                ) from e
            if time.monotonic() > self.deadline:
                t._abort("timeout")
                raise TransferError(
                    f"rank {t.rank}: {self.step}: timed out after {t.timeout:g} s "
                    f"waiting for peer ranks {self.peers}"
                )
            sleep = min(0.002, sleep * 2 or 0.00005)
            time.sleep(sleep)


__all__ = ["CupyNcclTransport"]
