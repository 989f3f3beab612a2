"""torchrun's elastic agent as the launcher runs it in its own process: its launch config (one
node, c10d rendezvous on 127.0.0.1, no restarts, no redirection by the agent), its log in
logs/torchrun.log, and multiprocessing's resource tracker for spawned ranks.
"""

from __future__ import annotations

import os

MONITOR_S = 0.1
"""The agent's monitor interval: seconds between its looks at the workers."""


def agent_log(logs: str):
    """torchrun's agent logs into logs/torchrun.log, not onto the console."""
    import logging

    h = logging.FileHandler(os.path.join(logs, "torchrun.log"))
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


def launch_config(n: int, logs: str, fork: bool):
    """torchrun's launch of `n` ranks on this node (see real_py/launch/job.py)."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

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

    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, logs_specs=_Logs(),
                        run_id=f"real_py-{os.getpid()}", rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                        rdzv_configs={"is_host": True}, max_restarts=0, monitor_interval=MONITOR_S,
                        start_method="fork" if fork else "spawn", local_addr="127.0.0.1",
                        # SIGINT / SIGTERM / SIGHUP stay the launcher's own (one line, SIGKILL at once)
                        signals_to_handle="SIGQUIT", shutdown_timeout=2)


def start_tracker(logs: str) -> None:
    """Start multiprocessing's resource tracker (spawn: the agent's queues and events are
    named semaphores) with its stderr in logs/torchrun.log: the command ends with os._exit,
    and the tracker's warning about the semaphores it then removes is no line of the job's."""
    from multiprocessing import resource_tracker

    fd = os.open(os.path.join(logs, "torchrun.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    saved = os.dup(2)
    try:
        os.dup2(fd, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


__all__ = ["agent_log", "launch_config", "start_tracker", "MONITOR_S"]
