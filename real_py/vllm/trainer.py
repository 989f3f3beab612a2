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

One file past 400 lines: most of it is RealPyTrainerEngine, whose send_weights and rank 0's _drive
of the vLLM client share the transfer group, plan and Reallocator that trainer_init sets up, and the
verdict every rank reads after an update (worker.py is the other side).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from ..layout import Layout, shard_layout
from ..realloc import DistTransport, ExpertShard, ModelShard, Reallocator
from ..realloc.moe_exec import MoeReallocator
from ..realloc.reallocator import DEFAULT_BUCKET_BYTES
from ..realloc.transports.store_group import TransferGroup, publish_ready, refuse, wait_ready
from ..spec import ModelConfig, model_spec, torch_dtype
from .names import config_dict
from .worker import fingerprint, trainers_disagree, vllm_plan

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
            raise TypeError(
                f"ShardSource takes this rank's real_py ModelShard, got {type(shard).__name__}; "
                "a trainer's own name -> tensor dict becomes one with "
                "real_py.interop.shard_from_params (after the interop adapters)"
            )
        if (experts is not None) != bool(shard.model.num_experts):
            raise ValueError(
                f"{shard.model.name}: an MoE model's source is its ModelShard and its "
                "ExpertShard (experts=), a dense model's the ModelShard alone"
            )
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
        held = [
            e.param.name for e in shard_layout(self.shard.model, self.shard.layout, stage).entries
        ]
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
    def trainer_init(
        cls, init_info: RealPyTrainerInitInfo, *, client, source=None
    ) -> RealPyTrainerEngine:
        if isinstance(source, ModelShard):
            source = ShardSource(source)
        if not isinstance(source, ShardSource):
            raise TypeError(
                "the real_py trainer engine needs source=ShardSource(shard) (this rank's "
                f"ModelShard in the trainer layout), got {type(source).__name__}"
            )
        info = init_info
        layout, cfg, rank = info.layout, info.config, info.rank
        T = layout.world
        if tuple(layout.ranks) != tuple(range(T)):
            raise ValueError(
                f"trainer layout {layout}: the real_py backend numbers trainer ranks 0..n-1; "
                f"got ranks {list(layout.ranks)[:8]}"
            )
        if info.transport not in ("gloo", "nccl"):
            raise ValueError(f"transport={info.transport!r}; allowed: 'gloo', 'nccl'")
        if info.num_workers < 1:
            raise ValueError(f"num_workers={info.num_workers} must be >= 1 (vLLM tp x dp)")
        client = as_client(client)
        engine = cls(client=client, source=source, is_sender=info.is_sender)
        engine.info, engine.rank = info, rank
        engine.side = f"trainer rank {rank} of {T}"
        engine.version = 0
        group = TransferGroup.connect(
            info.master_address, info.master_port, rank, T + info.num_workers, info.timeout_s
        )
        # From here a refusal is published, so every member fails with it at once.
        try:
            engine.spec = spec = model_spec(cfg)
            engine.fingerprint = fingerprint(cfg, layout)
            shard = source.shard
            if shard.model != spec or shard.layout != layout or shard.rank != rank:
                raise ValueError(
                    f"trainer rank {rank}: the source shard is {shard!r}, the init info says "
                    f"{spec.name} on {layout} rank {rank}"
                )
            want = "cuda" if info.transport == "nccl" else "cpu"
            if shard.flat.device.type != want:
                raise ValueError(
                    f"trainer rank {rank}: transport={info.transport!r} sends from {want} "
                    f"shards, this one is on {shard.flat.device}"
                )
            if info.is_sender and not (
                callable(getattr(client, "reset_prefix_cache", None))
                or getattr(client, "base_url", None)
            ):
                raise TypeError(
                    f"client {type(client).__name__} can start, update and finish a weight "
                    "update but not reset vLLM's prefix cache (reset_prefix_cache() or an "
                    "HTTP base_url), so cached prompts would keep old-weight tokens; give it "
                    "a reset_prefix_cache method"
                )
        except Exception as e:
            publish_ready(group, f"{type(e).__name__}: {e}")
            raise
        worker_info = {
            "master_address": info.master_address,
            "master_port": info.master_port,
            "num_trainers": T,
            "config": config_dict(cfg),
            "layout": asdict(layout),
            "num_workers": info.num_workers,
            "bucket_bytes": info.bucket_bytes,
            "timeout_s": info.timeout_s,
            "full_tensors": info.full_tensors,
            "transport": info.transport,
        }
        settings = [
            engine.fingerprint,
            info.num_workers,
            info.bucket_bytes,
            info.timeout_s,
            info.full_tensors,
            info.transport,
        ]
        # The workers block in init until every member joined: rank 0 asks them on the side, and
        # a failed call (no weight_transfer_config, a server without dev mode) fails every member.
        with ThreadPoolExecutor(max_workers=1) as pool:
            rpc = None
            if engine.is_sender:
                rpc = pool.submit(client.init_weight_transfer_engine, worker_info)
                rpc.add_done_callback(
                    lambda f: (
                        f.exception() is not None
                        and refuse(
                            group,
                            "vLLM's init_weight_transfer_engine call (trainer rank 0)",
                            f"{type(f.exception()).__name__}: {str(f.exception())[:600]}",
                        )
                    )
                )
            try:
                publish_ready(group, None, extra={"settings": settings})
                ready = wait_ready(group, engine.side)
                disagree = trainers_disagree(ready, T)
                if disagree:
                    raise RuntimeError(f"real_py transfer group ({engine.side}): {disagree}")
                engine.group = group.build(info.transport)
            except Exception as e:  # the member's own reason, with vLLM's error as the cause
                cause = rpc.exception(timeout=1.0) if rpc is not None and rpc.done() else None
                raise e from cause
            if rpc is not None:
                rpc.result(timeout=info.timeout_s)
        mode = ready[T]["extra"]
        engine.full = mode["full"]
        if mode["unknown"]:
            log.warning(
                "real_py: vLLM falls back to full tensors and load_weights for %s",
                ", ".join(mode["unknown"]),
            )
        engine.plan = vllm_plan(cfg, layout, T, mode["tp"], mode["dp"], engine.full)
        engine.transport = DistTransport(
            engine.group.pg, timeout=info.timeout_s, store=engine.group.store
        )
        move = MoeReallocator if spec.num_experts else Reallocator
        engine.realloc = move(engine.plan, engine.transport, bucket_bytes=info.bucket_bytes)
        if engine.is_sender:
            s = engine.plan.summary()
            log.info(
                "real_py: %s -> vLLM %s: %d bytes over the network (minimum %d, %s), %s",
                layout,
                engine.plan.dst,
                s["network_bytes"],
                s["min_network_bytes"],
                "met" if s["network_bytes"] == s["min_network_bytes"] else "NOT met",
                "full tensors (load_weights)" if engine.full else "each worker its shard in place",
            )
        return engine

    def send_weights(self) -> dict:
        """Push this rank's shard to the vLLM workers; on rank 0 also drive vLLM's update (start,
        update while the ranks send, finish, prefix-cache reset). Every rank returns once rank 0
        has heard every worker, with the same outcome: its stats (seconds, bytes sent, staging
        bytes; rank 0: every worker's receive and apply seconds), or the same error on every rank
        (vLLM then serves the previous weights on every worker, unless the error says a worker's
        weights are partly written)."""
        if self.realloc is None:
            raise RuntimeError(
                f"real_py: {self.side}: an earlier update failed and broke the transfer "
                "group; call trainer_init again (a new master_port) before sending"
            )
        self.version += 1
        step = f"update {self.version}"
        if not self.is_sender:
            try:
                stats = self._run(self.source.shard)
            finally:
                verdict = self._read_verdict()
            if verdict != "ok":
                self._break()
                raise RuntimeError(verdict)
            return stats
        try:
            stats = self._drive(step)
        except BaseException as e:
            self._verdict(
                f"real_py: {step} failed (reported by trainer rank 0): {type(e).__name__}: {e}"
            )
            self._break()
            raise
        self._verdict("ok")
        return stats

    def _drive(self, step: str) -> dict:
        """Rank 0: vLLM's start / update / finish around this rank's own move; the workers'
        reports."""
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        rpc = pool.submit(
            self.client.update_weights, {"version": self.version, "model": self.fingerprint}
        )

        def told(
            f,
        ):  # vLLM's call failed: every rank's waits end now, naming it, not at the timeout
            if f.exception() is not None:
                self.transport.fail(
                    step,
                    f"vLLM's update_weights call failed: {type(f.exception()).__name__}: "
                    f"{str(f.exception())[:600]}",
                    who="vLLM client (trainer rank 0)",
                )

        rpc.add_done_callback(told)
        error = None
        try:
            stats = self._run(self.source.shard)
        except BaseException as e:
            error = e
        # The workers end their call either way (done, or told of a failure through the store):
        # wait for it, bounded, then close vLLM's update session (else its next start refuses).
        try:
            rpc.result(timeout=self.info.timeout_s)
        except Exception as e:
            error = error or e
        finally:
            pool.shutdown(wait=False)
        if rpc.done():
            try:
                self.client.finish_weight_update()
            except Exception as e:
                error = error or e
        if error is not None:
            raise error
        stats["workers"] = self._worker_reports()
        failed = [w["error"] for w in stats["workers"] if "error" in w]
        if failed:
            partly = [w["worker"] for w in stats["workers"] if w.get("partly_written")]
            raise RuntimeError(
                f"real_py: {step} failed on {len(failed)} vLLM worker(s): {failed[0]}"
                + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
                + (
                    f"; workers {partly} have partly written weights: send a complete update "
                    "before generating"
                    if partly
                    else "; every worker keeps the previous weights"
                )
            )
        reset_prefix_cache(self.client)
        return stats

    def _verdict(self, text: str) -> None:
        try:
            self.group.store.set(f"verdict/{self.version}", text)
        except Exception:
            pass

    def _read_verdict(self) -> str:
        """Rank 0's outcome of this update (waited for, bounded)."""
        key, deadline = f"verdict/{self.version}", time.monotonic() + self.info.timeout_s
        try:
            while not self.group.store.check([key]):
                if time.monotonic() > deadline:
                    return (
                        f"real_py: {self.side}: no outcome of update {self.version} from trainer "
                        f"rank 0 within {self.info.timeout_s:g} s (rank 0 gone or stuck)"
                    )
                time.sleep(0.02)
            return self.group.store.get(key).decode()
        except Exception as e:
            return (
                f"real_py: {self.side}: lost trainer rank 0's store reading update "
                f"{self.version}'s outcome: {e}"
            )

    def _worker_reports(self) -> list[dict]:
        """Each worker's outcome of this update (written before its call returned)."""
        keys = [f"stats/{self.version}/{i}" for i in range(self.info.num_workers)]
        missing = [k for k in keys if not self.group.store.check([k])]
        if missing:
            raise RuntimeError(
                f"real_py: update {self.version}: vLLM workers "
                f"{[int(k.rsplit('/', 1)[1]) for k in missing]} answered without a report "
                "(their log says why)"
            )
        return [json.loads(self.group.store.get(k)) for k in keys]

    def _run(self, shard) -> dict:
        if self.source.experts is not None:
            return self.realloc.run(shard, self.source.experts, None, None)
        return self.realloc.run(shard, None)

    def _break(self) -> None:
        self.realloc = None
        self.group.close()

    def shutdown(self) -> None:
        """Close the transfer group (rank 0: its store goes with the last reference)."""
        self.realloc = self.transport = None
        if self.group is not None:
            self.group.close()
        self.group = None


def reset_prefix_cache(client) -> None:
    """vLLM's finish_weight_update keeps the prefix cache: drop it, or a cached prompt returns
    old-weight tokens. The offline LLM has reset_prefix_cache(); the HTTP server a route."""
    reset = getattr(client, "reset_prefix_cache", None)
    if callable(reset):
        if reset() is False:
            raise RuntimeError(
                "vLLM refused to reset its prefix cache after the weight update "
                "(requests still running?); cached prompts would see old weights"
            )
        return
    base = getattr(client, "base_url", None)
    if base is None:
        raise TypeError(
            f"{type(client).__name__} has neither reset_prefix_cache() nor a base_url: "
            "the prefix cache cannot be reset after the update"
        )
    import requests

    answer = requests.post(f"{base}/reset_prefix_cache", timeout=getattr(client, "timeout", 300))
    answer.raise_for_status()
    if (
        answer.headers.get("content-type", "").startswith("application/json")
        and answer.json().get("success") is False
    ):  # vLLM answers 200 with success false when busy
        raise RuntimeError(
            f"vLLM at {base} refused to reset its prefix cache after the weight update "
            "(requests still running?); cached prompts would see old weights"
        )
