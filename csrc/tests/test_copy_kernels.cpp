// C++ tests of the torch-free strided copy: the work-item table (ops/copy_items.h) and the CUDA
// kernel's lane code (ops/copy_kernel_impl.cuh, its host twin: the same functions compiled for
// the host) run here one lane after another, against a plain memcpy reference.
// A failure points to copy_items.cpp (coverage, slicing, grouping) or to the kernel's head /
// aligned / funnel-shift realigned / tail paths or its grid-stride warp loop; the kernel cannot
// run here otherwise (no GPU).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ops/copy_items.h"
#include "ops/copy_kernel_impl.cuh"
#include "tests/check.h"

using real_py::CopyItem;
using real_py::kDescCols;

// Random byte descriptors over `bufs` source and destination buffers: disjoint destination runs
// per buffer, sources that may overlap. kind 0: short runs, 1: long runs, 2: mixed. aligned:
// offsets, strides and run length multiples of one of 1, 2, 4, 8, 16 (drawn per descriptor).
static std::vector<int64_t> random_descs(std::mt19937_64& rng, int kind, int bufs, bool aligned,
                                         std::vector<int64_t>* src_need, std::vector<int64_t>* dst_need) {
  const int k = 1 + rng() % 24;
  std::vector<int64_t> d, cursor(bufs, 0);
  src_need->assign(bufs, 1);
  for (int i = 0; i < k; ++i) {
    int64_t len = kind == 0 ? 1 + rng() % 300 : kind == 1 ? 4096 + rng() % 70000 : 1 + rng() % 20000;
    const int64_t n = 1 + rng() % (kind == 1 ? 3 : 40);
    int64_t ds = len + rng() % 40, ss = rng() % (2 * len + 1), so = rng() % 64;
    const int64_t sb = rng() % bufs, db = rng() % bufs;
    int64_t doff = cursor[db] + rng() % 40;
    if (aligned) {
      const int64_t u = int64_t{1} << (rng() % 5);
      auto up = [u](int64_t x) { return (x + u - 1) / u * u; };
      len = up(len), so = up(so), doff = up(doff), ss = up(ss), ds = std::max(up(ds), len);
    }
    d.insert(d.end(), {so, doff, len, n, ss, ds, sb, db});
    cursor[db] = doff + (n - 1) * ds + len;
    (*src_need)[sb] = std::max((*src_need)[sb], so + (n - 1) * ss + len);
  }
  *dst_need = cursor;
  return d;
}

static void reference(const std::vector<char*>& src, const std::vector<char*>& dst, const std::vector<int64_t>& d) {
  for (size_t i = 0; i < d.size(); i += kDescCols) {
    for (int64_t r = 0; r < d[i + 3]; ++r) {
      std::memcpy(dst[d[i + 7]] + d[i + 1] + r * d[i + 5], src[d[i + 6]] + d[i] + r * d[i + 4], d[i + 2]);
    }
  }
}

// Buffers with 16 bytes of slack on both sides, based off 16-byte alignment by `shift`.
struct Buf {
  std::vector<char> mem;
  char* p;
  Buf(int64_t n, int64_t shift, std::mt19937_64& rng) : mem(n + 64) {
    for (auto& c : mem) c = static_cast<char>(rng());
    p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(mem.data()) + 31) & ~uintptr_t{15}) + shift;
  }
};

