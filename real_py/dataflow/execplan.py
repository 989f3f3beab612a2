"""Execution plans: for each PPO call (or any dataflow call), a set of global ranks and a layout.

This is the format the search writes (`python -m real_py search --out plan.json`) and the PPO
runtime reads. JSON form:

    {"world_size": 8, "ranks_per_node": 8,
     "calls": {"actor_gen": {"ranks": [0, 1, 2, 3], "dp": 4, "tp": 1, "pp": 1}, ...},
     "idle_ranks": [7],
     "searched_for": {"batch_size": 512, "mini_batches": 4, "micro_batches": 1, "ppo_epochs": 1,
                      "group_size": 1}}

`idle_ranks` (optional) lists ranks the plan leaves without a call on purpose: the search writes it
when its plan uses fewer ranks than the world it was searched for, and the trainer then runs the
plan without `allow_idle_ranks` (a plan that leaves other ranks idle is still refused).
`searched_for` (optional, written by the search) holds the batch settings the plan was searched
for; the trainer refuses a config with other ones (the plan's memory check, its divisibility
rules and its estimate were for those batches).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..layout import Layout


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSettings:
    """The batch settings a plan was searched for (the search's flags; the train config's keys
    in brackets)."""

    batch_size: int
    """Rows per iteration (--batch-size; data.batch_size)."""
    mini_batches: int
    """Optimizer steps per epoch (--ppo-minibatches; ppo.mini_batches)."""
    micro_batches: int
    """Micro-batches per train mini-batch (--micro-batches; ppo.micro_batches)."""
    ppo_epochs: int
    """Passes over the batch per train call (--ppo-epochs; ppo.ppo_epochs)."""
    group_size: int
    """Rows per prompt (--group-size; ppo.group_size), 1 for an algorithm without groups."""

    def __post_init__(self):
        for f in BATCH_FIELDS:
            v = getattr(self, f)
            if type(v) is not int or v < 1:
                raise ValueError(f"searched_for.{f}={v!r} must be an integer >= 1")


BATCH_FIELDS = ("batch_size", "mini_batches", "micro_batches", "ppo_epochs", "group_size")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionPlan:
    world_size: int
    calls: dict[str, Layout] = field(default_factory=dict)
    """call name -> layout (its `ranks` are the call's mesh, global ranks)."""
    ranks_per_node: int = 0
    """0 means unknown / one node."""
    idle_ranks: tuple[int, ...] = ()
    """Ranks left without a call on purpose (the search's plan used fewer ranks than the world)."""
    searched_for: BatchSettings | None = None
    """The batch settings the search placed the calls for; None: a plan not written by the
    search."""

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        for name, layout in self.calls.items():
            if layout.dp_shard != "none":
                raise ValueError(
                    f"call {name}: layout {layout} is dp-sharded (dp_shard="
                    f"{layout.dp_shard!r}); the engines and the PPO runtime run on "
                    "whole (stage, tp rank) shards. dp-sharded layouts are for trainers "
                    "embedding the reallocation (real_py.interop.embed); use dp_shard='none'"
                )
            bad = [r for r in layout.ranks if r >= self.world_size]
            if bad:
                raise ValueError(
                    f"call {name}: ranks {bad} are outside the world of size {self.world_size}"
                )
        bad = [r for r in self.idle_ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"idle_ranks {bad} are outside the world of size {self.world_size}")

    def uncovered_ranks(self) -> list[int]:
        used = set()
        for layout in self.calls.values():
            used.update(layout.ranks)
        return [r for r in range(self.world_size) if r not in used]

    def to_json(self) -> dict:
        return (
            {
                "world_size": self.world_size,
                "ranks_per_node": self.ranks_per_node,
                "calls": {
                    name: {"ranks": list(l.ranks), "dp": l.dp, "tp": l.tp, "pp": l.pp}
                    | ({"layers_per_stage": list(l.layers_per_stage)} if l.layers_per_stage else {})
                    | ({"partition": l.partition} if l.partition != "params" else {})
                    | ({"ep": l.ep} if l.ep > 1 else {})
                    | ({"etp": l.etp} if l.etp > 1 else {})
                    for name, l in self.calls.items()
                },
            }
            | ({"idle_ranks": list(self.idle_ranks)} if self.idle_ranks else {})
            | (
                {"searched_for": {f: getattr(self.searched_for, f) for f in BATCH_FIELDS}}
                if self.searched_for
                else {}
            )
        )

    @classmethod
    def from_json(cls, data: dict | str) -> ExecutionPlan:
        where = "execution plan"
        if isinstance(data, str):
            where = f"execution plan {data}"
            try:
                with open(data) as f:
                    data = json.load(f)
            except OSError as e:
                raise ValueError(f"{where}: {e.strerror or e}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(
                f"{where}: expected a JSON object with world_size and calls, got "
                f"{type(data).__name__}"
            )
        unknown = set(data) - {
            "world_size",
            "ranks_per_node",
            "calls",
            "idle_ranks",
            "searched_for",
        }
        if unknown:
            raise ValueError(
                f"{where} has unknown keys {sorted(unknown)}; allowed: "
                "world_size, ranks_per_node, calls, idle_ranks, searched_for"
            )
        idle = data.get("idle_ranks", [])
        if not isinstance(idle, list) or not all(type(r) is int for r in idle):
            raise ValueError(f"{where}: idle_ranks={idle!r} must be a list of rank numbers")
        missing = [k for k in ("world_size", "calls") if k not in data]
        if missing:
            raise ValueError(
                f'{where} lacks {missing}; expected {{"world_size": N, "calls": '
                '{call: {"ranks": [...], "dp": .., "tp": .., "pp": ..}}}'
            )
        for k in ("world_size", "ranks_per_node"):
            if k in data and (type(data[k]) is not int):
                raise ValueError(f"{where}: {k}={data[k]!r} must be an integer")
        if not isinstance(data["calls"], dict):
            raise ValueError(
                f"{where}: calls must map call names to layouts, got {type(data['calls']).__name__}"
            )
        calls = {}
        for name, c in data["calls"].items():
            if not isinstance(c, dict) or not isinstance(c.get("ranks"), list):
                raise ValueError(
                    f"{where}: call {name} must be a mapping with a list of ranks, got {c!r}"
                )
            extra = set(c) - {
                "ranks",
                "dp",
                "tp",
                "pp",
                "ep",
                "etp",
                "layers_per_stage",
                "partition",
            }
            if extra:
                raise ValueError(
                    f"call {name}: unknown keys {sorted(extra)}; allowed: ranks, dp, tp, "
                    "pp, ep, etp, layers_per_stage, partition"
                )
            try:
                lps = c.get("layers_per_stage")
                calls[name] = Layout(
                    dp=c.get("dp", 1),
                    tp=c.get("tp", 1),
                    pp=c.get("pp", 1),
                    ranks=tuple(c["ranks"]),
                    layers_per_stage=tuple(lps) if lps else None,
                    partition=c.get("partition", "params"),
                    ep=c.get("ep", 1),
                    etp=c.get("etp", 1),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"call {name}: {e}") from None
        searched = data.get("searched_for")
        if searched is not None and (
            not isinstance(searched, dict) or set(searched) != set(BATCH_FIELDS)
        ):
            raise ValueError(
                f"{where}: searched_for={searched!r} must map exactly "
                f"{', '.join(BATCH_FIELDS)} to the values the search used"
            )
        try:
            return cls(
                world_size=data["world_size"],
                calls=calls,
                ranks_per_node=data.get("ranks_per_node", 0),
                idle_ranks=tuple(idle),
                searched_for=BatchSettings(**searched) if searched is not None else None,
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
