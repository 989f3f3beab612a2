"""Argument parsing shared by the `python -m real_py` commands: model names and rank lists."""

from __future__ import annotations

import json
import os

from ..spec import PRESETS, ModelConfig, preset


def model_config(text: str, flag: str, **overrides) -> ModelConfig:
    """A preset name or a path to an HF config.json / checkpoint directory; ValueError listing
    the presets when it is neither."""
    if text in PRESETS:
        return preset(text, **overrides)
    if not os.path.exists(text):
        raise ValueError(f"{flag} {text!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                         "HF config.json or checkpoint directory")
    try:
        return ModelConfig.from_hf(text, **overrides)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {text!r}: not a readable HF config ({type(e).__name__}: {e})") from None


def ranks(text: str | None, flag: str) -> tuple[int, ...] | None:
    """'0,1,2' -> (0, 1, 2); None -> None."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated non-negative integers, e.g. 0,1,2,3") from None


def launch_local(nproc: int, argv: list[str], env: dict, what: str) -> int:
    """Run `python -m real_py <argv>` as ranks 0..nproc-1 on this machine (the single-node part
    of torchrun --standalone) and return the job's exit code.

    The rendezvous store listens on 127.0.0.1 only: the TCPStore server is handed a socket bound
    to loopback (a TCPStore, torchrun's included, otherwise listens on every interface whatever
    host it is given). The ranks find it through MASTER_ADDR / MASTER_PORT and
    TORCHELASTIC_USE_AGENT_STORE (connect as clients, as under torchrun's agent). Nothing is
    written to TMPDIR (torchrun leaves an empty torchelastic_* directory per job). The first
    rank that fails stops the others (SIGTERM and SIGCONT, then SIGKILL after 10 s); its exit
    code is the job's. For several nodes run torchrun yourself (see README)."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, nproc))
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.fileno(),
                          wait_for_workers=False, multi_tenant=True)
    sock.detach()  # the store owns the listening socket now and closes it
    cmd = [sys.executable, "-m", "real_py"] + argv
    print(f"launching {nproc} local {what}: {' '.join(cmd[1:])} (rendezvous on 127.0.0.1:{port})",
          flush=True)
    base = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0")
    procs: list[subprocess.Popen] = []

    def stop(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        for r in range(nproc):
            procs.append(subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r),
                                                        ROLE_RANK=str(r))))
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                r, c = bad[0]
                why = f"signal {-c}" if c < 0 else f"exit code {c}"
                print(f"error: rank {r} ended with {why}; stopping the other ranks", file=sys.stderr,
                      flush=True)
                return 128 - c if c < 0 else c
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        return 130
    finally:
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)  # a stopped rank acts on SIGTERM only once continued
        deadline = time.monotonic() + 10
        for p in alive:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        signal.signal(signal.SIGTERM, old)
        del store
