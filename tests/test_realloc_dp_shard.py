"""Checks dp-sharded layouts (FSDP2 dim-0 chunks, ZeRO-3 / FSDP1 flat split) as reallocation source
and destination.

A failure points to real_py/layout/dp_shard.py (dp_shard_layout), real_py/realloc/shard.py (dp
pieces), plan.py (entry ranges) or the C++ dp planner (csrc/planner/dp_shard.cpp); the oracle is
tests/support/oracle.py (index_buffer, torch.chunk).
"""

from __future__ import annotations

import random

import pytest
import torch
from support.oracle import min_network_elems, oracle_flat, random_dp_layout, random_full, tiny_spec
from test_realloc_plan import check_pair

from real_py import Layout, ModelShard, gather_full, plan_realloc
from real_py.dataflow.execplan import ExecutionPlan
from real_py.layout import dp_shard_layout
from real_py.realloc.reallocator import run_in_process
from real_py.realloc.transports import InProcessHub

TIED, BIAS, VALUE = tiny_spec(tied=True), tiny_spec(bias=True), tiny_spec(head="value")
BF16 = tiny_spec(tied=True, layers=3, vocab=97, dtype="bfloat16")
SPECS = [TIED, BIAS, VALUE, BF16, tiny_spec(layers=2, vocab=53, dtype="float64")]


def L(text, ranks=None, **kw):
    return Layout.parse(text, ranks=None if ranks is None else tuple(ranks), **kw)


NAMED = {
    "fsdp2 dp4-dim0 -> tp2pp2": (TIED, L("dp4,dim0"), L("tp2,pp2")),
    "tp2pp2 -> fsdp2 dp4-dim0": (TIED, L("tp2,pp2"), L("dp4,dim0")),
    "zero3 dp4-flat -> dp2tp2": (BIAS, L("dp4,flat"), L("dp2,tp2")),
    "dp2tp3 -> zero3 dp2tp3-flat (same ranks, local pieces)": (
        BIAS,
        L("dp2,tp3"),
        L("dp2,tp3,flat"),
    ),
    "dim0 -> flat, same dp": (VALUE, L("dp4,tp2,dim0"), L("dp4,tp2,flat")),
    "flat dp3 -> dim0 dp2 tp3, disjoint ranks": (
        BF16,
        L("dp3,flat"),
        L("dp2,tp3,dim0", range(3, 9)),
    ),
    "hsdp-like dp2tp2pp2-dim0 -> tp6 padded vocab": (BF16, L("dp2,tp2,pp2,dim0"), L("tp6")),
    "dim0 dp8 -> dp8 unsharded (all-gather)": (TIED, L("dp8,dim0"), L("dp8")),
    "dp8 unsharded -> flat dp8 (each keeps its piece)": (TIED, L("dp8"), L("dp8,flat")),
    "tied pp2 dim0 -> pp3 flat": (TIED, L("dp2,pp2,dim0"), L("dp2,pp3,flat", range(2, 8))),
}


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
@pytest.mark.parametrize("name", list(NAMED))
def test_named_pairs_plan(name, mode):
    """Plan only: oracle bit for bit, every destination element covered once, bytes = minimum."""
    check_pair(*NAMED[name], mode=mode)


def test_random_pairs_plan():
    """100 seeded random pairs, dp-sharded (dim0 / flat / none) on either side, planner
    invariants."""
    rng = random.Random(4242)
    for i in range(100):
        model = SPECS[i % len(SPECS)]
        src = random_dp_layout(rng, 8, model.num_layers)
        dst = random_dp_layout(rng, 8, model.num_layers)
        check_pair(
            model,
            src,
            dst,
            mode=("p2p", "broadcast")[i % 2],
            seed=i,
            min_split_bytes=rng.choice([64, 1 << 20]),
        )


