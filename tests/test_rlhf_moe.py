# Checks PPO and GRPO from mixture-of-experts HF checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral) through
# the runtime, on a plan whose actor trains with experts split by ep (dp2tp2ep4) and generates with
# every expert split by TP (dp2tp2etp2, vLLM's TP experts).
# A failure points to real_py/rlhf/models.py (experts, MoeReallocator), real_py/realloc/executor.py,
# real_py/engines/moe_train.py or real_py/dataflow/execplan.py (ep / etp keys).
"""After one iteration: every metric finite (the aux loss among them), the trained actor's dense and
expert tensors finite and moved from the checkpoint; the critic (PPO) trains from a zero value
head on the MoE body; the reference stays equal to the checkpoint."""

import io

import pytest
import torch
from support import models_oracle as O
from test_models_moe import CASES

from real_py.rlhf import config as CF
from real_py.rlhf.runtime import Runtime
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

PLAN = {
    "world_size": 4,
    "calls": {
        "actor_gen": {
            "ranks": [0, 1, 2, 3],
            "dp": 2,
            "tp": 2,
            "etp": 2,
        },  # experts split by TP, as vLLM
        "ref_inf": {"ranks": [0, 1], "dp": 2, "ep": 2},
        "rew_inf": {"ranks": [2, 3], "dp": 1, "tp": 2},
        "critic_inf": {"ranks": [2, 3], "dp": 1, "pp": 2},
        "actor_train": {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "ep": 4},
        "critic_train": {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "ep": 2},
    },
}
BASE = {
    "ppo": {"ppo_epochs": 1, "mini_batches": 2, "micro_batches": 1, "adam_eps": 1e-6},
    "generation": {"max_new_tokens": 6},
    "critic": {"vocab_size": 97},
}


