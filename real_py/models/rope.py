"""RoPE frequencies with HF rope_scaling, and the sliding-window key mask.

    inv_freq, scale = rope_parameters(config, seq_len)     # [head_dim/2] fp32, float
    cos, sin = rope_cos_sin_scaled(config, positions, dtype)
    keep = window_mask(q_slots, k_slots, window)            # bool [Tq, Tk], True = attend

The frequency formulas reproduce transformers 4.57.6 `modeling_rope_utils` (default, linear,
dynamic, yarn, llama3, longrope) operation for operation, so the fp32 results are bit-identical to
the oracle's `inv_freq` and `attention_scaling` (yarn multiplies cos and sin by it). Dynamic NTK
recomputes the frequencies from the forward's sequence length, seq_len = max(positions) + 1,
whenever it exceeds max_position_embeddings. transformers does the same, but statefully (a grown
inv_freq persists until a call shorter than max_position_embeddings resets it); here every
forward starts fresh, which equals transformers within one generate call (prefill, then decode
steps of growing length) and for every full-sequence forward that starts from a reset state.
longrope switches from short_factor to long_factor per forward when max(positions) + 1 exceeds
original_max_position_embeddings, as transformers' longrope_frequency_update does (so a decode
step past that length rotates its new keys with the long factors while older cached keys keep
the short ones, exactly as in transformers' generate).
Like transformers, dynamic scaling depends on the width of each forward: a micro-batch trimmed to
its longest row rescales by that length, not by the whole batch's.
"""

from __future__ import annotations

import functools
import math

import torch

from ..spec import ModelConfig


def _default_inv_freq(base, dim: int, device) -> torch.Tensor:
    return 1.0 / (
        base
        ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
    )


def rope_parameters(c: ModelConfig, seq_len: torch.Tensor | None = None, device=None) -> tuple:
    """(inv_freq [head_dim // 2] fp32, attention_scaling float) of `c` at sequence length seq_len
    (a 0-dim int tensor; only dynamic scaling reads it)."""
    dim, base = c.head_dim, c.rope_theta
    rs = dict(c.rope_scaling or ())
    kind = rs.get("rope_type", "default")
    if kind == "default":
        return _default_inv_freq(base, dim, device), 1.0
    factor = rs.get("factor")
    if kind == "linear":
        return _default_inv_freq(base, dim, device) / factor, 1.0
    if kind == "dynamic":
        maxp = c.max_position_embeddings
        if seq_len is None or int(seq_len) <= maxp:
            return _default_inv_freq(base, dim, device), 1.0
        base = base * ((factor * seq_len / maxp) - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim, device), 1.0
    if kind == "llama3":
        inv_freq = _default_inv_freq(base, dim, device)
        low, high = rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        return _yarn(c, rs, dim, base, factor, device)
    if kind == "longrope":
        return _longrope(c, rs, dim, base, seq_len, device)
    raise AssertionError(f"rope_type {kind!r} passed ModelConfig validation")


def _yarn(c: ModelConfig, rs: dict, dim: int, base: float, factor: float, device) -> tuple:
    def mscale_of(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rs.get("attention_factor")
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention is None:
        attention = (
            float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all))
            if mscale and mscale_all
            else mscale_of(factor)
        )
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    orig = rs.get("original_max_position_embeddings") or c.max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, attention


def _longrope(c: ModelConfig, rs: dict, dim: int, base: float, seq_len, device) -> tuple:
    """transformers' _compute_longrope_parameters with its per-forward switch (dynamic_rope_update):
    long_factor when max(positions) + 1 > original_max_position_embeddings, else short_factor."""
    factor, attention = rs.get("factor"), rs.get("attention_factor")
    orig = c.original_max_position_embeddings
    if orig:
        factor = c.max_position_embeddings / orig
    else:
        orig = c.max_position_embeddings
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    long = seq_len is not None and int(seq_len) > orig
    ext = torch.tensor(
        rs["long_factor" if long else "short_factor"], dtype=torch.float32, device=device
    )
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext * base**shape), attention


@functools.lru_cache(maxsize=64)
def _fixed_parameters(c: ModelConfig, device: torch.device) -> tuple:
    # Every rope_type but dynamic is independent of the sequence: computed once per device, so a
    # decode step does no host work and no host-to-device copy (a CUDA graph capture forbids one).
    return rope_parameters(c, None, device)


def rope_cos_sin_scaled(c: ModelConfig, positions: torch.Tensor, dtype) -> tuple:
    """positions [B, T] int64 -> cos, sin [B, T, head_dim] (fp32 math, scaled, then cast)."""
    if dict(c.rope_scaling or ()).get("rope_type") in ("dynamic", "longrope"):
        seq_len = positions.max() + 1 if positions.numel() else None
        inv_freq, scale = rope_parameters(c, seq_len, positions.device)
    else:
        inv_freq, scale = _fixed_parameters(c, positions.device)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def window_mask(q_slots: torch.Tensor, k_slots: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding-window rule as transformers' masking_utils: query slot q sees key slot k iff
    q - window < k <= q. q_slots [Tq], k_slots [Tk] int64 -> bool [Tq, Tk] (True = attend).

    Slots are KV-cache indices (prefill and decode alike), so a decode step masks keys older than
    the window whatever the cache layout, as long as a sequence's tokens occupy consecutive slots.
    """
    q, k = q_slots.unsqueeze(1), k_slots.unsqueeze(0)
    return (k <= q) & (k > q - window)
