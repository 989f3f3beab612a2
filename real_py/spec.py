"""Model description: parameter names, global shapes, dtypes, owners and TP partition rules.

A `ModelSpec` is the single source of truth shared by the planner (which bytes live where),
the shard buffers (flat-buffer offsets) and the models (parameter names and shapes).

TP partition rules (`TPRule`), for a parameter viewed as [A, D, B] around its split dim:
  replicated  every TP rank holds the whole tensor.
  split       dim `dim` is cut into `blocks` (fused tensors: q|k|v, gate|up); each block is
              split evenly across TP ranks; a rank's local tensor is its piece of every block,
              concatenated in block order.
  vocab       dim `dim` is padded up to a multiple of vocab_multiple * tp and split evenly;
              padding rows are zero and never transferred.

Storage formats (how a rank's local tensor orders its rows; the two sides of a reallocation may
differ, the planner converts exactly). Full tensors are always in the blocked order, q|k|v and
gate|up concatenated as HF concatenates them:
  groups=0    blocked: a TP rank's local tensor is its piece of every block, in block order.
  groups=G    interleaved: the blocks are cut into G groups, group j holding the j-th 1/G of every
              block in block order; a TP rank holds G/tp consecutive groups. Megatron-core's fused
              linear_qkv is G = num_key_value_heads ([q heads of group 0, k0, v0, q of group 1, ...]).
  Megatron-core's linear_fc1 (swiglu) holds [gate piece; up piece] per TP rank: that is blocked.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Literal

QKV_LAYOUTS = ("blocked", "megatron_grouped")
GATE_UP_LAYOUTS = ("blocked", "interleaved")
ALIGN_BYTES = 64  # every parameter starts on a 64-byte boundary of its shard's flat buffer

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


@dataclass(frozen=True, slots=True, kw_only=True)
class TPRule:
    kind: str = "replicated"
    """One of "replicated", "split", "vocab"."""
    dim: int = 0
    """Tensor dim that is split (ignored for replicated)."""
    blocks: tuple[int, ...] = ()
    """Sizes of the fused blocks along `dim` (sum == shape[dim]); () means one block."""
    units: tuple[tuple[str, int], ...] = ()
    """Per block, (config name, count) that tp must divide, e.g. ("num_key_value_heads", 8)."""
    groups: int = 0
    """split: 0 = blocked storage; G > 0 = blocks interleaved in G groups (module docstring)."""
    vocab_multiple: int = 1
    """vocab: rows padded to a multiple of vocab_multiple * tp (Megatron-core: 128)."""

    def __post_init__(self):
        if self.kind not in ("replicated", "split", "vocab"):
            raise ValueError(f"TPRule.kind={self.kind!r}; allowed: 'replicated', 'split', 'vocab'")
        if self.groups < 0 or (self.groups and self.kind != "split"):
            raise ValueError(f"TPRule.groups={self.groups} must be >= 0 and only set on a split rule")
        if self.vocab_multiple < 1 or (self.vocab_multiple > 1 and self.kind != "vocab"):
            raise ValueError(f"TPRule.vocab_multiple={self.vocab_multiple} must be >= 1 and only "
                             "set on a vocab rule")
        if self.units and len(self.units) != len(self.blocks):
            raise ValueError(f"TPRule.units has {len(self.units)} entries for {len(self.blocks)} blocks")


REPLICATED = TPRule()


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    owner: str
    """"embed", "layer", "final_norm" or "head"."""
    layer: int = -1
    """Layer index for owner == "layer"."""
    tp: TPRule = REPLICATED
    tied_to_head: bool = False
    """Tied input embedding: the head's pipeline stage holds a copy too."""

    def __post_init__(self):
        if self.owner not in ("embed", "layer", "final_norm", "head"):
            raise ValueError(f"{self.name}: owner={self.owner!r}; allowed: embed, layer, final_norm, head")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{self.name}: dtype={self.dtype!r}; allowed: {sorted(DTYPE_SIZES)}")
        if any(s <= 0 for s in self.shape):
            raise ValueError(f"{self.name}: shape {self.shape} has a non-positive dim")
        if self.tp.kind != "replicated":
            if not 0 <= self.tp.dim < len(self.shape):
                raise ValueError(f"{self.name}: split dim {self.tp.dim} out of range for shape {self.shape}")
            if self.tp.blocks and sum(self.tp.blocks) != self.shape[self.tp.dim]:
                raise ValueError(
                    f"{self.name}: blocks {self.tp.blocks} sum to {sum(self.tp.blocks)}, "
                    f"not shape[{self.tp.dim}]={self.shape[self.tp.dim]}")
            if self.tp.groups and any(b % self.tp.groups for b in self.blocks):
                raise ValueError(f"{self.name}: groups={self.tp.groups} does not divide every "
                                 f"block of {self.blocks}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.tp.blocks or (self.shape[self.tp.dim],)

    def geometry(self) -> tuple[int, int, int]:
        """(A, D, B): the tensor viewed as [A, D, B] around its split dim (D = numel if replicated)."""
        if self.tp.kind == "replicated":
            return 1, self.numel, 1
        d = self.tp.dim
        return math.prod(self.shape[:d]), self.shape[d], math.prod(self.shape[d + 1:])

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one TP rank's piece (identical on every TP rank; vocab includes padding)."""
        if self.tp.kind == "replicated":
            return self.shape
        d, size = self.tp.dim, self.shape[self.tp.dim]
        m = self.tp.vocab_multiple
        local = -(-size // (m * tp)) * m if self.tp.kind == "vocab" else size // tp
        return self.shape[:d] + (local,) + self.shape[d + 1:]

    def tp_error(self, tp: int) -> str | None:
        """Why `tp` cannot split this parameter, or None."""
        if self.tp.kind != "split":
            return None
        units = self.tp.units or tuple((f"{self.name}.shape[{self.tp.dim}]", b) for b in self.blocks)
        for (unit, count), block in zip(units, self.blocks):
            if count % tp or block % tp:
                return f"tp={tp} does not divide {unit}={count}"
        if self.tp.groups % tp:
            return f"tp={tp} does not divide the {self.tp.groups} interleaved groups"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """LLaMA / Qwen2 / Mistral-style decoder shape."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_hidden_layers: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Qwen2-style bias on q, k, v."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    head: str = "lm"
    """"lm" (actor, reference) or "value" (critic, reward: a scalar per token)."""
    dtype: str = "float32"
    head_dim: int = 0
    """Per-head dim; 0 means hidden_size // num_attention_heads."""
    qkv_layout: Literal["blocked", "megatron_grouped"] = "blocked"
    """Row order of a TP rank's fused q|k|v: "blocked" ([q; k; v], this project's models) or
    "megatron_grouped" (Megatron-core linear_qkv: per kv group, its q heads then k then v)."""
    gate_up_layout: Literal["blocked", "interleaved"] = "blocked"
    """Row order of a TP rank's fused gate|up: "blocked" ([gate; up], also Megatron-core's
    swiglu linear_fc1) or "interleaved" (gate row 0, up row 0, gate row 1, ...)."""
    vocab_pad_multiple: int = 1
    """Vocab rows padded to a multiple of this times tp (Megatron-core: 128); padding rows are
    zero on a destination and never transferred."""
    model_type: str = "llama"
    """HF model_type it came from and exports to: "llama", "mistral" or "qwen2"."""
    rope_scaling: dict | tuple | None = None
    """HF rope_scaling as sorted (key, value) pairs (a dict is accepted and frozen); rope_type one
    of "linear", "dynamic", "yarn", "llama3" (transformers' formulas); None: plain RoPE."""
    sliding_window: int = 0
    """Attention window in tokens (query q sees keys q - window < k <= q); 0: full attention."""
    window_layers: tuple[int, ...] | None = None
    """Layers that use the sliding window; None: every layer (Mistral). Qwen2: its layer_types."""
    pad_token_id: int | None = None
    """Kept for export: a value model's ...ForSequenceClassification needs it for batches > 1."""

    def uses_window(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return bool(self.sliding_window) and (self.window_layers is None or layer in self.window_layers)

    @property
    def position_limit(self) -> int:
        """Longest sequence the model accepts: max_position_embeddings, times the factor for
        dynamic RoPE scaling (which exists to run past it)."""
        rs = dict(self.rope_scaling or ())
        if rs.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * rs["factor"])
        return self.max_position_embeddings

    def __post_init__(self):
        _check_config_types(self)
        for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "vocab_size", "num_hidden_layers"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelConfig.{f}={getattr(self, f)} must be positive")
        if self.head not in ("lm", "value"):
            raise ValueError(f"ModelConfig.head={self.head!r}; allowed: 'lm', 'value'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                                 f"num_attention_heads={self.num_attention_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"ModelConfig.dtype={self.dtype!r}; allowed: {sorted(DTYPE_SIZES)}")
        for f, allowed in (("qkv_layout", QKV_LAYOUTS), ("gate_up_layout", GATE_UP_LAYOUTS)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"ModelConfig.{f}={getattr(self, f)!r}; allowed: {allowed}")
        if not isinstance(self.vocab_pad_multiple, int) or self.vocab_pad_multiple < 1:
            raise ValueError(f"ModelConfig.vocab_pad_multiple={self.vocab_pad_multiple!r} must be "
                             "a positive int (Megatron-core: 128)")
        _check_attention_fields(self)

    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike, **overrides) -> "ModelConfig":
        """From an HF config dict, a config.json path, or a checkpoint directory.

        Checks model_type / architectures and every field that changes the computation
        (real_py.hf_config): unsupported ones raise ValueError naming the field."""
        from .hf_config import config_kwargs

        where = "config"
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            where = path
            with open(path) as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: not valid JSON ({e})") from None
        kwargs = config_kwargs(config, where)
        hf_dtype = config.get("torch_dtype") or config.get("dtype")  # transformers >= 4.56: "dtype"
        if hf_dtype is not None:
            hf_dtype = str(hf_dtype).removeprefix("torch.")
            if hf_dtype not in DTYPE_SIZES:
                raise ValueError(f"HF config torch_dtype={hf_dtype!r}; allowed: {sorted(DTYPE_SIZES)} "
                                 "(or pass dtype=... to from_hf)")
            kwargs["dtype"] = hf_dtype
        kwargs.update(overrides)
        return cls(**kwargs)


_INT_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "num_hidden_layers", "max_position_embeddings", "head_dim", "sliding_window")
ROPE_SCALING_KEYS = {
    # rope_type: (required keys, optional keys), as transformers 4.57 validates them
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "llama3": ({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}, set()),
    "yarn": ({"factor"}, {"attention_factor", "beta_fast", "beta_slow", "original_max_position_embeddings",
                          "mscale", "mscale_all_dim", "truncate"}),
}
MODEL_TYPES = ("llama", "mistral", "qwen2")


def _check_config_types(c: ModelConfig) -> None:
    """ValueError naming the field for a value of the wrong type (before any arithmetic on it)."""
    for f in _INT_FIELDS:
        v = getattr(c, f)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"ModelConfig.{f}={v!r} must be an int")
    for f in ("rms_norm_eps", "rope_theta"):
        v = getattr(c, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"ModelConfig.{f}={v!r} must be a number")
    for f in ("tie_word_embeddings", "attention_bias"):
        if not isinstance(getattr(c, f), bool):
            raise ValueError(f"ModelConfig.{f}={getattr(c, f)!r} must be true or false")


