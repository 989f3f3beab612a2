// The planner loop for layouts with a dp-sharded side (see dp_shard.h). Same contract as
// make_plan: every destination element gets exactly one source, local when the receiving rank
// holds it in the source layout, else one message; senders balanced over the holders.
#include "planner/dp_shard.h"

#include <algorithm>
#include <array>
#include <map>
#include <stdexcept>
#include <string>

#include "planner/planner.h"
#include "planner/planner_impl.h"

namespace real_py {

std::vector<Box> flat_boxes(int64_t E, int64_t B, int64_t lo, int64_t hi) {
  std::vector<Box> out;
  const int64_t row = E * B;
  int64_t f = lo;
  while (f < hi) {
    const int64_t a = f / row, x = f % row / B, b = f % B;
    if (b != 0 || hi - f < B) {  // part of one run of B
      const int64_t end = std::min(hi, f - b + B);
      out.push_back({a, a + 1, x, x + 1, b, b + end - f});
      f = end;
    } else if (x != 0 || hi - f < row) {  // whole runs of B inside row a
      const int64_t nx = std::min(E - x, (hi - f) / B);
      out.push_back({a, a + 1, x, x + nx, 0, B});
      f += nx * B;
    } else {  // whole rows
      const int64_t na = (hi - f) / row;
      out.push_back({a, a + na, 0, E, 0, B});
      f += na * row;
    }
  }
  return out;
}

std::vector<SegBox> to_global(const std::vector<Box>& local, const std::vector<Segment>& segs) {
  std::vector<SegBox> out;
  for (const Box& b : local)
    for (size_t i = 0; i < segs.size(); ++i) {
      const Segment& s = segs[i];
      const int64_t lo = std::max(b.x_lo, s.local), hi = std::min(b.x_hi, s.local + s.hi - s.lo);
      if (lo < hi)
        out.push_back({{b.a_lo, b.a_hi, s.lo + lo - s.local, s.lo + hi - s.local, b.b_lo, b.b_hi},
                       static_cast<int64_t>(i)});
    }
  return out;
}

Box intersect(const Box& a, const Box& b) {
  return {std::max(a.a_lo, b.a_lo), std::min(a.a_hi, b.a_hi), std::max(a.x_lo, b.x_lo),
          std::min(a.x_hi, b.x_hi), std::max(a.b_lo, b.b_lo), std::min(a.b_hi, b.b_hi)};
}

Desc box_desc(const ParamGeom& g, const Box& b, int64_t src_base, int64_t src_ext, const Segment& s,
              int64_t dst_base, int64_t dst_ext, const Segment& d) {
  if (b.b_lo == 0 && b.b_hi == g.B)
    return make_desc(g, b.a_lo, b.a_hi, b.x_lo, b.x_hi, src_base, src_ext, s, dst_base, dst_ext, d);
  if (b.a_hi - b.a_lo != 1 || b.x_hi - b.x_lo != 1)
    throw std::logic_error("box_desc: a partial run of B must be one (a, x) position");
  Desc out;
  out.src_off = src_base + (b.a_lo * src_ext + s.local + b.x_lo - s.lo) * g.B + b.b_lo;
  out.dst_off = dst_base + (b.a_lo * dst_ext + d.local + b.x_lo - d.lo) * g.B + b.b_lo;
  out.len = out.src_stride = out.dst_stride = b.b_hi - b.b_lo;
  out.n = 1;
  return out;
}

namespace {

using Range = std::array<int64_t, 3>;  // lo, hi, offset

// dp replica d's range of entry i (an unsharded side holds the whole local tensor).
Range entry_range(const LayoutIn& l, int64_t i, int64_t d, int64_t local_numel) {
  if (!l.dp_sharded()) return {0, local_numel, l.entry_offset[i]};
  const int64_t* r = &l.entry_range[(i * l.dp + d) * 3];
  if (r[0] < 0 || r[0] > r[1] || r[1] > local_numel || r[2] < 0)
    throw std::invalid_argument("entry_range of entry " + std::to_string(i) + ", dp replica " +
                                std::to_string(d) + ": need 0 <= lo <= hi <= " +
                                std::to_string(local_numel) + " and offset >= 0");
  return {r[0], r[1], r[2]};
}

void check_ranges(const LayoutIn& l, const char* side) {
  if (l.dp_sharded() &&
      l.entry_range.size() != l.entry_param.size() * static_cast<size_t>(l.dp) * 3)
    throw std::invalid_argument(std::string(side) + ": entry_range must be [num_entries, dp, 3]");
}

}  // namespace

Plan make_plan_dp(const std::vector<ParamGeom>& params, const LayoutIn& src, const LayoutIn& dst,
                  const PlanOptions& opt) {
  CollectSink sink;
  plan_dp_into(params, src, dst, opt, sink);
  return assemble_plan(sink.messages, sink.locals);
}

void plan_dp_into(const std::vector<ParamGeom>& params, const LayoutIn& src, const LayoutIn& dst,
                  const PlanOptions& opt, PlanSink& sink) {
  check_ranges(src, "src");
  check_ranges(dst, "dst");
  const size_t P = params.size();
  // Any storage format on either side: a dp piece is a flat range of the rank's local tensor
  // ([A, local_extent, B] in that side's format), and to_global maps its boxes through the
  // side's segments (Segment.local), dropping vocab padding.
  int64_t num_ranks = 1;
  for (int64_t r : src.grid) num_ranks = std::max(num_ranks, r + 1);
  for (int64_t r : dst.grid) num_ranks = std::max(num_ranks, r + 1);

  std::vector<std::vector<int64_t>> src_ent(P), dst_ent(P);
  for (size_t i = 0; i < src.entry_param.size(); ++i) src_ent[src.entry_param[i]].push_back(i);
  for (size_t i = 0; i < dst.entry_param.size(); ++i) dst_ent[dst.entry_param[i]].push_back(i);
  std::vector<int64_t> src_stage(num_ranks, -1), src_tp(num_ranks, -1), src_dp(num_ranks, -1);
  for (int64_t s = 0; s < src.pp; ++s)
    for (int64_t d = 0; d < src.dp; ++d)
      for (int64_t t = 0; t < src.tp; ++t) {
        const int64_t r = src.rank(s, d, t);
        src_stage[r] = s, src_dp[r] = d, src_tp[r] = t;
      }

  SenderPicker picker(num_ranks, opt.ranks_per_node);
  std::vector<Holder> holders;
  std::vector<Box> pieces;

  for (size_t p = 0; p < P; ++p) {
    const ParamGeom& g = params[p];
    if (src_ent[p].empty() && !dst_ent[p].empty())
      throw std::invalid_argument("parameter " + std::to_string(p) + " is held by no source shard");
    const Format src_fmt = src.format_of(p), dst_fmt = dst.format_of(p);
    const int64_t src_ext = local_extent(g, src.tp, src_fmt), dst_ext = local_extent(g, dst.tp, dst_fmt);
    const int64_t src_numel = g.A * src_ext * g.B, dst_numel = g.A * dst_ext * g.B;
    // Each global element in one source segment, with every TP rank holding it there (the
    // same local position, so the same flat range of a dp replica; planner.cpp).
    const SourceSegments src_segs = source_segments(g, src.tp, src_fmt);
    const int64_t src_groups = static_cast<int64_t>(src_segs.segs.size());
    // Global boxes held by source entry e (index into src_ent[p]), dp replica d, tp group k
    // (inside k's own segments; its replicas hold the same boxes).
    auto held = [&](size_t e, int64_t d, int64_t k) {
      const Range r = entry_range(src, src_ent[p][e], d, src_numel);
      return to_global(flat_boxes(src_ext, g.B, r[0], r[1]), src_segs.segs[k]);
    };

    for (int64_t j : dst_ent[p]) {
      const int64_t t_stage = dst.entry_stage[j];
      for (int64_t k2 = 0; k2 < dst.tp; ++k2) {
        const std::vector<Segment> dsegs = segments(g, dst.tp, k2, dst_fmt);
        // dp replicas needing the same range (all of them when dst is not dp-sharded).
        std::map<Range, std::vector<int64_t>> by_range;
        for (int64_t d2 = 0; d2 < dst.dp; ++d2)
          by_range[entry_range(dst, j, d2, dst_numel)].push_back(dst.rank(t_stage, d2, k2));
        for (const auto& [drange, receivers] : by_range) {
          const int64_t dst_base = drange[2] - drange[0];
          for (const SegBox& db : to_global(flat_boxes(dst_ext, g.B, drange[0], drange[1]), dsegs)) {
            const Segment& ds = dsegs[db.seg];
            for (int64_t k = 0; k < src_groups; ++k) {
              for (size_t si = 0; si < src_segs.segs[k].size(); ++si) {
                const Segment& ss = src_segs.segs[k][si];
                const std::vector<int64_t>& tps = src_segs.tps[k][si];
                const auto holds_tp = [&](int64_t t) {
                  return std::find(tps.begin(), tps.end(), t) != tps.end();
                };
                Box q = db.box;
                q.x_lo = std::max(q.x_lo, ss.lo), q.x_hi = std::min(q.x_hi, ss.hi);
                if (q.empty()) continue;
                // Receivers by the source piece they take: (entry e, dp replica d), or (-1, -1)
                // for a source that is not dp-sharded (every replica holds all of q).
                std::map<std::pair<int64_t, int64_t>, std::vector<int64_t>> net;
                for (int64_t r : receivers) {
                  int64_t own = -1;  // the entry of p on r's own source stage
                  if (src_stage[r] >= 0)
                    for (size_t e = 0; e < src_ent[p].size(); ++e)
                      if (src.entry_stage[src_ent[p][e]] == src_stage[r]) own = e;
                  const bool holds = own >= 0 && holds_tp(src_tp[r]);
                  if (!src.dp_sharded()) {
                    if (holds)
                      sink.local(r, box_desc(g, q, src.entry_offset[src_ent[p][own]],
                                                        src_ext, ss, dst_base, dst_ext, ds));
                    else
                      net[{-1, -1}].push_back(r);
                    continue;
                  }
                  // A tied parameter on two source stages: take the pieces of r's own stage so
                  // that everything r holds is a local copy.
                  const size_t e = own >= 0 ? own : 0;
                  for (int64_t d = 0; d < src.dp; ++d) {
                    if (!(holds && d == src_dp[r])) {
                      net[{static_cast<int64_t>(e), d}].push_back(r);
                      continue;
                    }
                    const Range sr = entry_range(src, src_ent[p][e], d, src_numel);
                    for (const SegBox& sb : held(e, d, k)) {
                      const Box i = intersect(q, sb.box);
                      if (!i.empty())
                        sink.local(r, box_desc(g, i, sr[2] - sr[0], src_ext, ss,
                                                          dst_base, dst_ext, ds));
                    }
                  }
                }
                for (const auto& [piece, recvs] : net) {
                  holders.clear();
                  pieces.clear();
                  if (piece.first < 0) {
                    for (int64_t i : src_ent[p])
                      for (int64_t d = 0; d < src.dp; ++d)
                        for (int64_t t : tps)
                          holders.push_back({src.rank(src.entry_stage[i], d, t), src.entry_offset[i]});
                    pieces.push_back(q);
                  } else {
                    const auto [e, d] = piece;
                    const int64_t i = src_ent[p][e];
                    const Range sr = entry_range(src, i, d, src_numel);
                    for (int64_t t : tps)
                      holders.push_back({src.rank(src.entry_stage[i], d, t), sr[2] - sr[0]});
                    for (const SegBox& sb : held(e, d, k)) {
                      const Box i2 = intersect(q, sb.box);
                      if (!i2.empty()) pieces.push_back(i2);
                    }
                  }
                  std::vector<std::vector<int64_t>> groups;
                  if (opt.mode == Mode::kBroadcast) {
                    groups.push_back(recvs);
                    std::sort(groups.back().begin(), groups.back().end());
                  } else {
                    for (int64_t r : recvs) groups.push_back({r});
                  }
                  const int64_t H = static_cast<int64_t>(holders.size());
                  for (const Box& b : pieces) {
                    // Split big pieces so that every holder sends when holders outnumber groups.
                    int64_t chunks = 1;
                    const bool whole_b = b.b_lo == 0 && b.b_hi == g.B;
                    if (whole_b && H > static_cast<int64_t>(groups.size()) &&
                        b.numel() >= 2 * opt.min_split_elems)
                      chunks = std::min(H, b.numel() / opt.min_split_elems);
                    const bool along_a = b.a_hi - b.a_lo >= chunks;
                    if (!along_a) chunks = std::min(chunks, b.x_hi - b.x_lo);
                    const int64_t extent = along_a ? b.a_hi - b.a_lo : b.x_hi - b.x_lo;
                    for (int64_t c = 0; c < chunks; ++c) {
                      Box sub = b;
                      const int64_t c_lo = extent * c / chunks, c_hi = extent * (c + 1) / chunks;
                      if (along_a)
                        sub.a_lo = b.a_lo + c_lo, sub.a_hi = b.a_lo + c_hi;
                      else
                        sub.x_lo = b.x_lo + c_lo, sub.x_hi = b.x_lo + c_hi;
                      for (const auto& group : groups) {
                        const int64_t near = opt.mode == Mode::kP2P ? group[0] : -1;
                        const Holder& h = picker.pick(holders, near, sub.numel());
                        sink.message(h.rank, group,
                                     box_desc(g, sub, h.offset, src_ext, ss, dst_base, dst_ext, ds));
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace real_py
