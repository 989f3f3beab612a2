"""Pack/unpack bandwidth on plans of the LLaMA-2-70B shape, against torch and a plain copy.

Cases (bf16, parameter subsets of llama2-70b so that each case stays a few hundred MiB):
  column-split   lm_head (vocab split) tp8 -> tp4: one long run per message
  row-split      o_proj tp4 -> tp8 (2 KiB runs) and down_proj tp8 -> tp4 (7 KiB runs)
  fused-qkv      qkv_proj (q|k|v blocks) tp8 -> tp4: a few runs per block
  whole-shard    one full layer, dp2 -> dp1 at tp8: rank 0 copies its shard locally
Source and destination use disjoint ranks, so pack times every message one source rank sends and
unpack every message one destination rank receives (whole-shard: the local copy, via unpack).
GB/s counts bytes read + written (2 x payload), from the median of `--repeats` rounds; the
variants are timed round-robin within each round (fair under load from other processes).
In the same run:
  torch-runs     ReaL-style interval list: one slice per run, torch.cat(out=) (pack) or copy_
  torch-strided  one as_strided view + copy_ per descriptor (best case for plain torch)
  copy_          one contiguous copy_ of the same bytes (the roofline)
  memcpy         numpy copyto of the same bytes (libc memcpy)

    python bench/bench_pack.py --device cpu      -> bench/results/pack_cpu2_<date>.{json,md}
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import hardware_tag, time_interleaved, write_results  # noqa: E402

from real_py import Layout, ModelSpec, model_spec, plan_realloc, preset, shard_layout  # noqa: E402
from real_py.ops import descs_tensor, pack, unpack  # noqa: E402


SMALL = {}
"""--small: ModelConfig overrides that shrink every case (same head structure, ~1/50 the bytes)."""


def subset(names: tuple[str, ...], layers: int) -> ModelSpec:
    full = model_spec(preset("llama2-70b", dtype="bfloat16", num_hidden_layers=layers, **SMALL),
                      name="llama2-70b")
    params = tuple(p for p in full.params if any(n in p.name for n in names))
    return ModelSpec(name=f"llama2-70b[{','.join(names)}]", params=params, num_layers=layers)


def disjoint(src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    n = src.world
    return src, Layout(dp=dst.dp, tp=dst.tp, pp=dst.pp, ranks=tuple(range(n, n + dst.world)))


LAYER = ("input_layernorm", "qkv_proj", "o_proj", "post_attention_layernorm", "gate_up_proj", "down_proj")
CASES = [
    ("column-split lm_head tp8->tp4", ("lm_head",), 1, *disjoint(Layout(tp=8), Layout(tp=4))),
    ("row-split o_proj x2 tp4->tp8", ("o_proj",), 2, *disjoint(Layout(tp=4), Layout(tp=8))),
    ("row-split down_proj tp8->tp4", ("down_proj",), 1, *disjoint(Layout(tp=8), Layout(tp=4))),
    ("fused-qkv qkv_proj x2 tp8->tp4", ("qkv_proj",), 2, *disjoint(Layout(tp=8), Layout(tp=4))),
    ("whole-shard layer dp2->dp1 tp8", LAYER, 1, Layout(dp=2, tp=8), Layout(dp=1, tp=8)),
]


def filled(numel: int, device: str) -> torch.Tensor:
    """A bf16 buffer with every page touched (fresh pages would be timed as page faults)."""
    return torch.ones(numel, dtype=torch.bfloat16, device=device)


def runs_of(descs: np.ndarray) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, len) per run: the interval list a ReaL-style executor keeps."""
    return [(so + i * ss, do + i * ds, ln) for so, do, ln, n, ss, ds in descs.tolist() for i in range(n)]


def torch_runs_pack(src, runs, out):
    torch.cat([src[s:s + ln] for s, _, ln in runs], out=out)


def torch_runs_unpack(packed, runs, dst):
    for s, d, ln in runs:
        dst[d:d + ln].copy_(packed[s:s + ln])


def torch_strided(src, descs, dst):
    for so, do, ln, n, ss, ds in descs.tolist():
        if ln and n:
            dst.as_strided((n, ln), (ds, 1), do).copy_(src.as_strided((n, ln), (ss, 1), so))


