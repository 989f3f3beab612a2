"""Weight sync into vLLM on a CPU: the `real_py` backend against full HF tensors through vLLM's
layerwise reload (what TRL, verl and OpenRLHF do today), same engine, same run.

    make bench-vllm                                     # .venv-vllm's python, the defaults below
    .venv-vllm/bin/python bench/bench_vllm_sync.py [--rounds 3] [--layers 24] \
        [--layouts tp2pp2,fsdp2]
    .venv-vllm/bin/python bench/bench_vllm_sync.py --small   # a tiny Qwen2, for development

Model: a random-weight Qwen2 of Qwen2.5-0.5B's shape (hidden 896, intermediate 4864, 24 layers,
14 heads, 2 kv heads, head_dim 64, vocab 151936, tied embeddings; 494M parameters) in fp32,
written once with transformers (`Qwen2ForCausalLM(config)`, seed 0) into bench/.cache/vllm_sync/.
vLLM: one in-process `LLM` at tensor_parallel_size=2 started from that checkpoint, eager, no
tokenizer, with weight_transfer_config={"backend": "real_py"}.

Trainer: 4 ranks as threads of this process beside the LLM (each its own RealPyTrainerEngine
and transfer-group member, as tests/support/vllm_cases.py), holding the same weights in a layout:
tp2pp2 (dp1,tp2,pp2) or fsdp2 (FSDP2-style dim-0 sharding over 4 ranks, Layout(dp=4,
dp_shard="dim0")). Two paths per layout, through the same backend and the same vLLM engine:

    real_py       every rank sends its pieces straight to the workers that hold them, in vLLM's
                  live per-rank format; the workers write them in place and re-process the
                  touched layers
    full_tensors  RealPyTrainerInitInfo(full_tensors=True): every worker receives the full
                  tensors (straight from the ranks' shards: the trainer-side gather TRL & co.
                  add is omitted, which favours this path) and loads them with vLLM's
                  load_weights inside initialize_layerwise_reload / finalize_layerwise_reload

Per layout, `--rounds` rounds; each round runs both paths in turn (A B A B ...): init the
trainer engines (a new master_port: a new transfer group), one untimed warm-up update, then
`--per-init` timed updates. Each update first changes the weights slightly (every parameter
scaled by its own factor near 1, outside timing), so vLLM really loads new weights. Seconds of an
update: trainer rank 0's wall time of send_weights, which spans vLLM's start / update / finish
calls and the prefix-cache reset (the slowest side). Checks, outside timing: the first round's
warm-up sends W_check (every parameter scaled by a factor in 0.5..1.5): vLLM's greedy tokens and
logprobs after it must differ from the start-up ones and equal those of the other path (and
layout); the last round ends with an update back to the checkpoint's weights W0, whose tokens and
logprobs must equal those of the freshly started engine. Benchmarks never assert: the checks
are recorded in the report.

Writes bench/results/vllm_sync_<hw>_<date>.{json,md} (`_small` with --small).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # tp=2 on 2 cores (../shared/VLLM.md)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(_apply_breakdown)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

CACHE = HERE / ".cache" / "vllm_sync"
# Qwen2.5-0.5B's shape (head_dim = hidden / heads = 64).
FULL = dict(vocab=151936, hidden=896, intermediate=4864, heads=14, kv_heads=2, layers=24)
# --small: a tiny Qwen2 (head_dim 32: vLLM's CPU attention takes it; vocab 500 padded to 512).
SMALL = dict(vocab=500, hidden=128, intermediate=256, heads=4, kv_heads=2, layers=2)
PROMPTS = [[(7 * i + 3) % 500 for i in range(40)], [11, 12, 13], [499, 250, 1, 64]]
"""Token ids (< the small vocab); the first is longer than one KV block."""
PATHS = ("real_py", "full_tensors")
LAYOUTS = {"tp2pp2": "dp1,tp2,pp2", "fsdp2": "fsdp2"}
GOAL_SPEEDUP = 1.5


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--small", action="store_true", help="a tiny Qwen2 (development); report gets _small"
    )
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument(
        "--untied", action="store_true", help="an lm_head of its own (Qwen2.5-0.5B ties it)"
    )
    ap.add_argument(
        "--layouts", default="tp2pp2,fsdp2", help=f"trainer layouts among {list(LAYOUTS)}"
    )
    ap.add_argument(
        "--rounds", type=int, default=4, help="rounds per layout (each: both paths, one init each)"
    )
    ap.add_argument(
        "--per-init", type=int, default=2, help="timed updates after each init's warm-up"
    )
    ap.add_argument(
        "--bucket-mib", type=int, default=None, help="staging per trainer rank (default: real_py's)"
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.12,
        help="fraction of host memory each vLLM CPU worker reserves (weights + KV)",
    )
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument(
        "--max-tokens", type=int, default=8, help="greedy tokens per prompt in the checks"
    )
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="seconds any one transfer wait may take"
    )
    ap.add_argument("--out-dir", default=None, help="where the report goes (default bench/results)")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- the checkpoint


def _write_checkpoint(path: str, shape: dict, max_pos: int) -> None:
    """Runs in a spawned process, so the HF model's memory is gone before vLLM starts."""
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        num_hidden_layers=shape["layers"],
        max_position_embeddings=max_pos,
        tie_word_embeddings=shape["tied"],
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    Path(path, "DONE").write_text("ok\n")


