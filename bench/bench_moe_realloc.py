"""MoE reallocation: real_py against Megatron-core on 4 gloo ranks, and simulated large MoE models.

    python bench/bench_moe_realloc.py [--repeats 5] [--timeout 600]

Gloo rows: a small MoE model (8 experts) on the 4 gloo ranks of bench_realloc.py, four
expert-layout pairs (ep / etp changes), real_py's MoeReallocator against Megatron-core's
resharding (bench/realloc_mcore.py; `make bench-realloc` installs it), each verified bit for bit
against slicing the full tensors (tests/support/oracle.py), timed interleaved. Simulated rows: the
cluster simulator on Qwen3-235B-A22B (one 8-GPU node) and a Kimi-K2-shaped 1T model (256 GPUs)
against the link lower bound and checkpoint-engine's published figures. Writes
bench/results/moe_realloc_<hw>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from bench_realloc import WORLD, log, measure_links, sum_ranks, timed

from real_py import Layout, ModelConfig, model_spec
from real_py.realloc.shard import ModelShard

MOE_CONFIG = ModelConfig(
    hidden_size=512,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8000,
    num_hidden_layers=8,
    num_experts=8,
    moe_intermediate_size=512,
    num_experts_per_tok=2,
    mlp_only_layers=(0,),
)
MOE_PAIRS = [
    ("dp4,ep2", "dp2,tp2,etp2"),
    ("dp2,tp2,etp2", "dp4,ep2"),
    ("dp4,ep4", "dp2,tp2,etp2"),
    ("dp2,tp2,ep2", "dp2,tp2,ep4"),
]
# checkpoint-engine's published seconds and what they measured, per model
QWEN_CE = (6.22, "8 H800, vLLM TP8, BF16")
KIMI_CE = (16.04, "256 H20, 16 vLLM TP16 instances, FP8")
MOE_SIM = [  # (model, gpus, src, dst, checkpoint-engine's seconds, its setup)
    ("qwen3-235b-a22b", 8, "dp2,tp4,ep8", "dp2,tp4,etp8", *QWEN_CE),
    ("qwen3-235b-a22b", 8, "dp1,tp4,pp2,ep4", "dp2,tp4,etp8", *QWEN_CE),
    ("qwen3-235b-a22b", 8, "dp1,tp4,pp2,ep4", "dp2,tp4,ep8", *QWEN_CE),
    ("kimi-k2-shaped", 256, "dp4,tp8,pp8,ep32", "dp16,tp16,etp16", *KIMI_CE),
]


def _mcore_moe_setup() -> dict | str:
    """Megatron-core's resharding for the MoE rows: loaded module, groups, copy service; or why
    not."""
    try:
        import realloc_mcore

        mc = realloc_mcore.load()
        return {
            "mcore": mc,
            "groups": realloc_mcore.GroupCache(),
            "service": mc.copy_services.GlooCopyService(),
        }
    except (ImportError, RuntimeError) as e:
        return f"not run: {e}"


def _mcore_moe(ctx, model, plan, rank, full):
    """(MegatronMoeResharder over its own shards (source filled from `full`, destination empty),
    check() -> bool: destination bit for bit against tests/support/oracle.py, zero(): clear the
    destination), or ("n/a: <why>", None, None) where Megatron refuses the pair."""
    if isinstance(ctx, str):
        return ctx, None, None
    import realloc_mcore
    from support.oracle import expert_oracle, oracle_flat

    from real_py.realloc import ExpertShard

    dense, src, dst = plan.parts[0].plan, plan.src, plan.dst
    src_d = (
        ModelShard.from_full(dense.model, dense.src, rank, full)
        if rank in dense.src.ranks
        else None
    )
    src_e = (
        ExpertShard.from_full(model, src, rank, full)
        if src.expert_coords(rank) is not None
        else None
    )
    dst_d = ModelShard.empty(dense.model, dense.dst, rank) if rank in dense.dst.ranks else None
    dst_e = ExpertShard.empty(model, dst, rank) if dst.expert_coords(rank) is not None else None
    try:  # collective; a refusal raises on every rank alike (MegatronMoeResharder)
        m = realloc_mcore.MegatronMoeResharder(
            ctx["mcore"],
            ctx["groups"],
            ctx["service"],
            model,
            dense,
            src,
            dst,
            src_d,
            src_e,
            dst_d,
            dst_e,
        )
    except (ValueError, RuntimeError, NotImplementedError, KeyError) as e:
        return f"n/a: {e}", None, None

    def check() -> bool:
        ok = dst_d is None or torch.equal(
            dst_d.flat, oracle_flat(dense.model, dense.dst, rank, full)
        )
        if dst_e is not None:
            got, want = dst_e.params(), expert_oracle(model, dst, rank, full)
            ok &= set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
        return sum_ranks(0.0 if ok else 1.0) == 0

    def zero():
        for b in (dst_d, dst_e):
            if b is not None:
                b.flat.zero_()

    return m, check, zero


def moe_worker(rank, world, args) -> dict | None:
    """Each MoE pair: real_py's MoeReallocator (all parts as one merged schedule, gloo) on the
    rank's ModelShard + ExpertShard, and Megatron-core's resharding (_mcore_moe), each verified
    bit for bit against slicing the full tensors (tests/support/oracle.py), timed interleaved as a
    median of --repeats."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.oracle import expert_oracle, oracle_flat, random_full

    from real_py.realloc import ExpertShard, plan_moe_realloc
    from real_py.realloc.moe_exec import MoeReallocator
    from real_py.realloc.transports.dist import DistTransport

    torch.set_num_threads(1)
    model = model_spec(MOE_CONFIG, "moe-small")
    t = DistTransport(dist.group.WORLD, timeout=300)
    mc_ctx = _mcore_moe_setup()
    links = measure_links()
    log(f"links: {links}")
    full = random_full(model, 0)
    rows = []
    for s, d in MOE_PAIRS:
        src, dst = Layout.parse(s), Layout.parse(d)
        plan = plan_moe_realloc(model, src, dst)
        r = MoeReallocator(plan, t)
        a = b = (None, None)  # (ModelShard, ExpertShard) of the source and the destination
        if rank in src.ranks:
            a = (
                ModelShard.from_full(model, src, rank, full),
                ExpertShard.from_full(model, src, rank, full),
            )
        if rank in dst.ranks:
            b = ModelShard.empty(model, dst, rank), ExpertShard.empty(model, dst, rank)

        def run(r=r, a=a, b=b):
            r.run(*a, *b)

        run()  # warmup = verification run
        ok = True
        if b[0] is not None:
            ok = torch.equal(b[0].flat, oracle_flat(model, replace(dst, ep=1, etp=1), rank, full))
            want = expert_oracle(model, dst, rank, full)
            ok &= set(b[1].params()) == set(want) and all(
                torch.equal(b[1].view(k), v) for k, v in want.items()
            )
        ok = sum_ranks(0.0 if ok else 1.0) == 0
        mc, mc_check, mc_zero = _mcore_moe(mc_ctx, model, plan, rank, full)
        if mc_check is not None:
            mc_zero()
            mc.run()  # warmup = verification run
            mc_ok = mc_check()
            log(f"megatron-core: warmup + verification done ({'ok' if mc_ok else 'WRONG'})")
        secs, mc_secs = [], []
        for _ in range(args.repeats):  # methods interleaved
            secs.append(timed(run))
            if mc_check is not None:
                mc_secs.append(timed(mc.run))
        summ = plan.summary()
        lb = summ["max_ingress_bytes"] / (links["p2p_GBps"] * 1e9)
        rows.append(
            {
                "case": "gloo 4 ranks",
                "method": "real_py",
                "model": model.name,
                "params_M": round(model.numel / 1e6, 1),
                "src": str(src),
                "dst": str(dst),
                "parts": len(plan.parts),
                "seconds": statistics.median(secs),
                "verified": ok,
                "network_GB": summ["network_bytes"] / 1e9,
                "min_network_GB": summ["min_network_bytes"] / 1e9,
                "lb_seconds": lb,
                "frac_of_lb": lb / statistics.median(secs),
            }
        )
        log(f"{src} -> {dst}: {rows[-1]}")
        rows.append(
            _mcore_moe_row(rows[-1], mc, mc_secs, mc_ok if mc_check is not None else None, lb)
        )
        log(f"{src} -> {dst}: {rows[-1]}")
    return {"rows": rows, "links": links} if rank == 0 else None


