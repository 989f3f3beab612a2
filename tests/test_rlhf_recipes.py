# Checks the recipe options against hand-written references on ragged masks (empty responses, groups
# of one): KL estimators k1/k2/k3 and clamp, GRPO / Dr.GRPO / RLOO / REINFORCE++ / ReMax advantages,
# clip-higher, dual-clip, GSPO's sequence ratio, the four loss aggregations (values, gradients,
# invariance to the DP / micro-batch split), the adaptive KL controller and the per-algorithm
# default plans.
# A failure points to real_py/rlhf/ppo.py (the maths), real_py/rlhf/runtime.py (adaptive_kl) or
# real_py/rlhf/config/ (default_plan, checks).
import math

import pytest
import torch

from real_py.dataflow import ALGORITHMS
from real_py.rlhf import config as CF
from real_py.rlhf import ppo as P
from real_py.rlhf.runtime import adaptive_kl

# 5 rows, 6 predictions: ragged responses, row 3 empty.
MASK = torch.tensor(
    [
        [0, 1, 1, 1, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
    ],
    dtype=torch.float32,
)


def _rand(seed, *shape, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _cells():
    return [(i, t) for i in range(MASK.shape[0]) for t in range(MASK.shape[1]) if MASK[i, t]]


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamp", [None, 0.3])
def test_kl_estimators_values_and_gradients(est, clamp):
    logp = (-1 + _rand(0, 5, 6, scale=0.7)).requires_grad_(True)
    ref = -1 + _rand(1, 5, 6, scale=0.7)
    kl_t = P.kl_estimate(logp, ref, MASK, est, clamp)
    kl_t.sum().backward()
    kl = kl_t.detach()
    for i in range(5):
        for t in range(6):
            d = float(logp.detach()[i, t]) - float(ref[i, t])
            if not MASK[i, t]:
                assert float(kl[i, t]) == 0.0 and float(logp.grad[i, t]) == 0.0
                continue
            v, g = {
                "k1": (d, 1.0),
                "k2": (0.5 * d * d, d),
                "k3": (math.exp(-d) + d - 1, 1 - math.exp(-d)),
            }[est]
            if clamp is not None and abs(v) > clamp:
                v, g = math.copysign(clamp, v), 0.0
            assert math.isclose(float(kl[i, t]), v, rel_tol=1e-5, abs_tol=1e-6), (i, t)
            assert math.isclose(float(logp.grad[i, t]), g, rel_tol=1e-5, abs_tol=1e-6), (i, t)
    with pytest.raises(ValueError, match="k4"):
        P.kl_estimate(logp, ref, MASK, "k4")


def _groups_ref(scores, G, mode):
    out = []
    for lo in range(0, len(scores), G):
        g = scores[lo : lo + G]
        if max(g) == min(g):  # zero-variance groups and groups of one: 0
            out += [0.0] * G
            continue
        mean = sum(g) / G
        if mode == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / (G - 1))
            out += [(x - mean) / (std + 1e-6) for x in g]
        elif mode == "drgrpo":
            out += [x - mean for x in g]
        else:  # rloo: mean of the others
            out += [x - (sum(g) - x) / (G - 1) for x in g]
    return out


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("G", [1, 2, 3])
def test_outcome_advantages(mode, G):
    scores = [1.0, 0.0, 0.5, 0.5, 0.5, 0.5][: 6 // G * G]
    s = torch.tensor(scores)
    adv = P.group_advantages(s, G, norm_by_std=mode != "drgrpo", leave_one_out=mode == "rloo")
    torch.testing.assert_close(
        adv, torch.tensor(_groups_ref(scores, G, mode)), atol=1e-5, rtol=1e-5
    )


def test_grpo_advantages_kl_in_reward_is_verl_form_on_ragged_mask():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    mask = torch.cat([MASK, MASK[:1]])
    kl = _rand(2, 6, 6).abs() * mask
    beta = 0.1
    for est, mode in (("grpo", "grpo"), ("rloo", "rloo")):
        adv = P.grpo_advantages(scores, kl, mask, 2, beta, "reward", estimator=est)
        s2 = [float(scores[i]) - beta * float(kl[i].sum()) for i in range(6)]
        ref = _groups_ref(s2, 2, mode)
        for i in range(6):
            if scores[2 * (i // 2)] == scores[2 * (i // 2) + 1]:
                ref[i] = 0.0  # zero task-score variance: no advantage at all
        torch.testing.assert_close(adv, torch.tensor(ref).unsqueeze(1) * mask, atol=1e-5, rtol=1e-5)


def test_reinforce_returns_and_remax_baseline():
    scores = torch.tensor([1.0, 2.0, -1.0, 3.0, 0.5])
    kl = _rand(3, 5, 6) * MASK
    beta, gamma = 0.2, 0.9
    for base in (None, torch.tensor([0.5, 1.0, 0.0, 2.0, 0.5])):
        ret = P.reinforce_returns(scores, kl, MASK, beta, gamma, base)
        for i in range(5):
            idx = [t for t in range(6) if MASK[i, t]]
            b = 0.0 if base is None else float(base[i])
            r = {
                t: -beta * float(kl[i, t]) + (float(scores[i]) - b if t == idx[-1] else 0.0)
                for t in idx
            }
            for t in range(6):
                want = sum(gamma ** (k - t) * r[k] for k in idx if k >= t) if MASK[i, t] else 0.0
                assert math.isclose(float(ret[i, t]), want, rel_tol=1e-5, abs_tol=1e-6), (i, t)
    torch.testing.assert_close(
        P.group_mean(torch.tensor([1.0, 3.0, 0.0, 4.0]), 2), torch.tensor([2.0, 2.0, 2.0, 2.0])
    )


def _loss_ref(logp, old, adv, lo, hi, dual, seq):
    """Per-token loss by scalar arithmetic (and the GSPO ratio by its definition)."""
    out = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if MASK[i, t]]
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in idx) / len(idx)) if idx else 1.0
        for t in idx:
            r = s if seq else math.exp(float(logp[i, t] - old[i, t]))
            a = float(adv[i, t])
            loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
            if dual is not None and a < 0:
                loss = min(loss, -a * dual)
            out[i, t] = loss
    return out


@pytest.mark.parametrize(
    "lo,hi,dual,ratio",
    [
        (0.2, None, None, "token"),
        (0.2, 0.28, None, "token"),
        (0.2, 0.2, 3.0, "token"),
        (0.05, 0.1, None, "sequence"),
    ],
)
def test_policy_loss_options(lo, hi, dual, ratio):
    old = -1 + _rand(4, 5, 6, scale=0.5)
    logp = old + _rand(5, 5, 6, scale=1.5)  # large ratios: every branch is taken somewhere
    adv = _rand(6, 5, 6) * MASK
    lt, clipped = P.policy_loss_tokens(logp, old, adv, MASK, lo, hi, dual, ratio)
    ref = _loss_ref(logp, old, adv, lo, lo if hi is None else hi, dual, ratio == "sequence")
    torch.testing.assert_close(lt, ref, atol=1e-5, rtol=1e-5)
    assert 0 < float(clipped.sum()) < float(MASK.sum()) and float((clipped * (1 - MASK)).sum()) == 0


def test_gspo_gradient_is_that_of_the_sequence_ratio():
    """Inside the clip range, seq-mean-token-mean of GSPO's per-token loss has the gradient of
    -(1/n_seq) sum_i s_i A_i, s_i = exp(mean_t (logp - old)), by the chain rule."""
    old = -1 + _rand(7, 5, 6, scale=0.5)
    logp = (old + _rand(8, 5, 6, scale=0.01)).requires_grad_(True)
    adv_row = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])
    adv = adv_row.unsqueeze(1) * MASK
    lt, _ = P.policy_loss_tokens(logp, old, adv, MASK, 10.0, 10.0, None, "sequence")
    P.aggregate(lt, MASK, "seq-mean-token-mean", float(MASK.sum()), 5, 6).backward()
    for i in range(5):
        idx = [t for t in range(6) if MASK[i, t]]
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in idx) / len(idx)) if idx else 0.0
        for t in range(6):
            want = -s * float(adv_row[i]) / len(idx) / 5 if t in idx else 0.0
            assert math.isclose(float(logp.grad[i, t]), want, rel_tol=1e-4, abs_tol=1e-7), (i, t)


