"""vLLM plugin entry point (group `vllm.general_plugins`, declared in pyproject.toml): vLLM runs
`register` in its front end, its engine core and every worker, so `weight_transfer_config=
{"backend": "real_py"}` finds the worker engine; importing real_py.vllm registers the trainer
engine in a trainer process (which runs no plugins). A second call changes nothing."""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in (
        (WeightTransferEngineFactory, "RealPyWeightTransferEngine"),
        (WeightTransferTrainerFactory, "RealPyTrainerEngine"),
    ):
        try:
            factory.register_engine(
                "real_py", f"real_py.vllm.{'worker' if 'Weight' in cls else 'trainer'}", cls
            )
        except ValueError:  # registered already (vLLM calls plugins once per process part)
            pass
