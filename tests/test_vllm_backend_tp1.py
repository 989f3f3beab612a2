"""The real_py vLLM backend at vLLM tp=1 (one worker holds everything, vocab padded to 64 rows):
updates from three trainer layouts equal a fresh vLLM on the exported checkpoint, bit for bit.
A failure points to real_py/vllm/ or the vLLM storage format at tp=1 (spec/formats.py)."""

from __future__ import annotations

import pytest
from support.vllm_cases import (
    assert_matches_transformers,
    export,
    generate,
    load_full,
    perturbed,
    send,
    shards_of,
    start_llm,
    stop_llm,
    trainer_engines,
    write_checkpoint,
)

from real_py import Layout, ModelShard, model_spec
from real_py.interop import megatron_config, megatron_layout

pytestmark = [pytest.mark.dist, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tp1")
    cfg = write_checkpoint(root / "init", vocab=500, heads=4, kv_heads=2, tie=True)
    ref_full = perturbed(load_full(root / "init", cfg), seed=1)
    export(root / "ref", cfg, ref_full, source=root / "init")
    llm = start_llm(root / "ref", tp=1)
    yield {"llm": llm, "cfg": cfg, "ref_full": ref_full, "ref": generate(llm), "root": root}
    stop_llm(llm)


@pytest.mark.parametrize("name", ["tp2pp2", "fsdp2_dim0_dp4", "megatron_grouped_tp2"])
def test_update_equals_fresh_engine_on_exported_checkpoint(world, name):
    llm, cfg = world["llm"], world["cfg"]
    layout = {
        "tp2pp2": Layout.parse("dp1,tp2,pp2"),
        "fsdp2_dim0_dp4": Layout(dp=4, dp_shard="dim0"),
        "megatron_grouped_tp2": megatron_layout(dp=2, tp=2),
    }[name]
    tcfg = megatron_config(cfg) if name.startswith("megatron") else cfg
    other = perturbed(world["ref_full"], seed=4)
    shards = {r: ModelShard.from_full(model_spec(tcfg), layout, r, other) for r in layout.ranks}
    engines = trainer_engines(llm, tcfg, layout, shards)
    stats = send(engines)
    assert generate(llm) != world["ref"]
    assert_matches_transformers(
        generate(llm), world["root"], name, cfg, other, world["root"] / "init"
    )
    plan = engines[0].plan.summary()
    assert (
        plan["network_bytes"]
        == plan["min_network_bytes"]
        == stats[0]["workers"][0]["received_bytes"]
    )
    for r, sh in shards_of(tcfg, layout, world["ref_full"]).items():
        shards[r].flat.copy_(sh.flat)
    send(engines)
    assert generate(llm) == world["ref"]


def test_full_tensor_fallback_repacks_a_tied_lm_head(world):
    """The full-tensor path on a tied model: vLLM's layerwise reload leaves the tied lm_head's
    packed CPU copy of the old embedding; the backend re-packs it, so the answer equals
    transformers on the new weights."""
    llm, cfg = world["llm"], world["cfg"]
    layout = Layout.parse("dp1,tp2,pp2")
    other = perturbed(world["ref_full"], seed=12)
    shards = shards_of(cfg, layout, other)
    engines = trainer_engines(llm, cfg, layout, shards, full_tensors=True)
    stats = send(engines)
    assert all(w["full"] for w in stats[0]["workers"])
    assert_matches_transformers(
        generate(llm), world["root"], "full_tied", cfg, other, world["root"] / "init"
    )
    for r, sh in shards_of(cfg, layout, world["ref_full"]).items():
        shards[r].flat.copy_(sh.flat)
    send(engines)
    assert generate(llm) == world["ref"]


def _modules_on_receive_buffer(worker) -> list[str]:
    """Runs in the vLLM worker: the modules that keep a tensor on the backend's receive buffer."""
    from real_py.vllm.worker import _holds_storage

    eng = worker.weight_transfer_engine
    ptr = eng.shard.flat.untyped_storage().data_ptr()
    return [name for name, m in eng.model.named_modules() if _holds_storage(m, ptr)]


def test_no_layer_keeps_the_receive_buffer(world):
    """The prepacked layers are lent the received weight and pack a copy; none may keep the
    buffer itself, which the next update overwrites before every worker agreed to write."""
    llm, cfg = world["llm"], world["cfg"]
    layout = Layout.parse("dp1,tp2,pp2")
    shards = shards_of(cfg, layout, perturbed(world["ref_full"], seed=21))
    engines = trainer_engines(llm, cfg, layout, shards)
    send(engines)
    assert llm.collective_rpc(_modules_on_receive_buffer) == [[]]
    for r, sh in shards_of(cfg, layout, world["ref_full"]).items():
        shards[r].flat.copy_(sh.flat)
    send(engines)
    assert generate(llm) == world["ref"]


def test_holds_storage_sees_parameters_attributes_and_closures():
    import torch

    from real_py.vllm.worker import _holds_storage

    buf = torch.zeros(64)
    other = torch.zeros(8)
    m = torch.nn.Linear(4, 4)
    assert not _holds_storage(m, buf.untyped_storage().data_ptr())
    view = buf[8:24].view(4, 4)
    m.cpu_linear = lambda x, w, b: x @ view
    assert _holds_storage(m, buf.untyped_storage().data_ptr())
    m.cpu_linear = lambda x, w, b, _w=view.t(): x @ _w
    assert _holds_storage(m, buf.untyped_storage().data_ptr())
    m.cpu_linear = lambda x, w, b, _w=other: x @ _w
    assert not _holds_storage(m, buf.untyped_storage().data_ptr())
    m.weight.data = buf[:16].view(4, 4)
    assert _holds_storage(m, buf.untyped_storage().data_ptr())
