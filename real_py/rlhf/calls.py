"""What each kind of call does on one rank of its mesh, over its DP-local rows of the Store.

Every rank of a DP replica (all its TP and PP ranks) runs the same code on the same rows and
writes the same results. Metrics are added to `sums` (observe.MetricSums: sum, count) by one
reporter rank per DP replica (TP rank 0 of the last stage), and summed over the world later.
Everything else a call reads comes from its context.CallContext.

One file past 400 lines: run_call and the call kinds it dispatches to (generation on the engine or
vLLM, log-probs, values, reward, and the actor / critic updates in _advantages and _train) share the
DP-local rows, CallContext and one-reporter-per-replica rule above.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..liveness import user_code
from . import asyncrl, ppo
from .config.schema import GenConfig, PPOConfig, RewardConfig
from .context import CallContext
from .data import decode
from .observe import MetricSums
from .rewards import write_samples
from .rows import dp_rows


def run_call(ctx: CallContext, call, g, engine, store, sums: MetricSums, step: int) -> bool:
    """Run `call` on this rank's rows; False when it had none (a refill round of dynamic
    sampling that regenerates no row of this rank's replica)."""
    rows = dp_rows(g.layout, g.dp_rank, ctx.B, ctx.mini_batches.get(call.name, 1))
    if ctx.active_rows is not None and not call.trains:
        # A refill round of dynamic sampling: only the rows of dropped groups are regenerated.
        rows = [r for r in rows if r in ctx.active_rows]
        if not rows:
            return False
    reporter = g.tp_rank == 0 and g.is_last_stage
    if call.name == ctx.models.rollout_call:
        _generate_vllm(ctx, call, engine, store, rows)
    elif call.kind in ("generate", "generate_greedy"):
        gc = ctx.generation
        greedy = gc.greedy or call.kind == "generate_greedy"
        hook = None
        if call.kind == "generate" and ctx.prefetch is not None:
            hook = ctx.prefetch.swap_hook(call, g, engine, ctx.async_)
        out = engine.generate(
            store.rows("prompts", rows),
            store.rows("prompt_lengths", rows),
            store.rows("seeds", rows),
            max_new_tokens=gc.max_new_tokens,
            min_new_tokens=gc.min_new_tokens,
            greedy=greedy,
            temperature=gc.temperature,
            top_p=gc.top_p,
            top_k=gc.top_k,
            eos_token_id=stop_ids(gc, ctx.tokenizer) or None,
            decode=gc.decode,
            swap=hook.swap if hook else None,
        )
        at = hook.at if hook else None
        store.write(call.writes[0], rows, out["tokens"])
        store.write(call.writes[1], rows, out["lengths"])
        ver = None
        if "versions" in call.writes:
            # Async mode: the weight version of every response token, -1 off the response;
            # after an interrupt (new weights from decode step `at`) the later tokens are newer.
            pl = store.rows("prompt_lengths", rows)
            T1 = ctx.T - 1
            m = ppo.response_mask(pl, out["lengths"], T1 + 1)
            j = torch.arange(1, T1 + 1).unsqueeze(0) - pl.unsqueeze(
                1
            )  # new-token index of each prediction
            ver = torch.full_like(j, ctx.gen_version) + (0 if at is None else (j >= at).long())
            ver = torch.where(m > 0, ver, torch.full_like(ver, -1))
            store.write("versions", rows, ver)
        if len(call.writes) > 2:
            lp = engine.inference(out["tokens"], out["lengths"])["logprobs"]
            if at is not None:
                # Behaviour log-probs of the tokens sampled before the swap: the old weights.
                new_w = engine.shard.flat.clone()
                engine.shard.flat.copy_(hook.old)
                lp_old = engine.inference(out["tokens"], out["lengths"])["logprobs"]
                engine.shard.flat.copy_(new_w)
                lp = torch.where(ver[:, : lp.shape[1]] == ctx.gen_version, lp_old, lp)
            store.write(call.writes[2], rows, lp)
        if hook and reporter:
            sums.add("interrupted", float(len(rows)) if at is not None else 0.0, float(len(rows)))
    elif call.kind == "logprobs":
        lp = engine.inference(store.rows("tokens", rows), store.rows("lengths", rows))["logprobs"]
        store.write(call.writes[0], rows, lp)
    elif call.kind == "values":
        v = engine.inference(store.rows("tokens", rows), store.rows("lengths", rows))["values"]
        store.write(call.writes[0], rows, v)
    elif call.kind == "reward":
        # scores of (tokens, lengths); ReMax's reward call also scores (base_tokens, base_lengths).
        for j, key in enumerate(call.writes):
            tok_key, len_key = ("tokens", "lengths") if j == 0 else ("base_tokens", "base_lengths")
            _reward(
                ctx, engine, store, rows, step, key, tok_key, len_key, reporter and g.dp_rank == 0
            )
    elif call.kind in ("train_ppo_actor", "train_grpo_actor", "train_critic"):
        _train(ctx, call, g, engine, store, sums, rows, reporter, step)
    else:
        raise ValueError(f"call {call.name}: no runner for kind {call.kind!r}")
    return True