def _agg_ref(loss, mode, max_len):
    rows = [[float(loss[i, t]) for t in range(6) if MASK[i, t]] for i in range(5)]
    n_tok, n_seq = sum(len(r) for r in rows), len(rows)
    if mode == "token-mean":
        return sum(map(sum, rows)) / n_tok
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / n_seq
    if mode == "seq-mean-token-sum":
        return sum(map(sum, rows)) / n_seq
    return sum(map(sum, rows)) / (n_seq * max_len)


@pytest.mark.parametrize("mode", P.LOSS_AGG)
def test_aggregation_value_gradient_and_split_invariance(mode):
    """The sum of the shares of any split of the global mini-batch into parts (DP ranks x
    micro-batches) equals the whole, in value and gradient; the whole equals the reference."""
    x = _rand(9, 5, 6).requires_grad_(True)
    n_tok, n_seq = float(MASK.sum()), 5.0
    whole = P.aggregate(x * MASK, MASK, mode, n_tok, n_seq, 6)
    assert math.isclose(float(whole), _agg_ref(x.detach(), mode, 6), rel_tol=1e-6)
    (g_whole,) = torch.autograd.grad(whole, x)
    for parts in (
        [[0, 1, 2, 3, 4]],
        [[0, 1], [2, 3, 4]],
        [[0], [1], [2], [3], [4]],
        [[4, 0], [3, 1, 2]],
    ):
        total = sum(P.aggregate(x[p] * MASK[p], MASK[p], mode, n_tok, n_seq, 6) for p in parts)
        (g,) = torch.autograd.grad(total, x)
        torch.testing.assert_close(total, whole)
        torch.testing.assert_close(g, g_whole)
    with pytest.raises(ValueError, match="loss aggregation"):
        P.aggregate(x, MASK, "mean", 1, 1, 6)


