"""Which vLLM parameter holds which real_py parameter, and whether real_py knows its loader.

vLLM's Llama-family models (Llama, Mistral, Qwen2, Qwen3) keep the fused names real_py uses
(qkv_proj, gate_up_proj) under a `model.` prefix, with `lm_head.weight` at the top. What a rank
holds of each is the loader's rule, which real_py plans as a storage format (real_py.spec.
vllm_config): QKVParallelLinear [q_r; k_r; v_r] (kv heads replicated when tp > num_kv_heads),
MergedColumnParallelLinear [gate_r; up_r], RowParallelLinear split on the input dim,
VocabParallelEmbedding / ParallelLMHead rows padded to a multiple of 64 and split evenly, RMSNorm
replicated; Qwen3-MoE's experts as RoutedExperts' stacked w13_weight [E, 2I/tp, H] (gate rows,
then up) and w2_weight [E, H, I/tp], every expert on every worker (no expert parallelism). A
parameter whose module is of another class, or a vLLM parameter real_py has no name for, makes
a dense model fall back to full tensors and vLLM's own `load_weights` (an MoE model is refused:
vLLM's CPU reload does not re-pack experts).
"""

from __future__ import annotations

import re
from dataclasses import asdict

from ..spec import ModelConfig, ModelSpec

KNOWN_MODULES = {
    "qkv_proj": "QKVParallelLinear",
    "o_proj": "RowParallelLinear",
    "gate_up_proj": "MergedColumnParallelLinear",
    "down_proj": "RowParallelLinear",
    "embed_tokens": "VocabParallelEmbedding",
    "lm_head": "ParallelLMHead",
    "gate": "GateLinear",
    "routed_experts": "RoutedExperts",
}
"""Module (last name part) -> the vLLM class whose loader real_py plans; every other module
holding a planned parameter must be an RMSNorm (replicated)."""
KNOWN_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""model_type values whose vLLM model keeps real_py's fused names (checked per parameter too)."""


_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight$")
EXPERTS_MODULE = "mlp.experts.routed_experts"
"""Where vLLM 0.32 keeps a layer's routed experts (under its MoERunner `mlp.experts`)."""


def vllm_name(name: str) -> str:
    """real_py parameter name -> vLLM parameter name (Llama family; an expert's tensor -> the
    layer's stacked tensor, indexed by the expert number in the real_py name)."""
    m = _EXPERT.match(name)
    if m:
        weight = "w13_weight" if m[3] == "gate_up_proj" else "w2_weight"
        return f"model.layers.{m[1]}.{EXPERTS_MODULE}.{weight}"
    return name if name.startswith("lm_head.") else "model." + name


def unknown_params(spec: ModelSpec, model) -> list[str]:
    """vLLM parameters (and real_py parameters) that the planned format does not cover: vLLM
    names without a real_py parameter, real_py names without a vLLM parameter, and parameters of
    modules whose class is not the one whose loader real_py plans. Empty: shards go in place."""
    config = spec.config
    if config is None or config.model_type not in KNOWN_TYPES:
        return [f"<model_type {getattr(config, 'model_type', None)!r}>"]
    live = dict(model.named_parameters())
    modules = dict(model.named_modules())
    want = {vllm_name(p.name) for p in spec.params}
    out = sorted(set(live) - want) + sorted(want - set(live))
    for name in sorted(want & set(live)):
        owner = modules.get(name.rsplit(".", 1)[0])
        kind = type(owner).__name__
        expect = KNOWN_MODULES.get(name.rsplit(".", 2)[-2])
        if (expect or "RMSNorm") != kind:
            out.append(f"{name} ({kind})")
        elif kind == "RoutedExperts" and live[name].shape[0] != config.num_experts:
            out.append(
                f"{name} (holds {live[name].shape[0]} of {config.num_experts} experts: expert "
                "parallelism)"
            )
    return out


def config_dict(config: ModelConfig) -> dict:
    """A ModelConfig as JSON-safe plain data (init info travels over HTTP)."""
    d = asdict(config)
    if d["rope_scaling"] is not None:
        d["rope_scaling"] = dict(d["rope_scaling"])
    return d


def config_from_dict(d: dict) -> ModelConfig:
    """Inverse of config_dict (JSON turned tuples into lists)."""
    d = dict(d)
    for f in ("window_layers", "mlp_only_layers"):
        if d.get(f) is not None:
            d[f] = tuple(d[f])
    return ModelConfig(**d)
