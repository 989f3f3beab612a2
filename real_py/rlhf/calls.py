"""What each kind of call does on one rank of its mesh, over its DP-local rows of the Store.

Every rank of a DP replica (all its TP and PP ranks) runs the same code on the same rows and
writes the same results. Metrics are added to `sums` [len(METRICS), 2] (sum, count) by one
reporter rank per DP replica (TP rank 0 of the last stage), and summed over the world later.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ppo as P
from .data import decode
from .dataflow import dp_rows
from .observe import METRICS
from .rewards import write_samples


def _add(rt, sums, name: str, value: float, count: float) -> None:
    sums[METRICS.index(name), 0] += value
    sums[METRICS.index(name), 1] += count


def run_call(rt, call, g, engine, store, sums, step: int) -> None:
    rows = dp_rows(g.layout, g.dp_rank, rt.B, rt.mini_batches.get(call.name, 1))
    reporter = g.tp_rank == 0 and g.is_last_stage
    cfg = rt.cfg
    if call.kind == "generate":
        gc = cfg.generation
        out = engine.generate(store.rows("prompts", rows), store.rows("prompt_lengths", rows),
                              store.rows("seeds", rows), max_new_tokens=gc.max_new_tokens,
                              greedy=gc.greedy, temperature=gc.temperature, top_p=gc.top_p,
                              eos_token_id=eos_token_id(rt), decode=gc.decode)
        store.write("tokens", rows, out["tokens"])
        store.write("lengths", rows, out["lengths"])
        lp = engine.inference(store.rows("tokens", rows), store.rows("lengths", rows))["logprobs"]
        store.write("old_logp", rows, lp)
    elif call.kind == "logprobs":
        lp = engine.inference(store.rows("tokens", rows), store.rows("lengths", rows))["logprobs"]
        store.write(call.writes[0], rows, lp)
    elif call.kind == "values":
        v = engine.inference(store.rows("tokens", rows), store.rows("lengths", rows))["values"]
        store.write(call.writes[0], rows, v)
    elif call.kind == "reward":
        tok, ln, pl = (store.rows(k, rows) for k in ("tokens", "lengths", "prompt_lengths"))
        texts = None
        if rt.reward_fn is not None:
            texts = _texts(rt, step, rows, tok, pl, ln)
            row = rt.data.fields(_data_index(rt, step)[rows]) if rt.data is not None else {}
            score = rt.reward_fn(texts[0], texts[1], row)
        elif engine is None:
            score = P.rule_reward(tok, pl, ln, cfg.reward.target_token)
        else:
            v = engine.inference(tok, ln)["values"]
            score = v.gather(1, (ln - 1).unsqueeze(1)).squeeze(1)
        store.write(call.writes[0], rows, score)
        n = min(cfg.data.samples_per_step, len(rows))
        if rt.samples_path and n and reporter and g.dp_rank == 0:
            if texts is None:
                texts = _texts(rt, step, rows[:n], tok[:n], pl[:n], ln[:n])
            write_samples(rt.samples_path, step, texts[0][:n], texts[1][:n], score[:n], rows[:n])
    elif call.kind in ("train_ppo_actor", "train_grpo_actor", "train_critic"):
        _train(rt, call, g, engine, store, sums, rows, reporter)
    else:
        raise ValueError(f"call {call.name}: no runner for kind {call.kind!r}")


def eos_token_id(rt) -> int | None:
    """generation.eos_token_id, else the tokenizer's EOS (when a tokenizer is configured)."""
    eos = rt.cfg.generation.eos_token_id
    if eos is None and rt.tokenizer is not None:
        eos = rt.tokenizer.eos_token_id
    return eos


def _data_index(rt, step: int) -> torch.Tensor:
    """[B] data-set row of every batch row of iteration `step` (as runtime.make_batch picks them)."""
    cfg = rt.cfg
    return rt.data.batch_indices(step, rt.B, cfg.ppo.group_size if cfg.algo == "grpo" else 1)


def _texts(rt, step: int, rows: list[int], tok, pl, ln) -> tuple[list, list]:
    """(prompts, responses) of the rows: the data set's prompt values (decoded prompt tokens for
    synthetic prompts) and decoded responses; token id lists when there is no tokenizer."""
    if rt.tokenizer is None:
        return ([t[:p] for t, p in zip(tok.tolist(), pl.tolist())],
                [t[p:n] for t, p, n in zip(tok.tolist(), pl.tolist(), ln.tolist())])
    # With a data set the prompts are its own values (not a decode of the truncated tokens).
    prompts, responses = decode(rt.tokenizer, tok, pl, ln, prompts=rt.data is None)
    if rt.data is not None:
        prompts = rt.data.prompt_values(_data_index(rt, step)[rows])
    return prompts, responses


