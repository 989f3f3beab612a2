"""One `train` job on this node as one unit, the launcher's side: torchrun's launcher starts the
ranks, and the launcher process holds the run directory, watches the ranks, and ends them
together.

    fd = lock.lock_out_dir(out_dir)     # refuses a directory another job writes
                                        # (real_py/launch/lock.py)
    code = launch(world, out_dir, target, fork=True)
    lock.unlock()                       # after the job (the ranks hold the lock until they exit)

Ranks. `launch` runs torchrun's elastic agent in this process, through the library call the
torchrun command itself makes (torch.distributed.launcher.api.elastic_launch: one node, a
one-node rendezvous whose TCPStore listens on 127.0.0.1 only with a port the kernel picks
(agent.py), no restarts, the workers polled every 0.1 s). The agent hosts that TCPStore, which
the ranks use as their store
(TORCHELASTIC_USE_AGENT_STORE: env:// makes every rank a client), and starts the ranks with
RANK, WORLD_SIZE, MASTER_ADDR, ... in their environment. With `fork` (CPU jobs) the agent's
start method is "fork": rank r is a fork of this process, with torch, the package and the
config validated here already loaded, and calls `target()`; otherwise it is "spawn" (CUDA jobs:
CUDA must not be initialized before a fork), and `target` is pickled to a fresh interpreter. The
ranks are children of this process (in its process group: a kill of the group reaches them) and
hold the run directory's lock with it. What runs inside a rank (death with the launcher, its
failure record) is real_py/launch/rank.py.

Output. Each rank's stdout and stderr go through pipes (inherited, or handed over at spawn) to
a watcher thread of the launcher, into <out_dir>/logs/rank<r>.log; rank 0's stdout (step lines,
progress bar) is also shown. The agent's own log goes to logs/torchrun.log. A rank that fails
writes logs/failed_rank<r>.json with its full traceback in its log, then waits to be ended. The
watcher ends the job at the first failure record or rank death (after FAIL_GRACE_S for the
other ranks' records, then SIGKILL of every rank: a stopped rank cannot act on SIGTERM; each
rank tells the watcher its pid when it starts, and logs/job.json lists them); the agent then
sees its workers gone, and instead of its ChildFailedError the launcher prints one line: the
root cause and the log with the full trace (real_py/launch/report.py). Ctrl-C (SIGINT, SIGTERM,
SIGHUP) ends the ranks and prints one line. While the job runs, a rank inside user code (the
reward function, data loading) for USER_WARN_S seconds or more is named on stderr.

One file past 400 lines: nearly all of it is _Job, whose agent-side run, watcher thread, pipe pump,
signal handlers and _kill_all share one job's _Rank records, pipes, store client and lock; split,
each part would reach into that shared state.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from . import lock as _lock
from .agent import agent_log, launch_config, start_tracker
from .rank import Fd, Plumbing, fd_key, rank_entry
from .report import SIG_EXIT, doing, proc_state, report

WATCH_JOIN_S = 15.0
"""Seconds the launcher waits for its watcher thread at the end of the job."""
RANKS_GONE_S = 10.0
"""Seconds the launcher waits for killed ranks to be gone before it releases the run directory."""
FAIL_GRACE_S = 1.0
"""Seconds the launcher gives the other ranks to write their records after the first failure."""
USER_WARN_S = float(os.environ.get("REAL_PY_USER_WARN_S", "10"))
"""Seconds inside user code after which the launcher names the rank (then at 2x, 4x, ...)."""


def can_fork(device: str) -> bool:
    """Whether the agent may fork the ranks from this process: a CPU job, CUDA never initialized
    here. REAL_PY_LAUNCH=spawn (or exec) forces fresh interpreters."""
    import torch

    if os.environ.get("REAL_PY_LAUNCH", "fork") in ("spawn", "exec") or not hasattr(os, "fork"):
        return False
    if torch.cuda.is_initialized():
        return False
    return device == "cpu" or (
        device == "auto" and torch.version.cuda is None and torch.version.hip is None
    )


def launch(
    nproc: int, out_dir: str, target, *, fork: bool = True, what: str = "gloo processes"
) -> int:
    """Run the job's `nproc` local ranks, each calling `target()` (picklable unless `fork`),
    under torchrun's elastic agent in this process, and return the job's exit code (0, 1 failed,
    128+signal interrupted). Call with out_dir's lock held (lock_out_dir)."""
    job = _Job(nproc, out_dir, target, fork)
    mode = "forked from this process" if fork else "each a new python"
    print(
        f"launching {nproc} local {what} under torchrun's elastic agent ({mode}); "
        f"logs in {job.logs}",
        flush=True,
    )
    return job.run()


