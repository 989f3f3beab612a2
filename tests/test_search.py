# Checks the PPO plan simulator (hand-built timelines), C++/Python simulator agreement, that the
# C++ annealer finds the exhaustive optimum on small clusters, baselines, bad input and the CLI;
# a failure points to real_py/search/{simulate,problem,search}.py or csrc/search/*.cpp.
import itertools
import json
import math
import random
from types import SimpleNamespace

import pytest

from real_py import _C
from real_py.cli import main
from real_py.dataflow.execplan import ExecutionPlan
from real_py.search import Mesh, Problem, Workload, estimate, plan_search, ppo_models, simulate
from real_py.search.graph import PPO_GRAPH
from real_py.search.hardware import HardwareProfile, get_profile
from real_py.search.problem import Option
from real_py.spec import ModelConfig

pytestmark = pytest.mark.timeout(120)

FAST = HardwareProfile(
    name="fast",
    peak_flops=1e12,
    flops_eff=1,
    hbm_bw=1e12,
    hbm_eff=1,
    intra_bw=1e30,
    inter_bw=1e30,
    intra_lat=0.0,
    inter_lat=0.0,
    mem_bytes=100,
    mem_usable=1.0,
    ranks_per_node=4,
)


def hand_problem(mem=100.0, iters=1, cores=0):
    # gen [0,2) 1 s (weights from actor_train [0,4)), ref [2,4) 2 s, rew [0,2) 0.5 s,
    # critic_inf on critic_train's layout [0,2) 1 s, actor_train [0,4) 3 s, critic_train [0,2) 2 s.
    # cores > 0: the ranks share that many cores, every rank of a call busy and working.
    def opt(start, size, dp, t, persist=0.0, transient=0.0, weights=0.0):
        return Option(Mesh(start, size), dp, 1, 1, t, persist, transient, weights, {}, size, size)

    options = [
        [opt(0, 2, 2, 1.0, transient=5, weights=3)],
        [opt(2, 2, 2, 2.0)],
        [opt(0, 2, 2, 0.5)],
        [opt(0, 2, 2, 1.0)],
        [opt(0, 4, 4, 3.0, persist=10)],
        [opt(0, 2, 2, 2.0)],
    ]
    calls = []
    prob = SimpleNamespace(
        calls=PPO_GRAPH,
        names=[c.name for c in PPO_GRAPH],
        options=options,
        num_gpus=4,
        rpn=4,
        hw=SimpleNamespace(
            intra_bw=1e30,
            inter_bw=1e30,
            intra_lat=0.0,
            inter_lat=0.0,
            mem_limit=mem,
            shared_cores=cores,
        ),
        wl=Workload(),
        iters=iters,
        realloc_time=lambda c, s, d: calls.append(c) or 0.25,
    )
    return prob, calls


def test_hand_built_timeline():
    prob, _ = hand_problem()
    r = simulate(prob, [0] * 6)
    got = [(e.label, e.start, e.end, e.ranks) for e in r.events]
    assert got == [
        ("realloc actor", 0.0, 0.25, ((0, 2), (0, 4))),
        ("actor_gen", 0.25, 1.25, ((0, 2),)),
        ("ref_inf", 1.25, 3.25, ((2, 4),)),  # concurrent with rew_inf: disjoint meshes
        ("rew_inf", 1.25, 1.75, ((0, 2),)),
        ("critic_inf", 1.75, 2.75, ((0, 2),)),  # same layout as critic_train: no reallocation
        ("actor_train", 3.25, 6.25, ((0, 4),)),
        ("critic_train", 6.25, 8.25, ((0, 2),)),  # shares devices 0-1 with actor_train
    ]
    assert r.iter_time == 8.25
    ev = _C.SearchEvaluator(Problem.graph_dict(prob), prob.realloc_time)
    c = ev.simulate([0] * 6, True)
    assert c["iter_time"] == 8.25
    assert [(t[3], t[4]) for t in c["tasks"]] == [(e.start, e.end) for e in r.events]


