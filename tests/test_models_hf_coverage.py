# Checks HF model coverage against transformers: rope_scaling (linear/dynamic/llama3/yarn), Mistral
# sliding_window, Qwen2 use_sliding_window + max_window_layers, biases, tied; refusals of
# unsupported architectures/fields; save_hf's exported config.
# A failure points to real_py/models/rope.py (frequencies), real_py/models/transformer.py (window
# mask, KV cache slots), real_py/spec/hf_config.py (field parsing/refusals/export) or
# real_py/interop/hf.py.
"""Oracle: transformers 4.57 itself on random-init checkpoints it wrote. Sequences of 24 tokens
(the window is 4; dynamic RoPE's max_position_embeddings is 16, so it rescales). Generation is
compared with transformers' own KV-cache decoding (prefill, then one token per step), which is
what dynamic RoPE and the sliding-window cache must reproduce. One 4-rank spawn runs logits,
greedy generation and one AdamW step of every case on tp2pp2 (permuted ranks) and pp3 (untied)
or dp2pp2 (tied). fp32; tolerances as in
test_models_parallel.py (1e-5: TP/PP reorder sums by a few ulps; a wrong window or frequency moves
logits by > 1e-3, asserted below for every field).
"""

import io
import json
import os
from dataclasses import replace

import pytest
import torch
import transformers
from support import models_oracle as O

