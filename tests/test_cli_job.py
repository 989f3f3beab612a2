# Checks that `python -m real_py train` runs as one unit: its ranks die with the launcher and write
# nothing after it, a run directory is locked by the job writing it (a second job or a resume is
# refused naming the holder's pid), a failure on one rank ends the job with one line naming rank,
# step, call and exception (and the log with the full trace), a rank stuck in the reward function is
# named within seconds, Ctrl-C ends the job with one line, and the job's store listens on the
# loopback only.
# A failure points to real_py/launch/job.py (launcher, watcher), agent.py (launch config, loopback
# rendezvous), lock.py (out_dir lock), rank.py (inside a rank: death with the launcher, failure
# records), report.py (root cause), real_py/liveness.py (activity, record_failure) or
# real_py/cli/train.py (run, _spmd).
"""Each job runs in its own session (start_new_session) with a marker in its environment, so the
test finds every process of the job (launcher and ranks) in /proc whatever the launcher does."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from real_py.cli import main
from real_py.cli import train as cli_train
from real_py.launch import lock as L
from real_py.launch import rank as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD = """import os, time
def score(prompts, responses, answer):
    if any(responses) and os.environ.get("RANK") == "2":
        {body}
    return [0.0] * len(responses)
"""


def _job_pids(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment holds REAL_PY_TEST_JOB=<marker>."""
    want, out = f"REAL_PY_TEST_JOB={marker}".encode(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(d))
        except OSError:
            pass
    return out


