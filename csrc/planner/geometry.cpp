#include "planner/geometry.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace real_py {
namespace {

// Appends s, extending the last segment when s continues it in both D and local order
// (a grouped format with one block, or consecutive groups, is then one segment).
void append_segment(std::vector<Segment>& out, const Segment& s) {
  if (!out.empty() && out.back().hi == s.lo &&
      out.back().local + (out.back().hi - out.back().lo) == s.local) {
    out.back().hi = s.hi;
    return;
  }
  out.push_back(s);
}

std::string str(int64_t v) { return std::to_string(v); }

// Unit count of block i when replicate_units replicates it at this tp, else 0 (split as usual).
int64_t replicated_units(const ParamGeom& g, int64_t tp, const Format& f, size_t i) {
  if (!f.replicate_units || i >= g.units.size() || g.units[i] <= 0 || g.units[i] >= tp) return 0;
  const int64_t n = g.units[i], b = g.blocks.empty() ? g.D : g.blocks[i];
  if (tp % n || b % n)
    throw std::invalid_argument("replicate_units: tp " + str(tp) + " is not a multiple of the " +
                                str(n) + " units of block " + str(b));
  return n;
}

}  // namespace

int64_t local_extent(const ParamGeom& g, int64_t tp, const Format& f) {
  switch (g.kind) {
    case TPKind::kReplicated:
      return g.D;
    case TPKind::kVocab: {
      const int64_t m = std::max<int64_t>(1, f.vocab_multiple);
      return (g.D + m * tp - 1) / (m * tp) * m;
    }
    case TPKind::kSplit:
      if (f.replicate_units && f.groups == 0) {
        const std::vector<int64_t> one{g.D};
        const std::vector<int64_t>& blocks = g.blocks.empty() ? one : g.blocks;
        int64_t ext = 0;
        for (size_t i = 0; i < blocks.size(); ++i) {
          const int64_t n = replicated_units(g, tp, f, i);
          if (!n && blocks[i] % tp)
            throw std::invalid_argument("tp " + str(tp) + " does not divide block " + str(blocks[i]));
          ext += blocks[i] / (n ? n : tp);
        }
        return ext;
      }
      if (g.D % tp) throw std::invalid_argument("tp " + std::to_string(tp) + " does not divide " +
                                                std::to_string(g.D));
      return g.D / tp;
  }
  return 0;
}

std::vector<Segment> segments(const ParamGeom& g, int64_t tp, int64_t k, const Format& f) {
  std::vector<Segment> out;
  if (g.kind == TPKind::kReplicated) {
    out.push_back({0, g.D, 0});
  } else if (g.kind == TPKind::kVocab) {
    const int64_t ext = local_extent(g, tp, f);
    const int64_t lo = std::min(g.D, k * ext), hi = std::min(g.D, (k + 1) * ext);
    if (hi > lo) out.push_back({lo, hi, 0});
  } else if (f.groups > 0) {
    if (f.groups % tp) throw std::invalid_argument("tp " + std::to_string(tp) +
                                                   " does not divide groups " + std::to_string(f.groups));
    const std::vector<int64_t> one{g.D};
    const std::vector<int64_t>& blocks = g.blocks.empty() ? one : g.blocks;
    for (int64_t b : blocks)
      if (b % f.groups) throw std::invalid_argument("groups " + std::to_string(f.groups) +
                                                    " does not divide block " + std::to_string(b));
    const int64_t per_rank = f.groups / tp;
    int64_t local = 0;
    for (int64_t j = k * per_rank; j < (k + 1) * per_rank; ++j) {
      int64_t block_lo = 0;
      for (int64_t b : blocks) {
        const int64_t piece = b / f.groups;
        append_segment(out, {block_lo + j * piece, block_lo + (j + 1) * piece, local});
        local += piece;
        block_lo += b;
      }
    }
  } else {
    int64_t block_lo = 0, local = 0;
    const std::vector<int64_t> one{g.D};
    const std::vector<int64_t>& blocks = g.blocks.empty() ? one : g.blocks;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const int64_t b = blocks[i], n = replicated_units(g, tp, f, i);
      if (!n && b % tp) throw std::invalid_argument("tp " + std::to_string(tp) +
                                                    " does not divide block " + std::to_string(b));
      // A replicated block: unit k / (tp / n) of n; otherwise piece k of tp.
      const int64_t piece = n ? b / n : b / tp, at = n ? k / (tp / n) : k;
      out.push_back({block_lo + at * piece, block_lo + (at + 1) * piece, local});
      local += piece;
      block_lo += b;
    }
  }
  return out;
}

