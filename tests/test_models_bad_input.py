# Checks that bad configs, layouts, batches and generation arguments raise clear ValueErrors at
# construction or call time.
# A failure points to the argument checks in real_py/parallel.py, real_py/engines/ (engine,
# pipeline, generate, train) or real_py/models/vocab.py.
"""Pure checks run in-process; the ones that need process groups share one 2-rank gloo spawn."""

import pytest
import torch
from support import models_oracle as O

from real_py import Layout, ModelConfig, ModelShard, model_spec
from real_py.engines import Engine, OptimConfig, split_micro_batches
from real_py.models.vocab import vocab_parallel_logprobs
from real_py.parallel import ParallelGroups
from real_py.testing import run_distributed

CFG = ModelConfig(**O.TINY)
TIED = ModelConfig(**O.TINY, tie_word_embeddings=True)


def test_layouts_that_do_not_fit():
    with pytest.raises(
        ValueError, match=r"tp=3 does not divide num_attention_heads=4 .*pick tp in \{1, 2"
    ):
        ModelShard.empty(model_spec(CFG), Layout(tp=3), 0)
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2"):
        ModelShard.empty(model_spec(CFG), Layout(tp=4), 0)
    with pytest.raises(ValueError, match="pp=5 exceeds num_layers=3"):
        ModelShard.empty(model_spec(CFG), Layout(pp=5), 0)


def test_bad_batches():
    tokens, lengths = O.batch()
    with pytest.raises(ValueError, match=r"micro_batches=7 must be in \[1, batch size 6\]"):
        split_micro_batches({"tokens": tokens, "lengths": lengths}, 7)
    with pytest.raises(ValueError, match="lengths must be"):
        split_micro_batches({"tokens": tokens, "lengths": lengths + 5}, 2)
    with pytest.raises(ValueError, match=r"batch\['adv'\] must be a tensor with leading dim 6"):
        split_micro_batches({"tokens": tokens, "lengths": lengths, "adv": torch.zeros(5, 9)}, 2)
    with pytest.raises(ValueError, match="OptimConfig"):
        OptimConfig(lr=-1.0)


def test_micro_batches_sort_and_trim():
    tokens, lengths = O.batch()
    mbs = split_micro_batches({"tokens": tokens, "lengths": lengths, "adv": torch.ones(6, 9)}, 3)
    assert [mb.index.tolist() for mb in mbs] == [[0, 4], [2, 1], [5, 3]]
    assert [mb.length for mb in mbs] == [10, 9, 6]
    assert [tuple(mb.data["adv"].shape) for mb in mbs] == [(2, 9), (2, 8), (2, 5)]
    assert torch.equal(mbs[2].data["tokens"], tokens[[5, 3], :6])


def test_vocab_parallel_logprobs_single_rank_matches_log_softmax():
    logits = torch.randn(2, 5, 97)
    targets = torch.randint(0, 97, (2, 5))
    lp, ent = vocab_parallel_logprobs(logits, targets, None, 0, 97, with_entropy=True)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


def _dist_cases(rank, world):
    errors = []

    def expect(pattern, fn):
        try:
            fn()
        except ValueError as e:
            import re

            if not re.search(pattern, str(e)):
                errors.append(f"{pattern!r} not in {e}")
            return
        errors.append(f"no ValueError for {pattern!r}")

    expect("uses global rank 3 but the world has 2 ranks", lambda: ParallelGroups(Layout(dp=4)))
    layout = Layout(pp=2)
    plain = ParallelGroups(layout, tied=False)
    tied = ParallelGroups(layout, tied=True)
    shard = ModelShard.empty(model_spec(TIED), layout, rank)
    Engine(TIED, layout, plain, shard)  # tied groups are always built: `tied` is ignored
    expect("model specs disagree", lambda: Engine(CFG, layout, tied, shard))
    expect("layout mismatch", lambda: Engine(TIED, Layout(tp=2), tied, shard))
    eng = Engine(TIED, layout, tied, shard)
    p, n, s = torch.tensor([[1, 2]]), torch.tensor([2]), torch.tensor([0])
    expect("max_new_tokens=0 must be >= 1", lambda: eng.generate(p, n, s, max_new_tokens=0))
    expect(
        "temperature > 0",
        lambda: eng.generate(p, n, s, max_new_tokens=2, greedy=False, temperature=0.0),
    )
    expect("exceeds max_position_embeddings=64", lambda: eng.generate(p, n, s, max_new_tokens=63))
    return errors


@pytest.mark.dist
def test_distributed_argument_checks():
    for errors in run_distributed(_dist_cases, 2, timeout=120):
        assert not errors, errors
