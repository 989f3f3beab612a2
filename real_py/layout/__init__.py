"""Parallel layouts (dp, tp, pp over an explicit list of global ranks) and shard flat-buffer
layouts.

  grid.py      `Layout`: the axes, ranks and their order, pipeline partition rule, dp sharding;
               rank <-> coordinates
  fits.py      argument checks: `require_spec`, `require_layout`, `check_fits` (does a model fit)
  stages.py    the pipeline partition: `stage_layer_ranges`, `param_stages`
  shards.py    the flat buffer of a (stage, tp rank) shard (`shard_layout`) and of an expert shard
               (`expert_shard_layout`)
  dp_shard.py  a dp replica's piece of a shard under dp_shard "dim0" (FSDP2) or "flat" (ZeRO-3 /
               FSDP1): `dp_shard_layout`

The shard of (pp stage s, tp rank k) is one flat buffer holding the stage's parameters in forward
key order, each a contiguous range starting on an ALIGN_BYTES boundary; every dp replica holds the
same shard unless the layout is dp-sharded.
"""

from .dp_shard import DpPiece, DpShardLayout, dp_shard_layout
from .fits import check_experts, check_fits, require_layout, require_spec
from .grid import DP_SHARD, MAX_RANKS, PARTITIONS, Layout
from .shards import ShardEntry, ShardLayout, expert_shard_layout, shard_layout
from .stages import param_stages, stage_layer_ranges

__all__ = [
    "Layout",
    "DP_SHARD",
    "MAX_RANKS",
    "PARTITIONS",
    "require_spec",
    "require_layout",
    "check_fits",
    "check_experts",
    "stage_layer_ranges",
    "param_stages",
    "ShardEntry",
    "ShardLayout",
    "shard_layout",
    "expert_shard_layout",
    "DpPiece",
    "DpShardLayout",
    "dp_shard_layout",
]
