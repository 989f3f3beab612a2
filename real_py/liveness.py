"""Finding a silent peer within seconds: a heartbeat per process through the c10d store, and a
wait that watches the peers it depends on.

    store = start_heartbeat()                 # idempotent; the default process group's store
    watch = PeerWatch(store)
    wait_watched(lambda: work.wait(timeout), lambda: watch.raise_if_silent(peers, what))

A stopped (SIGSTOP) or wedged process never fails its sockets: its peers' gloo / NCCL waits
only end at the collective timeout (minutes), and then often blame a healthy rank that was
itself waiting. Every process that waits through here runs a daemon thread that bumps a counter
under `real_py/heartbeat/<global rank>` every HEARTBEAT_S seconds; a waiting rank runs the
blocking wait in a helper thread and meanwhile reads its peers' counters. A peer whose counter
has not moved for SILENT_S seconds (measured on the reader's own monotonic clock, so clock skew
between nodes does not matter) is named in the error. A peer that is merely slow (computing,
blocked on a third rank) keeps beating and is waited for as before.

A wait abandoned this way leaves its helper thread blocked until the op's own timeout ends it;
the process group should be considered broken after such an error (as after any transfer error).

Collectives that are not waited on through here (TP / DP all-reduces inside a call) are covered
by `Watchdog`: a thread that, while the process is inside a named section, ends the process with
a message naming the section and the silent peer.

What a process is doing goes out with its heartbeat, so that a launcher (real_py/launch/job.py) can
name a rank that is stuck in user code long before any transfer times out:

    set_activity("step 3")                    # the driver's coarse state
    with dog.section("rank 0, step 3, call rew_inf", peers): ...    # the call (Watchdog)
    with user_code("the reward function (reward.py:score)"): ...    # user code inside it

Every beat also writes `real_py/job/rank/<global rank>` = JSON {"n": beat counter, "pid",
"doing", "since", "user", "user_since", "done"} into the root store (the TCPStore under the
process group's prefixes), which the launcher of the job hosts. A process that fails writes a
failure record (`record_failure`): JSON into the job's logs folder, where the launcher picks the
root cause among the ranks' records.

One module past 400 lines: the heartbeat thread carries both the counter PeerWatch and the
Watchdog read and the activity record the launcher reads, and they share its private state
(the thread registry and lock, the activity levels); split, each part would reach into the others.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import threading
import time

HEARTBEAT_S = 0.5
"""Seconds between two beats of a process."""
SILENT_S = float(os.environ.get("REAL_PY_SILENT_S", "6"))
"""Seconds without a beat after which a peer counts as stopped (REAL_PY_SILENT_S overrides)."""
POLL_S = 0.1
"""Seconds between two checks of a waiting rank."""
ACTIVITY_S = 0.1
"""Seconds between two looks of the heartbeat thread at this process's activity (set_activity,
Watchdog sections, user_code): a change goes out with the next look, not the next beat."""

_PREFIX = "real_py/heartbeat/"
_started: dict[int, threading.Thread] = {}
_lock = threading.RLock()
_running: list[tuple[threading.Thread, threading.Event]] = []
"""Heartbeat and watchdog threads with their stop events (stop_threads)."""


def _spawn(target, name: str) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    th = threading.Thread(target=target, args=(stop,), name=name, daemon=True)
    with _lock:  # registered before it runs, so a concurrent stop_threads cannot miss it
        _running.append((th, stop))
        th.start()
    return th, stop


def stop_threads(timeout: float = 5.0) -> None:
    """Stop every heartbeat and watchdog thread of this process and wait for them; runs at
    exit too. Why: at interpreter shutdown CPython ends a daemon thread that wants the GIL back
    with pthread_exit, and when that thread is returning from a store call (C++ via pybind11)
    the forced unwind aborts the process ("terminate called without an active exception",
    SIGABRT after a finished run). Call it before destroy_process_group; a later
    start_heartbeat / Watchdog starts fresh threads."""
    with _lock:
        running, _running[:] = list(_running), []
        _started.clear()
    for _, stop in running:
        stop.set()
    for th, _ in running:
        if th is not threading.current_thread():
            th.join(timeout)


atexit.register(stop_threads)


def default_store():
    """The default process group's store, or None (no process group, or a backend without one)."""
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


JOB_KEY = "real_py/job/rank/"
"""Root-store key prefix of a process's heartbeat-and-activity record (JOB_KEY + global rank)."""

_doing: dict = {
    "base": None,
    "section": None,
    "user": None,
    "failed_in": None,
    "failed_user": None,
    "version": 0,
}
"""What this process does: (label, since wall time) per level; the section and user code it was
in when an exception left them (the first such, for its failure record)."""


def _set(level: str, value) -> None:
    _doing[level] = value
    _doing["version"] += 1


def set_activity(what: str | None) -> None:
    """The driver's coarse state ("starting", "step 3", "saving checkpoint step_3", ...)."""
    _set("base", (what, time.time()) if what else None)