def test_random_pairs_reallocator():
    """60 random pairs through the reallocator (in-process transport), sources untouched, bytes as
    planned."""
    rng = random.Random(77)
    for i in range(60):
        model = SPECS[i % len(SPECS)]
        full = random_full(model, i)
        src = random_dp_layout(rng, 8, model.num_layers)
        dst = random_dp_layout(rng, 8, model.num_layers)
        plan = plan_realloc(model, src, dst, mode=("p2p", "broadcast")[i % 2])
        srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
        before = {r: s.flat.clone() for r, s in srcs.items()}
        dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
        bucket = rng.choice([256, 1 << 12, 1 << 20])
        stats = run_in_process(InProcessHub(timeout=20), plan, srcs, dsts, bucket_bytes=bucket)
        tag = f"pair {i} {src}@{list(src.ranks)} -> {dst}@{list(dst.ranks)} bucket {bucket}"
        for r in src.ranks:
            assert torch.equal(srcs[r].flat, oracle_flat(model, src, r, full)), (
                f"{tag}: from_full rank {r}"
            )
            assert torch.equal(srcs[r].flat, before[r]), f"{tag}: source of rank {r} modified"
        for r in dst.ranks:
            assert torch.equal(dsts[r].flat, oracle_flat(model, dst, r, full)), (
                f"{tag}: rank {r} differs"
            )
        sent = sum(s["sent_bytes"] for s in stats.values())
        assert sent == plan.summary()["network_bytes"] or plan.mode == "broadcast", tag
        if plan.mode == "p2p":
            assert sent == min_network_elems(model, src, dst) * model.element_size, f"{tag}: bytes"


def test_round_trip_and_gather_full():
    """dp-sharded -> other -> the same dp-sharded layout restores every buffer; gather_full rebuilds
    the model."""
    rng = random.Random(5)
    for i in range(20):
        model = SPECS[i % len(SPECS)]
        full = random_full(model, 100 + i)
        a = random_dp_layout(rng, 8, model.num_layers)
        if a.dp_shard == "none":
            continue
        b = random_dp_layout(rng, 8, model.num_layers)
        srcs = {r: ModelShard.from_full(model, a, r, full) for r in a.ranks}
        mid = {r: ModelShard.empty(model, b, r) for r in b.ranks}
        run_in_process(
            InProcessHub(timeout=20), plan_realloc(model, a, b), srcs, mid, bucket_bytes=1 << 12
        )
        back = {r: ModelShard.empty(model, a, r) for r in a.ranks}
        run_in_process(
            InProcessHub(timeout=20),
            plan_realloc(model, b, a, mode="broadcast"),
            mid,
            back,
            bucket_bytes=1 << 16,
        )
        for r in a.ranks:
            assert torch.equal(back[r].flat, srcs[r].flat), f"round trip {a}->{b}->{a}: rank {r}"
        got = gather_full(model, back.values())
        assert all(torch.equal(got[k], full[k]) for k in full), f"gather_full of {a}"


def test_dim0_pieces_follow_torch_chunk():
    """FSDP2's rule: piece d of a local tensor is torch.chunk(t, dp, 0)[d] (empty past the last
    chunk), padded storage."""
    model = (
        TIED  # tp2 local tensors of 51 (vocab), 24, 18 and 12 rows: uneven and short last pieces
    )
    layout = L("dp8,tp2,dim0")
    full = random_full(model, 3)
    for d in range(8):
        shard = ModelShard.from_full(model, layout, layout.rank(d, 1, 0), full)
        whole = ModelShard.from_full(model, L("tp2"), 1, full)
        for name, v in shard.params().items():
            chunks = torch.chunk(whole.view(name), 8, 0)
            want = chunks[d] if d < len(chunks) else whole.view(name)[:0]
            assert torch.equal(v, want), f"{name} dp rank {d}"
    # Padded storage: each piece has room for ceil(rows / dp) rows.
    sl = dp_shard_layout(model, layout, 0, 7)
    emb = sl.piece("embed_tokens.weight")
    assert (
        emb.shape == (51 - 7 * 7, 24) and emb.offset == 0
    )  # 51 local rows: 7 per piece, last has 2


def test_layout_parse_and_errors():
    assert str(L("dp4,tp2,dim0")) == "dp4tp2pp1-dim0"
    assert L("dp4tp2pp1-flat") == Layout(dp=4, tp=2, dp_shard="flat")
    assert L("dp1,dim0").dp_shard == "none"  # nothing to shard over
    with pytest.raises(ValueError, match="dp_shard='rows'.*allowed"):
        Layout(dp=2, dp_shard="rows")
    with pytest.raises(ValueError, match="cannot parse layout"):
        Layout.parse("dp2,dim0,flat")
    with pytest.raises(ValueError, match="wrong.*must be 1-D|must be 1-D"):
        ModelShard(TIED, L("dp2,flat"), 0, torch.zeros(7))


