"""Megatron-core's resharding (megatron.core.resharding, gloo copy service) as a benchmark baseline.

Megatron-core is not a dependency of real_py. `make bench-realloc` puts the pinned wheel
(bench/requirements-bench.txt) under bench/.cache/mcore and triton, which its package import
needs, under bench/.cache/site; `load()` adds both to sys.path of the benchmark's own processes.

Running it on CPU needs one shim: its GlooCopyService and executor call torch.cuda.Stream /
stream / current_stream / synchronize and allocate pinned staging buffers. Those modules get a
`torch` proxy whose `cuda` calls are no-ops and whose `empty` drops pin_memory; every other
attribute is the real torch, so the planner, the executor and the copy service run unchanged.

Megatron plans from nn.Modules whose parameters carry its TP attributes (tensor_model_parallel,
partition_dim, partition_stride, partition_sizes for fused blocks) and a `pg_collection` with tp,
dp and pp process groups. `MegatronResharder` builds such modules over views of real_py's shard
buffers, so Megatron reads the source shard and writes the destination shard in place, and the
benchmark checks its output with the same oracle as every other method.

MoE (`MegatronMoeResharder`): the dense tensors as above, with the groups of the layout without
expert axes; each expert tensor as the per-expert parameter of a TEGroupedMLP,
`layers.i.mlp.experts.linear_fc{1,2}.weight{k}` with k the rank-local expert index, tagged as
Megatron's TEGroupedLinear tags them (allreduce=False: expert-parallel, so the planner resolves
k to the global expert through the ep group's rank order; tensor_model_parallel, partition_dim
0 for fc1 and 1 for fc2, split by the expt_tp group). The pg_collection then also carries ep,
expt_tp and expt_dp. Gate|up (fc1) is real_py's "blocked" layout, each half split on its own:
described with partition_sizes, as the dense gate_up is (Megatron's own TEGroupedLinear stamps
partition_stride=1 on fc1 and nothing else, i.e. a contiguous split, which would move a gated
fc1 wrongly across an etp change; its dense MLP uses partition_stride=2 for the same layout).
"""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

CACHE = Path(__file__).resolve().parent / ".cache"
MCORE_DIR, SITE_DIR = CACHE / "mcore", CACHE / "site"


def load():
    """Import megatron.core.resharding from the benchmark cache and patch it for CPU; or raise
    RuntimeError saying how to install it."""
    if not (MCORE_DIR / "megatron" / "core" / "resharding").is_dir():
        raise RuntimeError(
            f"megatron-core is not unpacked under {MCORE_DIR}; run `make bench-realloc`"
        )
    for d in (str(SITE_DIR), str(MCORE_DIR)):
        if d not in sys.path:
            sys.path.insert(0, d)
    import warnings

    with warnings.catch_warnings():
        # Its package import warns about missing Transformer Engine / Apex: irrelevant here.
        warnings.simplefilter("ignore")
        import megatron.core.resharding as resharding
        from megatron.core.resharding import execution
        from megatron.core.resharding.copy_services import gloo_copy_service
    shim = _TorchCpuShim()
    execution.torch = shim
    gloo_copy_service.torch = shim
    return resharding


class _NoStream:
    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass


class _NoCuda:
    """torch.cuda as Megatron's gloo path uses it, made of no-ops (everything runs on CPU)."""

    Stream = _NoStream

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream():
        return _NoStream()

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def empty_cache():
        pass


class _TorchCpuShim(types.SimpleNamespace):
    cuda = _NoCuda

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


class GroupCache:
    """One gloo process group per rank list, created by every rank in the same order."""

    def __init__(self):
        self._groups: dict[tuple[int, ...], object] = {}

    def get(self, ranks) -> object:
        key = tuple(ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), backend="gloo")
        return self._groups[key]

    def for_layout(self, layout) -> dict[int, types.SimpleNamespace]:
        """rank -> pg_collection (tp, dp, pp groups) for every rank of `layout`.

        new_group is collective over the world, so every rank builds every group."""
        out = {}
        for p in range(layout.pp):
            for d in range(layout.dp):
                for t in range(layout.tp):
                    out[layout.rank(d, t, p)] = types.SimpleNamespace(
                        tp=self.get(layout.rank(d, k, p) for k in range(layout.tp)),
                        dp=self.get(layout.rank(k, t, p) for k in range(layout.dp)),
                        pp=self.get(layout.rank(d, t, k) for k in range(layout.pp)),
                    )
        return out


