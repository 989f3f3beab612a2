"""Strided copy bandwidth (pack / unpack and compiled CopyPlans) per run-length class, against a
contiguous copy_ of the same bytes.

Run-length classes and their goals (GPU; the CPU report states the same ratios without a goal):
  runs >= 16 KiB      ours/copy_ >= 0.90
  runs 2 - 16 KiB     ours/copy_ >= 0.85
  runs < 2 KiB        reported, no goal
A case belongs to the class of its SHORTEST run. Cases:
  synthetic    one strided side (row-split: half of every row, stride 2 x run) and one contiguous
               side, runs of 2, 4, 7, 16, 64 KiB and 1 MiB; each aligned (src and dst offsets equal
               mod 16) and misaligned (source 2 bytes off: a bf16 piece at an odd element, the
               kernel's funnel-shift path); pack (strided -> packed) and unpack (packed -> strided)
  plans        messages of LLaMA-2-70B parameter subsets (bf16), as before: column-split lm_head
               tp8->tp4 (long runs), row-split o_proj tp4->tp8 (2 KiB runs), down_proj tp8->tp4
               (7 KiB runs), fused qkv tp8->tp4, one whole layer dp2->dp1 (the local copy)
Variants, timed round-robin within each repeat (fair under load from other processes):
  ours         real_py.ops.pack / unpack: per-call descriptors (work items built per call)
  planned      real_py.ops.CopyPlan built once, run per call (items resident on the device)
  copy_        one contiguous copy_ of the same bytes (the roofline); memcpy on CPU (numpy)
  torch_runs   (plans only) one slice per run, torch.cat(out=) / copy_: a ReaL-style executor
GB/s counts bytes read + written (2 x payload) over the median time; the class verdict uses
planned/copy_ (the kernel's speed; `ours` adds its per-call host work).

    python bench/bench_pack.py --device cuda         -> bench/results/pack_<gpu>_<date>.{json,md}
    python bench/bench_pack.py --device cpu          -> bench/results/pack_cpu<cores>_<date>.*
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import bench_parser, hardware_tag, time_interleaved, write_results

from real_py import Layout, ModelSpec, model_spec, plan_realloc, preset, shard_layout
from real_py.ops import CopyPlan, descs_tensor, pack, unpack

CLASSES = (
    ("runs >= 16 KiB", 16 << 10, 0.90),
    ("runs 2-16 KiB", 2 << 10, 0.85),
    ("runs < 2 KiB", 0, None),
)
SYNTH_RUNS = (2 << 10, 4 << 10, 7 << 10, 16 << 10, 64 << 10, 1 << 20)
SMALL = {}
"""--small: ModelConfig overrides that shrink the plan cases (same head structure)."""


def run_class(min_run_bytes: int) -> tuple[str, float | None]:
    return next((name, goal) for name, lo, goal in CLASSES if min_run_bytes >= lo)


def subset(names: tuple[str, ...], layers: int) -> ModelSpec:
    full = model_spec(
        preset("llama2-70b", dtype="bfloat16", num_hidden_layers=layers, **SMALL), name="llama2-70b"
    )
    params = tuple(p for p in full.params if any(n in p.name for n in names))
    return ModelSpec(name=f"llama2-70b[{','.join(names)}]", params=params, num_layers=layers)


def disjoint(src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    n = src.world
    return src, Layout(dp=dst.dp, tp=dst.tp, pp=dst.pp, ranks=tuple(range(n, n + dst.world)))


LAYER = (
    "input_layernorm",
    "qkv_proj",
    "o_proj",
    "post_attention_layernorm",
    "gate_up_proj",
    "down_proj",
)
PLAN_CASES = [
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
    return [
        (so + i * ss, do + i * ds, ln) for so, do, ln, n, ss, ds in descs.tolist() for i in range(n)
    ]


def torch_runs(jobs):
    for s, d, t, op in jobs:
        runs = runs_of(d)
        if op is pack:
            torch.cat([s[a : a + ln] for a, _, ln in runs], out=t)
        else:
            for a, b, ln in runs:
                t[b : b + ln].copy_(s[a : a + ln])


def measure(jobs, numel: int, device: str, repeats: int, baselines: bool) -> dict:
    """jobs: [(src, descs [k, 6] elements, dst, op)] making up one timed step of numel elements."""
    prepared = [(s, descs_tensor(d), t, op) for s, d, t, op in jobs]
    # One CopyPlan over every job: job j reads source buffer j and writes destination buffer j.
    rows8 = np.concatenate(
        [np.hstack([d, np.full((len(d), 2), j, np.int64)]) for j, (_, d, _, _) in enumerate(jobs)]
    )
    plan = CopyPlan(rows8, 2, device=device)
    srcs, dsts = [j[0] for j in jobs], [j[2] for j in jobs]
    a, b = filled(numel, device), filled(numel, device)
    fns = {
        "ours": lambda: [op(s, d, t) for s, d, t, op in prepared],
        "planned": lambda: plan.run(srcs, dsts),
        "copy_": lambda: b.copy_(a),
    }
    if device == "cpu":
        na, nb = a.view(torch.int16).numpy(), b.view(torch.int16).numpy()
        fns["memcpy"] = lambda: np.copyto(nb, na)
    if baselines:
        fns["torch_runs"] = lambda: torch_runs(jobs)
    timings = time_interleaved(fns, device=device, warmup=1, repeats=repeats)
    out = {name: t.gbps(4 * numel) for name, t in timings.items()}
    out["items"] = plan.num_items
    return out


def row(case, op, jobs, numel, device, repeats, baselines=False) -> dict:
    runs = sum(int(d[:, 3].sum()) for _, d, _, _ in jobs)
    min_run = 2 * min(int(d[:, 2].min()) for _, d, _, _ in jobs)
    cls, goal = run_class(min_run)
    r = measure(jobs, numel, device, repeats, baselines)
    out = {
        "case": case,
        "class": cls,
        "op": op,
        "MiB": numel * 2 / 2**20,
        "runs": runs,
        "min run B": min_run,
        "items": r.pop("items"),
        **{f"{k} GB/s": v for k, v in r.items()},
    }
    out["ours/copy_"] = r["ours"] / r["copy_"]
    out["planned/copy_"] = r["planned"] / r["copy_"]
    if "memcpy" in r:
        out["planned/memcpy"] = r["planned"] / r["memcpy"]
    if "torch_runs" in r:
        out["planned/torch_runs"] = r["planned"] / r["torch_runs"]
    out["goal"] = goal if goal is not None else ""
    out["met"] = (
        ""
        if goal is None or device != "cuda"
        else ("yes" if out["planned/copy_"] >= goal else "NO")
    )
    print(
        "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()),
        flush=True,
    )
    return out


def synthetic_rows(device, repeats, payload_bytes) -> list[dict]:
    rows = []
    for run in SYNTH_RUNS:
        ln = run // 2  # elements per run (bf16)
        n = max(1, payload_bytes // run)
        numel = ln * n
        strided = filled(2 * numel + 8, device)
        packed = filled(numel + 8, device)
        for shift, tag in ((0, "aligned"), (1, "misaligned")):
            side = np.array([[shift, 0, ln, n, 2 * ln, ln]], np.int64)
            name = f"runs {run >> 10} KiB, stride 2x, {tag}"
            rows.append(row(name, "pack", [(strided, side, packed, pack)], numel, device, repeats))
            back = side[:, [1, 0, 2, 3, 5, 4]]
            rows.append(
                row(name, "unpack", [(packed, back, strided, unpack)], numel, device, repeats)
            )
        del strided, packed
        gc.collect()
    return rows


def plan_rows(name, names, layers, src_l, dst_l, device, repeats) -> list[dict]:
    model = subset(names, layers)
    plan = plan_realloc(model, src_l, dst_l)

    def shard(layout, rank):
        return filled(shard_layout(model, layout, layout.coords(rank)[2]).numel, device)

    r_src, r_dst = src_l.ranks[0], dst_l.ranks[0]
    if r_src == r_dst:  # same ranks on both sides: the local copy
        rp = plan.for_rank(r_src)
        steps = [
            (
                "local(unpack)",
                [(shard(src_l, r_src), rp.local, shard(dst_l, r_dst), unpack)],
                rp.local_numel,
            )
        ]
    else:
        sends, recvs = plan.for_rank(r_src).sends, plan.for_rank(r_dst).recvs
        src, dst = shard(src_l, r_src), shard(dst_l, r_dst)
        steps = [
            (
                "pack",
                [(src, m.pack_descs(), filled(m.numel, device), pack) for m in sends],
                sum(m.numel for m in sends),
            ),
            (
                "unpack",
                [(filled(m.numel, device), m.unpack_descs(), dst, unpack) for m in recvs],
                sum(m.numel for m in recvs),
            ),
        ]
    out = [row(name, op, jobs, numel, device, repeats, baselines=True) for op, jobs, numel in steps]
    del steps
    gc.collect()
    return out


def class_summary(rows: list[dict], device: str) -> list[str]:
    lines = []
    for name, _, goal in CLASSES:
        got = [r["planned/copy_"] for r in rows if r["class"] == name]
        if not got:
            continue
        if goal is None:
            verdict = "no goal"
        elif device == "cuda":
            verdict = f"goal {goal}: {'met' if min(got) >= goal else 'NOT met'}"
        else:
            verdict = f"GPU goal {goal}"
        lines.append(
            f"{name}: planned/copy_ {min(got):.3f} - {max(got):.3f} over {len(got)} rows "
            f"({verdict})"
        )
    return lines


def main(argv=None):
    ap = bench_parser(__doc__, device="cpu")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU visible to torch")
    if args.small:
        SMALL.update(hidden_size=1024, intermediate_size=3584, vocab_size=4096)
    payload = (2 << 20) if args.small else (256 << 20) if args.device == "cuda" else (32 << 20)
    rows = synthetic_rows(args.device, args.repeats, payload)
    for case in PLAN_CASES:
        rows += plan_rows(*case, args.device, args.repeats)
    cpu = args.device == "cpu"
    cols = "case|class|op|MiB|runs|min run B|items|ours GB/s|planned GB/s|copy_ GB/s".split("|")
    cols += (["memcpy GB/s"] if cpu else []) + ["torch_runs GB/s", "ours/copy_", "planned/copy_"]
    cols += (["planned/memcpy"] if cpu else []) + ["planned/torch_runs", "goal", "met"]
    summary = class_summary(rows, args.device)
    print("\n".join(summary))
    hw = hardware_tag(args.device, args.small)
    notes = (
        "GB/s = (bytes read + bytes written) / median time. A case's class is that of its shortest "
        "run; goals (GPU): planned/copy_ >= 0.90 for runs >= 16 KiB, >= 0.85 for runs of 2-16 KiB. "
        "Per class:\n\n" + "\n".join(f"- {line}" for line in summary)
    )
    paths = write_results(
        "pack",
        hw,
        rows,
        columns=cols,
        title=f"strided copy bandwidth per run length ({args.device})",
        notes=notes,
        out_dir=args.out_dir,
        extra={"classes": summary},
    )
    print("wrote", *paths)


if __name__ == "__main__":
    main()