def _generate_vllm(ctx: CallContext, call, rollout, store, rows) -> None:
    """The actor's sampling call on vLLM (real_py/vllm/rollout.py): the same settings as the
    built-in engine (generation.*), one seeded request per row; writes tokens, lengths and
    vLLM's log-prob of each sampled token (rollout_logp)."""
    from ..vllm.rollout import Sampling

    gc = ctx.generation
    s = Sampling(
        max_new_tokens=gc.max_new_tokens,
        min_new_tokens=gc.min_new_tokens,
        greedy=gc.greedy,
        temperature=gc.temperature,
        top_p=gc.top_p,
        top_k=gc.top_k,
        stop_token_ids=tuple(stop_ids(gc, ctx.tokenizer)),
    )
    out = rollout.generate(
        store.rows("prompts", rows),
        store.rows("prompt_lengths", rows),
        store.rows("seeds", rows),
        s,
    )
    for key, value in zip(call.writes, (out["tokens"], out["lengths"], out["logprobs"])):
        store.write(key, rows, value)


def _reward(ctx: CallContext, engine, store, rows, step, key, tok_key, len_key, writer) -> None:
    tok, ln, pl = (store.rows(k, rows) for k in (tok_key, len_key, "prompt_lengths"))
    texts = None
    if ctx.reward_fn is not None:
        texts = _texts(ctx, rows, tok, pl, ln)
        row = ctx.prompts.fields(ctx.batch_index[rows]) if ctx.prompts is not None else {}
        with user_code(
            f"the reward function {ctx.reward_fn.spec}"
        ):  # named if it hangs (launch.job)
            score = ctx.reward_fn(texts[0], texts[1], row)
    elif engine is None:
        score = ppo.rule_reward(tok, pl, ln, ctx.reward.target_token)
    else:
        v = engine.inference(tok, ln)["values"]
        score = v.gather(1, (ln - 1).unsqueeze(1)).squeeze(1)
    store.write(key, rows, score)
    n = min(ctx.data.samples_per_step, len(rows))
    if ctx.samples_path and n and writer and key == "scores":
        if texts is None:
            texts = _texts(ctx, rows[:n], tok[:n], pl[:n], ln[:n])
        write_samples(ctx.samples_path, step, texts[0][:n], texts[1][:n], score[:n], rows[:n])


def eos_token_id(gc: GenConfig, tokenizer) -> int | None:
    """generation.eos_token_id, else the tokenizer's EOS (when a tokenizer is configured)."""
    eos = gc.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos


def stop_ids(gc: GenConfig, tokenizer) -> list[int]:
    """The tokens that end a response: the EOS (eos_token_id) and generation.stop_token_ids."""
    eos = eos_token_id(gc, tokenizer)
    extra = list(gc.stop_token_ids or ())
    return list(dict.fromkeys(([eos] if eos is not None else []) + extra))


