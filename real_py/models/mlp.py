"""The gated MLP (SwiGLU and its activation variants) of a dense layer, also a shared expert.

y = down_proj(act(gate) * up),  gate | up = gate_up_proj(x)   (column- then row-parallel)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from .tp import ColumnParallelLinear, RowParallelLinear

ACTS = {
    "silu": functional.silu,
    "swish": functional.silu,
    "gelu": functional.gelu,
    "relu": functional.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "gelu_pytorch_tanh": lambda x: functional.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    def __init__(self, p: dict, pre: str, group, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            p[pre + "gate_up_proj.weight"], p.get(pre + "gate_up_proj.bias"), group
        )
        self.down_proj = RowParallelLinear(
            p[pre + "down_proj.weight"], group, p.get(pre + "down_proj.bias")
        )
        self.act = ACTS[act]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(self.act(gate) * up)