def _worker(rank, world, runs, out_dir):
    from real_py.cli.export import export_checkpoint, export_live
    from real_py.rlhf import checkpoint

    out = {}
    for name, d in runs:
        cfg = CF.from_dict(d)
        plan, graph, models = CF.validate(cfg, world)
        rt = Runtime(cfg, plan, graph, models, timeout_s=120)
        it = rt.iteration(0)
        out[name] = {"metrics": it["metrics"]}
        for role in ("actor", "critic"):
            eng = rt.models.engines.get(role)
            if eng is not None:
                out[name][role] = {
                    n: p.detach().clone()
                    for n, p in {**eng.model.shard_params, **eng.model.expert_params}.items()
                }
                out[name][role + "_tp"] = eng.shard.tp_rank
        eng = rt.models.engines["actor"]
        if name == "qwen3_moe":
            # HF export (actor and critic) of the live run and of a saved step; resume restores
            # experts
            export_live(rt, f"{out_dir}/{name}-live")
            step = checkpoint.save(rt, f"{out_dir}/{name}-run", 1)
            if rank == 0:
                export_checkpoint(step, f"{out_dir}/{name}-ckpt")
            saved = None if eng is None else eng.experts.flat.clone()
            if eng is not None:
                eng.experts.flat.zero_()
            checkpoint.load(rt, step)
            out[name]["resumed"] = eng is None or torch.equal(eng.experts.flat, saved)
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.timeout(900)
def test_ppo_and_grpo_from_moe_checkpoints(tmp_path):
    runs = []
    for mt in ("qwen3_moe", "qwen2_moe", "mixtral"):
        a = O.make_checkpoint(str(tmp_path / mt), mt, seed=5, **CASES[mt])
        if mt == "qwen3_moe":
            runs.append(
                (
                    mt,
                    dict(
                        BASE, actor_path=a, critic_path=a, critic_init="zero", ref_path=a, plan=PLAN
                    ),
                )
            )
        grpo = {
            "world_size": 4,
            "calls": {k: v for k, v in PLAN["calls"].items() if not k.startswith("critic")},
        }
        runs.append(
            (
                mt + "-grpo",
                dict(
                    BASE, algo="grpo", actor_path=a, ref_path=a, reward={"kind": "rule"}, plan=grpo
                ),
            )
        )
    per_rank = [
        torch.load(io.BytesIO(b), weights_only=False)
        for b in run_distributed(_worker, 4, runs, str(tmp_path), timeout=850)
    ]
    for name, d in runs:
        m = per_rank[0][name]["metrics"]
        assert "moe_aux_loss" in m and m["moe_aux_loss"] > 0, (name, m)
        assert all(torch.isfinite(torch.tensor(float(v))) for v in m.values()), (name, m)
        want = O.load_oracle(d["actor_path"]).state_dict()
        for r in per_rank:
            act = r[name]["actor"]
            assert all(torch.isfinite(v).all() for v in act.values()), name
        experts = [n for n in per_rank[0][name]["actor"] if ".experts." in n]
        assert experts, name
        # the experts were trained: some differ from the checkpoint's (gate|up fused in real_py)
        hf = {
            k.removeprefix("model.").replace("block_sparse_moe", "mlp"): v for k, v in want.items()
        }
        changed = 0
        for n in experts:
            v = per_rank[0][name]["actor"][n]
            stem = n.removesuffix("gate_up_proj.weight")
            if n.endswith("gate_up_proj.weight"):
                g, u = ("w1", "w3") if name.startswith("mixtral") else ("gate_proj", "up_proj")
                orig = torch.cat([hf[stem + g + ".weight"], hf[stem + u + ".weight"]])
            else:
                orig = hf[n.replace("down_proj", "w2")] if name.startswith("mixtral") else hf[n]
            changed += not torch.equal(v, orig)
        assert changed > 0, (name, "no expert moved")

    # export: transformers reloads the written actor; its tensors equal every rank's pieces
    from test_models_moe import hf_grads

    from real_py import ModelConfig, model_spec
    from real_py.realloc.shard import tp_slice

    spec = {p.name: p for p in model_spec(ModelConfig.from_hf(runs[0][1]["actor_path"])).params}
    assert all(r["qwen3_moe"]["resumed"] for r in per_rank)
    critic_spec = {
        p.name: p
        for p in model_spec(ModelConfig.from_hf(runs[0][1]["actor_path"], head="value")).params
    }
    for kind in ("live", "ckpt"):
        for role, head, sp in (("actor", "lm", spec), ("critic", "value", critic_spec)):
            ref = O.load_oracle(str(tmp_path / f"qwen3_moe-{kind}" / role), head)
            for p in ref.parameters():
                p.grad = p.detach().clone()
            fused = hf_grads(ref)  # the parameters themselves, under real_py's fused names
            if head == "value":
                fused["value_head.weight"] = fused.pop("score.weight")
            assert set(fused) == set(sp), (kind, role)
            for r in per_rank:
                k = r["qwen3_moe"][role + "_tp"]
                for n, v in r["qwen3_moe"][role].items():
                    want = fused[n] if sp[n].expert >= 0 else tp_slice(sp[n], fused[n], 2, k)
                    assert torch.equal(v, want), (kind, role, n, k)


def _learn(rank, world, tmp, steps):
    import os

    from test_rlhf_learning import TASK, task_config

    d = task_config("grpo", steps=steps, out_dir=os.path.join(tmp, "moe"))
    import yaml

    with open(os.path.join(TASK, "grpo_moe.yaml")) as f:
        moe = yaml.safe_load(f)
    d.update(actor=moe["actor"], plan=moe["plan"])
    cfg = CF.from_dict(d)
    plan, graph, models = CF.validate(cfg, world)
    rt = Runtime(cfg, plan, graph, models, timeout_s=120)
    return [rt.iteration(s)["metrics"]["reward"] for s in range(steps)]


@pytest.mark.timeout(600)
def test_grpo_moe_learns_copy_task(tmp_path):
    """configs/copy_task/grpo_moe.yaml (4 experts, top-2, aux loss 0.01; trains on dp2tp2ep2,
    generates on dp4ep4): the mean reward of steps 32-36 exceeds that of steps 1-5 by 0.4 (recorded
    in bench/results/learning_moe_cpu2_20261204.md, seed 1: 0.20 over steps 1-5, 0.76 over steps
    31-35)."""
    rewards = run_distributed(_learn, 4, str(tmp_path), 36, timeout=550)[0]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first > 0.4, rewards
