"""Mixture-of-experts layouts (ep, etp) and their reallocation, checked against
tests/support/oracle.py.

Every destination piece is compared bit for bit with the oracle's slice of the full tensors
(expert pieces by the oracle's own folding math), and each plan's network bytes with the
oracle's count of what destination ranks need and do not hold."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from support.oracle import (
    expert_oracle,
    min_network_elems_moe,
    oracle_flat,
    random_full,
    random_moe_layout,
)

from real_py import Layout, ModelShard
from real_py.layout import expert_shard_layout
from real_py.realloc import ExpertShard, InProcessHub, plan_moe_realloc, plan_realloc
from real_py.realloc.moe_exec import MoeReallocator, run_moe_in_process
from real_py.realloc.moe_plan import expert_views
from real_py.spec import ModelConfig, model_spec
from real_py.testing import run_distributed

MOE = model_spec("moe-tiny")
L = Layout.parse

PAIRS = [  # (src, dst): training -> generation and back, ep changes, replication, etp
    ("dp4,ep4", "tp4,etp4"),  # ep4 tp1 -> experts split by tp
    ("tp4,etp4", "dp4,ep4"),
    ("dp2,tp2,ep2", "tp2,dp2,ep4"),  # ep = tp x dp on the destination
    ("dp2,tp2,ep4", "dp2,tp2,ep2"),  # expert replication over expert-dp
    ("dp4,ep2,etp2", "dp2,tp2,ep2"),
    ("dp2,tp1,pp2,ep2", "tp2,pp2,ep2"),  # pipeline stages
    ("dp4,ep4", "dp4,ep4"),  # nothing moves
]


def _execute(model, src, dst, full):
    """MoeReallocator on every rank in process (1 KiB bucket: many merged rounds); every
    destination buffer against the oracle, sources untouched."""
    plan = plan_moe_realloc(model, src, dst)
    srcs, dsts = _moe_shards(model, src, dst, full)
    before = {r: (s.flat.clone(), e.flat.clone()) for r, (s, e) in srcs.items()}
    run_moe_in_process(InProcessHub(timeout=30), plan, srcs, dsts, bucket_bytes=1 << 12)
    _check_against_oracle(model, src, dst, full, srcs, dsts, before)
    return plan


@pytest.mark.parametrize("src,dst", PAIRS)
def test_moe_pairs_bitwise_and_minimal(src, dst):
    src, dst = L(src), L(dst)
    plan = _execute(MOE, src, dst, random_full(MOE, 3))
    s = plan.summary()
    assert s["network_bytes"] == s["min_network_bytes"]
    assert s["network_bytes"] == min_network_elems_moe(MOE, src, dst) * MOE.element_size


def test_moe_random_pairs():
    """Random MoE layout pairs (ep, etp, tp, dp, pp, rank orders): bytes equal the oracle's
    minimum on all; a third executed bit for bit."""
    rng = random.Random(26)
    full = random_full(MOE, 7)
    for i in range(30):
        src = random_moe_layout(rng, 8, MOE)
        dst = random_moe_layout(rng, 8, MOE)
        plan = plan_moe_realloc(MOE, src, dst)
        assert (
            plan.summary()["network_bytes"]
            == min_network_elems_moe(MOE, src, dst) * MOE.element_size
        ), f"pair {i} {src} -> {dst}"
        if i % 3 == 0:
            _execute(MOE, src, dst, full)


def test_expert_storage_views():
    """Per-expert HF tensors and stacked grouped-GEMM tensors view the same expert-shard bytes."""
    lay = L("dp2,tp2,ep2,etp2")
    full = random_full(MOE, 5)
    for r in lay.ranks:
        _, ep_rank, _, stage = lay.expert_coords(r)
        sl = expert_shard_layout(MOE, lay, stage, ep_rank)
        flat = torch.zeros(sl.numel)
        want = expert_oracle(MOE, lay, r, full)
        for e in sl.entries:
            flat[e.offset : e.offset + e.numel] = want[e.param.name].reshape(-1)
        per = expert_views(MOE, lay, r, flat, "per_expert")
        stacked = expert_views(MOE, lay, r, flat, "stacked")
        mixtral = expert_views(MOE, lay, r, flat, "mixtral")
        Im, H = MOE.config.moe_intermediate_size, MOE.config.hidden_size
        k = r % 2  # etp index: i = dp * tp + tp_idx, etp fastest
        for j in range(ep_rank * 4, ep_rank * 4 + 4):
            name = f"layers.1.mlp.experts.{j}."
            g = full[name + "gate_up_proj.weight"]
            assert torch.equal(per[name + "gate_proj.weight"], g[k * Im // 2 : (k + 1) * Im // 2])
            assert torch.equal(
                per[name + "up_proj.weight"], g[Im + k * Im // 2 : Im + (k + 1) * Im // 2]
            )
            mx = name.replace(".mlp.", ".block_sparse_moe.")
            assert torch.equal(mixtral[mx + "w3.weight"], per[name + "up_proj.weight"])
            assert torch.equal(mixtral[mx + "w2.weight"], per[name + "down_proj.weight"])
            assert torch.equal(
                mixtral[mx + "w2.weight"],
                full[name + "down_proj.weight"][:, k * Im // 2 : (k + 1) * Im // 2],
            )
        gu = stacked["layers.1.mlp.experts.gate_up_proj.weight"]
        assert gu.shape == (4, Im, H)
        assert torch.equal(
            gu,
            torch.stack(
                [
                    want[f"layers.1.mlp.experts.{j}.gate_up_proj.weight"]
                    for j in range(ep_rank * 4, ep_rank * 4 + 4)
                ]
            ),
        )
        down = stacked["layers.2.mlp.experts.down_proj.weight"]
        assert down.shape == (4, H, Im // 2)


def test_moe_bad_layouts_and_configs():
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=8"):
        plan_moe_realloc(MOE, L("dp3,ep3"), L("dp1"))
    with pytest.raises(ValueError, match=r"ep4 x etp2 = 8 expert ranks must divide the 4"):
        L("dp4,ep4,etp2")
    with pytest.raises(ValueError, match="etp=32.*moe_intermediate_size=16"):
        plan_moe_realloc(MOE, L("dp32,etp32"), L("dp1"))
    with pytest.raises(ValueError, match="has no experts"):
        plan_realloc(model_spec("llama2-7b"), L("dp2"), L("dp2,ep2"))
    with pytest.raises(ValueError, match="plan_moe_realloc"):
        plan_realloc(MOE, L("dp2"), L("dp2"))
    with pytest.raises(ValueError, match="axis ep given more than once"):
        L("dp4,ep2,ep4")
    with pytest.raises(ValueError, match="Layout.etp=0"):
        Layout(dp=2, etp=0)
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        ModelConfig(
            hidden_size=8,
            intermediate_size=8,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=11,
            num_hidden_layers=1,
            num_experts=8,
            moe_intermediate_size=4,
            num_experts_per_tok=9,
        )
    assert str(L("dp4,tp2,pp1,ep8")) == "dp4tp2pp1ep8" and L("dp4tp2pp1ep8") == L(
        "dp4,tp2,ep8,etp1"
    )


def _dist_executor(rank: int, world: int, verify: bool = False, bucket: int = 1 << 12) -> int:
    """MoeReallocator on the rank's own ModelShard + ExpertShard (gloo): destination dense buffer
    and expert tensors against the oracle, sources untouched."""
    import torch.distributed as dist

    from real_py.realloc import ExpertShard
    from real_py.realloc.moe_exec import MoeReallocator
    from real_py.realloc.transports.dist import DistTransport

    t = DistTransport(dist.group.WORLD, timeout=60)
    full = random_full(MOE, 13)
    checked = 0
    for src, dst in (
        ("dp2,ep2", "tp2"),
        ("tp2", "dp2,ep2"),
        ("dp2,tp2,ep4", "dp2,pp2,ep2"),
        ("dp2,tp2,ep2", "tp2,dp2,etp2"),
        ("tp2,dp2,etp2", "dp2,tp2,ep2"),
        ("dp4,ep4", "tp4,etp4"),
        ("dp2,tp2,ep2", "dp4,ep4"),
        ("dp4,ep4", "tp2,dp2,etp2"),
        ("tp2,pp2,ep2", "dp4,ep4"),  # stacked experts
        ("tp2,pp2,etp2", "dp4,ep4"),
    ):  # one expert part per stage window
        src, dst = L(src), L(dst)
        s = ModelShard.from_full(MOE, src, rank, full) if rank in src.ranks else None
        se = ExpertShard.from_full(MOE, src, rank, full) if rank in src.ranks else None
        before = None if s is None else (s.flat.clone(), se.flat.clone())
        d = ModelShard.empty(MOE, dst, rank) if rank in dst.ranks else None
        de = ExpertShard.empty(MOE, dst, rank) if rank in dst.ranks else None
        r = MoeReallocator(plan_moe_realloc(MOE, src, dst), t, bucket_bytes=bucket, verify=verify)
        assert r.opts.pipeline  # gloo is asynchronous: two staging halves
        st = r.run(s, se, d, de, free_source=verify)
        assert st["staging_bytes"] <= bucket
        if verify and s is not None:  # free_source: released once every round completed
            assert (
                s.flat.untyped_storage().nbytes() == 0 and se.flat.untyped_storage().nbytes() == 0
            )
            s = se = None
        if before is not None and s is not None:
            assert torch.equal(s.flat, before[0]) and torch.equal(se.flat, before[1]), (
                f"rank {rank} source"
            )
        if d is not None:
            checked += _check_destination(MOE, src, dst, rank, full, d, de)
    return checked


@pytest.mark.dist
def test_moe_reallocator_on_expert_shards_gloo():
    out = run_distributed(_dist_executor, 4, timeout=300)
    assert all(n > 0 for n in out)


def _dist_executor_verify(rank: int, world: int) -> int:
    return _dist_executor(rank, world, verify=True, bucket=1 << 10)


@pytest.mark.dist
def test_moe_merged_gloo_verify_tiny_bucket():
    """Merged rounds on 4 gloo ranks with checksums, a 1 KiB bucket (many merged rounds, direct
    pieces in their rounds) and free_source."""
    out = run_distributed(_dist_executor_verify, 4, timeout=300)
    assert all(n > 0 for n in out)


# The merged schedule: every part's rounds run together (executor.py, rounds.py).

MERGED_PAIRS = [  # ep grows, shrinks, vanishes, appears; etp; stages
    ("dp4,ep4", "tp4,etp4"),
    ("tp4,etp4", "dp4,ep4"),
    ("dp2,tp2,ep2", "tp2,dp2,ep4"),
    ("dp2,tp2,ep4", "dp2,tp2,ep2"),
    ("dp4,ep2,etp2", "dp2,tp2,ep2"),
    ("dp2,tp1,pp2,ep2", "tp2,pp2,ep2"),
    ("tp2,pp2,ep2", "dp4,ep4"),
    ("dp4,ep4", "dp1,tp2,pp2,ep2"),  # stacked experts (etp1)
    ("tp2,pp2,ep2", "dp4,tp2,ep4,etp2"),  # one expert part per window
]


def test_moe_parts():
    """One expert part for all layers when every ep group of a pipelined side holds one expert
    range, or (etp1 on both sides) one of stacked experts; else one per window of layers cut by
    both sides' stages."""
    parts = lambda s, d: [p.label for p in plan_moe_realloc(MOE, L(s), L(d)).parts]
    assert parts("dp4,ep4", "tp4,etp4") == ["dense", "experts of layers [0, 3)"]
    assert parts("dp2,tp1,pp2,ep2", "tp2,pp2,ep2") == ["dense", "experts of layers [0, 3)"]
    assert parts("tp2,pp2,ep2", "dp4,ep4") == ["dense", "experts stacked"]
    assert parts("tp2,pp2,ep2", "dp4,tp2,ep4,etp2") == [
        "dense",
        "experts of layers [0, 2)",
        "experts of layers [2, 3)",
    ]