def checkpoint(shape: dict, max_pos: int) -> Path:
    import multiprocessing

    name = "qwen2_v{vocab}_h{hidden}_i{intermediate}_a{heads}_kv{kv_heads}_l{layers}".format(
        **shape
    ) + ("_tied" if shape["tied"] else "_untied")
    path = CACHE / name
    if not (path / "DONE").exists():
        path.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        proc = multiprocessing.get_context("spawn").Process(
            target=_write_checkpoint, args=(str(path), shape, max_pos)
        )
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"writing the checkpoint {path} failed (exit {proc.exitcode})")
        print(f"[bench] wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


# ----------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_ranks(ranks, work) -> dict:
    """work(rank) on every trainer rank, each a thread; the lowest failed rank's error raised."""
    from real_py.realloc.reallocator import run_ranks

    return run_ranks(None, ranks, work)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class HostMemory:
    """The least MemAvailable of the host while it runs (sampled every 0.5 s)."""

    def __init__(self):
        self.min_available = meminfo("MemAvailable")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.5):
            self.min_available = min(self.min_available, meminfo("MemAvailable"))

    def stop(self):
        self._stop.set()
        self._thread.join()


class RssPeak:
    """Peak resident memory of this process (the trainer ranks' threads and the LLM front end)
    above its level at entry, sampled every 5 ms."""

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.growth = self.peak - self.base
        return False


def factor(name: str, k: int, spread: float) -> float:
    """Parameter `name`'s scale in weight set k: 1 + spread * u, u in [-0.5, 0.5) from a hash
    of the name and k. A product by one scalar is exact and elementwise, so every layout holds
    the same weights after it."""
    u = (zlib.crc32(f"{name}/{k}".encode()) % 1001) / 1000.0 - 0.5
    return 1.0 + spread * u


CHECK = "check"
"""The weight set of the checks: every parameter scaled by its own factor in 0.5..1.5 and the
final norm negated (a random tied-embedding model answers every prompt by repeating its last
token; the negated norm moves the argmax away from it, so the check's tokens change)."""


def check_factor(name: str) -> float:
    return factor(name, -1, 1.0) * (-1.0 if name == "norm.weight" else 1.0)


def set_weights(shards: dict, bases: dict, k, spread: float = 0.0) -> None:
    """Every rank's shard := its base (the checkpoint's W0) scaled per parameter: weight set k
    (an int: factors within 1 +- spread / 2), CHECK, or None (W0 itself)."""
    for r, shard in shards.items():
        shard.flat.copy_(bases[r])
        if k is not None:
            for name, view in shard.params().items():
                view.mul_(check_factor(name) if k == CHECK else factor(name, k, spread))


def _hf_reference(path: str, answers: dict) -> dict:
    """Runs in a spawned process: transformers' Qwen2ForCausalLM on the checkpoint with the check
    weights (W_check, scaled as set_weights(CHECK) does), teacher-forced over each answer's
    prompts + tokens. key -> {"max_abs_dlogprob": largest |vLLM logprob - HF logprob|,
    "tokens_are_hf_argmax": every answer token is HF's argmax at its position}."""
    import torch
    import transformers

    from real_py.interop.hf import hf_names
    from real_py.spec import ModelConfig, model_spec

    spec = model_spec(ModelConfig.from_hf(path))
    model = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = dict(model.named_parameters())  # tied lm_head: once, as the embedding
    with torch.no_grad():
        for p in spec.params:
            for hn in hf_names(p):
                params[hn].mul_(check_factor(p.name))
    out = {}
    for key, answer in answers.items():
        worst, argmax_ok = 0.0, True
        for prompt, (toks, lps) in zip(PROMPTS, answer):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([prompt + toks])).logits[0].double(), -1)
            for i, (t, v) in enumerate(zip(toks, lps)):
                row = lp[len(prompt) - 1 + i]
                worst = max(worst, abs(float(row[t]) - v))
                argmax_ok &= int(row.argmax()) == t
        out[key] = {"max_abs_dlogprob": worst, "tokens_are_hf_argmax": argmax_ok}
    return out


