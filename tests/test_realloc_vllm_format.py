# Checks reallocation into vLLM's live per-rank storage format (vllm_config: blocked q|k|v and
# gate|up, vocab padded to 64, kv heads replicated when tp > nkv) from trainer layouts, bit for bit
# against tests/support/oracle.py, at the minimum network bytes.
# A failure points to csrc/planner/geometry.cpp (segments / source_segments with replicate_units),
# planner.cpp or dp_shard.cpp (formats on dp-sharded sides), real_py/spec (TPRule.replicate_units,
# vllm_config) or real_py/realloc/shard.py (tp_slice, gather_full).
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from support.oracle import (
    held_indices,
    index_buffer,
    oracle_flat,
    random_dp_layout,
    random_full,
    tiny_spec,
)

from real_py import Layout, ModelConfig, ModelShard, gather_full, model_spec, plan_realloc
from real_py.interop.adapters import megatron_config
from real_py.realloc import InProcessHub, run_in_process
from real_py.spec import TPRule, vllm_config

# Qwen2-style GQA (q|k|v bias): 8 q heads, 2 kv heads of 4; tp 4 and 8 replicate the kv heads.
GQA2 = ModelConfig(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=500,
    num_hidden_layers=4,
    attention_bias=True,
    model_type="qwen2",
)
# 4 kv heads (a tp4 trainer), untied and tied, vocab 1000.
GQA4 = dataclasses.replace(GQA2, num_key_value_heads=4, vocab_size=1000)
GQA4_TIED = dataclasses.replace(GQA4, tie_word_embeddings=True, attention_bias=False)


def _min_network_elems(src_model, src, dst_model, dst) -> int:
    """Elements a destination rank needs that its own source shard does not hold (oracle)."""
    total = 0
    for r in dst.ranks:
        need = index_buffer(dst_model, dst, r)
        need = need[need >= 0]
        if r in src.ranks:
            need = need[~torch.isin(need, index_buffer(src_model, src, r))]
        total += need.numel()
    return total


def check_move(
    src_model,
    src: Layout,
    dst_model,
    dst: Layout,
    seed: int = 0,
    mode: str = "p2p",
    bucket_bytes: int = 1 << 16,
):
    full = random_full(src_model, seed)
    plan = plan_realloc(src_model, src, dst, dst_model=dst_model, mode=mode)
    srcs = {r: ModelShard.from_full(src_model, src, r, full) for r in src.ranks}
    dsts = {r: ModelShard.empty(dst_model, dst, r) for r in dst.ranks}
    run_in_process(InProcessHub(timeout=20), plan, srcs, dsts, bucket_bytes=bucket_bytes)
    for r in dst.ranks:
        assert torch.equal(dsts[r].flat, oracle_flat(dst_model, dst, r, full)), (
            f"{src} -> {dst} ({mode}): rank {r} differs from the oracle"
        )
    s = plan.summary()
    assert s["network_bytes"] == s["min_network_bytes"], s
    assert (
        s["network_bytes"]
        == _min_network_elems(src_model, src, dst_model, dst) * src_model.element_size
    )
    for r in set(src.ranks) & set(dst.ranks):
        assert all(r not in m.peers for m in plan.for_rank(r).sends), f"rank {r} sends to itself"
    return plan, dsts, full


def test_vllm_vocab_padding_arithmetic():
    # vLLM: pad 500 rows to 512 (a multiple of 64), split evenly. tp=2: rank 1 holds rows
    # 256..499 and 12 zero rows; tp=1: 512 rows.
    for tp, rows in ((1, 512), (2, 256), (4, 128), (8, 64)):
        spec = model_spec(vllm_config(GQA2, tp))
        p = spec.param("embed_tokens.weight")
        assert p.local_shape(tp) == (rows, 32), tp
        assert rows * tp == 512
    p = model_spec(vllm_config(GQA2, 2)).param("lm_head.weight")
    held = held_indices(p, 2, 1).view(256, 32)[:, 0]
    assert held[:244].tolist() == [r * 32 for r in range(256, 500)]
    assert (held[244:] == -1).all()
    # 1000 rows: 1024 padded; tp=4 rank 3 holds rows 768..999 and 24 zero rows.
    p = model_spec(vllm_config(GQA4, 4)).param("embed_tokens.weight")
    assert p.local_shape(4) == (256, 32)
    assert int((held_indices(p, 4, 3).view(256, 32)[:, 0] < 0).sum()) == 24


