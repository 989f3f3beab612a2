"""Parameter specs: parameter names, global shapes, dtypes, owners and TP partition rules.

A `ModelSpec` is the single source of truth shared by the planner (which bytes live where),
the shard buffers (flat-buffer offsets) and the models (parameter names and shapes).

TP partition rules (`TPRule`), for a parameter viewed as [A, D, B] around its split dim:
  replicated  every TP rank holds the whole tensor.
  split       dim `dim` is cut into `blocks` (fused tensors: q|k|v, gate|up); each block is
              split evenly across TP ranks; a rank's local tensor is its piece of every block,
              concatenated in block order.
  vocab       dim `dim` is padded up to a multiple of vocab_multiple * tp and split evenly;
              padding rows are zero and never transferred.

Storage formats (how a rank's local tensor orders its rows; the two sides of a reallocation may
differ, the planner converts exactly). Full tensors are always in the blocked order, q|k|v and
gate|up concatenated as HF concatenates them:
  groups=0    blocked: a TP rank's local tensor is its piece of every block, in block order.
  groups=G    interleaved: the blocks are cut into G groups, group j holding the j-th 1/G of every
              block in block order; a TP rank holds G/tp consecutive groups. Megatron-core's fused
              linear_qkv is G = num_key_value_heads
              ([q heads of group 0, k0, v0, q of group 1, ...]).
  Megatron-core's linear_fc1 (swiglu) holds [gate piece; up piece] per TP rank: that is blocked.
  replicate_units  blocked, but a block whose unit count (TPRule.units) is smaller than tp is not
              split: each unit is held whole by tp / units consecutive TP ranks (vLLM's
              QKVParallelLinear when tp > num_key_value_heads: rank k holds kv head k // (tp / nkv)
              in both its k and its v block).

One file past 400 lines: TPRule, ParamSpec and ModelSpec, whose __post_init__ checks enforce the
rules above, and model_spec, which fills them from its parameter table for every supported
architecture, are that single source of truth and change together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import DTYPE_SIZES, ModelConfig, preset

ALIGN_BYTES = 64  # every parameter starts on a 64-byte boundary of its shard's flat buffer


@dataclass(frozen=True, slots=True, kw_only=True)
class TPRule:
    kind: str = "replicated"
    """One of "replicated", "split", "vocab"."""
    dim: int = 0
    """Tensor dim that is split (ignored for replicated)."""
    blocks: tuple[int, ...] = ()
    """Sizes of the fused blocks along `dim` (sum == shape[dim]); () means one block."""
    units: tuple[tuple[str, int], ...] = ()
    """Per block, (config name, count) that tp must divide, e.g. ("num_key_value_heads", 8)."""
    groups: int = 0
    """split: 0 = blocked storage; G > 0 = blocks interleaved in G groups (module docstring)."""
    vocab_multiple: int = 1
    """vocab: rows padded to a multiple of vocab_multiple * tp (Megatron-core: 128)."""
    replicate_units: bool = False
    """split, blocked storage: a block whose unit count (TPRule.units, e.g. ("num_key_value_heads",
    nkv)) is smaller than tp is replicated: TP rank k holds unit k // (tp / units), and tp must
    be a multiple of the count; vLLM's kv heads. Other blocks split as usual."""

    def __post_init__(self):
        if self.kind not in ("replicated", "split", "vocab"):
            raise ValueError(f"TPRule.kind={self.kind!r}; allowed: 'replicated', 'split', 'vocab'")
        if self.groups < 0 or (self.groups and self.kind != "split"):
            raise ValueError(
                f"TPRule.groups={self.groups} must be >= 0 and only set on a split rule"
            )
        if self.vocab_multiple < 1 or (self.vocab_multiple > 1 and self.kind != "vocab"):
            raise ValueError(
                f"TPRule.vocab_multiple={self.vocab_multiple} must be >= 1 and only "
                "set on a vocab rule"
            )
        if self.units and len(self.units) != len(self.blocks):
            raise ValueError(
                f"TPRule.units has {len(self.units)} entries for {len(self.blocks)} blocks"
            )
        if self.replicate_units and (self.kind != "split" or not self.units or self.groups):
            raise ValueError(
                "TPRule.replicate_units needs a split rule with units and blocked storage "
                f"(groups=0); got kind={self.kind!r}, units={self.units}, groups={self.groups}"
            )


