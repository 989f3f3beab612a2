// C++ unit tests for the interval and 2-D stride arithmetic (planner/geometry.h).
// A failure points to segment boundaries, padding, or descriptor canonicalization/merging.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "planner/geometry.h"
#include "planner/planner.h"

using namespace real_py;

#include "tests/check.h"

static void test_split_blocks() {
  // q|k|v blocks of 8, 2, 2 rows split over tp=2: rank 1 holds [4,8) [10,11) [11,12) ... per block.
  ParamGeom g{1, 12, 3, TPKind::kSplit, {8, 2, 2}};
  auto s = segments(g, 2, 1);
  CHECK(s.size() == 3);
  CHECK(s[0].lo == 4 && s[0].hi == 8 && s[0].local == 0);
  CHECK(s[1].lo == 9 && s[1].hi == 10 && s[1].local == 4);
  CHECK(s[2].lo == 11 && s[2].hi == 12 && s[2].local == 5);
  CHECK(local_extent(g, 2) == 6);
}

static void test_vocab_padding() {
  // 10 rows over tp=4: 3 rows each (padded to 12); rank 3 holds only row 9.
  ParamGeom g{1, 10, 5, TPKind::kVocab, {}};
  CHECK(local_extent(g, 4) == 3);
  auto s3 = segments(g, 4, 3);
  CHECK(s3.size() == 1 && s3[0].lo == 9 && s3[0].hi == 10 && s3[0].local == 0);
  // tp=5 divides evenly: rank 4 holds [8, 10).
  auto s4 = segments(g, 5, 4);
  CHECK(s4.size() == 1 && s4[0].lo == 8 && s4[0].hi == 10);
}

static void test_row_split_desc_is_one_2d_run() {
  // [A=6, D=12, B=1] split on dim 1: tp 3 -> tp 2. Source rank 1 holds [4, 8), dest rank 0 [0, 6).
  ParamGeom g{6, 12, 1, TPKind::kSplit, {}};
  Segment s = segments(g, 3, 1)[0], d = segments(g, 2, 0)[0];
  Desc x = make_desc(g, 0, 6, 4, 6, 100, 4, s, 200, 6, d);
  CHECK(x.n == 6 && x.len == 2);
  CHECK(x.src_off == 100 && x.dst_off == 204);
  CHECK(x.src_stride == 4 && x.dst_stride == 6);
}

static void test_whole_rows_collapse() {
  // Column split on dim 0 with B=8: a range of whole rows is one contiguous run.
  ParamGeom g{1, 16, 8, TPKind::kSplit, {}};
  Segment s = segments(g, 2, 0)[0], d = segments(g, 4, 1)[0];
  Desc x = make_desc(g, 0, 1, 4, 8, 0, 8, s, 0, 4, d);
  CHECK(x.n == 1 && x.len == 32 && x.src_off == 32 && x.dst_off == 0);
  CHECK(x.src_stride == 32 && x.dst_stride == 32);
}

static void test_merge() {
  std::vector<Desc> v;
  append_merged(v, Desc{0, 10, 4, 1, 4, 4});
  append_merged(v, Desc{4, 14, 6, 1, 6, 6});
  CHECK(v.size() == 1 && v[0].len == 10 && v[0].src_stride == 10);
  append_merged(v, Desc{11, 20, 1, 1, 1, 1});  // gap on the source side: no merge
  CHECK(v.size() == 2);
  std::vector<Desc> w;
  append_merged(w, Desc{0, 0, 2, 3, 5, 7});
  append_merged(w, Desc{15, 21, 2, 2, 5, 7});  // continues the 2-D run
  CHECK(w.size() == 1 && w[0].n == 5);
  append_merged(w, Desc{25, 35, 2, 1, 2, 2});  // single row right after: merges too
  CHECK(w.size() == 1 && w[0].n == 6);
}

static void test_plan_covers_once() {
  // A [4, 6] row-split tensor, tp 3 -> tp 2, dp 1 -> dp 2, disjoint ranks.
  ParamGeom g{4, 6, 1, TPKind::kSplit, {}};
  LayoutIn src, dst;
  src.tp = 3;
  src.grid = {0, 1, 2};
  src.entry_param = {0}, src.entry_stage = {0}, src.entry_offset = {0};
  dst.tp = 2, dst.dp = 2;
  dst.grid = {3, 4, 5, 6};
  dst.entry_param = {0}, dst.entry_stage = {0}, dst.entry_offset = {0};
  Plan p = make_plan({g}, src, dst, PlanOptions{});
  std::vector<int> hits(4 * 12, 0);  // 4 receivers x 12 elements
  for (size_t m = 0; m < p.msg_sender.size(); ++m) {
    const int64_t r = p.msg_receivers[p.msg_recv_ptr[m]];
    for (int64_t i = p.msg_desc_ptr[m]; i < p.msg_desc_ptr[m + 1]; ++i) {
      const Desc& d = p.descs[i];
      for (int64_t run = 0; run < d.n; ++run)
        for (int64_t e = 0; e < d.len; ++e) ++hits[(r - 3) * 12 + d.dst_off + run * d.dst_stride + e];
    }
  }
  for (int h : hits) CHECK(h == 1);
  CHECK(p.local_rank.empty());
}

static void test_grouped_blocks() {
  // q|k|v = 8|2|2 rows in 2 groups (Megatron: 4 q rows, 1 k, 1 v per group) over tp=2: rank 1
  // holds group 1 = q [4,8), k [9,10), v [11,12); over tp=1 the local order interleaves groups.
  ParamGeom g{1, 12, 3, TPKind::kSplit, {8, 2, 2}};
  Format f{2, 1};
  auto s = segments(g, 2, 1, f);
  CHECK(s.size() == 3);
  CHECK(s[0].lo == 4 && s[0].hi == 8 && s[0].local == 0);
  CHECK(s[1].lo == 9 && s[1].hi == 10 && s[1].local == 4);
  CHECK(s[2].lo == 11 && s[2].hi == 12 && s[2].local == 5);
  auto t = segments(g, 1, 0, f);
  CHECK(t.size() == 6);
  CHECK(t[1].lo == 8 && t[1].hi == 9 && t[1].local == 4);
  CHECK(t[3].lo == 4 && t[3].hi == 8 && t[3].local == 6);
  CHECK(local_extent(g, 1, f) == 12);
}

static void test_vocab_multiple() {
  // Megatron-style padding: 10 rows, multiple 4, tp=2 -> padded to 16, 8 rows per rank.
  ParamGeom g{1, 10, 5, TPKind::kVocab, {}};
  Format f{0, 4};
  CHECK(local_extent(g, 2, f) == 8);
  auto s1 = segments(g, 2, 1, f);
  CHECK(s1.size() == 1 && s1[0].lo == 8 && s1[0].hi == 10 && s1[0].local == 0);
}

int main() {
  test_grouped_blocks();
  test_vocab_multiple();
  test_split_blocks();
  test_vocab_padding();
  test_row_split_desc_is_one_2d_run();
  test_whole_rows_collapse();
  test_merge();
  test_plan_covers_once();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("test_geometry: all checks passed\n");
  return 0;
}
