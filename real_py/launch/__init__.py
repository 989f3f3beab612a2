"""Starting ranks: `train`'s one-node job under torchrun's elastic agent, run as one unit
(job.launch, its run-directory lock, what runs inside a rank, the one-line report of its end),
and `bench`'s re-run under the torchrun command. Which way starts which ranks, and why: README.md.
"""

from .job import can_fork, launch
from .lock import lock_out_dir, unlock
from .rank import failure_record, managed, run_rank
from .torchrun import launch_torchrun

__all__ = ["launch", "can_fork", "lock_out_dir", "unlock", "run_rank", "managed", "failure_record",
           "launch_torchrun"]
