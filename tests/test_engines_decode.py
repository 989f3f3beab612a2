# Checks the decode path's reuse and shortcuts on CPU: the static KV cache (bucketed key spans) kept
# across generate() calls gives the tokens of a fresh cache and of the dynamic one; stop tokens
# checked every few steps give the tokens and lengths of a check after every step; the compiled
# decode step (torch.compile, aot_eager here) gives the eager tokens with one compilation for every
# layer and span; unsorted inverse-CDF sampling; chunked vocab log-probs / entropy and their
# gradients against log_softmax; the train step's merged norm spans.
# A failure points to real_py/engines/decode.py (DecodeState, spans, compile),
# real_py/engines/generate.py (pick_tokens, stop checks), real_py/models/vocab.py (chunked
# log-probs) or real_py/engines/train.py (_merge_spans).
"""The CUDA-graph side of the same code (capture per span, replay across calls, inductor) runs in
tests/test_rlhf_cuda.py on a GPU."""

import io
from types import SimpleNamespace

import pytest
import torch

from real_py.engines import Engine
from real_py.engines.generate import pick_tokens
from real_py.layout import Layout
from real_py.models.vocab import vocab_parallel_logprobs
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
    num_hidden_layers=3,
    max_position_embeddings=256,
    head="lm",
)


def _engine(rank, cfg=None):
    cfg = cfg or ModelConfig(**CFG)
    layout = Layout()
    return Engine(
        cfg,
        layout,
        ParallelGroups(layout),
        ModelShard.from_full(model_spec(cfg), layout, rank, init_weights(cfg, 3)),
    )


def _prompts(seed, B, P):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 64, (B, P), generator=g)
    lengths = torch.randint(1, P + 1, (B,), generator=g)
    lengths[0] = P
    return tokens, lengths


def _worker(rank, world):
    import torch._dynamo

    from real_py.engines import generate as G

    out = {}
    seeds = torch.arange(5)
    calls = [
        (_prompts(1, 5, 9), 70),
        (_prompts(2, 5, 4), 60),
        (_prompts(1, 5, 9), 70),
        (_prompts(3, 5, 9), 150),
    ]
    # one engine generating four times (the state is reused while it fits, then replaced) against a
    # fresh engine per call and against the dynamic cache
    eng = _engine(rank)
    states = []
    for i, ((tok, ln), n) in enumerate(calls):
        for greedy in (True, False):
            kw = dict(max_new_tokens=n, greedy=greedy)
            reused = eng.generate(tok, ln, seeds, decode="static", **kw)["tokens"]
            fresh = _engine(rank).generate(tok, ln, seeds, decode="static", **kw)["tokens"]
            dyn = _engine(rank).generate(tok, ln, seeds, decode="dynamic", **kw)["tokens"]
            out[("reuse", i, greedy)] = (reused, fresh, dyn)
        states.append([id(s) for s in eng._decode_states.values()])
    out["states"] = states
    out["capacities"] = [s.capacity for s in eng._decode_states.values()]
    # stop tokens: checked after every step against every STOP_CHECK_EVERY steps
    tok, ln = _prompts(4, 5, 6)
    for every in (1, 8, 5):
        G.STOP_CHECK_EVERY = every
        for n in (40, 13):
            r = eng.generate(
                tok,
                ln,
                seeds,
                max_new_tokens=n,
                greedy=False,
                eos_token_id=list(range(2, 10)),
                decode="static",
            )
            out[("stop", every, n)] = {k: r[k] for k in ("tokens", "lengths", "new_tokens")}
    G.STOP_CHECK_EVERY = 8
    # compiled decode step (aot_eager: dynamo + AOT autograd without a code generator)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng.compile_decode = "aot_eager"
    tok, ln = calls[0][0]
    for greedy in (True, False):
        out[("compiled", greedy)] = (
            eng.generate(tok, ln, seeds, max_new_tokens=120, greedy=greedy, decode="static")[
                "tokens"
            ],
            _engine(rank).generate(
                tok, ln, seeds, max_new_tokens=120, greedy=greedy, decode="static"
            )["tokens"],
        )
    out["graphs"] = dict(torch._dynamo.utils.counters["stats"])
    out["compiled_states"] = [
        (s.backend, s.compiled_ok, s.backend_failed)
        for s in eng._decode_states.values()
        if s.backend
    ]
    eng.release_decode()
    out["released"] = len(getattr(eng, "_decode_states", {}))
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs():
    return torch.load(io.BytesIO(run_distributed(_worker, 1, timeout=400)[0]), weights_only=False)


