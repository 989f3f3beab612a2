"""HF config.json <-> ModelConfig: the supported architectures and fields, refusals, export.

    kwargs = config_kwargs(hf_dict, where)  # ModelConfig fields; ValueError on anything unsupported
    d = export_config(config)               # a complete transformers config dict for `config`

Supported (each covered by a transformers parity test, tests/test_models_hf_coverage.py):

  model_type   architectures
               fields beyond the shape

  llama        LlamaForCausalLM, LlamaForSequenceClassification
               head_dim, rope_scaling, tie_word_embeddings, attention_bias (q/k/v/o), mlp_bias,
               hidden_act
  mistral      MistralForCausalLM, MistralForSequenceClassification
               head_dim, rope_scaling, sliding_window (all layers)
  qwen2        Qwen2ForCausalLM, Qwen2ForSequenceClassification
               q/k/v bias, rope_scaling, use_sliding_window + sliding_window + max_window_layers (or
               layer_types), tied
  olmo2        Olmo2ForCausalLM
               norms after attention / MLP, whole-projection q/k norms, attention_bias,
               rope_scaling, tied
  phi3         Phi3ForCausalLM, Phi3ForSequenceClassification
               fused qkv_proj / gate_up_proj tensors, sliding_window (all layers), longrope, tied
  qwen3        Qwen3ForCausalLM, Qwen3ForSequenceClassification
               per-head q/k RMSNorm, head_dim, attention_bias (q/k/v/o), rope_scaling, sliding
               window as qwen2, tied
  gemma3_text  Gemma3ForCausalLM, Gemma3TextForSequenceClassification
               as gemma2 plus per-head (1 + w) q/k norms, rope_local_base_freq on sliding layers,
               rope_scaling on global layers only, sliding_window_pattern; multimodal gemma3 (also
               its Gemma3ForSequenceClassification) refused
  gemma2       Gemma2ForCausalLM, Gemma2ForSequenceClassification
               (1 + w) RMSNorms, sqrt(H) embedding scale, sandwich norms, hidden_activation,
               attn/final logit soft-capping, query_pre_attn_scalar, layer_types sliding windows,
               attention_bias, rope_scaling, tied
  qwen3_moe    Qwen3MoeForCausalLM, Qwen3MoeForSequenceClassification
               as qwen3 (no sliding window) plus routed experts: num_experts (transformers >= 5:
               num_local_experts), num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
               decoder_sparse_step, mlp_only_layers, router_aux_loss_coef
  qwen2_moe    Qwen2MoeForCausalLM, Qwen2MoeForSequenceClassification
               qkv_bias, the qwen3_moe expert fields plus shared_expert_intermediate_size (shared
               expert with its sigmoid gate); no sliding window
  mixtral      MixtralForCausalLM, MixtralForSequenceClassification
               num_local_experts, num_experts_per_tok (top-k renormalised), intermediate_size per
               expert, sliding_window (all layers), router_aux_loss_coef; router_jitter_noise must
               be 0

rope_scaling rope_type: linear, dynamic, yarn, llama3 (and default); longrope for llama and phi3
(short/long factors switched per forward at original_max_position_embeddings, attention factor);
transformers >= 5's `rope_parameters` is read as rope_theta + rope_scaling (per layer type for
gemma3_text). Refused, naming the field: any other model_type or architecture, hidden_act outside
_HIDDEN_ACTS (gelu_new, gelu_fast: rounding differs), mlp_bias outside llama, attention_dropout > 0
(changes training), partial_rotary_factor != 1, longrope outside llama / phi3, pruned_heads,
quantization_config, custom code (auto_map), and any field not listed below that is set
(softcapping, qk norms, ...).

One file past 400 lines: config_kwargs (read) and export_config (write) are the two directions of
one mapping and go by the same tables (ARCHITECTURES, MOE_TYPES, the fields read per model type),
so a new architecture is one edit here.
"""

