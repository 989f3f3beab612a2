# Checks the engines and the PPO runtime on CUDA with NCCL: logits / log-probs / a train step on the
# GPU against transformers, CUDA-graph decoding against eager decoding, a bf16 train step against
# the fp32-master oracle, one NCCL PPO iteration (1 GPU; 4 GPUs when present).
# A failure points to device placement in real_py/engines (engine.py, train.py, generate.py,
# decode.py), real_py/device.py, or the NCCL paths of real_py/rlhf (runtime.py, rows.py Pusher,
# calls.py).
"""Skipped without a GPU (marker `cuda`; scripts/gpu_check.sh runs them). One H200 allows only
world size 1 with NCCL (NCCL refuses two ranks on one GPU): every call then runs on dp1tp1pp1
and nothing is reallocated; the 4-rank NCCL iteration runs only where 4 GPUs are visible.

Tolerances: fp32 GPU vs transformers on CPU: both fp32 (TF32 is off for matmuls by default), the
kernels sum in other orders: 1e-4 on logits / log-probs, 1e-4 on updated weights (AdamW moves
them by ~lr = 1e-3). bf16: the CPU test's bounds (tests/test_engines_bf16_decode.py). Graph vs
eager: the replay of the eager modules runs the eager step's kernels on the same buffers, so
tokens must be identical; the compiled step (the default on CUDA) equals them in fp32, and in bf16
differs, if at all, only where the eager logits nearly tie.
"""

import io
import math

import pytest
import test_engines_bf16_decode as B16
import torch
from support import models_oracle as O

from real_py import Layout, ModelConfig
from real_py.engines import Engine, OptimConfig
from real_py.interop.hf import gather_state_dict, load_hf_shard
from real_py.parallel import ParallelGroups
from real_py.realloc.shard import ModelShard
from real_py.rlhf import config as CF
from real_py.rlhf.runtime import Runtime
from real_py.spec import model_spec
from real_py.testing import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.cuda, pytest.mark.timeout(450)]

LR = 1e-3
PROMPTS, SEEDS = B16.PROMPTS, B16.SEEDS


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _nll(total):
    """Sum of -log p over real next-token positions / total, on the device of the log-probs."""

    def loss_fn(o, mb):
        lp = o["logprobs"]
        mask = torch.arange(lp.shape[1], device=lp.device) < (mb["lengths"] - 1).unsqueeze(1)
        return -(lp * mask).sum() / total

    return loss_fn


