"""Model configuration: `ModelConfig` (a LLaMA / Qwen2 / Mistral-style decoder's shape and the
fields that change its computation), dtypes, storage-format names and presets.

`ModelConfig.from_hf` reads an HF config.json through real_py.spec.hf_config, which checks the
architecture and every computation-changing field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

from .hf_config import _HIDDEN_ACTS, config_kwargs

QKV_LAYOUTS = ("blocked", "megatron_grouped")
GATE_UP_LAYOUTS = ("blocked", "interleaved")

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
}


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


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
    """HF model_type it came from and exports to: "llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2" or "gemma3_text"."""
    rope_scaling: dict | tuple | None = None
    """HF rope_scaling as sorted (key, value) pairs (a dict is accepted and frozen); rope_type one
    of "linear", "dynamic", "yarn", "llama3" (transformers' formulas); None: plain RoPE."""
    sliding_window: int = 0
    """Attention window in tokens (query q sees keys q - window < k <= q); 0: full attention."""
    window_layers: tuple[int, ...] | None = None
    """Layers that use the sliding window; None: every layer (Mistral). Qwen2: its layer_types."""
    o_proj_bias: bool = False
    """Bias on o_proj ([H], replicated; added after the TP all-reduce): LLaMA / Qwen3 attention_bias."""
    mlp_bias: bool = False
    """LLaMA mlp_bias: biases on gate|up (split like the weight) and down_proj ([H], replicated)."""
    hidden_act: str = "silu"
    """Gate activation of the gated MLP, one of HIDDEN_ACTS (transformers' ACT2FN names)."""
    norm_after: bool = False
    """OLMo 2: RMSNorm on the attention and MLP outputs before each residual add
    (post_attention_layernorm, post_feedforward_layernorm) instead of on their inputs."""
    qk_norm_whole: bool = False
    """OLMo 2: the q/k norms run over the whole projection (weights [nh*hd], [nkv*hd], split by
    heads under TP; the RMS sums squares over the TP group), not per head. Needs qk_norm."""
    qk_norm: bool = False
    """Qwen3: RMSNorm over each head's dim of q and k (weights [head_dim], replicated), after the
    projection and before RoPE."""
    norm_plus_one: bool = False
    """Gemma: every RMSNorm scales by (1 + w) in fp32 and the embedding output is multiplied by
    sqrt(hidden_size) (rounded to the embedding dtype, as transformers does)."""
    sandwich_norm: bool = False
    """Gemma 2/3: post_attention_layernorm on the attention output, pre_feedforward_layernorm on the
    MLP input and post_feedforward_layernorm on its output (all replicated [H])."""
    attn_logit_softcapping: float = 0.0
    """Gemma 2: attention scores become cap * tanh(scores / cap) before the mask; 0: off."""
    final_logit_softcapping: float = 0.0
    """Gemma 2/3: lm logits become cap * tanh(logits / cap); 0: off."""
    query_pre_attn_scalar: float = 0.0
    """Gemma: attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5; 0: head_dim."""
    original_max_position_embeddings: int = 0
    """longrope only: the pre-training length (transformers reads the top-level config field, Phi-3's
    default 4096); it sets factor = max_position_embeddings / it and the short/long switch. 0: unset."""
    rope_local_base_freq: float = 0.0
    """Gemma 3: the sliding-window layers (window_layers) use plain RoPE with this base; rope_theta
    and rope_scaling apply to the global layers only. 0: every layer uses rope_theta/rope_scaling."""
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
        (real_py.spec.hf_config): unsupported ones raise ValueError naming the field."""
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
               "vocab_size", "num_hidden_layers", "max_position_embeddings", "head_dim", "sliding_window",
               "original_max_position_embeddings")
ROPE_SCALING_KEYS = {
    # rope_type: (required keys, optional keys), as transformers 4.57 validates them
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "llama3": ({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}, set()),
    # longrope: factor optional (original_max_position_embeddings overrides it); the rope_scaling
    # key original_max_position_embeddings is accepted but, as in transformers, not read
    "longrope": ({"short_factor", "long_factor"}, {"attention_factor", "factor", "original_max_position_embeddings"}),
    "yarn": ({"factor"}, {"attention_factor", "beta_fast", "beta_slow", "original_max_position_embeddings",
                          "mscale", "mscale_all_dim", "truncate"}),
}
# transformers ACT2FN names whose torch function real_py uses identically (gelu_new / gelu_fast are
# hand-written tanh formulas in transformers whose rounding differs; refused).
HIDDEN_ACTS = _HIDDEN_ACTS
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma2", "gemma3_text")


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
    if c.hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"ModelConfig.hidden_act={c.hidden_act!r}; allowed: {list(HIDDEN_ACTS)}")
    for f in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "rope_local_base_freq"):
        v = getattr(c, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"ModelConfig.{f}={v!r} must be a number >= 0 (0: off)")
    for f in ("tie_word_embeddings", "attention_bias", "qk_norm", "o_proj_bias", "mlp_bias", "norm_after",
              "qk_norm_whole", "norm_plus_one", "sandwich_norm"):
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
            if kind == "longrope":
                _check_longrope(c, rs)
            elif not isinstance(rs["factor"], (int, float)) or rs["factor"] <= 0:
                raise ValueError(f"rope_scaling factor={rs['factor']!r} must be a positive number")
        # lists (longrope factors) frozen to tuples: the config stays hashable
        object.__setattr__(c, "rope_scaling", tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                           for k, v in rs.items())) if rs else None)
    if c.sliding_window < 0:
        raise ValueError(f"ModelConfig.sliding_window={c.sliding_window} must be >= 0 (0: full attention)")
    if c.window_layers is not None:
        layers = tuple(c.window_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < c.num_hidden_layers
               for i in layers):
            raise ValueError(f"ModelConfig.window_layers={c.window_layers!r} must list layer indices in "
                             f"[0, {c.num_hidden_layers})")
        object.__setattr__(c, "window_layers", layers)


def _check_longrope(c: ModelConfig, rs: dict) -> None:
    for k in ("short_factor", "long_factor"):
        v = rs[k]
        if (not isinstance(v, (list, tuple)) or len(v) != c.head_dim // 2
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v)):
            raise ValueError(f"rope_scaling (longrope) {k} must be {c.head_dim // 2} numbers (head_dim / 2), got {v!r}")
    if not c.original_max_position_embeddings and not isinstance(rs.get("factor"), (int, float)):
        raise ValueError("rope_scaling (longrope) needs factor or the config's original_max_position_embeddings")


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
    # Shapes only (planning, simulation); rope_scaling of the released model is not set here.
    "llama3.1-405b": ModelConfig(hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                                 num_key_value_heads=8, vocab_size=128256, num_hidden_layers=126,
                                 rope_theta=500000.0),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}")
    from dataclasses import replace

    return replace(PRESETS[name], **overrides)
