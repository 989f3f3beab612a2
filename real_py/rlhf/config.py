"""Configuration of `python -m real_py train`: dataclasses, YAML loading, the embedded default.

Every section rejects unknown keys (ValueError naming the section, the key and the allowed
keys). Values are checked against the field annotations (`_coerce`: numeric strings become
numbers, anything else of the wrong type is refused naming the dotted key), then against the
allowed ranges (`_RANGES`). `validate(cfg, world_size)` checks the execution plan against the
graph, the world and the models before any work starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
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
    """Prompt tokens at most (the width of the prompt buffer); see truncate."""
    path: str | None = None
    """Prompt data set: a local .jsonl (one JSON object per line) or .parquet file; None: the
    synthetic prompts (num_prompts, min_prompt_len are used only then)."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt; the other fields go to a reward function as lists."""
    tokenizer_path: str | None = None
    """Local tokenizer directory (transformers AutoTokenizer); None: actor_path if it holds one."""
    chat_template: bool = False
    """Render each prompt (a string or a list of {role, content} messages) with the tokenizer's
    chat template and its generation prompt before tokenizing."""
    truncate: Literal["error", "left", "right"] = "error"
    """A prompt over max_prompt_len tokens: "error" (refuse the data set), "left" (keep its last
    max_prompt_len tokens), "right" (keep its first)."""
    shuffle: bool = True
    """Visit the data set in a seeded random order (else in file order); wraps around."""
    samples_per_step: int = 4
    """Samples (prompt, response, reward) appended per step to <out_dir>/samples.jsonl; 0: none."""


