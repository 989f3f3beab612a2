"""Checks of a train config before any rank starts: `check_values` (run by from_dict: the value
ranges of ranges.py, paths, and the rules that span fields) and `validate(cfg, world_size)`: the
execution plan against the graph, the world and the models, vocabularies against each other, then
host memory (host_memory.py), checkpoints, the prompt data and the reward function (files.py).
"""

from __future__ import annotations

from ...dataflow.execplan import ExecutionPlan
from ...dataflow.graph import ALGORITHMS, GROUPED, ROLLOUT_LOGP_CALL, Graph
from ...dataflow.rules import call_rule_errors, vllm_layout_errors
from ...layout import check_fits
from ...spec import model_spec
from .files import check_checkpoints, check_data_and_reward, check_paths, check_same_tokenizer
from .host_memory import check_host_memory, host_memory_need
from .notes import KL_LEGEND, notes
from .ranges import check_ranges
from .schema import TrainConfig

# host_memory_need, notes and KL_LEGEND live in host_memory.py and notes.py; importable here too.
__all__ = ["check_values", "validate", "host_memory_need", "notes", "KL_LEGEND"]


def check_values(cfg: TrainConfig) -> None:
    """The checks of one config on its own (no plan): ranges, paths, then the rules between
    fields."""
    check_ranges(cfg)
    check_paths(cfg)
    if cfg.wandb is not None:
        from ..observe import wandb_available

        if not wandb_available():
            raise ValueError(
                "config wandb is set but the wandb package is not installed; pip install "
                "wandb, or remove the wandb key"
            )
    if cfg.algo not in ALGORITHMS:
        raise ValueError(f"config algo={cfg.algo!r}; allowed: {sorted(ALGORITHMS)}")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "config device='cuda' but torch sees no GPU here (CPU-only torch, no "
                "driver or CUDA_VISIBLE_DEVICES empty); use device: cpu or auto"
            )
    d = cfg.data
    if not 1 <= d.min_prompt_len <= d.max_prompt_len:
        raise ValueError(
            f"config data: need 1 <= min_prompt_len <= max_prompt_len, got "
            f"{d.min_prompt_len}, {d.max_prompt_len}"
        )
    models = cfg.model_configs()
    vocab = models["actor"].vocab_size
    stops = cfg.generation.stop_token_ids or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
        raise ValueError(
            f"config generation.stop_token_ids={stops!r}: expected a list of token ids"
        )
    if cfg.generation.min_new_tokens > cfg.generation.max_new_tokens:
        raise ValueError(
            f"config generation.min_new_tokens={cfg.generation.min_new_tokens} exceeds "
            f"generation.max_new_tokens={cfg.generation.max_new_tokens}"
        )
    if cfg.reward.overlong_buffer > cfg.generation.max_new_tokens:
        raise ValueError(
            f"config reward.overlong_buffer={cfg.reward.overlong_buffer} exceeds "
            f"generation.max_new_tokens={cfg.generation.max_new_tokens}"
        )
    for key, v, used in (
        *((f"generation.stop_token_ids[{i}]", t, True) for i, t in enumerate(stops)),
        ("generation.eos_token_id", cfg.generation.eos_token_id, True),
        ("reward.target_token", cfg.reward.target_token, cfg.reward.kind == "rule"),
    ):
        if used and v is not None and not 0 <= v < vocab:
            raise ValueError(
                f"config {key}={v} is outside the actor vocabulary; allowed: 0 .. {vocab - 1} "
                f"(vocab_size={vocab})"
            )
    if "critic" not in cfg.graph().models():
        # A critic-free run would load no critic: a critic_path there is a config meant for PPO.
        for key, v, default in (
            ("critic_path", cfg.critic_path, None),
            ("critic_init", cfg.critic_init, "checkpoint"),
        ):
            if v != default:
                raise ValueError(
                    f"config {key}={v!r} but algo={cfg.algo!r} has no critic (critic-free): "
                    f"remove {key}, or use algo: ppo to train a critic"
                )
    if cfg.critic_init != "checkpoint" and not cfg.critic_path:
        raise ValueError(
            f"config critic_init={cfg.critic_init!r} needs critic_path (the checkpoint whose "
            "body the fresh value head sits on); it applies to the critic only, never to "
            "reward_path"
        )
    _check_vocab(cfg, models)