def test_replicated_kv_rows_by_hand():
    # q|k|v of 8|2|2 heads x 4 rows at tp=8: rank k holds q head k, kv head k // 4.
    p = model_spec(vllm_config(GQA2, 8)).param("layers.0.self_attn.qkv_proj.weight")
    assert p.tp.replicate_units and p.local_shape(8) == (12, 32)
    rows = held_indices(p, 8, 5).view(12, 32)[:, 0] // 32
    assert rows.tolist() == [20, 21, 22, 23, 36, 37, 38, 39, 44, 45, 46, 47]
    bias = model_spec(vllm_config(GQA2, 4)).param("layers.0.self_attn.qkv_proj.bias")
    assert held_indices(bias, 4, 1).tolist() == [*range(8, 16), 32, 33, 34, 35, 40, 41, 42, 43]
    # tp <= nkv: the flag changes nothing
    p2 = model_spec(vllm_config(GQA2, 2)).param("layers.0.self_attn.qkv_proj.weight")
    assert torch.equal(held_indices(p2, 2, 1), held_indices(model_spec(GQA2).param(p2.name), 2, 1))


def test_vllm_shards_and_gather_match_oracle():
    for cfg in (GQA2, GQA4_TIED):
        for tp in (1, 2, 4, 8):
            model = model_spec(vllm_config(cfg, tp))
            full = random_full(model, tp)
            layout = Layout(tp=tp)
            shards = [ModelShard.from_full(model, layout, r, full) for r in layout.ranks]
            for s in shards:
                assert torch.equal(s.flat, oracle_flat(model, layout, s.rank, full)), (tp, s.rank)
            for name, t in gather_full(model, shards).items():
                assert torch.equal(t, full[name]), (tp, name)


# (name, trainer config, trainer layout, vLLM tp): blocked trainers, a Megatron-format one
# (grouped q|k|v, vocab padded to 128 x tp), FSDP2 and ZeRO-3 sharded ones.
CASES = [
    ("tp2pp2 -> tp1", GQA2, "dp1,tp2,pp2", 1),
    ("tp2pp2 -> tp2", GQA2, "dp1,tp2,pp2", 2),
    ("tp2pp2 -> tp4 (kv x2)", GQA2, "dp1,tp2,pp2", 4),
    ("tp2pp2 -> tp8 (kv x4)", GQA2, "dp1,tp2,pp2", 8),
    ("megatron dp2pp2 -> tp2", megatron_config(GQA2), "dp2,tp1,pp2", 2),
    ("megatron dp2pp2 -> tp4", megatron_config(GQA2), "dp2,tp1,pp2", 4),
    ("megatron tp2 -> tp8", megatron_config(GQA4), "dp2,tp2,pp1", 8),
    ("fsdp2 dp4 -> tp1", GQA2, "dp4,dim0", 1),
    ("fsdp2 dp4 -> tp4", GQA2, "dp4,dim0", 4),
    ("fsdp2 dp4 -> tp8", GQA4_TIED, "dp4,dim0", 8),
    ("zero3 dp4 -> tp2", GQA4, "dp4,flat", 2),
    ("zero3 dp4 -> tp8", GQA2, "dp4,flat", 8),
    ("fsdp2 dp2tp2 -> tp4", GQA4, "dp2,tp2,dim0", 4),
    ("tp4 -> tp8 (kv x2)", GQA4, "tp4", 8),
    ("tp4 -> tp4", GQA4_TIED, "dp2,tp4", 4),
]


@pytest.mark.parametrize("name,cfg,src_text,tp", CASES, ids=[c[0] for c in CASES])
def test_trainer_to_vllm_bitwise(name, cfg, src_text, tp):
    train, gen = model_spec(cfg), model_spec(vllm_config(cfg, tp))
    src = Layout.parse(src_text)
    plan, dsts, full = check_move(train, src, gen, Layout(tp=tp), seed=tp)
    for k, v in gather_full(gen, list(dsts.values())).items():
        assert torch.equal(v, full[k]), k
    # vLLM engines with dp replicas on other ranks, broadcast grouping and small buckets
    check_move(
        train,
        src,
        gen,
        Layout(dp=2, tp=tp, ranks=tuple(range(3, 3 + 2 * tp))),
        seed=1,
        mode="broadcast",
        bucket_bytes=512,
    )


@pytest.mark.parametrize(
    "src_tp,dst_text",
    [
        (8, "dp1,tp2,pp2"),
        (4, "dp4,dim0"),
        (8, "dp4,flat"),
        (8, "vllm tp4"),
        (4, "vllm tp8"),
        (2, "dp2,tp1,pp2"),
    ],
)
def test_vllm_format_as_source(src_tp, dst_text):
    # Replicated kv heads on the source: each row is sent by one of its holders, held rows are
    # local copies (back to a trainer, or vLLM to vLLM at another tp).
    gen = model_spec(vllm_config(GQA2, src_tp))
    dst = Layout.parse(dst_text.removeprefix("vllm "))
    other = (
        model_spec(vllm_config(GQA2, dst.tp)) if dst_text.startswith("vllm") else model_spec(GQA2)
    )
    check_move(gen, Layout(tp=src_tp), other, dst, seed=src_tp)


