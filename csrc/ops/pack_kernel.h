// Torch-free CUDA strided byte copy behind real_py::pack / real_py::unpack (launcher in
// pack_kernel.cu, torch glue in pack_cuda.cpp).
//
// Shapes and units (all device pointers; everything in BYTES):
//   src            source buffer base
//   dst            destination buffer base (must not overlap src)
//   descs          [k, 6] int64 row-major: (src_off, dst_off, len, n, src_stride, dst_stride);
//                  run i copies src[src_off + i*src_stride : +len] -> dst[dst_off + i*dst_stride : +len];
//                  every descriptor non-empty (len > 0, n > 0) and in bounds (checked by the host)
//   prefix         [k + 1] int64: prefix[i] = sum over j < i of len_j * n_j; prefix[k] = total_bytes
//   total_bytes    > 0
// One launch of ceil(total_bytes / 16 KiB) blocks: block b copies bytes [b*16 KiB, (b+1)*16 KiB)
// of the concatenation of all runs, found by a binary search over prefix, so one
// long run and many short runs both spread over the whole GPU. Returns the launch error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace real_py {

cudaError_t launch_strided_copy(const void* src, void* dst, const int64_t* descs,
                                const int64_t* prefix, int64_t k, int64_t total_bytes,
                                cudaStream_t stream);

// The same copy with descs and prefix in HOST memory, k <= kMaxInlineDescs: they travel by value in
// the kernel's parameters (no device buffer, no host-to-device copy).
constexpr int64_t kMaxInlineDescs = 64;  // == pack_detail::kInlineDescs (static_assert in the .cu)
cudaError_t launch_strided_copy_inline(const void* src, void* dst, const int64_t* host_descs,
                                       const int64_t* host_prefix, int64_t k, int64_t total_bytes,
                                       cudaStream_t stream);

}  // namespace real_py
