"""The workload-dependent rules a call's layout must meet, declared once: the train job's
validation (rlhf/config/checks.py) and the plan search (search/problem.py) both ask these functions,
so every plan the search returns passes the trainer's batch rules (and, searched for vLLM
generation, the layouts vLLM can run)."""

from __future__ import annotations


def call_rule_errors(
    call: str,
    trains: bool,
    grpo_actor: bool,
    dp: int,
    batch_size: int,
    mini_batches: int,
    micro_batches: int,
    group_size: int = 1,
) -> list[str]:
    """Why a call with data-parallel degree dp cannot run this batch; empty when it can."""
    if batch_size % dp:
        return [f"call {call}: dp={dp} does not divide data.batch_size={batch_size}"]
    local = batch_size // dp
    errs = []
    if trains:
        if local % mini_batches or local // mini_batches < micro_batches:
            errs.append(
                f"call {call}: the DP-local batch of {local} rows cannot be cut into "
                f"ppo.mini_batches={mini_batches} mini-batches of at least "
                f"ppo.micro_batches={micro_batches} rows"
            )
        elif grpo_actor and (local // mini_batches) % group_size:
            errs.append(
                f"call {call}: ppo.group_size={group_size} must divide the "
                f"DP-local mini-batch of {local // mini_batches} rows"
            )
    return errs


def vllm_layout_errors(layout, world: int, config) -> list[str]:
    """Why vLLM cannot run the actor's generation call on `layout` (a Layout) in a world of
    `world` ranks ([] when it can); config: the actor's ModelConfig. vLLM runs inside the ranks
    (real_py/vllm/rollout.py) and cuts its tensor-parallel groups from the whole torch world,
    consecutive ranks. The train job's validation and the plan search (--engine vllm) both ask."""
    out = []
    if layout.pp != 1:
        out.append(f"pp={layout.pp}: vLLM generation runs dp x tp (pp 1)")
    if (
        layout.dp * layout.tp != world
        or tuple(layout.ranks) != tuple(range(world))
        or layout.order != "tp-dp-pp"
    ):
        out.append(
            f"ranks {list(layout.ranks)}: vLLM generation uses every rank of the world, tp fastest "
            f"(dp * tp = {world}, ranks 0..{world - 1} in order): inside torchrun vLLM cuts its "
            "tensor-parallel groups from the whole world"
        )
    if config.num_experts:
        out.append(
            "a mixture-of-experts actor: the runtime does not move experts into vLLM yet (the "
            "real_py vLLM backend does, real_py.vllm)"
        )
    heads, kv, tp = config.num_attention_heads, config.num_key_value_heads, layout.tp
    if heads % tp or (kv % tp and tp % kv):
        out.append(
            f"tp={tp} must divide the {heads} attention heads and divide or be a multiple of the "
            f"{kv} kv heads (vLLM's rule)"
        )
    return out
