"""The four PPO models on this rank: initial weights, shards per layout, weight reallocation.

A trainable model (actor, critic) keeps its shard and optimizer in the layout of its train call.
Before another call of the same model with a different layout, `Models.engine_for` moves its
weights into that layout with the planner and the reallocator (one Reallocator per (model, call),
built by every rank at start-up since transport setup may create subgroups); the runtime drops
the copy after the call. Reallocation runs over its own world-sized process group, so its
messages never meet the dataflow pushes on the default group. Frozen models (ref, reward) are
built directly in the layout of their only call; with `offload_frozen` their weights stay in a
host buffer (real_py.realloc.offload.HostOffload) except during that call: the runtime calls
`reload(model)` before it and `offload(model)` after it, and `engine_for` refuses an offloaded
model.

Device and memory: every shard lives on `device` (cuda:{local_rank} on a GPU) in the models'
dtype (bf16 with precision: bf16; the train engines add their fp32 master and Adam states). A
reallocated copy exists only while its call runs: `engine_for` builds the destination shard, the
runtime holds the returned engine for the one call and drops it, which returns the memory to
torch's caching allocator for the next call. So at most two copies of a model's weights coexist
on a rank (its home shard and one call's shard), plus the reallocator's bounded staging buckets.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..engines import Engine, OptimConfig
from ..interop.hf import load_hf_experts, load_hf_shard
from ..realloc.moe_exec import MoeReallocator
from ..realloc.moe_plan import plan_moe_realloc
from ..realloc.offload import HostOffload
from ..realloc.plan import plan_realloc
from ..realloc.reallocator import Reallocator
from ..realloc.shard import ExpertShard, ModelShard
from ..realloc.transports.dist import DistTransport
from ..spec import ModelConfig, model_spec, torch_dtype


def init_weights(config: ModelConfig, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """Full random weights: N(0, 0.02) matrices, unit norms (same on every rank for a seed and a
    device type; drawn on `device`, so a GPU run draws on the GPU: seconds, not a minute per 1B)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for p in model_spec(config).params:
        if p.name.endswith("norm.weight"):
            out[p.name] = torch.ones(p.shape, device=device)
        else:
            out[p.name] = torch.randn(p.shape, generator=g, device=device) * 0.02
    return {k: v.to(torch_dtype(config.dtype)) for k, v in out.items()}


