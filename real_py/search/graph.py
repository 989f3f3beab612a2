"""The PPO dataflow graph and the candidate (mesh, strategy) options of each call.

Meshes: aligned power-of-two blocks inside a node, and ranges of whole nodes. Strategies:
(dp, tp, pp) with dp * tp * pp = mesh size, tp in ModelSpec.tp_choices() and <= ranks per
node (tp across nodes is never competitive), pp <= layers, dp <= batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dataflow.graph import ALGORITHMS, Graph, with_engine_logprobs
from ..spec import ModelConfig, ModelSpec, model_spec, preset
from .costmodel import Mesh, Workload

CALLS = ("actor_gen", "ref_inf", "rew_inf", "critic_inf", "actor_train", "critic_train")


@dataclass(frozen=True, slots=True, kw_only=True)
class CallSpec:
    name: str
    model: str
    """"actor", "ref", "reward" or "critic"."""
    kind: str
    """"generate", "inference" or "train"."""
    deps: tuple[str, ...] = ()
    weight_src: str | None = None
    """The call whose layout holds this model's weights (trainable models), else None."""


_KINDS = {
    "generate": "generate",
    "generate_greedy": "generate",
    "logprobs": "inference",
    "values": "inference",
    "reward": "inference",
}


ENGINES = ("builtin", "vllm")
VLLM_LOGP = ("recompute", "rollout")  # generation.vllm_logp


def search_graph(
    algo: str = "ppo", engine: str = "builtin", vllm_logp: str = "recompute"
) -> tuple[CallSpec, ...]:
    """The calls of `algo` as the search sees them, derived from the runtime's own dataflow graph
    (real_py.dataflow.graph): kind generate / inference / train, dependencies = the producers of the
    keys a call reads, weight_src = the call that trains the model (the weights' home layout).
    engine="vllm": the graph the runtime runs with generation.engine: vllm (the recompute call
    actor_logp added, dataflow.graph.with_engine_logprobs); with vllm_logp="rollout"
    (generation.vllm_logp: vLLM's log-probs are old_logp) the graph is the built-in engine's."""
    if algo not in ALGORITHMS:
        raise ValueError(f"algo={algo!r}; allowed: {sorted(ALGORITHMS)}")
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}; allowed: {list(ENGINES)}")
    if vllm_logp not in VLLM_LOGP:
        raise ValueError(f"vllm_logp={vllm_logp!r}; allowed: {list(VLLM_LOGP)}")
    if vllm_logp != "recompute" and engine != "vllm":
        raise ValueError(f"vllm_logp={vllm_logp!r} needs engine='vllm' (engine={engine!r})")
    calls = ALGORITHMS[algo]
    recompute = engine == "vllm" and vllm_logp == "recompute"
    g = Graph(with_engine_logprobs(calls) if recompute else calls)
    out = []
    for n in g.order:
        c = g.calls[n]
        deps = tuple(dict.fromkeys(p for k in c.reads if (p := g.producer(k)) is not None))
        home = g.train_call(c.model)
        out.append(
            CallSpec(
                name=n,
                model=c.model,
                kind="train" if c.trains else _KINDS[c.kind],
                deps=deps,
                weight_src=home if home != n else None,
            )
        )
    return tuple(out)


def sampling_call(algo: str) -> str:
    """The actor's sampling call of `algo` (the one generation.engine: vllm moves onto vLLM)."""
    return next(c.name for c in ALGORITHMS[algo] if c.kind == "generate" and c.model == "actor")


PPO_GRAPH: tuple[CallSpec, ...] = search_graph("ppo")
"""The six PPO calls (actor_gen, ref_inf, rew_inf, critic_inf, actor_train, critic_train)."""


def dep_bytes(src: str, dst: str, wl: Workload) -> float:
    """Bytes a call reads from a dependency: int32 tokens (+ fp32 logprobs from generation to
    the actor's training), and one fp32 per token from each inference call."""
    tokens = wl.batch_size * wl.seq_len
    if src in ("actor_gen", "actor_greedy"):
        return tokens * (8 if dst == "actor_train" else 4)
    return tokens * 4


@dataclass(frozen=True, slots=True)
class PPOModels:
    actor: ModelSpec
    critic: ModelSpec
    ref: ModelSpec
    reward: ModelSpec

    def of(self, role: str) -> ModelSpec:
        return getattr(self, role)


def _config(name_or_cfg, dtype: str, head: str) -> ModelConfig:
    cfg = preset(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    return replace(cfg, dtype=dtype, head=head)


def ppo_models(actor, critic=None, dtype: str = "bfloat16") -> PPOModels:
    """Actor and reference share the actor's shape (lm head); critic and reward the critic's
    (value head). actor/critic: preset names or ModelConfigs."""
    critic = actor if critic is None else critic
    an = actor if isinstance(actor, str) else "actor"
    cn = critic if isinstance(critic, str) else "critic"
    a = model_spec(_config(actor, dtype, "lm"), an)
    c = model_spec(_config(critic, dtype, "value"), cn + "-value")
    return PPOModels(actor=a, critic=c, ref=a, reward=c)


def cluster_meshes(num_gpus: int, rpn: int) -> list[Mesh]:
    """Aligned power-of-two blocks inside each node, then every range of whole nodes."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus} must be >= 1")
    node = min(num_gpus, rpn)
    if num_gpus > rpn and num_gpus % rpn:
        raise ValueError(f"num_gpus={num_gpus} is not a multiple of ranks_per_node={rpn}")
    nodes = num_gpus // node
    meshes = []
    for n in range(nodes):
        size = 1
        while size < node:
            meshes += [Mesh(n * node + s, size) for s in range(0, node - size + 1, size)]
            size *= 2
    for count in range(1, nodes + 1):
        meshes += [Mesh(n * node, count * node) for n in range(nodes - count + 1)]
    return meshes


def strategies(model: ModelSpec, size: int, rpn: int, wl: Workload) -> list[tuple[int, int, int]]:
    tps = [t for t in model.tp_choices(limit=min(size, rpn)) if size % t == 0]
    out = []
    for tp in tps:
        for pp in range(1, min(size // tp, model.num_layers) + 1):
            if (size // tp) % pp == 0 and size // (tp * pp) <= wl.batch_size:
                out.append((size // (tp * pp), tp, pp))
    return out
