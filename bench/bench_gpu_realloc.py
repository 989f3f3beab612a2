"""Reallocation between layouts with every rank on ONE device, against a copy of the same bytes
and against the gather-and-slice method, bit for bit.

Pairs: the 7B bf16 pairs tp4pp1 -> tp2pp2, tp2pp2 -> dp4tp1pp1, tp8 -> tp1, and an MoE pair
dp4,ep4 -> tp4,etp4 (training-style expert parallelism to experts split by tensor parallelism).
Models: on a GPU LLaMA-2-7B and Qwen3-30B-A3B cut to 12 layers (7.6B); on a CPU scaled-down
shapes that fit a 24 GiB machine (`--device cpu`, default: a 0.94B LLaMA shape with 16 heads so
that tp8 divides them, and a 0.43B Qwen3-MoE shape); `--small`: tiny models (smoke run).
Methods (--transport):
  inprocess   every rank a thread of this process, the in-process transport, one pass
              (realloc/direct.py: one compiled copy per receiving rank and move), compiled once
              (InProcessMove) and replayed: rows "threads" (a worker thread per rank) and
              "one thread" (the phases of every rank in the calling thread)
  ipc         every rank its own process on the same GPU, CUDA IPC (transports/ipc.py)
  gather-slice  the peers' method on the same device (onedevice.GatherSlice): each tensor
              gathered whole, then every destination piece sliced out of it
Reference: one contiguous copy of the same bytes on the same device (GPU: copy_ of min(bytes,
4 GiB); CPU: one numpy memcpy of min(bytes, 1 GiB), single-threaded, as the goal states).
Goals: vs ref >= 0.7 in process (0.6 through CUDA IPC).
GB/s counts the bytes written into the destination shards (each once) over the median wall
time of one move (synchronized on a GPU; --repeats after a warm-up, the first call compiles:
`compile s`; in process the moves, the reference and gather-slice are timed round-robin within
each repeat). bit-exact: every destination piece equals the slice of its full tensor
(onedevice.check). extra MiB: memory beyond the source and destination shards, measured on a
GPU (peak allocated during a call minus what was allocated before it, plus the move's own copy
tables; not the reference's buffers) and computed on a CPU (copy tables; the baseline's largest
gathered tensor). host ms: GPU, the host time to issue one replayed move (goal <= 1 ms); CPU,
the one-thread row's wall time minus the time inside its copy calls, host / move its share of
that move (goal <= 0.05); medians over the repeats. launches: compiled copy calls per move (one
per receiving rank). A pair that fails (out of memory, say) is one row with its error; the
others still run, and the report is rewritten after every pair.

    python bench/bench_gpu_realloc.py --device cuda [--transport ipc]
        -> realloc_<transport>_<gpu>_<date>
    python bench/bench_gpu_realloc.py --device cpu
        -> realloc_inprocess_cpu<n>_<date>
"""

from __future__ import annotations

import functools
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from onedevice import GatherSlice, Shards, check, fill
from timing import bench_parser, hardware_tag, sync, write_results

from real_py import Layout, ModelConfig, model_spec, plan_realloc, preset
from real_py.realloc.inprocess_move import InProcessMove
from real_py.realloc.moe_plan import plan_moe_realloc
from real_py.realloc.transports import InProcessHub

PAIRS = [
    ("tp4pp1->tp2pp2", "tp4", "tp2,pp2"),
    ("tp2pp2->dp4tp1pp1", "tp2,pp2", "dp4"),
    ("tp8->tp1", "tp8", "tp1"),
]
MOE_PAIR = ("dp4ep4->tp4etp4", "dp4,ep4", "tp4,etp4")
GOALS = {("cuda", "inprocess"): 0.7, ("cuda", "ipc"): 0.6, ("cpu", "inprocess"): 0.7}


def models(device: str, small: bool):
    if small:
        dense = ModelConfig(
            hidden_size=256,
            intermediate_size=688,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=1024,
            num_hidden_layers=4,
            dtype="bfloat16",
        )
        moe = preset("moe-tiny", dtype="bfloat16")
        return model_spec(dense, "small"), model_spec(moe, "moe-tiny")
    if device == "cuda":
        return (
            model_spec(preset("llama2-7b", dtype="bfloat16"), "llama2-7b"),
            model_spec(preset("qwen3-30b-a3b", num_hidden_layers=12), "qwen3-30b-a3b[12 layers]"),
        )
    dense = ModelConfig(
        hidden_size=2048,
        intermediate_size=5504,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        num_hidden_layers=16,
        dtype="bfloat16",
    )
    moe = preset(
        "qwen3-30b-a3b",
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=8,
        num_experts=32,
        moe_intermediate_size=384,
        vocab_size=32000,
    )
    return model_spec(dense, "llama-shape-0.9b"), model_spec(moe, "qwen3-moe-shape-0.4b")


