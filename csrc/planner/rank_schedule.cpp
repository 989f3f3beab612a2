// Per-rank plan + schedule (see rank_schedule.h); mirrors real_py/realloc/schedule.py exactly.
#include "planner/rank_schedule.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace real_py {
namespace {

bool one_run(const Desc& d) { return d.n == 1 || (d.src_stride == d.len && d.dst_stride == d.len); }

// A message as this rank sees it: sizes always, descriptors only when the rank takes part.
struct MsgInfo {
  Desc last{};
  int64_t ndesc = 0, numel = 0;
  std::vector<int64_t> big;  // sizes of its committed big one-run descriptors, in order
  bool mine = false;
  std::vector<Desc> descs;
};

class RankSink : public PlanSink {
 public:
  RankSink(int64_t rank, int64_t direct_min) : rank_(rank), dmin_(direct_min) {}
  std::map<std::pair<int64_t, std::vector<int64_t>>, MsgInfo> msgs;
  std::vector<Desc> own_local;

  void message(int64_t sender, const std::vector<int64_t>& receivers, const Desc& d) override {
    auto [it, fresh] = msgs.try_emplace({sender, receivers});
    MsgInfo& m = it->second;
    if (fresh)
      m.mine = sender == rank_ ||
               std::find(receivers.begin(), receivers.end(), rank_) != receivers.end();
    m.numel += d.numel();
    if (m.mine) append_merged(m.descs, d);
    // The size summary follows append_merged: only the last descriptor can still grow.
    if (m.ndesc == 0) {
      m.last = d, m.ndesc = 1;
    } else if (!merge_into(m.last, d)) {
      commit(m);
      m.last = d, ++m.ndesc;
    }
  }
  void local(int64_t rank, const Desc& d) override {
    if (rank == rank_) append_merged(own_local, d);
  }
  void finish() {
    for (auto& [key, m] : msgs)
      if (m.ndesc) commit(m);
  }

 private:
  void commit(MsgInfo& m) const {
    if (dmin_ > 0 && one_run(m.last) && m.last.numel() >= dmin_) m.big.push_back(m.last.numel());
  }
  int64_t rank_, dmin_;
};

void cut_sizes(int64_t total, int64_t limit, std::vector<int64_t>& out) {
  if (total <= limit) {
    out.push_back(total);
    return;
  }
  for (int64_t lo = 0; lo < total; lo += limit) out.push_back(std::min(limit, total - lo));
}

// schedule._split_message on sizes only.
void chunk_sizes(const MsgInfo& m, int64_t dmin, int64_t limit, std::vector<int64_t>& out) {
  out.clear();
  if (dmin <= 0 || m.ndesc <= 1 || m.big.empty()) return cut_sizes(m.numel, limit, out);
  int64_t big = 0;
  for (int64_t b : m.big) big += b;
  if (m.ndesc > static_cast<int64_t>(m.big.size())) cut_sizes(m.numel - big, limit, out);
  for (int64_t b : m.big) cut_sizes(b, limit, out);
}

using Piece = std::pair<std::vector<Desc>, int64_t>;

void cut(const std::vector<Desc>& descs, int64_t total, int64_t limit, std::vector<Piece>& out) {
  if (total <= limit) {
    out.emplace_back(descs, total);
    return;
  }
  for (int64_t lo = 0; lo < total; lo += limit) {
    const int64_t hi = std::min(total, lo + limit);
    out.emplace_back(split_descs(descs, lo, hi), hi - lo);
  }
}

// schedule._split_message: the staged remainder's chunks, then the direct pieces.
std::vector<Piece> split_message(const std::vector<Desc>& descs, int64_t total, int64_t dmin,
                                 int64_t limit) {
  std::vector<Piece> out;
  auto is_big = [&](const Desc& d) { return one_run(d) && d.numel() >= dmin; };
  if (dmin <= 0 || descs.size() <= 1 || std::none_of(descs.begin(), descs.end(), is_big)) {
    cut(descs, total, limit, out);
    return out;
  }
  std::vector<Desc> rest;
  int64_t rest_numel = 0;
  for (const Desc& d : descs)
    if (!is_big(d)) rest.push_back(d), rest_numel += d.numel();
  if (!rest.empty()) cut(rest, rest_numel, limit, out);
  for (const Desc& d : descs)
    if (is_big(d)) {
      const int64_t run = d.len * d.n;
      cut({{d.src_off, d.dst_off, run, 1, run, run}}, run, limit, out);
    }
  return out;
}

struct OwnChunk {
  int64_t round, side, msg, numel;
  std::vector<Desc> descs;
};

}  // namespace

