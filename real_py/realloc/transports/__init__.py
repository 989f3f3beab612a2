"""Transports: move one round's chunks between ranks (interface in base.py).

  base.py       Transport / Handle / TransferError, the round contract every transport keeps
  inprocess.py  InProcessHub: all ranks as threads of one process (tests, benchmarks)
  dist.py       DistTransport: torch.distributed (gloo, NCCL), p2p rounds or broadcasts
  nccl.py       CupyNcclTransport: NCCL through cupy for jobs that share no process group
  ipc.py        IpcTransport: CUDA IPC between processes of one node (one-pass moves)
"""

from .base import Handle, Recvs, Sends, TransferError, Transport
from .dist import DistTransport
from .inprocess import InProcessHub, InProcessTransport
from .ipc import IpcTransport
from .nccl import CupyNcclTransport

__all__ = ["CupyNcclTransport", "DistTransport", "Handle", "InProcessHub", "InProcessTransport", "IpcTransport", "Recvs",
           "Sends", "TransferError", "Transport"]
