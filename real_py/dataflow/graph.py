"""Dataflow graph of model calls, derived from the data keys each call reads and writes.

    graph = Graph(PPO_CALLS)          # or GRPO_CALLS, or any list of Call
    graph.order                       # deterministic topological order (ties: declaration order)
    graph.producer("ref_logp")        # "ref_inf"
    graph.consumers("tokens")         # ("ref_inf", "rew_inf", ...)

Keys not written by any call are inputs of the iteration (prompts, seeds) and every rank holds
them. A key has one producer. Edges are producer -> consumer of a key; the order is Kahn's
algorithm picking, among ready calls, the earliest declared, so every rank derives the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KINDS = (
    "generate",
    "generate_greedy",
    "logprobs",
    "values",
    "reward",
    "train_ppo_actor",
    "train_grpo_actor",
    "train_critic",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    name: str
    model: str
    """"actor", "critic", "ref" or "reward" (the model whose weights the call uses)."""
    kind: str
    """How the runtime executes it; one of KINDS. "train_grpo_actor" is the critic-free actor
    update of every outcome / REINFORCE-style estimator (GRPO, RLOO, REINFORCE++, ReMax)."""
    reads: tuple[str, ...]
    writes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"call {self.name}: kind={self.kind!r}; allowed: {KINDS}")

    @property
    def trains(self) -> bool:
        return self.kind.startswith("train")


ROLLOUT = ("tokens", "lengths")
INPUTS = ("prompts", "prompt_lengths", "seeds")

PPO_CALLS = (
    Call(
        name="actor_gen",
        model="actor",
        kind="generate",
        reads=INPUTS,
        writes=ROLLOUT + ("old_logp",),
    ),
    Call(
        name="ref_inf",
        model="ref",
        kind="logprobs",
        reads=ROLLOUT + ("prompt_lengths",),
        writes=("ref_logp",),
    ),
    Call(
        name="rew_inf",
        model="reward",
        kind="reward",
        reads=ROLLOUT + ("prompt_lengths",),
        writes=("scores",),
    ),
    Call(
        name="critic_inf",
        model="critic",
        kind="values",
        reads=ROLLOUT + ("prompt_lengths",),
        writes=("values",),
    ),
    Call(
        name="actor_train",
        model="actor",
        kind="train_ppo_actor",
        reads=ROLLOUT + ("prompt_lengths", "old_logp", "ref_logp", "scores", "values"),
    ),
    Call(
        name="critic_train",
        model="critic",
        kind="train_critic",
        reads=ROLLOUT + ("prompt_lengths", "old_logp", "ref_logp", "scores", "values"),
    ),
)

GRPO_CALLS = (
    PPO_CALLS[0],
    PPO_CALLS[1],
    PPO_CALLS[2],
    Call(
        name="actor_train",
        model="actor",
        kind="train_grpo_actor",
        reads=ROLLOUT + ("prompt_lengths", "old_logp", "ref_logp", "scores"),
    ),
)

BASELINE = ("base_tokens", "base_lengths")

# ReMax: the greedy response per prompt is an extra generation call of the graph, placed,
# reallocated and pushed like any other (the actor is reallocated into actor_greedy's layout);
# the reward call scores it too (a frozen model has one call, whose layout holds its weights).
REMAX_CALLS = (
    PPO_CALLS[0],
    Call(name="actor_greedy", model="actor", kind="generate_greedy", reads=INPUTS, writes=BASELINE),
    PPO_CALLS[1],
    Call(
        name="rew_inf",
        model="reward",
        kind="reward",
        reads=PPO_CALLS[2].reads + BASELINE,
        writes=("scores", "base_scores"),
    ),
    Call(
        name="actor_train",
        model="actor",
        kind="train_grpo_actor",
        reads=GRPO_CALLS[3].reads + BASELINE + ("base_scores",),
    ),
)

ALGORITHMS = {
    "ppo": PPO_CALLS,
    "grpo": GRPO_CALLS,
    "rloo": GRPO_CALLS,
    "reinforce_pp": GRPO_CALLS,
    "reinforce_pp_baseline": GRPO_CALLS,
    "remax": REMAX_CALLS,
}
"""algo -> its calls. ppo: GAE with a critic; the others are critic-free and differ in the
advantage estimator (calls.py `_advantages`): grpo (and Dr.GRPO with ppo.norm_adv_by_std: false),
rloo, reinforce_pp, reinforce_pp_baseline, remax."""

ROLLOUT_LOGP_CALL = "actor_logp"


def with_engine_logprobs(calls) -> tuple[Call, ...]:
    """The graph of a generation engine whose log-probs are not the trainer's (vLLM): the actor's
    sampling call writes the engine's log-probs as rollout_logp, a new call actor_logp (the
    actor's weights, kind logprobs) recomputes old_logp from the tokens, and the actor's train
    call also reads rollout_logp (the gap metrics, truncated importance sampling)."""
    out = []
    for c in calls:
        if c.kind == "generate" and c.model == "actor":
            out.append(
                replace(c, writes=tuple("rollout_logp" if k == "old_logp" else k for k in c.writes))
            )
            out.append(
                Call(
                    name=ROLLOUT_LOGP_CALL,
                    model="actor",
                    kind="logprobs",
                    reads=ROLLOUT + ("prompt_lengths",),
                    writes=("old_logp",),
                )
            )
        elif c.trains and c.model == "actor":
            out.append(replace(c, reads=c.reads + ("rollout_logp",)))
        else:
            out.append(c)
    return tuple(out)


GROUPED = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
"""Algorithms that sample each prompt ppo.group_size times (contiguous rows)."""


class Graph:
    def __init__(self, calls):
        calls = tuple(calls)
        names = [c.name for c in calls]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate call names in {names}")
        self.calls = {c.name: c for c in calls}
        self._producer: dict[str, str] = {}
        for c in calls:
            for k in c.writes:
                if k in self._producer:
                    raise ValueError(
                        f"key {k!r} is written by both {self._producer[k]} and {c.name}; "
                        "a key has one producer"
                    )
                self._producer[k] = c.name
        self.inputs = tuple(sorted({k for c in calls for k in c.reads if k not in self._producer}))
        self.deps = {
            c.name: tuple(dict.fromkeys(self._producer[k] for k in c.reads if k in self._producer))
            for c in calls
        }
        for n, d in self.deps.items():
            if n in d:
                raise ValueError(f"call {n} reads a key it writes")
        self.order = self._topo(names)

    def _topo(self, names):
        done, order = set(), []
        while len(order) < len(names):
            ready = [n for n in names if n not in done and all(d in done for d in self.deps[n])]
            if not ready:
                left = [n for n in names if n not in done]
                raise ValueError(f"the calls {left} form a dependency cycle")
            order.append(ready[0])
            done.add(ready[0])
        return tuple(order)

    def producer(self, key: str) -> str | None:
        return self._producer.get(key)

    def consumers(self, key: str) -> tuple[str, ...]:
        return tuple(n for n in self.order if key in self.calls[n].reads)

    def models(self) -> dict[str, tuple[str, ...]]:
        """model -> its calls in order."""
        out: dict[str, list[str]] = {}
        for n in self.order:
            out.setdefault(self.calls[n].model, []).append(n)
        return {m: tuple(v) for m, v in out.items()}

    def train_call(self, model: str) -> str | None:
        return next(
            (n for n in self.order if self.calls[n].model == model and self.calls[n].trains), None
        )

    def describe(self) -> str:
        lines = []
        for n in self.order:
            c = self.calls[n]
            lines.append(
                f"{n:13s} {c.model:7s} reads {','.join(c.reads)} -> writes "
                f"{','.join(c.writes) or '(weights)'}; after {','.join(self.deps[n]) or '-'}"
            )
        return "\n".join(lines)


__all__ = [
    "Call",
    "Graph",
    "PPO_CALLS",
    "GRPO_CALLS",
    "REMAX_CALLS",
    "ALGORITHMS",
    "GROUPED",
    "BASELINE",
    "ROLLOUT",
    "INPUTS",
    "KINDS",
]
