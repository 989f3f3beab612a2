"""real_py as a vLLM weight-transfer backend named `real_py`: each vLLM worker receives exactly
its shard, from any trainer layout, written into its live parameters.

```
 trainer rank 0..n-1 (ModelShard, any real_py layout)          vLLM worker 0..w-1
   RealPyTrainerEngine.send_weights ---- gloo p2p (plan) ----> RealPyWeightTransferEngine
     rank 0: client.start / update / finish, reset cache         receive shard -> live params
   plan: real_py.plan_realloc(trainer layout -> vLLM live format, spec.vllm_config)
```

| file | role |
|---|---|
| `plugin.py` | `register()`: the `vllm.general_plugins` entry point (both engines) |
| `trainer.py` | `RealPyTrainerInitInfo`, `RealPyTrainerEngine`, `ShardSource` (trainer side) |
| `worker.py` | `RealPyWeightTransferEngine` (inside each vLLM worker), the shared plan |
| `names.py` | real_py -> vLLM names, which loaders real_py plans, configs as JSON |

The group of trainer ranks and workers on a store of their own is
`real_py/realloc/transports/store_group.py` (TransferGroup).

Importing this package needs vLLM; it registers the trainer engine (the worker engine comes with
vLLM's plugin loading). Usage: docs/vllm.md, examples/vllm_offline.py.
"""

from .plugin import register
from .trainer import (
    OfflineClient,
    RealPyTrainerEngine,
    RealPyTrainerInitInfo,
    ShardSource,
    reset_prefix_cache,
)
from .worker import RealPyInitInfo, RealPyWeightTransferEngine, vllm_plan

register()

__all__ = [
    "OfflineClient",
    "RealPyTrainerEngine",
    "RealPyTrainerInitInfo",
    "ShardSource",
    "RealPyInitInfo",
    "RealPyWeightTransferEngine",
    "register",
    "reset_prefix_cache",
    "vllm_plan",
]
