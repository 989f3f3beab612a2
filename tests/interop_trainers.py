"""Hand-sharded trainer state dicts for the interop tests, written from HF semantics alone (no
real_py slicing code): what a rank of a tp x pp trainer holds, as HF-named slices or as a
Megatron-core GPTModel local state dict (q|k|v fused per kv group, [gate; up] per TP rank, vocab
padded to 128 x tp, stage-local layer numbers, Transformer Engine norm names)."""

from __future__ import annotations

import torch


def tiny_llama(tied: bool, seed: int = 0):
    """(HF config dict, full HF state dict) of a small GQA LlamaForCausalLM (8 q / 4 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=4, vocab_size=200, num_hidden_layers=4, tie_word_embeddings=tied,
                      max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).float()
    return model.config.to_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _vocab_rows(t: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    part = t[k * rows:(k + 1) * rows]
    out[:len(part)] = part
    return out


def hf_rank_dict(sd: dict, tp: int, k: int, layers: range, first: bool, last: bool,
                 tied: bool) -> dict:
    """TP rank k's slices with HF names (global layer numbers); vocab padded to a multiple of tp."""
    V = sd["model.embed_tokens.weight"].shape[0]
    rows = -(-V // tp)
    out = {}
    if first:
        out["model.embed_tokens.weight"] = _vocab_rows(sd["model.embed_tokens.weight"], rows, k)
    for i in layers:
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = sd[p + n].clone()
        for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            out[p + n] = sd[p + n].chunk(tp, 0)[k].clone()
        for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            out[p + n] = sd[p + n].chunk(tp, 1)[k].clone()
    if last:
        out["model.norm.weight"] = sd["model.norm.weight"].clone()
        out["lm_head.weight"] = _vocab_rows(sd["model.embed_tokens.weight" if tied else "lm_head.weight"], rows, k)
    return out


def megatron_rank_dict(sd: dict, cfg: dict, tp: int, k: int, layers: range, first: bool,
                       last: bool, tied: bool) -> dict:
    """TP rank k of the stage holding `layers`, as Megatron-core names it."""
    V, H = sd["model.embed_tokens.weight"].shape
    nkv, hd = cfg["num_key_value_heads"], cfg["head_dim"]
    qpg = cfg["num_attention_heads"] // nkv
    rows = -(-V // (128 * tp)) * 128
    out = {}
    if first:
        out["embedding.word_embeddings.weight"] = _vocab_rows(sd["model.embed_tokens.weight"], rows, k)
    for local, i in enumerate(layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        q = sd[p + "self_attn.q_proj.weight"].view(nkv, qpg * hd, H)
        kk = sd[p + "self_attn.k_proj.weight"].view(nkv, hd, H)
        v = sd[p + "self_attn.v_proj.weight"].view(nkv, hd, H)
        grouped = torch.cat([q, kk, v], 1)  # [ng, (np/ng + 2) * hn, h] as Megatron splits it
        out[m + "self_attention.linear_qkv.weight"] = grouped.chunk(tp, 0)[k].reshape(-1, H).clone()
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = sd[p + "input_layernorm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"].chunk(tp, 1)[k].clone()
        out[m + "self_attention.core_attention._extra_state"] = torch.empty(0)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"].chunk(tp, 0)[k],
                                                      sd[p + "mlp.up_proj.weight"].chunk(tp, 0)[k]])
        out[m + "mlp.linear_fc1.layer_norm_weight"] = sd[p + "post_attention_layernorm.weight"].clone()
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"].chunk(tp, 1)[k].clone()
    if last:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
        if not tied or not first:  # pp=1 with tied embeddings: Megatron has no output_layer.weight
            out["output_layer.weight"] = _vocab_rows(
                sd["model.embed_tokens.weight" if tied else "lm_head.weight"], rows, k)
    return out
