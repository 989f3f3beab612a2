#include "planner/planner.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "planner/planner_impl.h"

namespace real_py {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

void check_layout(const LayoutIn& l, size_t num_params, const char* side) {
  const std::string s(side);
  if (l.dp < 1 || l.tp < 1 || l.pp < 1) throw std::invalid_argument(s + ": dp, tp, pp must be >= 1");
  if (static_cast<int64_t>(l.grid.size()) != l.dp * l.tp * l.pp)
    throw std::invalid_argument(s + ": grid has " + str(l.grid.size()) + " ranks, expected dp*tp*pp=" +
                                str(l.dp * l.tp * l.pp));
  if (l.entry_param.size() != l.entry_stage.size() || l.entry_param.size() != l.entry_offset.size())
    throw std::invalid_argument(s + ": shard entry arrays differ in length");
  for (size_t i = 0; i < l.entry_param.size(); ++i) {
    if (l.entry_param[i] < 0 || l.entry_param[i] >= static_cast<int64_t>(num_params))
      throw std::invalid_argument(s + ": entry " + str(i) + " names parameter " + str(l.entry_param[i]));
    if (l.entry_stage[i] < 0 || l.entry_stage[i] >= l.pp)
      throw std::invalid_argument(s + ": entry " + str(i) + " names stage " + str(l.entry_stage[i]));
  }
  for (int64_t r : l.grid)
    if (r < 0) throw std::invalid_argument(s + ": negative rank " + str(r));
  for (const auto* v : {&l.param_groups, &l.param_vocab_multiple, &l.param_replicate_units})
    if (!v->empty() && v->size() != num_params)
      throw std::invalid_argument(s + ": per-parameter format arrays need " + str(num_params) + " entries");
}

}  // namespace

Plan make_plan(const std::vector<ParamGeom>& params, const LayoutIn& src, const LayoutIn& dst,
               const PlanOptions& opt) {
  CollectSink sink;
  plan_into(params, src, dst, opt, sink);
  return assemble_plan(sink.messages, sink.locals);
}

