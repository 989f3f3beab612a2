// CUDA strided byte copy: the launchers (device code in copy_kernel_impl.cuh, shapes and units in
// copy_kernel.h).
#include "ops/copy_kernel.h"

#include <atomic>
#include <cstdint>
#include <cstring>

#include "ops/copy_kernel_impl.cuh"

namespace real_py {
namespace {

using namespace pack_detail;
static_assert(kMaxInlineItems == kInlineItems, "inline item count");
static_assert(sizeof(BufTable) + sizeof(InlineItems) + 8 <= 4096, "classic 4 KiB parameter limit");

constexpr int kMaxDevices = 64;

// Blocks of the grid: every SM filled with as many resident blocks as the kernel allows, found
// once per device (cudaDeviceGetAttribute and the occupancy query cost microseconds); rank
// threads launch concurrently, so the cache is atomic (two threads may both compute it).
cudaError_t grid_blocks(int64_t* out) {
  static std::atomic<int> cached[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= kMaxDevices || cached[dev].load(std::memory_order_relaxed) == 0) {
    int sms = 0, per_sm = 0;
    if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return err;
    if ((err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, copy_items_kernel, kThreads, 0)) != cudaSuccess) {
      return err;
    }
    const int blocks = sms * (per_sm > 0 ? per_sm : 1);
    if (dev < 0 || dev >= kMaxDevices) {
      *out = blocks;
      return cudaSuccess;
    }
    cached[dev].store(blocks, std::memory_order_relaxed);
  }
  *out = cached[dev].load(std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t fill_table(BufTable* t, const void* const* src_bufs, int num_src, void* const* dst_bufs,
                       int num_dst) {
  if (num_src < 1 || num_src > kMaxBufs || num_dst < 1 || num_dst > kMaxBufs) return cudaErrorInvalidValue;
  std::memset(t, 0, sizeof(*t));
  for (int i = 0; i < num_src; ++i) t->src[i] = static_cast<const char*>(src_bufs[i]);
  for (int i = 0; i < num_dst; ++i) t->dst[i] = static_cast<char*>(dst_bufs[i]);
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_copy_items(const CopyItem* dev_items, int64_t m, const void* const* src_bufs,
                              int num_src, void* const* dst_bufs, int num_dst, cudaStream_t stream) {
  if (m <= 0) return cudaSuccess;
  BufTable t;
  cudaError_t err = fill_table(&t, src_bufs, num_src, dst_bufs, num_dst);
  if (err != cudaSuccess) return err;
  int64_t full = 0;
  if ((err = grid_blocks(&full)) != cudaSuccess) return err;
  const int64_t need = (m + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t blocks = need < full ? need : full;
  copy_items_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dev_items, m, t);
  return cudaGetLastError();
}

cudaError_t launch_copy_inline_items(const CopyItem* host_items, int64_t m, const void* const* src_bufs,
                                     int num_src, void* const* dst_bufs, int num_dst,
                                     cudaStream_t stream) {
  if (m <= 0) return cudaSuccess;
  if (m > kInlineItems) return cudaErrorInvalidValue;
  BufTable t;
  cudaError_t err = fill_table(&t, src_bufs, num_src, dst_bufs, num_dst);
  if (err != cudaSuccess) return err;
  InlineItems p;
  std::memcpy(p.items, host_items, sizeof(CopyItem) * m);
  const int64_t blocks = (m + kWarpsPerBlock - 1) / kWarpsPerBlock;
  copy_inline_items_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, m, t);
  return cudaGetLastError();
}

}  // namespace real_py