def _check_vocab(cfg: TrainConfig, models: dict) -> None:
    """Every model that reads the actor's tokens (ref, critic, reward) covers its vocab: an id past
    a model's embedding would embed as zeros, silently."""
    V = models["actor"].vocab_size
    paths, used = cfg.model_paths(), cfg.graph().models()
    for m in ("ref", "critic", "reward"):
        if m not in used or (m == "reward" and cfg.reward.kind in ("rule", "function")):
            continue
        if paths.get(m) and paths["actor"]:
            check_same_tokenizer(paths["actor"], paths[m], m)
        if models[m].vocab_size < V:
            src = (
                f"{paths[m]}"
                if paths.get(m)
                else "random init (section `critic`)"
                if m != "ref"
                else "actor"
            )
            raise ValueError(
                f"config: {m} has vocab_size={models[m].vocab_size} ({src}) but the actor "
                f"({paths['actor'] or 'random init'}) emits ids up to {V - 1}; give {m} a "
                f"checkpoint / `critic: {{vocab_size: {V}}}` covering the actor's vocab"
            )


def validate(cfg: TrainConfig, world_size: int) -> tuple[ExecutionPlan, Graph, dict]:
    """Check the plan against the graph, the world and the models; returns (plan, graph, models)."""
    plan, graph, models = cfg.execution_plan(), cfg.graph(), cfg.model_configs()
    missing = [n for n in graph.order if n not in plan.calls]
    extra = [n for n in plan.calls if n not in graph.calls]
    if missing or extra:
        hint = (
            f"; {ROLLOUT_LOGP_CALL} recomputes old_logp for vLLM generation, which "
            "generation.vllm_logp: rollout skips: search with --vllm-logp rollout, or drop the "
            "call from the plan"
            if ROLLOUT_LOGP_CALL in extra
            else ""
        )
        raise ValueError(
            f"execution plan does not match the {cfg.algo} graph: missing calls {missing}, "
            f"unknown calls {extra}; the graph's calls are {list(graph.order)}{hint}"
        )
    if plan.world_size != world_size:
        raise ValueError(
            f"execution plan is for world_size={plan.world_size}, but the job has "
            f"{world_size} ranks"
        )
    _check_searched_for(cfg, plan)
    uncovered = plan.uncovered_ranks()
    unplanned = [r for r in uncovered if r not in plan.idle_ranks]  # the search records its own
    if unplanned and not cfg.allow_idle_ranks:
        raise ValueError(
            f"execution plan leaves ranks {unplanned} of world {world_size} without a "
            "call; give them a call, list them in the plan's idle_ranks, or set "
            "allow_idle_ranks: true to run it anyway"
        )
    B = cfg.data.batch_size
    for n in graph.order:
        call, layout = graph.calls[n], plan.calls[n]
        spec = model_spec(models[call.model], name=call.model)
        try:
            check_fits(spec, layout)
        except ValueError as e:
            raise ValueError(f"call {n} ({call.model} on {layout}): {e}") from None
        errs = call_rule_errors(
            n,
            call.trains,
            cfg.algo in GROUPED and call.kind == "train_grpo_actor",
            layout.dp,
            B,
            cfg.ppo.mini_batches,
            cfg.ppo.micro_batches,
            cfg.ppo.group_size,
        )
        if errs:
            raise ValueError(errs[0])
    if cfg.ppo.dynamic_sampling and (cfg.algo not in GROUPED or cfg.ppo.group_size < 2):
        raise ValueError(
            f"config ppo.dynamic_sampling needs groups: algo one of {list(GROUPED)} and "
            f"ppo.group_size >= 2 (got algo={cfg.algo!r}, group_size={cfg.ppo.group_size})"
        )
    if cfg.async_.max_staleness > 0 and cfg.ppo.dynamic_sampling:
        raise ValueError(
            f"config async.max_staleness={cfg.async_.max_staleness} with ppo.dynamic_sampling: "
            "refill rounds regenerate rows of the batch being trained; not supported in "
            "async mode (set one of them off)"
        )
    if cfg.async_.interrupt and not (cfg.async_.max_staleness and cfg.async_.overlap_realloc):
        raise ValueError(
            "config async.interrupt needs async.max_staleness >= 1 and async.overlap_realloc"
        )
    if cfg.async_.check_versions and cfg.async_.max_staleness == 0:
        raise ValueError("config async.check_versions needs async.max_staleness >= 1")
    if cfg.algo in GROUPED and B % cfg.ppo.group_size:
        raise ValueError(f"ppo.group_size={cfg.ppo.group_size} does not divide data.batch_size={B}")
    total = cfg.data.max_prompt_len + cfg.generation.max_new_tokens
    used = graph.models()  # only the models the graph uses
    for m in ("actor", "ref", "critic", "reward"):
        if (
            m in used
            and not (m == "reward" and cfg.reward.kind != "model")
            and total > models[m].max_position_embeddings
        ):
            raise ValueError(
                f"max_prompt_len + max_new_tokens = {total} exceeds {m} "
                f"max_position_embeddings={models[m].max_position_embeddings}"
            )
    _check_runtime_support(cfg, plan, graph, models)
    _check_vllm(cfg, plan, graph, models)
    check_host_memory(cfg, plan, graph, models)
    check_checkpoints(cfg, graph, models)
    check_data_and_reward(cfg, models)
    return plan, graph, models


