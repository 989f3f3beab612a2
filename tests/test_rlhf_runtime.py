# Checks the distributed PPO/GRPO runtime: 4 gloo ranks with per-call layouts (actor trains on
# dp1tp2pp2, generates on dp4tp1pp1; critic, ref, reward elsewhere) against the same iterations in
# one process, overlap of calls on disjoint meshes, and kill/resume of the train command.
# A failure points to real_py/rlhf/runtime.py / rows.py (row pushes, order), models.py (reallocation
# into and out of the train layout), calls.py (per-kind execution) or checkpoint.py / cli/train.py
# (resume).
"""Tolerances: fp32. The 4-rank run splits matmuls over TP and sums the critic's gradients over
DP in another order than the one-process run; after two iterations of AdamW (lr 1e-3) the
parameters agree to a few 1e-7, so 1e-5 catches any wrong row, slice or stale weight (which
moves parameters by ~lr). Adam eps is 1e-6, not 1e-8: a few weights get gradients of ~1e-9 (noise
level), which Adam with eps 1e-8 would turn into layout-dependent updates of ~lr/10 (the same
effect the models tests note for the k_proj bias). Generated tokens are compared exactly
(per-sequence seeded sampling).
"""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from real_py.interop.hf import gather_state_dict
from real_py.rlhf import config as CF
from real_py.rlhf.models import init_weights
from real_py.rlhf.runtime import Runtime
from real_py.testing import run_distributed

pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 2
BASE = {
    "ppo": {
        "ppo_epochs": 2,
        "mini_batches": 2,
        "micro_batches": 2,
        "adam_eps": 1e-6,
        "entropy_coef": 0.05,
    },
    "generation": {"max_new_tokens": 8},
}
GRPO_PLAN = {
    "world_size": 4,
    "calls": {k: v for k, v in CF.DEFAULT_PLAN["calls"].items() if not k.startswith("critic")},
}


def _dp2(algo):
    """algo's default plan with actor_train on dp2tp2pp1: the loss aggregations and the batch
    whitening then span two DP ranks (and BASE's two micro-batches)."""
    plan = CF.default_plan(algo)
    plan["calls"]["actor_train"] = {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "pp": 1}
    return plan


def _cases(single: bool):
    ppo = dict(BASE)
    # Reward model, not the rule reward: with a random actor the target token is rare, most groups
    # score 0 and the advantages vanish, so the update would be Adam acting on noise.
    grpo = dict(BASE, algo="grpo")
    # Recipe options whose statistics span DP ranks and micro-batches.
    opts = dict(
        BASE,
        algo="rloo",
        ppo=dict(
            BASE["ppo"],
            loss_agg="seq-mean-token-mean",
            clip_high=0.28,
            dual_clip=3.0,
            ratio="sequence",
            kl_estimator="k2",
        ),
    )
    remax = dict(BASE, algo="remax", ppo=dict(BASE["ppo"], loss_agg="seq-mean-token-sum-norm"))
    rpp = dict(
        BASE,
        algo="reinforce_pp_baseline",
        ppo=dict(BASE["ppo"], loss_agg="seq-mean-token-sum", kl_estimator="k3"),
    )
    cases = {
        "ppo": ppo,
        "grpo": grpo,
        "rloo_opts": opts,
        "remax": remax,
        "reinforce_pp_baseline": rpp,
    }
    for name, d in cases.items():
        if single:
            d["plan"] = CF.single_process_plan(CF.from_dict(d).graph())
        elif name == "grpo":
            d["plan"] = GRPO_PLAN
        elif name != "ppo":
            d["plan"] = _dp2(d["algo"])
    return cases


