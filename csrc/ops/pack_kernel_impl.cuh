// Device code of the strided byte copy (see pack_kernel.h for shapes and units), kept apart from
// the launcher so that csrc/tests/test_pack_kernels.cpp can run the same code on the host
// (threads of a block one after another) where there is no GPU.
//
// Two kernels share the block code: descriptors in device memory (any count), or up to
// kInlineDescs of them by value in the kernel parameters (no per-call upload).
//
// Work split: block b owns bytes [b*kStridedCopyBlockBytes, (b+1)*kStridedCopyBlockBytes) of the
// concatenated runs, found by a binary search over the prefix sums. Runs of at least
// kBlockRunBytes are copied by the whole block (one long run fills many blocks); shorter runs are
// dealt round-robin to warps, continuing the round across descriptors, so many short runs keep
// every warp busy. Each run uses the widest word (16, 8, 4, 2, 1 bytes) that src and dst share
// modulo 16, after a byte head that aligns dst; the remainder is a byte tail.
// Needs CUDA's built-ins (uint4, uint2, threadIdx, min, ...): nvcc provides them, the test a shim.
#pragma once

#include <cstdint>

namespace real_py {
namespace pack_detail {

constexpr int64_t kStridedCopyBlockBytes = 16 << 10;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kBlockRunBytes = 4 << 10;

// Kernel parameters stay under the classic 4 KiB limit: 64 * 7 * 8 + 8 = 3592 bytes.
constexpr int64_t kInlineDescs = 64;
struct InlineDescs {
  int64_t descs[6 * kInlineDescs];
  int64_t prefix[kInlineDescs + 1];
};

template <typename W>
__device__ __forceinline__ void copy_words(char* __restrict__ d, const char* __restrict__ s,
                                           int64_t n, int i, int stride) {
  constexpr int64_t w = sizeof(W);
  const int64_t head = min(n, static_cast<int64_t>((w - (reinterpret_cast<uintptr_t>(d) & (w - 1))) & (w - 1)));
  for (int64_t k = i; k < head; k += stride) d[k] = s[k];
  d += head, s += head, n -= head;
  const int64_t nw = n / w;
  W* __restrict__ dw = reinterpret_cast<W*>(d);
  const W* __restrict__ sw = reinterpret_cast<const W*>(s);
#pragma unroll 4
  for (int64_t k = i; k < nw; k += stride) dw[k] = sw[k];
  for (int64_t k = nw * w + i; k < n; k += stride) d[k] = s[k];
}

// Threads i, i + stride, ... of the caller's group copy n bytes s -> d.
__device__ __forceinline__ void copy_run(char* d, const char* s, int64_t n, int i, int stride) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(s);
  if ((x & 15) == 0) {
    copy_words<uint4>(d, s, n, i, stride);
  } else if ((x & 7) == 0) {
    copy_words<uint2>(d, s, n, i, stride);
  } else if ((x & 3) == 0) {
    copy_words<uint32_t>(d, s, n, i, stride);
  } else if ((x & 1) == 0) {
    copy_words<uint16_t>(d, s, n, i, stride);
  } else {
    copy_words<uint8_t>(d, s, n, i, stride);
  }
}

// One block's share of the copy (the kernels below differ only in where descs and prefix live).
__device__ __forceinline__ void strided_copy_block(const char* __restrict__ src, char* __restrict__ dst,
                                                   const int64_t* __restrict__ descs,
                                                   const int64_t* __restrict__ prefix, int64_t k,
                                                   int64_t total) {
  __shared__ int64_t first;
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * kStridedCopyBlockBytes;
  const int64_t b1 = min(b0 + kStridedCopyBlockBytes, total);
  if (threadIdx.x == 0) {
    // Last descriptor starting at or before b0 (descriptors are non-empty, so it holds b0).
    int64_t lo = 0, hi = k - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (prefix[mid] <= b0) lo = mid; else hi = mid - 1;
    }
    first = lo;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t dealt = 0;  // short runs dealt so far in this block, to continue the warp round-robin
  for (int64_t i = first; i < k && prefix[i] < b1; ++i) {
    const int64_t* d = descs + 6 * i;
    const int64_t so = d[0], doff = d[1], len = d[2], ss = d[4], ds = d[5], p = prefix[i];
    const int64_t lo = max(b0, p) - p, hi = min(b1, prefix[i + 1]) - p;  // bytes of this desc
    const int64_t r0 = lo / len, r1 = (hi + len - 1) / len;                // runs touched
    if (len >= kBlockRunBytes) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t a = max(lo - r * len, int64_t{0}), e = min(hi - r * len, len);
        copy_run(dst + doff + r * ds + a, src + so + r * ss + a, e - a, threadIdx.x, kThreads);
      }
    } else {
      const int64_t skip = ((warp - dealt) % kWarps + kWarps) % kWarps;
      for (int64_t r = r0 + skip; r < r1; r += kWarps) {
        const int64_t a = max(lo - r * len, int64_t{0}), e = min(hi - r * len, len);
        copy_run(dst + doff + r * ds + a, src + so + r * ss + a, e - a, lane, 32);
      }
      dealt += r1 - r0;
    }
  }
}

// Descriptors and prefix sums in device memory (any number of descriptors).
__global__ void __launch_bounds__(kThreads, 4)
strided_copy_kernel(const char* __restrict__ src, char* __restrict__ dst,
                    const int64_t* __restrict__ descs, const int64_t* __restrict__ prefix,
                    int64_t k, int64_t total) {
  strided_copy_block(src, dst, descs, prefix, k, total);
}

// Up to kInlineDescs descriptors passed by value in the kernel's parameters (read in place from
// the constant bank, __grid_constant__): no staging buffer and no host-to-device copy per call.
__global__ void __launch_bounds__(kThreads, 4)
strided_copy_inline_kernel(const char* __restrict__ src, char* __restrict__ dst,
                           const __grid_constant__ InlineDescs p, int64_t k, int64_t total) {
  strided_copy_block(src, dst, p.descs, p.prefix, k, total);
}

}  // namespace pack_detail
}  // namespace real_py