std::vector<Desc> split_descs(const std::vector<Desc>& descs, int64_t lo, int64_t hi) {
  std::vector<Desc> out;
  int64_t s = 0;
  for (const Desc& d : descs) {
    const int64_t e = s + d.numel();
    if (e <= lo) {
      s = e;
      continue;
    }
    if (s >= hi) break;
    const int64_t so = d.src_off, dof = d.dst_off, ln = d.len, ss = d.src_stride, ds = d.dst_stride;
    const int64_t a = std::max(lo, s) - s, b = std::min(hi, e) - s;
    s = e;
    if (a == 0 && b == d.numel()) {
      out.push_back(d);
      continue;
    }
    int64_t r0 = a / ln, c0 = a % ln;
    const int64_t r1 = b / ln, c1 = b % ln;
    if (r0 == r1) {
      out.push_back({so + r0 * ss + c0, dof + r0 * ds + c0, c1 - c0, 1, c1 - c0, c1 - c0});
      continue;
    }
    if (c0) {
      out.push_back({so + r0 * ss + c0, dof + r0 * ds + c0, ln - c0, 1, ln - c0, ln - c0});
      ++r0;
    }
    if (r1 > r0) {
      if (r1 - r0 > 1)
        out.push_back({so + r0 * ss, dof + r0 * ds, ln, r1 - r0, ss, ds});
      else
        out.push_back({so + r0 * ss, dof + r0 * ds, ln, 1, ln, ln});
    }
    if (c1) out.push_back({so + r1 * ss, dof + r1 * ds, c1, 1, c1, c1});
  }
  return out;
}

