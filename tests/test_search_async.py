# Checks the async-mode plan simulator (issue 22 item 4): on a hand-built plan with generation and training on disjoint devices the steady-state step is max(rollout side, train side) + reallocation, the sum in sync mode; k = 0 is the synchronous simulator; bad k is refused.
# A failure points to real_py/search/async_sim.py.
from types import SimpleNamespace

import pytest

from real_py.search import Mesh, Workload, simulate
from real_py.search.async_sim import simulate_async
from real_py.search.graph import search_graph
from real_py.search.problem import Option

GRPO = search_graph("grpo")        # actor_gen, ref_inf, rew_inf, actor_train


def hand(iters=4):
    # gen [0,2) 2 s, ref [0,2) 0.5 s, rew [0,2) 0.5 s (rollout side 3 s); actor_train [2,4) 2 s;
    # actor reallocation train -> gen layout 0.25 s; free data transfers.
    def opt(start, t, weights=0.0):
        return Option(Mesh(start, 2), 2, 1, 1, t, 0.0, 0.0, weights)

    options = [[opt(0, 2.0, weights=1)], [opt(0, 0.5)], [opt(0, 0.5)], [opt(2, 2.0)]]
    return SimpleNamespace(calls=GRPO, names=[c.name for c in GRPO], options=options, num_gpus=4, rpn=4,
                           hw=SimpleNamespace(intra_bw=1e30, inter_bw=1e30, intra_lat=0.0, inter_lat=0.0,
                                              mem_limit=100.0),
                           wl=Workload(), iters=iters, realloc_time=lambda c, s, d: 0.25)


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
