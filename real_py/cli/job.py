"""One `train` job on this node as one unit: torchrun's launcher starts the ranks, and the
launcher process holds the run directory, watches the ranks, and ends them together.

    fd = lock_out_dir(out_dir)          # refuses a directory another job writes, naming its pid
    code = launch(world, out_dir, target, fork=True)
    unlock()                             # after the job (the ranks hold the lock until they exit)

Ranks. `launch` runs torchrun's elastic agent in this process, through the library call the
torchrun command itself makes (torch.distributed.launcher.api.elastic_launch: one node, c10d
rendezvous on 127.0.0.1 with a port the kernel picks, no restarts, the workers polled every
0.1 s). The agent hosts the rendezvous TCPStore, which the ranks use as their store
(TORCHELASTIC_USE_AGENT_STORE: env:// makes every rank a client), and starts the ranks with
RANK, WORLD_SIZE, MASTER_ADDR, ... in their environment. With `fork` (CPU jobs) the agent's
start method is "fork": rank r is a fork of this process, with torch, the package and the
config validated here already loaded, and calls `target()`; otherwise it is "spawn" (CUDA jobs:
CUDA must not be initialized before a fork), and `target` is pickled to a fresh interpreter. The
ranks are children of this process (in its process group: a kill of the group reaches them) and
hold the run directory's lock with it. A rank dies with its launcher: PR_SET_PDEATHSIG
(SIGKILL), and a thread that waits on a pidfd of the launcher; a rank never writes after its
launcher is gone.

Output. Each rank's stdout and stderr go through pipes (inherited, or handed over at spawn) to
a watcher thread of the launcher, into <out_dir>/logs/rank<r>.log; rank 0's stdout (step lines,
progress bar) is also shown. The agent's own log goes to logs/torchrun.log. A rank that fails
writes logs/failed_rank<r>.json (rank, where, exception, message, time: real_py/liveness.py
record_failure) with its full traceback in its log, then waits to be ended. The watcher ends
the job at the first failure record or rank death (after FAIL_GRACE_S for the other ranks'
records, then SIGKILL of every rank: a stopped rank cannot act on SIGTERM; each rank tells the
watcher its pid when it starts, and logs/job.json lists them); the agent then sees its workers
gone, and instead of its ChildFailedError the launcher prints one line: the root cause (an
error raised by the job's own code before a peer's consequent transfer error, a rank that died,
a rank named silent, a rank stuck in user code), and the log with the full trace. Ctrl-C
(SIGINT, SIGTERM, SIGHUP) ends the ranks and prints one line. While the job runs, a rank inside
user code (the reward function, data loading) for USER_WARN_S seconds or more is named on
stderr.

Under an outside torchrun (several nodes) there is no launcher: rank 0 holds the lock, each
rank watches its parent (the torchrun agent) and ends when it is gone, and a failing rank writes
its failure record and one line after its traceback.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import sys
import threading
import time

LOCK_NAME = ".real_py.lock"
"""The lock file in out_dir: flock'ed by the job writing the directory, holding its pid."""
LOCK_WAIT_S = 20.0
"""Seconds a new job waits for a lock whose launcher is gone (its ranks are exiting)."""
WATCH_JOIN_S = 15.0
"""Seconds the launcher waits for its watcher thread at the end of the job."""
RANKS_GONE_S = 10.0
"""Seconds the launcher waits for killed ranks to be gone before it releases the run directory."""
FAIL_GRACE_S = 1.0
"""Seconds the launcher gives the other ranks to write their records after the first failure."""
USER_WARN_S = float(os.environ.get("REAL_PY_USER_WARN_S", "10"))
"""Seconds inside user code after which the launcher names the rank (then at 2x, 4x, ...)."""
EXIT_ORPHANED = 70
"""Exit code of a rank whose launcher (or torchrun agent) is gone."""
MONITOR_S = 0.1
"""The agent's monitor interval: seconds between its looks at the workers."""
FAILED_WAIT_S = 60.0
"""Seconds a failed rank of a launched job waits for the launcher to end it before it exits."""


# ------------------------------------------------------------------ the run directory's lock

_lock: dict = {"fd": None, "path": None, "made": None}


