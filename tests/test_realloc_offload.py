# Checks frozen-model offload: HostOffload round trips bit for bit with views kept valid and the
# host buffer reused, misuse errors, and the PPO runtime with offload_frozen (same results as
# without, ref/reward freed outside their calls, bytes reported).
# A failure points to real_py/realloc/offload.py (copy, storage resize, pinned buffer),
# real_py/rlhf/models.py (offloaders, engine_for check), runtime.py (reload/offload around the call,
# summary) or config.py / cli/train.py (the key, the step line).
"""The runtime comparison is exact (torch.equal, ==): offloading copies bytes out and back, so the
same 4-rank job with and without it must compute the same bits."""

import io

import numpy as np
import pytest
import torch

from real_py.layout import shard_layout
from real_py.realloc.offload import HostOffload
from real_py.rlhf import config as CF
from real_py.spec import model_spec, torch_dtype
from real_py.testing import run_distributed

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
FROZEN_CALLS = {"ref": "ref_inf", "reward": "rew_inf"}


def _filled(dtype, n=1000, device="cpu"):
    g = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(dtype).to(device)
    return torch.randint(-(2**40), 2**40, (n,), generator=g, dtype=dtype).to(device)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_keeps_views_and_reuses_host_buffer(dtype):
    flat = _filled(dtype)
    want = flat.clone()
    view = flat[100:300].view(20, 10)  # taken before the offload, like a model's Parameter
    param = torch.nn.Parameter(flat[300:400], requires_grad=False)
    off = HostOffload(flat, name="t")
    host_ptr = None
    for cycle in range(3):
        nbytes, sec = off.offload()
        assert nbytes == 1000 * flat.element_size() and sec >= 0
        assert off.offloaded and flat.untyped_storage().nbytes() == 0
        assert view.untyped_storage().nbytes() == 0 and param.untyped_storage().nbytes() == 0
        assert torch.equal(off.host, want), cycle
        host_ptr = host_ptr or off.host.data_ptr()
        assert off.host.data_ptr() == host_ptr, "host buffer re-allocated"
        assert not off.host.is_pinned()
        back, sec = off.reload()
        assert back == nbytes and sec >= 0
        assert not off.offloaded and flat.untyped_storage().nbytes() == nbytes
        assert torch.equal(flat, want), cycle
        # The old views see the reloaded bytes: they share the one storage object.
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert torch.equal(view, want[100:300].view(20, 10))
        assert torch.equal(param, want[300:400])
        flat.add_(1)  # writes after a reload are kept by the next cycle
        want.add_(1)


@pytest.mark.timeout(60)
def test_misuse_is_an_error():
    flat = _filled(torch.float32)
    off = HostOffload(flat, name="my buffer")
    with pytest.raises(RuntimeError, match=r"my buffer.*not offloaded"):
        off.reload()
    off.offload()
    with pytest.raises(RuntimeError, match=r"my buffer.*already offloaded"):
        off.offload()
    assert flat.untyped_storage().nbytes() == 0  # the failed call changed nothing
    off.reload()
    with pytest.raises(ValueError, match="1-D contiguous"):
        HostOffload(torch.zeros(4, 4), name="x")
    with pytest.raises(ValueError, match="own its whole storage"):
        HostOffload(flat[10:], name="x")
    with pytest.raises(ValueError, match="not resizable"):
        HostOffload(torch.from_numpy(np.zeros(8, dtype=np.float32)), name="x")


@pytest.mark.cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_pinned_round_trip(dtype):
    flat = _filled(dtype, n=1 << 20, device="cuda")
    want = flat.clone()
    view = flat[5:17]
    before = torch.cuda.memory_allocated()
    off = HostOffload(flat, name="gpu")
    nbytes, _ = off.offload()
    assert off.host.is_pinned() and off.host.device.type == "cpu"
    assert flat.untyped_storage().nbytes() == 0
    assert torch.cuda.memory_allocated() == before - nbytes
    assert torch.equal(off.host, want.cpu())
    off.reload()
    assert torch.equal(flat, want) and torch.equal(view, want[5:17])
    assert torch.cuda.memory_allocated() == before


def test_config_key_and_step_line(tmp_path):
    from real_py.cli.train import _line

    path = tmp_path / "c.yaml"
    path.write_text("steps: 1\noffload_frozen: true\n")
    assert CF.load(str(path)).offload_frozen is True and CF.from_dict({}).offload_frozen is False
    with pytest.raises(ValueError, match=r"unknown keys \['offload_frozn'\].*offload_frozen"):
        CF.from_dict({"offload_frozn": True})
    with pytest.raises(ValueError, match="offload_frozen='yes': expected true or false"):
        CF.from_dict({"offload_frozen": "yes"})
    out = {
        "metrics": {"reward": 0.5},
        "calls": {"ref_inf": 0.1},
        "realloc_seconds": {},
        "realloc_bytes": 0,
        "offload_seconds": {"ref": 0.004, "reward": 0.00025},
        "offload_bytes": 3 * 2**20,
    }
    assert _line(1, out).endswith("| offload ref 4.00ms reward 0.25ms 3.00 MiB")
    assert "offload" not in _line(1, dict(out, offload_seconds={}, offload_bytes=0))


