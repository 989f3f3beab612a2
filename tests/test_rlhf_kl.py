# Checks GRPO as published: the k3 KL estimator (values, gradient, unbiasedness), group advantages
# with zero-variance groups skipped, KL in the loss vs in the reward, and the ppo.kl_in config key.
# A failure points to real_py/rlhf/ppo.py (kl_estimate, group_advantages, grpo_advantages,
# zero_variance_groups), real_py/rlhf/calls.py (kl_in default, the loss term) or
# real_py/rlhf/config/ (ppo.kl_in).
import math

import pytest
import torch

from real_py.rlhf import calls as C
from real_py.rlhf import config as CF
from real_py.rlhf import ppo as P


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref), all [B, N]: exp(r) - r - 1 with r = ref_logp - logp on
    masked predictions, 0 elsewhere. Non-negative, unbiased for tokens sampled from pi, and its
    gradient in logp, 1 - exp(r), pulls logp toward ref_logp (Schulman 2020; GRPO's KL term)."""
    return P.kl_estimate(logp, ref_logp, mask, "k3")


def test_k3_values_and_gradient():
    # r = ref - logp: r = -1 -> e^-1 + 1 - 1 = 0.36788; r = 1 -> e - 2 = 0.71828; masked -> 0.
    logp = torch.tensor([[-1.0, -2.0, -5.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -1.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    k3 = k3_kl(logp, ref, mask)
    torch.testing.assert_close(k3.detach(), torch.tensor([[math.exp(-1), math.e - 2, 0.0]]))
    k3.sum().backward()
    # d/dlogp (e^r - r - 1) = 1 - e^r: positive where logp > ref (pushes logp down), 0 masked.
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - math.exp(-1), 1 - math.e, 0.0]]))


def test_k3_is_unbiased_for_kl():
    """Mean of k3 over tokens sampled from pi equals the exact KL(pi || ref) (within 4 sigma)."""
    g = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(8, generator=g), 0)
    ref = torch.softmax(torch.randn(8, generator=g), 0)
    exact = float((pi * (pi.log() - ref.log())).sum())
    tok = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    k3 = k3_kl(pi.log()[tok].unsqueeze(0), ref.log()[tok].unsqueeze(0), torch.ones(1, len(tok)))
    sigma = float(k3.std()) / math.sqrt(len(tok))
    assert abs(float(k3.mean()) - exact) < 4 * sigma, (float(k3.mean()), exact, sigma)


def test_group_advantages_zero_variance_is_exactly_zero():
    # Group [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(1/3) -> +-0.866; group [1, 1, 1, 1] -> 0.
    adv = P.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4)
    s = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([s, -s, s, -s, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    # Equal float32 scores whose mean is not exactly representable: still exactly 0, not ulp / eps.
    x = torch.full((7,), 0.1, dtype=torch.float32) * 7
    assert float(x.mean()) != float(x[0])  # (mean - x) / (std + eps) would be ~0.06 here
    assert torch.equal(P.group_advantages(x, 7), torch.zeros(7))
    assert P.zero_variance_groups(torch.tensor([2.0, 2.0, 1.0, 3.0]), 2).tolist() == [
        True,
        True,
        False,
        False,
    ]


def test_zero_variance_group_gives_zero_policy_gradient():
    """Rows of a group whose scores are all equal get advantage 0 in both kl_in modes, so the
    policy-gradient term has zero gradient there; with kl_in=loss the only gradient on those rows
    is kl_coef * (1 - exp(ref - logp)) from the k3 term, which pulls logp toward the reference."""
    scores = torch.tensor(
        [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    )  # group 0 saturated, group 1 not
    B, N = 8, 5
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(B, N, generator=g) * 3
    ref = old - 1.0 - torch.rand(B, N, generator=g)  # pi_old far above ref: large k1 KL
    mask = torch.ones(B, N)
    mask[:, :2] = 0  # prompt predictions
    kl = (old - ref) * mask
    beta = 0.05
    for kl_in in ("loss", "reward"):
        adv = P.grpo_advantages(scores, kl, mask, 4, beta, kl_in)
        assert torch.equal(adv[:4], torch.zeros(4, N)), kl_in
        assert bool((adv[4:] != 0).any()) and bool((adv[4:][mask[4:] == 0] == 0).all()), kl_in
        logp = old.clone().requires_grad_(True)
        pg, _ = P.policy_loss(logp, old, adv, mask, clip=0.2)
        pg.backward()
        assert torch.equal(logp.grad[:4], torch.zeros(4, N)), kl_in
        assert float(logp.grad[4:].abs().sum()) > 0, kl_in
    # kl_in=reward is verl's form: the KL summed into the score before the group statistics.
    a_rew = P.grpo_advantages(scores, kl, mask, 4, beta, "reward")
    s = [float(scores[i]) - beta * float(kl[i].sum()) for i in range(4, 8)]
    mean = sum(s) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / 3)
    want = torch.tensor([(x - mean) / (std + 1e-6) for x in s]).unsqueeze(1) * mask[4:]
    torch.testing.assert_close(a_rew[4:], want)
    logp = old.clone().requires_grad_(True)
    (beta * k3_kl(logp, ref, mask)).sum().backward()
    torch.testing.assert_close(logp.grad[:4], beta * (1 - torch.exp(ref - old))[:4] * mask[:4])
    assert bool((logp.grad[:4][mask[:4] > 0] > 0).all())  # descent lowers logp toward ref
    with pytest.raises(ValueError, match="kl_in"):
        P.grpo_advantages(scores, kl, mask, 4, beta, "both")


def test_kl_in_config():
    def kl_in(d):
        cfg = CF.from_dict(d)
        return C.kl_in(cfg.ppo, cfg.algo)

    assert kl_in({"algo": "grpo"}) == "loss"
    assert kl_in({"algo": "ppo"}) == "reward"
    assert kl_in({"algo": "grpo", "ppo": {"kl_in": "reward"}}) == "reward"
    assert kl_in({"algo": "ppo", "ppo": {"kl_in": "loss"}}) == "loss"
    with pytest.raises(ValueError, match="ppo.kl_in"):
        CF.from_dict({"ppo": {"kl_in": "advantage"}})