@dataclass(kw_only=True, slots=True, eq=False)
class _Rank:
    """One rank of the job as the launcher sees it; the watcher thread and the agent's side fill
    it in (under _Job.lock where both may). Compared by identity: one record per process."""

    rank: int
    """Its local rank (on one node also its global rank)."""
    pid: int | None = None
    """Its pid, as it told the watcher when it started (None: not started, or died before)."""
    pidfd: int | None = None
    """The launcher's pidfd of it: watched for its end, signalled instead of the pid."""
    log_fd: int | None = None
    """The launcher's fd of logs/rank<r>.log."""
    exit_code: int | None = None
    """Its exit status (negative: the signal that killed it); None while unknown."""
    ended_at: float | None = None
    """time.time() when the watcher saw it end (None: not seen)."""
    heartbeat: dict | None = None
    """Its last heartbeat-and-activity record from the store (liveness.JOB_KEY: "doing",
    "user", "user_since", "n", "done")."""
    beat_count: int | None = None
    """The record's beat counter ("n") when it last changed."""
    beat_changed_at: float = field(default_factory=time.monotonic)
    """time.monotonic() when the beat counter last changed."""
    silent_for: float | None = None
    """Seconds without a beat when the watcher named it silent (None: not silent)."""
    user_warn_at: dict = field(default_factory=dict)
    """user_since of a stay in user code -> seconds inside it at which it is named next."""
    killed: bool = False
    """SIGKILLed by the launcher."""
    state_at_kill: str | None = None
    """Its process state letter (/proc) just before the launcher's SIGKILL ("T": stopped)."""
    output_tail: bytes = b""
    """The last 4 KiB of its stdout and stderr (its last line goes into the report)."""
    reaped: bool = False
    """Gone (reaped by the agent) when it told its pid: never signalled by that pid."""


