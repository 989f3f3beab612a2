# Checks that an engine's log-probs and entropy are those of the temperature-scaled distribution the
# sampler draws from (Engine.logit_temperature, set by the RL runtime to generation.temperature): on
# tp=2, logit_temperature=2 on the original weights equals logit_temperature=1 on weights whose
# lm_head was halved, bit for bit (halving is exact in floating point), and differs from the
# unscaled log-probs.
# A failure points to Engine.head_outputs (real_py/engines/engine.py) or rlhf/models.py (temperature
# handed to the engines).
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

CFG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    num_hidden_layers=2,
    max_position_embeddings=32,
    head="lm",
    tie_word_embeddings=False,
)
TOKENS = torch.tensor([[5, 17, 3, 44, 8, 0], [9, 2, 61, 7, 1, 0]])
LENGTHS = torch.tensor([5, 6])


def _worker(rank, world):
    cfg = ModelConfig(**CFG)
    spec = model_spec(cfg)
    layout = Layout(dp=1, tp=2, pp=1)
    g = ParallelGroups(layout)
    full = init_weights(cfg, 3)
    halved = {k: (v / 2 if k == "lm_head.weight" else v) for k, v in full.items()}
    out = {}
    for name, weights, temp in (("t2", full, 2.0), ("halved", halved, 1.0), ("t1", full, 1.0)):
        eng = Engine(cfg, layout, g, ModelShard.from_full(spec, layout, rank, weights))
        eng.logit_temperature = temp
        out[name] = eng.inference(TOKENS, LENGTHS, with_entropy=True)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_logprobs_follow_the_sampling_temperature():
    for raw in run_distributed(_worker, 2, timeout=150):
        r = torch.load(io.BytesIO(raw))
        for k in ("logprobs", "entropy"):
            assert torch.equal(r["t2"][k], r["halved"][k]), k
        assert not torch.allclose(r["t2"]["logprobs"], r["t1"]["logprobs"])
        assert (r["t2"]["entropy"] > r["t1"]["entropy"]).any()


def test_top_p_after_top_k_uses_the_renormalised_mass():
    """probs [.3, .2, .15, .15, .1, .1], top_k=2, top_p=0.5: renormalised over the top 2, token 0
    alone holds 0.6 >= 0.5, so it is the only token ever drawn (transformers' TopK then TopP
    warpers); without renormalising, token 1 was drawn for 40% of the uniforms."""
    from real_py.engines.generate import pick_tokens

    logits = torch.tensor([[0.3, 0.2, 0.15, 0.15, 0.1, 0.1]]).log().expand(1000, 6)
    u = torch.linspace(0, 0.999, 1000)
    assert pick_tokens(logits, u, 1.0, 0.5, top_k=2).unique().tolist() == [0]
    # Without top_k, top_p 0.5 keeps tokens 0 and 1 (0.3 < 0.5 before token 1): both drawn.
    assert pick_tokens(logits, u, 1.0, 0.5).unique().tolist() == [0, 1]
    # top_k alone: tokens 0 and 1 in proportion 0.3 : 0.2.
    got = pick_tokens(logits, u, 1.0, 1.0, top_k=2)
    assert abs(float((got == 0).float().mean()) - 0.6) < 0.01
