"""Model configuration: `ModelConfig` (a LLaMA / Qwen2 / Mistral-style decoder's shape and the
fields that change its computation), dtypes, storage-format names and presets.

`ModelConfig.from_hf` reads an HF config.json through real_py.spec.hf_config, which checks the
architecture and every computation-changing field.

One file past 400 lines: ModelConfig's fields, the checks its __post_init__ runs on them (types,
attention, MoE, longrope, with their field tables) and PRESETS, built through those checks, are
together the one definition of a valid model config.
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
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
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
    kv_head_replicas: bool = False
    """vLLM: when tp exceeds num_key_value_heads each kv head is held by tp / nkv consecutive tp
    ranks (TPRule.replicate_units on qkv_proj; tp must then be a multiple of nkv). Storage only:
    blocked qkv_layout."""
    model_type: str = "llama"
    """HF model_type it came from and exports to: "llama", "mistral", "qwen2", "qwen3", "olmo2",
    "phi3", "gemma2" or "gemma3_text"."""
    rope_scaling: dict | tuple | None = None
    """HF rope_scaling as sorted (key, value) pairs (a dict is accepted and frozen); rope_type one
    of "linear", "dynamic", "yarn", "llama3" (transformers' formulas); None: plain RoPE."""
    sliding_window: int = 0
    """Attention window in tokens (query q sees keys q - window < k <= q); 0: full attention."""
    window_layers: tuple[int, ...] | None = None
    """Layers that use the sliding window; None: every layer (Mistral). Qwen2: its layer_types."""
    o_proj_bias: bool = False
    """Bias on o_proj ([H], replicated; added after the TP all-reduce): LLaMA / Qwen3
    attention_bias."""
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
    num_experts: int = 0
    """Mixture of experts: experts per MoE layer (0: dense model)."""
    moe_intermediate_size: int = 0
    """Each expert's intermediate size."""
    num_experts_per_tok: int = 0
    """Top-k experts per token (routing; planning does not depend on it)."""
    shared_expert_intermediate_size: int = 0
    """A shared expert (dense MLP beside the routed ones) of this size; 0: none."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: a sigmoid gate [1, H] on the shared expert's output."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers with a dense MLP in an MoE model (Qwen3-MoE mlp_only_layers, DeepSeek / Kimi
    first_k_dense_replace)."""
    decoder_sparse_step: int = 1
    """Qwen-MoE: layer i is MoE when (i + 1) % decoder_sparse_step == 0 (and not mlp_only)."""
    norm_topk_prob: bool = False
    """Routing: the top-k softmax probabilities renormalised to sum 1 (Mixtral always; Qwen-MoE
    norm_topk_prob) before weighting the experts' outputs."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing auxiliary loss (transformers' router_aux_loss_coef; read by
    the training loss, not by the forward)."""
    norm_plus_one: bool = False
    """Gemma: every RMSNorm scales by (1 + w) in fp32 and the embedding output is multiplied by
    sqrt(hidden_size) (rounded to the embedding dtype, as transformers does)."""
    sandwich_norm: bool = False
    """Gemma 2/3: post_attention_layernorm on the attention output, pre_feedforward_layernorm on the
    MLP input and post_feedforward_layernorm on its output (all replicated [H])."""
    attn_logit_softcapping: float = 0.0
    """Gemma 2: attention scores become cap * tanh(scores / cap) before the mask; 0: off."""
    final_logit_softcapping: float = 0.0
    """Gemma 2/3: lm logits become cap * tanh(logits / cap); 0: off. A value head is never capped
    (transformers' Gemma2/Gemma3Text ForSequenceClassification apply score.weight uncapped)."""
    query_pre_attn_scalar: float = 0.0
    """Gemma: attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
    0: head_dim."""
    original_max_position_embeddings: int = 0
    """longrope only: the pre-training length (transformers reads the top-level config field,
    Phi-3's default 4096); it sets factor = max_position_embeddings / it and the short/long switch.
    0: unset."""
    rope_local_base_freq: float = 0.0
    """Gemma 3: the sliding-window layers (window_layers) use plain RoPE with this base; rope_theta
    and rope_scaling apply to the global layers only. 0: every layer uses
    rope_theta/rope_scaling."""
    pad_token_id: int | None = None
    """The embedding row whose lookups get no gradient (transformers' nn.Embedding(padding_idx):
    the row still embeds, but training leaves it to the tied head, if any); negative counts from
    the end of the vocabulary, as in torch. Also needed for export: a value model's
    ...ForSequenceClassification reads it for batches > 1."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` has routed experts instead of a dense MLP."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def uses_window(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return bool(self.sliding_window) and (
            self.window_layers is None or layer in self.window_layers
        )

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
        for f in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "num_hidden_layers",
        ):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelConfig.{f}={getattr(self, f)} must be positive")
        if self.head not in ("lm", "value"):
            raise ValueError(f"ModelConfig.head={self.head!r}; allowed: 'lm', 'value'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not a multiple of "
                    f"num_attention_heads={self.num_attention_heads}; give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"ModelConfig.dtype={self.dtype!r}; allowed: {sorted(DTYPE_SIZES)}")
        for f, allowed in (("qkv_layout", QKV_LAYOUTS), ("gate_up_layout", GATE_UP_LAYOUTS)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"ModelConfig.{f}={getattr(self, f)!r}; allowed: {allowed}")
        if self.kv_head_replicas and self.qkv_layout != "blocked":
            raise ValueError(
                f"ModelConfig.kv_head_replicas (vLLM) needs qkv_layout='blocked', not "
                f"{self.qkv_layout!r}"
            )
        if not isinstance(self.vocab_pad_multiple, int) or self.vocab_pad_multiple < 1:
            raise ValueError(
                f"ModelConfig.vocab_pad_multiple={self.vocab_pad_multiple!r} must be "
                "a positive int (Megatron-core: 128)"
            )
        if (
            self.pad_token_id is not None
            and not -self.vocab_size <= self.pad_token_id < self.vocab_size
        ):
            raise ValueError(
                f"ModelConfig.pad_token_id={self.pad_token_id} is outside the vocabulary "
                f"(vocab_size={self.vocab_size}; transformers' nn.Embedding refuses it too)"
            )
        _check_attention_fields(self)
        _check_moe_fields(self)

    @property
    def padding_row(self) -> int | None:
        """pad_token_id as a row of the embedding table (negative ids count from vocab_size)."""
        p = self.pad_token_id
        return None if p is None else p % self.vocab_size

    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike, **overrides) -> ModelConfig:
        """From an HF config dict, a config.json path, or a checkpoint directory.

        Checks model_type / architectures and every field that changes the computation
        (real_py.spec.hf_config): unsupported ones raise ValueError naming the field."""
        where = "config"
        if isinstance(config, dict):
            hf = config
        else:
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            where = path
            with open(path) as f:
                try:
                    hf = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: not valid JSON ({e})") from None
        kwargs = config_kwargs(hf, where)
        hf_dtype = hf.get("torch_dtype") or hf.get("dtype")  # transformers >= 4.56: "dtype"
        if hf_dtype is not None:
            hf_dtype = str(hf_dtype).removeprefix("torch.")
            if hf_dtype not in DTYPE_SIZES:
                raise ValueError(
                    f"HF config torch_dtype={hf_dtype!r}; allowed: {sorted(DTYPE_SIZES)} "
                    "(or pass dtype=... to from_hf)"
                )
            kwargs["dtype"] = hf_dtype
        kwargs.update(overrides)
        return cls(**kwargs)


_INT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "num_hidden_layers",
    "max_position_embeddings",
    "head_dim",
    "sliding_window",
    "original_max_position_embeddings",
)
ROPE_SCALING_KEYS = {
    # rope_type: (required keys, optional keys), as transformers 4.57 validates them
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "llama3": (
        {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
        set(),
    ),
    # longrope: factor optional (original_max_position_embeddings overrides it); the rope_scaling
    # key original_max_position_embeddings is accepted but, as in transformers, not read
    "longrope": (
        {"short_factor", "long_factor"},
        {"attention_factor", "factor", "original_max_position_embeddings"},
    ),
    "yarn": (
        {"factor"},
        {
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "original_max_position_embeddings",
            "mscale",
            "mscale_all_dim",
            "truncate",
        },
    ),
}
# transformers ACT2FN names whose torch function real_py uses identically (gelu_new / gelu_fast are
# hand-written tanh formulas in transformers whose rounding differs; refused).
HIDDEN_ACTS = _HIDDEN_ACTS
MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3_text",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
)


def _check_config_types(c: ModelConfig) -> None:
    """ValueError naming the field for a value of the wrong type (before any arithmetic on it)."""
    for f in _INT_FIELDS:
        v = getattr(c, f)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"ModelConfig.{f}={v!r} must be an int")
    for f in ("rms_norm_eps", "rope_theta", "router_aux_loss_coef"):
        v = getattr(c, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"ModelConfig.{f}={v!r} must be a number")
    if c.hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"ModelConfig.hidden_act={c.hidden_act!r}; allowed: {list(HIDDEN_ACTS)}")
    for f in (
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "rope_local_base_freq",
    ):
        v = getattr(c, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"ModelConfig.{f}={v!r} must be a number >= 0 (0: off)")
    for f in (
        "tie_word_embeddings",
        "attention_bias",
        "qk_norm",
        "o_proj_bias",
        "mlp_bias",
        "norm_after",
        "qk_norm_whole",
        "norm_plus_one",
        "sandwich_norm",
        "norm_topk_prob",
        "kv_head_replicas",
    ):
        if not isinstance(getattr(c, f), bool):
            raise ValueError(f"ModelConfig.{f}={getattr(c, f)!r} must be true or false")


def _check_moe_fields(c: ModelConfig) -> None:
    """ValueError naming the field for inconsistent MoE fields."""
    for f in (
        "num_experts",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "shared_expert_intermediate_size",
        "decoder_sparse_step",
    ):
        v = getattr(c, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"ModelConfig.{f}={v!r} must be a non-negative int")
    if not c.num_experts:
        if c.moe_intermediate_size or c.num_experts_per_tok or c.shared_expert_intermediate_size:
            raise ValueError(
                "ModelConfig.moe_intermediate_size / num_experts_per_tok / "
                "shared_expert_intermediate_size are set but num_experts=0"
            )
        return
    if c.moe_intermediate_size < 1:
        raise ValueError(
            f"ModelConfig.num_experts={c.num_experts} needs moe_intermediate_size >= 1"
        )
    if not 1 <= c.num_experts_per_tok <= c.num_experts:
        raise ValueError(
            f"ModelConfig.num_experts_per_tok={c.num_experts_per_tok} must be in "
            f"[1, num_experts={c.num_experts}]"
        )
    if c.decoder_sparse_step < 1:
        raise ValueError(f"ModelConfig.decoder_sparse_step={c.decoder_sparse_step} must be >= 1")
    if c.shared_expert_gate and not c.shared_expert_intermediate_size:
        raise ValueError("ModelConfig.shared_expert_gate needs shared_expert_intermediate_size > 0")
    layers = tuple(c.mlp_only_layers)
    if any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < c.num_hidden_layers
        for i in layers
    ):
        raise ValueError(
            f"ModelConfig.mlp_only_layers={c.mlp_only_layers!r} must list layer indices "
            f"in [0, {c.num_hidden_layers})"
        )
    object.__setattr__(c, "mlp_only_layers", layers)


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
            raise ValueError(
                f"rope_scaling rope_type={kind!r} is not supported; supported: "
                f"{sorted(ROPE_SCALING_KEYS)}"
            )
        else:
            required, optional = ROPE_SCALING_KEYS[kind]
            missing, unknown = required - rs.keys(), rs.keys() - required - optional - {"rope_type"}
            if missing or unknown:
                raise ValueError(
                    f"rope_scaling ({kind}): missing keys {sorted(missing)}, unknown keys "
                    f"{sorted(unknown)}; allowed: {sorted(required | optional)}"
                )
            if kind == "longrope":
                _check_longrope(c, rs)
            elif not isinstance(rs["factor"], (int, float)) or rs["factor"] <= 0:
                raise ValueError(f"rope_scaling factor={rs['factor']!r} must be a positive number")
        # lists (longrope factors) frozen to tuples: the config stays hashable
        object.__setattr__(
            c,
            "rope_scaling",
            tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rs.items()))
            if rs
            else None,
        )
    if c.sliding_window < 0:
        raise ValueError(
            f"ModelConfig.sliding_window={c.sliding_window} must be >= 0 (0: full attention)"
        )
    if c.window_layers is not None:
        layers = tuple(c.window_layers)
        if any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < c.num_hidden_layers
            for i in layers
        ):
            raise ValueError(
                f"ModelConfig.window_layers={c.window_layers!r} must list layer indices in "
                f"[0, {c.num_hidden_layers})"
            )
        object.__setattr__(c, "window_layers", layers)


def _check_longrope(c: ModelConfig, rs: dict) -> None:
    for k in ("short_factor", "long_factor"):
        v = rs[k]
        if (
            not isinstance(v, (list, tuple))
            or len(v) != c.head_dim // 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v)
        ):
            raise ValueError(
                f"rope_scaling (longrope) {k} must be {c.head_dim // 2} numbers (head_dim / 2), "
                f"got {v!r}"
            )
    if not c.original_max_position_embeddings and not isinstance(rs.get("factor"), (int, float)):
        raise ValueError(
            "rope_scaling (longrope) needs factor or the config's original_max_position_embeddings"
        )


PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        num_hidden_layers=32,
    ),
    "llama2-13b": ModelConfig(
        hidden_size=5120,
        intermediate_size=13824,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        num_hidden_layers=40,
    ),
    "codellama-34b": ModelConfig(
        hidden_size=8192,
        intermediate_size=22016,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        num_hidden_layers=48,
        rope_theta=1e6,
    ),
    "llama2-70b": ModelConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        num_hidden_layers=80,
    ),
    # Shapes only (planning, simulation); rope_scaling of the released model is not set here.
    "llama3.1-405b": ModelConfig(
        hidden_size=16384,
        intermediate_size=53248,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
        num_hidden_layers=126,
        rope_theta=500000.0,
    ),
    # Mixture of experts: a tiny one for tests and the Qwen3 MoE shapes (real_py/models/moe.py
    # runs their forward).
    "moe-tiny": ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=97,
        num_hidden_layers=3,
        num_experts=8,
        moe_intermediate_size=16,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=16,
        shared_expert_gate=True,
        mlp_only_layers=(0,),
        model_type="qwen3",
        qk_norm=True,
    ),
    "qwen3-30b-a3b": ModelConfig(
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_hidden_layers=48,
        num_experts=128,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        qk_norm=True,
        model_type="qwen3",
        dtype="bfloat16",
        rope_theta=1e6,
    ),
    "qwen3-235b-a22b": ModelConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_hidden_layers=94,
        num_experts=128,
        moe_intermediate_size=1536,
        num_experts_per_tok=8,
        qk_norm=True,
        model_type="qwen3",
        dtype="bfloat16",
        rope_theta=1e6,
    ),
    # Kimi-K2's sizes (61 layers, first dense, 384 experts of 2048 + one shared, 8 active, BF16);
    # its MLA attention is stood in for by GQA (64 heads x 128, 16 kv heads so that TP16 splits it).
    "kimi-k2-shaped": ModelConfig(
        hidden_size=7168,
        intermediate_size=18432,
        num_attention_heads=64,
        num_key_value_heads=16,
        head_dim=128,
        vocab_size=163840,
        num_hidden_layers=61,
        num_experts=384,
        moe_intermediate_size=2048,
        num_experts_per_tok=8,
        shared_expert_intermediate_size=2048,
        mlp_only_layers=(0,),
        dtype="bfloat16",
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}")
    from dataclasses import replace

    return replace(PRESETS[name], **overrides)
