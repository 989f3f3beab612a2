"""Hardware profiles for the runtime estimator (all units SI: FLOP/s, bytes/s, bytes, seconds).

GPU profiles describe 8-GPU nodes (DGX/HGX class). Peak numbers are the dense bf16 datasheet
values; `flops_eff` and `hbm_eff` are the fractions a good implementation reaches (0.5 MFU for
large GEMMs, 0.8 of HBM bandwidth for streaming reads); link bandwidths are the values NCCL
achieves (ring all-reduce bus bandwidth intra-node, ~92% of the NIC inter-node), per GPU and
direction, so no extra factor applies to them. `cpu` is measured on this machine by
`calibrate_cpu()` (matmul, memcpy, gloo send/recv between 2 spawned ranks) and cached.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    name: str
    peak_flops: float
    """Dense peak FLOP/s of one device in the model dtype."""
    flops_eff: float
    """Fraction of peak a real kernel mix reaches."""
    hbm_bw: float
    """Device memory bandwidth, bytes/s."""
    hbm_eff: float
    intra_bw: float
    """Achieved per-device bandwidth to a device of the same node, bytes/s per direction."""
    inter_bw: float
    """Achieved per-device bandwidth to another node, bytes/s per direction."""
    intra_lat: float = 10e-6
    """Latency of one intra-node message or collective step, seconds."""
    inter_lat: float = 20e-6
    mem_bytes: float
    """Device memory, bytes."""
    mem_usable: float = 0.9
    """Fraction of memory a plan may use (context, allocator fragmentation take the rest)."""
    ranks_per_node: int = 8

    def __post_init__(self):
        for f in ("peak_flops", "flops_eff", "hbm_bw", "hbm_eff", "intra_bw", "inter_bw", "mem_bytes"):
            if not getattr(self, f) > 0:
                raise ValueError(f"HardwareProfile.{f}={getattr(self, f)} must be positive")
        if self.ranks_per_node < 1:
            raise ValueError(f"HardwareProfile.ranks_per_node={self.ranks_per_node} must be >= 1")

    @property
    def flops(self) -> float:
        """Achieved FLOP/s."""
        return self.peak_flops * self.flops_eff

    @property
    def mem_bw(self) -> float:
        """Achieved memory bandwidth, bytes/s."""
        return self.hbm_bw * self.hbm_eff

    @property
    def mem_limit(self) -> float:
        return self.mem_bytes * self.mem_usable


GB = 1e9
PROFILES: dict[str, HardwareProfile] = {
    # A100-SXM4-80G: 312 TFLOP/s bf16, 2.04 TB/s HBM2e, NVLink3 300 GB/s/dir (NCCL ~230),
    # HDR InfiniBand 200 Gb/s per GPU (NCCL ~23 GB/s).
    "a100": HardwareProfile(name="a100", peak_flops=312e12, flops_eff=0.5, hbm_bw=2.04e12, hbm_eff=0.8,
                            intra_bw=230 * GB, inter_bw=23 * GB, mem_bytes=80e9),
    # H100-SXM5-80G: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink4 450 GB/s/dir (NCCL ~360),
    # NDR InfiniBand 400 Gb/s per GPU (NCCL 46-48 GB/s).
    "h100": HardwareProfile(name="h100", peak_flops=989e12, flops_eff=0.5, hbm_bw=3.35e12, hbm_eff=0.8,
                            intra_bw=360 * GB, inter_bw=46 * GB, mem_bytes=80e9),
    # H200-SXM 141G: H100 compute with 4.8 TB/s HBM3e and 141 GB.
    "h200": HardwareProfile(name="h200", peak_flops=989e12, flops_eff=0.5, hbm_bw=4.8e12, hbm_eff=0.8,
                            intra_bw=360 * GB, inter_bw=46 * GB, mem_bytes=141e9),
}
PROFILE_NAMES = tuple(PROFILES) + ("cpu",)


def _cache_path() -> str:
    base = os.environ.get("REAL_PY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "real_py")
    return os.path.join(base, "cpu_profile.json")


def get_profile(name: str) -> HardwareProfile:
    """A profile by name; `cpu` is calibrated on first use and cached (see calibrate_cpu)."""
    key = name.lower().replace("-80g", "").replace("-", "")
    if key in PROFILES:
        return PROFILES[key]
    if key == "cpu":
        return cpu_profile()
    raise ValueError(f"unknown hardware profile {name!r}; allowed: {', '.join(PROFILE_NAMES)}")


def cpu_profile(refresh: bool = False) -> HardwareProfile:
    path = _cache_path()
    if not refresh and os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        if data.get("machine") == platform.node():
            return HardwareProfile(**data["profile"])
    prof, raw = calibrate_cpu()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": platform.node(), "measured": raw, "profile": asdict(prof)}, f, indent=1)
    return prof


def _gloo_pair(rank, world_size, nbytes, reps):
    import torch
    import torch.distributed as dist

    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    # One-byte round trips give the latency; large one-way transfers give the bandwidth.
    tiny = torch.zeros(1)
    for _ in range(3):
        (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
    t0 = time.perf_counter()
    for _ in range(reps):
        (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
    dist.barrier()
    bw_time = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(20):
        if rank == 0:
            dist.send(tiny, 1)
            dist.recv(tiny, 1)
        else:
            dist.recv(tiny, 0)
            dist.send(tiny, 0)
    lat = (time.perf_counter() - t0) / 40
    return bw_time, lat


def calibrate_cpu() -> tuple[HardwareProfile, dict]:
    """Measure this machine in a few seconds: fp32 matmul FLOP/s (one thread, as each gloo rank
    of the CPU runtime uses one), memcpy bandwidth, gloo send/recv bandwidth and latency."""
    import numpy as np
    import torch

    from ..testing import run_distributed

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            a @ b
            reps += 1
        flops = 2 * n ** 3 * reps / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    src = np.ones(64 << 20, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(5):
        np.copyto(dst, src)
    # Bytes read + written, like the GPU HBM figures.
    mem_bw = 2 * 5 * src.nbytes / (time.perf_counter() - t0)
    nbytes = 32 << 20
    res = run_distributed(_gloo_pair, 2, nbytes, 4, timeout=60)
    bw_time = max(r[0] for r in res)
    lat = max(r[1] for r in res)
    net_bw = nbytes / bw_time
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 8e9
    raw = {"matmul_flops": flops, "memcpy_bytes_per_s": mem_bw, "gloo_bytes_per_s": net_bw,
           "gloo_latency_s": lat, "mem_bytes": mem, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    # Efficiency factors are 1: the measured numbers already are what the runtime achieves.
    # All ranks share one machine (one "node" of up to 64 ranks; intra == inter bandwidth).
    prof = HardwareProfile(name="cpu", peak_flops=flops, flops_eff=1.0, hbm_bw=mem_bw, hbm_eff=1.0,
                           intra_bw=net_bw, inter_bw=net_bw, intra_lat=lat, inter_lat=lat,
                           mem_bytes=float(mem), mem_usable=0.5, ranks_per_node=64)
    return prof, raw
