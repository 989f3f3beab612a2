"""The run directory's lock: one job writes an out_dir at a time.

    fd = lock_out_dir(out_dir)   # refuses a directory another job writes, naming its pid
    ...                          # the job (its ranks inherit the lock and hold it until they exit)
    unlock()

`<out_dir>/.real_py.lock` is flock'ed by the job writing the directory and holds the launcher's
pid and command line. A job whose launcher is gone while its ranks still exit is waited for
(LOCK_WAIT_S); see real_py/launch/job.py for the launcher and real_py/launch/rank.py for the ranks.
"""

from __future__ import annotations

import errno
import os
import sys
import time

LOCK_NAME = ".real_py.lock"
"""The lock file in out_dir: flock'ed by the job writing the directory, holding its pid."""
LOCK_WAIT_S = 20.0
"""Seconds a new job waits for a lock whose launcher is gone (its ranks are exiting)."""

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


def _opens(pid: int, key: tuple[int, int]) -> bool | None:
    """Whether process `pid` has the file `key` (st_dev, st_ino) open; None: cannot tell
    (another user's process)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    except OSError:
        return None
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == key:
            return True
    return False


def _holds(pid: int | None, key: tuple[int, int]) -> bool:
    """Whether the job whose pid the lock file names still runs: alive, with the lock file open
    (a pid taken by another process since is no job)."""
    if not _alive(pid):
        return False
    opens = _opens(pid, key)
    return True if opens is None else opens


def _process(pid: int) -> str:
    """ "pid 4711 (real_py-rank2: python -m real_py train ...)"."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
    except OSError:
        return f"pid {pid}"
    return f"pid {pid} ({comm}: {cmd[:200]})" if cmd else f"pid {pid} ({comm})"


def _orphan_lock(out_dir: str, path: str, pid: int | None, what: str, key: tuple[int, int]) -> str:
    """The refusal for a lock whose job is gone: the processes that hold it instead."""
    job = (
        f"the job that took it (pid {pid}{f': {what}' if what else ''}) is gone"
        if pid
        else "its lock file names no job"
    )
    openers = [p for p in (int(d) for d in os.listdir("/proc") if d.isdigit()) if _opens(p, key)]
    if not openers:
        return (
            f"out_dir {out_dir} is locked, but by no running job: {job}, and no process visible "
            f"here holds {path} (another user's, or on another machine); find it with "
            f"`fuser -v {path}`, or choose another --out-dir"
        )
    them = "them" if len(openers) > 1 else "it"
    return (
        f"out_dir {out_dir} is locked by {', '.join(map(_process, openers))}, "
        f"not by a running job: {job}; stop {them} (kill {' '.join(map(str, openers))}), "
        "or choose another --out-dir"
    )


def lock_out_dir(out_dir: str, wait_s: float = LOCK_WAIT_S) -> int:
    """Take out_dir's lock for this process (and the ranks it starts); ValueError naming the
    holder's pid when another job holds it. A lock whose job is gone (its launcher killed: its
    ranks are exiting) is waited for up to `wait_s` seconds, then refused naming the processes
    that still hold it. Creates out_dir if needed."""
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
            st = os.fstat(fd)
            os.close(fd)
            key = (st.st_dev, st.st_ino)
            pid, what = _holder(path)
            if _holds(pid, key):
                raise ValueError(
                    f"out_dir {out_dir} is in use by another job: pid {pid}"
                    f"{f' ({what})' if what else ''}; wait for it to end or stop it "
                    f"(kill {pid}), or choose another --out-dir"
                ) from None
            if time.monotonic() > deadline:
                raise ValueError(_orphan_lock(out_dir, path, pid, what, key)) from None
            if not told:
                print(
                    f"out_dir {out_dir}: waiting for the processes that still hold the lock of a "
                    f"gone job{f' (pid {pid})' if pid else ''} to exit",
                    file=sys.stderr,
                    flush=True,
                )
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


def held_fd() -> int | None:
    """The fd of this process's lock (None: none held)."""
    return _lock["fd"]


def keep_file() -> None:
    """Make the next `unlock` leave the lock file in place: a rank of the job is still alive and
    holds its lock, and a new job must find that file (not a fresh one) to wait for it."""
    _lock["keep_file"] = True


__all__ = ["lock_out_dir", "unlock", "held_fd", "keep_file", "LOCK_NAME", "LOCK_WAIT_S"]
