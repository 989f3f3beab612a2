"""torch.distributed transport: one batch_isend_irecv per round, broadcasts in cached subgroups.

    transport = DistTransport(group, timeout=60.0)       # gloo (CPU) or NCCL (GPU) group
    Reallocator(plan, transport, bucket_bytes=...).run(src_shard, dst_shard)

Plan ranks are ranks of `group` (the same as global ranks for the world group). Every rank of
`group` must construct the Reallocator (setup is collective: broadcast-mode plans create one
subgroup per (sender, receivers) set, on every rank, in one sorted order, cached per transport).

A round posts its single-receiver chunks as one `dist.batch_isend_irecv` (one NCCL group call)
and then one async broadcast per multi-receiver chunk, sorted by (sender, receivers) so every
rank issues collectives in one global order. `Handle.wait()` polls the works against a deadline
of `timeout` seconds; a failed or late op becomes a TransferError naming this rank, the peer and
the round. A rank that gives up writes a line to the store (the default store unless one is
passed), filed under the group's setup count (the k-th setup is the same reallocation on every
rank, even when a peer has not reached it yet); a rank whose wait fails adds those lines to its
error, so a chain of failures still names the rank that failed first.

Waiting watches the peers (real_py/liveness.py): every process beats through the store, and
`Handle.wait()` runs the blocking waits in a helper thread while it reads, every 0.1 s, the
failure reports (a peer that gave up, e.g. rejecting its own input before posting anything:
raise at once, naming it and its reason, after a short grace for ops that do not depend on it)
and the heartbeats of the peers it waits on (one silent for liveness.SILENT_S seconds, e.g.
SIGSTOPped: raise naming it). Without a store, waits are plain blocking waits.

Stream order (NCCL; `stream_ordered=True` forces the same round loop on gloo, for tests): the
round loop completes a round with `Handle.order()`, which on NCCL makes the current stream wait
for the round's works (ProcessGroupNCCL runs them on its own communication streams, which wait
for the current stream when posted), with no host wait, and the unpack follows on the stream; at
the end it calls `wait()` on every round, which watches each against its deadline (and the
peers) on the host. On gloo `order()` is the blocking wait with its deadline.

Counters: `sent_bytes` / `received_bytes` (network payload bytes; a broadcast counts once for
its sender, as in ReallocPlan.per_rank_bytes()).

One file (about 400 lines): posting a round, waiting on it and naming a failure share the
transport's state (the subgroups, the store's reports, the peer watch), and a reader follows one
round from post to error here.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...liveness import PeerWatch, start_heartbeat, wait_watched
from .base import Handle, Recvs, Sends, TransferError, Transport

_EPOCHS: dict[tuple, int] = {}
"""Setups per (report prefix (process group), rank[, bare group]) in this process (ranks may share
a process as threads, each with its own transport). Setup is collective, so the k-th
setup on a group is the same reallocation on every rank: reports are filed under that count."""

REPORT_GRACE_S = 0.5
"""Seconds a wait still gives its ops after a peer reported a failure: ops that do not depend on
that peer (its data already arrived) complete, the rest are given up."""


class DistTransport(Transport):
    name = "torch.distributed"
    asynchronous = True

    def __init__(
        self, group, *, timeout: float = 60.0, store=None, stream_ordered: bool | None = None
    ):
        """group: an initialized ProcessGroup (dist.group.WORLD for the default one).

        timeout: seconds any one round may take before TransferError. store: where failure
        reports go (default: the default process group's store; None disables them). Reports
        are read after a failure, to name the rank that failed first."""
        if group is None:
            raise ValueError(
                "DistTransport needs an explicit process group (dist.group.WORLD for "
                "the default one)"
            )
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        self.group, self.timeout = group, float(timeout)
        # A group registered nowhere (a bare gloo backend two programs built on their own store,
        # such as real_py.vllm's transfer group) is addressed through its own methods.
        self._bare = group not in dist.distributed_c10d._world.pg_map
        if self._bare and store is None:
            raise ValueError(
                "DistTransport over a process group that torch.distributed does not "
                "know (built on its own store) needs that store: pass store="
            )
        self.rank = group.rank() if self._bare else dist.get_rank(group)
        self.world = group.size() if self._bare else dist.get_world_size(group)
        self.backend = group.name() if self._bare else dist.get_backend(group)
        self.stream_ordered = (
            self.backend == "nccl" if stream_ordered is None else bool(stream_ordered)
        )
        self.sent_bytes = self.received_bytes = 0
        self._global = (
            list(range(self.world))
            if self._bare
            else [dist.get_global_rank(group, r) for r in range(self.world)]
        )
        self._subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._prefix = f"real_py/failures/{getattr(group, 'group_name', 'group')}"
        if store is None:
            try:
                store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, ValueError):
                store = None
        self.store = store
        self._watch = (
            PeerWatch(start_heartbeat(store, self.rank if self._bare else dist.get_rank()))
            if store is not None
            else None
        )
        # Reports are filed per setup epoch: a report written by a rank that failed before a
        # peer's setup is still read by that peer (same epoch), and a later reallocation on the
        # group never reads an earlier one's reports (next epoch).
        # A bare group is built anew for each pairing (its own store): count its setups alone,
        # so a long-lived process (a vLLM worker) and a restarted peer agree on the first one.
        self._epoch_key = (self._prefix, self.rank) + ((id(group),) if self._bare else ())
        self._epoch = _EPOCHS.get(self._epoch_key, 0)
        self._warm = False

    # ------------------------------------------------------------------ setup

    def setup(self, plan) -> None:
        for r in plan.ranks():
            if not 0 <= r < self.world:
                raise ValueError(
                    f"plan uses rank {r}, but the group has {self.world} ranks; plan "
                    "ranks are ranks of the transport's group"
                )
        sets = sorted(
            {
                (int(plan.msg_sender[m]),) + plan.receivers(m)
                for m in range(plan.num_messages)
                if len(plan.receivers(m)) > 1
            }
        )
        if self._bare:
            if sets:
                raise ValueError(
                    "broadcast-mode plans need subgroups, which a group built on its "
                    "own store cannot make: plan with mode='p2p'"
                )
            if self.backend == "nccl" and not self._warm:  # as below: every rank's first op
                device = torch.device("cuda", torch.cuda.current_device())
                self.group.allreduce([torch.zeros(1, device=device)]).wait()
            self._warm = True
            self._epoch = _EPOCHS[self._epoch_key] = _EPOCHS.get(self._epoch_key, 0) + 1
            return
        whole = self.world == dist.get_world_size()
        for s in sets:
            key = tuple(sorted(s))
            if key in self._subgroups:
                continue
            # Every rank creates every subgroup in this sorted order, so group names line up.
            # With the whole world in `group` that is the plain new_group contract; for a
            # smaller group the non-members of `group` cannot join, so use local sync.
            self._subgroups[key] = dist.new_group(
                [self._global[r] for r in key],
                timeout=datetime.timedelta(seconds=self.timeout),
                backend=self.backend,
                use_local_synchronization=not whole,
            )
        if self.backend == "nccl" and not self._warm:
            # NCCL: the first op on a communicator must involve every rank of the group.
            dist.all_reduce(
                torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())),
                group=self.group,
            )
        self._warm = True
        self._epoch = _EPOCHS[self._epoch_key] = _EPOCHS.get(self._epoch_key, 0) + 1

    # ------------------------------------------------------------------ rounds

    def start(self, sends: Sends, recvs: Recvs, step: str) -> Handle:
        ops: list[tuple[Callable[..., Any], torch.Tensor, int]] = []  # (isend / irecv, t, peer)
        works: list[tuple[str, tuple[int, ...]]] = []  # (what, peer ranks) per op
        bcast: list[tuple[tuple[int, ...], int, int, torch.Tensor]] = []
        for i, (receivers, t) in enumerate(sends):
            if self.rank in receivers:
                raise ValueError(
                    f"rank {self.rank}: {step}: a chunk sent to itself; local copies "
                    "never go through the transport"
                )
            self.sent_bytes += t.numel() * t.element_size()
            if len(receivers) == 1:
                ops.append((dist.isend, t, self._global[receivers[0]]))
                works.append((f"send to peer rank {receivers[0]}", (receivers[0],)))
            else:
                bcast.append(((self.rank,) + tuple(receivers), 0, i, t))
        for i, (sender, t, receivers) in enumerate(recvs):
            self.received_bytes += t.numel() * t.element_size()
            if len(receivers) == 1:
                ops.append((dist.irecv, t, self._global[sender]))
                works.append((f"receive from peer rank {sender}", (sender,)))
            else:
                bcast.append(((sender,) + tuple(receivers), 1, i, t))
        pending: list[tuple[Any, str, tuple[int, ...]]] = []  # (work, what, peer ranks)
        try:
            if ops:
                # gloo matches a pair's messages in posting order, whichever way they are posted;
                # posted one by one, a failed post names its peer (a dead one fails at once).
                got = (
                    self._post_each(ops, works, step)
                    if self._bare
                    else dist.batch_isend_irecv(
                        [dist.P2POp(fn, t, peer, self.group) for fn, t, peer in ops]
                    )
                )
                # NCCL coalesces the group into one work; gloo returns one per op.
                if len(got) == len(ops):
                    pending += [(w, what, peers) for w, (what, peers) in zip(got, works)]
                else:
                    what = "; ".join(sorted({w for w, _ in works}))
                    peers = tuple(sorted({p for _, ps in works for p in ps}))
                    pending += [(w, what, peers) for w in got]
            bcast.sort(key=lambda x: (x[0], x[1], x[2]))
            for (sender, *to), _, _, t in bcast:
                g = self._subgroups.get(tuple(sorted((sender, *to))))
                if g is None:
                    raise ValueError(
                        f"rank {self.rank}: {step}: no subgroup for sender {sender} -> "
                        f"{to}; was transport.setup(plan) called?"
                    )
                w = dist.broadcast(t, src=self._global[sender], group=g, async_op=True)
                pending.append(
                    (
                        w,
                        f"broadcast from rank {sender} to ranks {to}"
                        + (f" (peer rank {sender})" if sender != self.rank else ""),
                        tuple(r for r in (sender, *to) if r != self.rank),
                    )
                )
        except (TransferError, ValueError):
            raise
        except Exception as e:  # posting failed (peer gone): same error path as a failed wait
            raise self._error(step, "posting ops", e) from e
        return _DistHandle(self, pending, step)

    def _post_each(self, ops, works, step: str) -> list:
        got = []
        for (fn, t, peer), (what, _) in zip(ops, works):
            try:
                got.append(
                    self.group.send([t], peer, 0)
                    if fn is dist.isend
                    else self.group.recv([t], peer, 0)
                )
            except Exception as e:
                raise self._error(step, f"posting ({what})", e) from e
        return got

    # ------------------------------------------------------------------ failures

    def fail(self, step: str, why: str, who: str | None = None) -> None:
        """who: the failing party when it is not this rank (a controller this rank drives): the
        line then reaches this rank's own waits too."""
        line = f"{who or f'rank {self.rank}'} in {step}: {why}"
        if self.store is None:
            return
        try:
            n = self.store.add(self._key("n"), 1)
            self.store.set(self._key(n), line[:2000])
        except Exception:
            pass

    def _key(self, what) -> str:
        return f"{self._prefix}/{self._epoch}/{what}"

    def _num_reports(self) -> int:
        if self.store is None:
            return 0
        try:
            return int(self.store.add(self._key("n"), 0))
        except Exception:
            return 0

    def reports(self) -> list[str]:
        """Failure lines written by other ranks in this reallocation (setup epoch)."""
        out = []
        for i in range(1, self._num_reports() + 1):
            key = self._key(i)
            try:
                if self.store.check([key]):
                    line = self.store.get(key).decode(errors="replace")
                    if not line.startswith(f"rank {self.rank} in "):
                        out.append(line)
            except Exception:
                pass
        return out

    def _check_peers(self, step: str, peers, state: dict) -> None:
        """Called while a round waits: raise TransferError if another rank reported a failure
        (after REPORT_GRACE_S) or one of `peers` (group ranks) stopped beating."""
        reports = self.reports()
        if reports:
            first = state.setdefault("reported", time.monotonic())
            if time.monotonic() - first >= REPORT_GRACE_S:
                root = reports[0].replace(" in ", " failed in ", 1)
                msg = (
                    f"rank {self.rank}: {step}: stopped waiting ({state['what']}): {root[:600]}"
                    + (f" (and {len(reports) - 1} more reports)" if len(reports) > 1 else "")
                )
                self.fail(step, f"TransferError: {msg}")
                raise _reported(TransferError(msg))
        watch = self._watch
        silent = watch.silent([self._global[p] for p in peers]) if watch is not None else []
        if watch is not None and silent:
            g, secs = silent[0]
            p = self._global.index(g)
            msg = (
                f"rank {self.rank}: {step}: peer rank {p}{'' if p == g else f' (global rank {g})'} "
                f"{watch.describe(g, secs)}, while waiting to {state['what']}"
            )
            self.fail(step, f"TransferError: {msg}")
            raise _reported(TransferError(msg))

    def _error(self, step: str, what: str, cause=None) -> TransferError:
        """The TransferError for a failed op; reports it first, then gives the other ranks a
        moment to report theirs, so that a chain of failures names the rank at its root."""
        msg = f"rank {self.rank}: {step}: {what}"
        if cause is not None:
            msg += f" failed: {type(cause).__name__}: {str(cause).strip().splitlines()[0][:300]}"
        self.fail(step, f"TransferError: {msg}")
        reports = self.reports()
        grace = time.monotonic() + min(2.0, self.timeout / 2)
        while not reports and self.store is not None and time.monotonic() < grace:
            time.sleep(0.05)
            reports = self.reports()
        if reports:
            msg += "; failures reported by other ranks: " + " | ".join(r[:400] for r in reports[:4])
        return _reported(TransferError(msg))


def _reported(e: TransferError) -> TransferError:
    """Mark an error this transport already reported to its peers (the reallocator then does
    not report it a second time)."""
    e.reported = True
    return e


class _DistHandle(Handle):
    def __init__(self, transport: DistTransport, pending: list, step: str):
        self.t, self.pending, self.step = transport, pending, step
        self.deadline: float | None = None
        """Set when the round is first depended on (order or wait): timeout seconds later."""

    def order(self) -> None:
        """NCCL: the current stream waits for the round's works (no host wait; `wait()` later
        watches them). gloo: the blocking wait."""
        if self.t.backend != "nccl":
            self.wait()
            return
        self.deadline = time.monotonic() + self.t.timeout
        for work, what, _ in self.pending:
            try:
                work.wait()  # no timeout: ProcessGroupNCCL only orders the current stream
            except Exception as e:
                self.pending = []
                raise self.t._error(self.step, what, e) from e

    def wait(self) -> None:
        # One blocking wait per op against the round's deadline: gloo's send/recv works never
        # report completion to is_completed() and a timed-out gloo wait closes the pair, so
        # polling or sliced waits are not an option. A dead peer fails the wait at once
        # ("Connection reset/closed by peer"); a live peer that never posts, at the deadline.
        # With a store, the waits run in a helper thread while this one watches the peers.
        t = self.t
        # An ordered round counts from its order() call (the host watches it later).
        deadline = self.deadline or time.monotonic() + t.timeout
        state: dict[str, Any] = {"what": "", "failed": None}

        def run():
            for work, what, _ in self.pending:
                state["what"] = what
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise TimeoutError("round deadline passed")
                    work.wait(datetime.timedelta(seconds=left))
                except Exception as e:
                    state["failed"] = (what, e, time.monotonic())
                    return

        if not self.pending:
            return
        if t._watch is None:
            run()
        else:
            peers = sorted({p for _, _, ps in self.pending for p in ps})
            wait_watched(run, lambda: t._check_peers(self.step, peers, state))
        # The round is over: release its Work objects (and their tensors) now, not whenever
        # this handle is collected (see liveness._Waiter).
        self.pending = []
        if state["failed"] is not None:
            what, e, when = state["failed"]
            if when >= deadline - 0.05:
                raise t._error(
                    self.step, f"timed out after {t.timeout:g} s waiting to {what}"
                ) from e
            raise t._error(self.step, what, e) from e


__all__ = ["DistTransport"]
