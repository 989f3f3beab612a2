"""Offload a flat weight buffer to host memory between uses, keeping every view of it valid.

    off = HostOffload(shard.flat, name="ref shard on rank 0")
    nbytes, seconds = off.offload()   # weights -> host buffer; the working storage is freed
    ...                               # other work uses the freed memory
    nbytes, seconds = off.reload()    # storage re-allocated, weights copied back

The working storage is freed with `flat.untyped_storage().resize_(0)` (FSDP's trick): the
tensor, every view of it and every nn.Parameter wrapping a view keep pointing at the same
storage object, which simply has no bytes until `reload()` gives it its size back. So a model
built over a ModelShard (real_py.models.StageModel) needs no re-binding after a reload.

On CUDA the host buffer is pinned (page-locked) and both copies are non_blocking on the current
stream, followed by a synchronize of that stream (the times reported are the real transfer
times, and the device storage is only freed once the copy out has finished). On CPU the weights
really move into a separate host buffer and the working storage is really freed (its nbytes is
0 while offloaded), but the two live in the same memory: nothing is saved there; the CPU path
exists so that the runtime and its tests exercise the same code as on a GPU.

Misuse is an error, not a no-op: offload() of an offloaded buffer and reload() of a resident one
raise RuntimeError naming the buffer, since a caller that loses track of the state would
otherwise read freed (or stale) weights. The host buffer is allocated on the first offload() and
reused by every later one. Reading the tensor (or a view) while offloaded is undefined (its
storage has 0 bytes); callers check `offloaded` first (real_py.rlhf.models.Models does).
"""

from __future__ import annotations

import time

import torch


class HostOffload:
    """Moves one flat tensor (1-D, contiguous, sole user of its storage) to host and back."""

    def __init__(self, flat: torch.Tensor, name: str = "tensor"):
        storage = flat.untyped_storage()
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(
                f"HostOffload({name}): need a 1-D contiguous tensor, got shape "
                f"{tuple(flat.shape)} strides {flat.stride()}"
            )
        # Freeing the storage frees every tensor on it: it must hold exactly this buffer.
        if flat.storage_offset() != 0 or storage.nbytes() != flat.numel() * flat.element_size():
            raise ValueError(
                f"HostOffload({name}): the tensor must own its whole storage (offset "
                f"{flat.storage_offset()}, storage {storage.nbytes()} bytes, tensor "
                f"{flat.numel() * flat.element_size()} bytes); pass the shard's flat "
                "buffer, not a view of a larger one"
            )
        if not storage.resizable():
            raise ValueError(
                f"HostOffload({name}): its storage is not resizable (memory from "
                "numpy, a file or DLPack); copy it into a torch-allocated tensor first"
            )
        self.flat, self.name = flat, name
        self.nbytes = storage.nbytes()
        self.host: torch.Tensor | None = None
        self.offloaded = False

    def _sync(self) -> None:
        if self.flat.is_cuda:
            torch.cuda.current_stream(self.flat.device).synchronize()

    def offload(self) -> tuple[int, float]:
        """Copy the weights to the host buffer and free the working storage; (bytes, seconds)."""
        if self.offloaded:
            raise RuntimeError(f"HostOffload({self.name}): already offloaded; reload() it first")
        t0 = time.perf_counter()
        if self.host is None:
            self.host = torch.empty(
                self.flat.shape, dtype=self.flat.dtype, pin_memory=self.flat.is_cuda
            )
        self.host.copy_(self.flat, non_blocking=self.flat.is_cuda)
        self._sync()
        self.flat.untyped_storage().resize_(0)
        self.offloaded = True
        return self.nbytes, time.perf_counter() - t0

    def reload(self) -> tuple[int, float]:
        """Give the storage its size back and copy the weights in; (bytes, seconds)."""
        if not self.offloaded:
            raise RuntimeError(
                f"HostOffload({self.name}): not offloaded (resident, "
                f"{self.flat.untyped_storage().nbytes()} bytes); nothing to reload"
            )
        assert self.host is not None  # offloaded implies a host copy
        t0 = time.perf_counter()
        self.flat.untyped_storage().resize_(self.nbytes)
        self.flat.copy_(self.host, non_blocking=self.flat.is_cuda)
        self._sync()
        self.offloaded = False
        return self.nbytes, time.perf_counter() - t0

    def __repr__(self) -> str:
        state = "offloaded" if self.offloaded else "resident"
        pinned = self.host is not None and self.host.is_pinned()
        return f"HostOffload({self.name}, {self.nbytes} bytes, {state}, pinned host={pinned})"


__all__ = ["HostOffload"]