class Job:
    """`python -m real_py train ARGS` in its own session; stdout read line by line, stderr to a
    file."""

    def __init__(self, tmp_path, args, env=None):
        self.marker, self.err_path = f"{tmp_path}-{time.monotonic_ns()}", tmp_path / "stderr.txt"
        self.err = open(self.err_path, "w")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "real_py", "train", "--no-progress", *args],
            cwd=ROOT,
            env=dict(os.environ, REAL_PY_TEST_JOB=self.marker, **(env or {})),
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            start_new_session=True,
        )
        self.out = []

    def until(self, prefix: str) -> str:
        for line in self.p.stdout:
            self.out.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(
            f"no line {prefix!r}; stdout:\n{''.join(self.out)[-3000:]}\n"
            f"stderr:\n{self.stderr()[-3000:]}"
        )

    def finish(self, timeout=240) -> int:
        self.out += self.p.stdout.readlines()
        return self.p.wait(timeout)

    def stderr(self) -> str:
        self.err.flush()
        return self.err_path.read_text()

    def kill(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        for pid in _job_pids(self.marker):
            os.kill(pid, signal.SIGKILL)
        self.p.wait()
        self.err.close()


def _files(out_dir: str) -> dict:
    """Every file under out_dir but the logs folder: size and mtime."""
    got = {}
    for d, dirs, files in os.walk(out_dir):
        dirs[:] = [x for x in dirs if x != "logs"]
        for f in files:
            st = os.stat(os.path.join(d, f))
            got[os.path.relpath(os.path.join(d, f), out_dir)] = (st.st_size, st.st_mtime_ns)
    return got


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill", ["group", "launcher"])
def test_killed_launcher_takes_its_ranks(tmp_path, kill):
    """SIGKILL of the job's process group (or of the launcher alone) after its first step: within
    seconds no process of the job is left, and nothing more is written (no checkpoint, no
    metrics line)."""
    out = str(tmp_path / "run")
    job = Job(tmp_path, ["--out-dir", out, "--steps", "200", "save_every=1"])
    try:
        job.until("step 1 |")
        assert len(_job_pids(job.marker)) >= 5, "launcher and 4 ranks expected"
        if kill == "group":
            os.killpg(job.p.pid, signal.SIGKILL)
        else:
            os.kill(job.p.pid, signal.SIGKILL)
        t = time.monotonic()
        job.p.wait()
        # The ranks die with the launcher (PR_SET_PDEATHSIG, a pidfd watch): well under a second
        # idle; 20 s leaves a loaded 2-core machine room to reap four torch processes, while ranks
        # that outlive their launcher go on with the job's 200 steps (minutes), so they still fail.
        while _job_pids(job.marker) and time.monotonic() - t < 20:
            time.sleep(0.05)
        left = _job_pids(job.marker)
        took = time.monotonic() - t
        assert not left, f"{len(left)} processes of the job still run {took:.1f} s after the kill"
        before = _files(out)
        time.sleep(3)
        assert _files(out) == before, "files written after the launcher was killed"
    finally:
        job.kill()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_locked_run_dir_and_ctrl_c(tmp_path, capsys, monkeypatch):
    """While a job runs, a second train on its out_dir (plain, --resume, --overwrite) is refused
    before launch, naming the job's pid, and changes nothing; Ctrl-C (SIGINT to the job's
    process group, as a terminal sends it) ends the job with one line and no traceback; then
    the directory is free."""
    out = str(tmp_path / "run")
    job = Job(tmp_path, ["--out-dir", out, "--steps", "200", "save_every=0"])
    launched = []
    monkeypatch.setattr(cli_train, "_launch", lambda args, world: launched.append(world) or 0)
    try:
        job.until("step 1 |")
        for extra in ([], ["--resume"], ["--overwrite"]):
            with pytest.raises(SystemExit) as e:
                main(["train", "--out-dir", out, "--steps", "3"] + extra)
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"is in use by another job: pid {job.p.pid}" in err, err
        assert not launched and os.path.exists(os.path.join(out, "metrics.jsonl"))
        job.until("step 3 |")  # the job went on
        os.killpg(job.p.pid, signal.SIGINT)
        assert job.finish(60) == 130
        err = job.stderr()
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith(
            "interrupted (SIGINT): ended the job's 4 ranks"
        ), err
        assert "Traceback" not in err + "".join(job.out)
        assert not _job_pids(job.marker)
    finally:
        job.kill()
    assert main(["train", "--out-dir", out, "--steps", "3", "--overwrite"]) == 0 and launched == [4]


def _copy_task(tmp_path, body: str) -> str:
    (tmp_path / "reward.py").write_text(REWARD.format(body=body))
    return os.path.join(ROOT, "configs", "copy_task", "ppo.yaml")


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("launch", ["fork", "spawn"])
def test_reward_error_is_one_line(tmp_path, launch):
    """The reward function raises on rank 2 at the first real responses: the job ends with one
    line naming rank 2, step 0, call rew_inf and the ValueError, and rank 2's log (with the
    traceback); the other ranks' consequent errors stay in their logs."""
    cfg = _copy_task(tmp_path, 'raise ValueError("cannot score response")')
    out = str(tmp_path / "run")
    job = Job(
        tmp_path,
        [
            "--config",
            cfg,
            "--out-dir",
            out,
            "--steps",
            "3",
            "--timeout",
            "60",
            f"reward.path={tmp_path / 'reward.py'}:score",
        ],
        env={"REAL_PY_LAUNCH": launch},
    )
    try:
        assert job.finish() == 1
        err = job.stderr()
        log = os.path.join(out, "logs", "rank2.log")
        last = err.strip().splitlines()[-1]
        assert last.startswith(
            "train failed: rank 2, step 0, call rew_inf: ValueError: cannot score response"
        ), err
        assert f"full trace: {log}" in last, last
        assert "Traceback" not in err and "Root Cause" not in err, err[-3000:]
        assert len((err + "".join(job.out)).splitlines()) < 40
        text = open(log).read()
        assert "Traceback" in text and "cannot score response" in text
        rec = json.load(open(os.path.join(out, "logs", "failed_rank2.json")))
        assert (
            rec["exception"] == "ValueError"
            and not rec["consequent"]
            and "reward function" in rec["user"]
        )
    finally:
        job.kill()


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_reward_hang_is_named(tmp_path):
    """The reward function hangs on rank 2: a warning names rank 2 inside the reward function
    within seconds (REAL_PY_USER_WARN_S=3), long before the transfer timeout (20 s) ends the job;
    when the peers give up, the one line names rank 2 inside the reward function, and rank 2's
    log holds its stack in the function."""
    cfg = _copy_task(tmp_path, "time.sleep(3600)")
    out = str(tmp_path / "run")
    job = Job(
        tmp_path,
        [
            "--config",
            cfg,
            "--out-dir",
            out,
            "--steps",
            "3",
            "--timeout",
            "20",
            f"reward.path={tmp_path / 'reward.py'}:score",
        ],
        env={"REAL_PY_USER_WARN_S": "3"},
    )
    try:
        job.until("launching")
        t0 = time.monotonic()
        seen = None
        while job.p.poll() is None and time.monotonic() - t0 < 120:
            if seen is None and "rank 2 has been inside the reward function" in job.stderr():
                seen = time.monotonic() - t0
            time.sleep(0.1)
        ended = time.monotonic() - t0
        assert job.finish() == 1
        err = job.stderr()
        warn = err.index("real_py: rank 2 has been inside the reward function")
        last = err.strip().splitlines()[-1]
        # Measured against the job's end, not against "launching" (the ranks' start and the first
        # generation take a while on a loaded machine): the warning is due 3 s into the hang, the
        # peers give up 20 s into it, so a warning that only comes with the give-up fails here.
        assert warn < err.index(last) and seen is not None and ended - seen > 8, (seen, ended, err)
        assert last.startswith("train failed: rank 2 has been inside the reward function"), err
        assert "step 0, call rew_inf" in last and "gave up waiting" in last, last
        assert (
            "in score" in open(os.path.join(out, "logs", "rank2.log")).read()
        )  # faulthandler stack
    finally:
        job.kill()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_ranks_start_without_validating_again_and_exit_fast(tmp_path):
    """The config is validated once, by the launcher: the reward function's check call (empty
    responses, config.validate) runs once, not once more per rank; and the command ends
    within a couple of seconds of its summary line (no interpreter teardown, no torchrun command
    in a child process). The ranks were started by torchrun's elastic agent in the launcher
    (its one-node rendezvous in logs/torchrun.log; job.json lists the ranks and the fork start)."""
    (tmp_path / "reward.py").write_text(
        "import os\n"
        "def score(prompts, responses, answer):\n"
        "    if len(responses) <= 2 and not any(responses):  # config.validate's check call\n"
        f"        open({str(tmp_path / 'checks')!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "    return [0.0] * len(responses)\n"
    )
    cfg = os.path.join(ROOT, "configs", "copy_task", "ppo.yaml")
    out = str(tmp_path / "run")
    job = Job(
        tmp_path,
        [
            "--config",
            cfg,
            "--out-dir",
            out,
            "--steps",
            "1",
            f"reward.path={tmp_path / 'reward.py'}:score",
        ],
    )
    try:
        job.until("summary ")
        t = time.monotonic()
        assert job.finish() == 0, job.stderr()[-3000:]
        took = time.monotonic() - t
        agent = open(os.path.join(out, "logs", "torchrun.log")).read()
        assert "hosts the job's TCPStore on 127.0.0.1:" in agent, agent[-2000:]
        info = json.load(open(os.path.join(out, "logs", "job.json")))
        assert (
            info["launcher"] == job.p.pid
            and info["start_method"] == "fork"
            and len(info["ranks"]) == 4
        )
        checks = (tmp_path / "checks").read_text().split()
        assert checks == [str(job.p.pid)], f"the reward function's validation call ran in {checks}"
        # About 0.2 s idle (bench/results/startup_cpu2_20261206.md); the interpreter teardown this
        # guards against took 6.4 s there (c77c110), so 5 s holds on a loaded machine and still
        # fails on it. A torchrun command in a child (2.4 s) is caught above: job.json names this
        # launcher.
        assert took < 5, f"the command took {took:.1f} s to exit after its summary"
    finally:
        job.kill()


def test_lock_holder_named_and_dead_holder_waited_for(tmp_path, monkeypatch):
    """lock_out_dir: a live holder (its pid in the lock file) is refused by pid at once; a holder
    whose process is gone is waited for until its lock goes (its ranks exiting), then taken, and
    refused after the wait naming the process that holds the lock (not a job that is gone);
    unlock removes the file."""
    d = str(tmp_path / "run")
    os.makedirs(d)
    path = os.path.join(d, L.LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()} python -m real_py train\n".encode())
    t = time.monotonic()
    with pytest.raises(
        ValueError, match=f"in use by another job: pid {os.getpid()} \\(python -m real_py train\\)"
    ):
        L.lock_out_dir(d, wait_s=30)
    assert time.monotonic() - t < 10, (
        "a live holder must be refused at once, not after the 30 s wait"
    )
    os.ftruncate(fd, 0)
    os.pwrite(fd, b"999999999 python -m real_py train\n", 0)  # no such pid: the launcher is gone
    with pytest.raises(ValueError) as e:
        L.lock_out_dir(d, wait_s=0.3)
    assert "in use by another job" not in str(e.value) and "kill 999999999" not in str(e.value), (
        e.value
    )
    assert f"is locked by pid {os.getpid()} (" in str(e.value), e.value  # what holds it
    assert "the job that took it (pid 999999999: python -m real_py train) is gone" in str(e.value)
    assert f"kill {os.getpid()})" in str(e.value), e.value
    threading.Timer(0.5, os.close, [fd]).start()  # its last rank exits
    L.lock_out_dir(d, wait_s=10)
    try:
        assert open(path).read().startswith(f"{os.getpid()} ")
    finally:
        L.unlock()
    assert not os.path.exists(path) and os.path.isdir(d)


def test_failure_record_finds_the_cause():
    """failure_record: below the runtime's wrapper, the user's error is not consequent; a
    transfer error is, and the silent peer it names is read."""
    from real_py.realloc.transports.base import TransferError

    def wrapped(inner):
        try:
            try:
                raise inner
            except Exception as e:
                raise RuntimeError(f"rank 2, step 0, call rew_inf: {type(e).__name__}: {e}") from e
        except RuntimeError as e:
            return e

    rec = R.failure_record(wrapped(ValueError("cannot score response")), 2)
    assert (rec["exception"], rec["message"], rec["consequent"]) == (
        "ValueError",
        "cannot score response",
        False,
    )
    rec = R.failure_record(
        wrapped(
            TransferError(
                "rank 0: round 1/3: peer rank 2 is silent: no heartbeat "
                "for 6.1 s (process stopped or hung), while waiting"
            )
        ),
        0,
    )
    assert rec["consequent"] and rec["silent_peer"] == 2 and rec["exception"] == "TransferError"


def _ended_job(tmp_path, codes: dict, records: dict, ended: dict | None = None):
    """A launcher's job after its end, as the watcher and the agent left it: `codes` rank -> exit
    code (negative: signal), `records` rank -> failure record; no process is started."""
    from real_py.launch import job as J

    jb = J._Job(4, str(tmp_path), None, True)
    t = time.time()
    for rk in jb.ranks:
        rk.pid = 1000 + rk.rank
        rk.exit_code = codes.get(rk.rank)
        rk.ended_at = (ended or {}).get(rk.rank, t + 0.01 * rk.rank)
        rk.killed = rk.exit_code is None
    jb.failure_records = records
    return jb


def test_root_cause_is_no_rank_the_agent_ended(tmp_path, capsys):
    """A rank that dies (exit 3, no record) makes torchrun's agent SIGTERM the others. When the
    watcher sees the SIGTERMed ranks end before the first one (it was busy, or the agent reaped
    the first one before it told its pid), the line still names the rank that died first; and a
    Watchdog's record (consequent, the silent peer only in its message) names the stopped rank,
    not a rank the agent's SIGTERM ended after the Watchdog's exit."""
    from real_py.launch.report import cause, report

    t = time.time()
    jb = _ended_job(
        tmp_path, {0: -15, 1: 3, 2: -15, 3: -15}, {}, ended={0: t, 1: t + 0.5, 2: t, 3: t}
    )
    assert cause(jb)[:2] == (1, "rank 1 exited with code 3 (last reported: start-up)")
    jb = _ended_job(
        tmp_path, {0: -15, 1: None, 2: -15, 3: -15}, {}, ended={0: t, 1: None, 2: t, 3: t}
    )
    jb.ranks[1].killed = False
    jb._agent_failures(
        {1: types.SimpleNamespace(local_rank=1, exitcode=3)}
    )  # the agent reaped it first
    assert jb.ranks[1].ended_at is None and cause(jb)[0] == 1
    dog = {
        "rank": 0,
        "time": t,
        "where": "rank 0, step 1, call actor_train",
        "exception": "SilentPeer",
        "message": "rank 0, step 1, call actor_train: peer rank 2 is silent: no heartbeat for "
        "9.0 s (process stopped or hung); a blocked collective cannot be given up, so this "
        "process exits",
        "consequent": True,
    }
    jb = _ended_job(tmp_path, {0: 75, 1: -15, 2: None, 3: -15}, {0: dog})
    jb.ranks[2].state_at_kill = "T"
    assert report(jb) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        "train failed: rank 2 was stopped (process state T: SIGSTOP or a debugger)"
    ), line
    assert "named silent by rank 0" in line, line
    jb = _ended_job(
        tmp_path, {0: -15, 1: -15, 2: -15, 3: -15}, {}
    )  # nothing else: the first one ended
    assert cause(jb)[:2] == (0, "rank 0 was killed by signal SIGTERM (last reported: start-up)")


