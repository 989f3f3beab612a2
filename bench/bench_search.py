"""Estimated PPO iteration time: searched plan vs symmetric and heuristic baselines (same
estimator).

Settings follow the ReaL paper: LLaMA-2 7B/13B/70B and CodeLLaMA-34B actors with a critic of the
same or smaller size, 8 to 128 H100, batch 512 prompts of 128 tokens, generation 128/384/896
tokens, plus a long-context setting (8k-token prompts, batch 64). Every number is an ESTIMATE
of the runtime model (real_py/search), not a measurement.

    python bench/bench_search.py [--budget 20] [--big-budget 60] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from real_py.benchmark import git_commit
from real_py.calibrate import resolve_profile
from real_py.search import Workload, plan_search

PAIRS = [
    ("llama2-7b", "llama2-7b", 8),
    ("llama2-13b", "llama2-7b", 16),
    ("codellama-34b", "llama2-7b", 32),
    ("llama2-70b", "llama2-7b", 64),
    ("llama2-70b", "llama2-70b", 128),
]
LONG = [
    ("llama2-7b", "llama2-7b", 16),
    ("llama2-13b", "llama2-7b", 32),
    ("llama2-70b", "llama2-7b", 128),
]


def settings(quick: bool):
    out = []
    for a, c, n in PAIRS:
        for g in (128, 384, 896):
            out.append(("standard", a, c, n, Workload(batch_size=512, prompt_len=128, gen_len=g)))
    for a, c, n in LONG:
        out.append(
            (
                "long-context",
                a,
                c,
                n,
                Workload(batch_size=64, prompt_len=8192, gen_len=384, micro_tokens=8192),
            )
        )
    return out[:2] if quick else out


def per_call(res, heu) -> dict:
    """Per call: the searched and the heuristic option's layout, estimated seconds and cost
    terms (costmodel.call_time's breakdown), to say which costs the searched plan avoids."""
    prob, out = res.problem, {}
    for i, name in enumerate(prob.names):
        o = prob.options[i][res.choice[i]]
        h = prob.options[i][prob.index[i][heu.layouts[name]]] if heu.layouts else None
        terms = lambda opt: {
            k: round(v, 4)
            for k, v in opt.breakdown.items()
            if isinstance(v, float) and v and k not in ("busy", "working")
        }
        out[name] = {
            "searched": str(o),
            "searched_s": o.time,
            "searched_terms": terms(o),
            "heuristic": str(h) if h else None,
            "heuristic_s": h.time if h else None,
            "heuristic_terms": terms(h) if h else None,
        }
    return out


def layouts_text(prob, choice):
    return {n: str(prob.options[i][choice[i]]) for i, n in enumerate(prob.names)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=20.0, help="search seconds per setting")
    ap.add_argument("--big-budget", type=float, default=60.0, help="seconds for 70B + 70B on 128")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--per-mesh",
        type=int,
        default=None,
        help="prune to this many fastest strategies per (call, mesh); default: all",
    )
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(__file__),
            "results",
            f"search_cpu{os.cpu_count()}_" + datetime.datetime.now(datetime.UTC).strftime("%Y%m%d"),
        ),
        help="results path without suffix (default bench/results/search_cpu<cores>_<yyyymmdd>)",
    )
    args = ap.parse_args()
    args.load_start = os.getloadavg()
    hw = resolve_profile(args.hardware)
    rows = []
    for theme, actor, critic, n, wl in settings(args.quick):
        budget = args.big_budget if n == 128 and critic == "llama2-70b" else args.budget
        setting = {"theme": theme, "actor": actor, "critic": critic, "gpus": n}
        setting |= {"prompt_len": wl.prompt_len, "gen_len": wl.gen_len, "batch_size": wl.batch_size}
        t0 = time.perf_counter()
        try:
            res = plan_search(
                actor,
                critic,
                num_gpus=n,
                hardware=hw,
                workload=wl,
                time_budget=budget,
                chains=4,
                seed=0,
                per_mesh=args.per_mesh,
            )
        except ValueError as e:
            rows.append({**setting, "error": str(e)})
            print(f"{theme:12s} {actor}+{critic} {n:3d} gpus: {e}", flush=True)
            continue
        took = time.perf_counter() - t0
        sym, heu = res.baselines["symmetric"], res.baselines["heuristic"]
        sim = res.simulate()
        realloc = sum(e.end - e.start for e in sim.events if e.realloc and e.iter == 0)
        row = {
            **setting,
            "budget_s": budget,
            "search_wall_s": took,
            "search_s_per_iter": res.iter_time,
            "symmetric_s_per_iter": sym.iter_time,
            "heuristic_s_per_iter": heu.iter_time,
            "speedup_vs_symmetric": sym.iter_time / res.iter_time,
            "speedup_vs_heuristic": heu.iter_time / res.iter_time,
            "realloc_s_first_iter": realloc,
            "plan": layouts_text(res.problem, res.choice),
            "symmetric_plan": {
                k: f"dp{v[1]}tp{v[2]}pp{v[3]}" for k, v in (sym.layouts or {}).items()
            },
            "heuristic_plan": {
                k: f"dp{v[1]}tp{v[2]}pp{v[3]}" for k, v in (heu.layouts or {}).items()
            },
            "options_per_call": res.stats["options"],
            "planner_calls": res.stats["planner_calls"],
            "steps": sum(c["steps"] for c in res.stats["chains"]),
            "acceptance": [round(c["acceptance"], 5) for c in res.stats["chains"]],
            "execution_plan": res.plan.to_json(),
            "seconds_tables": res.stats["seconds_tables"],
            "seconds_anneal": res.stats["seconds_anneal"],
            "per_call": per_call(res, heu),
        }
        rows.append(row)
        print(
            f"{theme:12s} {actor}+{critic} {n:3d} gpus gen {wl.gen_len:3d}: search "
            f"{res.iter_time:7.2f} s, symmetric {sym.iter_time:7.2f} s "
            f"({row['speedup_vs_symmetric']:.2f}x), heuristic {heu.iter_time:7.2f} s "
            f"({row['speedup_vs_heuristic']:.2f}x), {took:.1f} s wall",
            flush=True,
        )
    write(args, rows)