def test_hand_built_timeline_on_shared_cores():
    """4 ranks on 2 cores: a call placed beside running calls is stretched by
    contention(busy + their working ranks over its interval) / contention(busy)."""
    prob, _ = hand_problem(cores=2)
    r = simulate(prob, [0] * 6)
    got = [(e.label, e.start, e.end) for e in r.events]
    assert got == [
        ("realloc actor", 0.0, 0.25),
        ("actor_gen", 0.25, 1.25),
        ("ref_inf", 1.25, 3.25),  # placed beside nothing running
        ("rew_inf", 1.25, 2.25),  # beside ref_inf's 2 ranks: 4 busy on 2 cores, 0.5 s -> 1 s
        ("critic_inf", 2.25, 4.25),  # its whole second beside ref_inf: 1 s -> 2 s
        ("actor_train", 4.25, 7.25),  # alone: 4 busy, already in its 3 s
        ("critic_train", 7.25, 9.25),
    ]
    assert r.iter_time == 9.25
    ev = _C.SearchEvaluator(Problem.graph_dict(prob), prob.realloc_time)
    c = ev.simulate([0] * 6, True)
    assert c["iter_time"] == 9.25
    assert [(t[3], t[4]) for t in c["tasks"]] == [(e.start, e.end) for e in r.events]
    # ref_inf on one rank for 1.5 s: rew_inf beside 1 working rank, (2 + 1) / 2 = 1.5x -> 0.75 s;
    # critic_inf from 2.0, 0.75 of its 1 s beside it: w = 0.75, (2 + 0.75) / 2 = 1.375x.
    prob.options[1] = [Option(Mesh(2, 1), 1, 1, 1, 1.5, 0.0, 0.0, 0.0, {}, 1, 1)]
    r = simulate(prob, [0] * 6)
    spans = {e.label: (e.start, e.end) for e in r.events}
    assert spans["rew_inf"] == (1.25, 2.0) and spans["critic_inf"] == pytest.approx((2.0, 3.375))
    c = _C.SearchEvaluator(Problem.graph_dict(prob), prob.realloc_time).simulate([0] * 6, True)
    assert [(t[3], t[4]) for t in c["tasks"]] == pytest.approx([(e.start, e.end) for e in r.events])


def test_hand_built_iterations_and_memory():
    prob, calls = hand_problem(iters=2)
    r = simulate(prob, [0] * 6)
    # Iteration 2's reallocation waits for iteration 1's actor_train (ends 6.25) and runs on
    # devices 0-3 once critic_train frees 0-1 at 8.25; everything shifts by 8.25.
    assert [e.start for e in r.events if e.iter == 1][:2] == [8.25, 8.5]
    assert r.makespan == 16.5 and r.iter_time == 8.25
    # Devices 0-1: actor_train 10 persistent + gen 5 transient + 3 weight copy = 18.
    assert r.peak_mem == 18
    prob, _ = hand_problem(mem=17.5)
    assert math.isinf(simulate(prob, [0] * 6).iter_time)
    ev = _C.SearchEvaluator(Problem.graph_dict(prob), prob.realloc_time)
    assert math.isinf(ev.cost([0] * 6))


@pytest.fixture(scope="module")
def prob16():
    models = ppo_models("llama2-7b", "llama2-7b")
    return Problem(models, get_profile("h100"), 16, Workload(gen_len=128), per_mesh=2)


def test_cpp_and_python_simulators_agree(prob16):
    ev = prob16.evaluator()
    rng = random.Random(0)
    finite = 0
    for _ in range(150):
        choice = [rng.randrange(len(o)) for o in prob16.options]
        py, cc = simulate(prob16, choice), ev.simulate(choice)
        if math.isinf(py.iter_time):
            assert math.isinf(cc["iter_time"])
        else:
            finite += 1
            assert cc["iter_time"] == pytest.approx(py.iter_time, rel=1e-12)
        assert cc["peak_mem"] == pytest.approx(py.peak_mem, rel=1e-12)
    assert finite > 10


def _brute_force(prob):
    ev = prob.evaluator()
    best, arg = math.inf, None
    for choice in itertools.product(*(range(len(o)) for o in prob.options)):
        c = ev.cost(list(choice))
        if c < best:
            best, arg = c, choice
    return best, arg


SMALL = ModelConfig(
    hidden_size=2048,
    intermediate_size=5504,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
    num_hidden_layers=24,
)  # ~1.3B


@pytest.mark.parametrize("gpus,min_mesh,actor", [(4, 1, SMALL), (8, 2, "llama2-7b")])
def test_search_finds_exhaustive_optimum(gpus, min_mesh, actor):
    # Small space: the fastest strategy per mesh (per_mesh=1); on 8 devices meshes of >= 2
    # devices only: 7 options per call, 7**6 = 117649 plans enumerated.
    models = ppo_models(actor, SMALL)
    prob = Problem(
        models,
        get_profile("h100"),
        gpus,
        Workload(batch_size=128, gen_len=128),
        per_mesh=1,
        min_mesh_size=min_mesh,
    )
    assert math.prod(len(o) for o in prob.options) <= 120000
    best, arg = _brute_force(prob)
    assert math.isfinite(best)
    res = prob.evaluator().anneal(chains=4, time_budget=60, max_steps=3000, seed=1)
    assert res["best_cost"] <= best * 1.01
    assert res["best_cost"] >= best  # nothing beats the exhaustive optimum
    for st in res["chains"]:
        assert 0 < st["accepted"] < st["steps"]