def test_adaptive_kl_controller():
    cfg = CF.from_dict(
        {"ppo": {"kl_coef": 0.1, "kl_target": 0.5, "kl_horizon": 80}, "data": {"batch_size": 8}}
    )
    pc, n = cfg.ppo, cfg.data.batch_size
    assert math.isclose(adaptive_kl(0.1, 0.6, pc, n), 0.1 * (1 + 0.2 * 8 / 80))  # e = 0.2
    assert math.isclose(adaptive_kl(0.1, 5.0, pc, n), 0.1 * (1 + 0.2 * 8 / 80))  # clipped
    assert math.isclose(
        adaptive_kl(0.1, 0.25, pc, n), 0.1 * (1 - 0.5 * 0.2 * 8 / 80 * 2)
    )  # e = -0.5 -> -0.2
    assert adaptive_kl(0.1, float("nan"), pc, n) == 0.1
    assert adaptive_kl(0.1, 0.6, CF.from_dict({}).ppo, n) == 0.1  # no target: fixed


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_every_algorithm_runs_on_its_default_plan(algo):
    """`algo: X` alone validates (each algorithm has its default plan); plan.* overrides edit it."""
    cfg = CF.load(None, [f"algo={algo}"])
    plan, graph, _ = CF.validate(cfg, 4)
    assert set(plan.calls) == set(graph.order)
    assert ("critic_train" in graph.order) == (algo == "ppo")
    assert ("actor_greedy" in graph.order) == (algo == "remax")
    cfg = CF.load(None, ["plan.calls.ref_inf.tp=2", "plan.calls.ref_inf.dp=1", f"algo={algo}"])
    plan, _, _ = CF.validate(cfg, 4)
    assert (plan.calls["ref_inf"].dp, plan.calls["ref_inf"].tp) == (1, 2)
    # A plan naming a call the graph lacks is still refused before ranks start.
    if algo != "ppo":
        with pytest.raises(ValueError, match="unknown calls"):
            CF.validate(
                CF.load(
                    None,
                    [
                        f"algo={algo}",
                        "plan.calls.critic_inf.dp=1",
                        "plan.calls.critic_inf.ranks=[2]",
                        "plan.calls.critic_inf.tp=1",
                        "plan.calls.critic_inf.pp=1",
                    ],
                ),
                4,
            )


