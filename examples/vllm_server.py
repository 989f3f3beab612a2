"""Trainer ranks update a running vLLM OpenAI-compatible server through the `real_py`
weight-transfer backend and vLLM's own HTTP client, then query /v1/completions.

    .venv-vllm/bin/python examples/vllm_server.py [--steps 2] [--tp 2] [--workdir DIR]

Needs the vLLM venv (`make vllm-venv`, docs/vllm.md). The example

1. writes a small random Qwen2 checkpoint (vocab 500, head_dim 32) into --workdir or a
   temporary folder;
2. starts `python -m vllm.entrypoints.openai.api_server --model <ckpt> --weight-transfer-config
   '{"backend":"real_py"}' --dtype float32 --skip-tokenizer-init ...` as a subprocess with
   VLLM_SERVER_DEV_MODE=1 (the weight-transfer routes exist only then), its output in
   <workdir>/server.log (its last lines are printed on a failure; a temporary folder is removed
   at the end, --workdir keeps it), and waits for /health (at most --start-timeout seconds);
3. runs the trainer ranks as **threads of this process** (4 ranks, layout dp1,tp2,pp2, each with
   its real_py ModelShard loaded by load_hf_shard); rank 0 drives vLLM through
   `vllm.distributed.weight_transfer.clients.HTTPVLLMWeightSyncClient(base_url)`. Separate
   processes (torchrun) work alike: see examples/vllm_offline.py;
4. per step changes every shard in place, calls engine.send_weights() on every rank, and asks
   /v1/completions for greedy tokens of token-id prompts (`prompt` as a list of ints;
   `return_token_ids` gives the tokens and `return_tokens_as_token_ids` lets logprobs work
   without a tokenizer). The answer must have changed and must equal transformers' greedy
   decoding of the same weights exported as an HF checkpoint (tokens equal, logprobs within
   --tol). One PASS / FAIL line per step; non-zero exit on failure.

The server's whole process group is stopped at the end, whatever happens; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_offline import (
    BLOCK_SIZE,
    PROMPTS,
    compare,
    describe_plan,
    free_port,
    hf_greedy,
    make_checkpoint,
    show_mismatch,
    training_step,
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2, help="the server's --tensor-parallel-size")
    ap.add_argument(
        "--layout", default="dp1,tp2,pp2", help="trainer layout (its ranks run as threads)"
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="checkpoint, exports and server.log (default: a temporary folder)",
    )
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds to wait for /health"
    )
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for any one request or transfer wait"
    )
    return ap.parse_args(argv)


def start_server(ckpt: str, tp: int, port: int, log_path: str) -> subprocess.Popen:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    if tp > 1:
        env.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        )
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        ckpt,
        "--weight-transfer-config",
        json.dumps({"backend": "real_py"}),
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp),
        "--gpu-memory-utilization",
        "0.15",
        "--max-model-len",
        "128",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--skip-tokenizer-init",
    ]
    log = open(log_path, "w")
    # a session of its own: the server and every process it spawns are stopped together
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever of its group is left (engine core, workers)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def wait_healthy(base: str, proc: subprocess.Popen, log_path: str, timeout: float) -> float:
    import requests

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the vLLM server exited with {proc.returncode} before it was healthy; "
                f"last lines of {log_path}:\n{tail(log_path)}"
            )
        try:
            if requests.get(f"{base}/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(
        f"the vLLM server was not healthy within {timeout:g} s; last lines of {log_path}:\n"
        f"{tail(log_path)}"
    )


def tail(path: str, n: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def completions(base: str, model: str, prompts, max_tokens: int, timeout: float):
    """[(tokens, logprobs)] per prompt from /v1/completions, greedy, token ids in and out."""
    import requests

    out = []
    for p in prompts:
        r = requests.post(
            f"{base}/v1/completions",
            timeout=timeout,
            json={
                "model": model,
                "prompt": p,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            },
        )
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:500]}")
        c = r.json()["choices"][0]
        out.append((c["token_ids"], c["logprobs"]["token_logprobs"]))
    return out


def on_ranks(n: int, fn, timeout: float) -> dict:
    """fn(rank) on n threads (the trainer ranks); their results, or the lowest rank's error."""
    res, errs = {}, {}

    def one(r):
        try:
            res[r] = fn(r)
        except BaseException as e:
            errs[r] = e

    threads = [
        threading.Thread(target=one, args=(r,), daemon=True, name=f"trainer-rank-{r}")
        for r in range(n)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if errs:
        r = min(errs)
        raise RuntimeError(f"trainer rank {r}: {type(errs[r]).__name__}: {errs[r]}") from errs[r]
    if stuck:
        raise TimeoutError(f"{stuck} did not finish within {timeout:g} s")
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from real_py import Layout, ModelConfig, gather_full, model_spec
    from real_py.interop import load_hf_shard, save_hf
    from real_py.vllm import RealPyTrainerEngine, RealPyTrainerInitInfo, ShardSource

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below on a kill too
    tmp = None if args.workdir else tempfile.mkdtemp(prefix="real_py_vllm_server_")
    workdir = args.workdir or tmp
    os.makedirs(workdir, exist_ok=True)
    ckpt, log_path = os.path.join(workdir, "ckpt"), os.path.join(workdir, "server.log")
    layout = Layout.parse(args.layout)
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        make_checkpoint(ckpt, layers=max(4, layout.pp))
    cfg = ModelConfig.from_hf(ckpt)
    spec = model_spec(cfg)
    shards = [load_hf_shard(ckpt, cfg, layout, r) for r in range(layout.world)]

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(ckpt, args.tp, port, log_path)
    ok_all = True
    try:
        print(
            f"vLLM server (tp={args.tp}) healthy at {base} after "
            f"{wait_healthy(base, proc, log_path, args.start_timeout):.1f} s; log: {log_path}",
            flush=True,
        )
        before = completions(base, ckpt, PROMPTS, args.max_tokens, args.timeout)
        ref = hf_greedy(ckpt, PROMPTS, args.max_tokens)
        ok, same, diff = compare(before, ref, args.tol)
        if not ok:
            show_mismatch(before, ref)
        print(
            f"step 0: {'PASS' if ok else 'FAIL'}: server as loaded vs transformers on the "
            f"checkpoint: tokens {'equal' if same else 'DIFFER'}, max |logprob diff| {diff:.2e}",
            flush=True,
        )
        ok_all &= ok

        client = HTTPVLLMWeightSyncClient(base, timeout=args.timeout)
        group_port = free_port()

        def init(r):
            info = RealPyTrainerInitInfo(
                rank=r,
                master_address="127.0.0.1",
                master_port=group_port,
                config=cfg,
                layout=layout,
                num_workers=args.tp,
                timeout_s=args.timeout,
            )
            return RealPyTrainerEngine.trainer_init(
                info, client=client if r == 0 else None, source=ShardSource(shards[r])
            )

        engines = on_ranks(layout.world, init, 2 * args.timeout)
        print(describe_plan(engines[0].plan), flush=True)

        for step in range(1, args.steps + 1):
            for s in shards:
                training_step(s, step)
            stats = on_ranks(layout.world, lambda r: engines[r].send_weights(), 2 * args.timeout)[0]
            got = completions(base, ckpt, PROMPTS, args.max_tokens, args.timeout)
            out = os.path.join(workdir, f"step{step}")
            save_hf(out, cfg, gather_full(spec, shards), source=ckpt)  # the independent reference
            ref = hf_greedy(out, PROMPTS, args.max_tokens)
            ok, same, diff = compare(got, ref, args.tol)
            changed = got != before
            before = got
            print(
                f"step {step}: workers received {[w['received_bytes'] for w in stats['workers']]} "
                f"bytes; update {stats['seconds'] * 1e3:.1f} ms on rank 0",
                flush=True,
            )
            print(
                f"step {step}: {'PASS' if ok and changed else 'FAIL'}: /v1/completions "
                f"(tp={args.tp}) vs transformers on the gathered weights: tokens "
                f"{'equal' if same else 'DIFFER'} ({len(PROMPTS)} prompts x {args.max_tokens}), "
                f"max |logprob diff| {diff:.2e} (tol {args.tol:g}); answer "
                f"{'changed' if changed else 'UNCHANGED'} since the last weights",
                flush=True,
            )
            if not ok:
                show_mismatch(got, ref)
            ok_all &= ok and changed
        for e in engines.values():
            e.shutdown()
        client.shutdown_weight_transfer_engine()
        print(
            f"{'PASS' if ok_all else 'FAIL'}: {args.steps} updates of a vLLM server through the "
            "real_py backend",
            flush=True,
        )
    except BaseException:
        print(f"--- last lines of {log_path}:\n{tail(log_path)}", file=sys.stderr, flush=True)
        raise
    finally:
        stop_server(proc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