def test_random_dp_sharded_pairs_across_formats():
    """Seeded random pairs, either side dp-sharded or not, between storage formats (grouped
    q|k|v, interleaved gate|up, vocab padding), against the oracle at the minimum bytes."""
    formats = [
        {},
        {"qkv_layout": "megatron_grouped", "vocab_pad_multiple": 8},
        {"gate_up_layout": "interleaved", "vocab_pad_multiple": 4},
        {"kv_head_replicas": True},
    ]
    rng = random.Random(29)
    for i in range(40):
        a, b = rng.choice(formats), rng.choice(formats)
        kw = rng.choice([{"tied": True}, {"bias": True}, {"head": "value", "layers": 3}])
        src_model, dst_model = tiny_spec(**kw, **a), tiny_spec(**kw, **b)
        src, dst = (random_dp_layout(rng, 8, src_model.num_layers) for _ in range(2))
        check_move(
            src_model,
            src,
            dst_model,
            dst,
            seed=i,
            mode=("p2p", "broadcast")[i % 2],
            bucket_bytes=rng.choice([512, 1 << 16]),
        )


def test_bad_inputs_name_the_cause():
    with pytest.raises(ValueError, match=r"tp=3 does not divide vLLM's vocab padding of 64"):
        vllm_config(GQA2, 3)
    with pytest.raises(ValueError, match=r"tp=4 is above num_key_value_heads=3 and not a multiple"):
        vllm_config(
            dataclasses.replace(
                GQA2, hidden_size=48, num_attention_heads=12, num_key_value_heads=3
            ),
            4,
        )
    with pytest.raises(ValueError, match=r"tp=16 does not divide num_attention_heads=8"):
        vllm_config(GQA2, 16)
    with pytest.raises(ValueError, match=r"tp=0 must be a positive int"):
        vllm_config(GQA2, 0)
    with pytest.raises(ValueError, match=r"kv_head_replicas.*qkv_layout='blocked'"):
        dataclasses.replace(GQA2, qkv_layout="megatron_grouped", kv_head_replicas=True)
    with pytest.raises(ValueError, match=r"replicate_units needs a split rule"):
        TPRule(kind="vocab", replicate_units=True)
    with pytest.raises(ValueError, match=r"replicate_units needs a split rule"):
        TPRule(
            kind="split", blocks=(4, 2), units=(("h", 2), ("kv", 1)), groups=1, replicate_units=True
        )
    # A spec with replicated kv heads and tp not a multiple of nkv: the plan names the rule.
    odd = model_spec(
        dataclasses.replace(
            GQA2,
            hidden_size=48,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=48,
            kv_head_replicas=True,
        )
    )
    with pytest.raises(
        ValueError,
        match=r"tp=6 is above num_key_value_heads=4 and not a multiple of it "
        r"\(replicate_units",
    ):
        plan_realloc(odd, Layout(tp=2), Layout(tp=6))
    # Without the flag tp > nkv stays refused as before.
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads=2"):
        plan_realloc(model_spec(GQA2), Layout(tp=2), Layout(tp=4))


def test_storage_flag_is_compatible_with_blocked_trainer_spec():
    # The flag is storage only: a blocked trainer spec and a vLLM-format spec plan together, and
    # a real disagreement (shape) is still refused.
    model_spec(GQA2).check_compatible(model_spec(vllm_config(GQA2, 8)), storage=True)
    with pytest.raises(ValueError, match="disagree on .*tp"):
        model_spec(GQA2).check_compatible(model_spec(vllm_config(GQA2, 8)))


def test_hf_names_of_replicated_kv_shard():
    # A vLLM tp8 rank's fused tensors under HF names: q_proj one head, k_proj / v_proj its whole
    # kv head; and back (from_hf_state_dict) to the same fused tensors.
    from real_py.interop.adapters import from_hf_state_dict, to_hf_state_dict

    gen = model_spec(vllm_config(GQA2, 8))
    layout = Layout(tp=8)
    full = random_full(gen, 2)
    shard = ModelShard.from_full(gen, layout, 5, full)
    hf = to_hf_state_dict(shard.params(), gen, layout, 5)
    pre = "model.layers.1.self_attn."
    assert torch.equal(hf[pre + "q_proj.weight"], full["layers.1.self_attn.qkv_proj.weight"][20:24])
    assert torch.equal(hf[pre + "k_proj.weight"], full["layers.1.self_attn.qkv_proj.weight"][36:40])
    assert torch.equal(hf[pre + "v_proj.bias"], full["layers.1.self_attn.qkv_proj.bias"][44:48])
    back = from_hf_state_dict(hf, gen, layout, 5)
    assert all(torch.equal(back[k], v) for k, v in shard.params().items())
