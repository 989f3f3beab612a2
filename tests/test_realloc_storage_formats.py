# Checks fused-tensor storage formats (qkv_layout blocked | megatron_grouped, gate_up_layout
# blocked | interleaved, vocab_pad_multiple) end to end in one process: the planner converts
# between two sides' formats exactly (bit for bit against tests/support/oracle.py's independent
# index math), shards / gather_full agree with the oracle, the opt-in check catches Megatron-ordered
# q|k|v declared blocked, bad formats are refused. A failure points to csrc/planner/geometry.cpp
# (segments with Format), real_py/realloc/plan.py (_layout_arrays, dst_model),
# real_py/spec/params.py (TPRule groups / vocab_multiple), real_py/realloc/shard.py or
# real_py/interop/adapters.py (check_against_full).
import json
import random

import pytest
import torch
from support.oracle import held_indices, oracle_flat, random_full, random_layout, tiny_spec

from real_py import Layout, ModelConfig, ModelShard, gather_full, model_spec, plan_realloc
from real_py.interop.adapters import check_against_full, megatron_config
from real_py.interop.embed import reallocate_params, shard_from_params
from real_py.realloc.reallocator import Reallocator, run_in_process
from real_py.realloc.transports import InProcessHub

FORMATS = [
    {},
    {"qkv_layout": "megatron_grouped"},
    {"gate_up_layout": "interleaved", "vocab_pad_multiple": 4},
    {"qkv_layout": "megatron_grouped", "gate_up_layout": "interleaved", "vocab_pad_multiple": 8},
]


def spec(fmt: dict, **kw):
    return tiny_spec(**kw, **fmt)


def test_oracle_grouped_order_by_hand():
    # q|k|v of 12|6|6 heads (head_dim 2) stored grouped by the 6 kv groups: group 0 is q heads 0-1
    # (rows 0..3), k head 0 (rows 24..25), v head 0 (rows 36..37); tp=3 rank 1 holds groups 2-3.
    p = spec({"qkv_layout": "megatron_grouped"}).param("layers.0.self_attn.qkv_proj.weight")
    rows = held_indices(p, 3, 1).view(-1, 24)[:, 0] // 24
    assert rows.tolist() == [8, 9, 10, 11, 28, 29, 40, 41, 12, 13, 14, 15, 30, 31, 42, 43]


def test_shards_and_gather_match_oracle_for_every_format():
    for fmt in FORMATS:
        for kw in ({"tied": True}, {"bias": True}):
            model = spec(fmt, **kw)
            full = random_full(model, 3)
            for text in ("tp1", "tp2", "tp3", "tp6"):
                layout = Layout.parse(text)
                shards = [ModelShard.from_full(model, layout, r, full) for r in layout.ranks]
                for s in shards:
                    assert torch.equal(s.flat, oracle_flat(model, layout, s.rank, full)), (
                        fmt,
                        text,
                        s.rank,
                    )
                for name, t in gather_full(model, shards).items():
                    assert torch.equal(t, full[name]), (fmt, text, name)


def test_random_pairs_across_formats_bitwise():
    """200 seeded random layout pairs, each between two (usually different) storage formats."""
    rng = random.Random(13)
    for i in range(200):
        a, b = rng.choice(FORMATS), rng.choice(FORMATS)
        kw = rng.choice(
            [{"tied": True}, {"bias": True}, {"head": "value"}, {"tied": True, "layers": 3}]
        )
        src_model, dst_model = spec(a, **kw), spec(b, **kw)
        full = random_full(src_model, i)
        src, dst = (random_layout(rng, 8, src_model.num_layers) for _ in range(2))
        plan = plan_realloc(
            src_model, src, dst, dst_model=dst_model, mode=("p2p", "broadcast")[i % 2]
        )
        srcs = {r: ModelShard.from_full(src_model, src, r, full) for r in src.ranks}
        dsts = {r: ModelShard.empty(dst_model, dst, r) for r in dst.ranks}
        run_in_process(
            InProcessHub(timeout=20), plan, srcs, dsts, bucket_bytes=rng.choice([512, 1 << 16])
        )
        for r in dst.ranks:
            assert torch.equal(dsts[r].flat, oracle_flat(dst_model, dst, r, full)), (
                f"pair {i} {a}->{b} {src}->{dst}: rank {r} differs from the oracle"
            )
        s = plan.summary()
        assert s["network_bytes"] >= s["min_network_bytes"] >= 0, (i, s)