from __future__ import annotations

import json

# transformers ACT2FN names real_py computes identically (re-exported as spec.config.HIDDEN_ACTS)
_HIDDEN_ACTS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu", "sigmoid", "tanh")

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "olmo2": ("Olmo2ForCausalLM",),
    "phi3": ("Phi3ForCausalLM", "Phi3ForSequenceClassification"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2ForSequenceClassification"),
    # transformers names Gemma 3's text-only value model Gemma3TextForSequenceClassification
    # (Gemma3TextConfig, weights model.* + score.weight); Gemma3ForSequenceClassification wraps
    # the multimodal Gemma3Model (model_type gemma3), refused below
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification"),
    "mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification"),
}
# ARCHITECTURES[mt][0] is the causal LM, [1] (where there is one) the sequence classifier
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
# mixture-of-experts families whose attention or routing real_py does not implement, refused by name
_UNSUPPORTED_MOE = {
    "deepseek_v2": "DeepSeek-V2: multi-head latent attention (MLA) and grouped top-k routing are "
    "not implemented",
    "deepseek_v3": "DeepSeek-V3: multi-head latent attention (MLA), grouped top-k routing and the "
    "expert score-correction bias are not implemented",
    "kimi_k2": "Kimi-K2 (DeepSeek-V3 architecture): MLA, grouped routing and expert bias are not "
    "implemented",
    "glm4_moe": "GLM-4.5 MoE: sigmoid routing with expert bias (e_score_correction_bias) is not "
    "implemented",
    "dots1": "dots.llm1: grouped routing with expert bias is not implemented",
    "olmoe": "OLMoE: whole-projection q/k norms with routed experts are not implemented",
    "phimoe": "PhiMoE: sparsemixer routing is not implemented",
    "granitemoe": "GraniteMoE: scaled residuals and its fused expert layout are not implemented",
    "jamba": "Jamba: Mamba layers are not implemented",
    "qwen3_next": "Qwen3-Next: gated delta-net attention is not implemented",
}
# multimodal wrappers refused by name (their text stack is gemma3_text)
_MULTIMODAL = {
    "gemma3": "Gemma 3 multimodal (vision tower; Gemma3ForSequenceClassification wraps it too); "
    "use a text-only gemma3_text checkpoint: Gemma3ForCausalLM, or "
    "Gemma3TextForSequenceClassification for a value head"
}

_SHAPE = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
    "num_hidden_layers",
)
_READ = (
    "tie_word_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "head_dim",
    "pad_token_id",
)
# Fields that do not change the forward or backward of the supported decoders (PretrainedConfig
# generic keys, generation defaults, init / cache / bookkeeping).
_HARMLESS = {
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "initializer_range",
    "use_cache",
    "pretraining_tp",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "finetuning_task",
    "is_decoder",
    "tie_encoder_decoder",
    "chunk_size_feed_forward",
    "cross_attention_hidden_size",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "num_key_value_heads",
    "rope_scaling",
    "attention_bias",
    "pruned_heads",
}
_PER_TYPE = {
    "llama": {"mlp_bias", "attention_dropout", "hidden_act"},
    "mistral": {"sliding_window", "attention_dropout", "hidden_act"},
    "qwen2": {
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "attention_dropout",
        "hidden_act",
    },
}
_PER_TYPE["qwen3"] = _PER_TYPE["qwen2"]
_PER_TYPE["olmo2"] = {"attention_dropout", "hidden_act"}
_PER_TYPE["gemma2"] = {
    "attention_dropout",
    "hidden_activation",
    "hidden_act",
    "sliding_window",
    "layer_types",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "cache_implementation",
}
_PER_TYPE["gemma3_text"] = _PER_TYPE["gemma2"] | {
    "rope_local_base_freq",
    "sliding_window_pattern",
    "use_bidirectional_attention",
}
# resid_pdrop / embd_pdrop: dropout, checked to be 0 below; original_max_position_embeddings is
# read by longrope only (refused)
_MOE_FIELDS = {
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "output_router_logits",
    "attention_dropout",
    "hidden_act",
    "use_sliding_window",
    "sliding_window",
}
# transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts (read as num_experts)
_PER_TYPE["qwen3_moe"] = _MOE_FIELDS | {"num_local_experts"}
# max_window_layers is read by nothing in transformers' Qwen2MoE without use_sliding_window
# (refused)
_PER_TYPE["qwen2_moe"] = _MOE_FIELDS | {
    "shared_expert_intermediate_size",
    "qkv_bias",
    "max_window_layers",
}
_PER_TYPE["mixtral"] = {
    "num_local_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "output_router_logits",
    "router_jitter_noise",
    "attention_dropout",
    "hidden_act",
    "sliding_window",
}
_PER_TYPE["phi3"] = {
    "attention_dropout",
    "hidden_act",
    "sliding_window",
    "resid_pdrop",
    "embd_pdrop",
    "original_max_position_embeddings",
    "partial_rotary_factor",
}


