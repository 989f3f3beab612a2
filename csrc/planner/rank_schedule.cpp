// Per-rank plan + schedule (see rank_schedule.h); mirrors tests/support/schedule_oracle.py exactly.
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

// Packed (sender, receiver) key -> message index, open addressing with linear probing (no
// node allocation or bucket chain per lookup, as std::unordered_map has): the planner calls the
// sink once per piece and receiver, 162k times for 70B dp1,tp8,pp16 -> dp32,tp4,pp1.
class P2PIndex {
 public:
  // The index stored for `key`, or `fresh` (stored, inserted = true) when the key is new.
  size_t find_or_add(uint64_t key, size_t fresh, bool& inserted) {
    if (2 * (count_ + 1) > keys_.size()) grow();
    for (size_t i = slot(key);; i = (i + 1) & (keys_.size() - 1)) {
      if (vals_[i] == kEmpty) {
        keys_[i] = key, vals_[i] = fresh, ++count_, inserted = true;
        return fresh;
      }
      if (keys_[i] == key) {
        inserted = false;
        return vals_[i];
      }
    }
  }
  int64_t bytes() const { return static_cast<int64_t>(keys_.capacity() * 8 + vals_.capacity() * 8); }

 private:
  static constexpr size_t kEmpty = ~size_t{0};
  size_t slot(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ULL) >> shift_; }
  void grow() {
    std::vector<uint64_t> keys = std::move(keys_);
    std::vector<size_t> vals = std::move(vals_);
    const size_t cap = keys.empty() ? 1024 : 2 * keys.size();
    keys_.assign(cap, 0);
    vals_.assign(cap, kEmpty);
    shift_ = 64;
    for (size_t c = cap; c > 1; c >>= 1) --shift_;
    for (size_t j = 0; j < keys.size(); ++j)
      if (vals[j] != kEmpty) {
        size_t i = slot(keys[j]);
        while (vals_[i] != kEmpty) i = (i + 1) & (cap - 1);
        keys_[i] = keys[j], vals_[i] = vals[j];
      }
  }
  std::vector<uint64_t> keys_;
  std::vector<size_t> vals_;
  size_t count_ = 0;
  int shift_ = 64;
};

class RankSink : public PlanSink {
 public:
  RankSink(int64_t rank, int64_t direct_min) : rank_(rank), dmin_(direct_min) {}
  // Messages in arrival order; `ordered()` sorts them into the plan's (sender, receivers) order.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> keys;
  std::vector<MsgInfo> infos;
  std::vector<Desc> own_local;

  void message(int64_t sender, const std::vector<int64_t>& receivers, const Desc& d) override {
    MsgInfo& m = find(sender, receivers);
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
  // Message indices in the plan's order (std::map order of the key in CollectSink).
  // Bytes this sink holds (keys, summaries, own descriptors, indexes): its peak, reached at
  // the end of the planner loop.
  int64_t held_bytes() const {
    int64_t b = static_cast<int64_t>(keys.capacity() * sizeof(keys[0]) +
                                     infos.capacity() * sizeof(MsgInfo) +
                                     own_local.capacity() * sizeof(Desc) +
                                     p2p_.bytes());
    for (size_t i = 0; i < keys.size(); ++i)
      b += static_cast<int64_t>(keys[i].second.capacity() * 8 + infos[i].big.capacity() * 8 +
                                infos[i].descs.capacity() * sizeof(Desc));
    for (const auto& [key, idx] : multi_) b += static_cast<int64_t>(key.second.capacity() * 8 + 64);
    return b;
  }

  std::vector<size_t> finish() {
    for (MsgInfo& m : infos)
      if (m.ndesc) commit(m);
    std::vector<size_t> order(keys.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a] < keys[b]; });
    return order;
  }

 private:
  // p2p messages (one receiver) by a packed key, the rest by their full key; the planner makes
  // one call per descriptor, so this lookup is its hot path.
  MsgInfo& find(int64_t sender, const std::vector<int64_t>& receivers) {
    size_t idx;
    if (receivers.size() == 1) {
      const uint64_t k = (static_cast<uint64_t>(sender) << 32) ^ static_cast<uint64_t>(receivers[0]);
      bool fresh;
      idx = p2p_.find_or_add(k, infos.size(), fresh);
      if (fresh) add(sender, receivers);
    } else {
      auto it = multi_.find({sender, receivers});
      if (it == multi_.end()) it = multi_.emplace(std::make_pair(sender, receivers), infos.size()).first, add(sender, receivers);
      idx = it->second;
    }
    return infos[idx];
  }
  void add(int64_t sender, const std::vector<int64_t>& receivers) {
    keys.emplace_back(sender, receivers);
    infos.emplace_back();
    infos.back().mine = sender == rank_ ||
                        std::find(receivers.begin(), receivers.end(), rank_) != receivers.end();
  }
  P2PIndex p2p_;
  std::map<std::pair<int64_t, std::vector<int64_t>>, size_t> multi_;

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

