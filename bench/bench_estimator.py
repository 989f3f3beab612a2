"""Runtime estimator vs the PPO runtime: measured and estimated seconds per iteration, per plan.

    python bench/bench_estimator.py [--steps 10] [--warmup 2] [--search-budget 10]

Calibrates the `cpu` hardware profile in this run (refresh=True), then for a few execution
plans of the default PPO job (tiny random-init models, 4 gloo ranks, batch 8, prompts padded to
8 tokens, 12 new tokens, 2 PPO epochs x 2 mini-batches, 1 micro-batch) runs
`python -m real_py train` through bench_rlhf.run (median over the steps after the warm-up) and
asks `estimate()` for the same plan, models and workload. One of the plans is the one
`plan_search(..., hardware=<that profile>, num_gpus=4)` finds for this job.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_rlhf import ONE_LAYOUT, run  # noqa: E402
from timing import write_results  # noqa: E402

from real_py.execplan import ExecutionPlan  # noqa: E402
from real_py.rlhf import config as CF  # noqa: E402
from real_py.search import Workload, estimate, plan_search  # noqa: E402
from real_py.search.hardware import cpu_profile  # noqa: E402

CALLS = ("actor_gen", "ref_inf", "rew_inf", "critic_inf", "actor_train", "critic_train")
COMPUTE_TERMS = ("compute", "prefill", "decode", "optimizer")
DP2TP2 = {"world_size": 4, "calls": {n: {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "pp": 1} for n in CALLS}}


def job():
    """The default train config's models and the estimator's Workload for the same data."""
    cfg = CF.from_dict({})
    models = cfg.model_configs()
    p = cfg.ppo
    # The runtime pads prompts to max_prompt_len and always generates max_new_tokens (no eos);
    # one train call is ppo_epochs x mini_batches optimizer steps of one micro-batch each, so a
    # micro-batch holds every token of a mini-batch (micro_tokens larger than that).
    wl = Workload(batch_size=cfg.data.batch_size, prompt_len=cfg.data.max_prompt_len,
                  gen_len=cfg.generation.max_new_tokens, ppo_minibatches=p.ppo_epochs * p.mini_batches,
                  micro_tokens=10 ** 9 if p.micro_batches == 1 else 1)
    return cfg, models["actor"], models["critic"], wl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--search-budget", type=float, default=10.0)
    args = ap.parse_args()
    cfg, actor, critic, wl = job()
    dtype = actor.dtype
    hw = cpu_profile(refresh=True)
    found = plan_search(actor, critic, num_gpus=4, hardware=hw, workload=wl, dtype=dtype,
                        time_budget=args.search_budget, seed=0)
    plans = {"default": CF.DEFAULT_PLAN, "all dp1tp2pp2": ONE_LAYOUT, "all dp2tp2pp1": DP2TP2,
             "searched": found.plan.to_json()}
    rows, med = [], (lambda xs: statistics.median(xs) if xs else 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, plan) in enumerate(plans.items()):
            CF.validate(CF.from_dict({"plan": plan, "allow_idle_ranks": True}), 4)
            recs = run(plan, args.steps, tmp, f"p{i}")[args.warmup:]
            est = estimate(ExecutionPlan.from_json(plan), actor, critic, hardware=hw, workload=wl, dtype=dtype)
            meas = med([r["seconds"] for r in recs])
            row = {"plan": name, "measured s": meas, "estimated s": est["iter_time"],
                   "rel err": (est["iter_time"] - meas) / meas}
            for c in CALLS:
                m, e = med([r["calls"][c] for r in recs]), est["calls"][c]["seconds"]
                row[f"{c} meas/est s"] = f"{m:.4f}/{e:.4f}"
            for m in ("actor", "critic"):
                row[f"realloc {m} meas s"] = med([r["realloc_seconds"].get(m, 0.0) for r in recs])
            row["realloc est s"] = sum(est["realloc_seconds"].values())
            # Which estimate terms carry the plan: compute-like terms (FLOPs, memory reads,
            # optimizer) vs communication (tp/dp/pp collectives and hops), summed over calls.
            comp = sum(v for c in CALLS for k, v in est["calls"][c]["breakdown"].items()
                       if k in COMPUTE_TERMS)
            every = sum(est["calls"][c]["seconds"] for c in CALLS)
            row["est compute s"], row["est comm s"] = comp, every - comp
            row["layouts"] = "; ".join(f"{c}={est['calls'][c]['layout']}" for c in CALLS)
            row["breakdown"] = {c: {k: round(v, 6) for k, v in est["calls"][c]["breakdown"].items()}
                                for c in CALLS}
            rows.append(row)
            print(name, f"measured {meas:.3f} s, estimated {est['iter_time']:.3f} s", flush=True)
    errs = [abs(r["rel err"]) for r in rows]
    ratios = ", ".join(f"{r['plan']} {r['measured s'] / r['estimated s']:.1f}x" for r in rows)
    cols = [c for c in rows[0] if c not in ("breakdown", "layouts")]
    prof = {k: getattr(hw, k) for k in ("peak_flops", "hbm_bw", "intra_bw", "intra_lat")}
    write_results("estimator", "cpu2", rows, columns=cols + ["layouts"],
                  title="Runtime estimator vs PPO runtime, 4 gloo ranks (cpu2)",
                  notes=f"Measured: median over steps {args.warmup + 1}..{args.steps} of `python -m real_py "
                        f"train` (default config, slowest rank per call). Estimated: `estimate()` with the "
                        f"`cpu` profile calibrated in this run ({prof}) and Workload {wl}. Median |rel err| "
                        f"{med(errs):.2f} (target <= 0.25). Searched plan: plan_search time_budget "
                        f"{args.search_budget} s, estimated {found.iter_time:.4f} s. Per-call estimate "
                        f"breakdowns are in the JSON. The machine is shared with other jobs (+-30%). "
                        f"Measured/estimated per plan: {ratios}.")


if __name__ == "__main__":
    main()