def _worker(rank, world, cases):
    out = {}
    for name, d in cases.items():
        cfg = CF.from_dict(d)
        plan, graph, models = CF.validate(cfg, world)
        rt = Runtime(cfg, plan, graph, models, timeout_s=120)
        r = {"iters": []}
        for step in range(ITERS):
            it = rt.iteration(step)
            store = it.pop("store")
            # Each rank holds the rows its calls read (all of them on rank 0 unless actor_train is
            # dp > 1); the test merges the ranks' rows.
            it["tokens"], it["lengths"] = store.data["tokens"], store.data["lengths"]
            r["iters"].append(it)
        for model in ("actor", "critic"):
            call = graph.train_call(model)
            if call and rt.groups[call].member:
                full = gather_state_dict(rt.models.engines[model].shard, rt.groups[call])
                if full is not None:
                    r[model] = full
        out[name] = r
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _load(b):
    return torch.load(io.BytesIO(b), weights_only=False)


@pytest.fixture(scope="module")
def runs():
    one = _load(run_distributed(_worker, 1, _cases(True), timeout=240)[0])
    four = [_load(b) for b in run_distributed(_worker, 4, _cases(False), timeout=240)]
    return one, four


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo_opts", "remax", "reinforce_pp_baseline"])
def test_matches_single_process(runs, algo):
    one, four = runs
    ref, got = one[algo], four[0][algo]
    for i in range(ITERS):
        # Every row from some rank that holds it (prompt tokens are >= 1: a held row is nonzero).
        tok, ln = (
            torch.zeros_like(ref["iters"][i]["tokens"]),
            torch.zeros_like(ref["iters"][i]["lengths"]),
        )
        for r in four:
            held = r[algo]["iters"][i]["lengths"] > 0
            tok[held], ln[held] = (
                r[algo]["iters"][i]["tokens"][held],
                r[algo]["iters"][i]["lengths"][held],
            )
        assert bool((ln > 0).all()), f"iteration {i}: rows held by no rank"
        assert torch.equal(tok, ref["iters"][i]["tokens"]), f"iteration {i} tokens"
        assert torch.equal(ln, ref["iters"][i]["lengths"])
        for k, v in ref["iters"][i]["metrics"].items():
            assert abs(got["iters"][i]["metrics"][k] - v) < 1e-4, (
                i,
                k,
                got["iters"][i]["metrics"][k],
                v,
            )
    models = ("actor", "critic") if algo == "ppo" else ("actor",)
    for m in models:
        assert ref[m].keys() == got[m].keys()
        for name, t in ref[m].items():
            torch.testing.assert_close(got[m][name], t, atol=1e-5, rtol=0, msg=f"{m} {name}")
    # A run that never trained would match trivially: the weights must have moved from the init.
    cfg = CF.from_dict(_cases(False)[algo])
    init = init_weights(cfg.model_configs()["actor"], cfg.seed + 1)
    if algo == "remax":
        assert "actor_greedy" in got["iters"][0]["calls"]
    moved = max(float((got["actor"][n] - init[n]).abs().max()) for n in init)
    assert moved > 1e-4
    if algo == "ppo":
        it = got["iters"][0]
        assert set(it["realloc_seconds"]) == {"actor", "critic"} and it["realloc_bytes"] > 0
        assert it["data_bytes"] > 0


@pytest.mark.timeout(300)
def test_disjoint_meshes_overlap(runs):
    """ref_inf (ranks 0, 1) and rew_inf (ranks 2, 3) both only wait for actor_gen's rows: their
    [start, end] intervals must intersect in some iteration (a runtime that serialized calls, or
    made rew_inf wait for ref_inf, never overlaps them)."""
    _, four = runs
    events = [e for r in four for it in r["ppo"]["iters"] for e in it["events"]]
    assert {e[1] for e in events} >= {"ref_inf", "rew_inf"}
    overlaps = 0
    for i in range(ITERS):
        ev = [e for r in four for e in r["ppo"]["iters"][i]["events"]]
        ref = [(a, b) for _, n, a, b in ev if n == "ref_inf"]
        rew = [(a, b) for _, n, a, b in ev if n == "rew_inf"]
        overlaps += any(a1 < b2 and a2 < b1 for a1, b1 in ref for a2, b2 in rew)
    assert overlaps >= 1, events


