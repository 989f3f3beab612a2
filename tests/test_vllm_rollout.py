"""The runtime generating with vLLM (generation.engine: vllm): vLLM inside the 4 gloo ranks
(external_launcher), the actor's weights reallocated from its train layout into vLLM's live
format every step, vLLM's sampled-token log-probs kept as rollout_logp and old_logp recomputed
by the trainer. Checked against the built-in engine on the same weights (greedy tokens equal,
log-prob gap within fp32 noise) over steps that really move weights (train dp2,tp2 or
tp2,pp2 -> vLLM dp2 x tp2 or dp4 x tp1).
A failure points to real_py/vllm/rollout.py, real_py/rlhf/models.py (attach_rollout) or
real_py/rlhf/calls.py (_generate_vllm, the gap metrics)."""

from __future__ import annotations

import pytest
import torch
from support import vllm_cases

from real_py.rlhf import config as CF
from real_py.rlhf.ppo import response_mask
from real_py.rlhf.runtime import Runtime
from real_py.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.vllm, pytest.mark.timeout(900)]

CALLS = ("actor_gen", "ref_inf", "rew_inf", "actor_train")


def _plan(gen: str, train: str) -> dict:
    from real_py import Layout

    def one(text):
        lay = Layout.parse(text)
        return {"ranks": list(lay.ranks), "dp": lay.dp, "tp": lay.tp, "pp": lay.pp}

    return {
        "world_size": 4,
        "calls": {
            "actor_gen": one(gen),
            "ref_inf": one("dp4"),
            "rew_inf": one("dp4"),
            "actor_train": one(train),
        },
    }


def _config(ckpt, out, engine, gen="dp2,tp2", train="dp1,tp2,pp2", **kw) -> dict:
    return {
        "algo": "grpo",
        "steps": 2,
        "seed": 3,
        "actor_path": str(ckpt),
        "out_dir": str(out),
        "save_every": 0,
        "reward": {"kind": "rule", "target_token": 7},
        "data": {"batch_size": 8, "max_prompt_len": 8, "min_prompt_len": 4},
        "ppo": {
            "group_size": 2,
            "ppo_epochs": 1,
            "mini_batches": 1,
            "actor_lr": 1e-2,
            **kw.pop("ppo", {}),
        },
        "generation": {
            "engine": engine,
            "max_new_tokens": 6,
            "vllm_kv_cache_gib": 1,
            **kw.pop("generation", {}),
        },
        "plan": _plan(gen, train),
        **kw,
    }


def _job(rank, world, d):
    cfg = CF.from_dict(d)
    plan, graph, models = CF.validate(cfg, world)
    rt = Runtime(cfg, plan, graph, models, timeout_s=300)
    out = []
    for step in range(cfg.steps):
        res = rt.iteration(step)
        st = res["store"]
        # rank 0 holds every row of the rollout keys (dp4 reference call reads them all)
        out.append(
            {
                k: st.data[k].tolist()
                for k in ("tokens", "lengths", "prompt_lengths", "old_logp", "rollout_logp")
                if k in st.data
            }
            | {"metrics": res["metrics"]}
        )
    with open("/proc/self/maps") as f:  # vLLM's CPU tp-group segments this rank maps
        shm = sorted({line.split(None, 5)[5].strip() for line in f if "cpushm" in line})
    rt.close()  # vLLM's teardown now, while the groups live (and so no tracebacks at exit)
    return (out, shm) if rank == 0 else None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_rollout")
    vllm_cases.write_checkpoint(root / "actor", vocab=500, heads=4, kv_heads=2, layers=2, tie=True)
    return root


def test_vllm_generation_equals_the_builtin_engine_over_steps(ckpt):
    """Greedy: step 0 (the checkpoint) and step 1 (after an update pushed from dp1,tp2,pp2 into
    vLLM dp2 x tp2) give the built-in engine's tokens; old_logp (the trainer's recompute) is
    within fp32 noise of vLLM's rollout_logp, and the step reports the gap."""
    runs = {}
    for engine in ("builtin", "vllm"):
        d = _config(ckpt / "actor", ckpt / f"out_{engine}", engine, generation={"greedy": True})
        runs[engine], shm = run_distributed(_job, 4, d, timeout=600, pg_timeout=300)[0]
    # vLLM's tp group talks through /dev/shm segments whose names are the same for every job
    # under the external launcher: their names are gone once vLLM started (the next job with
    # tp > 1 on this machine would fail to create them), the mappings stay.
    assert shm and all(p.endswith("(deleted)") for p in shm), shm
    runs = {
        k: [{n: torch.tensor(x) if n != "metrics" else x for n, x in s.items()} for s in r]
        for k, r in runs.items()
    }
    for step in range(2):
        b, v = runs["builtin"][step], runs["vllm"][step]
        assert torch.equal(b["lengths"], v["lengths"]), step
        assert torch.equal(b["tokens"], v["tokens"]), step
        mask = response_mask(v["prompt_lengths"], v["lengths"], v["tokens"].shape[1])
        assert mask.sum() > 0
        gap = ((v["old_logp"] - v["rollout_logp"]).abs() * mask).max().item()
        assert gap < 1e-4, (step, gap)
        assert (
            (v["rollout_logp"] != 0).float() * (1 - mask)
        ).sum() == 0  # nothing off the response
        assert 0 <= v["metrics"]["rollout_logp_diff"] < 1e-4
        assert abs(v["metrics"]["rollout_kl"]) < 1e-6
        # the trainer's recompute equals the built-in engine's log-probs of the same tokens
        assert ((v["old_logp"] - b["old_logp"]).abs() * mask).max().item() < 1e-4
    assert not torch.equal(
        runs["vllm"][0]["tokens"], runs["vllm"][1]["tokens"]
    )  # the weights moved


def test_vllm_sampling_is_seeded_per_row_and_tis_weights_apply(ckpt):
    """Sampling at temperature 1 (dp4 x tp1 replicas from a dp2,tp2 trainer): two runs with the
    same seeds give the same tokens; tis_cap reports the capped share. The second run takes
    vLLM's log-probs as old_logp (generation.vllm_logp: rollout): no recompute, no gap metric,
    and its old_logp are the first run's rollout_logp (the same weights at step 0)."""
    outs = []
    for i, extra in enumerate(
        ({"ppo": {"tis_cap": 2.0}}, {"generation": {"vllm_logp": "rollout"}})
    ):
        d = _config(ckpt / "actor", ckpt / f"out_s{i}", "vllm", gen="dp4", train="dp2,tp2", **extra)
        outs.append(run_distributed(_job, 4, d, timeout=600, pg_timeout=300)[0][0])
    assert outs[0][0]["tokens"] == outs[1][0]["tokens"]
    m = outs[0][1]["metrics"]
    assert 0.0 <= m["tis_capped_frac"] <= 1.0 and m["rollout_logp_diff"] < 1e-3, m
    recomputed, taken = outs[0][0], outs[1][0]
    assert "rollout_logp_diff" not in outs[1][1]["metrics"]
    assert not torch.tensor(taken["rollout_logp"]).any()  # nothing writes it
    assert torch.equal(torch.tensor(taken["old_logp"]), torch.tensor(recomputed["rollout_logp"]))
    assert torch.tensor(taken["old_logp"]).abs().sum() > 0