from real_py import Layout, ModelConfig, gather_full, model_spec
from real_py.engines import Engine, OptimConfig
from real_py.interop.hf import gather_state_dict, load_hf_shard, save_hf
from real_py.models import StageModel
from real_py.parallel import ParallelGroups
from real_py.spec.hf_config import export_config
from real_py.testing import run_distributed

ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}
# name -> (model_type, tied, config fields)
CASES = {
    "llama-rope-linear-head_dim": (
        "llama",
        False,
        dict(rope_scaling=ROPE["linear"], head_dim=32),
    ),  # 4 x 32 != 64
    "llama-rope-dynamic": (
        "llama",
        False,
        dict(rope_scaling=ROPE["dynamic"], max_position_embeddings=16),
    ),
    "llama-rope-llama3": ("llama", False, dict(rope_scaling=ROPE["llama3"])),
    "llama-rope-yarn": ("llama", False, dict(rope_scaling=ROPE["yarn"])),
    "mistral-sliding-window": (
        "mistral",
        False,
        dict(sliding_window=4, rope_scaling=ROPE["llama3"]),
    ),
    "qwen2-sliding-max-window-layers": (
        "qwen2",
        False,
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "qwen2-tied-sliding-yarn": (
        "qwen2",
        True,
        dict(
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=2,
            rope_scaling=ROPE["yarn"],
        ),
    ),
    "qwen3-head_dim-sliding": (
        "qwen3",
        False,
        dict(head_dim=32, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "qwen3-tied-yarn": ("qwen3", True, dict(rope_scaling=ROPE["yarn"])),
    # num_key_value_heads=4: also run on tp=4 (_layouts)
    "qwen3-bias-tp4": ("qwen3", False, dict(attention_bias=True, num_key_value_heads=4)),
    "olmo2-tp4": (
        "olmo2",
        False,
        dict(num_key_value_heads=4, rope_scaling={"type": "linear", "factor": 2.0}),
    ),
    "olmo2-tied-gqa-bias": ("olmo2", True, dict(attention_bias=True)),
    "phi3-sliding-tp4": (
        "phi3",
        False,
        dict(num_key_value_heads=4, sliding_window=4, pad_token_id=0),
    ),
    "phi3-tied-gqa": ("phi3", True, dict(pad_token_id=0)),
    "llama-biases-gelu-tanh": (
        "llama",
        False,
        dict(attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh"),
    ),
    "llama-tied-biases-relu": (
        "llama",
        True,
        dict(attention_bias=True, mlp_bias=True, hidden_act="relu"),
    ),
    # longrope: original_max_position_embeddings 16 < 24 tokens, so full forwards use long_factor
    # and generation switches from short to long factors mid-decode (prompts of 6, up to 20
    # positions)
    "llama-longrope": (
        "llama",
        False,
        dict(
            original_max_position_embeddings=16,
            rope_scaling=dict(
                rope_type="longrope",
                short_factor=[1.0, 1.5, 2.0, 3.0, 1.2, 4.0, 8.0, 16.0],
                long_factor=[2.0, 3.0, 5.0, 7.0, 11.0, 13.0, 17.0, 19.0],
            ),
        ),
    ),
    "phi3-tied-longrope": (
        "phi3",
        True,
        dict(
            pad_token_id=0,
            original_max_position_embeddings=16,
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0, 1.1, 1.3, 2.0, 2.5, 3.0, 6.0, 9.0],
                long_factor=[1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 24.0, 30.0],
            ),
        ),
    ),
    # Gemma 2: caps low enough that tanh bends (scores ~ 1-10 with weights N(0, 0.2)); window 4 on
    # the default sliding/global alternation; query_pre_attn_scalar != head_dim
    "gemma2-tied-tp4": (
        "gemma2",
        True,
        dict(
            head_dim=16,
            num_key_value_heads=4,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
            max_position_embeddings=64,
        ),
    ),
    "gemma2-untied-layer_types": (
        "gemma2",
        False,
        dict(
            head_dim=16,
            sliding_window=4,
            attention_bias=True,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            max_position_embeddings=64,
        ),
    ),
    # Gemma 3 text: q/k norms, local RoPE base on sliding layers, linear scaling on the global one
    # only
    "gemma3-tied-tp4": (
        "gemma3_text",
        True,
        dict(
            head_dim=16,
            num_key_value_heads=4,
            sliding_window=4,
            sliding_window_pattern=3,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
            max_position_embeddings=64,
        ),
    ),
    "gemma3-untied-softcap": (
        "gemma3_text",
        False,
        dict(
            head_dim=16,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            max_position_embeddings=64,
        ),
    ),
}
if os.environ.get("MODELS_CASES"):  # targeted runs: a substring of the case names, e.g. "gemma"
    CASES = {k: v for k, v in CASES.items() if os.environ["MODELS_CASES"] in k}
T = 24
TOKENS = torch.randint(0, 97, (4, T), generator=torch.Generator().manual_seed(5))
# Three full rows: micro-batches are trimmed to their longest row, and dynamic RoPE (like
# transformers on a batch of that width) rescales by the width of each forward, so every
# micro-batch of the dynamic case must keep width 24 to compare with the one-batch oracle.
LENGTHS = torch.tensor([24, 20, 24, 24])
PROMPTS = (
    torch.tensor(
        [[5, 17, 3, 44, 8, 9], [9, 2, 61, 0, 0, 0], [1, 2, 3, 4, 5, 6], [70, 71, 0, 0, 0, 0]]
    ),
    torch.tensor([6, 3, 6, 2]),
)
MAX_NEW = 14  # prompts of up to 6 tokens reach 20 > window 4 and > 16 (dynamic RoPE rescales)
# Adam eps 1e-3 (not 1e-6): on the first step Adam moves a weight by lr * g / (|g| + eps), which
# for |g| ~ eps turns fp32 reordering noise in g (~1e-8 here, TP/PP vs one device) into updates
# that differ by ~lr; with eps 1e-3 the update stays ~0.5 lr for typical |g| ~ 1e-3 while noise
# maps to < 1e-7. A wrong gradient still moves weights by O(lr) and fails the 1e-5 check.
LR, WD, MAX_NORM, EPS = 1e-3, 0.1, 0.5, 1e-3
LAYOUTS_UNTIED = [Layout(dp=1, tp=2, pp=2, ranks=(3, 1, 2, 0), order="pp-tp-dp"), Layout(pp=3)]
LAYOUTS_TIED = [
    Layout(dp=1, tp=2, pp=2, ranks=(3, 1, 2, 0), order="pp-tp-dp"),
    Layout(dp=2, pp=2),
    Layout(pp=3, ranks=(2, 0, 1)),
]


def _layouts(name):
    mt, tied, over = CASES[name]
    base = LAYOUTS_TIED if tied else LAYOUTS_UNTIED
    return (
        base + [Layout(tp=4, ranks=(2, 0, 3, 1))] if over.get("num_key_value_heads") == 4 else base
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("cov")
    out = {}
    for i, (name, (mt, tied, over)) in enumerate(CASES.items()):
        out[name] = O.make_checkpoint(
            str(d / name),
            mt,
            tied=tied,
            seed=10 + i,
            **{k: (dict(v) if isinstance(v, dict) else v) for k, v in over.items()},
        )
    return out


def oracle_generate_cached(model, tokens, lengths, max_new):
    """transformers' own KV-cache greedy decoding of the left-padded batch, as its generate() runs
    it: prefill, then one token per forward with past_key_values (where dynamic RoPE grows with
    the batch's longest position and the window slides over cache slots)."""
    B, P = tokens.shape[0], int(lengths.max())
    ids, mask = torch.zeros(B, P, dtype=torch.int64), torch.zeros(B, P, dtype=torch.int64)
    for b in range(B):
        n = int(lengths[b])
        ids[b, P - n :], mask[b, P - n :] = tokens[b, :n], 1
    pos, pkv, new = (mask.cumsum(1) - 1).clamp(min=0), None, []
    with torch.no_grad():
        for _ in range(max_new):
            r = model(
                ids, attention_mask=mask, position_ids=pos, past_key_values=pkv, use_cache=True
            )
            pkv, t = r.past_key_values, r.logits[:, -1].argmax(-1)
            new.append(t)
            ids, pos = t.unsqueeze(1), pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.int64)], 1)
    return torch.stack(new, 1)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_and_the_field_matters(ckpts, name):
    path = ckpts[name]
    cfg = ModelConfig.from_hf(path)
    want = O.load_oracle(path)(TOKENS).logits.detach()
    pos = torch.arange(T).expand(4, T)
    with torch.no_grad():
        got = (m := StageModel(cfg, load_hf_shard(path, cfg, Layout(), 0))).head(m(TOKENS, pos))
        plain = replace(cfg, rope_scaling=None, sliding_window=0, window_layers=None)
        p = StageModel(plain, load_hf_shard(path, plain, Layout(), 0))
        without = p.head(p(TOKENS, pos))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if cfg.rope_scaling or cfg.sliding_window:
        assert (without - want).abs().max() > 1e-3, (
            f"{name}: the field must change the logits of this test"
        )
    if (
        cfg.o_proj_bias or cfg.mlp_bias or cfg.hidden_act != "silu"
    ):  # biases and activation reach the logits
        with torch.no_grad():
            silu = replace(cfg, hidden_act="silu")
            q = StageModel(silu, load_hf_shard(path, silu, Layout(), 0))
            if cfg.hidden_act != "silu":
                assert (q.head(q(TOKENS, pos)) - want).abs().max() > 1e-3, (
                    f"{name}: hidden_act must matter"
                )
            if cfg.o_proj_bias or cfg.mlp_bias:
                for k, v in m.shard_params.items():
                    if k.endswith(("o_proj.bias", "down_proj.bias", "gate_up_proj.bias")):
                        v.zero_()
                assert (m.head(m(TOKENS, pos)) - want).abs().max() > 1e-3, (
                    f"{name}: o/mlp biases must matter"
                )
        m = StageModel(cfg, load_hf_shard(path, cfg, Layout(), 0))
    if cfg.norm_plus_one:  # Gemma: each field moves the logits of this test
        gemma = dict(
            attn_logit_softcapping=0.0,
            final_logit_softcapping=0.0,
            query_pre_attn_scalar=0.0,
            norm_plus_one=False,
            rope_local_base_freq=0.0,
        )
        for f, off in gemma.items():
            if not getattr(cfg, f):
                continue
            other = replace(cfg, **{f: off})
            with torch.no_grad():
                q = StageModel(other, load_hf_shard(path, other, Layout(), 0))
                assert (q.head(q(TOKENS, pos)) - want).abs().max() > 1e-3, (
                    f"{name}: {f} must matter"
                )
    if cfg.qk_norm:  # Qwen3's per-head q/k norm weights must reach the logits too
        with torch.no_grad():
            for k, v in m.shard_params.items():
                if k.endswith(("q_norm.weight", "k_norm.weight")):
                    v.fill_(1.0)
            unnormed = m.head(m(TOKENS, pos))
        assert (unnormed - want).abs().max() > 1e-3, (
            f"{name}: q/k norm weights must change the logits"
        )