def _check_attention_fields(c: ModelConfig) -> None:
    """model_type, rope_scaling (frozen to sorted pairs), sliding_window, window_layers."""
    if c.model_type not in MODEL_TYPES:
        raise ValueError(f"ModelConfig.model_type={c.model_type!r}; allowed: {list(MODEL_TYPES)}")
    rs = c.rope_scaling
    if rs is not None:
        rs = dict(rs)
        if "type" in rs:  # transformers' backward-compatible spelling
            rs.setdefault("rope_type", rs.pop("type"))
        kind = rs.get("rope_type")
        if kind == "default":
            rs = None
        elif kind not in ROPE_SCALING_KEYS:
            raise ValueError(f"rope_scaling rope_type={kind!r} is not supported; supported: "
                             f"{sorted(ROPE_SCALING_KEYS)}")
        else:
            required, optional = ROPE_SCALING_KEYS[kind]
            missing, unknown = required - rs.keys(), rs.keys() - required - optional - {"rope_type"}
            if missing or unknown:
                raise ValueError(f"rope_scaling ({kind}): missing keys {sorted(missing)}, unknown keys "
                                 f"{sorted(unknown)}; allowed: {sorted(required | optional)}")
            if not isinstance(rs["factor"], (int, float)) or rs["factor"] <= 0:
                raise ValueError(f"rope_scaling factor={rs['factor']!r} must be a positive number")
        object.__setattr__(c, "rope_scaling", tuple(sorted(rs.items())) if rs else None)
    if c.sliding_window < 0:
        raise ValueError(f"ModelConfig.sliding_window={c.sliding_window} must be >= 0 (0: full attention)")
    if c.window_layers is not None:
        layers = tuple(c.window_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < c.num_hidden_layers
               for i in layers):
            raise ValueError(f"ModelConfig.window_layers={c.window_layers!r} must list layer indices in "
                             f"[0, {c.num_hidden_layers})")
        object.__setattr__(c, "window_layers", layers)


PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                             num_key_value_heads=32, vocab_size=32000, num_hidden_layers=32),
    "llama2-13b": ModelConfig(hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                              num_key_value_heads=40, vocab_size=32000, num_hidden_layers=40),
    "codellama-34b": ModelConfig(hidden_size=8192, intermediate_size=22016, num_attention_heads=64,
                                 num_key_value_heads=8, vocab_size=32000, num_hidden_layers=48,
                                 rope_theta=1e6),
    "llama2-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                              num_key_value_heads=8, vocab_size=32000, num_hidden_layers=80),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}")
    from dataclasses import replace

    return replace(PRESETS[name], **overrides)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    name: str
    params: tuple[ParamSpec, ...]
    """In forward key order: embedding, layers in order, final norm, head."""
    num_layers: int
    config: ModelConfig | None = field(default=None, compare=False)
    """The config it was built from (None for hand-built specs); not part of equality."""
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # Specs key every plan/layout cache; hashing 700+ params per lookup dominated planning.
        return self._hash

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.name, self.params, self.num_layers)))
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"ModelSpec {self.name}: duplicate parameter names {dup[:5]}")
        for p in self.params:
            if p.owner == "layer" and not 0 <= p.layer < self.num_layers:
                raise ValueError(f"{p.name}: layer={p.layer} outside [0, {self.num_layers})")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ModelSpec {self.name}: mixed dtypes {sorted(dtypes)}; a shard's flat "
                             "buffer holds one dtype, so cast the model to one dtype first")

    @property
    def dtype(self) -> str:
        return self.params[0].dtype

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def tp_choices(self, limit: int = 1024) -> list[int]:
        """Every tp in [1, limit] that splits all parameters."""
        return [t for t in range(1, limit + 1) if all(p.tp_error(t) is None for p in self.params)]

    def check_tp(self, tp: int) -> None:
        """Raise ValueError naming the first parameter that tp cannot split."""
        for p in self.params:
            why = p.tp_error(tp)
            if why:
                name = p.name if p.owner != "layer" else p.name.replace(f"layers.{p.layer}.", "layers.*.", 1)
                choices = [t for t in self.tp_choices(limit=max(64, tp)) if t <= max(64, tp)]
                raise ValueError(f"{why} of {name}; pick tp in {{{', '.join(map(str, choices))}}}")

    def check_compatible(self, other: "ModelSpec", *, storage: bool = False) -> None:
        """Raise ValueError if `other` disagrees on a parameter's name set, shape, dtype or rule.

        storage: let the two differ in storage format (TPRule.groups, vocab_multiple), which a
        reallocation plan converts between.
        """
        mine, theirs = {p.name: p for p in self.params}, {p.name: p for p in other.params}
        if mine.keys() != theirs.keys():
            only_a, only_b = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
            raise ValueError(f"model specs disagree on parameter names: only in src {only_a[:5]}, "
                             f"only in dst {only_b[:5]}")
        for name, a in mine.items():
            b = theirs[name]
            for attr in ("shape", "dtype", "tp", "owner", "layer", "tied_to_head"):
                if storage and attr == "tp" and _logical(a.tp) == _logical(b.tp):
                    continue
                if getattr(a, attr) != getattr(b, attr):
                    raise ValueError(f"model specs disagree on {name}.{attr}: src {getattr(a, attr)} "
                                     f"vs dst {getattr(b, attr)}")


