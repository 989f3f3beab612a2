"""Simulated reallocation time on DGX clusters: real_py's schedule vs its lower bound and vs a
broadcast-per-node strategy (real_py/realloc/simulate.py; no GPU needed).

    python bench/bench_cluster_sim.py

Cases: LLaMA-2-70B dp2,tp8,pp8 -> dp16,tp8,pp1 on 128 GPUs; LLaMA-3.1-405B
dp4,tp8,pp16 -> dp64,tp8,pp1 on 512 GPUs and dp8,tp8,pp16 -> dp128,tp8,pp1 on 1024 GPUs
(Megatron-style training layout -> tp8 generation replicas, colocated on the same GPUs), bf16,
p2p plans with ranks_per_node=8; the Reallocator's default 256 MiB bucket and a 1 GiB one.
Writes bench/results/cluster_sim_cpu2_<date>.{json,md}.
"""

from __future__ import annotations

import os
import sys
import time

from real_py import Layout, model_spec, plan_realloc
from real_py.realloc.simulate import CLUSTERS, broadcast_per_node, schedule_transfers, simulate
from real_py.spec.config import preset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import hardware_tag, write_results

CASES = [
    ("llama2-70b", "dp2,tp8,pp8", "dp16,tp8,pp1", "dgx-h100"),
    ("llama2-70b", "dp2,tp8,pp8", "dp16,tp8,pp1", "dgx-h200"),
    # tp8 replicas of 405B hold ~101 GB of bf16 weights per GPU: H200 (141 GB), not H100.
    ("llama3.1-405b", "dp4,tp8,pp16", "dp64,tp8,pp1", "dgx-h200"),
    ("llama3.1-405b", "dp8,tp8,pp16", "dp128,tp8,pp1", "dgx-h200"),
]
BUCKETS_MIB = (256, 1024)


def main():
    rows = []
    for name, s, d, kind in CASES:
        model = model_spec(preset(name, dtype="bfloat16"), name)
        src, dst = Layout.parse(s), Layout.parse(d)
        gpus = max(max(src.ranks), max(dst.ranks)) + 1
        cluster = CLUSTERS[kind].sized(gpus=gpus)
        plan = plan_realloc(model, src, dst, ranks_per_node=cluster.gpus_per_node)
        t0 = time.perf_counter()
        base = simulate(broadcast_per_node(plan, cluster), cluster)
        for mib in BUCKETS_MIB:
            t1 = time.perf_counter()
            res = simulate(
                schedule_transfers(plan, (mib << 20) // model.element_size // 2), cluster
            )
            rows.append(
                {
                    "model": name,
                    "src": s,
                    "dst": d,
                    "cluster": f"{cluster.nodes} x {kind}",
                    "gpus": gpus,
                    "bucket_MiB": mib,
                    "rounds": res.rounds,
                    "real_py_s": res.seconds,
                    "lower_bound_s": res.lower_bound,
                    "ratio": res.ratio,
                    "goal_ratio": 1.3,
                    "nvlink_bound_s": res.nvlink_bound,
                    "nic_bound_s": res.nic_bound,
                    "bottleneck": res.bottleneck,
                    "bcast_per_node_s": base.seconds,
                    "bcast_bottleneck": base.bottleneck,
                    "speedup_vs_bcast": base.seconds / res.seconds,
                    "network_GB": res.network_bytes / 1e9,
                    "simulate_s": time.perf_counter() - t1,
                }
            )
            r = rows[-1]
            print(
                f"{name} {s} -> {d} on {r['cluster']} bucket {mib} MiB: {r['real_py_s']:.3f} s, "
                f"bound {r['lower_bound_s']:.3f} s (x{r['ratio']:.2f}, {r['bottleneck']}), "
                f"broadcast per node {r['bcast_per_node_s']:.3f} s ({r['bcast_bottleneck']})",
                flush=True,
            )
        del t0
    cols = (
        "model src dst cluster bucket_MiB rounds real_py_s lower_bound_s ratio goal_ratio "
        "nvlink_bound_s nic_bound_s bottleneck bcast_per_node_s speedup_vs_bcast network_GB"
    ).split()
    paths = write_results(
        "cluster_sim",
        hardware_tag("cpu"),
        rows,
        columns=cols,
        title="Simulated reallocation on DGX H100/H200 clusters (bf16, p2p, ranks_per_node=8)",
        notes="Simulated, not measured: real_py/realloc/simulate.py replays the schedule's rounds "
        "(links: NVLink 450 GB/s per GPU and direction, 8 x 50 GB/s NICs per node, one per "
        "GPU, 10 us per round and link). lower_bound_s: busiest link's bytes / bandwidth. "
        "bcast_per_node: one hub GPU per node receives every byte from other nodes and "
        "fans out over NVLink. History (70B case, 256 MiB): the former frontier-fill rule (a "
        "chunk at or after its ranks' current round, send + receive sharing the bucket) "
        "simulated 2.59 s = 8.4x the bound; earliest fit with a shared budget 0.64 s = "
        "2.09x; earliest fit with half a bucket per direction (now) below. Not captured: other "
        "jobs' traffic, NCCL chunking and channels, PCIe, switch oversubscription, local copies, "
        "pack/unpack kernels.",
    )
    print("wrote", *paths)


if __name__ == "__main__":
    main()
