"""The real_py vLLM weight-transfer backend at vLLM tp=2 on a Qwen2 whose vocab needs padding:
after an update from any trainer layout, vLLM's greedy tokens and logprobs equal those of a fresh
vLLM started from the exported checkpoint; failures leave the previous weights serving.
A failure points to real_py/vllm/ (engines, group), the vLLM storage format (spec/formats.py)
or the planner."""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import replace

import pytest
import torch
from support.vllm_cases import (
    assert_matches_transformers,
    export,
    free_port,
    generate,
    load_full,
    on_ranks,
    perturbed,
    send,
    shards_of,
    start_llm,
    stop_llm,
    trainer_engines,
    write_checkpoint,
)

from real_py import Layout, ModelShard, model_spec
from real_py.interop import (
    from_megatron_state_dict,
    megatron_config,
    megatron_layout,
    shard_from_params,
)
from real_py.interop.adapters import to_megatron_state_dict

pytestmark = [pytest.mark.dist, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One engine for the module, started from the exported reference weights W_ref."""
    root = tmp_path_factory.mktemp("vllm_tp2")
    cfg = write_checkpoint(root / "init", vocab=500, heads=4, kv_heads=2)
    ref_full = perturbed(load_full(root / "init", cfg), seed=1)
    export(root / "ref", cfg, ref_full, source=root / "init")
    llm = start_llm(root / "ref", tp=2)
    w = {"llm": llm, "cfg": cfg, "ref_full": ref_full, "ref": generate(llm), "root": root}
    yield w
    stop_llm(llm)


def _layouts(cfg):
    """(id, trainer config, layout, shards from full tensors)."""
    mcfg = megatron_config(cfg)

    def megatron(full):  # through Megatron-core state dicts and the interop adapters
        layout, spec = megatron_layout(tp=2, pp=2), model_spec(mcfg)
        out = {}
        for r in layout.ranks:
            local = ModelShard.from_full(spec, layout, r, full).params()
            sd = to_megatron_state_dict(local, spec, layout, r)
            out[r] = shard_from_params(
                spec, layout, r, from_megatron_state_dict(sd, spec, layout, r)
            )
        return out

    fsdp = Layout(dp=4, dp_shard="dim0")
    tp2pp2 = Layout.parse("dp1,tp2,pp2")
    return {
        "tp2pp2": (cfg, tp2pp2, lambda full: shards_of(cfg, tp2pp2, full)),
        "fsdp2_dim0_dp4": (cfg, fsdp, lambda full: shards_of(cfg, fsdp, full)),
        "megatron_grouped_tp2pp2": (mcfg, megatron_layout(tp=2, pp=2), megatron),
    }


@pytest.mark.parametrize("name", ["tp2pp2", "fsdp2_dim0_dp4", "megatron_grouped_tp2pp2"])
def test_update_equals_fresh_engine_on_exported_checkpoint(world, name):
    llm, ref = world["llm"], world["ref"]
    cfg, layout, make = _layouts(world["cfg"])[name]
    other = perturbed(world["ref_full"], seed=7)
    shards = make(other)
    engines = trainer_engines(llm, cfg, layout, shards)
    stats = send(engines)
    assert generate(llm) != ref, "other weights sent, but vLLM still answers as the reference"
    assert_matches_transformers(
        generate(llm), world["root"], name, world["cfg"], other, world["root"] / "init"
    )
    # Every byte a worker holds arrived once; the trainers sent exactly the plan's minimum.
    plan = engines[0].plan.summary()
    assert plan["network_bytes"] == plan["min_network_bytes"]
    assert sum(s["sent_bytes"] for s in stats.values()) == plan["network_bytes"]
    assert sum(w["received_bytes"] for w in stats[0]["workers"]) == plan["network_bytes"]
    assert all(not w["full"] for w in stats[0]["workers"])
    # No trainer rank gathers: its staging stays within the bucket, far below the model.
    model_bytes = model_spec(cfg).numel * 4
    assert all(s["staging_bytes"] <= engines[r].info.bucket_bytes for r, s in stats.items())
    for r, sh in make(world["ref_full"]).items():
        shards[r].flat.copy_(sh.flat)
    send(engines)
    assert generate(llm) == ref
    assert max(s["staging_bytes"] for s in stats.values()) < model_bytes


def test_full_tensor_fallback_loads_through_vllm(world):
    llm, cfg = world["llm"], world["cfg"]
    layout = Layout.parse("dp1,tp2,pp2")
    shards = shards_of(cfg, layout, perturbed(world["ref_full"], seed=3))
    engines = trainer_engines(llm, cfg, layout, shards, full_tensors=True)
    assert generate(llm) == world["ref"]  # init alone changes nothing
    stats = send(engines)
    assert generate(llm) != world["ref"]
    assert_matches_transformers(
        generate(llm),
        world["root"],
        "full3",
        cfg,
        perturbed(world["ref_full"], seed=3),
        world["root"] / "init",
    )
    workers = stats[0]["workers"]
    assert all(w["full"] for w in workers)
    full_bytes = model_spec(cfg).numel * 4
    assert [w["received_bytes"] for w in workers] == [full_bytes] * len(workers)
    for r, sh in shards_of(cfg, layout, world["ref_full"]).items():
        shards[r].flat.copy_(sh.flat)
    send(engines)
    assert generate(llm) == world["ref"]


def test_update_resets_the_prefix_cache(world):
    """A prompt longer than one KV block, cached before the update, answers with the new
    weights: the same as after an explicit reset."""
    llm, cfg = world["llm"], world["cfg"]
    layout = Layout.parse("dp1,tp2,pp2")
    shards = shards_of(cfg, layout, world["ref_full"])
    engines = trainer_engines(llm, cfg, layout, shards)
    send(engines)
    before = generate(llm)  # caches the prompts' blocks under W_ref
    for r, sh in shards_of(cfg, layout, perturbed(world["ref_full"], seed=11)).items():
        shards[r].flat.copy_(sh.flat)
    send(engines)
    after = generate(llm)
    llm.reset_prefix_cache()
    assert after == generate(llm) != before
    for r, sh in shards_of(cfg, layout, world["ref_full"]).items():
        shards[r].flat.copy_(sh.flat)
    send(engines)
    assert generate(llm) == world["ref"]


def test_wrong_model_or_dtype_refused_at_init_on_both_sides(world):
    llm, cfg = world["llm"], world["cfg"]
    layout = Layout(dp=2)
    for bad, words in (
        (replace(cfg, num_hidden_layers=3), "does not match vLLM"),
        (replace(cfg, vocab_size=512), "does not match vLLM"),
        (replace(cfg, dtype="bfloat16"), "vLLM runs torch.float32"),
    ):
        spec = model_spec(bad)
        shards = {r: ModelShard.empty(spec, layout, r) for r in layout.ranks}
        with pytest.raises(RuntimeError, match=words) as e:
            trainer_engines(llm, bad, layout, shards, timeout_s=30)
        assert "member 2 refused" in str(e.value) and "vLLM worker 0" in str(e.value)
        assert generate(llm) == world["ref"]


def test_wrong_shard_mid_update_keeps_previous_weights(world):
    """A trainer rank whose shard is of another dtype fails its send; every worker gives up the
    update naming that rank, vLLM serves the previous weights, a new init works."""
    llm, cfg = world["llm"], world["cfg"]
    layout = Layout.parse("dp1,tp2,pp2")
    shards = shards_of(cfg, layout, perturbed(world["ref_full"], seed=5))
    engines = trainer_engines(llm, cfg, layout, shards, timeout_s=30)
    bad = replace(cfg, dtype="float64")
    engines[3].source.shard = ModelShard.empty(model_spec(bad), layout, 3)
    with pytest.raises(Exception, match="rank 3") as e:
        send(engines)
    assert "float64" in str(e.value) or "source shard" in str(e.value)
    assert generate(llm) == world["ref"], "a failed update changed what vLLM serves"
    with pytest.raises(RuntimeError, match="trainer_init again"):
        engines[0].send_weights()  # the sender heard every worker fail
    engines = trainer_engines(llm, cfg, layout, shards_of(cfg, layout, world["ref_full"]))
    send(engines)
    assert generate(llm) == world["ref"]


DOOMED = 2
"""The trainer rank killed below: stage 1, tp rank 0 of dp1,tp2,pp2. It sends to vLLM worker 0
only (layer 1's tp-0 half, lm_head rows 0..249), so worker 1 receives all of its shard anyway and
must still not write it: the workers write only once every one received all of its own."""


def _doomed_rank(cfg_dict, port, workers, ready, layout_dict):
    from real_py.vllm import RealPyTrainerEngine, RealPyTrainerInitInfo, ShardSource
    from real_py.vllm.names import config_from_dict

    cfg, layout = config_from_dict(cfg_dict), Layout(**layout_dict)
    shard = ModelShard.from_full(model_spec(cfg), layout, DOOMED, perturbed_full(cfg))
    info = RealPyTrainerInitInfo(
        rank=DOOMED,
        master_address="127.0.0.1",
        master_port=port,
        config=cfg,
        layout=layout,
        num_workers=workers,
        timeout_s=30,
    )
    RealPyTrainerEngine.trainer_init(info, client=None, source=ShardSource(shard))
    ready.set()
    signal.pause()


def perturbed_full(cfg):
    spec = model_spec(cfg)
    g = torch.Generator().manual_seed(9)
    return {p.name: torch.randn(p.shape, generator=g) for p in spec.params}


def test_trainer_rank_killed_before_an_update_keeps_previous_weights(world):
    from dataclasses import asdict

    from real_py.vllm import RealPyTrainerEngine, RealPyTrainerInitInfo, ShardSource
    from real_py.vllm.names import config_dict

    llm, cfg = world["llm"], world["cfg"]
    layout = Layout.parse("dp1,tp2,pp2")
    shards = shards_of(cfg, layout, perturbed_full(cfg))
    port, workers = free_port(), llm.llm_engine.vllm_config.parallel_config.world_size
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(
        target=_doomed_rank, args=(config_dict(cfg), port, workers, ready, asdict(layout))
    )
    proc.start()
    try:

        def init(r):
            info = RealPyTrainerInitInfo(
                rank=r,
                master_address="127.0.0.1",
                master_port=port,
                config=cfg,
                layout=layout,
                num_workers=workers,
                timeout_s=30,
            )
            return RealPyTrainerEngine.trainer_init(info, client=llm, source=ShardSource(shards[r]))

        engines = on_ranks([r for r in range(4) if r != DOOMED], init)
        plan = engines[0].plan
        takers = {
            w
            for m in range(plan.num_messages)
            if int(plan.msg_sender[m]) == DOOMED
            for w in plan.receivers(m)
        }
        assert takers and takers != set(plan.dst.ranks), (
            "the test needs a worker that does not wait on the dead rank"
        )
        assert ready.wait(60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(Exception) as e:
            send(engines)
        assert f"rank {DOOMED}" in str(e.value), str(e.value)
    finally:
        if proc.is_alive():
            proc.kill()
    assert generate(llm) == world["ref"], "a failed update changed what vLLM serves"
    engines = trainer_engines(llm, cfg, layout, shards_of(cfg, layout, world["ref_full"]))
    send(engines)
    assert generate(llm) == world["ref"]