@contextlib.contextmanager
def user_code(what: str):
    """Marks a call into user code ("the reward function (reward.py:score)"): the launcher warns
    about a rank that stays inside long, and names it if the job then fails."""
    prev = _doing["user"]
    _set("user", (what, time.time()))
    try:
        yield
    except BaseException:
        if _doing["failed_user"] is None:
            _doing["failed_user"] = what
        raise
    finally:
        _set("user", prev)


def activity() -> dict:
    """This process's state: doing (section, else the driver's label), since, user, user_since."""
    base, sec, user = _doing["base"], _doing["section"], _doing["user"]
    cur = sec or base
    return {
        "doing": cur[0] if cur else None,
        "since": cur[1] if cur else None,
        "user": user[0] if user else None,
        "user_since": user[1] if user else None,
    }


def failed_in() -> tuple[str | None, str | None]:
    """(section, user code) an exception left first in this process, or Nones."""
    return _doing["failed_in"], _doing["failed_user"]


def root_store(store):
    """The store under a process group's PrefixStores (the TCPStore a launcher hosts)."""
    try:
        import torch.distributed as dist

        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
    except (ImportError, AttributeError):
        pass
    return store


_logs: dict = {"dir": None, "rank": None}


def set_job_logs(logs_dir: str | None, rank: int) -> None:
    """Where record_failure writes this process's failure record (the job's logs folder)."""
    _logs["dir"], _logs["rank"] = logs_dir, rank


def record_failure(rec: dict) -> str | None:
    """Write `rec` (rank, step, call, exception, message, time, ...) as failed_rank<r>.json into
    the job's logs folder (set_job_logs), once per process; returns the path or None."""
    d, r = _logs["dir"], _logs["rank"]
    if d is None or _logs.get("written"):
        return None
    _logs["written"] = True
    path = os.path.join(d, f"failed_rank{r}.json")
    try:
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f, default=str)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def start_heartbeat(store=None, rank: int | None = None):
    """Start this process's heartbeat thread on `store` (default: the default store) unless it
    runs already; returns the store (None: no store, nothing started)."""
    store = store if store is not None else default_store()
    if store is None:
        return None
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank()
    with _lock:
        th = _started.get(id(store))
        if th is not None and th.is_alive():
            return store
        key, job_key, root = f"{_PREFIX}{rank}", f"{JOB_KEY}{rank}", root_store(store)
        pid = os.getpid()

        def publish(n, done=False):
            root.set(job_key, json.dumps({"n": n, "pid": pid, "done": done, **activity()}))

        def beat(stop):
            n, next_beat, seen = 0, 0.0, None
            while not stop.is_set():
                try:
                    if time.monotonic() >= next_beat:
                        n += 1
                        next_beat = time.monotonic() + HEARTBEAT_S
                        store.set(key, str(n))
                        seen = None
                    if _doing["version"] != seen:  # a new activity goes out within ACTIVITY_S
                        seen = _doing["version"]
                        publish(n)
                except Exception:
                    return
                stop.wait(ACTIVITY_S)
            try:  # stopped on purpose (stop_threads): peers still waiting learn it finished
                store.set(key, DONE.decode())
                publish(n, done=True)
            except Exception:
                pass

        _started[id(store)] = _spawn(beat, f"real_py-heartbeat-{rank}")[0]
    return store


def stop_heartbeat(store, timeout: float = 5.0) -> None:
    """Stop the heartbeat beating on `store` (a transfer group closed while the process lives
    on, as a vLLM worker after its trainer left); nothing if none does."""
    with _lock:
        th = _started.pop(id(store), None)
        hit = [x for x in _running if x[0] is th]
        _running[:] = [x for x in _running if x[0] is not th]
    for t, stop in hit:
        stop.set()
        t.join(timeout)


DONE = b"done"
"""A heartbeat's last value when its process stopped it on purpose (a finished run)."""


class SilentPeer(RuntimeError):
    """A peer's heartbeat stopped; the message names it and how long it has been silent."""


class PeerWatch:
    """Reads peers' heartbeat counters; a counter unchanged for `silent_s` seconds is silent."""

    def __init__(self, store, silent_s: float = SILENT_S):
        self.store, self.silent_s = store, float(silent_s)
        self._seen: dict[int, tuple[bytes, float]] = {}  # global rank -> (counter, when it moved)

    def silent(self, peers) -> list[tuple[int, float]]:
        """(global rank, seconds without a beat) of the `peers` that are silent. A peer that has
        never beaten is not judged (it may not have started its heartbeat yet)."""
        out, now = [], time.monotonic()
        for p in peers:
            key = f"{_PREFIX}{p}"
            try:
                if not self.store.check([key]):
                    continue
                value = self.store.get(key)
            except Exception:
                continue
            old = self._seen.get(p)
            if old is None or old[0] != value:
                self._seen[p] = (value, now)
            elif now - old[1] >= self.silent_s:
                out.append((p, now - old[1]))
        return out

    def describe(self, peer: int, secs: float) -> str:
        """What a silent peer's heartbeat says, for messages after "peer rank N": it ended its
        run (stopped its heartbeat on purpose: the ranks' schedules differ), or it stopped."""
        seen = self._seen.get(peer)
        if seen is not None and seen[0] == DONE:
            return (
                f"has finished its run (its heartbeat ended cleanly {secs:.1f} s ago) while this "
                "rank still waits on it"
            )
        return f"is silent: no heartbeat for {secs:.1f} s (process stopped or hung)"


