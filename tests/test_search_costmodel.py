# Checks the search's cost model pieces (FLOPs, collectives, decode roofline, memory, reallocation
# time, hardware profiles) against hand-computed values; a failure points to
# real_py/search/costmodel.py, realloc_cost.py or hardware.py (formula or unit error: every time is
# in seconds).
from dataclasses import replace

import pytest

from real_py.layout import Layout
from real_py.realloc.plan import plan_realloc
from real_py.search import Mesh, Workload, call_memory, call_time, get_profile
from real_py.search.costmodel import allreduce_time, fwd_flops, group_link, matmul_params
from real_py.search.hardware import HardwareProfile
from real_py.search.realloc_cost import ReallocCost, canonical_meshes, transfer_time
from real_py.spec import ModelConfig, model_spec, preset

pytestmark = pytest.mark.timeout(120)

TINY = ModelConfig(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=100,
    num_hidden_layers=2,
    dtype="bfloat16",
)
HW = HardwareProfile(
    name="t",
    peak_flops=1e12,
    flops_eff=0.5,
    hbm_bw=1e11,
    hbm_eff=0.5,
    intra_bw=1e10,
    inter_bw=1e9,
    intra_lat=1e-5,
    inter_lat=2e-5,
    mem_bytes=1e10,
    ranks_per_node=4,
)


def tiny():
    return model_spec(TINY, "tiny")


def test_param_and_flop_counts():
    m = tiny()
    # embed 6400; per layer norms 128 + qkv 12288 + o 4096 + gate_up 16384 + down 8192; norm 64;
    # head 6400
    assert m.numel == 6400 + 2 * 41088 + 64 + 6400
    assert matmul_params(m) == m.numel - 6400
    assert fwd_flops(m, 10, 8) == 10 * (2 * 88640 + 4 * 2 * 8 * 64)


def test_allreduce_and_links():
    assert allreduce_time(1e9, 1, 1e10, 1e-5) == 0.0
    assert allreduce_time(1e9, 4, 1e10, 1e-5) == pytest.approx(1e-5 + 1.5 * 0.1)
    # 8 ranks on 2 nodes of 4: tp=2 groups stay inside a node, dp=4 with stride 2 crosses nodes.
    mesh = Mesh(0, 8)
    assert group_link(HW, mesh, 1, 2) == (1e10, 1e-5)
    assert group_link(HW, mesh, 2, 4) == (1e9, 2e-5)
    assert group_link(HW, Mesh(4, 4), 1, 4) == (1e10, 1e-5)


def test_inference_time_by_hand():
    m, wl = tiny(), Workload(batch_size=8, prompt_len=12, gen_len=4, micro_tokens=1 << 20)
    t = call_time("inference", m, Mesh(0, 2), 1, 2, 1, HW, wl)
    tok = 8 * 16
    compute = tok * (2 * 88640 + 4 * 2 * 8 * 64) / 2 / 5e11
    tp = 2 * 2 * (1e-5 + 0.5 * 2 * tok * 64 * 2 / 1e10)  # 2 all-reduces x 2 layers, one micro-batch
    tp += 4 * 1e-5  # embedding and log-prob reductions of the vocab-parallel head (latency only)
    assert t["compute"] == pytest.approx(compute)
    assert t["tp"] == pytest.approx(tp)
    assert t["total"] == pytest.approx(compute + tp)


def test_decode_is_memory_bound_by_hand():
    m, wl = tiny(), Workload(batch_size=2, prompt_len=6, gen_len=4, micro_tokens=1 << 20)
    t = call_time("generate", m, Mesh(0, 1), 1, 1, 1, HW, wl)
    ctx = 6 + 2
    kv = 2 * ctx * 2 * 2 * 64 * 2  # seqs * ctx * layers * (k, v) * kv dim * bytes
    step_mem = (m.numel * 2 + kv) / 5e10
    step_flops = 2 * (2 * 88640 + 4 * 2 * ctx * 64) / 5e11
    assert t["decode"] == pytest.approx(4 * max(step_mem, step_flops))
    assert t["prefill"] == pytest.approx(2 * 6 * (2 * 88640 + 4 * 2 * 3 * 64) / 5e11)


