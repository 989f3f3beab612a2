"""Bad-input sweep: ~90 inputs a new user might give, each run through the real CLI.

    make test-bad-inputs                                       # about 10-20 minutes
    .venv/bin/python tests/support/bad_inputs_sweep.py [--only ID,ID] [--timeout 180] [--no-write]

An acceptance suite beside the tests, not collected by pytest (each case is a CLI process of up
to minutes): it exits 1 when a case ends unclear or silent, and writes its report.

Every case runs `python -m real_py ...` in a subprocess (fresh interpreter, its own timeout) in a
scratch workspace holding small HF checkpoints written with transformers (a Qwen3 actor, LLaMA
reward / causal-LM models), a prompt file, the copy task's tokenizer, reward functions, plan files
and a saved 2-rank run to resume. Each outcome is classified:

    clear-before-launch  exit 2, stderr exactly one `error:` line holding the case's cause phrase,
                         no ranks started ("launching" not printed)
    warned               the job ran, and a `warning:` line printed before launch names the cause
    clear-after-launch   ranks started, the job failed, and its error names the cause, with no
                         Python traceback
    unclear              failed without naming the cause, or with a traceback, or exit 2 with
                         more than one line
    silent               ran anyway (exit 0) without a word about the cause
    ok (control)         a good input that must run: it did
    late                 any of the above that took more than 30 s (the class is kept beside it)

Writes bench/results/bad_inputs_<hardware>_<yyyymmdd>.{md,json} (one row per case: id, what, the
outcome, seconds, exit code and the first error / warning line) with the counts in the notes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # tests/support/ -> the checkout
LATE_S = 30.0

FAST = [
    "steps=1",
    "save_every=0",
    "generation.max_new_tokens=4",
    "--no-progress",
    "--timeout",
    "60",
]
PLAN2 = {
    "world_size": 2,
    "calls": {
        n: {"ranks": [0, 1], "dp": 1, "tp": 2, "pp": 1}
        for n in ("actor_gen", "ref_inf", "rew_inf", "critic_inf", "actor_train", "critic_train")
    },
}

REWARDS = """
def good(prompts, responses, **row):
    return [float(len(r) > 0) for r in responses]
def needs_solution(prompts, responses, solution):
    return [0.0] * len(responses)
def raises(prompts, responses, **row):
    raise KeyError("score")
def wrong_length(prompts, responses, **row):
    return [1.0]
def strings(prompts, responses, **row):
    return ["1.0"] * len(responses)
def no_row(prompts, responses):
    return [0.0] * len(responses)
def fails_later(prompts, responses, **row):
    return [1.0 / (len(r) == 0) for r in responses]      # fine on the empty check, not on real ones
def nan_later(prompts, responses, **row):
    return [0.0 if r == "" else float("nan") for r in responses]
def hangs_later(prompts, responses, **row):
    import time
    if any(responses):
        time.sleep(3600)
    return [0.0] * len(responses)