def measure(jobs, nbytes: int, device: str, repeats: int) -> dict:
    """jobs: list of (src, descs ndarray, dst, op) calls making up one timed step."""
    prepared = [(s, d, descs_tensor(d), t, op, runs_of(d)) for s, d, t, op in jobs]
    ours = lambda: [op(s, dt, t) for s, _, dt, t, op, _ in prepared]  # noqa: E731
    ref = lambda: [(torch_runs_pack if op is pack else torch_runs_unpack)(s, r, t)  # noqa: E731
                   for s, _, _, t, op, r in prepared]
    strided = lambda: [torch_strided(s, d, t) for s, d, _, t, _, _ in prepared]  # noqa: E731
    numel = nbytes // 2
    # The roofline reuses the case's buffers where they are large enough (memory is shared).
    a = prepared[0][0] if prepared[0][0].numel() >= numel else filled(numel, device)
    b = prepared[0][3] if prepared[0][3].numel() >= numel else filled(numel, device)
    roof = lambda: b.copy_(a[:numel])  # noqa: E731
    fns = {"ours": ours, "torch_runs": ref, "torch_strided": strided, "copy_": roof}
    if device == "cpu":
        na, nb = a[:numel].view(torch.int16).numpy(), b.view(torch.int16).numpy()
        fns["memcpy"] = lambda: np.copyto(nb, na)
    timings = time_interleaved(fns, device=device, warmup=1, repeats=repeats)
    rows = {name: t.gbps(2 * nbytes) for name, t in timings.items()}
    rows["runs"] = sum(len(p[5]) for p in prepared)
    rows["min run B"] = 2 * min((ln for p in prepared for _, _, ln in p[5]), default=0)
    return rows


def run_case(name, names, layers, src_l, dst_l, device, repeats) -> list[dict]:
    model = subset(names, layers)
    plan = plan_realloc(model, src_l, dst_l)

    def shard(layout, rank):
        return filled(shard_layout(model, layout, layout.coords(rank)[2]).numel, device)

    out = []
    r_src, r_dst = src_l.ranks[0], dst_l.ranks[0]
    if r_src == r_dst:  # same ranks on both sides: the local copy
        rp = plan.for_rank(r_src)
        src, dst = shard(src_l, r_src), shard(dst_l, r_dst)
        steps = [("local(unpack)", [(src, rp.local, dst, unpack)], rp.local_numel)]
    else:
        sends, recvs = plan.for_rank(r_src).sends, plan.for_rank(r_dst).recvs
        src, dst = shard(src_l, r_src), shard(dst_l, r_dst)
        steps = [("pack", [(src, m.pack_descs(), filled(m.numel, device), pack) for m in sends],
                  sum(m.numel for m in sends)),
                 ("unpack", [(filled(m.numel, device), m.unpack_descs(), dst, unpack) for m in recvs],
                  sum(m.numel for m in recvs))]
    for op, jobs, numel in steps:
        nbytes = numel * 2
        r = measure(jobs, nbytes, device, repeats)
        row = {"case": name, "op": op, "MiB": nbytes / 2**20, "messages": len(jobs), "runs": r.pop("runs"),
               "min run B": r.pop("min run B"),
               **{f"{k} GB/s": v for k, v in r.items()}}
        row["ours/copy_"] = r["ours"] / r["copy_"]
        row["ours/torch_runs"] = r["ours"] / r["torch_runs"]
        row["ours/torch_strided"] = r["ours"] / r["torch_strided"]
        if "memcpy" in r:
            row["ours/memcpy"] = r["ours"] / r["memcpy"]
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        out.append(row)
        del jobs
        gc.collect()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--hardware", default=None, help="results tag (default: cpu<cores> on cpu, the GPU's model on cuda)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--small", action="store_true", help="shrunken cases (smoke run)")
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU visible to torch")
    if args.small:
        SMALL.update(hidden_size=1024, intermediate_size=3584, vocab_size=4096)
    rows = []
    for case in CASES:
        rows += run_case(*case, args.device, args.repeats)
        gc.collect()
    cols = ["case", "op", "MiB", "messages", "runs", "min run B", "ours GB/s", "torch_runs GB/s", "torch_strided GB/s",
            "copy_ GB/s"] + (["memcpy GB/s"] if args.device == "cpu" else [])
    cols += ["ours/copy_", "ours/torch_runs", "ours/torch_strided"]
    hw = (args.hardware or hardware_tag(args.device)) + ("_small" if args.small else "")
    notes = ("GB/s = (bytes read + bytes written) / median time; goals: ours/copy_ >= 0.85 for runs >= 4 KiB, "
             "ours/torch_runs >= 5 on row-split plans with many short runs.")
    paths = write_results("pack", hw, rows, columns=cols,
                          title=f"pack/unpack bandwidth ({args.device})", notes=notes, out_dir=args.out_dir)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