def _supported() -> str:
    return ", ".join(f"{t} ({'/'.join(a)})" for t, a in ARCHITECTURES.items())


def check_architecture(config: dict, where: str) -> str:
    """The model_type of an HF config dict; ValueError for anything but llama / mistral / qwen2."""
    mt = config.get("model_type")
    archs = config.get("architectures") or []
    if mt is None and not archs:
        mt = "llama"  # a bare dict of shape fields
    if mt in _MULTIMODAL or mt in _UNSUPPORTED_MOE:
        why = _MULTIMODAL.get(mt) or _UNSUPPORTED_MOE[mt]
        raise ValueError(
            f"{where}: architecture {mt!r} is not supported ({why}); supported: {_supported()}"
        )
    if mt not in ARCHITECTURES:
        name = mt if mt is not None else "/".join(map(str, archs))
        raise ValueError(
            f"{where}: architecture {name!r} is not supported; supported: {_supported()}"
        )
    bad = [a for a in archs if a not in ARCHITECTURES[mt]]
    if bad:
        raise ValueError(
            f"{where}: architecture {bad[0]!r} (model_type {mt}) is not supported; supported: "
            f"{_supported()}"
        )
    return mt


def _refuse(where: str, field: str, value, why: str):
    raise ValueError(f"{where}: config field {field}={value!r} is not supported ({why})")


