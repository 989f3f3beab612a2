# Checks the pieces of async RL that need no ranks: the decoupled PPO objective against a hand
# computation per token (clip, importance weight, cap, gradients), and the `async` config section
# (parsing, overrides, validation, the graph's version key).
# A failure points to real_py/rlhf/ppo.py (decoupled_policy_loss_tokens), real_py/rlhf/config/
# (schema AsyncConfig, load, checks) or real_py/rlhf/asyncrl.py.
import math

import pytest
import torch

from real_py.rlhf import asyncrl as A
from real_py.rlhf import config as CF
from real_py.rlhf import ppo as P

MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)


def _r(seed, scale=0.3):
    return -1 + torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("cap", [None, 1.3])
def test_decoupled_loss_matches_hand_computation(cap):
    logp = _r(0).requires_grad_(True)
    prox, behav, adv = _r(1), _r(2), torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    eps_lo, eps_hi = 0.2, 0.28
    loss, clipped = P.decoupled_policy_loss_tokens(
        logp, prox, behav, adv, MASK, eps_lo, eps_hi, imp_cap=cap
    )
    loss.sum().backward()
    loss = loss.detach()
    seen_zero_w = False
    for i in range(3):
        for t in range(4):
            if not MASK[i, t]:
                assert float(loss[i, t]) == 0.0 and float(logp.grad[i, t]) == 0.0
                continue
            r = math.exp(float(logp[i, t]) - float(prox[i, t]))
            w = math.exp(float(prox[i, t]) - float(behav[i, t]))
            if cap is not None and w > cap:
                w, seen_zero_w = 0.0, True
            a = float(adv[i, t])
            l1, l2 = -a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi)
            want = w * max(l1, l2)
            # d/dlogp: only the unclipped branch carries gradient (d r / d logp = r)
            g = w * (-a * r) if l1 >= l2 else 0.0
            assert math.isclose(float(loss[i, t]), want, rel_tol=1e-5, abs_tol=1e-7), (i, t)
            assert math.isclose(float(logp.grad[i, t]), g, rel_tol=1e-4, abs_tol=1e-6), (i, t)
            assert float(clipped[i, t]) == float(l2 > l1)
    if cap is not None:
        assert seen_zero_w, "the cap case should zero some token (pick another seed)"


def test_async_config_parse_override_validate():
    c = CF.load(None, ["algo=grpo", "async.max_staleness=2", "ppo.decoupled=true"])
    assert c.async_.max_staleness == 2 and c.ppo.decoupled
    assert CF.to_dict(c)["async"]["max_staleness"] == 2
    g = c.graph()
    assert "versions" in g.calls["actor_gen"].writes and "versions" in g.calls["actor_train"].reads
    assert "versions" not in CF.load(None, ["algo=grpo"]).graph().calls["actor_gen"].writes
    with pytest.raises(ValueError, match=r"async.max_staleness=-1 is out of range"):
        CF.from_dict({"async": {"max_staleness": -1}})
    with pytest.raises(ValueError, match="unknown keys"):
        CF.from_dict({"async": {"staleness": 1}})
    with pytest.raises(ValueError, match="behav_imp_weight_cap"):
        CF.from_dict({"ppo": {"behav_imp_weight_cap": 0.5}})
    with pytest.raises(ValueError, match="dynamic_sampling"):
        CF.validate(
            CF.from_dict(
                {
                    "algo": "grpo",
                    "async": {"max_staleness": 1},
                    "ppo": {"dynamic_sampling": True, "group_size": 2},
                }
            ),
            4,
        )
    with pytest.raises(ValueError, match="check_versions needs"):
        CF.validate(CF.from_dict({"async": {"check_versions": True}}), 4)


def test_version_mask_and_staleness():
    ver = torch.tensor([[-1, 3, 3, 3], [1, 1, -1, -1], [-1, -1, -1, -1]])
    m, dropped = A.version_mask(ver, MASK, current=4, k=2)
    assert dropped.tolist() == [False, True, False]
    assert torch.equal(m, MASK * torch.tensor([[1.0], [0.0], [1.0]]))
    assert A.staleness(ver, m, 4) == (3.0, 3.0)
