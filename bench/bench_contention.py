"""How ranks sharing this machine's cores slow each other: one small inference repeated by 1, 2
and 4 gloo ranks at once.

    python bench/bench_contention.py [--reps 40]

Every rank builds the default job's actor (tiny random-init model, real_py.engines.Engine, one
rank per layout) and times engine.inference on 2 rows of 20 tokens; in each phase only the
first `active` ranks compute (the others wait at the barrier), so the per-call seconds show the
slow-down the estimator's `cpu` profile models as contention(active ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from timing import hardware_tag, write_results  # noqa: E402

from real_py.engines import Engine  # noqa: E402
from real_py.layout import Layout  # noqa: E402
from real_py.parallel import ParallelGroups  # noqa: E402
from real_py.realloc.shard import ModelShard  # noqa: E402
from real_py.rlhf import config as CF  # noqa: E402
from real_py.rlhf.models import init_weights  # noqa: E402
from real_py.spec import model_spec  # noqa: E402
from real_py.testing import run_distributed  # noqa: E402

ACTIVE = (1, 2, 4)


def _worker(rank: int, world: int, reps: int) -> dict:
    cfg = CF.from_dict({}).model_configs()["actor"]
    groups = [ParallelGroups(Layout(ranks=(r,))) for r in range(world)]
    lay = Layout(ranks=(rank,))
    eng = Engine(cfg, lay, groups[rank], ModelShard.from_full(model_spec(cfg), lay, rank, init_weights(cfg, 0)))
    tok, ln = torch.randint(1, cfg.vocab_size, (2, 20)), torch.full((2,), 20)
    out = {}
    for active in ACTIVE:
        for _ in range(3):
            eng.inference(tok, ln)
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            if rank < active:
                for _ in range(5):
                    eng.inference(tok, ln)
            ts.append((time.perf_counter() - t0) / 5)
        out[active] = statistics.median(ts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    res = run_distributed(_worker, 4, args.reps, timeout=600)
    alone = res[0][1]
    rows = [{"ranks computing at once": a, "ms per inference (slowest active rank)": 1e3 * max(r[a] for r in res[:a]),
             "slow-down vs alone": max(r[a] for r in res[:a]) / alone,
             "os.cpu_count()": os.cpu_count()} for a in ACTIVE]
    write_results("contention", hardware_tag("cpu"), rows, columns=list(rows[0]),
                  title="Ranks sharing the cores: one small inference by 1, 2, 4 ranks at once",
                  notes=f"Default job's actor (tiny), 2 rows x 20 tokens, median of {args.reps} x 5 calls per "
                        "phase. A slow-down of n with n ranks means the ranks effectively share one core.")


if __name__ == "__main__":
    main()