def test_train_terms_by_hand():
    m, wl = (
        tiny(),
        Workload(batch_size=8, prompt_len=8, gen_len=8, ppo_minibatches=2, micro_tokens=16),
    )
    t = call_time("train", m, Mesh(0, 4), 2, 1, 2, HW, wl)
    tok = 8 / 2 * 16 / 2  # per replica per optimizer step
    mb = 2  # micro-batches of 16 tokens
    bubble = (mb + 1) / mb
    assert t["compute"] == pytest.approx(
        2 * 3 * tok * (2 * 88640 + 4 * 2 * 8 * 64) / 2 / 5e11 * bubble
    )
    local = m.numel / 2
    # per step: gradient all-reduce + loss and token-count all-reduces (dp) + grad-norm and loss
    # broadcast over the pipeline group
    assert t["dp"] == pytest.approx(2 * (1e-5 + 0.5 * 2 * local * 2 / 1e10 + 2 * 1e-5 + 2 * 1e-5))
    assert t["optimizer"] == pytest.approx(2 * local / 2 * (24 + 6) / 5e10)
    # pp=2: (m + pp - 2) = 2 hops forward and backward per step, stride dp*tp = 2 inside the node.
    assert t["pp"] == pytest.approx(2 * 2 * 2 * (1e-5 + 16 * 64 * 2 / 1e10))


def test_ppo_epochs_repeat_the_train_steps():
    m = tiny()
    one = call_time(
        "train", m, Mesh(0, 2), 1, 2, 1, HW, Workload(batch_size=8, prompt_len=8, gen_len=8)
    )
    two = call_time(
        "train",
        m,
        Mesh(0, 2),
        1,
        2,
        1,
        HW,
        Workload(batch_size=8, prompt_len=8, gen_len=8, ppo_epochs=2),
    )
    for k in set(one) - {"busy", "working"}:  # seconds terms; those two count ranks
        assert two[k] == pytest.approx(2 * one[k])
    assert (two["busy"], two["working"]) == (one["busy"], one["working"])


# Only host overheads: compute, bandwidth and latency are free.
FREE = dict(
    name="o",
    peak_flops=1e30,
    flops_eff=1.0,
    hbm_bw=1e30,
    hbm_eff=1.0,
    intra_bw=1e30,
    inter_bw=1e30,
    intra_lat=0.0,
    inter_lat=0.0,
    mem_bytes=1e12,
    layer_lat=1.0,
    head_lat=10.0,
    decode_layer_lat=100.0,
    decode_lat=1000.0,
    train_layer_lat=1e4,
    train_lat=1e5,
)


def test_host_overheads_by_hand():
    m, hw = tiny(), HardwareProfile(**FREE)
    wl = Workload(batch_size=8, prompt_len=8, gen_len=4, micro_tokens=32)
    # inference on pp=2: 8 seqs x 12 tokens = 96 tokens -> 3 micro-batches, bubble (3+1)/3;
    # per micro-batch 1 layer per stage plus the head.
    t = call_time("inference", m, Mesh(0, 2), 1, 1, 2, hw, wl)
    assert t["overhead"] == pytest.approx(3 * (4 / 3 * 1 * 1.0 + 10.0))
    # generate on one rank: prefill (64 tokens, 2 micro-batches) and scoring (96 tokens, 3), each
    # micro-batch 2 layers + head; 4 decode steps of 2 layers + sampling.
    g = call_time("generate", m, Mesh(0, 1), 1, 1, 1, hw, wl)
    assert g["overhead"] == pytest.approx(2 * (2 + 10) + 3 * (2 + 10) + 4 * (2 * 100 + 1000))
    # train: 4 mini-batches of 24 tokens, one micro-batch each, 2 layers + head per step.
    tr = call_time("train", m, Mesh(0, 1), 1, 1, 1, hw, wl)
    assert tr["overhead"] == pytest.approx(4 * (2 * 1e4 + 1e5))


