"""Where the time goes on one device: torch.profiler tables of pack calls and of generation.

The first H200 check (bench/results/gpu_check_h200_20261204.md) left two questions for a GPU:
pack / unpack reach 0.34-0.73x a device copy_ (the kernel alone ~0.71-0.84x, the rest per-call
work outside it), and a decode step of the 1.1B model at batch 32 takes ~6.4 ms with the CUDA
graph, about 14x what reading its 2.2 GB of weights takes at 4.8 TB/s. This script records, per
scenario, the wall time of one iteration without the profiler and the top device kernels and host
ops (self time per iteration) with it:

  pack <case>   one real_py pack call (iterations back to back, one synchronize at the end),
                and copy_ of the same bytes for reference
  generate <m>  one generate() of the 1.1B model (batch 32, prompt 128, 32 sampled tokens, as the
                PPO runtime samples) per decode mode

    python bench/profile_gpu.py --device cuda
    python bench/profile_gpu.py --device cpu --small       # dry run (host ops only)
Writes <out-dir>/profile_<hw>_<date>.{json,md}.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from bench_generate import BIG, SMALL, engine, one_rank_world
from timing import bench_parser, hardware_tag, sync, write_results

from real_py import ModelConfig
from real_py.device import resolve_device
from real_py.ops import pack

TOP = 12


def _device_us(e) -> float:
    # self_device_time_total (torch >= 2.4); self_cuda_time_total before
    if hasattr(e, "self_device_time_total"):
        return e.self_device_time_total
    return getattr(e, "self_cuda_time_total", 0.0)


def profile_rows(
    scenario: str, fn, iters: int, dev: torch.device, per: str = "iteration"
) -> list[dict]:
    """Wall time of one iteration without the profiler, then the top kernels and host ops with
    it."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(dev)
    wall = (time.perf_counter() - t0) / iters
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        sync(dev)
    ev = list(prof.key_averages())
    rows = [{"kind": "wall", "name": f"one {per}, no profiler", "calls": 1.0, "us": wall * 1e6}]
    # device: each kernel's self time (CUDA only); host: each op's self CPU time; top TOP of each
    kinds = [("device", _device_us)] if dev.type == "cuda" else []
    for kind, us in kinds + [("host", lambda e: e.self_cpu_time_total)]:
        top = sorted(ev, key=us, reverse=True)[:TOP]
        rows += [
            {"kind": kind, "name": e.key[:90], "calls": e.count / iters, "us": us(e) / iters}
            for e in top
            if us(e) > 0 or kind == "host"
        ]
    return [{"scenario": scenario, **r} for r in rows]
    return rows


def pack_scenarios(dev: torch.device, small: bool) -> list[tuple[str, object]]:
    n = (1 << 19) if small else (64 << 20)  # bf16 elements: 1 MiB / 128 MiB
    out = []
    for name, runs, length, stride in (
        ("one run", 1, n, 0),
        ("2048 B runs", n // 1024, 1024, 2048),
        ("7168 B runs", n // 3584, 3584, 7168),
    ):
        src = torch.randn(max(n, (runs - 1) * stride + length), device=dev).to(torch.bfloat16)
        dst = torch.empty(runs * length, device=dev, dtype=torch.bfloat16)
        descs = torch.tensor([[0, 0, length, runs, stride, length]])
        mib = dst.numel() * 2 / 2**20
        out.append((f"pack {name}, {mib:.0f} MiB", lambda s=src, d=descs, o=dst: pack(s, d, o)))
        ref = torch.empty_like(dst)
        out.append((f"copy_ {mib:.0f} MiB (reference)", lambda r=ref, o=dst: r.copy_(o)))
        if name == "7168 B runs":  # the same runs as 128 descriptors: past the 64 passed by value
            per = runs // 128
            many = torch.tensor(
                [
                    [i * per * stride, i * per * length, length, per, stride, length]
                    for i in range(128)
                ]
            )
            out.append(
                (
                    f"pack {name} as 128 descriptors, {mib:.0f} MiB",
                    lambda s=src, d=many, o=dst: pack(s, d, o),
                )
            )
    return out


def main(argv=None):
    ap = bench_parser(__doc__)
    args = ap.parse_args(argv)
    dev = resolve_device(args.device)
    B, P, N = (4, 8, 8) if args.small else (32, 128, 32)
    rows = []

    def record(scenario: str, fn, iters: int, per: str) -> None:
        """Profile one scenario, print its top rows and rewrite the results (a step cut short by
        its timeout keeps what it measured)."""
        t0 = time.perf_counter()
        new = profile_rows(scenario, fn, iters, dev, per)
        rows.extend(new)
        print(f"--- {scenario} ({time.perf_counter() - t0:.1f} s)", flush=True)
        for r in (
            [r for r in new if r["kind"] == "wall"]
            + [r for r in new if r["kind"] == "device"][:6]
            + [r for r in new if r["kind"] == "host"][:4]
        ):
            print(
                f"  {r['kind']:6} {r['calls']:8.1f} calls {r['us']:10.1f} us  {r['name']}",
                flush=True,
            )
        write_results(
            "profile",
            hardware_tag(args.device, args.small),
            rows,
            columns=["scenario", "kind", "name", "calls", "us"],
            title=f"profile of pack calls and generation ({args.device})",
            notes=f"us: microseconds per iteration (a pack / copy_ call, or one generate() of {N} "
            "new tokens); wall: without the profiler; device: self time of each kernel "
            f"(top {TOP}); host: self CPU time of each op (top {TOP}); calls per iteration.",
            out_dir=args.out_dir,
        )

    for scenario, fn in pack_scenarios(dev, args.small):
        record(scenario, fn, 20, "call")
    cfg = ModelConfig(**(SMALL if args.small else BIG), dtype="bfloat16")
    with one_rank_world(dev):
        eng = engine(cfg, dev)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(1, cfg.vocab_size, (B, P), generator=g)
        lengths, seeds = torch.full((B,), P), torch.arange(B)
        # The graph mode first: the open question (a decode step ~14x its weight-read time).
        for mode in (["graph"] if dev.type == "cuda" else []) + ["dynamic", "static"]:
            fn = lambda mode=mode: eng.generate(
                prompts, lengths, seeds, max_new_tokens=N, greedy=False, decode=mode
            )
            record(f"generate {mode}, batch {B}, {P} + {N} tokens", fn, 1, "generate()")
    print("done", flush=True)


if __name__ == "__main__":
    main()