class _Job:
    """The launcher's side of one job: its ranks (_Rank), the pipes it reads, the store it reads
    heartbeats from, and how the job is ending. The agent's thread (run) and the watcher thread
    (_watch) share it; _kill_all holds `lock`."""

    def __init__(self, nproc, out_dir, target, fork):
        self.num_ranks, self.out_dir, self.target, self.fork = nproc, out_dir, target, fork
        self.logs = os.path.join(out_dir, "logs")
        """The logs folder, <out_dir>/logs."""
        self.ranks = [_Rank(rank=r) for r in range(nproc)]
        self.store = None
        """A client of the job's TCPStore once every rank started (heartbeats), or None."""
        self.store_port: int | None = None
        self.output_pipes: dict[int, tuple[_Rank, bool]] = {}
        """Read end of a rank's stdout or stderr pipe -> (the rank, shown on the console too)."""
        self.hello_pipes: dict[int, _Rank] = {}
        """Read end of a rank's hello pipe ("<pid> <store port>" when it starts) -> the rank."""
        self.rank_pipe_ends: list[int] = []
        """The ranks' ends of the pipes and the go pipe's write end: closed here once all
        started."""
        self.go_fd: int | None = None
        """The go pipe's read end (forked ranks only; see _pipes)."""
        self.failure_records: dict[int, dict] = {}
        """Rank -> its failure record (logs/failed_rank<r>.json)."""
        self.first_failure_at: float | None = None
        """time.monotonic() of the first failure seen (None: none yet)."""
        self.ended_by_signal: int | None = None
        """The signal that ended the job (Ctrl-C, SIGTERM, SIGHUP, the agent's SIGQUIT), or None."""
        self.agent_returned = threading.Event()
        """Set when torchrun's agent has returned."""
        self.ranks_ended = threading.Event()
        """Set when the watcher has ended the ranks (or they all ended)."""
        self.lock = threading.RLock()
        self.alive_after_end: list[int] = []
        """Pids of ranks still alive after the end (see _wait_ranks_gone)."""

    # -------------------------------------------------------------- start

    def _fresh_logs(self) -> None:
        """The logs folder holds this job's logs: the previous job's go (a link is refused)."""
        if os.path.islink(self.logs):
            raise ValueError(
                f"{self.logs} is a symbolic link; a run writes its logs itself: remove it"
            )
        os.makedirs(self.logs, exist_ok=True)
        for name in os.listdir(self.logs):
            if re.fullmatch(
                r"(rank\d+\.log|failed_rank\d+\.json(\..*\.tmp)?|job\.json|torchrun\.log|"
                r"error_rank\d+\.json)",
                name,
            ):
                os.unlink(os.path.join(self.logs, name))

    def _open_log(self, r: int) -> int:
        return os.open(
            os.path.join(self.logs, f"rank{r}.log"),
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
        )

    def _pipes(self) -> Plumbing:
        out, err, hello = [], [], []
        for rk in self.ranks:
            rk.log_fd = self._open_log(rk.rank)
            for kind, console in ((out, rk.rank == 0), (err, False), (hello, None)):
                r, w = os.pipe()  # not inheritable: a fork keeps it, a spawn passes it (Fd)
                if console is None:
                    self.hello_pipes[r] = rk
                else:
                    self.output_pipes[r] = (rk, console)
                self.rank_pipe_ends.append(w)
                kind.append(Fd(w))
        lock = _lock.held_fd()
        lock = Fd(lock) if lock is not None else None
        if not self.fork:
            return Plumbing(
                stdout=out,
                stderr=err,
                hello=hello,
                lock=lock,
                logs=self.logs,
                launcher_pid=os.getpid(),
            )
        # The go pipe of forked ranks: its end (the launcher closes the write end once every rank
        # said hello) starts the job in every rank (rank._after_start).
        self.go_fd, go_w = os.pipe()
        self.rank_pipe_ends.append(go_w)
        own = [
            fd_key(fd)
            for fd in list(self.output_pipes)
            + list(self.hello_pipes)
            + [rk.log_fd for rk in self.ranks]
            + [go_w]
        ]
        return Plumbing(
            stdout=out,
            stderr=err,
            hello=hello,
            lock=lock,
            logs=self.logs,
            launcher_pid=os.getpid(),
            private=own,
            go=Fd(self.go_fd),
        )

    def run(self) -> int:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        self._fresh_logs()
        undo_log = agent_log(self.logs)
        handlers = {}
        try:
            for s in SIG_EXIT:
                handlers[s] = signal.signal(s, self._on_signal)
        except ValueError:  # not the main thread (tests)
            handlers = {}
        sys.stdout.flush()
        sys.stderr.flush()
        watcher = None
        failed = {}
        try:
            plumbing = self._pipes()
            config = launch_config(self.num_ranks, self.logs, self.fork)
            if not self.fork:
                start_tracker(self.logs)
            watcher = threading.Thread(target=self._watch, name="real_py-job-watch", daemon=True)
            watcher.start()
            try:
                elastic_launch(config, rank_entry)(plumbing, self.target)
                for rk in self.ranks:  # every rank returned 0 to the agent
                    rk.exit_code = 0 if rk.exit_code is None else rk.exit_code
            except ChildFailedError as e:
                failed = e.failures
            except SignalException as e:  # a signal the agent handles (SIGQUIT)
                self.ended_by_signal = self.ended_by_signal or e.sigval
        finally:
            self.agent_returned.set()
            if watcher is not None:
                watcher.join(WATCH_JOIN_S)
                if watcher.is_alive():
                    print(
                        f"real_py: the job's watcher did not stop within {WATCH_JOIN_S:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
            self._kill_all()
            self._wait_ranks_gone(RANKS_GONE_S)
            self._drain(1.0)
            for fd in self.rank_pipe_ends:
                os.close(fd)
            self.rank_pipe_ends.clear()
            go = [self.go_fd] if self.go_fd is not None else []
            for fd in list(self.output_pipes) + list(self.hello_pipes) + go:
                os.close(fd)
            self.go_fd = None
            self.output_pipes.clear()
            self.hello_pipes.clear()
            for rk in self.ranks:
                if rk.log_fd is not None:
                    os.close(rk.log_fd)
                if rk.pidfd is not None:
                    os.close(rk.pidfd)
            for s, h in handlers.items():
                signal.signal(s, h)
            undo_log()
        self._agent_failures(failed)
        return report(self)

    def _agent_failures(self, failures: dict) -> None:
        """The worker the agent found failed first (it then stops the others with SIGTERM): its
        exit code where the watcher did not see it (the agent reaped it first). Its end time stays
        as the watcher saw it, or unknown (it died before telling its pid): report.cause then
        takes it as the first death, not a rank the agent's SIGTERM ended after it."""
        for f in failures.values():
            rk = self.ranks[f.local_rank] if 0 <= f.local_rank < self.num_ranks else None
            if rk is not None and rk.exit_code is None:
                rk.exit_code = f.exitcode

    def _wait_ranks_gone(self, timeout: float) -> None:
        """Wait until every started rank has exited (its pidfd readable), so that the run
        directory's lock is released only when no rank can write any more; a rank still alive
        after `timeout` (uninterruptible sleep) keeps the lock file in place (see `unlock`)."""
        import select

        deadline = time.monotonic() + timeout
        for rk in self.ranks:
            if rk.pidfd is None:
                continue
            left = deadline - time.monotonic()
            ready, _, _ = select.select([rk.pidfd], [], [], max(left, 0.0))
            if not ready:
                self.alive_after_end.append(rk.pid)
        if self.alive_after_end:
            print(
                f"real_py: ranks with pids {self.alive_after_end} are still alive "
                f"{timeout:.0f} s after being killed; "
                f"the lock on the run directory stays until they are gone",
                file=sys.stderr,
                flush=True,
            )
            _lock.keep_file()

    def _on_signal(self, signum, frame) -> None:
        if self.ended_by_signal is None:
            self.ended_by_signal = signum
        self._kill_all(stacks=False)

    # -------------------------------------------------------------- watch

    def _watch(self) -> None:
        """The watcher thread (see _watch_loop). An error inside it ends the job with one line
        instead of leaving the ranks' pipes undrained (a rank would block in print)."""
        try:
            self._watch_loop()
        except BaseException as e:
            print(
                f"real_py: the job's watcher failed ({type(e).__name__}: {e}); ending the job",
                file=sys.stderr,
                flush=True,
            )
            self.ended_by_signal = self.ended_by_signal or signal.SIGTERM
            self._kill_all(stacks=False)
            self._drain(2.0)

    def _watch_loop(self) -> None:
        """The ranks' output into their logs, their pids, their ends, the failure records and
        heartbeats; ends the job on a failure."""
        import selectors

        sel = selectors.DefaultSelector()
        for fd in list(self.output_pipes) + list(self.hello_pipes):
            sel.register(fd, selectors.EVENT_READ)
        next_poll = 0.0
        while True:
            for key, _ in sel.select(timeout=0.1):
                if key.fd in self.hello_pipes:
                    self._hello(key.fd, sel)
                elif key.fd in self.output_pipes:
                    if not self._pump(key.fd):
                        sel.unregister(key.fd)
                else:  # a rank's pidfd: it ended
                    sel.unregister(key.fd)
                    self._exited(key.data)
            if self.agent_returned.is_set():
                self._poll()
                return
            now = time.monotonic()
            if self.ended_by_signal is not None:
                self._kill_all(stacks=False)
                continue
            if now >= next_poll:
                next_poll = now + 0.25
                self._poll()
            if self.ranks_ended.is_set():
                continue
            # An exit whose status the agent reaped first (code unknown) is no failure by itself:
            # ranks that return 0 are reaped at once, and a failed one the agent reports.
            if self.first_failure_at is None and (
                self.failure_records or any(rk.exit_code not in (None, 0) for rk in self.ranks)
            ):
                self.first_failure_at = now
            if self.first_failure_at is not None and now - self.first_failure_at >= FAIL_GRACE_S:
                self._poll()
                self._kill_all()

    def _hello(self, fd: int, sel) -> None:
        """A rank started: "<pid> <store port>" (nothing when its pipe fails). Once all have,
        job.json lists them, the launcher's copies of the ranks' pipe ends and of the go pipe's
        write end are closed (every forked rank then runs the job) and the store is read. A rank
        that dies before its hello leaves its pipe open here (this holds the write end): the agent
        sees it gone and stops the job."""
        rk = self.hello_pipes.pop(fd)
        sel.unregister(fd)
        try:
            data = os.read(fd, 256).decode().split()
        except OSError:
            data = []
        os.close(fd)
        if len(data) == 2:
            self._started(rk, int(data[0]), sel)
            self.store_port = int(data[1])
        if self.hello_pipes:
            return
        try:
            with open(os.path.join(self.logs, "job.json"), "w") as f:
                json.dump(
                    {
                        "launcher": os.getpid(),
                        "ranks": [x.pid for x in self.ranks],
                        "start_method": "fork" if self.fork else "spawn",
                        "store_port": self.store_port,
                    },
                    f,
                )
        except OSError:  # a full disk: the job runs without it
            pass
        for w in self.rank_pipe_ends:
            os.close(w)
        self.rank_pipe_ends.clear()
        if self.store_port is None:
            return
        try:
            import datetime

            import torch.distributed as dist

            self.store = dist.TCPStore(
                "127.0.0.1",
                self.store_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=10),
            )
        except Exception:
            self.store = None

    def _started(self, rk: _Rank, pid: int, sel) -> None:
        """Rank `rk` told its pid: a pidfd of it (watched for its end), unless the agent reaped it
        already; ended at once when the job is ending."""
        import selectors

        with self.lock:
            rk.pid = pid
            try:
                rk.pidfd = os.pidfd_open(rk.pid)
            except ProcessLookupError:
                rk.reaped = True
            except (OSError, AttributeError):
                rk.pidfd = None
            if rk.pidfd is not None and _parent(rk.pid) != os.getpid():
                # Reaped by the agent before the pidfd was taken, its pid another process's now.
                os.close(rk.pidfd)
                rk.pidfd, rk.reaped = None, True
            if rk.pidfd is not None:
                sel.register(rk.pidfd, selectors.EVENT_READ, rk)
        if self.ended_by_signal is not None or self.ranks_ended.is_set():
            self._kill_all(stacks=False)

    def _exited(self, rk: _Rank) -> None:
        """A rank's process ended: its exit status while the agent has not reaped it yet."""
        rk.ended_at = rk.ended_at or time.time()
        try:
            info = os.waitid(os.P_PID, rk.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, OSError):
            info = None
        if info is not None and info.si_pid == rk.pid:
            rk.exit_code = (
                -info.si_status
                if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
                else info.si_status
            )
        elif rk.exit_code is None:
            rk.exit_code = -1 if rk.killed else None

    def _pump(self, fd: int) -> bool:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        rk, console = self.output_pipes[fd]
        if not data:
            os.close(fd)
            del self.output_pipes[fd]
            return False
        try:
            os.write(rk.log_fd, data)
        except OSError:  # a full disk: keep draining (the tail below still names the cause)
            pass
        rk.output_tail = (rk.output_tail + data)[-4096:]
        if console:
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            except Exception:
                pass
        return True

    def _drain(self, secs: float) -> None:
        """Read what the ended ranks left in their pipes (a rank's own child may hold a pipe
        open: give up after `secs`)."""
        import select

        end = time.monotonic() + secs
        while self.output_pipes and time.monotonic() < end:
            ready, _, _ = select.select(list(self.output_pipes), [], [], 0.05)
            for fd in ready:
                self._pump(fd)

    def _kill_all(self, stacks: bool = True) -> None:
        """SIGKILL every rank still running (first, after a failure, their Python stacks into
        their logs: where a rank stuck in user code hangs)."""
        with self.lock:
            live = [
                rk
                for rk in self.ranks
                if rk.pid is not None and not rk.killed and rk.exit_code is None
            ]
            if not live:
                return
            if stacks and self.first_failure_at is not None and self.ended_by_signal is None:
                # faulthandler on SIGUSR1 (run_rank). A stopped rank cannot answer.
                for rk in live:
                    try:
                        if rk.pidfd is not None:
                            signal.pidfd_send_signal(rk.pidfd, signal.SIGUSR1)
                        elif not rk.reaped:
                            os.kill(rk.pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                self._drain(0.3)
            for rk in live:
                rk.state_at_kill = proc_state(rk.pid)
                try:  # through its pidfd: never another process that took a reaped rank's pid
                    if rk.pidfd is not None:
                        signal.pidfd_send_signal(rk.pidfd, signal.SIGKILL)
                    elif not rk.reaped:  # no pidfds here: by its pid
                        os.kill(rk.pid, signal.SIGKILL)
                    else:
                        continue
                    rk.killed = True
                except ProcessLookupError:
                    pass
            self.ranks_ended.set()

    def _poll(self) -> None:
        """Failure records from the logs folder; each rank's heartbeat and activity from the
        store; warnings for a rank long inside user code."""
        for rk in self.ranks:
            if rk.rank not in self.failure_records:
                path = os.path.join(self.logs, f"failed_rank{rk.rank}.json")
                try:
                    with open(path) as f:
                        self.failure_records[rk.rank] = json.load(f)
                except (OSError, ValueError):
                    pass
        if self.store is None:
            return
        from ..liveness import JOB_KEY, SILENT_S

        now = time.monotonic()
        for rk in self.ranks:
            if rk.exit_code is not None or rk.killed:
                continue
            key = f"{JOB_KEY}{rk.rank}"
            try:
                if not self.store.check([key]):
                    continue
                st = json.loads(self.store.get(key))
            except Exception:
                continue
            if st.get("n") != rk.beat_count:
                rk.beat_count, rk.beat_changed_at, rk.silent_for = st.get("n"), now, None
            rk.heartbeat = st
            if (
                now - rk.beat_changed_at >= SILENT_S
                and rk.silent_for is None
                and not st.get("done")
            ):
                rk.silent_for = now - rk.beat_changed_at
                ps = proc_state(rk.pid)
                print(
                    f"real_py: rank {rk.rank} is silent: no heartbeat for {rk.silent_for:.0f} s"
                    f"{' (process stopped)' if ps == 'T' else ''}; {doing(st)}",
                    file=sys.stderr,
                    flush=True,
                )
            if st.get("user"):
                secs = time.time() - st["user_since"]
                nxt = rk.user_warn_at.get(st["user_since"], USER_WARN_S)
                if secs >= nxt:
                    rk.user_warn_at[st["user_since"]] = nxt * 2
                    print(
                        f"real_py: rank {rk.rank} has been inside {st['user']} for {secs:.0f} s "
                        f"({doing(st, user=False)})",
                        file=sys.stderr,
                        flush=True,
                    )


def _parent(pid: int) -> int | None:
    """The parent pid of process `pid` (/proc/<pid>/stat), or None (gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


__all__ = ["can_fork", "launch", "FAIL_GRACE_S", "USER_WARN_S"]
