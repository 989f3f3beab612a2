"""Trainer ranks under torchrun update an in-process vLLM through the `real_py` weight-transfer
backend, and every update is checked against transformers on the gathered weights.

    .venv-vllm/bin/python -m torch.distributed.run --standalone --nproc-per-node 4 \
        examples/vllm_offline.py [--steps 3] [--tp 2] [--workdir DIR]

Needs the vLLM venv (`make vllm-venv`, docs/vllm.md). Each torchrun rank is a trainer process
with torch.distributed (gloo) set up by torchrun; it holds its shard of a small random Qwen2
(written into --workdir, or a temporary folder) in the trainer layout dp1,tp2,pp2, as real_py
ModelShards loaded with load_hf_shard. Rank 0 also runs an in-process `vllm.LLM` with
tensor_parallel_size=--tp and weight_transfer_config={"backend": "real_py"}.

Every step each rank changes its shard in place (a deterministic stand-in for an optimizer step,
the same on every rank) and calls engine.send_weights(): each rank sends its own pieces straight
to the vLLM workers that hold them, nobody gathers. Then, independently of that path, the ranks
gather the full tensors onto rank 0 (plain send / recv), rank 0 saves them as an HF checkpoint
and compares vLLM's greedy tokens and logprobs with transformers' greedy decoding of that
checkpoint (tokens equal, logprobs within --tol). One PASS / FAIL line per step; the exit status
is non-zero when a step fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import socket
import sys
import tempfile
import time
from types import SimpleNamespace

# Prompts as token ids (no tokenizer). The first is longer than one KV-cache block (BLOCK_SIZE;
# vLLM's CPU default is 128, as long as the whole context here), so its first block is cached:
# vLLM keeps its prefix cache across weight updates and the backend resets it, else this prompt
# would be answered from KV computed with the old weights.
BLOCK_SIZE = 32
PROMPTS = [[(7 * i + 3) % 500 for i in range(40)], [11, 12, 13], [499, 250, 1, 64]]
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps", type=int, default=3, help="training steps, each followed by an update"
    )
    ap.add_argument("--tp", type=int, default=2, help="vLLM tensor_parallel_size")
    ap.add_argument(
        "--layout", default="dp1,tp2,pp2", help="trainer layout (its world = torchrun's)"
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="checkpoint and exports (default: a temporary folder, removed)",
    )
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-4, help="largest |logprob difference| allowed")
    ap.add_argument(
        "--master-address",
        default="127.0.0.1",
        help="address of trainer rank 0 (it hosts the transfer group's store)",
    )
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="seconds any one transfer wait may take"
    )
    return ap.parse_args(argv)


def make_checkpoint(path: str, layers: int = 4) -> None:
    """A small random Qwen2: vocab 500 (vLLM pads it to 512), head_dim 32 (vLLM's CPU attention
    refuses some sizes, e.g. 24), two kv heads, an untied lm_head, float32."""
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,
        dtype="float32",
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)


def training_step(shard, step: int) -> None:
    """Stands in for an optimizer step: w -= 0.05 sin(7 step w), in place on this rank's shard.
    Elementwise and the same on every rank, so tp-replicated tensors (norms) stay equal."""
    import torch

    with torch.no_grad():
        shard.flat.sub_(0.05 * torch.sin(7.0 * step * shard.flat))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def without_torchrun_env():
    """vLLM's processes must not take rank 0's torchrun variables (RANK, WORLD_SIZE, ...) for
    their own: hide them while the engine spawns them."""
    saved = {k: os.environ.pop(k) for k in TORCHRUN_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def vllm_greedy(llm, prompts, max_tokens):
    """[(tokens, logprob of each token)] per prompt, greedy."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        temperature=0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]))
    return res


