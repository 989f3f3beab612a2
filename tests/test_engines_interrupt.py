# Checks interruptible generation: weights swapped in place between decode steps with the KV cache
# recomputed (one prefill of prompt + tokens so far with the new weights). The tokens before the
# swap are those of the old weights, the tokens after it exactly those the new weights generate
# greedily from that prefix, on TP and PP layouts of 2 gloo ranks and both cache modes.
# A failure points to real_py/engines/generate.py (the swap / recompute path) or
# real_py/engines/decode.py (prefill of a longer prefix).
import io

import pytest
import torch

from real_py.engines import Engine
from real_py.layout import Layout
from real_py.parallel import ParallelGroups
from real_py.realloc.shard import ModelShard
from real_py.rlhf.models import init_weights
from real_py.spec import ModelConfig, model_spec
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

CFG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    num_hidden_layers=2,
    max_position_embeddings=32,
    head="lm",
)
PROMPTS = torch.tensor([[5, 17, 3, 44, 8, 0], [9, 2, 61, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
PLENS = torch.tensor([5, 3, 6])
SEEDS = torch.tensor([1, 2, 3])
N, AT = 7, 3


def _worker(rank, world):
    cfg = ModelConfig(**CFG)
    spec = model_spec(cfg)
    out = {}
    for layout in (Layout(dp=1, tp=2, pp=1), Layout(dp=1, tp=1, pp=2)):
        g = ParallelGroups(layout)
        w1 = ModelShard.from_full(spec, layout, rank, init_weights(cfg, 1))
        w2 = ModelShard.from_full(spec, layout, rank, init_weights(cfg, 2))
        for mode in ("dynamic", "static"):
            eng = Engine(cfg, layout, g, ModelShard(spec, layout, rank, w1.flat.clone()))
            kw = dict(max_new_tokens=N, decode=mode)
            old = eng.generate(PROMPTS, PLENS, SEEDS, **kw)

            def swap(step):
                if step == AT:
                    eng.shard.flat.copy_(w2.flat)
                    return True
                return False

            mixed = eng.generate(PROMPTS, PLENS, SEEDS, swap=swap, **kw)
            # Reference: the new weights, prompted with prompt + the first AT old tokens.
            ref_p = torch.zeros(3, PROMPTS.shape[1] + AT, dtype=torch.int64)
            for b in range(3):
                n = int(PLENS[b])
                ref_p[b, : n + AT] = torch.cat([PROMPTS[b, :n], old["new_tokens"][b, :AT]])
            cont = eng.generate(ref_p, PLENS + AT, SEEDS, max_new_tokens=N - AT, decode=mode)
            out[(str(layout), mode)] = (
                old["new_tokens"],
                mixed["new_tokens"],
                cont["new_tokens"],
                mixed["swaps"],
                old["swaps"],
            )
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.timeout(300)
def test_swap_between_decode_steps_recomputes_the_cache():
    res = [torch.load(io.BytesIO(b)) for b in run_distributed(_worker, 2, timeout=240)]
    for r in res:
        for key, (old, mixed, cont, swaps, none) in r.items():
            assert swaps == [AT] and none == [], key
            assert torch.equal(mixed[:, :AT], old[:, :AT]), key
            assert torch.equal(mixed[:, AT:], cont), key
            assert not torch.equal(mixed, old), (
                f"{key}: the swap changed nothing (weights too alike?)"
            )
