"""Transports: move one round's chunks between ranks (interface in base.py).

base.py       Transport / Handle / TransferError, the round contract every transport keeps
inprocess.py  InProcessHub: all ranks as threads of one process (tests, benchmarks)
dist.py       DistTransport: torch.distributed (gloo, NCCL), p2p rounds or broadcasts
nccl.py       CupyNcclTransport: NCCL through cupy for jobs that share no process group
ipc.py        IpcTransport: CUDA IPC between processes of one node (one-pass moves)
store_group.py  TransferGroup: a gloo / NCCL group of programs with default groups of their own
              (trainer ranks and vLLM workers), for DistTransport
"""

from .base import Handle, Recvs, Sends, TransferError, Transport
from .dist import DistTransport
from .inprocess import InProcessHub, InProcessTransport
from .ipc import IpcTransport
from .nccl import CupyNcclTransport
from .store_group import TransferGroup

__all__ = [
    "CupyNcclTransport",
    "DistTransport",
    "Handle",
    "InProcessHub",
    "InProcessTransport",
    "IpcTransport",
    "Recvs",
    "Sends",
    "TransferError",
    "TransferGroup",
    "Transport",
]
