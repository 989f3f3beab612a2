"""Shared pieces of the reallocation tests: specs, the named layout-pair table, one case of a
seeded random sweep, and one checked transfer (oracle comparison, source intact, byte counts,
staging bound)."""

from __future__ import annotations

import torch

from real_py import Layout, ModelShard, plan_realloc
from real_py.realloc.reallocator import Reallocator
from support.oracle import min_network_elems, oracle_flat, random_full, random_layout, tiny_spec

SPECS = [
    tiny_spec(tied=True),
    tiny_spec(bias=True),
    tiny_spec(head="value"),
    tiny_spec(tied=True, layers=3, vocab=97, dtype="bfloat16"),
    tiny_spec(layers=2, vocab=53, dtype="float64"),
    tiny_spec(layers=2, dtype="float16"),
]
TIED, BIAS, VALUE, BF16_PAD = SPECS[:4]


def L(text: str, ranks=None, **kw) -> Layout:
    return Layout.parse(text, ranks=ranks, **kw)


def named_pairs(world: int) -> list[tuple[str, object, Layout, Layout]]:
    """(id, model, src, dst) for every pair that fits in `world` ranks."""
    pairs = [
        ("tp-only tp2->dp2", TIED, L("tp2"), L("dp2")),
        ("pp-only pp2->tp2 (qkv bias)", BIAS, L("pp2"), L("tp2")),
        ("identical tp2", TIED, L("tp2"), L("tp2")),
        ("disjoint tp1@0->tp1@1", VALUE, L("tp1", (0,)), L("tp1", (1,))),
        ("swapped ranks tp2", BIAS, L("tp2", (0, 1)), L("tp2", (1, 0))),
    ]
    if world >= 4:
        pairs += [
            ("non-dividing tp3->tp2 overlapping", BIAS, L("tp3"), L("tp2", (2, 3))),
            ("non-dividing tp2->tp3", TIED, L("tp2"), L("tp3", (1, 2, 3))),
            ("pp-only pp2->pp4 tied embeddings", TIED, L("pp2"), L("pp4")),
            ("dp-only dp2->dp4", VALUE, L("dp2"), L("dp4")),
            ("mixed dp2tp2->pp4", TIED, L("dp2,tp2"), L("pp4")),
            (
                "mixed dp1tp2pp2->dp2tp1pp2 tp-pp-dp",
                BIAS,
                L("tp2,pp2"),
                L("dp2,pp2", order="tp-pp-dp"),
            ),
            ("disjoint tp2@01->pp2@23", TIED, L("tp2"), L("pp2", (2, 3))),
            ("padded vocab bf16 tp1->tp3", BF16_PAD, L("tp1"), L("tp3", (1, 2, 3))),
            ("value head dp4->tp2pp2", VALUE, L("dp4"), L("tp2,pp2")),
        ]
    if world >= 8:
        pairs += [
            (
                "non-dividing dp2tp3->dp3tp2 overlapping",
                BIAS,
                L("dp2,tp3"),
                L("dp3,tp2", tuple(range(2, 8))),
            ),
            ("tp6->dp2tp2pp2 fused gqa", BIAS, L("tp6"), L("dp2,tp2,pp2")),
            ("dp8->tp2pp4 tied", TIED, L("dp8"), L("tp2,pp4")),
            ("tp2pp4->dp4tp2", TIED, L("tp2,pp4"), L("dp4,tp2")),
            ("disjoint dp2tp2@0-3->tp2pp2@4-7", BF16_PAD, L("dp2,tp2"), L("tp2,pp2", (4, 5, 6, 7))),
            ("tp6->dp2tp3 padded", BF16_PAD, L("tp6"), L("dp2,tp3", (7, 6, 5, 4, 3, 2))),
        ]
    return pairs


def random_case(rng, i: int, specs=SPECS):
    """Case i of a seeded sweep over 8 ranks: (model, full tensors, src, dst, plan with p2p and
    broadcast alternating, source shards, empty destination shards), shards keyed by rank."""
    model = specs[i % len(specs)]
    full = random_full(model, i)
    src, dst = (random_layout(rng, 8, model.num_layers) for _ in range(2))
    plan = plan_realloc(model, src, dst, mode=("p2p", "broadcast")[i % 2])
    srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
    dsts = {r: ModelShard.empty(model, dst, r) for r in dst.ranks}
    return model, full, src, dst, plan, srcs, dsts


def shards(model, layout: Layout, rank: int, full: dict, device="cpu") -> ModelShard | None:
    return ModelShard.from_full(model, layout, rank, full, device) if rank in layout.ranks else None


def check_transfer(
    transport,
    rank: int,
    model,
    src: Layout,
    dst: Layout,
    full: dict,
    *,
    mode: str,
    bucket: int,
    verify: bool = False,
    src_shard=None,
    what: str = "",
    device="cpu",
    **realloc_kw,
):
    """Run one transfer on every rank; assert the oracle, source intact, bytes, staging bound.

    realloc_kw: more Reallocator arguments (direct_min_bytes). Returns this rank's destination
    shard (None if not in dst)."""
    plan = plan_realloc(model, src, dst, mode=mode)
    tag = f"{what} {src}->{dst} {mode} bucket {bucket}: rank {rank}"
    s = src_shard if src_shard is not None else shards(model, src, rank, full, device)
    before = None if s is None else s.flat.clone()
    d = ModelShard.empty(model, dst, rank, device) if rank in dst.ranks else None
    sent0, recv0 = transport.sent_bytes, transport.received_bytes
    r = Reallocator(plan, transport, bucket_bytes=bucket, verify=verify, **realloc_kw)
    r.run(s, d)
    if d is not None:
        assert torch.equal(d.flat.cpu(), oracle_flat(model, dst, rank, full)), (
            f"{tag}: differs from oracle"
        )
    if s is not None:
        assert torch.equal(s.flat, before), f"{tag}: source shard modified"
    if r.staging is not None:
        nbytes = r.staging.numel() * r.staging.element_size()
        assert nbytes <= bucket, f"{tag}: staging {nbytes} B > bucket {bucket} B"
    if not verify:
        want = plan.per_rank_bytes().get(rank, {"send": 0, "recv": 0})
        got = (transport.sent_bytes - sent0, transport.received_bytes - recv0)
        assert got == (want["send"], want["recv"]), f"{tag}: network bytes {got} != plan {want}"
    if rank == 0:
        s_ = plan.summary()
        assert s_["network_bytes"] == min_network_elems(model, src, dst) * model.element_size, (
            f"{tag}: plan moves {s_['network_bytes']} B over the network, minimum differs"
        )
    return d


__all__ = ["SPECS", "named_pairs", "check_transfer", "shards", "random_full", "L"]