class Models:
    def __init__(
        self,
        graph,
        plan,
        configs: dict[str, ModelConfig],
        groups: dict,
        seed: int,
        *,
        lrs: dict[str, float],
        max_grad_norm: float,
        adam_eps: float,
        timeout_s: float,
        rule_reward: bool,
        paths: dict[str, str | None],
        verify: bool = False,
        offload_frozen: bool = False,
        critic_init: str = "checkpoint",
        device: torch.device | str = "cpu",
        temperature: float = 1.0,
        rollout_call: str | None = None,
    ):
        self.graph, self.plan, self.configs, self.groups = graph, plan, configs, groups
        self.verify = verify
        self.temperature = temperature  # every engine's logit_temperature (generation.temperature)
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.transport = DistTransport(
            dist.new_group(list(range(dist.get_world_size()))), timeout=timeout_s
        )
        self.specs = {m: model_spec(c, name=m) for m, c in configs.items()}
        self.home: dict[str, str] = {}  # model -> call whose layout holds its weights
        self.engines: dict[str, Engine | None] = {}
        self._reallocators: dict = {}
        self.rollout_call, self.rollout = rollout_call, None  # vLLM generation (attach_rollout)
        self.offloads: dict[str, HostOffload] = {}  # frozen model -> its offloader (holding ranks)
        self.expert_offloads: dict[str, HostOffload] = {}  # MoE: the same for its expert shard
        inits = {"actor": seed + 1, "ref": seed + 1, "critic": seed + 2, "reward": seed + 3}
        for m, calls in graph.models().items():
            if m == "reward" and rule_reward:
                continue
            home = graph.train_call(m) or calls[0]
            if len(calls) > 1 and not graph.calls[home].trains:
                raise ValueError(
                    f"model {m} has several calls {calls} but none trains; give each "
                    "frozen model one call"
                )
            self.home[m] = home
            layout, g = plan.calls[home], groups[home]
            if not g.member:
                self.engines[m] = None
                continue
            experts = None
            if paths.get(m):
                fresh = critic_init if m == "critic" and critic_init != "checkpoint" else None
                shard = load_hf_shard(
                    paths[m],
                    configs[m],
                    layout,
                    self.rank,
                    self.device,
                    name=m,
                    value_head_init=fresh,
                    seed=inits[m],
                )
                if configs[m].num_experts:
                    experts = load_hf_experts(
                        paths[m],
                        configs[m],
                        layout,
                        self.rank,
                        self.device,
                        name=m,
                        fresh_head=fresh is not None,
                    )
            else:
                full = init_weights(configs[m], inits[m], self.device)
                shard = ModelShard.from_full(self.specs[m], layout, self.rank, full, self.device)
                if configs[m].num_experts:
                    experts = ExpertShard.from_full(
                        self.specs[m], layout, self.rank, full, self.device
                    )
            optim = (
                OptimConfig(lr=lrs[m], max_grad_norm=max_grad_norm, eps=adam_eps)
                if graph.calls[home].trains
                else None
            )
            self.engines[m] = Engine(configs[m], layout, g, shard, optim=optim, experts=experts)
            self.engines[m].logit_temperature = temperature
            if offload_frozen and optim is None:
                # Off from the start: the weights are resident only during their call.
                self.offloads[m] = HostOffload(shard.flat, name=f"{m} shard on rank {self.rank}")
                self.offloads[m].offload()
                if experts is not None:
                    self.expert_offloads[m] = HostOffload(
                        experts.flat, name=f"{m} experts on rank {self.rank}"
                    )
                    self.expert_offloads[m].offload()
        for call in graph.order:
            m = graph.calls[call].model
            if call == rollout_call:
                continue  # attach_rollout plans it into vLLM's live format
            if m in self.home and plan.calls[call] != plan.calls[self.home[m]]:
                if self.specs[m].num_experts:  # dense part + one part per pair of ep groups
                    mplan = plan_moe_realloc(
                        self.specs[m],
                        plan.calls[self.home[m]],
                        plan.calls[call],
                        ranks_per_node=plan.ranks_per_node,
                    )
                    self._reallocators[(m, call)] = MoeReallocator(
                        mplan, self.transport, verify=verify
                    )
                    continue
                rplan = plan_realloc(
                    self.specs[m],
                    plan.calls[self.home[m]],
                    plan.calls[call],
                    ranks_per_node=plan.ranks_per_node,
                )
                self._reallocators[(m, call)] = Reallocator(rplan, self.transport, verify=verify)

    def attach_rollout(self, rollout) -> None:
        """vLLM generation (real_py.vllm.rollout.VLLMRollout on every rank): the actor's weights
        go from its home layout into vLLM's live per-rank format (rollout.spec) before each
        generation call, with the same transport as every other reallocation. Collective."""
        call = self.rollout_call
        src, dst = self.plan.calls[self.home["actor"]], self.plan.calls[call]
        rplan = plan_realloc(
            self.specs["actor"],
            src,
            dst,
            dst_model=rollout.spec,
            ranks_per_node=self.plan.ranks_per_node,
        )
        self._reallocators[("actor", call)] = Reallocator(rplan, self.transport, verify=self.verify)
        self.rollout = rollout

    def _to_rollout(self, call: str) -> tuple[object, dict]:
        dst = self.plan.calls[call]
        home_engine = self.engines["actor"]
        shard = (
            ModelShard.empty(self.rollout.spec, dst, self.rank, self.device)
            if self.rank in dst.ranks
            else None
        )
        t0, wall = time.perf_counter(), time.time()
        stats = self._reallocators[("actor", call)].run(
            home_engine.shard if home_engine else None, shard
        )
        if shard is not None:
            self.rollout.write(shard)
        stats["seconds"] = time.perf_counter() - t0
        stats["start"], stats["end"] = wall, wall + stats["seconds"]
        return (self.rollout if shard is not None else None), stats

    def engine_for(self, call: str) -> tuple[Engine | None, dict | None]:
        """The engine to run `call` with (reallocating if needed) and the reallocation stats.

        Every rank of the world calls this for every call in the global order; ranks outside
        both the home and the call layout return at once.
        """
        c = self.graph.calls[call]
        home = self.home.get(c.model)
        if home is None:
            return None, None
        off = self.offloads.get(c.model)
        if off is not None and off.offloaded:
            raise RuntimeError(
                f"{c.model} weights are offloaded to host on rank {self.rank}; "
                f"call Models.reload({c.model!r}) before running {call}"
            )
        if call == self.rollout_call:
            return self._to_rollout(call)
        src, dst = self.plan.calls[home], self.plan.calls[call]
        if src == dst:
            return self.engines[c.model], None
        if self.rank not in src.ranks and self.rank not in dst.ranks:
            return None, None
        realloc = self._reallocators[(c.model, call)]
        home_engine = self.engines[c.model]
        dst_shard = (
            ModelShard.empty(self.specs[c.model], dst, self.rank, self.device)
            if self.rank in dst.ranks
            else None
        )
        dst_experts = None
        t0, wall = time.perf_counter(), time.time()
        if isinstance(realloc, MoeReallocator):
            dst_experts = (
                ExpertShard.empty(self.specs[c.model], dst, self.rank, self.device)
                if dst_shard is not None
                else None
            )
            stats = realloc.run(
                home_engine.shard if home_engine else None,
                home_engine.experts if home_engine else None,
                dst_shard,
                dst_experts,
            )
        else:
            stats = realloc.run(home_engine.shard if home_engine else None, dst_shard)
        stats["seconds"] = time.perf_counter() - t0
        stats["start"], stats["end"] = wall, wall + stats["seconds"]  # for the span over ranks
        if dst_shard is None:
            return None, stats
        engine = Engine(
            self.configs[c.model], dst, self.groups[call], dst_shard, experts=dst_experts
        )
        engine.logit_temperature = self.temperature
        return engine, stats

    def reload(self, model: str) -> tuple[int, float]:
        """Bring an offloaded frozen model's weights back; (bytes, seconds); (0, 0.0) if this rank
        holds no offloaded copy of it."""
        return self._each_offload(model, "reload")

    def _each_offload(self, model: str, op: str) -> tuple[int, float]:
        """(bytes, seconds) of `op` on the model's offloaders (its shard and, MoE, its experts)."""
        nbytes, secs = 0, 0.0
        for offs in (self.offloads, self.expert_offloads):
            off = offs.get(model)
            if off is not None:
                b, s = getattr(off, op)()
                nbytes, secs = nbytes + b, secs + s
        return nbytes, secs

    def offload(self, model: str) -> tuple[int, float]:
        """Move a frozen model's weights to its host buffer; (bytes, seconds); (0, 0.0) if this
        rank holds no offloadable copy of it."""
        return self._each_offload(model, "offload")


__all__ = ["Models", "init_weights"]
