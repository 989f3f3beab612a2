# Checks real_py::pack / real_py::unpack (CPU, and CUDA on a GPU) bit for bit against a per-run
# slicing reference, under torch.library.opcheck, and their ValueErrors. A failure points to
# csrc/ops/ (checks.h, tiles.cpp, pack_cpu.cpp, pack_kernel.cu, pack_cuda.cpp) or real_py/ops.py.
import numpy as np
import pytest
import torch

try:  # the GPU machine may lack hypothesis: only the property test needs it
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:
    given = None

from real_py import Layout, ModelShard, model_spec, plan_realloc
from real_py.ops import descs_tensor, pack, unpack
from real_py.spec import ModelConfig

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64]


def reference_copy(src: torch.Tensor, descs: np.ndarray, dst: torch.Tensor) -> None:
    """The oracle: one slice assignment per run, in descriptor order."""
    for so, do, ln, n, ss, ds in descs.tolist():
        for i in range(n):
            dst[do + i * ds: do + i * ds + ln] = src[so + i * ss: so + i * ss + ln]


def random_bytes(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """numel elements with random bit patterns (NaN payloads included: compared as bytes)."""
    es = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * es,), dtype=torch.uint8, generator=gen).view(dtype)


def random_descs(rng: np.random.Generator, k: int, max_len: int, max_n: int,
                 src_overlap: bool = True) -> tuple[np.ndarray, int, int]:
    """k descriptors with disjoint destination runs (placed with gaps, shuffled) and sources at
    random offsets, strides in [0, 2*len] when src_overlap (overlapping reads). Returns
    (descs, src_numel, dst_numel)."""
    rows, cursor, src_need = [], 0, 1
    for _ in range(k):
        ln, n = int(rng.integers(0, max_len + 1)), int(rng.integers(0, max_n + 1))
        ds = ln + int(rng.integers(0, 8))
        ss = int(rng.integers(0, 2 * ln + 1)) if src_overlap else ln + int(rng.integers(0, 8))
        do = cursor + int(rng.integers(0, 8))
        so = int(rng.integers(0, 64))
        rows.append((so, do, ln, n, ss, ds))
        if ln and n:
            cursor = do + (n - 1) * ds + ln
            src_need = max(src_need, so + (n - 1) * ss + ln)
    rng.shuffle(rows)
    return np.array(rows, np.int64).reshape(-1, 6), src_need + int(rng.integers(0, 5)), cursor + 3


def _pack_style(descs: np.ndarray) -> np.ndarray:
    """The same runs written back to back into a packed buffer (pack's destination)."""
    out = descs.copy()
    sizes = descs[:, 2] * descs[:, 3]
    out[:, 1] = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(descs) else []
    out[:, 5] = descs[:, 2]
    return out


def samples() -> list[tuple[str, np.ndarray, int, int]]:
    """(id, descs, src_numel, dst_numel): empty, single, many, overlapping, uneven, long."""
    rng = np.random.default_rng(1234)
    out = [
        ("no-descs", np.zeros((0, 6), np.int64), 5, 5),
        ("empty-runs", np.array([[0, 0, 0, 4, 1, 1], [3, 2, 5, 0, 0, 0]], np.int64), 8, 8),
        ("single", np.array([[3, 1, 17, 1, 0, 0]], np.int64), 40, 20),
        ("single-strided", np.array([[1, 2, 7, 9, 11, 8]], np.int64), 100, 80),
        ("overlap-reads", np.array([[0, 0, 16, 12, 3, 16], [5, 200, 9, 4, 0, 9]], np.int64), 60, 240),
        ("long-run", np.array([[7, 3, 300_001, 1, 0, 0]], np.int64), 300_010, 300_005),
        ("many-short", np.array([[1, 0, 5, 20_000, 6, 5]], np.int64), 120_010, 100_000),
    ]
    for j in range(6):
        d, s, t = random_descs(rng, k=int(rng.integers(1, 40)), max_len=300, max_n=30)
        out.append((f"random{j}", d, s, t))
    # The CUDA op passes up to 64 non-empty descriptors by value, more through a device buffer:
    # both sides of the boundary, and many.
    for k in (64, 65):
        out.append((f"descs{k}", np.array([[3 * i, 2 * i, 2, 1, 0, 0] for i in range(k)], np.int64), 3 * k, 2 * k))
    # 70 descriptors of which 6 are empty: 64 non-empty ones, passed by value after the compaction
    d = np.array([[3 * i, 2 * i, 2 if i % 12 else 0, 1, 0, 0] for i in range(70)], np.int64)
    assert (d[:, 2] * d[:, 3] > 0).sum() == 64
    out.append(("descs70-6empty", d, 3 * 70, 2 * 70))
    d, s, t = random_descs(rng, k=300, max_len=300, max_n=30)
    out.append(("random-many", d, s, t))
    d, s, t = random_descs(rng, k=3, max_len=70_000, max_n=6, src_overlap=False)
    out.append(("random-long", d, s, t))
    out.append(("random-packed", _pack_style(d), s, int((d[:, 2] * d[:, 3]).sum())))
    return out


