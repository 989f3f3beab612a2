"""Dataflow graphs of model calls, execution plans and the batch rules a call's layout must meet:
pure descriptions that the runtime (real_py.rlhf) and the plan search (real_py.search) share
(see README.md)."""

from .execplan import ExecutionPlan
from .graph import ALGORITHMS, GROUPED, GRPO_CALLS, KINDS, PPO_CALLS, REMAX_CALLS, Call, Graph
from .rules import call_rule_errors

__all__ = [
    "Call",
    "Graph",
    "KINDS",
    "PPO_CALLS",
    "GRPO_CALLS",
    "REMAX_CALLS",
    "ALGORITHMS",
    "GROUPED",
    "ExecutionPlan",
    "call_rule_errors",
]