def _texts(ctx: CallContext, rows: list[int], tok, pl, ln) -> tuple[list, list]:
    """(prompts, responses) of the rows: the data set's prompt values (decoded prompt tokens for
    synthetic prompts) and decoded responses; token id lists when there is no tokenizer. The
    data-set rows are ctx.batch_index (as data.make_batch picks them, refilled rows of dynamic
    sampling included)."""
    if ctx.tokenizer is None:
        return (
            [t[:p] for t, p in zip(tok.tolist(), pl.tolist())],
            [t[p:n] for t, p, n in zip(tok.tolist(), pl.tolist(), ln.tolist())],
        )
    # With a data set the prompts are its own values (not a decode of the truncated tokens).
    prompts, responses = decode(ctx.tokenizer, tok, pl, ln, prompts=ctx.prompts is None)
    if ctx.prompts is not None:
        prompts = ctx.prompts.prompt_values(ctx.batch_index[rows])
    return prompts, responses


def _allreduce_dp(t: torch.Tensor, g, device) -> torch.Tensor:
    """Sum a CPU tensor over DP (on `device`: NCCL reduces device tensors only)."""
    if g.dp_size > 1:
        d = t.to(device)
        dist.all_reduce(d, group=g.dp_group)
        t.copy_(d)
    return t


def kl_in(pc: PPOConfig, algo: str) -> str:
    """Where the KL to the reference enters: ppo.kl_in, or by default "loss" for GRPO-style
    outcome estimators (grpo, rloo: as GRPO is published) and "reward" for the others (PPO,
    REINFORCE++ and ReMax put the per-token KL in the reward)."""
    return pc.kl_in or ("loss" if algo in ("grpo", "rloo") else "reward")


def kl_estimator(pc: PPOConfig, algo: str) -> str:
    """ppo.kl_estimator, or by default k1 in the reward and k3 in the loss."""
    return pc.kl_estimator or ("k1" if kl_in(pc, algo) == "reward" else "k3")


def _shape(rc: RewardConfig, max_len: int, moments, scores, resp_len, trunc):
    """ppo.shape_scores with the config's reward options (moments: None without
    reward.normalize)."""
    return ppo.shape_scores(
        scores,
        resp_len,
        trunc,
        max_len=max_len,
        moments=moments,
        overlong_buffer=rc.overlong_buffer,
        overlong_factor=rc.overlong_penalty,
        missing_eos_penalty=rc.missing_eos_penalty,
        clip=rc.clip,
    )