def test_engines_and_runtime_refuse_dp_sharded():
    """Engines / the PPO runtime run on whole shards: a dp-sharded layout is refused with the
    reason."""
    with pytest.raises(ValueError, match="call actor_gen: layout dp2tp1pp1-dim0 is dp-sharded"):
        ExecutionPlan(world_size=2, calls={"actor_gen": L("dp2,dim0")})
    from real_py.engines.engine import Engine
    from real_py.interop.hf import load_hf_shard
    from real_py.spec import ModelConfig

    with pytest.raises(ValueError, match="load_hf_shard: layout dp4tp1pp1-dim0 is dp-sharded"):
        load_hf_shard("/nonexistent", None, L("dp4,dim0"), 0)
    layout = L("dp2,flat")
    shard = ModelShard.empty(TIED, layout, 0)
    with pytest.raises(ValueError, match="Engine: layout dp2tp1pp1-flat is dp-sharded"):
        Engine(
            ModelConfig(
                hidden_size=24,
                intermediate_size=36,
                num_attention_heads=12,
                num_key_value_heads=6,
                vocab_size=101,
                num_hidden_layers=4,
            ),
            layout,
            None,
            shard,
        )


class _Mesh:
    """Stand-in with DeviceMesh's two attributes (the 4-rank test uses a real DeviceMesh)."""

    def __init__(self, mesh, names):
        self.mesh, self.mesh_dim_names = mesh, names


def test_layout_from_fsdp_meshes():
    from real_py.interop.embed import layout_from_device_mesh

    # FSDP2 mesh with a trivial replicate dim (HSDP of one replica): dp_shard x tp.
    m = _Mesh(torch.arange(8).view(1, 4, 2), ("dp_replicate", "dp_shard", "tp"))
    assert layout_from_device_mesh(
        m, {"dp_replicate": "dp", "dp_shard": "dp_shard", "tp": "tp"}
    ) == Layout(dp=4, tp=2, dp_shard="dim0")
    # 1-D FSDP mesh under another name, ZeRO-3 style flat sharding.
    one = layout_from_device_mesh(
        _Mesh(torch.arange(4).flip(0), ("fsdp",)), {"fsdp": "dp_shard"}, dp_shard="flat"
    )
    # torch numbers a mesh dim's ranks in sorted order and FSDP2 shards by that number, so the
    # mesh [3, 2, 1, 0] holds dp pieces 0..3 on ranks 0..3 (tests/test_realloc_dp_shard_dist.py
    # checks this against fully_shard).
    assert one == Layout(dp=4, dp_shard="flat", ranks=(0, 1, 2, 3)), one
    assert (
        layout_from_device_mesh(_Mesh(torch.arange(4).view(2, 2), ("dp", "tp"))).dp_shard == "none"
    )
    with pytest.raises(ValueError, match=r"roles \['dp'\] are given to several mesh dims.*HSDP"):
        layout_from_device_mesh(
            _Mesh(torch.arange(8).view(2, 2, 2), ("dp_replicate", "dp_shard", "tp")),
            {"dp_replicate": "dp", "dp_shard": "dp_shard", "tp": "tp"},
        )
    with pytest.raises(ValueError, match="dp_shard='rows'"):
        layout_from_device_mesh(_Mesh(torch.arange(2), ("dp_shard",)), dp_shard="rows")


def test_shard_from_params_takes_fsdp_local_pieces():
    """A trainer's FSDP2 local tensors (dim-0 pieces) become a shard; wrong piece shapes are
    named."""
    from real_py.interop.embed import shard_from_params

    layout, full = L("dp4,tp2,dim0"), random_full(TIED, 1)
    want = ModelShard.from_full(TIED, layout, 7, full)
    got = shard_from_params(TIED, layout, 7, {k: v.clone() for k, v in want.params().items()})
    assert torch.equal(got.flat, want.flat)
    whole = ModelShard.from_full(TIED, L("tp2"), 1, full).params()
    with pytest.raises(
        ValueError,
        match=r"embed_tokens.weight: local shape \(51, 24\) on rank 7, but "
        r"dp4tp2pp1-dim0 tp rank 1 dp rank 3 \(its dp piece\) holds \(12, 24\)",
    ):
        shard_from_params(
            TIED, layout, 7, {**want.params(), "embed_tokens.weight": whole["embed_tokens.weight"]}
        )