@pytest.mark.dist
@pytest.mark.timeout(450)
def test_static_cache_reused_across_calls_gives_fresh_tokens(runs):
    for key, (reused, fresh, dyn) in ((k, v) for k, v in runs.items() if k[0] == "reuse"):
        assert torch.equal(reused, fresh), key
        assert torch.equal(fresh, dyn), key
    s = runs["states"]
    # calls 0-2 fit the first state (9 + 70 slots -> capacity 128); call 3 (159 slots) replaces it
    assert s[0] == s[1] == s[2] and len(s[0]) == 1 and s[3] != s[0]
    assert runs["capacities"] == [192]


@pytest.mark.dist
@pytest.mark.timeout(450)
def test_stop_checked_every_few_steps_same_result(runs):
    for n in (40, 13):
        ref = runs[("stop", 1, n)]
        assert int(ref["lengths"].min()) < int(ref["lengths"].max()), "some rows must stop early"
        for every in (8, 5):
            got = runs[("stop", every, n)]
            for k in ref:
                assert torch.equal(got[k], ref[k]), (every, n, k)
    assert runs[("stop", 1, 40)]["new_tokens"].shape[1] < 40, (
        "the batch must stop before max_new_tokens"
    )


@pytest.mark.dist
@pytest.mark.timeout(450)
def test_compiled_decode_step_equals_eager_with_one_compilation(runs):
    for greedy in (True, False):
        compiled, eager = runs[("compiled", greedy)]
        assert torch.equal(compiled, eager), greedy
    assert runs["compiled_states"] == [("aot_eager", True, None)]
    # one graph for every layer and span (the key length is dynamic), one for the final norm
    assert runs["graphs"].get("unique_graphs") == 2, runs["graphs"]
    assert runs["released"] == 0


def test_unsorted_inverse_cdf_sampling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 2
    u = torch.rand(3, generator=g)
    got = pick_tokens(logits, u, 0.7, 1.0)
    cum = torch.softmax(logits / 0.7, -1).cumsum(-1)
    want = [int((cum[b] <= u[b] * cum[b, -1]).sum()) for b in range(3)]
    assert got.tolist() == want
    # frequencies follow the probabilities; a zero-probability token (banned) is never drawn
    probs = torch.tensor([0.1, 0.0, 0.45, 0.3, 0.15, 0.0])
    lg = probs.log().expand(20000, 6)
    draws = pick_tokens(lg, torch.rand(20000, generator=g), 1.0, 1.0)
    freq = torch.bincount(draws, minlength=6).float() / 20000
    assert freq[1] == 0 and freq[5] == 0 and (freq - probs).abs().max() < 0.015
    assert int(pick_tokens(lg[:1], torch.tensor([1 - 2**-24]), 1.0, 1.0)) == 4
    assert torch.equal(pick_tokens(logits, None, 1.0, 1.0), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_logprobs_entropy_and_grads_match_log_softmax(temperature):
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(3, 8, 13, generator=g) * 3).requires_grad_()
    tg = torch.randint(0, 11, (3, 7), generator=g)
    w1, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    ref_logits = full[:, :-1, :11] / temperature  # vocab 11 of 13 columns: 2 padding columns
    logp = torch.log_softmax(ref_logits, -1)
    lp_ref = logp.gather(-1, tg.unsqueeze(-1)).squeeze(-1)
    ent_ref = -(logp.exp() * logp).sum(-1)
    (g_ref,) = torch.autograd.grad((lp_ref * w1).sum() + (ent_ref * w2).sum(), full)
    for chunk in (1 << 25, 200, 20):  # whole, two rows per chunk, one token per chunk
        lp, ent = vocab_parallel_logprobs(
            full[:, :-1], tg, None, 0, 11, True, temperature=temperature, chunk_elems=chunk
        )
        (gr,) = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), full)
        torch.testing.assert_close(lp, lp_ref, atol=2e-6, rtol=0)
        torch.testing.assert_close(ent, ent_ref, atol=2e-6, rtol=0)
        torch.testing.assert_close(gr, g_ref, atol=2e-6, rtol=0)
        assert torch.isfinite(gr).all() and not gr[..., 11:].any() and not gr[:, -1].any()
        lp_only, none = vocab_parallel_logprobs(
            full[:, :-1], tg, None, 0, 11, temperature=temperature, chunk_elems=chunk
        )
        assert none is None and torch.equal(lp_only, lp)


def test_norm_spans_merge_counted_entries_across_gaps():
    from real_py.engines.train import _merge_spans

    E = lambda off, n: SimpleNamespace(offset=off, numel=n)
    entries = [E(0, 10), E(16, 4), E(32, 8), E(48, 8), E(64, 2)]
    counted = [(0, 10), (16, 4), (48, 8), (64, 2)]  # (32, 8) not counted (a replicated copy)
    assert _merge_spans(counted, entries) == [(0, 20), (48, 66)]
    assert _merge_spans([], entries) == []