def _advantages(ctx: CallContext, call, g, d: dict) -> dict:
    """Adds "mask", "kl" (k1, the reported metric), "adv", and for PPO "returns", "old_values"
    to the DP-local batch d; all [b, T-1]. One path for every estimator (ctx.algo)."""
    pc, rc, algo = ctx.ppo, ctx.reward, ctx.algo
    max_len, stops = ctx.generation.max_new_tokens, stop_ids(ctx.generation, ctx.tokenizer)
    T = d["tokens"].shape[1]
    mask = ppo.response_mask(d["prompt_lengths"], d["lengths"], T)
    d["kl"] = ppo.kl_estimate(d["old_logp"], d["ref_logp"], mask, "k1")
    trunc = ppo.truncated(d["tokens"], d["lengths"], d["prompt_lengths"], stops)
    d["raw_scores"] = d["scores"]
    moments = None
    if rc.normalize:  # the previous steps' moments plus this batch's (summed over DP)
        cur = ppo.masked_moments(d["scores"], torch.ones_like(d["scores"]))
        moments = ctx.reward_moments + _allreduce_dp(cur, g, ctx.device)
    d["scores"] = _shape(
        rc, max_len, moments, d["scores"], d["lengths"] - d["prompt_lengths"], trunc
    )
    if "base_scores" in d:  # ReMax's greedy baseline, shaped like the samples it is compared with
        bt = ppo.truncated(d["base_tokens"], d["base_lengths"], d["prompt_lengths"], stops)
        d["base_scores"] = _shape(
            rc, max_len, moments, d["base_scores"], d["base_lengths"] - d["prompt_lengths"], bt
        )
    if rc.mask_truncated:
        mask = mask * (~trunc).float().unsqueeze(1)
    d["mask"] = mask
    in_reward = kl_in(pc, algo) == "reward"
    kl = (
        ppo.kl_estimate(d["old_logp"], d["ref_logp"], mask, kl_estimator(pc, algo), pc.kl_clamp)
        if in_reward
        else torch.zeros_like(mask)
    )
    coef = ctx.kl_coef if in_reward else 0.0
    scores = d["scores"]
    if algo in ("grpo", "rloo"):
        d["adv"] = ppo.grpo_advantages(
            scores,
            kl,
            mask,
            pc.group_size,
            coef,
            kl_in(pc, algo),
            norm_by_std=pc.norm_adv_by_std,
            estimator=algo,
        )
        return d
    if algo in ("reinforce_pp", "reinforce_pp_baseline", "remax"):
        base = None
        if algo == "reinforce_pp_baseline":
            base = ppo.group_mean(scores, pc.group_size)
        elif algo == "remax":
            base = d["base_scores"]
        adv = ppo.reinforce_returns(scores, kl, mask, coef, pc.gamma, base)
        if algo != "remax" and pc.whiten_returns:
            adv = ppo.whiten(adv, mask, _allreduce_dp(ppo.masked_moments(adv, mask), g, ctx.device))
        d["adv"] = adv
        return d
    rewards = ppo.token_rewards(scores, kl, mask, coef)
    values = d["values"][:, :-1] * mask
    adv, ret = ppo.gae(rewards, values, mask, pc.gamma, pc.lam)
    if pc.whiten_advantages:
        adv = ppo.whiten(adv, mask, _allreduce_dp(ppo.masked_moments(adv, mask), g, ctx.device))
    d["adv"], d["returns"], d["old_values"] = adv, ret, values
    return d


