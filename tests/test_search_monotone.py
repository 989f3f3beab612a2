# Monotonicity of the search's cost model: more work (longer generation, longer
# prompts, a larger batch) never costs fewer estimated seconds, and faster hardware never costs
# more, for every call kind on every mesh x strategy the search enumerates. A failure points to a
# term of real_py/search/costmodel.py call_time that falls with more work.
from dataclasses import replace

import pytest

from real_py.search import Mesh, Workload, call_time, get_profile
from real_py.search.graph import strategies
from real_py.spec import model_spec, preset

pytestmark = pytest.mark.timeout(300)

KINDS = ("generate", "inference", "train")
MODELS = [model_spec(preset(n), n) for n in ("llama2-7b", "llama2-13b")]
# "shared": the `cpu` profile's kind of terms (core sharing, collective latency growing with ranks,
# fixed per-layer seconds) on a GPU-sized machine, so that the grid's meshes and models apply.
SHARED = replace(
    get_profile("h100"),
    name="shared",
    shared_cores=2,
    lat_contention=0.5,
    coll_lat_growth=0.6,
    pipe_wait_lat=2e-3,
    layer_lat=1e-4,
    head_lat=1e-3,
    decode_layer_lat=1e-4,
    decode_lat=1e-4,
    train_layer_lat=1e-3,
    train_lat=1e-3,
    tp_head_lat=1e-4,
    tp_train_lat=1e-4,
    tp_decode_lat=1e-4,
)
PROFILES = ("a100", "h100", SHARED)
SIZES = (1, 2, 4, 8)


def _grid(base: Workload):
    for model in MODELS:
        for prof in PROFILES:
            hw = get_profile(prof) if isinstance(prof, str) else prof
            for size in SIZES:
                for dp, tp, pp in strategies(model, size, hw.ranks_per_node, base):
                    yield model, hw, Mesh(0, size), dp, tp, pp


def _series(field, values, base):
    bad = []
    for model, hw, mesh, dp, tp, pp in _grid(base):
        for kind in KINDS:
            prev = None
            for v in values:
                wl = replace(base, **{field: v})
                if wl.batch_size < dp:
                    continue
                t = call_time(kind, model, mesh, dp, tp, pp, hw, wl)["total"]
                if prev is not None and t < prev[1] * (1 - 1e-9):
                    bad.append(
                        f"{kind} {model.name} {hw.name} dp{dp}tp{tp}pp{pp} {field} "
                        f"{prev[0]}->{v}: {prev[1]:.4f}s -> {t:.4f}s"
                    )
                prev = (v, t)
    return bad


BASE = Workload(batch_size=64, prompt_len=128, gen_len=128)


def test_known_case_gen_128_vs_144():
    model, hw = MODELS[0], get_profile("a100")
    t = [
        call_time("generate", model, Mesh(0, 4), 1, 1, 4, hw, replace(BASE, gen_len=g))["total"]
        for g in (128, 144)
    ]
    assert t[1] >= t[0]


@pytest.mark.parametrize(
    "field,values",
    [
        ("gen_len", list(range(16, 1025, 16))),
        ("prompt_len", list(range(16, 1025, 16))),
        ("batch_size", [8, 12, 16, 24, 32, 48, 64, 96, 100, 128, 192, 256, 512]),
    ],
)
@pytest.mark.parametrize("counts", ["free", "runtime"])
def test_more_work_never_costs_less(field, values, counts):
    """counts: each pass's cheapest micro-batch count, or the runtime's own (2 per train
    mini-batch, forward-only passes whole; Workload.runtime_micro_batches)."""
    base = BASE if counts == "free" else replace(BASE, micro_batches=2, runtime_micro_batches=True)
    bad = _series(field, values, base)
    assert not bad, f"{len(bad)} decreases, first: " + "; ".join(bad[:5])


def test_faster_hardware_never_costs_more():
    bad = []
    for model, hw, mesh, dp, tp, pp in _grid(BASE):
        for fld in ("peak_flops", "hbm_bw", "intra_bw", "inter_bw"):
            fast = replace(hw, **{fld: getattr(hw, fld) * 2})
            for kind in KINDS:
                for g in (64, 256, 1024):
                    wl = replace(BASE, gen_len=g)
                    slow_t = call_time(kind, model, mesh, dp, tp, pp, hw, wl)["total"]
                    fast_t = call_time(kind, model, mesh, dp, tp, pp, fast, wl)["total"]
                    if fast_t > slow_t * (1 + 1e-9):
                        bad.append(
                            f"{kind} {hw.name} dp{dp}tp{tp}pp{pp} 2x {fld} gen {g}: "
                            f"{slow_t} -> {fast_t}"
                        )
    assert not bad, f"{len(bad)} increases, first: " + "; ".join(bad[:5])


@pytest.mark.parametrize("gpus,hwname", [(4, "a100"), (8, "h100")])
def test_whole_plan_estimate_monotone_in_gen_len(gpus, hwname):
    from real_py.search import Problem, estimate, ppo_models
    from real_py.search.search import baseline_layouts, heuristic_baseline, symmetric_baseline

    models, hw = ppo_models("llama2-7b", "llama2-7b"), get_profile(hwname)
    prob = Problem(models, hw, gpus, BASE, extra=baseline_layouts(models, hw, gpus, BASE))
    sym = symmetric_baseline(prob)
    heu = heuristic_baseline(prob, sym)
    plans = [prob.execution_plan(prob.choice(b.layouts)) for b in (sym, heu) if b.layouts]
    assert plans
    for plan in plans:
        prev = None
        for g in range(64, 1025, 64):
            t = estimate(
                plan, "llama2-7b", "llama2-7b", hardware=hw, workload=replace(BASE, gen_len=g)
            )["iter_time"]
            assert prev is None or t >= prev[1] * (1 - 1e-9), (
                f"{plan} gen {prev[0]}->{g}: {prev[1]} -> {t}"
            )
            prev = (g, t)
