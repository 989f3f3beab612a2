"""What runs inside a rank of a `train` job: death with the launcher, the rank's output into the
launcher's pipes, and its failure record.

    run_rank(target, rank)       # target() -> exit code; an exception -> failure record, one line

A rank started by `launch` (real_py/launch/job.py) enters through `rank_entry`: its own ends of
the launcher's pipes become its stdout and stderr (the launcher's other fds a fork inherited are
closed, each only while its number still holds the launcher's file, or, a file in logs/ the agent's
logging still writes, replaced by /dev/null; the run directory's lock stays, close-on-exec, at fd 3
or above, and closed in any process the rank forks),
it tells the launcher its pid, and it dies with the launcher: PR_SET_PDEATHSIG (SIGKILL) and a
thread that waits on a pidfd of the launcher; a rank never writes after its launcher is gone. A
forked rank runs the job only once the launcher has heard every rank start (the go pipe's end): no
rank talks to the store while the agent still forks ranks from its threaded process
(`_after_start`). A rank that fails writes logs/failed_rank<r>.json (`failure_record`: rank, where,
exception, message, user code, whether the error is a consequence of a peer's failure) with its
traceback in its log, then waits to be ended.

Under an outside torchrun (several nodes) there is no launcher: each rank watches its parent (the
torchrun agent) and ends when it is gone, and a failing rank writes its failure record and one
line after its traceback.

One file past 400 lines: it is everything a rank does between torchrun's entry and target()'s exit
(fd plumbing, the death watches, the failure record), and job.py and report.py import their side of
that hand-over (Fd, Plumbing, fd_key, record_line, silent_peer) from here.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

EXIT_ORPHANED = 70
"""Exit code of a rank whose launcher (or torchrun agent) is gone."""
FAILED_WAIT_S = 60.0
"""Seconds a failed rank of a launched job waits for the launcher to end it before it exits."""
START_WAIT_S = 300.0
"""Seconds a rank of a launched job waits for every other rank to start before it fails."""


class Fd:
    """A file descriptor handed to a rank: inherited by a fork; passed to a spawned rank (the
    multiprocessing pickler duplicates it into the child under the same number)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import context

        popen = context.get_spawning_popen()
        return (Fd, (popen.duplicate_for_child(self.fd) if popen is not None else self.fd,))


@dataclass(kw_only=True)
class Plumbing:
    """What a rank gets from the launcher (pickled to a spawned rank): its pipes, the lock, the
    launcher's pid, and the launcher's own fds for a forked rank to close."""

    stdout: list[Fd]
    """Per rank, the write end of its stdout pipe (index: local rank)."""
    stderr: list[Fd]
    """Per rank, the write end of its stderr pipe."""
    hello: list[Fd]
    """Per rank, the write end of its hello pipe: "<pid> <store port>" once it starts."""
    lock: Fd | None
    """The run directory's lock (lock.held_fd), held by every rank until it ends; None: no lock."""
    logs: str
    """The logs folder, <out_dir>/logs."""
    launcher_pid: int
    """The launcher's pid: a rank dies with it."""
    private: list[tuple[int, int, int]] = field(default_factory=list)
    """The launcher's own fds (its ends of the pipes, the ranks' logs) as (fd, st_dev, st_ino),
    which a forked rank closes where the number still holds that file (`close_if_same`: the
    launcher closes some of them while the agent still forks ranks, and the numbers get reused)."""
    go: Fd | None = None
    """The read end of the go pipe (forked ranks only; see _after_start)."""


def fd_key(fd: int) -> tuple[int, int, int]:
    """(fd, st_dev, st_ino): an fd with the identity of the file it holds now (see
    close_if_same)."""
    st = os.fstat(fd)
    return fd, st.st_dev, st.st_ino


