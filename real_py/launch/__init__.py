"""Starting ranks: `train`'s one-node job under torchrun's elastic agent, run as one unit
(job.launch, its run-directory lock, what runs inside a rank, the one-line report of its end),
`bench`'s re-run under the torchrun command, and a function called on spawned ranks that return
values (spawn.spawn_ranks: calibration; tests through real_py.testing). Which way starts which
ranks, and why: README.md.
"""

from .job import can_fork, launch
from .lock import lock_out_dir, unlock
from .rank import failure_record, managed, run_rank
from .spawn import spawn_ranks
from .torchrun import launch_torchrun

__all__ = [
    "launch",
    "can_fork",
    "lock_out_dir",
    "unlock",
    "run_rank",
    "managed",
    "failure_record",
    "launch_torchrun",
    "spawn_ranks",
]
