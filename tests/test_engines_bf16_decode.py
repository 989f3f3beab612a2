# Checks the GPU-path code on CPU: bf16 train steps (fp32 master, fp32 reduction) against a
# plain-torch fp32-master AdamW on transformers' bf16 model, static-KV-cache decoding against the
# dynamic cache token for token on TP/PP layouts, one bf16 PPO iteration on 4 gloo ranks (also with
# NCCL-style batched row pushes), config / device errors.
# A failure points to real_py/engines/train.py (master weights, bucket conversion, clipping),
# engines/decode.py / generate.py (static cache, slots, masks), or rlhf/config.py / models.py /
# runtime.py (precision, device plumbing).
"""One 4-rank gloo spawn runs every case. Layouts move weights for real: dp1tp2pp2 (TP + PP + tied
embedding across stages), dp2tp1pp2 (DP buckets converted to fp32 from grad hooks, tied PP),
dp2tp2pp1.

Tolerances (bf16 train): the oracle is transformers' LlamaForCausalLM in bf16 in one process;
its bf16 activations and gradients differ from the TP/PP run by bf16 rounding (~1e-2 relative on
gradients). AdamW's update is ~lr * sign-like per element, so the fp32 masters after 2 steps
(lr 1e-4, below one bf16 ulp of the ~0.2-sized weights: without a master nothing would move)
agree to a small fraction of lr on average; a few elements whose gradient is at noise level may
differ by up to ~2 lr per step. Measured here: mean |diff| 0.008-0.012 lr, max 3.6 lr, 0.3% of
elements above lr; a pure-bf16 AdamW (no master, the code before this change) gives mean 1.7 lr
and 86% above lr. Checked: mean |diff| < 0.1 lr, max |diff| <= 4.5 lr (2 steps of at most ~2 lr),
under 2% of elements above lr, every bf16 shard element == its master rounded to bf16, loss and
grad norm within 2%.
Static vs dynamic cache (fp32): the static step attends over the whole preallocated cache with
unwritten slots masked, the dynamic one over the written prefix: the same maths, sums over a few
more exact zeros, so the sampled and greedy tokens must be identical.
"""

import io
import math
import weakref

import pytest
import torch
from support import models_oracle as O

from real_py import ModelConfig
from real_py.engines import Engine, OptimConfig
from real_py.interop.hf import gather_state_dict, load_hf_shard
from real_py.layout import Layout
from real_py.parallel import ParallelGroups
from real_py.realloc.shard import ModelShard
from real_py.rlhf import config as CF
from real_py.rlhf.runtime import Runtime
from real_py.spec import model_spec
from real_py.testing import run_distributed

LAYOUTS = [Layout(dp=1, tp=2, pp=2), Layout(dp=2, tp=1, pp=2), Layout(dp=2, tp=2, pp=1)]
LR, WD, MAX_NORM, EPS, STEPS = 1e-4, 0.01, 0.5, 1e-6, 2
PROMPTS = (
    torch.tensor(
        [[5, 17, 3, 44, 8, 0], [9, 2, 61, 0, 0, 0], [1, 2, 3, 4, 5, 6], [70, 71, 0, 0, 0, 0]]
    ),
    torch.tensor([5, 3, 6, 2]),
)
SEEDS = torch.tensor([11, 22, 33, 44])


def _rows(groups, n):
    per = n // groups.dp_size
    return slice(groups.dp_rank * per, (groups.dp_rank + 1) * per)


