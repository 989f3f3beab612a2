# Checks real_py::pack / real_py::unpack on CPU (tests/test_ops_cuda.py: on a GPU) bit for bit
# against a per-run slicing reference, under torch.library.opcheck, and their ValueErrors. A failure
# points to csrc/ops/ (checks.h, tiles.cpp, copy_cpu.cpp, copy_kernel.cu, copy_cuda.cpp) or
# real_py/ops.py.
import numpy as np
import pytest
import torch

try:  # the GPU machine may lack hypothesis: only the property test needs it
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:
    given = None

from support.ops_cases import DTYPES, SAMPLES, assert_rejected, check_op, random_bytes, random_descs

from real_py import Layout, ModelShard, model_spec, plan_realloc
from real_py.ops import descs_tensor, pack, unpack
from real_py.spec import ModelConfig


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", [pack, unpack], ids=["pack", "unpack"])
@pytest.mark.parametrize("name,descs,src_numel,dst_numel", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_matches_reference_cpu(name, descs, src_numel, dst_numel, op, dtype):
    check_op(op, descs, src_numel, dst_numel, dtype, "cpu")


# opcheck runs each sample several times; the small samples cover the schema.
SMALL_SAMPLES = [s for s in SAMPLES if s[2] <= 10_000]


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize(
    "name,descs,src_numel,dst_numel", SMALL_SAMPLES, ids=[s[0] for s in SMALL_SAMPLES]
)
def test_opcheck(name, descs, src_numel, dst_numel, op):
    gen = torch.Generator().manual_seed(1)
    args = (
        random_bytes(src_numel, torch.float32, gen),
        descs_tensor(descs),
        random_bytes(dst_numel, torch.float32, gen),
    )
    torch.library.opcheck(getattr(torch.ops.real_py, op).default, args)


def _random_descriptors_cpu(seed, k, es):
    rng = np.random.default_rng(seed)
    descs, s, t = random_descs(rng, k=k, max_len=50, max_n=9)
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[es]
    check_op(unpack, descs, s, t, dtype, "cpu", seed=seed % 1000)


@pytest.mark.parametrize("seed", range(40))
def test_seeded_random_descriptors_cpu(seed):
    _random_descriptors_cpu(seed, k=seed % 13, es=(1, 2, 4, 8)[seed % 4])


if given is not None:  # property test on top of the seeded cases where hypothesis is installed
    test_random_descriptors_cpu = settings(max_examples=60, deadline=None)(
        given(
            seed=st.integers(0, 2**32 - 1), k=st.integers(0, 12), es=st.sampled_from([1, 2, 4, 8])
        )(_random_descriptors_cpu)
    )


def test_plan_descriptors_reallocate_exactly():
    """Pack every message of a real plan on its sender, unpack on every receiver, run the local
    copies: each destination shard equals slicing the full tensors."""
    cfg = ModelConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=50,
        num_hidden_layers=3,
        dtype="bfloat16",
    )
    model = model_spec(cfg, name="tiny")
    gen = torch.Generator().manual_seed(0)
    full = {p.name: torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in model.params}
    for src_l, dst_l in [
        (Layout(dp=1, tp=2, pp=2), Layout(dp=2, tp=1, pp=2)),
        (Layout(dp=2, tp=2, pp=1), Layout(dp=1, tp=4, pp=1)),
    ]:
        plan = plan_realloc(model, src_l, dst_l)
        srcs = {r: ModelShard.from_full(model, src_l, r, full).flat for r in src_l.ranks}
        dsts = {r: ModelShard.empty(model, dst_l, r).flat for r in dst_l.ranks}
        for r in plan.ranks():
            rp = plan.for_rank(r)
            for m in rp.sends:
                packed = torch.empty(m.numel, dtype=torch.bfloat16)
                pack(srcs[r], descs_tensor(m.pack_descs()), packed)
                for q in m.peers:
                    unpack(packed, descs_tensor(m.unpack_descs()), dsts[q])
            if len(rp.local):
                unpack(srcs[r], descs_tensor(rp.local), dsts[r])
        for r in dst_l.ranks:
            want = ModelShard.from_full(model, dst_l, r, full).flat
            assert torch.equal(dsts[r].view(torch.int16), want.view(torch.int16)), (src_l, dst_l, r)


@pytest.mark.parametrize("op", [pack, unpack], ids=["pack", "unpack"])
def test_bad_input_raises_value_error(op):
    src, dst = torch.arange(100.0), torch.full((50,), -1.0)
    ok = [0, 0, 4, 2, 10, 4]
    d = lambda *rows: torch.tensor(rows, dtype=torch.int64)
    # Out of bounds: the first descriptor is fine, so nothing may be written before the check.
    assert_rejected(
        op,
        src,
        d(ok, [95, 0, 4, 2, 10, 4]),
        dst,
        r"descriptor 1 \(src_off=95.*past the end of (src|packed) \(numel 100\)",
    )
    assert_rejected(
        op,
        src,
        d(ok, [0, 40, 4, 3, 0, 4]),
        dst,
        r"descriptor 1 .*past the end of (out|dst) \(numel 50\)",
    )
    assert_rejected(op, src, d(ok, [0, 0, 4, 2**62, 2**62, 4]), dst, "past the end")
    assert_rejected(op, src, d([0, 0, -1, 1, 0, 0]), dst, "descriptor 0 .*negative")
    assert_rejected(op, src, d([0, 0, 4, 3, 1, 2]), dst, "overlapping runs")
    assert_rejected(op, src, torch.tensor([ok], dtype=torch.int32), dst, "descs must be int64")
    assert_rejected(op, src, torch.tensor([ok[:5]]), dst, r"descs must be \[k, 6\]")
    assert_rejected(op, src, torch.tensor(ok), dst, r"descs must be \[k, 6\]")
    assert_rejected(op, src.double(), d(ok), dst, "dtype mismatch")
    assert_rejected(op, src[::2], d(ok), dst, "must be contiguous")
    assert_rejected(op, src.view(10, 10), d(ok), dst, "must be a 1-D flat buffer")
    assert_rejected(op, src, d(ok), torch.zeros(10, 10), "must be a 1-D flat buffer")
    assert_rejected(op, src[40:], d(ok), src[:50], "share memory")


def test_descs_tensor_shares_memory():
    a = np.arange(12, dtype=np.int64).reshape(2, 6)
    assert descs_tensor(a).data_ptr() == a.ctypes.data
    a.setflags(write=False)
    assert descs_tensor(a).data_ptr() == a.ctypes.data
    with pytest.raises(ValueError, match=r"\[k, 6\]"):
        descs_tensor(np.zeros((2, 5), np.int64))
