"""In-process reallocation of a LLaMA-2-7B-shaped bf16 model between layouts on one device.

Every rank of both layouts is a thread of this process with its shard on the same device; the
real_py in-process transport hands chunks over by a device-to-device copy, so a run measures the
planner's schedule, the pack / unpack kernels and the copies, without a network. GB/s counts the
bytes written into the destination shards (each destination byte once) over the wall time of
one reallocation (median of --repeats after one untimed run, which is checked bit for bit against
slicing the full tensors). The reference copies min(bytes moved, 4 GiB) with one contiguous
copy_ on the same device; vs copy_ is the ratio of the two GB/s.

    python bench/bench_gpu_realloc.py --device cuda               # 7B bf16, 88 GiB peak on the H200 (dp4)
    python bench/bench_gpu_realloc.py --device cpu --small        # smoke run, tiny model
Writes <out-dir>/realloc_<hw>_<date>.{json,md}; on a CPU only with --small (realloc_cpu<cores>_<date>
is bench_realloc.py's gloo report).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from timing import hardware_tag, time_fn, write_results  # noqa: E402

from real_py import Layout, ModelConfig, model_spec, plan_realloc, preset  # noqa: E402
from real_py.device import peak_memory_mib, reset_peak_memory  # noqa: E402
from real_py.realloc.shard import ModelShard, gather_full  # noqa: E402
from real_py.realloc.transports import InProcessHub  # noqa: E402
from real_py.realloc.reallocator import run_in_process

PAIRS = [("tp4pp1->tp2pp2", Layout(tp=4), Layout(tp=2, pp=2)),
         ("tp2pp2->dp4tp1pp1", Layout(tp=2, pp=2), Layout(dp=4)),
         ("tp8->tp1", Layout(tp=8), Layout(tp=1))]


def config(small: bool) -> ModelConfig:
    if small:
        return ModelConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8,
                           num_key_value_heads=8, vocab_size=1024, num_hidden_layers=4, dtype="bfloat16")
    return preset("llama2-7b", dtype="bfloat16")


def sources(model, layout, device) -> dict[int, ModelShard]:
    """Shards whose flat buffers hold arange patterns (distinct per rank, cheap to make)."""
    out = {}
    for r in layout.ranks:
        shard = ModelShard.empty(model, layout, r, device)
        shard.flat.copy_(torch.arange(shard.flat.numel(), device=device).remainder_(251)
                         .to(shard.flat.dtype))
        out[r] = shard
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny model (smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU visible to torch")
    if args.device == "cpu" and not args.small:
        ap.error("--device cpu takes --small: the 7B model's layouts need ~90 GB, and a cpu report "
                 "would replace bench_realloc.py's realloc_cpu<cores>_<date>")
    cfg = config(args.small)
    model = model_spec(cfg, name="llama2-7b" if not args.small else "small")
    dev = torch.device(args.device)
    rows = []
    for name, src, dst in PAIRS:
        plan = plan_realloc(model, src, dst)
        srcs = sources(model, src, dev)
        dsts = {r: ModelShard.empty(model, dst, r, dev) for r in dst.ranks}
        nbytes = sum(s.flat.numel() * s.flat.element_size() for s in dsts.values())
        hub = InProcessHub(timeout=600)
        run_in_process(hub, plan, srcs, dsts)  # warm-up, and the run that is checked
        # Oracle: the destination shards, gathered, equal the sources gathered (bit for bit).
        want, got = gather_full(model, srcs.values()), gather_full(model, dsts.values())
        ok = all(torch.equal(want[k], got[k]) for k in want)
        del want, got

        def run():
            run_in_process(hub, plan, srcs, dsts)
            if dev.type == "cuda":
                torch.cuda.synchronize()

        t = time_fn(run, device="cpu", warmup=0, repeats=args.repeats)
        # The reference copies min(nbytes, 4 GiB): a copy that size already runs at the device's
        # bandwidth, and a copy of all the bytes (50 GiB for dp4 of 7B) beside the shards would not fit.
        cbytes = min(nbytes, 4 << 30)
        a = torch.empty(cbytes // 2, dtype=torch.bfloat16, device=dev)
        b = torch.empty_like(a)
        tc = time_fn(lambda: b.copy_(a), device=args.device, warmup=1, repeats=args.repeats)
        rows.append({"pair": name, "GiB moved": nbytes / 2**30, "seconds": t.median_s,
                     "GB/s": t.gbps(nbytes), "copy_ GB/s": tc.gbps(cbytes),
                     "vs copy_": t.gbps(nbytes) / tc.gbps(cbytes), "bit-exact": ok,
                     "peak GiB": peak_memory_mib(dev) / 1024})
        print(rows[-1], flush=True)
        del srcs, dsts, a, b, hub
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_memory(dev)
    paths = write_results("realloc", hardware_tag(args.device, args.small),
                          rows, columns=list(rows[0]),
                          title=f"in-process reallocation, {model.name} bf16 ({args.device})",
                          notes="GB/s = destination bytes / median wall time of one reallocation "
                                "(all ranks as threads on one device, in-process transport); copy_ = "
                                "one contiguous device copy of min(bytes, 4 GiB) (GB/s counts them once "
                                "too); vs copy_ = GB/s / copy_ GB/s.", out_dir=args.out_dir)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