REPLICATED = TPRule()


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    owner: str
    """"embed", "layer", "final_norm" or "head"."""
    layer: int = -1
    """Layer index for owner == "layer"."""
    tp: TPRule = REPLICATED
    tied_to_head: bool = False
    """Tied input embedding: the head's pipeline stage holds a copy too."""
    expert: int = -1
    """Expert index of an MoE expert tensor (split over ep by index, within it by etp under
    `tp`); -1 for every other parameter."""

    def __post_init__(self):
        if self.owner not in ("embed", "layer", "final_norm", "head"):
            raise ValueError(
                f"{self.name}: owner={self.owner!r}; allowed: embed, layer, final_norm, head"
            )
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{self.name}: dtype={self.dtype!r}; allowed: {sorted(DTYPE_SIZES)}")
        if any(s <= 0 for s in self.shape):
            raise ValueError(f"{self.name}: shape {self.shape} has a non-positive dim")
        if self.tp.kind != "replicated":
            if not 0 <= self.tp.dim < len(self.shape):
                raise ValueError(
                    f"{self.name}: split dim {self.tp.dim} out of range for shape {self.shape}"
                )
            if self.tp.blocks and sum(self.tp.blocks) != self.shape[self.tp.dim]:
                raise ValueError(
                    f"{self.name}: blocks {self.tp.blocks} sum to {sum(self.tp.blocks)}, "
                    f"not shape[{self.tp.dim}]={self.shape[self.tp.dim]}"
                )
            if self.tp.groups and any(b % self.tp.groups for b in self.blocks):
                raise ValueError(
                    f"{self.name}: groups={self.tp.groups} does not divide every "
                    f"block of {self.blocks}"
                )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.tp.blocks or (self.shape[self.tp.dim],)

    def geometry(self) -> tuple[int, int, int]:
        """(A, D, B): the tensor viewed as [A, D, B] around its split dim (D = numel if
        replicated)."""
        if self.tp.kind == "replicated":
            return 1, self.numel, 1
        d = self.tp.dim
        return math.prod(self.shape[:d]), self.shape[d], math.prod(self.shape[d + 1 :])

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one TP rank's piece (identical on every TP rank; vocab includes padding)."""
        if self.tp.kind == "replicated":
            return self.shape
        d, size = self.tp.dim, self.shape[self.tp.dim]
        m = self.tp.vocab_multiple
        if self.tp.kind == "vocab":
            local = -(-size // (m * tp)) * m
        elif self.tp.replicate_units:  # a replicated block keeps one whole unit per rank
            local = sum(b // min(tp, n) for b, (_, n) in zip(self.blocks, self.tp.units))
        else:
            local = size // tp
        return self.shape[:d] + (local,) + self.shape[d + 1 :]

    def tp_error(self, tp: int) -> str | None:
        """Why `tp` cannot split this parameter, or None."""
        if self.tp.kind != "split":
            return None
        # Checked for every parameter of every layout a plan touches: name the unit (an
        # f-string per block) only once a block fails.
        units = self.tp.units
        for i, block in enumerate(self.blocks):
            if self.tp.replicate_units and units[i][1] < tp:
                unit, count = units[i]
                if tp % count or block % count:
                    return (
                        f"tp={tp} is above {unit}={count} and not a multiple of it "
                        f"(replicate_units: each of the {count} units is held by "
                        f"tp / {count} TP ranks)"
                    )
                continue
            if block % tp or (units and units[i][1] % tp):
                unit, count = units[i] if units else (f"{self.name}.shape[{self.tp.dim}]", block)
                return f"tp={tp} does not divide {unit}={count}"
        if self.tp.groups % tp:
            return f"tp={tp} does not divide the {self.tp.groups} interleaved groups"
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    name: str
    params: tuple[ParamSpec, ...]
    """In forward key order: embedding, layers in order, final norm, head."""
    num_layers: int
    config: ModelConfig | None = field(default=None, compare=False)
    """The config it was built from (None for hand-built specs); not part of equality."""
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _experts: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # Specs key every plan/layout cache; hashing 700+ params per lookup dominated planning.
        return self._hash

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.name, self.params, self.num_layers)))
        object.__setattr__(self, "_experts", max((p.expert for p in self.params), default=-1) + 1)
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"ModelSpec {self.name}: duplicate parameter names {dup[:5]}")
        for p in self.params:
            if p.owner == "layer" and not 0 <= p.layer < self.num_layers:
                raise ValueError(f"{p.name}: layer={p.layer} outside [0, {self.num_layers})")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(
                f"ModelSpec {self.name}: mixed dtypes {sorted(dtypes)}; a shard's flat "
                "buffer holds one dtype, so cast the model to one dtype first"
            )

    @property
    def dtype(self) -> str:
        return self.params[0].dtype

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0: a dense model)."""
        return self._experts

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def tp_choices(self, limit: int = 1024) -> list[int]:
        """Every tp in [1, limit] that splits all parameters."""
        return [
            t
            for t in range(1, limit + 1)
            if all(p.tp_error(t) is None for p in self.params if p.expert < 0)
        ]

    def check_tp(self, tp: int) -> None:
        """Raise ValueError naming the first parameter that tp cannot split."""
        for p in self.params:
            why = p.tp_error(tp) if p.expert < 0 else None  # experts split by etp (check_experts)
            if why:
                name = (
                    p.name
                    if p.owner != "layer"
                    else p.name.replace(f"layers.{p.layer}.", "layers.*.", 1)
                )
                choices = [t for t in self.tp_choices(limit=max(64, tp)) if t <= max(64, tp)]
                raise ValueError(f"{why} of {name}; pick tp in {{{', '.join(map(str, choices))}}}")

    def check_compatible(self, other: ModelSpec, *, storage: bool = False) -> None:
        """Raise ValueError if `other` disagrees on a parameter's name set, shape, dtype or rule.

        storage: let the two differ in storage format (TPRule.groups, vocab_multiple,
        replicate_units), which a reallocation plan converts between.
        """
        mine, theirs = {p.name: p for p in self.params}, {p.name: p for p in other.params}
        if mine.keys() != theirs.keys():
            only_a, only_b = (
                sorted(mine.keys() - theirs.keys()),
                sorted(theirs.keys() - mine.keys()),
            )
            raise ValueError(
                f"model specs disagree on parameter names: only in src {only_a[:5]}, "
                f"only in dst {only_b[:5]}"
            )
        for name, a in mine.items():
            b = theirs[name]
            for attr in ("shape", "dtype", "tp", "owner", "layer", "tied_to_head", "expert"):
                if storage and attr == "tp" and _logical(a.tp) == _logical(b.tp):
                    continue
                if getattr(a, attr) != getattr(b, attr):
                    raise ValueError(
                        f"model specs disagree on {name}.{attr}: src {getattr(a, attr)} "
                        f"vs dst {getattr(b, attr)}"
                    )


def _logical(rule: TPRule) -> TPRule:
    """The rule without its storage format (what full tensors and the TP split depend on)."""
    from dataclasses import replace

    return replace(rule, groups=0, vocab_multiple=1, replicate_units=False)


def _moe_params(c: ModelConfig, pre: str, lp: list) -> list:
    """An MoE layer's MLP: router and shared expert appended to `lp` (dense rules), the expert
    tensors returned as (name, shape, rule, expert): every expert's fused gate|up, then every
    expert's down, so that a rank's consecutive experts form the stacked grouped-GEMM tensors
    [E_local, 2I/etp, H] and [E_local, H, I/etp] (spec.moe.stacked_views)."""
    H, Im, E = c.hidden_size, c.moe_intermediate_size, c.num_experts
    lp.append((pre + "mlp.gate.weight", (E, H), REPLICATED))  # router: replicated, fp32 compute
    Is = c.shared_expert_intermediate_size
    if Is:
        lp += [
            (
                pre + "mlp.shared_expert.gate_up_proj.weight",
                (2 * Is, H),
                TPRule(
                    kind="split",
                    dim=0,
                    blocks=(Is, Is),
                    units=(("shared_expert_intermediate_size", Is),) * 2,
                ),
            ),
            (
                pre + "mlp.shared_expert.down_proj.weight",
                (H, Is),
                TPRule(
                    kind="split",
                    dim=1,
                    blocks=(Is,),
                    units=(("shared_expert_intermediate_size", Is),),
                ),
            ),
        ]
        if c.shared_expert_gate:
            lp.append((pre + "mlp.shared_expert_gate.weight", (1, H), REPLICATED))
    gu = TPRule(kind="split", dim=0, blocks=(Im, Im), units=(("moe_intermediate_size", Im),) * 2)
    down = TPRule(kind="split", dim=1, blocks=(Im,), units=(("moe_intermediate_size", Im),))
    return [(f"{pre}mlp.experts.{j}.gate_up_proj.weight", (2 * Im, H), gu, j) for j in range(E)] + [
        (f"{pre}mlp.experts.{j}.down_proj.weight", (H, Im), down, j) for j in range(E)
    ]


def model_spec(config: ModelConfig | str, name: str | None = None) -> ModelSpec:
    """Build the fused-parameter spec of a LLaMA-style decoder.

    Parameters (H hidden, I intermediate, nh/nkv heads, hd head dim, V vocab):
      embed_tokens.weight                   [V, H]            vocab split dim 0
      layers.i.input_layernorm.weight       [H]               replicated (not with norm_after)
      layers.i.self_attn.qkv_proj.weight    [(nh+2nkv)hd, H]  split dim 0, blocks q|k|v
      layers.i.self_attn.qkv_proj.bias      [(nh+2nkv)hd]     (attention_bias only)
      layers.i.self_attn.q_norm.weight      [hd]              replicated (qk_norm only, Qwen3)
      layers.i.self_attn.k_norm.weight      [hd]              replicated (qk_norm only)
        (qk_norm_whole, OLMo 2: q_norm [nh*hd], k_norm [nkv*hd], split dim 0 by heads)
      layers.i.self_attn.o_proj.weight      [H, nh*hd]        split dim 1
      layers.i.self_attn.o_proj.bias        [H]               replicated (o_proj_bias only)
      layers.i.post_attention_layernorm.w.  [H]               replicated
      layers.i.mlp.gate_up_proj.weight      [2I, H]           split dim 0, blocks gate|up
      layers.i.mlp.gate_up_proj.bias        [2I]              split like the weight (mlp_bias)
      layers.i.mlp.down_proj.weight         [H, I]            split dim 1
      layers.i.mlp.down_proj.bias           [H]               replicated (mlp_bias)
      layers.i.pre_feedforward_layernorm.w  [H]               replicated (sandwich_norm, Gemma)
      layers.i.post_feedforward_layernorm.w [H]               replicated (norm_after, OLMo 2;
                                                              sandwich_norm)
    MoE layers (ModelConfig.is_moe_layer; Im = moe_intermediate_size, E experts) instead of mlp.*:
      layers.i.mlp.gate.weight              [E, H]            replicated (router)
      layers.i.mlp.shared_expert.gate_up_proj.weight / down_proj.weight
                                                              (shared expert, dense rules)
      layers.i.mlp.shared_expert_gate.weight [1, H]           replicated (Qwen2-MoE)
      layers.i.mlp.experts.j.gate_up_proj.w [2Im, H]          expert j; etp split dim 0, gate|up
      layers.i.mlp.experts.j.down_proj.w    [H, Im]           expert j; etp split dim 1
      norm.weight                           [H]               replicated
      lm_head.weight                        [V, H]            vocab split (untied lm head)
      value_head.weight                     [1, H]            replicated (value head)

    config.qkv_layout / gate_up_layout / vocab_pad_multiple / kv_head_replicas set the storage
    format (TPRule.groups, vocab_multiple, replicate_units) of qkv_proj, gate_up_proj and the
    vocab-split tensors.
    """
    if isinstance(config, str):
        name = name or config
        config = preset(config)
    c, dt = config, config.dtype
    H, I, hd, nh, nkv, V = (
        c.hidden_size,
        c.intermediate_size,
        c.head_dim,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
    )
    heads = (
        ("num_attention_heads", nh),
        ("num_key_value_heads", nkv),
        ("num_key_value_heads", nkv),
    )
    qkv = TPRule(
        kind="split",
        dim=0,
        blocks=(nh * hd, nkv * hd, nkv * hd),
        units=heads,
        groups=nkv if c.qkv_layout == "megatron_grouped" else 0,
        replicate_units=c.kv_head_replicas,
    )
    vocab = TPRule(kind="vocab", dim=0, vocab_multiple=c.vocab_pad_multiple)
    tied = c.tie_word_embeddings and c.head == "lm"
    params = [
        ParamSpec(
            name="embed_tokens.weight",
            shape=(V, H),
            dtype=dt,
            owner="embed",
            tp=vocab,
            tied_to_head=tied,
        )
    ]
    for i in range(c.num_hidden_layers):
        pre = f"layers.{i}."
        lp: list[tuple[str, tuple[int, ...], TPRule]] = (
            [] if c.norm_after else [(pre + "input_layernorm.weight", (H,), REPLICATED)]
        )
        lp.append((pre + "self_attn.qkv_proj.weight", ((nh + 2 * nkv) * hd, H), qkv))
        if c.attention_bias:
            lp.append((pre + "self_attn.qkv_proj.bias", ((nh + 2 * nkv) * hd,), qkv))
        if c.qk_norm and c.qk_norm_whole:  # OLMo 2: one weight per projection row, split by heads
            lp += [
                (
                    pre + "self_attn.q_norm.weight",
                    (nh * hd,),
                    TPRule(
                        kind="split", dim=0, blocks=(nh * hd,), units=(("num_attention_heads", nh),)
                    ),
                ),
                (
                    pre + "self_attn.k_norm.weight",
                    (nkv * hd,),
                    TPRule(
                        kind="split",
                        dim=0,
                        blocks=(nkv * hd,),
                        units=(("num_key_value_heads", nkv),),
                    ),
                ),
            ]
        elif c.qk_norm:  # per-head norms: every TP rank applies the same [hd] weight to its heads
            lp += [
                (pre + "self_attn.q_norm.weight", (hd,), REPLICATED),
                (pre + "self_attn.k_norm.weight", (hd,), REPLICATED),
            ]
        gate_up = TPRule(
            kind="split",
            dim=0,
            blocks=(I, I),
            units=(("intermediate_size", I), ("intermediate_size", I)),
            groups=I if c.gate_up_layout == "interleaved" else 0,
        )
        lp.append(
            (
                pre + "self_attn.o_proj.weight",
                (H, nh * hd),
                TPRule(
                    kind="split", dim=1, blocks=(nh * hd,), units=(("num_attention_heads", nh),)
                ),
            )
        )
        if c.o_proj_bias:  # added once, after the row-parallel all-reduce
            lp.append((pre + "self_attn.o_proj.bias", (H,), REPLICATED))
        lp.append((pre + "post_attention_layernorm.weight", (H,), REPLICATED))
        if c.sandwich_norm:  # Gemma 2/3: norm on the MLP input as well as on both sublayer outputs
            lp.append((pre + "pre_feedforward_layernorm.weight", (H,), REPLICATED))
        experts = []
        if c.is_moe_layer(i):
            experts = _moe_params(c, pre, lp)
        else:
            lp.append((pre + "mlp.gate_up_proj.weight", (2 * I, H), gate_up))
            if c.mlp_bias:
                lp.append((pre + "mlp.gate_up_proj.bias", (2 * I,), gate_up))
            lp.append(
                (
                    pre + "mlp.down_proj.weight",
                    (H, I),
                    TPRule(kind="split", dim=1, blocks=(I,), units=(("intermediate_size", I),)),
                )
            )
            if c.mlp_bias:
                lp.append((pre + "mlp.down_proj.bias", (H,), REPLICATED))
        if c.norm_after or c.sandwich_norm:
            lp.append((pre + "post_feedforward_layernorm.weight", (H,), REPLICATED))
        params += [
            ParamSpec(name=n, shape=s, dtype=dt, owner="layer", layer=i, tp=r) for n, s, r in lp
        ]
        params += [
            ParamSpec(name=n, shape=s, dtype=dt, owner="layer", layer=i, tp=r, expert=j)
            for n, s, r, j in experts
        ]
    params.append(ParamSpec(name="norm.weight", shape=(H,), dtype=dt, owner="final_norm"))
    if c.head == "value":
        params.append(ParamSpec(name="value_head.weight", shape=(1, H), dtype=dt, owner="head"))
    elif not tied:
        params.append(
            ParamSpec(name="lm_head.weight", shape=(V, H), dtype=dt, owner="head", tp=vocab)
        )
    return ModelSpec(
        name=name or "model", params=tuple(params), num_layers=c.num_hidden_layers, config=c
    )