SourceSegments source_segments(const ParamGeom& g, int64_t tp, const Format& f) {
  SourceSegments out;
  if (g.kind == TPKind::kReplicated) {
    out.segs.push_back(segments(g, tp, 0, f));
    std::vector<int64_t> all(tp);
    for (int64_t t = 0; t < tp; ++t) all[t] = t;
    out.tps.assign(1, std::vector<std::vector<int64_t>>(out.segs[0].size(), all));
    return out;
  }
  out.segs.resize(tp);
  out.tps.resize(tp);
  for (int64_t k = 0; k < tp; ++k) out.segs[k] = segments(g, tp, k, f);
  const bool replicates = g.kind == TPKind::kSplit && f.replicate_units && f.groups == 0;
  if (!replicates) {
    for (int64_t k = 0; k < tp; ++k)
      out.tps[k].assign(out.segs[k].size(), std::vector<int64_t>{k});
    return out;
  }
  // Replicated units are whole segments repeated at the same local position on consecutive TP
  // ranks; the lowest such rank keeps the segment, listing the others as holders too.
  const auto same = [](const Segment& a, const Segment& b) {
    return a.lo == b.lo && a.hi == b.hi && a.local == b.local;
  };
  std::vector<std::vector<Segment>> all = std::move(out.segs);
  out.segs.assign(tp, {});
  for (int64_t k = 0; k < tp; ++k)
    for (const Segment& s : all[k]) {
      bool lower = false;
      std::vector<int64_t> holders{k};
      for (int64_t t = 0; t < tp && !lower; ++t) {
        if (t == k) continue;
        for (const Segment& o : all[t]) {
          if (std::max(o.lo, s.lo) >= std::min(o.hi, s.hi)) continue;
          if (!same(o, s))
            throw std::logic_error("source_segments: TP ranks " + str(k) + " and " + str(t) +
                                   " hold overlapping segments at different local positions");
          if (t < k) lower = true;
          else holders.push_back(t);
        }
      }
      if (lower) continue;
      out.segs[k].push_back(s);
      out.tps[k].push_back(std::move(holders));
    }
  return out;
}

Desc make_desc(const ParamGeom& g, int64_t a_lo, int64_t a_hi, int64_t lo, int64_t hi,
               int64_t src_base, int64_t src_ext, const Segment& s, int64_t dst_base,
               int64_t dst_ext, const Segment& d) {
  Desc out;
  out.src_off = src_base + (a_lo * src_ext + s.local + lo - s.lo) * g.B;
  out.dst_off = dst_base + (a_lo * dst_ext + d.local + lo - d.lo) * g.B;
  out.len = (hi - lo) * g.B;
  out.n = a_hi - a_lo;
  out.src_stride = src_ext * g.B;
  out.dst_stride = dst_ext * g.B;
  if (out.n > 1 && out.len == out.src_stride && out.len == out.dst_stride) {
    out.len *= out.n;
    out.n = 1;
  }
  if (out.n == 1) out.src_stride = out.dst_stride = out.len;
  return out;
}

bool merge_into(Desc& p, const Desc& d) {
  if (p.n == 1 && d.n == 1 && p.src_off + p.len == d.src_off && p.dst_off + p.len == d.dst_off) {
    p.len += d.len;
    p.src_stride = p.dst_stride = p.len;
    return true;
  }
  const bool same_strides =
      d.n == 1 || (d.src_stride == p.src_stride && d.dst_stride == p.dst_stride);
  if (p.n > 1 && d.len == p.len && same_strides && d.src_off == p.src_off + p.n * p.src_stride &&
      d.dst_off == p.dst_off + p.n * p.dst_stride) {
    p.n += d.n;
    return true;
  }
  return false;
}

void append_merged(std::vector<Desc>& out, const Desc& d) {
  if (out.empty() || !merge_into(out.back(), d)) out.push_back(d);
}

}  // namespace real_py
