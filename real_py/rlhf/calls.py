"""What each kind of call does on one rank of its mesh, over its DP-local rows of the Store.

Every rank of a DP replica (all its TP and PP ranks) runs the same code on the same rows and
writes the same results. Metrics are added to `sums` [len(METRICS), 2] (sum, count) by one
reporter rank per DP replica (TP rank 0 of the last stage), and summed over the world later.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ppo as P
from .dataflow import dp_rows


def _add(rt, sums, name: str, value: float, count: float) -> None:
    from .runtime import METRICS

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
                              eos_token_id=gc.eos_token_id, decode=gc.decode)
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
        if engine is None:
            score = P.rule_reward(tok, pl, ln, cfg.reward.target_token)
        else:
            v = engine.inference(tok, ln)["values"]
            score = v.gather(1, (ln - 1).unsqueeze(1)).squeeze(1)
        store.write(call.writes[0], rows, score)
    elif call.kind in ("train_ppo_actor", "train_grpo_actor", "train_critic"):
        _train(rt, call, g, engine, store, sums, rows, reporter)
    else:
        raise ValueError(f"call {call.name}: no runner for kind {call.kind!r}")


def _allreduce_dp(t: torch.Tensor, g, device) -> torch.Tensor:
    """Sum a CPU tensor over DP (on `device`: NCCL reduces device tensors only)."""
    if g.dp_size > 1:
        d = t.to(device)
        dist.all_reduce(d, group=g.dp_group)
        t.copy_(d)
    return t


def _advantages(rt, call, g, d: dict) -> dict:
    """Adds "mask", "adv", "returns" (PPO) to the DP-local batch d; all [b, T-1]."""
    pc = rt.cfg.ppo
    T = d["tokens"].shape[1]
    mask = P.response_mask(d["prompt_lengths"], d["lengths"], T)
    rewards, kl = P.kl_penalized_rewards(d["scores"], d["old_logp"], d["ref_logp"], mask, pc.kl_coef)
    d["mask"], d["kl"] = mask, kl
    if call.kind == "train_grpo_actor":
        # Outcome advantage per sequence (group-normalized score) minus the per-token KL penalty.
        ga = P.group_advantages(d["scores"], pc.group_size)
        d["adv"] = (ga.unsqueeze(1) - pc.kl_coef * kl) * mask
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
    fields = ["tokens", "lengths", "mask"] + (["old_values", "returns"] if critic else ["old_logp", "adv"])
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
                    ent = float((out["entropy"].detach() * data["mask"]).sum())
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
