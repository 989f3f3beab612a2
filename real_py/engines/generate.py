"""Autoregressive generation with a KV cache, pipelined over stages, per-sequence seeded sampling.

Prompts arrive right-padded and are left-aligned internally (positions count from each prompt's
first token; padded keys are masked), so one prefill plus one-token decode steps serve the whole
batch. Each step runs the stages in turn (activations point to point), the last stage gathers
the logits over TP (identical on every TP rank), picks the next tokens and broadcasts them over
the pipeline. Sampling draws one uniform per sequence per step from that sequence's own
torch.Generator seeded by its seed, so a sequence's tokens do not depend on the layout, the batch
split or its neighbours. Finished sequences (EOS) emit pad_token_id until all are done.
The cache and the decode step (dynamic, static, CUDA graph) live in decode.py; everything runs on
the engine's device and the results come back on the device of the prompts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.tp import gather_from_tp
from .decode import Decoder, pick_mode
from .pipeline import P2P


def pick_tokens(
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    temperature: float,
    top_p: float,
    top_k: int = 0,
) -> torch.Tensor:
    """logits [B, V] float; uniforms [B] in [0, 1) or None for greedy. Returns [B] int64.

    Inverse-CDF sampling, one uniform per token. Without truncation (top_k 0 or >= V, top_p 1)
    over the vocabulary in index order: the token whose interval of the cumulative probability
    (token 0 first) holds u * total. No sort, and all of it on the device. With top-k or top-p,
    over the temperature-scaled, top-k- then top-p-truncated distribution with tokens sorted by
    probability (ties by index). Both are exact samples of the same distribution; for a given
    uniform they generally pick different tokens (a run without truncation draws other tokens
    than the sorted rule did for the same seeds).
    """
    if uniforms is None:
        return logits.argmax(-1)
    V = logits.shape[-1]
    probs = torch.softmax(logits.float() / temperature, -1)
    truncated = 0 < top_k < V
    if not truncated and top_p >= 1.0:
        cum = probs.cumsum(-1)
        total = cum[:, -1:].contiguous()
        idx = torch.searchsorted(cum, uniforms.unsqueeze(-1) * total, right=True)
        # u * total rounded up to total (u within 2^-24 of 1) must not select a zero-probability
        # tail: the last token that reaches the total is the last one with mass
        last = torch.searchsorted(cum, total, right=False)
        return torch.minimum(idx, last).clamp(max=V - 1).squeeze(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    if truncated:
        sorted_p[:, top_k:] = 0.0
    cum = sorted_p.cumsum(-1)
    if top_p < 1.0:
        # top-p on the top-k distribution renormalised (as transformers' and vLLM's warpers do):
        # keep a token while the mass before it is below top_p of the kept mass.
        kept = top_p * cum[:, -1:] if truncated else top_p
        sorted_p = sorted_p.masked_fill(cum - sorted_p >= kept, 0.0)
        cum = sorted_p.cumsum(-1)
    target = (uniforms * cum[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cum, target, right=True).clamp(max=V - 1)
    return order.gather(-1, idx).squeeze(-1)


STOP_CHECK_EVERY = 8
"""Decode steps between host checks of "every sequence has stopped" (each check waits for the
device). The done mask itself is updated on the device every step, so tokens after a stop are
pad_token_id as before, and the result is trimmed to the step where the last sequence stopped:
the same tokens and lengths as a check after every step, up to STOP_CHECK_EVERY - 1 steps of
pad tokens computed and dropped."""


@torch.no_grad()
def generate(
    engine,
    prompt_tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    seeds: torch.Tensor,
    *,
    max_new_tokens: int,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id=None,
    pad_token_id: int = 0,
    decode: str = "auto",
    top_k: int = 0,
    swap=None,
    min_new_tokens: int = 0,
) -> dict:
    """prompt_tokens [B, P] right-padded, prompt_lengths [B], seeds [B] int64.
    eos_token_id: a token id or a list of them (any ends a response, and is kept in it) or None.
    decode: "auto" (CUDA graph on CUDA with tp == 1, else static cache), "dynamic", "static" or
    "graph" (see decode.py).
    min_new_tokens: the stop tokens (eos_token_id) get probability zero for the first
    min_new_tokens new tokens, so no response ends earlier (transformers' min_new_tokens, vLLM's
    min_tokens: their logits set to -inf before temperature, top-k and top-p). Only sampling is
    changed: log-probs computed later by an inference call are the model's own (the
    unmasked distribution, as verl / vLLM report them), so the first min_new_tokens tokens were
    drawn from a slightly different distribution than the behaviour log-probs say.

    swap: interruptible generation (async RL). None, or a callable swap(step) -> bool called
    before every decode step step >= 1 on every rank of the replica (it must answer the same on
    all of them); True means the caller has just replaced the engine's weights in place (a new
    version). The KV cache is then RECOMPUTED: one prefill of prompt + the step tokens so far
    with the new weights (the cache of the old weights is dropped), so token `step` onwards is
    exactly what the new weights generate from that prefix. "swaps" in the result lists the
    steps at which weights changed: new token j was sampled by version (number of swaps <= j).

    Returns {"tokens": [B, P' + N] right-padded prompt + generated tokens, "lengths": [B],
    "prompt_lengths": [B], "new_tokens": [B, N], "swaps": [steps]} (N <= max_new_tokens,
    P' = max prompt length), identical on every rank of the DP replica.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(
            f"min_new_tokens={min_new_tokens} must be in [0, max_new_tokens={max_new_tokens}]"
        )
    c, g, dev = engine.config, engine.groups, engine.device
    mode = pick_mode(engine, decode)
    if eos_token_id is not None and not isinstance(eos_token_id, (list, tuple)):
        eos_token_id = [eos_token_id]
    stops = torch.tensor(list(eos_token_id), dtype=torch.int64) if eos_token_id else None
    # ids outside the vocabulary can never be sampled, so only the others need banning
    banned = None if stops is None else stops[(stops >= 0) & (stops < c.vocab_size)].to(dev)
    where = prompt_tokens.device
    prompt_tokens, prompt_lengths = prompt_tokens.cpu(), prompt_lengths.cpu()
    B = prompt_tokens.shape[0]
    if not greedy and (temperature <= 0 or not 0 < top_p <= 1):
        raise ValueError(
            f"sampling needs temperature > 0 and top_p in (0, 1]; got {temperature}, {top_p}"
        )
    if prompt_lengths.shape != (B,) or seeds.shape != (B,) or int(prompt_lengths.min()) < 1:
        raise ValueError(f"prompt_lengths and seeds must be [B={B}] with lengths >= 1")
    P = int(prompt_lengths.max())
    total = P + max_new_tokens
    if total > c.position_limit:
        raise ValueError(
            f"prompt {P} + max_new_tokens {max_new_tokens} exceeds max_position_embeddings="
            f"{c.max_position_embeddings} (position limit {c.position_limit})"
        )
    pad = P - prompt_lengths
    left = torch.full((B, P), pad_token_id, dtype=torch.int64)
    valid = torch.zeros(B, total, dtype=torch.bool)
    for b in range(B):
        n = int(prompt_lengths[b])
        left[b, P - n :] = prompt_tokens[b, :n]
        valid[b, P - n : P] = True
    pos = (torch.arange(P).unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)
    # A left-padding query would see no key at all (NaN rows); let it see itself.
    mask = torch.ones(P, P, dtype=torch.bool).tril() & valid[:, None, None, :P]
    mask = (mask | torch.eye(P, dtype=torch.bool)).to(dev)
    left, valid, pos, lengths_dev = left.to(dev), valid.to(dev), pos.to(dev), prompt_lengths.to(dev)
    # One uniform per sequence and step from the sequence's own generator, drawn up front: rand(n)
    # of a CPU generator is n successive rand(1) (the oracle in tests/support/models_oracle.py draws
    # them one by one), and one host-to-device copy replaces one per step, each of which waited for
    # the device (a pageable copy synchronizes with the stream).
    draws = None
    if g.is_last_stage and not greedy:
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        draws = torch.stack([torch.rand(max_new_tokens, generator=gen) for gen in gens], 1).to(
            dev
        )  # [steps, B]
    dec = Decoder(engine, B, total, valid, mode)
    valid = (
        dec.valid
    )  # the decoder's live key mask ([B, >= total]; a persistent buffer for static / graph)
    p2p = P2P(g, dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    new = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.int64, device=dev)
    lay = engine.layout
    # an ep (or etp) group can span dp replicas: its all-to-alls (gathers) need every replica to
    # step, so the replicas agree on stopping after every step; a swap callback is asked before
    # every step it would be asked today: both check every step
    sync_dp = (lay.ep > 1 or lay.etp > lay.tp) and g.dp_size > 1
    every = 1 if (sync_dp or swap is not None) else STOP_CHECK_EVERY
    all_done = (
        torch.zeros(max_new_tokens, dtype=torch.bool, device=dev) if stops is not None else None
    )
    stops_dev = stops.to(dev) if stops is not None else None
    x, steps, swaps = left, 0, []
    for step in range(max_new_tokens):
        recompute = step > 0 and swap is not None and bool(swap(step))
        if recompute:
            # New weights: drop the cache, prefill prompt + tokens so far (positions and padding
            # as the first prefill, the generated tokens after the prompt).
            swaps.append(step)
            n = P + step
            x = torch.cat([left, new[:, :step]], 1)
            pos = (torch.arange(n, device=dev).unsqueeze(0) - pad.to(dev).unsqueeze(1)).clamp(min=0)
            mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril() & valid[:, None, None, :n]
            mask = mask | torch.eye(n, dtype=torch.bool, device=dev)
            dec = Decoder(engine, B, total, valid[:, :total].clone(), mode)
            valid = dec.valid
        n = x.shape[1]
        inp = x if g.is_first_stage else p2p.recv((B, n, c.hidden_size), engine.dtype, g.prev_rank)
        # Step s >= 1 feeds the token of step s - 1, which lands in cache slot P + s - 1.
        if step == 0 or recompute:
            out = dec.prefill(inp, pos, mask)
        else:
            out = dec.step(inp, pos, P + step - 1)
        nxt = torch.empty(B, dtype=torch.int64, device=dev)
        if g.is_last_stage:
            logits = gather_from_tp(out, g.tp_group, g.tp_ranks)[:, : c.vocab_size]
            if step < min_new_tokens and banned is not None:
                logits = logits.index_fill(-1, banned, float("-inf"))
            u = None if draws is None else draws[step]
            nxt = pick_tokens(logits, u, temperature, top_p, top_k).masked_fill(done, pad_token_id)
        else:
            p2p.send(out, g.next_rank)
        p2p.flush()
        if g.pp_size > 1:
            dist.broadcast(nxt, g.last_stage_rank, group=g.pp_group)
        new[:, step] = nxt
        steps = step + 1
        if stops is not None:
            done |= torch.isin(nxt, stops_dev)
            all_done[step] = done.all()
            if sync_dp:
                finished = all_done[step].to(torch.int64).reshape(1)
                dist.all_reduce(finished, op=dist.ReduceOp.MIN, group=g.dp_group)
                if bool(finished.item()):
                    break
            elif (step + 1) % every == 0 and bool(all_done[step].item()):
                # done only grows: the first step at which every sequence had stopped
                steps = int(all_done[: step + 1].to(torch.int8).argmax()) + 1
                break
        valid[:, P + step] = True
        x = nxt.unsqueeze(1)
        pos = (lengths_dev + step).unsqueeze(1)
    if stops is not None and not sync_dp and steps == max_new_tokens and max_new_tokens % every:
        # the loop ran out between two checks: trim to where every sequence had stopped, if it had
        flags = all_done.cpu()
        if bool(flags[-1]):
            steps = int(flags.to(torch.int8).argmax()) + 1
    new = new[:, :steps].cpu()
    gen_len = torch.full((B,), steps, dtype=torch.int64)
    if stops is not None:
        is_eos = torch.isin(new, stops)
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, steps)
        gen_len = first
    out = torch.full((B, P + steps), pad_token_id, dtype=torch.int64)
    for b in range(B):
        n, m = int(prompt_lengths[b]), int(gen_len[b])
        out[b, :n] = prompt_tokens[b, :n]
        out[b, n : n + m] = new[b, :m]
    res = {
        "tokens": out,
        "lengths": prompt_lengths + gen_len,
        "prompt_lengths": prompt_lengths.clone(),
        "new_tokens": new,
    }
    res = {k: v.to(where) for k, v in res.items()}
    res["swaps"] = swaps
    return res
