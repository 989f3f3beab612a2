"""Independent oracle for reallocation tests: which global elements a rank holds, by index math.

Written apart from the planner and from real_py.realloc.shard.tp_slice: a rank's piece of a
parameter is computed as a global index tensor (`held_indices`), and shards are assembled with
index_select.
Tests compare real shards bit for bit with `oracle_flat`, never with a second copy of the plan.
"""

from __future__ import annotations

import random

import torch

from real_py import Layout, ModelSpec, model_spec, shard_layout
from real_py.layout import param_stages
from real_py.spec import ALIGN_BYTES, ModelConfig, torch_dtype


def held_indices(p, tp: int, k: int) -> torch.Tensor:
    """Global flat indices (row-major over p.shape) of TP rank k's local tensor, in local order.

    Vocab padding rows are -1. Grouped storage (p.tp.groups = G): the rows in fused memory order
    are listed group by group (each group: its 1/G of every block), and rank k holds the k-th of
    tp equal consecutive chunks of that list. replicate_units (vLLM kv heads): a block of
    `count` units (TPRule.units) with count < tp gives rank k its unit k * count // tp whole.
    """
    gid = torch.arange(p.numel, dtype=torch.int64).view(p.shape)
    if p.tp.kind == "replicated":
        return gid.reshape(-1)
    d = p.tp.dim
    size = p.shape[d]
    if p.tp.kind == "vocab":
        m = p.tp.vocab_multiple
        per = (size + m * tp - 1) // (m * tp) * m
        rows = torch.arange(k * per, (k + 1) * per)
        valid = rows < size
        picked = gid.index_select(d, rows.clamp(max=size - 1))
        mask_shape = [1] * len(p.shape)
        mask_shape[d] = per
        return torch.where(valid.view(mask_shape), picked, torch.full_like(picked, -1)).reshape(-1)
    if p.tp.groups:
        G, starts = p.tp.groups, [sum(p.blocks[:j]) for j in range(len(p.blocks))]
        memory = [
            st + g * (b // G) + r
            for g in range(G)
            for st, b in zip(starts, p.blocks)
            for r in range(b // G)
        ]
        return gid.index_select(d, torch.tensor(memory).chunk(tp)[k]).reshape(-1)
    rows, start = [], 0
    for i, b in enumerate(p.blocks):
        count = p.tp.units[i][1] if p.tp.replicate_units else tp
        if count < tp:  # replicated block (vLLM kv heads): count units over tp ranks, in order
            u, size = k * count // tp, b // count
            rows.append(torch.arange(start + u * size, start + (u + 1) * size))
        else:
            rows.append(torch.arange(start + k * (b // tp), start + (k + 1) * (b // tp)))
        start += b
    return gid.index_select(d, torch.cat(rows)).reshape(-1)


def oracle_flat(model: ModelSpec, layout: Layout, rank: int, full: dict) -> torch.Tensor:
    """The flat buffer `rank` must hold in `layout`, assembled from full tensors by index_select."""
    if layout.dp_shard != "none":
        return oracle_flat_dp(model, layout, rank, full)
    _, k, stage = layout.coords(rank)
    sl = shard_layout(model, layout, stage)
    out = torch.zeros(sl.numel, dtype=torch_dtype(model.dtype))
    for e in sl.entries:
        idx = held_indices(e.param, layout.tp, k)
        src = full[e.param.name].reshape(-1)
        vals = src.index_select(0, idx.clamp(min=0))
        vals[idx < 0] = 0
        out[e.offset : e.offset + e.numel] = vals
    return out


def data_mask(model: ModelSpec, layout: Layout, rank: int) -> torch.Tensor:
    """Bool [numel]: which flat-buffer elements of `rank` hold model data (not padding)."""
    if layout.dp_shard != "none":
        return index_buffer(model, layout, rank) >= 0
    _, k, stage = layout.coords(rank)
    sl = shard_layout(model, layout, stage)
    mask = torch.zeros(sl.numel, dtype=torch.bool)
    for e in sl.entries:
        mask[e.offset : e.offset + e.numel] = held_indices(e.param, layout.tp, k) >= 0
    return mask


def min_network_elems(model: ModelSpec, src: Layout, dst: Layout) -> int:
    """Elements every destination rank needs that its own source shard does not hold."""
    if src.dp_shard != "none" or dst.dp_shard != "none":
        return min_network_elems_dp(model, src, dst)
    total = 0
    for r in dst.ranks:
        _, k2, s2 = dst.coords(r)
        src_pos = src.coords(r)
        for p in model.params:
            if s2 not in param_stages(model, dst, p):
                continue
            need = held_indices(p, dst.tp, k2)
            need = need[need >= 0]
            if src_pos is not None and src_pos[2] in param_stages(model, src, p):
                have = held_indices(p, src.tp, src_pos[1])
                total += int((~torch.isin(need, have)).sum())
            else:
                total += need.numel()
    return total


def random_full(model: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dt = torch_dtype(model.dtype)
    return {p.name: torch.randn(p.shape, generator=g).to(dt) for p in model.params}


# Small specs exercising every rule: fused GQA QKV (q 12 heads, kv 6), qkv bias, odd vocab
# (padding), tied and untied embeddings, value head. tp choices: 1, 2, 3, 6.
def tiny_spec(
    *, tied=False, bias=False, head="lm", layers=4, vocab=101, dtype="float32", name=None, **storage
) -> ModelSpec:
    """storage: qkv_layout, gate_up_layout, vocab_pad_multiple (ModelConfig fields)."""
    cfg = ModelConfig(
        hidden_size=24,
        intermediate_size=36,
        num_attention_heads=12,
        num_key_value_heads=6,
        head_dim=2,
        vocab_size=vocab,
        num_hidden_layers=layers,
        tie_word_embeddings=tied,
        attention_bias=bias,
        head=head,
        dtype=dtype,
        **storage,
    )
    return model_spec(cfg, name or f"tiny{'-tied' if tied else ''}{'-bias' if bias else ''}-{head}")


TP_CHOICES = (1, 2, 3, 6)


def random_layout(rng: random.Random, world: int, num_layers: int, max_ranks: int = 8) -> Layout:
    """A random layout on a random subset of range(world) (random rank order and axis order)."""
    while True:
        tp = rng.choice(TP_CHOICES)
        pp = rng.choice([1, 2, 3, 4])
        dp = rng.choice([1, 2, 3])
        n = dp * tp * pp
        if n <= min(world, max_ranks) and pp <= num_layers:
            break
    ranks = rng.sample(range(world), n)
    order = rng.choice(["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"])
    lps = None
    if pp > 1 and rng.random() < 0.3:
        cuts = sorted(rng.sample(range(1, num_layers), pp - 1))
        lps = tuple(b - a for a, b in zip([0] + cuts, cuts + [num_layers]))
    return Layout(dp=dp, tp=tp, pp=pp, ranks=tuple(ranks), order=order, layers_per_stage=lps)


# dp-sharded layouts (Layout.dp_shard "dim0" / "flat"). The buffer is described as an index
# buffer: element i holds (parameter number << 40) + global flat index, or -1 for padding. The
# whole (stage, tp rank) shard's index buffer comes from held_indices; the dp piece is then cut
# with torch.chunk (dim0, FSDP2's rule) or an even split of the flat buffer (flat, ZeRO-3).
_PID_SHIFT = 40


def index_buffer(model: ModelSpec, layout: Layout, rank: int) -> torch.Tensor:
    """int64 [numel]: which parameter element each flat-buffer element of `rank` holds (-1:
    none)."""
    d, k, stage = layout.coords(rank)
    pid = {p.name: i for i, p in enumerate(model.params)}
    sl = shard_layout(model, layout, stage)
    whole = torch.full((sl.numel,), -1, dtype=torch.int64)
    for e in sl.entries:
        h = held_indices(e.param, layout.tp, k)
        whole[e.offset : e.offset + e.numel] = torch.where(
            h >= 0, (pid[e.param.name] << _PID_SHIFT) + h, -1
        )
    if layout.dp_shard == "none":
        return whole
    if layout.dp_shard == "flat":
        c = -(-sl.numel // layout.dp)
        out = torch.full((c,), -1, dtype=torch.int64)
        piece = whole[d * c : (d + 1) * c]
        out[: piece.numel()] = piece
        return out
    assert layout.dp_shard == "dim0", layout.dp_shard
    align = max(1, ALIGN_BYTES // model.element_size)
    parts = []
    for e in sl.entries:
        local = whole[e.offset : e.offset + e.numel].view(e.local_shape)
        chunks = torch.chunk(local, layout.dp, 0)
        storage = chunks[0].numel()  # FSDP2 pads every piece to the first chunk's size
        piece = chunks[d].reshape(-1) if d < len(chunks) else local.new_empty(0)
        slot = torch.full((-(-storage // align) * align,), -1, dtype=torch.int64)
        slot[: piece.numel()] = piece
        parts.append(slot)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def oracle_flat_dp(model: ModelSpec, layout: Layout, rank: int, full: dict) -> torch.Tensor:
    """oracle_flat for any layout (dp-sharded or not), from index_buffer."""
    idx = index_buffer(model, layout, rank)
    out = torch.zeros(idx.numel(), dtype=torch_dtype(model.dtype))
    for i, p in enumerate(model.params):
        at = (idx >= 0) & (idx >> _PID_SHIFT == i)
        if at.any():
            out[at] = full[p.name].reshape(-1)[idx[at] & ((1 << _PID_SHIFT) - 1)]
    return out


def min_network_elems_dp(model: ModelSpec, src: Layout, dst: Layout) -> int:
    """min_network_elems for any layouts: elements a destination rank needs and does not hold."""
    total = 0
    for r in dst.ranks:
        need = index_buffer(model, dst, r)
        need = need[need >= 0]
        if r in src.ranks:
            need = need[~torch.isin(need, index_buffer(model, src, r))]
        total += need.numel()
    return total


def random_dp_layout(rng: random.Random, world: int, num_layers: int, max_ranks: int = 8) -> Layout:
    """random_layout, dp-sharded (dim0 or flat) two times in three when dp > 1."""
    layout = random_layout(rng, world, num_layers, max_ranks)
    shard = rng.choice(["none", "dim0", "flat"])
    return Layout(
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        ranks=layout.ranks,
        order=layout.order,
        layers_per_stage=layout.layers_per_stage,
        dp_shard=shard,
    )


# Mixture of experts. A rank's expert pieces by index math, apart from real_py.layout's
# expert_coords / expert_shard_layout and the MoE planner: the stage's (dp, tp) ranks are
# numbered i = dp_idx * tp + tp_idx (Megatron-core's parallel folding) and cut etp fastest,
# then ep; ep group g holds experts [g E/ep, (g + 1) E/ep), etp rank k the k-th etp piece.
def expert_position(layout: Layout, rank: int):
    """(ep_idx, etp_idx, stage) of `rank`, or None."""
    c = layout.coords(rank)
    if c is None:
        return None
    i = c[0] * layout.tp + c[1]
    return (i // layout.etp) % layout.ep, i % layout.etp, c[2]


def expert_held(model: ModelSpec, layout: Layout, rank: int):
    """[(param, held global flat indices)] of every expert tensor `rank` holds."""
    pos = expert_position(layout, rank)
    if pos is None:
        return []
    g, k, stage = pos
    per = model.num_experts // layout.ep
    return [
        (p, held_indices(p, layout.etp, k))
        for p in model.params
        if p.expert >= 0
        and g * per <= p.expert < (g + 1) * per
        and stage in param_stages(model, layout, p)
    ]


def expert_oracle(model: ModelSpec, layout: Layout, rank: int, full: dict) -> dict:
    """name -> the etp piece of that expert tensor `rank` must hold, sliced from full tensors."""
    return {
        p.name: full[p.name].reshape(-1).index_select(0, idx).view(p.local_shape(layout.etp))
        for p, idx in expert_held(model, layout, rank)
    }


def dense_only(model: ModelSpec) -> ModelSpec:
    return ModelSpec(
        name=model.name + "-dense-oracle",
        params=tuple(p for p in model.params if p.expert < 0),
        num_layers=model.num_layers,
    )


def dense_layout(model: ModelSpec, layout: Layout) -> Layout:
    """`layout` without expert axes, keeping the full model's pipeline stages (the dense tensors
    stay on the stages the whole model's split puts them on)."""
    from dataclasses import replace

    from real_py.layout import stage_layer_ranges

    ranges = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)
    return replace(layout, ep=1, etp=1, layers_per_stage=tuple(hi - lo for lo, hi in ranges))


def min_network_elems_moe(model: ModelSpec, src: Layout, dst: Layout) -> int:
    """Elements every destination rank needs (dense and experts) that it does not hold already."""
    total = min_network_elems(dense_only(model), dense_layout(model, src), dense_layout(model, dst))
    for r in dst.ranks:
        have = {p.name: idx for p, idx in expert_held(model, src, r)}
        for p, need in expert_held(model, dst, r):
            total += (
                int((~torch.isin(need, have[p.name])).sum()) if p.name in have else need.numel()
            )
    return total


def random_moe_layout(
    rng: random.Random, world: int, model: ModelSpec, max_ranks: int = 8
) -> Layout:
    """A random MoE layout of `model` (tp in model.tp_choices, ep | experts, ep etp | dp tp)."""
    E = model.num_experts
    while True:
        tp = rng.choice([t for t in model.tp_choices(8)])
        dp, pp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3])
        n = dp * tp * pp
        if n > min(world, max_ranks) or pp > model.num_layers:
            continue
        combos = [
            (e, t)
            for e in range(1, E + 1)
            for t in (1, 2, 4, 8)
            if E % e == 0 and (dp * tp) % (e * t) == 0
        ]
        ep, etp = rng.choice(combos)
        break
    ranks = rng.sample(range(world), n)
    order = rng.choice(["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"])
    return Layout(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, ranks=tuple(ranks), order=order)
