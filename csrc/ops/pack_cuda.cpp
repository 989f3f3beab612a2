// CUDA kernels of real_py::pack / real_py::unpack: checks (checks.h), descriptors (by value or
// uploaded), one launch of the torch-free kernel (pack_kernel.cu) on the current stream of the
// buffers' device.
//
// Descriptors: the host converts the CPU descriptors to bytes, drops empty ones and appends their
// byte prefix sums. Up to kMaxInlineDescs of them travel by value in the kernel's parameters: a
// call is then the checks and one launch, nothing else (a per-call pinned staging block and H2D
// copy cost ~15-25 us on the H200, bench/results/gpu_20261204/README.md). More are written into one pinned staging tensor
// from torch's caching host allocator and a non_blocking copy on the current stream brings them
// to the device. The caching allocators make that safe without a private cache: the pinned
// block is recycled only after the copy's recorded event completes, and the device block only
// after the kernel that follows on the same stream (stream-ordered reuse). Cost of that path:
// one small H2D copy per call, about 56 bytes per descriptor, independent of the bytes moved.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "ops/checks.h"
#include "ops/pack_kernel.h"

namespace real_py {
namespace {

void strided_copy_cuda(const char* op, const at::Tensor& src, const char* src_name,
                       const at::Tensor& descs, const at::Tensor& dst, const char* dst_name) {
  check_copy_args(op, src, src_name, descs, dst, dst_name, c10::DeviceType::CUDA);
  const int64_t es = static_cast<int64_t>(src.element_size());
  const int64_t k = descs.size(0);
  const int64_t* d = descs.const_data_ptr<int64_t>();
  int64_t m = 0;
  for (int64_t i = 0; i < k; ++i) m += (d[6 * i + 2] > 0 && d[6 * i + 3] > 0);
  if (m == 0) return;

  // Layout: [m, 6] byte descriptors, then [m + 1] byte prefix sums.
  const bool inline_descs = m <= kMaxInlineDescs;
  int64_t small[7 * kMaxInlineDescs + 1];
  at::Tensor staging;
  if (!inline_descs) staging = at::empty({7 * m + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* bd = inline_descs ? small : staging.data_ptr<int64_t>();
  int64_t* prefix = bd + 6 * m;
  int64_t total = 0, j = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t* x = d + 6 * i;
    if (x[2] == 0 || x[3] == 0) continue;
    for (int c = 0; c < 6; ++c) bd[6 * j + c] = c == 3 ? x[c] : x[c] * es;
    prefix[j++] = total;
    total += x[2] * es * x[3];
  }
  prefix[m] = total;

  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  cudaError_t err;
  if (inline_descs) {
    err = launch_strided_copy_inline(src.const_data_ptr(), dst.data_ptr(), bd, prefix, m, total, stream);
  } else {
    const at::Tensor dev = staging.to(at::TensorOptions().device(src.device()), /*non_blocking=*/true);
    const int64_t* dev_descs = dev.const_data_ptr<int64_t>();
    err = launch_strided_copy(src.const_data_ptr(), dst.data_ptr(), dev_descs, dev_descs + 6 * m, m, total, stream);
  }
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed on ", src.device(), ": ",
              cudaGetErrorString(err));
}

void pack_cuda(const at::Tensor& src, const at::Tensor& descs, const at::Tensor& out) {
  strided_copy_cuda("pack", src, "src", descs, out, "out");
}

void unpack_cuda(const at::Tensor& packed, const at::Tensor& descs, const at::Tensor& dst) {
  strided_copy_cuda("unpack", packed, "packed", descs, dst, "dst");
}

}  // namespace
}  // namespace real_py

TORCH_LIBRARY_IMPL(real_py, CUDA, m) {
  m.impl("pack", &real_py::pack_cuda);
  m.impl("unpack", &real_py::unpack_cuda);
}
