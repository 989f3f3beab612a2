"""Generation tokens/s of one engine on one device: dynamic cache, static cache, CUDA graph.

A random-init LLaMA-style model (~1.1B parameters, bf16; --small: a tiny one) on layout
dp1tp1pp1 in a one-rank world (NCCL on CUDA, gloo on CPU). Each mode generates --new-tokens
greedy tokens for --batch prompts of --prompt-len tokens (no EOS, so every sequence runs to the
end); tokens/s = batch * new tokens / wall time of one generate() call (median of --repeats after
one warm-up), prefill included. "same tokens" compares each mode's output with the dynamic
cache's. Modes: dynamic (the KV cache grows per step), static (preallocated cache, fixed shapes),
graph (static + the decode step replayed from a CUDA graph; CUDA only).

    python bench/bench_generate.py --device cuda
    python bench/bench_generate.py --device cpu --small
Writes <out-dir>/generate_<hw>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from timing import hardware_tag, time_fn, write_results  # noqa: E402

from real_py import Layout, ModelConfig, model_spec  # noqa: E402
from real_py.device import backend_for, peak_memory_mib, reset_peak_memory, resolve_device  # noqa: E402
from real_py.engines import Engine  # noqa: E402
from real_py.parallel import ParallelGroups  # noqa: E402
from real_py.rlhf.models import init_weights  # noqa: E402
from real_py.realloc.shard import ModelShard  # noqa: E402

# 1.10B parameters (the TinyLlama-1.1B shape): 22 layers of hidden 2048, GQA 32/4 heads,
# intermediate 5632, vocab 32000, untied head.
BIG = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
           vocab_size=32000, num_hidden_layers=22, max_position_embeddings=2048)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, num_hidden_layers=2, max_position_embeddings=256)


@contextlib.contextmanager
def one_rank_world(device: torch.device):
    """A one-rank world for the block (the engines need process groups), destroyed after it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend_for(device), init_method=f"file://{tmp}/rdzv",
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
        try:
            yield
        finally:
            dist.destroy_process_group()


def engine(cfg: ModelConfig, device: torch.device, seed: int = 0) -> Engine:
    layout = Layout()
    shard = ModelShard.from_full(model_spec(cfg), layout, 0, init_weights(cfg, seed, device), device)
    return Engine(cfg, layout, ParallelGroups(layout), shard)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny model and sizes (smoke run)")
    ap.add_argument("--batch", type=int, default=None, help="default 32 (small: 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (small: 8)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 256 (small: 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    B = args.batch or (4 if args.small else 32)
    P = args.prompt_len or (8 if args.small else 128)
    N = args.new_tokens or (16 if args.small else 256)
    dev = resolve_device(args.device)
    cfg = ModelConfig(**(SMALL if args.small else BIG), dtype="bfloat16")
    with one_rank_world(dev):
        eng = engine(cfg, dev)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(1, cfg.vocab_size, (B, P), generator=g).to(dev)
        lengths = torch.full((B,), P, dtype=torch.int64, device=dev)
        seeds = torch.arange(B, device=dev)
        modes = ["dynamic", "static"] + (["graph"] if dev.type == "cuda" else [])
        rows, ref = [], None
        for mode in modes:
            out = {}

            def run():
                out["tokens"] = eng.generate(prompts, lengths, seeds, max_new_tokens=N, decode=mode)["tokens"]
                if dev.type == "cuda":
                    torch.cuda.synchronize()

            reset_peak_memory(dev)
            t = time_fn(run, device="cpu", warmup=1, repeats=args.repeats)
            ref = out["tokens"] if ref is None else ref
            rows.append({"mode": mode, "batch": B, "prompt": P, "new tokens": N,
                         "seconds": t.median_s, "tokens/s": B * N / t.median_s,
                         "same tokens": bool(torch.equal(out["tokens"], ref)),
                         "peak GiB": peak_memory_mib(dev) / 1024})
            print(rows[-1], flush=True)
    params = model_spec(cfg).numel
    paths = write_results("generate", hardware_tag(args.device, args.small), rows,
                          columns=list(rows[0]),
                          title=f"generation tokens/s, {'tiny' if args.small else '1.1B'} bf16 model, "
                                f"dp1tp1pp1 ({args.device})",
                          notes="tokens/s = batch * new tokens / median wall time of one greedy "
                                "generate() (prefill included); graph = static KV cache with the "
                                "decode step replayed from a torch.cuda.CUDAGraph.",
                          extra={"config": BIG if not args.small else SMALL, "params": params},
                          out_dir=args.out_dir)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
