"""GRPO end to end on one device: real_py (`python -m real_py train`) beside TRL's GRPOTrainer.

Both sides load the same HF checkpoint, made once here: a Qwen2-style model with random init
(transformers' own), Qwen2.5-0.5B's transformer shape (24 layers, hidden 896, 14 query / 2 KV
heads, intermediate 4864, tied embeddings) over the copy task's 16-token character tokenizer
(configs/copy_task/tokenizer): 0.36B parameters, saved in fp32 (--small: a tiny one). Same work
on both sides (setup() holds it; tests/test_bench_trl.py checks both configurations against it):

  prompts     configs/copy_task/prompts.jsonl in file order (no shuffling), 16 per step (small 4)
  group size  8 completions per prompt (small 4), advantages (s - mean_g) / std_g per group
  lengths     exactly 128 new tokens (small 8) (the EOS banned until then: min_new_tokens on both)
  reward      reward() below: the fraction of a completion's characters equal to the prompt's
              last digit (the data set's "answer"), the same function on both sides
  loss        clipped ratio (0.2), token mean over the step's tokens, k3 KL to the reference in
              the loss (coefficient 0.04), one optimizer step per iteration (ppo_epochs 1,
              one mini-batch, 4 micro-batches: TRL's gradient accumulation), AdamW at 1e-5
              constant, max grad norm 1.0, temperature 1, no top-k / top-p
  precision   bf16 compute with fp32 master weights (real_py: precision bf16; TRL: fp32 weights
              under bf16 autocast); TRL without gradient checkpointing and with transformers'
              generate() (no vLLM)

Per step and side: seconds, generated tokens per second (tokens of the step / its seconds; one
device), peak GPU memory, mean reward. The report gives both reward curves and the step rate
ratio (median step seconds from the second step on; the first includes compilation and warm-up).
TRL's side runs in its own process under --trl-timeout (default 180 s): the steps it finished
count. TRL comes from --wheels DIR (pip install --no-index --find-links DIR trl) when given, else
from the environment; without it TRL's side is skipped with a message.

    python bench/bench_trl.py --device cuda [--wheels DIR]
    python bench/bench_trl.py --device cpu --small            # tiny, both sides if trl is installed
Writes <out-dir>/trl_<hw>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TASK = ROOT / "configs" / "copy_task"

QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def reward(prompts, completions, answer=None, **_):
    """Fraction of each completion's characters equal to its prompt's last digit (real_py calls
    fn(prompts, responses, **row); TRL calls fn(prompts=..., completions=..., **columns))."""
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        a = answer[i] if answer is not None else str(p)[-1:]
        c = c if isinstance(c, str) else str(c)
        out.append(sum(ch == a for ch in c) / len(c) if c else 0.0)
    return out


def setup(small: bool) -> dict:
    """The work both sides do (one dict, written to the workers as JSON)."""
    return {
        "model": TINY if small else QWEN_05B,
        "steps": 2 if small else 20,
        "prompts_per_step": 4 if small else 16,
        "group": 4 if small else 8,
        "new_tokens": 8 if small else 128,
        "micro": 2 if small else 4,
        "lr": 1e-5,
        "kl": 0.04,
        "clip": 0.2,
        "max_grad_norm": 1.0,
        "seed": 1,
        "max_prompt_len": 8,
        "prompts_file": str(TASK / "prompts.jsonl"),
        "tokenizer": str(TASK / "tokenizer"),
    }


def make_checkpoint(s: dict, path: str) -> str:
    """Qwen2ForCausalLM with transformers' random init over the task tokenizer, fp32, +
    tokenizer."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(s["tokenizer"])
    cfg = transformers.Qwen2Config(
        **s["model"],
        vocab_size=len(tok),
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(s["seed"])
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def real_py_config(s: dict, ckpt: str, out_dir: str, device: str) -> dict:
    """The `python -m real_py train` config of the work `s` (GRPO on one rank)."""
    n, g = s["new_tokens"], s["group"]
    d = {
        "algo": "grpo",
        "steps": s["steps"],
        "seed": s["seed"],
        "out_dir": out_dir,
        "save_every": 0,
        "device": device,
        "precision": "bf16" if device == "cuda" else "fp32",
        "actor_path": ckpt,
        "data": {
            "path": s["prompts_file"],
            "prompt_key": "prompt",
            "tokenizer_path": ckpt,
            "max_prompt_len": s["max_prompt_len"],
            "batch_size": s["prompts_per_step"] * g,
            "shuffle": False,
            "samples_per_step": 0,
        },
        "generation": {
            "max_new_tokens": n,
            "min_new_tokens": n,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "greedy": False,
        },
        "reward": {"kind": "function", "path": f"{Path(__file__).resolve()}:reward"},
        "ppo": {
            "group_size": g,
            "ppo_epochs": 1,
            "mini_batches": 1,
            "micro_batches": s["micro"],
            "actor_lr": s["lr"],
            "kl_coef": s["kl"],
            "kl_in": "loss",
            "kl_estimator": "k3",
            "clip": s["clip"],
            "max_grad_norm": s["max_grad_norm"],
            "adam_eps": 1e-8,
            "loss_agg": "token-mean",
            "norm_adv_by_std": True,
            "entropy_coef": 0.0,
        },
    }
    from real_py.rlhf import config as CF

    d["plan"] = CF.single_process_plan(CF.from_dict({"algo": "grpo"}).graph())
    return d


def trl_args(s: dict, out_dir: str, device: str) -> dict:
    """GRPOConfig keyword arguments of the work `s` (one process, one device)."""
    n, g = s["new_tokens"], s["group"]
    per_step = s["prompts_per_step"] * g
    return {
        "output_dir": out_dir,
        "max_steps": s["steps"],
        "learning_rate": s["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": s["max_grad_norm"],
        "per_device_train_batch_size": per_step // s["micro"],
        "gradient_accumulation_steps": s["micro"],
        "num_generations": g,
        "num_iterations": 1,
        "max_completion_length": n,
        "generation_kwargs": {"min_new_tokens": n},
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "beta": s["kl"],
        "epsilon": s["clip"],
        "loss_type": "dapo",
        "scale_rewards": "group",
        "shuffle_dataset": False,
        "seed": s["seed"],
        "bf16": device == "cuda",
        "use_cpu": device == "cpu",
        "gradient_checkpointing": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_dropout": True,
        "log_completions": False,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
    }


def work_of_real_py(d: dict) -> dict:
    """The work a real_py config describes, in setup()'s terms."""
    g = d["ppo"]["group_size"]
    return {
        "prompts_file": d["data"]["path"],
        "prompts_per_step": d["data"]["batch_size"] // g,
        "group": g,
        "new_tokens": (d["generation"]["max_new_tokens"], d["generation"]["min_new_tokens"]),
        "lr": d["ppo"]["actor_lr"],
        "steps": d["steps"],
        "kl": d["ppo"]["kl_coef"],
        "clip": d["ppo"]["clip"],
        "shuffle": d["data"]["shuffle"],
        "optimizer_steps_per_step": d["ppo"]["ppo_epochs"] * d["ppo"]["mini_batches"],
        "micro": d["ppo"]["micro_batches"],
        "max_grad_norm": d["ppo"]["max_grad_norm"],
    }


def work_of_trl(a: dict, prompts_file: str) -> dict:
    """The work GRPOConfig keyword arguments describe, in setup()'s terms."""
    per_step = a["per_device_train_batch_size"] * a["gradient_accumulation_steps"]
    n = a["max_completion_length"]
    return {
        "prompts_file": prompts_file,
        "prompts_per_step": per_step // a["num_generations"],
        "group": a["num_generations"],
        "new_tokens": (n, a["generation_kwargs"]["min_new_tokens"]),
        "lr": a["learning_rate"],
        "steps": a["max_steps"],
        "kl": a["beta"],
        "clip": a["epsilon"],
        "shuffle": a["shuffle_dataset"],
        "optimizer_steps_per_step": a["num_iterations"],
        "micro": a["gradient_accumulation_steps"],
        "max_grad_norm": a["max_grad_norm"],
    }


def read_rows(path: str) -> list[dict]:
    """A JSON-lines file's records ([] where a side stopped before writing it)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- real_py's side ------------------------------------------------------------------------
def run_real_py(s: dict, ckpt: str, work: str, device: str, timeout: float) -> dict:
    import yaml

    out_dir = os.path.join(work, "real_py")
    cfg = real_py_config(s, ckpt, out_dir, device)
    path = os.path.join(work, "real_py.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    cmd = [sys.executable, "-m", "real_py", "train", "--config", path, "--no-progress"]
    t0 = time.perf_counter()
    rc, log = _run(cmd, timeout, cwd=str(ROOT))
    total = time.perf_counter() - t0
    recs = read_rows(os.path.join(out_dir, "metrics.jsonl"))
    per_step_tokens = s["prompts_per_step"] * s["group"] * s["new_tokens"]
    steps = []
    for r in recs:
        gen = r["calls"].get("actor_gen")
        steps.append(
            {
                "step": r["step"],
                "seconds": r["seconds"],
                "reward": r["metrics"].get("reward"),
                "response_length": r["metrics"].get("response_length"),
                "tokens/s": per_step_tokens / r["seconds"],
                "gen tokens/s": per_step_tokens / gen if gen else None,
                "peak GiB": max(r.get("peak_mem_mib", {}).values(), default=0.0) / 1024,
            }
        )
    return {
        "rc": rc,
        "seconds_total": total,
        "steps": steps,
        "log_tail": log[-3000:],
        "config": cfg,
    }


# -- TRL's side ----------------------------------------------------------------------------
def install_trl(wheels: str | None) -> str | None:
    """None when trl imports (after installing it from `wheels`), else why not."""
    if wheels and import_trl().returncode:  # an importable trl is used as it is
        if not os.path.isdir(wheels):
            return f"--wheels {wheels}: no such directory"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        pip.append("--no-index")
        # A distribution's system Python (PEP 668, e.g. Ubuntu's python3.12) refuses pip installs
        # unless told otherwise (older pips ignore it); a venv needs no such override.
        env = dict(os.environ)
        if sys.prefix == sys.base_prefix:
            env["PIP_BREAK_SYSTEM_PACKAGES"] = "1"
        r = subprocess.run(
            pip + ["--find-links", wheels, "trl"],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        # a version bound the machine's packages miss: the wheels alone, then import decides
        if r.returncode:
            whls = sorted(str(p) for p in Path(wheels).glob("*.whl"))
            r2 = subprocess.run(
                pip + ["--no-deps", *whls], capture_output=True, text=True, timeout=600, env=env
            )
            if r2.returncode:
                return (
                    f"pip install --no-index --find-links {wheels} trl failed: "
                    f"{(r.stdout + r.stderr)[-400:]}; the wheels with --no-deps: "
                    f"{(r2.stdout + r2.stderr)[-400:]}"
                )
            print(
                f"trl installed from {wheels} without its dependency check: "
                f"{(r.stdout + r.stderr)[-300:]}"
            )
    r = import_trl()
    if r.returncode:
        return "trl cannot be imported: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return None


def import_trl() -> subprocess.CompletedProcess:
    """`import trl` in a fresh interpreter (this one may have imported it before an install)."""
    code = "import trl, sys; sys.stdout.write(trl.__version__)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def run_trl(s: dict, ckpt: str, work: str, device: str, timeout: float) -> dict:
    spec = {
        "setup": s,
        "ckpt": ckpt,
        "device": device,
        "out_dir": os.path.join(work, "trl"),
        "records": os.path.join(work, "trl_steps.jsonl"),
    }
    path = os.path.join(work, "trl_spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    t0 = time.perf_counter()
    rc, log = _run(
        [sys.executable, str(Path(__file__).resolve()), "--trl-worker", path],
        timeout,
        cwd=str(ROOT),
    )
    total = time.perf_counter() - t0
    recs = read_rows(spec["records"])
    head = next((r for r in recs if r.get("kind") == "init"), {})
    steps = []
    for r in (r for r in recs if r.get("kind") == "step"):
        toks = (
            r["mean_length"] * s["prompts_per_step"] * s["group"] if r.get("mean_length") else None
        )
        steps.append(
            {
                "step": r["step"],
                "seconds": r["seconds"],
                "reward": r.get("reward"),
                "response_length": r.get("mean_length"),
                "tokens/s": toks / r["seconds"] if toks else None,
                "gen tokens/s": None,
                "peak GiB": r.get("peak_mib", 0.0) / 1024,
            }
        )
    return {
        "rc": rc,
        "seconds_total": total,
        "steps": steps,
        "log_tail": log[-3000:],
        "init_seconds": head.get("seconds"),
        "timed_out": rc == 124,
        "version": head.get("version"),
    }


def trl_worker(spec_path: str) -> None:
    """TRL's side in its own process: GRPOTrainer on the shared checkpoint; one JSON line per
    optimizer step (seconds, reward, mean completion length, peak memory) as it goes."""
    t_start = time.perf_counter()
    spec = json.load(open(spec_path))
    s, device = spec["setup"], spec["device"]
    import torch
    import trl
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import AutoTokenizer, TrainerCallback

    rec_f = open(spec["records"], "a")

    def write(rec):
        rec_f.write(json.dumps(rec) + "\n")
        rec_f.flush()

    cuda = device == "cuda" and torch.cuda.is_available()

    class Steps(TrainerCallback):
        """A step's seconds: from the end of the previous optimizer step (or the start of
        training) to the end of this one; its peak memory: since the previous step's end."""

        t_prev, sec, peak = None, None, 0.0

        def _now(self):
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.t_prev = self._now()

        def on_step_end(self, args, state, control, **kw):
            now = self._now()
            self.sec = now - (self.t_prev if self.t_prev is not None else now)
            self.t_prev = now
            if cuda:
                self.peak = torch.cuda.max_memory_allocated() / 2**20
                torch.cuda.reset_peak_memory_stats()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and self.sec is not None:
                write(
                    {
                        "kind": "step",
                        "step": state.global_step,
                        "seconds": self.sec,
                        "reward": logs["reward"],
                        "mean_length": logs.get("completions/mean_length"),
                        "peak_mib": self.peak,
                        "kl": logs.get("kl"),
                        "loss": logs.get("loss"),
                    }
                )
                self.sec = None

    rows = read_rows(s["prompts_file"])
    # an explicit fingerprint: hashing the arrow table (Dataset.from_list) fails with some
    # pyarrow / dill pairs, and the fingerprint only names the cache
    data = Dataset(
        InMemoryTable.from_pylist([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
        fingerprint="copy_task_prompts",
    )
    tok = AutoTokenizer.from_pretrained(spec["ckpt"])
    args = trl.GRPOConfig(**trl_args(s, spec["out_dir"], device))
    trainer = trl.GRPOTrainer(
        model=spec["ckpt"],
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Steps()],
    )
    write({"kind": "init", "seconds": time.perf_counter() - t_start, "version": trl.__version__})
    trainer.train()


def _run(cmd: list[str], timeout: float, cwd: str) -> tuple[int, str]:
    """Run cmd in its own process group; on timeout kill the group. (exit code or 124, output)."""
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(
                os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
            ),
        )

        # This process stopped from outside (gpu_check's deadline: SIGTERM, then SIGKILL) must not
        # leave the child's session on the GPU: a SIGTERM here ends the child's group first.
        def _stop(signum, frame):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            raise SystemExit(128 + signum)

        prev = signal.signal(signal.SIGTERM, _stop)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = 124
        finally:
            signal.signal(signal.SIGTERM, prev)
        out.seek(0)
        text = out.read()
    sys.stdout.write(text[-4000:])
    sys.stdout.flush()
    return rc, text


def _median_after_first(steps: list[dict]) -> float | None:
    xs = [r["seconds"] for r in steps if r["step"] > 1] or [r["seconds"] for r in steps]
    return statistics.median(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument(
        "--small", action="store_true", help="tiny model and sizes (smoke run, the tests)"
    )
    ap.add_argument(
        "--wheels", default=None, help="folder of wheels to pip install trl from (--no-index)"
    )
    ap.add_argument("--trl-timeout", type=float, default=180.0, help="seconds for TRL's whole side")
    ap.add_argument(
        "--real-timeout", type=float, default=300.0, help="seconds for real_py's whole side"
    )
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/results)")
    ap.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    sys.path.insert(0, str(HERE))
    sys.path.insert(1, str(ROOT))

    s = setup(args.small)
    extra = {"setup": s}
    with tempfile.TemporaryDirectory() as work:
        ckpt = make_checkpoint(s, os.path.join(work, "ckpt"))
        import transformers

        extra["params"] = sum(
            p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(ckpt).parameters()
        )
        print(
            f"checkpoint: {extra['params'] / 1e6:.1f}M parameters; work {json.dumps(s)}", flush=True
        )
        ours = run_real_py(s, ckpt, work, args.device, args.real_timeout)
        extra["real_py"] = {k: v for k, v in ours.items() if k != "steps"}
        print(
            f"real_py: exit {ours['rc']}, {len(ours['steps'])} steps in "
            f"{ours['seconds_total']:.1f} s",
            flush=True,
        )
        report(args, s, extra, ours, None)
        why = install_trl(args.wheels)
        theirs = None
        if why is None:
            theirs = run_trl(s, ckpt, work, args.device, args.trl_timeout)
            extra["trl"] = {k: v for k, v in theirs.items() if k != "steps"}
            print(
                f"TRL {theirs.get('version')}: exit "
                f"{theirs['rc']}{' (timed out)' if theirs['timed_out'] else ''}, "
                f"{len(theirs['steps'])} steps in {theirs['seconds_total']:.1f} s",
                flush=True,
            )
        else:
            extra["trl_skipped"] = why
            print(f"TRL side skipped: {why}", flush=True)
    extra["complete"] = True
    report(args, s, extra, ours, theirs)
    return 0 if ours["rc"] == 0 else 1


def report(args, s: dict, extra: dict, ours: dict, theirs: dict | None) -> None:
    """Write the report of what has run (after real_py's side, again after TRL's)."""
    from timing import hardware_tag, markdown_table, write_results

    rows = [dict(side="real_py", **r) for r in ours["steps"]] + [
        dict(side="trl", **r) for r in (theirs or {}).get("steps", [])
    ]
    med = {"real_py": _median_after_first(ours["steps"])}
    if theirs:
        med["trl"] = _median_after_first(theirs["steps"])
    extra["median_step_seconds"] = med
    notes = (
        f"Work: {s['prompts_per_step']} prompts x {s['group']} completions of {s['new_tokens']} "
        f"tokens per step, {s['steps']} steps, lr {s['lr']}, KL {s['kl']} (k3 in the loss), "
        f"{s['micro']} micro-batches, model {extra['params'] / 1e6:.1f}M parameters (Qwen2, random "
        "init). tokens/s: generated tokens of the step / step seconds (one device); gen tokens/s: "
        f"/ the generation call alone (real_py). real_py: {len(ours['steps'])} steps, exit "
        f"{ours['rc']}, {ours['seconds_total']:.0f} s with start-up."
    )
    if theirs:
        notes += (
            f" TRL {theirs.get('version')}: {len(theirs['steps'])} steps, exit {theirs['rc']}"
            f"{' (stopped at the time limit)' if theirs['timed_out'] else ''}, "
            f"{theirs['seconds_total']:.0f} s with start-up ({theirs.get('init_seconds') or 0:.0f} "
            "s before training)."
        )
        if med.get("trl") and med.get("real_py"):
            extra["step_rate_ratio"] = med["trl"] / med["real_py"]
            notes += (
                f"\n\nMedian step seconds from step 2 on: real_py {med['real_py']:.3f}, TRL "
                f"{med['trl']:.3f}: real_py runs {extra['step_rate_ratio']:.2f}x TRL's step rate "
                "(goal 3x)."
            )
        k = min(3, len(ours["steps"]), len(theirs["steps"]))
        if k:
            n = min(len(ours["steps"]), len(theirs["steps"]))
            for side, st in (("real_py", ours["steps"][:n]), ("trl", theirs["steps"][:n])):
                extra[f"reward_first_last_{side}"] = (
                    _mean(r["reward"] for r in st[:k]),
                    _mean(r["reward"] for r in st[-k:]),
                )
            notes += (
                "\n\nMean reward over the first / last "
                + str(k)
                + f" of the {n} steps both sides ran: "
                + "; ".join(
                    f"{side} {a:.3f} -> {b:.3f}"
                    for side in ("real_py", "trl")
                    for a, b in [extra[f"reward_first_last_{side}"]]
                    if a is not None and b is not None
                )
            )
    elif "trl_skipped" in extra:
        notes += f"\n\nTRL's side did not run: {extra['trl_skipped']}"
    if not extra.get("complete"):
        notes += "\n\nPARTIAL: written after real_py's side; TRL's side had not finished."
    cols = "side|step|seconds|tokens/s|gen tokens/s|peak GiB|reward|response_length".split("|")
    paths = write_results(
        "trl",
        hardware_tag(args.device, args.small),
        rows,
        columns=cols,
        title=(
            f"GRPO on one {args.device} device: real_py against TRL's GRPOTrainer, "
            "same model and work"
        ),
        notes=notes,
        extra=extra,
        out_dir=args.out_dir,
    )
    if extra.get("complete"):
        print(markdown_table(rows, cols))
        print("wrote", *paths)


if __name__ == "__main__":
    sys.exit(main())
