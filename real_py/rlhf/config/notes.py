"""What the launcher prints before launch besides errors: `notes`, warnings about a config that
runs but not as its author may expect, and `KL_LEGEND`, the step line's kl in words.
"""

from __future__ import annotations

import os

from .schema import TrainConfig

KL_LEGEND = (
    "kl = the k1 estimate of KL(actor || reference), sum over each response's tokens of "
    "(log pi_old - log pi_ref), mean over the batch's sequences; k1 is unbiased only on "
    "average over sampled responses, so a step's value can be negative (often while the actor is "
    "still close to the reference, or when sampling with temperature / top_p / top_k differs from "
    "the actor's own distribution)"
)
"""The step line's `kl` in words (printed by the launcher; docs/running.md)."""


def notes(cfg: TrainConfig, world_size: int) -> list[str]:
    """Warnings about a config that runs but not as its author may expect: keys the reward kind
    ignores, and more ranks than CPU cores. The launcher prints them before launch."""
    out = []
    plan = cfg.execution_plan()
    idle = plan.uncovered_ranks()
    if idle:
        why = (
            "recorded in the plan's idle_ranks: the search found no faster use for them"
            if set(idle) <= set(plan.idle_ranks)
            else "allow_idle_ranks: true"
        )
        out.append(
            f"the execution plan leaves ranks {idle} of {plan.world_size} without a call ({why}); "
            "they only join the world's collectives"
        )
    if cfg.reward.kind != "model" and cfg.reward_path:
        out.append(
            f"reward_path={cfg.reward_path!r} is ignored: reward.kind={cfg.reward.kind!r} scores "
            "without a reward model; remove reward_path, or set reward.kind: model to use it"
        )
    if cfg.reward.kind != "function" and cfg.reward.path:
        out.append(
            f"reward.path={cfg.reward.path!r} is ignored: it is read with reward.kind: function "
            f"only (reward.kind={cfg.reward.kind!r})"
        )
    gc = cfg.generation
    cut = []
    if gc.engine == "vllm" and gc.vllm_logp == "rollout" and not gc.greedy:
        vocab = cfg.model_configs()["actor"].vocab_size
        cut = [
            f"{k}={v:g}"
            for k, v, on in (
                ("top_p", gc.top_p, gc.top_p < 1),
                ("top_k", gc.top_k, 0 < gc.top_k < vocab),
                ("min_new_tokens", gc.min_new_tokens, gc.min_new_tokens > 0),
            )
            if on
        ]
    if cut:
        out.append(
            f"generation.vllm_logp: rollout with {', '.join(cut)}: vLLM's log-probs (old_logp) "
            "are of the distribution it sampled from, renormalised after top-p / top-k / the "
            "stop tokens banned before min_new_tokens, the trainer's of the whole one: the policy "
            "ratio starts at the kept mass Z (below 1) on those tokens, tokens with a negative "
            "advantage lose their gradient where Z < 1 - ppo.clip, and the kl term rises by "
            "-log Z; vllm_logp: recompute takes old_logp from the trainer, as the built-in "
            "engine does"
        )
    import torch

    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    busy = world_size - len(idle)  # idle ranks wait in collectives, using no core
    if not cuda and busy > cores:
        out.append(
            f"the plan has {busy} ranks with calls but this machine gives this process {cores} CPU "
            f"core{'s' if cores > 1 else ''}: ranks share cores and the run will be slow (calls "
            f"running side by side stretch by up to {busy / cores:g}x); for speed use a plan "
            f"of at most {cores} ranks "
            f"(python -m real_py search --gpus {cores} --hardware cpu --out plan.json) or a "
            "machine with more cores"
        )
    return out
