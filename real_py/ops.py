"""Pack/unpack ops: descriptor-driven strided byte copies between flat buffers.

    pack(src, descs, out)       src [S] flat buffer -> out [P] packed buffer
    unpack(packed, descs, dst)  packed [P] -> dst [D] flat buffer (also local flat -> flat)
    CopyPlan(descs8, element_size, device).run(srcs, dsts)
                                a copy compiled once: descriptors over several source and
                                destination buffers, kept on the device as work items; each run
                                is one kernel launch (GPU) or one C++ call (CPU)

descs: [k, 6] int64 CPU tensor in ELEMENTS of the buffers' dtype, rows (src_off, dst_off, len,
n, src_stride, dst_stride): run i copies src[src_off + i*src_stride : +len] to
dst[dst_off + i*dst_stride : +len]. Message.pack_descs()/unpack_descs() produce them.
Buffers: 1-D, contiguous, one dtype (any element size), one device (CPU, or CUDA when the
extension was built with CUDA; the CUDA kernels run on the current stream). Bad arguments raise
ValueError before anything is written. `import real_py` registers the ops
(torch.ops.real_py.pack / unpack); these wrappers are also real_py.pack / real_py.unpack.

Example (gather two strided runs of a [4, 6] matrix's columns 2..3, then scatter them back):

>>> import torch, real_py
>>> src = torch.arange(24, dtype=torch.float32)           # a [4, 6] matrix, flat
>>> descs = torch.tensor([[2, 0, 2, 4, 6, 2]])            # 4 runs of 2: columns 2..3 of each row
>>> packed = torch.empty(8)
>>> real_py.pack(src, descs, packed)
>>> packed.tolist()
[2.0, 3.0, 8.0, 9.0, 14.0, 15.0, 20.0, 21.0]
>>> dst = torch.zeros(24)
>>> real_py.unpack(packed, torch.tensor([[0, 2, 2, 4, 2, 6]]), dst)
>>> torch.equal(dst.view(4, 6)[:, 2:4], src.view(4, 6)[:, 2:4])
True
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import numpy as np
import torch

# The compiled extension (real_py/_C*.so); loading it registers torch.ops.real_py. Loaded by name:
# the import graph cannot see a compiled module and would record `from . import _C` as an import
# of the package root.
_C = importlib.import_module(f"{__package__}._C")


def extension() -> ModuleType:
    """The compiled extension module: the ops, the reallocation planner, the round replay and the
    search evaluator. Its one home; other modules take it from here."""
    return _C


def pack(src: torch.Tensor, descs: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the runs of `descs` out of flat buffer `src` into `out` (the packed buffer).

    src: [S] 1-D contiguous; descs: [k, 6] int64 CPU, elements (src_off, dst_off, len, n,
    src_stride, dst_stride); out: [P] same dtype and device as src, written in place
    (run i of row j lands at out[dst_off + i*dst_stride : +len]). Returns None.
    """
    torch.ops.real_py.pack(src, descs, out)


