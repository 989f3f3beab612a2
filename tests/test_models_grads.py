# Checks parameter GRADIENTS of every PPO/GRPO loss term (clipped policy loss on log-probs, entropy
# bonus, clipped value loss) and tied embeddings on pp = 2, 3, 4, against single-device torch
# autograd on transformers' own models, plus reallocating a trained pp=3 tied model bit for bit.
# A failure points to real_py/models/vocab.py (vocab-parallel log-prob / entropy backward),
# real_py/models/tp.py, real_py/engines/train.py (tied / DP gradient sums) or real_py/parallel.py
# (tied groups).
"""One 4-rank gloo spawn runs every (model, layout, loss term) case; ranks outside a layout skip it
(but still build its groups). The reference is transformers' LlamaForCausalLM / Qwen2ForCausalLM
(/ *ForSequenceClassification) on the whole batch with full-vocab log_softmax, in the parent.

Engines train with lr=0 and no clipping, so after train_step the flat gradient buffer holds the
(DP-summed, tied-summed) gradient of the loss; it is gathered to full tensors per parameter and
compared with the reference: max |g - g_ref| <= 1e-4 * max |g_ref| + 1e-7 per tensor (fp32; TP
and PP reorder sums, a few ulps; a missing term or reduction is off by percents).
"""

import io
import os

import pytest
import torch
import torch.distributed as dist
from support import models_oracle as O
from support.oracle import oracle_flat

from real_py import Layout, ModelConfig, ModelShard, model_spec, plan_realloc
from real_py.engines import Engine, OptimConfig
from real_py.interop.hf import gather_state_dict, load_hf_shard
from real_py.parallel import ParallelGroups
from real_py.realloc.reallocator import Reallocator
from real_py.realloc.transports.dist import DistTransport
from real_py.rlhf import ppo as P
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

# 8 heads / 4 KV heads so tp=4 fits; 4 layers so pp=4 fits; vocab 97 pads to 100 on tp=4.
SIZES = dict(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4)
CLIP, VCLIP, RTOL, ATOL = 0.2, 0.2, 1e-4, 1e-7
LM_LAYOUTS = [
    Layout(),
    Layout(tp=2),
    Layout(tp=4),
    Layout(pp=2),
    Layout(tp=2, pp=2),
    Layout(dp=2, tp=2),
    Layout(dp=2, pp=2, ranks=(3, 1, 2, 0)),
]
TIED_EXTRA = [Layout(pp=3, ranks=(3, 1, 2)), Layout(pp=4), Layout(pp=4, ranks=(2, 0, 3, 1))]
VALUE_LAYOUTS = [Layout(), Layout(tp=4), Layout(tp=2, pp=2), Layout(dp=2, pp=2)]
TERMS = {"lm": ("logprob", "entropy"), "value": ("value",)}
PROMPTS, MAX_NEW = (
    (torch.tensor([[5, 17, 3, 44], [9, 2, 0, 0], [70, 71, 72, 0]]), torch.tensor([4, 2, 3])),
    5,
)
# pp=3 tied model, trained one step, then reallocated to these layouts (and back from tp2).
REALLOC_SRC, REALLOC_DSTS = Layout(pp=3, ranks=(3, 1, 2)), [Layout(tp=2), Layout(dp=2, tp=2)]


def _data(B=6, T=10):
    tokens, lengths = O.batch(B=B, T=T)
    g = torch.Generator().manual_seed(5)
    prompt = torch.tensor([3, 2, 4, 1, 5, 2])
    mask = P.response_mask(prompt, lengths, T)
    return {
        "tokens": tokens,
        "lengths": lengths,
        "mask": mask,
        "adv": torch.randn(B, T - 1, generator=g) * mask,
        "noise": torch.randn(B, T - 1, generator=g) * 0.3,
        "returns": torch.randn(B, T - 1, generator=g),
        "vnoise": torch.randn(B, T - 1, generator=g) * 0.3,
    }


def _loss(term, out, d, n_tok):
    """The loss terms of rlhf/calls.py, normalized by the global response-token count."""
    if term == "logprob":
        return P.policy_loss(out["logprobs"], d["old_logp"], d["adv"], d["mask"], CLIP)[0] / n_tok
    if term == "entropy":
        return -(out["entropy"] * d["mask"]).sum() / n_tok
    return (
        P.value_loss(out["values"][:, :-1], d["old_values"], d["returns"], d["mask"], VCLIP)[0]
        / n_tok
    )