def _engines(rank, path):
    out = {}
    tokens, lengths = O.batch()
    total = float((lengths - 1).sum())
    for layout in LAYOUTS:
        groups = ParallelGroups(layout)
        if not groups.member:
            continue
        r = {}
        cfg32 = ModelConfig.from_hf(path, head="lm")
        eng = Engine(cfg32, layout, groups, load_hf_shard(path, cfg32, layout, rank))
        prow = _rows(groups, 4)
        pt, pl, sd = PROMPTS[0][prow], PROMPTS[1][prow], SEEDS[prow]
        for mode in ("dynamic", "static"):
            r[mode] = [
                eng.generate(pt, pl, sd, max_new_tokens=8, decode=mode)["tokens"],
                eng.generate(pt, pl, sd, max_new_tokens=8, greedy=False, top_p=0.9, decode=mode)[
                    "tokens"
                ],
            ]
        cfg16 = ModelConfig.from_hf(path, head="lm", dtype="bfloat16")
        shard = load_hf_shard(path, cfg16, layout, rank)
        eng = Engine(
            cfg16,
            layout,
            groups,
            shard,
            optim=OptimConfig(
                lr=LR, eps=EPS, weight_decay=WD, max_grad_norm=MAX_NORM, bucket_numel=3000
            ),
        )
        rows = _rows(groups, tokens.shape[0])
        loss_fn = lambda o, mb: O.nll_loss(o["logprobs"], mb["lengths"], total)
        r["stats"] = [
            eng.train_step(
                loss_fn, {"tokens": tokens[rows], "lengths": lengths[rows]}, micro_batches=2
            )
            for _ in range(STEPS)
        ]
        tr = eng._trainer
        r["dtypes"] = (
            shard.flat.dtype,
            tr.master.dtype,
            tr.exp_avg.dtype,
            tr.exp_avg_sq.dtype,
            tr.red.dtype,
            tr.grad.dtype,
        )
        r["rounded"] = torch.equal(shard.flat, tr.master.to(torch.bfloat16))
        master = ModelShard(model_spec(cfg32), layout, rank, tr.master)
        r["full16"] = gather_state_dict(shard, groups)
        r["full32"] = gather_state_dict(master, groups)
        out[repr(layout)] = r
    return out


def _runtime(rank, world):
    d = {
        "precision": "bf16",
        "ppo": {"ppo_epochs": 1, "mini_batches": 2, "micro_batches": 2},
        "generation": {"max_new_tokens": 6},
        "device": "auto",
    }
    cfg = CF.from_dict(d)
    plan, graph, models = CF.validate(cfg, world)
    rt = Runtime(cfg, plan, graph, models, timeout_s=120)
    # Every reallocated copy must be freed when its call returns (no lingering reference or cycle
    # keeps a second full copy of the weights alive on the device).
    copies, engine_for = [], rt.models.engine_for

    def spy(call):
        eng, stats = engine_for(call)
        if stats is not None and eng is not None:
            copies.append(weakref.ref(eng.shard.flat))
        return eng, stats

    rt.models.engine_for = spy
    it = rt.iteration(0)
    released = (len(copies), sum(ref() is None for ref in copies))
    rt.models.engine_for = engine_for
    store = it.pop("store")
    # The NCCL way of pushing rows (one batch_isend_irecv per call), over gloo: same iteration.
    rt2 = Runtime(cfg, plan, graph, models, timeout_s=120)
    rt2.batched_pushes = True
    it2 = rt2.iteration(0)
    batched_same = (
        it2["metrics"] == it["metrics"]
        and it2["data_bytes"] == it["data_bytes"]
        and all(torch.equal(store.data[k], it2["store"].data[k]) for k in store.data)
    )
    dtypes = {
        m: (e.shard.flat.dtype, e._trainer.master.dtype if e._trainer else None)
        for m, e in rt.models.engines.items()
        if e is not None
    }
    # One more reallocation of the actor into its generate layout: the bf16 bytes arrive intact.
    eng, _ = rt.models.engine_for("actor_gen")
    gen_full = gather_state_dict(eng.shard, rt.groups["actor_gen"]) if eng is not None else None
    tr_g = rt.groups["actor_train"]
    home_full = gather_state_dict(rt.models.engines["actor"].shard, tr_g) if tr_g.member else None
    return {
        "it": it,
        "dtypes": dtypes,
        "gen_full": gen_full,
        "home_full": home_full,
        "device": str(rt.device),
        "batched_same": batched_same,
        "released": released,
    }


def _worker(rank, world, path):
    torch.manual_seed(0)
    out = {"engines": _engines(rank, path), "runtime": _runtime(rank, world)}
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = O.make_checkpoint(
        str(tmp_path_factory.mktemp("ckpt") / "tied"), "llama", tied=True, seed=1
    )
    per_rank = run_distributed(_worker, 4, path, timeout=280)
    return path, [torch.load(io.BytesIO(b), weights_only=False) for b in per_rank]


