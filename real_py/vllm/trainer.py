"""Trainer side of the `real_py` weight-transfer backend (runs on every trainer rank).

    source = ShardSource(shard)                  # this rank's ModelShard in any real_py layout
    info = RealPyTrainerInitInfo(rank=rank, master_address=..., master_port=..., config=cfg,
                                 layout=layout, num_workers=vllm_tp * vllm_dp)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=source)
    engine.send_weights()                        # after every optimizer step, on every rank

Every trainer rank sends its own pieces straight to the vLLM workers that hold them (the plan
real_py.plan_realloc makes from the trainer layout to vLLM's live per-rank format); no rank
gathers a full tensor, and a rank's extra memory is its staging buffer (bucket_bytes). Rank 0
also drives vLLM through the client (the offline LLM, HTTPVLLMWeightSyncClient, any object with
vLLM's four weight-sync methods): init, start, update (while the ranks send), finish, and a
prefix-cache reset, so no prompt cached before the update returns old-weight tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightSource, WeightTransferInitRequest,
                                                   WeightTransferUpdateRequest)

from ..layout import Layout, shard_layout
from ..realloc import DistTransport, ExpertShard, ModelShard, Reallocator
from ..realloc.moe_exec import MoeReallocator
from ..realloc.reallocator import DEFAULT_BUCKET_BYTES
from ..spec import ModelConfig, model_spec, torch_dtype
from ..realloc.transports.store_group import TransferGroup, publish_ready, wait_ready
from .names import config_dict
from .worker import fingerprint, vllm_plan

log = logging.getLogger("real_py.vllm")


class OfflineClient:
    """vLLM's weight-sync client protocol over an in-process `LLM` (vLLM ships clients for its
    HTTP server and for Ray actors; the LLM's own methods take request objects). trainer_init
    wraps an LLM passed as `client` in one."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> bool:
        return self.llm.reset_prefix_cache()


def as_client(client):
    """An offline LLM wrapped in OfflineClient; any other client as it is."""
    return OfflineClient(client) if hasattr(client, "llm_engine") else client


class ShardSource(WeightSource):
    """A trainer rank's weights as real_py holds them: its ModelShard in the trainer layout.

    metadata() lists every parameter with its full shape (vLLM's contract), iteration yields this
    rank's local pieces (views of the shard, not full tensors: real_py never gathers), and
    held_names() the parameters of this rank's pipeline stage. The shard is read at every
    send_weights, so a trainer that updates it in place sends its newest weights."""

    def __init__(self, shard: ModelShard, experts: ExpertShard | None = None):
        if not isinstance(shard, ModelShard):
            raise TypeError(f"ShardSource takes this rank's real_py ModelShard, got {type(shard).__name__}; "
                            "a trainer's own name -> tensor dict becomes one with "
                            "real_py.interop.shard_from_params (after the interop adapters)")
        if (experts is not None) != bool(shard.model.num_experts):
            raise ValueError(f"{shard.model.name}: an MoE model's source is its ModelShard and its "
                             "ExpertShard (experts=), a dense model's the ModelShard alone")
        self.shard, self.experts = shard, experts

    def metadata(self) -> list[ParamMeta]:
        dtype = torch_dtype(self.shard.model.dtype)
        return [ParamMeta(p.name, dtype, p.shape) for p in self.shard.model.params]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.shard.params().items()
        if self.experts is not None:
            yield from self.experts.params().items()

    def held_names(self):
        stage = self.shard.layout.coords(self.shard.rank)[2]
        held = [e.param.name for e in shard_layout(self.shard.model, self.shard.layout, stage).entries]
        return held + (list(self.experts.params()) if self.experts is not None else [])


@dataclass
class RealPyTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "real_py"
    master_address: str
    master_port: int
    config: ModelConfig
    """The trainer's model (shapes, dtype and its storage format: blocked, Megatron grouped)."""
    layout: Layout
    """The trainer's layout; its ranks are the trainer ranks 0..n-1 that call trainer_init."""
    num_workers: int
    """vLLM workers: tensor_parallel_size * data_parallel_size."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Staging per rank (peak extra memory of a trainer rank)."""
    timeout_s: float = 300.0
    """Seconds any one wait (join, a round of the move) may take before an error naming the side
    and the rank."""
    full_tensors: bool = False
    """Every worker receives the full tensors and loads them with vLLM's load_weights."""
    transport: str = "gloo"
    """"gloo" (trainer shards in host memory) or "nccl" (trainer shards on this rank's current
    CUDA device, workers receive on theirs)."""


