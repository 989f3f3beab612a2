"""PPO / GRPO dataflow runtime: calls on their own layouts, weights reallocated between calls."""

from .graph import ALGORITHMS, GRPO_CALLS, PPO_CALLS, Call, Graph

__all__ = ["Call", "Graph", "PPO_CALLS", "GRPO_CALLS", "ALGORITHMS"]
