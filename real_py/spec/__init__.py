"""Model description, the bottom layer: what a model's parameters are (names, global shapes, dtype,
owner, TP rule and storage format) and the configurations they are built from.

  config.py     ModelConfig (shape + computation-changing fields), dtypes, presets
  hf_config.py  HF config.json <-> ModelConfig: supported architectures and fields, refusals
  params.py     TPRule, ParamSpec, ModelSpec and model_spec (the fused-parameter builder)
  formats.py    other systems' per-rank storage formats as ModelConfig fields (vllm_config)

It imports nothing else from real_py.
"""

from .config import (
    DTYPE_SIZES,
    GATE_UP_LAYOUTS,
    MODEL_TYPES,
    PRESETS,
    QKV_LAYOUTS,
    ROPE_SCALING_KEYS,
    ModelConfig,
    preset,
    torch_dtype,
)
from .formats import vllm_config
from .params import ALIGN_BYTES, REPLICATED, ModelSpec, ParamSpec, TPRule, model_spec

__all__ = [
    "ALIGN_BYTES",
    "DTYPE_SIZES",
    "GATE_UP_LAYOUTS",
    "MODEL_TYPES",
    "PRESETS",
    "QKV_LAYOUTS",
    "REPLICATED",
    "ROPE_SCALING_KEYS",
    "ModelConfig",
    "ModelSpec",
    "ParamSpec",
    "TPRule",
    "model_spec",
    "preset",
    "torch_dtype",
    "vllm_config",
]
