"""Hardware profiles for the runtime estimator (all units SI: FLOP/s, bytes/s, bytes, seconds).

GPU profiles describe 8-GPU nodes (DGX/HGX class). Peak numbers are the dense bf16 datasheet
values; `flops_eff` and `hbm_eff` are the fractions a good implementation reaches (0.5 MFU for
large GEMMs, 0.8 of HBM bandwidth for streaming reads); link bandwidths are the values NCCL
achieves (ring all-reduce bus bandwidth intra-node, ~92% of the NIC inter-node), per GPU and
direction, so no extra factor applies to them. `cpu` is measured on this machine by
real_py.calibrate (the runtime's own engines and gloo, with 4 ranks busy) and cached there:
`get_profile` here only looks up the fixed profiles, `real_py.calibrate.resolve_profile` every name.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    # Fixed host-side seconds (op dispatch) per micro-batch, on top of the roofline terms. They
    # dominate small models run eagerly on a CPU; on GPUs launches overlap device work (and
    # decode runs as CUDA graphs), so the GPU profiles leave them at 0.
    layer_lat: float = 0.0
    """Per transformer layer per forward pass (prefill, inference, scoring)."""
    head_lat: float = 0.0
    """Per forward pass: embedding, head, log-probs or values."""
    decode_layer_lat: float = 0.0
    """Per transformer layer per decode step (one token, KV cache update)."""
    decode_lat: float = 0.0
    """Per decode step: head on the last token and sampling."""
    train_layer_lat: float = 0.0
    """Per transformer layer per optimizer step of one micro-batch: forward, backward, Adam."""
    train_lat: float = 0.0
    """Per optimizer step of one micro-batch: embedding, head, loss, their backward, Adam."""
    value_head_lat: float | None = None
    """head_lat of a model with a value head (one output per token instead of log-probs over the
    vocabulary, no entropy); None: head_lat."""
    value_train_lat: float | None = None
    """train_lat of a model with a value head; None: train_lat."""
    tp_head_lat: float = 0.0
    """Per forward pass with tp > 1: host work of the vocab-parallel embedding and head beyond
    the latency of their collectives."""
    tp_train_lat: float = 0.0
    """The same per optimizer step of one micro-batch (forward and backward)."""
    tp_decode_lat: float = 0.0
    """Per decode step with tp > 1: host work of the logits all-gather beyond its latency."""
    realloc_lat: float = 0.0
    """Per reallocation: planning lookup, buffer set-up, completion check."""
    lat_contention: float = 0.0
    """Growth of the collective latency per unit of contention above 1 (see contention())."""
    coll_lat_growth: float = 0.0
    """Growth of a collective's latency per rank beyond two, relative to intra_lat / inter_lat
    (the latency of a two-rank collective): a ring all-reduce over n ranks takes 2 (n - 1) steps
    where a pair takes 2, so 1.0 would be a ring whose every step costs what a pair's does; the
    `cpu` profile measures it (gloo, 4 busy ranks against pairs: ~0.6 on this machine) and applies
    it to broadcasts as well; 0: flat (the GPU profiles: NCCL's small-message trees and LL protocol
    keep it within a few microseconds on one node)."""
    p2p_lat_ratio: float = 1.0
    """Latency of one point-to-point message relative to a small collective's (intra_lat and
    inter_lat are collective latencies; gloo's all-reduce takes several round trips): a
    pipeline hop, and the last stage's broadcast of results or new tokens (no reduction: over a
    pair of stages one message; grown by coll_lat_growth for more stages)."""
    pipe_wait_lat: float = 0.0
    """Extra seconds of each message between pipeline stages (activation hop, the last stage's
    broadcast, a stage group's all-reduce) when dp > 1 replicas of a pipeline share the cores:
    each replica's stages hand over at their own times, so a woken stage often finds its core
    taken by another replica's working stage, although no more ranks work at once than there
    are cores. A wait per hand-over, not a stretch of the stages' work: a pass with more work
    between hand-overs loses a smaller share. The `cpu` profile measures it (calibrate/measure.py:
    pp=2 engines on every pair of ranks at once, as many working stages as cores, against phase A's
    pairs, half as many); 0: each device is its own processor (the GPU profiles)."""
    shared_cores: int = 0
    """CPU runtime: the ranks share this many cores, so a call on n > shared_cores ranks runs
    n / shared_cores times slower (every rank is one single-threaded process); 0: each device
    is its own processor."""

    def __post_init__(self):
        for f in (
            "peak_flops",
            "flops_eff",
            "hbm_bw",
            "hbm_eff",
            "intra_bw",
            "inter_bw",
            "mem_bytes",
        ):
            if not getattr(self, f) > 0:
                raise ValueError(f"HardwareProfile.{f}={getattr(self, f)} must be positive")
        for f in (
            "layer_lat",
            "head_lat",
            "decode_layer_lat",
            "decode_lat",
            "train_layer_lat",
            "train_lat",
            "tp_head_lat",
            "tp_train_lat",
            "tp_decode_lat",
            "realloc_lat",
            "intra_lat",
            "inter_lat",
            "p2p_lat_ratio",
            "lat_contention",
            "coll_lat_growth",
            "pipe_wait_lat",
        ):
            if not getattr(self, f) >= 0:
                raise ValueError(f"HardwareProfile.{f}={getattr(self, f)} must be >= 0")
        for f in ("value_head_lat", "value_train_lat"):
            if getattr(self, f) is not None and not getattr(self, f) >= 0:
                raise ValueError(f"HardwareProfile.{f}={getattr(self, f)} must be >= 0 (or None)")
        if self.shared_cores < 0:
            raise ValueError(f"HardwareProfile.shared_cores={self.shared_cores} must be >= 0")
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

    def pass_lat(self, head: str, train: bool) -> float:
        """Fixed seconds per forward pass (train: per optimizer step of one micro-batch) outside
        the layers, for a model with an `lm` or a `value` head."""
        if train:
            return (
                self.value_train_lat
                if head == "value" and self.value_train_lat is not None
                else self.train_lat
            )
        return (
            self.value_head_lat
            if head == "value" and self.value_head_lat is not None
            else self.head_lat
        )

    def contention(self, ranks: int) -> float:
        """Slow-down of processor work when `ranks` devices are busy on `shared_cores` cores."""
        return max(1.0, ranks / self.shared_cores) if self.shared_cores else 1.0

    def coll_lat(self, lat: float, n: int) -> float:
        """Latency of one collective over n ranks whose two-rank latency is `lat`."""
        return lat * (1.0 + self.coll_lat_growth * max(n - 2, 0))

    def lat_slowdown(self, ranks: int) -> float:
        """Slow-down of a message's latency when `ranks` devices are busy (a peer may be waiting
        for a core before it answers)."""
        return 1.0 + self.lat_contention * (self.contention(ranks) - 1.0)

    @property
    def mem_limit(self) -> float:
        return self.mem_bytes * self.mem_usable


GB = 1e9
PROFILES: dict[str, HardwareProfile] = {
    # A100-SXM4-80G: 312 TFLOP/s bf16, 2.04 TB/s HBM2e, NVLink3 300 GB/s/dir (NCCL ~230),
    # HDR InfiniBand 200 Gb/s per GPU (NCCL ~23 GB/s).
    "a100": HardwareProfile(
        name="a100",
        peak_flops=312e12,
        flops_eff=0.5,
        hbm_bw=2.04e12,
        hbm_eff=0.8,
        intra_bw=230 * GB,
        inter_bw=23 * GB,
        mem_bytes=80e9,
    ),
    # H100-SXM5-80G: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink4 450 GB/s/dir (NCCL ~360),
    # NDR InfiniBand 400 Gb/s per GPU (NCCL 46-48 GB/s).
    "h100": HardwareProfile(
        name="h100",
        peak_flops=989e12,
        flops_eff=0.5,
        hbm_bw=3.35e12,
        hbm_eff=0.8,
        intra_bw=360 * GB,
        inter_bw=46 * GB,
        mem_bytes=80e9,
    ),
    # H200-SXM 141G: H100 compute with 4.8 TB/s HBM3e and 141 GB.
    "h200": HardwareProfile(
        name="h200",
        peak_flops=989e12,
        flops_eff=0.5,
        hbm_bw=4.8e12,
        hbm_eff=0.8,
        intra_bw=360 * GB,
        inter_bw=46 * GB,
        mem_bytes=141e9,
    ),
}
MEASURED = ("cpu",)
"""Profile names measured on this machine (real_py.calibrate.resolve_profile), not looked up."""
PROFILE_NAMES = tuple(PROFILES) + MEASURED


def get_profile(name: str) -> HardwareProfile:
    """A fixed profile by name (PROFILES; case, dashes and "-80g" ignored). A measured name
    (`cpu`) is refused: real_py.calibrate.resolve_profile calibrates it."""
    key = name.lower().replace("-80g", "").replace("-", "")
    if key in PROFILES:
        return PROFILES[key]
    if key in MEASURED:
        raise ValueError(
            f"hardware profile {name!r} is measured on this machine, not looked up: "
            f"resolve it with real_py.calibrate.resolve_profile({name!r}) and pass the profile"
        )
    raise ValueError(f"unknown hardware profile {name!r}; allowed: {', '.join(PROFILE_NAMES)}")