def megatron_module(shard, pg_collection) -> torch.nn.Module:
    """An nn.Module tree whose parameters are views of `shard`'s flat buffer, tagged the way
    Megatron's parallel layers tag theirs. Names keep real_py's global layer indices, which is
    what Megatron's resolved names are after PP canonicalization."""
    root = torch.nn.Module()
    tp = shard.layout.tp
    for name, view in shard.params().items():
        p = shard.model.param(name)
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        param = torch.nn.Parameter(view, requires_grad=False)
        if p.tp.kind != "replicated":
            param.tensor_model_parallel = True
            param.partition_dim = p.tp.dim
            param.partition_stride = 1
            if p.tp.kind == "split" and len(p.blocks) > 1:
                # Fused q|k|v and gate|up: each block split on its own (Megatron's
                # block-interleaved TP, as for Mamba's in_proj).
                param.partition_sizes = [b // tp for b in p.blocks]
        mod.register_parameter(leaf, param)
    root.pg_collection = pg_collection
    return root


class MegatronResharder:
    """Plan once (metadata all-gather + deterministic replay), then `run()` executes the plan."""

    def __init__(self, resharding, groups: GroupCache, service, src_shard, dst_shard, src, dst):
        if any(
            p.tp.kind == "vocab" and p.shape[p.tp.dim] % lay.tp
            for lay in (src, dst)
            for p in (src_shard or dst_shard).model.params
        ):
            raise ValueError(
                "vocab_size must be a multiple of tp for Megatron (it pads the vocab "
                "itself, real_py pads per shard)"
            )
        self.resharding, self.service = resharding, service
        rank = dist.get_rank()
        src_pgs, dst_pgs = groups.for_layout(src), groups.for_layout(dst)
        self.src_mod = megatron_module(src_shard, src_pgs[rank]) if src_shard is not None else None
        self.dst_mod = megatron_module(dst_shard, dst_pgs[rank]) if dst_shard is not None else None
        self.plan = resharding.build_local_reshard_plan(self.src_mod, self.dst_mod)
        self.recv_bytes = self._remote_bytes()

    def _remote_bytes(self) -> int:
        """Bytes this rank receives from other ranks under Megatron's plan."""
        rank = dist.get_rank()
        dst_params = dict(self.dst_mod.named_parameters()) if self.dst_mod is not None else {}
        return sum(
            dst_params[op.param_name][op.my_slice].numel()
            * dst_params[op.param_name].element_size()
            for op in self.plan.recv_ops
            if op.peer_rank != rank
        )

    def run(self) -> None:
        with torch.no_grad():
            self.resharding.execute_reshard_plan(
                self.plan, self.src_mod, self.dst_mod, self.service
            )


def moe_pg_collections(
    groups: GroupCache, layout, dense_layout
) -> dict[int, types.SimpleNamespace]:
    """rank -> pg_collection of an MoE model on `layout`: tp, dp, pp of `dense_layout` (the layout
    without expert axes) plus ep, expt_tp, expt_dp from real_py's expert coordinates (etp fastest,
    then ep, then expert-dp: Megatron's parallel folding). The ep group lists its ranks in ep
    order, which is how Megatron maps a local expert index to the global one."""
    out = groups.for_layout(dense_layout)
    for s in range(layout.pp):
        for d in range(layout.edp):
            for g in range(layout.ep):
                for t in range(layout.etp):
                    pg = out[layout.expert_rank(d, g, t, s)]
                    pg.ep = groups.get(layout.expert_rank(d, k, t, s) for k in range(layout.ep))
                    pg.expt_tp = groups.get(
                        layout.expert_rank(d, g, k, s) for k in range(layout.etp)
                    )
                    pg.expt_dp = groups.get(
                        layout.expert_rank(k, g, t, s) for k in range(layout.edp)
                    )
    return out


_FC = {"gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}


def add_grouped_experts(root: torch.nn.Module, experts) -> None:
    """Add `experts` (an ExpertShard) to `root` as TEGroupedMLP per-expert parameters over views
    of its flat buffer: layers.i.mlp.experts.linear_fc{1,2}.weight{k}, k = global expert -
    first expert of the rank's ep group."""
    layout, model = experts.layout, experts.model
    first = experts.ep_rank * (model.num_experts // layout.ep)
    for name, view in experts.params().items():
        p = model.param(name)
        layer, rest = name.split(".mlp.experts.")
        j, proj, _ = rest.split(".")
        if proj not in _FC:
            raise ValueError(
                f"{name}: no TEGroupedMLP counterpart for {proj!r} (known: {sorted(_FC)})"
            )
        mod = root
        for part in f"{layer}.mlp.experts.{_FC[proj]}".split("."):
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        param = torch.nn.Parameter(view, requires_grad=False)
        param.allreduce = (
            False  # expert parallel (Megatron's convention, utils.extract_param_metadata)
        )
        param.tensor_model_parallel = True
        param.partition_dim = p.tp.dim
        param.partition_stride = 1
        if len(p.blocks) > 1:
            param.partition_sizes = [b // layout.etp for b in p.blocks]
        mod.register_parameter(f"weight{int(j) - first}", param)


class MegatronMoeResharder(MegatronResharder):
    """Megatron's resharding of an MoE model, over a rank's dense ModelShard and ExpertShard.

    `dense` is the dense part's ReallocPlan of the MoePlan (dense spec, layouts without expert
    axes); src/dst_* are None where the rank holds no shard on that side. Collective: every
    rank constructs it. What Megatron refuses (building the modules, its metadata extraction,
    its planner) raises the same RuntimeError on every rank, naming the first refusing rank."""

    def __init__(
        self,
        resharding,
        groups: GroupCache,
        service,
        model,
        dense,
        src,
        dst,
        src_dense,
        src_experts,
        dst_dense,
        dst_experts,
    ):
        self.resharding, self.service = resharding, service
        rank = dist.get_rank()
        src_pgs = moe_pg_collections(groups, src, dense.src)  # collective: before anything can fail
        dst_pgs = moe_pg_collections(groups, dst, dense.dst)
        self.src_mod = self.dst_mod = None
        mine = None
        try:
            if any(
                p.tp.kind == "vocab" and p.shape[p.tp.dim] % lay.tp
                for lay in (src, dst)
                for p in dense.model.params
            ):
                raise ValueError(
                    "vocab_size must be a multiple of tp for Megatron (it pads the "
                    "vocab itself, real_py pads per shard)"
                )
            if src_dense is not None:
                self.src_mod = megatron_module(src_dense, src_pgs[rank])
                add_grouped_experts(self.src_mod, src_experts)
            if dst_dense is not None:
                self.dst_mod = megatron_module(dst_dense, dst_pgs[rank])
                add_grouped_experts(self.dst_mod, dst_experts)
            # build_local_reshard_plan's steps, so that a rank-local refusal (before its
            # all-gather) reaches every rank instead of leaving the others in a collective.
            cache: dict = {}
            mine = tuple(
                resharding.planner._extract_module_metadata(m, rank, model.num_experts, 0, cache)
                for m in (self.src_mod, self.dst_mod)
            )
        except Exception as e:
            mine = f"rank {rank}: {type(e).__name__}: {e}"
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        refused = [g for g in gathered if isinstance(g, str)]
        if refused:
            raise RuntimeError(refused[0])
        # Deterministic replay of the same rosters on every rank: a refusal here is everyone's.
        self.plan = resharding.build_plan_from_rosters(
            *resharding.index_metadata_rosters(gathered), rank
        )
        self.recv_bytes = self._remote_bytes()


__all__ = [
    "load",
    "GroupCache",
    "MegatronResharder",
    "MegatronMoeResharder",
    "megatron_module",
    "moe_pg_collections",
    "add_grouped_experts",
]
