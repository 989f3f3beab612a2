# Checks PPO model initialisation from HF checkpoints: a critic on the actor's causal-LM checkpoint
# with a fresh value head (critic_init), a reference from its own ref_path, and the vocab /
# tokenizer checks before ranks start.
# A failure points to real_py/interop/hf.py load_hf_shard (fresh head, spec name),
# real_py/rlhf/models.py (paths, critic_init) or real_py/rlhf/config/ (checks.py _check_vocab,
# files.py check_same_tokenizer, critic_init, ref_path).
"""The 4-rank run uses the default execution plan: the critic lives on dp2tp2 (train) and is
reallocated to pp2 for inference, the reference on dp2 ranks 0-1; the gathered weights are
compared bit for bit with the checkpoints' tensors (transformers' own state dict)."""

import io
import json
import os

import pytest
import torch
from support import models_oracle as O

from real_py.interop.hf import gather_state_dict
from real_py.rlhf import config as CF
from real_py.rlhf.runtime import Runtime
from real_py.testing import run_distributed

BASE = {
    "ppo": {"ppo_epochs": 1, "mini_batches": 2, "micro_batches": 1, "adam_eps": 1e-6},
    "generation": {"max_new_tokens": 6},
}
CRITIC = {"vocab_size": 97}  # the random-init reward (TINY critic shape) covers the actor vocab


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("init")
    return {
        "actor": O.make_checkpoint(str(d / "actor"), "llama", seed=1),
        "ref": O.make_checkpoint(str(d / "ref"), "llama", seed=2),
        "small": O.make_checkpoint(str(d / "small"), "llama", seed=3, vocab_size=90),
    }


def _tokenizer(path, vocab):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(os.path.join(path, "tokenizer.json"))


def test_vocab_and_tokenizer_checks_before_ranks_start(ckpts, tmp_path):
    a = ckpts["actor"]
    with pytest.raises(
        ValueError, match=r"critic has vocab_size=64 .* actor .* emits ids up to 96"
    ):
        CF.from_dict({"actor_path": a})
    with pytest.raises(ValueError, match=r"reward has vocab_size=64"):
        CF.from_dict({"actor_path": a, "algo": "grpo"})
    CF.from_dict(
        {"actor_path": a, "algo": "grpo", "reward": {"kind": "rule"}}
    )  # no model reads the tokens
    CF.from_dict({"actor_path": a, "critic": CRITIC})
    with pytest.raises(ValueError, match=r"ref has vocab_size=90 \(.*small\)"):
        CF.from_dict({"actor_path": a, "critic": CRITIC, "ref_path": ckpts["small"]})
    # Same vocab size, different token ids: refused when both checkpoints ship a tokenizer.
    x, y = tmp_path / "x", tmp_path / "y"
    for d, vocab in ((x, {"<unk>": 0, "a": 1, "b": 2}), (y, {"<unk>": 0, "b": 1, "a": 2})):
        d.mkdir()
        for f in os.listdir(a):
            os.link(os.path.join(a, f), d / f)
        _tokenizer(str(d), vocab)
    with pytest.raises(
        ValueError, match=r"ref \(.*y\) and the actor \(.*x\) have different tokenizers: 2 tokens"
    ):
        CF.from_dict({"actor_path": str(x), "critic": CRITIC, "ref_path": str(y)})
    CF.from_dict({"actor_path": str(x), "critic": CRITIC, "ref_path": str(x)})
    with pytest.raises(ValueError, match=r"critic_init='zero' needs critic_path"):
        CF.from_dict({"critic_init": "zero"})
    with pytest.raises(
        ValueError, match=r"critic_init='xavier'; allowed: 'checkpoint', 'zero', 'normal'"
    ):
        CF.from_dict({"critic_init": "xavier", "critic_path": a})
    # Without critic_init, a causal-LM critic_path names the missing head and the way out.
    from real_py import Layout
    from real_py.interop.hf import load_hf_shard

    cfg = CF.from_dict({"actor_path": a, "critic_path": a, "critic": CRITIC}).model_configs()[
        "critic"
    ]
    with pytest.raises(ValueError, match=r"no tensor 'score.weight' .*critic_init: zero \| normal"):
        load_hf_shard(a, cfg, Layout(), 0)