def free(dev) -> None:
    """Collect the garbage and give the freed device memory back (between pairs)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def timed(fn, dev, repeats: int) -> float:
    """Median wall time of fn() (synchronized) over `repeats` calls after a warm-up call."""
    fn()
    sync(dev)
    times = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_plan(model, src: Layout, dst: Layout):
    return plan_moe_realloc(model, src, dst) if model.num_experts else plan_realloc(model, src, dst)


def shard_args(shards: Shards) -> dict:
    """rank -> what InProcessMove.run takes: a ModelShard, or (ModelShard, ExpertShard)."""
    if shards.experts:
        return {r: (shards.dense[r], shards.experts[r]) for r in shards.dense}
    return dict(shards.dense)


def zero(shards: Shards) -> None:
    for r in shards.dense:
        for f in shards.flats(r):
            if f is not None:
                f.zero_()


def inprocess_rows(name, model, src, dst, dev, repeats, goal) -> list[dict]:
    """The in-process moves (threads, one thread), the reference copy and gather-and-slice, timed
    round-robin within every repeat (so load from other processes hits them alike)."""
    srcs, dsts = Shards(model, src, dev), Shards(model, dst, dev)
    fill(srcs)
    nbytes = dsts.nbytes()
    base = {"pair": name, "model": model.name, "GiB moved": nbytes / 2**30}
    sa, da = shard_args(srcs), shard_args(dsts)
    moves, info = {}, {}
    try:  # closed on every path: a worker blocked on its queue would keep its last shards alive
        for threads in (True, False):
            key = "in-process, " + ("threads" if threads else "one thread")
            t0 = time.perf_counter()
            moves[key] = InProcessMove(
                InProcessHub(timeout=600), make_plan(model, src, dst), threads=threads
            )
            zero(dsts)
            moves[key].run(sa, da)  # compiles the copies (first call), checked here
            sync(dev)
            info[key] = {
                "compile s": time.perf_counter() - t0,
                "bit-exact": check(dsts),
                "host": [],
                "tables": sum(x.runner.table_bytes for x in moves[key].reallocs.values()),
                "launches": sum(
                    len(p.groups)
                    for x in moves[key].reallocs.values()
                    for p in x.runner._plans.values()
                ),
            }
        gs = GatherSlice(srcs, dsts)
        zero(dsts)
        gs.run()
        sync(dev)
        gs_ok = check(dsts)
        ref_fn, ref_bytes = reference(nbytes, dev)
        fns = {
            "ref": ref_fn,
            **{k: functools.partial(m.run, sa, da) for k, m in moves.items()},
            "gather-slice": gs.run,
        }
        times = {k: [] for k in fns}
        peak = {}
        for k, fn in fns.items():  # warm-up (and the extra memory of each, on a GPU)
            if dev.type == "cuda":
                sync(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                # shards, reference buffers, every move's tables
                before = torch.cuda.memory_allocated(dev)
            fn()
            sync(dev)
            if dev.type == "cuda":  # what the call allocated on top, plus the move's copy tables
                tables = info.get(k, {}).get("tables", 0)
                peak[k] = torch.cuda.max_memory_allocated(dev) - before + tables
        for _ in range(repeats):
            for k, fn in fns.items():
                sync(dev)
                t0 = time.perf_counter()
                out = fn()
                issued = time.perf_counter() - t0
                sync(dev)
                times[k].append(time.perf_counter() - t0)
                # host work: GPU, the time to issue; CPU, the wall time outside the copies
                if k in moves:
                    copy_s = sum(st["phases"]["unpack"] for st in out.values())
                    info[k]["host"].append(
                        (issued, issued if dev.type == "cuda" else max(0.0, issued - copy_s))
                    )
        med = {k: statistics.median(v) for k, v in times.items()}
        ref = ref_bytes / med["ref"] / 1e9
        gbps = {k: nbytes / med[k] / 1e9 for k in moves}
        g_gbps = nbytes / med["gather-slice"] / 1e9
        rows = []
        for k in moves:
            host = statistics.median(h for _, h in info[k]["host"])
            share = (
                statistics.median(h / w for w, h in info[k]["host"])
                if dev.type == "cpu"
                else host / med[k]
            )
            extra = peak.get(k, info[k]["tables"])
            rows.append(
                {
                    **base,
                    "method": k,
                    "seconds": med[k],
                    "GB/s": gbps[k],
                    "ref GB/s": ref,
                    "vs ref": gbps[k] / ref,
                    "goal": goal,
                    "met": "yes" if gbps[k] / ref >= goal else "NO",
                    "vs gather-slice": gbps[k] / g_gbps,
                    "bit-exact": info[k]["bit-exact"],
                    "launches": info[k]["launches"],
                    "extra MiB": extra / 2**20,
                    "extra how": "measured" if k in peak else "copy tables (computed)",
                    "host ms": host * 1e3,
                    "host / move": share,
                    "compile s": info[k]["compile s"],
                }
            )
        extra = peak.get("gather-slice", gs.extra_bytes)
        rows.append(gather_slice_row(base, med["gather-slice"], ref, gs_ok, extra, bool(peak)))
    finally:
        for m in moves.values():
            m.close()
    for r in rows:
        print(r, flush=True)
    # fns (and fn) hold the moves, gs.run, the reference
    del srcs, dsts, moves, gs, sa, da, ref_fn, fns, fn
    free(dev)
    return rows


def reference(nbytes: int, dev):
    """One contiguous copy of min(nbytes, cap) on the device (copy_), numpy's memcpy on a CPU:
    (fn, bytes it copies)."""
    cap = (4 << 30) if dev.type == "cuda" else (1 << 30)
    n = min(nbytes, cap)
    if dev.type == "cuda":
        a = torch.empty(n // 2, dtype=torch.int16, device=dev)
        b = torch.empty_like(a)
        return (lambda: b.copy_(a)), n
    a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    return (lambda: np.copyto(b, a)), n


def gather_slice_row(base: dict, seconds: float, ref: float, ok: bool, extra: int, measured):
    """The gather-and-slice row of a pair (`base`: pair, model, GiB moved); extra: bytes."""
    gbps = base["GiB moved"] * 2**30 / seconds / 1e9
    return {
        **base,
        "method": "gather-slice",
        "seconds": seconds,
        "GB/s": gbps,
        "ref GB/s": ref,
        "vs ref": gbps / ref,
        "bit-exact": ok,
        "extra MiB": extra / 2**20,
        "extra how": "measured" if measured else "largest tensor (computed)",
    }


def gather_row(name, model, src, dst, dev, repeats, ref) -> dict:
    """The gather-and-slice method on the same device (onedevice.GatherSlice), checked."""
    free(dev)
    srcs, dsts = Shards(model, src, dev), Shards(model, dst, dev)
    fill(srcs)
    nbytes, shard_bytes = dsts.nbytes(), srcs.nbytes() + dsts.nbytes()
    base_run = GatherSlice(srcs, dsts)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    med = timed(base_run.run, dev, repeats)
    extra = (
        (torch.cuda.max_memory_allocated(dev) - shard_bytes)
        if dev.type == "cuda"
        else base_run.extra_bytes
    )
    base = {"pair": name, "model": model.name, "GiB moved": nbytes / 2**30}
    row = gather_slice_row(base, med, ref, check(dsts), extra, dev.type == "cuda")
    print(row, flush=True)
    del srcs, dsts, base_run
    free(dev)
    return row


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--transport", choices=("inprocess", "ipc"), default="inprocess")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU visible to torch")
    if args.transport == "ipc" and args.device != "cuda":
        raise SystemExit("--transport ipc needs --device cuda (CUDA IPC)")
    dev = torch.device(args.device)
    dense, moe = models(args.device, args.small)
    pairs = [(n, dense, Layout.parse(s), Layout.parse(d)) for n, s, d in PAIRS]
    pairs.append((MOE_PAIR[0], moe, Layout.parse(MOE_PAIR[1]), Layout.parse(MOE_PAIR[2])))
    goal = GOALS[(args.device, args.transport)]
    cols = (
        "pair|model|method|GiB moved|seconds|GB/s|ref GB/s|vs ref|goal|met|vs gather-slice"
        "|bit-exact|launches|extra MiB|extra how|host ms|host / move|compile s|error"
    ).split("|")
    ref_name = (
        "one device copy_ of min(bytes, 4 GiB)"
        if dev.type == "cuda"
        else "one numpy memcpy of min(bytes, 1 GiB)"
    )
    # the ref and the goal of this run, then the method and columns (the docstring)
    notes = f"ref = {ref_name}, same device; goal: vs ref >= {goal}.\n\n" + __doc__.split("\n\n")[1]
    rows = []
    for name, model, src, dst in pairs:
        try:
            if args.transport == "inprocess":
                rows += inprocess_rows(name, model, src, dst, dev, args.repeats, goal)
            else:
                ref_fn, ref_bytes = reference(_dst_bytes(model, dst), dev)
                ref = ref_bytes / timed(ref_fn, dev, args.repeats) / 1e9
                del ref_fn
                from ipc_bench import ipc_rows

                got = ipc_rows(name, model, src, dst, args.repeats, goal, ref, args.small)
                rows += got  # kept if gather-and-slice then fails
                rows.append(gather_row(name, model, src, dst, dev, args.repeats, ref))
                got[0]["vs gather-slice"] = got[0]["GB/s"] / rows[-1]["GB/s"]
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            rows.append(
                {
                    "pair": name,
                    "model": model.name,
                    "goal": goal,
                    "met": "NO",
                    "error": (
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    ),
                }
            )
        finally:
            free(dev)
        paths = write_results(
            f"realloc_{args.transport}",
            hardware_tag(args.device, args.small),
            rows,
            columns=cols,
            title=f"reallocation on one device ({args.transport}, {args.device})",
            notes=notes,
            out_dir=args.out_dir,
        )
    print("wrote", *paths)


def _dst_bytes(model, layout: Layout) -> int:
    from real_py.layout import expert_shard_layout, shard_layout

    es = model.element_size
    total = 0
    for r in layout.ranks:
        _, _, stage = layout.coords(r)
        total += shard_layout(model, layout, stage).numel * es
        if model.num_experts:
            c = layout.expert_coords(r)
            total += expert_shard_layout(model, layout, c[3], c[1]).numel * es
    return total


if __name__ == "__main__":
    main()
