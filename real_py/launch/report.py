"""The end of a launched job in one line: its root cause among the ranks' failure records and
ends, and what the watcher says about a rank while the job runs.

    code = report(job)  # 0, or prints "train failed: ..." / "interrupted (...)" and 1 / 128+n

The root cause is, in this order: an error raised by the job's own code (a failure record that is
no consequence of a peer's failure), a rank that died (the first; not one that torchrun's agent
ended with SIGTERM after another rank's failure), a rank its peers named silent (in their records,
or in a Watchdog's message), a rank stuck in user code, a rank the agent ended, the first transfer
error.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

from .rank import EXIT_ORPHANED, record_line, silent_peer

SIG_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
"""The launcher's exit code after each signal that ends the job."""


def report(job) -> int:
    """0 when every rank succeeded; else one line on stderr (the root cause, or the signal that
    ended the job) and the exit code."""
    if job.ended_by_signal is not None:
        name = signal.Signals(job.ended_by_signal).name
        where = doing(job.ranks[0].heartbeat or {}, user=False)
        print(
            f"interrupted ({name}): ended the job's {job.num_ranks} ranks "
            f"(rank 0 was at {where}); logs in {job.logs}",
            file=sys.stderr,
            flush=True,
        )
        return SIG_EXIT.get(job.ended_by_signal, 128 + int(job.ended_by_signal))
    if all(rk.exit_code == 0 for rk in job.ranks) and not job.failure_records:
        return 0
    r, line, named = cause(job)
    others = sorted(x for x in job.failure_records if x != r and x not in named)
    tail = (
        f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too"
        if others
        else ""
    )
    where = (
        f"full trace: {os.path.join(job.logs, f'rank{r}.log')}"
        if r in job.failure_records
        else f"logs: {job.logs}"
    )
    print(f"train failed: {line} ({where}{tail})", file=sys.stderr, flush=True)
    return 1


def cause(job) -> tuple[int | None, str, list[int]]:
    """(the rank at the root, one line on it, the ranks that line already names)."""
    recs = job.failure_records
    own = sorted(
        (rec for rec in recs.values() if not rec.get("consequent")), key=lambda x: x.get("time", 0)
    )
    if own:
        rec = own[0]
        return rec["rank"], record_line(rec), []
    # Ranks that died on their own (no record): the first to end. A rank the agent reaped before
    # the watcher saw its end (code known from the agent only, end time unknown) is the one the
    # agent found failed first. A rank ended by SIGTERM was ended by the agent, which stops the
    # other workers so after the first failure (this launcher itself only ever SIGKILLs): a
    # consequence, named only when nothing else explains the failure.
    gone = [
        rk
        for rk in job.ranks
        if rk.exit_code not in (None, 0)
        and not rk.killed
        and rk.rank not in recs
        and rk.exit_code != EXIT_ORPHANED
    ]
    died = sorted(
        (rk for rk in gone if rk.exit_code != -signal.SIGTERM),
        key=lambda rk: float("-inf") if rk.ended_at is None else rk.ended_at,
    )
    if died:
        return _died(died[0])
    named: dict[int, list[int]] = {}
    for rec in recs.values():
        p = rec.get("silent_peer")
        p = (
            silent_peer(rec.get("message") or "") if p is None else int(p)
        )  # a Watchdog's record names it in text
        if p is not None:
            named.setdefault(p, []).append(rec["rank"])
    if named:
        p = max(named, key=lambda k: len(named[k]))
        rk = job.ranks[p] if 0 <= p < job.num_ranks else None
        how = "stopped responding"
        if rk is not None and rk.state_at_kill == "T":
            how = "was stopped (process state T: SIGSTOP or a debugger)"
        where = doing(rk.heartbeat) if rk is not None and rk.heartbeat else "starting"
        by = ", ".join(map(str, sorted(named[p])))
        return (
            p,
            (
                f"rank {p} {how} (last reported: {where}): no heartbeat, named silent by "
                f"rank{'s' if len(named[p]) > 1 else ''} {by}"
            ),
            named[p],
        )
    stuck = [rk for rk in job.ranks if rk.heartbeat and rk.heartbeat.get("user")]
    if stuck:
        rk = min(stuck, key=lambda k: k.heartbeat["user_since"])
        first = min(recs.values(), key=lambda x: x.get("time", 0)) if recs else None
        secs = (rk.ended_at or time.time()) - rk.heartbeat["user_since"]
        return (
            rk.rank,
            (
                f"rank {rk.rank} has been inside {rk.heartbeat['user']} for {secs:.0f} s "
                f"({doing(rk.heartbeat, user=False)})"
                + (f"; the other ranks gave up waiting ({record_line(first)})" if first else "")
            ),
            [],
        )
    stopped = sorted(
        (rk for rk in gone if rk.exit_code == -signal.SIGTERM), key=lambda rk: rk.ended_at or 0
    )
    if stopped:
        return _died(stopped[0])
    if recs:
        rec = min(recs.values(), key=lambda x: x.get("time", 0))
        return rec["rank"], record_line(rec), []
    return None, "the job ended without a failure record", []


def _died(rk) -> tuple[int, str, list[int]]:
    how = (
        f"was killed by signal {signal.Signals(-rk.exit_code).name}"
        if rk.exit_code < 0
        else f"exited with code {rk.exit_code}"
    )
    where = doing(rk.heartbeat) if rk.heartbeat else "start-up"
    last = _last_line(rk.output_tail)
    line = f"rank {rk.rank} {how} (last reported: {where})" + (
        f"; its last output: {last}" if last else ""
    )
    return rk.rank, line, []


def proc_state(pid: int | None) -> str | None:
    """The process state letter in /proc (R, S, T stopped, Z, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def doing(st: dict, user: bool = True) -> str:
    """ "step 3, call rew_inf" (the rank's section, without its "rank N, " prefix) and the user
    code it is inside."""
    what = re.sub(r"^rank \d+, ", "", st.get("doing") or "starting")
    if user and st.get("user"):
        what += f", inside {st['user']} for {time.time() - st['user_since']:.0f} s"
    return what


def _last_line(tail: bytes) -> str:
    lines = [
        x.strip()
        for x in tail.decode(errors="replace").replace("\r", "\n").splitlines()
        if x.strip()
    ]
    return lines[-1][:300] if lines else ""


__all__ = ["report", "cause", "proc_state", "doing", "SIG_EXIT"]