def _holder(path: str) -> tuple[int | None, str]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None, ""
    head, _, rest = text.partition(" ")
    return (int(head) if head.isdigit() else None), rest


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def lock_out_dir(out_dir: str, wait_s: float = LOCK_WAIT_S) -> int:
    """Take out_dir's lock for this process (and the ranks it starts); ValueError naming the
    holder's pid when another job holds it. A holder whose launcher is gone (killed: its ranks
    are exiting) is waited for up to `wait_s` seconds. Creates out_dir if needed."""
    import fcntl

    if _lock["fd"] is not None:
        return _lock["fd"]
    made = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, LOCK_NAME)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"{path} is a symbolic link; remove it") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid, what = _holder(path)
            if _alive(pid) or time.monotonic() > deadline:
                state = "" if _alive(pid) else f" (gone; its ranks still hold the lock after {wait_s:g} s)"
                raise ValueError(f"out_dir {out_dir} is in use by another job: pid {pid}{state}"
                                 f"{f' ({what})' if what else ''}; wait for it to end or stop it "
                                 f"(kill {pid}), or choose another --out-dir") from None
            if not told:
                print(f"out_dir {out_dir}: waiting for the ranks of job pid {pid} (gone) to exit",
                      file=sys.stderr, flush=True)
                told = True
            time.sleep(0.1)
            continue
        try:  # the file we locked may have been unlinked by its previous holder meanwhile
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {' '.join(['python'] + sys.argv)[:500]}\n".encode())
        _lock.update(fd=fd, path=path, made=out_dir if made else None)
        return fd


def unlock() -> None:
    """Release this process's lock: remove the lock file (while holding it), close it; an
    out_dir this process created and left empty is removed too."""
    fd, path, made = _lock["fd"], _lock["path"], _lock["made"]
    if fd is None:
        return
    keep = _lock.pop("keep_file", False)
    _lock.update(fd=None, path=None, made=None)
    if not keep:  # a live rank still holds the file's lock: a new job must find that file
        try:
            os.unlink(path)
        except OSError:
            pass
    os.close(fd)
    if made:
        try:
            os.rmdir(made)
        except OSError:
            pass


# ------------------------------------------------------------------ the launcher


def can_fork(device: str) -> bool:
    """Whether the agent may fork the ranks from this process: a CPU job, CUDA never initialized
    here. REAL_PY_LAUNCH=spawn (or exec) forces fresh interpreters."""
    import torch

    if os.environ.get("REAL_PY_LAUNCH", "fork") in ("spawn", "exec") or not hasattr(os, "fork"):
        return False
    if torch.cuda.is_initialized():
        return False
    return device == "cpu" or (device == "auto" and torch.version.cuda is None and torch.version.hip is None)


def launch(nproc: int, out_dir: str, target, *, fork: bool = True, what: str = "gloo processes") -> int:
    """Run the job's `nproc` local ranks, each calling `target()` (picklable unless `fork`),
    under torchrun's elastic agent in this process, and return the job's exit code (0, 1 failed,
    128+signal interrupted). Call with out_dir's lock held (lock_out_dir)."""
    job = _Job(nproc, out_dir, target, fork)
    mode = "forked from this process" if fork else "each a new python"
    print(f"launching {nproc} local {what} under torchrun's elastic agent ({mode}); logs in {job.logs}",
          flush=True)
    return job.run()


_SIG_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class _Fd:
    """A file descriptor handed to a rank: inherited by a fork; passed to a spawned rank (the
    multiprocessing pickler duplicates it into the child under the same number)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import context

        popen = context.get_spawning_popen()
        return (_Fd, (popen.duplicate_for_child(self.fd) if popen is not None else self.fd,))


class _Plumbing:
    """What a rank gets from the launcher: its pipes, the lock, the launcher's pid."""

    def __init__(self, out, err, hello, lock, logs, launcher):
        self.out, self.err, self.hello, self.lock = out, err, hello, lock
        self.logs, self.launcher = logs, launcher


class _Rank:
    __slots__ = ("r", "pid", "pidfd", "log", "code", "ended", "state", "moved", "n", "killed", "warned",
                 "stopped", "tail", "pstate")

    def __init__(self, r):
        self.r, self.pid, self.pidfd, self.log = r, None, None, None
        self.code = self.ended = self.state = self.pstate = None
        self.moved, self.n, self.killed, self.warned, self.stopped = time.monotonic(), None, False, {}, None
        self.tail = b""


