# Checks PPO and GRPO iterations with actor, critic and reward loaded from transformers checkpoints
# on 4 gloo ranks whose calls use different layouts (weights reallocated), against the checkpoint
# tensors and a one-process run.
# A failure points to real_py/interop/hf.py load_hf_shard (the spec name a loaded shard carries,
# slicing) or real_py/rlhf/models.py (loading models from paths, reallocation of loaded shards).
"""Checkpoints are written by transformers' save_pretrained (LlamaForCausalLM, and
LlamaForSequenceClassification with num_labels=1 for critic and reward). Oracle for the loaded
and reallocated shards: tests/support/oracle.py (oracle_flat) over the HF tensors fused by
models_oracle.fused_state (bit for bit). The 4-rank iteration must produce the same tokens as the
one-process iteration (per-sequence seeded sampling) and metrics within 1e-4.
"""

import io
import json
import os

import pytest
import torch
import transformers
from support import models_oracle as O
from support.oracle import data_mask, oracle_flat

from real_py.rlhf import config as CF
from real_py.rlhf.runtime import Runtime
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

HF = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=4,
    vocab_size=64,
    max_position_embeddings=64,
)
BASE = {
    "ppo": {"ppo_epochs": 1, "mini_batches": 2, "adam_eps": 1e-6},
    "generation": {"max_new_tokens": 6},
    "save_every": 0,
}
GRPO_PLAN = CF.load(
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "grpo_cpu4.yaml"
    )
).plan
# Calls whose weights are checked against the checkpoint: the actor and critic after reallocation
# out of their train layouts, the frozen models as loaded.
CHECKED = {
    "ppo": ("actor_gen", "critic_inf", "ref_inf", "rew_inf"),
    "grpo": ("actor_gen", "ref_inf", "rew_inf"),
}


def _save(tmp):
    for name, cls, seed in (
        ("actor", transformers.LlamaForCausalLM, 0),
        ("critic", transformers.LlamaForSequenceClassification, 1),
        ("reward", transformers.LlamaForSequenceClassification, 2),
    ):
        torch.manual_seed(seed)
        kw = dict(HF, num_labels=1) if name != "actor" else HF
        model = cls(transformers.LlamaConfig(**kw))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.1)
        model.save_pretrained(os.path.join(tmp, name), safe_serialization=True)


def _cases(tmp, single: bool):
    paths = {m + "_path": os.path.join(tmp, m) for m in ("actor", "critic", "reward")}
    ppo, grpo = (
        dict(BASE, **paths),
        dict(  # no critic_path: GRPO has no critic (refused before launch)
            BASE,
            algo="grpo",
            **{k: v for k, v in paths.items() if k != "critic_path"},
            data={"batch_size": 16},
            ppo=dict(BASE["ppo"], group_size=4),
        ),
    )
    if single:
        ppo["plan"] = CF.single_process_plan(CF.from_dict(ppo).graph())
        grpo["plan"] = CF.single_process_plan(CF.from_dict(grpo).graph())
    else:
        grpo["plan"] = GRPO_PLAN
    return {"ppo": ppo, "grpo": grpo}


def _worker(rank, world, tmp, single):
    full = {
        m: O.fused_state(O.load_oracle(os.path.join(tmp, m), "lm" if m == "actor" else "value"))
        for m in ("actor", "critic", "reward")
    }
    full["ref"] = full["actor"]
    out = {}
    for algo, d in _cases(tmp, single).items():
        cfg = CF.from_dict(d)
        plan, graph, models = CF.validate(cfg, world)
        rt = Runtime(cfg, plan, graph, models, timeout_s=120)
        rt.samples_path = os.path.join(tmp, f"samples_{algo}_{world}.jsonl")
        checked = []
        for call in CHECKED[algo]:
            engine, stats = rt.models.engine_for(call)  # collective: every rank, same order
            if engine is None:
                continue
            m, layout = graph.calls[call].model, plan.calls[call]
            want = oracle_flat(engine.shard.model, layout, rank, full[m])
            keep = data_mask(engine.shard.model, layout, rank)
            assert engine.shard.model.name == m, (call, engine.shard.model.name)
            assert torch.equal(engine.shard.flat[keep], want[keep]), (
                f"rank {rank} {call}: weights differ from the checkpoint"
            )
            checked.append((call, stats is not None))
        it = rt.iteration(0)
        store = it.pop("store")
        out[algo] = {
            "checked": checked,
            "metrics": it["metrics"],
            "realloc_bytes": it["realloc_bytes"],
            "realloc_seconds": it["realloc_seconds"],
            "tokens": store.data["tokens"],
            "lengths": store.data["lengths"],
        }
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _load(b):
    return torch.load(io.BytesIO(b), weights_only=False)


@pytest.mark.timeout(300)
def test_hf_models_reallocated_through_ppo_and_grpo(tmp_path):
    """Every loaded or reallocated shard equals slicing the checkpoint; a PPO and a GRPO iteration
    run on 4 ranks with the actor (and critic) reallocated, and match the one-process run."""
    _save(str(tmp_path))
    one = _load(run_distributed(_worker, 1, str(tmp_path), True, timeout=200)[0])
    four = [_load(b) for b in run_distributed(_worker, 4, str(tmp_path), False, timeout=280)]
    for algo in ("ppo", "grpo"):
        calls = {c for r in four for c, _ in r[algo]["checked"]}
        assert calls == set(CHECKED[algo]), (algo, calls)
        moved = {c for r in four for c, realloc in r[algo]["checked"] if realloc}
        assert {"actor_gen"} <= moved and (algo == "grpo" or "critic_inf" in moved), (algo, moved)
        got, ref = four[0][algo], one[algo]
        assert got["realloc_bytes"] > 0 and "actor" in got["realloc_seconds"]
        # A rank holds the rows of the calls it is in; every row is held by some rank.
        held = torch.zeros(len(ref["lengths"]), dtype=torch.bool)
        for r in four:
            rows = r[algo]["lengths"] > 0
            held |= rows
            assert torch.equal(r[algo]["tokens"][rows], ref["tokens"][rows]), algo
            assert torch.equal(r[algo]["lengths"][rows], ref["lengths"][rows]), algo
        assert bool(held.all()), algo
        for k, v in ref["metrics"].items():
            assert abs(got["metrics"][k] - v) < 1e-4, (algo, k, got["metrics"][k], v)
        assert {"reward", "kl", "policy_loss"} <= set(got["metrics"])
        # Samples of a reward model without a tokenizer: token ids, the rows' scores' mean agrees.
        with open(tmp_path / f"samples_{algo}_4.jsonl") as f:
            samples = [json.loads(line) for line in f]
        assert [s["row"] for s in samples] == [0, 1, 2, 3] and {s["step"] for s in samples} == {1}
        for s in samples:
            n = int(ref["lengths"][s["row"]])
            assert s["prompt"] + s["response"] == ref["tokens"][s["row"], :n].tolist()
            assert isinstance(s["reward"], float)