def test_error_from_user_code_is_no_consequence(monkeypatch):
    """An error raised by user code (a reward function's "Read timed out") is the rank's own,
    whatever its words: not consequent, and the root cause before a peer's transfer error."""
    from real_py import liveness
    from real_py.launch.report import cause
    from real_py.realloc.transports.base import TransferError

    monkeypatch.setitem(liveness._doing, "failed_user", "the reward function reward.py:score")
    rec = R.failure_record(TimeoutError("reward server: Read timed out"), 2)
    assert rec["consequent"] is False and rec["user"] == "the reward function reward.py:score"
    monkeypatch.setitem(liveness._doing, "failed_user", None)
    peer = R.failure_record(TransferError("rank 0: round 1/3: recv from peer rank 2 timed out"), 0)
    assert peer["consequent"] is True
    peer["time"] = rec["time"] - 1  # the peer's record even came first
    jb = types.SimpleNamespace(failure_records={0: peer, 2: rec}, ranks=[], num_ranks=4)
    assert cause(jb)[0] == 2


def _watching_child(launcher, pidfd_open=None, report_fd=None) -> int:
    """Fork a process that runs the rank's launcher watch on `launcher` (os.pidfd_open replaced
    by `pidfd_open`), writes "watching" to `report_fd`, and would run 10 s more."""
    pid = os.fork()
    if pid:
        return pid
    try:
        if pidfd_open is not None:
            os.pidfd_open = pidfd_open
        R._watch_launcher(launcher)
        if report_fd is not None:
            os.write(report_fd, b"watching\n")
        time.sleep(10)
    finally:
        os._exit(0)


