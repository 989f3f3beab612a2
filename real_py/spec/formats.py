"""Storage formats of other systems, as ModelConfig storage fields (the planner converts between
any two exactly; ModelConfig's shape and computation fields are left as they are).

  vllm_config   vLLM's live per-rank weights (Qwen2 / Llama): [q; k; v] and [gate; up] per TP
                rank, vocab padded to a multiple of 64 and split evenly, kv heads replicated
                when tp exceeds num_key_value_heads.
"""

from __future__ import annotations

from dataclasses import replace

from .config import ModelConfig

VLLM_VOCAB_PADDING = (
    64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (pad_vocab_size, VocabParallelEmbedding)
)


def vllm_config(config: ModelConfig, tp: int) -> ModelConfig:
    """`config` in vLLM's per-rank storage format at tensor-parallel size `tp`.

    vLLM pads the vocab rows to a multiple of 64 (absolute, not per rank) and splits them evenly
    over tp: real_py's vocab_pad_multiple * tp = 64, so vocab_pad_multiple = 64 // tp (vocab 500,
    tp=2: rank 1 holds rows 256..499 and 12 zero rows). QKVParallelLinear holds [q; k; v] rows
    per rank (blocked) with kv head k // (tp / nkv) on rank k when tp > nkv (kv_head_replicas);
    MergedColumnParallelLinear holds [gate; up] (blocked). ValueError names the cause when vLLM
    cannot shard the model at this tp.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"vllm_config: tp={tp!r} must be a positive int")
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    if VLLM_VOCAB_PADDING % tp:
        raise ValueError(
            f"vllm_config: tp={tp} does not divide vLLM's vocab padding of "
            f"{VLLM_VOCAB_PADDING} rows (the padded vocab is split evenly over tp)"
        )
    if nh % tp:
        raise ValueError(f"vllm_config: tp={tp} does not divide num_attention_heads={nh}")
    if tp > nkv and tp % nkv:
        raise ValueError(
            f"vllm_config: tp={tp} is above num_key_value_heads={nkv} and not a multiple "
            f"of it (vLLM replicates each kv head over tp / {nkv} ranks)"
        )
    if tp <= nkv and nkv % tp:
        raise ValueError(f"vllm_config: tp={tp} does not divide num_key_value_heads={nkv}")
    if config.intermediate_size % tp:
        raise ValueError(
            f"vllm_config: tp={tp} does not divide intermediate_size={config.intermediate_size}"
        )
    return replace(
        config,
        qkv_layout="blocked",
        gate_up_layout="blocked",
        vocab_pad_multiple=VLLM_VOCAB_PADDING // tp,
        kv_head_replicas=True,
    )