def _allreduce_dp(t: torch.Tensor, g, device) -> torch.Tensor:
    """Sum a CPU tensor over DP (on `device`: NCCL reduces device tensors only)."""
    if g.dp_size > 1:
        d = t.to(device)
        dist.all_reduce(d, group=g.dp_group)
        t.copy_(d)
    return t


def kl_in(cfg) -> str:
    """Where the KL to the reference enters: cfg.ppo.kl_in, or by default "loss" for GRPO (as
    published) and "reward" for PPO."""
    return cfg.ppo.kl_in or ("loss" if cfg.algo == "grpo" else "reward")


def _advantages(rt, call, g, d: dict) -> dict:
    """Adds "mask", "kl" (k1), "adv", "returns" (PPO) to the DP-local batch d; all [b, T-1]."""
    pc = rt.cfg.ppo
    T = d["tokens"].shape[1]
    mask = P.response_mask(d["prompt_lengths"], d["lengths"], T)
    in_reward = kl_in(rt.cfg) == "reward"
    rewards, kl = P.kl_penalized_rewards(d["scores"], d["old_logp"], d["ref_logp"], mask,
                                         pc.kl_coef if in_reward else 0.0)
    d["mask"], d["kl"] = mask, kl
    if call.kind == "train_grpo_actor":
        d["adv"] = P.grpo_advantages(d["scores"], kl, mask, pc.group_size, pc.kl_coef, kl_in(rt.cfg))
        return d
    values = d["values"][:, :-1] * mask
    adv, ret = P.gae(rewards, values, mask, pc.gamma, pc.lam)
    if pc.whiten_advantages:
        adv = P.whiten(adv, mask, _allreduce_dp(P.masked_moments(adv, mask), g, rt.device))
    d["adv"], d["returns"], d["old_values"] = adv, ret, values
    return d


def _train(rt, call, g, engine, store, sums, rows, reporter) -> None:
    pc = rt.cfg.ppo
    keys = [k for k in call.reads]
    d = {k: store.rows(k, rows) for k in keys}
    d = _advantages(rt, call, g, d)
    critic = call.kind == "train_critic"
    if reporter and not critic:
        resp = d["mask"].sum(1)
        _add(rt, sums, "reward", float(d["scores"].sum()), len(rows))
        _add(rt, sums, "kl", float(d["kl"].sum()), len(rows))
        _add(rt, sums, "response_length", float(resp.sum()), len(rows))
    kl_loss = not critic and kl_in(rt.cfg) == "loss"
    fields = ["tokens", "lengths", "mask"] + (["old_values", "returns"] if critic else ["old_logp", "adv"])
    fields += ["ref_logp"] if kl_loss else []
    local = torch.arange(len(rows))
    for _ in range(pc.ppo_epochs):
        for mb in local.tensor_split(pc.mini_batches):
            batch = {k: d[k][mb] for k in fields}
            n_tok = float(_allreduce_dp(batch["mask"].sum().double().reshape(1), g, rt.device))
            extra = []

            def loss_fn(out, data, n_tok=max(n_tok, 1.0), extra=extra):
                if critic:
                    loss, nclip = P.value_loss(out["values"][:, :-1], data["old_values"], data["returns"],
                                               data["mask"], pc.value_clip)
                    extra.append((float(nclip), 0.0, float(data["mask"].sum())))
                else:
                    loss, nclip = P.policy_loss(out["logprobs"], data["old_logp"], data["adv"],
                                                data["mask"], pc.clip)
                    if kl_loss:
                        loss = loss + pc.kl_coef * P.k3_kl(out["logprobs"], data["ref_logp"], data["mask"]).sum()
                    ent_sum = (out["entropy"] * data["mask"]).sum()
                    if pc.entropy_coef:
                        loss = loss - pc.entropy_coef * ent_sum
                    ent = float(ent_sum.detach())
                    extra.append((float(nclip), ent, float(data["mask"].sum())))
                return loss / n_tok

            res = engine.train_step(loss_fn, batch, micro_batches=pc.micro_batches,
                                    with_entropy=not critic)
            if reporter:
                ncl, ent, ntk = (sum(x[i] for x in extra) for i in range(3))
                if critic:
                    _add(rt, sums, "value_clip_frac", ncl, ntk)
                else:
                    _add(rt, sums, "clip_frac", ncl, ntk)
                    _add(rt, sums, "entropy", ent, ntk)
                if g.dp_rank == 0:
                    _add(rt, sums, "value_loss" if critic else "policy_loss", res["loss"], 1)