def _exit_code(pid: int, timeout: float = 5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_launcher_watch_without_a_pidfd_of_the_launcher():
    """A rank whose launcher is gone before it takes its pidfd exits at once (EXIT_ORPHANED):
    pidfd_open's ESRCH, or a launcher pid that names another live process by then (never watched
    instead); without pidfds the rank polls its parent and exits soon after the parent goes."""
    gone = 2**22 + 12345  # above pid_max: ESRCH
    assert _exit_code(_watching_child(gone)) == R.EXIT_ORPHANED
    # The launcher's pid is taken by another process (here the test runner's parent: alive, not
    # the rank's parent): watching it would keep the rank running.
    assert _exit_code(_watching_child(os.getppid())) == R.EXIT_ORPHANED

    def no_pidfd(pid):
        raise OSError(38, "Function not implemented")

    r, w = os.pipe()
    middle = os.fork()  # the launcher: parent of the rank
    if middle == 0:
        try:
            os.close(r)
            _watching_child(os.getpid(), no_pidfd, w)
            time.sleep(10)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        assert f.readline() == b"watching\n"  # running under its live launcher
        os.kill(middle, signal.SIGKILL)
        os.waitpid(middle, 0)
        t = time.monotonic()
        # The rank polls its parent every 0.1 s; one that outlives its launcher runs its 10 s
        # more: 5 s holds on a loaded machine and still tells the two apart.
        assert f.read() == b"" and time.monotonic() - t < 5, "the rank outlived its launcher"


def test_lock_of_a_gone_job_names_what_holds_it(tmp_path):
    """A lock file naming a pid that another process took since (alive, without the lock file
    open), or naming no pid at all, is no running job: lock_out_dir waits, then names the process
    that holds the lock."""
    d = str(tmp_path / "run")
    os.makedirs(d)
    fd = os.open(os.path.join(d, L.LOCK_NAME), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        for text in (f"{os.getppid()} python -m real_py train\n", "garbage\n"):
            os.ftruncate(fd, 0)
            os.pwrite(fd, text.encode(), 0)
            t = time.monotonic()
            with pytest.raises(ValueError) as e:
                L.lock_out_dir(d, wait_s=0.3)
            msg = str(e.value)
            assert time.monotonic() - t >= 0.3, "refused at once, as if a live job held it"
            assert (
                "in use by another job" not in msg and f"is locked by pid {os.getpid()} (" in msg
            ), msg
        assert "its lock file names no job" in msg, msg
    finally:
        os.close(fd)


_LAUNCHER_ENDS: dict = {}
"""The launcher's own ends of the job's pipes ("pipe:[inode]"), noted before it starts the ranks."""


def _fd_table() -> dict:
    """fd -> (link, open for reading?, close-on-exec?) of this process."""
    got = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            with open(f"/proc/self/fdinfo/{name}") as f:
                flags = int(f.read().split("flags:")[1].split()[0], 8)
        except OSError:
            continue
        got[int(name)] = (
            link,
            flags & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR),
            bool(flags & 0o2000000),
        )
    return got


def _report_fds(path: str, logs: str, lock_file: str) -> int:
    """A rank's target: what it holds of the launcher's (see test_ranks_hold_only_their_own_fds)."""
    table = _fd_table()
    pid = (
        os.fork()
    )  # a process the rank starts (a data loader worker, a pool of the reward function)
    if pid == 0:
        os._exit(10 + sum(link == lock_file for link, _, _ in _fd_table().values()))
    child_locks = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) - 10
    out = {
        "logs": [link for link, _, _ in table.values() if link.startswith(logs + os.sep)],
        "pidfds": [
            fd
            for fd, (link, _, _) in table.items()
            if link == "anon_inode:[pidfd]" and fd != R._state["pidfd"]
        ],
        "launcher_ends": [
            link
            for link, reads, _ in table.values()
            if reads and link in _LAUNCHER_ENDS.get("ends", ())
        ],
        "locks": [cloexec for link, _, cloexec in table.values() if link == lock_file],
        "child_locks": child_locks,
    }
    with open(os.path.join(path, f"fds{os.environ['RANK']}.json"), "w") as f:
        json.dump(out, f)
    return 0


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fork,lock_on_stdin",
    [(True, False), (False, False), (True, True)],
    ids=["fork", "spawn", "fork-lock-on-fd0"],
)
def test_ranks_hold_only_their_own_fds(tmp_path, monkeypatch, fork, lock_on_stdin):
    """A rank holds nothing of the launcher's but its own pipe ends and the run directory's lock:
    no rank's log, no torchrun.log, none of the launcher's pipe ends or pidfds; the lock once,
    close-on-exec, and a process the rank forks does not inherit it (it could outlive the rank
    and keep the directory locked). Also when the launcher's stdin was closed and the lock took
    fd 0 (which the rank's own stdin replaces)."""
    import functools

    from real_py.launch import job as J

    out = str(tmp_path / "run")
    pipes = J._Job._pipes

    def noting(self):
        plumbing = pipes(self)
        _LAUNCHER_ENDS["ends"] = {
            f"pipe:[{os.fstat(fd).st_ino}]"
            for fd in list(self.output_pipes) + list(self.hello_pipes)
        }
        return plumbing

    monkeypatch.setattr(J._Job, "_pipes", noting)
    stdin = os.dup(0) if lock_on_stdin else None
    if stdin is not None:
        os.close(0)
    try:
        assert L.lock_out_dir(out) == 0 or stdin is None
        logs = os.path.realpath(os.path.join(out, "logs"))
        target = functools.partial(
            _report_fds, str(tmp_path), logs, os.path.realpath(os.path.join(out, L.LOCK_NAME))
        )
        assert J.launch(2, out, target, fork=fork) == 0
    finally:
        L.unlock()
        if stdin is not None:
            os.dup2(stdin, 0)
            os.close(stdin)
        _LAUNCHER_ENDS.clear()
    for r in range(2):
        got = json.load(open(tmp_path / f"fds{r}.json"))
        assert got == {
            "logs": [],
            "pidfds": [],
            "launcher_ends": [],
            "locks": [True],
            "child_locks": 0,
        }, (r, got)


