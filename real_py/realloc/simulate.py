"""Cluster simulator: replay a reallocation schedule's rounds on a modelled topology.

    cluster = CLUSTERS["dgx-h100"].sized(nodes=16)
    res = simulate(schedule_transfers(plan), cluster)   # SimResult
    res.seconds, res.lower_bound, res.ratio, res.bottleneck

Topology: `nodes` x `gpus_per_node` GPUs, global rank r on node r // gpus_per_node. Every GPU
has an NVLink port (egress and ingress, `nvlink_GBps` each way, through the NVSwitch) and uses
NIC (local index * nics_per_node // gpus_per_node) of its node (rail-aligned; `nic_GBps` each
way). A transfer inside a node crosses its sender's NVLink egress and receiver's NVLink
ingress; between nodes, the sender's NIC egress and the receiver's NIC ingress (GPUDirect RDMA;
PXN routing over another GPU's NIC is not modelled). A multi-receiver chunk (broadcast mode) is
a pipelined chain sender -> r1 -> r2 ..., each hop crossing its own links with the full bytes.

Replay (round by round, as the Reallocator runs them): a round's transfers on a link start when
the link has finished its previous round's work and every rank using it in this round has
finished its own previous round; the link then needs its bytes over its bandwidth plus one
`latency_s` (a round's messages are posted together, one NCCL group). A transfer ends when the
slower of its two links ends; a rank's round ends with its last transfer. So no link ever
carries two rounds at once and the result is never below the lower bound.

Lower bound: the busiest link's total bytes over its bandwidth (NVLink and NIC separately; the
bound is the larger), i.e. what the move costs on this topology with perfect overlap.

Not captured: congestion from other jobs, NCCL's own chunking / protocol switches and
channel counts, PCIe between GPU and NIC, switch oversubscription above the nodes, local
copies (memory bandwidth), and pack/unpack kernels. See real_py/realloc/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .plan import ReallocPlan


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    nodes: int
    gpus_per_node: int
    nvlink_GBps: float
    """Per GPU and direction (NVLink 4 on H100/H200: 900 GB/s bidirectional = 450 each way)."""
    nics_per_node: int
    nic_GBps: float
    """Per NIC and direction (ConnectX-7 400 Gb/s = 50 GB/s)."""
    latency_s: float = 10e-6

    def __post_init__(self):
        for f in ("nodes", "gpus_per_node", "nics_per_node"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"Cluster {self.name!r}: {f}={getattr(self, f)} must be >= 1")
        for f in ("nvlink_GBps", "nic_GBps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Cluster {self.name!r}: {f}={getattr(self, f)} must be > 0")
        if self.latency_s < 0:
            raise ValueError(f"Cluster {self.name!r}: latency_s={self.latency_s} must be >= 0")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def sized(self, *, nodes: int | None = None, gpus: int | None = None) -> Cluster:
        """This kind of node, `nodes` of them (or enough for `gpus`)."""
        if gpus is not None:
            nodes = -(-gpus // self.gpus_per_node)
        return replace(self, nodes=nodes)


CLUSTERS = {
    # DGX H100 / H200: 8 GPUs on NVSwitch (NVLink 4, 450 GB/s each way per GPU), 8 ConnectX-7
    # 400 Gb/s compute NICs, one per GPU. The two presets differ in GPU memory, not links.
    "dgx-h100": Cluster("dgx-h100", 1, 8, 450.0, 8, 50.0, 10e-6),
    "dgx-h200": Cluster("dgx-h200", 1, 8, 450.0, 8, 50.0, 10e-6),
}


@dataclass(frozen=True, slots=True)
class Transfers:
    """Chunks to replay: chunk i goes from sender[i] to receivers[recv_ptr[i]:recv_ptr[i+1]]
    in round[i] with nbytes[i] bytes (rounds ascending)."""

    round: np.ndarray
    sender: np.ndarray
    recv_ptr: np.ndarray
    receivers: np.ndarray
    nbytes: np.ndarray
    label: str = ""

    @property
    def num_rounds(self) -> int:
        return int(self.round.max()) + 1 if len(self.round) else 0


@dataclass(frozen=True, slots=True)
class SimResult:
    seconds: float
    lower_bound: float
    nvlink_bound: float
    nic_bound: float
    bottleneck: str
    """The link that sets the lower bound."""
    rounds: int
    network_bytes: int

    @property
    def ratio(self) -> float:
        return self.seconds / self.lower_bound if self.lower_bound > 0 else 1.0

    def as_dict(self) -> dict:
        return {
            "seconds": self.seconds,
            "lower_bound": self.lower_bound,
            "nvlink_bound": self.nvlink_bound,
            "nic_bound": self.nic_bound,
            "ratio": self.ratio,
            "bottleneck": self.bottleneck,
            "rounds": self.rounds,
            "network_bytes": self.network_bytes,
        }


def schedule_transfers(
    plan: ReallocPlan, round_elems: int | None = None, direct_min_elems: int = 0
) -> Transfers:
    """Every chunk of the plan's schedule (sizes only, from C++; no descriptors). Defaults: the
    Reallocator's (256 MiB bucket, pipelined -> rounds of 64 MiB per rank and direction)."""
    es = plan.element_size
    if round_elems is None:
        round_elems = (256 << 20) // es // 2
    a = plan.rank_arrays(-1, round_elems, direct_min_elems)  # rank -1: every chunk, no descriptors
    rp, rc = a["msg_recv_ptr"], a["msg_receivers"]
    m = a["all_msg"]
    counts = (rp[1:] - rp[:-1])[m]
    ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    starts = rp[:-1][m]
    idx = np.repeat(starts - ptr[:-1], counts) + np.arange(ptr[-1])
    return Transfers(
        a["all_round"],
        a["msg_sender"][m],
        ptr,
        rc[idx],
        a["all_numel"] * es,
        label=f"real_py schedule ({plan.mode})",
    )


