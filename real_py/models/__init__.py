"""TP/PP LLaMA / Qwen2-style decoder over shard buffers (see README.md)."""

from .moe import expert_token_counts, load_balancing_loss, router_records, router_z_loss
from .tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    reduce_from_tp,
)
from .transformer import KVCache, StageModel
from .vocab import vocab_parallel_logprobs

__all__ = [
    "KVCache",
    "StageModel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "reduce_from_tp",
    "vocab_parallel_logprobs",
    "expert_token_counts",
    "load_balancing_loss",
    "router_records",
    "router_z_loss",
]
