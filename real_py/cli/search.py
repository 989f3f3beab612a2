"""`python -m real_py search`: search a PPO execution plan, compare with baselines, draw it."""

from __future__ import annotations

import json

from ..dataflow.graph import ALGORITHMS, GROUPED
from ..search import Workload, plan_search
from ..search.hardware import PROFILE_NAMES
from ..spec import PRESETS
from .common import model_config


def add_parser(sub):
    p = sub.add_parser("search", help="search a PPO execution plan with the runtime estimator")
    p.add_argument(
        "--model",
        default="llama2-7b",
        help=f"actor preset ({', '.join(PRESETS)}) or a path to an HF config.json / checkpoint dir",
    )
    p.add_argument(
        "--critic",
        default=None,
        help="critic / reward model preset or HF config path (default: same as --model)",
    )
    p.add_argument(
        "--algo",
        default="ppo",
        choices=sorted(ALGORITHMS),
        help="the dataflow graph to place: ppo (actor, critic, reference, reward) or a critic-free "
        "algorithm (no critic calls; remax adds the greedy baseline generation)",
    )
    p.add_argument("--gpus", type=int, required=True, help="number of devices")
    p.add_argument(
        "--hardware",
        default="h100",
        help=f"profile: {', '.join(PROFILE_NAMES)} "
        "(cpu: calibrated on this machine on first use, then cached)",
    )
    p.add_argument("--batch-size", type=int, default=512, help="prompts per iteration")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=384)
    p.add_argument("--ppo-minibatches", type=int, default=4, help="optimizer steps per PPO epoch")
    p.add_argument("--ppo-epochs", type=int, default=1, help="passes over the batch per train call")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="ppo.micro_batches: micro-batches per train mini-batch (every mini-batch of every DP "
        "rank must hold at least this many rows); the estimate runs that many",
    )
    p.add_argument(
        "--free-micro-batches",
        action="store_true",
        help="let each pass take its cheapest micro-batch count (from 16384 tokens per micro-batch "
        "up to 4 x pp, as ReaL's runtime does) instead of real_py's own counts (--micro-batches "
        "per train mini-batch, forward-only passes whole): estimates for another runtime",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="ppo.group_size of a grouped algorithm: DP-local actor mini-batches hold whole groups",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--time-budget", type=float, default=30.0, help="seconds for the whole search")
    p.add_argument("--chains", type=int, default=4)
    p.add_argument(
        "--per-mesh",
        type=int,
        default=None,
        help="prune to the K fastest strategies per (call, mesh); "
        "default: every memory-feasible one",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="async RL bound the run allows (async.max_staleness); the search scores plans in "
        "async mode and says whether running asynchronously pays (default 0: synchronous)",
    )
    p.add_argument(
        "--engine",
        default="builtin",
        choices=("builtin", "vllm"),
        help="generation.engine of the run: vllm places the actor's sampling call only on layouts "
        "vLLM can run (every rank, tp fastest, pp 1) and adds the recompute call actor_logp",
    )
    p.add_argument(
        "--vllm-logp",
        default="recompute",
        choices=("recompute", "rollout"),
        help="generation.vllm_logp of the run (with --engine vllm): rollout takes vLLM's "
        "log-probs as old_logp, so the plan has no recompute call actor_logp",
    )
    p.add_argument("--out", help="write the ExecutionPlan JSON here")
    p.add_argument("--plot", help="write a timeline PNG here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _fmt(layouts):
    if not layouts:
        return "infeasible"
    return ", ".join(
        f"{n}=dp{k[1]}tp{k[2]}pp{k[3]}@{k[0].start}+{k[0].size}" for n, k in layouts.items()
    )


def run(args) -> int:
    if args.gpus < 1:
        raise ValueError(f"--gpus={args.gpus} must be >= 1")
    for flag, v in (
        ("--time-budget", args.time_budget),
        ("--batch-size", args.batch_size),
        ("--prompt-len", args.prompt_len),
        ("--gen-len", args.gen_len),
        ("--ppo-minibatches", args.ppo_minibatches),
        ("--ppo-epochs", args.ppo_epochs),
        ("--micro-batches", args.micro_batches),
        ("--group-size", args.group_size),
        ("--chains", args.chains),
    ):
        if not v > 0:
            raise ValueError(f"{flag}={v} must be > 0")
    # Presets go by name (the plan names its models after them); an HF config becomes a ModelConfig.
    actor = args.model if args.model in PRESETS else model_config(args.model, "--model")
    critic = (
        args.critic
        if args.critic is None or args.critic in PRESETS
        else model_config(args.critic, "--critic")
    )
    wl = Workload(
        batch_size=args.batch_size,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        ppo_minibatches=args.ppo_minibatches,
        ppo_epochs=args.ppo_epochs,
        micro_batches=args.micro_batches,
        group_size=args.group_size,
        runtime_micro_batches=not args.free_micro_batches,
    )
    if args.vllm_logp != "recompute" and args.engine != "vllm":
        raise ValueError(
            f"--vllm-logp {args.vllm_logp} needs --engine vllm (the built-in engine's log-probs "
            "are the trainer's own)"
        )
    if args.max_staleness < 0:
        raise ValueError(f"--max-staleness={args.max_staleness} must be >= 0 (0: synchronous)")
    if args.per_mesh is not None and args.per_mesh < 1:
        raise ValueError(f"--per-mesh must be >= 1, got {args.per_mesh}")
    from ..calibrate import resolve_profile  # `cpu` is measured on this machine (first use; cached)

    hw = resolve_profile(args.hardware)
    res = plan_search(
        actor,
        critic,
        num_gpus=args.gpus,
        hardware=hw,
        workload=wl,
        per_mesh=args.per_mesh,
        time_budget=args.time_budget,
        chains=args.chains,
        seed=args.seed,
        dtype=args.dtype,
        algo=args.algo,
        max_staleness=args.max_staleness,
        engine=args.engine,
        vllm_logp=args.vllm_logp,
    )
    sim = res.simulate()
    if args.out:
        res.plan.save(args.out)
    if args.plot:
        from ..search.plot import plot_timeline

        second = "critic" if args.algo == "ppo" else "reward model"
        title = (
            f"{args.algo}: {args.model} actor + {args.critic or args.model} {second}, "
            f"{args.gpus} x {args.hardware}, "
            f"gen {args.gen_len}{f', async k={res.staleness}' if res.staleness else ''}: "
            f"{res.iter_time:.2f} s/iter (symmetric "
            f"{res.baselines['symmetric'].iter_time:.2f}, "
            f"heuristic {res.baselines['heuristic'].iter_time:.2f})"
        )
        plot_timeline(sim.events, args.gpus, args.plot, title)
    out = {
        "iter_time_s": res.iter_time,
        "max_staleness": res.staleness,
        "plan": res.plan.to_json(),
        "baselines": {
            k: {"iter_time_s": b.iter_time, "layouts": _fmt(b.layouts)}
            for k, b in res.baselines.items()
        },
        "stats": res.stats,
    }
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return 0
    print(f"searched plan: {res.iter_time:.3f} s/iteration (estimated, {args.hardware})")
    idle = list(res.plan.idle_ranks)
    if idle:
        full = ", ".join(f"{k} {b.iter_time:.3f}" for k, b in res.baselines.items() if b.layouts)
        used = args.gpus - len(idle)
        print(
            f"  ranks {idle} of {args.gpus} left idle: spreading the calls over them did not lower "
            f"the estimate{f' (plans on all {args.gpus}: {full} s/iteration)' if full else ''}; "
            f"the plan records them as idle_ranks, so train runs it as searched on {args.gpus} "
            f"ranks (or search with --gpus {used} for a {used}-rank job)"
        )
    if args.max_staleness:
        sync = res.stats["sync_iter_time"]
        print(
            "  mode: "
            + (
                f"asynchronous, set `async: {{max_staleness: {res.staleness}}}` in the train "
                f"config ({sync:.3f} s/iteration synchronously)"
                if res.staleness
                else "synchronous (running this plan asynchronously gains nothing)"
            )
        )
    for i, name in enumerate(res.problem.names):
        o = res.problem.options[i][res.choice[i]]
        print(f"  {name:13s} {str(o):28s} {o.time:8.3f} s")
    for e in sim.events:
        if e.realloc and e.iter == 0:
            print(f"  realloc before {e.call}: {e.end - e.start:.3f} s")
    for k, b in res.baselines.items():
        sp = b.iter_time / res.iter_time
        print(
            f"{k:10s} {b.iter_time:8.3f} s/iteration  (search speedup {sp:.2f}x): {_fmt(b.layouts)}"
        )
    st = res.stats
    acc = ", ".join(f"{c['acceptance']:.3f}" for c in st["chains"])
    print(
        f"search: {st['seconds_total']:.1f} s total ({st['seconds_tables']:.1f} s tables), "
        f"{sum(c['steps'] for c in st['chains'])} steps, acceptance per chain {acc}, "
        f"{st['planner_calls']} planner calls"
    )
    if args.out:
        print(
            f"plan written to {args.out}"
            + (f" (idle_ranks {idle})" if idle else "")
            + f"; train it with plan: {{path: {args.out}}} and the batch settings it was searched "
            f"for: data.batch_size: {args.batch_size}, ppo.mini_batches: {args.ppo_minibatches}, "
            f"ppo.micro_batches: {args.micro_batches}, ppo.ppo_epochs: {args.ppo_epochs}"
            + (f", ppo.group_size: {args.group_size}" if args.algo in GROUPED else "")
            + (", generation.engine: vllm" if args.engine == "vllm" else "")
            + (
                f", generation.vllm_logp: {args.vllm_logp}"
                if args.engine == "vllm" and args.vllm_logp != "recompute"
                else ""
            )
        )
    if args.plot:
        print(f"timeline written to {args.plot}")
    return 0
