// Torch-free CUDA strided byte copy behind real_py::pack / unpack / copy_planned (launchers in
// copy_kernel.cu, device code in copy_kernel_impl.cuh, torch glue in copy_cuda.cpp).
//
// Shapes and units (everything in BYTES):
//   items        CopyItem table (copy_items.h): m items, each a slice of one run or a few short
//                runs with its own offsets, strides and buffer indices; built on the host once
//                (build_copy_items), in device memory here
//   src_bufs     num_src (<= kMaxBufs) source base pointers (device), indexed by item.src_buf
//   dst_bufs     num_dst (<= kMaxBufs) destination base pointers, indexed by item.dst_buf;
//                no destination byte is written twice, destinations do not overlap sources
// One launch: a grid of (SM count x resident blocks per SM) blocks of 256 threads, fewer when
// there are fewer items than warps; warp w copies items w, w + warps, ... (grid-stride), so one
// long run and many short runs both spread over the whole GPU and no block searches.
// Returns the launch error (cudaErrorInvalidValue for bad counts).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/copy_items.h"

namespace real_py {

cudaError_t launch_copy_items(const CopyItem* dev_items, int64_t m, const void* const* src_bufs,
                              int num_src, void* const* dst_bufs, int num_dst, cudaStream_t stream);

// The same with up to kMaxInlineItems items in HOST memory: they travel by value in the kernel's
// parameters (no device buffer, no host-to-device copy).
constexpr int64_t kMaxInlineItems = 48;  // == pack_detail::kInlineItems (static_assert in the .cu)
cudaError_t launch_copy_inline_items(const CopyItem* host_items, int64_t m, const void* const* src_bufs,
                                     int num_src, void* const* dst_bufs, int num_dst,
                                     cudaStream_t stream);

}  // namespace real_py
