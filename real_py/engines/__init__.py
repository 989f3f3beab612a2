"""Generate, inference and train engines over shard buffers (see README.md)."""

from .engine import Engine
from .generate import pick_tokens
from .pipeline import MicroBatch, split_micro_batches
from .train import OptimConfig

__all__ = ["Engine", "OptimConfig", "MicroBatch", "split_micro_batches", "pick_tokens"]
