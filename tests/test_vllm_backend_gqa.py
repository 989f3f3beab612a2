"""The real_py vLLM backend on a GQA Llama with one kv head at vLLM tp=2 (each worker holds a
replica of the kv head, vocab 1000 padded to 1024, tied embedding and lm_head): updates from
tp=1 trainer layouts equal a fresh vLLM on the exported checkpoint, bit for bit.
A failure points to the replicated-kv storage format (TPRule.replicate_units) or the tied
lm_head's re-processing in real_py/vllm/worker.py."""

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

from real_py import Layout

pytestmark = [pytest.mark.dist, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_gqa")
    cfg = write_checkpoint(
        root / "init", model_type="llama", vocab=1000, heads=4, kv_heads=1, tie=True
    )
    ref_full = perturbed(load_full(root / "init", cfg), seed=1)
    export(root / "ref", cfg, ref_full, source=root / "init")
    llm = start_llm(root / "ref", tp=2)
    yield {"llm": llm, "cfg": cfg, "ref_full": ref_full, "ref": generate(llm), "root": root}
    stop_llm(llm)


@pytest.mark.parametrize("text", ["dp2,pp2", "dp4,dim0", "dp4,flat"])
def test_update_with_replicated_kv_heads(world, text):
    llm, cfg = world["llm"], world["cfg"]
    layout = Layout.parse(text)
    other = perturbed(world["ref_full"], seed=6)
    shards = shards_of(cfg, layout, other)
    engines = trainer_engines(llm, cfg, layout, shards)
    stats = send(engines)
    assert generate(llm) != world["ref"]
    assert_matches_transformers(
        generate(llm), world["root"], text.replace(",", "_"), cfg, other, world["root"] / "init"
    )
    plan = engines[0].plan.summary()
    # Both workers hold the one kv head: each receives its copy once, nothing more.
    assert plan["network_bytes"] == plan["min_network_bytes"]
    assert sum(w["received_bytes"] for w in stats[0]["workers"]) == plan["network_bytes"]
    for r, sh in shards_of(cfg, layout, world["ref_full"]).items():
        shards[r].flat.copy_(sh.flat)
    send(engines)
    assert generate(llm) == world["ref"]