def write(args, rows) -> None:
    import numpy
    import torch

    commit = git_commit()
    meta = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores (cpu2, shared)",
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "commit": commit,
        "hardware_profile": args.hardware,
        "note": "all iteration times are estimates of the cost model",
        "loadavg_start": args.load_start,
        "loadavg_end": os.getloadavg(),
    }
    std = [r for r in rows if r["theme"] == "standard" and "error" not in r]
    long = [r for r in rows if r["theme"] == "long-context" and "error" not in r]
    summary = {}
    for name, rs in (("standard", std), ("long-context", long)):
        if rs:
            summary[name] = {
                "mean_speedup_vs_heuristic": statistics.mean(r["speedup_vs_heuristic"] for r in rs),
                "mean_speedup_vs_symmetric": statistics.mean(r["speedup_vs_symmetric"] for r in rs),
            }
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    lines = [
        f"# Plan search vs baselines (estimated, {args.hardware})",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; machine: {meta['machine']}; "
        f"python {meta['python']}, torch {meta['torch']}, numpy {meta['numpy']}; "
        f"commit {commit}.  ",
        "All times are seconds per PPO iteration ESTIMATED by real_py.search (not measured).  ",
        "Machine load average (1, 5, 15 min) at start "
        f"{tuple(round(x, 1) for x in args.load_start)}, at end "
        f"{tuple(round(x, 1) for x in meta['loadavg_end'])}: the search is time-budgeted, so a "
        "loaded machine explores fewer plans.",
        "",
        "| setting | actor + critic | GPUs | prompt/gen | search s | symmetric s | heuristic s | "
        "vs sym | vs heur | search wall s | searched plan (gen / train) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['theme']} | {r['actor']} + {r['critic']} | {r['gpus']} | "
                f"{r['prompt_len']}/{r['gen_len']} | infeasible: {r['error']} | | | | | | |"
            )
            continue
        p = r["plan"]
        lines.append(
            f"| {r['theme']} | {r['actor']} + {r['critic']} | {r['gpus']} | "
            f"{r['prompt_len']}/{r['gen_len']} | {r['search_s_per_iter']:.2f} | "
            f"{r['symmetric_s_per_iter']:.2f} | {r['heuristic_s_per_iter']:.2f} | "
            f"{r['speedup_vs_symmetric']:.2f}x | {r['speedup_vs_heuristic']:.2f}x | "
            f"{r['search_wall_s']:.1f} | {p['actor_gen']} / {p['actor_train']} |"
        )
    lines.append("")
    for name, s in summary.items():
        lines.append(
            f"- {name}: mean speedup vs heuristic {s['mean_speedup_vs_heuristic']:.2f}x, "
            f"vs symmetric {s['mean_speedup_vs_symmetric']:.2f}x"
        )
    lines += [
        "",
        "Options per call (every memory-feasible strategy per mesh unless --per-mesh) and search "
        "time per setting: in the JSON (`options_per_call`, `seconds_tables`, `seconds_anneal`).",
        "",
    ]
    for r in long:
        lines += [
            f"### Long context, {r['actor']} + {r['critic']} on {r['gpus']} GPUs: per call, "
            "estimated seconds (searched vs heuristic) and the searched call's largest terms",
            "",
            "| call | searched | s | heuristic | s | searched terms (s) |",
            "|---|---|---|---|---|---|",
        ]
        for name, c in r["per_call"].items():
            top = sorted(
                ((k, v) for k, v in c["searched_terms"].items() if k != "total"),
                key=lambda kv: -kv[1],
            )[:3]
            lines.append(
                f"| {name} | {c['searched']} | {c['searched_s']:.2f} | {c['heuristic']} | "
                f"{c['heuristic_s']:.2f} | " + ", ".join(f"{k} {v:.2f}" for k, v in top) + " |"
            )
        lines.append("")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
