"""The reallocation path: plan -> schedule -> copy plans (one pass, or pack rows -> transport ->
unpack rows per round), on shard buffers.

  shard.py        ModelShard: one rank's flat buffer with named views; ExpertShard (MoE experts);
                  tp_slice, gather_full
  plan.py         plan_realloc -> ReallocPlan (the C++ planner's exact transfer plan)
  moe_plan.py     plan_moe_realloc -> MoePlan: MoE layouts (ep, etp) as a dense part + expert parts
  rank_schedule.py one rank's rounds of the bucket schedule (chunks in rounds of bounded size, the
                  same on every rank), from C++ without the other ranks' descriptors
  options.py      MoveOptions: the move's knobs, resolved for a transport in one place
  executor.py     Executor: one rank's move of a ReallocPlan or MoePlan, one lane per part;
                  run_in_process for all ranks at once
  reallocator.py  Reallocator: the executor for a ReallocPlan, run(src, dst)
  moe_exec.py     MoeReallocator: the executor for a MoePlan,
                  run(src, src_experts, dst, dst_experts)
  expert_readdress.py expert parts' descriptors moved into the ExpertShard buffers
  direct.py       one pass (addressable transports): one compiled copy per rank and move
  rounds.py       the round loop (pack rows, transport, unpack rows, verify) over lanes
  round_layout.py one merged round's staging offsets, pack / unpack rows and messages
  inprocess_move.py InProcessMove: every rank of a plan in this process, compiled once, replayed
  offload.py      HostOffload: a shard's flat buffer out to host memory and back
  transports/     in-process, CUDA IPC, torch.distributed (gloo / NCCL), cupy-NCCL
"""

from .executor import Executor, run_in_process
from .inprocess_move import InProcessMove
from .moe_exec import MoeReallocator
from .moe_plan import MoePlan, plan_moe_realloc
from .offload import HostOffload
from .options import MoveOptions
from .plan import MODES, ReallocPlan, plan_realloc
from .rank_schedule import RankSchedule, rank_schedule
from .reallocator import Reallocator, checksum, new_destination
from .shard import ExpertShard, ModelShard, gather_full, tp_slice
from .transports import DistTransport, InProcessHub, IpcTransport, TransferError, Transport

__all__ = [
    "MODES",
    "DistTransport",
    "Executor",
    "ExpertShard",
    "HostOffload",
    "InProcessHub",
    "InProcessMove",
    "IpcTransport",
    "ModelShard",
    "MoePlan",
    "MoeReallocator",
    "MoveOptions",
    "ReallocPlan",
    "Reallocator",
    "RankSchedule",
    "TransferError",
    "Transport",
    "checksum",
    "gather_full",
    "new_destination",
    "plan_moe_realloc",
    "plan_realloc",
    "rank_schedule",
    "run_in_process",
    "tp_slice",
]