def _oracle_bf16_steps(path):
    """transformers' bf16 model, fp32 master copy with torch.optim.AdamW, clip in fp32."""
    tokens, lengths = O.batch()
    m16 = O.load_oracle(path).to(torch.bfloat16).train()
    m32 = O.load_oracle(path).train()
    with torch.no_grad():
        for p16, p32 in zip(m16.parameters(), m32.parameters()):
            p32.copy_(p16.float())  # the master starts from the bf16 weights, as the Trainer's
    init = O.fused_state(m32)
    opt = torch.optim.AdamW(m32.parameters(), lr=LR, eps=EPS, weight_decay=WD, foreach=False)
    losses, norms = [], []
    for _ in range(STEPS):
        logits = m16(tokens).logits.float()
        lp = (
            torch.log_softmax(logits[:, :-1], -1)
            .gather(-1, tokens[:, 1:].unsqueeze(-1))
            .squeeze(-1)
        )
        loss = O.nll_loss(lp, lengths, float((lengths - 1).sum()))
        loss.backward()
        for p16, p32 in zip(m16.parameters(), m32.parameters()):
            p32.grad = p16.grad.float()
            p16.grad = None
        norms.append(float(torch.nn.utils.clip_grad_norm_(m32.parameters(), MAX_NORM)))
        opt.step()
        with torch.no_grad():
            for p16, p32 in zip(m16.parameters(), m32.parameters()):
                p16.copy_(p32)
        losses.append(loss.item())
    return O.fused_state(m32), init, losses, norms


def _by_layout(per_rank, key):
    return [r["engines"][key] for r in per_rank if key in r["engines"]]


@pytest.mark.dist
def test_bf16_train_steps_match_fp32_master_oracle(runs):
    path, per_rank = runs
    want, init, losses, norms = _oracle_bf16_steps(path)
    assert norms[0] > MAX_NORM, "the oracle step must exercise clipping"
    moved = torch.cat([(want[k] - init[k]).abs().flatten() for k in want]).mean()
    assert moved > 0.5 * LR, f"the oracle masters must move by ~lr, moved {float(moved)}"
    for layout in LAYOUTS:
        res = _by_layout(per_rank, repr(layout))
        for r in res:
            assert r["dtypes"] == (torch.bfloat16,) + (torch.float32,) * 4 + (torch.bfloat16,), r[
                "dtypes"
            ]
            assert r["rounded"], f"{layout}: shard is not the master rounded to bf16"
        got32 = [r["full32"] for r in res if r["full32"] is not None]
        got16 = [r["full16"] for r in res if r["full16"] is not None]
        assert len(got32) == 1 and len(got16) == 1 and sorted(got32[0]) == sorted(want)
        every = torch.cat([(got32[0][k] - v).abs().flatten() for k, v in want.items()])
        assert float((every > LR).float().mean()) < 0.02, (
            repr(layout),
            float((every > LR).float().mean()),
        )
        for k, v in want.items():
            diff = (got32[0][k] - v).abs()
            assert float(diff.mean()) < 0.1 * LR and float(diff.max()) <= 4.5 * LR, (
                repr(layout),
                k,
                float(diff.mean()),
                float(diff.max()),
            )
            assert torch.equal(got16[0][k], got32[0][k].to(torch.bfloat16)), (repr(layout), k)
        for s, loss, norm in zip(res[0]["stats"], losses, norms):
            assert math.isclose(s["loss"], loss, rel_tol=2e-2), (repr(layout), s, loss)
            assert math.isclose(s["grad_norm"], norm, rel_tol=2e-2), (repr(layout), s, norm)


@pytest.mark.dist
def test_static_cache_decoding_equals_dynamic_token_for_token(runs):
    _, per_rank = runs
    for layout in LAYOUTS:
        for r in _by_layout(per_rank, repr(layout)):
            for kind, a, b in zip(("greedy", "sampled"), r["dynamic"], r["static"]):
                assert torch.equal(a, b), (repr(layout), kind, a, b)
            assert not torch.equal(r["static"][0], r["static"][1]), (
                "sampling must differ from greedy"
            )


