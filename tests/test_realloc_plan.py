"""Checks the C++ transfer planner against an independent oracle (no process group).

A failure points to the planner (csrc/planner/), the layout/shard offsets
(real_py/layout/shards.py), or sender selection: a destination element uncovered, covered twice, or
sent when held locally.
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.oracle import (
    data_mask,
    min_network_elems,
    oracle_flat,
    random_full,
    random_layout,
    tiny_spec,
)

from real_py import Layout, ModelShard, model_spec, plan_realloc
from real_py.spec import ModelConfig


def run_plan(plan, src_flats: dict[int, torch.Tensor], dst_numel: dict[int, int]):
    """Follow only the plan's descriptors: returns (dst flats, per-rank write counts)."""
    out = {
        r: torch.zeros(n, dtype=next(iter(src_flats.values())).dtype) for r, n in dst_numel.items()
    }
    hits = {r: np.zeros(n, np.int64) for r, n in dst_numel.items()}

    def apply(src, dst, hit, descs):
        for so, do, ln, n, ss, ds in descs.tolist():
            si = (so + np.arange(n)[:, None] * ss + np.arange(ln)[None, :]).reshape(-1)
            di = (do + np.arange(n)[:, None] * ds + np.arange(ln)[None, :]).reshape(-1)
            dst[torch.from_numpy(di)] = src[torch.from_numpy(si)]
            np.add.at(hit, di, 1)

    for m in range(plan.num_messages):
        for r in plan.receivers(m):
            apply(src_flats[int(plan.msg_sender[m])], out[r], hits[r], plan.message_descs(m))
    for i, r in enumerate(plan.local_rank.tolist()):
        apply(
            src_flats[r],
            out[r],
            hits[r],
            plan.descs[plan.local_desc_ptr[i] : plan.local_desc_ptr[i + 1]],
        )
    return out, hits


def check_pair(model, src: Layout, dst: Layout, mode: str = "p2p", seed: int = 0, **opts):
    full = random_full(model, seed)
    plan = plan_realloc(model, src, dst, mode=mode, **opts)
    src_flats = {r: oracle_flat(model, src, r, full) for r in src.ranks}
    dst_numel = {r: ModelShard.empty(model, dst, r).flat.numel() for r in dst.ranks}
    got, hits = run_plan(plan, src_flats, dst_numel)
    for r in dst.ranks:
        want = oracle_flat(model, dst, r, full)
        assert torch.equal(got[r], want), f"{src}->{dst} {mode}: rank {r} differs from the oracle"
        mask = data_mask(model, dst, r).numpy()
        assert (hits[r][mask] == 1).all(), f"rank {r}: data element not covered exactly once"
        assert (hits[r][~mask] == 0).all(), f"rank {r}: padding written"
    s = plan.summary()
    es = model.element_size
    assert s["network_bytes"] == min_network_elems(model, src, dst) * es, (
        "network bytes above minimum"
    )
    assert s["network_bytes"] == s["min_network_bytes"]
    assert (
        s["local_bytes"] + s["network_bytes"]
        == sum(int(data_mask(model, dst, r).sum()) for r in dst.ranks) * es
    )
    for r in set(src.ranks) & set(dst.ranks):
        for m in plan.for_rank(r).sends:
            assert r not in m.peers, f"rank {r} sends to itself over the network"
    return plan


def L(text, ranks=None, **kw):
    layout = Layout.parse(text, **kw)
    return Layout.parse(text, ranks=tuple(ranks), **kw) if ranks is not None else layout