def _run_params(plan, params_by_rank, check=None):
    hub, out, errors = InProcessHub(timeout=5), {}, {}
    import threading

    def work(r):
        try:
            out[r] = reallocate_params(
                Reallocator(plan, hub.transport(r)), params_by_rank.get(r), check=check
            )
        except BaseException as e:
            errors[r] = e
            hub.fail(r, str(e))

    threads = [threading.Thread(target=work, args=(r,)) for r in plan.ranks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, errors


def test_megatron_order_declared_blocked_is_caught_by_the_check():
    cfg = ModelConfig(
        hidden_size=24,
        intermediate_size=36,
        num_attention_heads=12,
        num_key_value_heads=6,
        head_dim=2,
        vocab_size=101,
        num_hidden_layers=2,
    )
    blocked, grouped = model_spec(cfg, "m"), model_spec(megatron_config(cfg), "m")
    full = random_full(blocked, 1)
    src, dst = Layout(tp=2), Layout(dp=2, ranks=(2, 3))
    # The trainer's tensors really are Megatron-ordered (and vocab padded to 128 x tp) ...
    megatron_shards = {r: ModelShard.from_full(grouped, src, r, full) for r in src.ranks}
    # ... declared right, the destination is exact, and the check passes.
    plan = plan_realloc(grouped, src, dst, dst_model=blocked)
    out, errors = _run_params(plan, {r: s.params() for r, s in megatron_shards.items()}, check=full)
    assert not errors, errors
    for r in dst.ranks:
        for name, t in out[r].items():
            assert torch.equal(t, full[name]), name
    # Declared blocked (same shapes once the vocab padding agrees): the check names the tensor.
    blocked_pad = model_spec(ModelConfig(**{**_fields(cfg), "vocab_pad_multiple": 128}), "m")
    plan = plan_realloc(blocked_pad, src, dst, dst_model=blocked)
    before = {r: s.flat.clone() for r, s in megatron_shards.items()}
    out, errors = _run_params(plan, {r: s.params() for r, s in megatron_shards.items()}, check=full)
    msg = str(errors[0])
    assert (
        isinstance(errors[0], ValueError)
        and "layers.0.self_attn.qkv_proj.weight" in msg
        and "megatron_grouped" in msg
        and "declares blocked" in msg
    ), msg
    assert all(torch.equal(s.flat, before[r]) for r, s in megatron_shards.items()), (
        "source modified"
    )
    # Without the check the same input goes through (silently wrong), which is why it exists.
    out, errors = _run_params(plan, {r: s.params() for r, s in megatron_shards.items()})
    assert not errors and not torch.equal(
        out[2]["layers.0.self_attn.qkv_proj.weight"], full["layers.0.self_attn.qkv_proj.weight"]
    )


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_check_against_full_counts_and_wrong_weights():
    model = spec({"qkv_layout": "megatron_grouped"}, bias=True)
    full = random_full(model, 2)
    layout = Layout(tp=3)
    params = ModelShard.from_full(model, layout, 1, full).params()
    # 4 layers x (qkv weight, qkv bias, gate_up) + embedding + lm head
    assert check_against_full(model, layout, 1, params, full) == 4 * 3 + 2
    params["layers.2.mlp.gate_up_proj.weight"] = params["layers.2.mlp.gate_up_proj.weight"] + 1
    with pytest.raises(
        ValueError, match=r"layers\.2\.mlp\.gate_up_proj\.weight on rank 1 .*wrong weights"
    ):
        check_against_full(model, layout, 1, params, full)


def test_bad_formats_refused():
    base = _fields(
        ModelConfig(
            hidden_size=24,
            intermediate_size=36,
            num_attention_heads=12,
            num_key_value_heads=6,
            head_dim=2,
            vocab_size=101,
            num_hidden_layers=2,
        )
    )
    with pytest.raises(
        ValueError, match=r"qkv_layout='grouped'; allowed: \('blocked', 'megatron_grouped'\)"
    ):
        ModelConfig(**{**base, "qkv_layout": "grouped"})
    with pytest.raises(ValueError, match=r"gate_up_layout='megatron'; allowed"):
        ModelConfig(**{**base, "gate_up_layout": "megatron"})
    with pytest.raises(ValueError, match=r"vocab_pad_multiple=0 must be a positive int"):
        ModelConfig(**{**base, "vocab_pad_multiple": 0})
    # tp=4 does not divide the 6 kv groups of the grouped q|k|v.
    with pytest.raises(ValueError, match=r"tp=4 does not divide"):
        plan_realloc(
            model_spec(ModelConfig(**{**base, "qkv_layout": "megatron_grouped"})),
            Layout(tp=1),
            Layout(tp=4),
        )
    # Specs that disagree beyond storage format are still refused.
    with pytest.raises(ValueError, match=r"disagree"):
        plan_realloc(
            model_spec(ModelConfig(**base)),
            Layout(tp=1),
            Layout(tp=2),
            dst_model=model_spec(ModelConfig(**{**base, "intermediate_size": 48})),
        )


def test_shard_from_params_names_expected_shape_for_padding():
    model = spec({"vocab_pad_multiple": 128})
    layout = Layout(tp=2)
    params = ModelShard.from_full(model, layout, 0, random_full(model, 0)).params()
    params["embed_tokens.weight"] = params["embed_tokens.weight"][:51]
    with pytest.raises(
        ValueError,
        match=r"embed_tokens\.weight: local shape \(51, 24\) on rank 0, "
        r"but dp1tp2pp1 tp rank 0 holds \(128, 24\)",
    ):
        shard_from_params(model, layout, 0, params)


def test_from_hf_honours_torch_dtype(tmp_path):
    cfg = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "vocab_size": 50,
        "num_hidden_layers": 2,
        "torch_dtype": "bfloat16",
    }
    assert ModelConfig.from_hf(cfg).dtype == "bfloat16"
    assert ModelConfig.from_hf({**cfg, "torch_dtype": None, "dtype": "float16"}).dtype == "float16"
    assert ModelConfig.from_hf(cfg, dtype="float32").dtype == "float32"
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "torch_dtype": "float64"}))
    assert ModelConfig.from_hf(tmp_path).dtype == "float64"
    with pytest.raises(ValueError, match=r"torch_dtype='float8_e4m3fn'"):
        ModelConfig.from_hf({**cfg, "torch_dtype": "float8_e4m3fn"})


