"""real_py: parameter reallocation between arbitrary TP/PP/DP layouts for RLHF.

Importing the package loads the C++ extension, which registers torch.ops.real_py.pack / unpack.
The names below are the public API (docs/embedding.md); subpackages keep their own `__all__`.
"""

from .interop.embed import layout_from_device_mesh, reallocate_flat, reallocate_params
from .layout import Layout, ShardLayout, check_fits, shard_layout, stage_layer_ranges
from .ops import pack, unpack
from .realloc.plan import ReallocPlan, plan_realloc
from .realloc.reallocator import Reallocator
from .realloc.shard import ModelShard, gather_full
from .realloc.transports import DistTransport, TransferError
from .spec import ModelConfig, ModelSpec, ParamSpec, TPRule, model_spec, preset

__all__ = [
    "Layout",
    "ShardLayout",
    "check_fits",
    "shard_layout",
    "stage_layer_ranges",
    "ReallocPlan",
    "plan_realloc",
    "Reallocator",
    "ModelShard",
    "gather_full",
    "DistTransport",
    "TransferError",
    "ModelConfig",
    "ModelSpec",
    "ParamSpec",
    "TPRule",
    "model_spec",
    "preset",
    "reallocate_params",
    "reallocate_flat",
    "layout_from_device_mesh",
    "pack",
    "unpack",
]
