"""real_py: parameter reallocation between arbitrary TP/PP/DP layouts for RLHF.

Importing the package loads the C++ extension, which registers torch.ops.real_py.pack / unpack.
"""

from .layout import Layout, ShardLayout, check_fits, shard_layout, stage_layer_ranges
from .ops import pack, unpack
from .plan import ReallocPlan, plan_realloc
from .reallocator import Reallocator
from .shard import ModelShard, gather_full
from .spec import ModelConfig, ModelSpec, ParamSpec, TPRule, model_spec, preset

__all__ = [
    "Layout", "ShardLayout", "check_fits", "shard_layout", "stage_layer_ranges",
    "ReallocPlan", "plan_realloc", "Reallocator", "ModelShard", "gather_full",
    "ModelConfig", "ModelSpec", "ParamSpec", "TPRule", "model_spec", "preset",
    "pack", "unpack",
]
