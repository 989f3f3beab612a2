"""Does a rank blocked in dist.recv take a core from busy ranks? 4 gloo ranks on this machine's
2 cores: ranks 0 and 1 run 20 x (ten 128x128 matmuls + one 16 KiB all-reduce over the pair), as a
pipeline's first tp=2 stage does, while ranks 2 and 3 wait in `barrier`, `recv` or `irecv().wait()`
(a second stage waiting for its input). Prints the pair's median milliseconds over 30 repeats
(bench/results/estimator_pool_cpu2_20261205.md).

    .venv/bin/python bench/tools/recv_wait_check.py
"""

import statistics
import time

import torch
import torch.distributed as dist

from real_py.testing import run_distributed


def work(rank: int, world: int, mode: str):
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])
    x, a = torch.zeros(4096), torch.randn(128, 128)
    res = []
    for _ in range(30):
        dist.barrier()
        if rank < 2:
            t0 = time.perf_counter()
            for _ in range(20):
                for _ in range(10):
                    a @ a
                dist.all_reduce(x, group=pair)
            res.append(time.perf_counter() - t0)
            if mode != "barrier" and rank == 0:
                dist.send(torch.zeros(1), 2)
                dist.send(torch.zeros(1), 3)
        elif mode == "recv":
            dist.recv(torch.zeros(1), 0)
        elif mode == "irecv_wait":
            dist.irecv(torch.zeros(1), 0).wait()
        dist.barrier()
    return statistics.median(res) if res else None


if __name__ == "__main__":
    for mode in ("barrier", "recv", "irecv_wait", "barrier", "recv"):
        r = run_distributed(work, 4, mode, timeout=300)
        print(mode, [round(v * 1000, 2) for v in r if v is not None], "ms per 20 all-reduces")