def _tcp_listeners(pid: int) -> list[str]:
    """ "address:port" of every TCP socket process `pid` listens on (from /proc/net/tcp and
    tcp6)."""
    inodes = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                addr, port = cols[1].split(":")
                ip = (
                    ".".join(str(b) for b in reversed(bytes.fromhex(addr)))
                    if len(addr) == 8
                    else ":".join(addr[i : i + 4] for i in range(0, 32, 4))
                )
                out.append(f"{ip}:{int(port, 16)}")
    return out


def _report_store(path: str) -> int:
    """A rank's target: the ranks' store works (a gloo group over it), and what the launcher
    (this rank's parent, the agent's process) listens on."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    with open(os.path.join(path, f"store{os.environ['RANK']}.json"), "w") as f:
        json.dump(
            {
                "sum": t.item(),
                "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])],
                "listeners": _tcp_listeners(os.getppid()),
            },
            f,
        )
    return 0


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fork", [True, False], ids=["fork", "spawn"])
def test_the_jobs_store_listens_on_the_loopback_only(tmp_path, fork):
    """The launcher's only listening socket is the store the ranks use, bound to 127.0.0.1 (torch's
    own rendezvous backends listen on every interface, a second store included)."""
    import functools

    from real_py.launch import job as J

    out = str(tmp_path / "run")
    L.lock_out_dir(out)
    try:
        assert J.launch(2, out, functools.partial(_report_store, str(tmp_path)), fork=fork) == 0
    finally:
        L.unlock()
    for r in range(2):
        got = json.load(open(tmp_path / f"store{r}.json"))
        addr, port = got["master"]
        assert got["sum"] == 2.0 and addr == "127.0.0.1", (r, got)
        assert got["listeners"] == [f"127.0.0.1:{port}"], (r, got)


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_launcher_output_into_the_logs_folder(tmp_path):
    """The launcher's stdout and stderr are a file in <out_dir>/logs/
    (`train ... > run/logs/console.log 2>&1`): one that --overwrite deletes under it, then a live
    one on --resume. The ranks write into their own pipes, and the job trains."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    for extra, steps in (["--overwrite"], "1"), (["--resume"], "2"):
        with open(out / "logs" / "console.log", "w+") as f:
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "real_py",
                    "train",
                    "--no-progress",
                    "--out-dir",
                    str(out),
                    "--steps",
                    steps,
                    *extra,
                ],
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                code = p.wait(90)
            except subprocess.TimeoutExpired:
                code = "no end within 90 s"
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            f.seek(0)
            text = f.read()
        assert code == 0 and f"summary (steps 1-{steps}" in text, (extra, code, text[-3000:])