def _moe_shards(model, src, dst, full):
    srcs = {
        r: (ModelShard.from_full(model, src, r, full), ExpertShard.from_full(model, src, r, full))
        for r in src.ranks
    }
    dsts = {
        r: (ModelShard.empty(model, dst, r), ExpertShard.empty(model, dst, r)) for r in dst.ranks
    }
    return srcs, dsts


def _check_destination(model, src, dst, rank, full, d, e) -> int:
    """`rank`'s destination ModelShard d and ExpertShard e against slicing the full tensors (the
    full model's ModelShard holds the dense tensors of its own stages); returns the expert
    tensors compared."""
    assert torch.equal(d.flat, oracle_flat(model, replace(dst, ep=1, etp=1), rank, full)), (
        f"{src}->{dst}: dense buffer of rank {rank} differs from the oracle"
    )
    want = expert_oracle(model, dst, rank, full)
    assert set(e.params()) == set(want)
    for name, v in want.items():
        assert torch.equal(e.view(name), v), f"{src}->{dst}: {name} on rank {rank} differs"
    return len(want)


def _check_against_oracle(model, src, dst, full, srcs, dsts, before):
    for r, (s, e) in srcs.items():
        assert torch.equal(s.flat, before[r][0]) and torch.equal(e.flat, before[r][1]), (
            f"{src}->{dst}: source of rank {r} modified"
        )
    for r, (d, e) in dsts.items():
        _check_destination(model, src, dst, r, full, d, e)


