"""transformers checkpoints (dense families and Qwen3-MoE / Qwen2-MoE / Mixtral) <-> shard buffers.

    shard = load_hf_shard(path, config, layout, rank)  # reads only this rank's slices
    full = gather_state_dict(shard, groups)            # collective; full tensors on layout.ranks[0]
    save_hf(out_dir, config, full, hf_config=...)      # same HF names and format

HF names map onto the fused spec names: q_proj|k_proj|v_proj -> qkv_proj (blocks along dim 0),
gate_proj|up_proj -> gate_up_proj, the rest one to one under "model."; a value head is stored as
"score.weight" [1, H] (the *ForSequenceClassification of spec.hf_config.ARCHITECTURES, e.g.
Gemma3TextForSequenceClassification, with num_labels=1). MoE: expert j's gate_proj|up_proj ->
experts.j.gate_up_proj (Mixtral's block_sparse_moe.experts.j.w1|w3; w2 -> down_proj), read into a
rank's ExpertShard by load_hf_experts; the router (mlp.gate), shared expert and its gate load with
the dense shard. Every tensor the config needs is checked (presence, shape) from the safetensors
headers before anything is read; a mismatch raises ValueError naming the tensor and the cause.

One file past 400 lines: loading (HFCheckpoint, load_hf_shard, load_hf_experts) and saving
(full_to_hf_state_dict, save_hf, the gathers) are the two directions of one name mapping (hf_names,
FUSED_CHECKPOINTS) and must agree tensor for tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist

from ..layout import Layout, require_layout
from ..realloc.shard import ExpertShard, ModelShard, gather_full
from ..spec import ModelConfig, ModelSpec, ParamSpec, model_spec, torch_dtype
from ..spec.hf_config import ARCHITECTURES, check_architecture, export_config

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# copied from the source checkpoint directory on export when present
STANDALONE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


# model_types whose checkpoints store q|k|v and gate|up fused, in real_py's block order (Phi-3)
FUSED_CHECKPOINTS = ("phi3",)


def _fused(model: ModelSpec) -> bool:
    return model.config is not None and model.config.model_type in FUSED_CHECKPOINTS


def _names(model: ModelSpec, p: ParamSpec) -> list[str]:
    return hf_names(
        p, _fused(model), model.config is not None and model.config.model_type == "mixtral"
    )


def hf_names(p: ParamSpec, fused: bool = False, mixtral: bool = False) -> list[str]:
    """HF tensor names whose concatenation (along the split dim, in block order) is p. fused: the
    checkpoint stores qkv_proj and gate_up_proj as one tensor each (Phi-3). mixtral: the MoE block
    is block_sparse_moe, experts' gate | up | down are w1 | w3 | w2."""
    n = p.name
    if fused and n.startswith("layers."):
        return ["model." + n]
    if mixtral and ".mlp." in n:
        n = "model." + n.replace(".mlp.", ".block_sparse_moe.", 1)
        if ".gate_up_proj." in n:
            return [n.replace("gate_up_proj", "w1"), n.replace("gate_up_proj", "w3")]
        return [n.replace("down_proj", "w2")]
    if n.startswith("layers."):
        if ".qkv_proj." in n:
            return ["model." + n.replace("qkv_proj", x) for x in ("q_proj", "k_proj", "v_proj")]
        if ".gate_up_proj." in n:
            return ["model." + n.replace("gate_up_proj", x) for x in ("gate_proj", "up_proj")]
        return ["model." + n]
    if n in ("embed_tokens.weight", "norm.weight"):
        return ["model." + n]
    if n == "value_head.weight":
        return ["score.weight"]
    return [n]


def _block_shape(p: ParamSpec, j: int, fused: bool = False) -> tuple[int, ...]:
    if p.tp.kind != "split" or fused:
        return p.shape
    shape = list(p.shape)
    shape[p.tp.dim] = p.blocks[j]
    return tuple(shape)