class _Job:
    def __init__(self, nproc, out_dir, target, fork):
        self.n, self.out_dir, self.target, self.fork = nproc, out_dir, target, fork
        self.logs = os.path.join(out_dir, "logs")
        self.ranks = [_Rank(r) for r in range(nproc)]
        self.store = None
        self.streams = {}          # read fd -> (rank, console?)
        self.hellos = {}           # read fd -> rank: "<pid> <store port>" when it starts
        self.writers = []          # the ranks' ends of the pipes, closed here once all started
        self.records: dict[int, dict] = {}
        self.failing = None        # monotonic time of the first failure seen
        self.signal = None
        self.over = threading.Event()     # the agent has returned
        self.ended = threading.Event()    # the watcher has ended the ranks (or they all ended)
        self.lock = threading.RLock()
        self.alive: list[int] = []      # pids of ranks still alive after the end (see _wait_ranks_gone)

    # -------------------------------------------------------------- start

    def _fresh_logs(self) -> None:
        """The logs folder holds this job's logs: the previous job's go (a link is refused)."""
        if os.path.islink(self.logs):
            raise ValueError(f"{self.logs} is a symbolic link; a run writes its logs itself: remove it")
        os.makedirs(self.logs, exist_ok=True)
        for name in os.listdir(self.logs):
            if re.fullmatch(r"(rank\d+\.log|failed_rank\d+\.json(\..*\.tmp)?|job\.json|torchrun\.log|"
                            r"error_rank\d+\.json)", name):
                os.unlink(os.path.join(self.logs, name))

    def _open_log(self, r: int) -> int:
        return os.open(os.path.join(self.logs, f"rank{r}.log"),
                       os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)

    def _pipes(self) -> _Plumbing:
        out, err, hello = [], [], []
        for rk in self.ranks:
            rk.log = self._open_log(rk.r)
            for kind, console in ((out, rk.r == 0), (err, False), (hello, None)):
                r, w = os.pipe()
                os.set_inheritable(w, True)
                if console is None:
                    self.hellos[r] = rk
                else:
                    self.streams[r] = (rk, console)
                self.writers.append(w)
                kind.append(_Fd(w))
        lock = _lock["fd"]
        return _Plumbing(out, err, hello, _Fd(lock) if lock is not None else None, self.logs, os.getpid())

    def _agent_log(self):
        """torchrun's agent logs into logs/torchrun.log, not onto the console."""
        import logging

        h = logging.FileHandler(os.path.join(self.logs, "torchrun.log"))
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        saved = []
        for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
            lg = logging.getLogger(name)
            saved.append((lg, lg.propagate, lg.level))
            lg.addHandler(h)
            lg.propagate = False
            lg.setLevel(logging.INFO)

        def undo():
            for lg, prop, level in saved:
                lg.removeHandler(h)
                lg.propagate, lg.level = prop, level
            h.close()

        return undo

    def _config(self):
        from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
        from torch.distributed.launcher.api import LaunchConfig

        logs = self.logs

        class _Logs(LogsSpecs):
            """No redirection by the agent (each rank redirects into its pipes itself); the
            error file of an exception escaping a rank's entry point goes into logs/."""

            def __init__(self):
                super().__init__(log_dir=logs)

            def reify(self, envs):
                n = len(envs)
                return LogsDest({r: "" for r in range(n)}, {r: "" for r in range(n)}, {}, {},
                                {r: os.path.join(logs, f"error_rank{r}.json") for r in range(n)})

            @property
            def root_log_dir(self) -> str:
                return logs

        return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=self.n, logs_specs=_Logs(),
                            run_id=f"real_py-{os.getpid()}", rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                            rdzv_configs={"is_host": True}, max_restarts=0, monitor_interval=MONITOR_S,
                            start_method="fork" if self.fork else "spawn", local_addr="127.0.0.1",
                            # SIGINT / SIGTERM / SIGHUP stay the launcher's own (one line, SIGKILL at once)
                            signals_to_handle="SIGQUIT", shutdown_timeout=2)

    def _tracker(self) -> None:
        """Start multiprocessing's resource tracker (spawn: the agent's queues and events are
        named semaphores) with its stderr in logs/torchrun.log: the command ends with os._exit,
        and the tracker's warning about the semaphores it then removes is no line of the job's."""
        from multiprocessing import resource_tracker

        fd = os.open(os.path.join(self.logs, "torchrun.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        saved = os.dup(2)
        try:
            os.dup2(fd, 2)
            resource_tracker.ensure_running()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(fd)

    def run(self) -> int:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        self._fresh_logs()
        undo_log = self._agent_log()
        handlers = {}
        try:
            for s in _SIG_EXIT:
                handlers[s] = signal.signal(s, self._on_signal)
        except ValueError:  # not the main thread (tests)
            handlers = {}
        sys.stdout.flush()
        sys.stderr.flush()
        watcher = None
        failed = {}
        try:
            plumbing = self._pipes()
            config = self._config()
            if not self.fork:
                self._tracker()
            watcher = threading.Thread(target=self._watch, name="real_py-job-watch", daemon=True)
            watcher.start()
            try:
                elastic_launch(config, _rank_entry)(plumbing, self.target)
                for rk in self.ranks:  # every rank returned 0 to the agent
                    rk.code = 0 if rk.code is None else rk.code
            except ChildFailedError as e:
                failed = e.failures
            except SignalException as e:  # a signal the agent handles (SIGQUIT)
                self.signal = self.signal or e.sigval
        finally:
            self.over.set()
            if watcher is not None:
                watcher.join(WATCH_JOIN_S)
                if watcher.is_alive():
                    print(f"real_py: the job's watcher did not stop within {WATCH_JOIN_S:.0f} s", file=sys.stderr,
                          flush=True)
            self._kill_all()
            self._wait_ranks_gone(RANKS_GONE_S)
            self._drain(1.0)
            for fd in self.writers:
                os.close(fd)
            self.writers.clear()
            for fd in list(self.streams) + list(self.hellos):
                os.close(fd)
            self.streams.clear()
            self.hellos.clear()
            for rk in self.ranks:
                if rk.log is not None:
                    os.close(rk.log)
                if rk.pidfd is not None:
                    os.close(rk.pidfd)
            for s, h in handlers.items():
                signal.signal(s, h)
            undo_log()
        for f in failed.values():  # the agent's first failed worker: its exit code, if not seen
            rk = self.ranks[f.local_rank] if 0 <= f.local_rank < self.n else None
            if rk is not None and rk.code is None:
                rk.code, rk.ended = f.exitcode, rk.ended or time.time()
        return self._report()

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
                self.alive.append(rk.pid)
        if self.alive:
            print(f"real_py: ranks with pids {self.alive} are still alive {timeout:.0f} s after being killed; "
                  f"the lock on the run directory stays until they are gone", file=sys.stderr, flush=True)
            _lock["keep_file"] = True

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
        self._kill_all(stacks=False)

    # -------------------------------------------------------------- watch

    def _watch(self) -> None:
        """The watcher thread (see _watch_loop). An error inside it ends the job with one line
        instead of leaving the ranks' pipes undrained (a rank would block in print)."""
        try:
            self._watch_loop()
        except BaseException as e:  # noqa: BLE001 - reported, then the job ends
            print(f"real_py: the job's watcher failed ({type(e).__name__}: {e}); ending the job", file=sys.stderr,
                  flush=True)
            self.signal = self.signal or signal.SIGTERM
            self._kill_all(stacks=False)
            self._drain(2.0)

    def _watch_loop(self) -> None:
        """The ranks' output into their logs, their pids, their ends, the failure records and
        heartbeats; ends the job on a failure."""
        import selectors

        sel = selectors.DefaultSelector()
        for fd in list(self.streams) + list(self.hellos):
            sel.register(fd, selectors.EVENT_READ)
        next_poll = 0.0
        while True:
            for key, _ in sel.select(timeout=0.1):
                if key.fd in self.hellos:
                    self._hello(key.fd, sel)
                elif key.fd in self.streams:
                    if not self._pump(key.fd):
                        sel.unregister(key.fd)
                else:  # a rank's pidfd: it ended
                    sel.unregister(key.fd)
                    self._exited(key.data)
            if self.over.is_set():
                self._poll()
                return
            now = time.monotonic()
            if self.signal is not None:
                self._kill_all(stacks=False)
                continue
            if now >= next_poll:
                next_poll = now + 0.25
                self._poll()
            if self.ended.is_set():
                continue
            # An exit whose status the agent reaped first (code unknown) is no failure by itself:
            # ranks that return 0 are reaped at once, and a failed one the agent reports.
            if self.failing is None and (self.records or any(rk.code not in (None, 0) for rk in self.ranks)):
                self.failing = now
            if self.failing is not None and now - self.failing >= FAIL_GRACE_S:
                self._poll()
                self._kill_all()

    def _hello(self, fd: int, sel) -> None:
        """A rank started: "<pid> <store port>". Once all have, job.json lists them, the
        launcher's copies of the ranks' pipe ends are closed and the store is read."""
        import selectors

        rk = self.hellos.pop(fd)
        sel.unregister(fd)
        try:
            data = os.read(fd, 256).decode().split()
        except OSError:
            data = []
        os.close(fd)
        if len(data) != 2:
            return
        with self.lock:
            rk.pid = int(data[0])
            try:
                rk.pidfd = os.pidfd_open(rk.pid)
                sel.register(rk.pidfd, selectors.EVENT_READ, rk)
            except (OSError, AttributeError):
                rk.pidfd = None
        if self.signal is not None or self.ended.is_set():
            self._kill_all(stacks=False)
        if self.hellos:
            return
        for w in self.writers:
            os.close(w)
        self.writers.clear()
        with open(os.path.join(self.logs, "job.json"), "w") as f:
            json.dump({"launcher": os.getpid(), "ranks": [x.pid for x in self.ranks],
                       "start_method": "fork" if self.fork else "spawn", "store_port": int(data[1])}, f)
        try:
            import datetime

            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", int(data[1]), is_master=False,
                                       timeout=datetime.timedelta(seconds=10))
        except Exception:  # noqa: BLE001 - without the store no heartbeats are read, nothing else
            self.store = None

    def _exited(self, rk: _Rank) -> None:
        """A rank's process ended: its exit status while the agent has not reaped it yet."""
        rk.ended = rk.ended or time.time()
        try:
            info = os.waitid(os.P_PID, rk.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, OSError):
            info = None
        if info is not None and info.si_pid == rk.pid:
            rk.code = -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
        elif rk.code is None:
            rk.code = -1 if rk.killed else None

    def _pump(self, fd: int) -> bool:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        rk, console = self.streams[fd]
        if not data:
            os.close(fd)
            del self.streams[fd]
            return False
        try:
            os.write(rk.log, data)
        except OSError:  # a full disk: keep draining (the tail below still names the cause)
            pass
        rk.tail = (rk.tail + data)[-4096:]
        if console:
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            except Exception:  # noqa: BLE001 - a closed or unusual stdout: the log has it
                pass
        return True

    def _drain(self, secs: float) -> None:
        """Read what the ended ranks left in their pipes (a rank's own child may hold a pipe
        open: give up after `secs`)."""
        import select

        end = time.monotonic() + secs
        while self.streams and time.monotonic() < end:
            ready, _, _ = select.select(list(self.streams), [], [], 0.05)
            for fd in ready:
                self._pump(fd)

    def _kill_all(self, stacks: bool = True) -> None:
        """SIGKILL every rank still running (first, after a failure, their Python stacks into
        their logs: where a rank stuck in user code hangs)."""
        with self.lock:
            live = [rk for rk in self.ranks if rk.pid is not None and not rk.killed and rk.code is None]
            if not live:
                return
            if stacks and self.failing is not None and self.signal is None:
                # faulthandler on SIGUSR1 (run_rank). A stopped rank cannot answer.
                for rk in live:
                    try:
                        if rk.pidfd is not None:
                            signal.pidfd_send_signal(rk.pidfd, signal.SIGUSR1)
                        else:
                            os.kill(rk.pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                self._drain(0.3)
            for rk in live:
                rk.pstate = _proc_state(rk.pid)
                try:  # through its pidfd: never another process that took a reaped rank's pid
                    if rk.pidfd is not None:
                        signal.pidfd_send_signal(rk.pidfd, signal.SIGKILL)
                    else:
                        os.kill(rk.pid, signal.SIGKILL)
                    rk.killed = True
                except ProcessLookupError:
                    pass
            self.ended.set()

    def _poll(self) -> None:
        """Failure records from the logs folder; each rank's heartbeat and activity from the
        store; warnings for a rank long inside user code."""
        for rk in self.ranks:
            if rk.r not in self.records:
                path = os.path.join(self.logs, f"failed_rank{rk.r}.json")
                try:
                    with open(path) as f:
                        self.records[rk.r] = json.load(f)
                except (OSError, ValueError):
                    pass
        if self.store is None:
            return
        from ..liveness import JOB_KEY, SILENT_S

        now = time.monotonic()
        for rk in self.ranks:
            if rk.code is not None or rk.killed:
                continue
            key = f"{JOB_KEY}{rk.r}"
            try:
                if not self.store.check([key]):
                    continue
                st = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - an unreadable record judges nobody
                continue
            if st.get("n") != rk.n:
                rk.n, rk.moved, rk.stopped = st.get("n"), now, None
            rk.state = st
            if now - rk.moved >= SILENT_S and rk.stopped is None and not st.get("done"):
                rk.stopped = now - rk.moved
                ps = _proc_state(rk.pid)
                print(f"real_py: rank {rk.r} is silent: no heartbeat for {rk.stopped:.0f} s"
                      f"{' (process stopped)' if ps == 'T' else ''}; {_doing(st)}", file=sys.stderr, flush=True)
            if st.get("user"):
                secs = time.time() - st["user_since"]
                nxt = rk.warned.get(st["user_since"], USER_WARN_S)
                if secs >= nxt:
                    rk.warned[st["user_since"]] = nxt * 2
                    print(f"real_py: rank {rk.r} has been inside {st['user']} for {secs:.0f} s "
                          f"({_doing(st, user=False)})", file=sys.stderr, flush=True)

    # -------------------------------------------------------------- report

    def _report(self) -> int:
        if self.signal is not None:
            name = signal.Signals(self.signal).name
            where = _doing(self.ranks[0].state or {}, user=False)
            print(f"interrupted ({name}): ended the job's {self.n} ranks (rank 0 was at {where}); logs in "
                  f"{self.logs}", file=sys.stderr, flush=True)
            return _SIG_EXIT.get(self.signal, 128 + int(self.signal))
        if all(rk.code == 0 for rk in self.ranks) and not self.records:
            return 0
        r, cause, named = self._cause()
        others = sorted(x for x in self.records if x != r and x not in named)
        tail = f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too" if others else ""
        where = (f"full trace: {os.path.join(self.logs, f'rank{r}.log')}" if r in self.records
                 else f"logs: {self.logs}")
        print(f"train failed: {cause} ({where}{tail})", file=sys.stderr, flush=True)
        return 1

    def _cause(self) -> tuple[int | None, str, list[int]]:
        """(the rank at the root, one line on it, the ranks that line already names)."""
        recs = self.records
        own = sorted((rec for rec in recs.values() if not rec.get("consequent")), key=lambda x: x.get("time", 0))
        if own:
            rec = own[0]
            return rec["rank"], _record_line(rec), []
        died = sorted((rk for rk in self.ranks if rk.code not in (None, 0) and not rk.killed
                       and rk.r not in recs and rk.code != EXIT_ORPHANED), key=lambda rk: rk.ended or 0)
        if died:
            rk = died[0]
            how = (f"was killed by signal {signal.Signals(-rk.code).name}" if rk.code < 0
                   else f"exited with code {rk.code}")
            where = _doing(rk.state) if rk.state else "start-up"
            last = _last_line(rk.tail)
            return rk.r, (f"rank {rk.r} {how} (last reported: {where})"
                          + (f"; its last output: {last}" if last else "")), []
        named: dict[int, list[int]] = {}
        for rec in recs.values():
            if rec.get("silent_peer") is not None:
                named.setdefault(int(rec["silent_peer"]), []).append(rec["rank"])
        if named:
            p = max(named, key=lambda k: len(named[k]))
            rk = self.ranks[p] if 0 <= p < self.n else None
            how = "stopped responding"
            if rk is not None and rk.pstate == "T":
                how = "was stopped (process state T: SIGSTOP or a debugger)"
            where = _doing(rk.state) if rk is not None and rk.state else "starting"
            by = ", ".join(map(str, sorted(named[p])))
            return p, (f"rank {p} {how} (last reported: {where}): no heartbeat, named silent by "
                       f"rank{'s' if len(named[p]) > 1 else ''} {by}"), named[p]
        stuck = [rk for rk in self.ranks if rk.state and rk.state.get("user")]
        if stuck:
            rk = min(stuck, key=lambda k: k.state["user_since"])
            first = min(recs.values(), key=lambda x: x.get("time", 0)) if recs else None
            secs = (rk.ended or time.time()) - rk.state["user_since"]
            return rk.r, (f"rank {rk.r} has been inside {rk.state['user']} for {secs:.0f} s "
                          f"({_doing(rk.state, user=False)})"
                          + (f"; the other ranks gave up waiting ({_record_line(first)})" if first else "")), []
        if recs:
            rec = min(recs.values(), key=lambda x: x.get("time", 0))
            return rec["rank"], _record_line(rec), []
        return None, "the job ended without a failure record", []


def _proc_state(pid: int | None) -> str | None:
    """The process state letter in /proc (R, S, T stopped, Z, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _doing(st: dict, user: bool = True) -> str:
    """"step 3, call rew_inf" (the rank's section, without its "rank N, " prefix) and the user
    code it is inside."""
    what = re.sub(r"^rank \d+, ", "", st.get("doing") or "starting")
    if user and st.get("user"):
        what += f", inside {st['user']} for {time.time() - st['user_since']:.0f} s"
    return what


def _record_line(rec: dict) -> str:
    where = re.sub(r"^rank \d+, ", "", rec.get("where") or "") or "starting"
    msg = f"rank {rec.get('rank')}, {where}: {rec.get('exception')}: {rec.get('message')}"
    if rec.get("user"):
        msg += f" (raised inside {rec['user']})"
    return msg


def _last_line(tail: bytes) -> str:
    lines = [x.strip() for x in tail.decode(errors="replace").replace("\r", "\n").splitlines() if x.strip()]
    return lines[-1][:300] if lines else ""


# ------------------------------------------------------------------ the ranks

_state: dict = {"managed": False, "rank": None, "launcher": None, "pidfd": None}


def managed() -> bool:
    """Whether this process is a rank started by `launch` (not under an outside torchrun)."""
    return _state["managed"]


def _rank_entry(plumbing: _Plumbing, target) -> int:
    """A rank started by torchrun's agent in `launch` (its entry point: a fork of the launcher,
    or a fresh interpreter for spawn): its own ends of the launcher's pipes as stdout and
    stderr, death with the launcher, its pid to the watcher, then `target()` as run_rank. Returns
    0 to the agent on success; a failed rank ends with os._exit (run_rank)."""
    r = int(os.environ["LOCAL_RANK"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends the job on Ctrl-C
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the launcher's handlers are not the rank's
        signal.signal(sig, signal.SIG_DFL)
    _state.update(managed=True, rank=r, launcher=plumbing.launcher)
    _die_with_parent(plumbing.launcher)
    mine = (plumbing.out[r].fd, plumbing.err[r].fd, plumbing.hello[r].fd)
    for fd in (x.fd for x in plumbing.out + plumbing.err + plumbing.hello):
        if fd not in mine:
            try:
                os.close(fd)
            except OSError:
                pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(mine[0], 1)
    os.dup2(mine[1], 2)
    for fd in (null, mine[0], mine[1]):
        os.close(fd)
    os.write(mine[2], f"{os.getpid()} {os.environ.get('MASTER_PORT', 0)}\n".encode())
    os.close(mine[2])
    _watch_launcher(plumbing.launcher)
    # plumbing.lock: the run directory's lock, inherited or handed over, held until this rank ends.

    import torch

    torch.random.default_generator.manual_seed(67280421310721)  # as in a fresh process
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, f"real_py-rank{r}".encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
    return run_rank(target, int(os.environ["RANK"]), plumbing.logs)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it (the launcher's main thread, where
    the agent runs) ends; exits at once when the launcher is already gone."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)


def _watch_launcher(pid: int) -> None:
    """End this process when the launcher is gone (a pidfd of it becomes readable; the parent
    pid as a fallback): behind PR_SET_PDEATHSIG."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        fd = None
    _state["pidfd"] = fd

    def loop():
        import select

        if fd is not None:
            p = select.poll()
            p.register(fd, select.POLLIN)
            while not p.poll(1000):
                pass
        else:
            while os.getppid() == pid:
                time.sleep(0.5)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=loop, name="real_py-launcher-watch", daemon=True).start()


def _watch_parent() -> None:
    """Outside torchrun: end this process when its parent (the torchrun agent) is gone."""
    parent = os.getppid()

    def loop():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=loop, name="real_py-parent-watch", daemon=True).start()