def _check_searched_for(cfg: TrainConfig, plan: ExecutionPlan) -> None:
    """A searched plan runs only with the batch settings it was searched for: its memory check,
    its divisibility rules and its estimate were for those batches."""
    if plan.searched_for is None:
        return
    p = cfg.ppo
    have = {
        "batch_size": ("data.batch_size", cfg.data.batch_size, "--batch-size"),
        "mini_batches": ("ppo.mini_batches", p.mini_batches, "--ppo-minibatches"),
        "micro_batches": ("ppo.micro_batches", p.micro_batches, "--micro-batches"),
        "ppo_epochs": ("ppo.ppo_epochs", p.ppo_epochs, "--ppo-epochs"),
        "group_size": ("ppo.group_size", cfg.group_size(), "--group-size"),
    }
    diff = [
        (key, getattr(plan.searched_for, f), v, flag)
        for f, (key, v, flag) in have.items()
        if getattr(plan.searched_for, f) != v
    ]
    if diff:
        where = (
            f"execution plan plan.path={cfg.plan['path']!r}"
            if set(cfg.plan) == {"path"}
            else "the execution plan under plan:"
        )
        raise ValueError(
            f"{where} was searched for other batch settings than the config's: "
            + ", ".join(f"{key}={v} (searched for {s})" for key, s, v, _ in diff)
            + "; its memory check and estimate hold for the searched ones. Search again with "
            + " ".join(f"{flag} {v}" for _, _, v, flag in diff)
            + ", or set "
            + ", ".join(f"{key}: {s}" for key, s, _, _ in diff)
            + " in the config"
        )


def _check_runtime_support(
    cfg: TrainConfig, plan: ExecutionPlan, graph: Graph, models: dict
) -> None:
    """Combinations the ranks would refuse after start-up (runtime.py, engines/decode.py, the HF
    export at the end of the run), refused here instead, before any rank starts."""
    for m in sorted(graph.models()):
        c, section = models[m], "actor" if m in ("actor", "ref") else "critic"
        for key in ("qkv_layout", "gate_up_layout"):
            if getattr(c, key) != "blocked":
                raise ValueError(
                    f"config {section}.{key}={getattr(c, key)!r}: the train engines compute on "
                    f"blocked fused tensors; remove {key} from `{section}` (other storage layouts "
                    "are for reallocating between trainers, real_py.interop)"
                )
    moe = sorted(m for m, c in models.items() if c.num_experts)
    k = cfg.async_.max_staleness
    if moe and k:
        raise ValueError(
            f"config async.max_staleness={k} with a mixture-of-experts model ({', '.join(moe)}): "
            "asynchronous RL is not implemented for MoE models; set async.max_staleness: 0 "
            "(synchronous), or use a dense model"
        )
    actor, mode = models["actor"], cfg.generation.decode
    gen = [n for n in graph.order if graph.calls[n].kind == "generate"]
    length_bound = (
        any(actor.uses_window(i) for i in range(actor.num_hidden_layers))
        or dict(actor.rope_scaling or ()).get("rope_type") == "dynamic"
    )
    if mode in ("static", "graph") and length_bound:
        raise ValueError(
            f"config generation.decode={mode!r} needs an actor without sliding-window attention "
            "and dynamic RoPE scaling (its cache does not track the length they depend on); "
            "use generation.decode: dynamic or auto"
        )
    if mode == "graph":
        import torch

        cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        wide = [f"{n} (tp={plan.calls[n].tp})" for n in gen if plan.calls[n].tp != 1]
        if not cuda or wide or actor.num_experts:
            why = (
                "the device is CPU"
                if not cuda
                else f"generation runs with tensor parallelism: {', '.join(wide)}"
                if wide
                else "the actor has experts (MoE routing cannot be captured)"
            )
            raise ValueError(
                f"config generation.decode='graph' needs CUDA, tp=1 on the generation calls and a "
                f"dense actor, but {why}; use generation.decode: auto (a CUDA graph where one can "
                "be captured) or dynamic"
            )
    if cfg.export == "hf":
        paths = cfg.model_paths()
        for m in ("actor", "critic"):
            call = graph.train_call(m)
            if call is None or not models[m].num_experts:
                continue
            if not paths.get(m):
                raise ValueError(
                    f"config export: hf with a random-init mixture-of-experts {m}: an MoE model is "
                    f"exported with the config.json of the checkpoint it was loaded from, and {m} "
                    f"has none; set {m}_path to an HF checkpoint, or remove export (checkpoints "
                    "under out_dir are written either way)"
                )
            if plan.calls[call].etp != 1:
                raise ValueError(
                    f"config export: hf: {m} trains on {plan.calls[call]} (etp="
                    f"{plan.calls[call].etp}) and experts are gathered for export from etp=1 "
                    f"layouts only; train {m} with etp=1 (plan.calls.{call}.etp), or remove export"
                )


