"""The workload-dependent rules a call's layout must meet, declared once: the train job's
validation (rlhf/config/checks.py) and the plan search (search/problem.py) both ask this function,
so every plan the search returns passes the trainer's batch rules."""

from __future__ import annotations


def call_rule_errors(call: str, trains: bool, grpo_actor: bool, dp: int, batch_size: int,
                     mini_batches: int, micro_batches: int, group_size: int = 1) -> list[str]:
    """Why a call with data-parallel degree dp cannot run this batch; empty when it can."""
    if batch_size % dp:
        return [f"call {call}: dp={dp} does not divide data.batch_size={batch_size}"]
    local = batch_size // dp
    errs = []
    if trains:
        if local % mini_batches or local // mini_batches < micro_batches:
            errs.append(f"call {call}: the DP-local batch of {local} rows cannot be cut into "
                        f"ppo.mini_batches={mini_batches} mini-batches of at least "
                        f"ppo.micro_batches={micro_batches} rows")
        elif grpo_actor and (local // mini_batches) % group_size:
            errs.append(f"call {call}: ppo.group_size={group_size} must divide the "
                        f"DP-local mini-batch of {local // mini_batches} rows")
    return errs
