// Device code of the strided byte copy (shapes and units in copy_kernel.h, work items in
// copy_items.h). Everything except the __global__ kernels is REAL_PY_HD (host and device), so the
// C++ tests (csrc/tests/test_copy_kernels.cpp) and the CPU extension's kernel twin
// (pack_twin.cpp) run the same lane code on the host, lanes one after another, without a GPU.
//
// Work split: a grid sized to the device (SMs x resident blocks, copy_kernel.cu), each warp
// taking work items grid-stride: item i goes to global warp i mod (number of warps). An item
// is a slice of at most 16 KiB of one run or a few whole short runs (copy_items.h), so a warp
// copies one run (or one slice) at a time with all 32 lanes: a 2 KiB run is 128 16-byte words,
// four per lane, all four loads in flight before the first store (unroll 4).
//
// Alignment: the destination is aligned first (a head of up to 15 bytes, one byte per lane);
// the middle is copied in 16-byte words stored aligned; the tail (< 16 bytes), one byte per
// lane. When the source is then 16-byte aligned too, the middle is plain 16-byte loads. When it
// is not (src and dst offsets differ mod 16: bf16 pieces at odd element offsets, rows whose
// length is not a multiple of 8 elements), each lane loads the two ALIGNED 16-byte source words
// that cover its destination word and funnel-shifts them into place (__funnelshift_r on 32-bit
// lanes). Chosen over narrow (4-, 2- or 1-byte) words because it keeps every load and store
// 16 bytes wide: a 2-byte-misaligned bf16 run would otherwise fall back to 2-byte words, eight
// times the instructions per byte. The second load of a lane is the first load of its
// neighbour, so it hits L1: DRAM traffic is the bytes copied. No load touches a 16-byte word
// without a byte of the run in it, so nothing is read outside the source buffer's allocation.
// Runs of at most 1 KiB in a group item go to groups of 16 or 8 lanes (lanes_per_run).
#pragma once

#include <cstdint>

#include "ops/copy_items.h"

#if defined(__CUDACC__)
#define REAL_PY_HD __host__ __device__ __forceinline__
#define REAL_PY_UNROLL _Pragma("unroll")
#else
#define REAL_PY_HD inline
#define REAL_PY_UNROLL
#endif

namespace real_py {
namespace pack_detail {

constexpr int kThreads = 256;  // per block: 8 warps
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kUnroll = 4;

#if defined(__CUDACC__)
using Word16 = uint4;  // one 128-bit load / store
#else
struct alignas(16) Word16 {
  uint32_t x, y, z, w;
};
#endif

// Source and destination base pointers of one launch, by value in the kernel's parameters.
struct BufTable {
  const char* src[kMaxBufs];
  char* dst[kMaxBufs];
};

// Up to kInlineItems items travel by value too (per-call ops with few items: no upload).
constexpr int kInlineItems = 48;
struct InlineItems {
  CopyItem items[kInlineItems];
};

REAL_PY_HD uint32_t funnel_r(uint32_t lo, uint32_t hi, int shift) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, shift);
#else
  const uint64_t v = (static_cast<uint64_t>(hi) << 32) | lo;
  return static_cast<uint32_t>(v >> (shift & 31));
#endif
}

// 16 bytes starting `q * 4 + bits / 8` bytes into the 32-byte pair (a, b).
template <int Q>
REAL_PY_HD Word16 realign(const Word16& a, const Word16& b, int bits) {
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  return {funnel_r(w[Q], w[Q + 1], bits), funnel_r(w[Q + 1], w[Q + 2], bits),
          funnel_r(w[Q + 2], w[Q + 3], bits), funnel_r(w[Q + 3], w[Q + 4], bits)};
}

// Lane `lane` of a warp: its share of nw 16-byte words d[j] = source bytes at s + 16 j, for a
// 16-byte aligned d and a source whose address is sa + delta (sa aligned, 0 < delta < 16); lanes
// lane, lane + width, ... of a group of `width` lanes.
template <int Q>
REAL_PY_HD void copy_realigned(Word16* __restrict__ d, const Word16* __restrict__ sa, int64_t nw,
                               int bits, int lane, int width) {
  int64_t j = lane;
  for (; j + width * (kUnroll - 1) < nw; j += width * kUnroll) {
    Word16 a[kUnroll], b[kUnroll];
REAL_PY_UNROLL
    for (int u = 0; u < kUnroll; ++u) a[u] = sa[j + width * u], b[u] = sa[j + width * u + 1];
REAL_PY_UNROLL
    for (int u = 0; u < kUnroll; ++u) d[j + width * u] = realign<Q>(a[u], b[u], bits);
  }
  for (; j < nw; j += width) d[j] = realign<Q>(sa[j], sa[j + 1], bits);
}

