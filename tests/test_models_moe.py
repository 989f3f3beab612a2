# Checks the mixture-of-experts forward (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers:
# logits, KV-cache decode steps, greedy generation, the load-balancing aux loss and one step's
# gradients (log-prob, entropy and aux-loss terms), on ep1 and on expert-parallel layouts (ep2 / ep4
# with dp, tp2 and pp2; experts split by etp2) over 4 gloo ranks.
# A failure points to real_py/models/moe.py (routing, dispatch, aux loss), real_py/models/tp.py (TP
# row split), real_py/spec/hf_config.py (MoE fields) or real_py/interop/hf.py (expert tensor names).
"""Oracle: transformers 4.57 itself on random-init checkpoints it wrote
(models_oracle.make_checkpoint), with output_router_logits=True for its aux_loss
(load_balancing_loss_func with the attention mask) and autograd for the gradients. Nothing here
calls real_py to compute an expected value: HF gradients are mapped to real_py's fused names by
plain renames in this file, and each rank's piece is compared with a slice of them. fp32; 1e-5 as
the dense tests (TP/EP reorder sums by ulps).
"""

import io
import re

import pytest
import torch
import torch.distributed as dist
import transformers
from support import models_oracle as O

from real_py import Layout, ModelConfig, ModelShard, model_spec
from real_py.interop.hf import load_hf_experts, load_hf_shard
from real_py.models import (
    StageModel,
    expert_token_counts,
    load_balancing_loss,
    router_records,
    router_z_loss,
    vocab_parallel_logprobs,
)
from real_py.models.tp import gather_from_tp
from real_py.parallel import ParallelGroups
from real_py.realloc.shard import ExpertShard, tp_slice
from real_py.testing import run_distributed

