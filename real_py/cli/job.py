"""One `train` job on this node as one unit: the launcher starts the ranks, holds the run
directory, watches the ranks, and ends them together.

    fd = lock_out_dir(out_dir)          # refuses a directory another job writes, naming its pid
    code = launch(world, out_dir, target=lambda: ..., argv=[...], env={...}, fork=True)
    unlock()                             # after the job (the ranks hold the lock until they exit)

Ranks. With `fork` (CPU jobs: torch and the package are imported and the config validated once,
in the launcher) rank r is a fork of the launcher that calls `target()`; otherwise it is a fresh
`python -m real_py <argv>` with RANK etc. in its environment (CUDA jobs: CUDA must not be
initialized before a fork). Either way the ranks stay in the launcher's process group (a kill of
the group reaches them), connect to a TCPStore the launcher hosts (TORCHELASTIC_USE_AGENT_STORE,
so env:// makes every rank a client), and hold the run directory's lock with it. A rank dies
with its launcher: PR_SET_PDEATHSIG (SIGKILL) and a thread that waits for the end of a pipe only
the launcher holds; a rank never writes after its launcher is gone.

Output. Each rank's stdout and stderr go through pipes into <out_dir>/logs/rank<r>.log; rank 0's
stdout (step lines, progress bar) is also shown. A rank that fails writes
logs/failed_rank<r>.json (rank, where, exception, message, time: real_py/liveness.py
record_failure) with its full traceback in its log. The launcher ends the job at the first
failure record or non-zero exit (after FAIL_GRACE_S for the other ranks' records, then SIGKILL:
a stopped rank cannot act on SIGTERM) and prints one line: the root cause (an error raised by
the job's own code before a peer's consequent transfer error, a rank that died, a rank named
silent, a rank stuck in user code), and the log with the full trace. Ctrl-C (SIGINT, SIGTERM,
SIGHUP) ends the ranks and prints one line. While the job runs, a rank inside user code (the
reward function, data loading) for USER_WARN_S seconds or more is named on stderr.

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
FAIL_GRACE_S = 1.0
"""Seconds the launcher gives the other ranks to write their records after the first failure."""
USER_WARN_S = float(os.environ.get("REAL_PY_USER_WARN_S", "10"))
"""Seconds inside user code after which the launcher names the rank (then at 2x, 4x, ...)."""
EXIT_ORPHANED = 70
"""Exit code of a rank whose launcher (or torchrun agent) is gone."""

_ENV = "REAL_PY_JOB"
"""Environment of an exec'd rank: JSON {"fd": control pipe, "logs": folder, "launcher": pid}."""


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
    _lock.update(fd=None, path=None, made=None)
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
    """Whether ranks may be forks of this process: a CPU job, CUDA never initialized here.
    REAL_PY_LAUNCH=exec forces fresh processes."""
    import torch

    if os.environ.get("REAL_PY_LAUNCH", "fork") == "exec" or not hasattr(os, "fork"):
        return False
    if torch.cuda.is_initialized():
        return False
    return device == "cpu" or (device == "auto" and torch.version.cuda is None and torch.version.hip is None)


def launch(nproc: int, out_dir: str, *, target=None, argv=None, env=None, what: str = "gloo processes") -> int:
    """Run the job's `nproc` local ranks (forks running `target()`, or with target None
    `python -m real_py <argv>` under `env`) and return its exit code (0, 1 failed, 128+signal
    interrupted). Call with out_dir's lock held (lock_out_dir)."""
    job = _Job(nproc, out_dir, target, argv, env or dict(os.environ))
    mode = "forked from this process" if target is not None else "each a new python"
    print(f"launching {nproc} local {what} ({mode}); logs in {job.logs}", flush=True)
    return job.run()


_SIG_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class _Rank:
    __slots__ = ("r", "pid", "popen", "ctrl", "log", "code", "ended", "state", "moved", "n",
                 "killed", "warned", "stopped", "tail", "pstate")

    def __init__(self, r):
        self.r, self.pid, self.popen, self.ctrl, self.log = r, None, None, None, None
        self.code = self.ended = self.state = self.pstate = None
        self.moved, self.n, self.killed, self.warned, self.stopped = time.monotonic(), None, False, {}, None
        self.tail = b""