def _one_gpu(rank, world, path, device_type="cuda"):
    """device_type="cpu" runs the same code on gloo without the graph mode (a dry run by hand)."""
    dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    modes = ("dynamic", "static", "graph") if device_type == "cuda" else ("dynamic", "static")
    layout = Layout()
    groups = ParallelGroups(layout)
    tokens, lengths = O.batch()
    out = {}
    cfg = ModelConfig.from_hf(path, head="lm")
    eng = Engine(
        cfg,
        layout,
        groups,
        load_hf_shard(path, cfg, layout, rank, dev),
        optim=OptimConfig(lr=LR, eps=1e-6, max_grad_norm=0.5),
    )
    assert eng.device == dev and eng.model.shard_params["norm.weight"].device == dev
    out["logits"] = eng.forward_logits(tokens)  # CPU in, CPU out
    out["inf"] = eng.inference(tokens.to(dev), lengths.to(dev))  # CUDA in, CUDA out
    assert out["inf"]["logprobs"].device == dev
    out["inf"] = {k: v.cpu() for k, v in out["inf"].items()}
    for dtype in ("float32", "bfloat16"):
        c = ModelConfig.from_hf(path, head="lm", dtype=dtype)
        e = Engine(c, layout, groups, load_hf_shard(path, c, layout, rank, dev))
        for greedy in (True, False):
            for mode in modes + (("graph-eager",) if device_type == "cuda" else ()):
                e.compile_decode = False if mode == "graph-eager" else None
                # twice: the second call replays the graphs (and the cache) the first one made
                for call in range(2):
                    out[(dtype, greedy, mode, call)] = e.generate(
                        PROMPTS[0],
                        PROMPTS[1],
                        SEEDS,
                        max_new_tokens=70,
                        greedy=greedy,
                        top_p=0.9,
                        decode=mode.replace("-eager", ""),
                    )["tokens"]
                # a shorter prompt set and stop tokens through the same state
                out[(dtype, greedy, mode, "stop")] = e.generate(
                    PROMPTS[0][:, :3],
                    PROMPTS[1].clamp(max=3),
                    SEEDS,
                    max_new_tokens=40,
                    greedy=greedy,
                    eos_token_id=list(range(10, 40)),
                    decode=mode.replace("-eager", ""),
                )["tokens"]
            e.compile_decode = None
        if device_type == "cuda":
            states = getattr(e, "_decode_states", {}).values()
            out[(dtype, "states")] = [
                (s.backend, s.compiled_ok, s.backend_failed, sorted(s.graphs)) for s in states
            ]
            # bf16: a compiled step may flip a near-tied argmax against the eager one; record the
            # eager logits' margin between the two tokens at each row's first difference
            a, b = out[(dtype, True, "static", 0)], out[(dtype, True, "graph", 0)]
            margins = []
            for row in range(a.shape[0]):
                diff = (a[row] != b[row]).nonzero()
                if len(diff):
                    j = int(diff[0])
                    lg = e.forward_logits(a[row : row + 1, :j].to(dev))[0, -1].float()
                    margins.append(
                        (float((lg[a[row, j]] - lg[b[row, j]]).abs()), float(lg.abs().max()))
                    )
            out[(dtype, "margins")] = margins
    loss_fn = _nll(float((lengths - 1).sum()))
    eng.train_step(loss_fn, {"tokens": tokens, "lengths": lengths}, micro_batches=2)
    out["trained"] = {k: v.cpu() for k, v in gather_state_dict(eng.shard, groups).items()}
    # bf16 train steps with the fp32 master, on the GPU.
    c16 = ModelConfig.from_hf(path, head="lm", dtype="bfloat16")
    shard = load_hf_shard(path, c16, layout, rank, dev)
    e16 = Engine(
        c16,
        layout,
        groups,
        shard,
        optim=OptimConfig(lr=B16.LR, eps=B16.EPS, weight_decay=B16.WD, max_grad_norm=B16.MAX_NORM),
    )
    stats = [
        e16.train_step(loss_fn, {"tokens": tokens, "lengths": lengths}, micro_batches=2)
        for _ in range(B16.STEPS)
    ]
    tr = e16._trainer
    compiled = {
        n: (t.calls.backend, t.calls.ok, t.calls.failed) if t.calls is not None else None
        for n, t in (("fp32", eng._trainer), ("bf16", tr))
    }
    master = ModelShard(model_spec(cfg), layout, rank, tr.master)
    out["bf16"] = {
        "stats": stats,
        "master": {k: v.cpu() for k, v in gather_state_dict(master, groups).items()},
        "rounded": torch.equal(shard.flat, tr.master.to(torch.bfloat16)),
        "dtypes": (shard.flat.dtype, tr.master.dtype, tr.exp_avg.dtype, tr.red.dtype),
        "compiled": compiled,
    }
    # One PPO iteration with NCCL, bf16, frozen models offloaded to pinned host memory.
    d = {
        "precision": "bf16",
        "device": device_type,
        "offload_frozen": True,
        "ppo": {"ppo_epochs": 1, "mini_batches": 2, "micro_batches": 2},
        "generation": {"max_new_tokens": 6},
    }
    tc = CF.from_dict(d)
    tc.plan = CF.single_process_plan(tc.graph())
    plan, graph, models = CF.validate(tc, world)
    rt = Runtime(tc, plan, graph, models, timeout_s=120)
    it = rt.iteration(0)
    it.pop("store")
    out["ppo"] = {
        "it": it,
        "devices": {
            m: str(e.shard.flat.device) for m, e in rt.models.engines.items() if e is not None
        },
    }
    return _save(out)


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    # 256 positions: generations long enough for two 64-slot decode buckets
    path = O.make_checkpoint(
        str(tmp_path_factory.mktemp("ckpt") / "tied"),
        "llama",
        tied=True,
        seed=1,
        max_position_embeddings=256,
    )
    res = run_distributed(_one_gpu, 1, path, timeout=400, backend="nccl")[0]
    return path, torch.load(io.BytesIO(res), weights_only=False)


def test_engine_on_cuda_matches_transformers(one_gpu):
    path, r = one_gpu
    ref = O.load_oracle(path)
    tokens, lengths = O.batch()
    with torch.no_grad():
        logits = ref(tokens).logits.float()
    torch.testing.assert_close(r["logits"].float(), logits, atol=1e-4, rtol=0)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    valid = torch.arange(lp.shape[1]) < (lengths - 1).unsqueeze(1)
    torch.testing.assert_close(r["inf"]["logprobs"], lp * valid, atol=1e-4, rtol=0)
    O.oracle_train_step(ref, tokens, lengths, "lm", LR, 0.0, 0.5, eps=1e-6)
    for k, v in O.fused_state(ref).items():
        torch.testing.assert_close(r["trained"][k], v, atol=1e-4, rtol=0, msg=lambda m: f"{k}: {m}")


