"""Checks failure handling of distributed reallocation over gloo: a killed rank, a stalled rank,
data corrupted in flight (verify=True), free_source, and the staging bound.

A failure points to real_py/realloc/transports/dist.py (timeouts, error text, failure reports) or to
the reallocator's verify / free_source / staging handling (real_py/realloc/reallocator.py).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from support.dist_cases import TIED, random_full
from support.oracle import oracle_flat

from real_py import Layout, ModelShard, plan_realloc
from real_py.realloc.reallocator import Reallocator
from real_py.realloc.transports.base import Handle, TransferError, Transport
from real_py.realloc.transports.dist import DistTransport
from real_py.testing import run_distributed

SRC, DST = Layout.parse("tp2,pp2"), Layout.parse("dp4")  # every rank needs data from every other


class Wrapped(Transport):
    """Delegates to a real transport; `hook(i, sends, recvs)` runs before round i starts and
    `after(i, recvs)` after it completed (fault injection)."""

    def __init__(self, inner, hook=None, after=None):
        self.inner, self.rank, self.hook, self.after, self.i = inner, inner.rank, hook, after, 0

    def setup(self, plan):
        self.inner.setup(plan)

    def fail(self, step, why):
        self.inner.fail(step, why)

    def start(self, sends, recvs, step):
        i, self.i = self.i, self.i + 1
        if self.hook:
            self.hook(i, sends, recvs)
        h, after = self.inner.start(sends, recvs, step), self.after

        class _H(Handle):
            def wait(self):
                h.wait()
                if after:
                    after(i, recvs)

        return _H()


def _faults(rank: int, world: int) -> dict:
    full = random_full(TIED, 3)
    t = DistTransport(dist.group.WORLD, timeout=20)
    seen = {}

    # 1. free_source: storage released after a successful transfer, result exact.
    s, d = ModelShard.from_full(TIED, SRC, rank, full), ModelShard.empty(TIED, DST, rank)
    r = Reallocator(plan_realloc(TIED, SRC, DST), t, bucket_bytes=2048)
    r.run(s, d, free_source=True)
    assert s.flat.untyped_storage().nbytes() == 0, "source storage not freed"
    assert torch.equal(d.flat, oracle_flat(TIED, DST, rank, full))
    # Staging: one buffer of two halves, within the bucket, reused on the next run.
    assert r.pipeline and r.staging.numel() * r.staging.element_size() <= 2048
    staging = r.staging
    r.run(ModelShard.from_full(TIED, SRC, rank, full), ModelShard.empty(TIED, DST, rank))
    assert r.staging is staging, "staging buffer reallocated on the second run"

    # 2. verify=True with a byte flipped after receiving, in rank 1's last receiving round.
    plan = plan_realloc(TIED, SRC, DST)
    flip = {}

    def corrupt(i, recvs):
        if i == flip.get("round"):
            recvs[0][1].view(torch.uint8)[0] ^= 1
            flip["peer"] = recvs[0][0]

    w = Wrapped(t, after=corrupt if rank == 1 else None)
    r = Reallocator(plan, w, bucket_bytes=2048, verify=True)
    flip["round"] = max(i for i, rr in enumerate(r.rounds) if rr.recvs)
    s, d = ModelShard.from_full(TIED, SRC, rank, full), ModelShard.empty(TIED, DST, rank)
    if rank == 1:
        with pytest.raises(TransferError) as e:
            r.run(s, d, free_source=True)
        msg = str(e.value)
        rr = r.rounds[flip["round"]]
        assert f"rank 1: round {rr.index}/" in msg and "checksum mismatch" in msg, msg
        assert f"from peer rank {flip['peer']}" in msg, msg
        assert s.flat.untyped_storage().nbytes() > 0, "source freed although the transfer failed"
        assert torch.equal(s.flat, oracle_flat(TIED, SRC, rank, full))
        seen["corrupt"] = msg
    else:
        r.run(s, d)
        assert torch.equal(d.flat, oracle_flat(TIED, DST, rank, full))
    dist.barrier()

    # 3. A live rank that never joins: the others time out naming it (or a rank that did).
    t2 = DistTransport(dist.group.WORLD, timeout=3)
    r = Reallocator(plan, t2, bucket_bytes=2048)
    s, d = ModelShard.from_full(TIED, SRC, rank, full), ModelShard.empty(TIED, DST, rank)
    if rank == 3:
        time.sleep(12)  # past every peer's deadline (and grace), alive all along
        return seen
    t0 = time.monotonic()
    with pytest.raises(TransferError) as e:
        r.run(s, d)
    msg = str(e.value)
    # A rank blocked on another survivor (itself blocked on rank 3) may name that survivor when
    # the root's failure report lands after the grace window: every survivor names a peer and
    # the round; at least one (checked in the parent) names rank 3.
    assert msg.startswith(f"rank {rank}: round ") and "peer rank " in msg, msg
    assert time.monotonic() - t0 < 3 + 8, "failing took much longer than the timeout"
    assert torch.equal(s.flat, oracle_flat(TIED, SRC, rank, full)), "source modified"
    seen["stalled"] = msg
    return seen


@pytest.mark.dist
def test_corruption_free_source_and_stalled_peer():
    out = run_distributed(_faults, 4, timeout=200)
    assert "checksum mismatch" in out[1]["corrupt"]
    assert any("peer rank 3" in out[r]["stalled"] for r in (0, 1, 2)), [
        out[r]["stalled"] for r in (0, 1, 2)
    ]


def _killed(rank: int, world: int) -> str | None:
    full = random_full(TIED, 4)
    t = DistTransport(dist.group.WORLD, timeout=15)

    def die(i, sends, recvs):
        if i == 3:
            os._exit(17)  # killed mid-transfer: no cleanup, sockets reset by the kernel

    r = Reallocator(
        plan_realloc(TIED, SRC, DST), Wrapped(t, hook=die if rank == 2 else None), bucket_bytes=1024
    )
    s, d = ModelShard.from_full(TIED, SRC, rank, full), ModelShard.empty(TIED, DST, rank)
    try:
        r.run(s, d)
    except TransferError as e:
        msg = str(e)
        assert msg.startswith(f"rank {rank}: round ") and "peer rank 2" in msg, msg
        assert torch.equal(s.flat, oracle_flat(TIED, SRC, rank, full)), "source modified"
        return msg
    raise AssertionError(f"rank {rank} finished although rank 2 died in its round 3")


@pytest.mark.dist
def test_killed_rank_fails_peers_naming_it():
    out = run_distributed(_killed, 4, timeout=120, allow_exit=(2,))
    assert out[2] is None
    assert all("peer rank 2" in out[r] for r in (0, 1, 3))


def _early_failure_and_stopped_rank(rank: int, world: int) -> dict:
    """A: rank 2 rejects its own input (no source shard) before posting anything; B: rank 3 is
    SIGSTOPped before its first round; C: rank 2 is SIGSTOPped instead of pushing rows (the
    runtime's Pusher). Timeouts are 60 s: only telling / watching the peers makes the others
    fail within seconds. Rank 0 SIGKILLs each stopped rank once the others named it."""
    import signal

    full = random_full(TIED, 5)
    store = dist.distributed_c10d._get_default_store()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    # One group per phase: A's abandoned receives stay posted on its group.
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    plan = plan_realloc(TIED, SRC, DST)
    out = {}

    t = DistTransport(groups[0], timeout=60)
    if rank != 2:  # rank 2 reports its failure before its peers have even set up: still seen
        time.sleep(3)
    r = Reallocator(plan, t, bucket_bytes=2048)
    s, d = ModelShard.from_full(TIED, SRC, rank, full), ModelShard.empty(TIED, DST, rank)
    t0 = time.monotonic()
    with pytest.raises((TransferError, ValueError)) as e:
        r.run(None if rank == 2 else s, d)
    out["early"] = (type(e.value).__name__, str(e.value), time.monotonic() - t0)
    if rank == 3:  # it gets killed below: rank 0 returns its result
        store.set("early3", json.dumps(out["early"]))
    assert torch.equal(s.flat, oracle_flat(TIED, SRC, rank, full)), "source modified"

    def stop(i, sends, recvs):
        if i == 0:
            store.set("stopped_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

    t = DistTransport(groups[1], timeout=60)
    r = Reallocator(plan, Wrapped(t, hook=stop if rank == 3 else None), bucket_bytes=1024)
    s, d = ModelShard.from_full(TIED, SRC, rank, full), ModelShard.empty(TIED, DST, rank)
    with pytest.raises(TransferError) as e:
        r.run(s, d)
    out["stopped"] = (str(e.value), time.time() - float(store.get("stopped_at")))
    store.add("detected", 1)
    if rank == 0:  # the others detect it on their own; then nothing may stay stopped
        deadline = time.monotonic() + 30
        while int(store.add("detected", 0)) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(pids[3], signal.SIGKILL)
        out["early3"] = tuple(json.loads(store.get("early3")))

    # C: the runtime's row pushes. Rank 2 stops instead of sending its rows to ranks 0 and 1.
    from real_py.liveness import PeerWatch, start_heartbeat
    from real_py.rlhf.rows import Pusher, Store

    rows = Store({"scores": ((), torch.float32)}, 4)
    pusher = Pusher(rank, 60, watch=PeerWatch(start_heartbeat()))
    msgs = {(2, 0): [("scores", (0, 1))], (2, 1): [("scores", (2, 3))]}
    pusher.post(rows, msgs, 5, "rew_inf", sending=False)
    if rank == 2:
        store.set("out2", json.dumps(out))  # it gets killed below: rank 0 returns its results
        store.set("stopped2_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    with pytest.raises(RuntimeError) as e:
        pusher.wait_for(rows, {"scores"}, 7)
    out["push"] = (str(e.value), time.time() - float(store.get("stopped2_at")))
    store.add("detected2", 1)
    if rank == 0:
        deadline = time.monotonic() + 30
        while int(store.add("detected2", 0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(pids[2], signal.SIGKILL)
        out["out2"] = {k: tuple(v) for k, v in json.loads(store.get("out2")).items()}
    return out


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_early_failure_and_stopped_rank_are_named_in_seconds():
    out = run_distributed(_early_failure_and_stopped_rank, 4, timeout=200, allow_exit=(2, 3))
    assert out[2] is None and out[3] is None
    out[2] = out[0]["out2"]
    kind, msg, _ = out[2]["early"]
    assert kind == "ValueError" and "rank 2 is in the source layout" in msg, msg
    early = {0: out[0]["early"], 1: out[1]["early"], 3: out[0]["early3"]}
    for r in (0, 1, 3):
        kind, msg, took = early[r]
        assert kind == "TransferError" and msg.startswith(f"rank {r}: "), msg
        assert "rank 2 failed in input check: ValueError: rank 2 is in the source layout" in msg, (
            msg
        )
        assert took < 20, f"rank {r} learnt of rank 2's failure after {took:.1f} s (timeout 60 s)"
    for r in (0, 1, 2):
        msg, took = out[r]["stopped"]
        assert msg.startswith(f"rank {r}: round ") and "peer rank 3 is silent" in msg, msg
        assert took < 30, f"rank {r} named the stopped rank after {took:.1f} s (timeout 60 s)"
    for r in (0, 1):
        msg, took = out[r]["push"]
        assert msg.startswith(
            f"rank {r}, step 7: receiving ['scores'] of rew_inf from rank 2: peer rank 2 is silent"
        ), msg
        assert took < 30, f"rank {r} named the stopped rank after {took:.1f} s (timeout 60 s)"
    print(
        "row pushes: detection seconds after SIGSTOP:",
        {r: round(out[r]["push"][1], 2) for r in (0, 1)},
    )
    print(
        "detection seconds after SIGSTOP:",
        {r: round(out[r]["stopped"][1], 2) for r in (0, 1, 2)},
        "; after the early failure:",
        {r: round(early[r][2], 2) for r in (0, 1, 3)},
    )


def _stopped_in_collective(rank: int, world: int, out_dir: str) -> None:
    """Rank 3 is SIGSTOPped while ranks 0-2 are blocked in an all-reduce with it (as in a TP
    all-reduce inside a call): the runtime's Watchdog names it within seconds, not at the
    process group's 60 s timeout. Each survivor writes its message, rank 0 SIGKILLs rank 3."""
    import signal

    from real_py.liveness import Watchdog, default_store, start_heartbeat

    store = start_heartbeat()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())

    def on_silent(msg: str) -> None:
        took = time.time() - float(store.get("stopped_at"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump([msg, took], f)
        if rank == 0:
            os.kill(pids[3], signal.SIGKILL)
        os._exit(75)

    dog = Watchdog(default_store(), on_silent=on_silent)
    dist.barrier()
    if rank == 3:
        store.set("stopped_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    with dog.section(f"rank {rank}, step 7, call actor_train", peers=range(world)):
        dist.all_reduce(torch.ones(4))
    raise AssertionError(f"rank {rank}: the all-reduce finished although rank 3 is stopped")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_watchdog_names_a_rank_stopped_in_a_collective(tmp_path):
    out = run_distributed(
        _stopped_in_collective, 4, str(tmp_path), timeout=90, allow_exit=(0, 1, 2, 3)
    )
    assert out == [None] * 4, out
    for r in (0, 1, 2):
        msg, took = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert msg.startswith(f"rank {r}, step 7, call actor_train: peer rank 3 is silent"), msg
        assert took < 30, f"rank {r} named the stopped rank after {took:.1f} s (pg timeout 60 s)"
        print(f"rank {r}: watchdog named rank 3 after {took:.1f} s")


def test_finished_waits_hold_no_references():
    """A watched wait's job (its closure and what it holds: a round's Work objects and tensors)
    is released as soon as it returns, not kept in the helper thread until the next job: kept,
    they outlived destroy_process_group and were freed during interpreter shutdown, which
    aborted train runs at exit ("terminate called without an active exception")."""
    import gc
    import weakref

    from real_py.liveness import wait_watched

    class Held:  # stands in for a gloo Work object the wait closes over
        pass

    held = Held()
    ref = weakref.ref(held)

    def wait(h=held):
        time.sleep(0.01)

    wait_watched(wait, lambda: None, poll=0.005)
    del held, wait
    time.sleep(0.05)  # the helper thread finishes its loop iteration
    gc.collect()
    assert ref() is None, gc.get_referrers(ref()) if ref() is not None else ""


def test_stop_threads_ends_heartbeat_and_watchdog():
    """stop_threads() (called before destroy_process_group and at exit) ends the heartbeat and
    watchdog threads: left running, a daemon thread returning from a store call (C++) during
    interpreter shutdown is ended by pthread_exit and aborts the process ("terminate called
    without an active exception"; 1 of 5 async train runs before, 0 of 16 after). A heartbeat
    started afterwards beats again."""
    import threading

    from real_py import liveness

    class Store:  # the c10d store calls the threads make
        def __init__(self):
            self.kv = {}

        def set(self, k, v):
            self.kv[k] = v.encode()

        def check(self, keys):
            return all(k in self.kv for k in keys)

        def get(self, k):
            return self.kv[k]

    store = Store()
    liveness.start_heartbeat(store, rank=7)
    dog = liveness.Watchdog(store)
    names = lambda: {t.name for t in threading.enumerate()}
    assert {"real_py-heartbeat-7", "real_py-watchdog"} <= names()
    liveness.stop_threads()
    assert not {"real_py-heartbeat-7", "real_py-watchdog"} & names()
    assert store.kv["real_py/heartbeat/7"] == liveness.DONE  # a finished run says so
    watch = liveness.PeerWatch(store, silent_s=0.0)
    assert watch.silent([7]) == [] and [p for p, _ in watch.silent([7])] == [7]
    assert watch.describe(7, 5.0).startswith("has finished its run")
    store.set("real_py/heartbeat/8", "12")  # a counter that stopped moving: silent
    watch.silent([8])
    assert watch.describe(8, 5.0) == "is silent: no heartbeat for 5.0 s (process stopped or hung)"
    del store.kv["real_py/heartbeat/7"]
    time.sleep(2 * liveness.HEARTBEAT_S)
    assert "real_py/heartbeat/7" not in store.kv  # stopped: no beat any more
    liveness.start_heartbeat(store, rank=7)
    deadline = time.monotonic() + 30
    while int(store.kv.get("real_py/heartbeat/7", b"0")) < 2:  # a fresh thread beats again
        assert time.monotonic() < deadline, "no second beat within 30 s after the restart"
        time.sleep(0.05)
    liveness.stop_threads()
    del dog
