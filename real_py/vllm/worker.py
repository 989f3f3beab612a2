"""vLLM worker side of the `real_py` weight-transfer backend (runs inside every vLLM worker).

    init_transfer_engine   check the trainer's model against vLLM's, join the transfer group,
                           plan the move trainer layout -> this worker's live format, allocate
                           the receive shard
    start_weight_update    nothing (weights stay live until a whole update has arrived)
    receive_weights        receive this worker's exact shard (real_py Reallocator over gloo),
                           then write it into the live parameters and re-process touched layers
    finish_weight_update   nothing (the trainer engine resets the prefix cache after it)

An update is received into a shard buffer of this worker's own (one local copy of the model)
and only written into the live parameters once all of it arrived: a trainer that dies or sends
a wrong model mid-update fails the update on both sides and vLLM keeps serving the previous
weights (the transfer group is then broken: initialize the engine again before the next update).

A model whose parameters real_py cannot place in vLLM's live format (names.unknown_params)
falls back to full tensors: every worker receives the whole model (still straight from the
trainer ranks' shards, no gather) and loads it through vLLM's own `load_weights` inside its
layerwise reload; one log line names the parameters that caused it.

One file past 400 lines: most of it is RealPyWeightTransferEngine, whose hooks share the transfer
group, plan and receive shard that init_transfer_engine sets up; the helpers before it are the
ones the trainer side (trainer.py, rollout.py) checks against the same plan.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, replace

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..layout import Layout
from ..realloc import (
    DistTransport,
    ExpertShard,
    ModelShard,
    Reallocator,
    plan_moe_realloc,
    plan_realloc,
)
from ..realloc.moe_exec import MoeReallocator
from ..realloc.reallocator import DEFAULT_BUCKET_BYTES
from ..realloc.transports.store_group import TransferGroup, publish_ready, wait_ready
from ..spec import ModelConfig, model_spec, torch_dtype, vllm_config
from .names import EXPERTS_MODULE, config_from_dict, unknown_params, vllm_name

log = logging.getLogger("real_py.vllm")


@dataclass
class RealPyInitInfo(WeightTransferInitInfo):
    """What the trainer sends every worker at init (JSON-safe)."""

    master_address: str
    master_port: int
    num_trainers: int
    config: dict
    """The trainer's ModelConfig (names.config_dict): shapes and the trainer's storage format."""
    layout: dict
    """The trainer's real_py Layout (dataclasses.asdict)."""
    num_workers: int
    """vLLM workers the trainer expects (tensor_parallel_size * data_parallel_size)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 300.0
    full_tensors: bool = False
    """Send every worker the full tensors and load them with vLLM's load_weights (the path
    other trainers take; measured against in bench/bench_vllm_sync.py)."""
    transport: str = "gloo"
    """"gloo" (the receive shard in host memory, then copied into the live parameters) or
    "nccl" (on the worker's GPU; trainer shards on their GPUs)."""


@dataclass
class RealPyUpdateInfo(WeightTransferUpdateInfo):
    version: int
    model: str
    """The trainer spec's fingerprint (name and shapes), checked against the one at init."""


def vllm_plan(config: ModelConfig, src: Layout, num_trainers: int, tp: int, dp: int, full: bool):
    """The plan every member replays: trainer layout `src` (ranks 0..num_trainers-1) -> the vLLM
    workers (ranks after them, tp fastest) in vLLM's live format, or, `full`, the whole model on
    every worker in blocked storage (for load_weights)."""
    ranks = tuple(range(num_trainers, num_trainers + tp * dp))
    if full:
        dst_cfg = replace(
            config, qkv_layout="blocked", gate_up_layout="blocked", vocab_pad_multiple=1
        )
        dst = Layout(dp=tp * dp, ranks=ranks)
    else:  # MoE: every expert on every worker, each split by tp (vLLM without expert parallelism)
        dst_cfg = vllm_config(config, tp)
        dst = Layout(dp=dp, tp=tp, etp=tp if config.num_experts else 1, ranks=ranks)
    if config.num_experts:
        return plan_moe_realloc(model_spec(config), src, dst, dst_model=model_spec(dst_cfg))
    return plan_realloc(model_spec(config), src, dst, dst_model=model_spec(dst_cfg))


def trainers_disagree(ready: dict, num_trainers: int) -> str:
    """Which trainer rank's settings (model, layout, worker count, bucket, timeout, path,
    transport) differ from rank 0's, from the readiness records: "" when none. Every member
    reads the same records, so all of them refuse together."""
    first = ready[0]["extra"]["settings"]
    for r in range(1, num_trainers):
        if ready[r]["extra"]["settings"] != first:
            return (
                f"trainer rank {r} was initialized with {ready[r]['extra']['settings']}, "
                f"rank 0 with {first} (fingerprint, num_workers, bucket_bytes, timeout_s, "
                "full_tensors, transport must agree)"
            )
    return ""


def check_live_shapes(model: torch.nn.Module, spec, tp: int, side: str) -> None:
    """Every live vLLM tensor that still has its loaded shape (on CPU the linear weights are
    prepacked and emptied) has the shape the plan writes; a mismatch is a format real_py does
    not know, never a silent wrong write."""
    live, modules = dict(model.named_parameters()), dict(model.named_modules())
    for p in spec.params:
        if p.expert >= 0:  # stacked, maybe padded and prepacked by the MoE kernel
            continue
        name = vllm_name(p.name)
        shape = tuple(live[name].shape)
        owner = modules[name.rsplit(".", 1)[0]]
        if (
            not live[name].numel()
            and name.endswith(".weight")
            and hasattr(owner, "input_size_per_partition")
        ):
            shape = (owner.output_size_per_partition, owner.input_size_per_partition)  # prepacked
        if live[name].numel() or len(shape) == 2:
            if shape != p.local_shape(tp):
                raise RuntimeError(
                    f"{side}: vLLM holds {name} as {shape}, real_py planned "
                    f"{p.local_shape(tp)} for tp={tp}"
                )


def write_dense(model: torch.nn.Module, spec, shard: ModelShard) -> None:
    """Write a received shard in vLLM's live per-rank format (spec = model_spec(vllm_config(...)),
    experts excluded) into the live vLLM model, then re-run what vLLM runs after loading on every
    module holding a written parameter. The shard is not kept: a layer that would keep the
    buffer gets its own copy."""
    live = dict(model.named_parameters())
    touched, lent = set(), set()
    with torch.no_grad():
        for p in spec.params:
            if p.expert >= 0:
                continue
            t = shard.view(p.name)
            param = live[vllm_name(p.name)]
            if tuple(param.shape) == tuple(t.shape):
                param.data.copy_(t)
            else:  # prepacked on CPU (an empty tensor): lend the layer the received weight,
                param.data = t  # which its re-processing packs into a copy of its own
                lent.add(id(param))
            touched.add(id(param))
    # Re-run what vLLM runs after loading on every module holding a written parameter (a tied
    # lm_head holds the embedding's: its packed copy is rebuilt too). Not on the input embedding:
    # its lookup reads the weight itself, and the GEMM copy vLLM's CPU backend packs for it at
    # load is never used (a tied lm_head packs its own): a third of the re-processing of a 0.5B
    # model (bench/results/vllm_sync_cpu2_*).
    buffer = shard.flat.untyped_storage().data_ptr()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or type(module).__name__ == "VocabParallelEmbedding":
            continue
        mine = {n: v for n, v in module._parameters.items() if v is not None and id(v) in touched}
        if not mine:
            continue
        method.process_weights_after_loading(module)
        # A layer must not keep the receive buffer (the next update overwrites it before every
        # worker agreed to write). The CPU packers copy the lent weight and drop it for an empty
        # tensor; one that keeps it (no prepack on this platform, or a packer that captures it)
        # gets its own copy and is processed again.
        if any(id(v) in lent for v in mine.values()) and _holds_storage(module, buffer):
            for n, v in mine.items():
                if id(v) in lent:
                    v.data = v.data.clone()
                    module._parameters[n] = v
            method.process_weights_after_loading(module)


def _holds_storage(module: torch.nn.Module, ptr: int) -> bool:
    """Whether the module keeps a tensor on the storage at ptr: as a parameter or buffer, an
    attribute, or captured by a callable attribute (vLLM's CPU GEMM dispatch stores closures)."""

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif callable(value):
            for cell in getattr(value, "__closure__", None) or ():
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(content, torch.Tensor):
                    yield content
            for default in getattr(value, "__defaults__", None) or ():
                if isinstance(default, torch.Tensor):
                    yield default

    values = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
    return any(
        t.numel() and t.untyped_storage().data_ptr() == ptr
        for v in values
        if v is not None
        for t in tensors(v)
    )


def fingerprint(config: ModelConfig, layout: Layout) -> str:
    """Names, shapes, dtype and storage of the trainer's model and its layout, as one short
    string that every process computes alike (no salted hash())."""
    spec = model_spec(config)
    text = repr([(p.name, p.shape, p.tp) for p in spec.params]) + config.dtype + repr(layout)
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    return f"{config.model_type}:{digest}:{config.dtype}:{layout}"


class RealPyWeightTransferEngine(WeightTransferEngine[RealPyInitInfo, RealPyUpdateInfo]):
    init_info_cls = RealPyInitInfo
    update_info_cls = RealPyUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self.realloc: Reallocator | None = None
        self.store = None

    # ------------------------------------------------------------------ init

    # vLLM's executor reads only the first failed worker's answer to a collective call and leaves
    # the others' in their queues, where the next call reads them (vLLM 0.32): so these methods
    # never raise into vLLM. A failure is logged here (one line naming this worker and the cause)
    # and reported through the group's store, where the trainer engine raises it.

    def init_transfer_engine(self, info: RealPyInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        self._broken()  # a new trainer, or the same one after a failed update: a new group
        pc = self.parallel_config
        tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
        self.index = pc.data_parallel_index * pc.world_size + get_tensor_model_parallel_rank()
        self.side = (
            f"vLLM worker {self.index} (dp {pc.data_parallel_index}, tp rank "
            f"{get_tensor_model_parallel_rank()} of {tp})"
        )
        T, W = int(info.num_trainers), tp * dp
        self.num_workers, self.timeout_s = W, float(info.timeout_s)
        try:
            group = TransferGroup.connect(
                info.master_address, info.master_port, T + self.index, T + W, info.timeout_s
            )
        except Exception as e:
            log.error("real_py: %s: %s", self.side, e)
            return
        self.store = group.store
        try:
            self._setup(info, T, W, tp, dp, pc.pipeline_parallel_size)
        except Exception as e:
            log.error("real_py: %s refuses the trainer: %s: %s", self.side, type(e).__name__, e)
            publish_ready(group, f"{type(e).__name__}: {e}")
            return
        publish_ready(group, None, extra=self._mode if self.index == 0 else None)
        try:
            disagree = trainers_disagree(wait_ready(group, self.side), T)
            if disagree:
                raise RuntimeError(disagree)
            self.group = group.build(info.transport)
            self.transport = DistTransport(
                self.group.pg, timeout=info.timeout_s, store=self.group.store
            )
            move = MoeReallocator if self.experts is not None else Reallocator
            self.realloc = move(self.plan, self.transport, bucket_bytes=info.bucket_bytes)
        except Exception as e:
            log.error("real_py: %s: %s", self.side, e)
            self._broken()
            return
        log.info(
            "real_py: %s receives %s from %d trainer ranks",
            self.side,
            "full tensors (load_weights)" if self.full else "its shard in place",
            T,
        )

    def _setup(self, info: RealPyInitInfo, T: int, W: int, tp: int, dp: int, pp: int) -> None:
        if pp != 1:
            raise ValueError(
                f"{self.side}: vLLM pipeline_parallel_size={pp}; the real_py backend "
                "writes tensor- and data-parallel workers (pipeline_parallel_size=1)"
            )
        if info.transport not in ("gloo", "nccl") or (
            info.transport == "nccl" and self.device.type != "cuda"
        ):
            raise ValueError(
                f"{self.side}: transport={info.transport!r} on a worker on {self.device}; "
                "allowed: 'gloo', or 'nccl' with vLLM on GPUs"
            )
        if info.num_workers != W:
            raise ValueError(
                f"{self.side}: the trainer expects {info.num_workers} vLLM workers, this "
                f"engine has {W} (tensor_parallel_size={tp} x data_parallel_size={dp})"
            )
        cfg = config_from_dict(info.config)
        src = Layout(**info.layout)
        if tuple(src.ranks) != tuple(range(T)):
            raise ValueError(f"{self.side}: trainer layout {src} must use ranks 0..{T - 1}")
        own = self._own_config(cfg)
        want = torch_dtype(cfg.dtype)
        if self.model_config.dtype != want:
            raise ValueError(
                f"{self.side}: the trainer sends {cfg.dtype}, vLLM runs {self.model_config.dtype}; "
                "cast the trainer's shards (reallocation moves raw bytes) or start vLLM "
                f"with dtype={cfg.dtype}"
            )
        live = model_spec(vllm_config(own, tp))
        dst_spec = model_spec(vllm_config(cfg, tp))
        try:
            dst_spec.check_compatible(live)
        except ValueError as e:
            raise ValueError(
                f"{self.side}: the trainer's model does not match vLLM's "
                f"({self.model_config.model}): {e}"
            ) from None
        unknown = unknown_params(dst_spec, self.model)
        if cfg.num_experts and (unknown or info.full_tensors):
            # vLLM's CPU reload re-packs no experts on a weight update (UnquantizedFusedMoEMethod
            # skips the kernel's prepack once set up): loading full tensors would serve garbage.
            raise ValueError(
                f"{self.side}: {cfg.model_type} has experts and "
                + (
                    f"real_py does not know the vLLM loader of {', '.join(unknown[:4])}"
                    if unknown
                    else "full_tensors=True was asked"
                )
                + "; MoE models go in place only (vLLM's own reload does not re-pack "
                "experts on its CPU backend)"
            )
        self.full = bool(info.full_tensors or unknown)
        if unknown:
            log.warning(
                "real_py: %s falls back to full tensors and load_weights: real_py does not "
                "know the vLLM loader of %s",
                self.side,
                ", ".join(unknown[:8])
                + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""),
            )
        if not self.full:
            self._check_live_shapes(dst_spec, tp)
        self._mode = {"full": self.full, "unknown": unknown[:32], "tp": tp, "dp": dp}
        self.fingerprint = fingerprint(cfg, src)
        self.plan = vllm_plan(cfg, src, T, tp, dp, self.full)
        self.dst_spec, self.dst = self.plan.dst_model, self.plan.dst
        device = self.device if info.transport == "nccl" else "cpu"
        self.shard = ModelShard.empty(self.dst_spec, self.dst, T + self.index, device=device)
        self.experts = (
            ExpertShard.empty(self.dst_spec, self.dst, T + self.index, device=device)
            if cfg.num_experts
            else None
        )

    def _own_config(self, cfg: ModelConfig) -> ModelConfig:
        """vLLM's model as a real_py ModelConfig (its checkpoint's config.json when vLLM loaded a
        local directory), in the trainer's dtype and storage so that only shapes are compared."""
        path = self.model_config.model
        source = (
            path
            if os.path.isfile(os.path.join(str(path), "config.json"))
            else self.model_config.hf_config.to_dict()
        )
        own = ModelConfig.from_hf(source)
        return replace(own, dtype=cfg.dtype)

    def _check_live_shapes(self, spec, tp: int) -> None:
        check_live_shapes(self.model, spec, tp, self.side)

    # ------------------------------------------------------------------ updates

    def start_weight_update(self) -> None:
        pass

    def receive_weights(self, info: RealPyUpdateInfo) -> None:
        """Receive the whole update into this worker's shard buffer; write it into the live
        parameters only once every worker has received all of its own (a worker that writes while a
        peer failed would serve tensor-parallel halves of two models). On any failure before the
        write every worker keeps the previous weights. The outcome goes to the store under
        stats/<version>/<worker> ("error" on failure; "partly_written" if the write itself
        failed)."""
        step = f"update {info.version}"
        report = {"worker": self.index, "full": getattr(self, "full", None)}
        received = False
        try:
            if self.realloc is None:
                raise RuntimeError(
                    "no transfer group (init_weight_transfer_engine failed or was not "
                    "called, or an earlier update failed): initialize again"
                )
            if info.model != self.fingerprint:
                why = (
                    f"the trainer sends {info.model}, this engine was initialized for "
                    f"{self.fingerprint}; initialize the engine again for a new model or layout"
                )
                self.transport.fail(step, why)
                raise ValueError(why)
            t0 = time.perf_counter()
            try:
                stats = (
                    self.realloc.run(None, None, self.shard, self.experts)
                    if self.experts is not None
                    else self.realloc.run(None, self.shard)
                )
            except BaseException as e:
                self.store.set(
                    f"recv/{info.version}/{self.index}", f"{type(e).__name__}: {e}"[:1500]
                )
                raise
            self.store.set(f"recv/{info.version}/{self.index}", "ok")
            peers = self._all_received(info.version)
            if peers:
                raise RuntimeError(f"not written: {peers}")
            t1 = time.perf_counter()
            received = True
            self._apply()
            report.update(
                received_bytes=stats["received_bytes"],
                local_bytes=stats["local_bytes"],
                receive_s=t1 - t0,
                apply_s=time.perf_counter() - t1,
            )
            log.info(
                "real_py: %s %s: %d bytes in %.3f s, written and re-processed in %.3f s",
                self.side,
                step,
                stats["received_bytes"],
                t1 - t0,
                report["apply_s"],
            )
        except Exception as e:
            report["error"] = f"{self.side}: {type(e).__name__}: {str(e)[:1500]}"
            report["partly_written"] = received
            log.error(
                "real_py: %s %s failed, %s: %s",
                self.side,
                step,
                "its weights are partly written" if received else "the previous weights stay",
                report["error"],
            )
            self._broken()
        if self.store is not None:
            try:
                self.store.set(f"stats/{info.version}/{self.index}", json.dumps(report))
            except Exception as e:
                log.error("real_py: %s could not report %s: %s", self.side, step, e)

    def _all_received(self, version: int) -> str:
        """Wait (bounded) until every worker said how its receive went; "" when all did fine,
        else which ones failed or did not answer."""
        keys = [f"recv/{version}/{i}" for i in range(self.num_workers)]
        deadline = time.monotonic() + self.timeout_s
        while not all(self.store.check([k]) for k in keys):
            if time.monotonic() > deadline:
                missing = [i for i, k in enumerate(keys) if not self.store.check([k])]
                return (
                    f"vLLM workers {missing} did not finish receiving within {self.timeout_s:g} s"
                )
            time.sleep(0.01)
        bad = [(i, self.store.get(k).decode()) for i, k in enumerate(keys)]
        bad = [(i, why) for i, why in bad if why != "ok"]
        return "; ".join(f"vLLM worker {i} failed to receive ({why[:300]})" for i, why in bad)

    def finish_weight_update(self) -> None:
        pass

    def _broken(self) -> None:
        """Drop the transfer group and what the move held (the receive shard: a model copy)."""
        self.realloc = self.transport = self.plan = None
        self.shard = self.experts = None
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ writing

    def _apply(self) -> None:
        if self.full:
            self._load_full()
            return
        write_dense(self.model, self.dst_spec, self.shard)
        if self.experts is not None:
            self._apply_experts()

    def _apply_experts(self) -> None:
        """Each MoE layer's experts stacked into vLLM's w13 [E, 2I/tp, H] / w2 [E, H, I/tp], then
        the layer processed as at load: on CPU the MoE kernel's own step (pad the intermediate
        dim, prepack), which vLLM's weight-update path skips once the kernel is set up."""
        from vllm.platforms import current_platform

        modules = dict(self.model.named_modules())
        cfg, views = self.dst_spec.config, self.experts.params()
        for i in range(cfg.num_hidden_layers):
            if not cfg.is_moe_layer(i):
                continue
            module = modules[f"model.layers.{i}.{EXPERTS_MODULE}"]
            pre = f"layers.{i}.mlp.experts."
            with torch.no_grad():
                for attr, part in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj")):
                    stacked = torch.stack(
                        [views[f"{pre}{j}.{part}.weight"] for j in range(cfg.num_experts)]
                    )
                    setattr(
                        module,
                        attr,
                        torch.nn.Parameter(stacked.to(self.device), requires_grad=False),
                    )
            method = module.quant_method
            kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            if current_platform.is_cpu() and kernel is not None:
                kernel.process_weights_after_loading(module)
            else:
                method.process_weights_after_loading(module)

    def _load_full(self) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from ..interop.hf import full_to_hf_state_dict

        full = {p.name: self.shard.view(p.name) for p in self.dst_spec.params}
        hf = full_to_hf_state_dict(self.dst_spec, full)
        initialize_layerwise_reload(self.model)
        self.model.load_weights(hf.items())
        finalize_layerwise_reload(self.model, self.model_config)
        # A tied lm_head has no checkpoint tensor of its own: the layerwise reload restores it
        # unprocessed, and on CPU it would go on computing from the packed copy of the old
        # embedding (measured: logprobs 0.37 off transformers). Re-pack it from the new weight.
        if getattr(self.model_config.hf_config, "tie_word_embeddings", False):
            for module in self.model.modules():
                if type(module).__name__ == "ParallelLMHead":
                    module.quant_method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        self._broken()
