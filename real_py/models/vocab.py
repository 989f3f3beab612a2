"""Log-probabilities and entropy over vocab-parallel logits, never gathering the full vocab.

Each TP rank holds logits for vocab rows [tp_rank * V_local, (tp_rank + 1) * V_local); rows at or
past vocab_size are padding and are excluded. Three small all-reduces replace a gather of
[tokens, V] logits: the max (no grad; the result does not depend on it), the sum of exp, and the
picked target logit (autograd through reduce_from_tp, whose backward is the identity because
every TP rank computes the same loss).

Entropy H = lse - sum_j p_j z_j (z shifted by the max) uses the global lse inside each rank's
LOCAL probabilities p_j = exp(z_j - lse). The gradient reaching lse through those local terms
is a partial sum over this rank's vocab rows only, so lse enters them through copy_to_tp
(backward all-reduce): without it dH/dz_i = -p_i (z_i - sum_j p_j z_j) would use only the local
part of sum_j p_j z_j on each rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .tp import _size, copy_to_tp, reduce_from_tp


def mask_vocab_padding(logits: torch.Tensor, tp_rank: int, vocab_size: int) -> torch.Tensor:
    """Set logits of padding rows (global index >= vocab_size) to the dtype's lowest value."""
    v_local = logits.shape[-1]
    valid = min(max(vocab_size - tp_rank * v_local, 0), v_local)
    if valid == v_local:
        return logits
    pad = torch.arange(v_local, device=logits.device) >= valid
    return logits.masked_fill(pad, torch.finfo(logits.dtype).min)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, group, tp_rank: int,
                            vocab_size: int, with_entropy: bool = False):
    """log p(targets) and optionally the entropy of each distribution.

    logits: [..., V_local] float, targets: [...] int64 global token ids.
    Returns (logprobs [...], entropy [...] or None), identical on every TP rank.
    """
    logits = mask_vocab_padding(logits.float(), tp_rank, vocab_size)
    v_local = logits.shape[-1]
    m = logits.detach().amax(-1)
    if _size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m.unsqueeze(-1)
    lse = reduce_from_tp(shifted.exp().sum(-1), group).log()
    local = targets - tp_rank * v_local
    inside = (local >= 0) & (local < v_local)
    picked = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tp(picked * inside, group)
    logprobs = picked - lse
    if not with_entropy:
        return logprobs, None
    probs = (shifted - copy_to_tp(lse, group).unsqueeze(-1)).exp()
    entropy = lse - reduce_from_tp((probs * shifted).sum(-1), group)
    return logprobs, entropy
