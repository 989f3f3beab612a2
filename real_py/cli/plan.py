"""`python -m real_py plan`: print the exact transfer plan summary between two layouts."""

from __future__ import annotations

import json
import time

from .common import model_config, ranks
from ..layout import Layout
from ..realloc.plan import MODES, plan_realloc
from ..spec import PRESETS, model_spec


def add_parser(sub):
    p = sub.add_parser("plan", help="plan a reallocation and print its summary")
    p.add_argument("--model", default="llama2-7b",
                   help=f"preset ({', '.join(PRESETS)}) or a path to an HF config.json / checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    p.add_argument("--src", required=True, help="source layout, e.g. dp2,tp4,pp1")
    p.add_argument("--dst", required=True, help="destination layout, e.g. dp4,tp1,pp2")
    p.add_argument("--src-ranks", help="comma-separated global ranks of the source (default 0..n-1)")
    p.add_argument("--dst-ranks", help="comma-separated global ranks of the destination (default 0..n-1)")
    p.add_argument("--mode", choices=MODES, default="p2p")
    p.add_argument("--ranks-per-node", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args) -> int:
    spec = model_spec(model_config(args.model, "--model", dtype=args.dtype), args.model)
    src = Layout.parse(args.src, ranks=ranks(args.src_ranks, "--src-ranks"))
    dst = Layout.parse(args.dst, ranks=ranks(args.dst_ranks, "--dst-ranks"))
    t0 = time.perf_counter()
    plan = plan_realloc(spec, src, dst, mode=args.mode, ranks_per_node=args.ranks_per_node)
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