# -- the runtime: one 4-rank spawn runs the default PPO job with and without offload_frozen ------

STEPS = 2


def _frozen_bytes(models, rank):
    """What this rank's frozen shards weigh, from the layout alone (not from the shards)."""
    out = {}
    for m, call in FROZEN_CALLS.items():
        layout = models.plan.calls[call]
        coords = layout.coords(rank)
        if coords is not None:
            sl = shard_layout(model_spec(models.configs[m], name=m), layout, coords[2])
            out[m] = sl.numel * torch_dtype(models.configs[m].dtype).itemsize
    return out


def _runtime_worker(rank, world):
    from real_py.rlhf import runtime
    from real_py.rlhf.runtime import Runtime

    seen = []  # (call, {frozen model: storage bytes of its shard on this rank}) during calls
    run_call = runtime.run_call  # the name the runtime calls

    def probe(rt, call, *a, **k):
        seen.append(
            (
                call.name,
                {
                    m: e.shard.flat.untyped_storage().nbytes()
                    for m, e in rt.models.engines.items()
                    if m in FROZEN_CALLS and e
                },
            )
        )
        return run_call(rt, call, *a, **k)

    runtime.run_call = probe
    res = {}
    for on in (False, True):
        seen.clear()
        cfg = CF.from_dict({"offload_frozen": on, "generation": {"max_new_tokens": 8}})
        plan, graph, models = CF.validate(cfg, world)
        rt = Runtime(cfg, plan, graph, models, timeout_s=120)
        iters = []
        for step in range(STEPS):
            it = rt.iteration(step)
            iters.append({k: it[k] for k in ("metrics", "offload_seconds", "offload_bytes")})
            iters[-1]["resident_after"] = {
                m: e.shard.flat.untyped_storage().nbytes()
                for m, e in rt.models.engines.items()
                if m in FROZEN_CALLS and e
            }
        r = {
            "iters": iters,
            "seen": list(seen),
            "expect": _frozen_bytes(rt.models, rank),
            "flat": {
                m: rt.models.engines[m].shard.flat.clone()
                for m in ("actor", "critic")
                if rt.models.engines[m] is not None
            },
        }
        if on:
            r["engine_for_errors"] = []
            for m in r["expect"]:
                with pytest.raises(
                    RuntimeError, match=rf"{m} weights are offloaded to host on rank {rank}"
                ):
                    rt.models.engine_for(FROZEN_CALLS[m])
                r["engine_for_errors"].append(m)
        res[on] = r
    buf = io.BytesIO()  # tensors through the result queue need their sender alive
    torch.save(res, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runtime_runs():
    out = run_distributed(_runtime_worker, 4, timeout=280)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in out]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_runtime_same_results_with_offload(runtime_runs):
    for rank, res in enumerate(runtime_runs):
        off, on = res[False], res[True]
        for i in range(STEPS):
            assert on["iters"][i]["metrics"] == off["iters"][i]["metrics"], (rank, i)
        assert off["flat"].keys() == on["flat"].keys() and off["flat"]
        for m in off["flat"]:
            assert torch.equal(on["flat"][m], off["flat"][m]), (rank, m)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_runtime_frozen_models_offloaded_outside_their_call(runtime_runs):
    holders = {
        m: [r for r, res in enumerate(runtime_runs) if m in res[True]["expect"]]
        for m in FROZEN_CALLS
    }
    assert holders == {"ref": [0, 1], "reward": [2, 3]}  # the default plan
    for rank, res in enumerate(runtime_runs):
        on, off = res[True], res[False]
        expect = on["expect"]
        assert on["engine_for_errors"] == list(expect)
        assert len(on["seen"]) >= STEPS * 3
        for call, sizes in on["seen"]:
            for m, nbytes in sizes.items():
                want = expect[m] if call == FROZEN_CALLS[m] else 0
                assert nbytes == want, (rank, call, m, nbytes, want)
        # Without the option nothing moves: resident throughout.
        for call, sizes in off["seen"]:
            assert sizes == expect, (rank, call)
        for i in range(STEPS):
            assert on["iters"][i]["resident_after"] == {m: 0 for m in expect}
            assert off["iters"][i]["resident_after"] == expect


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_runtime_reports_offload_bytes_and_seconds(runtime_runs):
    # Every holding rank copies its shard out and back once per iteration.
    total = 2 * sum(sum(res[True]["expect"].values()) for res in runtime_runs)
    assert total > 0
    for res in runtime_runs:
        for i in range(STEPS):
            it, it_off = res[True]["iters"][i], res[False]["iters"][i]
            assert it["offload_bytes"] == total, (i, it["offload_bytes"], total)
            assert set(it["offload_seconds"]) == set(FROZEN_CALLS)
            assert all(s > 0 for s in it["offload_seconds"].values())
            assert it_off["offload_bytes"] == 0 and it_off["offload_seconds"] == {}