def close_if_same(fd: int, dev: int, ino: int) -> bool:
    """Close `fd` if it still holds the file (dev, ino) (fd_key); an fd closed since, or whose
    number now holds another file, stays as it is. Whether it was closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    if (st.st_dev, st.st_ino) != (dev, ino):
        return False
    _close(fd)
    return True


_state: dict = {"managed": False, "rank": None, "launcher": None, "pidfd": None}


def managed() -> bool:
    """Whether this process is a rank started by `launch` (not under an outside torchrun)."""
    return _state["managed"]


def rank_entry(plumbing: Plumbing, target) -> int:
    """A rank started by torchrun's agent in `launch` (its entry point: a fork of the launcher,
    or a fresh interpreter for spawn): its own ends of the launcher's pipes as stdout and
    stderr, death with the launcher, its pid to the watcher, then `target()` as run_rank. Returns
    0 to the agent on success; a failed rank ends with os._exit (run_rank)."""
    r = int(os.environ["LOCAL_RANK"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends the job on Ctrl-C
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the launcher's handlers are not the rank's
        signal.signal(sig, signal.SIG_DFL)
    _state.update(managed=True, rank=r, launcher=plumbing.launcher_pid)
    _die_with_parent(plumbing.launcher_pid)
    mine = (plumbing.stdout[r].fd, plumbing.stderr[r].fd, plumbing.hello[r].fd)
    for fd in (x.fd for x in plumbing.stdout + plumbing.stderr + plumbing.hello):
        if fd not in mine:
            _close(fd)
    # Every fd the rank keeps goes to 3 or above before fds 0-2 are replaced: a launcher started
    # with stdin (or stdout) closed may have handed the lock or a pipe over as fd 0-2, and the
    # launcher's own 0-2 (a file in logs/, say) are replaced below, never closed in between.
    null = _above_stdio(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
    mine = tuple(_above_stdio(fd) for fd in mine)
    for held in (plumbing.lock, plumbing.go):
        if held is not None:
            held.fd = _above_stdio(held.fd)
    go = () if plumbing.go is None else (plumbing.go.fd,)
    _close_launchers(plumbing, keep=mine + go + (null,), null=null)
    if plumbing.lock is not None:  # the rank's only, released when it ends: never its children's
        os.set_inheritable(plumbing.lock.fd, False)
        os.register_at_fork(after_in_child=functools.partial(_close, plumbing.lock.fd))
    os.dup2(null, 0)
    os.dup2(mine[0], 1)
    os.dup2(mine[1], 2)
    for fd in (null, mine[0], mine[1]):
        os.close(fd)
    os.write(mine[2], f"{os.getpid()} {os.environ.get('MASTER_PORT', 0)}\n".encode())
    os.close(mine[2])
    _watch_launcher(plumbing.launcher_pid)
    # plumbing.lock: the run directory's lock, inherited or handed over, held until this rank ends
    # (it ends with the launcher): a new job on the directory waits until no rank can write.

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
    if plumbing.go is not None:
        target = functools.partial(_after_start, plumbing.go.fd, target)
    return run_rank(target, int(os.environ["RANK"]), plumbing.logs)


def _after_start(go: int, target):
    """`target()` once the launcher has seen every rank of the job start (the end of the go pipe;
    see rank_entry): a rank that talked to the store earlier would have the agent's store thread
    resolve its address (getnameinfo) while the agent forks the next rank, and that rank would
    inherit glibc's resolver lock held, and hang in its own first getnameinfo. A job whose ranks
    do not all start within START_WAIT_S is a failure of this rank, named as such. Forked ranks
    only: a spawned rank is a fresh interpreter and inherits no lock."""
    import select

    from .. import liveness

    liveness.set_activity("starting: waiting for the job's other ranks to start")
    p = select.poll()
    p.register(go, select.POLLIN)
    try:
        ready = p.poll(START_WAIT_S * 1000)
    finally:
        os.close(go)
    if orphaned():  # the pipe's end was the launcher's death (its SIGKILL of this rank follows)
        os._exit(EXIT_ORPHANED)
    if not ready:
        raise RuntimeError(
            f"rank {os.environ.get('RANK')}: the job's other ranks did not all start within "
            f"{START_WAIT_S:.0f} s (see logs/torchrun.log)"
        )
    if ready[0][1] & select.POLLNVAL:
        raise RuntimeError(
            f"rank {os.environ.get('RANK')}: the launcher's go pipe (fd {go}) is no open file"
        )
    liveness.set_activity(None)
    return target()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _above_stdio(fd: int) -> int:
    """`fd` if it is 3 or above, else a close-on-exec copy of it there (the original, one of
    0-2, is replaced by the rank's stdin, stdout or stderr)."""
    if fd > 2:
        return fd
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)