class HFCheckpoint:
    """Tensor names, shapes and lazy slices of a safetensors checkpoint directory."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = os.fspath(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(os.path.join(self.path, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise ValueError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors checkpoints are supported)"
            )
        missing = [fn for fn in files if not os.path.isfile(os.path.join(self.path, fn))]
        if missing:
            raise ValueError(
                f"{self.path}: model.safetensors.index.json names {len(missing)} shard file(s) "
                f"that are missing, first {missing[0]!r}; copy the whole checkpoint directory"
            )
        self._handles, self.shapes = {}, {}
        for fn in files:
            try:
                h = safe_open(os.path.join(self.path, fn), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError (not an OSError)
                raise ValueError(
                    f"{os.path.join(self.path, fn)} is not a readable safetensors file "
                    f"(truncated or corrupt: {e}); re-download or re-save it"
                ) from None
            for name in h.keys():
                self._handles[name] = h
                self.shapes[name] = tuple(h.get_slice(name).get_shape())

    def read(
        self, name: str, dim: int = 0, lo: int | None = None, hi: int | None = None
    ) -> torch.Tensor:
        """The tensor, or rows/cols [lo, hi) along dim 0 or 1 read from disk as a slice."""
        sl = self._handles[name].get_slice(name)
        if lo is None:
            return sl[:]
        return sl[lo:hi] if dim == 0 else sl[:, lo:hi]

    def check(self, model: ModelSpec, fresh_head: bool = False) -> None:
        """ValueError naming the first missing, misshapen or unexpected tensor. fresh_head: the
        value head is initialised, not read (a causal-LM body; its lm_head / score are ignored)."""
        tied = model.config is not None and model.config.tie_word_embeddings
        wanted = {}
        for p in model.params:
            if fresh_head and p.owner == "head":
                continue
            for j, name in enumerate(_names(model, p)):
                wanted[name] = _block_shape(p, j, _fused(model))
        for name, shape in wanted.items():
            if name not in self.shapes:
                hint = (
                    "; a causal-LM checkpoint as a value model needs a fresh value head "
                    "(critic_init: zero | normal)"
                    if name == "score.weight"
                    else "; it holds a value head 'score.weight' (a *ForSequenceClassification "
                    "checkpoint): load it with head='value'"
                    if name == "lm_head.weight" and "score.weight" in self.shapes
                    else ""
                )
                raise ValueError(
                    f"checkpoint {self.path} has no tensor {name!r} required by the "
                    f"config ({len(self.shapes)} tensors present){hint}"
                )
            if self.shapes[name] != shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {list(self.shapes[name])}, the "
                    f"config expects {list(shape)}"
                )
        for name in self.shapes:
            if (
                name in wanted
                or name.endswith(_IGNORED_SUFFIXES)
                or (tied and name == "lm_head.weight")
            ):
                continue
            if fresh_head and name in ("lm_head.weight", "score.weight"):
                continue
            raise ValueError(
                f"checkpoint tensor {name!r} is not part of the config's model "
                "(check num_hidden_layers, attention_bias, tie_word_embeddings, head)"
            )


VALUE_HEAD_INITS = ("zero", "normal")


def load_hf_shard(
    path,
    config: ModelConfig,
    layout: Layout,
    rank: int,
    device="cpu",
    *,
    name: str | None = None,
    value_head_init: str | None = None,
    seed: int = 0,
) -> ModelShard:
    """This rank's shard of `layout`, reading only the slices it holds.

    name: the ModelSpec name of the shard (the runtime plans reallocations with the model's
    name). value_head_init "zero" | "normal" (value configs only): start a fresh value head,
    zeros or N(0, 0.02) from `seed` (identical on every rank), on the checkpoint's body, e.g. a
    critic from the actor's causal-LM checkpoint (its lm_head is dropped).
    """
    require_layout(layout)
    if layout.dp_shard != "none":
        raise ValueError(
            f"load_hf_shard: layout {layout} is dp-sharded; load into the layout "
            "without dp sharding and reallocate to it (plan_realloc)"
        )
    _check_checkpoint_config(path)
    if value_head_init is not None and (
        value_head_init not in VALUE_HEAD_INITS or config.head != "value"
    ):
        raise ValueError(
            f"value_head_init={value_head_init!r} needs a value config (head='value') and "
            f"one of {list(VALUE_HEAD_INITS)}"
        )
    model = model_spec(config, name=name)
    ckpt = HFCheckpoint(path)
    ckpt.check(model, fresh_head=value_head_init is not None)
    shard = ModelShard.empty(model, layout, rank, device)
    _read_entries(ckpt, model, shard, layout.tp, shard.tp_rank, value_head_init, seed)
    return shard


def load_hf_experts(
    path,
    config: ModelConfig,
    layout: Layout,
    rank: int,
    device="cpu",
    *,
    name: str | None = None,
    fresh_head: bool = False,
) -> ExpertShard:
    """This rank's expert shard of an MoE `layout` (experts of its ep rank, their etp pieces),
    reading only those tensors (or their etp slices) from the checkpoint. fresh_head: a value
    model on a causal-LM checkpoint (load_hf_shard's value_head_init), whose head is not read."""
    require_layout(layout)
    _check_checkpoint_config(path)
    model = model_spec(config, name=name)
    if not model.num_experts:
        raise ValueError(f"load_hf_experts: {path} config has no experts (num_experts=0)")
    ckpt = HFCheckpoint(path)
    ckpt.check(model, fresh_head=fresh_head)
    shard = ExpertShard.empty(model, layout, rank, device)
    _read_entries(ckpt, model, shard, layout.etp, shard.etp_rank, None, 0)
    return shard


def _read_entries(ckpt, model, shard, tp: int, k: int, value_head_init, seed) -> None:
    """Fill every entry of `shard` (a ModelShard or ExpertShard) with its tp-rank-k piece."""
    dtype = torch_dtype(model.dtype)
    for e in shard.shard_layout.entries:
        p, dst = e.param, shard.view(e.param.name)
        names = _names(model, p)
        if value_head_init is not None and p.owner == "head":
            fresh = (
                torch.zeros(p.shape)
                if value_head_init == "zero"
                else torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.02
            )
            dst.copy_(fresh.to(dtype))
        elif p.tp.kind == "replicated":
            dst.copy_(ckpt.read(names[0]).to(dtype))
        elif p.tp.kind == "vocab":
            size, local = p.shape[p.tp.dim], e.local_shape[p.tp.dim]
            lo, hi = min(size, k * local), min(size, (k + 1) * local)
            if hi > lo:
                dst.narrow(p.tp.dim, 0, hi - lo).copy_(
                    ckpt.read(names[0], p.tp.dim, lo, hi).to(dtype)
                )
        elif p.tp.replicate_units and any(n < tp for _, n in p.tp.units):
            raise ValueError(
                f"{p.name}: reading a checkpoint into replicated units (kv_head_replicas "
                f"with tp={tp} above {p.tp.units[-1][0]}) is not supported; load at a tp "
                "that splits every head and reallocate"
            )
        else:
            off = 0
            groups = p.tp.groups or tp  # blocked storage: one group per TP rank
            for j in range(k * groups // tp, (k + 1) * groups // tp):
                for b, block in enumerate(p.blocks):
                    # one tensor per block, or one fused tensor holding the blocks in order
                    name, base = (names[b], 0) if len(names) > 1 else (names[0], sum(p.blocks[:b]))
                    piece = block // groups
                    dst.narrow(p.tp.dim, off, piece).copy_(
                        ckpt.read(name, p.tp.dim, base + j * piece, base + (j + 1) * piece).to(
                            dtype
                        )
                    )
                    off += piece


def full_to_hf_state_dict(
    model: ModelSpec, full: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors by project name, q/k/v and gate/up fused -> HF names, split back
    out. The public interop.to_hf_state_dict takes one rank's shard of a layout instead."""
    out = {}
    for p in model.params:
        names = _names(model, p)
        if len(names) == 1:
            out[names[0]] = full[p.name].contiguous()
        else:
            for name, t in zip(names, full[p.name].split(list(p.blocks), p.tp.dim)):
                out[name] = t.contiguous()
    return out


def _check_checkpoint_config(path) -> None:
    """A checkpoint's own config.json must name a supported architecture (clear error first,
    instead of a missing-tensor error later)."""
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
        if isinstance(d, dict):
            check_architecture(d, cfg_path)


def hf_config_dict(
    config: ModelConfig, model_type: str | None = None, source: dict | None = None
) -> dict:
    """A complete transformers config for `config` (real_py.spec.hf_config.export_config);
    model_type (llama, mistral, qwen2) defaults to config.model_type; `source` is the original
    config.json."""
    if model_type is not None:
        if model_type not in ARCHITECTURES:
            raise ValueError(f"model_type={model_type!r}; allowed: {sorted(ARCHITECTURES)}")
        config = dataclasses.replace(config, model_type=model_type)
    return export_config(config, source)


def save_hf(
    path,
    config: ModelConfig,
    full: dict[str, torch.Tensor],
    *,
    model_type: str | None = None,
    hf_config: dict | None = None,
    source=None,
) -> None:
    """Write model.safetensors + config.json: hf_config verbatim when given, else a complete config
    from `config` (see hf_config_dict), keeping the non-computation fields of `source` (a
    checkpoint directory, a config.json path or a dict) when given. A source directory's tokenizer
    files and generation_config.json (STANDALONE_FILES) are copied beside the weights."""
    from safetensors.torch import save_file

    src_dir = None
    if source is not None and not isinstance(source, dict):
        src = os.fspath(source)
        src_dir = src if os.path.isdir(src) else os.path.dirname(src)
        src = os.path.join(src, "config.json") if os.path.isdir(src) else src
        with open(src) as f:
            source = json.load(f)
    model = model_spec(config)
    missing = [p.name for p in model.params if p.name not in full]
    if missing:
        raise ValueError(f"save_hf: state dict lacks {missing[:5]}")
    if config.num_experts and hf_config is None:
        # no MoE config writer (export_config refuses): the source's own config.json, after
        # checking that it describes this very model (training does not change the architecture)
        if (
            source is not None and config.head == "value"
        ):  # a critic / reward model on the source's body
            cls = next(
                a
                for a in ARCHITECTURES[config.model_type]
                if a.endswith("ForSequenceClassification")
            )
            source = {k: v for k, v in source.items() if k not in ("id2label", "label2id")}
            source.update(
                architectures=[cls],
                num_labels=1,
                pad_token_id=config.pad_token_id if config.pad_token_id is not None else 0,
            )
            config = dataclasses.replace(config, pad_token_id=source["pad_token_id"])
        if source is None or ModelConfig.from_hf(source, dtype=config.dtype) != config:
            raise ValueError(
                f"save_hf: a mixture-of-experts model ({config.model_type}, head={config.head}) is "
                "written with the config.json of the checkpoint it was loaded from, which must "
                "describe the same model; pass source= (that checkpoint) or hf_config="
            )
        hf_config = dict(source, torch_dtype=config.dtype)
        hf_config.pop("dtype", None)
    os.makedirs(path, exist_ok=True)
    save_file(
        full_to_hf_state_dict(model, full),
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config or hf_config_dict(config, model_type, source), f, indent=2, default=str)
    if src_dir:
        # a standalone checkpoint: AutoTokenizer / generate() read these beside the weights
        for fn in STANDALONE_FILES:
            if os.path.isfile(os.path.join(src_dir, fn)):
                shutil.copyfile(os.path.join(src_dir, fn), os.path.join(path, fn))


def gather_state_dict(shard: ModelShard, groups) -> dict[str, torch.Tensor] | None:
    """Collective over the layout: full tensors on layout.ranks[0], None on the other ranks.

    The dp-replica-0 rank of every (stage, tp) position sends its flat buffer point to point.
    """
    layout, model = shard.layout, shard.model
    dst = layout.rank(0, 0, 0)
    if groups.rank != dst:
        if shard.dp_rank == 0:
            dist.send(shard.flat, dst)
        return None
    shards = []
    for s in range(layout.pp):
        for t in range(layout.tp):
            src = layout.rank(0, t, s)
            if src == dst:
                shards.append(shard)
                continue
            other = ModelShard.empty(model, layout, src, shard.flat.device)
            dist.recv(other.flat, src)
            shards.append(other)
    by_stage: dict[int, list[ModelShard]] = {}
    for got in shards:
        by_stage.setdefault(got.stage, []).append(got)
    full: dict[str, torch.Tensor] = {}
    for stage_shards in by_stage.values():
        for name, tensor in gather_full_stage(model, stage_shards).items():
            full.setdefault(name, tensor)
    return full


def experts_full(shards: list[ExpertShard]) -> dict[str, torch.Tensor]:
    """Full expert tensors from expert shards covering every (stage, ep rank) of one etp1 layout."""
    out = {}
    for s in shards:
        if s.layout.etp != 1:
            raise ValueError(
                f"experts_full: layout {s.layout} splits experts by etp={s.layout.etp}; "
                "reallocate to an etp1 layout first"
            )
        out.update({name: v.clone() for name, v in s.params().items()})
    missing = (
        [p.name for p in shards[0].model.params if p.expert >= 0 and p.name not in out]
        if shards
        else []
    )
    if missing:
        raise ValueError(f"experts_full: no shard holds {missing[:3]}")
    return out


def gather_experts(experts: ExpertShard, groups) -> dict[str, torch.Tensor] | None:
    """Collective over the layout (as gather_state_dict): full expert tensors on the rank that
    gets the dense ones (layout.rank(0, 0, 0)), None elsewhere. Expert-dp replica 0 of every
    (stage, ep rank) sends its expert buffer."""
    layout, model = experts.layout, experts.model
    dst = layout.rank(0, 0, 0)
    if layout.etp != 1:
        raise ValueError(
            f"gather_experts: layout {layout} has etp={layout.etp}; only etp1 is gathered"
        )
    if groups.rank != dst:
        if experts.edp_rank == 0:
            dist.send(experts.flat, dst)
        return None
    shards = []
    for s in range(layout.pp):
        for g in range(layout.ep):
            src = layout.expert_rank(0, g, 0, s)
            if src == dst:
                shards.append(experts)
                continue
            other = ExpertShard.empty(model, layout, src, experts.flat.device)
            dist.recv(other.flat, src)
            shards.append(other)
    return experts_full(shards)


def gather_full_stage(model: ModelSpec, shards: list[ModelShard]) -> dict[str, torch.Tensor]:
    """gather_full restricted to the parameters present in one stage's shards."""
    names = {e.param.name for e in shards[0].shard_layout.entries}
    sub = ModelSpec(
        name=model.name,
        params=tuple(p for p in model.params if p.name in names),
        num_layers=model.num_layers,
    )
    return gather_full(sub, shards)