def test_cuda_graph_decode_equals_eager(one_gpu):
    """graph-eager replays the eager step's kernels: identical tokens, first call and replayed,
    with stop tokens. The compiled graph (the default): identical in fp32; in bf16 any difference
    must start at a near tie of the eager logits (bf16 rounding inside fused kernels)."""
    _, r = one_gpu
    for dtype in ("float32", "bfloat16"):
        for greedy in (True, False):
            for call in (0, 1, "stop"):
                static = r[(dtype, greedy, "static", call)]
                assert torch.equal(r[(dtype, greedy, "graph-eager", call)], static), (
                    dtype,
                    greedy,
                    call,
                )
                if dtype == "float32":
                    assert torch.equal(r[(dtype, greedy, "graph", call)], static), (
                        dtype,
                        greedy,
                        call,
                    )
                    assert torch.equal(static, r[(dtype, greedy, "dynamic", call)]), (
                        dtype,
                        greedy,
                        call,
                    )
            assert torch.equal(r[(dtype, greedy, "graph", 0)], r[(dtype, greedy, "graph", 1)]), (
                dtype,
                greedy,
            )
        states = r[(dtype, "states")]
        compiled = [s for s in states if s[0] == "inductor"]
        assert len(compiled) == 1 and compiled[0][1:3] == (True, None), states
        assert compiled[0][3] == [64, 128], (
            states
        )  # one graph per 64-slot bucket, reused across calls
    for gap, scale in r[("bfloat16", "margins")]:
        assert gap <= 2**-6 * scale + 1e-3, (gap, scale)


def test_bf16_train_step_on_cuda(one_gpu):
    path, r = one_gpu
    want, init, losses, norms = B16._oracle_bf16_steps(path)
    b = r["bf16"]
    # the train steps (fp32 and bf16) ran the compiled layers (the CUDA default), no fallback
    assert b["compiled"] == {"fp32": ("inductor", True, None), "bf16": ("inductor", True, None)}, b[
        "compiled"
    ]
    assert b["dtypes"] == (torch.bfloat16, torch.float32, torch.float32, torch.float32)
    assert b["rounded"], "the bf16 shard must be the master rounded to bf16"
    assert sorted(b["master"]) == sorted(want)
    every = torch.cat([(b["master"][k] - v).abs().flatten() for k, v in want.items()])
    assert float(every.mean()) < 0.1 * B16.LR and float(every.max()) <= 4.5 * B16.LR
    for s, loss, norm in zip(b["stats"], losses, norms):
        assert math.isclose(s["loss"], loss, rel_tol=2e-2) and math.isclose(
            s["grad_norm"], norm, rel_tol=2e-2
        )


def test_nccl_ppo_iteration_one_gpu(one_gpu):
    _, r = one_gpu
    it = r["ppo"]["it"]
    assert set(r["ppo"]["devices"].values()) == {"cuda:0"}
    assert all(math.isfinite(v) for v in it["metrics"].values()), it["metrics"]
    assert set(it["peak_mem_mib"]) == set(it["calls"]) and all(
        v > 0 for v in it["peak_mem_mib"].values()
    )
    assert it["offload_bytes"] > 0


def _four_gpus(rank, world):
    d = {
        "precision": "bf16",
        "device": "cuda",
        "ppo": {"ppo_epochs": 1, "mini_batches": 2, "micro_batches": 2},
        "generation": {"max_new_tokens": 6},
    }
    cfg = CF.from_dict(d)
    plan, graph, models = CF.validate(cfg, world)
    rt = Runtime(cfg, plan, graph, models, timeout_s=120)
    its = [rt.iteration(s) for s in range(2)]
    for it in its:
        it.pop("store")
    return _save(its)


@pytest.mark.skipif(
    torch.cuda.device_count() < 4, reason="the default plan needs 4 GPUs (one per rank)"
)
def test_nccl_ppo_iteration_four_gpus():
    its = torch.load(
        io.BytesIO(run_distributed(_four_gpus, 4, timeout=300, backend="nccl")[0]),
        weights_only=False,
    )
    for it in its:
        assert all(math.isfinite(v) for v in it["metrics"].values()), it["metrics"]
        assert it["realloc_bytes"] > 0 and it["data_bytes"] > 0 and it["peak_mem_mib"]