class _Job:
    def __init__(self, nproc, out_dir, target, argv, env):
        self.n, self.out_dir, self.target, self.argv, self.env = nproc, out_dir, target, argv, env
        self.logs = os.path.join(out_dir, "logs")
        self.ranks = [_Rank(r) for r in range(nproc)]
        self.store = None
        self.streams = {}          # read fd -> (rank, console?)
        self.records: dict[int, dict] = {}
        self.failing = None        # monotonic time of the first failure seen
        self.signal = None

    # -------------------------------------------------------------- start

    def _fresh_logs(self) -> None:
        """The logs folder holds this job's logs: the previous job's go (a link is refused)."""
        if os.path.islink(self.logs):
            raise ValueError(f"{self.logs} is a symbolic link; a run writes its logs itself: remove it")
        os.makedirs(self.logs, exist_ok=True)
        for name in os.listdir(self.logs):
            if re.fullmatch(r"(rank\d+\.log|failed_rank\d+\.json(\..*\.tmp)?|job\.json)", name):
                os.unlink(os.path.join(self.logs, name))

    def _open_log(self, r: int) -> int:
        return os.open(os.path.join(self.logs, f"rank{r}.log"),
                       os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)

    def _rank_env(self, r: int, port: int | None) -> dict:
        env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(self.n), "LOCAL_WORLD_SIZE": str(self.n),
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True",
               "OMP_NUM_THREADS": self.env.get("OMP_NUM_THREADS", "1")}
        if port is not None:
            env["MASTER_PORT"] = str(port)
        return env

    def _start_store(self):
        import datetime
        import socket

        import torch.distributed as dist

        # A socket bound here, on the loopback only and on a port the kernel picks (no race with
        # other jobs), handed to the store: TCPStore itself would listen on every interface.
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(128)
        port = self._listen.getsockname()[1]
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60), master_listen_fd=self._listen.fileno())
        return port

    def _start(self) -> None:
        self._fresh_logs()
        sys.stdout.flush()
        sys.stderr.flush()
        if self.target is not None:
            ctrl_writers = []
            for rk in self.ranks:
                self._fork(rk, ctrl_writers)
            port = self._start_store()  # after the forks: no rank inherits its socket or thread
            for rk in self.ranks:
                os.write(rk.ctrl, f"{port}\n".encode())
        else:
            import subprocess

            port = self._start_store()
            lock = [_lock["fd"]] if _lock["fd"] is not None else []
            for rk in self.ranks:
                cr, cw = os.pipe()
                env = dict(self.env, **self._rank_env(rk.r, port))
                env[_ENV] = json.dumps({"fd": cr, "logs": self.logs, "launcher": os.getpid()})
                rk.popen = subprocess.Popen([sys.executable, "-m", "real_py"] + list(self.argv), env=env,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, pass_fds=[cr] + lock)
                os.close(cr)
                rk.pid, rk.ctrl = rk.popen.pid, cw
                rk.log = self._open_log(rk.r)
                for f, console in ((rk.popen.stdout, rk.r == 0), (rk.popen.stderr, False)):
                    fd = os.dup(f.fileno())
                    f.close()
                    self.streams[fd] = (rk, console)
        with open(os.path.join(self.logs, "job.json"), "w") as f:
            json.dump({"launcher": os.getpid(), "ranks": [rk.pid for rk in self.ranks],
                       "mode": "fork" if self.target is not None else "exec", "store_port": port}, f)

    def _fork(self, rk: _Rank, ctrl_writers: list) -> None:
        cr, cw = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        readers = list(self.streams)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the rank: never returns into the launcher's code
            code = 1
            try:
                for fd in readers + ctrl_writers + [cw, out_r, err_r]:
                    os.close(fd)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                for fd in (null, out_w, err_w):
                    os.close(fd)
                _die_with_parent(parent)
                port = _read_line(cr)
                os.environ.update(self._rank_env(rk.r, int(port)))
                code = _rank_child(self.target, rk.r, cr, self.logs)
            finally:
                os._exit(code)
        for fd in (cr, out_w, err_w):
            os.close(fd)
        ctrl_writers.append(cw)
        rk.pid, rk.ctrl = pid, cw
        rk.log = self._open_log(rk.r)
        self.streams[out_r] = (rk, rk.r == 0)
        self.streams[err_r] = (rk, False)

    # -------------------------------------------------------------- watch

    def run(self) -> int:
        handlers = {}
        try:
            for s in _SIG_EXIT:
                handlers[s] = signal.signal(s, self._on_signal)
        except ValueError:  # not the main thread (tests)
            handlers = {}
        try:
            self._start()
            self._watch()
        finally:
            self._kill_all()
            self._reap(block=True)
            self._drain(1.0)
            for rk in self.ranks:
                if rk.log is not None:
                    os.close(rk.log)
                if rk.ctrl is not None:
                    os.close(rk.ctrl)
            for fd in list(self.streams):
                os.close(fd)
            self.streams.clear()
            for s, h in handlers.items():
                signal.signal(s, h)
        return self._report()

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def _watch(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        for fd in self.streams:
            sel.register(fd, selectors.EVENT_READ)
        next_poll = 0.0
        while True:
            if self.signal is not None:
                return
            for key, _ in sel.select(timeout=0.1):
                if not self._pump(key.fd):
                    sel.unregister(key.fd)
            self._reap()
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + 0.25
                self._poll()
            if self.failing is None and (self.records or any(rk.code not in (None, 0) for rk in self.ranks)):
                self.failing = now
            if all(rk.code is not None for rk in self.ranks):
                self._poll()
                return
            if self.failing is not None and now - self.failing >= FAIL_GRACE_S:
                self._poll()
                return

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
        os.write(rk.log, data)
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

    def _reap(self, block: bool = False) -> None:
        for rk in self.ranks:
            if rk.code is not None or rk.pid is None:
                continue
            try:
                pid, status = os.waitpid(rk.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                pid, status = rk.pid, 0
            if pid == rk.pid:
                rk.code = os.waitstatus_to_exitcode(status)
                rk.ended = time.time()
                if rk.popen is not None:
                    rk.popen.returncode = rk.code

    def _kill_all(self) -> None:
        live = [rk for rk in self.ranks if rk.pid is not None and rk.code is None]
        if live and self.failing is not None and self.signal is None:
            # Each rank's Python stacks into its log first (faulthandler on SIGUSR1, run_rank):
            # where a rank stuck in user code hangs. A stopped rank cannot answer.
            for rk in live:
                try:
                    os.kill(rk.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            self._drain(0.3)
        for rk in self.ranks:
            if rk.pid is not None and rk.code is None:
                rk.pstate = _proc_state(rk.pid)
                try:
                    os.kill(rk.pid, signal.SIGKILL)
                    rk.killed = True
                except ProcessLookupError:
                    pass

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
            if rk.code is not None:
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
            return _SIG_EXIT.get(self.signal, 1)
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


def _read_line(fd: int) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        b = os.read(fd, 64)
        if not b:
            os._exit(EXIT_ORPHANED)  # the launcher is gone before the job started
        buf += b
    return buf.decode().strip()


# ------------------------------------------------------------------ the ranks

_state: dict = {"managed": False, "rank": None, "ctrl": None}


def managed() -> bool:
    """Whether this process is a rank started by `launch` (not under an outside torchrun)."""
    return _state["managed"] or _ENV in os.environ


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it (the launcher's main thread) ends;
    exits at once when the launcher is already gone."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)


def _watch_fd(fd: int) -> None:
    """End this process when the launcher's end of the control pipe closes (it died)."""
    def loop():
        try:
            while os.read(fd, 64):
                pass
        except OSError:
            pass
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
    """Whether the launcher of this rank is gone (its control pipe is closed)."""
    fd = _state["ctrl"]
    if fd is None:
        return False
    import select

    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP)
    return any(ev & (select.POLLHUP | select.POLLERR) for _, ev in p.poll(0))


def _rank_child(target, rank: int, ctrl: int, logs: str) -> int:
    """A forked rank: the launcher's state it does not want, then `target()` as run_rank."""
    import torch

    _state.update(managed=True, rank=rank, ctrl=ctrl)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the launcher's handlers are not the rank's
        signal.signal(sig, signal.SIG_DFL)
    torch.random.default_generator.manual_seed(67280421310721)  # as in a fresh process
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, f"real_py-rank{rank}".encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
    _watch_fd(ctrl)
    return run_rank(target, rank, logs)


def run_rank(target, rank: int, logs: str | None = None) -> int:
    """Run this rank's part of the job: `target()` -> exit code. An exception is written as the
    rank's failure record (liveness.record_failure) and its traceback to stderr, then one line;
    returns 1. A rank of a launched job ends with os._exit (no interpreter teardown)."""
    from .. import liveness

    if _ENV in os.environ and not _state["managed"]:  # exec'd by launch
        info = json.loads(os.environ[_ENV])
        logs = info["logs"]
        _state.update(managed=True, rank=rank, ctrl=info["fd"])
        _die_with_parent(info["launcher"])
        _watch_fd(info["fd"])
    if _state["managed"]:
        import faulthandler

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends the job on Ctrl-C
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
        os._exit(code)
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