class RealPyTrainerEngine(TrainerWeightTransferEngine[RealPyTrainerInitInfo]):
    init_info_cls = RealPyTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: RealPyTrainerInitInfo, *, client, source=None) -> "RealPyTrainerEngine":
        if isinstance(source, ModelShard):
            source = ShardSource(source)
        if not isinstance(source, ShardSource):
            raise TypeError("the real_py trainer engine needs source=ShardSource(shard) (this rank's "
                            f"ModelShard in the trainer layout), got {type(source).__name__}")
        info = init_info
        layout, cfg, rank = info.layout, info.config, info.rank
        T = layout.world
        if tuple(layout.ranks) != tuple(range(T)):
            raise ValueError(f"trainer layout {layout}: the real_py backend numbers trainer ranks 0..n-1; "
                             f"got ranks {list(layout.ranks)[:8]}")
        spec = model_spec(cfg)
        shard = source.shard
        if shard.model != spec or shard.layout != layout or shard.rank != rank:
            raise ValueError(f"trainer rank {rank}: the source shard is {shard!r}, the init info says "
                             f"{spec.name} on {layout} rank {rank}")
        if info.transport not in ("gloo", "nccl"):
            raise ValueError(f"transport={info.transport!r}; allowed: 'gloo', 'nccl'")
        want = "cuda" if info.transport == "nccl" else "cpu"
        if shard.flat.device.type != want:
            raise ValueError(f"trainer rank {rank}: transport={info.transport!r} sends from {want} "
                             f"shards, this one is on {shard.flat.device}")
        if info.num_workers < 1:
            raise ValueError(f"num_workers={info.num_workers} must be >= 1 (vLLM tp x dp)")
        client = as_client(client)
        if info.is_sender and not (callable(getattr(client, "reset_prefix_cache", None))
                                   or getattr(client, "base_url", None)):
            raise TypeError(f"client {type(client).__name__} can start, update and finish a weight "
                            "update but not reset vLLM's prefix cache (reset_prefix_cache() or an HTTP "
                            "base_url), so cached prompts would keep old-weight tokens; give it a "
                            "reset_prefix_cache method")
        engine = cls(client=client, source=source, is_sender=info.is_sender)
        engine.info, engine.spec, engine.rank = info, spec, rank
        engine.side = f"trainer rank {rank} of {T}"
        engine.fingerprint = fingerprint(cfg, layout)
        engine.version = 0
        world = T + info.num_workers
        group = TransferGroup.connect(info.master_address, info.master_port, rank, world, info.timeout_s)
        worker_info = {"master_address": info.master_address, "master_port": info.master_port,
                       "num_trainers": T, "config": config_dict(cfg), "layout": asdict(layout),
                       "num_workers": info.num_workers, "bucket_bytes": info.bucket_bytes,
                       "timeout_s": info.timeout_s, "full_tensors": info.full_tensors,
                       "transport": info.transport}
        # The workers block in init until every member joined: rank 0 asks them on the side.
        with ThreadPoolExecutor(max_workers=1) as pool:
            rpc = pool.submit(client.init_weight_transfer_engine, worker_info) if engine.is_sender else None
            try:
                publish_ready(group, None)
                ready = wait_ready(group, engine.side)
                engine.group = group.build(info.transport)
            except Exception as e:  # the member's own reason, with vLLM's error as the cause
                cause = rpc.exception(timeout=1.0) if rpc is not None and rpc.done() else None
                raise e from cause
            if rpc is not None:
                rpc.result()
        mode = ready[T]["extra"]
        engine.full = mode["full"]
        if mode["unknown"]:
            log.warning("real_py: vLLM falls back to full tensors and load_weights for %s",
                        ", ".join(mode["unknown"]))
        engine.plan = vllm_plan(cfg, layout, T, mode["tp"], mode["dp"], engine.full)
        engine.transport = DistTransport(engine.group.pg, timeout=info.timeout_s, store=engine.group.store)
        move = MoeReallocator if spec.num_experts else Reallocator
        engine.realloc = move(engine.plan, engine.transport, bucket_bytes=info.bucket_bytes)
        if engine.is_sender:
            s = engine.plan.summary()
            log.info("real_py: %s -> vLLM %s: %d bytes over the network (minimum %d, %s), %s",
                     layout, engine.plan.dst, s["network_bytes"], s["min_network_bytes"],
                     "met" if s["network_bytes"] == s["min_network_bytes"] else "NOT met",
                     "full tensors (load_weights)" if engine.full else "each worker its shard in place")
        return engine

    def send_weights(self) -> dict:
        """Push this rank's shard to the vLLM workers; on rank 0 also drive vLLM's update (start,
        update while the ranks send, finish, prefix-cache reset). Returns this rank's stats
        (seconds, bytes sent, staging bytes; rank 0: every worker's receive and apply seconds)."""
        if self.realloc is None:
            raise RuntimeError(f"real_py: {self.side}: an earlier update failed and broke the transfer "
                               "group; call trainer_init again (a new master_port) before sending")
        self.version += 1
        shard = self.source.shard
        if not self.is_sender:
            return self._run(shard)
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        rpc = pool.submit(self.client.update_weights, {"version": self.version, "model": self.fingerprint})
        try:
            stats = self._run(shard)
        except BaseException:
            # The workers learn of this rank's failure through the group's store and give up their
            # receive, keeping the previous weights: let their call end, close vLLM's update
            # session, then raise this rank's error.
            try:
                rpc.result(timeout=self.info.timeout_s)
                self.client.finish_weight_update()
            except Exception:  # noqa: BLE001 - this rank's own error is the one raised
                pass
            raise
        finally:
            pool.shutdown(wait=False)
        rpc.result()
        stats["workers"] = self._worker_reports()
        self.client.finish_weight_update()
        failed = [w["error"] for w in stats["workers"] if "error" in w]
        if failed:
            self.realloc = None
            self.group.close()
            raise RuntimeError(f"real_py: update {self.version} failed on {len(failed)} vLLM worker(s), "
                               f"which keep the previous weights: {failed[0]}"
                               + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
        reset_prefix_cache(self.client)
        return stats

    def _worker_reports(self) -> list[dict]:
        """Each worker's outcome of this update (written before its call returned)."""
        keys = [f"stats/{self.version}/{i}" for i in range(self.info.num_workers)]
        missing = [k for k in keys if not self.group.store.check([k])]
        if missing:
            raise RuntimeError(f"real_py: update {self.version}: vLLM workers "
                               f"{[int(k.rsplit('/', 1)[1]) for k in missing]} answered without a report "
                               "(their log says why)")
        return [json.loads(self.group.store.get(k)) for k in keys]

    def _run(self, shard) -> dict:
        try:
            if self.source.experts is not None:
                return self.realloc.run(shard, self.source.experts, None, None)
            return self.realloc.run(shard, None)
        except BaseException:
            self.realloc = None
            self.group.close()
            raise

    def shutdown(self) -> None:
        self.group.close()


def reset_prefix_cache(client) -> None:
    """vLLM's finish_weight_update keeps the prefix cache: drop it, or a cached prompt returns
    old-weight tokens. The offline LLM has reset_prefix_cache(); the HTTP server a route."""
    reset = getattr(client, "reset_prefix_cache", None)
    if callable(reset):
        if reset() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache after the weight update "
                               "(requests still running?); cached prompts would see old weights")
        return
    base = getattr(client, "base_url", None)
    if base is None:
        raise TypeError(f"{type(client).__name__} has neither reset_prefix_cache() nor a base_url: "
                        "the prefix cache cannot be reset after the update")
    import requests

    answer = requests.post(f"{base}/reset_prefix_cache", timeout=getattr(client, "timeout", 300))
    answer.raise_for_status()
    if answer.headers.get("content-type", "").startswith("application/json") and \
            answer.json().get("success") is False:  # vLLM answers 200 with success false when busy
        raise RuntimeError(f"vLLM at {base} refused to reset its prefix cache after the weight update "
                           "(requests still running?); cached prompts would see old weights")