def _train(args, out_dir, cfg_path):
    cmd = [
        sys.executable,
        "-m",
        "real_py",
        "train",
        "--config",
        cfg_path,
        "--out-dir",
        out_dir,
        "--no-progress",
        "--timeout",
        "120",
    ] + args
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return r.stdout, [json.loads(line) for line in f]


def _run_killed_after_step_1(out_dir, cfg_path):
    """Start a 3-step job and SIGKILL its whole process group once step 1's checkpoint is
    complete (out_dir/latest names it), i.e. while step 2 or 3 is running."""
    cmd = [
        sys.executable,
        "-m",
        "real_py",
        "train",
        "--config",
        cfg_path,
        "--out-dir",
        out_dir,
        "--no-progress",
        "--timeout",
        "120",
        "--steps",
        "3",
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    latest = os.path.join(out_dir, "latest")
    try:
        deadline = time.monotonic() + 240
        while not (os.path.exists(latest) and open(latest).read().strip() == "step_1"):
            assert p.poll() is None, f"job exited with {p.returncode} before its step-1 checkpoint"
            assert time.monotonic() < deadline, "no step-1 checkpoint within 240 s"
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.timeout(600)
def test_kill_and_resume(tmp_path):
    """Run A does 2 steps uninterrupted. Run B is killed (SIGKILL) after its step-1 checkpoint;
    run C, a new job, resumes from it. C's step 2 must equal A's step 2 exactly: metrics, and
    every rank's saved shards and optimizer moments."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "steps: 2\nsave_every: 1\nverify_realloc: true\nreward: {kind: rule, target_token: 7}\n"
        "generation: {max_new_tokens: 6}\n"
    )
    a, b, c = (str(tmp_path / x) for x in "abc")
    out_a, ma = _train([], a, str(cfg))
    assert "launching 4 local gloo processes" in out_a and "step 2 |" in out_a
    _run_killed_after_step_1(b, str(cfg))
    # As if B had logged steps 2 and 3 (and half a line) before the kill: resuming B in place
    # from step 1 must leave each step's records once.
    for name, n in (("metrics.jsonl", 1), ("samples.jsonl", 4)):
        with open(os.path.join(b, name), "a") as f:
            f.write(
                "".join(
                    json.dumps({"step": s, "old": True}) + "\n" for s in (2, 3) for _ in range(n)
                )
            )
            f.write('{"step": 3, "trunc')
    out_c, mc = _train(["--resume", os.path.join(b, "step_1")], b, str(cfg))
    assert re.search(r"dropped [34] later records of metrics.jsonl", out_c), out_c[-2000:]
    assert [m["step"] for m in ma] == [1, 2] and [m["step"] for m in mc] == [1, 2]
    assert mc[1]["metrics"] == ma[1]["metrics"]
    samples = {
        x: [json.loads(line) for line in open(os.path.join(x, "samples.jsonl"))] for x in (a, b)
    }
    assert samples[b] == samples[a] and {s["step"] for s in samples[a]} == {1, 2}
    # A resume into a new directory still works.
    _, mc = _train(["--resume", os.path.join(b, "step_1")], c, str(cfg))
    assert [m["step"] for m in mc] == [2] and mc[0]["metrics"] == ma[1]["metrics"]
    for r in range(4):
        sa = torch.load(os.path.join(a, "step_2", f"rank{r}.pt"), weights_only=False)
        sc = torch.load(os.path.join(c, "step_2", f"rank{r}.pt"), weights_only=False)
        assert sa["models"].keys() == sc["models"].keys() == {"actor", "critic"}
        for m, s in sa["models"].items():
            for k in ("flat", "exp_avg", "exp_avg_sq"):
                assert torch.equal(s[k], sc["models"][m][k]), (r, m, k)
            assert s["num_steps"] == sc["models"][m]["num_steps"] > 0


def _hf_worker(rank, world, tmp):
    from real_py.interop.hf import save_hf

    # A value model is exported with a pad id (transformers' sequence classifier pools by it;
    # real_py writes 0 when the config has none) and the embedding's pad row then gets no
    # gradient, as in transformers: give the random-init critic that pad id too.
    base = dict(
        BASE, plan=CF.single_process_plan(CF.from_dict({}).graph()), critic={"pad_token_id": 0}
    )
    cfg = CF.from_dict(base)
    confs = cfg.model_configs()
    for m, seed in (("actor", cfg.seed + 1), ("critic", cfg.seed + 2), ("reward", cfg.seed + 3)):
        save_hf(os.path.join(tmp, m), confs[m], init_weights(confs[m], seed))
    out = []
    for d in (
        base,
        dict(
            base,
            actor_path=os.path.join(tmp, "actor"),
            critic_path=os.path.join(tmp, "critic"),
            reward_path=os.path.join(tmp, "reward"),
        ),
    ):
        cfg = CF.from_dict(d)
        plan, graph, models = CF.validate(cfg, world)
        it = Runtime(cfg, plan, graph, models, timeout_s=60).iteration(0)
        out.append((it["metrics"], it["store"].data["tokens"]))
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.timeout(120)
def test_hf_checkpoints(tmp_path):
    """Models loaded from HF safetensors holding the random-init weights run exactly like the
    random-init models (same tokens, same metrics); a bad path fails in validation."""
    (m0, t0), (m1, t1) = _load(run_distributed(_hf_worker, 1, str(tmp_path), timeout=120)[0])
    assert torch.equal(t0, t1) and m0 == m1
    with pytest.raises(ValueError, match="config actor"):
        CF.from_dict({"actor_path": str(tmp_path / "missing")})


def _dies_worker(rank, world):
    cfg = CF.from_dict(dict(BASE, ppo={"adam_eps": 1e-6}))
    plan, graph, models = CF.validate(cfg, world)
    rt = Runtime(cfg, plan, graph, models, timeout_s=30)
    rt.iteration(0)
    if rank == 3:
        os._exit(1)
    rt.iteration(1)


@pytest.mark.timeout(200)
def test_dead_rank_fails_fast_with_rank_and_step():
    """Rank 3 dies between iterations: the others must fail (not hang) with errors that name
    their rank, the iteration and the call they were in."""
    with pytest.raises(RuntimeError) as e:
        run_distributed(_dies_worker, 4, timeout=150, pg_timeout=30, allow_exit=(3,))
    msg = str(e.value)
    for r in range(3):
        assert f"rank {r}, step 1, call " in msg, msg[-3000:]


def _rank_pid(out_dir: str, rank: int) -> int:
    """The pid of the job's `rank`, as the launcher wrote it into <out_dir>/logs/job.json."""
    with open(os.path.join(out_dir, "logs", "job.json")) as f:
        return json.load(f)["ranks"][rank]


@pytest.mark.timeout(300)
def test_stopped_rank_is_named_and_job_ends(tmp_path):
    """SIGSTOP rank 2 after step 1 of a 4-rank train job (--timeout 120): the others name it
    within seconds (heartbeat watch in the row pushes / transfers, the watchdog), the launcher
    then ends the job itself (SIGKILL reaches a stopped process; SIGTERM does not) within
    seconds of that, names rank 2 in its one line and leaves no process behind."""
    from real_py.liveness import SILENT_S

    out_dir = str(tmp_path / "run")
    cmd = [
        sys.executable,
        "-m",
        "real_py",
        "train",
        "--out-dir",
        out_dir,
        "--no-progress",
        "--timeout",
        "120",
        "--steps",
        "4",
        "save_every=0",
    ]
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, victim, stopped = [], None, None
    try:
        for line in p.stdout:
            out.append(line)
            if victim is None and line.startswith("step 1 |"):
                victim = _rank_pid(out_dir, 2)
                os.kill(victim, signal.SIGSTOP)
                stopped = time.monotonic()
        p.wait(timeout=60)
        took = time.monotonic() - stopped
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = "".join(out)
    assert victim is not None, text[-3000:]
    assert p.returncode != 0, text[-3000:]
    # Wherever the others wait on rank 2, it is named within seconds: in a transfer or a row
    # push by the wait itself, in a collective inside a call (a pipeline recv, a TP all-reduce)
    # or at the end of the step by the runtime's watchdog. Their messages are in their logs.
    logs = "".join(open(os.path.join(out_dir, "logs", f"rank{r}.log")).read() for r in (0, 1, 3))
    silent = re.search(
        r"rank [013], step \d+, (call \w+|end of iteration).*peer rank 2 is silent", logs
    )
    assert silent, logs[-3000:]
    assert re.search(r"^train failed: rank 2 was stopped .*named silent by rank", text, re.M), text[
        -3000:
    ]
    assert took < SILENT_S + 10, (
        f"job ended {took:.1f} s after the stop (detection after {SILENT_S} s)"
    )
    print(f"job ended {took:.1f} s after the stop:", silent.group(0)[:200])
    assert (
        not os.path.exists(f"/proc/{victim}")
        or open(f"/proc/{victim}/stat").read().split()[2] == "Z"
    )


@pytest.mark.timeout(600)
def test_kill_and_resume_in_async_mode(tmp_path):
    """Async GRPO (k=2, decoupled loss, weights received during generation) on the copy task with
    generation and training on disjoint ranks: run A does 3 steps; run B is SIGKILLed after its
    step-1 checkpoint (which holds the queued rollouts of later batches), run C resumes it. C's
    steps 2 and 3 (metrics, including staleness and dropped rows) and every rank's step-3 shards and
    Adam moments must equal A's."""
    import yaml

    d = CF.read_yaml(
        os.path.join(ROOT, "configs", "copy_task", "grpo.yaml")
    )  # its paths made absolute
    # 20-token responses (min_new_tokens) make a step last long enough that the kill lands
    # after the step-1 checkpoint and before the job ends, even on a loaded machine.
    d.update(
        steps=3,
        save_every=1,
        verify_realloc=True,
        data=dict(d["data"], batch_size=16),
        generation=dict(d["generation"], max_new_tokens=20, min_new_tokens=20),
        ppo=dict(d["ppo"], decoupled=True),
        plan={
            "world_size": 4,
            "calls": {
                "actor_gen": {"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1},
                "ref_inf": {"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1},
                "rew_inf": {"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1},
                "actor_train": {"ranks": [0, 1], "dp": 1, "tp": 2, "pp": 1},
            },
        },
    )
    d["async"] = {"max_staleness": 2, "check_versions": True, "overlap_realloc": True}
    cfg = tmp_path / "async.yaml"
    cfg.write_text(yaml.safe_dump(d))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _, ma = _train([], a, str(cfg))
    _run_killed_after_step_1(b, str(cfg))
    _, mb = _train(["--resume", os.path.join(b, "step_1")], b, str(cfg))
    assert [m["step"] for m in ma] == [1, 2, 3] and [m["step"] for m in mb] == [1, 2, 3]
    strip = lambda m: {k: v for k, v in m.items() if k != "prefetched_calls"}
    assert [strip(m["metrics"]) for m in mb[1:]] == [strip(m["metrics"]) for m in ma[1:]]
    assert "staleness" in ma[2]["metrics"]
    for r in range(4):
        sa = torch.load(os.path.join(a, "step_3", f"rank{r}.pt"), weights_only=False)
        sb = torch.load(os.path.join(b, "step_3", f"rank{r}.pt"), weights_only=False)
        assert sa["models"].keys() == sb["models"].keys()
        for m, s in sa["models"].items():
            for k in ("flat", "exp_avg", "exp_avg_sq"):
                if k in s:
                    assert torch.equal(s[k], sb["models"][m][k]), (r, m, k)
