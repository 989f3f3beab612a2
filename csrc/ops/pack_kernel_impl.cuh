// Device code of the strided byte copy (see pack_kernel.h for shapes and units), kept apart from
// the launcher so that csrc/tests/test_pack_kernels.cpp can run the same code on the host
// (threads of a block one after another) where there is no GPU.
//
// Work split: block b owns bytes [b*kStridedCopyBlockBytes, (b+1)*kStridedCopyBlockBytes) of the
// concatenated runs, found by a binary search over the prefix sums. Two paths per descriptor:
//   aligned (the common case: bf16/fp32 shards whose offsets, strides and run lengths are
//     multiples of 4, 8 or 16 bytes): the block's bytes of the descriptor are a flat sequence of
//     words of that width, word q being word q % (len/w) of run q / (len/w); every thread copies
//     every 256th word, kUnroll loads in flight before their stores, whatever the run length;
//   otherwise: runs of at least kBlockRunBytes are copied by the whole block, shorter runs dealt
//     round-robin to warps (continuing the round across descriptors); each run uses the widest
//     word that src and dst share modulo 16, after a byte head that aligns dst, and a byte tail.
// 64 KiB per block: the H200 check of 2026-12-04 measured 16 KiB blocks at 0.36-0.72x a device
// copy_, the per-block setup (search, descriptor loads) being a large part of so little work.
// Needs CUDA's built-ins (uint4, uint2, threadIdx, min, ...): nvcc provides them, the test a shim.
#pragma once

#include <cstdint>

namespace real_py {
namespace pack_detail {

constexpr int64_t kStridedCopyBlockBytes = 64 << 10;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kBlockRunBytes = 4 << 10;
constexpr int kUnroll = 4;
// The aligned path for descriptors of at least this many bytes (below, most threads of a block
// would idle and the warp round-robin of the other path does better). Decided per descriptor, not
// per block's share of it: a word straddling two blocks is copied by the block of its first byte,
// so every block of one descriptor must take the same path.
constexpr int64_t kFlatMinBytes = 2 << 10;

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

// Bytes [lo, hi) (relative to the descriptor's first byte) of one descriptor whose offsets,
// strides, run length and buffer bases are all multiples of sizeof(W). Word q belongs to the block
// whose range holds its first byte. Needs len / sizeof(W) < 2^31 (checked by the caller).
template <typename W>
__device__ __forceinline__ void copy_desc_words(char* __restrict__ dst, const char* __restrict__ src,
                                                int64_t so, int64_t doff, int64_t len, int64_t n,
                                                int64_t ss, int64_t ds, int64_t lo, int64_t hi) {
  constexpr int64_t w = sizeof(W);
  const int64_t qa = (lo + w - 1) / w, qb = (hi + w - 1) / w;
  if (qa >= qb) return;
  const uint32_t nq = static_cast<uint32_t>(qb - qa);  // <= kStridedCopyBlockBytes / w + 1
  if (n == 1) {  // one run: a contiguous copy
    const W* __restrict__ s = reinterpret_cast<const W*>(src + so) + qa;
    W* __restrict__ d = reinterpret_cast<W*>(dst + doff) + qa;
    for (uint32_t t = threadIdx.x; t < nq; t += kThreads * kUnroll) {
      W v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (t + u * kThreads < nq) v[u] = s[t + u * kThreads];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (t + u * kThreads < nq) d[t + u * kThreads] = v[u];
      }
    }
    return;
  }
  const uint32_t lw = static_cast<uint32_t>(len / w);  // words per run
  const int64_t r0 = qa / lw;
  const uint32_t q0 = static_cast<uint32_t>(qa - r0 * lw);  // < lw
  const char* __restrict__ s0 = src + so + r0 * ss;
  char* __restrict__ d0 = dst + doff + r0 * ds;
  for (uint32_t t = threadIdx.x; t < nq; t += kThreads * kUnroll) {
    W v[kUnroll];
    int64_t at[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t q = t + u * kThreads;
      if (q < nq) {
        const uint32_t r = (q0 + q) / lw, o = (q0 + q) - r * lw;
        v[u] = *reinterpret_cast<const W*>(s0 + r * ss + o * w);
        at[u] = r * ds + o * w;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (t + u * kThreads < nq) *reinterpret_cast<W*>(d0 + at[u]) = v[u];
    }
  }
}

// The aligned path's word size for one descriptor: 16, 8 or 4 bytes, or 0 (use the other path).
__device__ __forceinline__ int flat_word(const char* src, const char* dst, int64_t so, int64_t doff,
                                         int64_t len, int64_t n, int64_t ss, int64_t ds) {
  const uint64_t g = static_cast<uint64_t>(so | doff | len | (n > 1 ? ss | ds : 0)) |
                     reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  for (int w = 16; w >= 4; w /= 2) {
    if (g % w == 0 && len / w < (int64_t{1} << 31)) return w;
  }
  return 0;
}

__global__ void __launch_bounds__(kThreads, 4)
strided_copy_kernel(const char* __restrict__ src, char* __restrict__ dst,
                    const int64_t* __restrict__ descs, const int64_t* __restrict__ prefix,
                    int64_t k, int64_t total) {
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
    if (prefix[i + 1] - p >= kFlatMinBytes) {  // by the descriptor's size: every block decides alike
      const int w = flat_word(src, dst, so, doff, len, d[3], ss, ds);
      if (w == 16) {
        copy_desc_words<uint4>(dst, src, so, doff, len, d[3], ss, ds, lo, hi);
        continue;
      } else if (w == 8) {
        copy_desc_words<uint2>(dst, src, so, doff, len, d[3], ss, ds, lo, hi);
        continue;
      } else if (w == 4) {
        copy_desc_words<uint32_t>(dst, src, so, doff, len, d[3], ss, ds, lo, hi);
        continue;
      }
    }
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

}  // namespace pack_detail
}  // namespace real_py