def _hops(t: Transfers):
    """(round, u, v, bytes) per hop; a multi-receiver chunk is a chain in receiver order."""
    counts = np.diff(t.recv_ptr)
    single = counts == 1
    rnd, u, v, b = (
        [t.round[single]],
        [t.sender[single]],
        [t.receivers[t.recv_ptr[:-1][single]]],
        [t.nbytes[single]],
    )
    for i in np.nonzero(~single)[0].tolist():
        chain = [int(t.sender[i])] + t.receivers[t.recv_ptr[i] : t.recv_ptr[i + 1]].tolist()
        rnd.append(np.full(len(chain) - 1, t.round[i]))
        u.append(np.array(chain[:-1]))
        v.append(np.array(chain[1:]))
        b.append(np.full(len(chain) - 1, t.nbytes[i]))
    cat = [np.concatenate(x).astype(np.int64) for x in (rnd, u, v, b)]
    order = np.argsort(cat[0], kind="stable")
    return [x[order] for x in cat]


def _link_name(link: int, c: Cluster) -> str:
    w, nk = c.gpus, c.nodes * c.nics_per_node
    if link < w:
        return f"NVLink egress of GPU {link}"
    if link < 2 * w:
        return f"NVLink ingress of GPU {link - w}"
    k = link - 2 * w
    side = "egress" if k < nk else "ingress"
    k %= nk
    return f"NIC {k % c.nics_per_node} of node {k // c.nics_per_node} ({side})"