def test_runtime_micro_batch_counts():
    """Workload.runtime_micro_batches: the runtime's counts (micro_batches per train mini-batch,
    forward-only passes whole) instead of the cheapest count from micro_tokens."""
    m, hw = tiny(), HardwareProfile(**FREE)
    wl = Workload(
        batch_size=8,
        prompt_len=8,
        gen_len=4,
        micro_tokens=32,
        micro_batches=2,
        runtime_micro_batches=True,
    )
    # inference on pp=2: 96 tokens in one pass, bubble (1 + 1) / 1, 1 layer per stage plus the head
    # (test_host_overheads_by_hand: 3 micro-batches from micro_tokens)
    t = call_time("inference", m, Mesh(0, 2), 1, 1, 2, hw, wl)
    assert t["overhead"] == pytest.approx(1 * (2 * 1 * 1.0 + 10.0))
    g = call_time("generate", m, Mesh(0, 1), 1, 1, 1, hw, wl)
    assert g["overhead"] == pytest.approx((2 + 10) + (2 + 10) + 4 * (2 * 100 + 1000))
    # train: 4 mini-batches of 24 tokens, 2 micro-batches each (1 from micro_tokens)
    tr = call_time("train", m, Mesh(0, 1), 1, 1, 1, hw, wl)
    assert tr["overhead"] == pytest.approx(4 * 2 * (2 * 1e4 + 1e5))
    # on pp=2 the count stays 2 although 8 micro-batches would cost less: the bubble is (2+1)/2
    tp2 = call_time("train", m, Mesh(0, 2), 1, 1, 2, hw, wl)
    assert tp2["overhead"] == pytest.approx(4 * 2 * (3 / 2 * 1 * 1e4 + 1e5))
    # memory: the inference pass holds all 96 tokens (32 from micro_tokens), a train micro-batch 12
    free = replace(wl, runtime_micro_batches=False)
    assert call_memory("inference", m, 1, 1, 1, wl)["transient"] == pytest.approx(
        3 * call_memory("inference", m, 1, 1, 1, free)["transient"]
    )
    assert call_memory("train", m, 1, 1, 1, wl)["transient"] == pytest.approx(
        call_memory("train", m, 1, 1, 1, free)["transient"] / 2
    )
    # generate: the larger of decoding (KV cache 49152 B + one step's logits 3200 B) and its
    # scoring pass (the inference pass's 136704 B)
    assert (
        call_memory("generate", m, 1, 1, 1, wl)["transient"]
        == call_memory("inference", m, 1, 1, 1, wl)["transient"]
    )
    assert call_memory("generate", m, 1, 1, 1, free)["transient"] == pytest.approx(
        8 * 12 * 2 * 2 * 4 * 16 * 2 + 8 * 100 * 4
    )


def test_value_head_pass_costs_by_hand():
    """A value model's passes carry value_head_lat / value_train_lat; unset, the lm head's."""
    v = model_spec(replace(TINY, head="value"), "tiny-value")
    wl = Workload(batch_size=8, prompt_len=8, gen_len=4, micro_tokens=1 << 20)
    hw = HardwareProfile(**FREE | dict(value_head_lat=3.0, value_train_lat=7.0))
    assert call_time("inference", v, Mesh(0, 1), 1, 1, 1, hw, wl)["overhead"] == pytest.approx(
        2 * 1.0 + 3.0
    )
    assert call_time("train", v, Mesh(0, 1), 1, 1, 1, hw, wl)["overhead"] == pytest.approx(
        4 * (2 * 1e4 + 7.0)
    )
    assert call_time("inference", tiny(), Mesh(0, 1), 1, 1, 1, hw, wl)["overhead"] == pytest.approx(
        2 + 10.0
    )
    same = HardwareProfile(**FREE)
    assert call_time("inference", v, Mesh(0, 1), 1, 1, 1, same, wl)["overhead"] == pytest.approx(
        2 + 10.0
    )
    with pytest.raises(ValueError, match="value_head_lat"):
        replace(same, value_head_lat=-1.0)


