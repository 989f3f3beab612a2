# Checks real_py.interop.adapters in one process: HF-named and Megatron-core-named per-rank dicts
# (built by hand in examples/trainer_interop.py from a transformers LlamaForCausalLM) map to exactly
# the local tensors tests/support/oracle.py says the rank holds, and back; bad dicts raise
# ValueError naming the key and the expected shape / order / pipeline split, leaving the dict
# untouched. A failure points to real_py/interop/adapters.py, the Megatron conventions in it, or
# Layout.partition.
import sys
from pathlib import Path

import pytest
import torch

from real_py import Layout, ModelConfig, model_spec, shard_layout, stage_layer_ranges
from real_py.interop.adapters import (
    from_hf_state_dict,
    from_megatron_state_dict,
    megatron_config,
    megatron_layout,
    to_hf_state_dict,
    to_megatron_state_dict,
)
from real_py.interop.embed import shard_from_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from support.oracle import oracle_flat
from trainer_interop import hf_rank_dict, megatron_rank_dict, tiny_llama

MODELS = {tied: tiny_llama(tied) for tied in (False, True)}


def fused_full(model, sd: dict) -> dict:
    """Full project tensors from a full HF dict, fused by hand (blocked: q|k|v, gate|up)."""
    out = {}
    for p in model.params:
        n = p.name
        if ".qkv_proj." in n:
            out[n] = torch.cat(
                [sd["model." + n.replace("qkv_proj", x)] for x in ("q_proj", "k_proj", "v_proj")]
            )
        elif ".gate_up_proj." in n:
            out[n] = torch.cat(
                [sd["model." + n.replace("gate_up_proj", x)] for x in ("gate_proj", "up_proj")]
            )
        else:
            out[n] = sd[n if n == "lm_head.weight" else "model." + n]
    return out


def oracle_params(model, layout, rank, full) -> dict:
    _, _, stage = layout.coords(rank)
    flat = oracle_flat(model, layout, rank, full)
    return {
        e.param.name: flat[e.offset : e.offset + e.numel].view(e.local_shape)
        for e in shard_layout(model, layout, stage).entries
    }


def rank_dicts(kind: str, tied: bool, layout: Layout, rank: int):
    cfg, sd = MODELS[tied]
    _, k, stage = layout.coords(rank)
    base = ModelConfig.from_hf(cfg)
    model = model_spec(megatron_config(base) if kind == "megatron" else base)
    lo, hi = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)[stage]
    args = (sd, layout.tp, k, range(lo, hi), stage == 0, stage == layout.pp - 1, tied)
    d = (
        megatron_rank_dict(sd, cfg, *args[1:2], k, *args[3:])
        if kind == "megatron"
        else hf_rank_dict(*args)
    )
    return model, fused_full(model, sd), d


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", ["hf", "megatron"])
def test_rank_dicts_map_to_oracle_and_back(kind, tied):
    for layout in (
        megatron_layout(tp=2, pp=2),
        megatron_layout(tp=4),
        megatron_layout(tp=1, pp=4),
        megatron_layout(dp=2, tp=2),
    ):
        for rank in layout.ranks:
            model, full, d = rank_dicts(kind, tied, layout, rank)
            before = {k: v.clone() for k, v in d.items()}
            frm, to = (
                (from_megatron_state_dict, to_megatron_state_dict)
                if kind == "megatron"
                else (from_hf_state_dict, to_hf_state_dict)
            )
            params = frm(d, model, layout, rank)
            want = oracle_params(model, layout, rank, full)
            assert list(sorted(params)) == sorted(want), (kind, layout, rank)
            for name, t in want.items():
                assert torch.equal(params[name], t), f"{kind} {layout} rank {rank}: {name}"
            back = to(params, model, layout, rank)
            d = {k: v for k, v in d.items() if not k.endswith("._extra_state")}
            assert sorted(back) == sorted(d), (kind, layout, rank, sorted(set(back) ^ set(d)))
            for key, t in d.items():
                assert torch.equal(back[key], t), f"{kind} {layout} rank {rank}: {key}"
            assert all(torch.equal(before[k], v) for k, v in d.items()), "input dict modified"


def test_full_hf_dict_round_trip():
    cfg, sd = MODELS[True]
    model = model_spec(ModelConfig.from_hf(cfg))
    params = from_hf_state_dict(sd, model)
    full = fused_full(model, sd)
    assert sorted(params) == sorted(full) and all(torch.equal(params[n], full[n]) for n in full)
    back = to_hf_state_dict(params, model)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_megatron_dict_declared_blocked_refused():
    model, _, d = rank_dicts("megatron", False, megatron_layout(tp=2, pp=2), 0)
    blocked = model_spec(ModelConfig.from_hf(MODELS[False][0], vocab_pad_multiple=128))
    with pytest.raises(
        ValueError,
        match=r"qkv_layout='blocked', but Megatron-core's linear_qkv is grouped "
        r"per kv group; build the spec from megatron_config",
    ):
        from_megatron_state_dict(d, blocked, megatron_layout(tp=2, pp=2), 0)