def test_qwen2_window_layers_follow_transformers():
    tiny = dict(O.TINY, num_hidden_layers=5)
    on = transformers.Qwen2Config(
        **tiny, use_sliding_window=True, sliding_window=4, max_window_layers=3
    )
    assert ModelConfig.from_hf(on.to_dict()).window_layers == (3, 4)
    legacy = {
        k: v for k, v in on.to_dict().items() if k != "layer_types"
    }  # pre-layer_types config.json
    assert ModelConfig.from_hf(legacy).window_layers == (3, 4)
    off = transformers.Qwen2Config(
        **tiny, use_sliding_window=False, sliding_window=4, max_window_layers=3
    )
    assert ModelConfig.from_hf(off.to_dict()).sliding_window == 0
    mis = transformers.MistralConfig(**O.TINY, sliding_window=4).to_dict()
    c = ModelConfig.from_hf(mis)
    assert (
        c.sliding_window == 4
        and c.window_layers is None
        and all(c.uses_window(i) for i in range(3))
    )


def _worker(rank, world, cases):
    out = {}
    for name, path, _tied in cases:
        cfg = ModelConfig.from_hf(path)
        for layout in _layouts(name):
            groups = ParallelGroups(layout)
            if not groups.member:
                continue
            shard = load_hf_shard(path, cfg, layout, rank)
            eng = Engine(
                cfg,
                layout,
                groups,
                shard,
                optim=OptimConfig(lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=MAX_NORM),
            )
            per = 4 // layout.dp
            rows = slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)
            r = {
                "logits": eng.forward_logits(TOKENS[rows]),
                "greedy": eng.generate(
                    PROMPTS[0][rows],
                    PROMPTS[1][rows],
                    torch.zeros(per, dtype=torch.int64),
                    max_new_tokens=MAX_NEW,
                )["new_tokens"],
            }
            total = float((LENGTHS - 1).sum())
            loss_fn = lambda o, mb: O.nll_loss(o["logprobs"], mb["lengths"], total)
            r["stats"] = eng.train_step(
                loss_fn,
                {"tokens": TOKENS[rows], "lengths": LENGTHS[rows]},
                micro_batches=2 if per > 1 else 1,
            )
            r["full"] = gather_state_dict(shard, groups)
            out[(name, repr(layout))] = (groups.dp_rank, groups.tp_rank, groups.stage, r)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(ckpts):
    cases = [(n, ckpts[n], CASES[n][1]) for n in CASES]
    per_rank = run_distributed(
        _worker, 4, cases, timeout=float(os.environ.get("MODELS_TEST_TIMEOUT", 300))
    )
    return [torch.load(io.BytesIO(b), weights_only=False) for b in per_rank]


