"""PPO / GRPO maths as pure functions over padded [B, N] tensors.

Grid: a sequence of T tokens (right-padded) has N = T - 1 next-token predictions; prediction t
is "token t+1 given tokens 0..t". `response_mask(prompt_lengths, lengths, T)` [B, N] marks the
predictions of response tokens (token positions prompt_length .. length-1). Values from a value
head are per token position [B, T]; the value of the state before action t is values[:, t], so
`values[:, :-1]` lies on the same [B, N] grid. Every function here is torch-only (no
torch.distributed): the runtime passes global statistics in where a batch spans DP ranks.

One file past 400 lines: every function here (KL estimators, GAE and the GRPO / REINFORCE
advantages, the PPO, decoupled and value losses, score shaping) works on the [B, N] grid and
response_mask above, and calls.py reads them together as one recipe.
"""

from __future__ import annotations

import torch


def response_mask(prompt_lengths: torch.Tensor, lengths: torch.Tensor, T: int) -> torch.Tensor:
    """prompt_lengths, lengths [B] int64 -> [B, T-1] float32, 1 on predictions of response
    tokens."""
    pos = torch.arange(1, T, device=lengths.device).unsqueeze(0)
    return ((pos >= prompt_lengths.unsqueeze(1)) & (pos < lengths.unsqueeze(1))).float()


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k1",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) [B, N] from log-probs of tokens sampled from pi, 0 off
    the mask (Schulman 2020, "Approximating KL divergence"), with d = logp - ref_logp:

        k1 = d                       unbiased, can be negative
        k2 = d^2 / 2                 biased, low variance; gradient d * grad logp
        k3 = exp(-d) + d - 1         unbiased, non-negative (GRPO's KL term)

    clamp: the estimate is clamped to [-clamp, clamp] (verl clamps k3 to +-10 against exp blow-ups).
    """
    d = (logp - ref_logp) * mask
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    elif estimator == "k3":
        kl = torch.exp(-d) + d - 1.0
    else:
        raise ValueError(f"KL estimator {estimator!r}; allowed: {KL_ESTIMATORS}")
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl * mask


def logprob_gap(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[float, float, float]:
    """How far the trainer's log-probs of the sampled tokens are from the generation engine's,
    over the mask: (sum of |train - rollout|, sum of the k3 estimate of KL(pi_rollout || pi_train),
    tokens). The tokens were drawn from pi_rollout, so k3 is taken at d = rollout - train."""
    diff = ((train_logp - rollout_logp).abs() * mask).sum()
    kl = kl_estimate(rollout_logp, train_logp, mask, "k3").sum()
    return float(diff), float(kl), float(mask.sum())


def truncated_is_weights(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, float]:
    """Truncated importance sampling (Yao et al. 2025): per-token weights min(pi_train /
    pi_rollout, cap) on the mask, 0 off it, no gradient; and how many tokens were capped. They
    multiply the per-token policy loss, correcting for tokens sampled by an engine whose
    probabilities differ from the trainer's."""
    ratio = torch.exp(train_logp - rollout_logp)
    on = mask > 0
    capped = float((on & (ratio > cap)).sum())
    return (ratio.clamp(max=cap) * mask).detach(), capped


def last_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [B, N] -> (index of each row's last masked prediction [B], rows with any [B] bool)."""
    last = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(1)
    return last, mask.sum(1) > 0


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """scores [B], kl [B, N] (any estimator) -> per-token rewards [B, N]: -kl_coef * kl on response
    predictions, plus the sequence score on the last one (InstructGPT; OpenRLHF / verl
    kl-in-reward). Empty responses get nothing."""
    rewards = -kl_coef * kl * mask
    last, has = last_index(mask)
    rewards[torch.arange(len(scores))[has], last[has]] += scores[has]
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
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


def whiten(
    x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on masked elements, 0 elsewhere; moments from masked_moments
    (summed over every DP rank holding part of the batch). Unbiased variance."""
    s, s2, n = moments.tolist()
    mean = s / n
    var = max((s2 - n * mean * mean) / max(n - 1, 1), 0.0)
    return ((x - mean) / (var + eps) ** 0.5) * mask


LOSS_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def policy_loss_tokens(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate, all [B, N]. Returns (loss [B, N], clipped [B, N] 0/1), 0 off
    the mask; aggregate the loss with `aggregate`.

    PPO (Schulman 2017): max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = pi / pi_old per
    token; clip_high > clip_low is DAPO's clip-higher (Yu et al. 2025, eq. 10: eps_low 0.2,
    eps_high 0.28). dual_clip = c > 1 (Ye et al. 2020, "Mastering complex control in MOBA
    games", eq. 5): for A < 0 the loss is also capped at -c A, so a huge ratio on a bad token
    cannot blow the loss up. ratio="sequence" is GSPO (Zheng et al. 2025, eq. 7):
    s_i = exp(mean_t log(pi / pi_old)) over the response of sequence i, used on every token as
    sg(s_i) * pi_t / sg(pi_t) (its value is s_i; with seq-mean-token-mean aggregation its gradient
    is that of s_i * A_i), log s_i clamped at 10 as verl does.
    """
    clip_high = clip_low if clip_high is None else clip_high
    if ratio == "sequence":
        n = mask.sum(1).clamp(min=1)
        log_s = ((logp - old_logp) * mask).sum(1) / n
        log_r = (logp - logp.detach() + log_s.detach().unsqueeze(1)).clamp(max=10.0)
    elif ratio == "token":
        log_r = logp - old_logp
    else:
        raise ValueError(f"ratio={ratio!r}; allowed: 'token', 'sequence'")
    r = torch.exp(log_r * mask)
    l1 = -adv * r
    l2 = -adv * r.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(l1, l2)
    clipped = l2 > l1
    if dual_clip is not None:
        l3 = -adv * dual_clip
        capped = (adv < 0) & (l3 < loss)
        loss = torch.where(capped, l3, loss)
        clipped = clipped | capped
    return loss * mask, clipped.float() * mask


def decoupled_policy_loss_tokens(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio: str = "token",
    imp_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO (AReaL, Fu et al. 2025, eq. 5), all [B, N]: per token

        w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),  r = pi / pi_prox,
        w = pi_prox / pi_behav  (no gradient)

    behav_logp: log-probs of the policy that sampled the tokens (possibly stale); prox_logp: of
    the proximal policy (the weights before this update), the clip's anchor. Tokens with
    w > imp_cap get weight 0 (AReaL's behav_imp_weight_cap). dual_clip / ratio as in
    policy_loss_tokens (the ratio is always against pi_prox). With prox == behav it is
    policy_loss_tokens. Returns (loss [B, N], clipped [B, N] 0/1), 0 off the mask."""
    loss, clipped = policy_loss_tokens(
        logp, prox_logp, adv, mask, clip_low, clip_high, dual_clip, ratio
    )
    w = torch.exp((prox_logp - behav_logp).detach() * mask)
    if imp_cap is not None:
        w = torch.where(w > imp_cap, torch.zeros_like(w), w)
    return loss * w, clipped


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate, all [B, N]. Returns (sum over masked tokens of the loss, number of
    masked tokens where the clipped branch was taken); divide both by the global token count.
    kw: clip_high, dual_clip, ratio of policy_loss_tokens."""
    loss, clipped = policy_loss_tokens(logp, old_logp, adv, mask, clip, **kw)
    return loss.sum(), clipped.sum().detach()


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, n_tok: float, n_seq: float, max_len: int
) -> torch.Tensor:
    """This part's share of the loss of a global mini-batch, for per-token losses [B, N] (0 off
    the mask) of some of its rows. n_tok / n_seq: response tokens / rows of the WHOLE global
    mini-batch (summed over DP ranks and micro-batches), so the shares of all parts add up to the
    loss of the whole, whatever the DP / micro-batch split (gradients are summed over both):

        token-mean               sum_{i,t} l_it / n_tok                   (DAPO eq. 8; PPO here)
        seq-mean-token-mean      sum_i (sum_t l_it / |y_i|) / n_seq       (GRPO paper eq. 3)
        seq-mean-token-sum       sum_{i,t} l_it / n_seq
        seq-mean-token-sum-norm  sum_{i,t} l_it / (n_seq * max_len)       (Dr.GRPO, Liu et al. 2025:
                                 a constant normaliser, max_len = generation.max_new_tokens)

    An empty response contributes 0 and counts as a row (n_seq counts every row)."""
    if mode == "token-mean":
        return loss.sum() / max(n_tok, 1.0)
    if mode == "seq-mean-token-mean":
        return (loss.sum(1) / mask.sum(1).clamp(min=1)).sum() / max(n_seq, 1.0)
    if mode == "seq-mean-token-sum":
        return loss.sum() / max(n_seq, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return loss.sum() / (max(n_seq, 1.0) * max_len)
    raise ValueError(f"loss aggregation {mode!r}; allowed: {LOSS_AGG}")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
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
        raise ValueError(
            f"batch of {scores.numel()} rows is not a multiple of group_size={group_size}"
        )
    g = scores.view(-1, group_size)
    return (g.amax(1) == g.amin(1)).repeat_interleave(group_size)


def group_advantages(
    scores: torch.Tensor,
    group_size: int,
    eps: float = 1e-6,
    *,
    norm_by_std: bool = True,
    leave_one_out: bool = False,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Outcome advantages of groups of group_size contiguous rows, scores [B] -> [B]:

        GRPO (Shao et al. 2024, eq. 3 outcome supervision):  (s_i - mean_g) / (std_g + eps),
                                                             std unbiased
        Dr.GRPO (Liu et al. 2025, norm_by_std=False):        s_i - mean_g
        RLOO (Ahmadian et al. 2024, leave_one_out=True):     s_i - mean_{j != i} s_j
                                                             = G / (G - 1) (s_i - mean_g)

    Exactly 0 on the rows flagged by skip (default: zero_variance_groups(scores), which includes
    every group of one: no baseline); the mean of equal float32 scores can differ from them by an
    ulp, which the division by eps would blow up to a spurious advantage."""
    zero = zero_variance_groups(scores, group_size) if skip is None else skip
    g = scores.view(-1, group_size)
    adv = g - g.mean(1, keepdim=True)
    if leave_one_out and group_size > 1:
        adv = adv * (group_size / (group_size - 1))
    elif norm_by_std and not leave_one_out:
        std = g.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
        adv = adv / (std + eps)
    return adv.reshape(-1).masked_fill(zero, 0.0)


OUTCOME_ESTIMATORS = ("grpo", "rloo")


def grpo_advantages(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    kl_coef: float,
    kl_in: str,
    *,
    norm_by_std: bool = True,
    estimator: str = "grpo",
) -> torch.Tensor:
    """Per-token outcome advantages [B, N] of GRPO / Dr.GRPO / RLOO (see group_advantages) from
    scores [B], a per-token KL estimate kl and mask [B, N]: the row's advantage on each of its
    response predictions.

    kl_in="loss": advantages of the scores (the KL is a separate loss term). kl_in="reward":
    verl's form (compute_grpo_outcome_advantage on token_level_rewards after apply_kl_penalty):
    the KL is summed into the score before the group statistics, s_i' = s_i - kl_coef *
    sum_t kl_it. Either way every row of a group whose TASK scores are all equal gets 0: such a
    group says nothing about which response is better, and with s' its advantages would be its
    KL differences divided by their own tiny std, noise at full scale (a 300-step GRPO run of
    configs/grpo_cpu4.yaml collapsed from a KL-only signal, reward 0.98 -> 0.0 at step 275).
    These rows still take part in the batch (token counts, KL and entropy terms); to drop them
    and refill the batch, use ppo.dynamic_sampling (DAPO)."""
    if kl_in not in ("loss", "reward"):
        raise ValueError(f"kl_in={kl_in!r}; allowed: 'loss', 'reward'")
    if estimator not in OUTCOME_ESTIMATORS:
        raise ValueError(f"outcome estimator {estimator!r}; allowed: {OUTCOME_ESTIMATORS}")
    skip = zero_variance_groups(scores, group_size)
    s = scores - kl_coef * (kl * mask).sum(1) if kl_in == "reward" else scores
    adv = group_advantages(
        s, group_size, norm_by_std=norm_by_std, leave_one_out=estimator == "rloo", skip=skip
    )
    return adv.unsqueeze(1) * mask


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over masked predictions, all [B, N]; 0 off the mask."""
    out = torch.zeros_like(rewards)
    nxt = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        nxt = (rewards[:, t] + gamma * nxt) * mask[:, t]
        out[:, t] = nxt
    return out


def reinforce_returns(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
    baseline: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token returns [B, N] of the REINFORCE family: r_t = -kl_coef * kl_t plus (s - b) on
    the last response prediction, G_t = sum_{k >= t} gamma^(k-t) r_k.

    REINFORCE++ (Hu 2025, arXiv 2501.03262, eq. 8-10): b = 0, KL in the reward, then G whitened
    over the global batch (the caller, with moments summed over DP). REINFORCE++-baseline: b =
    the group's mean score, then the same whitening. ReMax (Li et al. 2023, eq. 5): b = the
    score of the greedy response to the same prompt, no whitening (verl compute_remax_outcome_
    advantage: reward-to-go minus the baseline)."""
    s = scores if baseline is None else scores - baseline
    return returns_to_go(token_rewards(s, kl, mask, kl_coef), mask, gamma)


def group_mean(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] -> [B]: each row's group mean (groups of group_size contiguous rows)."""
    if scores.numel() % group_size:
        raise ValueError(
            f"batch of {scores.numel()} rows is not a multiple of group_size={group_size}"
        )
    return scores.view(-1, group_size).mean(1).repeat_interleave(group_size)


def truncated(
    tokens: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor, stop_ids
) -> torch.Tensor:
    """[B] bool: the response does not end with one of stop_ids (cut at max_new_tokens), or is
    empty. No stop ids: every response counts as truncated."""
    last = tokens.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    ends = torch.isin(last, torch.tensor(list(stop_ids or ()), dtype=tokens.dtype))
    return ~ends | (lengths <= prompt_lengths)


def overlong_penalty(
    resp_len: torch.Tensor, max_len: int, buffer: int, factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), [B] -> [B]: 0 up to
    max_len - buffer tokens, then factor * ((max_len - buffer) - len) / buffer, -factor beyond."""
    if buffer <= 0:
        return torch.zeros(resp_len.shape, dtype=torch.float32)
    over = (resp_len.float() - (max_len - buffer)).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)


def shape_scores(
    scores: torch.Tensor,
    resp_len: torch.Tensor,
    trunc: torch.Tensor,
    *,
    max_len: int,
    moments: torch.Tensor | None = None,
    overlong_buffer: int = 0,
    overlong_factor: float = 1.0,
    missing_eos_penalty: float | None = None,
    clip: float | None = None,
) -> torch.Tensor:
    """Scores [B] as the advantage estimators see them: (s - mean) / (std + 1e-6) with the running
    moments [sum, sum of squares, count] (None: no normalisation), plus the overlong penalty, minus
    missing_eos_penalty on truncated responses, then clamped to [-clip, clip]."""
    s = scores.float()
    if moments is not None:
        tot, sq, n = moments.tolist()
        mean = tot / max(n, 1.0)
        std = max((sq - n * mean * mean) / max(n - 1, 1.0), 0.0) ** 0.5
        s = (s - mean) / (std + 1e-6)
    s = s + overlong_penalty(resp_len, max_len, overlong_buffer, overlong_factor)
    if missing_eos_penalty is not None:
        s = s - missing_eos_penalty * trunc.float()
    if clip is not None:
        s = s.clamp(-clip, clip)
    return s


LR_DECAYS = ("constant", "linear", "cosine")


def lr_at(
    k: int,
    base: float,
    total: int,
    warmup: int = 0,
    decay: str = "constant",
    min_ratio: float = 0.0,
) -> float:
    """Learning rate of optimizer step k (0-based) of `total`: linear warmup base * (k + 1) / warmup
    over the first `warmup` steps, then with p = (k - warmup) / max(total - warmup, 1) in [0, 1]:
    constant base, linear base * (m + (1 - m)(1 - p)) or cosine
    base * (m + (1 - m)(1 + cos(pi p)) / 2), m = min_ratio (the schedules of HF transformers'
    get_scheduler, with a floor)."""
    import math

    if decay not in LR_DECAYS:
        raise ValueError(f"lr decay {decay!r}; allowed: {LR_DECAYS}")
    if k < warmup:
        return base * (k + 1) / warmup
    p = min(max((k - warmup) / max(total - warmup, 1), 0.0), 1.0)
    if decay == "constant":
        return base
    f = 1.0 - p if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return base * (min_ratio + (1.0 - min_ratio) * f)


def rule_reward(
    tokens: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, target_token: int
) -> torch.Tensor:
    """Rule-based score [B]: fraction of response tokens equal to target_token."""
    T = tokens.shape[1]
    pos = torch.arange(T).unsqueeze(0)
    resp = (pos >= prompt_lengths.unsqueeze(1)) & (pos < lengths.unsqueeze(1))
    hits = ((tokens == target_token) & resp).sum(1).float()
    return hits / resp.sum(1).clamp(min=1).float()


__all__ = [
    "response_mask",
    "kl_estimate",
    "token_rewards",
    "KL_ESTIMATORS",
    "policy_loss_tokens",
    "aggregate",
    "LOSS_AGG",
    "returns_to_go",
    "reinforce_returns",
    "group_mean",
    "OUTCOME_ESTIMATORS",
    "last_index",
    "truncated",
    "overlong_penalty",
    "shape_scores",
    "lr_at",
    "LR_DECAYS",
    "gae",
    "masked_moments",
    "whiten",
    "policy_loss",
    "value_loss",
    "group_advantages",
    "zero_variance_groups",
    "grpo_advantages",
    "rule_reward",
]
