"""The host memory a CPU job needs (`host_memory_need`: every rank's shards, trained models with
gradients and Adam states, summed over the local ranks), and the check that refuses a job whose
models cannot fit this machine's available memory before its ranks start.
"""

from __future__ import annotations

from ...dataflow.execplan import ExecutionPlan
from ...dataflow.graph import Graph
from ...spec import model_spec
from .schema import TrainConfig


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


RANK_PROCESS_BYTES = 100 << 20
"""A rank's own memory before any model (interpreter, torch, real_py), counted as its
proportional share (PSS: a forked rank shares the launcher's pages): 93-150 MB per rank of the
copy-task job."""
LAUNCHER_BYTES = 150 << 20
"""The launcher process (PSS 139 MB in the copy-task job)."""
VLLM_PROCESS_BYTES = 250 << 20
"""What vLLM adds to a process beyond its weights and KV cache (its modules, scheduler,
sampler): a rank of the copy-task job with vLLM holds 1,355 MB (PSS) with a 1 GiB KV cache
against 93-150 MB without; the launcher, which imports vLLM to check the model, 405 MB against
139 MB."""


def host_memory_need(
    cfg: TrainConfig, plan: ExecutionPlan, graph: Graph, models: dict
) -> dict[str, int]:
    """Bytes per model that a CPU job holds at once, summed over its ranks (all on this machine):
    the home layout's shards (a trained model's with its fp32 gradient and Adam moments, and the
    fp32 master copy under bf16) plus the largest other layout it is reallocated to; and the rank
    processes themselves (with vLLM's share where it generates). A lower bound of the job's peak:
    activations and buffers come on top."""
    from ...realloc.plan import _shard_data_numel

    out = {"processes": LAUNCHER_BYTES + RANK_PROCESS_BYTES * plan.world_size}
    for m, calls in graph.models().items():
        if m == "reward" and cfg.reward.kind != "model":
            continue
        spec = model_spec(models[m], name=m)
        es = spec.element_size

        def total(layout, spec=spec):
            return sum(_shard_data_numel(spec, layout, r) for r in layout.ranks)

        home = graph.train_call(m) or calls[0]
        trained = graph.calls[home].trains
        per_elem = es + ((12 + (4 if es < 4 else 0)) if trained else 0)
        others = {plan.calls[c] for c in calls if plan.calls[c] != plan.calls[home]}
        out[m] = total(plan.calls[home]) * per_elem + max(
            (total(l) * es for l in others), default=0
        )
        if m == "actor" and cfg.generation.engine == "vllm":
            # vLLM's live model on the generation ranks beside the received shard, and its KV cache
            gen = plan.calls[next(c for c in calls if graph.calls[c].kind == "generate")]
            kv = int(cfg.generation.vllm_kv_cache_gib * 2**30)
            out["vllm"] = total(gen) * es + kv * gen.world + VLLM_PROCESS_BYTES * (gen.world + 1)
    return out


def check_host_memory(cfg: TrainConfig, plan: ExecutionPlan, graph: Graph, models: dict) -> None:
    """A CPU job whose models cannot fit this machine's available memory is refused before its
    ranks start (they would be killed by the kernel's OOM killer mid-start-up, without a word)."""
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return
    avail = available_bytes()
    if avail is None:
        return
    need = host_memory_need(cfg, plan, graph, models)
    if sum(need.values()) > 0.9 * avail:
        GiB = 2**30
        parts = ", ".join(
            f"{m} {b / GiB:.1f}" for m, b in sorted(need.items(), key=lambda x: -x[1])
        )
        raise ValueError(
            f"config: the models need at least {sum(need.values()) / GiB:.1f} GiB of memory on "
            f"this machine ({parts} GiB: every rank's shards, trained models with gradients and "
            f"Adam states, and the processes, over {plan.world_size} local ranks) but "
            f"{avail / GiB:.1f} GiB is "
            "available; use smaller models, fewer data-parallel replicas in the plan, or GPUs "
            "(device: cuda)"
        )