def _replicas(per_rank, key):
    by_dp = {}
    for res in per_rank:
        if key in res:
            dp, _, _, r = res[key]
            if dp in by_dp:
                assert torch.equal(r["greedy"], by_dp[dp]["greedy"]), key
            by_dp.setdefault(dp, r)
    return [by_dp[d] for d in sorted(by_dp)]


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_layouts_logits_generation_train_step_match_transformers(ckpts, runs):
    for name, (_, _tied, _) in CASES.items():
        path = ckpts[name]
        ref = O.load_oracle(path)
        with torch.no_grad():
            logits = ref(TOKENS).logits
        greedy = oracle_generate_cached(ref, *PROMPTS, MAX_NEW)  # before the oracle's train step
        loss, norm = O.oracle_train_step(ref, TOKENS, LENGTHS, "lm", LR, WD, MAX_NORM, eps=EPS)
        want = O.fused_state(ref)
        for layout in _layouts(name):
            key = (name, repr(layout))
            reps = _replicas(runs, key)
            torch.testing.assert_close(
                torch.cat([r["logits"] for r in reps]),
                logits,
                atol=1e-5,
                rtol=0,
                msg=lambda m: f"{key} logits: {m}",
            )
            assert torch.equal(torch.cat([r["greedy"] for r in reps]), greedy), (
                key,
                "greedy generation",
            )
            fulls = [
                res[key][3]["full"]
                for res in runs
                if key in res and res[key][3]["full"] is not None
            ]
            assert len(fulls) == 1 and sorted(fulls[0]) == sorted(want), key
            for k, v in want.items():
                torch.testing.assert_close(
                    fulls[0][k], v, atol=1e-5, rtol=0, msg=lambda m: f"{key} {k}: {m}"
                )
            stats = reps[0]["stats"]
            assert abs(stats["loss"] - loss) < 1e-5 and abs(stats["grad_norm"] - norm) < 1e-4, (
                key,
                stats,
            )


# -- refusals ---------------------------------------------------------------------------------


def _llama(**over):
    return dict(transformers.LlamaConfig(**O.TINY).to_dict(), **over)