def _logical(rule: TPRule) -> TPRule:
    """The rule without its storage format (what full tensors and the TP split depend on)."""
    from dataclasses import replace

    return replace(rule, groups=0, vocab_multiple=1)


def model_spec(config: ModelConfig | str, name: str | None = None) -> ModelSpec:
    """Build the fused-parameter spec of a LLaMA-style decoder.

    Parameters (H hidden, I intermediate, nh/nkv heads, hd head dim, V vocab):
      embed_tokens.weight                   [V, H]            vocab split dim 0
      layers.i.input_layernorm.weight       [H]               replicated
      layers.i.self_attn.qkv_proj.weight    [(nh+2nkv)hd, H]  split dim 0, blocks q|k|v
      layers.i.self_attn.qkv_proj.bias      [(nh+2nkv)hd]     (attention_bias only)
      layers.i.self_attn.o_proj.weight      [H, nh*hd]        split dim 1
      layers.i.post_attention_layernorm.w.  [H]               replicated
      layers.i.mlp.gate_up_proj.weight      [2I, H]           split dim 0, blocks gate|up
      layers.i.mlp.down_proj.weight         [H, I]            split dim 1
      norm.weight                           [H]               replicated
      lm_head.weight                        [V, H]            vocab split (untied lm head)
      value_head.weight                     [1, H]            replicated (value head)

    config.qkv_layout / gate_up_layout / vocab_pad_multiple set the storage format (TPRule.groups,
    vocab_multiple) of qkv_proj, gate_up_proj and the vocab-split tensors.
    """
    if isinstance(config, str):
        name = name or config
        config = preset(config)
    c, dt = config, config.dtype
    H, I, hd, nh, nkv, V = (c.hidden_size, c.intermediate_size, c.head_dim, c.num_attention_heads,
                            c.num_key_value_heads, c.vocab_size)
    heads = (("num_attention_heads", nh), ("num_key_value_heads", nkv), ("num_key_value_heads", nkv))
    qkv = TPRule(kind="split", dim=0, blocks=(nh * hd, nkv * hd, nkv * hd), units=heads,
                 groups=nkv if c.qkv_layout == "megatron_grouped" else 0)
    vocab = TPRule(kind="vocab", dim=0, vocab_multiple=c.vocab_pad_multiple)
    tied = c.tie_word_embeddings and c.head == "lm"
    params = [ParamSpec(name="embed_tokens.weight", shape=(V, H), dtype=dt, owner="embed",
                        tp=vocab, tied_to_head=tied)]
    for i in range(c.num_hidden_layers):
        pre = f"layers.{i}."
        lp = [
            (pre + "input_layernorm.weight", (H,), REPLICATED),
            (pre + "self_attn.qkv_proj.weight", ((nh + 2 * nkv) * hd, H), qkv),
        ]
        if c.attention_bias:
            lp.append((pre + "self_attn.qkv_proj.bias", ((nh + 2 * nkv) * hd,), qkv))
        lp += [
            (pre + "self_attn.o_proj.weight", (H, nh * hd),
             TPRule(kind="split", dim=1, blocks=(nh * hd,), units=(("num_attention_heads", nh),))),
            (pre + "post_attention_layernorm.weight", (H,), REPLICATED),
            (pre + "mlp.gate_up_proj.weight", (2 * I, H),
             TPRule(kind="split", dim=0, blocks=(I, I),
                    units=(("intermediate_size", I), ("intermediate_size", I)),
                    groups=I if c.gate_up_layout == "interleaved" else 0)),
            (pre + "mlp.down_proj.weight", (H, I),
             TPRule(kind="split", dim=1, blocks=(I,), units=(("intermediate_size", I),))),
        ]
        params += [ParamSpec(name=n, shape=s, dtype=dt, owner="layer", layer=i, tp=r) for n, s, r in lp]
    params.append(ParamSpec(name="norm.weight", shape=(H,), dtype=dt, owner="final_norm"))
    if c.head == "value":
        params.append(ParamSpec(name="value_head.weight", shape=(1, H), dtype=dt, owner="head"))
    elif not tied:
        params.append(ParamSpec(name="lm_head.weight", shape=(V, H), dtype=dt, owner="head",
                                tp=vocab))
    return ModelSpec(name=name or "model", params=tuple(params), num_layers=c.num_hidden_layers, config=c)