@pytest.mark.parametrize("src,dst", MERGED_PAIRS)
@pytest.mark.parametrize(
    "kw",
    [
        dict(bucket_bytes=1 << 10, pipeline=True, verify=True),
        dict(bucket_bytes=1 << 12, direct_min_bytes=64, one_pass=False),
        dict(bucket_bytes=1 << 10, one_pass=False),
        dict(),
    ],
)
def test_moe_merged_in_process(src, dst, kw):
    """All parts as one schedule on the in-process transport, bit for bit against the oracle:
    tiny buckets (hundreds of merged rounds), pipelined halves with checksums, direct pieces,
    and the default: one pass (one compiled copy per rank over dense and expert buffers)."""
    src, dst = L(src), L(dst)
    full = random_full(MOE, 17)
    plan = plan_moe_realloc(MOE, src, dst)
    srcs, dsts = _moe_shards(MOE, src, dst, full)
    before = {r: (s.flat.clone(), e.flat.clone()) for r, (s, e) in srcs.items()}
    stats = run_moe_in_process(InProcessHub(timeout=60), plan, srcs, dsts, **kw)
    _check_against_oracle(MOE, src, dst, full, srcs, dsts, before)
    for r, st in stats.items():
        assert st["staging_bytes"] <= kw.get("bucket_bytes", 256 << 20), (
            f"rank {r}: {st['staging_bytes']}"
        )
    if kw.get("bucket_bytes") == 1 << 10 and plan.summary()["network_bytes"] > 64 << 10:
        assert (
            max(st["rounds"] for st in stats.values()) > 20
        )  # the merged-round logic is exercised