def test_length_check_only_against_models_the_graph_uses():
    over = [
        "critic.max_position_embeddings=8",
        "data.max_prompt_len=8",
        "generation.max_new_tokens=4",
    ]
    CF.validate(
        CF.load(None, ["algo=grpo", "reward.kind=rule"] + over), 4
    )  # no critic, no reward model
    with pytest.raises(ValueError, match="critic max_position_embeddings"):
        CF.validate(CF.load(None, ["algo=ppo"] + over), 4)
    with pytest.raises(ValueError, match="reward max_position_embeddings"):
        CF.validate(CF.load(None, ["algo=grpo"] + over), 4)


def test_option_ranges():
    for key, bad in (
        ("ppo.dual_clip", 1.0),
        ("ppo.clip_high", 0.0),
        ("ppo.kl_target", 0.0),
        ("ppo.kl_clamp", -1),
    ):
        with pytest.raises(ValueError, match=key):
            CF.from_dict({key.split(".")[0]: {key.split(".")[1]: bad}})
    for key, bad in (("loss_agg", "mean"), ("kl_estimator", "k4"), ("ratio", "seq")):
        with pytest.raises(ValueError, match=f"ppo.{key}"):
            CF.from_dict({"ppo": {key: bad}})


def test_reward_shaping_against_reference():
    # rows: a stop-ended response of 2 tokens, a truncated one of 4 (max), an empty one, one of 3.
    tokens = torch.tensor(
        [[1, 2, 5, 9, 0, 0, 0], [1, 2, 5, 5, 5, 5, 0], [1, 2, 0, 0, 0, 0, 0], [1, 2, 6, 6, 8, 0, 0]]
    )
    pl, ln = torch.tensor([2, 2, 2, 2]), torch.tensor([4, 6, 2, 5])
    trunc = P.truncated(tokens, ln, pl, [9, 8])
    assert trunc.tolist() == [False, True, True, False]
    assert P.truncated(tokens, ln, pl, []).tolist() == [True] * 4
    resp = ln - pl
    # DAPO eq. 13 with L_max 4, L_cache 2: len 2 -> 0, 3 -> -0.5 * f, 4 -> -1 * f.
    torch.testing.assert_close(
        P.overlong_penalty(resp, 4, 2, 0.5), torch.tensor([0.0, -0.5, 0.0, -0.25])
    )
    scores = torch.tensor([1.0, 3.0, -2.0, 0.0])
    m = torch.tensor(
        [10.0, 30.0, 4.0], dtype=torch.float64
    )  # 4 earlier scores: mean 2.5, var 1/3*(30-25)
    mean, std = 2.5, math.sqrt((30 - 4 * 6.25) / 3)
    got = P.shape_scores(
        scores,
        resp,
        trunc,
        max_len=4,
        moments=m,
        overlong_buffer=2,
        overlong_factor=0.5,
        missing_eos_penalty=0.3,
        clip=1.5,
    )
    want = []
    for s, r, t in zip(scores.tolist(), resp.tolist(), trunc.tolist()):
        x = (s - mean) / (std + 1e-6) + {2: 0.0, 3: -0.25, 4: -0.5, 0: 0.0}[r] - (0.3 if t else 0.0)
        want.append(max(-1.5, min(1.5, x)))
    torch.testing.assert_close(got, torch.tensor(want))
    assert torch.equal(P.shape_scores(scores, resp, trunc, max_len=4), scores)


def test_top_k_and_stop_ids_in_generation():
    from real_py.engines import pick_tokens

    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    # Sorted probabilities 0.4 (id 1), 0.3 (id 3), 0.2, 0.1; top_k=2 renormalises over 0.7.
    for u, want in ((0.0, 1), (0.56, 1), (0.58, 3), (0.99, 3)):
        assert int(pick_tokens(logits, torch.tensor([u]), 1.0, 1.0, top_k=2)) == want, u
    # no truncation: inverse CDF over the vocabulary in index order (cumulative 0.1, 0.5, 0.7, 1.0)
    for u, want in ((0.05, 0), (0.3, 1), (0.6, 2), (0.99, 3)):
        assert int(pick_tokens(logits, torch.tensor([u]), 1.0, 1.0)) == want, u
    with pytest.raises(ValueError, match="stop_token_ids"):
        CF.from_dict({"generation": {"stop_token_ids": ["a"]}})
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\]"):
        CF.from_dict({"generation": {"stop_token_ids": [3, 99]}})


