"""`python -m real_py <argv>` as the ranks of a one-node job under the `torchrun` command
(`torch.distributed.run --standalone`), in a subprocess: how `bench` starts its ranks.

    code = launch_torchrun(nproc, ["bench", ...], os.environ, "processes")

Why not `job.launch` (what `train` uses): `bench`'s ranks keep no run directory (no lock, no
logs/, no failure records) and print their results themselves; run by the torchrun command, a
one-node job is the same command line a several-node job runs (docs/running.md).
"""

from __future__ import annotations


def launch_torchrun(nproc: int, argv: list[str], env: dict, what: str) -> int:
    """Run `python -m real_py <argv>` as ranks 0..nproc-1 of a single-node job under
    `torch.distributed.run --standalone` (torchrun: its c10d rendezvous, its worker monitoring:
    the first failing rank stops the others) and return the job's exit code.

    torchrun writes a torchelastic_* directory per job into TMPDIR and leaves it behind: the job
    gets a private TMPDIR that is removed afterwards. The rendezvous stores are torchrun's own
    TCPStores, which listen on every interface (only a socket bound before a store is created
    restricts it, and torchrun's backends take none; `train`'s launcher binds its own,
    launch/agent.py); on a shared host, firewall their ports or run the job in a network
    namespace. For several nodes run torchrun yourself (docs/running.md)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    tmp = tempfile.mkdtemp(prefix="real_py_job_")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "real_py",
    ] + argv
    print(f"launching {nproc} local {what}: {' '.join(cmd[1:])}", flush=True)
    try:
        return subprocess.call(cmd, env=dict(env, TMPDIR=tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["launch_torchrun"]