def _apply_breakdown(worker) -> dict:
    """Runs in each vLLM worker (collective_rpc) after a real_py update: the worker's own apply
    step (RealPyWeightTransferEngine._apply: write the received shard into the live parameters,
    then re-process the touched modules) run again on the shard it holds (the same weights, so
    serving is unchanged), with every quant method's process_weights_after_loading timed per
    module class (patched for the call, restored after). write_s = the rest of the apply: the
    copy_ into parameters that kept their shape and handing the layers vLLM emptied when it
    prepacked them their received weight. copied_MiB / emptied_MiB: the bytes of each kind."""
    from real_py.vllm.names import vllm_name

    eng = worker.weight_transfer_engine
    live = dict(eng.model.named_parameters())
    names = {id(m): n for n, m in eng.model.named_modules()}
    out = {"copied_MiB": 0.0, "emptied_MiB": 0.0, "process_s": {}, "process_n": {}}
    for p in eng.dst_spec.params:
        if getattr(p, "expert", -1) >= 0:  # dense models only here
            continue
        local, param = eng.shard.view(p.name), live[vllm_name(p.name)]  # this worker's piece
        key = "copied_MiB" if tuple(param.shape) == tuple(local.shape) else "emptied_MiB"
        out[key] += local.numel() * local.element_size() / 2**20
    depth = [0]

    def timed(orig):
        def wrapper(self, layer, *a, **kw):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return orig(self, layer, *a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # a method calling its base class's counts once
                    kind = type(layer).__name__ + (
                        " (lm_head)" if names.get(id(layer), "").endswith("lm_head") else ""
                    )
                    out["process_s"][kind] = (
                        out["process_s"].get(kind, 0.0) + time.perf_counter() - t
                    )
                    out["process_n"][kind] = out["process_n"].get(kind, 0) + 1

        return wrapper

    patched = {}
    for module in eng.model.modules():
        method = getattr(module, "quant_method", None)
        for cls in type(method).__mro__ if method is not None else ():
            if "process_weights_after_loading" in vars(cls) and cls not in patched:
                patched[cls] = vars(cls)["process_weights_after_loading"]
                cls.process_weights_after_loading = timed(patched[cls])
    try:
        t0 = time.perf_counter()
        eng._apply()
        out["apply_s"] = time.perf_counter() - t0
    finally:
        for cls, orig in patched.items():
            cls.process_weights_after_loading = orig
    out["write_s"] = out["apply_s"] - sum(out["process_s"].values())
    return out


def generate(llm, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def max_logprob_diff(a, b) -> float | None:
    """Largest |logprob difference| over the prompts' tokens; None when the tokens differ."""
    if [t for t, _ in a] != [t for t, _ in b]:
        return None
    return max((abs(x - y) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb)), default=0.0)


def med(xs):
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------- the run


def main() -> None:
    args = parse_args()
    from timing import hardware_tag, write_results

    from real_py import Layout, ModelShard, model_spec
    from real_py.interop.hf import load_hf_shard
    from real_py.realloc.reallocator import DEFAULT_BUCKET_BYTES
    from real_py.spec import ModelConfig
    from real_py.vllm import RealPyTrainerEngine, RealPyTrainerInitInfo, ShardSource
    from real_py.vllm.worker import vllm_plan

    shape = dict(SMALL if args.small else FULL, tied=not args.untied)
    if args.layers:
        shape["layers"] = args.layers
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        raise SystemExit(f"--layouts: unknown {bad}; allowed {list(LAYOUTS)}")
    bucket = DEFAULT_BUCKET_BYTES if args.bucket_mib is None else args.bucket_mib << 20
    load_before = [round(x, 2) for x in os.getloadavg()]
    t_start = time.perf_counter()
    mem, mem_total = HostMemory(), meminfo("MemTotal")
    from real_py.benchmark import git_commit

    commit_at_start = git_commit()  # vLLM's workers import real_py.vllm when they start, below

    path = checkpoint(shape, max_pos=max(args.max_model_len, 256))
    cfg = ModelConfig.from_hf(str(path))
    spec = model_spec(cfg)
    model_bytes = spec.numel * 4
    print(
        f"[bench] model {spec.numel / 1e6:.1f}M params, {model_bytes / 2**20:.0f} MiB fp32; "
        f"load average {load_before}",
        flush=True,
    )

    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=str(path),
        tensor_parallel_size=2,
        gpu_memory_utilization=args.gpu_memory_utilization,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=args.max_model_len,
        enforce_eager=True,
        enable_prefix_caching=True,
        weight_transfer_config={"backend": "real_py"},
    )
    llm_start_s = time.perf_counter() - t0
    workers = llm.llm_engine.vllm_config.parallel_config.world_size
    ref = generate(llm, args.max_tokens)  # the engine fresh from the checkpoint (W0)
    print(
        f"[bench] vLLM tp=2 up in {llm_start_s:.0f} s; W0 tokens {[t for t, _ in ref]}", flush=True
    )

    rows, check_out, breakdown = [], {}, []
    for lname in layouts:
        layout = Layout(dp=4, dp_shard="dim0") if lname == "fsdp2" else Layout.parse(LAYOUTS[lname])
        T = layout.world
        # The trainer's shards of W0, and a copy of each (the base every update's weights scale).
        full = load_hf_shard(str(path), cfg, Layout(), 0)
        shards = {r: ModelShard.from_full(spec, layout, r, full.params()) for r in layout.ranks}
        del full
        gc.collect()
        bases = {r: s.flat.clone() for r, s in shards.items()}
        live_min = vllm_plan(cfg, layout, T, 2, 1, False).summary()
        engines: dict = {}
        k = 0  # weight-set counter (timed updates), shared by both paths: each update is new

        def init(full_tensors: bool) -> dict:
            for e in engines.values():
                e.shutdown()
            port = free_port()

            def one(r):
                info = RealPyTrainerInitInfo(
                    rank=r,
                    master_address="127.0.0.1",
                    master_port=port,
                    config=cfg,
                    layout=layout,
                    num_workers=workers,
                    bucket_bytes=bucket,
                    timeout_s=args.timeout,
                    full_tensors=full_tensors,
                )
                return RealPyTrainerEngine.trainer_init(
                    info, client=llm, source=ShardSource(shards[r])
                )

            return on_ranks(range(T), one)

        def update() -> dict:
            """One update on every rank; rank 0's wall time of send_weights, every rank's stats."""
            walls = {}

            def one(r):
                t = time.perf_counter()
                s = engines[r].send_weights()
                walls[r] = time.perf_counter() - t
                return s

            with RssPeak() as mem:
                stats = on_ranks(range(T), one)
            return {
                "update_s": walls[0],
                "rank_wall_s": [walls[r] for r in range(T)],
                "rank_move_s": [stats[r]["seconds"] for r in range(T)],
                "sent_bytes": [stats[r]["sent_bytes"] for r in range(T)],
                "staging_bytes": [stats[r]["staging_bytes"] for r in range(T)],
                "workers": stats[0]["workers"],
                "rss_growth_bytes": mem.growth,
            }

        per = {p: {"timed": [], "warmup": [], "init_s": [], "plan": None} for p in PATHS}
        for rnd in range(args.rounds):
            for pname in PATHS:
                rec = per[pname]
                t = time.perf_counter()
                engines = init(pname == "full_tensors")
                rec["init_s"].append(time.perf_counter() - t)
                rec["plan"] = engines[0].plan.summary()
                rec["mode_full"] = engines[0].full
                # Warm-up (untimed). In the first round it carries W_check, then the checks.
                if rnd == 0:
                    set_weights(shards, bases, CHECK)
                    rec["warmup"].append(update())
                    out = generate(llm, args.max_tokens)
                    check_out[(lname, pname)] = out
                else:
                    k += 1
                    set_weights(shards, bases, k, spread=2e-3)
                    rec["warmup"].append(update())
                for _ in range(args.per_init):
                    k += 1
                    set_weights(shards, bases, k, spread=2e-3)  # outside timing
                    u = update()
                    rec["timed"].append(u)
                    print(
                        f"[bench] {lname} {pname} round {rnd}: {u['update_s']:.3f} s (workers "
                        f"receive {[round(w['receive_s'], 3) for w in u['workers']]}, apply "
                        f"{[round(w['apply_s'], 3) for w in u['workers']]})",
                        flush=True,
                    )
                if rnd == args.rounds - 1:  # back to W0: must answer as the fresh engine
                    set_weights(shards, bases, None)
                    update()
                    rec["back_to_w0"] = max_logprob_diff(generate(llm, args.max_tokens), ref)
                    if pname == "real_py" and lname == layouts[-1]:  # where a real_py apply goes
                        llm.collective_rpc(_apply_breakdown)  # (the first one warms up)
                        breakdown = llm.collective_rpc(_apply_breakdown)
        for e in engines.values():
            e.shutdown()
        engines = {}

        for pname in PATHS:
            rec = per[pname]
            timed = rec["timed"]
            plan = rec["plan"]
            upd = [u["update_s"] for u in timed]
            recv = [max(w["receive_s"] for w in u["workers"]) for u in timed]
            apply = [max(w["apply_s"] for w in u["workers"]) for u in timed]
            per_worker = [w["received_bytes"] for w in timed[-1]["workers"]]
            total = sum(per_worker)
            staging = max(max(u["staging_bytes"]) for u in rec["warmup"] + timed)
            rss = max(u["rss_growth_bytes"] for u in rec["warmup"] + timed)
            other = "full_tensors" if pname == "real_py" else "real_py"
            d_other = max_logprob_diff(check_out[(lname, pname)], check_out[(lname, other)])
            rows.append(
                {
                    "layout": lname,
                    "path": pname,
                    "vllm_mode": "full" if rec["mode_full"] else "live",
                    "update_s": med(upd),
                    "min_s": min(upd),
                    "max_s": max(upd),
                    "n": len(upd),
                    "worker_receive_s": med(recv),
                    "worker_apply_s": med(apply),
                    "apply_share": med(apply) / med(upd),
                    "trainer_move_s": med([max(u["rank_move_s"]) for u in timed]),
                    "recv_MiB_per_worker": "/".join(f"{b / 2**20:.0f}" for b in per_worker),
                    "network_MiB": total / 2**20,
                    "plan_network_MiB": plan["network_bytes"] / 2**20,
                    "min_live_MiB": live_min["min_network_bytes"] / 2**20,
                    "bytes_vs_min": total / live_min["min_network_bytes"],
                    "sent_eq_plan": sum(timed[-1]["sent_bytes"]) == plan["network_bytes"] == total,
                    "staging_MiB_max_rank": staging / 2**20,
                    "bucket_MiB": bucket / 2**20,
                    "model_MiB": model_bytes / 2**20,
                    "rss_growth_MiB": rss / 2**20,
                    "init_s": med(rec["init_s"]),
                    "warmup_s": med([u["update_s"] for u in rec["warmup"]]),
                    "tokens_changed": [t for t, _ in check_out[(lname, pname)]]
                    != [t for t, _ in ref],
                    "check_vs_other_path": "tokens differ"
                    if d_other is None
                    else f"max |dlogprob| {d_other:.3g}",
                    "back_to_w0_vs_fresh": "tokens differ"
                    if rec["back_to_w0"] is None
                    else f"max |dlogprob| {rec['back_to_w0']:.3g}",
                    "raw": {
                        "timed": timed,
                        "warmup": rec["warmup"],
                        "init_s": rec["init_s"],
                        "plan": plan,
                    },
                }
            )
        shards = bases = None  # this layout's shards go before the next one's are built
        gc.collect()

    # Speed-ups and goals, per layout.
    for row in rows:
        rp = next(r for r in rows if r["layout"] == row["layout"] and r["path"] == "real_py")
        fu = next(r for r in rows if r["layout"] == row["layout"] and r["path"] == "full_tensors")
        row["speedup_vs_full"] = fu["update_s"] / row["update_s"]  # full_tensors: 1 by definition
        if row["path"] == "real_py":
            row["goals_met"] = {
                "speedup>=1.5": fu["update_s"] / rp["update_s"] >= GOAL_SPEEDUP,
                "bytes=min": rp["network_MiB"] == rp["min_live_MiB"] and rp["sent_eq_plan"],
                "staging<=bucket": rp["staging_MiB_max_rank"] <= rp["bucket_MiB"],
            }
    # W_check across every row: the same weights give the same answer.
    keys = list(check_out)
    cross = {
        f"{a[0]}/{a[1]} vs {b[0]}/{b[1]}": max_logprob_diff(check_out[a], check_out[b])
        for i, a in enumerate(keys)
        for b in keys[i + 1 :]
    }
    load_after = [round(x, 2) for x in os.getloadavg()]
    total_s = time.perf_counter() - t_start
    mem.stop()

    # The reference for W_check: transformers on the same weights (a spawned process).
    import multiprocessing

    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        hf = pool.apply(
            _hf_reference, (str(path), {f"{a}/{b}": v for (a, b), v in check_out.items()})
        )
    hf_s = time.perf_counter() - t0
    for row in rows:
        h = hf[f"{row['layout']}/{row['path']}"]
        row["hf_dlogprob"] = h["max_abs_dlogprob"]
        row["check_vs_hf"] = f"max |dlogprob| {h['max_abs_dlogprob']:.3g}, tokens " + (
            "= HF argmax" if h["tokens_are_hf_argmax"] else "NOT HF argmax"
        )

    import transformers
    import vllm

    columns = [
        "layout",
        "path",
        "update_s",
        "min_s",
        "max_s",
        "n",
        "speedup_vs_full",
        "worker_receive_s",
        "worker_apply_s",
        "apply_share",
        "trainer_move_s",
        "recv_MiB_per_worker",
        "network_MiB",
        "min_live_MiB",
        "bytes_vs_min",
        "staging_MiB_max_rank",
        "bucket_MiB",
        "model_MiB",
        "rss_growth_MiB",
        "init_s",
        "warmup_s",
        "tokens_changed",
        "check_vs_hf",
        "check_vs_other_path",
        "back_to_w0_vs_fresh",
    ]
    table_rows = [{k: v for k, v in r.items() if k != "raw"} for r in rows]
    if git_commit() != commit_at_start:
        notes_extra = (
            f"The checkout changed during the run: {commit_at_start} at its start (the code vLLM's "
            f"workers imported), {git_commit()} when the report was written."
        )
    else:
        notes_extra = ""
    notes = notes_text(
        args,
        shape,
        spec,
        layouts,
        rows,
        cross,
        load_before,
        load_after,
        llm_start_s,
        total_s,
        vllm.__version__,
        transformers.__version__,
        breakdown,
        mem_total,
        mem.min_available,
    )
    notes = notes_extra + ("\n\n" if notes_extra else "") + notes
    theme_hw = hardware_tag("cpu", args.small) + ("_untied" if args.untied else "")
    jpath, mpath = write_results(
        "vllm_sync",
        theme_hw,
        table_rows,
        columns=columns,
        title=(
            "Weight sync into vLLM (CPU, tp=2): real_py backend vs full tensors + layerwise reload"
        ),
        notes=notes,
        out_dir=args.out_dir,
        extra={
            "versions": {"vllm": vllm.__version__, "transformers": transformers.__version__},
            "load_avg_before": load_before,
            "load_avg_after": load_after,
            "llm_start_s": llm_start_s,
            "total_s": total_s,
            "hf_reference_s": hf_s,
            "check_vs_hf": hf,
            "apply_breakdown": breakdown,
            "git_commit_at_start": commit_at_start,
            "host_mem_total_bytes": mem_total,
            "host_mem_min_available_bytes": mem.min_available,
            "shape": shape,
            "params": spec.numel,
            "checkpoint": str(path),
            "check_cross": cross,
            "ref_tokens": [t for t, _ in ref],
            "check_tokens": {f"{a}/{b}": [t for t, _ in v] for (a, b), v in check_out.items()},
            "raw": {f"{r['layout']}/{r['path']}": r["raw"] for r in rows},
            "args": vars(args),
        },
    )
    print(f"[bench] wrote {mpath} and {jpath.name} ({total_s:.0f} s)", flush=True)


