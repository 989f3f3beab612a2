"""Adapters between trainers' own per-rank state dicts and real_py's names and storage.

    HF names (transformers Llama / Qwen2):      from_hf_state_dict / to_hf_state_dict
    Megatron-core GPTModel local state dicts:   from_megatron_state_dict / to_megatron_state_dict
    Megatron conventions as a config / layout:  megatron_config / megatron_layout
    Opt-in check against known full tensors:    check_against_full

Every function maps ONE rank's dict: `layout` and `rank` say which TP slice and pipeline stage
it holds (None: full tensors, one stage). Outputs feed real_py.interop.embed.reallocate_params and
come back from it:

    spec = model_spec(megatron_config(ModelConfig.from_hf(path)))          # trainer side
    gen = model_spec(ModelConfig.from_hf(path))                             # generation side
    plan = plan_realloc(spec, megatron_layout(dp=1, tp=2, pp=2), Layout(dp=4), dst_model=gen)
    params = from_megatron_state_dict(model.state_dict(), spec, plan.src, rank)
    new = reallocate_params(Reallocator(plan, DistTransport(group)), params)
    hf_local = to_hf_state_dict(new, gen, plan.dst, rank)

Conventions handled here: HF keeps q/k/v and gate/up apart (fused per the spec's qkv_layout /
gate_up_layout, per TP rank); Megatron-core fuses q|k|v per kv group (qkv_layout
"megatron_grouped"), keeps [gate; up] per TP rank (gate_up_layout "blocked"), pads the vocab to
128 x tp (vocab_pad_multiple=128), numbers a pipeline stage's layers from 0, splits stages by
layer count (Layout.partition="layers") and names the last stage's tied embedding copy
output_layer.weight. Vocab padding rows are not model data: they are never transferred and are
zero in a destination.

One file past 400 lines: the HF and Megatron-core adapters and check_against_full place one rank's
tensors through the same private helpers (_position, _renumber, _split_desc, _check_shape); split
per trainer, both files would import them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from ..layout import Layout, shard_layout, stage_layer_ranges
from ..realloc.shard import tp_slice
from ..spec import ModelConfig, ModelSpec, ParamSpec
from .hf import _IGNORED_SUFFIXES, hf_names

# Megatron-core GPTModel names (TE layer spec; the local spec's norm names are accepted too).
_MEGATRON_LAYER = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.qkv_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.qkv_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.gate_up_proj.weight": "mlp.linear_fc1.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_MEGATRON_LOCAL_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_MEGATRON_OTHER = {
    "embed_tokens.weight": "embedding.word_embeddings.weight",
    "norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MEGATRON_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def megatron_config(config: ModelConfig, *, vocab_pad_multiple: int = 128) -> ModelConfig:
    """`config` with Megatron-core's storage conventions: grouped q|k|v, [gate; up] per TP rank,
    vocab padded to vocab_pad_multiple x tp (Megatron's --make-vocab-size-divisible-by)."""
    return replace(
        config,
        qkv_layout="megatron_grouped",
        gate_up_layout="blocked",
        vocab_pad_multiple=vocab_pad_multiple,
    )


def megatron_layout(dp: int = 1, tp: int = 1, pp: int = 1, ranks=None) -> Layout:
    """Megatron-core's default rank order (tp fastest, then dp, then pp) and layer split."""
    return Layout(dp=dp, tp=tp, pp=pp, ranks=ranks, order="tp-dp-pp", partition="layers")


def _position(model: ModelSpec, layout: Layout | None, rank: int | None):
    """(tp, tp_rank, {project name: ShardEntry} of the rank's stage, (lo, hi) layers, stage, pp)."""
    if layout is None:
        layout, rank = Layout(), 0
    if layout.dp_shard != "none":
        # FSDP2 shards each HF / Megatron tensor separately; its pieces of q/k/v or gate/up cannot
        # be fused into this project's tensors. Pass dp-sharded pieces straight to
        # reallocate_params / shard_from_params with project names instead.
        raise ValueError(
            f"layout {layout} is dp-sharded: the adapters map whole TP-local tensors; "
            "hand FSDP2 to_local() pieces under project names to reallocate_params"
        )
    coords = layout.coords(rank) if rank is not None else None
    if coords is None:
        raise ValueError(f"rank {rank} is not in layout {layout}")
    _, k, stage = coords
    entries = {e.param.name: e for e in shard_layout(model, layout, stage).entries}
    lo, hi = stage_layer_ranges(model, layout.pp, layout.layers_per_stage, layout.partition)[stage]
    return layout, k, entries, (lo, hi), stage


def _split_desc(layout: Layout) -> str:
    if layout.layers_per_stage is not None:
        return f"layers_per_stage={layout.layers_per_stage}"
    return f"partition={layout.partition!r}"


def _fuse(p: ParamSpec, parts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """One TP rank's pieces of p's blocks (q, k, v or gate, up) -> its local fused tensor."""
    d, groups = p.tp.dim, p.tp.groups or tp
    per_rank = groups // tp
    chunks = [t.chunk(per_rank, d) for t in parts]
    return torch.cat([c[g] for g in range(per_rank) for c in chunks], d)


def _block_pieces(p: ParamSpec, tp: int) -> list[int]:
    """Rows of each block one TP rank holds (blocked storage; replicate_units keeps a block of
    fewer units than tp whole per unit)."""
    if p.tp.replicate_units:
        return [b // min(tp, n) for b, (_, n) in zip(p.blocks, p.tp.units)]
    return [b // tp for b in p.blocks]


def _unfuse(p: ParamSpec, local: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Inverse of _fuse: one rank's local fused tensor -> its piece of every block."""
    if p.tp.replicate_units:
        return list(local.split(_block_pieces(p, tp), p.tp.dim))
    d, groups = p.tp.dim, p.tp.groups or tp
    per_rank, nb = groups // tp, len(p.blocks)
    pieces = local.split([b // groups for b in p.blocks] * per_rank, d)
    return [torch.cat([pieces[g * nb + j] for g in range(per_rank)], d) for j in range(nb)]


def _check_shape(key: str, t: torch.Tensor, want: Sequence[int], why: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {tuple(want)} ({why})")


def _renumber(sd: Mapping[str, torch.Tensor], shift: int, prefix: str) -> dict[str, torch.Tensor]:
    """Keys `{prefix}{i}.rest` -> `{prefix}{i + shift}.rest` (stage-local <-> global layers)."""
    out = {}
    for key, t in sd.items():
        if key.startswith(prefix):
            i, rest = key[len(prefix) :].split(".", 1)
            key = f"{prefix}{int(i) + shift}.{rest}"
        out[key] = t
    return out


def from_hf_state_dict(
    sd: Mapping[str, torch.Tensor],
    model: ModelSpec,
    layout: Layout | None = None,
    rank: int | None = None,
    *,
    stage_local_layers: bool = False,
) -> dict[str, torch.Tensor]:
    """One rank's HF-named tensors (q/k/v and gate/up apart, each its TP slice) -> project
    names, fused in the spec's storage order. Nothing in `sd` is modified. stage_local_layers:
    the dict numbers its stage's layers from 0 (else global layer numbers, as a model sliced
    from one LlamaForCausalLM keeps them).

    Raises ValueError naming the HF key on an unknown key, a missing q/k/v or gate/up part, a
    parameter of another pipeline stage, or a wrong shape (and what the layout expects).
    """
    layout, k, entries, (lo, _), stage = _position(model, layout, rank)
    if stage_local_layers:
        sd = _renumber(sd, lo, "model.layers.")
    tied = any(p.tied_to_head for p in model.params)
    owner: dict[str, tuple[str, int]] = {}
    for p in model.params:
        for j, n in enumerate(hf_names(p)):
            owner[n] = (p.name, j)
    if tied:
        owner["lm_head.weight"] = ("embed_tokens.weight", 0)
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in sd.items():
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        if key not in owner:
            raise ValueError(
                f"{key}: not a parameter of {model.name} (HF names such as "
                "model.layers.0.self_attn.q_proj.weight)"
            )
        name, j = owner[key]
        if name not in entries:
            raise ValueError(
                f"{key}: {name} is not on stage {stage} of {layout} (pipeline split "
                f"{_split_desc(layout)}); pass layout=... matching the trainer's split"
            )
        if key == "lm_head.weight" and tied and "model.embed_tokens.weight" in sd:
            continue  # a tied lm_head.weight aliases the embedding of a single-stage dict
        parts.setdefault(name, {})[j] = t
    out = {}
    for name, got in parts.items():
        e = entries[name]
        p = e.param
        names = hf_names(p)
        if p.tp.kind == "split" and len(p.blocks) > 1:
            missing = [names[j] for j in range(len(p.blocks)) if j not in got]
            if missing:
                raise ValueError(f"{missing[0]}: missing, needed with {names} to build {name}")
            for j, n in enumerate(names):
                want = list(e.local_shape)
                want[p.tp.dim] = _block_pieces(p, layout.tp)[j]
                _check_shape(n, got[j], want, f"tp rank {k} of {layout}")
            out[name] = _fuse(p, [got[j] for j in range(len(p.blocks))], layout.tp)
        else:
            _check_shape(
                names[0],
                got[0],
                e.local_shape,
                f"tp rank {k} of {layout}"
                + (
                    f", vocab padded to a multiple of {p.tp.vocab_multiple} x tp"
                    if p.tp.kind == "vocab"
                    else ""
                ),
            )
            out[name] = got[0]
    return out


def to_hf_state_dict(
    params: Mapping[str, torch.Tensor],
    model: ModelSpec,
    layout: Layout | None = None,
    rank: int | None = None,
    *,
    stage_local_layers: bool = False,
) -> dict[str, torch.Tensor]:
    """Inverse of from_hf_state_dict: project names -> HF names (q/k/v, gate/up split back
    out; views where the storage allows). A tied embedding is also given as lm_head.weight on
    the last stage (and only there when pp > 1)."""
    layout, _, entries, (lo, _), stage = _position(model, layout, rank)
    last = stage == layout.pp - 1
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name not in entries:
            raise ValueError(
                f"{name}: not on stage {stage} of {layout} (pipeline split {_split_desc(layout)})"
            )
        p = entries[name].param
        names = hf_names(p)
        if p.tp.kind == "split" and len(p.blocks) > 1:
            out.update(zip(names, _unfuse(p, t, layout.tp)))
        elif p.tied_to_head:
            if stage == 0:
                out[names[0]] = t
            if last:
                out["lm_head.weight"] = t
        else:
            out[names[0]] = t
    return _renumber(out, -lo, "model.layers.") if stage_local_layers else out


def _megatron_names(
    model: ModelSpec, layout: Layout, stage: int, lo: int, fused_norms: bool
) -> dict:
    """project name -> Megatron-core local key for the parameters of one stage."""
    names = {}
    for p in model.params:
        m = _LAYER_RE.match(p.name)
        if m:
            rest = m.group(2)
            if rest not in _MEGATRON_LAYER:
                continue
            meg = _MEGATRON_LAYER[rest]
            if not fused_norms:
                meg = _MEGATRON_LOCAL_NORMS.get(rest, meg)
            names[p.name] = f"decoder.layers.{int(m.group(1)) - lo}.{meg}"
        elif p.name in _MEGATRON_OTHER:
            names[p.name] = _MEGATRON_OTHER[p.name]
    if any(p.tied_to_head for p in model.params) and layout.pp > 1 and stage == layout.pp - 1:
        names["embed_tokens.weight"] = "output_layer.weight"
    return names


def _check_megatron_spec(model: ModelSpec) -> None:
    if any(p.name == "value_head.weight" for p in model.params):
        raise ValueError("Megatron-core GPTModel names cover lm heads; value_head.weight has none")
    cfg = model.config
    if cfg is not None and cfg.qkv_layout != "megatron_grouped":
        raise ValueError(
            f"{model.name}: qkv_layout={cfg.qkv_layout!r}, but Megatron-core's "
            "linear_qkv is grouped per kv group; build the spec from "
            "megatron_config(config)"
        )


def from_megatron_state_dict(
    sd: Mapping[str, torch.Tensor], model: ModelSpec, layout: Layout, rank: int
) -> dict[str, torch.Tensor]:
    """One rank's Megatron-core GPTModel local state dict (stage-local layer numbers, TP slices,
    fused linear_qkv grouped per kv group) -> project names (global layer numbers).

    `model` must use Megatron's storage (megatron_config) and `layout` the trainer's pipeline
    split (megatron_layout: by layer count). Keys ending in ._extra_state (Transformer Engine
    metadata) are skipped. Raises ValueError naming the Megatron key on an unknown or missing
    key, a layer outside the stage, or a wrong local shape (with the expected shape and order).
    Values are the dict's own tensors (no copies); nothing in `sd` is modified.
    """
    _check_megatron_spec(model)
    layout, k, entries, (lo, hi), stage = _position(model, layout, rank)
    names = _megatron_names(model, layout, stage, lo, fused_norms=True)
    local_norms = _megatron_names(model, layout, stage, lo, fused_norms=False)
    back = {v: n for n, v in names.items()} | {v: n for n, v in local_norms.items()}
    out = {}
    for key, t in sd.items():
        if key.endswith("._extra_state"):
            continue
        name = back.get(key)
        if name is None:
            m = _MEGATRON_LAYER_RE.match(key)
            if m and int(m.group(1)) >= hi - lo:
                raise ValueError(
                    f"{key}: stage {stage} of {layout} holds {hi - lo} layers (global "
                    f"{lo}..{hi - 1}) under the pipeline split {_split_desc(layout)}; "
                    "Megatron-core splits by layer count (megatron_layout)"
                )
            raise ValueError(f"{key}: not a Megatron-core GPTModel parameter of {model.name}")
        if name not in entries:
            raise ValueError(
                f"{key}: {name} is not on stage {stage} of {layout} (pipeline split "
                f"{_split_desc(layout)})"
            )
        e = entries[name]
        why = f"tp rank {k} of {layout}"
        if e.param.tp.kind == "vocab":
            why += (
                f", vocab {e.param.shape[0]} padded to a multiple of "
                f"{e.param.tp.vocab_multiple} x tp={layout.tp}"
            )
        elif e.param.tp.groups:
            why += (
                f", rows grouped per kv group: [q heads, k, v] x {e.param.tp.groups // layout.tp}"
            )
        _check_shape(key, t, e.local_shape, why)
        if name in out:
            raise ValueError(f"{key}: {name} given twice (TE and local norm names)")
        out[name] = t
    missing = sorted(names[n] for n in entries if n not in out)
    if missing:
        raise ValueError(
            f"rank {rank} ({layout}, stage {stage}, layers {lo}..{hi - 1} under the "
            f"pipeline split {_split_desc(layout)}): Megatron state dict lacks "
            f"{missing[:5]}"
        )
    return out


def to_megatron_state_dict(
    params: Mapping[str, torch.Tensor],
    model: ModelSpec,
    layout: Layout,
    rank: int,
    *,
    fused_norms: bool = True,
) -> dict[str, torch.Tensor]:
    """Inverse of from_megatron_state_dict (values are the same tensors). fused_norms: name the
    norms as the Transformer Engine layer spec does (linear_qkv.layer_norm_weight), else as the
    local spec (input_layernorm.weight, pre_mlp_layernorm.weight)."""
    _check_megatron_spec(model)
    layout, _, entries, (lo, _), stage = _position(model, layout, rank)
    names = _megatron_names(model, layout, stage, lo, fused_norms)
    out = {}
    for name, t in params.items():
        if name not in entries:
            raise ValueError(
                f"{name}: not on stage {stage} of {layout} (pipeline split {_split_desc(layout)})"
            )
        out[names[name]] = t
    return out


def check_against_full(
    model: ModelSpec,
    layout: Layout,
    rank: int,
    params: Mapping[str, torch.Tensor],
    full: Mapping[str, torch.Tensor],
) -> int:
    """Opt-in check that a rank's local tensors are stored as `model` declares.

    Compares every fused tensor (several blocks: q|k|v, gate|up) and vocab-split tensor in
    `params` that `full` also holds (full tensors, blocked order, e.g. the HF checkpoint the
    trainer loaded: from_hf_state_dict(hf_sd, spec_tp1)) with the slice the spec says this rank
    holds. Cost: one slice and compare per checked tensor. Returns how many tensors it checked.
    Raises ValueError naming the tensor, the declared storage and, when another storage order
    matches, that one (e.g. Megatron-ordered q|k|v declared blocked).
    """
    _, k, entries, _, _ = _position(model, layout, rank)
    checked = 0
    for name, t in params.items():
        e = entries.get(name)
        if e is None or name not in full:
            continue
        p = e.param
        if not (p.tp.kind == "vocab" or (p.tp.kind == "split" and len(p.blocks) > 1)):
            continue
        ref = full[name].to(t.dtype)
        checked += 1
        if torch.equal(tp_slice(p, ref, layout.tp, k).to(t.device), t):
            continue
        declared = (
            _storage_name(model, p, p.tp.groups)
            if p.tp.kind == "split"
            else f"vocab_multiple={p.tp.vocab_multiple}"
        )
        if p.tp.kind == "split":
            # The storage orders in use: blocked, Megatron's per-kv-group q|k|v, row-interleaved.
            alts = [
                g
                for g in (0, _kv_groups(model), p.blocks[0])
                if g != p.tp.groups
                and (g == 0 or (g % layout.tp == 0 and all(b % g == 0 for b in p.blocks)))
            ]
            for g in alts:
                alt = replace(p, tp=replace(p.tp, groups=g))
                if torch.equal(tp_slice(alt, ref, layout.tp, k).to(t.device), t):
                    raise ValueError(
                        f"{name} on rank {rank} ({layout}, tp rank {k}): rows are stored as "
                        f"{_storage_name(model, p, g)}, the spec declares {declared}; "
                        "set ModelConfig.qkv_layout / gate_up_layout to match the trainer"
                    )
        raise ValueError(
            f"{name} on rank {rank} ({layout}, tp rank {k}): local tensor differs from "
            f"the reference full tensor's slice for the declared storage ({declared}) "
            "and from every other storage order: wrong weights or wrong reference"
        )
    return checked


def _kv_groups(model: ModelSpec) -> int:
    return model.config.num_key_value_heads if model.config is not None else 0


def _storage_name(model: ModelSpec, p: ParamSpec, groups: int) -> str:
    if groups == 0:
        return "blocked"
    if ".qkv_proj." in p.name and groups == _kv_groups(model):
        return "megatron_grouped"
    if ".gate_up_proj." in p.name and groups == p.blocks[0]:
        return "interleaved"
    return f"{groups} interleaved groups"


__all__ = [
    "from_hf_state_dict",
    "to_hf_state_dict",
    "from_megatron_state_dict",
    "to_megatron_state_dict",
    "megatron_config",
    "megatron_layout",
    "check_against_full",
]