@dataclass(kw_only=True, slots=True)
class GenConfig:
    max_new_tokens: int = 12
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    eos_token_id: int | None = None
    decode: Literal["auto", "dynamic", "static", "graph"] = "auto"
    """KV cache and decode step (real_py/engines/decode.py): "auto" replays the decode step from a
    CUDA graph on CUDA with tp == 1 and uses the dynamic (growing) cache elsewhere; "static"
    (the graph's code run eagerly), "dynamic" or "graph" (CUDA with tp == 1 only) force one."""


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
    kl_in: Literal["loss", "reward"] | None = None
    """Where the KL to the reference (coefficient kl_coef, GRPO's beta) enters: "reward" (k1
    penalty -kl_coef * (log pi_old - log pi_ref) per token in the rewards, InstructGPT-style) or
    "loss" (kl_coef * the k3 estimator per token added to the policy loss, as GRPO is published).
    None: "loss" for grpo, "reward" for ppo."""
    entropy_coef: float = 0.0
    """Entropy bonus: the actor loss subtracts entropy_coef * mean response-token entropy; 0 disables."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    kind: Literal["model", "rule", "function"] = "model"
    """"model" (the reward model's value at the last token), "rule" (fraction of target_token) or
    "function" (a user callable, `path`)."""
    target_token: int = 7
    path: str | None = None
    """kind "function": "file.py:fn" or "package.module:fn", called as fn(prompts, responses,
    **row) -> list[float] with decoded texts and the data set's other fields (see rlhf/rewards.py)."""


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
    """ModelConfig fields of the actor (the reference shares it, and its initial weights unless
    ref_path is set); None: a tiny random-init model, or the config of actor_path."""
    critic: dict | None = None
    """ModelConfig fields of the critic and reward model (head is forced to "value")."""
    actor_path: str | None = None
    """HF checkpoint (LLaMA / Qwen2 safetensors) of the actor and reference; `actor` overrides
    its config fields. None: random init from `seed`."""
    critic_path: str | None = None
    """HF checkpoint of the critic (a ...ForSequenceClassification with num_labels=1)."""
    reward_path: str | None = None
    """HF checkpoint of the reward model; None: random init (or critic's shape)."""
    critic_init: Literal["checkpoint", "zero", "normal"] = "checkpoint"
    """Value head of critic_path: "checkpoint" reads its score.weight; "zero" / "normal" (N(0, 0.02),
    seeded) start a fresh head on the checkpoint's body, e.g. a causal-LM (SFT) checkpoint whose
    lm_head is dropped."""
    ref_path: str | None = None
    """HF checkpoint of the reference model; None: actor_path (or the actor's random init). Its
    vocab must cover the actor's (checked before ranks start)."""
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
    wandb: dict | None = None
    """Weights & Biases run options passed to `wandb.init` (e.g. {project: rlhf, name: run1}); None:
    no W&B (the package is not imported). TensorBoard events are always written to out_dir."""
    export: Literal["hf"] | None = None
    """"hf": at the end of the run write the trained actor (and critic) as HF checkpoints to
    <out_dir>/hf/actor and <out_dir>/hf/critic (see also `python -m real_py export`)."""
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
        if self.ref_path:
            try:
                out["ref"] = ModelConfig.from_hf(self.ref_path, **{**(self.actor or {}), "head": "lm",
                                                                  "dtype": dtype})
            except (TypeError, OSError) as e:
                raise ValueError(f"config ref ({self.ref_path}): {e}") from None
        return out

    def model_paths(self) -> dict[str, str | None]:
        return {"actor": self.actor_path, "ref": self.ref_path or self.actor_path, "critic": self.critic_path,
                "reward": self.reward_path}

    def execution_plan(self) -> ExecutionPlan:
        data = self.plan
        if set(data) == {"path"}:
            return ExecutionPlan.from_json(data["path"])
        return ExecutionPlan.from_json(data)

    def graph(self) -> Graph:
        return Graph(ALGORITHMS[self.algo])


def _describe(tp) -> str:
    """An annotation in words, for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            dict: "a mapping", list: "a list", type(None): "null"}.get(origin or tp, str(tp))


def _coerce(value, tp, key: str):
    """`value` as the annotation `tp` wants it, or ValueError naming the dotted `key`.

    Numbers given as strings are converted (PyYAML reads `1e-5` as a string): "8" -> 8 for an
    int, "1e-5" -> 1e-05 for a float; 2.0 is an int, 2.5 is not. Booleans are only true/false
    (the YAML loader below does not read yes/no/on/off as booleans, so those are refused here).
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _coerce(value, a, key)
                except ValueError:
                    pass
    elif origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ValueError(f"config {key}={value!r}; allowed: {', '.join(repr(a) for a in args)}")
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp in (int, float) and not isinstance(value, bool):
        x = value
        if isinstance(x, str):
            try:
                x = int(x.strip()) if tp is int else float(x)
            except ValueError:
                try:
                    x = float(x)
                except ValueError:
                    pass
        if isinstance(x, (int, float)) and not math.isnan(x):
            if tp is float:
                return float(x)
            if isinstance(x, int) or x.is_integer():
                return int(x)
    elif tp in (str, dict, list) or origin in (dict, list):
        if isinstance(value, origin or tp):
            return value
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value
    raise ValueError(f"config {key}={value!r}: expected {_describe(tp)}")


PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _build(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise ValueError(f"config {where}: expected a mapping, got {type(d).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ValueError(f"config {where}: unknown keys {unknown}; allowed: {allowed}")
    hints = typing.get_type_hints(cls)
    prefix = "" if cls is TrainConfig else where + "."
    kw = {}
    for k, v in d.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kw[k] = _build(tp, v, prefix + k)
        else:
            kw[k] = _coerce(v, tp, prefix + k)
    return cls(**kw)


def from_dict(d: dict | None) -> TrainConfig:
    cfg = _build(TrainConfig, d or {}, "top level")
    _check_values(cfg)
    return cfg


def _yaml_loader():
    """PyYAML's SafeLoader with YAML 1.2 booleans: only true/false (any case) are booleans, so
    `greedy: yes` stays the string 'yes' and is refused instead of silently meaning true."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    return Loader


def read_yaml(path: str | None) -> dict:
    """The raw mapping of a YAML config file ({} for None); ValueError naming the file otherwise."""
    if path is None:
        return {}
    import yaml

    try:
        with open(path) as f:
            d = yaml.load(f, Loader=_yaml_loader())
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if d is not None and not isinstance(d, dict):
        raise ValueError(f"config file {path}: expected a mapping of keys, got {type(d).__name__}")
    return d or {}


def apply_overrides(d: dict, overrides) -> dict:
    """A copy of `d` with `key.sub=value` strings applied (values read as YAML, like the file).

    `plan.path=x.json` replaces the whole plan mapping (a plan file stands for the plan). Unknown
    keys are left in for `_build` to refuse like unknown YAML keys.
    """
    import copy

    import yaml

    d = copy.deepcopy(d)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"override {item!r}: expected KEY=VALUE with a dotted KEY, e.g. ppo.actor_lr=1e-5")
        try:
            value = yaml.load(text, Loader=_yaml_loader()) if text.strip() else None
        except yaml.YAMLError:
            raise ValueError(f"override {item!r}: the value is not valid YAML") from None
        if parts == ["plan", "path"]:
            d["plan"] = {}
        elif len(parts) > 1 and parts[0] not in d:
            # plan.calls.ref_inf.tp=2 without a plan in the file edits the default plan.
            f = next((f for f in dataclasses.fields(TrainConfig) if f.name == parts[0]), None)
            if f is not None and f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
                if isinstance(default, dict):
                    d[parts[0]] = copy.deepcopy(default)
        node = d
        for i, p in enumerate(parts[:-1]):
            if not isinstance(node.get(p), dict):
                if node.get(p) is not None:
                    raise ValueError(f"override {item!r}: {'.'.join(parts[:i + 1])} is not a mapping")
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    return d


def load(path: str | None, overrides=()) -> TrainConfig:
    """The config of a YAML file (None: the embedded default) with KEY=VALUE overrides applied."""
    return from_dict(apply_overrides(read_yaml(path), overrides))


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


_RANGES = (
    # (dotted key, test, allowed range in words); types are already checked.
    ("save_every", lambda v: v >= 0, ">= 0 (0: no checkpoints)"),
    ("ppo.clip", lambda v: v > 0, "> 0"),
    ("ppo.value_clip", lambda v: v > 0, "> 0"),
    ("ppo.gamma", lambda v: 0 <= v <= 1, "[0, 1]"),
    ("ppo.lam", lambda v: 0 <= v <= 1, "[0, 1]"),
    ("ppo.kl_coef", lambda v: v >= 0, ">= 0"),
    ("ppo.actor_lr", lambda v: v > 0, "> 0"),
    ("ppo.critic_lr", lambda v: v > 0, "> 0"),
    ("ppo.max_grad_norm", lambda v: v > 0, "> 0"),
    ("ppo.adam_eps", lambda v: v > 0, "> 0"),
    ("ppo.group_size", lambda v: v >= 1, ">= 1"),
    ("generation.temperature", lambda v: v > 0, "> 0"),
    ("generation.top_p", lambda v: 0 < v <= 1, "(0, 1]"),
    ("data.samples_per_step", lambda v: v >= 0, ">= 0"),
    *((k, lambda v: v >= 1, ">= 1") for k in (
        "steps", "data.batch_size", "data.num_prompts", "ppo.ppo_epochs", "ppo.mini_batches",
        "ppo.micro_batches", "generation.max_new_tokens")),
)


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_values(cfg: TrainConfig) -> None:
    for key, ok, allowed in _RANGES:
        v = _get(cfg, key)
        if not ok(v):
            raise ValueError(f"config {key}={v!r} is out of range; allowed: {allowed}")
    for key, path in (("actor_path", cfg.actor_path), ("critic_path", cfg.critic_path),
                      ("reward_path", cfg.reward_path), ("ref_path", cfg.ref_path)):
        if path and not os.path.exists(path):
            raise ValueError(f"config {key}={path!r}: no such local file or directory; only local HF "
                             "checkpoint directories are read (nothing is downloaded from the Hub: "
                             "download it first, e.g. huggingface-cli download, and give its directory)")
    if cfg.wandb is not None:
        from .observe import wandb_available

        if not wandb_available():
            raise ValueError("config wandb is set but the wandb package is not installed; pip install "
                             "wandb, or remove the wandb key")
    model_hints = typing.get_type_hints(ModelConfig)
    for name in ("actor", "critic"):
        d = getattr(cfg, name)
        if d:
            # Known ModelConfig fields get the same typing as the sections; unknown ones are
            # refused by model_configs() with the list of fields.
            setattr(cfg, name, {k: _coerce(v, model_hints[k], f"{name}.{k}") if k in model_hints else v
                                for k, v in d.items()})
    if cfg.algo not in ALGORITHMS:
        raise ValueError(f"config algo={cfg.algo!r}; allowed: {sorted(ALGORITHMS)}")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("config device='cuda' but torch sees no GPU here (CPU-only torch, no "
                             "driver or CUDA_VISIBLE_DEVICES empty); use device: cpu or auto")
    d = cfg.data
    if not 1 <= d.min_prompt_len <= d.max_prompt_len:
        raise ValueError(f"config data: need 1 <= min_prompt_len <= max_prompt_len, got "
                         f"{d.min_prompt_len}, {d.max_prompt_len}")
    models = cfg.model_configs()
    vocab = models["actor"].vocab_size
    for key, v, used in (("generation.eos_token_id", cfg.generation.eos_token_id, True),
                         ("reward.target_token", cfg.reward.target_token, cfg.reward.kind == "rule")):
        if used and v is not None and not 0 <= v < vocab:
            raise ValueError(f"config {key}={v} is outside the actor vocabulary; allowed: 0 .. {vocab - 1} "
                             f"(vocab_size={vocab})")
    if cfg.critic_init != "checkpoint" and not cfg.critic_path:
        raise ValueError(f"config critic_init={cfg.critic_init!r} needs critic_path (the checkpoint whose "
                         "body the fresh value head sits on)")
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
            _check_same_tokenizer(paths["actor"], paths[m], m)
        if models[m].vocab_size < V:
            src = f"{paths[m]}" if paths.get(m) else "random init (section `critic`)" if m != "ref" else "actor"
            raise ValueError(f"config: {m} has vocab_size={models[m].vocab_size} ({src}) but the actor "
                             f"({paths['actor'] or 'random init'}) emits ids up to {V - 1}; give {m} a "
                             f"checkpoint / `critic: {{vocab_size: {V}}}` covering the actor's vocab")


def _tokenizer_vocab(path: str):
    """token -> id of a checkpoint's tokenizer.json (vocab and added tokens), or None without one."""
    f = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(f):
        return None
    try:
        with open(f) as fh:
            d = json.load(fh)
        vocab = dict(d.get("model", {}).get("vocab") or {})
        vocab.update({t["content"]: t["id"] for t in d.get("added_tokens") or ()})
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{f}: not a tokenizers JSON file ({e})") from None
    return vocab


def _check_same_tokenizer(actor_path: str, path: str, model: str) -> None:
    a, b = _tokenizer_vocab(actor_path), _tokenizer_vocab(path)
    if a is None or b is None or a == b:
        return
    diff = sorted(t for t in a.keys() | b.keys() if a.get(t) != b.get(t))
    raise ValueError(f"config: {model} ({path}) and the actor ({actor_path}) have different tokenizers: "
                     f"{len(diff)} tokens map to other ids, e.g. {diff[:3]}; {model} would read the "
                     "actor's token ids as other tokens")


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
    _check_data_and_reward(cfg, models)
    return plan, graph, models


def _check_data_and_reward(cfg: TrainConfig, models: dict) -> None:
    """Load the prompt data set, tokenizer and reward function once, so that any error in them
    shows before ranks start (every rank loads them again, cached per process)."""
    from . import data as D
    from .rewards import FunctionReward, check_call

    data = D.load(cfg, models["actor"].vocab_size)
    if cfg.reward.kind == "function":
        fr = FunctionReward(cfg.reward.path)
        if data is not None:
            check_call(fr, data)
        if D.tokenizer(cfg, data) is None:
            raise ValueError("config reward.kind=function needs a tokenizer to decode responses: set "
                             "data.tokenizer_path (or data.path with a tokenizer)")


def single_process_plan(graph: Graph) -> dict:
    """Every call on (dp1, tp1, pp1) of rank 0: the reference run of the distributed tests."""
    return {"world_size": 1, "calls": {n: {"ranks": [0], "dp": 1, "tp": 1, "pp": 1} for n in graph.order}}


__all__ = ["TrainConfig", "DataConfig", "GenConfig", "PPOConfig", "RewardConfig", "from_dict", "load",
           "to_dict", "validate", "single_process_plan", "DEFAULT_PLAN", "TINY"]