TIED, UNTIED, BIAS = tiny_spec(tied=True), tiny_spec(), tiny_spec(bias=True)
VALUE = tiny_spec(head="value")
NAMED = {
    "tp-only dp1tp2pp1->dp1tp6pp1": (UNTIED, L("dp1,tp2,pp1"), L("dp1,tp6,pp1")),
    "pp-only dp1tp1pp4->dp1tp1pp2": (UNTIED, L("dp1,tp1,pp4"), L("dp1,tp1,pp2")),
    "dp-only dp2tp1pp1->dp4tp1pp1": (UNTIED, L("dp2,tp1,pp1"), L("dp4,tp1,pp1")),
    "mixed dp2tp2pp1->dp1tp2pp2": (BIAS, L("dp2,tp2,pp1"), L("dp1,tp2,pp2")),
    "identical dp2tp2pp2": (TIED, L("dp2,tp2,pp2"), L("dp2,tp2,pp2")),
    "disjoint dp1tp2pp2->dp2tp2pp1@4..7": (UNTIED, L("dp1,tp2,pp2"), L("dp2,tp2,pp1", range(4, 8))),
    "overlapping dp2tp3pp1->dp1tp2pp2@3..6": (
        BIAS,
        L("dp2,tp3,pp1"),
        L("dp1,tp2,pp2", range(3, 7)),
    ),
    "non-dividing tp3->tp2": (UNTIED, L("dp1,tp3,pp1"), L("dp1,tp2,pp1")),
    "non-dividing tp6->tp4-like(tp2 pp2)": (BIAS, L("dp1,tp6,pp1"), L("dp2,tp2,pp1")),
    "fused-gqa-qkv tp1->tp6": (BIAS, L("dp1,tp1,pp1"), L("dp1,tp6,pp1")),
    "tied pp1->pp3": (TIED, L("dp2,tp1,pp1"), L("dp1,tp2,pp3")),
    "tied pp2->pp1 tp3": (TIED, L("dp1,tp1,pp2"), L("dp2,tp3,pp1")),
    "padded-vocab tp2->tp3 (101 rows)": (UNTIED, L("dp1,tp2,pp1"), L("dp1,tp3,pp1")),
    "value-head dp2tp2pp2->dp1tp1pp1": (VALUE, L("dp2,tp2,pp2"), L("dp1,tp1,pp1", [7])),
    "reversed order": (UNTIED, L("dp2,tp2,pp1", order="pp-dp-tp"), L("dp1,tp2,pp2", [3, 2, 1, 0])),
    "explicit pp partition": (
        UNTIED,
        L("dp1,tp1,pp2", layers_per_stage=(1, 3)),
        L("dp1,tp1,pp2", layers_per_stage=(3, 1)),
    ),
}


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
@pytest.mark.parametrize("name", list(NAMED))
def test_named_pairs(name, mode):
    check_pair(*NAMED[name], mode=mode)


def test_random_pairs():
    """300+ seeded random pairs over random rank subsets of an 8-rank world, both modes."""
    rng = random.Random(1234)
    specs = [
        TIED,
        UNTIED,
        BIAS,
        VALUE,
        tiny_spec(tied=True, layers=3, vocab=97, dtype="bfloat16"),
        # Qwen3 q/k norms (replicated [hd]), LLaMA o_proj / mlp biases (replicated, split gate|up)
        tiny_spec(
            bias=True, qk_norm=True, o_proj_bias=True, mlp_bias=True, name="tiny-norms-biases"
        ),
        # OLMo 2: whole-projection q/k norms split by heads, norms after the sublayers
        tiny_spec(tied=True, qk_norm=True, qk_norm_whole=True, norm_after=True, name="tiny-olmo2"),
        # Gemma 3: sandwich norms (pre/post feed-forward, replicated) and per-head q/k norms
        tiny_spec(
            tied=True, qk_norm=True, sandwich_norm=True, norm_plus_one=True, name="tiny-gemma3"
        ),
    ]
    for i in range(512):
        model = specs[i % len(specs)]
        src = random_layout(rng, 8, model.num_layers)
        dst = random_layout(rng, 8, model.num_layers)
        check_pair(
            model,
            src,
            dst,
            mode=("p2p", "broadcast")[i % 2],
            seed=i,
            min_split_bytes=rng.choice([64, 1 << 20]),
        )