NOT_A_FUNCTION = 3
"""


def build_workspace(w: str) -> None:
    """Checkpoints, data, tokenizer, reward file, plans and a saved run under `w`."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    qwen = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    llama = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    T.Qwen3ForCausalLM(T.Qwen3Config(**qwen)).save_pretrained(f"{w}/actor")
    T.LlamaForSequenceClassification(T.LlamaConfig(**llama, num_labels=1)).save_pretrained(
        f"{w}/rm"
    )
    T.LlamaForSequenceClassification(
        T.LlamaConfig(**dict(llama, vocab_size=32), num_labels=1)
    ).save_pretrained(f"{w}/rm_v32")
    T.LlamaForCausalLM(T.LlamaConfig(**llama)).save_pretrained(f"{w}/lm")
    T.GPT2LMHeadModel(
        T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=64, n_positions=64)
    ).save_pretrained(f"{w}/gpt2")
    os.makedirs(f"{w}/empty_dir")
    os.makedirs(f"{w}/config_only")
    shutil.copy(f"{w}/actor/config.json", f"{w}/config_only/config.json")
    shutil.copytree(f"{w}/actor", f"{w}/truncated")
    with open(f"{w}/truncated/model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(f"{w}/truncated/model.safetensors") // 2)
    shutil.copytree(os.path.join(ROOT, "configs", "copy_task", "tokenizer"), f"{w}/tok")
    shutil.copy(os.path.join(ROOT, "configs", "copy_task", "prompts.jsonl"), f"{w}/prompts.jsonl")
    shutil.copy(f"{w}/prompts.jsonl", f"{w}/prompts.txt")
    with open(f"{w}/rewards.py", "w") as f:
        f.write(REWARDS)
    with open(f"{w}/plan_bad.json", "w") as f:
        f.write('{"world_size": 4, "calls": {')
    from real_py.rlhf.config import default_plan

    def plan(name, edit):
        p = default_plan("ppo")
        edit(p)
        with open(f"{w}/{name}.json", "w") as f:
            json.dump(p, f)

    plan("plan_no_calls", lambda p: p.pop("calls"))
    plan("plan_missing_call", lambda p: p["calls"].pop("critic_train"))
    plan(
        "plan_unknown_call",
        lambda p: p["calls"].__setitem__("actor_rollout", p["calls"]["actor_gen"]),
    )
    plan("plan_rank_outside", lambda p: p["calls"]["ref_inf"].__setitem__("ranks", [4, 5]))
    plan(
        "plan_idle_rank",
        lambda p: [
            c.__setitem__("ranks", [0, 1]) or c.update(dp=1, tp=2, pp=1)
            for c in p["calls"].values()
        ],
    )
    plan("plan_tp3", lambda p: p["calls"]["ref_inf"].update(ranks=[0, 1, 2], dp=1, tp=3))
    plan("plan_dp_string", lambda p: p["calls"]["ref_inf"].update(dp="2"))
    open(f"{w}/empty.jsonl", "w").close()
    with open(f"{w}/bad.jsonl", "w") as f:
        f.write('{"prompt": "12", "answer": "2"}\n{"prompt": "34", answer: 4}\n')
    plan(
        "plan_pp4", lambda p: p["calls"]["critic_inf"].update(ranks=[0, 1, 2, 3], dp=1, tp=1, pp=4)
    )
    plan("plan_dp3", lambda p: p["calls"]["ref_inf"].update(ranks=[0, 1, 2], dp=3, tp=1))

    def world8(p):
        p["world_size"] = 8
        for n, c in p["calls"].items():
            c.update(
                ranks=list(range(8)),
                **(
                    {"dp": 2, "tp": 2, "pp": 2}
                    if n.endswith("train")
                    else {"dp": 8, "tp": 1, "pp": 1}
                ),
            )

    plan("plan_world8", world8)
    with open(f"{w}/plan2.json", "w") as f:
        json.dump(PLAN2, f)
    # A saved 2-rank run (steps 1-2, a checkpoint per step) for the resume cases.
    cfg = f"{w}/run2.yaml"
    with open(cfg, "w") as f:
        f.write(
            "steps: 2\nsave_every: 1\nreward: {kind: rule}\ngeneration: {max_new_tokens: 4}\n"
            "plan: {path: plan2.json}\n"
        )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "real_py",
            "train",
            "--config",
            cfg,
            "--out-dir",
            f"{w}/run",
            "--no-progress",
        ],
        cwd=w,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        raise RuntimeError(
            f"the workspace's 2-rank run failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        )


def _copy_run(w: str, d: str) -> str:
    shutil.copytree(f"{w}/run", f"{d}/run", symlinks=True)
    return f"{d}/run"


def _flip_byte(w: str, d: str) -> None:
    run = _copy_run(w, d)
    p = f"{run}/step_1/rank1.pt"
    data = bytearray(open(p, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(p, "wb").write(bytes(data))


def _pickled_callable(w: str, d: str) -> None:
    import torch

    class Plant:
        def __reduce__(self):
            return (os.makedirs, (f"{d}/code_ran",))

    run = _copy_run(w, d)
    p = f"{run}/step_1/rank1.pt"
    torch.save(torch.load(p, weights_only=True) | {"hook": Plant()}, p)
    meta = json.load(open(f"{run}/step_1/meta.json"))
    data = open(p, "rb").read()
    meta["files"]["rank1.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    json.dump(meta, open(f"{run}/step_1/meta.json", "w"))


def _garbage_latest(w: str, d: str) -> None:
    run = _copy_run(w, d)
    open(f"{run}/latest", "w").write("../../etc\n")


def _subdir_config(w: str, d: str) -> None:
    os.makedirs(f"{d}/cfgs")
    shutil.copy(f"{w}/prompts.jsonl", f"{d}/cfgs/prompts.jsonl")
    with open(f"{d}/cfgs/c.yaml", "w") as f:
        f.write(
            f"data: {{path: prompts.jsonl, tokenizer_path: {w}/tok, batch_size: 8}}\n"
            "reward: {kind: rule}\nplan: {path: ../plan2.json}\n"
        )
    shutil.copy(f"{w}/plan2.json", f"{d}/plan2.json")


def T(id, what, args, phrase, yaml=None, kind="bad", setup=None, cwd=None):
    return {
        "id": id,
        "what": what,
        "args": args,
        "phrase": phrase,
        "yaml": yaml,
        "kind": kind,
        "setup": setup,
        "cwd": cwd,
    }


RUN = ["--out-dir", "{d}/out"]
CASES = [
    # Config file: keys, types, values
    T(
        "typo-top-key",
        "a top-level key misspelt (step: 3)",
        ["train"] + RUN,
        "unknown keys ['step']",
        "step: 3",
    ),
    T(
        "typo-section-key",
        "ppo.lr instead of ppo.actor_lr",
        ["train"] + RUN,
        "ppo: unknown keys ['lr']",
        "ppo: {lr: 1e-5}",
    ),
    T(
        "steps-word",
        "steps: ten",
        ["train"] + RUN,
        "steps='ten': expected an integer",
        "steps: ten",
    ),
    T(
        "bool-yes",
        "greedy: yes (YAML 1.1 boolean)",
        ["train"] + RUN,
        "generation.greedy='yes': expected true or false",
        "generation: {greedy: yes}",
    ),
    T(
        "clip-negative",
        "ppo.clip: -1",
        ["train"] + RUN,
        "ppo.clip=-1.0 is out of range",
        "ppo: {clip: -1}",
    ),
    T(
        "temperature-0",
        "generation.temperature: 0",
        ["train"] + RUN,
        "generation.temperature=0.0 is out of range",
        "generation: {temperature: 0}",
    ),
    T(
        "batch-0",
        "data.batch_size: 0",
        ["train"] + RUN,
        "data.batch_size=0 is out of range",
        "data: {batch_size: 0}",
    ),
    T("algo-unknown", "algo: dpo", ["train"] + RUN, "algo='dpo'; allowed", "algo: dpo"),
    T(
        "precision-fp16",
        "precision: fp16",
        ["train"] + RUN,
        "precision='fp16'; allowed",
        "precision: fp16",
    ),
    T("device-gpu", "device: gpu", ["train"] + RUN, "device='gpu'; allowed", "device: gpu"),
    T(
        "device-cuda-no-gpu",
        "device: cuda on a machine without a GPU",
        ["train"] + RUN,
        "torch sees no GPU",
        "device: cuda",
    ),
    T("yaml-syntax", "a YAML syntax error", ["train"] + RUN, "is not valid YAML", "ppo: {clip: ["),
    T(
        "yaml-list",
        "a YAML list instead of a mapping",
        ["train"] + RUN,
        "expected a mapping of keys",
        "- steps: 3",
    ),
    T(
        "config-missing",
        "--config of a file that does not exist",
        ["train", "--config", "{d}/nope.yaml"] + RUN,
        "nope.yaml: No such file",
    ),
    T(
        "eos-outside-vocab",
        "generation.eos_token_id past the vocabulary",
        ["train"] + RUN,
        "eos_token_id=500 is outside the actor vocabulary",
        "generation: {eos_token_id: 500}",
    ),
    T(
        "min-over-max-tokens",
        "min_new_tokens > max_new_tokens",
        ["train"] + RUN,
        "min_new_tokens=20 exceeds generation.max_new_tokens=12",
        "generation: {min_new_tokens: 20}",
    ),
    T(
        "too-long",
        "prompt + response longer than the model's positions",
        ["train"] + RUN,
        "exceeds actor max_position_embeddings=16",
        "actor: {max_position_embeddings: 16}",
    ),
    T(
        "group-not-dividing",
        "grpo group_size 3 with batch 8",
        ["train", "algo=grpo"] + RUN,
        "group_size=3",
        "ppo: {group_size: 3}",
    ),
    T(
        "dynamic-sampling-ppo",
        "DAPO dynamic sampling with ppo",
        ["train"] + RUN,
        "ppo.dynamic_sampling needs groups",
        "ppo: {dynamic_sampling: true}",
    ),
    # KEY=VALUE overrides and flags
    T(
        "override-no-equals",
        "an override without =",
        ["train", "steps"] + RUN,
        "expected KEY=VALUE",
    ),
    T("override-unknown", "ppo.lrr=1", ["train", "ppo.lrr=1"] + RUN, "ppo: unknown keys ['lrr']"),
    T(
        "override-inf",
        "ppo.actor_lr=1e400",
        ["train", "ppo.actor_lr=1e400"] + RUN,
        "expected a finite number",
    ),
    T("timeout-0", "--timeout 0", ["train", "--timeout", "0"] + RUN, "--timeout=0.0 must be > 0"),
    T("steps-flag-0", "--steps 0", ["train", "--steps", "0"] + RUN, "steps=0 is out of range"),
    T(
        "resume-and-overwrite",
        "--resume with --overwrite",
        ["train", "--resume", "--overwrite"] + RUN,
        "--resume and --overwrite exclude each other",
    ),
    # Missing or wrong files
    T(
        "actor-missing",
        "actor_path to a directory that does not exist",
        ["train", "actor_path=ckpt/sft"] + RUN,
        "actor_path='ckpt/sft': no such local file or directory",
    ),
    T(
        "actor-hub-id",
        "actor_path given as a Hub id",
        ["train"] + RUN,
        "nothing is downloaded from the Hub",
        "actor_path: meta-llama/Llama-2-7b-hf",
    ),
    T(
        "actor-empty-dir",
        "actor_path to an empty directory",
        ["train", "actor_path={w}/empty_dir"] + RUN,
        "not an HF checkpoint directory",
    ),
    T(
        "actor-no-weights",
        "actor_path with config.json but no safetensors",
        ["train", "actor_path={w}/config_only"] + RUN,
        "no model.safetensors",
    ),
    T(
        "actor-truncated",
        "actor_path with a truncated safetensors file",
        ["train", "actor_path={w}/truncated"] + RUN,
        "is not a readable safetensors file",
    ),
    T(
        "actor-gpt2",
        "actor_path of an unsupported architecture (GPT-2)",
        ["train", "actor_path={w}/gpt2"] + RUN,
        "is not supported",
    ),
    T(
        "data-missing",
        "data.path that does not exist",
        ["train", "data.path=prompts.jsnl", "data.tokenizer_path={w}/tok"] + RUN,
        "data.path='prompts.jsnl': no such file",
    ),
    T(
        "data-extension",
        "data.path with a .txt extension",
        ["train", "data.path={w}/prompts.txt", "data.tokenizer_path={w}/tok"] + RUN,
        "unknown extension '.txt'",
    ),
    T(
        "data-prompt-key",
        "data.prompt_key not in the rows",
        [
            "train",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
            "data.prompt_key=question",
        ]
        + RUN,
        "no prompt key data.prompt_key='question'",
    ),
    T(
        "data-empty",
        "an empty prompt file",
        ["train", "data.path={w}/empty.jsonl", "data.tokenizer_path={w}/tok"] + RUN,
        "the file has no rows",
    ),
    T(
        "data-bad-line",
        "a prompt file with a line that is not JSON",
        ["train", "data.path={w}/bad.jsonl", "data.tokenizer_path={w}/tok"] + RUN,
        "line 2: not JSON",
    ),
    T(
        "data-too-long",
        "prompts longer than max_prompt_len (truncate: error)",
        [
            "train",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
            "data.max_prompt_len=3",
        ]
        + RUN,
        "data.truncate",
    ),
    T(
        "data-no-tokenizer",
        "data.path without any tokenizer",
        ["train", "data.path={w}/prompts.jsonl"] + RUN,
        "needs a tokenizer",
    ),
    T(
        "tokenizer-missing",
        "data.tokenizer_path that does not exist",
        ["train", "data.path={w}/prompts.jsonl", "data.tokenizer_path={w}/tokenizer"] + RUN,
        "data.tokenizer_path=",
    ),
    T(
        "config-relative-elsewhere",
        "a config with paths relative to its folder, run from another directory (control)",
        ["train", "--config", "{d}/cfgs/c.yaml"] + RUN + FAST,
        "",
        kind="control",
        setup=_subdir_config,
    ),
    # Reward functions
    T(
        "reward-file-missing",
        "reward.path file that does not exist",
        [
            "train",
            "reward.kind=function",
            "reward.path=rewrds.py:good",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN,
        "no such file 'rewrds.py'",
    ),
    T(
        "reward-no-attr",
        "reward.path naming a function the file lacks",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:score",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN,
        "has no attribute 'score'",
    ),
    T(
        "reward-not-callable",
        "reward.path naming a constant",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:NOT_A_FUNCTION",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN,
        "not callable",
    ),
    T(
        "reward-needs-field",
        "a reward function with a parameter the data lacks",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:needs_solution",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN,
        "the data has no field 'solution'",
    ),
    T(
        "reward-needs-field-synthetic",
        "the same with the synthetic prompts",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:needs_solution",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN,
        "the data has no field 'solution'",
    ),
    T(
        "reward-no-row",
        "a reward function without **row given a data set with fields",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:no_row",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN,
        "has no parameter for ['answer']",
    ),
    T(
        "reward-raises",
        "a reward function that raises",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:raises",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN,
        "KeyError",
    ),
    T(
        "reward-wrong-length",
        "a reward function returning one score for the batch",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:wrong_length",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN
        + FAST,
        "returned 1 scores for",
    ),
    T(
        "reward-strings",
        "a reward function returning strings",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:strings",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN,
        "as a score",
    ),
    T(
        "reward-fails-later",
        "a reward function that fails on real responses only (after launch)",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:fails_later",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN
        + FAST,
        "ZeroDivisionError",
    ),
    T(
        "reward-nan-later",
        "a reward function returning NaN on real responses (after launch)",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:nan_later",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN
        + FAST,
        "non-finite score",
    ),
    T(
        "reward-hangs-later",
        "a reward function that hangs on real responses (after launch, --timeout 20)",
        [
            "train",
            "reward.kind=function",
            "reward.path={w}/rewards.py:hangs_later",
            "data.path={w}/prompts.jsonl",
            "data.tokenizer_path={w}/tok",
        ]
        + RUN
        + FAST[:-2]
        + ["--timeout", "20"],
        "hangs_later",
    ),
    T(
        "reward-no-tokenizer",
        "a reward function without a tokenizer",
        ["train", "reward.kind=function", "reward.path={w}/rewards.py:good"] + RUN,
        "needs a tokenizer to decode",
    ),
    # Execution plans
    T(
        "plan-missing",
        "plan.path that does not exist",
        ["train", "plan.path=plan.jsn"] + RUN,
        "plan.path='plan.jsn': no such file",
    ),
    T(
        "plan-malformed",
        "a plan file that is not JSON",
        ["train", "plan.path={w}/plan_bad.json"] + RUN,
        "is not valid JSON",
    ),
    T(
        "plan-no-calls",
        "a plan without calls",
        ["train", "plan.path={w}/plan_no_calls.json"] + RUN,
        "lacks ['calls']",
    ),
    T(
        "plan-missing-call",
        "a plan without critic_train",
        ["train", "plan.path={w}/plan_missing_call.json"] + RUN,
        "missing calls ['critic_train']",
    ),
    T(
        "plan-unknown-call",
        "a plan with an unknown call",
        ["train", "plan.path={w}/plan_unknown_call.json"] + RUN,
        "unknown calls ['actor_rollout']",
    ),
    T(
        "plan-rank-outside",
        "a call on ranks outside the world",
        ["train", "plan.path={w}/plan_rank_outside.json"] + RUN,
        "outside the world of size 4",
    ),
    T(
        "plan-idle-rank",
        "a 4-rank plan that uses ranks 0-1 only",
        ["train", "plan.path={w}/plan_idle_rank.json"] + RUN,
        "leaves ranks [2, 3] of world 4 without a call",
    ),
    T(
        "plan-tp3",
        "tp=3 with 4 attention heads",
        ["train", "plan.path={w}/plan_tp3.json"] + RUN,
        "ref_inf",
    ),
    T(
        "plan-pp-layers",
        "pp=4 for the 2-layer critic",
        ["train", "plan.path={w}/plan_pp4.json"] + RUN,
        "critic_inf",
    ),
    T(
        "plan-dp3",
        "dp=3 with batch 8",
        ["train", "plan.path={w}/plan_dp3.json"] + RUN,
        "dp=3 does not divide data.batch_size=8",
    ),
    T(
        "plan-world8-cores",
        "an 8-rank plan on a 2-core machine",
        ["train", "plan.path={w}/plan_world8.json"] + RUN + FAST,
        "ranks share cores and the run will be slow",
        kind="warn",
    ),
    T(
        "plan-dp-string",
        "a plan with dp given as a string",
        ["train", "plan.path={w}/plan_dp_string.json"] + RUN,
        "call ref_inf",
    ),
    T(
        "model-over-memory",
        "a 7B-shaped actor on the 4-rank CPU plan",
        ["train"] + RUN,
        "GiB of memory on this machine",
        "actor: {hidden_size: 4096, intermediate_size: 11008, num_hidden_layers: 32, "
        "num_attention_heads: 32, num_key_value_heads: 32, vocab_size: 32000}\n"
        "critic: {vocab_size: 32000}",
    ),
    T(
        "moe-async",
        "a mixture-of-experts actor with async.max_staleness=1",
        ["train", "algo=grpo", "async.max_staleness=1"] + RUN,
        "asynchronous RL is not implemented for MoE models",
        "actor: {model_type: qwen3_moe, qk_norm: true, num_experts: 4, num_experts_per_tok: 2, "
        "moe_intermediate_size: 64}",
    ),
    T(
        "decode-graph-cpu",
        "generation.decode: graph on CPU",
        ["train", "generation.decode=graph"] + RUN,
        "decode='graph' needs CUDA",
    ),
    T(
        "export-random-moe",
        "export: hf of a random-init MoE actor",
        ["train", "algo=grpo", "export=hf"] + RUN,
        "export: hf with a random-init mixture-of-experts actor",
        "actor: {model_type: qwen3_moe, qk_norm: true, num_experts: 4, num_experts_per_tok: 2, "
        "moe_intermediate_size: 64}",
    ),
    T(
        "qkv-layout",
        "actor.qkv_layout set to a storage layout",
        ["train", "actor.qkv_layout=megatron_grouped"] + RUN,
        "actor.qkv_layout='megatron_grouped'",
    ),
    T(
        "wandb-missing",
        "wandb options without the wandb package",
        ["train"] + RUN,
        "wandb package is not installed",
        "wandb: {project: x}",
    ),
    # Checkpoints that do not fit together
    T(
        "critic-vocab-32",
        "a reward model whose vocabulary is smaller than the actor's",
        ["train", "actor_path={w}/actor", "critic_path={w}/rm", "reward_path={w}/rm_v32"] + RUN,
        "vocab_size=32",
    ),
    T(
        "reward-causal-lm",
        "a causal LM as reward_path",
        ["train", "actor_path={w}/actor", "reward_path={w}/lm"] + RUN,
        "is not a reward model",
    ),
    T(
        "reward-causal-lm-critic-init",
        "the same with critic_init: zero (the old hint)",
        ["train", "actor_path={w}/actor", "reward_path={w}/lm", "critic_init=zero"] + RUN,
        "never to reward_path",
    ),
    T(
        "critic-causal-lm",
        "a causal LM as critic_path without critic_init",
        ["train", "actor_path={w}/actor", "critic_path={w}/lm", "reward_path={w}/rm"] + RUN,
        "set critic_init: zero",
    ),
    T(
        "critic-path-grpo",
        "critic_path with a critic-free algorithm",
        ["train", "algo=grpo", "actor_path={w}/actor", "critic_path={w}/rm", "reward_path={w}/rm"]
        + RUN
        + FAST,
        "critic_path='{w}/rm' is ignored",
        kind="warn",
    ),
    T(
        "reward-path-rule",
        "reward_path with reward.kind: rule",
        ["train", "reward.kind=rule", "reward_path={w}/rm"] + RUN + FAST,
        "reward_path='{w}/rm' is ignored",
        kind="warn",
    ),
    T(
        "own-models-control",
        "own Qwen3 actor + LLaMA RM (control)",
        ["train", "actor_path={w}/actor", "critic_path={w}/rm", "reward_path={w}/rm"] + RUN + FAST,
        "",
        kind="control",
    ),
    # Resume
    T(
        "resume-typo",
        "--resume of a directory that does not exist",
        ["train", "--resume", "{d}/rnu/step_1"] + RUN,
        "no checkpoint: does not exist",
    ),
    T(
        "resume-not-a-step",
        "--resume of a directory without a checkpoint",
        ["train", "--resume", "{w}/empty_dir"] + RUN,
        "has no meta.json",
    ),
    T(
        "resume-bare-no-run",
        "--resume alone in a new out_dir",
        ["train", "--resume"] + RUN,
        "latest",
    ),
    T(
        "resume-other-vocab",
        "--resume with another actor vocabulary",
        [
            "train",
            "--config",
            "{w}/run2.yaml",
            "--resume",
            "{w}/run/step_1",
            "actor.vocab_size=128",
            "critic.vocab_size=128",
        ]
        + RUN,
        "models.actor.vocab_size is 64 in the checkpoint, 128 in this config",
    ),
    T(
        "resume-other-plan",
        "--resume with another plan",
        ["train", "--resume", "{w}/run/step_1"] + RUN,
        "plan.world_size is 2 in the checkpoint, 4 in this config",
    ),
    T(
        "resume-flipped-byte",
        "--resume with a flipped byte in a rank file",
        [
            "train",
            "--config",
            "{w}/run2.yaml",
            "--resume",
            "{d}/run/step_1",
            "--out-dir",
            "{d}/run",
        ],
        "rank1.pt fails its sha256 check",
        setup=_flip_byte,
    ),
    T(
        "resume-pickled",
        "--resume with a rank file holding a pickled callable, checksum matched",
        [
            "train",
            "--config",
            "{w}/run2.yaml",
            "--resume",
            "{d}/run/step_1",
            "--out-dir",
            "{d}/run",
        ],
        "rank1.pt refused: it holds more than tensors",
        setup=_pickled_callable,
    ),
    T(
        "resume-bad-latest",
        "--resume of a run whose latest marker names ../../etc",
        ["train", "--config", "{w}/run2.yaml", "--resume", "{d}/run", "--out-dir", "{d}/run"],
        "must name a step directory",
        setup=_garbage_latest,
    ),
    T(
        "existing-run",
        "a new run into an out_dir holding a run",
        ["train", "--config", "{w}/run2.yaml", "--out-dir", "{w}/run"],
        "already holds a run",
    ),
    # Other commands
    T("search-gpus-0", "search --gpus 0", ["search", "--gpus", "0"], "--gpus=0 must be >= 1"),
    T(
        "search-unknown-model",
        "search --model llama3",
        ["search", "--gpus", "8", "--model", "llama3"],
        "neither a preset",
    ),
    T(
        "search-hardware",
        "search --hardware tpu",
        ["search", "--gpus", "8", "--hardware", "tpu"],
        "unknown hardware profile 'tpu'",
    ),
    T(
        "search-70b-2gpus",
        "search a 70B actor + critic on 2 H100s",
        ["search", "--gpus", "2", "--model", "llama2-70b", "--time-budget", "2"],
        "no feasible plan",
    ),
    T(
        "export-not-a-run",
        "export --run of a directory without checkpoints",
        ["export", "--run", "{w}/empty_dir", "--out", "{d}/hf"],
        "not a train run directory",
    ),
    T(
        "plot-not-a-run",
        "plot of a directory without metrics",
        ["plot", "{w}/empty_dir"],
        "no metrics.jsonl",
    ),
]


def run_case(c: dict, w: str, timeout: float) -> dict:
    d = tempfile.mkdtemp(prefix=c["id"] + ".", dir=w)
    if c["setup"]:
        c["setup"](w, d)
    sub = lambda s: s.replace("{w}", w).replace("{d}", d)
    args = [sub(a) for a in c["args"]]
    if c["yaml"] is not None:
        with open(f"{d}/cfg.yaml", "w") as f:
            f.write(c["yaml"] + "\n")
        args = args[:1] + ["--config", f"{d}/cfg.yaml"] + args[1:]
    cwd = sub(c["cwd"]) if c["cwd"] else d
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "real_py"] + args,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
        code, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = (
            "timeout",
            (e.stdout or b"").decode(errors="replace"),
            (e.stderr or b"").decode(errors="replace"),
        )
    seconds = time.perf_counter() - t0
    phrase = sub(c["phrase"])
    launched = "launching" in out
    errs = [ln for ln in err.splitlines() if ln.strip()]
    err_lines = [ln for ln in errs if ln.startswith("error:")]
    warns = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    if c["kind"] == "control":
        outcome = "ok (control)" if code == 0 else "unclear"
        shown = (err_lines or errs or [""])[-1]
    elif code == 0:
        hit = [ln for ln in warns if phrase in ln]
        outcome = "warned" if hit else "silent"
        shown = (hit or warns or [""])[0]
    elif code == 2 and not launched and len(errs) == 1 and err_lines and phrase in err_lines[0]:
        outcome, shown = "clear-before-launch", err_lines[0]
    elif launched and code not in (0, 2) and phrase in err and "Traceback" not in err:
        outcome = "clear-after-launch"
        shown = next((ln for ln in errs if phrase in ln), "")
    else:
        outcome = "unclear"
        shown = (err_lines or errs or [""])[0]
    return {
        "id": c["id"],
        "what": c["what"],
        "outcome": outcome,
        "late": seconds > LATE_S,
        "seconds": round(seconds, 1),
        "exit": code,
        "launched": launched,
        "message": shown.replace(w, "W").replace("|", "/")[:260],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case ids")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    ap.add_argument("--no-write", action="store_true", help="print only, write no report")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or c["id"] in args.only.split(",")]
    w = tempfile.mkdtemp(prefix="real_py_bad_inputs_")
    rows = []
    try:
        t0 = time.perf_counter()
        build_workspace(w)
        print(f"workspace {w} built in {time.perf_counter() - t0:.0f} s", flush=True)
        for c in cases:
            rows.append(run_case(c, w, args.timeout))
            r = rows[-1]
            print(
                f"{r['id']:30s} {r['outcome']:20s}{' LATE' if r['late'] else ''} "
                f"{r['seconds']:6.1f}s exit {r['exit']}: {r['message'][:150]}",
                flush=True,
            )
    finally:
        shutil.rmtree(w, ignore_errors=True)
    counts = Counter(r["outcome"] for r in rows)
    late = sum(r["late"] for r in rows)
    summary = (
        f"tried {len(rows)}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"; late (> {LATE_S:.0f} s) {late}"
    )
    print(summary)
    failed = counts["unclear"] + counts["silent"]
    if args.no_write:
        return 1 if failed else 0
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from timing import hardware_tag, write_results

    for r in rows:
        r["late"] = "late" if r["late"] else ""
    paths = write_results(
        "bad_inputs",
        hardware_tag("cpu"),
        rows,
        columns=["id", "what", "outcome", "late", "seconds", "exit", "launched", "message"],
        title="Bad-input sweep: what a new user might give, through the real CLI",
        notes=summary + ". Each case is `python -m real_py ...` in a fresh subprocess "
        "(tests/support/bad_inputs_sweep.py lists the cases and the phrase each message must "
        "hold); W is the scratch workspace. Classes: clear-before-launch (exit 2, one `error:` "
        "line naming the cause, no ranks started), warned (ran, with a `warning:` line before "
        "launch naming the cause), clear-after-launch (ranks started, the error names the cause, "
        "no traceback), unclear, silent (ran without a word), ok (control: a good input that must "
        "run), late (> 30 s, beside its class).",
        extra={"counts": dict(counts), "late": late},
    )
    print("wrote", *paths)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