def test_plan_search_beats_or_matches_baselines_and_estimate_agrees():
    res = plan_search(
        "llama2-7b",
        "llama2-7b",
        num_gpus=16,
        hardware="h100",
        workload=Workload(gen_len=128),
        time_budget=3,
        chains=2,
        seed=0,
    )
    sym, heu = res.baselines["symmetric"], res.baselines["heuristic"]
    assert res.iter_time <= heu.iter_time <= sym.iter_time < math.inf
    plan = ExecutionPlan.from_json(json.loads(json.dumps(res.plan.to_json())))
    assert set(plan.calls) == {c.name for c in PPO_GRAPH}
    est = estimate(plan, "llama2-7b", "llama2-7b", hardware="h100", workload=Workload(gen_len=128))
    assert est["feasible"] and est["iter_time"] == pytest.approx(res.iter_time, rel=1e-12)
    assert 0.1 < est["iter_time"] < 100  # seconds, not ms or us


def test_cluster_too_small_names_memory_need():
    with pytest.raises(
        ValueError, match=r"no layout of call .* smallest per-device need is [0-9.]+ GiB"
    ):
        Problem(ppo_models("llama2-70b", "llama2-70b"), get_profile("h100"), 2, Workload())
    # Each call fits alone on 8 H100, but not all four 70B models with their training state.
    with pytest.raises(
        ValueError, match=r"no feasible plan .* smallest per-device memory need .* [0-9.]+ GiB"
    ):
        plan_search(
            "llama2-70b", "llama2-70b", num_gpus=8, hardware="h100", time_budget=2, chains=1
        )


def test_model_no_layout_fits():
    # 3 heads and one layer: only tp=1, pp=1, and 26 GB of weights + 4x optimizer do not fit.
    big = ModelConfig(
        hidden_size=96000,
        intermediate_size=96000,
        num_attention_heads=3,
        num_key_value_heads=3,
        vocab_size=1000,
        num_hidden_layers=1,
    )
    with pytest.raises(ValueError, match="no layout of call actor_gen|no layout of call ref_inf"):
        Problem(ppo_models(big, big), get_profile("h100"), 8, Workload())


def test_unknown_hardware():
    with pytest.raises(ValueError, match="allowed: a100, h100, h200, cpu"):
        plan_search("llama2-7b", num_gpus=8, hardware="v100")


def test_cli_writes_plan_and_png(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(
        [
            "search",
            "--model",
            "llama2-7b",
            "--critic",
            "llama2-7b",
            "--gpus",
            "16",
            "--hardware",
            "h100",
            "--gen-len",
            "384",
            "--time-budget",
            "1",
            "--chains",
            "2",
            "--out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    assert ExecutionPlan.from_json(str(out)).world_size == 16
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "symmetric" in text and "heuristic" in text and "acceptance" in text


def test_annealing_is_independent_of_the_time_unit(prob16):
    # ReaL's search mixed ms and us; here acceptance depends on relative change only. Times
    # scaled by 1024 (exact in binary floating point) must give the same walk, move for move.
    g = prob16.graph_dict()
    scaled = dict(
        g,
        options=[o.copy() for o in g["options"]],
        intra_bw=g["intra_bw"] / 1024,
        inter_bw=g["inter_bw"] / 1024,
        intra_lat=g["intra_lat"] * 1024,
        inter_lat=g["inter_lat"] * 1024,
    )
    for o in scaled["options"]:
        o[:, 5] *= 1024
    runs = []
    for graph, unit in ((g, 1.0), (scaled, 1024.0)):
        ev = _C.SearchEvaluator(
            graph, lambda c, s, d, unit=unit: prob16.realloc_time(c, s, d) * unit
        )
        runs.append(ev.anneal(chains=2, time_budget=60, max_steps=4000, seed=3))
    a, b = runs
    assert a["best"] == b["best"]
    assert b["best_cost"] == a["best_cost"] * 1024
    assert [c["accepted"] for c in a["chains"]] == [c["accepted"] for c in b["chains"]]


@pytest.mark.parametrize("algo", ["grpo", "remax"])
def test_search_places_the_runtimes_graph(algo, tmp_path):
    """The search's calls are the runtime's (real_py.dataflow.graph): a critic-free algorithm has no
    critic calls, ReMax's greedy generation is placed (and reallocated like actor_gen), and the
    plan it writes passes the train job's validation for that algorithm."""
    from real_py.dataflow.graph import ALGORITHMS, Graph
    from real_py.rlhf import config as CF
    from real_py.search.graph import search_graph

    assert search_graph("ppo") == PPO_GRAPH
    graph = search_graph(algo)
    assert [c.name for c in graph] == list(Graph(ALGORITHMS[algo]).order)
    assert not any(c.model == "critic" for c in graph)
    res = plan_search("llama2-7b", num_gpus=8, hardware="h100", time_budget=2, algo=algo)
    assert set(res.plan.calls) == {c.name for c in graph}
    if algo == "remax":
        greedy = graph[[c.name for c in graph].index("actor_greedy")]
        assert greedy.kind == "generate" and greedy.weight_src == "actor_train"
    path = tmp_path / "plan.json"
    res.plan.save(str(path))
    cfg = CF.from_dict({"algo": algo, "plan": {"path": str(path)}, "reward": {"kind": "rule"}})
    assert set(cfg.execution_plan().calls) == {c.name for c in graph}
