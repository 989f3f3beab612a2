"""Log-probabilities and entropy over vocab-parallel logits, never gathering the full vocab and
never holding the whole [tokens, V] in fp32.

Each TP rank holds logits for vocab rows [tp_rank * V_local, (tp_rank + 1) * V_local); rows at or
past vocab_size are padding and are excluded. The work runs in chunks of tokens (at most
CHUNK_ELEMS fp32 logits at a time, converted from the logits' dtype chunk by chunk) inside one
autograd Function:

  forward   per chunk and token, on this rank's vocab slice: the max m, A = sum exp(z - m),
            B = sum exp(z - m) (z - m) (entropy only) and the target's z; then two small
            all-reduces over TP (the max, then the rescaled sums and the target logit) give the
            global lse = M + log A_g, log p(target) = z_t - lse and the entropy
            H = log A_g - B_g / A_g
  backward  per chunk, recomputed from the saved logits (the model dtype) and the per-token lse
            and H: d/dz_i = g_lp (1[i = t] - p_i) - g_H p_i (z_i - lse + H), with global lse and H,
            so no collective is needed (every TP rank holds the same upstream gradients)

z = logits / temperature in fp32. Saved for backward: the logits tensor itself (which the head
produced anyway) and three fp32 numbers per token, instead of several fp32 [tokens, V] tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .tp import _size

CHUNK_ELEMS = 1 << 25
"""fp32 logits held at once per chunk (128 MiB); a chunk covers whole tokens."""


def _valid_cols(v_local: int, tp_rank: int, vocab_size: int) -> int:
    return min(max(vocab_size - tp_rank * v_local, 0), v_local)


def _as3d(logits: torch.Tensor) -> torch.Tensor:
    """[rows, tokens, V] view of logits (2D: one row; a [B, T, V] slice such as logits[:, :-1]
    stays a view, never copied)."""
    if logits.dim() == 3:
        return logits
    if logits.dim() <= 2:
        return logits.reshape((1,) * (3 - logits.dim()) + tuple(logits.shape))
    return logits.reshape(-1, logits.shape[-2], logits.shape[-1])


def _blocks(rows: int, tokens: int, v: int, chunk_elems: int):
    """(row slice, token slice) blocks of at most ~chunk_elems logits, whole tokens each."""
    if tokens * v <= chunk_elems:
        step = max(1, chunk_elems // max(tokens * v, 1))
        return [(slice(r, min(rows, r + step)), slice(0, tokens)) for r in range(0, rows, step)]
    step = max(1, chunk_elems // max(v, 1))
    return [
        (slice(r, r + 1), slice(t, min(tokens, t + step)))
        for r in range(rows)
        for t in range(0, tokens, step)
    ]


def _z(block: torch.Tensor, valid: int, temperature: float) -> torch.Tensor:
    """fp32 copy [n, V] of a [rows, tokens, V] block / temperature, padding columns at fp32's
    lowest value."""
    z = block.to(torch.float32, memory_format=torch.contiguous_format, copy=True).view(
        -1, block.shape[-1]
    )
    if temperature != 1.0:
        z.div_(temperature)
    if valid < z.shape[-1]:
        z[:, valid:] = torch.finfo(torch.float32).min
    return z


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits, targets, group, tp_rank, vocab_size, with_entropy, temperature, chunk_elems
    ):
        v_local = logits.shape[-1]
        x = _as3d(logits)
        rows, tokens = x.shape[0], x.shape[1]
        tgt = targets.reshape(rows, tokens)
        valid = _valid_cols(v_local, tp_rank, vocab_size)
        local = tgt - tp_rank * v_local
        inside = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        dev = logits.device
        m = torch.empty(rows, tokens, dtype=torch.float32, device=dev)
        # A = sum e^(z - m), z_target, B = sum e^(z - m) (z - m)
        sums = torch.zeros(3 if with_entropy else 2, rows, tokens, dtype=torch.float32, device=dev)
        for r, t in _blocks(rows, tokens, v_local, chunk_elems):
            z = _z(x[r, t], valid, temperature)
            shape = m[r, t].shape
            mc = z.amax(-1)
            m[r, t] = mc.view(shape)
            sums[1, r, t] = z.gather(-1, local[r, t].reshape(-1, 1)).view(shape)
            z.sub_(mc[:, None])
            e = z.exp()
            sums[0, r, t] = e.sum(-1).view(shape)
            if with_entropy:
                sums[2, r, t] = e.mul_(z).sum(-1).view(shape)
        sums[1] *= inside
        if _size(group) > 1:
            M = m.clone()
            dist.all_reduce(M, op=dist.ReduceOp.MAX, group=group)
            scale = torch.exp(m - M)
            if (
                with_entropy
            ):  # sum e^(z - M)(z - M) = e^(m - M) (B + (m - M) A); 0 on an all-padding slice
                sums[2] = torch.where(scale > 0, scale * (sums[2] + (m - M) * sums[0]), 0.0)
            sums[0] *= scale
            dist.all_reduce(sums, group=group)
        else:
            M = m
        log_a = sums[0].log()
        lse = M + log_a
        logprobs = sums[1] - lse
        entropy = log_a - sums[2] / sums[0] if with_entropy else None
        ctx.save_for_backward(logits, targets, lse, entropy if with_entropy else lse)
        ctx.args = (tp_rank, vocab_size, with_entropy, temperature, chunk_elems)
        lead = logits.shape[:-1]
        return logprobs.view(lead), (entropy.view(lead) if with_entropy else None)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, lse, entropy = ctx.saved_tensors
        tp_rank, vocab_size, with_entropy, temperature, chunk_elems = ctx.args
        v_local = logits.shape[-1]
        x = _as3d(logits)
        rows, tokens = x.shape[0], x.shape[1]
        valid = _valid_cols(v_local, tp_rank, vocab_size)
        local = targets.reshape(rows, tokens) - tp_rank * v_local
        inside = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        dev = logits.device
        g_lp = (
            torch.zeros(rows, tokens, dtype=torch.float32, device=dev)
            if g_lp is None
            else g_lp.reshape(rows, tokens).float()
        )
        use_ent = with_entropy and g_ent is not None
        g_h = g_ent.reshape(rows, tokens).float() if use_ent else None
        lse = lse.reshape(rows, tokens)
        entropy = entropy.reshape(rows, tokens)
        grad = torch.empty(x.shape, dtype=logits.dtype, device=dev)
        for r, t in _blocks(rows, tokens, v_local, chunk_elems):
            z = _z(x[r, t], valid, temperature)
            lse_c, glp_c = lse[r, t].reshape(-1, 1), g_lp[r, t].reshape(-1, 1)
            if use_ent:
                tt = z - (lse_c - entropy[r, t].reshape(-1, 1))  # z - lse + H
                p = z.sub_(lse_c).exp_()  # p (z no longer needed)
                # -(g_lp p + g_H p (z - lse + H)); p * (...) first: 0 for padding whatever g_H
                g = tt.mul_(p).mul_(g_h[r, t].reshape(-1, 1)).add_(p * glp_c).neg_()
            else:
                g = z.sub_(lse_c).exp_().mul_(-glp_c)
            g.scatter_add_(
                -1, local[r, t].reshape(-1, 1), (g_lp[r, t] * inside[r, t]).reshape(-1, 1)
            )
            if temperature != 1.0:
                g.div_(temperature)
            grad[r, t] = g.view(grad[r, t].shape)
        return grad.view(logits.shape), None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group,
    tp_rank: int,
    vocab_size: int,
    with_entropy: bool = False,
    *,
    temperature: float = 1.0,
    chunk_elems: int = CHUNK_ELEMS,
):
    """log p(targets) and optionally the entropy of each distribution, of logits / temperature.

    logits: [..., V_local] (any float dtype; computed in fp32 chunk by chunk), targets: [...]
    int64 global token ids. Returns (logprobs [...] fp32, entropy [...] fp32 or None), identical
    on every TP rank; differentiable with respect to logits.
    """
    if temperature <= 0:
        raise ValueError(f"vocab_parallel_logprobs: temperature={temperature} must be > 0")
    return _VocabParallelLogprobs.apply(
        logits,
        targets,
        group,
        tp_rank,
        vocab_size,
        bool(with_entropy),
        float(temperature),
        int(chunk_elems),
    )