def test_pipeline_messages_by_hand():
    """A hop and the last stage's broadcast over two stages are point-to-point messages
    (p2p_lat_ratio x the collective latency); a stage group's all-reduce (train) is a collective."""
    m = tiny()
    wl = Workload(batch_size=8, prompt_len=8, gen_len=4, runtime_micro_batches=True)
    lat = HardwareProfile(**FREE | dict(intra_lat=1.0, inter_lat=1.0, p2p_lat_ratio=0.25))
    # inference, one micro-batch: one hop + the results broadcast
    assert call_time("inference", m, Mesh(0, 2), 1, 1, 2, lat, wl)["pp"] == pytest.approx(0.5)
    # generate: prefill and scoring passes one hop each; per decode step one hop + one broadcast
    g = call_time("generate", m, Mesh(0, 2), 1, 1, 2, lat, wl)
    assert g["prefill_pp"] == pytest.approx(0.25) and g["score_pp"] == pytest.approx(0.25)
    assert g["decode_pp"] == pytest.approx(4 * 0.5)
    # train: 4 optimizer steps of a forward and a backward hop, and 2 small all-reduces over pp
    t = call_time("train", m, Mesh(0, 2), 1, 1, 2, lat, wl)
    assert t["pp"] == pytest.approx(4 * 2 * 0.25) and t["dp"] == pytest.approx(4 * 2 * 1.0)


def test_contention_by_hand():
    m = tiny()
    wl = Workload(batch_size=8, prompt_len=8, gen_len=4, micro_tokens=1 << 20)
    base = replace(HW, layer_lat=1e-3, head_lat=2e-3)
    shared = replace(base, shared_cores=2, lat_contention=0.5)
    assert (
        shared.contention(1) == 1.0 and shared.contention(6) == 3.0 and base.contention(64) == 1.0
    )
    assert shared.lat_slowdown(4) == pytest.approx(1.5)
    # 4 busy ranks on 2 cores: processor terms x2, message waits x(1 + 0.5 * (2 - 1)).
    a = call_time("inference", m, Mesh(0, 4), 2, 2, 1, base, wl)
    b = call_time("inference", m, Mesh(0, 4), 2, 2, 1, shared, wl)
    assert b["compute"] == pytest.approx(2 * a["compute"]) and b["overhead"] == pytest.approx(
        2 * a["overhead"]
    )
    assert b["tp"] == pytest.approx(1.5 * a["tp"])
    # pp=2 with one micro-batch: one stage busy at a time, so 2 busy ranks: no slow-down.
    c = call_time("inference", m, Mesh(0, 4), 1, 2, 2, shared, wl)
    assert c == call_time("inference", m, Mesh(0, 4), 1, 2, 2, base, wl)
    # ... but after the pipeline flush all 4 ranks reduce gradients and step at once.
    tb = call_time("train", m, Mesh(0, 4), 2, 1, 2, base, wl)
    ts = call_time("train", m, Mesh(0, 4), 2, 1, 2, shared, wl)
    assert ts["compute"] == pytest.approx(tb["compute"]) and ts["overhead"] == pytest.approx(
        tb["overhead"]
    )
    assert ts["optimizer"] == pytest.approx(2 * tb["optimizer"]) and ts["dp"] == pytest.approx(
        1.5 * tb["dp"]
    )
    # Replicas of a pipeline (dp > 1, pp > 1) hand over out of step: every message between
    # stages waits pipe_wait_lat more; the stages' work is not stretched. One replica (dp = 1),
    # or no pipeline, does not wait.
    w = 1e-3
    piped = replace(shared, pipe_wait_lat=w)
    one = Workload(batch_size=8, prompt_len=8, gen_len=4, runtime_micro_batches=True)
    i0, i1 = (call_time("inference", m, Mesh(0, 4), 2, 1, 2, h, one) for h in (shared, piped))
    assert i1["pp"] - i0["pp"] == pytest.approx(2 * w)  # hop + broadcast, 2 busy ranks: x1
    assert i1["overhead"] == i0["overhead"] and i1["compute"] == i0["compute"]
    t0, t1 = (call_time("train", m, Mesh(0, 4), 2, 1, 2, h, one) for h in (shared, piped))
    assert t1["pp"] - t0["pp"] == pytest.approx(4 * 2 * w)  # 4 steps x (forward + backward hop)
    # not the 2 small all-reduces over the stages per step: after the flush every rank is busy
    assert t1["dp"] == t0["dp"]
    assert t1["overhead"] == t0["overhead"] and t1["optimizer"] == t0["optimizer"]
    g0, g1 = (call_time("generate", m, Mesh(0, 4), 2, 1, 2, h, one) for h in (shared, piped))
    assert g1["decode_pp"] - g0["decode_pp"] == pytest.approx(4 * 2 * w)
    assert g1["total"] - g0["total"] == pytest.approx((4 * 2 + 2) * w)  # + prefill and scoring hops
    for dp, tp, pp in ((1, 2, 2), (2, 2, 1), (4, 1, 1)):
        for kind in ("generate", "inference", "train"):
            assert call_time(kind, m, Mesh(0, 4), dp, tp, pp, piped, wl) == call_time(
                kind, m, Mesh(0, 4), dp, tp, pp, shared, wl
            )
    # Only where the call's ranks outnumber the cores: a core per rank (4 cores) does not wait.
    a, b = (
        call_time("generate", m, Mesh(0, 4), 2, 1, 2, replace(h, shared_cores=4), wl)
        for h in (shared, piped)
    )
    assert a == b
    # With more working ranks than cores (dp4 x pp2 on 2 cores: messages x lat_slowdown(4)) the
    # wait is added, not stretched: it was measured with as many working stages as cores.
    i0, i1 = (call_time("inference", m, Mesh(0, 8), 4, 1, 2, h, one) for h in (shared, piped))
    assert i0["busy"] == 4 and shared.lat_slowdown(4) > 1
    assert i1["pp"] - i0["pp"] == pytest.approx(2 * w)


