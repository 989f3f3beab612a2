"""Configuration of `python -m real_py train`.

schema.py       the keys: one dataclass per section with a docstring under each field; the default
load.py         YAML and KEY=VALUE overrides -> typed TrainConfig (unknown keys and types refused)
paths.py        relative input paths of a config file resolve against its folder
ranges.py       the allowed range of a field, declared beside it in schema.py (`ranged`)
checks.py       `check_values` (ranges, paths, rules between fields), then `validate`: plan vs
                graph, world and models; vocabularies
files.py        the checks that read the disk: paths, tokenizers, checkpoint headers, data, reward
host_memory.py  what a CPU job holds in host memory, refused before launch if it cannot fit
notes.py        warnings printed before launch, the step line's kl legend
"""

from .checks import check_values, validate
from .load import apply_overrides, from_dict, load, read_yaml, to_dict
from .notes import KL_LEGEND, notes
from .schema import (
    DEFAULT_PLAN,
    PRECISION_DTYPES,
    TINY,
    DataConfig,
    GenConfig,
    PPOConfig,
    RewardConfig,
    TrainConfig,
    default_plan,
    single_process_plan,
)

__all__ = [
    "TrainConfig",
    "DataConfig",
    "GenConfig",
    "PPOConfig",
    "RewardConfig",
    "from_dict",
    "load",
    "read_yaml",
    "apply_overrides",
    "to_dict",
    "validate",
    "check_values",
    "single_process_plan",
    "DEFAULT_PLAN",
    "PRECISION_DTYPES",
    "TINY",
    "default_plan",
    "notes",
    "KL_LEGEND",
]
