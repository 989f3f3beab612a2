"""torchrun's elastic agent as the launcher runs it in its own process: its launch config (one
node, no restarts, no redirection by the agent), the one-node rendezvous whose store listens on
the loopback only, its log in logs/torchrun.log, and multiprocessing's resource tracker for
spawned ranks.
"""

from __future__ import annotations

import os

MONITOR_S = 0.1
"""The agent's monitor interval: seconds between its looks at the workers."""
LOOPBACK_RDZV = "real_py-loopback"
"""The rendezvous backend name of LoopbackRendezvous in torch's handler registry."""
STORE_TIMEOUT_S = 600
"""The store server's timeout (torch's static rendezvous uses the same); every client (the
ranks, the launcher's watcher) sets its own."""


def agent_log(logs: str):
    """torchrun's agent logs into logs/torchrun.log, not onto the console."""
    import logging

    h = logging.FileHandler(os.path.join(logs, "torchrun.log"))
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in (
        "torch.distributed.elastic",
        "torch.distributed.launcher",
        "torch.multiprocessing",
        __name__,
    ):
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


def _loopback_rendezvous(params):
    """torch's rendezvous handler registry calls this for LOOPBACK_RDZV."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    class LoopbackRendezvous(RendezvousHandler):
        """The rendezvous of a one-node job: this node is node 0 of 1, and the TCPStore it hosts
        (the agent's store and, through TORCHELASTIC_USE_AGENT_STORE, the ranks') listens on
        127.0.0.1 only. torch's own backends start every TCPStore server on all interfaces
        (c10d, static; also for `torchrun --standalone`); a socket bound to the loopback and
        handed over as master_listen_fd is the one way TCPStore takes another address."""

        def __init__(self, run_id: str):
            self.run_id, self.store, self.port = run_id, None, 0

        def get_backend(self) -> str:
            return LOOPBACK_RDZV

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self):
            import datetime
            import logging
            import socket

            from torch.distributed import PrefixStore, TCPStore

            if self.store is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(("127.0.0.1", 0))
                sock.listen(128)
                self.port = sock.getsockname()[1]
                # The store owns the socket from here (detach: Python never closes it).
                self.store = TCPStore(
                    "127.0.0.1",
                    self.port,
                    None,
                    True,
                    datetime.timedelta(seconds=STORE_TIMEOUT_S),
                    master_listen_fd=sock.detach(),
                )
                logging.getLogger(__name__).info(
                    "process %d hosts the job's TCPStore on 127.0.0.1:%d only",
                    os.getpid(),
                    self.port,
                )
            return RendezvousInfo(
                PrefixStore(self.run_id, self.store),
                0,
                1,
                RendezvousStoreInfo("127.0.0.1", self.port),
            )

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

    return LoopbackRendezvous(params.run_id)


def launch_config(n: int, logs: str, fork: bool):
    """torchrun's launch of `n` ranks on this node (see real_py/launch/job.py), with the loopback
    rendezvous (registered here, once per process)."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import LaunchConfig

    rendezvous_handler_registry.register(LOOPBACK_RDZV, _loopback_rendezvous)

    class _Logs(LogsSpecs):
        """No redirection by the agent (each rank redirects into its pipes itself); the
        error file of an exception escaping a rank's entry point goes into logs/."""

        def __init__(self):
            super().__init__(log_dir=logs)

        def reify(self, envs):
            n = len(envs)
            return LogsDest(
                {r: "" for r in range(n)},
                {r: "" for r in range(n)},
                {},
                {},
                {r: os.path.join(logs, f"error_rank{r}.json") for r in range(n)},
            )

        @property
        def root_log_dir(self) -> str:
            return logs

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        logs_specs=_Logs(),
        run_id=f"real_py-{os.getpid()}",
        rdzv_backend=LOOPBACK_RDZV,
        rdzv_endpoint="",
        max_restarts=0,
        monitor_interval=MONITOR_S,
        start_method="fork" if fork else "spawn",
        local_addr="127.0.0.1",
        # SIGINT / SIGTERM / SIGHUP stay the launcher's own (one line, SIGKILL at once)
        signals_to_handle="SIGQUIT",
        shutdown_timeout=2,
    )


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


__all__ = ["agent_log", "launch_config", "start_tracker", "LOOPBACK_RDZV", "MONITOR_S"]