def _mcore_moe_row(rp: dict, mc, secs: list, ok, lb: float) -> dict:
    """The Megatron-core row of an MoE pair, next to real_py's row `rp`."""
    row = {
        k: rp[k]
        for k in ("case", "model", "params_M", "src", "dst", "min_network_GB", "lb_seconds")
    }
    row["method"] = "megatron-core"
    if isinstance(mc, str):
        return {**row, "note": mc}
    t = statistics.median(secs)
    return {
        **row,
        "seconds": t,
        "verified": ok,
        "network_GB": sum_ranks(mc.recv_bytes) / 1e9,
        "frac_of_lb": lb / t,
        "vs_real_py": t / rp["seconds"],
    }


def moe_sim_rows() -> list[dict]:
    from real_py.realloc import plan_moe_realloc
    from real_py.realloc.reallocator import DEFAULT_DIRECT_MIN_BYTES
    from real_py.realloc.simulate import CLUSTERS, simulate

    rows = []
    for name, gpus, s, d, ce, what in MOE_SIM:
        model = model_spec(name)
        t0 = time.perf_counter()
        plan = plan_moe_realloc(model, Layout.parse(s), Layout.parse(d), ranks_per_node=8)
        summ = plan.summary()
        cluster = CLUSTERS["dgx-h100"].sized(gpus=gpus)
        # The executor's defaults: 256 MiB bucket, pipelined (NCCL), 256 KiB direct pieces.
        dmin = DEFAULT_DIRECT_MIN_BYTES // model.element_size
        t1 = time.perf_counter()
        merged = plan.transfers(direct_min_elems=dmin)
        derive = time.perf_counter() - t1
        union = simulate(merged, cluster)
        seq = simulate(plan.sequential_transfers(direct_min_elems=dmin), cluster)
        rows.append(
            {
                "case": f"simulated dgx-h100 x{gpus // 8}",
                "model": name,
                "params_M": round(model.numel / 1e6),
                "src": s,
                "dst": d,
                "parts": len(plan.parts),
                "seconds": union.seconds,
                "seconds_parts_in_sequence": seq.seconds,
                "lb_seconds": union.lower_bound,
                "ratio_to_lb": union.ratio,
                "bottleneck": union.bottleneck,
                "network_GB": summ["network_bytes"] / 1e9,
                "min_network_GB": summ["min_network_bytes"] / 1e9,
                "checkpoint_engine_s": ce,
                "checkpoint_engine_setup": what,
                "frac_of_checkpoint_engine": union.seconds / ce,
                "rounds": union.rounds,
                "schedule_s": derive,
                "plan_and_sim_s": time.perf_counter() - t0,
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    from real_py.testing import run_distributed

    load = os.getloadavg()
    out = run_distributed(moe_worker, WORLD, args, timeout=args.timeout, pg_timeout=300)[0]
    rows = out["rows"] + moe_sim_rows()
    cols = (
        "case model params_M src dst method parts seconds seconds_parts_in_sequence lb_seconds "
        "ratio_to_lb frac_of_lb verified network_GB min_network_GB vs_real_py rounds schedule_s "
        "bottleneck checkpoint_engine_s frac_of_checkpoint_engine note"
    ).split()
    notes = (
        f"gloo rows: {WORLD} gloo ranks on this machine (load average at start {load[0]:.1f}), "
        f"median of {args.repeats} after a warmup that is the verification run (destination "
        "dense buffer and every expert piece compared bit for bit with tests/support/oracle.py "
        "slicing the full tensors); MoeReallocator runs all parts of the plan as one merged "
        "schedule on the rank's ModelShard + ExpertShard buffers (no copies). lb_seconds = the "
        "largest bytes one rank receives / the p2p gloo GB/s measured in the run "
        f"({out['links']['p2p_GBps']:.2f} GB/s). megatron-core rows: "
        "megatron.core.resharding (gloo copy service, CPU shim: bench/realloc_mcore.py) over "
        "views of its own dense ModelShard and ExpertShard per rank, the experts described as "
        "TEGroupedMLP per-expert parameters (linear_fc1/linear_fc2.weight{k}, k local, "
        "allreduce=False, ep/expt_tp/expt_dp groups), fc1's blocked gate|up with "
        "partition_sizes as for the dense gate_up (with Megatron's own TEGroupedLinear tags, "
        "partition_stride=1 on fc1, the etp-changing pair comes out wrong); timed interleaved "
        "with real_py, same warmup/verification; vs_real_py = its seconds / real_py's; 'n/a: "
        "<reason>' where Megatron refuses a pair. Simulated rows: real_py/realloc/simulate.py "
        "on DGX H100 nodes (NVLink 450 GB/s per GPU and direction, one 400 Gb/s NIC per GPU) "
        "replaying MoePlan.transfers(), the merged schedule MoeReallocator runs (chunk for "
        "chunk, tests/test_realloc_moe.py) with its defaults (256 MiB bucket, pipelined, 256 KiB "
        "direct pieces; the dense part's direct pieces, which the executor posts at the start "
        "on NCCL, are modelled in their rounds); schedule_s = seconds to derive it (sizes "
        "only); seconds_parts_in_sequence = the same parts one after the other, each with a "
        "whole bucket. Qwen3-235B has "
        "4 kv heads, which real_py's TP cannot split 8 ways, so the TP8 generation side is "
        "attention tp4 x dp2 with experts split 8 ways (etp8, 'experts split by tp') or ep8. "
        "kimi-k2-shaped stands GQA (64 x 128, 16 kv heads) in for MLA and is BF16. "
        "checkpoint-engine's figures (its README) start from host memory, include the copy "
        "into vLLM's weights and were measured on H800 / H20 (H20: 900 GB/s NVLink, the "
        "Kimi run FP8, half the bytes); these start from GPU-resident training shards and "
        "end in GPU destination buffers, modelled, not measured."
    )
    from timing import hardware_tag, write_results

    write_results(
        "moe_realloc",
        hardware_tag("cpu"),
        rows,
        columns=cols,
        title=(
            "MoE reallocation: real_py vs Megatron-core on 4 gloo ranks; simulated "
            "Qwen3-235B-A22B and Kimi-K2-shaped"
        ),
        notes=notes,
        extra={"links": out["links"], "load_average": load, "repeats": args.repeats},
    )


if __name__ == "__main__":
    main()
