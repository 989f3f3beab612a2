// C++ unit tests for the interval and 2-D stride arithmetic (planner/geometry.h).
// A failure points to segment boundaries, padding, or descriptor canonicalization/merging.
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
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

// q|k|v = 8|4|4 rows (4 q heads, 2 kv heads of 2 rows), B = 1, replicate_units (vLLM): at tp=4
// every two ranks share a kv head. Global row of local row j of TP rank k, by hand.
static int64_t vllm_row(int64_t tp, int64_t k, int64_t j) {
  if (tp <= 2) {  // split as usual: q 8/tp rows, then k and v 4/tp rows each
    const int64_t q = 8 / tp, kv = 4 / tp;
    if (j < q) return k * q + j;
    if (j < q + kv) return 8 + k * kv + j - q;
    return 12 + k * kv + j - q - kv;
  }
  const int64_t head = k / 2;  // tp=4: kv head k / 2, whole
  if (j < 2) return 2 * k + j;
  if (j < 4) return 8 + 2 * head + j - 2;
  return 12 + 2 * head + j - 4;
}

static void test_replicated_units_segments() {
  ParamGeom g{1, 16, 1, TPKind::kSplit, {8, 4, 4}, {4, 2, 2}};
  const Format f{0, 1, 1};
  CHECK(local_extent(g, 4, f) == 6);
  CHECK(local_extent(g, 2, f) == 8);  // tp <= kv heads: nothing replicated
  for (int64_t k = 0; k < 4; ++k) {
    auto s = segments(g, 4, k, f);
    CHECK(s.size() == 3);
    for (const Segment& x : s)
      for (int64_t i = x.lo; i < x.hi; ++i) CHECK(vllm_row(4, k, x.local + i - x.lo) == i);
  }
  // The source view: each row once, with all its holders (kv head 1 on ranks 2 and 3).
  SourceSegments src = source_segments(g, 4, f);
  CHECK(src.segs.size() == 4);
  CHECK(src.segs[0].size() == 3 && src.segs[1].size() == 1 && src.segs[3].size() == 1);
  CHECK((src.tps[2][1] == std::vector<int64_t>{2, 3}) && (src.tps[3][0] == std::vector<int64_t>{3}));
  CHECK(src.segs[2][2].lo == 14 && src.segs[2][2].hi == 16 && src.segs[2][2].local == 4);
  bool threw = false;
  try {
    segments(g, 3, 0, f);  // 3 ranks cannot share 2 kv heads
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(local_extent(g, 4) == 4);  // without the flag every block's rows split evenly
}

// Plans tp a -> tp b on ranks 0..3 (dp fills the rest), both sides replicate_units, runs it on
// buffers of global row numbers, checks every destination row and the local / network split.
static void check_replicated_plan(int64_t src_tp, int64_t dst_tp, int64_t want_network) {
  ParamGeom g{1, 16, 1, TPKind::kSplit, {8, 4, 4}, {4, 2, 2}};
  const Format f{0, 1, 1};
  LayoutIn src, dst;
  src.tp = src_tp, src.dp = 4 / src_tp, dst.tp = dst_tp, dst.dp = 4 / dst_tp;
  src.grid = dst.grid = {0, 1, 2, 3};
  src.entry_param = dst.entry_param = {0};
  src.entry_stage = dst.entry_stage = {0};
  src.entry_offset = dst.entry_offset = {0};
  src.param_replicate_units = dst.param_replicate_units = {1};
  const int64_t se = local_extent(g, src_tp, f), de = local_extent(g, dst_tp, f);
  std::vector<std::vector<int64_t>> in(4, std::vector<int64_t>(se)), out(4, std::vector<int64_t>(de, -1));
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t j = 0; j < se; ++j) in[r][j] = vllm_row(src_tp, r % src_tp, j);
  Plan p = make_plan({g}, src, dst, PlanOptions{});
  const auto apply = [&](int64_t from, int64_t to, const Desc& d) {
    for (int64_t run = 0; run < d.n; ++run)
      for (int64_t e = 0; e < d.len; ++e) {
        int64_t& slot = out[to][d.dst_off + run * d.dst_stride + e];
        CHECK(slot == -1);  // written once
        slot = in[from][d.src_off + run * d.src_stride + e];
      }
  };
  int64_t network = 0;
  for (size_t m = 0; m < p.msg_sender.size(); ++m)
    for (int64_t i = p.msg_desc_ptr[m]; i < p.msg_desc_ptr[m + 1]; ++i)
      for (int64_t x = p.msg_recv_ptr[m]; x < p.msg_recv_ptr[m + 1]; ++x) {
        apply(p.msg_sender[m], p.msg_receivers[x], p.descs[i]);
        network += p.descs[i].numel();
      }
  for (size_t l = 0; l < p.local_rank.size(); ++l)
    for (int64_t i = p.local_desc_ptr[l]; i < p.local_desc_ptr[l + 1]; ++i)
      apply(p.local_rank[l], p.local_rank[l], p.descs[i]);
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t j = 0; j < de; ++j) CHECK(out[r][j] == vllm_row(dst_tp, r % dst_tp, j));
  CHECK(network == want_network);
}

static void test_replicated_units_plans() {
  // tp1 dp4 -> tp4: every rank holds everything, all local.
  check_replicated_plan(1, 4, 0);
  // tp4 -> tp1 dp4: each rank holds 6 of 16 rows and receives 10.
  check_replicated_plan(4, 1, 40);
  // tp2 dp2 -> tp4: rank r (tp rank r % 2) holds q rows [4t, 4t+4) and kv head t = r % 2; tp4
  // rank r needs q rows [2r, 2r+2) and kv head r / 2: ranks 0 and 3 hold all of it, ranks 1
  // and 2 receive 2 q rows and 4 kv rows each.
  check_replicated_plan(2, 4, 12);
  // tp4 -> tp4: identity, all local.
  check_replicated_plan(4, 4, 0);
}

int main() {
  test_replicated_units_segments();
  test_replicated_units_plans();
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