REAL_PY_HD void copy_aligned(Word16* __restrict__ d, const Word16* __restrict__ s, int64_t nw, int lane,
                             int width) {
  int64_t j = lane;
  for (; j + width * (kUnroll - 1) < nw; j += width * kUnroll) {
    Word16 v[kUnroll];
REAL_PY_UNROLL
    for (int u = 0; u < kUnroll; ++u) v[u] = s[j + width * u];
REAL_PY_UNROLL
    for (int u = 0; u < kUnroll; ++u) d[j + width * u] = v[u];
  }
  for (; j < nw; j += width) d[j] = s[j];
}

// Lane `lane` of a group of `width` lanes (32: the whole warp): its share of copying n bytes
// s -> d (every lane of the group calls it alike).
REAL_PY_HD void warp_copy_run(char* __restrict__ d, const char* __restrict__ s, int64_t n, int lane,
                              int width = 32) {
  const int64_t head = (16 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  const int64_t h = head < n ? head : n;
  for (int64_t k = lane; k < h; k += width) d[k] = s[k];
  d += h, s += h, n -= h;
  const int64_t nw = n >> 4;
  if (nw > 0) {
    const int delta = static_cast<int>(reinterpret_cast<uintptr_t>(s) & 15);
    Word16* dw = reinterpret_cast<Word16*>(d);
    if (delta == 0) {
      copy_aligned(dw, reinterpret_cast<const Word16*>(s), nw, lane, width);
    } else {
      const Word16* sa = reinterpret_cast<const Word16*>(s - delta);
      const int bits = (delta & 3) * 8;
      switch (delta >> 2) {
        case 0: copy_realigned<0>(dw, sa, nw, bits, lane, width); break;
        case 1: copy_realigned<1>(dw, sa, nw, bits, lane, width); break;
        case 2: copy_realigned<2>(dw, sa, nw, bits, lane, width); break;
        default: copy_realigned<3>(dw, sa, nw, bits, lane, width); break;
      }
    }
  }
  for (int64_t k = (nw << 4) + lane; k < n; k += width) d[k] = s[k];
}

// Lanes per run for an item's runs: short runs of a group item split the warp into groups of 8
// or 16 lanes, one run per group at a time, so a 256-byte run (16 words) keeps 8 lanes busy with
// two words each instead of 32 lanes with 16 idle, and 4 runs are in flight per warp: short runs
// (row-split pieces at high tensor parallelism, MoE expert pieces) are bound by loads in flight.
REAL_PY_HD int lanes_per_run(const CopyItem& it) {
  return it.count == 1 ? 32 : it.bytes <= 256 ? 8 : it.bytes <= 1024 ? 16 : 32;
}

// Lane `lane`'s share of one work item.
REAL_PY_HD void warp_copy_item(const CopyItem& it, const BufTable& bufs, int lane) {
  const char* s = bufs.src[it.src_buf] + it.src;
  char* d = bufs.dst[it.dst_buf] + it.dst;
  const int width = lanes_per_run(it), groups = 32 / width, g = lane / width;
  s += g * it.src_stride, d += g * it.dst_stride;
  for (int32_t r = g; r < it.count; r += groups, s += groups * it.src_stride, d += groups * it.dst_stride) {
    warp_copy_run(d, s, it.bytes, lane % width, width);
  }
}

// Global warp `warp` of `num_warps`, lane `lane`: items warp, warp + num_warps, ... (grid-stride).
REAL_PY_HD void warp_copy_items(const CopyItem* __restrict__ items, int64_t m, const BufTable& bufs,
                                int64_t warp, int64_t num_warps, int lane) {
  for (int64_t i = warp; i < m; i += num_warps) {
    const CopyItem it = items[i];  // into registers (from global memory or the parameter bank)
    warp_copy_item(it, bufs, lane);
  }
}

#if defined(__CUDACC__)
__global__ void __launch_bounds__(kThreads)
copy_items_kernel(const CopyItem* __restrict__ items, int64_t m, const __grid_constant__ BufTable bufs) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  warp_copy_items(items, m, bufs, warp, static_cast<int64_t>(gridDim.x) * kWarpsPerBlock, threadIdx.x % 32);
}

__global__ void __launch_bounds__(kThreads)
copy_inline_items_kernel(const __grid_constant__ InlineItems items, int64_t m,
                         const __grid_constant__ BufTable bufs) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  warp_copy_items(items.items, m, bufs, warp, static_cast<int64_t>(gridDim.x) * kWarpsPerBlock,
                  threadIdx.x % 32);
}
#endif

}  // namespace pack_detail
}  // namespace real_py
