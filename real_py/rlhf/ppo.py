"""PPO / GRPO maths as pure functions over padded [B, N] tensors.

Grid: a sequence of T tokens (right-padded) has N = T - 1 next-token predictions; prediction t
is "token t+1 given tokens 0..t". `response_mask(prompt_lengths, lengths, T)` [B, N] marks the
predictions of response tokens (token positions prompt_length .. length-1). Values from a value
head are per token position [B, T]; the value of the state before action t is values[:, t], so
`values[:, :-1]` lies on the same [B, N] grid. Every function here is torch-only (no
torch.distributed): the runtime passes global statistics in where a batch spans DP ranks.
"""

from __future__ import annotations

import torch


def response_mask(prompt_lengths: torch.Tensor, lengths: torch.Tensor, T: int) -> torch.Tensor:
    """prompt_lengths, lengths [B] int64 -> [B, T-1] float32, 1 on predictions of response tokens."""
    pos = torch.arange(1, T).unsqueeze(0)
    return ((pos >= prompt_lengths.unsqueeze(1)) & (pos < lengths.unsqueeze(1))).float()


def kl_penalized_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B]; logp, ref_logp, mask [B, N]. Returns (rewards [B, N], kl [B, N]).

    rewards = -kl_coef * (logp - ref_logp) on response predictions, plus the sequence score on
    its last response prediction (the k1 estimator of KL, as in InstructGPT / OpenRLHF).
    """
    kl = (logp - ref_logp) * mask
    rewards = -kl_coef * kl
    last = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(1)
    has = mask.sum(1) > 0
    rewards[torch.arange(len(scores))[has], last[has]] += scores[has]
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards, values, mask [B, N] -> (advantages, returns) [B, N], zero outside the mask.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where
    V_{t+1} and A_{t+1} are 0 past the last response prediction (the episode ends there).
    """
    B, N = rewards.shape
    adv = torch.zeros_like(rewards)
    next_v = torch.zeros(B, dtype=rewards.dtype)
    next_a = torch.zeros(B, dtype=rewards.dtype)
    for t in reversed(range(N)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        a = (delta + gamma * lam * next_a) * m
        adv[:, t] = a
        next_v, next_a = values[:, t] * m, a
    return adv, (adv + values) * mask


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, count] float64 over masked elements (all-reduce these over DP)."""
    xd, md = x.double(), mask.double()
    return torch.stack([(xd * md).sum(), (xd * xd * md).sum(), md.sum()])


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on masked elements, 0 elsewhere; moments from masked_moments
    (summed over every DP rank holding part of the batch). Unbiased variance."""
    s, s2, n = moments.tolist()
    mean = s / n
    var = max((s2 - n * mean * mean) / max(n - 1, 1), 0.0)
    return ((x - mean) / (var + eps) ** 0.5) * mask


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate, all [B, N]. Returns (sum over masked tokens of the loss, number of
    masked tokens where the clipped branch was taken); divide both by the global token count."""
    ratio = torch.exp(logp - old_logp)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = torch.maximum(l1, l2)
    clipped = (l2 > l1).float()
    return (loss * mask).sum(), (clipped * mask).sum().detach()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), all [B, N].
    Returns (masked sum, masked count of tokens where the clipped branch was taken)."""
    delta = values - old_values
    # Inside the clip range keep `values` itself: old + (values - old) differs from values by
    # rounding, which would count unclipped tokens as clipped depending on the layout.
    v_clip = torch.where(delta.abs() > clip, old_values + delta.clamp(-clip, clip), values)
    l1 = (values - returns) ** 2
    l2 = (v_clip - returns) ** 2
    loss = 0.5 * torch.maximum(l1, l2)
    return (loss * mask).sum(), ((l2 > l1).float() * mask).sum().detach()


def zero_variance_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """scores [B] (groups of group_size contiguous rows) -> [B] bool, True on every row of a group
    whose scores are all equal: such a group says nothing about which response is better."""
    if scores.numel() % group_size:
        raise ValueError(f"batch of {scores.numel()} rows is not a multiple of group_size={group_size}")
    g = scores.view(-1, group_size)
    return (g.amax(1) == g.amin(1)).repeat_interleave(group_size)


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages: scores [B] (B a multiple of group_size, groups contiguous) ->
    [B] (score - group mean) / (group std + eps), std unbiased; exactly 0 on the rows of a
    zero-variance group (the mean of equal float32 scores can differ from them by an ulp, which
    the division by eps would blow up to a spurious advantage)."""
    zero = zero_variance_groups(scores, group_size)
    g = scores.view(-1, group_size)
    std = g.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
    adv = ((g - g.mean(1, keepdim=True)) / (std + eps)).reshape(-1)
    return adv.masked_fill(zero, 0.0)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref), all [B, N]: exp(r) - r - 1 with r = ref_logp - logp on
    masked predictions, 0 elsewhere. Non-negative, unbiased for tokens sampled from pi, and its
    gradient in logp, 1 - exp(r), pulls logp toward ref_logp (Schulman 2020; GRPO's KL term)."""
    r = (ref_logp - logp) * mask
    return (torch.exp(r) - r - 1.0) * mask


def grpo_advantages(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, group_size: int,
                    kl_coef: float, kl_in: str) -> torch.Tensor:
    """Per-token GRPO advantages [B, N] from scores [B] and the k1 KL kl, mask [B, N].

    kl_in="loss": the group-normalized score on every response prediction (the KL to the
    reference is a separate loss term, k3_kl). kl_in="reward": the same minus kl_coef * kl per
    token. Either way every row of a zero-variance group gets 0 (skipped, as DAPO does). Why:
    once every sample of a group scores the same, the score says nothing, and with the KL in the
    reward the only advantage left is the KL penalty, of fixed sign on the tokens the policy
    samples with probability ~1 (log pi > log ref there); Adam rescales that small, consistent
    gradient to full learning-rate steps against the rewarded tokens. A 300-step GRPO run of
    configs/grpo_cpu4.yaml was reported to collapse that way (reward 0.98 -> 0.0 at step 275).
    """
    if kl_in not in ("loss", "reward"):
        raise ValueError(f"kl_in={kl_in!r}; allowed: 'loss', 'reward'")
    adv = group_advantages(scores, group_size).unsqueeze(1) * mask
    if kl_in == "reward":
        adv = adv - kl_coef * kl * mask
    return adv.masked_fill(zero_variance_groups(scores, group_size).unsqueeze(1), 0.0)


def rule_reward(tokens: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor,
                target_token: int) -> torch.Tensor:
    """Rule-based score [B]: fraction of response tokens equal to target_token."""
    T = tokens.shape[1]
    pos = torch.arange(T).unsqueeze(0)
    resp = (pos >= prompt_lengths.unsqueeze(1)) & (pos < lengths.unsqueeze(1))
    hits = ((tokens == target_token) & resp).sum(1).float()
    return hits / resp.sum(1).clamp(min=1).float()


__all__ = ["response_mask", "kl_penalized_rewards", "gae", "masked_moments", "whiten", "policy_loss",
           "value_loss", "group_advantages", "zero_variance_groups", "k3_kl", "grpo_advantages",
           "rule_reward"]