RankSchedule make_rank_schedule(const std::vector<ParamGeom>& params, const LayoutIn& src,
                                const LayoutIn& dst, const PlanOptions& opt, int64_t rank,
                                const ScheduleOptions& sopt) {
  if (sopt.round_elems < 2)
    throw std::invalid_argument("round of " + std::to_string(sopt.round_elems) +
                                " elements is too small; need >= 2");
  if (sopt.direct_min_elems < 0) throw std::invalid_argument("direct_min_elems must be >= 0");
  if (rank < 0) throw std::invalid_argument("rank " + std::to_string(rank) + " must be >= 0");
  const int64_t dmin = sopt.direct_min_elems, bucket = sopt.round_elems;
  const int64_t limit = std::max<int64_t>(1, bucket / 2);
  RankSink sink(rank, dmin);
  plan_into(params, src, dst, opt, sink);
  sink.finish();

  RankSchedule out;
  out.rank = rank;
  out.local = std::move(sink.own_local);
  int64_t num_ranks = 1;
  for (int64_t r : src.grid) num_ranks = std::max(num_ranks, r + 1);
  for (int64_t r : dst.grid) num_ranks = std::max(num_ranks, r + 1);
  // Frontier fill (schedule.Schedule): per rank only its current round and what it holds;
  // a chunk lands in the latest current round of its ranks, or the next one when it lacks room.
  std::vector<int64_t> cur(num_ranks, 0), used(num_ranks, 0), sizes;
  std::vector<OwnChunk> own;
  int64_t m = 0;
  for (auto& [key, info] : sink.msgs) {
    const auto& [sender, receivers] = key;
    out.msg_sender.push_back(sender);
    out.msg_receivers.insert(out.msg_receivers.end(), receivers.begin(), receivers.end());
    out.msg_recv_ptr.push_back(static_cast<int64_t>(out.msg_receivers.size()));
    out.msg_numel.push_back(info.numel);
    chunk_sizes(info, dmin, limit, sizes);
    std::vector<Piece> pieces;
    if (info.mine) {
      pieces = split_message(info.descs, info.numel, dmin, limit);
      if (pieces.size() != sizes.size())
        throw std::logic_error("rank schedule: message " + std::to_string(m) + " cut into " +
                               std::to_string(pieces.size()) + " chunks, its size summary says " +
                               std::to_string(sizes.size()));
    } else {
      ++out.summary_count;
    }
    for (size_t c = 0; c < sizes.size(); ++c) {
      const int64_t n = sizes[c];
      int64_t k = cur[sender];
      for (int64_t r : receivers) k = std::max(k, cur[r]);
      bool fits = (cur[sender] == k ? used[sender] : 0) + n <= bucket;
      for (int64_t r : receivers) fits = fits && (cur[r] == k ? used[r] : 0) + n <= bucket;
      if (!fits) ++k;
      auto take = [&](int64_t r) {
        if (cur[r] != k) cur[r] = k, used[r] = 0;
        used[r] += n;
      };
      take(sender);
      for (int64_t r : receivers) take(r);
      out.num_rounds = std::max(out.num_rounds, k + 1);
      if (info.mine) {
        if (pieces[c].second != n) throw std::logic_error("rank schedule: chunk size mismatch");
        own.push_back({k, sender == rank ? 0 : 1, m, n, std::move(pieces[c].first)});
      }
    }
    info.descs.clear();
    info.descs.shrink_to_fit();
    ++m;
  }
  std::stable_sort(own.begin(), own.end(), [](const OwnChunk& a, const OwnChunk& b) {
    return a.round != b.round ? a.round < b.round : a.side < b.side;
  });
  // Staging slots per round: sends from offset 0, then receives (schedule._place).
  int64_t off = 0;
  for (size_t i = 0; i < own.size(); ++i) {
    const OwnChunk& c = own[i];
    if (i == 0 || c.round != own[i - 1].round) {
      if (i) out.round_staging.push_back(off);
      off = 0;
      out.round_index.push_back(c.round);
      if (i) {
        out.round_chunk_ptr.push_back(static_cast<int64_t>(i));
        out.round_pack_ptr.push_back(static_cast<int64_t>(out.pack_descs.size()));
        out.round_unpack_ptr.push_back(static_cast<int64_t>(out.unpack_descs.size()));
      }
    }
    out.chunk_msg.push_back(c.msg);
    out.chunk_round.push_back(c.round);
    out.chunk_side.push_back(c.side);
    out.chunk_numel.push_back(c.numel);
    out.chunk_descs.insert(out.chunk_descs.end(), c.descs.begin(), c.descs.end());
    out.chunk_desc_ptr.push_back(static_cast<int64_t>(out.chunk_descs.size()));
    if (c.descs.size() == 1 && one_run(c.descs[0])) {
      out.chunk_slot.push_back(-1);
      continue;
    }
    out.chunk_slot.push_back(off);
    std::vector<Desc>& dest = c.side == 0 ? out.pack_descs : out.unpack_descs;
    int64_t packed = off;
    for (Desc d : c.descs) {
      if (c.side == 0)
        d.dst_off = packed, d.dst_stride = d.len;
      else
        d.src_off = packed, d.src_stride = d.len;
      packed += d.numel();
      dest.push_back(d);
    }
    off += c.numel;
  }
  if (!own.empty()) {
    out.round_staging.push_back(off);
    out.round_chunk_ptr.push_back(static_cast<int64_t>(own.size()));
    out.round_pack_ptr.push_back(static_cast<int64_t>(out.pack_descs.size()));
    out.round_unpack_ptr.push_back(static_cast<int64_t>(out.unpack_descs.size()));
  }
  return out;
}

}  // namespace real_py