class _Waiter:
    """A long-lived helper thread that runs blocking waits handed to it (starting a thread per
    wait costs ~0.3 ms, a hand-off to a running one ~0.01 ms: rounds are many and short)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="real_py-wait", daemon=True).start()

    def _loop(self):
        while True:
            wait, result = self.jobs.get()
            try:
                wait()
                result.put(None)
            except BaseException as e:
                result.put(e)
            # Drop the finished job now: its closure holds the round's gloo / NCCL Work objects
            # (and their tensors). Kept in this daemon thread's frame until the next job, they
            # outlived destroy_process_group and were freed during interpreter shutdown, which
            # aborted the process ("terminate called without an active exception", SIGABRT).
            del wait, result


_idle: list[_Waiter] = []

EXIT_SILENT_PEER = 75
"""Exit code of a process whose Watchdog found a silent peer (EX_TEMPFAIL)."""


class Watchdog:
    """Names a stopped peer while this process may be blocked in a collective it cannot watch
    op by op (TP / DP all-reduces inside a call, the end-of-step all-reduce: wrapping each of
    those in a helper-thread wait would tax every layer of every step).

        dog = Watchdog(store)
        with dog.section("rank 0, step 3, call actor_train", peers=[0, 1, 2, 3]):
            ...                                   # collectives

    A daemon thread reads the peers' heartbeats every HEARTBEAT_S; inside a section, a peer
    silent for `silent_s` seconds is fatal: the process cannot get out of a blocked gloo / NCCL
    wait by itself, so (as torch's NCCL heartbeat monitor does) `on_silent(message)` runs, by
    default printing the message (section, silent peer, seconds) to stderr, filing it with the
    store and exiting with EXIT_SILENT_PEER. The default threshold is SILENT_S + 3 s, so waits
    that watch their peers themselves (DistTransport rounds, row pushes) raise their own, more
    precise error first."""

    def __init__(self, store, silent_s: float | None = None, on_silent=None):
        self.watch = PeerWatch(store, SILENT_S + 3.0 if silent_s is None else silent_s)
        self.store = store
        self.on_silent = on_silent or self._exit
        self._section: tuple[str, tuple[int, ...]] | None = None
        self._fired = False
        _spawn(self._loop, "real_py-watchdog")

    def section(self, what: str, peers):
        dog = self

        class _Section:
            def __enter__(self):
                dog._section = (what, tuple(int(p) for p in peers))
                _set("section", (what, time.time()))

            def __exit__(self, typ, *exc):
                dog._section = None
                if typ is not None and _doing["failed_in"] is None:
                    _doing["failed_in"] = what
                _set("section", None)
                return False

        return _Section()

    def _loop(self, stop):
        while not self._fired and not stop.wait(HEARTBEAT_S):
            cur = self._section
            if cur is None:
                continue
            silent = self.watch.silent(cur[1])
            if silent and self._section is cur:
                p, secs = silent[0]
                self._fired = True
                self.on_silent(
                    f"{cur[0]}: peer rank {p} {self.watch.describe(p, secs)}; a blocked "
                    "collective cannot be given up, so this process exits"
                )

    def _exit(self, message: str) -> None:
        import sys

        print(f"real_py watchdog: {message}", file=sys.stderr, flush=True)
        try:
            n = self.store.add("real_py/watchdog/n", 1)
            self.store.set(f"real_py/watchdog/{n}", message[:2000])
        except Exception:
            pass
        sec = self._section
        record_failure(
            {
                "rank": _logs["rank"],
                "pid": os.getpid(),
                "time": time.time(),
                "where": sec[0] if sec else None,
                "exception": "SilentPeer",
                "message": message[:2000],
                "consequent": True,
            }
        )
        os._exit(EXIT_SILENT_PEER)


def wait_watched(wait, check, poll: float = POLL_S) -> None:
    """Run the blocking `wait()` in a helper thread; every `poll` seconds until it returns, call
    `check()`, which raises to give up the wait. Re-raises what `wait()` raised. A helper whose
    wait was given up stays blocked in it (until the op's own timeout) and is not reused."""
    with _lock:
        waiter = _idle.pop() if _idle else None
    waiter = waiter or _Waiter()
    result: queue.SimpleQueue = queue.SimpleQueue()
    waiter.jobs.put((wait, result))
    while True:
        try:
            err = result.get(timeout=poll)
            break
        except queue.Empty:
            check()  # raising here abandons `waiter`
    with _lock:
        _idle.append(waiter)
    if err is not None:
        raise err


__all__ = [
    "start_heartbeat",
    "stop_threads",
    "PeerWatch",
    "SilentPeer",
    "Watchdog",
    "wait_watched",
    "default_store",
    "root_store",
    "set_activity",
    "user_code",
    "activity",
    "failed_in",
    "set_job_logs",
    "record_failure",
    "HEARTBEAT_S",
    "SILENT_S",
    "EXIT_SILENT_PEER",
    "JOB_KEY",
]
