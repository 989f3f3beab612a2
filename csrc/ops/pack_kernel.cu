// CUDA strided byte copy: the launcher (device code in pack_kernel_impl.cuh, shapes and units in
// pack_kernel.h).
#include "ops/pack_kernel.h"

#include <cstdint>

#include "ops/pack_kernel_impl.cuh"

namespace real_py {

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

}  // namespace real_py
