# Checks generation.min_new_tokens (no response ends before N new tokens) against transformers' own
# generate().
# A failure points to real_py/engines/generate.py (the stop tokens banned for the first N steps).
"""transformers' MinNewTokensLengthLogitsProcessor sets the EOS logits to -inf while fewer than
min_new_tokens tokens were generated; greedy decoding of a tiny random LLaMA checkpoint must then
give the same tokens and the same lengths on tp1, tp2 and pp2. The EOS is a token the model emits
second for prompt 0 without the option (its response ends before MIN_NEW), so the option changes the
result (checked too)."""

import os

import pytest
import torch
from support import models_oracle as O

from real_py import Layout, ModelConfig
from real_py.engines import Engine
from real_py.interop.hf import load_hf_shard
from real_py.parallel import ParallelGroups
from real_py.testing import run_distributed

PROMPTS = torch.tensor([[5, 17, 3, 44, 8], [9, 2, 61, 0, 0], [70, 71, 0, 0, 0]])
LENGTHS = torch.tensor([5, 3, 2])
MAX_NEW, MIN_NEW = 8, 5


def hf_generate(model, eos, min_new):
    """transformers' generate() on the left-padded batch (greedy); returns [B, MAX_NEW] new tokens,
    pad (0) after the EOS."""
    B, P = PROMPTS.shape
    ids, mask = torch.zeros(B, P, dtype=torch.int64), torch.zeros(B, P, dtype=torch.int64)
    for b in range(B):
        n = int(LENGTHS[b])
        ids[b, P - n :], mask[b, P - n :] = PROMPTS[b, :n], 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        min_new_tokens=min_new,
        eos_token_id=eos,
        pad_token_id=0,
        do_sample=False,
    )
    new = out[:, P:]
    return torch.nn.functional.pad(new, (0, MAX_NEW - new.shape[1]))


def _worker(rank, world, path, eos, layouts):
    cfg = ModelConfig.from_hf(path)
    out = {}
    for name, layout in layouts:
        groups = ParallelGroups(layout)
        if not groups.member:
            continue
        eng = Engine(cfg, layout, groups, load_hf_shard(path, cfg, layout, rank))
        seeds = torch.arange(3)
        r = {
            k: eng.generate(
                PROMPTS, LENGTHS, seeds, max_new_tokens=MAX_NEW, eos_token_id=eos, min_new_tokens=m
            )
            for k, m in (("plain", 0), ("min", MIN_NEW))
        }
        # Sampling at a high temperature: the EOS is likely at every step, never before MIN_NEW.
        r["sampled"] = eng.generate(
            PROMPTS,
            LENGTHS,
            seeds,
            max_new_tokens=MAX_NEW,
            eos_token_id=[eos, 7],
            min_new_tokens=MIN_NEW,
            greedy=False,
            temperature=50.0,
        )
        out[name] = {
            k: (v["new_tokens"].tolist(), (v["lengths"] - LENGTHS).tolist()) for k, v in r.items()
        }
    return out  # lists: shared-memory tensors die with the worker


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = O.make_checkpoint(str(tmp_path_factory.mktemp("min") / "llama"), "llama", seed=4)
    model = O.load_oracle(path)
    eos = int(hf_generate(model, None, 0)[0, 1])
    return path, model, eos


def _check(got, model, eos):
    for key, m in (("plain", 0), ("min", MIN_NEW)):
        want = hf_generate(model, eos, m)
        tokens, resp = got[key]
        for b in range(PROMPTS.shape[0]):
            n = int(resp[b])
            assert tokens[b][:n] == want[b, :n].tolist(), (key, b)
            hits = (want[b] == eos).nonzero()
            assert n == (int(hits[0]) + 1 if len(hits) else MAX_NEW), (key, b, n, want[b])
    # The boundary: no stop token among the first MIN_NEW new tokens, greedy or sampled (an
    # off-by-one in the ban lets one through at index MIN_NEW - 1).
    for key, stops in (("min", {eos}), ("sampled", {eos, 7})):
        tokens, resp = got[key]
        for b in range(PROMPTS.shape[0]):
            assert not set(tokens[b][:MIN_NEW]) & stops, (key, b, tokens[b])
    plain, short = got["plain"][1], got["min"][1]
    assert plain[0] < MIN_NEW, "the EOS must end prompt 0's response early without the option"
    assert min(short) >= MIN_NEW
    assert min(got["sampled"][1]) >= MIN_NEW


@pytest.mark.dist
def test_min_new_tokens_matches_transformers_on_one_rank(case):
    path, model, eos = case
    got = run_distributed(_worker, 1, path, eos, [("tp1", Layout())], timeout=120)[0]["tp1"]
    _check(got, model, eos)


@pytest.mark.dist
def test_min_new_tokens_matches_transformers_on_tp2_and_pp2(case):
    path, model, eos = case
    layouts = [("tp2", Layout(tp=2)), ("pp2", Layout(pp=2))]
    per_rank = run_distributed(
        _worker, 2, path, eos, layouts, timeout=float(os.environ.get("MODELS_TEST_TIMEOUT", 240))
    )
    for name, _ in layouts:
        assert per_rank[0][name] == per_rank[1][name]
        _check(per_rank[0][name], model, eos)


def test_min_new_tokens_bad_values():
    from real_py.engines.generate import generate

    with pytest.raises(ValueError, match="min_new_tokens=9 must be in"):
        generate(None, PROMPTS, LENGTHS, torch.arange(3), max_new_tokens=8, min_new_tokens=9)
