"""`python -m real_py plan`: print the exact transfer plan summary between two layouts.

    python -m real_py plan --model llama2-70b --src dp2,tp8,pp8 --dst dp16,tp8,pp1
    python -m real_py plan --model llama2-7b --plan plan.json --from actor_train --to actor_gen

With --plan, the two layouts (and their ranks and ranks per node) are those of two calls of an
execution plan, e.g. one that `python -m real_py search --out plan.json` wrote.
"""

from __future__ import annotations

import json
import time

from ..dataflow.execplan import ExecutionPlan
from ..dataflow.graph import ALGORITHMS
from ..layout import Layout
from ..realloc.plan import MODES, plan_realloc
from ..spec import PRESETS, model_spec
from .common import model_config, ranks


def add_parser(sub):
    p = sub.add_parser("plan", help="plan a reallocation and print its summary")
    p.add_argument(
        "--model",
        default="llama2-7b",
        help=f"preset ({', '.join(PRESETS)}) or a path to an HF config.json / checkpoint dir",
    )
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    p.add_argument("--src", help="source layout, e.g. dp2,tp4,pp1")
    p.add_argument("--dst", help="destination layout, e.g. dp4,tp1,pp2")
    p.add_argument(
        "--plan", help="an execution plan JSON (python -m real_py search --out); with --from / --to"
    )
    p.add_argument(
        "--from", dest="from_call", help="with --plan: the call whose layout is the source"
    )
    p.add_argument(
        "--to", dest="to_call", help="with --plan: the call whose layout is the destination"
    )
    p.add_argument(
        "--src-ranks", help="comma-separated global ranks of the source (default 0..n-1)"
    )
    p.add_argument(
        "--dst-ranks", help="comma-separated global ranks of the destination (default 0..n-1)"
    )
    p.add_argument("--mode", choices=MODES, default="p2p")
    p.add_argument("--ranks-per-node", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _layouts(args) -> tuple[Layout, Layout, int]:
    if args.plan is None:
        if args.from_call or args.to_call:
            raise ValueError("--from / --to name calls of an execution plan: give --plan FILE too")
        if not args.src or not args.dst:
            raise ValueError("give --src and --dst, or --plan FILE --from CALL --to CALL")
        return (
            Layout.parse(args.src, ranks=ranks(args.src_ranks, "--src-ranks")),
            Layout.parse(args.dst, ranks=ranks(args.dst_ranks, "--dst-ranks")),
            args.ranks_per_node,
        )
    if args.src or args.dst or args.src_ranks or args.dst_ranks:
        raise ValueError(
            "--plan takes the layouts from the plan's calls: drop --src / --dst / --*-ranks"
        )
    if not args.from_call or not args.to_call:
        raise ValueError("--plan needs --from CALL and --to CALL")
    ep = ExecutionPlan.from_json(args.plan)
    for flag, call in (("--from", args.from_call), ("--to", args.to_call)):
        if call not in ep.calls:
            raise ValueError(
                f"{flag} {call}: {args.plan} has no such call; its calls are {list(ep.calls)}"
            )
    model = {c.name: c.model for calls in ALGORITHMS.values() for c in calls}
    a, b = model.get(args.from_call), model.get(args.to_call)
    if a and b and a != b:
        raise ValueError(
            f"--from {args.from_call} runs the {a} model, --to {args.to_call} the {b} model: "
            "a reallocation moves one model between two of its calls"
        )
    return (
        ep.calls[args.from_call],
        ep.calls[args.to_call],
        args.ranks_per_node or ep.ranks_per_node,
    )


def run(args) -> int:
    spec = model_spec(model_config(args.model, "--model", dtype=args.dtype), args.model)
    src, dst, rpn = _layouts(args)
    t0 = time.perf_counter()
    plan = plan_realloc(spec, src, dst, mode=args.mode, ranks_per_node=rpn)
    took = time.perf_counter() - t0
    if args.json:
        s = plan.summary()
        s["plan_seconds"] = took
        s["per_rank"] = {str(k): v for k, v in s["per_rank"].items()}
        print(json.dumps(s, indent=1))
    else:
        print(plan.describe())
        print(f"  planned in {took * 1e3:.1f} ms")
    return 0