def simulate(t: Transfers, cluster: Cluster) -> SimResult:
    """Replay `t` on `cluster` (see the module docstring for the model)."""
    c = cluster
    rnd, u, v, nb = _hops(t)
    w = c.gpus
    if len(u) and max(int(u.max()), int(v.max())) >= w:
        raise ValueError(
            f"transfers use rank {max(int(u.max()), int(v.max()))}, cluster "
            f"{c.name} has {w} GPUs ({c.nodes} nodes x {c.gpus_per_node})"
        )
    if len(u) and (u == v).any():
        raise ValueError("a transfer from a rank to itself (local copies are not transfers)")
    nk = c.nodes * c.nics_per_node
    gpn = c.gpus_per_node
    nic = lambda r: (r // gpn) * c.nics_per_node + (r % gpn) * c.nics_per_node // gpn
    inter = u // gpn != v // gpn
    l1 = np.where(inter, 2 * w + nic(u), u)  # egress link
    l2 = np.where(inter, 2 * w + nk + nic(v), w + v)  # ingress link
    bw = np.concatenate((np.full(2 * w, c.nvlink_GBps), np.full(2 * nk, c.nic_GBps))) * 1e9
    nlinks = len(bw)
    total = np.zeros(nlinks)
    np.add.at(total, l1, nb)
    np.add.at(total, l2, nb)
    per_link = total / bw
    nvl = float(per_link[: 2 * w].max()) if w else 0.0
    nicb = float(per_link[2 * w :].max()) if nk else 0.0
    bound = max(nvl, nicb)
    bottleneck = _link_name(int(per_link.argmax()), c) if len(nb) else "none"

    from ..ops import extension

    # The replay is sequential over rounds (each starts from the previous one's link and rank
    # times): C++ (csrc/planner/replay.cpp), ~0.1 ms per round in numpy, which the plan search
    # paid for every layout pair it priced.
    bounds = (
        np.searchsorted(rnd, np.arange(t.num_rounds + 1)) if len(rnd) else np.zeros(1, np.int64)
    )
    seconds = extension().replay_rounds(
        u, v, l1, l2, nb.astype(np.float64), bounds, bw, w, c.latency_s
    )
    return SimResult(seconds, bound, nvl, nicb, bottleneck, t.num_rounds, int(nb.sum()))


def broadcast_per_node(plan: ReallocPlan, cluster: Cluster) -> Transfers:
    """The baseline strategy on the same topology (checkpoint-engine style): every destination
    node has one chosen GPU, its hub (lowest destination rank on the node), through which all
    bytes from other nodes enter: for each destination shard (stage, tp rank) present on the
    node, the bytes of the receiver needing most of it cross once, from the plan's senders to
    the hub (round 0); the hub then sends every GPU of the node its remote bytes over NVLink
    (round 1). Transfers inside a node stay as planned (round 0); no bucketing."""
    gpn = cluster.gpus_per_node
    es = plan.element_size
    hub: dict[int, int] = {}
    for r in sorted(plan.dst.ranks):
        hub.setdefault(r // gpn, r)
    remote: dict[int, list[tuple[int, int]]] = {}  # receiver -> [(sender, bytes)] across nodes
    rows = []  # (round, sender, receiver, bytes)
    for m in range(plan.num_messages):
        s, n = int(plan.msg_sender[m]), int(plan.msg_numel[m]) * es
        for r in plan.receivers(m):
            if s // gpn == r // gpn:
                rows.append((0, s, r, n))
            else:
                remote.setdefault(r, []).append((s, n))
    groups: dict[tuple, list[int]] = {}
    for r in sorted(remote):
        d, k, stage = plan.dst.coords(r)
        groups.setdefault((r // gpn, stage, k), []).append(r)
    for (node, _, _), members in groups.items():
        h = hub[node]
        rep = max(members, key=lambda r: (sum(n for _, n in remote[r]), -r))
        rows += [(0, s, h, n) for s, n in remote[rep]]
        rows += [(1, h, r, sum(n for _, n in remote[r])) for r in members if r != h]
    rows.sort(key=lambda x: x[0])
    a = np.array(rows, np.int64).reshape(-1, 4)
    return Transfers(
        a[:, 0],
        a[:, 1],
        np.arange(len(a) + 1, dtype=np.int64),
        a[:, 2],
        a[:, 3],
        label="broadcast per node",
    )


__all__ = [
    "Cluster",
    "CLUSTERS",
    "Transfers",
    "SimResult",
    "schedule_transfers",
    "simulate",
    "broadcast_per_node",
]