def test_row_split_is_one_descriptor_per_piece():
    """Row-parallel weights (split on dim 1) cost O(1) descriptors, not one per row."""
    model = model_spec(
        ModelConfig(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=64,
            num_hidden_layers=1,
        )
    )
    plan = plan_realloc(model, L("dp1,tp2,pp1"), L("dp1,tp4,pp1", range(2, 6)))
    # o_proj [256, 256] and down_proj [256, 512], tp 2 -> 4: each of the 4 receivers gets each
    # weight as ONE descriptor of 256 runs (64 and 128 elements long).
    row_descs = sorted((d[2], d[3]) for d in plan.descs.tolist() if d[3] > 1)
    assert row_descs == [(64, 256)] * 4 + [(128, 256)] * 4
    # At most one descriptor per (receiver, parameter block): qkv has 3 blocks, gate_up 2.
    assert len(plan.descs) <= 4 * (len(model.params) + 3)


def test_replicated_sent_once_per_receiver():
    """Norm weights (replicated) reach each receiver once, not once per source TP rank."""
    plan = check_pair(UNTIED, L("dp1,tp6,pp1"), L("dp1,tp1,pp1", [6]))
    h = UNTIED.config.hidden_size
    recv = sum(m.numel for m in plan.for_rank(6).recvs)
    data = sum(p.numel for p in UNTIED.params)
    assert recv == data  # exactly the model, no duplicates (norms would be 6x otherwise)
    assert h > 0


def test_pp_change_spreads_over_replicas():
    """dp2 -> dp1 with a PP change: both source replicas send, halving the busiest link."""
    model = model_spec(
        ModelConfig(
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=512,
            num_hidden_layers=4,
        )
    )
    plan = plan_realloc(model, L("dp2,tp1,pp2"), L("dp1,tp1,pp1", [4]))
    send = {r: v["send"] for r, v in plan.summary()["per_rank"].items() if r < 4}
    assert min(send.values()) > 0, f"a source replica sends nothing: {send}"
    assert max(send.values()) < 0.6 * sum(send.values()), send


def test_sender_balance_across_replicas():
    """dp4 -> dp4 with a TP change: egress is spread evenly over the source replicas."""
    model = tiny_spec(layers=4)
    plan = plan_realloc(model, L("dp4,tp1,pp1"), L("dp4,tp2,pp1", range(4, 12)))
    send = [v["send"] for r, v in plan.summary()["per_rank"].items() if r < 4]
    assert max(send) <= 1.5 * min(send), send


def test_ranks_per_node_prefers_same_node():
    """With nodes of 4 ranks, a receiver on node 1 pulls from the replica on its own node."""
    model = tiny_spec(layers=2)
    src = L("dp2,tp1,pp1", [0, 4])  # replica 0 on node 0, replica 1 on node 1
    dst = L("dp1,tp1,pp1", [5])  # receiver on node 1
    plan = plan_realloc(model, src, dst, ranks_per_node=4)
    assert {m.peers for m in plan.for_rank(5).recvs} == {(4,)}


def test_broadcast_groups_identical_receivers():
    model = tiny_spec(layers=2)
    plan = check_pair(model, L("dp1,tp2,pp1"), L("dp3,tp2,pp1", range(2, 8)), mode="broadcast")
    assert any(len(plan.receivers(m)) == 3 for m in range(plan.num_messages))


def _plan_digest(model_name: str, src: str, dst: str) -> str:
    plan = plan_realloc(model_spec(model_name), Layout.parse(src), Layout.parse(dst))
    h = hashlib.sha256()
    for a in (plan.descs, plan.msg_sender, plan.msg_receivers, plan.msg_desc_ptr, plan.local_rank):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@pytest.mark.dist
def test_plan_identical_across_processes():
    args = ("llama2-13b", "dp2,tp4,pp2", "dp4,tp2,pp2")
    code = (
        "import sys; sys.path.insert(0, 'tests'); from test_realloc_plan import _plan_digest; "
        f"print(_plan_digest(*{args!r}))"
    )
    root = str(Path(__file__).resolve().parent.parent)
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
            env={"PYTHONHASHSEED": str(seed)},
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert outs == {_plan_digest(*args)}