def test_lr_schedule_against_reference():
    base, total, warm, m = 1e-3, 12, 2, 0.1
    for k in range(total):
        if k < warm:
            want = {"constant": base * (k + 1) / warm}
            want = dict(want, linear=want["constant"], cosine=want["constant"])
        else:
            p = (k - warm) / (total - warm)
            want = {
                "constant": base,
                "linear": base * (m + (1 - m) * (1 - p)),
                "cosine": base * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))),
            }
        for decay, w in want.items():
            assert math.isclose(P.lr_at(k, base, total, warm, decay, m), w, rel_tol=1e-12), (
                k,
                decay,
            )
    assert P.lr_at(0, base, total) == base  # no warmup, constant
    assert math.isclose(P.lr_at(total, base, total, 0, "cosine", 0.0), 0.0, abs_tol=1e-18)
    with pytest.raises(ValueError, match="ppo.min_lr_ratio"):
        CF.from_dict({"ppo": {"min_lr_ratio": 2}})


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_adaptive_kl_and_reward_moments_survive_resume(tmp_path):
    """A run resumed from step 2 continues with the same adapted KL coefficient and running reward
    moments: steps 3-4 equal those of the uninterrupted run."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    over = [
        "algo=grpo",
        "reward.kind=rule",
        "ppo.kl_target=0.05",
        "ppo.kl_horizon=20",
        "reward.normalize=true",
        "save_every=2",
        "data.batch_size=8",
        "ppo.group_size=2",
    ]

    def train(out, steps, *extra):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "real_py",
                "train",
                *over,
                f"steps={steps}",
                "--out-dir",
                str(out),
                "--no-progress",
                *extra,
            ],
            cwd=root,
            check=True,
            capture_output=True,
            timeout=300,
        )
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["metrics"] for line in f]

    full = train(tmp_path / "a", 4)
    train(tmp_path / "b", 2)
    resumed = train(tmp_path / "b", 4, "--resume")
    assert full[1]["kl_coef"] != full[0]["kl_coef"]  # the controller moved it
    assert [m["kl_coef"] for m in resumed[-2:]] == [m["kl_coef"] for m in full[2:]]
    assert [m["policy_loss"] for m in resumed[-2:]] == [m["policy_loss"] for m in full[2:]]


def _stop_case(rank, world):
    from real_py import Layout, ModelConfig, ModelShard, model_spec
    from real_py.engines import Engine
    from real_py.parallel import ParallelGroups

    cfg = ModelConfig(**CF.TINY, head="lm")
    layout = Layout()
    shard = ModelShard.empty(model_spec(cfg), layout, rank)
    shard.flat.copy_(
        torch.randn(shard.flat.shape, generator=torch.Generator().manual_seed(0)) * 0.5
    )
    eng = Engine(cfg, layout, ParallelGroups(layout), shard)
    p = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]])
    n, s = torch.tensor([3, 2, 1]), torch.tensor([0, 1, 2])
    free = eng.generate(p, n, s, max_new_tokens=6, greedy=False, top_k=5)
    stops = [int(free["new_tokens"][0, 2]), int(free["new_tokens"][1, 1])]
    cut = eng.generate(p, n, s, max_new_tokens=6, greedy=False, top_k=5, eos_token_id=stops)
    return free["new_tokens"].tolist(), (cut["lengths"] - n).tolist(), stops


@pytest.mark.dist
def test_several_stop_ids_end_responses():
    """Sampling is seeded per row, so with stop ids every response is the unstopped one cut
    after the first token that is any of the stop ids (kept in the response)."""
    from real_py.testing import run_distributed

    new, resp, stops = run_distributed(_stop_case, 1, timeout=120)[0]
    for i, row in enumerate(new):
        hits = [j for j, t in enumerate(row) if t in stops]
        assert resp[i] == (hits[0] + 1 if hits else len(row)), (i, row, stops)
    assert int(resp[0]) <= 3 and int(resp[1]) <= 2
