"""SPMD dataflow runtime: every rank walks the graph's global order and runs the calls it is in.

    rt = Runtime(cfg, plan, graph, models)    # collective: groups, models (every rank, same order)
    out = rt.iteration(step)                  # collective: one PPO (or GRPO) iteration

Per call, in the global order, every rank: (1) takes part in the reallocation of the call's
model if it is in the home or the call layout, (2) if in the call's mesh, waits for the rows the
call reads and runs it (calls.run_call, with the rank's context.CallContext), (3) posts the
pushes of what the call wrote (receivers post irecv at once, senders isend after the call).
Calls on disjoint meshes therefore run at the same time. At the end of an iteration one world
all-reduce sums the metrics (observe.MetricSums) and one all_gather_object collects every rank's
observe.StepRecord, which observe.step_summary turns into the step's timings. On CUDA
(cfg.device) every model lives on cuda:{local_rank}, the world is NCCL (the launcher inits it,
see real_py/device.py) and so are the groups, the reallocation and the row pushes (device byte
buffers); the peak GPU memory of each call (torch.cuda.max_memory_allocated, reset before its
reload / reallocation) is reported as "peak_mem_mib". With cfg.offload_frozen, a frozen model
(ref, reward) is reloaded from host memory before its call (before waiting for its rows, so the
copy overlaps the wait) and offloaded right after it (after posting its pushes).

One file past 400 lines: nearly all of it is Runtime, whose per-call steps (reallocation, waiting
for rows, run_call, pushes, offload) and sync, async and dynamic-sampling iterations share its
groups, Models, row pushes, CallContext and watchdog.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist

from ..device import peak_memory_mib, reset_peak_memory, resolve_device
from ..liveness import PeerWatch, Watchdog, start_heartbeat, user_code
from ..parallel import ParallelGroups
from .asyncrl import AsyncState, Prefetch, async_report, prefetch_calls
from .calls import run_call
from .config.schema import PPOConfig
from .context import CallContext
from .data import load as load_prompts
from .data import make_batch
from .data import tokenizer as data_tokenizer
from .models import Models
from .observe import Event, MetricSums, Offload, Realloc, StepRecord, step_summary, sync_free_calls
from .ppo import zero_variance_groups
from .rewards import FunctionReward
from .rows import Pusher, Store, dp_rows, key_schema, push_plan


def adaptive_kl(coef: float, kl: float | None, pc: PPOConfig, batch_size: int) -> float:
    """The adaptive KL controller of Ziegler et al. 2019 (sec. 2.2):
    beta <- beta * (1 + K_beta * e), e = clip(KL / target - 1, -0.2, 0.2), K_beta = n / horizon
    with n the samples of the step. Unchanged without ppo.kl_target or a KL measurement. Every rank
    sees the same all-reduced KL, so the coefficient stays identical everywhere."""
    if pc.kl_target is None or kl is None or math.isnan(kl):
        return coef
    e = min(max(kl / pc.kl_target - 1.0, -0.2), 0.2)
    return coef * (1.0 + e * batch_size / pc.kl_horizon)


def _context_field(name: str) -> property:
    """A Runtime attribute held in its CallContext (checkpoint.save / load and the driver use
    these)."""
    return property(
        lambda self: getattr(self.ctx, name), lambda self, v: setattr(self.ctx, name, v)
    )


class Runtime:
    kl_coef = _context_field("kl_coef")
    reward_moments = _context_field("reward_moments")
    samples_path = _context_field("samples_path")  # the driver sets <out_dir>/samples.jsonl
    astate = _context_field("astate")

    def __init__(self, cfg, plan, graph, configs, *, timeout_s: float = 300.0):
        self.cfg, self.plan, self.graph, self.configs = cfg, plan, graph, configs
        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        self.device = resolve_device(cfg.device)
        backend = dist.get_backend()
        if (backend == "nccl") != (self.device.type == "cuda"):
            raise ValueError(
                f"config device={cfg.device!r} resolves to {self.device}, but the world's "
                f"backend is {backend}; init the process group with "
                f"{'nccl' if self.device.type == 'cuda' else 'gloo'}"
            )
        # new_group is collective over the world: every rank builds every call's groups, in order.
        by_layout, self.groups = {}, {}
        moe = any(c.num_experts for c in configs.values())
        ac = cfg.async_
        if moe and ac.max_staleness:
            raise ValueError(
                "async RL (async.max_staleness >= 1) with mixture-of-experts models is not "
                "implemented; use max_staleness: 0"
            )
        for n in graph.order:
            layout = plan.calls[n]
            if layout not in by_layout:
                # MoE: expert-dp and layout groups for the experts' gradients and the aux loss
                by_layout[layout] = ParallelGroups(layout, timeout_s=timeout_s, moe=moe)
            self.groups[n] = by_layout[layout]
        if self.device.type == "cuda":
            # NCCL builds a communicator on its first collective, which every rank must join:
            # do it here, not in the first (partial) batch of row pushes.
            dist.all_reduce(torch.zeros(1, device=self.device))
        # Row pushes as one batch_isend_irecv per call (see rows.Pusher): required by NCCL.
        self.batched_pushes = self.device.type == "cuda"
        pc = cfg.ppo
        self.models = Models(
            graph,
            plan,
            configs,
            self.groups,
            cfg.seed,
            lrs={"actor": pc.actor_lr, "critic": pc.critic_lr},
            max_grad_norm=pc.max_grad_norm,
            adam_eps=pc.adam_eps,
            timeout_s=timeout_s,
            rule_reward=cfg.reward.kind in ("rule", "function"),
            paths=cfg.model_paths(),
            verify=cfg.verify_realloc,
            offload_frozen=cfg.offload_frozen,
            critic_init=cfg.critic_init,
            device=self.device,
            temperature=cfg.generation.temperature,
            rollout_call=self._vllm_call(graph),
        )
        if self.models.rollout_call is not None:
            self.models.attach_rollout(self._start_vllm(cfg, plan, configs["actor"]))
        # Row pushes watch their peer's heartbeat: a stopped rank is named within seconds.
        store = start_heartbeat()
        self.watch = PeerWatch(store) if store is not None else None
        # Collectives inside a call and at the end of a step cannot be watched op by op: a
        # watchdog names a peer that stops beating meanwhile (and ends this process).
        self.dog = Watchdog(store) if store is not None else None
        with user_code(f"loading the data set {cfg.data.path}"):
            prompts = load_prompts(cfg, configs["actor"].vocab_size)
        self.B, self.T = (
            cfg.data.batch_size,
            cfg.data.max_prompt_len + cfg.generation.max_new_tokens,
        )
        self.schema = key_schema(cfg.data.max_prompt_len, self.T)
        self.mini_batches = {n: pc.mini_batches for n in graph.order if graph.calls[n].trains}
        self.pushes = {n: push_plan(graph, plan, n, self.B, self.mini_batches) for n in graph.order}
        self.order = list(enumerate(graph.order))
        self.rollout = [(i, n) for i, n in self.order if not graph.calls[n].trains]
        self.train = [(i, n) for i, n in self.order if graph.calls[n].trains]
        # Async mode (async.max_staleness >= 1): queue, versions, ledger, double buffer
        # (asyncrl.py).
        astate = (
            AsyncState(ac.max_staleness, self.B, ac.check_versions) if ac.max_staleness else None
        )
        pre = (
            prefetch_calls(graph, plan, self.models.home)
            if astate is not None and ac.overlap_realloc
            else []
        )
        self.prefetch = (
            Prefetch(
                pre, self.models, plan, rank=self.rank, device=self.device, timeout_s=timeout_s
            )
            if pre
            else None
        )
        self.sync_free = sync_free_calls(graph, plan) if astate is None else set()
        self.ctx = CallContext(
            rank=self.rank,
            device=self.device,
            algo=cfg.algo,
            steps=cfg.steps,
            B=self.B,
            T=self.T,
            mini_batches=self.mini_batches,
            data=cfg.data,
            generation=cfg.generation,
            ppo=pc,
            reward=cfg.reward,
            async_=ac,
            models=self.models,
            prompts=prompts,
            tokenizer=data_tokenizer(cfg, prompts),
            reward_fn=FunctionReward(cfg.reward.path) if cfg.reward.kind == "function" else None,
            astate=astate,
            prefetch=self.prefetch,
            kl_coef=pc.kl_coef,
            reward_moments=torch.zeros(3, dtype=torch.float64),
        )

    def close(self) -> None:
        """End vLLM generation, if any (VLLMRollout.close: it ends torch.distributed's default
        group too, so this comes last); nothing else needs closing."""
        if self.models.rollout is not None:
            self.models.rollout.close()

    def _vllm_call(self, graph) -> str | None:
        """The actor's sampling call when vLLM runs it (generation.engine: vllm), else None."""
        if self.cfg.generation.engine != "vllm":
            return None
        return next(n for n in graph.order if graph.calls[n].kind == "generate")

    def _start_vllm(self, cfg, plan, actor):
        """vLLM inside every rank (collective: each rank builds its worker, vLLM cuts its groups
        from the world). A start failure names the rank and vLLM's reason before step 1."""
        from ..vllm.rollout import VLLMRollout

        gc = cfg.generation
        return VLLMRollout(
            actor,
            plan.calls[self.models.rollout_call],
            max_model_len=cfg.data.max_prompt_len + gc.max_new_tokens,
            seed=cfg.seed,
            source=cfg.actor_path,
            kv_cache_gib=gc.vllm_kv_cache_gib,
            gpu_memory_utilization=gc.vllm_gpu_memory_utilization,
        )

    def iteration(self, step: int) -> dict:
        """Run one iteration; returns, on every rank, {"metrics" (means, see observe.METRICS),
        the step's timings and volumes (see observe.step_summary), "store" (this rank's rows)},
        plus "async" in async mode."""
        if self.astate is not None:
            return self._async_iteration(step)
        store, pusher = self._new_batch(step), self._pusher()
        sums, rec = MetricSums(), StepRecord()
        order, dynamic = self.order, self.cfg.ppo.dynamic_sampling
        if dynamic:
            # DAPO dynamic sampling: the rollout calls, refilled until no group is all-equal.
            rounds, dropped = self._sample_dynamically(step, store, pusher, sums, rec)
            order = self.train
        self._run(order, step, store, pusher, sums, rec)
        out = self._finish(step, sums, pusher, store, rec)
        if dynamic:
            out["metrics"]["dropped_groups"] = float(dropped)
            out["metrics"]["gen_rounds"] = float(rounds)
        return out

    def _sample_dynamically(self, step, store, pusher, sums, rec) -> tuple[int, int]:
        """Rollout calls, then every rank learns every score and the rows of all-equal groups are
        regenerated from new prompts, up to ppo.max_gen_rounds rounds; returns (rounds, groups
        dropped)."""
        pc = self.cfg.ppo
        self._run(self.rollout, step, store, pusher, sums, rec)
        rounds, dropped = 1, 0
        while True:
            zero = zero_variance_groups(self._all_scores(store, step), pc.group_size)
            if not bool(zero.any()) or rounds == pc.max_gen_rounds:
                return rounds, dropped
            rows = zero.nonzero().flatten().tolist()
            dropped += len(rows) // pc.group_size
            # New prompts: the batch of a "virtual" step past the run's last one, distinct for
            # every (step, round), so refills do not repeat this run's own batches (before the
            # data set wraps around) and their sampling seeds differ from every real step's.
            self._write_batch(
                store, self.cfg.steps + step * (pc.max_gen_rounds - 1) + rounds - 1, rows
            )
            self.ctx.active_rows = set(rows)
            try:
                self._run(self.rollout, step, store, pusher, sums, rec)
            finally:
                self.ctx.active_rows = None
            rounds += 1

    def _async_iteration(self, step: int) -> dict:
        """One step of async mode (see asyncrl.py): rollout calls of batch step + k with the
        weights of version `step`, then the train calls of the queued batch `step`."""
        st, k, pf = self.astate, self.astate.k, self.prefetch
        st.version = step
        if pf is not None:
            pf.used = []
        sums, rec = MetricSums(), StepRecord()
        st.snapshot(self.models.engines.get("actor"))
        t_pro = time.time()
        if not st.queue:
            # Prologue (first step or resume): batches step .. step+k-1 with the current weights.
            for b in range(step, min(step + k, self.cfg.steps)):
                store, pusher = self._rollout(b, sums, rec)
                pusher.finish(store, b)
                st.queue.append((b, store, st.version))
        t_pro = time.time() - t_pro
        new, b = None, step + k
        # Double buffer: version step+1 moves during this step when step+1 generates a batch.
        pre = pf is not None and b + 1 < self.cfg.steps
        if pre:
            pf.armed = step
        if b < self.cfg.steps:
            # The train ranks send the weights and post their receives, then train below while
            # the generation ranks generate; receives complete at pusher.finish.
            new = self._rollout(b, sums, rec)
        if not st.queue or st.queue[0][0] != step:
            raise RuntimeError(
                f"rank {self.rank}, step {step}: async queue holds batches "
                f"{[q[0] for q in st.queue]}, expected batch {step} first"
            )
        _, cur, gen_v = st.queue.popleft()
        tpush = self._pusher()
        self._run(self.train, step, cur, tpush, sums, rec)
        if pre:
            pf.send(step, rec)
        t_wait = time.time()
        if new is not None:
            new[1].finish(new[0], b)
            st.queue.append((b, new[0], st.version))
        t_wait = time.time() - t_wait
        out = self._finish(step, sums, tpush, cur, rec)
        dropped = int(sums.total("rows_dropped_step"))
        st.trained += self.B - dropped
        st.dropped += dropped
        out["metrics"].update(
            st.ledger(),
            rows_dropped=float(dropped),
            version=float(step + 1),
            batch_version=float(gen_v),
            prefetched_calls=float(len(pf.used) if pf is not None else 0),
        )
        out["async"] = async_report(
            out["events"], {n for _, n in self.rollout}, {n for _, n in self.train}, t_pro, t_wait
        )
        return out

    def _rollout(self, b: int, sums, rec) -> tuple[Store, Pusher]:
        """Run the rollout calls of batch b into a fresh Store with the current actor version;
        returns (store, pusher) with the pushes still in flight."""
        store, pusher = self._new_batch(b), self._pusher()
        self.ctx.gen_version = self.astate.version
        self._run(self.rollout, b, store, pusher, sums, rec)
        self.astate.generated += self.B
        return store, pusher

    def _pusher(self) -> Pusher:
        return Pusher(self.rank, self.timeout_s, self.device, self.batched_pushes, watch=self.watch)

    def _new_batch(self, step: int) -> Store:
        store = Store(self.schema, self.B)
        self._write_batch(store, step, list(range(self.B)))
        return store

    def _write_batch(self, store, step: int, rows: list[int]) -> None:
        """Inputs (prompts, prompt_lengths, seeds) of `rows` from make_batch(step), and their data
        set rows in ctx.batch_index (every rank holds every input row)."""
        ctx, repeat = self.ctx, self.cfg.group_size()
        batch = make_batch(
            self.cfg.data,
            step,
            self.configs["actor"].vocab_size,
            ctx.prompts,
            seed=self.cfg.seed,
            repeat=repeat,
        )
        for k, v in batch.items():
            store.write(k, rows, v[rows])
        if ctx.prompts is not None:
            idx = ctx.prompts.batch_indices(step, self.B, repeat)
            if ctx.batch_index is None or len(rows) == self.B:
                ctx.batch_index = idx.clone()
            else:
                ctx.batch_index[rows] = idx[rows]

    def _finish(self, step, sums: MetricSums, pusher, store, rec: StepRecord) -> dict:
        """End of a step: pushes done, `sums` all-reduced, every rank's record gathered and
        summarised, reward moments and the adaptive KL coefficient updated."""
        world, ctx = dist.get_world_size(), self.ctx
        try:
            with self._watched(f"rank {self.rank}, step {step}, end of iteration", range(world)):
                pusher.finish(store, step)
                t = sums.t.to(self.device)
                dist.all_reduce(t)
                sums.t = t.cpu()
                rec.data_bytes = pusher.bytes_sent
                records = [None] * world
                dist.all_gather_object(records, rec)
        except Exception as e:
            raise RuntimeError(
                f"rank {self.rank}, step {step}, end of iteration: {type(e).__name__}: {e}"
            ) from e
        out = {
            "metrics": sums.means(),
            **step_summary(records, self.graph.order, self.sync_free),
            "store": store,
        }
        ctx.reward_moments += sums.reward_moments()
        if self.cfg.ppo.kl_target is not None:
            out["metrics"]["kl_coef"] = ctx.kl_coef
        ctx.kl_coef = adaptive_kl(ctx.kl_coef, out["metrics"].get("kl"), self.cfg.ppo, self.B)
        out["metrics"].pop("rows_dropped_step", None)
        return out

    def _all_scores(self, store, step: int) -> torch.Tensor:
        """[B] scores on every rank: the reward call's reporters (TP rank 0 of the last stage of
        each DP replica) contribute their rows to one world all-reduce."""
        name = self.graph.producer("scores")
        g, layout = self.groups[name], self.plan.calls[name]
        buf = torch.zeros(2, self.B, dtype=torch.float64)
        if g.member and g.tp_rank == 0 and g.is_last_stage:
            rows = dp_rows(layout, g.dp_rank, self.B)
            buf[0, rows] = store.rows("scores", rows).double()
            buf[1, rows] = 1.0
        try:
            buf = buf.to(self.device)
            dist.all_reduce(buf)
            buf = buf.cpu()
        except Exception as e:
            raise RuntimeError(
                f"rank {self.rank}, step {step}, dynamic sampling: gathering scores: "
                f"{type(e).__name__}: {e}"
            ) from e
        if not bool((buf[1] == 1).all()):
            raise RuntimeError(
                f"rank {self.rank}, step {step}: dynamic sampling got "
                f"{int((buf[1] != 1).sum())} rows without exactly one score"
            )
        return buf[0].float()

    def _run(self, calls, step, store, pusher, sums, rec) -> None:
        for i, name in calls:
            try:
                reset_peak_memory(self.device)
                with self._watched(
                    f"rank {self.rank}, step {step}, call {name}", self.plan.calls[name].ranks
                ):
                    self._call(i, name, step, store, pusher, sums, rec)
                if self.device.type == "cuda":
                    rec.peak_mem_mib[name] = peak_memory_mib(self.device)
            except Exception as e:
                raise RuntimeError(
                    f"rank {self.rank}, step {step}, call {name}: {type(e).__name__}: {e}"
                ) from e

    def _watched(self, what: str, peers):
        return self.dog.section(what, peers) if self.dog is not None else contextlib.nullcontext()

    def _call(self, i, name, step, store, pusher, sums, rec: StepRecord) -> None:
        call = self.graph.calls[name]
        offloaded = call.model in self.models.offloads
        if offloaded:
            in_bytes, in_sec = self.models.reload(call.model)
        t_r = time.time()
        # Async double buffer: the weights may have moved during the previous step.
        engine, rstats = (self.prefetch if self.prefetch is not None else self.models).engine_for(
            name
        )
        if rstats is not None:
            rec.reallocs.append(
                Realloc(call.model, name, rstats["start"], rstats["end"], rstats["sent_bytes"])
            )
            if self.astate is not None:  # async mode: reallocation intervals, for the overlap
                rec.events.append(Event(self.rank, "realloc:" + name, t_r, time.time()))
        g = self.groups[name]
        pusher.post(store, self.pushes[name], i + 1, name, sending=False)
        if g.member:
            pusher.wait_for(store, call.reads, step)
            t0 = time.time()
            worked = run_call(self.ctx, call, g, engine, store, sums, step)
            t1 = time.time()
            # A run with no rows of this rank leaves a zero-length marker: it counts the run
            # (runs are matched across ranks by their order) but does not open its span.
            rec.events.append(Event(self.rank, name, t0 if worked else t1, t1))
        # Every rank (senders are members; on NCCL the held receives go out here too).
        pusher.post(store, self.pushes[name], i + 1, name, sending=True)
        if offloaded:
            out_bytes, out_sec = self.models.offload(call.model)
            rec.offloads.append(Offload(call.model, in_sec + out_sec, in_bytes + out_bytes))
        # A reallocated engine is dropped on return; home engines stay in self.models.


__all__ = ["Runtime", "make_batch", "adaptive_kl"]