def _legacy_rope(config: dict, where: str, mt: str) -> dict:
    """transformers >= 5 writes RoPE as `rope_parameters` ({rope_type, rope_theta, factor, ...}, or
    one such mapping per layer type for gemma3_text) where 4.x wrote rope_theta / rope_scaling /
    rope_local_base_freq. Returns the config with the 4.x fields that the rest of this module reads,
    refusing a rope_parameters that contradicts a 4.x field also present."""
    rp = config.get("rope_parameters")
    if rp is None:
        return config
    if not isinstance(rp, dict):
        _refuse(where, "rope_parameters", rp, "expected a mapping")
    config = {k: v for k, v in config.items() if k != "rope_parameters"}
    per_type = set(rp) <= {"full_attention", "sliding_attention"} and all(
        isinstance(v, dict) for v in rp.values()
    )
    if (
        per_type
        and mt != "gemma3_text"
        and len({json.dumps(v, sort_keys=True) for v in rp.values()}) > 1
    ):
        _refuse(
            where,
            "rope_parameters",
            rp,
            f"one RoPE per layer type is gemma3_text's; {mt} has one RoPE",
        )
    full = dict(rp.get("full_attention", next(iter(rp.values()), {})) if per_type else rp)
    legacy = {}
    if "rope_theta" in full:
        legacy["rope_theta"] = full.pop("rope_theta")
    if full.get("partial_rotary_factor", 1) not in (1, 1.0):  # refused as the 4.x field is, below
        legacy["partial_rotary_factor"] = full["partial_rotary_factor"]
    full.pop("partial_rotary_factor", None)
    if full.get("rope_type") == "longrope" and "original_max_position_embeddings" in full:
        # transformers 5 copies it in; 4.x longrope reads the top-level field (4.x semantics here:
        # factor = max_position_embeddings / original_max_position_embeddings)
        legacy["original_max_position_embeddings"] = full.pop("original_max_position_embeddings")
    if full.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = full
    elif set(full) - {"rope_type"}:
        _refuse(
            where,
            "rope_parameters",
            rp,
            f"fields {sorted(set(full) - {'rope_type'})} with the default rope_type",
        )
    if per_type and mt == "gemma3_text" and "rope_theta" in rp.get("sliding_attention", {}):
        local = rp["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            _refuse(where, "rope_parameters", rp, "gemma3_text scales RoPE on global layers only")
        legacy["rope_local_base_freq"] = local["rope_theta"]
    for k, v in legacy.items():
        if config.get(k) is not None and config[k] != v:
            _refuse(
                where,
                "rope_parameters",
                rp,
                f"it says {k}={v!r} and the config says {k}={config[k]!r}",
            )
        config[k] = v
    return config


def config_kwargs(config: dict, where: str = "config") -> dict:
    """ModelConfig keyword arguments for an HF config dict; ValueError naming the first field that
    is missing, unsupported or of the wrong type."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    mt = check_architecture(config, where)
    config = _legacy_rope(config, where, mt)
    for k in _SHAPE:
        if config.get(k) is None:
            raise ValueError(f"{where}: config has no {k!r} (required for model_type {mt})")
    kw = {k: config[k] for k in _SHAPE}
    kw.update({k: config[k] for k in _READ if config.get(k) is not None})
    kw["num_key_value_heads"] = config.get("num_key_value_heads") or config["num_attention_heads"]
    kw["model_type"] = mt
    if any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ()):
        # a reward / critic checkpoint: real_py builds its scalar value head (score.weight [1, H])
        labels = config.get("num_labels", len(config.get("id2label") or {0: 0}))
        if labels != 1:
            _refuse(
                where,
                "num_labels",
                labels,
                "a value head is one scalar per token; need num_labels=1",
            )
        kw["head"] = "value"
    # Gemma's MLP reads hidden_activation (its hidden_act is a legacy field transformers ignores)
    act = (
        (config.get("hidden_activation") or "gelu_pytorch_tanh")
        if mt.startswith("gemma")
        else config.get("hidden_act", "silu")
    )
    if act not in _HIDDEN_ACTS:
        _refuse(where, "hidden_act", act, f"implemented: {list(_HIDDEN_ACTS)}")
    kw["hidden_act"] = act
    for drop in ("resid_pdrop", "embd_pdrop"):
        if config.get(drop) not in (None, 0, 0.0):
            _refuse(where, drop, config[drop], "dropout changes training; need 0")
    if config.get("attention_dropout") not in (None, 0, 0.0):
        _refuse(
            where,
            "attention_dropout",
            config["attention_dropout"],
            "dropout changes training; need 0",
        )
    if config.get("mlp_bias"):
        if mt != "llama":
            _refuse(where, "mlp_bias", config["mlp_bias"], f"{mt} has no MLP biases")
        kw["mlp_bias"] = True
    if config.get("partial_rotary_factor") not in (None, 1, 1.0):
        _refuse(
            where,
            "partial_rotary_factor",
            config["partial_rotary_factor"],
            "RoPE covers the whole head",
        )
    if config.get("pruned_heads"):
        _refuse(where, "pruned_heads", config["pruned_heads"], "heads must be complete")
    if mt in ("llama", "qwen3", "olmo2", "gemma2", "gemma3_text", "qwen3_moe"):
        # transformers' llama / qwen3 / olmo2 / gemma attention_bias biases q, k, v and o_proj
        kw["attention_bias"] = kw["o_proj_bias"] = bool(config.get("attention_bias"))
        kw["qk_norm"] = mt in ("qwen3", "olmo2", "gemma3_text", "qwen3_moe")
        kw["qk_norm_whole"] = kw["norm_after"] = mt == "olmo2"
    elif mt == "qwen2_moe":
        kw["attention_bias"] = bool(
            config.get("qkv_bias", True)
        )  # Qwen2MoeConfig.qkv_bias: q/k/v only
    else:
        kw["attention_bias"] = (
            mt == "qwen2"
        )  # transformers' qwen2 always has q/k/v biases, mistral none
    rs = config.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict):
            _refuse(where, "rope_scaling", rs, "expected a mapping")
        kw["rope_scaling"] = rs
    longrope = isinstance(rs, dict) and (rs.get("rope_type") or rs.get("type")) == "longrope"
    if longrope and mt not in ("llama", "phi3"):
        _refuse(where, "rope_scaling", rs, f"longrope is implemented for llama and phi3, not {mt}")
    if longrope and config.get("original_max_position_embeddings"):
        kw["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    if mt in ("gemma2", "gemma3_text"):
        _gemma_kwargs(config, kw, where, mt)
    if mt == "phi3":
        kw["attention_bias"] = False  # fused qkv_proj / gate_up_proj tensors in the checkpoint
    if mt in MOE_TYPES:
        _moe_kwargs(config, kw, where, mt)
    if mt in ("mistral", "phi3", "mixtral") and config.get("sliding_window") is not None:
        kw["sliding_window"] = config["sliding_window"]
    if mt in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        window = config.get("sliding_window")
        if window is None:
            _refuse(where, "sliding_window", None, "use_sliding_window needs a window size")
        types = config.get("layer_types")
        if types is None:
            # transformers' Qwen2Config: layers >= max_window_layers slide (default 28)
            types = [
                "sliding_attention"
                if i >= config.get("max_window_layers", 28)
                else "full_attention"
                for i in range(config["num_hidden_layers"])
            ]
        kw["sliding_window"] = window
        kw["window_layers"] = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif mt in ("qwen2", "qwen3") and any(
        t != "full_attention" for t in config.get("layer_types") or ()
    ):
        _refuse(
            where, "layer_types", config["layer_types"], "sliding layers need use_sliding_window"
        )
    allowed = (
        _HARMLESS
        | _PER_TYPE[mt]
        | set(_SHAPE)
        | set(_READ)
        | ({"original_max_position_embeddings"} if longrope else set())
    )
    for k, v in config.items():
        if k in allowed or k.startswith("_") or v is None or v is False or v == {} or v == []:
            continue
        if k in ("quantization_config", "auto_map"):
            _refuse(where, k, v, "quantized or custom-code checkpoints are not supported")
        supported = sorted(
            set(_SHAPE) | set(_READ) | _PER_TYPE[mt] | {"rope_scaling", "num_key_value_heads"}
        )
        _refuse(
            where,
            k,
            v,
            f"not a field real_py implements for {mt}; supported {mt} fields: {supported}",
        )
    return kw


def _moe_kwargs(config: dict, kw: dict, where: str, mt: str) -> None:
    """Routed-expert fields of qwen3_moe / qwen2_moe / mixtral, with their transformers config
    defaults (Qwen3MoeConfig, Qwen2MoeConfig, MixtralConfig) for the ones a config.json leaves
    out."""
    if mt == "mixtral":
        kw.update(
            num_experts=config.get("num_local_experts", 8),
            moe_intermediate_size=kw["intermediate_size"],
            num_experts_per_tok=config.get("num_experts_per_tok", 2),
            norm_topk_prob=True,
        )
        if config.get("router_jitter_noise") not in (None, 0, 0.0):
            _refuse(
                where,
                "router_jitter_noise",
                config["router_jitter_noise"],
                "random jitter of the router input in training; need 0",
            )
    else:
        defaults = (128, 8, 768) if mt == "qwen3_moe" else (60, 4, 1408)
        if (
            "num_local_experts" in config
            and config.get("num_experts", config["num_local_experts"])
            != config["num_local_experts"]
        ):
            _refuse(
                where,
                "num_local_experts",
                config["num_local_experts"],
                f"disagrees with num_experts={config['num_experts']}",
            )
        kw.update(
            num_experts=config.get("num_experts", config.get("num_local_experts", defaults[0])),
            num_experts_per_tok=config.get("num_experts_per_tok", defaults[1]),
            moe_intermediate_size=config.get("moe_intermediate_size", defaults[2]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        )
        if config.get("use_sliding_window"):
            _refuse(
                where, "use_sliding_window", True, f"sliding windows are not implemented for {mt}"
            )
        if mt == "qwen2_moe":
            shared = config.get("shared_expert_intermediate_size", 5632)
            if not shared:
                _refuse(
                    where,
                    "shared_expert_intermediate_size",
                    shared,
                    "transformers' Qwen2MoE always has a shared expert; need > 0",
                )
            kw.update(shared_expert_intermediate_size=shared, shared_expert_gate=True)
    kw["router_aux_loss_coef"] = float(config.get("router_aux_loss_coef", 0.001))


def _gemma_kwargs(config: dict, kw: dict, where: str, mt: str) -> None:
    """Gemma 2 / Gemma 3 text fields, with their transformers config defaults for the ones a
    config.json leaves out (Gemma2Config / Gemma3TextConfig)."""
    g3 = mt == "gemma3_text"
    kw.update(norm_plus_one=True, sandwich_norm=True)
    kw["query_pre_attn_scalar"] = config.get("query_pre_attn_scalar", 256)
    caps = (None, None) if g3 else (50.0, 30.0)
    # transformers 4.57's Gemma3Attention stores attn_logit_softcapping but never passes it to the
    # attention function: Gemma 3 text attends uncapped whatever the field says, and so does real_py
    kw["attn_logit_softcapping"] = (
        0.0 if g3 else config.get("attn_logit_softcapping", caps[0]) or 0.0
    )
    kw["final_logit_softcapping"] = config.get("final_logit_softcapping", caps[1]) or 0.0
    if config.get("use_bidirectional_attention"):
        _refuse(where, "use_bidirectional_attention", True, "real_py decoders are causal")
    pattern = config.get("sliding_window_pattern", 6) if g3 else 2
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(config["num_hidden_layers"])
    ]
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if len(types) != config["num_hidden_layers"] or bad:
        _refuse(where, "layer_types", types, "one of sliding_attention / full_attention per layer")
    window = config.get("sliding_window", 4096)
    if "sliding_attention" in types:
        if not window:
            _refuse(where, "sliding_window", window, "sliding_attention layers need a window size")
        kw["sliding_window"] = window
        kw["window_layers"] = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    kw.setdefault("rms_norm_eps", 1e-6)
    kw.setdefault("tie_word_embeddings", True)
    kw.setdefault("head_dim", 256)
    kw.setdefault("max_position_embeddings", 131072 if g3 else 8192)
    if g3:
        kw.setdefault("rope_theta", 1_000_000.0)
        kw["rope_local_base_freq"] = float(config.get("rope_local_base_freq", 10_000.0))


def export_config(config, source: dict | None = None) -> dict:
    """A complete transformers config dict for a ModelConfig: model_type, architectures, shape,
    rope_scaling, sliding window, tie_word_embeddings, torch_dtype, pad_token_id and num_labels=1
    for value models. `source` (the original config.json) supplies the fields real_py does not
    model (bos/eos ids, initializer_range, ...); every computation field comes from `config`."""
    import transformers

    c, mt = config, config.model_type
    if mt in MOE_TYPES or c.num_experts:
        raise ValueError(
            f"export of mixture-of-experts configs (model_type {mt!r}) is not implemented; "
            "pass hf_config= (the source config.json) to save_hf"
        )
    olmo = c.qk_norm and c.qk_norm_whole and c.norm_after
    if (
        c.qk_norm != (mt in ("qwen3", "olmo2", "gemma3_text"))
        or (mt == "olmo2") != olmo
        or (c.norm_after and not olmo)
    ):
        raise ValueError(
            f"qk_norm={c.qk_norm}, qk_norm_whole={c.qk_norm_whole}, norm_after={c.norm_after} "
            f"cannot export as model_type {mt!r} (per-head q/k norms: qwen3; whole-projection "
            "q/k norms with norms after the sublayers: olmo2)"
        )
    kw = dict(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        vocab_size=c.vocab_size,
        num_hidden_layers=c.num_hidden_layers,
        tie_word_embeddings=c.tie_word_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        torch_dtype=c.dtype,
        hidden_act="silu",
        rope_scaling=(
            {k: list(v) if isinstance(v, tuple) else v for k, v in c.rope_scaling}
            if c.rope_scaling
            else None
        ),
        head_dim=c.head_dim,
    )
    if c.original_max_position_embeddings:
        kw["original_max_position_embeddings"] = c.original_max_position_embeddings
    if c.mlp_bias and mt != "llama":
        raise ValueError(f"mlp_bias exports as model_type 'llama' only, not {mt!r}")
    if not mt.startswith("gemma") and (
        c.rope_local_base_freq
        or c.norm_plus_one
        or c.sandwich_norm
        or c.attn_logit_softcapping
        or c.final_logit_softcapping
        or c.query_pre_attn_scalar
    ):
        raise ValueError(
            f"Gemma fields (norm_plus_one, sandwich_norm, soft-capping, query_pre_attn_scalar) "
            f"cannot export as model_type {mt!r}"
        )
    if c.o_proj_bias != (
        c.attention_bias and mt in ("llama", "qwen3", "olmo2", "gemma2", "gemma3_text")
    ):
        raise ValueError(
            f"attention_bias={c.attention_bias}, o_proj_bias={c.o_proj_bias} cannot export as "
            f"model_type {mt!r} (llama / qwen3: both or neither; qwen2: q/k/v only)"
        )
    kw["hidden_act"] = c.hidden_act
    if mt == "llama":
        if c.sliding_window:
            raise ValueError(
                "sliding_window exports as model_type 'mistral' or 'qwen2', not 'llama'"
            )
        kw.update(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    elif mt == "olmo2":
        if c.sliding_window:
            raise ValueError("olmo2 has no sliding window")
        kw.update(attention_bias=c.attention_bias)
        kw.pop("head_dim")  # Olmo2Config has none: hidden_size // num_attention_heads
        if c.head_dim * c.num_attention_heads != c.hidden_size:
            raise ValueError(
                f"olmo2 needs head_dim = hidden_size / num_attention_heads, got {c.head_dim}"
            )
    elif mt in ("gemma2", "gemma3_text"):
        g3 = mt == "gemma3_text"
        if (
            not (c.norm_plus_one and c.sandwich_norm)
            or c.qk_norm != g3
            or c.qk_norm_whole
            or c.norm_after
            or c.mlp_bias
            or bool(c.rope_local_base_freq) != g3
        ):
            raise ValueError(
                f"{mt} needs (1 + w) norms and sandwich norms, no MLP biases; per-head q/k norms "
                "and rope_local_base_freq exactly for gemma3_text"
            )
        if g3:
            kw["rope_local_base_freq"] = c.rope_local_base_freq
        kw.pop("hidden_act")
        layers = range(c.num_hidden_layers)
        kw.update(
            hidden_activation=c.hidden_act,
            attention_bias=c.attention_bias,
            query_pre_attn_scalar=c.query_pre_attn_scalar or c.head_dim,
            attn_logit_softcapping=c.attn_logit_softcapping or None,
            final_logit_softcapping=c.final_logit_softcapping or None,
            sliding_window=c.sliding_window or None,
            layer_types=[
                "sliding_attention" if c.uses_window(i) else "full_attention" for i in layers
            ],
        )
    elif mt == "phi3":
        if c.attention_bias or c.o_proj_bias or c.mlp_bias or c.window_layers is not None:
            raise ValueError("phi3 has no biases and slides every layer or none")
        kw.update(sliding_window=c.sliding_window or None)
        if kw["rope_scaling"]:  # Phi3Config wants exactly type, short_factor, long_factor
            rs = kw["rope_scaling"]
            if set(rs) != {"rope_type", "short_factor", "long_factor"}:
                raise ValueError(
                    "phi3 exports rope_scaling longrope with short/long factors only, "
                    f"got {sorted(rs)}"
                )
            kw["rope_scaling"] = {"type": rs.pop("rope_type"), **rs}
        kw.pop("head_dim")  # Phi3Config has none: hidden_size // num_attention_heads
        if c.head_dim * c.num_attention_heads != c.hidden_size:
            raise ValueError(
                f"phi3 needs head_dim = hidden_size / num_attention_heads, got {c.head_dim}"
            )
    elif mt == "mistral":
        if c.attention_bias:
            raise ValueError(
                "mistral has no q/k/v biases; export attention_bias=True as model_type 'qwen2'"
            )
        if c.window_layers is not None and c.sliding_window:
            raise ValueError(
                "mistral slides every layer; export per-layer windows as model_type 'qwen2'"
            )
        kw.update(sliding_window=c.sliding_window or None)
    else:
        if mt == "qwen2" and not c.attention_bias:
            raise ValueError(
                "qwen2 always has q/k/v biases; use model_type 'llama' for attention_bias=False"
            )
        if mt == "qwen3":
            kw.update(attention_bias=c.attention_bias)
        layers = range(c.num_hidden_layers)
        kw.update(
            use_sliding_window=bool(c.sliding_window),
            sliding_window=c.sliding_window or None,
            max_window_layers=c.num_hidden_layers,
            layer_types=[
                "sliding_attention" if c.uses_window(i) else "full_attention" for i in layers
            ],
        )
    if c.head == "value" and len(ARCHITECTURES[mt]) < 2:
        raise ValueError(
            f"transformers has no sequence-classification model for model_type {mt!r}: a value "
            "head cannot export as it"
        )
    kw["architectures"] = [ARCHITECTURES[mt][1 if c.head == "value" else 0]]
    if c.head == "value":
        # ...ForSequenceClassification reads the last non-pad token; without pad_token_id it
        # refuses batches > 1. real_py pads with 0 unless the config says otherwise.
        kw.update(num_labels=1, pad_token_id=c.pad_token_id if c.pad_token_id is not None else 0)
    elif c.pad_token_id is not None:
        kw["pad_token_id"] = c.pad_token_id
    out = dict(source or {})
    for k in (
        "rope_scaling",
        "sliding_window",
        "original_max_position_embeddings",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "id2label",
        "label2id",
        "num_labels",
        "head_dim",
        "attention_bias",
        "mlp_bias",
        "hidden_activation",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope_local_base_freq",
        "sliding_window_pattern",
        "rope_parameters",
        "partial_rotary_factor",
    ):
        out.pop(k, None)
    out.update(transformers.AutoConfig.for_model(mt, **{**_passthrough(out), **kw}).to_dict())
    return out


def _passthrough(source: dict) -> dict:
    keep = ("bos_token_id", "eos_token_id", "initializer_range", "use_cache", "pad_token_id")
    return {k: source[k] for k in keep if k in source}