COEF = 0.5  # router_aux_loss_coef: large, so a wrong aux gradient shows
CASES = {  # model_type -> checkpoint fields beyond models_oracle.TINY
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        router_aux_loss_coef=COEF,
    ),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=40,
        router_aux_loss_coef=COEF,
    ),
    "mixtral": dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        sliding_window=4,
        router_aux_loss_coef=COEF,
    ),
}
B, T = 4, 10
TOKENS = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(7))
LENGTHS = torch.tensor([10, 7, 10, 5])
MASK = (torch.arange(T) < LENGTHS.unsqueeze(1)).long()
PROMPT = TOKENS[:, :5]
MAX_NEW = 8
LAYOUTS = [  # 4 gloo ranks at most
    Layout(dp=2, ep=2),  # experts split, dp tokens exchanged
    Layout(tp=2, ep=2),  # ep group = TP group: row blocks exchanged
    # ep over dp x tp; permuted ranks: group rank -> ep index (3, 0, 2, 1) is not its own inverse
    Layout(dp=2, tp=2, ep=4, ranks=(1, 2, 3, 0), order="dp-tp-pp"),
    Layout(dp=2, pp=2, ep=2),  # one ep group per pipeline stage
    Layout(tp=2, pp=2, ep=2),  # tp row blocks and stages together
    # etp: each expert's intermediate dim split; rows gathered over the etp group, partial outputs
    # summed
    Layout(tp=2, etp=2),  # etp group = TP group (vLLM's TP experts)
    Layout(dp=2, etp=2),  # etp group across two dp replicas
    Layout(dp=2, tp=2, ep=2, etp=2),  # etp over tp, ep over dp
]
# qwen3_moe on every layout; the other families on four (dispatch across dp, TP row blocks with
# permuted ranks, pp, etp) to keep the spawn short
FAMILY_LAYOUTS = {
    "qwen3_moe": LAYOUTS,
    "qwen2_moe": [LAYOUTS[i] for i in (0, 2, 3, 5)],
    "mixtral": [LAYOUTS[i] for i in (1, 2, 4, 7)],
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {mt: O.make_checkpoint(str(root / mt), mt, seed=3, **kw) for mt, kw in CASES.items()}


def _hf_named(name: str) -> str:
    """transformers parameter name -> real_py's unfused name (Mixtral's w1/w3/w2 as
    gate/up/down)."""
    name = name.removeprefix("model.").replace("block_sparse_moe", "mlp")
    return re.sub(
        r"\.w([123])\.",
        lambda m: {"1": ".gate_proj.", "3": ".up_proj.", "2": ".down_proj."}[m[1]],
        name,
    )


def hf_grads(ref) -> dict:
    """The oracle's gradients under real_py's fused names (q|k|v, gate|up concatenated on dim 0)."""
    g = {
        _hf_named(k): (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
        for k, p in ref.named_parameters()
    }
    out = {}
    for n, v in g.items():
        if ".q_proj." in n:
            out[n.replace("q_proj", "qkv_proj")] = torch.cat(
                [v, g[n.replace("q_proj", "k_proj")], g[n.replace("q_proj", "v_proj")]]
            )
        elif ".gate_proj." in n:
            out[n.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [v, g[n.replace("gate_proj", "up_proj")]]
            )
        elif not any(s in n for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[n] = v
    return out


ENT = 0.1  # entropy bonus: the PPO loss's entropy term


def entropy_term(logp_all: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """-ENT * sum of the next-token distributions' entropies over real positions / all of them."""
    ent = -(logp_all.exp() * logp_all).sum(-1)
    mask = torch.arange(ent.shape[1]) < (lengths - 1).unsqueeze(1)
    return -ENT * (ent * mask).sum() / float((LENGTHS - 1).sum())


def oracle(path):
    """transformers' logits, aux loss, router logits and gradients of nll - ENT entropy + coef
    aux."""
    ref = O.load_oracle(path)
    out = ref(TOKENS, attention_mask=MASK, output_router_logits=True)
    logp = torch.log_softmax(out.logits[:, :-1], -1)
    lp = logp.gather(-1, TOKENS[:, 1:, None]).squeeze(-1)
    loss = (
        O.nll_loss(lp, LENGTHS, float((LENGTHS - 1).sum()))
        + entropy_term(logp, LENGTHS)
        + COEF * out.aux_loss
    )
    loss.backward()
    return ref, out, hf_grads(ref)


def _model(path, cfg, layout=Layout(), rank=0, groups=None):
    return StageModel(
        cfg,
        load_hf_shard(path, cfg, layout, rank),
        groups.tp_group if groups else None,
        load_hf_experts(path, cfg, layout, rank),
        groups.ep_group if groups else None,
        groups.etp_group if groups else None,
    )


@pytest.mark.parametrize("mt", list(CASES))
def test_ep1_logits_aux_loss_gradients(ckpts, mt):
    path = ckpts[mt]
    cfg = ModelConfig.from_hf(path)
    assert cfg.router_aux_loss_coef == COEF and cfg.num_experts == 8
    ref, out, want = oracle(path)
    m = _model(path, cfg)
    logits = m.head(m(TOKENS, torch.arange(T).expand(B, T)))
    keep = MASK.bool()  # transformers masks the padding keys; real positions are unaffected
    torch.testing.assert_close(logits[keep], out.logits[keep], atol=1e-5, rtol=0)
    recs = router_records(m)
    assert len(recs) == len(out.router_logits) > 0
    aux = load_balancing_loss(recs, cfg.num_experts, cfg.num_experts_per_tok, MASK)
    torch.testing.assert_close(aux, out.aux_loss, atol=1e-6, rtol=0)
    logp = torch.log_softmax(logits[:, :-1], -1)
    lp = logp.gather(-1, TOKENS[:, 1:, None]).squeeze(-1)
    (
        O.nll_loss(lp, LENGTHS, float((LENGTHS - 1).sum()))
        + entropy_term(logp, LENGTHS)
        + cfg.router_aux_loss_coef * aux
    ).backward()
    params = {**m.shard_params, **m.expert_params}
    assert sorted(params) == sorted(want)
    for n, p in params.items():
        torch.testing.assert_close(
            p.grad, want[n], atol=1e-5, rtol=0, msg=lambda s: f"{mt} {n}: {s}"
        )
    assert any(want[n].abs().max() > 1e-4 for n in want if ".mlp.gate." in n), (
        "router gradients vanish"
    )
    # z-loss and per-expert counts from transformers' router logits (independent formulas)
    keep = MASK.reshape(-1).bool()
    z = torch.stack([torch.logsumexp(r.float(), -1).pow(2)[keep] for r in out.router_logits]).mean()
    torch.testing.assert_close(router_z_loss(recs, MASK), z, atol=1e-6, rtol=1e-6)
    want_counts = torch.stack(
        [
            torch.bincount(
                r.topk(cfg.num_experts_per_tok, -1).indices[keep].reshape(-1), minlength=8
            )
            for r in out.router_logits
        ]
    )
    assert torch.equal(expert_token_counts(recs, cfg.num_experts, MASK), want_counts)


@pytest.mark.parametrize("mt", list(CASES))
def test_ep1_kv_cache_decode_steps(ckpts, mt):
    """Prefill 4 tokens, then one token per step through the KV cache, against transformers'
    past_key_values steps (Mixtral: the sliding window of 4 over cache slots)."""
    path = ckpts[mt]
    cfg = ModelConfig.from_hf(path)
    m, ref = _model(path, cfg), O.load_oracle(path)
    with torch.no_grad():
        caches = m.new_caches(B, T)
        got = [m.head(m(TOKENS[:, :4], torch.arange(4).expand(B, 4), None, caches))]
        r = ref(TOKENS[:, :4], use_cache=True)
        want, pkv = [r.logits], r.past_key_values
        for t in range(4, T):
            got.append(m.head(m(TOKENS[:, t : t + 1], torch.full((B, 1), t), None, caches)))
            r = ref(TOKENS[:, t : t + 1], past_key_values=pkv, use_cache=True)
            want.append(r.logits)
            pkv = r.past_key_values
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=1e-5, rtol=0)


# -- expert-parallel layouts on 4 gloo ranks ----------------------------------------------------


def _stage_forward(m, g, x, pos, caches=None):
    """One pipeline pass of this rank's stage: (input that needs a gradient or None, output)."""
    inp = None
    if not g.is_first_stage:
        inp = torch.empty(x.shape[0], x.shape[1], m.config.hidden_size)
        dist.recv(inp, g.prev_rank)
        inp.requires_grad_(caches is None)
        x = inp
    h = m(x, pos, None, caches)
    if not g.is_last_stage:
        dist.send(h.detach(), g.next_rank)
    return inp, h


def _generate(m, g, prompt):
    b, P = prompt.shape
    caches, x, pos, new = m.new_caches(b, P + MAX_NEW), prompt, torch.arange(P).expand(b, P), []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            _, h = _stage_forward(m, g, x, pos, caches)
            tok = torch.empty(b, 1, dtype=torch.int64)
            if g.is_last_stage:
                logits = gather_from_tp(m.head(h[:, -1:]), g.tp_group, g.tp_ranks)
                tok = logits[..., : m.config.vocab_size].argmax(-1)  # vocab padding rows dropped
                if not g.is_first_stage:
                    dist.send(tok, g.pp_ranks[0])
            else:
                dist.recv(tok, g.last_stage_rank)
            new.append(tok)
            x, pos = tok, pos[:, -1:] + 1
    return torch.cat(new, 1)


def _worker(rank, world, cases):
    out = {}
    for mt, path in cases:
        cfg = ModelConfig.from_hf(path)
        for layout in FAMILY_LAYOUTS[mt]:
            g = ParallelGroups(layout)
            everyone = dist.new_group(list(layout.ranks))  # the ranks whose tokens form the batch
            if not g.member:
                continue
            m = _model(path, cfg, layout, rank, g)
            per = B // layout.dp
            rows = slice(g.dp_rank * per, (g.dp_rank + 1) * per)
            tokens, mask = TOKENS[rows], MASK[rows]
            inp, h = _stage_forward(m, g, tokens, torch.arange(T).expand(per, T))
            aux = load_balancing_loss(
                router_records(m), cfg.num_experts, cfg.num_experts_per_tok, mask, everyone
            )
            r = {"aux": aux.item()}
            if g.is_last_stage:
                logits = m.head(h)
                r["logits"] = gather_from_tp(logits.detach(), g.tp_group, g.tp_ranks)[
                    ..., : cfg.vocab_size
                ]
                lp, ent = vocab_parallel_logprobs(
                    logits[:, :-1],
                    tokens[:, 1:],
                    g.tp_group,
                    g.tp_rank,
                    cfg.vocab_size,
                    with_entropy=True,
                )
                mask = torch.arange(T - 1) < (LENGTHS[rows] - 1).unsqueeze(1)
                loss = (
                    O.nll_loss(lp, LENGTHS[rows], float((LENGTHS - 1).sum()))
                    - ENT * (ent * mask).sum() / float((LENGTHS - 1).sum())
                    + cfg.router_aux_loss_coef * aux
                )
                loss.backward()
            else:
                grad = torch.empty_like(h)
                dist.recv(grad, g.next_rank)
                torch.autograd.backward([h, cfg.router_aux_loss_coef * aux], [grad, torch.ones(())])
            if inp is not None:
                dist.send(inp.grad, g.prev_rank)
            r["grads"] = {
                n: p.grad.clone() for n, p in {**m.shard_params, **m.expert_params}.items()
            }
            r["greedy"] = _generate(m, g, PROMPT[rows])
            with torch.no_grad():  # one token per rank: fewer rows than TP ranks (empty row blocks)
                _, h1 = _stage_forward(m, g, tokens[:1, :1], torch.zeros(1, 1, dtype=torch.int64))
                if g.is_last_stage:
                    r["one"] = gather_from_tp(m.head(h1), g.tp_group, g.tp_ranks)[
                        ..., : cfg.vocab_size
                    ]
            r["etp_rank"] = layout.expert_coords(rank)[2]
            out[(mt, repr(layout))] = (g.dp_rank, g.tp_rank, g.stage, r)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(ckpts):
    per_rank = run_distributed(_worker, 4, list(ckpts.items()), timeout=240)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in per_rank]


def oracle_greedy(ref):
    pkv, ids, pos, new = None, PROMPT, torch.arange(PROMPT.shape[1]).expand(B, -1), []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            r = ref(ids, position_ids=pos, past_key_values=pkv, use_cache=True)
            pkv, ids = r.past_key_values, r.logits[:, -1:].argmax(-1)
            new.append(ids)
            pos = pos[:, -1:] + 1
    return torch.cat(new, 1)


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mt", list(CASES))
def test_ep_layouts_logits_generation_gradients(ckpts, runs, mt):
    """Per layout: logits of each dp replica's rows, KV-cache greedy generation, the aux loss
    (sum of the ranks' terms) and every rank's gradient piece (dense pieces summed over dp
    replicas, expert tensors over the ranks holding them) equal transformers'."""
    path = ckpts[mt]
    cfg = ModelConfig.from_hf(path)
    spec = {p.name: p for p in model_spec(cfg).params}
    ref, out, want = oracle(path)
    greedy = oracle_greedy(O.load_oracle(path))
    for layout in FAMILY_LAYOUTS[mt]:
        key = (mt, repr(layout))
        res = [x[key] for x in runs if key in x]
        assert len(res) == layout.world, key
        last = {dp: r for dp, _, s, r in res if s == layout.pp - 1}
        keep = MASK.bool()
        torch.testing.assert_close(
            torch.cat([last[d]["logits"] for d in range(layout.dp)])[keep],
            out.logits[keep],
            atol=1e-5,
            rtol=0,
            msg=lambda s: f"{key} logits: {s}",
        )
        assert torch.equal(torch.cat([last[d]["greedy"] for d in range(layout.dp)]), greedy), (
            key,
            "greedy",
        )
        per = B // layout.dp
        torch.testing.assert_close(
            torch.cat([last[d]["one"] for d in range(layout.dp)]),
            out.logits[::per, :1],
            atol=1e-5,
            rtol=0,
            msg=lambda s: f"{key} one token: {s}",
        )
        torch.testing.assert_close(
            torch.tensor(sum(r["aux"] for *_, r in res)),
            out.aux_loss.detach(),
            atol=1e-6,
            rtol=0,
            msg=lambda s: f"{key} aux loss: {s}",
        )
        summed: dict = {}
        for _, tp, _stage, r in res:
            for n, gr in r["grads"].items():
                k = (n, tp if spec[n].expert < 0 else r["etp_rank"])  # experts: their etp piece
                summed[k] = summed.get(k, 0) + gr
        for (n, tp), gr in summed.items():
            exp = tp_slice(spec[n], want[n], layout.tp if spec[n].expert < 0 else layout.etp, tp)
            torch.testing.assert_close(
                gr, exp, atol=1e-5, rtol=0, msg=lambda s: f"{key} {n} tp {tp}: {s}"
            )
        assert {n for n, _ in summed} == set(want), key


# -- refusals ---------------------------------------------------------------------------------


def test_refusals(ckpts):
    with pytest.raises(
        ValueError,
        match=r"architecture 'deepseek_v3' is not supported \(DeepSeek-V3: multi-head "
        r"latent attention \(MLA\), grouped top-k routing",
    ):
        ModelConfig.from_hf(dict(transformers.DeepseekV3Config(**O.TINY).to_dict()))
    mix = transformers.MixtralConfig(**O.TINY, router_jitter_noise=0.1).to_dict()
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1 is not supported"):
        ModelConfig.from_hf(mix)
    q3 = transformers.Qwen3MoeConfig(**O.TINY, use_sliding_window=True, sliding_window=4).to_dict()
    with pytest.raises(ValueError, match=r"use_sliding_window=True is not supported"):
        ModelConfig.from_hf(q3)
    path = ckpts["qwen3_moe"]
    cfg = ModelConfig.from_hf(path)
    with pytest.raises(ValueError, match=r"has 8 experts per MoE layer; pass experts="):
        StageModel(cfg, load_hf_shard(path, cfg, Layout(), 0))
    lay = Layout(dp=2, ep=2)
    with pytest.raises(ValueError, match=r"ep=2; pass ep_group"):
        StageModel(
            cfg, load_hf_shard(path, cfg, lay, 0), None, ExpertShard.empty(model_spec(cfg), lay, 0)
        )
    lay = Layout(dp=2, etp=2)
    with pytest.raises(ValueError, match=r"etp=2; pass etp_group"):
        StageModel(
            cfg, load_hf_shard(path, cfg, lay, 0), None, ExpertShard.empty(model_spec(cfg), lay, 0)
        )


def test_bad_expert_inputs(ckpts):
    """Wrong expert buffers, a rank outside the layout and an incomplete shared expert are refused
    naming the cause."""
    path = ckpts["qwen3_moe"]
    cfg = ModelConfig.from_hf(path)
    spec = model_spec(cfg)
    lay = Layout(dp=2, ep=2)
    with pytest.raises(
        ValueError,
        match=r"expert flat buffer for .* rank 1 must be a contiguous 1-D torch.float32 tensor",
    ):
        ExpertShard(spec, lay, 1, torch.zeros(5))
    with pytest.raises(ValueError, match=r"rank 7 is not in layout"):
        ExpertShard.empty(spec, lay, 7)
    with pytest.raises(ValueError, match=r"is not of layout .* rank 0"):
        StageModel(
            cfg,
            load_hf_shard(path, cfg, Layout(), 0),
            None,
            ExpertShard.empty(spec, Layout(dp=2), 1),
        )
    q2 = transformers.Qwen2MoeConfig(**O.TINY, shared_expert_intermediate_size=0).to_dict()
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=0 is not supported"):
        ModelConfig.from_hf(q2)
    dense = ModelConfig.from_hf(transformers.Qwen3Config(**O.TINY).to_dict())
    with pytest.raises(ValueError, match=r"experts given but ModelConfig.num_experts=0"):
        StageModel(
            dense,
            ModelShard.empty(model_spec(dense), Layout(), 0),
            None,
            ExpertShard.empty(spec, Layout(), 0),
        )


@pytest.mark.parametrize("mt", list(CASES))
def test_value_head_checkpoints(tmp_path, mt):
    """*ForSequenceClassification MoE checkpoints (num_labels=1) load as value models: per-token
    values equal transformers' score(hidden) and the value gradients (with the aux loss) equal
    autograd's."""
    path = O.make_checkpoint(str(tmp_path / mt), mt, seed=6, head="value", **CASES[mt])
    cfg = ModelConfig.from_hf(path)
    assert cfg.head == "value"
    ref = O.load_oracle(path, "value")
    out = ref.model(TOKENS, attention_mask=MASK, output_router_logits=True)
    want = ref.score(out.last_hidden_state).squeeze(-1)
    m = _model(path, cfg)
    got = m.head(m(TOKENS, torch.arange(T).expand(B, T)))
    keep = MASK.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)
    targets = torch.randn(B, T, generator=torch.Generator().manual_seed(2))
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf_aux = load_balancing_loss_func(out.router_logits, 8, cfg.num_experts_per_tok, MASK)
    (O.value_loss(want, LENGTHS, targets, float(LENGTHS.sum())) + COEF * hf_aux).backward()
    aux = load_balancing_loss(router_records(m), cfg.num_experts, cfg.num_experts_per_tok, MASK)
    (O.value_loss(got, LENGTHS, targets, float(LENGTHS.sum())) + COEF * aux).backward()
    grads = hf_grads(ref)
    grads["value_head.weight"] = grads.pop("score.weight")
    for n, p in {**m.shard_params, **m.expert_params}.items():
        torch.testing.assert_close(
            p.grad, grads[n], atol=1e-5, rtol=0, msg=lambda s: f"{mt} {n}: {s}"
        )