def notes_text(
    args,
    shape,
    spec,
    layouts,
    rows,
    cross,
    load_before,
    load_after,
    llm_start_s,
    total_s,
    vllm_version,
    tf_version,
    breakdown,
    mem_total,
    mem_min_avail,
) -> str:
    import torch

    from real_py.benchmark import cpu_model

    lines = []
    add = lines.append
    add(
        f"Versions: vLLM {vllm_version} (CPU build), transformers {tf_version}, torch "
        f"{torch.__version__}. CPU: {cpu_model()}, {os.cpu_count()} cores (shared machine). Load "
        f"average (1/5/15 min) before the run {load_before}, after {load_after} (the run's own "
        "load: 2 vLLM workers, the trainer threads). Host memory: least available during the run "
        f"{mem_min_avail / 2**30:.1f} GiB of {mem_total / 2**30:.1f} GiB. vLLM start "
        f"{llm_start_s:.0f} s; whole run {total_s:.0f} s."
    )
    add("")
    add(
        "Model: random-weight Qwen2 (transformers `Qwen2ForCausalLM(config)`, seed 0), vocab "
        f"{shape['vocab']}, hidden {shape['hidden']}, intermediate {shape['intermediate']}, "
        f"{shape['layers']} layers, {shape['heads']} heads / {shape['kv_heads']} kv heads "
        f"(head_dim {shape['hidden'] // shape['heads']}), "
        f"{'tied embeddings' if shape['tied'] else 'untied lm_head'}: {spec.numel / 1e6:.1f}M "
        f"parameters, {spec.numel * 4 / 2**20:.0f} MiB in fp32"
        + (" (Qwen2.5-0.5B's shape)." if shape == dict(FULL, tied=True) else ".")
    )
    add(
        "vLLM: one in-process `LLM`, tensor_parallel_size=2 (VLLM_CPU_OMP_THREADS_BIND=0|1), "
        f"dtype float32, gpu_memory_utilization={args.gpu_memory_utilization}, "
        f"max_model_len={args.max_model_len}, enforce_eager, skip_tokenizer_init, prefix caching "
        "on, weight_transfer_config backend real_py. Trainer: 4 ranks as threads of the bench "
        f"process ({', '.join(layouts)}: tp2pp2 = dp1,tp2,pp2; fsdp2 = Layout(dp=4, "
        "dp_shard='dim0')), each its own RealPyTrainerEngine; their pack work shares this "
        "process's GIL (the moves run in C++ and gloo), and everything shares the 2 cores with "
        "vLLM's engine-core and 2 worker processes."
    )
    add("")
    add(
        "Paths: `real_py` = the backend's default (each trainer rank sends its pieces straight to "
        "the workers that hold them, in vLLM's live per-rank format; the workers write them in "
        "place and re-run process_weights_after_loading on touched layers). `full_tensors` = "
        "RealPyTrainerInitInfo(full_tensors=True): every worker receives the full model and loads "
        "it through vLLM's load_weights inside initialize_layerwise_reload / "
        "finalize_layerwise_reload, what TRL, verl and OpenRLHF do. The baseline here omits the "
        "trainer-side gather of full tensors those trainers add before sending (the full tensors "
        "go straight from the ranks' shards), so it is favoured: a real TRL-style sync is slower "
        "than this row and needs a full-model buffer on the trainer."
    )
    if shape["tied"] and all(r["hf_dlogprob"] <= 1e-3 for r in rows if r["path"] == "full_tensors"):
        add(
            "With tied embeddings the full_tensors path includes the backend's re-pack of the tied "
            "lm_head after finalize_layerwise_reload (real_py/vllm/worker.py `_load_full`): vLLM's "
            "layerwise reload alone leaves the ParallelLMHead's packed CPU copy of the old "
            "embedding in place (each worker logs 'ParallelLMHead: Failed to load weights'), and "
            "an earlier run of this benchmark, before that re-pack, answered up to 0.37 off "
            "transformers in logprob on W_check. A trainer that reloads a tied model through "
            "vLLM's layerwise reload on a CPU, as TRL & co. do, serves that stale lm_head."
        )
    add("")
    add(
        f"Method: per layout, {args.rounds} rounds; each round runs real_py then full_tensors on "
        "the same vLLM engine (A B A B ...): init the trainer engines (new master_port, a new "
        f"transfer group), one untimed warm-up update, {args.per_init} timed update(s). Before "
        "every update (outside timing) each parameter is scaled by its own factor within 1 +- "
        "1e-3 of the checkpoint's, a new set per update, so vLLM loads new weights each time. "
        "update_s: trainer rank 0's wall time of send_weights (it drives vLLM's start / update / "
        "finish and the prefix-cache reset, so it spans the workers' receive and apply: the "
        "slowest side), median, min and max over the timed updates. worker_receive_s / "
        "worker_apply_s: the slower worker's receive and write/re-process seconds "
        "(stats['workers']), medians; a worker writes only once every worker has received all of "
        "its own, so receive_s includes that wait. apply_share = worker_apply_s / update_s: the "
        "share of an update spent writing and re-processing layers (full_tensors: load_weights in "
        "the layerwise reload). trainer_move_s: the slowest trainer rank's Reallocator.run "
        "seconds. init_s: trainer_init on the 4 ranks (vLLM's init_weight_transfer_engine "
        "included), median over the rounds; warmup_s: the first update after an init (untimed), "
        "median."
    )
    add("")
    add(
        "Bytes: recv_MiB_per_worker / network_MiB are what the workers received "
        "(stats['workers']); min_live_MiB is the plan's minimum for vLLM's live per-rank format "
        "(engine.plan.summary()['min_network_bytes'] of the real_py plan; trainer and workers "
        "share no rank, so every byte crosses the group); bytes_vs_min their ratio. full_tensors "
        "receives the full model per worker. sent_eq_plan: the ranks' sent_bytes sum = the plan's "
        "network_bytes = what the workers received. Memory: staging_MiB_max_rank = the largest "
        "stats['staging_bytes'] of a trainer rank (its extra memory, bounded by bucket_bytes), "
        "against model_MiB; rss_growth_MiB = the largest growth of this process's resident memory "
        "during an update (the 4 ranks together plus the LLM front end, sampled every 5 ms, "
        "warm-up updates included): a full-model gather would add model_MiB."
    )
    add("")
    add(
        "Checks (outside timing; recorded, never asserted): the first round's warm-up of each row "
        "sends W_check (every parameter scaled by its own factor in 0.5..1.5, the final norm "
        f"negated), then greedy tokens of 3 prompts ({args.max_tokens} tokens each, with "
        "logprobs): tokens_changed = they differ from the freshly started engine's (W0); "
        "check_vs_hf = against transformers' Qwen2ForCausalLM on the same W_check (fp32, "
        "teacher-forced over vLLM's tokens; a spawned process after the timed part): the largest "
        "logprob difference and whether every token is HF's argmax; check_vs_other_path = the "
        "other path's answer for the same W_check, same layout (`tokens differ` or the largest "
        "logprob difference); back_to_w0_vs_fresh = after the row's last update back to W0, "
        "against the freshly started engine. Every pair of rows on W_check: "
        + "; ".join(
            f"{k}: {'tokens differ' if v is None else f'{v:.3g}'}" for k, v in cross.items()
        )
        + "."
    )
    add("")
    hf_full = [r for r in rows if r["path"] == "full_tensors" and r["hf_dlogprob"] > 1e-3]
    hf_ok = [r for r in rows if r["path"] == "real_py" and r["hf_dlogprob"] <= 1e-3]
    if hf_full and shape["tied"]:
        add(
            "The full_tensors rows do not answer as the reference (largest |dlogprob| against HF "
            f"{max(r['hf_dlogprob'] for r in hf_full):.3g}; real_py rows "
            + (f"{max(r['hf_dlogprob'] for r in hf_ok):.3g}" if hf_ok else "also off")
            + "). The cause, with tied "
            "embeddings: vLLM's layerwise reload loads embed_tokens.weight, but no checkpoint "
            "tensor names lm_head.weight (tied), so finalize_layerwise_reload finds the "
            "ParallelLMHead with nothing loaded, logs 'ParallelLMHead: Failed to load weights' in "
            "every worker and puts the layer's old kernel tensors back without re-running "
            "process_weights_after_loading. On vLLM's CPU backend the lm_head computes from a "
            "packed (oneDNN) copy of the embedding made there, so after a full_tensors update the "
            "logits come from the lm_head packed at the previous real_py update or at start-up, "
            "with the new embedding and layers. So this baseline also skips the lm_head's repack, "
            "which real_py does (breakdown below): it favours the baseline's time. It affects the "
            "backend's full-tensor fallback (real_py/vllm/worker.py `_load_full`) and anyone "
            "reloading a tied model through vLLM's layerwise reload on a CPU. With an untied "
            "lm_head (`--small --untied`) both paths equal HF."
        )
        add("")
    add(
        "Goal (real_py rows): at least 1.5x faster per update than full_tensors, bytes = the "
        "minimum, trainer extra memory within the bucket:"
    )
    for r in rows:
        if r["path"] == "real_py":
            fu = next(x for x in rows if x["layout"] == r["layout"] and x["path"] == "full_tensors")
            g = r["goals_met"]
            add(
                f"- {r['layout']}: {r['update_s']:.3g} s against {fu['update_s']:.3g} s = "
                f"{fu['update_s'] / r['update_s']:.2f}x "
                f"({'met' if g['speedup>=1.5'] else 'NOT met'}); bytes {r['network_MiB']:.1f} MiB "
                f"= {r['bytes_vs_min']:.3f}x the minimum "
                f"({'met' if g['bytes=min'] else 'NOT met'}; full_tensors "
                f"{fu['bytes_vs_min']:.2f}x); staging {r['staging_MiB_max_rank']:.1f} MiB per rank "
                f"<= bucket {r['bucket_MiB']:.0f} MiB "
                f"({'met' if g['staging<=bucket'] else 'NOT met'}), "
                f"{r['staging_MiB_max_rank'] / r['model_MiB']:.3f} of the model; process RSS grew "
                f"at most {r['rss_growth_MiB']:.0f} MiB during an update against "
                f"{r['model_MiB']:.0f} MiB of model"
                + (": no full-model gather." if r["rss_growth_MiB"] < r["model_MiB"] else ".")
            )
    add("")
    for r in rows:
        if r["path"] == "real_py":
            fu = next(x for x in rows if x["layout"] == r["layout"] and x["path"] == "full_tensors")
            add(
                f"- {r['layout']}, where the time goes: receive {r['worker_receive_s']:.3g} s "
                f"against {fu['worker_receive_s']:.3g} s (full_tensors / real_py "
                f"{fu['worker_receive_s'] / r['worker_receive_s']:.2f}, for "
                f"{r['bytes_vs_min'] / fu['bytes_vs_min']:.2f} of the bytes), write + re-process "
                f"{r['worker_apply_s']:.3g} s against {fu['worker_apply_s']:.3g} s "
                f"({r['apply_share']:.0%} of real_py's update, {fu['apply_share']:.0%} of "
                "full_tensors')."
            )
    if breakdown:
        add("")
        parts = []
        for i, b in enumerate(breakdown):
            proc = ", ".join(
                f"{k} x{b['process_n'][k]} {v:.3f} s"
                for k, v in sorted(b["process_s"].items(), key=lambda kv: -kv[1])
            )
            parts.append(
                f"worker {i}: {b['apply_s']:.3f} s = write {b['write_s']:.3f} s (copy_ "
                f"{b['copied_MiB']:.0f} MiB into live tensors, {b['emptied_MiB']:.0f} MiB handed "
                f"to prepacked layers) + re-processing {proc}"
            )
        add(
            "Where a real_py apply goes (after the last real_py row: each worker's own apply step, "
            "RealPyWeightTransferEngine._apply, run again on the shard it holds through "
            "collective_rpc, the second of two runs, with vLLM's process_weights_after_loading "
            "timed per module class; "
            "write = the rest): " + "; ".join(parts) + "."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
