"""Pack/unpack ops: descriptor-driven strided byte copies between flat buffers.

    pack(src, descs, out)       src [S] flat buffer -> out [P] packed buffer
    unpack(packed, descs, dst)  packed [P] -> dst [D] flat buffer (also local flat -> flat)

descs: [k, 6] int64 CPU tensor in ELEMENTS of the buffers' dtype, rows (src_off, dst_off, len,
n, src_stride, dst_stride): run i copies src[src_off + i*src_stride : +len] to
dst[dst_off + i*dst_stride : +len]. Message.pack_descs()/unpack_descs() produce them.
Buffers: 1-D, contiguous, one dtype (any element size), one device (CPU, or CUDA when the
extension was built with CUDA; the CUDA kernels run on the current stream). Bad arguments raise
ValueError before anything is written.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from . import _C  # noqa: F401  (loading the extension registers torch.ops.real_py)


def pack(src: torch.Tensor, descs: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the runs of `descs` out of flat buffer `src` into `out` (the packed buffer)."""
    torch.ops.real_py.pack(src, descs, out)


def unpack(packed: torch.Tensor, descs: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the runs of `descs` out of `packed` into flat buffer `dst`."""
    torch.ops.real_py.unpack(packed, descs, dst)


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


__all__ = ["pack", "unpack", "descs_tensor"]
