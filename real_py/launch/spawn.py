"""A function called on spawned ranks, its per-rank return values back to the caller: how
calibration (real_py/calibrate) starts its ranks, and, through real_py.testing.run_distributed,
the tests and benchmarks.

    results = spawn_ranks(fn, world_size, *args, timeout=120)

runs fn(rank, world_size, *args) in `world_size` fresh processes (multiprocessing's spawn) with
torch.distributed initialized (gloo, file:// rendezvous in a private temporary folder, so no
free-port races). The function must be picklable (module level). Returns the list of per-rank
return values. A worker that raises makes the call raise RuntimeError with that rank's
traceback; a worker still running after `timeout` seconds is killed and the error names the
ranks that did not finish. `allow_exit`: ranks expected to die (fault-injection tests); their
result is None if they exit without reporting. backend="nccl" gives rank r the GPU cuda:r (at
most one rank per GPU).

Why not job.launch (train's job): the caller wants values back, not an exit code; there is no
run directory to lock or log into; it runs from library code (resolve_profile("cpu"), called by
`search --hardware cpu` or a user's script), on any thread, and prints nothing. Spawned, not
forked: each rank is a fresh interpreter whatever the caller has initialized (threads, CUDA).
Which way starts which ranks: README.md.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _worker(fn, rank, world_size, init_file, pg_timeout, results, args, env, backend="gloo"):
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":  # one GPU per rank, made current before NCCL picks one
            os.environ["LOCAL_RANK"] = str(rank)
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def spawn_ranks(
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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(fn, r, world_size, init_file, pg_timeout, results, args, env or {}, backend),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < world_size:
            left = deadline - time.monotonic()
            try:
                rank, ok, val = results.get(timeout=max(0.1, min(left, 1.0)))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and r not in out and r not in errors
                ]
                # A process that died without reporting (killed, segfault) is an error too.
                for r in dead:
                    time.sleep(0.2)
                    if r not in out and r not in errors and results.empty():
                        if r in allow_exit:
                            out[r] = None
                        else:
                            errors[r] = (
                                f"rank {r} exited with code {procs[r].exitcode} without a result"
                            )
                if time.monotonic() > deadline:
                    break
                continue
            (out if ok else errors)[rank] = val
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        missing = [r for r in range(world_size) if r not in out and r not in errors]
        if errors or missing:
            parts = [f"--- rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(f"--- ranks {missing} did not finish within {timeout:.0f} s (killed)")
            raise RuntimeError(
                f"spawn_ranks({getattr(fn, '__name__', fn)}, world_size={world_size}) "
                "failed:\n" + "\n".join(parts)
            )
        return [out[r] for r in range(world_size)]


__all__ = ["spawn_ranks"]
