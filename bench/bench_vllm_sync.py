"""Weight sync into vLLM on a CPU: the `real_py` backend against full HF tensors through vLLM's
layerwise reload (what TRL, verl and OpenRLHF do), same engine, same run.

    make bench-vllm                                          # .venv-vllm's python, the defaults
    .venv-vllm/bin/python bench/bench_vllm_sync.py [--rounds 4] [--layouts tp2pp2,fsdp2]
    .venv-vllm/bin/python bench/bench_vllm_sync.py --small   # a tiny Qwen2, for development

Model: a random-weight Qwen2 of Qwen2.5-0.5B's shape in fp32 (transformers, seed 0, written once
into bench/.cache/vllm_sync/). vLLM: one in-process `LLM`, tensor_parallel_size=2, eager, no
tokenizer, weight_transfer_config={"backend": "real_py"}. Trainer: 4 ranks as threads of this
process, each its own RealPyTrainerEngine, in tp2pp2 (dp1,tp2,pp2) or fsdp2 (Layout(dp=4,
dp_shard="dim0")). Paths, through the same backend and engine: `real_py` (every rank sends its
pieces straight to the workers that hold them, in vLLM's live per-rank format; the workers write
them in place and re-process the touched layers) and `full_tensors` (RealPyTrainerInitInfo(
full_tensors=True): every worker receives the full tensors and loads them with load_weights
inside vLLM's layerwise reload; the trainer-side gather TRL & co. add is omitted, which favours
this path).

Method: per layout, --rounds rounds, each running both paths in turn (A B A B ...): init the
trainer engines (a new transfer group), one untimed warm-up update, --per-init timed updates.
Before each update (outside timing) every parameter is scaled by its own factor within 1 +- 1e-3,
so vLLM loads new weights. update_s: trainer rank 0's wall time of send_weights (it spans vLLM's
start / update / finish and the prefix-cache reset), median, min, max. worker_receive_s /
worker_apply_s: the slower worker's receive and write + re-process seconds, medians (receive
includes waiting for the other worker); apply_share = worker_apply_s / update_s; trainer_move_s:
the slowest rank's Reallocator.run. init_s, warmup_s: medians over the rounds. Bytes: what the
workers received against min_live_MiB, the plan's minimum for vLLM's live format. Memory:
staging_MiB_max_rank, a trainer rank's extra memory (bounded by the bucket); rss_growth_MiB, this
process's largest resident growth during an update (sampled every 5 ms): a gather would add
model_MiB. Checks (outside timing, recorded, never asserted): the first warm-up of each row sends
W_check (factors in 0.5..1.5, the final norm negated), then greedy tokens with logprobs of 3
prompts: tokens_changed against the fresh engine, check_vs_hf against transformers on W_check
(teacher-forced, a spawned process), check_vs_other_path; back_to_w0_vs_fresh after the last
update back to the checkpoint's weights.

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
GPU_MEMORY_UTILIZATION = 0.12  # of host memory, per vLLM CPU worker (weights + KV)
MAX_MODEL_LEN = 256
MAX_TOKENS = 8  # greedy tokens per prompt in the checks


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny Qwen2; report gets _small")
    ap.add_argument("--untied", action="store_true", help="an lm_head of its own")
    ap.add_argument("--layouts", default="tp2pp2,fsdp2", help=f"among {list(LAYOUTS)}")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per layout (both paths each)")
    ap.add_argument("--per-init", type=int, default=2, help="timed updates after each warm-up")
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


class Sampler:
    """The least (`low=True`) or largest value of read() while running, sampled every `every`
    seconds: the host's MemAvailable, or this process's resident bytes (growth above entry)."""

    def __init__(self, read, every: float, low: bool = False):
        self.read, self.every, self.pick = read, every, min if low else max
        self.base = self.value = read()

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.every):
            self.value = self.pick(self.value, self.read())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.value = self.pick(self.value, self.read())
        self.growth = self.value - self.base
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
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        raise SystemExit(f"--layouts: unknown {bad}; allowed {list(LAYOUTS)}")
    bucket = DEFAULT_BUCKET_BYTES
    load_before = [round(x, 2) for x in os.getloadavg()]
    t_start = time.perf_counter()
    mem_total = meminfo("MemTotal")
    mem = Sampler(lambda: meminfo("MemAvailable"), 0.5, low=True).__enter__()
    from real_py.benchmark import git_commit

    commit_at_start = git_commit()  # vLLM's workers import real_py.vllm when they start, below

    path = checkpoint(shape, max_pos=MAX_MODEL_LEN)
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
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        enable_prefix_caching=True,
        weight_transfer_config={"backend": "real_py"},
    )
    llm_start_s = time.perf_counter() - t0
    workers = llm.llm_engine.vllm_config.parallel_config.world_size
    ref = generate(llm, MAX_TOKENS)  # the engine fresh from the checkpoint (W0)
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
                    timeout_s=600.0,
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

            with Sampler(rss_bytes, 0.005) as mem:
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
                    out = generate(llm, MAX_TOKENS)
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
                    rec["back_to_w0"] = max_logprob_diff(generate(llm, MAX_TOKENS), ref)
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
    mem.__exit__()

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

    columns = (
        "layout path update_s min_s max_s n speedup_vs_full worker_receive_s worker_apply_s "
        "apply_share trainer_move_s recv_MiB_per_worker network_MiB min_live_MiB bytes_vs_min "
        "staging_MiB_max_rank bucket_MiB model_MiB rss_growth_MiB init_s warmup_s tokens_changed "
        "check_vs_hf check_vs_other_path back_to_w0_vs_fresh"
    ).split()
    table_rows = [{k: v for k, v in r.items() if k != "raw"} for r in rows]
    if git_commit() != commit_at_start:
        notes_extra = (
            f"The checkout changed during the run: {commit_at_start} at its start (the code vLLM's "
            f"workers imported), {git_commit()} when the report was written."
        )
    else:
        notes_extra = ""
    run = dict(
        vllm=vllm.__version__,
        transformers=transformers.__version__,
        load_before=load_before,
        load_after=load_after,
        llm_start_s=llm_start_s,
        total_s=total_s,
        mem_total=mem_total,
        mem_min_available=mem.value,
    )
    notes = notes_text(args, shape, spec, rows, cross, run, breakdown)
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
        extra=run
        | {
            "hf_reference_s": hf_s,
            "check_vs_hf": hf,
            "apply_breakdown": breakdown,
            "git_commit_at_start": commit_at_start,
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


def notes_text(args, shape, spec, rows, cross, run: dict, breakdown) -> str:
    import torch

    from real_py.benchmark import cpu_model

    lines = [
        f"Versions: vLLM {run['vllm']} (CPU build), transformers {run['transformers']}, torch "
        f"{torch.__version__}. CPU: {cpu_model()}, {os.cpu_count()} cores (shared). Load average "
        f"before the run {run['load_before']}, after {run['load_after']} (its own load: 2 vLLM "
        f"workers, the trainer threads). Host memory: least available "
        f"{run['mem_min_available'] / 2**30:.1f} GiB of {run['mem_total'] / 2**30:.1f} GiB. "
        f"vLLM start {run['llm_start_s']:.0f} s; whole run {run['total_s']:.0f} s.",
        "",
        f"Model: vocab {shape['vocab']}, hidden {shape['hidden']}, intermediate "
        f"{shape['intermediate']}, {shape['layers']} layers, {shape['heads']} heads / "
        f"{shape['kv_heads']} kv heads, {'tied' if shape['tied'] else 'untied'} lm_head: "
        f"{spec.numel / 1e6:.1f}M parameters, {spec.numel * 4 / 2**20:.0f} MiB in fp32. vLLM: "
        f"gpu_memory_utilization={GPU_MEMORY_UTILIZATION}, max_model_len={MAX_MODEL_LEN}, "
        f"prefix caching on. {args.rounds} rounds x {args.per_init} timed updates per path.",
        "",
        __doc__.split("\n\n", 2)[2].rsplit("\n\n", 1)[0],
        "",
        "W_check across every pair of rows: "
        + "; ".join(
            f"{k}: {'tokens differ' if v is None else f'{v:.3g}'}" for k, v in cross.items()
        )
        + ".",
    ]
    if shape["tied"] and any(r["hf_dlogprob"] > 1e-3 for r in rows if r["path"] == "full_tensors"):
        lines += [
            "",
            "The full_tensors rows do not answer as transformers: with tied embeddings vLLM's "
            "layerwise reload leaves the CPU lm_head's packed copy of the old embedding in place "
            "('ParallelLMHead: Failed to load weights'); real_py/vllm/worker.py `_load_full` "
            "re-packs it. Check that re-pack.",
        ]
    lines += ["", "Goal (real_py rows): 1.5x faster, the minimum bytes, staging within the bucket:"]
    for r in rows:
        if r["path"] != "real_py":
            continue
        fu = next(x for x in rows if x["layout"] == r["layout"] and x["path"] == "full_tensors")
        g = {k: "met" if v else "NOT met" for k, v in r["goals_met"].items()}
        lines.append(
            f"- {r['layout']}: {r['update_s']:.3g} s against {fu['update_s']:.3g} s = "
            f"{fu['update_s'] / r['update_s']:.2f}x ({g['speedup>=1.5']}); bytes "
            f"{r['network_MiB']:.1f} MiB = {r['bytes_vs_min']:.3f}x the minimum ({g['bytes=min']}; "
            f"full_tensors {fu['bytes_vs_min']:.2f}x); staging {r['staging_MiB_max_rank']:.1f} MiB "
            f"per rank <= bucket {r['bucket_MiB']:.0f} MiB ({g['staging<=bucket']}); RSS grew at "
            f"most {r['rss_growth_MiB']:.0f} MiB against {r['model_MiB']:.0f} MiB of model. Time: "
            f"receive {r['worker_receive_s']:.3g} s against {fu['worker_receive_s']:.3g} s, write "
            f"+ re-process {r['worker_apply_s']:.3g} s against {fu['worker_apply_s']:.3g} s "
            f"({r['apply_share']:.0%} of real_py's update, {fu['apply_share']:.0%} of "
            "full_tensors')."
        )
    parts = []
    for i, b in enumerate(breakdown):
        proc = ", ".join(
            f"{k} x{b['process_n'][k]} {v:.3f} s"
            for k, v in sorted(b["process_s"].items(), key=lambda kv: -kv[1])
        )
        parts.append(
            f"worker {i}: {b['apply_s']:.3f} s = write {b['write_s']:.3f} s (copy_ "
            f"{b['copied_MiB']:.0f} MiB into live tensors, {b['emptied_MiB']:.0f} MiB handed to "
            f"prepacked layers) + re-processing {proc}"
        )
    if parts:
        lines += [
            "",
            "Where a real_py apply goes (each worker's RealPyWeightTransferEngine._apply run again "
            "on its shard through collective_rpc, the second of two runs, "
            "process_weights_after_loading timed per module class): " + "; ".join(parts) + ".",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
