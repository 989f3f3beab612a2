# Checks the engines on mixture-of-experts models (Engine with an ExpertShard): full logits, greedy
# generation, and one AdamW train_step with the load-balancing aux loss, against transformers.
# A failure points to real_py/engines/moe_train.py (expert gradients, reduction, router losses),
# real_py/engines/train.py (1F1B with router-loss terms on every stage) or
# real_py/engines/generate.py.
"""Oracle: transformers' model, its aux_loss (output_router_logits, attention_mask), autograd,
clip_grad_norm_ and torch.optim.AdamW on the whole batch (tests/test_models_moe.py builds the
checkpoints). Layouts on 4 gloo ranks: dp2ep2 (tokens of two dp replicas meet in one ep group),
dp2pp2ep2 (the aux loss's counts summed across stages inside 1F1B), ep1 dp2 (experts replicated,
gradients summed over the stage), tp2pp2ep2 (TP row blocks routed per rank, stages) and
dp2tp2ep2etp2 (expert pieces over the TP ranks, experts over the dp ranks)."""

import io

import pytest
import torch
import torch.distributed as dist
from support import models_oracle as O
from test_models_moe import CASES, LENGTHS, MASK, MAX_NEW, PROMPT, TOKENS, B, hf_grads

from real_py import Layout, ModelConfig, model_spec
from real_py.engines import Engine, OptimConfig
from real_py.interop.hf import gather_state_dict, load_hf_experts, load_hf_shard
from real_py.parallel import ParallelGroups
from real_py.realloc.shard import tp_slice
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

LR, WD, EPS, MAX_NORM = (
    1e-3,
    0.1,
    1e-3,
    0.5,
)  # eps 1e-3: Adam does not blow up ulp-level noise of ~0 gradients
LAYOUTS = [
    Layout(dp=2, ep=2),
    Layout(dp=2, pp=2, ep=2),
    Layout(dp=2),
    Layout(tp=2, pp=2, ep=2),
    Layout(dp=2, tp=2, ep=2, etp=2),
]
FAMILIES = ["qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-engines")
    return {mt: O.make_checkpoint(str(root / mt), mt, seed=4, **CASES[mt]) for mt in FAMILIES}


def _worker(rank, world, cases):
    out = {}
    total = float((LENGTHS - 1).sum())
    for mt, path in cases:
        cfg = ModelConfig.from_hf(path)
        for layout in LAYOUTS:
            g = ParallelGroups(layout, moe=True)
            if not g.member:
                continue
            eng = Engine(
                cfg,
                layout,
                g,
                load_hf_shard(path, cfg, layout, rank),
                experts=load_hf_experts(path, cfg, layout, rank),
                optim=OptimConfig(lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=MAX_NORM),
            )
            per = B // layout.dp
            rows = slice(g.dp_rank * per, (g.dp_rank + 1) * per)
            r = {
                "logits": eng.forward_logits(TOKENS[rows]),
                "greedy": eng.generate(
                    PROMPT[rows],
                    torch.full((per,), PROMPT.shape[1]),
                    torch.zeros(per, dtype=torch.int64),
                    max_new_tokens=MAX_NEW,
                )["new_tokens"],
            }
            r["static"] = eng.generate(
                PROMPT[rows],
                torch.full((per,), PROMPT.shape[1]),
                torch.zeros(per, dtype=torch.int64),
                max_new_tokens=MAX_NEW,
                decode="static",
            )["new_tokens"]
            # stop tokens that end dp replica 0's rows at once: with ep > 1 the other replica's
            # all-to-alls still need replica 0 to step (generate stops every replica together)
            eos = (
                r["greedy"][:, 0].clone() if g.dp_rank == 0 else torch.zeros(per, dtype=torch.int64)
            )
            dist.broadcast(eos, layout.rank(0, 0, 0), group=g.layout_group)
            r["eos"] = eos
            r["eos_new"] = eng.generate(
                PROMPT[rows],
                torch.full((per,), PROMPT.shape[1]),
                torch.zeros(per, dtype=torch.int64),
                max_new_tokens=MAX_NEW,
                eos_token_id=eos.tolist(),
            )["new_tokens"]
            loss_fn = lambda o, mb: O.nll_loss(o["logprobs"], mb["lengths"], total)
            r["stats"] = eng.train_step(loss_fn, {"tokens": TOKENS[rows], "lengths": LENGTHS[rows]})
            r["full"] = gather_state_dict(eng.shard, g)
            r["experts"] = {n: p.detach().clone() for n, p in eng.model.expert_params.items()}
            r["etp_rank"] = layout.expert_coords(rank)[2]
            out[(mt, repr(layout))] = (g.dp_rank, g.stage, r)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(ckpts):
    per_rank = run_distributed(_worker, 4, list(ckpts.items()), timeout=300)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in per_rank]


