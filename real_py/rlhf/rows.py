"""Moving batch rows between the meshes of a producer call and its consumers, point to point.

Every rank keeps a `Store`: key -> a global-batch tensor [B, *trailing] of which it fills only
the rows it produced or received. Rows of a call with layout L are split evenly over L.dp: DP
rank d holds rows [d * B / dp, (d + 1) * B / dp) on every one of its TP and PP ranks.

After a producer call, `push_plan` (pure, identical on every rank) lists for every consumer rank
the rows it needs of each written key, minus rows it already holds; each row comes from one rank
of the producer replica holding it (spread over that replica's TP x PP ranks by receiver rank).
All keys one sender sends one receiver after one call travel as ONE byte message, tagged with the
producer's position in the global order, so messages of different calls never match each other.
Receivers post their irecv at once and wait only before the call that reads the data: that is
what lets calls on disjoint meshes run at the same time.

On NCCL (device buffers; the Store itself stays on the CPU) the receives of a call are held
back and posted together with that call's sends, in one batch_isend_irecv, after the call ran:
NCCL ignores tags and runs one pair's operations in issue order, so a receive posted early could
sit in front of a send the peer waits for. Every rank posts every call's batch in the same global
order (the runtime calls post(sending=True) on every rank), which keeps the pairs matched.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..liveness import PeerWatch, SilentPeer, wait_watched


def key_schema(P: int, T: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """key -> (trailing shape, dtype) for prompts of at most P tokens and sequences of T tokens."""
    i64, f32 = torch.int64, torch.float32
    return {
        "prompts": ((P,), i64),
        "prompt_lengths": ((), i64),
        "seeds": ((), i64),
        "tokens": ((T,), i64),
        "lengths": ((), i64),
        "old_logp": ((T - 1,), f32),
        "rollout_logp": ((T - 1,), f32),  # vLLM generation: the engine's own log-probs
        "ref_logp": ((T - 1,), f32),
        "scores": ((), f32),
        "values": ((T,), f32),
        "base_tokens": ((T,), i64),
        "base_lengths": ((), i64),
        "base_scores": ((), f32),
        # async mode: actor weight version of every response token (-1 off the response)
        "versions": ((T - 1,), i64),
    }


def dp_rows(layout, dp_rank: int, B: int, mini_batches: int = 1) -> list[int]:
    """Global rows of DP rank `dp_rank`: its 1/dp share of each of the `mini_batches` contiguous
    mini-batches, in mini-batch order (so a train call's global mini-batch j is the same rows
    whatever its dp; with mini_batches=1 a contiguous block)."""
    per, out = B // mini_batches, []
    for j in range(mini_batches):
        share = per // layout.dp
        lo = j * per + dp_rank * share
        out += range(lo, lo + share)
    return out


def push_plan(
    graph, plan, call: str, B: int, mini_batches: dict[str, int]
) -> dict[tuple[int, int], list[tuple[str, tuple[int, ...]]]]:
    """(sender, receiver) -> [(key, rows)] for the keys `call` writes; deterministic order.
    mini_batches: call -> mini-batches of its row split (1 when absent)."""
    src = plan.calls[call]
    writes = graph.calls[call].writes
    need: dict[tuple[int, str], set[int]] = {}
    for c in graph.order:
        keys = [k for k in graph.calls[c].reads if k in writes]
        if not keys:
            continue
        layout = plan.calls[c]
        for r in layout.ranks:
            rows = dp_rows(layout, layout.coords(r)[0], B, mini_batches.get(c, 1))
            for k in keys:
                need.setdefault((r, k), set()).update(rows)
    msgs: dict[tuple[int, int], list] = {}
    for (r, k), rows in sorted(need.items()):
        for d in range(src.dp):
            mine = sorted(set(dp_rows(src, d, B, mini_batches.get(call, 1))) & rows)
            if not mine:
                continue
            holders = [src.rank(d, t, p) for p in range(src.pp) for t in range(src.tp)]
            if r in holders:
                continue
            sender = holders[r % len(holders)]
            msgs.setdefault((sender, r), []).append((k, tuple(mine)))
    return dict(sorted(msgs.items()))


class Store:
    def __init__(self, schema: dict, B: int):
        self.schema, self.B = schema, B
        self.data = {k: torch.zeros((B,) + shape, dtype=dt) for k, (shape, dt) in schema.items()}

    def write(self, key: str, rows: list[int], value: torch.Tensor) -> None:
        t = self.data[key]
        v = value.to(t.dtype)
        if v.dim() == 2 and v.shape[1] < t.shape[1]:
            v = torch.cat([v, v.new_zeros(v.shape[0], t.shape[1] - v.shape[1])], 1)
        t[list(rows)] = v

    def rows(self, key: str, rows: list[int]) -> torch.Tensor:
        """A copy of the rows, in the given order."""
        return self.data[key][list(rows)]

    def pack(self, parts) -> torch.Tensor:
        return torch.cat(
            [
                self.data[k][list(rows)].contiguous().view(torch.uint8).reshape(-1)
                for k, rows in parts
            ]
        )

    def nbytes(self, parts) -> int:
        total = 0
        for k, rows in parts:
            shape, dt = self.schema[k]
            n = len(rows)
            for s in shape:
                n *= s
            total += n * torch.tensor([], dtype=dt).element_size()
        return total

    def unpack(self, parts, buf: torch.Tensor) -> None:
        off = 0
        for k, rows in parts:
            t = self.data[k]
            n = self.nbytes([(k, rows)])
            raw = buf[off : off + n]
            # Keys of different dtypes share one message: a piece after an odd number of int32
            # values starts misaligned for an 8-byte dtype, and view() needs aligned storage.
            if off % t.element_size():
                raw = raw.clone()
            piece = raw.view(t.dtype).view((len(rows),) + t.shape[1:])
            t[list(rows)] = piece
            off += n


class Pusher:
    """Posts the pushes of one iteration and waits for them with a timeout."""

    def __init__(
        self,
        rank: int,
        timeout_s: float,
        device=None,
        batched: bool | None = None,
        watch: PeerWatch | None = None,
    ):
        """batched: hold receives back and post each call's pushes as one batch_isend_irecv
        (default: on CUDA, which NCCL needs; gloo runs it too, which is how it is tested).
        watch: a liveness.PeerWatch; a wait then fails within seconds, naming the peer, when the
        peer's heartbeat stops (a stopped process) instead of at the timeout."""
        self.rank, self.timeout = rank, datetime.timedelta(seconds=timeout_s)
        self.watch = watch
        self.device = torch.device(device or "cpu")
        self.batched = self.device.type == "cuda" if batched is None else batched
        self.recvs: list = []  # (work, buf, parts, sender, call)
        self.sends: list = []  # (work, buf, receiver, call)
        self.held: list = []  # NCCL: (buf, parts, sender, call) waiting for the call's batch
        self.bytes_sent = 0

    def post(self, store: Store, msgs: dict, tag: int, call: str, sending: bool) -> None:
        """Receivers post irecv (before `call`); senders post isend once it ran (sending=True).
        On NCCL the receives wait for the sending=True post, which every rank makes."""
        nccl = self.batched
        batch, recvs, sends = [], [], []
        for (s, r), parts in msgs.items():
            if r == self.rank and not sending:
                buf = torch.empty(store.nbytes(parts), dtype=torch.uint8, device=self.device)
                if nccl:
                    self.held.append((buf, parts, s, call))
                else:
                    self.recvs.append((dist.irecv(buf, s, tag=tag), buf, parts, s, call))
            elif s == self.rank and sending:
                buf = store.pack(parts).to(self.device)
                self.bytes_sent += buf.numel()
                if nccl:
                    sends.append((buf, r, call))
                else:
                    self.sends.append((dist.isend(buf, r, tag=tag), buf, r, call))
        if nccl and sending:
            recvs, self.held = self.held, []
            batch = [dist.P2POp(dist.irecv, buf, s, tag=tag) for buf, _, s, _ in recvs] + [
                dist.P2POp(dist.isend, buf, r, tag=tag) for buf, r, _ in sends
            ]
        if batch:
            work = _Batch(dist.batch_isend_irecv(batch))
            self.recvs += [(work, buf, parts, s, c) for buf, parts, s, c in recvs]
            self.sends += [(work, buf, r, c) for buf, r, c in sends]

    def _wait(self, work, what: str, step: int, peer: int) -> None:
        def check():
            silent = self.watch.silent([peer])
            if silent:
                raise SilentPeer(
                    f"rank {self.rank}, step {step}: {what}: peer rank {peer} "
                    f"{self.watch.describe(peer, silent[0][1])}"
                )

        try:
            if self.watch is None:
                work.wait(self.timeout)
            else:
                wait_watched(lambda: work.wait(self.timeout), check)
        except SilentPeer:
            raise
        except RuntimeError as e:
            raise RuntimeError(
                f"rank {self.rank}, step {step}: {what} failed or timed out after "
                f"{self.timeout.total_seconds():.0f} s: {e}"
            ) from None

    def wait_for(self, store: Store, keys, step: int) -> None:
        """Complete every posted receive carrying any of `keys`."""
        keep = []
        for work, buf, parts, s, call in self.recvs:
            if any(k in keys for k, _ in parts):
                self._wait(
                    work, f"receiving {[k for k, _ in parts]} of {call} from rank {s}", step, s
                )
                store.unpack(parts, buf.cpu())
            else:
                keep.append((work, buf, parts, s, call))
        self.recvs = keep

    def finish(self, store: Store, step: int) -> None:
        self.wait_for(store, set(store.schema), step)
        for work, _, r, call in self.sends:
            self._wait(work, f"sending rows of {call} to rank {r}", step, r)
        self.sends = []


class _Batch:
    """The works of one batch_isend_irecv (NCCL coalesces them into one) as one waitable that
    several receives share: waited once (a second wait on a finished gloo recv blocks)."""

    def __init__(self, works):
        self.works, self.done = works, False

    def wait(self, timeout=None):
        if not self.done:
            for w in self.works:
                w.wait(timeout)
            self.done = True


__all__ = ["key_schema", "dp_rows", "push_plan", "Store", "Pusher"]