@pytest.mark.dist
def test_bf16_ppo_iteration_on_4_ranks(runs):
    _, per_rank = runs
    rts = [r["runtime"] for r in per_rank]
    it = rts[0]["it"]
    assert {r["device"] for r in rts} == {"cpu"}
    assert set(it["metrics"]) >= {"reward", "kl", "policy_loss", "value_loss"}, it["metrics"]
    assert all(math.isfinite(v) for v in it["metrics"].values()), it["metrics"]
    assert it["peak_mem_mib"] == {}, "no GPU: no peak memory"
    assert it["realloc_bytes"] > 0, "the default plan reallocates the actor and critic"
    assert it["data_bytes"] > 0
    assert all(r["batched_same"] for r in rts), (
        "batched (NCCL-style) row pushes changed the iteration"
    )
    assert sum(r["released"][0] for r in rts) > 0
    assert all(n == freed for n, freed in (r["released"] for r in rts)), [
        r["released"] for r in rts
    ]
    for r in rts:
        for m, (flat, master) in r["dtypes"].items():
            assert flat == torch.bfloat16, (m, flat)
            assert master == (torch.float32 if m in ("actor", "critic") else None), (m, master)
    gen = [r["gen_full"] for r in rts if r["gen_full"] is not None]
    home = [r["home_full"] for r in rts if r["home_full"] is not None]
    assert len(gen) == 1 and len(home) == 1
    for k, v in home[0].items():
        assert v.dtype == torch.bfloat16 and torch.equal(gen[0][k], v), k


def test_config_device_precision_decode_checked(monkeypatch):
    cfg = CF.from_dict({"precision": "bf16"})
    assert cfg.device == "auto" and {c.dtype for c in cfg.model_configs().values()} == {"bfloat16"}
    assert {c.dtype for c in CF.from_dict({}).model_configs().values()} == {"float32"}
    for bad, match in (
        ({"device": "tpu"}, "device='tpu'; allowed"),
        ({"precision": "fp16"}, "precision='fp16'; allowed"),
        ({"generation": {"decode": "eager"}}, "generation.decode='eager'; allowed"),
        ({"precision": "bf16", "critic": {"dtype": "float32"}}, "critic.dtype='float32' conflicts"),
    ):
        with pytest.raises(ValueError, match=match):
            CF.from_dict(bad)
    # The one-GPU example config is valid (its device: cuda checked apart, above and on a GPU).
    import os

    import yaml

    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "ppo_gpu1_bf16.yaml")) as f:
        d = yaml.safe_load(f)
    assert d.pop("device") == "cuda"
    # Validated as a CPU job here, whose host-memory check (tests/test_rlhf_config_messages.py)
    # would refuse the 1.1B models on a small machine: that check is left out.
    from real_py.rlhf.config import host_memory

    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
    CF.validate(CF.from_dict(d), 1)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the errors of a machine without a GPU"
)
def test_cuda_requests_without_gpu_are_errors():
    from types import SimpleNamespace

    from real_py.device import backend_for, resolve_device
    from real_py.engines.decode import pick_mode

    assert (
        resolve_device("auto") == torch.device("cpu") and backend_for(torch.device("cpu")) == "gloo"
    )
    for fn in (lambda: resolve_device("cuda"), lambda: CF.from_dict({"device": "cuda"})):
        with pytest.raises(ValueError, match="torch sees no GPU"):
            fn()
    eng = SimpleNamespace(
        config=CF.from_dict({}).model_configs()["actor"],
        device=torch.device("cpu"),
        groups=SimpleNamespace(tp_size=1),
    )
    assert pick_mode(eng, "auto") == "dynamic" and pick_mode(eng, "static") == "static"
    with pytest.raises(ValueError, match="decode='graph' needs a CUDA engine"):
        pick_mode(eng, "graph")


def test_step_line_reports_peak_memory():
    from real_py.cli.train import _line

    out = {
        "metrics": {"reward": 1.0},
        "calls": {"actor_gen": 0.5},
        "realloc_seconds": {},
        "realloc_bytes": 0,
        "peak_mem_mib": {"actor_gen": 1234.4, "actor_train": 2048.0},
    }
    assert _line(1, out).endswith("| peak actor_gen 1234MiB actor_train 2048MiB")
    assert "peak" not in _line(1, dict(out, peak_mem_mib={}))