def test_plan_is_cached():
    a = plan_realloc(UNTIED, L("dp1,tp2,pp1"), L("dp2,tp1,pp1"))
    assert plan_realloc(UNTIED, L("dp1,tp2,pp1"), L("dp2,tp1,pp1")) is a


# ---------------------------------------------------------------------------- bad input


def test_tp_not_dividing_heads():
    with pytest.raises(
        ValueError,
        match=r"src layout dp1tp5pp1: tp=5 does not divide "
        r"num_attention_heads=12 of layers\.\*\.self_attn\.qkv_proj"
        r"\.weight; pick tp in \{1, 2, 3, 6",
    ):
        plan_realloc(UNTIED, L("dp1,tp5,pp1"), L("dp1,tp1,pp1"))


def test_tp_not_dividing_kv_heads():
    model = model_spec(
        ModelConfig(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=100,
            num_hidden_layers=2,
        )
    )
    with pytest.raises(
        ValueError, match=r"dst layout dp1tp4pp1: tp=4 does not divide num_key_value_heads=2"
    ):
        plan_realloc(model, L("dp1,tp1,pp1"), L("dp1,tp4,pp1"))


def test_tp_not_dividing_intermediate():
    model = model_spec(
        ModelConfig(
            hidden_size=64,
            intermediate_size=100,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=100,
            num_hidden_layers=2,
        )
    )
    with pytest.raises(
        ValueError, match=r"tp=8 does not divide intermediate_size=100 .*gate_up_proj"
    ):
        plan_realloc(model, L("dp1,tp8,pp1"), L("dp1,tp1,pp1"))


def test_pp_larger_than_layers():
    with pytest.raises(ValueError, match=r"pp=5 exceeds num_layers=4 .*pick pp in 1\.\.4"):
        plan_realloc(UNTIED, L("dp1,tp1,pp1"), L("dp1,tp1,pp5"))


def test_bad_explicit_partition():
    with pytest.raises(
        ValueError, match=r"layers_per_stage=\(1, 1\) sums to 2, but .* has 4 layers"
    ):
        plan_realloc(UNTIED, L("dp1,tp1,pp2", layers_per_stage=(1, 1)), L("dp1,tp1,pp1"))


def test_duplicate_ranks():
    with pytest.raises(ValueError, match=r"duplicates \[3\]"):
        Layout(dp=2, tp=1, pp=1, ranks=(3, 3))


def test_wrong_rank_count():
    with pytest.raises(ValueError, match=r"needs 4 ranks, got 3"):
        Layout(dp=2, tp=2, pp=1, ranks=(0, 1, 2))


def test_spec_mismatch_shape():
    other = model_spec(
        ModelConfig(
            hidden_size=24,
            intermediate_size=48,
            num_attention_heads=12,
            num_key_value_heads=6,
            head_dim=2,
            vocab_size=101,
            num_hidden_layers=4,
        )
    )
    with pytest.raises(
        ValueError, match=r"disagree on layers\.0\.mlp\.gate_up_proj\.weight\.shape"
    ):
        plan_realloc(UNTIED, L("dp1,tp1,pp1"), L("dp1,tp1,pp1"), dst_model=other)


def test_spec_mismatch_dtype():
    with pytest.raises(
        ValueError, match=r"disagree on embed_tokens\.weight\.dtype: src float32 vs dst bfloat16"
    ):
        plan_realloc(
            UNTIED, L("dp1,tp1,pp1"), L("dp1,tp1,pp1"), dst_model=tiny_spec(dtype="bfloat16")
        )


def test_spec_mismatch_names():
    with pytest.raises(
        ValueError, match=r"disagree on parameter names: only in src \['lm_head\.weight'\]"
    ):
        plan_realloc(UNTIED, L("dp1,tp1,pp1"), L("dp1,tp1,pp1"), dst_model=TIED)


def test_bad_mode():
    with pytest.raises(ValueError, match=r"mode='ring'; allowed"):
        plan_realloc(UNTIED, L("dp1,tp1,pp1"), L("dp1,tp1,pp1"), mode="ring")
