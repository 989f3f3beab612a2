"""Tokens/s of the generate, inference and train engines on CPU gloo ranks (no assertions).

    .venv/bin/python bench/bench_engines.py [--world 4] [--layouts dp2tp2pp1,dp1tp2pp2,dp2tp1pp2]

A ~100M-parameter LLaMA-style config (hidden 768, 8 layers, GQA 12/4 heads, vocab 32000,
untied) with random weights, fp32. For each layout, all ranks build groups, then time one
warm-up and `--repeats` timed calls of each engine method; tokens/s counts every token the
whole layout processed (prompt + generated for generate, all positions for inference/train).
Writes bench/results/engines_<hardware>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from real_py import Layout, ModelConfig, ModelShard, model_spec  # noqa: E402
from real_py.engines import Engine, OptimConfig  # noqa: E402
from real_py.parallel import ParallelGroups  # noqa: E402
from real_py.testing import run_distributed  # noqa: E402
from timing import RESULTS, environment, hardware_tag  # noqa: E402

CFG = ModelConfig(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=4,
                  vocab_size=32000, num_hidden_layers=8, max_position_embeddings=1024)


def _timed(fn, repeats):
    fn()
    dist.barrier()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return min(times), times


def _worker(rank, world, layouts, a):
    out = []
    for text in layouts:
        layout = Layout.parse(text)
        groups = ParallelGroups(layout)
        if not groups.member:
            continue
        shard = ModelShard.empty(model_spec(CFG), layout, rank)
        gen = torch.Generator().manual_seed(1000 + groups.tp_rank * 10 + groups.stage)
        for name, v in shard.params().items():
            if v.dim() > 1:
                v.normal_(0.0, 0.02, generator=gen)
            else:
                v.fill_(1.0)
        eng = Engine(CFG, layout, groups, shard, optim=OptimConfig(lr=1e-5))
        g = torch.Generator().manual_seed(7 + groups.dp_rank)
        B, T = a.batch // layout.dp, a.seq
        tokens = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        lengths[0] = T
        prompts, plen = tokens[:, :a.prompt], torch.full((B,), a.prompt)
        seeds = torch.arange(B) + 100 * groups.dp_rank
        mb = min(B, a.micro_batches)

        def loss_fn(o, m):
            return -o["logprobs"].sum() / float(lengths.sum() * layout.dp)

        res = {"layout": text}
        t, ts = _timed(lambda: eng.generate(prompts, plen, seeds, max_new_tokens=a.new_tokens,
                                            greedy=False, top_p=0.9), a.repeats)
        res["generate"] = {"s": t, "all_s": ts, "tokens_per_s": a.batch * a.new_tokens / t,
                           "note": f"batch {a.batch}, prompt {a.prompt}, {a.new_tokens} new tokens (decode tokens/s)"}
        t, ts = _timed(lambda: eng.inference(tokens, lengths, micro_batches=mb), a.repeats)
        n_tok = int(lengths.sum()) * layout.dp
        res["inference"] = {"s": t, "all_s": ts, "tokens_per_s": n_tok / t,
                            "note": f"batch {a.batch} x <= {T} tokens (real tokens counted), {mb} micro-batches"}
        t, ts = _timed(lambda: eng.train_step(loss_fn, {"tokens": tokens, "lengths": lengths}, mb), a.repeats)
        res["train"] = {"s": t, "all_s": ts, "tokens_per_s": n_tok / t,
                        "note": f"same batch, {mb} micro-batches, AdamW + clipping"}
        out.append(res)
        del eng, shard
    return json.dumps(out) if rank == 0 else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layouts", default="dp2tp2pp1,dp1tp2pp2,dp2tp1pp2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hardware", default=None, help="results tag (default: cpu<cores>)")
    ap.add_argument("--date", default=None, help="results date yyyymmdd (default: today, UTC)")
    a = ap.parse_args(argv)
    env = environment()
    a.hardware = a.hardware or hardware_tag("cpu")
    a.date = a.date or env["date_utc"][:10].replace("-", "")
    layouts = a.layouts.split(",")
    for text in layouts:
        if Layout.parse(text).world != a.world:
            raise ValueError(f"layout {text} does not use all {a.world} ranks")
    t0, load_before = time.time(), os.getloadavg()
    rows = json.loads(run_distributed(_worker, a.world, layouts, a, timeout=1200, pg_timeout=600)[0])
    meta = {"command": "python bench/bench_engines.py " + " ".join(argv or sys.argv[1:]),
            "model": {"params": model_spec(CFG).numel, **{k: getattr(CFG, k) for k in (
                "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "num_hidden_layers", "dtype")}},
            "world": a.world, "backend": "gloo", "threads_per_rank": 1,
            "machine": f"{platform.machine()} {os.cpu_count()} cores ({a.hardware}), {platform.platform()}",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "git_commit": env["git_commit"]},
            "date": a.date, "wall_s": time.time() - t0,
            "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()}, "results": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = str(RESULTS / f"engines_{a.hardware}_{a.date}")
    with open(base + ".json", "w") as f:
        json.dump(meta, f, indent=2)
    md = io.StringIO()
    md.write(f"# Engine throughput, {a.hardware}, {a.date}\n\n`{meta['command']}`\n\n")
    md.write(f"Model: {meta['model']['params'] / 1e6:.1f}M params fp32 ({CFG.num_hidden_layers} layers, "
             f"hidden {CFG.hidden_size}, GQA {CFG.num_attention_heads}/{CFG.num_key_value_heads}, vocab "
             f"{CFG.vocab_size}); {a.world} gloo ranks, 1 thread each; {meta['machine']}; torch "
             f"{torch.__version__}, git commit {env['git_commit']}, {env['date_utc']} UTC. Best of {a.repeats} after one warm-up. Load average (1 min) "
             f"{load_before[0]:.1f} before, {meta['loadavg_1_5_15']['after'][0]:.1f} after: the 2 cores are "
             "shared with other jobs, so treat the numbers as rough.\n\n")
    md.write("| layout | generate tok/s | inference tok/s | train tok/s |\n|---|---|---|---|\n")
    for r in rows:
        md.write(f"| {r['layout']} | {r['generate']['tokens_per_s']:.1f} | {r['inference']['tokens_per_s']:.1f} "
                 f"| {r['train']['tokens_per_s']:.1f} |\n")
    md.write("\n" + "\n".join(f"- {k}: {rows[0][k]['note']}" for k in ("generate", "inference", "train")) + "\n")
    with open(base + ".md", "w") as f:
        f.write(md.getvalue())
    print(md.getvalue())


if __name__ == "__main__":
    main()