@pytest.mark.parametrize(
    "src,dst",
    MERGED_PAIRS[:4] + MERGED_PAIRS[6:] + [("dp8,ep8", "dp2,tp4,etp2"), ("dp2,tp4,ep4", "dp8,ep2")],
)
@pytest.mark.parametrize("bucket,dmin", [(1 << 10, 0), (1 << 11, 64), (1 << 9, 0)])
def test_moe_transfers_are_the_executed_schedule(src, dst, bucket, dmin):
    """MoePlan.transfers (what the cluster simulator replays) lists, per rank and merged round,
    exactly the chunks each rank's MoeReallocator sends and receives (derived per rank)."""
    src, dst = L(src), L(dst)
    plan = plan_moe_realloc(MOE, src, dst)
    hub = InProcessHub()
    ex = {
        r: MoeReallocator(
            plan, hub.transport(r), bucket_bytes=bucket, direct_min_bytes=dmin, one_pass=False
        )
        for r in sorted(set(src.ranks) | set(dst.ranks))
    }
    opts = ex[0].opts
    t = plan.transfers(opts.round_elems, opts.direct_min_elems)
    es = MOE.element_size
    want: dict = {}
    for i in range(len(t.round)):
        k, nb = int(t.round[i]), int(t.nbytes[i])
        want.setdefault((int(t.sender[i]), k, "send"), []).append(nb)
        for r in t.receivers[t.recv_ptr[i] : t.recv_ptr[i + 1]].tolist():
            want.setdefault((r, k, "recv"), []).append(nb)
    got: dict = {}
    for r, x in ex.items():
        for k, lanes in x.runner.merged:
            for _, rr in lanes:
                if rr.sends:
                    got.setdefault((r, k, "send"), []).extend(c.numel * es for c in rr.sends)
                if rr.recvs:
                    got.setdefault((r, k, "recv"), []).extend(c.numel * es for c in rr.recvs)
            sent = sum(c.numel for _, rr in lanes for c in rr.sends)
            received = sum(c.numel for _, rr in lanes for c in rr.recvs)
            # one round's budget per rank and direction, whatever the number of parts
            assert sent <= opts.round_elems // 2 and received <= opts.round_elems // 2, (r, k)
        assert x.runner.half <= opts.round_elems
    assert got == want
    assert t.num_rounds == max((k for x in ex.values() for k, _ in x.runner.merged), default=-1) + 1