def test_megatron_bad_shapes_and_numbering_named():
    layout = megatron_layout(tp=2, pp=2)
    model, _, d = rank_dicts("megatron", False, layout, 0)
    before = {k: v.clone() for k, v in d.items()}
    bad = dict(d)
    bad["embedding.word_embeddings.weight"] = d["embedding.word_embeddings.weight"][
        :100
    ]  # padded to tp only
    with pytest.raises(
        ValueError,
        match=r"embedding\.word_embeddings\.weight: shape \(100, 32\), expected "
        r"\(128, 32\) \(tp rank 0 of dp1tp2pp2, vocab 200 padded to a "
        r"multiple of 128 x tp=2\)",
    ):
        from_megatron_state_dict(bad, model, layout, 0)
    bad = dict(d)
    bad["decoder.layers.0.self_attention.linear_qkv.weight"] = d[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ][:-4]
    with pytest.raises(
        ValueError,
        match=r"decoder\.layers\.0\.self_attention\.linear_qkv\.weight: shape "
        r"\(28, 32\), expected \(32, 32\) \(.*rows grouped per kv group: "
        r"\[q heads, k, v\] x 2\)",
    ):
        from_megatron_state_dict(bad, model, layout, 0)
    # Global layer numbers on stage 1 (Megatron numbers each stage's layers from 0).
    _, _, d1 = rank_dicts("megatron", False, layout, 2)
    renum = {
        k.replace("decoder.layers.1.", "decoder.layers.3.").replace(
            "decoder.layers.0.", "decoder.layers.2."
        ): v
        for k, v in d1.items()
    }
    with pytest.raises(
        ValueError,
        match=r"decoder\.layers\.\d\.\S+: stage 1 of dp1tp2pp2 holds 2 layers "
        r"\(global 2\.\.3\) under the pipeline split partition='layers'",
    ):
        from_megatron_state_dict(renum, model, layout, 2)
    missing = {k: v for k, v in d.items() if "linear_fc2" not in k or ".1." not in k}
    with pytest.raises(
        ValueError, match=r"lacks \['decoder\.layers\.1\.mlp\.linear_fc2\.weight'\]"
    ):
        from_megatron_state_dict(missing, model, layout, 0)
    with pytest.raises(
        ValueError, match=r"decoder\.layers\.0\.mlp\.router\.weight: not a Megatron-core"
    ):
        from_megatron_state_dict(
            {**d, "decoder.layers.0.mlp.router.weight": torch.zeros(1)}, model, layout, 0
        )
    assert all(torch.equal(before[k], v) for k, v in d.items()) and d.keys() == before.keys()


def test_pipeline_split_named_when_dict_does_not_match():
    cfg, sd = MODELS[False]
    # A value-head spec: the last stage is light, so balancing by parameters gives stage 0 fewer
    # layers than Megatron's split by layer count.
    model = model_spec(ModelConfig.from_hf(cfg, head="value", vocab_size=4000))
    by_params, by_layers = Layout(pp=2), Layout(pp=2, partition="layers")
    assert stage_layer_ranges(model, 2, None, "params") != stage_layer_ranges(
        model, 2, None, "layers"
    )
    full = {p.name: torch.zeros(p.shape) for p in model.params}
    trainer = oracle_params(model, by_layers, 0, full)  # the trainer splits by layer count
    with pytest.raises(
        ValueError,
        match=r"missing \[\], unexpected \['layers\.1\.\S+.*the stage holds "
        r"layers 0\.\.0 under the pipeline split partition='params' "
        r"\(Megatron-core splits by layer count: Layout\(partition='layers'\)\)",
    ):
        shard_from_params(model, by_params, 0, trainer)
    shard_from_params(model, by_layers, 0, trainer)
    with pytest.raises(ValueError, match=r"partition='layers' needs pp=3 to divide num_layers=4"):
        shard_layout(model, Layout(pp=3, partition="layers"), 0)
    with pytest.raises(
        ValueError, match=r"Layout.partition='megatron'; allowed: \('params', 'layers'\)"
    ):
        Layout(pp=2, partition="megatron")


def test_hf_stage_local_layer_numbers():
    cfg, sd = MODELS[False]
    model = model_spec(ModelConfig.from_hf(cfg))
    layout = Layout(tp=2, pp=2, partition="layers")
    d = hf_rank_dict(sd, 2, 1, range(2, 4), False, True, False)
    local = {
        k.replace("layers.2.", "layers.0.").replace("layers.3.", "layers.1."): v
        for k, v in d.items()
    }
    params = from_hf_state_dict(local, model, layout, 3, stage_local_layers=True)
    assert params.keys() == from_hf_state_dict(d, model, layout, 3).keys()
    assert "layers.3.mlp.down_proj.weight" in params
    back = to_hf_state_dict(params, model, layout, 3, stage_local_layers=True)
    assert sorted(back) == sorted(local) and all(torch.equal(back[k], v) for k, v in local.items())


def test_hf_bad_keys_named():
    layout = Layout(tp=2)
    cfg, sd = MODELS[False]
    model = model_spec(ModelConfig.from_hf(cfg))
    d = hf_rank_dict(sd, 2, 1, range(4), True, True, False)
    with pytest.raises(
        ValueError, match=r"model\.layers\.2\.self_attn\.v_proj\.weight: missing, needed with"
    ):
        from_hf_state_dict(
            {k: v for k, v in d.items() if k != "model.layers.2.self_attn.v_proj.weight"},
            model,
            layout,
            1,
        )
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.self_attn\.k_proj\.weight: shape \(16, 32\), "
        r"expected \(8, 32\) \(tp rank 1 of dp1tp2pp1\)",
    ):
        from_hf_state_dict(
            {
                **d,
                "model.layers.0.self_attn.k_proj.weight": sd[
                    "model.layers.0.self_attn.k_proj.weight"
                ],
            },
            model,
            layout,
            1,
        )
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.experts\.weight: not a parameter of"
    ):
        from_hf_state_dict(
            {**d, "model.layers.0.mlp.experts.weight": torch.zeros(1)}, model, layout, 1
        )
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.2\.input_layernorm\.weight: layers\.2\.input_layernorm"
        r"\.weight is not on stage 0 of dp1tp1pp2 \(pipeline split "
        r"partition='params'\)",
    ):
        from_hf_state_dict(
            hf_rank_dict(sd, 1, 0, range(4), True, False, False), model, Layout(pp=2), 0
        )
