"""Decode speed of one engine on one device against the weight-read roofline and transformers.

A random-init LLaMA-style model (the TinyLlama-1.1B shape, bf16; --small: a tiny one) made by
transformers (LlamaForCausalLM, its own init), saved once as an HF checkpoint in a temporary
folder and loaded by both sides: real_py (layout dp1tp1pp1, a one-rank world: NCCL on CUDA, gloo
on CPU) and transformers. 32 prompts of 128 tokens, 256 greedy new tokens (--small: 4, 8, 16), no
EOS (every sequence runs to the end). Per mode:

  seconds, tokens/s   one generate() call (median of --repeats after a warm-up call, whose time
                      is "first s": compilation and graph capture), prefill included;
                      tokens/s = batch * new tokens / seconds
  step ms             one decode step: (seconds - seconds of a 1-token generate()) / (new - 1)
  roofline %          the weight-read time of a step (every weight read once: parameter bytes
                      less the embedding table, of which a step reads `batch` rows) at the HBM
                      bandwidth of the device (table: H100 3.35 TB/s, H200 4.8 TB/s, ...; else the
                      measured copy_ rate) / step ms; "KV %" the same with the step's average
                      KV-cache read added
  same / prefix       greedy tokens equal to the reference mode's (dynamic: the eager kernels of
                      the earlier code) for every row, and the mean fraction of each row equal
                      before the first difference (bf16 flips near-tied argmaxes between kernels);
                      "same as hf" / "hf prefix" the same against transformers' tokens

Modes on CUDA: graph (CUDA-graph decode with the compiled step: the default), graph-eager (the
graph without torch.compile), dynamic (eager, the reference), hf-static (transformers'
generate() with cache_implementation="static": its own compiled decode step where transformers
compiles one). On CPU: dynamic, static, hf-static. An fp32 check then runs the same greedy
generation small (8 prompts, 32 new tokens) in fp32 with ours (default mode and
dynamic) and transformers (dynamic cache) and reports whether the tokens are equal (not asserted).

    python bench/bench_generate.py --device cuda
    python bench/bench_generate.py --device cpu --small
Writes <out-dir>/generate_<hw>_<date>.{json,md}.
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from timing import bench_parser, hardware_tag, sync, write_results

from real_py import Layout, ModelConfig, model_spec
from real_py.device import backend_for, peak_memory_mib, reset_peak_memory, resolve_device
from real_py.engines import Engine
from real_py.parallel import ParallelGroups
from real_py.realloc.shard import ModelShard
from real_py.rlhf.models import init_weights

# 1.10B parameters (the TinyLlama-1.1B shape): 22 layers of hidden 2048, GQA 32/4 heads,
# intermediate 5632, vocab 32000, untied head.
BIG = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    num_hidden_layers=22,
    max_position_embeddings=2048,
)
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
)

HBM_BYTES_PER_S = {
    "h200": 4.8e12,
    "h100": 3.35e12,
    "h800": 3.35e12,
    "gh200": 4.0e12,
    "b200": 8.0e12,
    "a100": 2.0e12,
    "l40s": 0.864e12,
    "a10": 0.6e12,
    "l4": 0.3e12,
}
"""Datasheet HBM bandwidth by device-name keyword (H100: the SXM part; PCIe is 2.0 TB/s)."""


@contextlib.contextmanager
def one_rank_world(device: torch.device):
    """A one-rank world for the block (the engines need process groups), destroyed after it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            backend_for(device),
            init_method=f"file://{tmp}/rdzv",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=300),
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def engine(cfg: ModelConfig, device: torch.device, seed: int = 0) -> Engine:
    """An engine on real_py's own random init (bench_gpu_ppo, profile_gpu)."""
    layout = Layout()
    shard = ModelShard.from_full(
        model_spec(cfg), layout, 0, init_weights(cfg, seed, device), device
    )
    return Engine(cfg, layout, ParallelGroups(layout), shard)


def hf_engine(path: str, dtype: str, device: torch.device) -> Engine:
    from real_py.interop.hf import load_hf_shard

    cfg = ModelConfig.from_hf(path, head="lm", dtype=dtype)
    layout = Layout()
    return Engine(cfg, layout, ParallelGroups(layout), load_hf_shard(path, cfg, layout, 0, device))


def make_hf_model(sizes: dict, device: torch.device, path: str):
    """transformers' LlamaForCausalLM with its own random init, bf16 on `device`, saved to path."""
    import transformers

    cfg = transformers.LlamaConfig(
        **sizes, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        except TypeError:  # transformers before `dtype`
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def hbm_bandwidth(device: torch.device) -> tuple[float, str, float]:
    """(bytes/s used for the roofline, its source, the measured copy_ rate in bytes/s)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 24)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    sync(device)
    measured = 2 * a.numel() * 4 * reps / (time.perf_counter() - t0)
    del a, b
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key in sorted(HBM_BYTES_PER_S, key=len, reverse=True):
            if key in name.replace("-", " ").split():
                return HBM_BYTES_PER_S[key], f"datasheet ({key})", measured
    return measured, "measured copy_", measured


def prefix_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the fraction of new tokens equal before the first difference."""
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n]).int().cumprod(1)
    return float(same.sum(1).float().mean() / max(a.shape[1], b.shape[1], 1))