def orphaned() -> bool:
    """Whether the launcher of this rank is gone."""
    pid = _state["launcher"]
    if pid is None:
        return False
    fd = _state["pidfd"]
    if fd is not None:
        import select

        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(0))
    return os.getppid() != pid


def run_rank(target, rank: int, logs: str | None = None) -> int:
    """Run this rank's part of the job: `target()` -> exit code. An exception is written as the
    rank's failure record (liveness.record_failure) and its traceback to stderr, then one line;
    returns 1. A failed rank of a launched job then waits for the launcher to end it (it SIGKILLs
    every rank once the others had FAIL_GRACE_S to write their records: an exit now would have
    torchrun's agent SIGTERM them first), and leaves with os._exit (no interpreter teardown)."""
    from .. import liveness

    if _state["managed"]:
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks into the log before a kill
    else:
        _watch_parent()
    if logs is not None:
        liveness.set_job_logs(logs, rank)
    code = 1
    try:
        code = target()
    except BaseException as e:  # noqa: BLE001 - every failure is recorded and reported the same way
        if orphaned():
            os._exit(EXIT_ORPHANED)
        import traceback

        rec = failure_record(e, rank)
        try:
            traceback.print_exc()
            print(f"real_py: {_record_line(rec)}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        liveness.record_failure(rec)
        code = 1
    if _state["managed"]:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        if code == 0:
            return 0  # to the agent, which ends the ranks once all have returned
        end = time.monotonic() + FAILED_WAIT_S
        while time.monotonic() < end and not orphaned():
            time.sleep(0.1)
        os._exit(EXIT_ORPHANED if orphaned() else code)
    return code


_CONSEQUENT = re.compile(r"peer rank \d+|connection (closed|reset)|broken pipe|timed out|"
                         r"stopped waiting|failures reported by other ranks", re.IGNORECASE)
_COMM = ("TransferError", "SilentPeer", "DistError", "DistNetworkError", "DistStoreError", "DistBackendError")
_WRAPPER = re.compile(r"^rank \d+, (step \d+|dynamic sampling)")
"""The runtime's RuntimeError around a call's error ("rank 2, step 0, call rew_inf: ValueError: ...")."""


def failure_record(e: BaseException, rank: int) -> dict:
    """rank, pid, time, where (the section or driver state it failed in), exception and message
    (the first error in the chain below the runtime's wrappers: the user's ValueError, a
    TransferError, ...; the message's first line), user (user code it was inside), consequent
    (a communication error: a peer failed first), silent_peer (the global rank it names)."""
    from .. import liveness

    chain, cur = [], e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    shown = next((x for x in chain if not _WRAPPER.match(str(x))), chain[-1])
    section, user = liveness.failed_in()
    where = section or liveness.activity()["doing"]
    text = str(shown).strip()
    msg = re.split(r"; failures reported by other ranks", text.splitlines()[0] if text else "")[0][:500]
    full = "\n".join(str(x) for x in chain)
    silent = re.search(r"peer rank (\d+)(?: \(global rank (\d+)\))? (is silent|has finished)", full)
    consequent = (any(type(x).__name__ in _COMM for x in chain) or bool(_CONSEQUENT.search(full))
                  or isinstance(e, KeyboardInterrupt))
    return {"rank": rank, "pid": os.getpid(), "time": time.time(), "where": where,
            "exception": type(shown).__name__, "message": msg, "user": user, "consequent": consequent,
            "silent_peer": int(silent.group(2) or silent.group(1)) if silent else None}


__all__ = ["lock_out_dir", "unlock", "can_fork", "launch", "run_rank", "managed", "orphaned",
           "failure_record", "LOCK_NAME", "EXIT_ORPHANED"]