def test_sync_free_inference_counts_one_busy_rank():
    """A dp-only inference call has no collective, so its ranks run their shares apart and the
    processor terms are not stretched by its own peers; with tp (collectives) they are."""
    m = tiny()
    wl = Workload(batch_size=8, prompt_len=8, gen_len=4, micro_tokens=1 << 20)
    base = replace(HW, layer_lat=1e-3, head_lat=2e-3)
    shared = replace(base, shared_cores=2, lat_contention=0.5)
    assert call_time("inference", m, Mesh(0, 4), 4, 1, 1, shared, wl) == call_time(
        "inference", m, Mesh(0, 4), 4, 1, 1, base, wl
    )
    a = call_time("inference", m, Mesh(0, 4), 2, 2, 1, base, wl)
    b = call_time("inference", m, Mesh(0, 4), 2, 2, 1, shared, wl)
    assert b["overhead"] == pytest.approx(2 * a["overhead"])
    # Generation and train calls on dp alone still share the cores (ranks start together).
    for kind in ("generate", "train"):
        g0 = call_time(kind, m, Mesh(0, 4), 4, 1, 1, base, wl)
        g1 = call_time(kind, m, Mesh(0, 4), 4, 1, 1, shared, wl)
        assert g1["overhead"] == pytest.approx(2 * g0["overhead"])


