"""Generation with vLLM against the built-in engine, timed inside the runtime (CPU, gloo ranks).

    .venv-vllm/bin/python bench/bench_vllm_speed.py [--steps 4] [--cases toy-grpo ...]

Each case runs `python -m real_py train` once per engine with the same model, prompts, reward,
plan and seed (the engines rotate, case by case and repeat by repeat), and reads the per-call
seconds of steps 2.. from metrics.jsonl (step 1 holds the start-up). Engines: builtin, vllm
(old_logp recomputed by the trainer: the call actor_logp) and vllm-rollout
(generation.vllm_logp: rollout, vLLM's log-probs are old_logp, no recompute call). Per run:

- the generation call (actor_gen): seconds and new tokens per second (response_length x rows);
- the whole step, and what vLLM adds to it: the actor_logp call (old_logp recomputed on the
  train layout; the built-in engine returns it with the tokens) and the actor's reallocation
  into the generation layout (vLLM's live format, or the built-in engine's layout).

Cases: the copy task's vLLM configs (the toy: 2 new tokens) and a 0.51B Llama-shaped fp32 actor
(30 layers, hidden 1024; 32-token synthetic prompts, up to 32 new tokens) on 2 ranks, one per
core: generation on tp2 (one vLLM engine over both ranks), training on pp2, so the weights move
between the two every step with either engine; 4 ranks holding vLLM beside the trained actor
were killed for memory here. PPO (16 prompts, fixed length: the plain decode of the first try in
the issue, sampled) and GRPO (4 prompts x 4 samples, stop tokens on, so lengths are uneven). The
PPO case's critic is a 2-layer model of the same width (a 0.51B critic with Adam does not fit 24
GiB beside the actor); it is the same for both engines.
Writes bench/results/vllm_speed_cpu2_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from timing import hardware_tag, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BIG = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 30,
    "vocab_size": 4096,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
TWO = {"ranks": [0, 1], "dp": 1, "tp": 2, "pp": 1}
BIG_PLAN = {
    "world_size": 2,
    "calls": {
        "actor_gen": TWO,
        "ref_inf": TWO,
        "rew_inf": {"ranks": [0, 1], "dp": 2, "tp": 1, "pp": 1},
        "actor_train": {"ranks": [0, 1], "dp": 1, "tp": 1, "pp": 2},
    },
}


def big_config(algo: str) -> dict:
    calls = dict(BIG_PLAN["calls"])
    cfg = {
        "algo": algo,
        "save_every": 0,
        "actor": BIG,
        "offload_frozen": True,
        "data": {"num_prompts": 64, "min_prompt_len": 32, "max_prompt_len": 32},
        "reward": {"kind": "rule", "target_token": 7},
    }
    if algo == "ppo":
        cfg["critic"] = dict(BIG, num_hidden_layers=2)
        cfg["data"]["batch_size"] = 16
        cfg["generation"] = {"max_new_tokens": 32}
        cfg["ppo"] = {"ppo_epochs": 1, "mini_batches": 1}
        calls["critic_inf"] = calls["critic_train"] = {"ranks": [0, 1], "dp": 1, "tp": 1, "pp": 2}
    else:
        # 1 in 16 of the vocabulary stops a sample: lengths spread over 1..32 tokens.
        cfg["data"]["batch_size"] = 16
        cfg["generation"] = {"max_new_tokens": 32, "stop_token_ids": list(range(16, 272))}
        cfg["ppo"] = {"group_size": 4, "ppo_epochs": 1, "mini_batches": 1}
    cfg["plan"] = {"world_size": 2, "calls": calls}
    return cfg


CASES = {
    "toy-grpo": lambda tmp: os.path.join(ROOT, "configs", "copy_task", "grpo_vllm.yaml"),
    "toy-ppo": lambda tmp: os.path.join(ROOT, "configs", "copy_task", "ppo_vllm.yaml"),
    "0.5b-ppo": lambda tmp: _write(tmp, "ppo", big_config("ppo")),
    "0.5b-grpo": lambda tmp: _write(tmp, "grpo", big_config("grpo")),
}


def _write(tmp: str, name: str, cfg: dict) -> str:
    path = os.path.join(tmp, f"{name}_big.yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    return path


ENGINES = {
    "builtin": ["generation.engine=builtin"],
    "vllm": ["generation.engine=vllm", "generation.vllm_logp=recompute"],
    "vllm-rollout": ["generation.engine=vllm", "generation.vllm_logp=rollout"],
}


def run(config: str, engine: str, steps: int, out: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "real_py",
        "train",
        "--config",
        config,
        "--out-dir",
        out,
        "--no-progress",
        "--overwrite",
        *ENGINES[engine],
        f"steps={steps}",
    ]
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(recs: list[dict], rows: int) -> dict:
    steady = recs[1:] or recs
    med = lambda xs: statistics.median(xs)
    gen = med([r["calls"]["actor_gen"] for r in steady])
    tokens = med([r["metrics"]["response_length"] * rows for r in steady])
    return {
        "gen_s": gen,
        "new_tokens": tokens,
        "tokens_per_s": tokens / gen,
        "step_s": med([r["seconds"] for r in steady]),
        "actor_logp_s": med([r["calls"].get("actor_logp", 0.0) for r in steady]),
        "actor_realloc_s": med([r["realloc_seconds"].get("actor", 0.0) for r in steady]),
        "steps_timed": len(steady),
        # every call's and every model's reallocation seconds (medians), in the JSON only
        "calls_s": {c: med([r["calls"].get(c, 0.0) for r in steady]) for c in steady[0]["calls"]},
        "realloc_s": {
            m: med([r["realloc_seconds"].get(m, 0.0) for r in steady])
            for m in steady[0]["realloc_seconds"]
        },
    }


def rows_of(config: str) -> int:
    import yaml

    with open(config) as f:
        return int(yaml.safe_load(f)["data"]["batch_size"])


COLS = (
    "gen_s",
    "new_tokens",
    "tokens_per_s",
    "step_s",
    "actor_logp_s",
    "actor_realloc_s",
    "load_1min_before",
)
"""Per run, then the median over runs: one report row per case and engine."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--repeats", type=int, default=1, help="runs per engine and case (rotating)")
    args = ap.parse_args()
    results, runs_all, t_all = [], {}, time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            config = CASES[case](tmp)
            rows = rows_of(config)
            per = {e: [] for e in args.engines}
            for rep in range(args.repeats):
                k = rep % len(args.engines)
                for engine in args.engines[k:] + args.engines[:k]:
                    out = os.path.join(tmp, f"{case}_{engine}_{rep}")
                    load = os.getloadavg()[0]  # the machine is shared: what ran beside the run
                    per[engine].append(summarize(run(config, engine, args.steps, out), rows))
                    per[engine][-1]["load_1min_before"] = load
                    print(case, engine, per[engine][-1], flush=True)
            med = {
                e: {k: statistics.median(r[k] for r in runs) for k in COLS}
                for e, runs in per.items()
            }
            for engine in args.engines:
                row = {"case": case, "engine": engine, "rows": rows, **med[engine]}
                if "builtin" in med:
                    row["tokens/s vs builtin"] = (
                        row["tokens_per_s"] / med["builtin"]["tokens_per_s"]
                    )
                    row["step speed vs builtin"] = med["builtin"]["step_s"] / row["step_s"]
                calls = per[engine][0]["calls_s"]
                row["calls (s, first run)"] = ", ".join(f"{c} {v:.3g}" for c, v in calls.items())
                results.append(row)
            runs_all[case] = per
    elapsed = time.time() - t_all
    note = (
        f"Each case: `python -m real_py train` per engine, {args.steps} steps, {args.repeats} "
        "run(s) per engine, engines rotating; medians over steps 2.. (step 1 holds vLLM's "
        "start-up and the first compile), then over runs. gen_s / tokens_per_s: the actor_gen "
        "call (new tokens = response_length x rows); step_s: the whole step; actor_logp_s: the "
        "recompute call (vllm only: old_logp on the train layout; vllm-rollout takes vLLM's "
        "log-probs instead); actor_realloc_s: the actor's move into the generation layout "
        "(vLLM's live format or the built-in engine's layout); step speed vs builtin: builtin "
        "step_s / this step_s (> 1: faster); load_1min_before: the machine's 1-minute load "
        "average when the run started (2 cores: above 2, something else ran beside it). 2 "
        "shared CPU cores, AVX2 (vLLM's CPU build has no fast kernels for it). "
        + __doc__.split("\n\n")[4].replace("\n", " ")
        + f" Whole benchmark {elapsed:.0f} s."
    )
    cols = ["case", "engine", "rows", *COLS, "tokens/s vs builtin", "step speed vs builtin"]
    jpath, mpath = write_results(
        "vllm_speed",
        hardware_tag("cpu"),
        results,
        columns=cols + ["calls (s, first run)"],
        notes=note,
        title="Generation with vLLM against the built-in engine, inside the "
        "runtime (gloo ranks, CPU)",
        extra={"runs": runs_all},
    )
    print(jpath, mpath)


if __name__ == "__main__":
    main()
