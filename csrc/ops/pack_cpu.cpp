// CPU kernels of real_py::pack / real_py::unpack (schemas in ops.cpp, checks in checks.h).
//
// The descriptors become a tile list (tiles.h): long runs cut into kTileBytes pieces, short runs
// batched, tiles grouped into ~kTileBytes work units, which the threads of at::parallel_for take
// one at a time from a shared counter. Runs are copied with memcpy, except on large calls, where
// runs of 1 KiB and more use non-temporal (streaming) stores: the destination is not read back
// soon, and bypassing the cache saves the read-for-ownership traffic of ordinary stores (glibc
// itself only streams above ~192 MiB per call). Numbers: bench/bench_pack.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include "ops/checks.h"
#include "ops/tiles.h"

namespace real_py {
namespace {

constexpr int64_t kTileBytes = 256 << 10;
// Stream only when the whole call is larger than the last-level cache (below that, cached stores
// win: the data stays hot) and runs fill whole cache lines (a partial line written with streaming
// stores is flushed on its own, which is slow). Measured here (1 thread, 64 MiB, runs of 2 KiB):
// glibc memcpy 5.7 GB/s (read + written; it switches to `rep movsb` at 2 KiB, slow on this AMD
// core), 16-byte loop with ordinary stores 7.9, with streaming stores 10.9; runs of 256 KiB:
// 11.0 / 10.6 / 10.9. So streaming never loses on large calls and wins on KiB-sized runs.
constexpr int64_t kStreamMinTotal = 8 << 20;
constexpr int64_t kStreamMinRun = 1 << 10;
// Runs up to kPrefetchMaxRun start cold: the hardware prefetcher does not follow a strided
// source (2 KiB of every 4 KiB row: one run per page). Prefetching the run about kPrefetchBytes
// ahead raised 2 KiB / 4 KiB-stride copies from 2.9 to 4.8-5.9 GB/s and 7 KiB / 14 KiB-stride
// from 2.0 to 3.2-3.6 GB/s (1 thread, loaded machine, medians); longer runs stream by themselves.
constexpr int64_t kPrefetchMaxRun = 16 << 10;
constexpr int64_t kPrefetchBytes = 8 << 10;

#if defined(__SSE2__)
void copy_streaming(char* d, const char* s, int64_t n) {
  const int64_t head = std::min<int64_t>(n, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 64; d += 64, s += 64, n -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, n);
}
#endif

void copy_groups(const TileList& tl, int64_t g0, int64_t g1, const char* src, char* dst,
                 bool stream) {
  for (int64_t t = tl.group_ptr[g0]; t < tl.group_ptr[g1]; ++t) {
    const CopyTile& c = tl.tiles[t];
    const char* s = src + c.src;
    char* d = dst + c.dst;
#if defined(__SSE2__)
    if (stream && c.len >= kStreamMinRun) {
      const int64_t ahead = c.len <= kPrefetchMaxRun ? std::max<int64_t>(1, kPrefetchBytes / c.len) : c.n;
      for (int64_t r = 0; r < c.n; ++r, s += c.src_stride, d += c.dst_stride) {
        if (r + ahead < c.n) {
          const char* p = s + ahead * c.src_stride;
          for (int64_t q = 0; q < c.len; q += 64) _mm_prefetch(p + q, _MM_HINT_T0);
        }
        copy_streaming(d, s, c.len);
      }
      continue;
    }
#endif
    for (int64_t r = 0; r < c.n; ++r, s += c.src_stride, d += c.dst_stride) {
      std::memcpy(d, s, c.len);
    }
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // make streamed stores visible before the task ends
#endif
}

void strided_copy_cpu(const char* op, const at::Tensor& src, const char* src_name,
                      const at::Tensor& descs, const at::Tensor& dst, const char* dst_name) {
  check_copy_args(op, src, src_name, descs, dst, dst_name, c10::DeviceType::CPU);
  const TileList tl = make_tiles(descs.const_data_ptr<int64_t>(), descs.size(0),
                                 static_cast<int64_t>(src.element_size()), kTileBytes);
  if (tl.bytes == 0) return;
  const auto* s = static_cast<const char*>(src.const_data_ptr());
  auto* d = static_cast<char*>(dst.data_ptr());
  const bool stream = tl.bytes >= kStreamMinTotal;
  // Threads take groups from a shared counter rather than a fixed half each: when another process
  // holds a core (the usual case on a shared host), the running thread simply takes more groups.
  const int64_t num_groups = tl.num_groups();
  const int64_t workers = std::min<int64_t>(num_groups, at::get_num_threads());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t g; (g = next.fetch_add(1, std::memory_order_relaxed)) < num_groups;) {
      copy_groups(tl, g, g + 1, s, d, stream);
    }
  });
}

void pack_cpu(const at::Tensor& src, const at::Tensor& descs, const at::Tensor& out) {
  strided_copy_cpu("pack", src, "src", descs, out, "out");
}

void unpack_cpu(const at::Tensor& packed, const at::Tensor& descs, const at::Tensor& dst) {
  strided_copy_cpu("unpack", packed, "packed", descs, dst, "dst");
}

}  // namespace
}  // namespace real_py

TORCH_LIBRARY_IMPL(real_py, CPU, m) {
  m.impl("pack", &real_py::pack_cpu);
  m.impl("unpack", &real_py::unpack_cpu);
}