SAMPLES = samples()


def _check(op, descs: np.ndarray, src_numel: int, dst_numel: int, dtype, device: str, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = random_bytes(src_numel, dtype, gen)
    dst = random_bytes(dst_numel, dtype, gen)
    want = dst.clone()
    reference_copy(src, descs, want)
    got = dst.to(device)
    op(src.to(device), descs_tensor(descs), got)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", [pack, unpack], ids=["pack", "unpack"])
@pytest.mark.parametrize("name,descs,src_numel,dst_numel", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_matches_reference_cpu(name, descs, src_numel, dst_numel, op, dtype):
    _check(op, descs, src_numel, dst_numel, dtype, "cpu")


# opcheck runs each sample several times; the small samples cover the schema.
SMALL_SAMPLES = [s for s in SAMPLES if s[2] <= 10_000]


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize("name,descs,src_numel,dst_numel", SMALL_SAMPLES, ids=[s[0] for s in SMALL_SAMPLES])
def test_opcheck(name, descs, src_numel, dst_numel, op):
    gen = torch.Generator().manual_seed(1)
    args = (random_bytes(src_numel, torch.float32, gen), descs_tensor(descs),
            random_bytes(dst_numel, torch.float32, gen))
    torch.library.opcheck(getattr(torch.ops.real_py, op).default, args)


def _random_descriptors_cpu(seed, k, es):
    rng = np.random.default_rng(seed)
    descs, s, t = random_descs(rng, k=k, max_len=50, max_n=9)
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[es]
    _check(unpack, descs, s, t, dtype, "cpu", seed=seed % 1000)


@pytest.mark.parametrize("seed", range(40))
def test_seeded_random_descriptors_cpu(seed):
    _random_descriptors_cpu(seed, k=seed % 13, es=(1, 2, 4, 8)[seed % 4])


if given is not None:  # property test on top of the seeded cases where hypothesis is installed
    test_random_descriptors_cpu = settings(max_examples=60, deadline=None)(given(
        seed=st.integers(0, 2**32 - 1), k=st.integers(0, 12), es=st.sampled_from([1, 2, 4, 8]))(
        _random_descriptors_cpu))


def test_plan_descriptors_reallocate_exactly():
    """Pack every message of a real plan on its sender, unpack on every receiver, run the local
    copies: each destination shard equals slicing the full tensors."""
    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=50, num_hidden_layers=3, dtype="bfloat16")
    model = model_spec(cfg, name="tiny")
    gen = torch.Generator().manual_seed(0)
    full = {p.name: torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in model.params}
    for src_l, dst_l in [(Layout(dp=1, tp=2, pp=2), Layout(dp=2, tp=1, pp=2)),
                         (Layout(dp=2, tp=2, pp=1), Layout(dp=1, tp=4, pp=1))]:
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


def _bad(op, src, descs, dst, match):
    before = dst.clone()
    with pytest.raises(ValueError, match=match):
        op(src, descs, dst)
    # Bytes, not values: random bytes hold NaNs, and NaN != NaN.
    assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8)), "a rejected call wrote to its destination"


