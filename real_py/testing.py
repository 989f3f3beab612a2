"""Spawn gloo ranks for tests and benchmarks: file rendezvous, a timeout, errors with the rank.

    run_distributed(fn, world_size, *args, timeout=120)

runs fn(rank, world_size, *args) in `world_size` fresh processes with torch.distributed
initialized (gloo, file:// rendezvous, so no free-port races). The function must be picklable
(module level). Returns the list of per-rank return values. A worker that raises makes the call
raise RuntimeError with that rank's traceback; a worker still running after `timeout` seconds
is killed and the error names the ranks that did not finish. `allow_exit`: ranks expected to die
(fault-injection tests); their result is None if they exit without reporting. backend="nccl"
gives rank r the GPU cuda:r (CUDA tests; at most one rank per GPU).

For tests and bench/ only: the package's own code starts ranks through real_py.launch (this is
real_py.launch.spawn.spawn_ranks; real_py/launch/README.md says which way starts which ranks).
"""

from __future__ import annotations

from .launch.spawn import spawn_ranks


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    env: dict | None = None,
    allow_exit=(),
    backend: str = "gloo",
) -> list:
    """fn(rank, world_size, *args) in `world_size` spawned ranks; their return values (see the
    module docstring)."""
    return spawn_ranks(
        fn,
        world_size,
        *args,
        timeout=timeout,
        pg_timeout=pg_timeout,
        env=env,
        allow_exit=allow_exit,
        backend=backend,
    )


__all__ = ["run_distributed"]
