# Checks the async-mode plan simulator and search: on a hand-built plan with
# generation and training on disjoint devices the steady-state step is max(rollout side, train
# side) + reallocation, the sum in sync mode; k = 0 is the synchronous simulator; bad k is
# refused; the C++ simulator agrees with the Python one in async mode; plan_search chooses the
# async mode (and the disjoint placement it rewards) when allowed and faster.
# A failure points to real_py/search/simulate.py, csrc/search/simulate.cpp or search.py.
import math
import random
from types import SimpleNamespace

import pytest

from real_py import _C
from real_py.search import Mesh, Problem, Workload, plan_search, ppo_models, simulate
from real_py.search.graph import search_graph
from real_py.search.hardware import get_profile
from real_py.search.problem import Option
from real_py.spec import ModelConfig


def simulate_async(prob, choice, k):
    return simulate(prob, choice, staleness=k)


GRPO = search_graph("grpo")  # actor_gen, ref_inf, rew_inf, actor_train


def hand(iters=4):
    # gen [0,2) 2 s, ref [0,2) 0.5 s, rew [0,2) 0.5 s (rollout side 3 s); actor_train [2,4) 2 s;
    # actor reallocation train -> gen layout 0.25 s; free data transfers.
    def opt(start, t, weights=0.0):
        return Option(Mesh(start, 2), 2, 1, 1, t, 0.0, 0.0, weights)

    options = [[opt(0, 2.0, weights=1)], [opt(0, 0.5)], [opt(0, 0.5)], [opt(2, 2.0)]]
    return SimpleNamespace(
        calls=GRPO,
        names=[c.name for c in GRPO],
        options=options,
        num_gpus=4,
        rpn=4,
        hw=SimpleNamespace(
            intra_bw=1e30, inter_bw=1e30, intra_lat=0.0, inter_lat=0.0, mem_limit=100.0
        ),
        wl=Workload(),
        iters=iters,
        realloc_time=lambda c, s, d: 0.25,
    )


def test_async_step_is_the_slower_side_plus_transfer():
    prob = hand()
    assert [c.name for c in GRPO] == ["actor_gen", "ref_inf", "rew_inf", "actor_train"]
    sync = simulate(prob, [0] * 4)
    assert sync.iter_time == pytest.approx(0.25 + 3.0 + 2.0)
    for k in (1, 2):
        r = simulate_async(prob, [0] * 4, k)
        assert r.iter_time == pytest.approx(0.25 + 3.0), k
    assert simulate_async(prob, [0] * 4, 0).iter_time == sync.iter_time
    # train side slower: the step follows it
    prob.options[3] = [Option(Mesh(2, 2), 2, 1, 1, 5.0, 0.0, 0.0, 0.0)]
    assert simulate_async(prob, [0] * 4, 1).iter_time == pytest.approx(0.25 + 5.0)


def test_async_versions_order_and_bad_k():
    prob = hand(iters=3)
    r = simulate_async(prob, [0] * 4, 1)
    gen = [e for e in r.events if e.call == "actor_gen" and not e.realloc]
    trn = [e for e in r.events if e.call == "actor_train" and not e.realloc]
    # batch s + 1's generation starts before batch s's training ends (overlap) but after the
    # training of batch s - 1 (its weights)
    for s in range(1, 3):
        assert gen[s + 1].start < trn[s].end and gen[s + 1].start >= trn[s - 1].end
    with pytest.raises(ValueError, match="k=-1"):
        simulate_async(prob, [0] * 4, -1)


def test_cpp_agrees_in_async_mode():
    prob = hand(iters=3)
    for k in (0, 1, 2):
        py = simulate(prob, [0] * 4, staleness=k)
        ev = _C.SearchEvaluator(
            Problem.graph_dict(SimpleNamespace(**vars(prob), staleness=k)), prob.realloc_time
        )
        cc = ev.simulate([0] * 4, True)
        assert cc["iter_time"] == pytest.approx(py.iter_time, rel=1e-12), k
        assert [(t[1], t[3], t[4]) for t in cc["tasks"]] == [
            (e.iter, e.start, e.end) for e in py.events
        ], k


@pytest.fixture(scope="module")
def grpo16():
    models = ppo_models("llama2-7b", "llama2-7b")
    return [
        Problem(
            models,
            get_profile("h100"),
            16,
            Workload(gen_len=512),
            per_mesh=2,
            graph=search_graph("grpo"),
            staleness=k,
        )
        for k in (0, 1, 2)
    ]


def test_cpp_and_python_agree_on_random_async_plans(grpo16):
    rng = random.Random(0)
    finite = 0
    for prob in grpo16[1:]:
        ev = prob.evaluator()
        for _ in range(60):
            choice = [rng.randrange(len(o)) for o in prob.options]
            py, cc = simulate(prob, choice), ev.simulate(choice)
            if math.isinf(py.iter_time):
                assert math.isinf(cc["iter_time"])
                continue
            finite += 1
            assert cc["iter_time"] == pytest.approx(py.iter_time, rel=1e-12)
            # never slower than the same plan run synchronously
            assert py.iter_time <= simulate(prob, choice, staleness=0).iter_time * (1 + 1e-12)
    assert finite > 20


def test_search_chooses_async_and_reports_the_mode():
    # Few long responses (decoding bound by weight reads: more devices barely speed it up) and
    # 4 epochs of training: running both sides at once on their own devices pays.
    wl = Workload(batch_size=32, gen_len=1024, ppo_epochs=4, ppo_minibatches=2)
    kw = dict(
        num_gpus=16,
        hardware="h100",
        workload=wl,
        time_budget=60,
        max_steps=2000,
        chains=2,
        seed=0,
        algo="grpo",
    )
    sync = plan_search("llama2-7b", **kw)
    asy = plan_search("llama2-7b", **kw, max_staleness=1)
    assert sync.staleness == 0
    # Allowed to overlap, the search finds a faster step, in async mode, than any synchronous plan.
    assert asy.staleness == 1 and asy.iter_time < sync.iter_time
    assert asy.stats["sync_iter_time"] > asy.iter_time
    # The chosen plan's timeline overlaps generation of batch s + 1 with training of batch s.
    ev = asy.simulate().events
    gen = [e for e in ev if e.call == "actor_gen" and not e.realloc and e.iter >= 0]
    trn = [e for e in ev if e.call == "actor_train" and not e.realloc]
    assert any(g.start < t.end and t.start < g.end for g in gen for t in trn)


def test_search_keeps_sync_when_async_gains_nothing():
    # One device: everything shares it, overlap is impossible, so the mode chosen is 0.
    small = ModelConfig(
        hidden_size=2048,
        intermediate_size=5504,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        num_hidden_layers=24,
    )  # ~1.3B
    res = plan_search(
        small,
        num_gpus=1,
        hardware="h100",
        workload=Workload(batch_size=16, gen_len=64),
        time_budget=1,
        chains=1,
        seed=0,
        algo="grpo",
        max_staleness=2,
    )
    assert res.staleness == 0 and res.iter_time == pytest.approx(res.stats["sync_iter_time"])
