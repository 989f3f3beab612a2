# Checks real_py::pack / real_py::unpack on a GPU: the CPU tests' samples
# (tests/support/ops_cases.py) bit for bit against the slicing reference, on the current stream, and
# the CUDA-only errors. A failure points to csrc/ops/ (copy_kernel.cu, copy_cuda.cpp) or
# real_py/ops.py.
# Without a GPU the whole module is one skip (not one per sample: a marker skips case by case).
import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (marker cuda)", allow_module_level=True)

from support.ops_cases import (
    DTYPES,
    SAMPLES,
    assert_rejected,
    check_op,
    random_bytes,
    random_descs,
    reference_copy,
)

from real_py.ops import descs_tensor, pack, unpack

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", [pack, unpack], ids=["pack", "unpack"])
@pytest.mark.parametrize("name,descs,src_numel,dst_numel", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_matches_reference_cuda(name, descs, src_numel, dst_numel, op, dtype):
    check_op(op, descs, src_numel, dst_numel, dtype, "cuda")


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
    torch.library.opcheck(
        torch.ops.real_py.unpack.default, (g_src, descs_tensor(descs), g_dst.clone())
    )
    assert_rejected(unpack, g_src, torch.tensor([[0, 0, s + 1, 1, 0, 0]]), g_dst, "past the end")
    assert_rejected(unpack, src, descs_tensor(descs), g_dst, "is on cpu")
    assert_rejected(unpack, g_src, descs_tensor(descs).cuda(), g_dst, "descs must be a CPU tensor")
