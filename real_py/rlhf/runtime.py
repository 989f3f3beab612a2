"""SPMD dataflow runtime: every rank walks the graph's global order and runs the calls it is in.

    rt = Runtime(cfg, plan, graph, models)    # collective: groups, models (every rank, same order)
    out = rt.iteration(step)                  # collective: one PPO (or GRPO) iteration

Per call, in the global order, every rank: (1) takes part in the reallocation of the call's
model if it is in the home or the call layout, (2) if in the call's mesh, waits for the rows the
call reads and runs it, (3) posts the pushes of what the call wrote (receivers post irecv at
once, senders isend after the call). Calls on disjoint meshes therefore run at the same time.
At the end of an iteration one world all-reduce sums the metrics and one all_gather_object
collects per-rank call timings. On CUDA (cfg.device) every model lives on cuda:{local_rank}, the
world is NCCL (the launcher inits it, see real_py/device.py) and so are the groups, the
reallocation and the row pushes (device byte buffers); the peak GPU memory of each call
(torch.cuda.max_memory_allocated, reset before its reload / reallocation) is reported as
"peak_mem_mib". With cfg.offload_frozen, a frozen model (ref, reward) is reloaded
from host memory before its call (before waiting for its rows, so the copy overlaps the wait)
and offloaded right after it (after posting its pushes).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter

import torch
import torch.distributed as dist

from ..device import peak_memory_mib, reset_peak_memory, resolve_device
from ..liveness import PeerWatch, Watchdog, start_heartbeat
from ..parallel import ParallelGroups
from . import calls as C
from . import data as D
from . import ppo as P
from .asyncrl import AsyncState, overlap_seconds
from .models import Models
from .observe import METRICS
from .rewards import FunctionReward
from .rows import Pusher, Store, dp_rows, key_schema, push_plan

"""Per iteration: reward, kl (sum over response tokens of log pi_old - log pi_ref) and
response_length are means over sequences; policy_loss / value_loss means over optimizer steps
(each the token mean of its mini-batch); clip fractions and entropy means over response tokens
of every mini-batch pass."""


def make_batch(cfg, step: int, vocab_size: int, data=None) -> dict[str, torch.Tensor]:
    """The iteration's prompts, right-padded, with a sampling seed per row: rows of the prompt
    data set `data` (rlhf.data.PromptData) or, without one, a slice of the seeded synthetic prompt
    set. The grouped algorithms (GRPO, RLOO, REINFORCE++) repeat each prompt group_size times."""
    d, B = cfg.data, cfg.data.batch_size
    repeat = cfg.group_size()
    seeds = cfg.seed * 1_000_003 + step * B + torch.arange(B)
    if data is not None:
        idx = data.batch_indices(step, B, repeat)
        return {"prompts": data.prompts[idx], "prompt_lengths": data.lengths[idx], "seeds": seeds}
    g = torch.Generator().manual_seed(cfg.seed)
    lens = torch.randint(d.min_prompt_len, d.max_prompt_len + 1, (d.num_prompts,), generator=g)
    toks = torch.randint(1, vocab_size, (d.num_prompts, d.max_prompt_len), generator=g)
    toks = toks * (torch.arange(d.max_prompt_len) < lens.unsqueeze(1))
    idx = (step * (B // repeat) + torch.arange(B // repeat)) % d.num_prompts
    idx = idx.repeat_interleave(repeat)
    return {"prompts": toks[idx], "prompt_lengths": lens[idx], "seeds": seeds}


def adaptive_kl(coef: float, kl: float | None, cfg) -> float:
    """The adaptive KL controller of Ziegler et al. 2019 (sec. 2.2): beta <- beta * (1 + K_beta * e),
    e = clip(KL / target - 1, -0.2, 0.2), K_beta = n / horizon with n the samples of the step.
    Unchanged without ppo.kl_target or a KL measurement. Every rank sees the same all-reduced KL,
    so the coefficient stays identical everywhere."""
    pc = cfg.ppo
    if pc.kl_target is None or kl is None or math.isnan(kl):
        return coef
    e = min(max(kl / pc.kl_target - 1.0, -0.2), 0.2)
    return coef * (1.0 + e * cfg.data.batch_size / pc.kl_horizon)


class Runtime:
    def __init__(self, cfg, plan, graph, configs, *, timeout_s: float = 300.0):
        self.cfg, self.plan, self.graph, self.configs = cfg, plan, graph, configs
        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        self.device = resolve_device(cfg.device)
        backend = dist.get_backend()
        if (backend == "nccl") != (self.device.type == "cuda"):
            raise ValueError(f"config device={cfg.device!r} resolves to {self.device}, but the world's "
                             f"backend is {backend}; init the process group with "
                             f"{'nccl' if self.device.type == 'cuda' else 'gloo'}")
        # new_group is collective over the world: every rank builds every call's groups, in order.
        by_layout, self.groups = {}, {}
        moe = any(c.num_experts for c in configs.values())
        if moe and cfg.async_.max_staleness:
            raise ValueError("async RL (async.max_staleness >= 1) with mixture-of-experts models is not "
                             "implemented; use max_staleness: 0")
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
        rule = cfg.reward.kind in ("rule", "function")   # no reward model
        self.models = Models(graph, plan, configs, self.groups, cfg.seed,
                             lrs={"actor": cfg.ppo.actor_lr, "critic": cfg.ppo.critic_lr},
                             max_grad_norm=cfg.ppo.max_grad_norm, adam_eps=cfg.ppo.adam_eps,
                             timeout_s=timeout_s, rule_reward=rule,
                             paths=cfg.model_paths(), verify=cfg.verify_realloc,
                             offload_frozen=cfg.offload_frozen, critic_init=cfg.critic_init,
                             device=self.device, temperature=cfg.generation.temperature)
        # Row pushes watch their peer's heartbeat: a stopped rank is named within seconds.
        store = start_heartbeat()
        self.watch = PeerWatch(store) if store is not None else None
        # Collectives inside a call and at the end of a step cannot be watched op by op: a
        # watchdog names a peer that stops beating meanwhile (and ends this process).
        self.dog = Watchdog(store) if store is not None else None
        self.data = D.load(cfg, configs["actor"].vocab_size)
        self.tokenizer = D.tokenizer(cfg, self.data)
        self.reward_fn = FunctionReward(cfg.reward.path) if cfg.reward.kind == "function" else None
        # Where the reward call appends samples; the driver sets <out_dir>/samples.jsonl.
        self.samples_path: str | None = None
        self.B = cfg.data.batch_size
        # KL coefficient of this step: ppo.kl_coef, adapted after every step when ppo.kl_target is set.
        self.kl_coef = cfg.ppo.kl_coef
        # [sum, sum of squares, count] of every score of the previous steps (reward.normalize).
        self.reward_moments = torch.zeros(3, dtype=torch.float64)
        # Dynamic sampling: the rows a refill round regenerates (None: all); data-set row per batch row.
        self.active_rows: set[int] | None = None
        self.batch_index: torch.Tensor | None = None
        self.T = cfg.data.max_prompt_len + cfg.generation.max_new_tokens
        self.schema = key_schema(cfg.data.max_prompt_len, self.T)
        self.mini_batches = {n: cfg.ppo.mini_batches for n in graph.order if graph.calls[n].trains}
        self.pushes = {n: push_plan(graph, plan, n, self.B, self.mini_batches) for n in graph.order}
        # Async mode (async.max_staleness >= 1): queue, versions, ledger (asyncrl.py).
        ac = cfg.async_
        self.astate = AsyncState(ac.max_staleness, self.B, ac.check_versions) if ac.max_staleness else None
        self.gen_version = 0     # weight version the rollout calls in flight generate with
        self._prefetch = self._prefetch_calls() if self.astate is not None and ac.overlap_realloc else []
        self._prefetched: dict = {}      # call -> engine (or None): weights already moved
        self._start_after: tuple | None = None   # (call, fn): start the receive thread after its realloc
        self._thread = None
        self._used_prefetch: list[str] = []    # calls of this step that ran on moved-ahead weights

    def iteration(self, step: int) -> dict:
        """Run one iteration; returns {"metrics", "calls" (per call: seconds from its last rank's
        start to its last rank's end, or for a call whose ranks never wait for each other (dp-only
        generation and inference, synchronous mode) its longest rank's own run; summed over its
        runs: async prologue batches, refill rounds),
        "realloc_seconds" (per model: summed over its reallocations, each from its last rank's
        start to its last rank's end), "realloc_bytes" (sum over ranks),
        "offload_seconds" (per frozen model: max over ranks of reload + offload seconds; {} without
        offload_frozen), "offload_bytes" (sum over ranks of bytes copied in and out), "data_bytes",
        "peak_mem_mib" (per call: max over ranks of the GPU memory peak, MiB; {} on CPU),
        "events" (rank, call, start, end), "store"} on every rank."""
        if self.astate is not None:
            return self._async_iteration(step)
        store = Store(self.schema, self.B)
        self._write_batch(store, step, list(range(self.B)))
        pusher = Pusher(self.rank, self.timeout_s, self.device, self.batched_pushes, watch=self.watch)
        # One row per metric, plus the sum of squared scores (reward.normalize).
        sums = torch.zeros(len(METRICS) + 1, 2, dtype=torch.float64)
        events, reallocs, offloads, peaks = [], [], [], {}
        pc = self.cfg.ppo
        order = list(enumerate(self.graph.order))
        rollout = [(i, n) for i, n in order if not self.graph.calls[n].trains]
        rounds, dropped = 1, 0
        if pc.dynamic_sampling:
            # DAPO dynamic sampling: rollout calls, then every rank learns every score and the
            # rows of all-equal groups are regenerated from new prompts, up to max_gen_rounds.
            self._run(rollout, step, store, pusher, sums, events, reallocs, offloads, peaks)
            while True:
                zero = P.zero_variance_groups(self._all_scores(store, step), pc.group_size)
                if not bool(zero.any()) or rounds == pc.max_gen_rounds:
                    break
                rows = zero.nonzero().flatten().tolist()
                dropped += len(rows) // pc.group_size
                # New prompts: the batch of a "virtual" step past the run's last one, distinct for
                # every (step, round), so refills do not repeat this run's own batches (before the
                # data set wraps around) and their sampling seeds differ from every real step's.
                virtual = self.cfg.steps + step * (pc.max_gen_rounds - 1) + rounds - 1
                self._write_batch(store, virtual, rows)
                self.active_rows = set(rows)
                try:
                    self._run(rollout, step, store, pusher, sums, events, reallocs, offloads, peaks)
                finally:
                    self.active_rows = None
                rounds += 1
            order = [(i, n) for i, n in order if self.graph.calls[n].trains]
        self._run(order, step, store, pusher, sums, events, reallocs, offloads, peaks)
        out = self._finish(step, sums, pusher, store, (events, reallocs, offloads, peaks))
        if pc.dynamic_sampling:
            out["metrics"]["dropped_groups"] = float(dropped)
            out["metrics"]["gen_rounds"] = float(rounds)
        return out

    def _async_iteration(self, step: int) -> dict:
        """One step of async mode (see asyncrl.py): rollout calls of batch step + k with the
        weights of version `step`, then the train calls of the queued batch `step`."""
        st, k = self.astate, self.astate.k
        st.version = step
        self._used_prefetch = []
        sums = torch.zeros(len(METRICS) + 1, 2, dtype=torch.float64)
        events, reallocs, offloads, peaks = [], [], [], {}
        lists = (events, reallocs, offloads, peaks)
        order = list(enumerate(self.graph.order))
        rollout = [(i, n) for i, n in order if not self.graph.calls[n].trains]
        train = [(i, n) for i, n in order if self.graph.calls[n].trains]
        actor_home = self.models.engines.get("actor")
        st.snapshot(actor_home)
        t_pro = time.time()
        if not st.queue:
            # Prologue (first step or resume): batches step .. step+k-1 with the current weights.
            for b in range(step, min(step + k, self.cfg.steps)):
                store, pusher = self._rollout(b, rollout, sums, lists)
                pusher.finish(store, b)
                st.queue.append((b, store, st.version))
        t_pro = time.time() - t_pro
        new, b = None, step + k
        # Double buffer: version step+1 moves during this step when step+1 generates a batch.
        pre = bool(self._prefetch) and b + 1 < self.cfg.steps
        if pre:
            self._start_after = (self._prefetch[-1], lambda: self._start_prefetch(step))
        if b < self.cfg.steps:
            # The train ranks send the weights and post their receives, then train below while
            # the generation ranks generate; receives complete at pusher.finish.
            new = self._rollout(b, rollout, sums, lists)
        if not st.queue or st.queue[0][0] != step:
            raise RuntimeError(f"rank {self.rank}, step {step}: async queue holds batches "
                               f"{[q[0] for q in st.queue]}, expected batch {step} first")
        _, cur, gen_v = st.queue.popleft()
        tpush = Pusher(self.rank, self.timeout_s, self.device, self.batched_pushes, watch=self.watch)
        self._run(train, step, cur, tpush, sums, *lists)
        self._start_after = None
        if pre:
            self._send_prefetch(step, reallocs, events)
        t_wait = time.time()
        if new is not None:
            new[1].finish(new[0], b)
            st.queue.append((b, new[0], st.version))
        t_wait = time.time() - t_wait
        out = self._finish(step, sums, tpush, cur, lists)
        m = out["metrics"]
        dropped = int(self._last_sums[METRICS.index("rows_dropped_step"), 0])
        st.trained += self.B - dropped
        st.dropped += dropped
        m.update(st.ledger())
        m["rows_dropped"] = float(dropped)
        m["version"] = float(step + 1)
        m["batch_version"] = float(gen_v)
        m["prefetched_calls"] = float(len(self._used_prefetch))
        gen = {n for _, n in rollout}
        trn = {n for _, n in train}
        rea = {"realloc:" + n for _, n in rollout}
        out["async"] = {"prologue_seconds": t_pro, "wait_rows_seconds": t_wait,
                        # seconds in which a rollout call ran while a train call ran (any ranks)
                        "overlap_seconds": overlap_seconds(out["events"], gen, trn),
                        # seconds of rollout-side reallocation during which a rollout call ran
                        # (double buffer: the receive runs under generation; without it only
                        # the senders' wait for completion can overlap generation)
                        "realloc_hidden_seconds": overlap_seconds(out["events"], rea, gen),
                        # wall seconds in which some rank reallocated for a rollout call
                        "realloc_seconds": overlap_seconds(out["events"], rea, rea)}
        return out

    def _prefetch_calls(self) -> list[str]:
        """The actor's rollout calls whose weights can move during generation (double buffer):
        all on ranks disjoint from the actor's train ranks, and no other model reallocated for a
        rollout call (the receive thread would share the reallocation group with it)."""
        home = self.models.home.get("actor")
        if home is None:
            return []
        src = set(self.plan.calls[home].ranks)
        calls = []
        for n in self.graph.order:
            c = self.graph.calls[n]
            h = self.models.home.get(c.model)
            if c.trains or h is None or self.plan.calls[n] == self.plan.calls[h]:
                continue
            if c.model != "actor" or src & set(self.plan.calls[n].ranks):
                return []
            calls.append(n)
        return calls

    def _start_prefetch(self, step: int) -> None:
        """Generation ranks: begin receiving the next version in a thread (during this step's
        generation); the train ranks send it after their train calls."""
        import threading

        dst = set().union(*(self.plan.calls[n].ranks for n in self._prefetch))
        if self.rank not in dst:
            return
        box: dict = {}

        def recv():
            try:
                if self.device.type == "cuda":
                    # The current CUDA device is per thread: this one's must be the rank's.
                    torch.cuda.set_device(self.device)
                for n in self._prefetch:
                    t0 = time.time()
                    eng, stats = self.models.engine_for(n)
                    box[n] = (eng, stats, t0, time.time())
            except BaseException as e:   # re-raised by the main thread at the join
                box["error"] = e
        th = threading.Thread(target=recv, name=f"realloc-prefetch-{step}", daemon=True)
        th.start()
        self._thread = (th, box)

    def _join_prefetch(self, step: int, reallocs, events) -> None:
        th, box = self._thread
        self._thread = None
        th.join(self.timeout_s)
        if th.is_alive():
            raise RuntimeError(f"rank {self.rank}, step {step}: receiving the next actor weights "
                               f"({self._prefetch}) did not finish within {self.timeout_s:.0f} s")
        if "error" in box:
            e = box["error"]
            raise RuntimeError(f"rank {self.rank}, step {step}: receiving the next actor weights: "
                               f"{type(e).__name__}: {e}") from e
        for n in self._prefetch:
            # The receive thread's interval includes waiting for the train step to end: kept as
            # its own event, not as reallocation time (the senders' interval is the transfer).
            eng, stats, t0, t1 = box[n]
            events.append((self.rank, "recv_thread:" + n, t0, t1))
            self._prefetched[n] = eng

    def _send_prefetch(self, step: int, reallocs, events) -> None:
        """Train ranks: send the new version to the generation layout (after the train calls)."""
        home_ranks = set(self.plan.calls[self.models.home["actor"]].ranks)
        for n in self._prefetch:
            if self.rank in home_ranks:
                t0 = time.time()
                try:
                    _, stats = self.models.engine_for(n)
                except Exception as e:
                    raise RuntimeError(f"rank {self.rank}, step {step}: sending the next actor "
                                       f"weights for {n}: {type(e).__name__}: {e}") from e
                reallocs.append(("actor", n, stats["start"], stats["end"], stats["sent_bytes"]))
                events.append((self.rank, "realloc:" + n, t0, time.time()))
            self._prefetched[n] = None
        if self._thread is not None:
            self._join_prefetch(step, reallocs, events)

    def _rollout(self, b: int, rollout, sums, lists):
        """Run the rollout calls of batch b into a fresh Store with the current actor version;
        returns (store, pusher) with the pushes still in flight."""
        store = Store(self.schema, self.B)
        self._write_batch(store, b, list(range(self.B)))
        pusher = Pusher(self.rank, self.timeout_s, self.device, self.batched_pushes, watch=self.watch)
        self.gen_version = self.astate.version
        self._run(rollout, b, store, pusher, sums, *lists)
        self.astate.generated += self.B
        return store, pusher

    def _finish(self, step, sums, pusher, store, lists) -> dict:
        """End of a step (sync or async): pushes done, metrics all-reduced, summary, reward
        moments and the adaptive KL coefficient updated."""
        events, reallocs, offloads, peaks = lists
        try:
            with self._watched(f"rank {self.rank}, step {step}, end of iteration",
                               range(dist.get_world_size())):
                pusher.finish(store, step)
                sums = sums.to(self.device)
                dist.all_reduce(sums)
                sums = sums.cpu()
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, (events, reallocs, offloads, pusher.bytes_sent, peaks))
        except Exception as e:
            raise RuntimeError(f"rank {self.rank}, step {step}, end of iteration: "
                               f"{type(e).__name__}: {e}") from e
        out = self._summary(sums, gathered, store)
        r = METRICS.index("reward")
        self.reward_moments += torch.tensor([sums[r, 0], sums[len(METRICS), 0], sums[r, 1]],
                                            dtype=torch.float64)
        if self.cfg.ppo.kl_target is not None:
            out["metrics"]["kl_coef"] = self.kl_coef
        self.kl_coef = adaptive_kl(self.kl_coef, out["metrics"].get("kl"), self.cfg)
        out["metrics"].pop("rows_dropped_step", None)
        self._last_sums = sums
        return out

    def _write_batch(self, store, step: int, rows: list[int]) -> None:
        """Inputs (prompts, prompt_lengths, seeds) of `rows` from make_batch(step), and their data
        set rows in self.batch_index (every rank holds every input row)."""
        batch = make_batch(self.cfg, step, self.configs["actor"].vocab_size, self.data)
        for k, v in batch.items():
            store.write(k, rows, v[rows])
        if self.data is not None:
            idx = self.data.batch_indices(step, self.B, self.cfg.group_size())
            if self.batch_index is None or len(rows) == self.B:
                self.batch_index = idx.clone()
            else:
                self.batch_index[rows] = idx[rows]

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
            raise RuntimeError(f"rank {self.rank}, step {step}, dynamic sampling: gathering scores: "
                               f"{type(e).__name__}: {e}") from e
        if not bool((buf[1] == 1).all()):
            raise RuntimeError(f"rank {self.rank}, step {step}: dynamic sampling got "
                               f"{int((buf[1] != 1).sum())} rows without exactly one score")
        return buf[0].float()

    def _run(self, calls, step, store, pusher, sums, events, reallocs, offloads, peaks) -> None:
        for i, name in calls:
            try:
                reset_peak_memory(self.device)
                with self._watched(f"rank {self.rank}, step {step}, call {name}",
                                   self.plan.calls[name].ranks):
                    self._call(i, name, store, pusher, sums, events, reallocs, offloads, step)
                if self.device.type == "cuda":
                    peaks[name] = peak_memory_mib(self.device)
            except Exception as e:
                raise RuntimeError(f"rank {self.rank}, step {step}, call {name}: "
                                   f"{type(e).__name__}: {e}") from e

    def _watched(self, what: str, peers):
        return self.dog.section(what, peers) if self.dog is not None else contextlib.nullcontext()

    def _call(self, i, name, store, pusher, sums, events, reallocs, offloads, step) -> None:
        call = self.graph.calls[name]
        offloaded = call.model in self.models.offloads
        if offloaded:
            in_bytes, in_sec = self.models.reload(call.model)
        t_r = time.time()
        if name in self._prefetched:     # async double buffer: moved during the previous step
            engine, rstats = self._prefetched.pop(name), None
            self._used_prefetch.append(name)
        else:
            engine, rstats = self.models.engine_for(name)
        if self._start_after is not None and self._start_after[0] == name:
            fn, self._start_after = self._start_after[1], None
            fn()
        if rstats is not None:
            reallocs.append((call.model, name, rstats["start"], rstats["end"], rstats["sent_bytes"]))
            if self.astate is not None:   # async mode: reallocation intervals, for the overlap
                events.append((self.rank, "realloc:" + name, t_r, time.time()))
        g = self.groups[name]
        pusher.post(store, self.pushes[name], i + 1, name, sending=False)
        if g.member:
            pusher.wait_for(store, call.reads, step)
            t0 = time.time()
            worked = C.run_call(self, call, g, engine, store, sums, step)
            t1 = time.time()
            # A run with no rows of this rank leaves a zero-length marker: it counts the run
            # (runs are matched across ranks by their order) but does not open its span.
            events.append((self.rank, name, t0 if worked else t1, t1))
        # Every rank (senders are members; on NCCL the held receives go out here too).
        pusher.post(store, self.pushes[name], i + 1, name, sending=True)
        if offloaded:
            out_bytes, out_sec = self.models.offload(call.model)
            offloads.append((call.model, in_sec + out_sec, in_bytes + out_bytes))
        # A reallocated engine is dropped on return; home engines stay in self.models.

    def _summary(self, sums, gathered, store) -> dict:
        metrics = {m: (s / c if c else float("nan")) for m, (s, c) in zip(METRICS, sums.tolist()) if c}
        events, spans, r_spans, own = [], {}, {}, {}
        r_bytes, o_sec, o_bytes, d_bytes, peak = 0, {}, 0, 0, {}
        for ev, rl, ol, pushed, pk in gathered:
            events += ev
            for name, mib in pk.items():
                peak[name] = max(peak.get(name, 0.0), mib)
            # The k-th run of a call on this rank (a refill round runs it again), and the k-th
            # reallocation of a model for a call: the same run on every rank that takes part.
            seen = Counter()
            for _, name, a, b in ev:
                if b > a:   # not a rank's marker of a run it had no rows for
                    _span(spans, (name, seen[name]), a, b)
                    own[name, seen[name]] = max(own.get((name, seen[name]), 0.0), b - a)
                seen[name] += 1
            for model, call, a, b, nbytes in rl:
                _span(r_spans, (model, call, seen[model, call]), a, b)
                seen[model, call] += 1
                r_bytes += nbytes
            for model, sec, nbytes in ol:
                o_sec[model] = max(o_sec.get(model, 0.0), sec)
                o_bytes += nbytes
            d_bytes += pushed
        # A call's (a reallocation's) seconds run from the moment its last rank enters it to the
        # moment its last rank leaves, summed over its runs: a rank that arrives late from earlier
        # work (rank 0 writing the previous step's logs) is not charged to the call its peers
        # wait in. Wall clocks of the ranks are compared, as for the async overlap figures.
        # A call whose ranks never wait for each other (_sync_free_calls) has no such wait to
        # leave out: its seconds are its longest rank's own run. (From the last rank's start, a
        # dp-only generation whose ranks entered up to 29 ms apart on 2 shared cores counted
        # 16-39 ms of runs of 35-49 ms: bench/results/trace_cpu2_20261204_session4/.)
        calls, r_sec = {}, {}
        free = _sync_free_calls(self.graph, self.plan) if self.astate is None else set()
        for (name, k), (a, b) in spans.items():
            calls[name] = calls.get(name, 0.0) + (own[name, k] if name in free else max(b - a, 0.0))
        for (model, _, _), (a, b) in r_spans.items():
            r_sec[model] = r_sec.get(model, 0.0) + max(b - a, 0.0)
        calls = {n: calls[n] for n in self.graph.order if n in calls}
        return {"metrics": metrics, "calls": calls, "realloc_seconds": r_sec,
                "realloc_bytes": r_bytes, "offload_seconds": o_sec, "offload_bytes": o_bytes,
                "data_bytes": d_bytes, "peak_mem_mib": {n: peak[n] for n in self.graph.order if n in peak},
                "events": events, "store": store}


def _sync_free_calls(graph, plan) -> set[str]:
    """Calls whose ranks never wait for each other while they run: rollout calls (generation,
    inference) on dp replicas alone (tp = pp = 1 and no expert group across replicas, ep = etp =
    1: no collective inside the call; each rank runs its own rows). Synchronous mode only: in
    async mode a generation's rank may wait for the next weights' receive thread (the trainer
    ranks) inside the call."""
    out = set()
    for n in graph.order:
        lay = plan.calls[n]
        if not graph.calls[n].trains and lay.tp == lay.pp == lay.ep == lay.etp == 1:
            out.add(n)
    return out


def _span(spans: dict, key, start: float, end: float) -> None:
    """Widen spans[key] to (latest start, latest end) over the ranks."""
    a, b = spans.get(key, (start, end))
    spans[key] = (max(a, start), max(b, end))


__all__ = ["Runtime", "make_batch", "adaptive_kl"]
