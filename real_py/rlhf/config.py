"""Configuration of `python -m real_py train`: dataclasses, YAML loading, the embedded default.

Every section rejects unknown keys (ValueError naming the section, the key and the allowed
keys). `validate(cfg, world_size)` checks the execution plan against the graph, the world and
the models before any work starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from ..execplan import ExecutionPlan
from ..layout import check_fits
from ..spec import ModelConfig, model_spec
from .graph import ALGORITHMS, Graph

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, num_hidden_layers=4, max_position_embeddings=64)

DEFAULT_PLAN = {
    "world_size": 4,
    "calls": {
        "actor_gen": {"ranks": [0, 1, 2, 3], "dp": 4, "tp": 1, "pp": 1},
        "ref_inf": {"ranks": [0, 1], "dp": 2, "tp": 1, "pp": 1},
        "rew_inf": {"ranks": [2, 3], "dp": 1, "tp": 2, "pp": 1},
        "critic_inf": {"ranks": [2, 3], "dp": 1, "tp": 1, "pp": 2},
        "actor_train": {"ranks": [0, 1, 2, 3], "dp": 1, "tp": 2, "pp": 2},
        "critic_train": {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "pp": 1},
    },
}


@dataclass(kw_only=True, slots=True)
class DataConfig:
    num_prompts: int = 256
    """Size of the built-in synthetic prompt set (random token ids, seeded)."""
    batch_size: int = 8
    """Prompts per iteration (rows of the global batch)."""
    min_prompt_len: int = 3
    max_prompt_len: int = 8


@dataclass(kw_only=True, slots=True)
class GenConfig:
    max_new_tokens: int = 12
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    eos_token_id: int | None = None
    decode: Literal["auto", "dynamic", "static", "graph"] = "auto"
    """KV cache and decode step (real_py/engines/decode.py): "auto" replays the decode step from a
    CUDA graph on CUDA with tp == 1 and runs the static cache eagerly elsewhere; "static",
    "dynamic" (growing cache) or "graph" (CUDA with tp == 1 only) force one."""


@dataclass(kw_only=True, slots=True)
class PPOConfig:
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2
    """Policy ratio clip."""
    value_clip: float = 0.2
    ppo_epochs: int = 2
    mini_batches: int = 2
    """Mini-batches per PPO epoch (each an optimizer step)."""
    micro_batches: int = 1
    """Micro-batches per train step (pipeline schedule)."""
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    max_grad_norm: float = 1.0
    adam_eps: float = 1e-8
    group_size: int = 2
    """GRPO: consecutive rows sharing a prompt (the prompt is repeated group_size times)."""
    whiten_advantages: bool = True


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    kind: str = "model"
    """"model" (the reward model's value at the last token) or "rule" (fraction of target_token)."""
    target_token: int = 7


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    algo: str = "ppo"
    """A key of graph.ALGORITHMS: "ppo" or "grpo" (critic-free)."""
    steps: int = 30
    seed: int = 1234
    out_dir: str = "runs/train"
    save_every: int = 10
    """Checkpoint every N steps (and at the end); 0 disables."""
    actor: dict | None = None
    """ModelConfig fields of the actor (the reference shares it and its initial weights); None:
    a tiny random-init model, or the config of actor_path."""
    critic: dict | None = None
    """ModelConfig fields of the critic and reward model (head is forced to "value")."""
    actor_path: str | None = None
    """HF checkpoint (LLaMA / Qwen2 safetensors) of the actor and reference; `actor` overrides
    its config fields. None: random init from `seed`."""
    critic_path: str | None = None
    """HF checkpoint of the critic (a ...ForSequenceClassification with num_labels=1)."""
    reward_path: str | None = None
    """HF checkpoint of the reward model; None: random init (or critic's shape)."""
    verify_realloc: bool = False
    """Ship a checksum with every reallocation chunk and fail on a mismatch (costs a pass over the
    bytes on both sides)."""
    offload_frozen: bool = False
    """Keep the frozen models' weights (reference, reward model; not a rule reward) in host memory
    except during their call: reloaded just before it, offloaded right after it, every iteration
    (pinned host buffer on GPU; on CPU the working buffer is freed but the copy lives in the same
    RAM). Trainable models (actor, critic) stay in place."""
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenConfig = field(default_factory=GenConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    plan: dict = field(default_factory=lambda: {"world_size": DEFAULT_PLAN["world_size"],
                                                 "calls": dict(DEFAULT_PLAN["calls"])})
    """ExecutionPlan JSON (or {"path": file.json})."""
    allow_idle_ranks: bool = False
    """Run a plan that leaves some ranks without a call (they only join the world collectives).
    Off by default so that a plan that does not cover the world is caught before launch; a searched
    plan for a small job may idle ranks on purpose."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where every engine runs: "cuda" puts rank r's models on cuda:{LOCAL_RANK} and uses NCCL for
    every collective, reallocation and row push; "cpu" uses gloo; "auto" picks cuda when torch
    sees a GPU."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Parameter and activation dtype of every model: "bf16" keeps the shards (and what a
    reallocation moves) in bfloat16, with fp32 master weights, fp32 Adam states and fp32 gradient
    reduction held by the train engines. Overrides the models' dtype (set it here, not in
    actor/critic)."""

    def model_configs(self) -> dict[str, ModelConfig]:
        out = {}
        tiny = {"actor": TINY, "critic": dict(TINY, num_hidden_layers=2)}
        dtype = PRECISION_DTYPES.get(self.precision)
        for name, d, path, head in (("actor", self.actor, self.actor_path, "lm"),
                                    ("critic", self.critic, self.critic_path, "value"),
                                    ("reward", self.critic, self.reward_path, "value")):
            if d and "dtype" in d and d["dtype"] != dtype:
                raise ValueError(f"config {'actor' if name == 'actor' else 'critic'}.dtype="
                                 f"{d['dtype']!r} conflicts with precision={self.precision!r} "
                                 f"(dtype {dtype!r}); set precision instead")
            try:
                if path:
                    out[name] = ModelConfig.from_hf(path, **{**(d or {}), "head": head, "dtype": dtype})
                else:
                    out[name] = ModelConfig(**{**tiny.get(name, tiny["critic"]), **(d or {}), "head": head,
                                               "dtype": dtype})
            except (TypeError, OSError) as e:
                raise ValueError(f"config {name}{' (' + path + ')' if path else ''}: {e}; allowed "
                                 f"fields: {[f.name for f in dataclasses.fields(ModelConfig)]}") from None
        out["ref"] = out["actor"]
        return out

    def model_paths(self) -> dict[str, str | None]:
        return {"actor": self.actor_path, "ref": self.actor_path, "critic": self.critic_path,
                "reward": self.reward_path}

    def execution_plan(self) -> ExecutionPlan:
        data = self.plan
        if set(data) == {"path"}:
            return ExecutionPlan.from_json(data["path"])
        return ExecutionPlan.from_json(data)

    def graph(self) -> Graph:
        return Graph(ALGORITHMS[self.algo])


PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

_SECTIONS = {"data": DataConfig, "generation": GenConfig, "ppo": PPOConfig, "reward": RewardConfig}


def _build(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise ValueError(f"config {where}: expected a mapping, got {type(d).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ValueError(f"config {where}: unknown keys {unknown}; allowed: {allowed}")
    kw = {k: (_build(_SECTIONS[k], v, k) if k in _SECTIONS and cls is TrainConfig else v)
          for k, v in d.items()}
    return cls(**kw)


def from_dict(d: dict | None) -> TrainConfig:
    cfg = _build(TrainConfig, d or {}, "top level")
    _check_values(cfg)
    return cfg


def load(path: str | None) -> TrainConfig:
    if path is None:
        return from_dict({})
    import yaml

    with open(path) as f:
        return from_dict(yaml.safe_load(f) or {})


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def _check_values(cfg: TrainConfig) -> None:
    if cfg.algo not in ALGORITHMS:
        raise ValueError(f"config algo={cfg.algo!r}; allowed: {sorted(ALGORITHMS)}")
    for name in ("verify_realloc", "offload_frozen", "allow_idle_ranks"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"config {name}={getattr(cfg, name)!r} must be true or false")
    for name, v, allowed in (("device", cfg.device, ("auto", "cpu", "cuda")),
                             ("precision", cfg.precision, tuple(PRECISION_DTYPES)),
                             ("generation.decode", cfg.generation.decode, ("auto", "dynamic", "static", "graph"))):
        if v not in allowed:
            raise ValueError(f"config {name}={v!r}; allowed: {list(allowed)}")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("config device='cuda' but torch sees no GPU here (CPU-only torch, no "
                             "driver or CUDA_VISIBLE_DEVICES empty); use device: cpu or auto")
    if cfg.reward.kind not in ("model", "rule"):
        raise ValueError(f"config reward.kind={cfg.reward.kind!r}; allowed: 'model', 'rule'")
    d = cfg.data
    if not 1 <= d.min_prompt_len <= d.max_prompt_len:
        raise ValueError(f"config data: need 1 <= min_prompt_len <= max_prompt_len, got "
                         f"{d.min_prompt_len}, {d.max_prompt_len}")
    for name, v in (("steps", cfg.steps), ("data.batch_size", d.batch_size),
                    ("data.num_prompts", d.num_prompts), ("ppo.ppo_epochs", cfg.ppo.ppo_epochs),
                    ("ppo.mini_batches", cfg.ppo.mini_batches), ("ppo.micro_batches", cfg.ppo.micro_batches),
                    ("generation.max_new_tokens", cfg.generation.max_new_tokens)):
        if v < 1:
            raise ValueError(f"config {name}={v} must be >= 1")
    cfg.model_configs()


def validate(cfg: TrainConfig, world_size: int) -> tuple[ExecutionPlan, Graph, dict]:
    """Check the plan against the graph, the world and the models; returns (plan, graph, models)."""
    plan, graph, models = cfg.execution_plan(), cfg.graph(), cfg.model_configs()
    missing = [n for n in graph.order if n not in plan.calls]
    extra = [n for n in plan.calls if n not in graph.calls]
    if missing or extra:
        raise ValueError(f"execution plan does not match the {cfg.algo} graph: missing calls {missing}, "
                         f"unknown calls {extra}; the graph's calls are {list(graph.order)}")
    if plan.world_size != world_size:
        raise ValueError(f"execution plan is for world_size={plan.world_size}, but the job has "
                         f"{world_size} ranks")
    uncovered = plan.uncovered_ranks()
    if uncovered and not cfg.allow_idle_ranks:
        raise ValueError(f"execution plan leaves ranks {uncovered} of world {world_size} without a "
                         "call; give them a call, or set allow_idle_ranks: true to run it anyway")
    B = cfg.data.batch_size
    for n in graph.order:
        call, layout = graph.calls[n], plan.calls[n]
        spec = model_spec(models[call.model], name=call.model)
        try:
            check_fits(spec, layout)
        except ValueError as e:
            raise ValueError(f"call {n} ({call.model} on {layout}): {e}") from None
        if B % layout.dp:
            raise ValueError(f"call {n}: dp={layout.dp} does not divide data.batch_size={B}")
        local = B // layout.dp
        if call.trains:
            if local % cfg.ppo.mini_batches or local // cfg.ppo.mini_batches < cfg.ppo.micro_batches:
                raise ValueError(f"call {n}: the DP-local batch of {local} rows cannot be cut into "
                                 f"ppo.mini_batches={cfg.ppo.mini_batches} mini-batches of at least "
                                 f"ppo.micro_batches={cfg.ppo.micro_batches} rows")
            if call.kind == "train_grpo_actor" and (local // cfg.ppo.mini_batches) % cfg.ppo.group_size:
                raise ValueError(f"call {n}: ppo.group_size={cfg.ppo.group_size} must divide the "
                                 f"DP-local mini-batch of {local // cfg.ppo.mini_batches} rows")
    if cfg.algo == "grpo" and B % cfg.ppo.group_size:
        raise ValueError(f"ppo.group_size={cfg.ppo.group_size} does not divide data.batch_size={B}")
    total = cfg.data.max_prompt_len + cfg.generation.max_new_tokens
    for m in ("actor", "critic"):
        if total > models[m].max_position_embeddings:
            raise ValueError(f"max_prompt_len + max_new_tokens = {total} exceeds {m} "
                             f"max_position_embeddings={models[m].max_position_embeddings}")
    return plan, graph, models


def single_process_plan(graph: Graph) -> dict:
    """Every call on (dp1, tp1, pp1) of rank 0: the reference run of the distributed tests."""
    return {"world_size": 1, "calls": {n: {"ranks": [0], "dp": 1, "tp": 1, "pp": 1} for n in graph.order}}


__all__ = ["TrainConfig", "DataConfig", "GenConfig", "PPOConfig", "RewardConfig", "from_dict", "load",
           "to_dict", "validate", "single_process_plan", "DEFAULT_PLAN", "TINY"]