def test_moe_merged_verify_names_rank_round_and_part():
    """A bit flipped in flight in a merged round: the receiver raises naming itself, the round,
    the part and the peer; its peers stop waiting and name it; sources stay intact."""
    import re
    import threading

    from real_py.realloc import TransferError
    from real_py.realloc.transports.inprocess import InProcessTransport

    class Flip(InProcessTransport):
        def exchange(self, sends, recvs, step):
            super().exchange(sends, recvs, step)
            if step == "merged round 3" and recvs:
                recvs[0][1].view(torch.uint8)[0] ^= 4

    src, dst = L("dp4,ep4"), L("tp4,etp4")
    full = random_full(MOE, 19)
    plan = plan_moe_realloc(MOE, src, dst)
    srcs, dsts = _moe_shards(MOE, src, dst, full)
    before = {r: (s.flat.clone(), e.flat.clone()) for r, (s, e) in srcs.items()}
    hub, errors = InProcessHub(timeout=10), {}

    def work(r):
        t = Flip(hub, r) if r == 2 else hub.transport(r)
        try:
            MoeReallocator(plan, t, bucket_bytes=1 << 10, verify=True).run(
                *srcs[r], *dsts[r], free_source=True
            )
        except Exception as e:
            errors[r] = e
            hub.fail(r, str(e))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(isinstance(e, TransferError) for e in errors.values()), errors
    assert len(errors) > 1, f"only {sorted(errors)} failed: the peers of rank 2 must fail too"
    errors = {r: str(e) for r, e in errors.items()}
    assert re.match(
        r"rank 2: merged round 3: checksum mismatch on chunk 0 of the round "
        r"\((dense|experts[^)]*\)), "
        r"plan message \d+, \d+ elements\) from peer rank \d:",
        errors[2],
    ), errors[2]
    assert all(
        "peer rank 2 failed during merged round" in m for r, m in errors.items() if r != 2
    ), errors
    for r in errors:  # free_source never frees on failure
        s, e = srcs[r]
        assert torch.equal(s.flat, before[r][0]) and torch.equal(e.flat, before[r][1]), r


