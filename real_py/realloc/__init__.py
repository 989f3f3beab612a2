"""The reallocation path: plan -> schedule -> pack -> transport -> unpack, on shard buffers.

  shard.py        ModelShard: one rank's flat buffer with named views; ExpertShard (MoE experts); tp_slice, gather_full
  plan.py         plan_realloc -> ReallocPlan (the C++ planner's exact transfer plan)
  rank_schedule.py one rank's rounds of the bucket schedule (chunks in rounds of bounded size, the
                  same on every rank), from C++ without the other ranks' descriptors
  rounds.py       the round loop (pack, transport, unpack, verify) over one or several plans' lanes
  reallocator.py  Reallocator: executes a plan on one rank; run_in_process for all ranks at once
  direct.py       one-pass moves (addressable transports): one compiled copy per rank and move
  inprocess_move.py InProcessMove: every rank of a plan in this process, compiled once, replayed
  moe_plan.py     plan_moe_realloc -> MoePlan: MoE layouts (ep, etp) as a dense part + expert parts
  moe_exec.py     MoeReallocator: runs a MoePlan's parts as one schedule on a rank's ModelShard + ExpertShard
  offload.py      HostOffload: a shard's flat buffer out to host memory and back
  transports/     in-process, CUDA IPC, torch.distributed (gloo / NCCL), cupy-NCCL
"""

from .moe_plan import MoePlan, plan_moe_realloc
from .offload import HostOffload
from .plan import MODES, ReallocPlan, plan_realloc
from .reallocator import Reallocator, checksum, new_destination, run_in_process
from .rank_schedule import RankSchedule, rank_schedule
from .shard import ExpertShard, ModelShard, gather_full, tp_slice
from .inprocess_move import InProcessMove
from .transports import DistTransport, InProcessHub, IpcTransport, TransferError, Transport

__all__ = ["MODES", "DistTransport", "ExpertShard", "MoePlan", "plan_moe_realloc", "HostOffload", "InProcessHub",
           "InProcessMove", "IpcTransport", "ModelShard", "ReallocPlan", "Reallocator",
           "RankSchedule", "TransferError", "Transport", "checksum", "gather_full", "new_destination",
           "plan_realloc", "rank_schedule", "run_in_process", "tp_slice"]
