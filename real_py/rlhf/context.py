"""What a call sees on its rank: the typed contract between the runtime and calls.py.

    ctx = CallContext(rank=..., device=..., ppo=cfg.ppo, ...)   # built once by runtime.Runtime
    calls.run_call(ctx, call, g, engine, store, sums, step)     # every call of every step

The context carries the config sections a call reads (never the whole TrainConfig), the models,
the prompt data and reward function, and the run state the runtime advances between steps (the
KL coefficient, reward moments) and between the rounds of a step (dynamic sampling's active rows,
the data-set rows of the batch, the weight version rollouts generate with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .asyncrl import AsyncState, Prefetch
from .config.schema import AsyncConfig, DataConfig, GenConfig, PPOConfig, RewardConfig
from .data import PromptData
from .models import Models
from .rewards import FunctionReward


@dataclass(kw_only=True, slots=True)
class CallContext:
    rank: int
    device: torch.device
    algo: str
    steps: int  # iterations of the run (the LR schedule's length)
    B: int  # rows of a batch
    T: int  # token positions of a row (prompt + response)
    mini_batches: dict[str, int]  # per train call
    data: DataConfig
    generation: GenConfig
    ppo: PPOConfig
    reward: RewardConfig
    async_: AsyncConfig
    models: Models
    prompts: PromptData | None  # the prompt data set (None: synthetic prompts)
    tokenizer: Any  # for decoding samples and responses (None: token ids)
    reward_fn: FunctionReward | None  # reward.kind == "function"
    samples_path: str | None = None  # where the reward call appends samples (set by the driver)
    astate: AsyncState | None = None  # async mode: queue, versions, ledger
    prefetch: Prefetch | None = None  # async.overlap_realloc: the double buffer
    # Run state.
    kl_coef: float  # this step's KL coefficient (adapted with ppo.kl_target)
    reward_moments: torch.Tensor  # [sum, sum of squares, count] of earlier steps' scores
    active_rows: set[int] | None = None  # a refill round's rows (None: all)
    batch_index: torch.Tensor | None = None  # [B] data-set row of every batch row
    gen_version: int = 0  # weight version the rollout calls in flight generate with


__all__ = ["CallContext"]
