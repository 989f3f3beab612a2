# Checks the PPO/GRPO maths against hand-computed values, the key-derived call graph, and that bad
# configs, plans and checkpoints fail before any work starts.
# A failure points to real_py/rlhf/ppo.py (maths), real_py/dataflow/graph.py (dependencies, order)
# or real_py/rlhf/config/ / checkpoint.py (validation).
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from real_py.dataflow import GRPO_CALLS, PPO_CALLS, Call, Graph
from real_py.rlhf import checkpoint
from real_py.rlhf import config as CF
from real_py.rlhf import ppo as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gae_hand_computed():
    # Row 0: full mask, gamma 0.9, lam 0.5 (worked by hand in the comments).
    # t2: d=1-0.7=0.3, A=0.3; t1: d=0.9*0.7-0.6=0.03, A=0.03+0.45*0.3=0.165;
    # t0: d=0.9*0.6-0.5=0.04, A=0.04+0.45*0.165=0.11425.
    # Row 1: mask 0,1,1,0 (prompt prediction, two response tokens, padding): the episode ends at
    # t2 (next value 0): t2: d=1-0.4=0.6, A=0.6; t1: d=0.2+0.9*0.4-0.5=0.06, A=0.06+0.45*0.6=0.33.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.2, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.0], [9.0, 0.5, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [0.0, 1, 1, 0]])
    adv, ret = P.gae(rewards, values * mask, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3, 0], [0, 0.33, 0.6, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.61425, 0.765, 1.0, 0], [0, 0.83, 1.0, 0]]))


def test_kl_rewards_and_mask():
    mask = P.response_mask(torch.tensor([2, 1]), torch.tensor([4, 3]), T=5)
    assert mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]
    logp = torch.tensor([[-1.0, -1.0, -2.0, -1.0], [-1.0, -2.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0, -3.0], [-2.0, -1.0, 0.0, 0.0]])
    # k1 KL in the reward, as InstructGPT / OpenRLHF: -kl_coef * (logp - ref) per prediction
    kl = P.kl_estimate(logp, ref, mask, "k1")
    rewards = P.token_rewards(torch.tensor([2.0, -1.0]), kl, mask, kl_coef=0.1)
    assert kl.tolist() == [[0, 0, -1, 0], [1, -1, 0, 0]]
    # score lands on the last response prediction: index 2 of row 0, index 1 of row 1.
    torch.testing.assert_close(rewards, torch.tensor([[0, 0, 2.1, 0], [-0.1, -0.9, 0, 0]]))


def test_clipped_losses():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    # ratio 1.5, A 1: max(-1.5, -1.2) = -1.2 clipped; ratio 0.5, A -1: max(0.5, 0.8) = 0.8 clipped;
    # ratio 1.1, A 2: -2.2 inside the clip range.
    loss, nclip = P.policy_loss(logp, old, adv, torch.ones(1, 3), clip=0.2)
    assert math.isclose(loss.item(), -2.6, rel_tol=1e-6) and nclip.item() == 2
    loss, nclip = P.policy_loss(logp, old, adv, torch.tensor([[0.0, 1, 1]]), clip=0.2)
    assert math.isclose(loss.item(), -1.4, rel_tol=1e-6) and nclip.item() == 1
    # V 1.0, V_old 0.5, R 2: clipped V 0.7 -> 0.5 * max(1, 1.69) = 0.845; V 0, R 0.3: 0.045.
    v, nclip = P.value_loss(
        torch.tensor([[1.0, 0.0]]),
        torch.tensor([[0.5, 0.0]]),
        torch.tensor([[2.0, 0.3]]),
        torch.ones(1, 2),
        clip=0.2,
    )
    assert math.isclose(v.item(), 0.89, rel_tol=1e-6) and nclip.item() == 1


def test_whiten_group_rule():
    x, m = torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1, 1, 0])
    torch.testing.assert_close(
        P.whiten(x, m, P.masked_moments(x, m)), torch.tensor([-1.0, 0, 1, 0])
    )
    ga = P.group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2)
    torch.testing.assert_close(
        ga, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2), 0, 0]), atol=1e-5, rtol=0
    )
    tok = torch.tensor([[4, 7, 7, 1, 0], [7, 7, 3, 7, 7]])
    r = P.rule_reward(tok, torch.tensor([1, 2]), torch.tensor([4, 5]), target_token=7)
    torch.testing.assert_close(r, torch.tensor([2 / 3, 2 / 3]))
    with pytest.raises(ValueError, match="group_size=3"):
        P.group_advantages(torch.zeros(4), 3)


