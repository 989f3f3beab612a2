"""The plan search for a run that generates with vLLM (plan_search(engine="vllm"), `search
--engine vllm`): the sampling call only on layouts vLLM can run inside the ranks, the recompute
call placed too, and a fixed plan vLLM cannot run refused by name."""

import pytest

from real_py.dataflow.execplan import ExecutionPlan
from real_py.dataflow.rules import vllm_layout_errors
from real_py.layout import Layout
from real_py.search import Workload, estimate, plan_search
from real_py.search.graph import ppo_models, search_graph
from real_py.search.hardware import get_profile
from real_py.search.problem import Problem

WL = Workload(batch_size=64, prompt_len=128, gen_len=256, ppo_minibatches=2, group_size=4)


def test_vllm_search_places_the_sampling_call_only_where_vllm_runs():
    models = ppo_models("llama2-7b")
    kw = dict(graph=search_graph("grpo", "vllm"), grouped=True)
    plain = Problem(models, get_profile("h100"), 8, WL, graph=search_graph("grpo"), grouped=True)
    vllm = Problem(models, get_profile("h100"), 8, WL, vllm_call="actor_gen", **kw)
    gen = plain.names.index("actor_gen")
    runnable = lambda o: not vllm_layout_errors(o.layout(), 8, models.actor.config)
    assert not all(runnable(o) for o in plain.options[gen])  # the filter has work to do
    opts = vllm.options[vllm.names.index("actor_gen")]
    assert opts and all(runnable(o) for o in opts)
    assert {o.key for o in opts} == {o.key for o in plain.options[gen] if runnable(o)}
    assert "actor_logp" in vllm.names and "actor_logp" not in plain.names

    res = plan_search(
        "llama2-7b",
        algo="grpo",
        num_gpus=8,
        hardware="h100",
        workload=WL,
        time_budget=2,
        chains=1,
        engine="vllm",
    )
    assert vllm_layout_errors(res.plan.calls["actor_gen"], 8, models.actor.config) == []
    assert "actor_logp" in res.plan.calls


def test_estimate_refuses_a_plan_vllm_cannot_run_naming_the_call():
    pp2 = Layout(dp=2, tp=1, pp=2, ranks=(0, 1, 2, 3))
    lay = Layout(dp=4, tp=1, pp=1, ranks=(0, 1, 2, 3))
    calls = {c.name: lay for c in search_graph("grpo", "vllm")}
    ok = ExecutionPlan(world_size=4, ranks_per_node=4, calls=calls)
    wl = Workload(batch_size=32, ppo_minibatches=2, group_size=4)
    assert (
        "actor_logp" in estimate(ok, "llama2-7b", workload=wl, algo="grpo", engine="vllm")["calls"]
    )
    bad = ExecutionPlan(world_size=4, ranks_per_node=4, calls={**calls, "actor_gen": pp2})
    estimate(bad, "llama2-7b", workload=wl, algo="grpo")  # the built-in engine runs it
    with pytest.raises(
        ValueError, match=r"call actor_gen on vLLM: pp=2: vLLM generation runs dp x tp"
    ):
        estimate(bad, "llama2-7b", workload=wl, algo="grpo", engine="vllm")


def test_vllm_logp_rollout_searches_without_the_recompute_call():
    # generation.vllm_logp: rollout (vLLM's log-probs are old_logp): the graph the run has
    assert [c.name for c in search_graph("grpo", "vllm", "rollout")] == [
        c.name for c in search_graph("grpo")
    ]
    res = plan_search(
        "llama2-7b",
        algo="grpo",
        num_gpus=8,
        hardware="h100",
        workload=WL,
        time_budget=1,
        chains=1,
        engine="vllm",
        vllm_logp="rollout",
    )
    assert "actor_logp" not in res.plan.calls
    assert (
        vllm_layout_errors(res.plan.calls["actor_gen"], 8, ppo_models("llama2-7b").actor.config)
        == []
    )
    with pytest.raises(ValueError, match=r"vllm_logp='rollout' needs engine='vllm'"):
        search_graph("grpo", "builtin", "rollout")
    with pytest.raises(ValueError, match=r"vllm_logp='sometimes'; allowed"):
        search_graph("grpo", "vllm", "sometimes")