def _oracle_step(path):
    ref = O.load_oracle(path)
    with torch.no_grad():
        logits = ref(TOKENS).logits
    from test_models_moe import oracle_greedy

    greedy = oracle_greedy(ref)
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=WD, foreach=False)
    out = ref(TOKENS, attention_mask=MASK, output_router_logits=True)
    lp = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, TOKENS[:, 1:, None]).squeeze(-1)
    nll = O.nll_loss(lp, LENGTHS, float((LENGTHS - 1).sum()))
    (nll + ref.config.router_aux_loss_coef * out.aux_loss).backward()
    grads = hf_grads(ref)
    # An expert no token reached has grad None in transformers, which AdamW skips (no weight
    # decay); real_py's flat AdamW decays every parameter every step, as Megatron-core does
    # (experts get zero gradients): give the oracle zeros so both apply the same rule.
    for p in ref.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    opt.step()
    ref.zero_grad()
    after = {n: v.detach() for n, v in hf_grads_like(ref).items()}
    return logits, greedy, nll.item(), out.aux_loss.item(), norm.item(), grads, after


def hf_grads_like(ref):
    """The oracle's parameters (not gradients) under real_py's fused names."""
    for p in ref.parameters():
        p.grad = p.detach().clone()
    return hf_grads(ref)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("mt", FAMILIES)
def test_engine_logits_generation_train_step(ckpts, runs, mt):
    logits, greedy, nll, aux, norm, _, after = _oracle_step(ckpts[mt])
    spec = model_spec(ModelConfig.from_hf(ckpts[mt]))
    for layout in LAYOUTS:
        key = (mt, repr(layout))
        res = [x[key] for x in runs if key in x]
        assert len(res) == layout.world, key
        first = {dp: r for dp, s, r in res if s == 0}
        keep = MASK.bool()
        got = torch.cat([first[d]["logits"] for d in range(layout.dp)])
        torch.testing.assert_close(
            got[keep], logits[keep], atol=1e-5, rtol=0, msg=lambda s: f"{key} logits {s}"
        )
        assert torch.equal(torch.cat([first[d]["greedy"] for d in range(layout.dp)]), greedy), (
            key,
            "greedy",
        )
        assert torch.equal(torch.cat([first[d]["static"] for d in range(layout.dp)]), greedy), (
            key,
            "static",
        )
        eos = set(first[0]["eos"].tolist())
        for d in range(layout.dp):
            got = first[d]["eos_new"]
            for b, row in enumerate(greedy[d * got.shape[0] : (d + 1) * got.shape[0]].tolist()):
                n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                assert got[b, :n].tolist() == row[:n] and not got[b, n:].any(), (
                    key,
                    d,
                    b,
                    got[b],
                    row,
                )
        st = first[0]["stats"]
        assert abs(st["loss"] - nll) < 1e-5 and abs(st["aux_loss"] - aux) < 1e-6, (
            key,
            st,
            nll,
            aux,
        )
        assert abs(st["grad_norm"] - norm) < 1e-4, (key, st["grad_norm"], norm)
        moe_layers = [i for i in range(spec.num_layers) if spec.config.is_moe_layer(i)]
        counts = st["expert_counts"]
        assert counts.shape == (len(moe_layers), 8)
        assert (counts.sum(1) == int(MASK.sum()) * spec.config.num_experts_per_tok).all(), (
            key,
            counts,
        )
        fulls = [r["full"] for *_, r in res if r["full"] is not None]
        assert len(fulls) == 1, key
        for n, v in fulls[0].items():
            torch.testing.assert_close(
                v, after[n], atol=1e-5, rtol=0, msg=lambda s: f"{key} {n}: {s}"
            )
        held = {}
        for *_, r in res:
            for n, v in r["experts"].items():
                k = (n, r["etp_rank"])
                if k in held:  # expert-dp replicas stay equal
                    assert torch.equal(held[k], v), (key, n)
                held[k] = v
        assert {n for n, _ in held} == {p.name for p in spec.params if p.expert >= 0}, key
        params = {p.name: p for p in spec.params}
        for (n, t), v in held.items():
            torch.testing.assert_close(
                v,
                tp_slice(params[n], after[n], layout.etp, t),
                atol=1e-5,
                rtol=0,
                msg=lambda s: f"{key} {n} etp {t}: {s}",
            )
