"""A transfer group of programs that each have their own default process group (trainer ranks
under torchrun and vLLM's workers, say): a gloo or NCCL group on a store of its own.

    group = TransferGroup.connect(host, port, rank, world, timeout_s)   # the store only
    publish_ready(group, error_or_None, extra=...)    # this member checked its inputs
    wait_ready(group, side)                           # every member did, or one names its error
    group = group.build()                             # the gloo backend over all members

Neither side can put the other in its default process group (torchrun made the trainer's, vLLM
made the workers'), so the members meet through a TCPStore that member 0 hosts and build a
backend on it that is registered nowhere (as vLLM's own stateless groups are). real_py.vllm
numbers trainer rank t as t and vLLM worker i (dp * tp_size + tp_rank) as num_trainers + i.
DistTransport takes such a group as it is (gloo, or NCCL on GPUs). A member that rejects its inputs
(another model, a dtype, a worker count) says so in the store before the backend is built, so every
member fails at once with that member's reason instead of waiting for a peer that never joins.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

PREFIX = "real_py/group/"


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferGroup:
    store: dist.Store
    """The prefixed TCPStore of the group: readiness, the chosen format, failure reports,
    heartbeats and per-update stats."""
    rank: int
    world: int
    timeout_s: float
    address: str
    pg: Any = None
    """The backend over all members (ProcessGroupGloo or ProcessGroupNCCL, whose torch stubs
    share no base with shutdown()), once built."""

    @classmethod
    def connect(
        cls, host: str, port: int, rank: int, world: int, timeout_s: float
    ) -> TransferGroup:
        """Reach the group's store (rank 0 hosts it)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            tcp = dist.TCPStore(
                host, int(port), world, is_master=rank == 0, timeout=timeout, wait_for_workers=False
            )
        except Exception as e:
            raise RuntimeError(
                f"real_py transfer group: member {rank} of {world} could not reach "
                f"the store at {host}:{port} within {timeout_s:g} s ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0][:200]})"
            ) from e
        return cls(
            store=dist.PrefixStore(PREFIX, tcp),
            rank=rank,
            world=world,
            timeout_s=timeout_s,
            address=f"{host}:{port}",
        )

    def build(self, backend: str = "gloo") -> TransferGroup:
        """The backend over all members: "gloo" (CPU shards, any machine) or "nccl" (shards on
        each member's current CUDA device)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.PrefixStore("pg", self.store)
        pg: Any
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, self.rank, self.world, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, self.rank, self.world, options)
        else:
            raise ValueError(f"transport={backend!r}; allowed: 'gloo', 'nccl'")
        return replace(self, pg=pg)

    def close(self) -> None:
        """Stop this member's heartbeat on the group's store and shut the backend down."""
        from ...liveness import stop_heartbeat

        stop_heartbeat(self.store)
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:
                pass


def publish_ready(group: TransferGroup, error: str | None, extra: dict | None = None) -> None:
    """Tell the members this one checked its inputs (error: why it cannot take part)."""
    group.store.set(f"ready/{group.rank}", json.dumps({"error": error, "extra": extra}))
    if error:  # it knows its own refusal (member 0 lingers until every member has read one)
        group.store.set(f"refusal_seen/{group.rank}", "1")


def refuse(group: TransferGroup, who: str, why: str) -> None:
    """Fail the join for every member on behalf of a party that is not a member (the call that
    asks vLLM's workers to join, say)."""
    group.store.set("refused", json.dumps({"who": who, "why": why}))


def wait_ready(group: TransferGroup, side: str, poll_s: float = 0.05) -> dict[int, dict]:
    """Every member's readiness record; RuntimeError naming this side and the first member that
    refused (with its reason), or those that did not answer within the group's timeout."""
    deadline = time.monotonic() + group.timeout_s
    keys = [f"ready/{r}" for r in range(group.world)]
    got: dict[int, dict] = {}
    while True:
        if group.store.check(["refused"]):
            other = json.loads(group.store.get("refused"))
            _linger(group)
            raise RuntimeError(
                f"real_py transfer group ({side}): {other['who']} failed: {other['why']}"
            )
        for r, key in enumerate(keys):
            if r not in got and group.store.check([key]):
                got[r] = json.loads(group.store.get(key))
                if got[r]["error"]:
                    _linger(group)
                    raise RuntimeError(
                        f"real_py transfer group ({side}): member {r} refused: {got[r]['error']}"
                    )
        if len(got) == group.world:
            return got
        if time.monotonic() > deadline:
            missing = [r for r in range(group.world) if r not in got]
            raise RuntimeError(
                f"real_py transfer group ({side}): members {missing} of "
                f"{group.world} did not join at {group.address} within "
                f"{group.timeout_s:g} s "
            )
        time.sleep(poll_s)


def _linger(group: TransferGroup, grace_s: float = 10.0) -> None:
    """A member that read a refusal says so (one key per member: a member that refused and then
    read its own refusal counts once); member 0, whose process hosts the store, waits (a few
    seconds at most) until every member has, so none loses the reason with the store."""
    try:
        group.store.set(f"refusal_seen/{group.rank}", "1")
        keys = [f"refusal_seen/{r}" for r in range(group.world)]
        deadline = time.monotonic() + min(grace_s, group.timeout_s)
        while group.rank == 0 and not group.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:
        pass