def unpack(packed: torch.Tensor, descs: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the runs of `descs` out of `packed` into flat buffer `dst`.

    packed: [P] 1-D contiguous; descs: [k, 6] int64 CPU, elements, read side first as in pack;
    dst: [D] same dtype and device, written in place. Same kernel as pack (the name says which
    side is the flat shard buffer). Returns None.
    """
    torch.ops.real_py.unpack(packed, descs, dst)


_CPU_ITEM_BYTES = 16 << 10


class CopyPlan:
    """A strided copy compiled once and replayed: `run(srcs, dsts)` copies every run of `descs`.

    descs: [k, 8] int64 in ELEMENTS, rows (src_off, dst_off, len, n, src_stride, dst_stride,
    src_buf, dst_buf): run i copies srcs[src_buf][src_off + i*src_stride : +len] to
    dsts[dst_buf][dst_off + i*dst_stride : +len]. The descriptors are checked and turned into work
    items (csrc/ops/copy_items.h: slices of at most 16 KiB of long runs, or a few whole short
    runs, each with its own addresses) once, here, and the item table is uploaded to `device` once.
    A run checks the buffers against the plan's bounds and makes one call of real_py::copy_planned
    per group of 64 source x 64 destination buffers (one group: one launch). Buffers: 1-D
    contiguous, destinations on `device` (on a GPU a source may be on another GPU: the kernel runs
    on `device` and reads it by peer access, enabled on first use, or refuses the pair; the caller
    orders the source's writes before the run, as IpcTransport does with events), any dtype of
    `element_size` bytes; no destination byte written twice
    (the plan's descriptors are disjoint on the destination side), no source sharing memory with a
    destination. CUDA: on the current stream."""

    def __init__(self, descs: np.ndarray, element_size: int, device="cpu", item_bytes: int = 0):
        d = np.ascontiguousarray(descs, dtype=np.int64).reshape(-1, 8)
        self.device = torch.device(device)
        self.element_size = int(element_size)
        self.bytes = 0
        self.groups: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        """(first source buffer, first destination buffer, items on device, bounds) per launch."""
        blocks = (d[:, 6] // 64) * 65536 + d[:, 7] // 64
        for key in np.unique(blocks).tolist():
            part = d[blocks == key].copy()
            a, b = (key // 65536) * 64, (key % 65536) * 64
            part[:, 6] -= a
            part[:, 7] -= b
            # A CPU runs items in tasks of ~256 KiB on a few threads: the largest items (16 KiB)
            # cost the least per byte there; a GPU gets smaller ones for small plans (one warp
            # each, enough of them to fill the device: csrc/ops/copy_items.cpp).
            ib = item_bytes or (_CPU_ITEM_BYTES if self.device.type == "cpu" else 0)
            items, bounds, nbytes = _C.copy_plan(part, self.element_size, ib)
            if nbytes == 0:
                continue
            self.bytes += nbytes
            self.groups.append(
                (a, b, torch.from_numpy(items).to(self.device), torch.from_numpy(bounds))
            )
        self._empty: torch.Tensor | None = None

    @property
    def num_items(self) -> int:
        return sum(g[2].shape[0] for g in self.groups)

    @property
    def table_bytes(self) -> int:
        """Device memory of the item tables (48 bytes per item)."""
        return self.num_items * 48

    def run(self, srcs, dsts) -> None:
        """Copy; srcs / dsts: sequences of flat buffers indexed by the descriptors' src_buf /
        dst_buf (None where the plan addresses none)."""
        for a, b, items, bounds in self.groups:
            s = [self._buf(x) for x in srcs[a : a + 64]]
            t = [self._buf(x) for x in dsts[b : b + 64]]
            torch.ops.real_py.copy_planned(s, t, items, bounds)

    def _buf(self, x):
        if x is not None:
            return x
        if self._empty is None:
            self._empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        return self._empty


def descs_tensor(descs: np.ndarray) -> torch.Tensor:
    """[k, 6] int64 numpy array -> CPU int64 tensor sharing its memory (copies only if the array
    is not already C-contiguous int64)."""
    a = np.ascontiguousarray(descs, dtype=np.int64)
    if a.ndim != 2 or a.shape[1] != 6:
        raise ValueError(f"descs must be [k, 6] int64, got shape {a.shape}")
    if a.flags.writeable:
        return torch.from_numpy(a)
    # Plans freeze their arrays; the ops only read descs, so sharing read-only memory is safe.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


@torch.library.register_fake("real_py::pack")
def _pack_fake(src, descs, out):
    return None


@torch.library.register_fake("real_py::unpack")
def _unpack_fake(packed, descs, dst):
    return None


@torch.library.register_fake("real_py::copy_planned")
def _copy_planned_fake(srcs, dsts, items, bounds):
    return None


# The schemas live in C++ (csrc/ops/ops.cpp), which cannot carry docstrings; help() on the op
# packets shows these instead.
torch.ops.real_py.pack.__doc__ = (
    "real_py::pack(Tensor src, Tensor descs, Tensor(a!) out) -> ()\n\n" + (pack.__doc__ or "")
)
torch.ops.real_py.unpack.__doc__ = (
    "real_py::unpack(Tensor packed, Tensor descs, Tensor(a!) dst) -> ()\n\n"
    + (unpack.__doc__ or "")
)

__all__ = ["CopyPlan", "pack", "unpack", "descs_tensor", "extension"]
