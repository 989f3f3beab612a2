// CPU kernels of real_py::pack / unpack / copy_planned (schemas in ops.cpp, checks in checks.h).
//
// The work items are the CUDA kernel's (copy_items.h: slices of at most 16 KiB of long runs, or
// a few whole short runs); a call takes them in tasks of about kTaskBytes, which the threads of
// at::parallel_for take one at a time from a shared counter. Runs are copied with memcpy, except
// on large calls, where runs of 1 KiB and more use non-temporal (streaming) stores: the
// destination is not read back soon, and bypassing the cache saves the read-for-ownership traffic
// of ordinary stores (glibc itself only streams above ~192 MiB per call). Numbers:
// bench/bench_pack.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include "ops/checks.h"
#include "ops/copy_items.h"

namespace real_py {
namespace {

constexpr int64_t kTaskBytes = 256 << 10;
constexpr int64_t kRunCostBytes = 64;  // fixed cost of one run, in bytes of copying
// Stream only when the whole call is larger than the last-level cache (below that, cached stores
// win: the data stays hot) and runs fill whole cache lines (a partial line written with streaming
// stores is flushed on its own, which is slow). Measured here (1 thread, 64 MiB, runs of 2 KiB):
// glibc memcpy 5.7 GB/s (read + written; it switches to `rep movsb` at 2 KiB, slow on this AMD
// core), 16-byte loop with ordinary stores 7.9, with streaming stores 10.9; runs of 256 KiB:
// 11.0 / 10.6 / 10.9. So streaming never loses on large calls and wins on KiB-sized runs. From
// 256 bytes on: a 7B-shaped tp8 -> tp1 move (512-byte runs of row-split weights) went from 0.36 to
// 0.39 of memcpy in a micro-benchmark of that pattern alone (noisy shared machine), never lower.
constexpr int64_t kStreamMinTotal = 8 << 20;
constexpr int64_t kStreamMinRun = 256;
// Short runs start cold: the hardware prefetcher does not follow a strided source (2 KiB of
// every 4 KiB row: one run per page). Prefetching the run about kPrefetchBytes ahead raised
// 2 KiB / 4 KiB-stride copies from 2.9 to 4.8-5.9 GB/s (1 thread, loaded machine, medians).
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

void copy_item(const CopyItem& c, const char* const* srcs, char* const* dsts, bool stream) {
  const char* s = srcs[c.src_buf] + c.src;
  char* d = dsts[c.dst_buf] + c.dst;
#if defined(__SSE2__)
  if (stream && c.bytes >= kStreamMinRun) {
    const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / c.bytes);
    for (int64_t r = 0; r < c.count; ++r, s += c.src_stride, d += c.dst_stride) {
      if (r + ahead < c.count) {
        const char* p = s + ahead * c.src_stride;
        for (int64_t q = 0; q < c.bytes; q += 64) _mm_prefetch(p + q, _MM_HINT_T0);
      }
      copy_streaming(d, s, c.bytes);
    }
    return;
  }
#endif
  for (int64_t r = 0; r < c.count; ++r, s += c.src_stride, d += c.dst_stride) std::memcpy(d, s, c.bytes);
}

// Every item, in tasks of about kTaskBytes taken from a shared counter: when another process
// holds a core (the usual case on a shared host), the running thread simply takes more tasks.
void run_items(const CopyItem* items, int64_t m, const char* const* srcs, char* const* dsts) {
  if (m == 0) return;
  std::vector<int64_t> task{0};
  int64_t cost = 0, total = 0;
  for (int64_t i = 0; i < m; ++i) {
    cost += (items[i].bytes + kRunCostBytes) * static_cast<int64_t>(items[i].count);
    total += static_cast<int64_t>(items[i].bytes) * items[i].count;
    if (cost >= kTaskBytes) task.push_back(i + 1), cost = 0;
  }
  if (task.back() != m) task.push_back(m);
  const bool stream = total >= kStreamMinTotal;
  const int64_t num_tasks = static_cast<int64_t>(task.size()) - 1;
  const int64_t workers = std::min<int64_t>(num_tasks, at::get_num_threads());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
      for (int64_t i = task[t]; i < task[t + 1]; ++i) copy_item(items[i], srcs, dsts, stream);
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();  // make streamed stores visible before the task ends
#endif
  });
}

void strided_copy_cpu(const char* op, const at::Tensor& src, const char* src_name,
                      const at::Tensor& descs, const at::Tensor& dst, const char* dst_name) {
  check_copy_args(op, src, src_name, descs, dst, dst_name, c10::DeviceType::CPU);
  const std::vector<int64_t> rows = byte_rows(descs, static_cast<int64_t>(src.element_size()));
  std::vector<CopyItem> items;
  build_copy_items(rows.data(), static_cast<int64_t>(rows.size()) / kDescCols, kMaxItemBytes, &items);
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  run_items(items.data(), static_cast<int64_t>(items.size()), &s, &d);
}

void pack_cpu(const at::Tensor& src, const at::Tensor& descs, const at::Tensor& out) {
  strided_copy_cpu("pack", src, "src", descs, out, "out");
}

void unpack_cpu(const at::Tensor& packed, const at::Tensor& descs, const at::Tensor& dst) {
  strided_copy_cpu("unpack", packed, "packed", descs, dst, "dst");
}

void copy_planned_cpu(at::TensorList srcs, at::TensorList dsts, const at::Tensor& items,
                      const at::Tensor& bounds) {
  check_planned_args(srcs, dsts, items, bounds, c10::DeviceType::CPU);
  const char* s[kMaxBufs];
  char* d[kMaxBufs];
  for (size_t i = 0; i < srcs.size(); ++i) s[i] = static_cast<const char*>(srcs[i].const_data_ptr());
  for (size_t i = 0; i < dsts.size(); ++i) d[i] = static_cast<char*>(dsts[i].data_ptr());
  run_items(reinterpret_cast<const CopyItem*>(items.const_data_ptr<int64_t>()), items.size(0), s, d);
}

}  // namespace
}  // namespace real_py

TORCH_LIBRARY_IMPL(real_py, CPU, m) {
  m.impl("pack", &real_py::pack_cpu);
  m.impl("unpack", &real_py::unpack_cpu);
  m.impl("copy_planned", &real_py::copy_planned_cpu);
}
