"""Interop with what users and trainers bring: HF checkpoints, trainer state dicts, the embed API.

hf.py        HF safetensors checkpoints straight into / out of any layout's shards
adapters.py  HF / Megatron-core per-rank state dicts <-> real_py names and storage formats
embed.py     trainer-facing API: name -> tensor dicts, flat buffers, DeviceMesh -> Layout
"""

from .adapters import (
    check_against_full,
    from_hf_state_dict,
    from_megatron_state_dict,
    megatron_config,
    megatron_layout,
    to_hf_state_dict,
    to_megatron_state_dict,
)
from .embed import layout_from_device_mesh, reallocate_flat, reallocate_params, shard_from_params
from .hf import gather_state_dict, load_hf_shard, save_hf

__all__ = [
    "check_against_full",
    "from_hf_state_dict",
    "from_megatron_state_dict",
    "gather_state_dict",
    "layout_from_device_mesh",
    "load_hf_shard",
    "megatron_config",
    "megatron_layout",
    "reallocate_flat",
    "reallocate_params",
    "save_hf",
    "shard_from_params",
    "to_hf_state_dict",
    "to_megatron_state_dict",
]