def _close_launchers(plumbing: Plumbing, keep, null: int) -> None:
    """A forked rank holds a copy of every fd of the launcher: close the launcher's own (its ends
    of the ranks' pipes, every rank's log, its pidfds of the ranks started before this one), so
    that no rank holds another's log or keeps a pipe open for its reader. Another file in logs/
    (torchrun.log, under the agent's logging handler the rank inherited) gets /dev/null (`null`)
    instead: its number stays taken, and what the rank logs there goes nowhere. Fds 0-2 stay
    (rank_entry replaces them), as does the run directory's lock."""
    for fd, dev, ino in plumbing.private:
        if fd > 2 and fd not in keep:
            close_if_same(fd, dev, ino)
    logs = os.path.join(os.path.realpath(plumbing.logs), "")
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd in keep or (plumbing.lock is not None and fd == plumbing.lock.fd):
            continue
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link == "anon_inode:[pidfd]":
            _close(fd)
        elif link.startswith(logs):
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:
                pass


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
    """End this process when the launcher, its parent, is gone: a thread waits on a pidfd of it
    (behind PR_SET_PDEATHSIG). A launcher gone before the pidfd is taken (pidfd_open's ESRCH, or
    its pid already another process's) ends the rank at once; without pidfds (an old kernel, a
    seccomp filter) the thread watches the parent pid instead."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(EXIT_ORPHANED)
    except (OSError, AttributeError):
        fd = None
    if os.getppid() != pid:  # gone before the pidfd: it may be another process's now
        os._exit(EXIT_ORPHANED)
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
                time.sleep(0.1)
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
    except BaseException as e:
        if orphaned():
            os._exit(EXIT_ORPHANED)
        import traceback

        rec = failure_record(e, rank)
        try:
            traceback.print_exc()
            print(f"real_py: {record_line(rec)}", file=sys.stderr, flush=True)
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


def record_line(rec: dict) -> str:
    where = re.sub(r"^rank \d+, ", "", rec.get("where") or "") or "starting"
    msg = f"rank {rec.get('rank')}, {where}: {rec.get('exception')}: {rec.get('message')}"
    if rec.get("user"):
        msg += f" (raised inside {rec['user']})"
    return msg


_CONSEQUENT = re.compile(
    r"peer rank \d+|connection (closed|reset)|broken pipe|timed out|"
    r"stopped waiting|failures reported by other ranks",
    re.IGNORECASE,
)
_COMM = (
    "TransferError",
    "SilentPeer",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistBackendError",
)
_SILENT = re.compile(r"peer rank (\d+)(?: \(global rank (\d+)\))? (is silent|has finished)")
_WRAPPER = re.compile(r"^rank \d+, (step \d+|dynamic sampling)")
"""The runtime's RuntimeError around a call's error
("rank 2, step 0, call rew_inf: ValueError: ...")."""


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
    msg = re.split(r"; failures reported by other ranks", text.splitlines()[0] if text else "")[0][
        :500
    ]
    full = "\n".join(str(x) for x in chain)
    # A communication error is a peer's failure seen here; words like "timed out" are one only
    # outside user code (a reward function's own "Read timed out" is this rank's error).
    consequent = (
        any(type(x).__name__ in _COMM for x in chain)
        or isinstance(e, KeyboardInterrupt)
        or (user is None and bool(_CONSEQUENT.search(full)))
    )
    return {
        "rank": rank,
        "pid": os.getpid(),
        "time": time.time(),
        "where": where,
        "exception": type(shown).__name__,
        "message": msg,
        "user": user,
        "consequent": consequent,
        "silent_peer": silent_peer(full),
    }


def silent_peer(text: str) -> int | None:
    """The global rank a message names as silent ("peer rank 2 is silent: ...", a failure record's
    or a Watchdog's), or None."""
    m = _SILENT.search(text or "")
    return int(m.group(2) or m.group(1)) if m else None


__all__ = [
    "rank_entry",
    "Fd",
    "Plumbing",
    "fd_key",
    "close_if_same",
    "run_rank",
    "managed",
    "orphaned",
    "failure_record",
    "record_line",
    "silent_peer",
    "EXIT_ORPHANED",
]