def timed(fn, device, repeats: int) -> tuple[float, float, object]:
    """(first call s, median of `repeats` later calls s, last result)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return first, (statistics.median(times) if times else first), out


def ours(eng, prompts, lengths, n: int, mode: str, compile_flag):
    seeds = torch.arange(prompts.shape[0], device=prompts.device)

    def run(n=n):
        eng.compile_decode = compile_flag
        try:
            return eng.generate(prompts, lengths, seeds, max_new_tokens=n, decode=mode)[
                "new_tokens"
            ]
        finally:
            eng.compile_decode = None

    return run


def hf(model, prompts, n: int, static: bool):
    """transformers' greedy generate() of n new tokens (no EOS: every row runs to the end)."""
    from transformers import GenerationConfig

    mask = torch.ones_like(prompts)
    # a default filled in from the model would stop rows
    model.generation_config.eos_token_id = None
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=1)
    if static:
        kw["cache_implementation"] = "static"

    def run(n=n):
        with torch.no_grad():
            out = model.generate(
                input_ids=prompts,
                attention_mask=mask,
                generation_config=GenerationConfig(max_new_tokens=n, **kw),
            )
        return out[:, prompts.shape[1] :]

    return run


def main(argv=None):
    ap = bench_parser(__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    B, P, N = (4, 8, 16) if args.small else (32, 128, 256)
    dev = resolve_device(args.device)
    sizes = SMALL if args.small else BIG
    rows, extra = [], {"config": sizes}
    with one_rank_world(dev), tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        hf_model = make_hf_model(sizes, dev, tmp)
        eng = hf_engine(tmp, "bfloat16", dev)
        extra["setup_seconds"] = time.perf_counter() - t0
        cfg = eng.config
        spec = model_spec(cfg)
        embed = sum(p.numel for p in spec.params if p.name == "embed_tokens.weight")
        tied = any(p.tied_to_head for p in spec.params)
        weight_bytes = (spec.numel - (0 if tied else embed)) * 2 + B * cfg.hidden_size * 2
        bw, bw_src, bw_measured = hbm_bandwidth(dev)
        kv_per_slot = 2 * cfg.num_hidden_layers * B * cfg.num_key_value_heads * cfg.head_dim * 2
        kv_bytes = kv_per_slot * (P + N / 2)  # the average step's keys and values (a dense read)
        extra.update(
            params=spec.numel,
            weight_bytes=weight_bytes,
            hbm_bytes_per_s=bw,
            hbm_source=bw_src,
            copy_bytes_per_s=bw_measured,
            kv_bytes_avg_step=kv_bytes,
            weight_read_ms=weight_bytes / bw * 1e3,
        )
        print(
            f"{spec.numel / 1e9:.2f}B params, weights {weight_bytes / 2**30:.2f} GiB, HBM "
            f"{bw / 1e12:.2f} TB/s ({bw_src}; copy_ {bw_measured / 1e12:.2f} TB/s): weight read "
            f"{weight_bytes / bw * 1e3:.3f} ms",
            flush=True,
        )
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(3, cfg.vocab_size, (B, P), generator=g).to(dev)
        lengths = torch.full((B,), P, dtype=torch.int64, device=dev)
        if dev.type == "cuda":
            modes = [
                ("dynamic", "dynamic", False),
                ("graph", "graph", None),
                ("graph-eager", "graph", False),
            ]
        else:
            modes = [("dynamic", "dynamic", False), ("static", "static", None)]
        runs = {name: ours(eng, prompts, lengths, N, mode, flag) for name, mode, flag in modes}
        runs["hf-static"] = hf(hf_model, prompts, N, static=True)
        ref, tokens = None, {}
        for name, run in runs.items():
            row = {"mode": name, "batch": B, "prompt": P, "new tokens": N}
            try:
                reset_peak_memory(dev)
                # dynamic on a GPU is host-bound (slow): its warm-up call alone
                reps = 0 if name == "dynamic" and dev.type == "cuda" else args.repeats
                first, sec, toks = timed(run, dev, reps)
                tokens[name] = toks.cpu()
                peak = peak_memory_mib(dev) / 1024
                _, one, _ = timed(lambda: run(1), dev, 2)
                step = (sec - one) / max(N - 1, 1)
                ref = toks if ref is None else ref
                pct = 100 / bw / step if step > 0 else float("nan")  # % of roofline per byte
                row.update(
                    {
                        "first s": first,
                        "seconds": sec,
                        "tokens/s": B * N / sec,
                        "step ms": step * 1e3,
                        "roofline %": weight_bytes * pct,
                        "KV %": (weight_bytes + kv_bytes) * pct,
                        "same": bool(
                            toks.shape == ref.shape and torch.equal(toks.cpu(), ref.cpu())
                        ),
                        "prefix": prefix_fraction(toks.cpu(), ref.cpu()),
                        "peak GiB": peak,
                    }
                )
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                traceback.print_exc()
            rows.append(row)
            print(row, flush=True)
            write_report(args, rows, extra)
        if "hf-static" in tokens:  # greedy tokens against transformers' (bf16: near ties may flip)
            for r in rows:
                if r["mode"] in tokens:
                    a, b = tokens[r["mode"]], tokens["hf-static"]
                    r["same as hf"] = bool(a.shape == b.shape and torch.equal(a, b))
                    r["hf prefix"] = prefix_fraction(a, b)
        extra["decode_states"] = [
            [st.backend, st.compiled_ok, st.backend_failed, sorted(st.graphs), st.capacity]
            for st in getattr(eng, "_decode_states", {}).values()
        ]
        by = {r["mode"]: r for r in rows}
        ours_name = "graph" if dev.type == "cuda" else "static"
        if "tokens/s" in by.get(ours_name, {}) and "tokens/s" in by.get("hf-static", {}):
            extra["speedup_vs_hf_static"] = by[ours_name]["tokens/s"] / by["hf-static"]["tokens/s"]
            extra["step_speedup_vs_hf_static"] = (
                by["hf-static"]["step ms"] / by[ours_name]["step ms"]
            )
        extra["fp32_check"] = fp32_check(hf_model, tmp, dev, 8, P, 32)
        print("fp32 check", extra["fp32_check"], flush=True)
    extra["complete"] = True
    write_report(args, rows, extra)


def write_report(args, rows: list[dict], extra: dict) -> None:
    """The report of what has run so far (written after every mode: a step cut by its time cap
    still leaves one; extra["complete"] says whether every part ran)."""
    cols = (
        "mode|batch|prompt|new tokens|first s|seconds|tokens/s|step ms|roofline %|KV %|same|prefix"
        "|same as hf|hf prefix|peak GiB"
    ).split("|")
    if any("error" in r for r in rows):
        cols.append("error")
    bw = extra["hbm_bytes_per_s"]
    notes = (
        f"{extra['params'] / 1e9:.2f}B parameters; a step reads "
        f"{extra['weight_bytes'] / 2**30:.2f} GiB of weights: {extra['weight_read_ms']:.3f} ms at "
        f"{bw / 1e12:.2f} TB/s ({extra['hbm_source']}; a device copy_ measured "
        f"{extra['copy_bytes_per_s'] / 1e12:.2f} TB/s).\n\n"
        + __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]  # the method and columns
    )
    if not extra.get("complete"):
        notes += "\n\nPARTIAL: the run stopped before every mode and check had run."
    if "speedup_vs_hf_static" in extra:
        notes += (
            "\n\nOurs against transformers' static-cache generate(): "
            f"{extra['speedup_vs_hf_static']:.2f}x tokens/s, "
            f"{extra['step_speedup_vs_hf_static']:.2f}x per decode step (goal 2x)."
        )
    if "fp32_check" in extra:
        notes += "\n\nfp32 greedy token check: " + ", ".join(
            f"{k}: {v}" for k, v in extra["fp32_check"].items()
        )
    paths = write_results(
        "generate",
        hardware_tag(args.device, args.small),
        rows,
        columns=cols,
        title=f"decode speed, {'tiny' if args.small else '1.1B'} bf16 model, dp1tp1pp1 "
        f"({args.device}), against the weight-read roofline and transformers",
        notes=notes,
        extra=extra,
        out_dir=args.out_dir,
    )
    if extra.get("complete"):
        print("wrote", *paths)


