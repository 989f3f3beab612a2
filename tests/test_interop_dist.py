# Checks the interop example on 4 spawned gloo ranks: a transformers LlamaForCausalLM sharded by
# hand (tp2 pp2, HF-named slices and Megatron-core local dicts with grouped q|k|v and 128 x tp
# vocab padding, tied and untied) -> generation layout dp4 -> back, bit for bit against the full
# transformers tensors and the trainer's own dicts; plus storage-format layout pairs over gloo
# against tests/support/oracle.py. A failure points to real_py/interop/adapters.py, the planner's
# storage-format conversion (csrc/planner/geometry.cpp, real_py/realloc/plan.py) or
# examples/trainer_interop.py.
import sys
from pathlib import Path

import pytest
import torch
from support.oracle import oracle_flat, random_full, tiny_spec

from real_py import Layout, ModelShard, plan_realloc
from real_py.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from trainer_interop import tiny_llama, worker

pytestmark = pytest.mark.dist

GROUPED = {"qkv_layout": "megatron_grouped", "vocab_pad_multiple": 8}
INTERLEAVED = {"gate_up_layout": "interleaved"}
FORMAT_PAIRS = [  # (src format, dst format, src layout, dst layout, dst ranks)
    (GROUPED, {}, "tp2,pp2", "dp4", None),
    ({}, GROUPED, "dp2,tp2", "tp2,pp2", None),
    (INTERLEAVED, GROUPED, "tp3", "dp2,tp2", (3, 2, 1, 0)),
    (GROUPED, INTERLEAVED, "tp2,pp2", "tp3", (1, 2, 3)),
]


def _worker(rank: int, world: int, models: dict) -> dict:
    import torch.distributed as dist

    from real_py.realloc.reallocator import Reallocator
    from real_py.realloc.transports.dist import DistTransport

    out = worker(rank, world, models)
    transport = DistTransport(dist.group.WORLD, timeout=60)
    for i, (a, b, s, d, ranks) in enumerate(FORMAT_PAIRS):
        src_model, dst_model = tiny_spec(bias=True, **a), tiny_spec(bias=True, **b)
        src, dst = Layout.parse(s), Layout.parse(d, ranks=ranks)
        full = random_full(src_model, i)
        plan = plan_realloc(
            src_model, src, dst, dst_model=dst_model, mode=("p2p", "broadcast")[i % 2]
        )
        mine = ModelShard.from_full(src_model, src, rank, full) if rank in src.ranks else None
        got = ModelShard.empty(dst_model, dst, rank) if rank in dst.ranks else None
        Reallocator(plan, transport, bucket_bytes=2048).run(mine, got)
        if got is not None:
            assert torch.equal(got.flat, oracle_flat(dst_model, dst, rank, full)), (
                f"rank {rank}: {a}{s} -> {b}{d} differs from the oracle"
            )
    out["format_pairs"] = len(FORMAT_PAIRS)
    return out


def test_trainer_to_generation_and_back_on_4_ranks():
    models = {tied: tiny_llama(tied) for tied in (False, True)}
    out = run_distributed(_worker, 4, models, timeout=240)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(len(o["done"]) == 4 and o["format_pairs"] == 4 for o in out), out