def test_graph_from_keys():
    g = Graph(PPO_CALLS)
    assert g.order == (
        "actor_gen",
        "ref_inf",
        "rew_inf",
        "critic_inf",
        "actor_train",
        "critic_train",
    )
    assert g.deps["actor_train"] == ("actor_gen", "ref_inf", "rew_inf", "critic_inf")
    assert (
        g.consumers("values") == ("actor_train", "critic_train")
        and g.producer("scores") == "rew_inf"
    )
    assert g.inputs == ("prompt_lengths", "prompts", "seeds")
    # Declared in a scrambled order, the derived order still respects every dependency.
    g2 = Graph(tuple(reversed(PPO_CALLS)))
    pos = {n: i for i, n in enumerate(g2.order)}
    assert all(pos[d] < pos[n] for n, ds in g2.deps.items() for d in ds)
    grpo = Graph(GRPO_CALLS)
    assert grpo.order == ("actor_gen", "ref_inf", "rew_inf", "actor_train")
    assert "critic" not in grpo.models()
    with pytest.raises(ValueError, match="cycle"):
        Graph(
            [
                Call(name="a", model="actor", kind="logprobs", reads=("y",), writes=("x",)),
                Call(name="b", model="ref", kind="logprobs", reads=("x",), writes=("y",)),
            ]
        )
    with pytest.raises(ValueError, match="one producer"):
        Graph(
            [
                Call(name="a", model="actor", kind="logprobs", reads=(), writes=("x",)),
                Call(name="b", model="ref", kind="logprobs", reads=(), writes=("x",)),
            ]
        )
    with pytest.raises(ValueError, match="kind="):
        Call(name="a", model="actor", kind="dance", reads=())


def _plan(**changes):
    calls = {k: dict(v) for k, v in CF.DEFAULT_PLAN["calls"].items()}
    for k, v in changes.items():
        if v is None:
            calls.pop(k)
        else:
            calls[k] = v
    return {"world_size": 4, "calls": calls}


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"bogus": 1}, r"top level: unknown keys \['bogus'\]"),
        ({"ppo": {"clip_range": 0.1}}, r"ppo: unknown keys \['clip_range'\]"),
        ({"actor": {"hidden": 3}}, "config actor"),
        ({"algo": "dpo"}, "algo='dpo'"),
        ({"plan": _plan(critic_inf=None)}, r"missing calls \['critic_inf'\]"),
        (
            {"plan": _plan(rew_inf={"ranks": [2, 4], "dp": 2})},
            r"call rew_inf: ranks \[4\] are outside",
        ),
        (
            {
                "plan": _plan(
                    actor_gen={"ranks": [0, 1], "dp": 2},
                    actor_train={"ranks": [0, 1], "tp": 2},
                    critic_train={"ranks": [0, 1], "dp": 2},
                    rew_inf={"ranks": [0, 1], "dp": 2},
                    critic_inf={"ranks": [0, 1], "pp": 2},
                )
            },
            r"leaves ranks \[2, 3\] .*allow_idle_ranks",
        ),
        (
            {"plan": _plan(actor_train={"ranks": [0, 1, 2], "tp": 3}, actor_gen={"ranks": [3]})},
            r"call actor_train \(actor on dp1tp3pp1\): tp=3 does not divide num_attention_heads=4",
        ),
        (
            {
                "plan": _plan(ref_inf={"ranks": [0, 1], "pp": 2}),
                "actor": dict(CF.TINY, num_hidden_layers=1),
            },
            r"call ref_inf .*pp=2 exceeds num_layers=1",
        ),
        ({"data": {"batch_size": 6}}, r"call actor_gen: dp=4 does not divide data.batch_size=6"),
        ({"algo": "grpo", "plan": _plan(critic_inf=None, critic_train=None)}, None),
    ],
)
def test_bad_config(cfg, match):
    if match is None:
        CF.validate(CF.from_dict(cfg), 4)
        return
    with pytest.raises(ValueError, match=match):
        CF.validate(CF.from_dict(cfg), 4)


def test_plan_world_size_mismatch():
    with pytest.raises(ValueError, match="world_size=4, but the job has 2"):
        CF.validate(CF.from_dict({}), 2)


