// C++ tests of the torch-free pack/unpack work split: the CPU tile list (ops/tiles.h) and the CUDA
// kernel's device code (ops/pack_kernel_impl.cuh) run on the host, one thread after another.
// A failure points to tiles.cpp (coverage, grouping) or to the kernel's block/warp split,
// partial-run bounds or word-size paths; the kernel cannot run here otherwise (no GPU).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ops/tiles.h"

// Host stand-ins for the CUDA built-ins the kernel uses. Threads of a block run in order 0..255, so
// thread 0's binary search (followed by the kernel's only __syncthreads) comes first.
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct HostDim3 { unsigned x = 0, y = 0, z = 0; };
static HostDim3 threadIdx, blockIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static
#define __syncthreads()
using std::max;
using std::min;
#include "ops/pack_kernel_impl.cuh"

#include "tests/check.h"

// Random descriptors in bytes: disjoint destination runs, sources that may overlap.
// kind 0: short runs, 1: long runs, 2: mixed. aligned: each descriptor's offsets, strides and run
// length are multiples of one of 1, 2, 4, 8, 16 (drawn per descriptor), as in shards of
// bf16 / fp32 tensors, so the kernel's aligned word paths run and the prefix sums between them
// fall off their word size.
static std::vector<int64_t> random_descs(std::mt19937_64& rng, int kind, int64_t* src_need,
                                         int64_t* dst_need, bool aligned = false, int max_k = 20) {
  const int k = 1 + rng() % max_k;
  std::vector<int64_t> d;
  int64_t cursor = 0, need = 1;
  for (int i = 0; i < k; ++i) {
    const int64_t len = kind == 0 ? 1 + rng() % 300 : kind == 1 ? 4096 + rng() % 70000 : 1 + rng() % 20000;
    const int64_t n = 1 + rng() % (kind == 1 ? 3 : 40);
    int64_t ds = len + rng() % 40, ss = rng() % (2 * len + 1), so = rng() % 64;
    int64_t doff = cursor + rng() % 40;
    if (aligned) {
      const int64_t u = int64_t{1} << (rng() % 5);
      auto up = [u](int64_t x) { return (x + u - 1) / u * u; };
      const int64_t l = up(len);
      d.insert(d.end(), {up(so), up(doff), l, n, up(ss), std::max(up(ds), l)});
    } else {
      d.insert(d.end(), {so, doff, len, n, ss, ds});
    }
    so = d[d.size() - 6], doff = d[d.size() - 5], ss = d[d.size() - 2], ds = d[d.size() - 1];
    const int64_t len_used = d[d.size() - 4];
    cursor = doff + (n - 1) * ds + len_used;
    need = std::max(need, so + (n - 1) * ss + len_used);
  }
  *src_need = need + 64;
  *dst_need = cursor + 64;
  return d;
}

static std::vector<char> reference(const std::vector<char>& src, std::vector<char> dst,
                                   const std::vector<int64_t>& d) {
  for (size_t i = 0; i < d.size(); i += 6) {
    for (int64_t r = 0; r < d[i + 3]; ++r) {
      std::memcpy(&dst[d[i + 1] + r * d[i + 5]], &src[d[i] + r * d[i + 4]], d[i + 2]);
    }
  }
  return dst;
}