REFUSALS = [
    (
        "gpt2",
        lambda: transformers.GPT2Config(n_layer=2).to_dict(),
        r"architecture 'gpt2' is not supported; supported: llama",
    ),
    (
        "gemma",
        lambda: transformers.GemmaConfig(**O.TINY).to_dict(),
        r"architecture 'gemma' is not supported",
    ),
    (
        "phi3-resid_pdrop",
        lambda: transformers.Phi3Config(**O.TINY, resid_pdrop=0.1).to_dict(),
        r"resid_pdrop=0.1",
    ),
    (
        "olmo3",
        lambda: dict(transformers.Olmo2Config(**O.TINY).to_dict(), model_type="olmo3"),
        r"architecture 'olmo3' is not supported",
    ),
    (
        "llama-base-model",
        lambda: _llama(architectures=["LlamaModel"]),
        r"architecture 'LlamaModel' .* not supported",
    ),
    (
        "no-model-type",
        lambda: {"architectures": ["GPT2LMHeadModel"]},
        r"architecture 'GPT2LMHeadModel' is not supported",
    ),
    (
        "hidden_act",
        lambda: _llama(hidden_act="gelu_new"),
        r"config field hidden_act='gelu_new' is not supported",
    ),
    (
        "mistral-mlp_bias",
        lambda: dict(transformers.MistralConfig(**O.TINY).to_dict(), mlp_bias=True),
        r"config field mlp_bias=True is not supported \(mistral has no MLP biases\)",
    ),
    ("attention_dropout", lambda: _llama(attention_dropout=0.1), r"attention_dropout=0.1"),
    (
        "partial_rotary_factor",
        lambda: _llama(partial_rotary_factor=0.5),
        r"partial_rotary_factor=0.5",
    ),
    (
        "longrope-qwen2",
        lambda: dict(
            transformers.Qwen2Config(**O.TINY).to_dict(),
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [1.0] * 8,
                "factor": 2.0,
            },
        ),
        r"longrope is implemented for llama and phi3, not qwen2",
    ),
    (
        "longrope-short-factors",
        lambda: _llama(
            original_max_position_embeddings=16,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 8},
        ),
        r"short_factor must be 8 numbers",
    ),
    (
        "rope-su",
        lambda: _llama(rope_scaling={"rope_type": "su", "factor": 2.0}),
        r"rope_type='su' is not supported; supported: "
        r"\['dynamic', 'linear', 'llama3', 'longrope', 'yarn'\]",
    ),
    (
        "llama3-missing-key",
        lambda: _llama(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        r"rope_scaling \(llama3\): missing keys "
        r"\['high_freq_factor', 'low_freq_factor', 'original_max_position_embeddings'\]",
    ),
    (
        "attn_logit_softcapping",
        lambda: _llama(attn_logit_softcapping=50.0),
        r"config field attn_logit_softcapping=50.0",
    ),
    (
        "final_logit_softcapping",
        lambda: _llama(final_logit_softcapping=30.0),
        r"final_logit_softcapping=30.0",
    ),
    ("qk-norm", lambda: _llama(use_qk_norm=True), r"config field use_qk_norm=True"),
    (
        "quantization_config",
        lambda: _llama(quantization_config={"quant_method": "gptq"}),
        r"quantization_config",
    ),
    ("auto_map", lambda: _llama(auto_map={"AutoModel": "x.Y"}), r"auto_map"),
    (
        "llama-sliding_window",
        lambda: _llama(sliding_window=4),
        r"config field sliding_window=4 .* for llama",
    ),
    (
        "qwen2-layer_types-without-window",
        lambda: dict(
            transformers.Qwen2Config(**O.TINY).to_dict(), layer_types=["sliding_attention"] * 3
        ),
        r"layer_types=.*need use_sliding_window",
    ),
    (
        "missing-num_attention_heads",
        lambda: {k: v for k, v in _llama().items() if k != "num_attention_heads"},
        r"config has no 'num_attention_heads'",
    ),
    (
        "gemma3-multimodal",
        lambda: {
            "model_type": "gemma3",
            "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": dict(O.TINY),
        },
        r"architecture 'gemma3' is not supported \(Gemma 3 multimodal",
    ),
    (
        "gemma3-multimodal-classifier",
        lambda: {
            "model_type": "gemma3",
            "architectures": ["Gemma3ForSequenceClassification"],
            "text_config": dict(O.TINY),
        },
        (
            r"architecture 'gemma3' is not supported .*Gemma3ForSequenceClassification wraps it.*"
            r"Gemma3TextForSequenceClassification for a value head"
        ),
    ),
    (
        "gemma3-bidirectional",
        lambda: transformers.Gemma3TextConfig(**O.TINY, use_bidirectional_attention=True).to_dict(),
        r"use_bidirectional_attention=True is not supported",
    ),
    (
        "gemma2-layer_types",
        lambda: dict(
            transformers.Gemma2Config(**O.TINY).to_dict(), layer_types=["chunked_attention"] * 3
        ),
        r"config field layer_types=.*one of sliding_attention",
    ),
    (
        "gemma2-mlp_bias",
        lambda: dict(transformers.Gemma2Config(**O.TINY).to_dict(), mlp_bias=True),
        r"mlp_bias=True is not supported \(gemma2 has no MLP biases\)",
    ),
    (
        "string-hidden_size",
        lambda: _llama(hidden_size="64"),
        r"ModelConfig.hidden_size='64' must be an int",
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_unsupported_configs_are_refused_naming_the_field(case):
    _, make, phrase = case
    d = make()
    before = json.dumps(d, sort_keys=True, default=str)
    with pytest.raises(ValueError, match=phrase):
        ModelConfig.from_hf(d)
    assert json.dumps(d, sort_keys=True, default=str) == before, "from_hf must not edit its input"


def test_sequence_classification_checkpoint_builds_the_value_head(tmp_path):
    """from_hf says which head a checkpoint holds; loading it as an LM points at the value head."""
    path = O.make_checkpoint(str(tmp_path / "q3v"), "qwen3", head="value")
    cfg = ModelConfig.from_hf(path)
    assert cfg.head == "value" and ModelConfig.from_hf(path, head="lm").head == "lm"
    with pytest.raises(
        ValueError, match=r"no tensor 'lm_head.weight'.*value head 'score.weight'.*head='value'"
    ):
        load_hf_shard(path, ModelConfig.from_hf(path, head="lm"), Layout(), 0)
    m = StageModel(cfg, load_hf_shard(path, cfg, Layout(), 0))
    ref = O.load_oracle(path, "value")
    with torch.no_grad():
        want = ref.score(ref.model(TOKENS).last_hidden_state).squeeze(-1)
        torch.testing.assert_close(
            m.head(m(TOKENS, torch.arange(T).expand(4, T))), want, atol=1e-5, rtol=0
        )
    two = dict(
        transformers.Qwen3Config(**O.TINY, num_labels=2).to_dict(),
        architectures=["Qwen3ForSequenceClassification"],
    )
    with pytest.raises(ValueError, match=r"num_labels=2 is not supported"):
        ModelConfig.from_hf(two)


# Gemma 3 text value model (Gemma3TextForSequenceClassification): q/k norms, local RoPE base on the
# sliding layers, linear scaling on the global one, window 4 < 12 tokens; final_logit_softcapping
# set to show the value head is not capped (transformers' score head ignores it)
G3V = {
    "head_dim": 16,
    "sliding_window": 4,
    "sliding_window_pattern": 3,
    "rope_local_base_freq": 100.0,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "final_logit_softcapping": 3.0,
    "query_pre_attn_scalar": 24,
}
G3V_LAYOUTS = [
    Layout(),
    Layout(tp=2, ranks=(1, 0)),
    Layout(pp=2, ranks=(3, 2)),
    Layout(tp=2, pp=2, layers_per_stage=(2, 1), ranks=(2, 0, 3, 1)),
]  # uneven: 2 + 1 layers
G3V_LENGTHS = torch.tensor([12, 9, 12, 5])
# no pad (0) inside a sequence: transformers pools at the rightmost token != pad_token_id
G3V_TOKENS = (
    TOKENS[:, :12].clamp(min=1).masked_fill(torch.arange(12) >= G3V_LENGTHS.unsqueeze(1), 0)
)


def _g3v_worker(rank, world, path):
    cfg = ModelConfig.from_hf(path)
    out = {}
    for layout in G3V_LAYOUTS:
        groups = ParallelGroups(layout)
        if not groups.member:
            continue
        eng = Engine(cfg, layout, groups, load_hf_shard(path, cfg, layout, rank))
        out[repr(layout)] = eng.inference(G3V_TOKENS, G3V_LENGTHS, micro_batches=2)["values"]
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_gemma3_value_model_matches_transformers_on_layouts(tmp_path):
    """A Gemma3TextForSequenceClassification checkpoint builds the value head (score.weight) and
    its per-token values on tp1, tp2, pp2 and an uneven tp2pp2 equal transformers' score(hidden);
    the value at each sequence's last token is the model's pooled reward (right padding)."""
    path = O.make_checkpoint(
        str(tmp_path / "g3v"),
        "gemma3_text",
        head="value",
        seed=7,
        **{k: (dict(v) if isinstance(v, dict) else v) for k, v in G3V.items()},
    )
    cfg = ModelConfig.from_hf(path)
    assert (
        cfg.head == "value"
        and cfg.model_type == "gemma3_text"
        and cfg.final_logit_softcapping == 3.0
    )
    with pytest.raises(
        ValueError, match=r"no tensor 'lm_head.weight'.*value head 'score.weight'.*head='value'"
    ):
        load_hf_shard(path, ModelConfig.from_hf(path, head="lm"), Layout(), 0)
    ref = O.load_oracle(path, "value")
    assert type(ref).__name__ == "Gemma3TextForSequenceClassification"
    valid = torch.arange(12) < G3V_LENGTHS.unsqueeze(1)
    with torch.no_grad():
        want = (
            ref.score(ref.model(G3V_TOKENS).last_hidden_state).squeeze(-1).masked_fill(~valid, 0.0)
        )
        pooled = ref(G3V_TOKENS).logits.squeeze(-1)  # batch of 4: pools by pad_token_id
    assert (want - 3.0 * torch.tanh(want / 3.0)).abs().max() > 1e-3, (
        "capping must change these values"
    )
    per_rank = [
        torch.load(io.BytesIO(b)) for b in run_distributed(_g3v_worker, 4, path, timeout=240)
    ]
    for layout in G3V_LAYOUTS:
        got = [r[repr(layout)] for r in per_rank if repr(layout) in r]
        assert len(got) == layout.world, layout
        for v in got:  # every rank of the layout holds the values
            torch.testing.assert_close(
                v, want, atol=1e-5, rtol=0, msg=lambda m, lay=layout: f"{lay}: {m}"
            )
            torch.testing.assert_close(
                v[torch.arange(4), G3V_LENGTHS - 1],
                pooled,
                atol=1e-5,
                rtol=0,
                msg=lambda m, lay=layout: f"{lay} pooled: {m}",
            )


def test_direct_construction_errors_name_the_field():
    with pytest.raises(ValueError, match=r"ModelConfig.hidden_size='64' must be an int"):
        ModelConfig(**dict(O.TINY, hidden_size="64"))
    with pytest.raises(ValueError, match=r"ModelConfig.model_type='gpt2'; allowed"):
        ModelConfig(**O.TINY, model_type="gpt2")


def test_loader_refuses_a_checkpoint_of_another_architecture(ckpts, tmp_path):
    """load_hf_shard (and the CLI through it) names the architecture, not a missing tensor."""
    src = ckpts["llama-rope-linear-head_dim"]
    for mt, cfg in (
        ("gemma", transformers.GemmaConfig(**O.TINY)),
        ("gpt2", transformers.GPT2Config(n_layer=2)),
    ):
        d = tmp_path / mt
        d.mkdir()
        os.link(os.path.join(src, "model.safetensors"), d / "model.safetensors")
        cfg.save_pretrained(d)
        with pytest.raises(
            ValueError, match=rf"architecture '{mt}' is not supported; supported: llama"
        ):
            load_hf_shard(str(d), ModelConfig(**O.TINY), Layout(), 0)
        with pytest.raises(ValueError, match=rf"config.json: architecture '{mt}' is not supported"):
            ModelConfig.from_hf(str(d))


# -- export -----------------------------------------------------------------------------------


def test_save_hf_writes_a_complete_config(ckpts, tmp_path):
    """Export without hf_config=: transformers reloads it (architectures, rope_scaling, windows,
    tied, pad_token_id), batches of 2+ work for value models, tensors and outputs are equal."""
    for name in (
        "qwen2-tied-sliding-yarn",
        "mistral-sliding-window",
        "llama-rope-llama3",
        "qwen3-tied-yarn",
        "qwen3-head_dim-sliding",
        "llama-biases-gelu-tanh",
        "llama-tied-biases-relu",
        "olmo2-tied-gqa-bias",
        "gemma2-tied-tp4",
        "gemma2-untied-layer_types",
        "gemma3-tied-tp4",
        "gemma3-untied-softcap",
        "llama-longrope",
        "phi3-tied-longrope",
        "phi3-tied-gqa",
        "phi3-sliding-tp4",
    ):
        if name not in ckpts:  # MODELS_CASES run
            continue
        path = ckpts[name]
        # no Olmo2ForSequenceClassification
        for head in ("lm", "value") if CASES[name][0] != "olmo2" else ("lm",):
            cfg = ModelConfig.from_hf(path, head=head)
            layout = Layout(tp=2, pp=2)
            full = (
                gather_full(
                    model_spec(cfg), [load_hf_shard(path, cfg, layout, r) for r in layout.ranks]
                )
                if head == "lm"
                else gather_full(
                    model_spec(cfg),
                    [
                        load_hf_shard(path, cfg, layout, r, value_head_init="normal", seed=3)
                        for r in layout.ranks
                    ],
                )
            )
            out = str(tmp_path / f"{name}-{head}")
            # With source= (a critic exported from the actor's causal-LM checkpoint): the
            # computation fields come from the spec, the rest (bos/eos ids) from the source.
            with open(os.path.join(path, "config.json")) as f:
                src = dict(json.load(f), bos_token_id=5, eos_token_id=6)
            save_hf(out, cfg, full, source=src if head == "value" else None)
            with open(os.path.join(out, "config.json")) as f:
                written = json.load(f)
            if head == "value":
                assert (written["bos_token_id"], written["eos_token_id"]) == (5, 6), name
            mt = CASES[name][0]
            # transformers' text-only Gemma 3 classifier is Gemma3Text..., its causal LM Gemma3...
            assert written["model_type"] == mt and written["architectures"] == [
                {
                    "llama": "Llama",
                    "mistral": "Mistral",
                    "qwen2": "Qwen2",
                    "qwen3": "Qwen3",
                    "olmo2": "Olmo2",
                    "phi3": "Phi3",
                    "gemma2": "Gemma2",
                    "gemma3_text": "Gemma3" if head == "lm" else "Gemma3Text",
                }[mt]
                + ("ForCausalLM" if head == "lm" else "ForSequenceClassification")
            ], written
            back_cfg = ModelConfig.from_hf(out, head=head)
            assert replace(back_cfg, pad_token_id=cfg.pad_token_id) == cfg, (name, head)
            back = O.load_oracle(out, head)
            tokens = TOKENS[:3].clamp(min=1)
            if head == "value":
                tokens[1, 20:] = back.config.pad_token_id  # right padding: the value is read at 19
            with torch.no_grad():
                if head == "lm":
                    torch.testing.assert_close(
                        back(tokens).logits, O.load_oracle(path)(tokens).logits, atol=0, rtol=0
                    )
                else:
                    assert len(written["id2label"]) == 1 and written["pad_token_id"] is not None
                    pooled = back(tokens).logits  # batch of 3: needs pad_token_id
                    shard = load_hf_shard(out, cfg, Layout(), 0)
                    m = StageModel(cfg, shard)
                    vals = m.head(m(tokens, torch.arange(T).expand(3, T)))
                    last = torch.tensor([T - 1, 19, T - 1])
                    torch.testing.assert_close(
                        pooled.squeeze(-1), vals[torch.arange(3), last], atol=1e-5, rtol=0
                    )
            got = O.fused_state(back)  # every tensor reloads equal (value head: score.weight)
            assert sorted(got) == sorted(full), (name, head, sorted(set(got) ^ set(full)))
            for k, v in full.items():
                assert torch.equal(got[k], v), (name, head, k)


def test_export_is_a_standalone_checkpoint(ckpts, tmp_path):
    """save_hf(source=dir) copies the tokenizer and generation_config.json: AutoTokenizer and
    AutoModelForCausalLM both load the export, with equal tensors."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tmp_path / "src"
    import shutil

    shutil.copytree(ckpts["qwen3-tied-yarn"], src)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(src)
    transformers.GenerationConfig(eos_token_id=3, max_new_tokens=7).save_pretrained(src)
    cfg = ModelConfig.from_hf(src)
    full = gather_full(model_spec(cfg), [load_hf_shard(src, cfg, Layout(tp=2), r) for r in (0, 1)])
    out = tmp_path / "out"
    save_hf(out, cfg, full, source=str(src))
    assert transformers.AutoTokenizer.from_pretrained(out)("w5 w7")["input_ids"] == [5, 7]
    assert transformers.GenerationConfig.from_pretrained(out).max_new_tokens == 7
    a, b = O.load_oracle(out).state_dict(), O.load_oracle(str(src)).state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "name",
    [
        "mistral-sliding-window",
        "qwen2-sliding-max-window-layers",
        "llama-rope-dynamic",
        "qwen3-head_dim-sliding",
        "qwen3-tied-yarn",
        "llama-biases-gelu-tanh",
        "olmo2-tied-gqa-bias",
        "phi3-sliding-tp4",
        "gemma2-tied-tp4",
        "gemma2-untied-layer_types",
        "gemma3-tied-tp4",
        "gemma3-untied-softcap",
        "llama-longrope",
        "phi3-tied-longrope",
    ],
)
def test_kv_cache_decode_steps_match_transformers_cache(ckpts, name):
    """Prefill 6 tokens, then 18 one-token steps through the KV cache: every step's logits equal
    transformers' own past_key_values steps (keys older than the window masked at decode time;
    dynamic RoPE rescales new keys only, cached keys keep their rotation)."""
    path = ckpts[name]
    cfg = ModelConfig.from_hf(path)
    m, ref = StageModel(cfg, load_hf_shard(path, cfg, Layout(), 0)), O.load_oracle(path)
    tok = TOKENS[:2]
    with torch.no_grad():
        caches = m.new_caches(2, T)
        got = [m.head(m(tok[:, :6], torch.arange(6).expand(2, 6), None, caches))]
        r = ref(tok[:, :6], use_cache=True)
        want, pkv = [r.logits], r.past_key_values
        for t in range(6, T):
            got.append(m.head(m(tok[:, t : t + 1], torch.full((2, 1), t), None, caches)))
            r = ref(tok[:, t : t + 1], past_key_values=pkv, use_cache=True)
            want.append(r.logits)
            pkv = r.past_key_values
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=1e-5, rtol=0)


def _v5(d: dict, rope_parameters: dict) -> dict:
    """A config dict as transformers >= 5 writes it: RoPE in rope_parameters, no 4.x RoPE fields."""
    return dict(
        {
            k: v
            for k, v in d.items()
            if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq")
        },
        rope_parameters=rope_parameters,
    )


def test_transformers5_rope_parameters_read_as_the_4x_fields():
    linear = {"rope_type": "linear", "factor": 2.0}
    v4 = _llama(rope_theta=5e5, rope_scaling=linear)
    assert ModelConfig.from_hf(_v5(v4, dict(linear, rope_theta=5e5))) == ModelConfig.from_hf(v4)
    plain = _llama(rope_theta=1e4)
    got = ModelConfig.from_hf(_v5(plain, {"rope_type": "default", "rope_theta": 1e4}))
    assert got == ModelConfig.from_hf(plain) and got.rope_scaling is None and got.rope_theta == 1e4
    g4 = transformers.Gemma3TextConfig(
        **O.TINY, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=linear
    ).to_dict()
    g5 = _v5(
        g4,
        {
            "full_attention": dict(linear, rope_theta=1e6),
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    want = ModelConfig.from_hf(g4)
    assert want.rope_local_base_freq == 1e4 and ModelConfig.from_hf(g5) == want
    # longrope: transformers 5 moves original_max_position_embeddings into rope_parameters
    sf, lf = [1.0, 1.1, 1.3, 2.0, 2.5, 3.0, 6.0, 9.0], [1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 24.0, 30.0]
    p4 = transformers.Phi3Config(
        **O.TINY,
        pad_token_id=0,
        original_max_position_embeddings=16,
        rope_scaling=dict(type="longrope", short_factor=sf, long_factor=lf),
    ).to_dict()
    p5 = _v5(
        {k: v for k, v in p4.items() if k != "original_max_position_embeddings"},
        dict(
            rope_type="longrope",
            short_factor=sf,
            long_factor=lf,
            rope_theta=p4["rope_theta"],
            original_max_position_embeddings=16,
        ),
    )
    assert ModelConfig.from_hf(p5) == ModelConfig.from_hf(p4)
    assert "rope_parameters" not in export_config(
        ModelConfig.from_hf(p5), p5
    )  # no stale v5 copy beside the 4.x fields
    with pytest.raises(
        ValueError,
        match=r"rope_parameters=.*it says rope_theta=500000.0 "
        r"and the config says rope_theta=10000.0",
    ):
        ModelConfig.from_hf(
            dict(plain, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
        )
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5 is not supported"):
        ModelConfig.from_hf(
            _v5(plain, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
        )
    assert (
        ModelConfig.from_hf(
            _v5(plain, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0})
        )
        == got
    )
    with pytest.raises(
        ValueError, match=r"rope_parameters=.*fields \['factor'\] with the default rope_type"
    ):
        ModelConfig.from_hf(_v5(plain, {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(
        ValueError, match=r"rope_parameters=.*one RoPE per layer type is gemma3_text's; llama"
    ):
        ModelConfig.from_hf(
            _v5(
                plain,
                {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e5}},
            )
        )