static void test_kernel_twin_matches_reference() {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 240; ++trial) {
    const bool aligned = trial % 2 == 0;
    const int bufs = 1 + trial % 3;
    std::vector<int64_t> sn, dn;
    const auto d = random_descs(rng, trial % 3, bufs, aligned, &sn, &dn);
    std::vector<Buf> sb, db, want;
    std::vector<char*> sp, dp, wp;
    for (int b = 0; b < bufs; ++b) {
      // Aligned trials keep both bases 16-byte aligned three times in four.
      sb.emplace_back(sn[b], aligned && rng() % 4 ? 0 : rng() % 16, rng);
      db.emplace_back(dn[b], aligned && rng() % 4 ? 0 : rng() % 16, rng);
    }
    for (int b = 0; b < bufs; ++b) {
      want.push_back(db[b]);
      want.back().p = want.back().mem.data() + (db[b].p - db[b].mem.data());
      sp.push_back(sb[b].p), dp.push_back(db[b].p), wp.push_back(want.back().p);
    }
    reference(sp, wp, d);
    std::vector<CopyItem> items;
    const int64_t item_bytes = std::vector<int64_t>{16, 100, 1024, 4096, 16384}[trial % 5];
    const int64_t bytes = real_py::build_copy_items(d.data(), static_cast<int64_t>(d.size() / kDescCols),
                                                    item_bytes, &items);
    int64_t want_bytes = 0;
    for (size_t i = 0; i < d.size(); i += kDescCols) want_bytes += d[i + 2] * d[i + 3];
    CHECK(bytes == want_bytes);
    real_py::pack_detail::BufTable t{};
    for (int b = 0; b < bufs; ++b) t.src[b] = sp[b], t.dst[b] = dp[b];
    // The kernel's grid: warps of a few blocks, grid-stride over the items, lanes in order.
    const int64_t warps = 1 + rng() % 40;
    for (int64_t w = 0; w < warps; ++w) {
      for (int lane = 0; lane < 32; ++lane) {
        real_py::pack_detail::warp_copy_items(items.data(), static_cast<int64_t>(items.size()), t, w, warps, lane);
      }
    }
    for (int b = 0; b < bufs; ++b) CHECK(db[b].mem == want[b].mem);  // slack bytes included
  }
}

static void test_items_cover_every_byte_once() {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 150; ++trial) {
    std::vector<int64_t> sn, dn;
    auto d = random_descs(rng, trial % 3, 1, false, &sn, &dn);
    d.insert(d.end(), {5, 0, 0, 3, 1, 1, 0, 0});  // empty descriptors vanish
    d.insert(d.end(), {5, 0, 4, 0, 1, 1, 0, 0});
    const int64_t ib = 16 + rng() % 9000;
    std::vector<CopyItem> items;
    real_py::build_copy_items(d.data(), static_cast<int64_t>(d.size() / kDescCols), ib, &items);
    std::vector<int> hits(dn[0], 0);
    for (const auto& c : items) {
      CHECK(c.bytes > 0 && c.count > 0 && c.bytes <= ib);
      CHECK(c.count == 1 || static_cast<int64_t>(c.bytes) * c.count <= ib);
      for (int64_t r = 0; r < c.count; ++r) {
        for (int64_t b = 0; b < c.bytes; ++b) ++hits[c.dst + r * c.dst_stride + b];
      }
    }
    for (size_t i = 0; i < d.size(); i += kDescCols) {  // every destination byte of a run: once
      for (int64_t r = 0; r < d[i + 3]; ++r) {
        for (int64_t b = 0; b < d[i + 2]; ++b) CHECK(hits[d[i + 1] + r * d[i + 5] + b] == 1);
      }
    }
  }
}

// Every (src mod 16, dst mod 16, length) combination through one warp: the head, the aligned and
// each of the 15 realigned middles, the tail.
static void test_every_alignment_pair() {
  std::mt19937_64 rng(3);
  for (int so = 0; so < 16; ++so) {
    for (int dof = 0; dof < 16; ++dof) {
      for (int64_t n : {1, 15, 16, 17, 31, 33, 100, 2048, 2050, 7000}) {
        Buf s(n + 32, 0, rng), d(n + 32, 0, rng), w(n + 32, 0, rng);
        w.mem = d.mem;
        w.p = w.mem.data() + (d.p - d.mem.data());
        std::memcpy(w.p + dof, s.p + so, n);
        for (int lane = 0; lane < 32; ++lane) real_py::pack_detail::warp_copy_run(d.p + dof, s.p + so, n, lane);
        CHECK(d.mem == w.mem);
      }
    }
  }
}

static void test_default_item_bytes() {
  CHECK(real_py::default_item_bytes(0) == real_py::kMinItemBytes);
  CHECK(real_py::default_item_bytes(int64_t{1} << 40) == real_py::kMaxItemBytes);
  const int64_t mid = real_py::default_item_bytes(64 << 20);
  CHECK(mid % 16 == 0 && mid >= real_py::kMinItemBytes && mid <= real_py::kMaxItemBytes);
}

int main() {
  test_kernel_twin_matches_reference();
  test_items_cover_every_byte_once();
  test_every_alignment_pair();
  test_default_item_bytes();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("test_copy_kernels: all checks passed\n");
  return 0;
}