def test_moe_rank_in_layout_without_shards_is_named():
    """A rank of the source layout that passes no shards fails before anything moves, naming
    itself and the layout; its peers stop waiting and name it; sources stay intact."""
    src, dst = L("dp4,ep4"), L("tp4,etp4")
    full = random_full(MOE, 23)
    plan = plan_moe_realloc(MOE, src, dst)
    srcs, dsts = _moe_shards(MOE, src, dst, full)
    before = {r: (s.flat.clone(), e.flat.clone()) for r, (s, e) in srcs.items()}
    srcs_missing = {r: v for r, v in srcs.items() if r != 1}
    # run_moe_in_process raises rank 0's error: it names rank 1 and rank 1's own ValueError
    from real_py.realloc import TransferError

    with pytest.raises(
        TransferError,
        match=r"rank 0: peer rank 1 failed during one-pass copy \(ValueError: "
        r"rank 1 is in the source layout dp4tp1pp1ep4 but passed no source",
    ):
        run_moe_in_process(InProcessHub(timeout=30), plan, srcs_missing, dsts)
    for r, (s, e) in srcs_missing.items():
        assert torch.equal(s.flat, before[r][0]) and torch.equal(e.flat, before[r][1]), r


@pytest.mark.parametrize("one_pass", [None, False], ids=["one-pass", "rounds"])
def test_moe_replaced_expert_flat_is_named(one_pass):
    """An ExpertShard whose flat buffer was replaced by a float64 one (its constructor never saw
    it) fails before anything moves, naming the rank, the shard and both dtypes."""
    src, dst = L("dp2,ep2"), L("tp2,etp2")
    plan = plan_moe_realloc(MOE, src, dst)
    srcs, dsts = _moe_shards(MOE, src, dst, random_full(MOE, 5))
    experts = srcs[0][1]
    numel = experts.flat.numel()
    experts.flat = experts.flat.double()
    with pytest.raises(
        ValueError,
        match=rf"source expert shard of rank 0 \({MOE.name}, {src}\): its flat buffer "
        rf"is \({numel},\) torch.float64; the plan needs a 1-D contiguous torch.float32 buffer "
        rf"of {numel} elements",
    ):
        run_moe_in_process(InProcessHub(timeout=30), plan, srcs, dsts, one_pass=one_pass)


@pytest.mark.parametrize("src", ["dp2,tp2,ep2", "dp4,ep4", "dp2,pp2,ep2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_moe_into_vllm_format(src, tp):
    """An MoE trainer layout into vLLM's live format (dense tensors: vocab padded to 64 rows,
    replicated kv heads past num_key_value_heads; every expert on every worker, split by tp),
    bit for bit against the oracle on the destination's own spec, at the minimum bytes."""
    from real_py.spec import vllm_config

    dst_model = model_spec(vllm_config(MOE.config, tp))
    dst = Layout(tp=tp, etp=tp, ranks=tuple(range(4, 4 + tp)))
    src = L(src)
    full = random_full(MOE, 23)
    plan = plan_moe_realloc(MOE, src, dst, dst_model=dst_model)
    srcs = {
        r: (ModelShard.from_full(MOE, src, r, full), ExpertShard.from_full(MOE, src, r, full))
        for r in src.ranks
    }
    dsts = {
        r: (ModelShard.empty(dst_model, dst, r), ExpertShard.empty(dst_model, dst, r))
        for r in dst.ranks
    }
    run_moe_in_process(
        InProcessHub(timeout=60), plan, srcs, dsts, bucket_bytes=1 << 12, one_pass=False
    )
    for r, (d, e) in dsts.items():
        _check_destination(dst_model, src, dst, r, full, d, e)
    s = plan.summary()
    assert s["network_bytes"] == s["min_network_bytes"]