def _note_start(path: str, logs: str) -> int:
    """A rank's target: which ranks job.json lists as started when this rank's job begins."""
    try:
        with open(os.path.join(logs, "job.json")) as f:
            started = json.load(f)["ranks"]
    except OSError:
        started = None
    with open(os.path.join(path, f"start{os.environ['RANK']}.json"), "w") as f:
        json.dump(started, f)
    return 0


def _launch_noting_start(tmp_path, n: int) -> int:
    """Exit code of an in-process forked job of `n` ranks running _note_start."""
    import functools

    from real_py.launch import job as J

    out = str(tmp_path / "run")
    L.lock_out_dir(out)
    try:
        return J.launch(
            n,
            out,
            functools.partial(_note_start, str(tmp_path), os.path.join(out, "logs")),
            fork=True,
        )
    finally:
        L.unlock()


def _slow_forks(monkeypatch, secs: float, after: int = 0):
    """The agent's forks of the ranks after the first `after` take `secs` seconds longer."""
    import multiprocessing.context as mpc

    real, n = mpc.ForkProcess._Popen, [0]

    def slow(process_obj):
        n[0] += 1
        if n[0] > after:
            time.sleep(secs)
        return real(process_obj)

    monkeypatch.setattr(mpc.ForkProcess, "_Popen", staticmethod(slow))


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_no_rank_runs_the_job_before_all_are_forked(tmp_path, monkeypatch):
    """A rank's job (its store connection first) begins only once the launcher has heard every
    rank start: the agent forks the ranks from a process with threads, among them the store's,
    which resolves each connecting rank's address (getnameinfo); a rank forked meanwhile inherits
    glibc's resolver lock held and hangs in its own first getnameinfo, in init_process_group.
    With the forks 0.4 s apart, every rank finds all four listed as started when its job begins."""
    _slow_forks(monkeypatch, 0.4, after=1)
    assert _launch_noting_start(tmp_path, 4) == 0
    for r in range(4):
        started = json.load(open(tmp_path / f"start{r}.json"))
        assert started is not None and None not in started and len(started) == 4, (r, started)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ranks_not_all_started_is_one_line(tmp_path, monkeypatch, capsys):
    """A rank whose peers do not all start within START_WAIT_S fails, named as waiting for them,
    and the job ends with that one line instead of hanging."""
    monkeypatch.setattr(R, "START_WAIT_S", 1.0)
    _slow_forks(monkeypatch, 8.0, after=1)
    assert _launch_noting_start(tmp_path, 2) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "train failed: rank 0, starting: waiting for the job's other ranks to start: "
        "RuntimeError: rank 0: the job's other ranks did not all start within 1 s"
    ), err
    assert not os.path.exists(tmp_path / "start0.json")


