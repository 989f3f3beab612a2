"""Device choice of one rank: `device: auto|cpu|cuda` -> torch.device and the collective backend.

    dev = resolve_device("auto")        # cuda:{LOCAL_RANK} when torch sees a GPU, else cpu
    dist.init_process_group(backend_for(dev), ...)

On CUDA every rank owns one GPU, cuda:{LOCAL_RANK} (torchrun sets LOCAL_RANK; without it, the
global rank modulo the GPU count), made current with torch.cuda.set_device so that NCCL and
all_gather_object pick the same one. Collectives are NCCL on CUDA and gloo on CPU.
"""

from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cpu", "cuda")


def local_rank() -> int:
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return int(os.environ.get("RANK", "0")) % max(torch.cuda.device_count(), 1)


def resolve_device(name: str) -> torch.device:
    """ "cpu", "cuda" (error without a GPU) or "auto"; CUDA devices are made current."""
    if name not in DEVICES:
        raise ValueError(f"device={name!r}; allowed: {list(DEVICES)}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' but torch sees no GPU (CPU-only torch, no driver or "
            "CUDA_VISIBLE_DEVICES empty); use device: cpu or auto"
        )
    n = torch.cuda.device_count()
    r = local_rank()
    if r >= n:
        raise ValueError(
            f"local rank {r} has no GPU: this node has {n}; launch at most {n} processes per node"
        )
    torch.cuda.set_device(r)
    return torch.device("cuda", r)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def peak_memory_mib(device: torch.device) -> float:
    """torch.cuda.max_memory_allocated since the last reset, MiB (0.0 on CPU)."""
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**20


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


__all__ = [
    "resolve_device",
    "backend_for",
    "local_rank",
    "peak_memory_mib",
    "reset_peak_memory",
    "DEVICES",
]