def test_checkpoint_from_another_model(tmp_path):
    cfg = CF.from_dict({})
    d = tmp_path / "step_3"
    d.mkdir()
    meta = checkpoint._meta(cfg) | {"step": 3, "files": {}}
    (d / "meta.json").write_text(json.dumps(meta))
    assert checkpoint.check(cfg, str(d)) == 3
    other = CF.from_dict({"actor": dict(CF.TINY, hidden_size=32)})
    with pytest.raises(
        ValueError, match="models.actor.hidden_size is 64 in the checkpoint, 32 in this config"
    ):
        checkpoint.check(other, str(d))


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_cli_rejects_before_launch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 2\nppo: {epochs: 3}\n")
    r = subprocess.run(
        [sys.executable, "-m", "real_py", "train", "--config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "ppo: unknown keys ['epochs']" in r.stderr
    assert "launching" not in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "real_py",
            "train",
            "--resume",
            str(tmp_path / "nope"),
            "--out-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no checkpoint" in r.stderr


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_push_plan_delivers_exactly_the_needed_rows(algo):
    """Every consumer rank ends up with exactly the rows its calls read (its DP share of each
    global mini-batch), receives each row once, receives nothing it holds or does not need, and
    gets it from a rank of the producer replica that holds it."""
    from real_py.rlhf.rows import dp_rows, push_plan

    d = {"algo": algo, "ppo": {"mini_batches": 2}}
    if algo == "grpo":
        d["plan"] = {
            "world_size": 4,
            "calls": {
                k: v for k, v in CF.DEFAULT_PLAN["calls"].items() if not k.startswith("critic")
            },
        }
    cfg = CF.from_dict(d)
    plan, graph, _ = CF.validate(cfg, 4)
    B = cfg.data.batch_size
    mbs = {n: 2 for n in graph.order if graph.calls[n].trains}
    sent = 0
    for prod in graph.order:
        src = plan.calls[prod]
        msgs = push_plan(graph, plan, prod, B, mbs)
        for k in graph.calls[prod].writes:
            for r in range(4):
                need = set()
                for c in graph.consumers(k):
                    lay = plan.calls[c]
                    if r in lay.ranks:
                        need |= set(dp_rows(lay, lay.coords(r)[0], B, mbs.get(c, 1)))
                held = (
                    set(dp_rows(src, src.coords(r)[0], B, mbs.get(prod, 1)))
                    if r in src.ranks
                    else set()
                )
                got = []
                for (s, rr), parts in msgs.items():
                    for kk, rows in parts:
                        if rr == r and kk == k:
                            got += rows
                            owned = dp_rows(src, src.coords(s)[0], B, mbs.get(prod, 1))
                            assert set(rows) <= set(owned), (prod, k, s, r)
                assert len(got) == len(set(got)), (prod, k, r)
                assert set(got) == need - held, (prod, k, r)
                sent += len(got)
    assert sent > 0


def test_shipped_configs():
    """configs/*.yaml load and validate; the PPO one is the embedded default written out."""
    ppo = CF.load(os.path.join(ROOT, "configs", "ppo_cpu4.yaml"))
    CF.validate(ppo, 4)
    default = CF.from_dict({})
    assert CF.to_dict(ppo) | {"actor": None, "critic": None, "plan": None} == CF.to_dict(
        default
    ) | {"plan": None}
    assert ppo.execution_plan() == default.execution_plan()
    assert ppo.model_configs() == CF.from_dict({}).model_configs()
    CF.validate(CF.load(os.path.join(ROOT, "configs", "grpo_cpu4.yaml")), 4)


def test_truncated_importance_weights_and_the_logprob_gap_on_known_numbers():
    import math

    train = torch.tensor([[0.0, math.log(0.5), math.log(0.9), 0.0]])
    rollout = torch.tensor([[0.0, math.log(0.1), math.log(0.9), math.log(0.3)]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    w, capped = P.truncated_is_weights(train, rollout, mask, cap=2.0)
    # ratios 5 (capped to 2), 1, 1/0.3; off the mask 0
    assert torch.allclose(w, torch.tensor([[0.0, 2.0, 1.0, 2.0]])), w
    assert capped == 2.0 and not w.requires_grad
    w, capped = P.truncated_is_weights(train, rollout, mask, cap=10.0)
    assert torch.allclose(w, torch.tensor([[0.0, 5.0, 1.0, 1 / 0.3]])) and capped == 0.0
    diff, kl, n = P.logprob_gap(train, rollout, mask)
    assert n == 3.0
    assert math.isclose(diff, math.log(5) + 0 + math.log(1 / 0.3), rel_tol=1e-6)
    # k3 of KL(rollout || train) at each token: r - 1 - log r, r = train / rollout
    want = sum(r - 1 - math.log(r) for r in (5.0, 1.0, 1 / 0.3))
    assert math.isclose(kl, want, rel_tol=1e-5)