// A queue of round counters indexed from its front: a vector and a head index (std::deque's
// indexing was a tenth of the fill's time); the dropped front is compacted away in bulk.
class Window {
 public:
  int64_t& operator[](size_t i) { return v_[head_ + i]; }
  int64_t operator[](size_t i) const { return v_[head_ + i]; }
  size_t size() const { return v_.size() - head_; }
  bool empty() const { return size() == 0; }
  int64_t front() const { return v_[head_]; }
  void push_back(int64_t x) { v_.push_back(x); }
  void pop_front() {
    if (++head_ >= 1024 && 2 * head_ >= v_.size()) {
      v_.erase(v_.begin(), v_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }

 private:
  std::vector<int64_t> v_;
  size_t head_ = 0;
};

// One rank's send or receive side in the fill: elements per round from `first`, its earliest
// round that is not full (rounds before it are never looked at again, so they are dropped:
// the window stays short and memory does not grow with the number of rounds).
//
// fit(k, n) is "the earliest round >= k with room for n", asked a few times per chunk, so it
// is the fill's hot path. Rounds are grouped in blocks of kBlock; bmin holds a lower bound of
// each block's least-used round, so a block with no room for n is jumped in one read, and a
// block that may have room is scanned in a tight loop over `used` (cheaper per round than
// the union-find pointer chasing this replaced). The bound is only raised by a scan that
// found no room in a whole block (take() never rescans a block), so it stays a lower bound
// as rounds only fill up. A full-size chunk (n >= limit) needs an empty round: the same
// search with no room to spare.
struct Lane {
  int64_t first = 0;
  Window used;
  // Earliest round >= k (k >= first) with room for n elements.
  int64_t fit(int64_t k, int64_t n) {
    const int64_t cap = std::max<int64_t>(0, limit_ - n), end = first + static_cast<int64_t>(used.size());
    while (k < end) {
      const int64_t b = k / kBlock, lo = b * kBlock, hi = std::min(end, lo + kBlock);
      int64_t& m = bmin[b - bfirst];
      if (m > cap) {
        k = lo + kBlock;  // m > 0: the block was whole when m was set, so hi == lo + kBlock
        continue;
      }
      for (; k < hi; ++k)
        if (used[k - first] <= cap) return k;
      // No room in [k, hi): when the block is whole, its true minimum replaces the bound.
      if (lo >= first && hi == lo + kBlock) {
        int64_t mm = used[lo - first];
        for (int64_t r = lo + 1; r < hi; ++r) mm = std::min(mm, used[r - first]);
        m = mm;
      }
    }
    return k;
  }
  void take(int64_t k, int64_t n) {
    const int64_t i = k - first;
    while (static_cast<int64_t>(used.size()) <= i) {
      const int64_t r = first + static_cast<int64_t>(used.size());
      used.push_back(0);
      if (r % kBlock == 0 || bmin.empty()) bmin.push_back(0);
    }
    used[i] += n;
    while (!used.empty() && used.front() >= limit_) {
      used.pop_front(), ++first;
      while (bfirst < first / kBlock) bmin.pop_front(), ++bfirst;
    }
  }
  static constexpr int64_t kBlock = 32;
  Window bmin;  // a lower bound of the least elements used in each block, from block bfirst
  int64_t bfirst = 0;
  int64_t limit_ = 0;
};

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
  if (rank < -1) throw std::invalid_argument("rank " + std::to_string(rank) + " must be >= -1");
  const int64_t dmin = sopt.direct_min_elems, bucket = sopt.round_elems;
  const int64_t limit = std::max<int64_t>(1, bucket / 2);
  RankSink sink(rank, dmin);
  plan_into(params, src, dst, opt, sink);
  const std::vector<size_t> order = sink.finish();
  const int64_t sink_bytes = sink.held_bytes();

  RankSchedule out;
  out.rank = rank;
  out.local = std::move(sink.own_local);
  int64_t num_ranks = 1;
  for (int64_t r : src.grid) num_ranks = std::max(num_ranks, r + 1);
  for (int64_t r : dst.grid) num_ranks = std::max(num_ranks, r + 1);
  // Earliest fit (schedule_oracle.Schedule): a chunk goes to the earliest round where its sender can
  // still send it and every receiver can still receive it, each side holding at most half the
  // bucket per rank and round (a full-duplex round: egress and ingress both at their limit).
  std::vector<Lane> lanes[2] = {std::vector<Lane>(num_ranks), std::vector<Lane>(num_ranks)};
  for (auto& side : lanes)
    for (Lane& l : side) l.limit_ = limit;
  std::vector<int64_t> sizes;
  std::vector<std::pair<int64_t, int64_t>> stair;  // (chunk size, round) of this message's chunks
  std::vector<OwnChunk> own;
  int64_t m = 0;
  for (size_t idx : order) {
    const auto& [sender, receivers] = sink.keys[idx];
    MsgInfo& info = sink.infos[idx];
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
    stair.clear();
    for (size_t c = 0; c < sizes.size(); ++c) {
      const int64_t n = sizes[c];
      // The earliest round where every end fits: each lane's next fit is monotone in k, so
      // iterating them to a fixed point gives the smallest common round (schedule_oracle.py's scan).
      int64_t k = lanes[0][sender].first;
      for (int64_t r : receivers) k = std::max(k, lanes[1][r].first);
      // An earlier chunk of this message of size n' <= n went to round k': no round before
      // k' had room for n' at every end then, and rounds only fill up, so none has room for
      // n now. `stair` keeps those (n', k') with k' rising in n' (dominated ones dropped).
      auto st = std::upper_bound(stair.begin(), stair.end(), n,
                                 [](int64_t v, const std::pair<int64_t, int64_t>& e) { return v < e.first; });
      if (st != stair.begin()) k = std::max(k, std::prev(st)->second);
      // Round robin over the lanes until every one accepted the same k (a lane that already
      // accepted k is not asked again).
      const size_t L = receivers.size() + 1;
      for (size_t i = 0, agreed = 0; agreed < L; i = i + 1 == L ? 0 : i + 1) {
        Lane& lane = i == 0 ? lanes[0][sender] : lanes[1][receivers[i - 1]];
        const int64_t k2 = lane.fit(k, n);
        agreed = k2 == k ? agreed + 1 : 1;
        k = k2;
      }
      lanes[0][sender].take(k, n);
      for (int64_t r : receivers) lanes[1][r].take(k, n);
      {  // k is at least the bound for n; entries of sizes >= n and rounds <= k are dominated
        auto pos = std::lower_bound(stair.begin(), stair.end(), n,
                                    [](const std::pair<int64_t, int64_t>& e, int64_t v) { return e.first < v; });
        auto stop = pos;
        while (stop != stair.end() && stop->second <= k) ++stop;
        stair.insert(stair.erase(pos, stop), {n, k});
      }
      out.num_rounds = std::max(out.num_rounds, k + 1);
      if (rank < 0) out.all_round.push_back(k), out.all_msg.push_back(m), out.all_numel.push_back(n);
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
  const int64_t out_bytes = static_cast<int64_t>(
      8 * (out.msg_sender.size() + out.msg_recv_ptr.size() + out.msg_receivers.size() +
           out.msg_numel.size() + 7 * out.chunk_msg.size() + 5 * out.round_index.size()) +
      sizeof(Desc) * (out.local.size() + out.chunk_descs.size() + out.pack_descs.size() +
                      out.unpack_descs.size()));
  out.held_bytes = sink_bytes + out_bytes;  // the sink is alive while the output is built
  return out;
}

}  // namespace real_py
