"""Shared pieces of the vLLM backend tests: small HF checkpoints, one vLLM engine per module,
trainer ranks as threads beside it (each with its own transfer-group member), greedy tokens and
logprobs, and the reference: a fresh vLLM engine started from the exported checkpoint."""

from __future__ import annotations

import os
import socket

import pytest
import torch

if os.environ.get("REAL_PY_REQUIRE_VLLM"):  # make test-vllm: a missing vLLM fails, never skips
    import vllm  # noqa: F401
else:
    pytest.importorskip(
        "vllm",
        reason="vLLM is not installed in this venv: `make test-vllm` runs "
        "these tests in .venv-vllm",
    )
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

from real_py import Layout, ModelConfig, ModelShard, gather_full, model_spec
from real_py.interop.hf import load_hf_shard, save_hf
from real_py.realloc.reallocator import run_ranks

PROMPTS = [[1, 2, 3, 4, 5] * 8, [7, 8, 9], [11, 12, 13, 14] * 5]
"""Token-id prompts; the first is longer than one KV block of 32 tokens (start_llm's block_size: the
CPU default, 128, would leave a 40-token prompt uncached and the prefix-cache test empty)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(
    path,
    *,
    model_type="qwen2",
    vocab=500,
    hidden=128,
    heads=4,
    kv_heads=2,
    layers=2,
    tie=False,
    seed=0,
) -> ModelConfig:
    """A random-init transformers checkpoint (fp32, head_dim 32: vLLM's CPU attention takes it)."""
    import transformers

    cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[model_type]
    cfg = cls[0](
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    cls[1](cfg).save_pretrained(path)
    return ModelConfig.from_hf(str(path))


def perturbed(full: dict, seed: int, scale: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in full.items()}


def start_llm(path, tp: int):
    from vllm import LLM

    return LLM(
        model=str(path),
        tensor_parallel_size=tp,
        gpu_memory_utilization=0.15,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=32,
        weight_transfer_config={"backend": "real_py"},
    )


def stop_llm(llm) -> None:
    """End a module's engine at its teardown: vLLM's workers first (they beat into the transfer
    group's store, which trainer rank 0 hosts), then the trainer engines made for it (their
    groups, heartbeats and store). Left to interpreter exit, their finalizers ran after pytest
    closed its streams ("Logging error"), and workers still beating into a closed store printed
    "Broken pipe"."""
    llm.llm_engine.engine_core.shutdown()
    for engine in reversed(_LIVE):  # rank 0 hosts the store: last
        engine.shutdown()
    _LIVE.clear()


def generate(llm, prompts=PROMPTS, max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and the logprob of each, per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def on_ranks(ranks, work) -> dict:
    """work(rank) on every trainer rank, each a thread; the lowest failed rank's error raised."""
    return run_ranks(None, ranks, work)


_LIVE: list = []
"""The last trainer engines made here: shut down when the next ones are made (their groups,
heartbeat threads and rank 0's store go with them)."""


def trainer_engines(
    llm, cfg: ModelConfig, layout: Layout, shards: dict, *, timeout_s=60.0, **kw
) -> dict:
    from real_py.vllm import RealPyTrainerEngine, RealPyTrainerInitInfo, ShardSource

    for engine in reversed(_LIVE):  # rank 0 hosts the store: last
        engine.shutdown()
    _LIVE.clear()

    port = free_port()
    workers = llm.llm_engine.vllm_config.parallel_config.world_size

    def init(r):
        info = RealPyTrainerInitInfo(
            rank=r,
            master_address="127.0.0.1",
            master_port=port,
            config=cfg,
            layout=layout,
            num_workers=workers,
            timeout_s=timeout_s,
            **kw,
        )
        return RealPyTrainerEngine.trainer_init(info, client=llm, source=ShardSource(shards[r]))

    engines = on_ranks(range(layout.world), init)
    _LIVE.extend(engines.values())
    return engines


def send(engines: dict) -> dict:
    return on_ranks(sorted(engines), lambda r: engines[r].send_weights())


def shards_of(cfg: ModelConfig, layout: Layout, full: dict) -> dict:
    spec = model_spec(cfg)
    return {r: ModelShard.from_full(spec, layout, r, full) for r in layout.ranks}


def export(path, cfg: ModelConfig, full: dict, source) -> None:
    save_hf(str(path), cfg, full, source=str(source))


def full_of(cfg: ModelConfig, shards: dict) -> dict:
    return gather_full(model_spec(cfg), list(shards.values()))


def load_full(path, cfg: ModelConfig) -> dict:
    """The checkpoint's tensors under real_py names (one tp1 shard's views, cloned)."""
    shard = load_hf_shard(str(path), cfg, Layout(), 0)
    return {k: v.clone() for k, v in shard.params().items()}


def hf_greedy(path, prompts=PROMPTS, max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
    """The independent reference: transformers' own forward on a checkpoint, greedy token by
    token."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids, toks, lps = list(p), [], []
            for _ in range(max_tokens):
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                t = int(lp.argmax())
                toks.append(t)
                lps.append(float(lp[t]))
                ids.append(t)
            out.append((toks, lps))
    return out


def assert_matches_transformers(
    got, root, name: str, cfg: ModelConfig, full: dict, source, tol=1e-4
):
    """vLLM's answer after an update against transformers on the same weights exported as an HF
    checkpoint: the same greedy tokens, logprobs within `tol` (fp32). Catches any parameter the
    backend does not write (its old value would change the answer far beyond tol)."""
    export(root / name, cfg, full, source)
    ref = hf_greedy(root / name)
    for (gt, gl), (rt, rl) in zip(got, ref):
        assert gt == rt, f"{name}: vLLM tokens {gt} != transformers {rt}"
        assert max(abs(a - b) for a, b in zip(gl, rl)) <= tol, f"{name}: logprobs {gl} vs {rl}"