def test_dp_sharded_layout_with_storage_format():
    # A Megatron-format spec (grouped q|k|v, vocab padded to 128 x tp) on a dp-sharded side, either
    # way: planned exactly (the boxes map through each side's segments), at the minimum bytes.
    from real_py import ModelConfig, model_spec
    from real_py.interop.adapters import megatron_config

    cfg = ModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        num_hidden_layers=2,
    )
    blocked, mega = model_spec(cfg), model_spec(megatron_config(cfg))
    for src_model, src, dst_model, dst in (
        (mega, Layout(dp=2, dp_shard="dim0"), blocked, Layout(dp=2)),
        (mega, Layout(tp=2), blocked, Layout(dp=2, dp_shard="dim0")),
        (blocked, Layout(dp=2), mega, Layout(dp=2, tp=2, dp_shard="flat")),
    ):
        full = random_full(src_model, 5)
        plan = plan_realloc(src_model, src, dst, dst_model=dst_model)
        srcs = {r: ModelShard.from_full(src_model, src, r, full) for r in src.ranks}
        dsts = {r: ModelShard.empty(dst_model, dst, r) for r in dst.ranks}
        run_in_process(InProcessHub(timeout=20), plan, srcs, dsts)
        for r in dst.ranks:
            assert torch.equal(dsts[r].flat, oracle_flat(dst_model, dst, r, full)), (src, dst, r)
        s = plan.summary()
        assert s["network_bytes"] == s["min_network_bytes"], (src, dst)


def test_dp_sharding_with_layer_count_split():
    """partition='layers' survives dp sharding (gather_full, reallocation vs the oracle) and plan
    JSON; a failure points to a place that rebuilds a Layout without its partition."""
    model = tiny_spec(layers=4, vocab=301, head="value")
    full = random_full(model, 7)
    a = Layout(dp=2, pp=2, dp_shard="dim0", partition="layers")
    b = Layout(tp=2, pp=2, partition="layers", ranks=(1, 3, 0, 2))
    srcs = {r: ModelShard.from_full(model, a, r, full) for r in a.ranks}
    got = gather_full(model, srcs.values())
    assert all(torch.equal(got[k], full[k]) for k in full)
    dst = {r: ModelShard.empty(model, b, r) for r in b.ranks}
    run_in_process(
        InProcessHub(timeout=20), plan_realloc(model, a, b), srcs, dst, bucket_bytes=1 << 12
    )
    for r in b.ranks:
        assert torch.equal(dst[r].flat, oracle_flat(model, b, r, full)), f"rank {r}"
    plan = ExecutionPlan.from_json(
        {
            "world_size": 4,
            "calls": {"x": {"ranks": [0, 1, 2, 3], "pp": 2, "dp": 2, "partition": "layers"}},
        }
    )
    assert ExecutionPlan.from_json(plan.to_json()).calls["x"].partition == "layers"
    # An explicit split leaves nothing for `partition` to choose: equal layouts compare equal.
    assert Layout(pp=2, layers_per_stage=(2, 2), partition="layers") == Layout(
        pp=2, layers_per_stage=(2, 2)
    )
    from real_py.layout import stage_layer_ranges

    with pytest.raises(ValueError, match="partition='layers' needs pp=3 to divide num_layers=4"):
        stage_layer_ranges(model, 3, None, "layers")


def test_adapters_refuse_dp_sharded_layouts():
    """The HF / Megatron adapters map whole TP-local tensors; a dp-sharded layout is refused by
    name."""
    from real_py.interop.adapters import from_hf_state_dict

    with pytest.raises(ValueError, match="dp-sharded: the adapters map whole TP-local tensors"):
        from_hf_state_dict({}, tiny_spec(), Layout(dp=2, dp_shard="dim0"), 0)