def hf_greedy(path, prompts, max_tokens):
    """The reference: transformers' forward on the exported checkpoint, greedy token by token."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    res = []
    with torch.no_grad():
        for p in prompts:
            ids, toks, lps = list(p), [], []
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1)
                t = int(lp.argmax())
                toks.append(t)
                lps.append(float(lp[t]))
                ids.append(t)
            res.append((toks, lps))
    return res


def compare(got, ref, tol):
    """(ok, tokens_equal, max |logprob diff| over the tokens both agree on)."""
    same = all(g[0] == r[0] for g, r in zip(got, ref))
    diff = max((abs(a - b) for g, r in zip(got, ref) for a, b in zip(g[1], r[1])), default=0.0)
    return same and diff <= tol, same, diff


def show_mismatch(got, ref) -> None:
    for g, r in zip(got, ref):
        print(
            f"    vLLM {g[0]} {[round(x, 5) for x in g[1]]}\n"
            f"    HF   {r[0]} {[round(x, 5) for x in r[1]]}",
            flush=True,
        )


def describe_plan(plan) -> str:
    s = plan.summary()
    met = "met" if s["network_bytes"] == s["min_network_bytes"] else "NOT met"
    lines = [
        f"plan {s['src']} -> {s['dst']} ({s['dtype']}): network {s['network_bytes']} bytes "
        f"(minimum {s['min_network_bytes']}, {met}), "
        f"local {s['local_bytes']} bytes, {s['num_messages']} messages",
        "  group rank   send bytes   recv bytes  (trainer ranks first, then vLLM workers)",
    ]
    for r, v in sorted(s["per_rank"].items()):
        lines.append(f"  {r:10d} {v['send']:12d} {v['recv']:12d}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tp > 1:  # vLLM's CPU workers each bind to cores; on a small machine name them
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)),
        )
    import torch
    import torch.distributed as dist

    from real_py import Layout, ModelConfig
    from real_py.interop import gather_state_dict, load_hf_shard, save_hf
    from real_py.vllm import RealPyTrainerEngine, RealPyTrainerInitInfo, ShardSource

    torch.set_num_threads(1)  # four trainer ranks beside vLLM on a few cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout.parse(args.layout)
    if layout.world != world:
        raise SystemExit(
            f"--layout {args.layout} has {layout.world} ranks, torchrun started {world}"
        )

    # rank 0 writes the checkpoint and chooses the transfer group's port; everyone learns both
    tmp = None
    if rank == 0:
        workdir = args.workdir or (tmp := tempfile.mkdtemp(prefix="real_py_vllm_"))
        ckpt = os.path.join(workdir, "ckpt")
        if not os.path.isfile(os.path.join(ckpt, "config.json")):
            make_checkpoint(ckpt, layers=max(4, layout.pp))
    box = [ckpt if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ckpt = box[0]
    workdir = os.path.dirname(ckpt)
    cfg = ModelConfig.from_hf(ckpt)
    shard = load_hf_shard(ckpt, cfg, layout, rank)

    llm = None
    ok_all = True
    try:
        if rank == 0:
            from vllm import LLM

            t0 = time.perf_counter()
            with without_torchrun_env():
                llm = LLM(
                    model=ckpt,
                    tensor_parallel_size=args.tp,
                    weight_transfer_config={"backend": "real_py"},
                    dtype="float32",
                    gpu_memory_utilization=0.15,
                    skip_tokenizer_init=True,
                    enforce_eager=True,
                    max_model_len=128,
                    block_size=BLOCK_SIZE,
                )
            print(
                f"[rank 0] vLLM (tp={args.tp}) started in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            before = vllm_greedy(llm, PROMPTS, args.max_tokens)
            ref = hf_greedy(ckpt, PROMPTS, args.max_tokens)
            ok, same, diff = compare(before, ref, args.tol)
            if not ok:
                show_mismatch(before, ref)
            print(
                f"[rank 0] step 0: {'PASS' if ok else 'FAIL'}: vLLM as loaded vs transformers on "
                f"the checkpoint: tokens {'equal' if same else 'DIFFER'}, max |logprob diff| "
                f"{diff:.2e}",
                flush=True,
            )
            ok_all &= ok
        box = [free_port() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)

        info = RealPyTrainerInitInfo(
            rank=rank,
            master_address=args.master_address,
            master_port=box[0],
            config=cfg,
            layout=layout,
            num_workers=args.tp,
            timeout_s=args.timeout,
        )
        engine = RealPyTrainerEngine.trainer_init(info, client=llm, source=ShardSource(shard))
        if rank == 0:
            print(describe_plan(engine.plan), flush=True)

        for step in range(1, args.steps + 1):
            training_step(shard, step)
            stats = engine.send_weights()
            # the independent reference: the same weights gathered (plain send / recv) and exported
            full = gather_state_dict(shard, SimpleNamespace(rank=rank))
            if rank == 0:
                out = os.path.join(workdir, f"step{step}")
                save_hf(out, cfg, full, source=ckpt)
                got, ref = (
                    vllm_greedy(llm, PROMPTS, args.max_tokens),
                    hf_greedy(out, PROMPTS, args.max_tokens),
                )
                ok, same, diff = compare(got, ref, args.tol)
                changed = got != before
                before = got
                w = stats["workers"]
                print(
                    f"[rank 0] step {step}: sent {stats['sent_bytes']} bytes from rank 0 in "
                    f"{stats['seconds'] * 1e3:.1f} ms; workers received "
                    f"{[x['received_bytes'] for x in w]} bytes, applied in "
                    f"{max(x['apply_s'] for x in w) * 1e3:.1f} ms",
                    flush=True,
                )
                print(
                    f"[rank 0] step {step}: {'PASS' if ok else 'FAIL'}: vLLM tp={args.tp} vs "
                    f"transformers on the gathered weights: tokens {'equal' if same else 'DIFFER'} "
                    f"({len(PROMPTS)} prompts x {args.max_tokens}), max |logprob diff| {diff:.2e} "
                    f"(tol {args.tol:g}); output {'changed' if changed else 'UNCHANGED'} since the "
                    "last weights",
                    flush=True,
                )
                if not ok:
                    show_mismatch(got, ref)
                ok_all &= ok and changed
        engine.shutdown()
        if rank == 0:
            # the workers leave the transfer group; vLLM serves on
            llm.shutdown_weight_transfer_engine()
            print(
                f"[rank 0] {'PASS' if ok_all else 'FAIL'}: {args.steps} updates through the "
                "real_py backend",
                flush=True,
            )
    finally:
        if llm is not None:
            del llm
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
