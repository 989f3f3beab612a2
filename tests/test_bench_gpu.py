# Checks the CPU-testable logic of the GPU benches that scripts/gpu_check.sh runs: the estimator's
# datasheet profile follows the GPU (bench_gpu_ppo), timed() reports the median of the timed calls
# (bench_generate), and the fused AdamW path of the CUDA train step equals the CPU one. Never timed.
# A failure points to bench/bench_gpu_ppo.py (datasheet_profile), bench/bench_generate.py (timed) or
# real_py/engines/train.py (_adamw_fused, _adamw_flat).
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def test_ppo_estimator_uses_the_gpus_own_datasheet(monkeypatch):
    import bench_gpu_ppo as B

    for tag, want in (
        ("h100", "h100"),
        ("h200", "h200"),
        ("a100", "a100"),
        ("l40s", "h200"),
        ("cpu2", "h200"),
    ):
        monkeypatch.setattr(B, "hardware_tag", lambda device, small=False, tag=tag: tag)
        assert B.datasheet_profile("cuda") == want, tag


def test_generate_timed_reports_the_median(monkeypatch):
    import bench_generate as B

    # first call 10 s, then calls of 1 s and 3 s: the median of an even count is their mean
    clock = iter([0.0, 10.0, 10.0, 11.0, 11.0, 14.0])
    monkeypatch.setattr(B.time, "perf_counter", lambda: next(clock))
    first, med, out = B.timed(lambda: "x", torch.device("cpu"), 2)
    assert (first, med, out) == (10.0, 2.0, "x")


@pytest.mark.parametrize("clip", [1.0, 0.37])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adamw_equals_the_flat_update(clip, weight_decay, monkeypatch):
    """The CUDA path (torch._fused_adamw_ over pieces of the flat buffers, the clip factor as its
    grad_scale) runs here on the CPU kernel: the same weights as the CPU path's op-by-op update."""
    from real_py.engines import train as T

    monkeypatch.setattr(T, "FUSED_PIECE", 300)  # several pieces, the last one short
    trainer = T.Trainer.__new__(T.Trainer)
    trainer.cfg = T.OptimConfig(lr=1e-2, weight_decay=weight_decay, eps=1e-6)
    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    got = {}
    for kind in ("flat", "fused"):
        p = p0.clone()
        b = SimpleNamespace(red=None, exp_avg=torch.zeros(1000), exp_avg_sq=torch.zeros(1000))
        for step in (1, 2, 3):
            trainer.num_steps = step
            b.red = grad * step
            if kind == "fused":
                trainer._adamw_fused(p, b, clip)
            else:
                b.red.mul_(clip)
                trainer._adamw_flat(p, b.red, b.exp_avg, b.exp_avg_sq)
        got[kind] = p
    assert not torch.equal(got["flat"], p0)
    torch.testing.assert_close(got["fused"], got["flat"], atol=1e-6, rtol=0)