@pytest.mark.parametrize("op", [pack, unpack], ids=["pack", "unpack"])
def test_bad_input_raises_value_error(op):
    src, dst = torch.arange(100.0), torch.full((50,), -1.0)
    ok = [0, 0, 4, 2, 10, 4]
    d = lambda *rows: torch.tensor(rows, dtype=torch.int64)  # noqa: E731
    # Out of bounds: the first descriptor is fine, so nothing may be written before the check.
    _bad(op, src, d(ok, [95, 0, 4, 2, 10, 4]), dst, r"descriptor 1 \(src_off=95.*past the end of (src|packed) \(numel 100\)")
    _bad(op, src, d(ok, [0, 40, 4, 3, 0, 4]), dst, r"descriptor 1 .*past the end of (out|dst) \(numel 50\)")
    _bad(op, src, d(ok, [0, 0, 4, 2**62, 2**62, 4]), dst, "past the end")
    _bad(op, src, d([0, 0, -1, 1, 0, 0]), dst, "descriptor 0 .*negative")
    _bad(op, src, d([0, 0, 4, 3, 1, 2]), dst, "overlapping runs")
    _bad(op, src, torch.tensor([ok], dtype=torch.int32), dst, "descs must be int64")
    _bad(op, src, torch.tensor([ok[:5]]), dst, r"descs must be \[k, 6\]")
    _bad(op, src, torch.tensor(ok), dst, r"descs must be \[k, 6\]")
    _bad(op, src.double(), d(ok), dst, "dtype mismatch")
    _bad(op, src[::2], d(ok), dst, "must be contiguous")
    _bad(op, src.view(10, 10), d(ok), dst, "must be a 1-D flat buffer")
    _bad(op, src, d(ok), torch.zeros(10, 10), "must be a 1-D flat buffer")
    _bad(op, src[40:], d(ok), src[:50], "share memory")


def test_descs_tensor_shares_memory():
    a = np.arange(12, dtype=np.int64).reshape(2, 6)
    assert descs_tensor(a).data_ptr() == a.ctypes.data
    a.setflags(write=False)
    assert descs_tensor(a).data_ptr() == a.ctypes.data
    with pytest.raises(ValueError, match=r"\[k, 6\]"):
        descs_tensor(np.zeros((2, 5), np.int64))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", [pack, unpack], ids=["pack", "unpack"])
@pytest.mark.parametrize("name,descs,src_numel,dst_numel", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_matches_reference_cuda(name, descs, src_numel, dst_numel, op, dtype):
    _check(op, descs, src_numel, dst_numel, dtype, "cuda")


@pytest.mark.cuda
def test_cuda_current_stream_opcheck_and_errors():
    rng = np.random.default_rng(7)
    descs, s, t = random_descs(rng, k=200, max_len=5000, max_n=20)
    gen = torch.Generator().manual_seed(3)
    src, dst = random_bytes(s, torch.float16, gen), random_bytes(t, torch.float16, gen)
    want = dst.clone()
    reference_copy(src, descs, want)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the kernel must run on (and be ordered by) this stream
        g_src, g_dst = src.cuda(), dst.cuda()
        unpack(g_src, descs_tensor(descs), g_dst)
        got = g_dst.cpu()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    torch.library.opcheck(torch.ops.real_py.unpack.default, (g_src, descs_tensor(descs), g_dst.clone()))
    _bad(unpack, g_src, torch.tensor([[0, 0, s + 1, 1, 0, 0]]), g_dst, "past the end")
    _bad(unpack, src, descs_tensor(descs), g_dst, "is on cpu")
    _bad(unpack, g_src, descs_tensor(descs).cuda(), g_dst, "descs must be a CPU tensor")
