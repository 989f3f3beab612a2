// C++ unit tests for the dp-sharding boxes (planner/dp_shard.h) and the dp planner's coverage.
// A failure points to flat-range decomposition, segment mapping, or make_plan_dp's exactly-once rule.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "planner/dp_shard.h"
#include "planner/planner.h"

using namespace real_py;

#include "tests/check.h"

static void test_flat_boxes_cover_range_in_order() {
  // Every flat range of small [A, E, B] tensors: boxes enumerate exactly lo..hi-1, in order, and
  // each box spans all of B or is a single (a, x) position.
  for (int64_t A = 1; A <= 3; ++A)
    for (int64_t E = 1; E <= 4; ++E)
      for (int64_t B = 1; B <= 3; ++B) {
        const int64_t n = A * E * B;
        for (int64_t lo = 0; lo <= n; ++lo)
          for (int64_t hi = lo; hi <= n; ++hi) {
            std::vector<int64_t> got;
            for (const Box& b : flat_boxes(E, B, lo, hi)) {
              CHECK((b.b_lo == 0 && b.b_hi == B) || (b.a_hi - b.a_lo == 1 && b.x_hi - b.x_lo == 1));
              for (int64_t a = b.a_lo; a < b.a_hi; ++a)
                for (int64_t x = b.x_lo; x < b.x_hi; ++x)
                  for (int64_t y = b.b_lo; y < b.b_hi; ++y) got.push_back((a * E + x) * B + y);
            }
            CHECK(static_cast<int64_t>(got.size()) == hi - lo);
            for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == lo + static_cast<int64_t>(i));
            CHECK(flat_boxes(E, B, lo, hi).size() <= 5);
          }
      }
}

static void test_to_global_maps_blocks() {
  // q|k|v blocks 8, 2, 2 over tp 2, rank 1 local [0, 6) = global [4,8) [9,10) [11,12).
  ParamGeom g{1, 12, 3, TPKind::kSplit, {8, 2, 2}};
  auto segs = segments(g, 2, 1);
  auto out = to_global({{0, 1, 3, 6, 0, 3}}, segs);  // local x 3..5
  CHECK(out.size() == 3);
  CHECK(out[0].box.x_lo == 7 && out[0].box.x_hi == 8 && out[0].seg == 0);
  CHECK(out[1].box.x_lo == 9 && out[1].box.x_hi == 10 && out[1].seg == 1);
  CHECK(out[2].box.x_lo == 11 && out[2].box.x_hi == 12 && out[2].seg == 2);
}

static void test_dp_plan_covers_once() {
  // One [6, 4] parameter, row-split (dim 0) over tp: src dp2 flat-sharded (tp 1), dst tp2 on
  // other ranks. Every destination element written exactly once, values follow the source.
  ParamGeom g{1, 6, 4, TPKind::kSplit, {}};
  LayoutIn src, dst;
  src.dp = 2, src.grid = {0, 1}, src.entry_param = {0}, src.entry_stage = {0}, src.entry_offset = {0};
  src.entry_range = {0, 13, 0, 13, 24, 0};  // dp 0: [0, 13), dp 1: [13, 24), both at offset 0
  dst.tp = 2, dst.grid = {2, 3}, dst.entry_param = {0}, dst.entry_stage = {0}, dst.entry_offset = {0};
  Plan plan = make_plan_dp({g}, src, dst, PlanOptions{});
  std::vector<std::vector<int64_t>> out(4, std::vector<int64_t>(12, -1));
  auto value = [](int64_t sender, int64_t off) { return sender == 0 ? off : 13 + off; };
  for (size_t m = 0; m < plan.msg_sender.size(); ++m)
    for (int64_t ri = plan.msg_recv_ptr[m]; ri < plan.msg_recv_ptr[m + 1]; ++ri)
      for (int64_t di = plan.msg_desc_ptr[m]; di < plan.msg_desc_ptr[m + 1]; ++di) {
        const Desc& d = plan.descs[di];
        for (int64_t i = 0; i < d.n; ++i)
          for (int64_t j = 0; j < d.len; ++j) {
            int64_t& slot = out[plan.msg_receivers[ri]][d.dst_off + i * d.dst_stride + j];
            CHECK(slot == -1);
            slot = value(plan.msg_sender[m], d.src_off + i * d.src_stride + j);
          }
      }
  for (int64_t r = 2; r < 4; ++r)
    for (int64_t i = 0; i < 12; ++i) CHECK(out[r][i] == (r - 2) * 12 + i);
  CHECK(plan.local_rank.empty());
}

int main() {
  test_flat_boxes_cover_range_in_order();
  test_to_global_maps_blocks();
  test_dp_plan_covers_once();
  if (failures) std::fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? EXIT_FAILURE : EXIT_SUCCESS;
}