def _worker(rank, world, d):
    cfg = CF.from_dict(d)
    plan, graph, models = CF.validate(cfg, world)
    rt = Runtime(cfg, plan, graph, models, timeout_s=120)
    out = {}
    for m in ("critic", "ref"):
        call = graph.train_call(m) or graph.models()[m][0]
        if rt.groups[call].member:
            full = gather_state_dict(rt.models.engines[m].shard, rt.groups[call])
            if full is not None:
                out[m] = full
    it = rt.iteration(0)
    out["metrics"] = it["metrics"]
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_critic_from_actor_checkpoint_and_ref_from_its_own_path(ckpts):
    a, r = ckpts["actor"], ckpts["ref"]
    d = dict(BASE, actor_path=a, critic_path=a, critic_init="zero", ref_path=r, critic=CRITIC)
    per_rank = [
        torch.load(io.BytesIO(b), weights_only=False)
        for b in run_distributed(_worker, 4, d, timeout=240)
    ]
    got = {m: [p[m] for p in per_rank if m in p] for m in ("critic", "ref")}
    assert len(got["critic"]) == 1 and len(got["ref"]) == 1
    body = O.fused_state(O.load_oracle(a))
    body.pop("lm_head.weight")
    critic = got["critic"][0]
    assert torch.equal(critic.pop("value_head.weight"), torch.zeros(1, 64))
    assert sorted(critic) == sorted(body)
    for k, v in body.items():
        assert torch.equal(critic[k], v), k
    want_ref = O.fused_state(O.load_oracle(r))
    assert sorted(got["ref"][0]) == sorted(want_ref)
    for k, v in want_ref.items():
        assert torch.equal(got["ref"][0][k], v), k
    m = per_rank[0]["metrics"]
    assert all(torch.isfinite(torch.tensor(float(v))) for v in m.values()), m
    assert json.dumps(m)  # plain numbers


def test_checkpoint_headers_checked_before_ranks_start(ckpts, tmp_path):
    """validate reads every loaded checkpoint's safetensors headers: a truncated file, a tensor
    shape that disagrees with config.json and a missing index shard fail naming the model and file;
    an out_dir that is a file is refused."""
    import shutil

    a = ckpts["actor"]
    trunc = tmp_path / "trunc"
    shutil.copytree(a, trunc)
    st = trunc / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    shape = tmp_path / "shape"
    shutil.copytree(a, shape)
    cfg = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(
        json.dumps(cfg | {"intermediate_size": cfg["intermediate_size"] * 2})
    )
    sharded = tmp_path / "sharded"
    shutil.copytree(a, sharded)
    names = json.loads(
        (sharded / "model.safetensors").read_bytes()[
            8 : 8 + int.from_bytes((sharded / "model.safetensors").read_bytes()[:8], "little")
        ]
    )
    weight_map = {k: "model-00002-of-00002.safetensors" for k in names if k != "__metadata__"}
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "afile").write_text("x")
    for over, msg in [
        ({"ref_path": str(trunc)}, r"model ref \(.*trunc\): .*model.safetensors is not a readable"),
        ({"ref_path": str(shape)}, r"model ref \(.*shape\): checkpoint tensor .* has shape"),
        (
            {"ref_path": str(sharded)},
            r"model ref \(.*sharded\): .* names 1 shard file\(s\) that are missing",
        ),
        ({"out_dir": str(tmp_path / "afile")}, "out_dir=.*afile' is a file"),
    ]:
        with pytest.raises(ValueError, match=msg):
            CF.validate(CF.from_dict(dict(BASE, actor_path=a, critic=CRITIC, **over)), 4)


def _families_worker(rank, world, runs):
    """One PPO iteration per family from its own HF checkpoint (actor, critic body, reference) on
    the default plan (the critic moves dp2tp2 -> pp2); returns the gathered critic bodies."""
    out = {}
    for name, d in runs:
        cfg = CF.from_dict(d)
        plan, graph, models = CF.validate(cfg, world)
        rt = Runtime(cfg, plan, graph, models, timeout_s=120)
        it = rt.iteration(0)
        role = "critic" if cfg.algo == "ppo" else "actor"  # GRPO: no critic; the trained actor
        call = graph.train_call(role)
        full = (
            gather_state_dict(rt.models.engines[role].shard, rt.groups[call])
            if rt.groups[call].member
            else None
        )
        out[name] = {"metrics": it["metrics"], "critic": full}
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