def test_hf_checkpoint_loads_into_megatron_storage(tmp_path):
    # A trainer with Megatron storage can start from an HF checkpoint: slice-on-read follows the
    # spec's storage (grouped q|k|v, 128 x tp vocab padding), bit for bit against the oracle.
    from real_py.interop.hf import load_hf_shard, save_hf

    cfg = ModelConfig(
        hidden_size=24,
        intermediate_size=36,
        num_attention_heads=12,
        num_key_value_heads=6,
        head_dim=2,
        vocab_size=101,
        num_hidden_layers=2,
        attention_bias=True,
    )
    full = random_full(model_spec(cfg), 5)
    save_hf(tmp_path, cfg, full, model_type="qwen2")
    for meg in (megatron_config(cfg), megatron_config(cfg, vocab_pad_multiple=8)):
        model = model_spec(meg)
        for layout in (Layout(tp=3), Layout(tp=2, pp=2), Layout(tp=6)):
            for r in layout.ranks:
                got = load_hf_shard(tmp_path, meg, layout, r)
                assert torch.equal(got.flat, oracle_flat(model, layout, r, full)), (layout, r)


def test_engines_refuse_non_blocked_storage():
    from real_py.engines.engine import Engine

    cfg = ModelConfig(
        hidden_size=24,
        intermediate_size=36,
        num_attention_heads=12,
        num_key_value_heads=6,
        head_dim=2,
        vocab_size=101,
        num_hidden_layers=2,
    )
    for bad in (
        megatron_config(cfg),
        ModelConfig(**{**_fields(cfg), "gate_up_layout": "interleaved"}),
    ):
        with pytest.raises(ValueError, match=r"the engines compute on blocked fused tensors"):
            Engine(bad, Layout(), None, None)