def _check_vllm(cfg: TrainConfig, plan: ExecutionPlan, graph: Graph, models: dict) -> None:
    """generation.engine: vllm, generation.vllm_logp and ppo.tis_cap, refused before launch where
    they cannot run."""
    if cfg.generation.engine != "vllm":
        if cfg.ppo.tis_cap is not None:
            raise ValueError(
                f"config ppo.tis_cap={cfg.ppo.tis_cap} needs generation.engine: vllm (the built-in "
                "engine's rollout log-probs are the trainer's own: the weight would be 1)"
            )
        if cfg.generation.vllm_logp != "recompute":
            raise ValueError(
                f"config generation.vllm_logp={cfg.generation.vllm_logp!r} needs "
                "generation.engine: vllm (the built-in engine's log-probs are the trainer's own)"
            )
        return
    gc = cfg.generation
    if gc.vllm_logp == "rollout" and gc.greedy and gc.temperature != 1:
        raise ValueError(
            f"config generation.vllm_logp: rollout with greedy: true and temperature="
            f"{gc.temperature:g}: greedy vLLM returns log-probs at temperature 1 while the "
            "trainer's divide by generation.temperature, so old_logp would not be the trainer's "
            "policy; use vllm_logp: recompute, or temperature: 1"
        )
    if gc.vllm_logp == "rollout" and cfg.ppo.tis_cap is not None:
        raise ValueError(
            f"config ppo.tis_cap={cfg.ppo.tis_cap} with generation.vllm_logp: rollout: truncated "
            "importance sampling weighs vLLM's log-probs against the trainer's recompute, which "
            "vllm_logp: rollout skips; use vllm_logp: recompute, or remove ppo.tis_cap"
        )
    if cfg.async_.max_staleness:
        raise ValueError(
            f"config generation.engine: vllm with async.max_staleness={cfg.async_.max_staleness}: "
            "asynchronous RL with vLLM generation is not implemented (weights pushed at version "
            "boundaries); use async.max_staleness: 0"
        )
    gen = next(n for n in graph.order if graph.calls[n].kind == "generate")
    errs = vllm_layout_errors(plan.calls[gen], plan.world_size, models["actor"])
    if errs:
        raise ValueError(
            f"config generation.engine: vllm cannot run {gen} on {plan.calls[gen]}: "
            + "; ".join(errs)
        )
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "config generation.engine: vllm, but vLLM is not installed in this Python; "
            "`make vllm-venv` builds .venv-vllm (docs/vllm.md): run the job with "
            ".venv-vllm/bin/python -m real_py train ..."
        )
    import torch

    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    head_dim = models["actor"].head_dim
    if cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ValueError(
                f"config generation.engine: vllm on CPU: the actor's head_dim={head_dim} is not "
                f"one vLLM's CPU attention runs ({sizes}); change the actor's hidden_size / "
                "num_attention_heads (or head_dim), or use the built-in engine"
            )