static void test_kernel_matches_reference() {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 300; ++trial) {
    int64_t sn, dn;
    const bool aligned = trial >= 150;
    // Every fifth trial draws up to 64 descriptors: the by-value kernel's capacity.
    const auto d = random_descs(rng, trial % 3, &sn, &dn, aligned, trial % 5 == 0 ? 64 : 20);
    std::vector<char> src(sn), dst(dn);
    for (auto& c : src) c = static_cast<char>(rng());
    for (auto& c : dst) c = static_cast<char>(rng());
    const auto want = reference(src, dst, d);
    // Bases shifted off 16-byte alignment by different amounts: every word-size path runs.
    std::vector<char> sbuf(sn + 32), dbuf(dn + 32);
    auto align = [](char* p) { return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t{15}); };
    // Aligned trials keep both bases 16-byte aligned three times in four.
    char* sp = align(sbuf.data()) + (aligned && rng() % 4 ? 0 : rng() % 16);
    char* dp = align(dbuf.data()) + (aligned && rng() % 4 ? 0 : rng() % 16);
    std::memcpy(sp, src.data(), sn);
    std::memcpy(dp, dst.data(), dn);
    const int64_t k = static_cast<int64_t>(d.size() / 6);
    std::vector<int64_t> prefix{0};
    for (int64_t i = 0; i < k; ++i) prefix.push_back(prefix.back() + d[6 * i + 2] * d[6 * i + 3]);
    const int64_t total = prefix.back();
    // Odd trials: the by-value kernel (descriptors in its parameters; random_descs draws <= 64).
    const bool inline_descs = trial % 2 == 1;
    real_py::pack_detail::InlineDescs params{};
    CHECK(k <= real_py::pack_detail::kInlineDescs);
    std::copy(d.begin(), d.end(), params.descs);
    std::copy(prefix.begin(), prefix.end(), params.prefix);
    const int64_t bb = real_py::pack_detail::kStridedCopyBlockBytes;
    for (int64_t b = 0; b < (total + bb - 1) / bb; ++b) {
      blockIdx.x = static_cast<unsigned>(b);
      for (unsigned t = 0; t < real_py::pack_detail::kThreads; ++t) {
        threadIdx.x = t;
        if (inline_descs) {
          real_py::pack_detail::strided_copy_inline_kernel(sp, dp, params, k, total);
        } else {
          real_py::pack_detail::strided_copy_kernel(sp, dp, d.data(), prefix.data(), k, total);
        }
      }
    }
    CHECK(std::memcmp(dp, want.data(), dn) == 0);
  }
}

static void test_tiles_cover_every_byte_once() {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 150; ++trial) {
    int64_t sn, dn;
    auto d = random_descs(rng, trial % 3, &sn, &dn);
    d.insert(d.end(), {5, 0, 0, 3, 1, 1});  // empty descriptors vanish
    d.insert(d.end(), {5, 0, 4, 0, 1, 1});
    const int64_t tile = 1 + rng() % 9000;
    const auto tl = real_py::make_tiles(d.data(), static_cast<int64_t>(d.size() / 6), 1, tile);
    std::vector<int> hits(dn, 0);
    std::vector<char> src(sn), got(dn, 0), want(dn, 0);
    for (auto& c : src) c = static_cast<char>(rng());
    want = reference(src, want, d);
    int64_t bytes = 0;
    for (const auto& t : tl.tiles) {
      CHECK(t.len > 0 && t.n > 0 && (t.n == 1 || t.len * t.n <= tile || t.len < tile));
      for (int64_t r = 0; r < t.n; ++r) {
        for (int64_t b = 0; b < t.len; ++b) ++hits[t.dst + r * t.dst_stride + b];
        std::memcpy(&got[t.dst + r * t.dst_stride], &src[t.src + r * t.src_stride], t.len);
      }
      bytes += t.len * t.n;
    }
    CHECK(bytes == tl.bytes);
    CHECK(got == want);
    for (size_t i = 0; i < d.size(); i += 6) {  // every destination byte of a run: exactly once
      for (int64_t r = 0; r < d[i + 3]; ++r) {
        for (int64_t b = 0; b < d[i + 2]; ++b) CHECK(hits[d[i + 1] + r * d[i + 5] + b] == 1);
      }
    }
    CHECK(tl.group_ptr.front() == 0 && tl.group_ptr.back() == static_cast<int64_t>(tl.tiles.size()));
    CHECK(std::is_sorted(tl.group_ptr.begin(), tl.group_ptr.end()));
  }
}

int main() {
  test_kernel_matches_reference();
  test_tiles_cover_every_byte_once();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("test_pack_kernels: all checks passed\n");
  return 0;
}
