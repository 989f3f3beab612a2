// CUDA kernels of real_py::pack / unpack / copy_planned: checks (checks.h), work items (by value
// or in device memory), one launch of the torch-free kernel (copy_kernel.cu) on the current
// stream of the buffers' device.
//
// pack / unpack (per-call descriptors): the host converts the CPU descriptors to bytes and builds
// the work items (copy_items.h). Up to kMaxInlineItems of them travel by value in the kernel's
// parameters: a call is then the checks and one launch (a per-call pinned staging block and H2D
// copy cost ~15-25 us on the H200). More are written into one pinned staging tensor from torch's
// caching host allocator and a non_blocking copy on the current stream brings them to the
// device. The caching allocators make that safe without a private cache: the pinned block is
// recycled only after the copy's recorded event completes, and the device block only after the
// kernel that follows on the same stream (stream-ordered reuse). Cost of that path: one H2D copy
// of 48 bytes per item (one item per 16 KiB of payload or per descriptor).
//
// copy_planned: the items already live on the device (real_py.ops.CopyPlan uploads them once);
// a call checks the buffers against the plan's bounds and launches: no per-call host work that
// grows with the plan.
#include <ATen/ATen.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/checks.h"
#include "ops/copy_items.h"
#include "ops/copy_kernel.h"

namespace real_py {
namespace {

void strided_copy_cuda(const char* op, const at::Tensor& src, const char* src_name,
                       const at::Tensor& descs, const at::Tensor& dst, const char* dst_name) {
  check_copy_args(op, src, src_name, descs, dst, dst_name, c10::DeviceType::CUDA);
  const std::vector<int64_t> rows = byte_rows(descs, static_cast<int64_t>(src.element_size()));
  if (rows.empty()) return;
  const int64_t k = static_cast<int64_t>(rows.size()) / kDescCols;
  int64_t total = 0;
  for (int64_t i = 0; i < k; ++i) total += rows[kDescCols * i + 2] * rows[kDescCols * i + 3];
  std::vector<CopyItem> items;
  build_copy_items(rows.data(), k, default_item_bytes(total), &items);
  const int64_t m = static_cast<int64_t>(items.size());

  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  const void* s = src.const_data_ptr();
  void* d = dst.data_ptr();
  cudaError_t err;
  if (m <= kMaxInlineItems) {
    err = launch_copy_inline_items(items.data(), m, &s, 1, &d, 1, stream);
  } else {
    at::Tensor staging = at::empty({m * 6}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(staging.data_ptr<int64_t>(), items.data(), sizeof(CopyItem) * m);
    const at::Tensor dev = staging.to(at::TensorOptions().device(src.device()), /*non_blocking=*/true);
    err = launch_copy_items(reinterpret_cast<const CopyItem*>(dev.const_data_ptr<int64_t>()), m, &s, 1, &d,
                            1, stream);
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

// A source on another GPU is read by the kernel over NVLink / PCIe: the destinations' device
// needs peer access to the source's. at::cuda::get_p2p_access(dst, src) enables it once per pair
// and caches the answer, for cudaMalloc'd blocks and the caching allocator's expandable segments
// alike (a plain cudaDeviceEnablePeerAccess does not reach those); a pair without P2P is refused
// naming both devices rather than faulting on an illegal address.
void ensure_peer_access(const c10::Device& dst, const c10::Device& src) {
  if (src.index() == dst.index()) return;
  TORCH_CHECK_VALUE(at::cuda::get_p2p_access(dst.index(), src.index()), "copy_planned: a source buffer is on ",
                    src, " and the destinations on ", dst, ", and ", dst, " cannot access ", src,
                    " as a peer (no NVLink / PCIe P2P between them)");
}

void copy_planned_cuda(at::TensorList srcs, at::TensorList dsts, const at::Tensor& items,
                       const at::Tensor& bounds) {
  check_planned_args(srcs, dsts, items, bounds, c10::DeviceType::CUDA);
  const void* s[kMaxBufs];
  void* d[kMaxBufs];
  for (size_t i = 0; i < srcs.size(); ++i) s[i] = srcs[i].const_data_ptr();
  for (size_t i = 0; i < dsts.size(); ++i) d[i] = dsts[i].data_ptr();
  const c10::cuda::CUDAGuard guard(dsts[0].device());  // sources may be peers' (checks.h)
  for (size_t i = 0; i < srcs.size(); ++i) ensure_peer_access(dsts[0].device(), srcs[i].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dsts[0].device().index()).stream();
  const cudaError_t err = launch_copy_items(reinterpret_cast<const CopyItem*>(items.const_data_ptr<int64_t>()),
                                            items.size(0), s, static_cast<int>(srcs.size()), d,
                                            static_cast<int>(dsts.size()), stream);
  TORCH_CHECK(err == cudaSuccess, "copy_planned: CUDA launch failed on ", dsts[0].device(), ": ",
              cudaGetErrorString(err));
}

}  // namespace
}  // namespace real_py

TORCH_LIBRARY_IMPL(real_py, CUDA, m) {
  m.impl("pack", &real_py::pack_cuda);
  m.impl("unpack", &real_py::unpack_cuda);
  m.impl("copy_planned", &real_py::copy_planned_cuda);
}