def _train(
    ctx: CallContext, call, g, engine, store, sums: MetricSums, rows, reporter, step: int
) -> None:
    pc = ctx.ppo
    keys = [k for k in call.reads]
    d = {k: store.rows(k, rows) for k in keys}
    d = _advantages(ctx, call, g, d)
    critic = call.kind == "train_critic"
    st = ctx.astate
    if "versions" in d:
        # Async mode: rows generated more than k versions ago leave the loss (counted dropped).
        d["mask"], old = asyncrl.version_mask(d["versions"], d["mask"], st.version, st.k)
        if reporter:
            sums.add("rows_dropped_step", float(old.sum()), 0.0)
            s_sum, s_cnt = asyncrl.staleness(d["versions"], d["mask"], st.version)
            sums.add("staleness", s_sum, s_cnt)
        if ctx.async_.check_versions:
            e_rec, e_new, ntok = asyncrl.version_errors(
                st, ctx.models.configs["actor"], ctx.models.specs["actor"], g, engine, d, d["mask"]
            )
            if reporter:
                sums.add("version_err", e_rec, ntok)
                sums.add("version_err_newest", e_new, ntok)
    decoupled = pc.decoupled and not critic
    if decoupled:
        # The proximal policy: this train engine's weights before the step's first update.
        d["prox_logp"] = engine.inference(d["tokens"], d["lengths"])["logprobs"]
    tis = None
    if "rollout_logp" in d and not critic:
        # The generation engine's log-probs against the trainer's recompute (old_logp), over
        # the response tokens; truncated importance sampling weights from their ratio.
        if reporter:
            diff, kl, n = ppo.logprob_gap(d["old_logp"], d["rollout_logp"], d["mask"])
            sums.add("rollout_logp_diff", diff, n)
            sums.add("rollout_kl", kl, n)
        if pc.tis_cap is not None:
            tis, capped = ppo.truncated_is_weights(
                d["old_logp"], d["rollout_logp"], d["mask"], pc.tis_cap
            )
            d["tis_w"] = tis
            if reporter:
                sums.add("tis_capped_frac", capped, float(d["mask"].sum()))
    if reporter and not critic:
        resp = d["mask"].sum(1)
        sums.add("reward", float(d["raw_scores"].sum()), len(rows))
        # Sum of squared raw scores for the running normalisation.
        sums.add_squared_scores(float((d["raw_scores"].double() ** 2).sum()), len(rows))
        sums.add("kl", float(d["kl"].sum()), len(rows))
        sums.add("response_length", float(resp.sum()), len(rows))
    kl_loss = not critic and kl_in(pc, ctx.algo) == "loss"
    est, coef, max_len = kl_estimator(pc, ctx.algo), ctx.kl_coef, ctx.generation.max_new_tokens
    fields = ["tokens", "lengths", "mask"] + (
        ["old_values", "returns"] if critic else ["old_logp", "adv"]
    )
    fields += ["ref_logp"] if kl_loss else []
    fields += ["prox_logp"] if decoupled else []
    fields += ["tis_w"] if tis is not None else []
    local = torch.arange(len(rows))
    base_lr = pc.critic_lr if critic else pc.actor_lr
    total = ctx.steps * pc.ppo_epochs * pc.mini_batches
    for epoch in range(pc.ppo_epochs):
        for j, mb in enumerate(local.tensor_split(pc.mini_batches)):
            k = (step * pc.ppo_epochs + epoch) * pc.mini_batches + j  # optimizer step of the run
            lr = ppo.lr_at(k, base_lr, total, pc.warmup_steps, pc.lr_decay, pc.min_lr_ratio)
            batch = {k: d[k][mb] for k in fields}
            # Tokens and rows of the GLOBAL mini-batch: every part's loss is its share of the
            # whole (ppo.aggregate), and gradients are summed over micro-batches and DP.
            counts = torch.tensor([float(batch["mask"].sum()), float(len(mb))], dtype=torch.float64)
            n_tok, n_seq = _allreduce_dp(counts, g, ctx.device).tolist()
            extra = []

            def loss_fn(out, data, n_tok=max(n_tok, 1.0), n_seq=n_seq, extra=extra):
                m = data["mask"]
                if critic:
                    loss, nclip = ppo.value_loss(
                        out["values"][:, :-1], data["old_values"], data["returns"], m, pc.value_clip
                    )
                    extra.append((float(nclip), 0.0, float(m.sum())))
                    return loss / n_tok
                if decoupled:
                    loss, clipped = ppo.decoupled_policy_loss_tokens(
                        out["logprobs"],
                        data["prox_logp"],
                        data["old_logp"],
                        data["adv"],
                        m,
                        pc.clip,
                        pc.clip_high,
                        pc.dual_clip,
                        pc.ratio,
                        pc.behav_imp_weight_cap,
                    )
                else:
                    loss, clipped = ppo.policy_loss_tokens(
                        out["logprobs"],
                        data["old_logp"],
                        data["adv"],
                        m,
                        pc.clip,
                        pc.clip_high,
                        pc.dual_clip,
                        pc.ratio,
                    )
                if "tis_w" in data:
                    loss = loss * data["tis_w"]
                if kl_loss:
                    loss = loss + coef * ppo.kl_estimate(
                        out["logprobs"], data["ref_logp"], m, est, pc.kl_clamp
                    )
                ent_tok = out["entropy"] * m
                if pc.entropy_coef:
                    loss = loss - pc.entropy_coef * ent_tok
                extra.append((float(clipped.sum()), float(ent_tok.sum().detach()), float(m.sum())))
                return ppo.aggregate(loss, m, pc.loss_agg, n_tok, n_seq, max_len)

            res = engine.train_step(
                loss_fn, batch, micro_batches=pc.micro_batches, with_entropy=not critic, lr=lr
            )
            if reporter:
                ncl, ent, ntk = (sum(x[i] for x in extra) for i in range(3))
                if critic:
                    sums.add("value_clip_frac", ncl, ntk)
                else:
                    sums.add("clip_frac", ncl, ntk)
                    sums.add("entropy", ent, ntk)
                if g.dp_rank == 0:
                    sums.add("value_loss" if critic else "policy_loss", res["loss"], 1)
                    if "aux_loss" in res and not critic:
                        sums.add("moe_aux_loss", res["aux_loss"], 1)