def test_rank_closes_the_launchers_fds_by_identity(tmp_path):
    """A forked rank closes the launcher's private fds by number and identity: a number the
    launcher closed while the agent still forked ranks, and that another file took since (a
    pidfd, the agent's pipe to the rank), stays open; a file in logs/ that is no private fd
    (torchrun.log under the agent's inherited logging handler) becomes /dev/null, not a free
    number that something else takes."""
    logs = tmp_path / "logs"
    logs.mkdir()
    gone = os.open(tmp_path / "hello", os.O_CREAT | os.O_WRONLY)
    stale = R.fd_key(gone)
    os.close(gone)
    reused = os.open(tmp_path / "other", os.O_CREAT | os.O_WRONLY)  # the closed fd's number
    r, w = os.pipe()
    agent_log = os.open(logs / "torchrun.log", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        assert reused == stale[0]
        R._close_launchers(
            R.Plumbing(
                stdout=[],
                stderr=[],
                hello=[],
                lock=None,
                logs=str(logs),
                launcher_pid=os.getppid(),
                private=[stale, R.fd_key(r)],
            ),
            keep=(w, null),
            null=null,
        )
        assert os.readlink(f"/proc/self/fd/{reused}") == str(tmp_path / "other")
        assert not os.path.exists(f"/proc/self/fd/{r}")
        assert (
            os.readlink(f"/proc/self/fd/{agent_log}") == os.devnull
            and os.write(agent_log, b"x") == 1
        )
        assert not os.get_inheritable(agent_log)
        assert not R.close_if_same(w, *stale[1:]) and R.close_if_same(*R.fd_key(w))
        assert not R.close_if_same(w, *stale[1:])  # closed already (EBADF)
    finally:
        for fd in (reused, r, w, agent_log, null):
            R._close(fd)


def test_spawned_ranks_run_the_launchers_config(tmp_path, monkeypatch):
    """A spawned rank (CUDA's start method) gets the config, checkpoint and validation the
    launcher resolved, pickled: it never reads the config file again (which may have changed
    since) nor runs the launcher's part (_config: the lock, the checkpoint sweep)."""
    import pickle

    from real_py.launch import job as J
    from real_py.rlhf import config

    got = {}
    monkeypatch.setenv("REAL_PY_LAUNCH", "spawn")
    monkeypatch.setattr(
        J, "launch", lambda world, out_dir, target, **kw: got.update(target=target, kw=kw) or 0
    )
    out = str(tmp_path / "run")
    assert main(["train", "--out-dir", out, "--steps", "2", "ppo.kl_coef=0.05"]) == 0
    assert got["kw"]["fork"] is False
    pickled = pickle.dumps(got["target"])

    def never(*a, **k):
        raise AssertionError("a spawned rank ran the launcher's part again")

    ran = {}
    monkeypatch.setattr(config, "read_yaml", never)
    monkeypatch.setattr(cli_train, "_config", never)
    monkeypatch.setattr(
        cli_train,
        "_spmd",
        lambda args, cfg, ckpt, validated=None: ran.update(cfg=cfg, validated=validated) or 0,
    )
    assert pickle.loads(pickled)() == 0  # as the spawned rank gets it and runs it
    assert ran["cfg"].steps == 2 and ran["cfg"].ppo.kl_coef == 0.05 and ran["cfg"].out_dir == out
    assert ran["validated"] is not None and ran["validated"][0].world_size == 4