def _reference(path, head, d):
    """(old_logp / old_values to feed the workers, {term: fused name -> grad}, logits)."""
    model = O.load_oracle(path, head)
    n_tok = float(d["mask"].sum())
    grads, logits, extra = {}, None, {}
    for term in TERMS[head]:
        model.zero_grad()
        if head == "lm":
            logits = model(d["tokens"]).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1)
            lp = logp.gather(-1, d["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
            # old_logp near the current one, so some ratios clip and some do not.
            extra["old_logp"] = (lp.detach() + d["noise"]) * d["mask"]
            out = {"logprobs": lp, "entropy": -(logp.exp() * logp).sum(-1)}
        else:
            values = model.score(model.model(d["tokens"]).last_hidden_state).squeeze(-1)
            extra["old_values"] = (values[:, :-1].detach() + d["vnoise"]) * d["mask"]
            out = {"values": values}
        _loss(term, out, d | extra, n_tok).backward()

        class Grads:  # fused_state over the .grad tensors (tied: one Parameter, summed grad)
            config = model.config

            def state_dict(self):
                return {k: p.grad for k, p in model.named_parameters()}

        grads[term] = O.fused_state(Grads())
    return extra, grads, None if logits is None else logits.detach()


def _worker(rank, world, cases, d, realloc=True):
    out = {}
    n_tok = float(d["mask"].sum())
    for name, path, head, layouts, extra in cases:
        cfg = ModelConfig.from_hf(path, head=head)
        spec = model_spec(cfg)
        data = d | extra
        for layout in layouts:
            groups = ParallelGroups(layout)  # plain construction, whatever the spec or pp
            if not groups.member:
                continue
            shard = load_hf_shard(path, cfg, layout, rank)
            eng = Engine(cfg, layout, groups, shard, optim=OptimConfig(lr=0.0, max_grad_norm=0.0))
            per = data["tokens"].shape[0] // layout.dp
            rows = slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)
            batch = {
                k: data[k][rows]
                for k in ("tokens", "lengths", "mask")
                + (("adv", "old_logp") if head == "lm" else ("returns", "old_values"))
            }
            r = {}
            if head == "lm":
                r["logits"] = eng.forward_logits(batch["tokens"])
            if name == "qwen2_tied" and layout.dp == 1:
                r["greedy"] = eng.generate(
                    *PROMPTS, torch.zeros(3, dtype=torch.int64), max_new_tokens=MAX_NEW
                )["new_tokens"]
            for term in TERMS[head]:
                eng.train_step(
                    lambda o, mb, term=term: _loss(term, o, mb, n_tok),
                    batch,
                    micro_batches=2,
                    with_entropy=head == "lm",
                )
                g = ModelShard(spec, layout, rank, eng._trainer.grad.clone())
                r[term] = gather_state_dict(g, groups)
            out[(name, str(layout), layout.ranks)] = (groups.dp_rank, r)
    if realloc:
        out["realloc"] = _realloc_trained(rank, cases[1], d | cases[1][4], n_tok)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _realloc_trained(rank, case, data, n_tok):
    """Train the tied model one real AdamW step on pp=3, then move it pp3 -> each dst and
    tp2 -> pp3; every destination shard must equal the oracle slicing of the trained weights."""
    _, path, _, _, _ = case
    cfg = ModelConfig.from_hf(path)
    spec = model_spec(cfg)
    src = REALLOC_SRC
    groups = ParallelGroups(src)
    shard = None
    if groups.member:
        shard = load_hf_shard(path, cfg, src, rank)
        eng = Engine(cfg, src, groups, shard, optim=OptimConfig(lr=1e-2))
        eng.train_step(
            lambda o, mb: _loss("logprob", o, mb, n_tok),
            {k: data[k] for k in ("tokens", "lengths", "mask", "adv", "old_logp")},
            micro_batches=3,
        )
    full = gather_state_dict(shard, groups) if shard is not None else None
    box = [full]
    dist.broadcast_object_list(box, src=src.ranks[0])
    full = box[0]
    t = DistTransport(dist.group.WORLD, timeout=30)
    checked = []
    for dst in REALLOC_DSTS:
        for a, b, s in ((src, dst, shard), (dst, src, None)):
            if s is None and rank in a.ranks:
                s = ModelShard.from_full(spec, a, rank, full)
            d_ = ModelShard.empty(spec, b, rank) if rank in b.ranks else None
            Reallocator(plan_realloc(spec, a, b), t, bucket_bytes=1 << 14).run(
                s if rank in a.ranks else None, d_
            )
            if d_ is not None:
                assert torch.equal(d_.flat, oracle_flat(spec, b, rank, full)), (
                    f"{a}->{b} rank {rank}"
                )
                checked.append(f"{a}->{b}")
    # The trained tied copies on the first and last stage must agree (tied all-reduce).
    if shard is not None and shard.stage in (0, src.pp - 1):
        emb = shard.view("embed_tokens.weight").clone()
        ref = oracle_flat(spec, src, rank, full)
        assert torch.equal(shard.flat, ref), (
            f"rank {rank}: trained pp3 shard differs from its gathered copy"
        )
        checked.append(f"tied copy stage {shard.stage} {tuple(emb.shape)}")
    return checked


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grads")
    d = _data()
    untied = O.make_checkpoint(str(tmp / "llama"), "llama", tied=False, seed=0, **SIZES)
    tied = O.make_checkpoint(str(tmp / "qwen2_tied"), "qwen2", tied=True, seed=1, **SIZES)
    value = O.make_checkpoint(str(tmp / "value"), "llama", head="value", seed=2, **SIZES)
    refs, cases = {}, []
    for name, path, head, layouts in (
        ("llama", untied, "lm", LM_LAYOUTS),
        ("qwen2_tied", tied, "lm", LM_LAYOUTS + TIED_EXTRA),
        ("value", value, "value", VALUE_LAYOUTS),
    ):
        extra, grads, logits = _reference(path, head, d)
        refs[name] = (grads, logits)
        cases.append((name, path, head, layouts, extra))
    outs = [torch.load(io.BytesIO(b)) for b in run_distributed(_worker, 4, cases, d, timeout=240)]
    return cases, refs, outs


def _gathered(outs, key, head="lm"):
    """The full gradients from the layout's first rank, and every DP replica's logits in order."""
    hits = [o[key] for o in outs if key in o]
    full = next(r for _, r in hits if r[TERMS[head][0]] is not None)
    logits = {dp: r["logits"] for dp, r in hits if "logits" in r}
    return full, [logits[k] for k in sorted(logits)]


def _check_grads(got, want, tag):
    assert got.keys() == want.keys(), f"{tag}: names {sorted(got.keys() ^ want.keys())}"
    bad = []
    for n, ref in want.items():
        err = float((got[n] - ref).abs().max())
        bound = RTOL * float(ref.abs().max()) + ATOL
        if not err <= bound:
            bad.append(
                f"{n}: max err {err:.3g} > {bound:.3g} "
                f"({err / max(float(ref.abs().max()), 1e-30):.2%})"
            )
    assert not bad, f"{tag}:\n" + "\n".join(bad)


def test_gradients_of_every_loss_term_match_autograd(runs):
    cases, refs, outs = runs
    n = 0
    for name, _, head, layouts, _ in cases:
        grads, _ = refs[name]
        for layout in layouts:
            full, _ = _gathered(outs, (name, str(layout), layout.ranks), head)
            for term in TERMS[head]:
                _check_grads(
                    full[term], grads[term], f"{name} {layout} ranks {layout.ranks} {term}"
                )
                n += 1
    assert n == 2 * 7 + 2 * 10 + 4


def test_forward_logits_match_transformers_including_tied_pp3_pp4(runs):
    cases, refs, outs = runs
    for name, _, head, layouts, _ in cases:
        if head != "lm":
            continue
        want = refs[name][1]
        for layout in layouts:
            _, logits = _gathered(outs, (name, str(layout), layout.ranks))
            per = want.shape[0] // layout.dp
            for k, lg in enumerate(logits):
                torch.testing.assert_close(
                    lg,
                    want[k * per : (k + 1) * per],
                    atol=1e-5,
                    rtol=0,
                    msg=lambda m: f"{name} {layout} dp {k}: {m}",
                )


def test_tied_greedy_generation_on_pp3_pp4_matches_transformers(runs):
    cases, _, outs = runs
    name, path = cases[1][0], cases[1][1]
    want = O.oracle_generate(O.load_oracle(path), *PROMPTS, MAX_NEW)
    n = 0
    for layout in cases[1][3]:
        if layout.dp == 1:
            for o in outs:
                hit = o.get((name, str(layout), layout.ranks))
                if hit is not None:
                    assert torch.equal(hit[1]["greedy"], want), f"{layout} ranks {layout.ranks}"
                    n += 1
    assert n == sum(x.world for x in cases[1][3] if x.dp == 1)  # every rank of pp 1..4 layouts


def test_tied_pp3_reallocates_bit_for_bit(runs):
    _, _, outs = runs
    done = sorted(c for o in outs for c in o["realloc"])
    for dst in REALLOC_DSTS:
        assert f"{REALLOC_SRC}->{dst}" in done and f"{dst}->{REALLOC_SRC}" in done, done
    assert sum(c.startswith("tied copy") for c in done) == 2, done


# -- the newer families: every loss term's gradients on TP x PP (fused Phi-3 storage, q/k
# norms, biases, Gemma's (1 + w) norms / soft-capping / sandwich norms, longrope) ----------------
LONGROPE = dict(
    original_max_position_embeddings=6,
    rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0, 1.5, 2.0, 3.0], long_factor=[2.0, 3.0, 5.0, 7.0]
    ),
)
GEMMA = dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=12, final_logit_softcapping=3.0)
# name -> (model_type, tied, head, config fields); every case runs tp2pp2 (permuted ranks), tp4 and
# pp3. pad_token_id: transformers' embedding row of the pad token gets no gradient from lookups
# (nn.Embedding padding_idx). The batch holds OLMo 2's default pad 1 once, 60 (a later TP rank's
# rows) and 96 (the last row) at real positions; 0 only in the padding, where no gradient reaches.
FAMILIES = {
    "qwen3": ("qwen3", False, "lm", dict(attention_bias=True, pad_token_id=60)),
    "qwen3-value": ("qwen3", False, "value", {}),
    "olmo2-tied": ("olmo2", True, "lm", {}),
    "olmo2-untied": ("olmo2", False, "lm", dict(attention_bias=True)),
    "qwen3-tied": ("qwen3", True, "lm", {}),
    "phi3": (
        "phi3",
        False,
        "lm",
        dict(
            pad_token_id=0,
            original_max_position_embeddings=6,
            rope_scaling=dict(
                type="longrope", short_factor=[1.0, 1.5, 2.0, 3.0], long_factor=[2.0, 3.0, 5.0, 7.0]
            ),
        ),
    ),
    "phi3-value": ("phi3", False, "value", dict(pad_token_id=0)),
    "llama-biases": (
        "llama",
        False,
        "lm",
        dict(
            attention_bias=True,
            mlp_bias=True,
            hidden_act="gelu_pytorch_tanh",
            pad_token_id=96,
            **LONGROPE,
        ),
    ),
    "llama-biases-value": ("llama", False, "value", dict(attention_bias=True, mlp_bias=True)),
    "gemma2-tied": ("gemma2", True, "lm", dict(GEMMA, attn_logit_softcapping=2.0)),
    "gemma2-value": ("gemma2", False, "value", dict(GEMMA, attn_logit_softcapping=2.0)),
    "gemma3-tied": (
        "gemma3_text",
        True,
        "lm",
        dict(
            GEMMA,
            rope_local_base_freq=100.0,
            sliding_window_pattern=2,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    # Gemma3TextForSequenceClassification; its final_logit_softcapping does not reach the value head
    "gemma3-value": (
        "gemma3_text",
        False,
        "value",
        dict(
            GEMMA,
            rope_local_base_freq=100.0,
            sliding_window_pattern=2,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
}
if os.environ.get("FAMILY_CASES"):  # targeted runs: a substring of the case names
    FAMILIES = {k: v for k, v in FAMILIES.items() if os.environ["FAMILY_CASES"] in k}
FAMILY_LAYOUTS = [
    Layout(tp=2, pp=2, ranks=(3, 1, 2, 0), order="pp-tp-dp"),
    Layout(tp=4),
    Layout(pp=3, ranks=(2, 0, 3)),
]


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("family_grads")
    d = _data()
    refs, cases = {}, []
    for i, (name, (mt, tied, head, over)) in enumerate(FAMILIES.items()):
        path = O.make_checkpoint(
            str(tmp / name),
            mt,
            tied=tied,
            head=head,
            seed=20 + i,
            **SIZES,
            **{k: (dict(v) if isinstance(v, dict) else v) for k, v in over.items()},
        )
        extra, grads, logits = _reference(path, head, d)
        refs[name] = (grads, logits)
        cases.append((name, path, head, FAMILY_LAYOUTS, extra))
    outs = [
        torch.load(io.BytesIO(b)) for b in run_distributed(_worker, 4, cases, d, False, timeout=600)
    ]
    return cases, refs, outs


@pytest.mark.timeout(900)
def test_family_gradients_and_logits_match_autograd(family_runs):
    """logprob / entropy (lm) and value-loss gradients of every family, and lm logits."""
    _check_families(family_runs)


def _check_families(family_runs):
    cases, refs, outs = family_runs
    n, failed = 0, []
    for name, _, head, layouts, _ in cases:
        grads, want = refs[name]
        for layout in layouts:
            full, logits = _gathered(outs, (name, str(layout), layout.ranks), head)
            for term in TERMS[head]:
                try:  # every failing (case, layout, term), not just the first
                    _check_grads(
                        full[term], grads[term], f"{name} {layout} ranks {layout.ranks} {term}"
                    )
                except AssertionError as e:
                    failed.append(str(e))
                n += 1
            if head == "lm":
                torch.testing.assert_close(
                    torch.cat(logits),
                    want,
                    atol=1e-5,
                    rtol=0,
                    msg=lambda m: f"{name} {layout}: {m}",
                )
    assert not failed, "\n".join(failed)
    assert n == len(FAMILY_LAYOUTS) * sum(len(TERMS[c[2]]) for c in cases)