void plan_into(const std::vector<ParamGeom>& params, const LayoutIn& src, const LayoutIn& dst,
               const PlanOptions& opt, PlanSink& sink) {
  const size_t P = params.size();
  check_layout(src, P, "src");
  check_layout(dst, P, "dst");
  if (src.dp_sharded() || dst.dp_sharded()) return plan_dp_into(params, src, dst, opt, sink);
  int64_t num_ranks = 1;
  for (int64_t r : src.grid) num_ranks = std::max(num_ranks, r + 1);
  for (int64_t r : dst.grid) num_ranks = std::max(num_ranks, r + 1);

  // Where each parameter lives: (stage, offset) per side; each source rank's position.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> src_at(P), dst_at(P);
  for (size_t i = 0; i < src.entry_param.size(); ++i)
    src_at[src.entry_param[i]].emplace_back(src.entry_stage[i], src.entry_offset[i]);
  for (size_t i = 0; i < dst.entry_param.size(); ++i)
    dst_at[dst.entry_param[i]].emplace_back(dst.entry_stage[i], dst.entry_offset[i]);
  std::vector<int64_t> src_stage(num_ranks, -1), src_tp(num_ranks, -1);
  for (int64_t s = 0; s < src.pp; ++s)
    for (int64_t d = 0; d < src.dp; ++d)
      for (int64_t t = 0; t < src.tp; ++t) {
        const int64_t r = src.rank(s, d, t);
        src_stage[r] = s;
        src_tp[r] = t;
      }

  SenderPicker picker(num_ranks, opt.ranks_per_node);
  std::vector<Holder> holders;
  // Receiver groups: the sorted receivers (broadcast) or one receiver at a time (p2p, in
  // net_recv order), kept in reused vectors: the sink is called once per piece and group.
  std::vector<int64_t> net_recv, bcast, one(1);

  for (size_t p = 0; p < P; ++p) {
    const ParamGeom& g = params[p];
    if (src_at[p].empty() && !dst_at[p].empty())
      throw std::invalid_argument("parameter " + str(p) + " is held by no source shard");
    const Format src_fmt = src.format_of(p), dst_fmt = dst.format_of(p);
    const int64_t src_ext = local_extent(g, src.tp, src_fmt), dst_ext = local_extent(g, dst.tp, dst_fmt);
    // Each global element in one source segment, with the TP ranks holding it (several for a
    // replicated parameter or a replicated unit); destination segments of different TP ranks
    // may overlap (replicated units), each is filled on its own.
    const SourceSegments src_segs = source_segments(g, src.tp, src_fmt);
    const int64_t src_groups = static_cast<int64_t>(src_segs.segs.size());

    for (const auto& [t_stage, dst_off] : dst_at[p]) {
      for (int64_t k2 = 0; k2 < dst.tp; ++k2) {
        for (const Segment& ds : segments(g, dst.tp, k2, dst_fmt)) {
          for (int64_t k = 0; k < src_groups; ++k) {
            for (size_t si = 0; si < src_segs.segs[k].size(); ++si) {
              const Segment& ss = src_segs.segs[k][si];
              const std::vector<int64_t>& tps = src_segs.tps[k][si];
              const int64_t lo = std::max(ds.lo, ss.lo), hi = std::min(ds.hi, ss.hi);
              if (lo >= hi) continue;
              // Holders: every source rank (any stage holding p) with this piece.
              holders.clear();
              for (const auto& [s, soff] : src_at[p])
                for (int64_t d = 0; d < src.dp; ++d)
                  for (int64_t t : tps) holders.push_back({src.rank(s, d, t), soff});
              // Receivers: the dst replicas of (t_stage, k2); local when they hold the piece.
              net_recv.clear();
              for (int64_t d2 = 0; d2 < dst.dp; ++d2) {
                const int64_t r = dst.rank(t_stage, d2, k2);
                const int64_t s = src_stage[r];
                int64_t soff = -1;
                if (s >= 0 && std::find(tps.begin(), tps.end(), src_tp[r]) != tps.end())
                  for (const auto& [hs, ho] : src_at[p])
                    if (hs == s) soff = ho;
                if (soff >= 0) {
                  sink.local(r, make_desc(g, 0, g.A, lo, hi, soff, src_ext, ss, dst_off, dst_ext, ds));
                } else {
                  net_recv.push_back(r);
                }
              }
              if (net_recv.empty()) continue;
              const bool broadcast = opt.mode == Mode::kBroadcast;
              if (broadcast) {
                bcast = net_recv;
                std::sort(bcast.begin(), bcast.end());
              }
              const int64_t num_groups = broadcast ? 1 : static_cast<int64_t>(net_recv.size());
              // Split big pieces so that every holder sends when holders outnumber groups.
              const int64_t numel = g.A * (hi - lo) * g.B;
              int64_t chunks = 1;
              const int64_t H = static_cast<int64_t>(holders.size());
              if (H > num_groups && numel >= 2 * opt.min_split_elems)
                chunks = std::min(H, numel / opt.min_split_elems);
              const bool along_a = g.A >= chunks;
              if (!along_a) chunks = std::min(chunks, hi - lo);
              const int64_t extent = along_a ? g.A : hi - lo;
              for (int64_t c = 0; c < chunks; ++c) {
                const int64_t c_lo = extent * c / chunks, c_hi = extent * (c + 1) / chunks;
                const int64_t a_lo = along_a ? c_lo : 0, a_hi = along_a ? c_hi : g.A;
                const int64_t x_lo = along_a ? lo : lo + c_lo, x_hi = along_a ? hi : lo + c_hi;
                const int64_t chunk_numel = (a_hi - a_lo) * (x_hi - x_lo) * g.B;
                for (int64_t i = 0; i < num_groups; ++i) {
                  if (!broadcast) one[0] = net_recv[i];
                  const std::vector<int64_t>& group = broadcast ? bcast : one;
                  const Holder& h = picker.pick(holders, broadcast ? -1 : one[0], chunk_numel);
                  sink.message(h.rank, group,
                               make_desc(g, a_lo, a_hi, x_lo, x_hi, h.offset, src_ext, ss, dst_off,
                                         dst_ext, ds));
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
