// CUDA strided byte copy: the launcher (device code in pack_kernel_impl.cuh, shapes and units in
// pack_kernel.h).
#include "ops/pack_kernel.h"

#include <cstdint>
#include <cstring>

#include "ops/pack_kernel_impl.cuh"

namespace real_py {
static_assert(kMaxInlineDescs == pack_detail::kInlineDescs, "inline descriptor count");

cudaError_t launch_strided_copy(const void* src, void* dst, const int64_t* descs,
                                const int64_t* prefix, int64_t k, int64_t total_bytes,
                                cudaStream_t stream) {
  using namespace pack_detail;
  if (k <= 0 || total_bytes <= 0) return cudaSuccess;
  const int64_t blocks = (total_bytes + kStridedCopyBlockBytes - 1) / kStridedCopyBlockBytes;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;  // > 32 TiB in one call
  strided_copy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const char*>(src), static_cast<char*>(dst), descs, prefix, k, total_bytes);
  return cudaGetLastError();
}

cudaError_t launch_strided_copy_inline(const void* src, void* dst, const int64_t* host_descs,
                                       const int64_t* host_prefix, int64_t k, int64_t total_bytes,
                                       cudaStream_t stream) {
  using namespace pack_detail;
  if (k <= 0 || total_bytes <= 0) return cudaSuccess;
  if (k > kInlineDescs) return cudaErrorInvalidValue;
  const int64_t blocks = (total_bytes + kStridedCopyBlockBytes - 1) / kStridedCopyBlockBytes;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  InlineDescs p;
  std::memcpy(p.descs, host_descs, sizeof(int64_t) * 6 * k);
  std::memcpy(p.prefix, host_prefix, sizeof(int64_t) * (k + 1));
  strided_copy_inline_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const char*>(src), static_cast<char*>(dst), p, k, total_bytes);
  return cudaGetLastError();
}

}  // namespace real_py