# the newer families; each runs one PPO (critic from the actor's body) and one GRPO iteration
FAMILIES = (
    ("qwen3", {}),
    ("olmo2", {}),
    ("phi3", {"pad_token_id": 0}),
    (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "hidden_act": "gelu_pytorch_tanh",
            "original_max_position_embeddings": 8,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5, 2.0, 3.0, 1.0, 2.0, 4.0, 8.0],
                "long_factor": [2.0, 3.0, 5.0, 7.0, 2.0, 3.0, 5.0, 9.0],
            },
        },
    ),
    ("gemma2", {"head_dim": 16, "sliding_window": 4, "attn_logit_softcapping": 2.0}),
    ("gemma3_text", {"head_dim": 16, "sliding_window": 4, "sliding_window_pattern": 2}),
)
if os.environ.get("FAMILY_CASES"):  # targeted runs: a substring of the model_types, e.g. "gemma3"
    FAMILIES = tuple(f for f in FAMILIES if os.environ["FAMILY_CASES"] in f[0])


@pytest.mark.dist
@pytest.mark.timeout(1200)
def test_new_families_run_ppo_and_grpo_from_hf_checkpoints(tmp_path):
    """qwen3 (per-head q/k norms), olmo2 (norms after, whole-projection q/k norms), phi3 (fused
    checkpoint tensors), llama with biases / gelu / longrope, gemma2, gemma3_text: PPO and GRPO run
    from the checkpoint (GRPO: the trained actor is finite and moved); after one iteration the
    critic's weights (trained from a zero value head on the actor's body) are finite and moved.
    gemma3_text's PPO reads its critic and reward from a Gemma3TextForSequenceClassification
    checkpoint instead."""
    runs = []
    for mt, over in FAMILIES:
        a = O.make_checkpoint(str(tmp_path / mt), mt, seed=4, **over)
        if mt == "gemma3_text":
            v = O.make_checkpoint(str(tmp_path / (mt + "-value")), mt, head="value", seed=5, **over)
            runs.append(
                (
                    mt,
                    dict(
                        BASE, actor_path=a, critic_path=v, reward_path=v, ref_path=a, critic=CRITIC
                    ),
                )
            )
        else:
            runs.append(
                (
                    mt,
                    dict(
                        BASE,
                        actor_path=a,
                        critic_path=a,
                        critic_init="zero",
                        ref_path=a,
                        critic=CRITIC,
                    ),
                )
            )
        runs.append(
            (
                mt + "-grpo",
                dict(BASE, algo="grpo", actor_path=a, ref_path=a, reward={"kind": "rule"}),
            )
        )
    per_rank = [
        torch.load(io.BytesIO(b), weights_only=False)
        for b in run_distributed(_families_worker, 4, runs, timeout=1100)
    ]
    for mt, d in runs:
        m = per_rank[0][mt]["metrics"]
        assert all(torch.isfinite(torch.tensor(float(v))) for v in m.values()), (mt, m)
        if (
            d.get("algo") == "grpo"
        ):  # the actor trained one iteration: finite, moved from the checkpoint
            act = [p[mt]["critic"] for p in per_rank if p[mt]["critic"] is not None]
            want = O.fused_state(O.load_oracle(d["actor_path"]))
            assert len(act) == 1 and sorted(act[0]) == sorted(want), mt
            assert all(torch.isfinite(v).all() for v in act[0].values()), mt
            assert any(not torch.equal(act[0][k], want[k]) for k in want), (
                mt,
                "actor did not move",
            )
            continue
        assert all(torch.isfinite(torch.tensor(float(v))) for v in m.values()), (mt, m)
        crit = [p[mt]["critic"] for p in per_rank if p[mt]["critic"] is not None]
        assert len(crit) == 1, mt
        if (
            d.get("critic_init") is None
        ):  # a value checkpoint: every tensor finite and trained away from it
            want = O.fused_state(O.load_oracle(d["critic_path"], "value"))
            assert sorted(crit[0]) == sorted(want), mt
            assert all(torch.isfinite(v).all() for v in crit[0].values()), mt
            assert not torch.equal(crit[0]["value_head.weight"], want["value_head.weight"]), (
                mt,
                "critic did not move",
            )
            # read from the checkpoint (weights ~ N(0, 0.2)): two Adam steps of lr 1e-3 stay
            # within 1e-2
            assert all(float((crit[0][k] - w).abs().max()) < 1e-2 for k, w in want.items()), mt
            continue
        body = O.fused_state(O.load_oracle(d["actor_path"]))
        assert sorted(k for k in crit[0] if k != "value_head.weight") == sorted(
            k for k in body if k != "lm_head.weight"
        )
        assert not torch.equal(
            crit[0]["value_head.weight"], torch.zeros_like(crit[0]["value_head.weight"])
        ), mt