def fp32_check(hf_model, path: str, dev, B: int, P: int, N: int) -> dict:
    """Greedy tokens in fp32: ours (default decode mode, and dynamic) against transformers'
    (dynamic cache); reported, not asserted."""
    out = {"batch": B, "new tokens": N}
    try:
        model = hf_model.float()
        eng = hf_engine(path, "float32", dev)  # the bf16 checkpoint's values, exactly, in fp32
        g = torch.Generator().manual_seed(2)
        prompts = torch.randint(3, eng.config.vocab_size, (B, P), generator=g).to(dev)
        lengths = torch.full((B,), P, dtype=torch.int64, device=dev)
        seeds = torch.arange(B, device=dev)
        auto = eng.generate(prompts, lengths, seeds, max_new_tokens=N)["new_tokens"].cpu()
        dyn = eng.generate(prompts, lengths, seeds, max_new_tokens=N, decode="dynamic")[
            "new_tokens"
        ].cpu()
        ref = hf(model, prompts, N, static=False)().cpu()
        out.update(
            {
                "ours == transformers": bool(auto.shape == ref.shape and torch.equal(auto, ref)),
                "dynamic == transformers": bool(dyn.shape == ref.shape and torch.equal(dyn, ref)),
                "ours prefix": round(prefix_fraction(auto, ref), 4),
            }
        )
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        traceback.print_exc()
    return out


if __name__ == "__main__":
    main()