def test_collective_latency_grows_with_ranks_by_hand():
    """coll_lat_growth = 1: a collective over n ranks waits n - 1 times a pair's latency (a ring's
    2 (n - 1) steps against a pair's 2); pipeline hops (point to point) do not grow."""
    ring = replace(HW, coll_lat_growth=1.0)
    assert ring.coll_lat(1e-3, 1) == ring.coll_lat(1e-3, 2) == 1e-3
    assert ring.coll_lat(1e-3, 4) == pytest.approx(3e-3) and HW.coll_lat(1e-3, 4) == 1e-3
    assert all(get_profile(n).coll_lat_growth == 0.0 for n in ("a100", "h100", "h200"))
    m = tiny()
    wl = Workload(batch_size=8, prompt_len=8, gen_len=4, micro_tokens=1 << 20)
    fast = dict(intra_bw=1e30, inter_bw=1e30)  # latency only
    for dp, growth in ((2, 1.0), (4, 3.0)):
        a = call_time("train", m, Mesh(0, 4), dp, 4 // dp, 1, replace(HW, **fast), wl)
        b = call_time("train", m, Mesh(0, 4), dp, 4 // dp, 1, replace(ring, **fast), wl)
        assert b["dp"] == pytest.approx(growth * a["dp"])
    a = call_time("inference", m, Mesh(0, 4), 1, 1, 4, replace(HW, **fast), wl)
    b = call_time("inference", m, Mesh(0, 4), 1, 1, 4, replace(ring, **fast), wl)
    hops = a["pp"] - HW.intra_lat  # the last stage's result broadcast is a collective over 4 ranks
    assert b["pp"] == pytest.approx(hops + 3 * HW.intra_lat)


def test_tensor_parallel_host_extras_by_hand():
    m, wl = tiny(), Workload(batch_size=8, prompt_len=8, gen_len=4, micro_tokens=1 << 20)
    hw = HardwareProfile(
        **FREE
        | dict(
            layer_lat=0.0,
            head_lat=0.0,
            decode_layer_lat=0.0,
            decode_lat=0.0,
            train_layer_lat=0.0,
            train_lat=0.0,
            tp_head_lat=1.0,
            tp_train_lat=10.0,
            tp_decode_lat=100.0,
        )
    )
    assert call_time("inference", m, Mesh(0, 2), 1, 2, 1, hw, wl)["tp"] == pytest.approx(1.0)
    assert call_time("train", m, Mesh(0, 2), 1, 2, 1, hw, wl)["tp"] == pytest.approx(4 * 10.0)
    g = call_time("generate", m, Mesh(0, 2), 1, 2, 1, hw, wl)
    assert (g["prefill_tp"], g["score_tp"], g["decode_tp"]) == pytest.approx((1.0, 1.0, 4 * 100.0))
    assert call_time("inference", m, Mesh(0, 1), 1, 1, 1, hw, wl)["total"] == pytest.approx(0.0)


def test_value_head_tensor_parallel_pass_by_hand():
    """Under tp a value head's pass makes one small collective outside the layers (the
    vocab-parallel embedding's all-reduce), an lm head's HEAD_COLLS (plus the log-prob
    reductions), and only the lm head pays the vocab-parallel head's host extras."""
    from real_py.search.costmodel import HEAD_COLLS

    wl = Workload(batch_size=8, prompt_len=8, gen_len=4, micro_tokens=1 << 20)
    v = model_spec(replace(TINY, head="value"), "tiny-value")
    lat = HardwareProfile(**FREE | dict(intra_lat=1.0, intra_bw=1e30, inter_bw=1e30))
    # inference: 2 layers x 2 all-reduces (latency 1 each) + the head's collectives
    assert call_time("inference", v, Mesh(0, 2), 1, 2, 1, lat, wl)["tp"] == pytest.approx(2 * 2 + 1)
    assert call_time("inference", tiny(), Mesh(0, 2), 1, 2, 1, lat, wl)["tp"] == pytest.approx(
        2 * 2 + HEAD_COLLS
    )
    # train: 4 optimizer steps, forward + backward: 2 x (4 + 1) per step for the value head
    assert call_time("train", v, Mesh(0, 2), 1, 2, 1, lat, wl)["tp"] == pytest.approx(
        4 * 2 * (2 * 2 + 1)
    )
    host = HardwareProfile(**FREE | dict(tp_head_lat=1.0, tp_train_lat=10.0))
    assert call_time("inference", v, Mesh(0, 2), 1, 2, 1, host, wl)["tp"] == pytest.approx(0.0)
    assert call_time("train", v, Mesh(0, 2), 1, 2, 1, host, wl)["tp"] == pytest.approx(0.0)


def test_profile_rejects_negative_overheads():
    for f in (
        "layer_lat",
        "realloc_lat",
        "p2p_lat_ratio",
        "lat_contention",
        "pipe_wait_lat",
        "shared_cores",
    ):
        with pytest.raises(ValueError, match=f):
            replace(HW, **{f: -1})


def test_memory_by_hand():
    m, wl = (
        tiny(),
        Workload(batch_size=8, prompt_len=8, gen_len=8, ppo_minibatches=2, micro_tokens=16),
    )
    mem = call_memory("train", m, 2, 1, 2, wl)
    assert mem["persist"] == pytest.approx(m.numel / 2 * (4 + 6))
    assert mem["weights"] == pytest.approx(m.numel / 2 * 2)
    g = call_memory("generate", m, 2, 2, 1, wl)
    assert g["transient"] == pytest.approx(4 * 16 * 2 * 2 * 64 * 2 / 2 + 4 * 100 * 4 / 2)


def test_seconds_for_a_known_workload():
    # 7B training, 512 x 512 tokens on 8 H100 at 50% MFU:
    # 6 * 6.7e9 * 262144 / (8 * 494.5e12) ~ 2.7 s.
    m = model_spec(replace(preset("llama2-7b"), dtype="bfloat16"), "7b")
    t = call_time(
        "train", m, Mesh(0, 8), 8, 1, 1, get_profile("h100"), Workload(prompt_len=256, gen_len=256)
    )
    assert 2.0 < t["compute"] < 3.5
    assert 2.0 < t["total"] < 5.0


def test_unknown_profile_lists_choices():
    with pytest.raises(ValueError, match="a100, h100, h200, cpu"):
        get_profile("tpu-v5")
    assert get_profile("H100-80G").name == "h100"


def test_search_refuses_a_measured_profile_name():
    """The search never calibrates: `cpu` by name is refused, pointing to real_py.calibrate."""
    from real_py.search import plan_search

    with pytest.raises(ValueError, match="real_py.calibrate.resolve_profile"):
        get_profile("cpu")
    with pytest.raises(ValueError, match="real_py.calibrate.resolve_profile"):
        plan_search("llama2-7b", num_gpus=8, hardware="cpu", time_budget=1, chains=1)


def test_transfer_time_by_hand():
    m = tiny()
    plan = plan_realloc(m, Layout(ranks=(0,)), Layout(ranks=(1,)), ranks_per_node=4)
    nbytes = m.numel * 2
    n = plan.num_messages
    # sender and receiver each handle n messages over NVLink
    assert transfer_time(plan, HW) == pytest.approx(nbytes / 1e10 + n * 1e-5)
    plan = plan_realloc(m, Layout(ranks=(0,)), Layout(ranks=(4,)), ranks_per_node=4)
    assert transfer_time(plan, HW) == pytest.approx(nbytes / 1e9 + plan.num_messages * 2e-5)
    same = plan_realloc(m, Layout(ranks=(0,)), Layout(ranks=(0,)), ranks_per_node=4)
    assert transfer_time(same, HW) == pytest.approx(2 * nbytes / 5e10)  # local copy, read + write
    # A fixed cost per reallocation, and both scaled when the ranks share cores.
    slow = replace(HW, realloc_lat=1e-3, shared_cores=1, p2p_lat_ratio=0.5)
    plan = plan_realloc(m, Layout(ranks=(0,)), Layout(ranks=(1,)), ranks_per_node=4)
    assert transfer_time(plan, slow) == pytest.approx(
        2 * (nbytes / 1e10 + plan.num_messages * 0.5e-5 + 1e-3)
    )


@pytest.mark.parametrize(
    "a,b", [((8, 4), (20, 2)), ((0, 8), (24, 8)), ((4, 4), (6, 2)), ((16, 8), (4, 4))]
)
def test_canonical_placement_keeps_the_cost(a, b):
    m = tiny()
    a, b = Mesh(*a), Mesh(*b)
    ca, cb = canonical_meshes(a, b, 4)
    assert ca.size == a.size and cb.size == b.size and min(ca.start, cb.start) < 4
    direct = transfer_time(
        plan_realloc(
            m,
            Layout(dp=a.size, ranks=a.ranks),
            Layout(tp=2, dp=b.size // 2, ranks=b.ranks),
            ranks_per_node=4,
        ),
        HW,
    )
    rc = ReallocCost(HW)
    assert rc.time(m, (a, a.size, 1, 1), (b, b.size // 2, 2, 1)) == pytest.approx(direct)
