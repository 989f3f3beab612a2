"""Interop example: a trainer holding a transformers LlamaForCausalLM sharded by hand (tp2 pp2)
hands its per-rank state dict to a generation layout (dp4) and takes it back, bit for bit; once
with HF names, once as Megatron-core local state dicts (q|k|v fused per kv group, vocab padded to
128 x tp, layers numbered per stage).

    python examples/trainer_interop.py          # spawns 4 gloo ranks on this machine (CPU)

Under torchrun on a cluster the worker is the same: build the two specs and layouts, call
from_megatron_state_dict(model.state_dict(), ...) on each rank, reallocate_params, and
to_hf_state_dict / to_megatron_state_dict on the way out. tests/test_interop_dist.py runs this
file's `worker` in CI. The hand sharding below is written from HF semantics alone (no real_py
slicing code), so the example doubles as an independent check.
"""

from __future__ import annotations

import torch


def tiny_llama(tied: bool, seed: int = 0):
    """(HF config dict, full HF state dict) of a small GQA LlamaForCausalLM (8 q / 4 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=4,
        vocab_size=200,
        num_hidden_layers=4,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).float()
    return model.config.to_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _vocab_rows(t: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    part = t[k * rows : (k + 1) * rows]
    out[: len(part)] = part
    return out


def hf_rank_dict(
    sd: dict, tp: int, k: int, layers: range, first: bool, last: bool, tied: bool
) -> dict:
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
        for n in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
        ):
            out[p + n] = sd[p + n].chunk(tp, 0)[k].clone()
        for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            out[p + n] = sd[p + n].chunk(tp, 1)[k].clone()
    if last:
        out["model.norm.weight"] = sd["model.norm.weight"].clone()
        out["lm_head.weight"] = _vocab_rows(
            sd["model.embed_tokens.weight" if tied else "lm_head.weight"], rows, k
        )
    return out


def megatron_rank_dict(
    sd: dict, cfg: dict, tp: int, k: int, layers: range, first: bool, last: bool, tied: bool
) -> dict:
    """TP rank k of the stage holding `layers`, as Megatron-core names it."""
    V, H = sd["model.embed_tokens.weight"].shape
    nkv, hd = cfg["num_key_value_heads"], cfg["head_dim"]
    qpg = cfg["num_attention_heads"] // nkv
    rows = -(-V // (128 * tp)) * 128
    out = {}
    if first:
        out["embedding.word_embeddings.weight"] = _vocab_rows(
            sd["model.embed_tokens.weight"], rows, k
        )
    for local, i in enumerate(layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        q = sd[p + "self_attn.q_proj.weight"].view(nkv, qpg * hd, H)
        kk = sd[p + "self_attn.k_proj.weight"].view(nkv, hd, H)
        v = sd[p + "self_attn.v_proj.weight"].view(nkv, hd, H)
        grouped = torch.cat([q, kk, v], 1)  # [ng, (np/ng + 2) * hn, h] as Megatron splits it
        out[m + "self_attention.linear_qkv.weight"] = grouped.chunk(tp, 0)[k].reshape(-1, H).clone()
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = sd[
            p + "input_layernorm.weight"
        ].clone()
        out[m + "self_attention.linear_proj.weight"] = (
            sd[p + "self_attn.o_proj.weight"].chunk(tp, 1)[k].clone()
        )
        out[m + "self_attention.core_attention._extra_state"] = torch.empty(0)
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [
                sd[p + "mlp.gate_proj.weight"].chunk(tp, 0)[k],
                sd[p + "mlp.up_proj.weight"].chunk(tp, 0)[k],
            ]
        )
        out[m + "mlp.linear_fc1.layer_norm_weight"] = sd[
            p + "post_attention_layernorm.weight"
        ].clone()
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"].chunk(tp, 1)[k].clone()
    if last:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
        if not tied or not first:  # pp=1 with tied embeddings: Megatron has no output_layer.weight
            out["output_layer.weight"] = _vocab_rows(
                sd["model.embed_tokens.weight" if tied else "lm_head.weight"], rows, k
            )
    return out


def _check_equal(got: dict, want: dict, what: str) -> None:
    want = {k: v for k, v in want.items() if not k.endswith("._extra_state")}
    if sorted(got) != sorted(want):
        raise AssertionError(f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}")
    for k, v in want.items():
        if not torch.equal(got[k], v):
            raise AssertionError(f"{what}: {k} differs")


def worker(rank: int, world: int, models: dict) -> dict:
    """One rank: trainer (tp2 pp2) -> generation (dp4) -> trainer, for each model and naming."""
    import torch.distributed as dist

    from real_py import Layout, ModelConfig, model_spec, plan_realloc, stage_layer_ranges
    from real_py.interop.adapters import (
        from_hf_state_dict,
        from_megatron_state_dict,
        megatron_config,
        megatron_layout,
        to_hf_state_dict,
        to_megatron_state_dict,
    )
    from real_py.interop.embed import reallocate_params
    from real_py.realloc.reallocator import Reallocator
    from real_py.realloc.transports.dist import DistTransport

    transport = DistTransport(dist.group.WORLD, timeout=60)
    train_layout, gen_layout = megatron_layout(tp=2, pp=2), Layout(dp=4)
    _, k, stage = train_layout.coords(rank)
    done = []
    for tied, (cfg, sd) in sorted(models.items()):
        gen = model_spec(ModelConfig.from_hf(cfg))  # blocked q|k|v, what real_py's engines run
        for naming in ("hf", "megatron"):
            if naming == "hf":
                train = model_spec(ModelConfig.from_hf(cfg))
                lo, hi = stage_layer_ranges(train, 2, None, "layers")[stage]
                mine = hf_rank_dict(sd, 2, k, range(lo, hi), stage == 0, stage == 1, tied)
                params = from_hf_state_dict(mine, train, train_layout, rank)
            else:
                train = model_spec(megatron_config(ModelConfig.from_hf(cfg)))
                lo, hi = stage_layer_ranges(train, 2, None, "layers")[stage]
                mine = megatron_rank_dict(
                    sd, cfg, 2, k, range(lo, hi), stage == 0, stage == 1, tied
                )
                params = from_megatron_state_dict(mine, train, train_layout, rank)
            # The opt-in check: the trainer's fused tensors against the checkpoint it loaded.
            reference = from_hf_state_dict(sd, gen)
            forward = plan_realloc(train, train_layout, gen_layout, dst_model=gen)
            gen_params = reallocate_params(Reallocator(forward, transport), params, check=reference)
            _check_equal(
                to_hf_state_dict(gen_params, gen, gen_layout, rank),
                sd,
                f"rank {rank} {naming} tied={tied} generation side",
            )
            back = plan_realloc(gen, gen_layout, train_layout, dst_model=train)
            again = reallocate_params(Reallocator(back, transport), gen_params)
            if naming == "hf":
                _check_equal(
                    to_hf_state_dict(again, train, train_layout, rank),
                    mine,
                    f"rank {rank} hf tied={tied} back on the trainer",
                )
            else:
                _check_equal(
                    to_megatron_state_dict(again, train, train_layout, rank),
                    mine,
                    f"rank {rank} megatron tied={tied} back on the trainer",
                )
            done.append(f"{naming} tied={tied}: {len(mine)} tensors there and back")
    return {"rank": rank, "done": done}


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
    from real_py.testing import run_distributed

    models = {tied: tiny_llama(tied) for tied in (False, True)}
    for out in run_distributed(worker, 4, models, timeout=300):
        print(f"rank {out['rank']}: " + "; ".join(out["done"]))
    print("all ranks bit for bit: trainer tp2pp2 -> generation dp4 -> trainer")
