// Interval and 2-D stride arithmetic for TP-partitioned tensors. Torch-free.
//
// A parameter is viewed as [A, D, B] around its TP-split dim (replicated: [1, numel, 1]).
// A TP rank holds a list of segments of D; its local tensor is [A, local_extent, B] with the
// segments concatenated in order. Copies between two such local tensors are 2-D strided runs.
#pragma once

#include <cstdint>
#include <vector>

namespace real_py {

enum class TPKind : int { kReplicated = 0, kSplit = 1, kVocab = 2 };

struct ParamGeom {
  int64_t A = 1, D = 1, B = 1;
  TPKind kind = TPKind::kReplicated;
  std::vector<int64_t> blocks;  // sizes along D; empty means one block of size D
  // Per block, its unit count (heads: TPRule.units); empty: none given. Only read by a Format
  // with replicate_units.
  std::vector<int64_t> units;
};

// Global [lo, hi) of D held by a TP rank, starting at index `local` of its local D axis.
struct Segment {
  int64_t lo, hi, local;
};

// One 2-D strided copy, all in elements: n runs of len elements, run i reads
// src[src_off + i * src_stride, +len) and writes dst[dst_off + i * dst_stride, +len).
// Canonical form: n == 1 implies src_stride == dst_stride == len.
struct Desc {
  int64_t src_off, dst_off, len, n, src_stride, dst_stride;
  int64_t numel() const { return len * n; }
  bool operator==(const Desc& o) const {
    return src_off == o.src_off && dst_off == o.dst_off && len == o.len && n == o.n &&
           src_stride == o.src_stride && dst_stride == o.dst_stride;
  }
};

// How one side stores a parameter (the two sides of a plan may differ). D coordinates are
// always the blocked order (block 0, then block 1, ...).
//   groups > 0: the fused blocks are interleaved in `groups` groups (group j holds the j-th
//     1/groups of every block, in block order: Megatron's q|k|v per kv group); TP rank k
//     holds groups/tp whole consecutive groups. 0: blocked (every block split evenly).
//   vocab_multiple: vocab rows are padded to a multiple of vocab_multiple * tp (Megatron: 128).
//   replicate_units (blocked only): a block of n = ParamGeom::units units with n < tp is not
//     split: TP rank k holds unit k / (tp / n) whole, so tp / n ranks hold the same rows at the
//     same local position (vLLM's kv heads when tp > num_key_value_heads); tp % n == 0.
struct Format {
  int64_t groups = 0, vocab_multiple = 1, replicate_units = 0;
};

// Local D extent of one TP rank (vocab: padded to a multiple of vocab_multiple * tp, divided).
int64_t local_extent(const ParamGeom& g, int64_t tp, const Format& f = {});

// Segments of D held by TP rank k of tp, in local order (empty segments dropped; vocab
// padding excluded).
std::vector<Segment> segments(const ParamGeom& g, int64_t tp, int64_t k, const Format& f = {});

// The source side's segments for planning, each global element once: TP rank k's segments
// that no lower TP rank holds (segs[k]), each with every TP rank holding it at the same local
// position (tps[k][i], ascending; {k} unless replicate_units replicates it; every TP rank of a
// replicated parameter, which has only k = 0).
struct SourceSegments {
  std::vector<std::vector<Segment>> segs;
  std::vector<std::vector<std::vector<int64_t>>> tps;
};
SourceSegments source_segments(const ParamGeom& g, int64_t tp, const Format& f = {});

// Build the canonical descriptor copying rows [a_lo, a_hi) x D-range [lo, hi) from a source
// local tensor (flat offset src_base, local extent src_ext, segment s) into a destination
// local tensor (dst_base, dst_ext, segment d). [lo, hi) must lie inside both segments.
Desc make_desc(const ParamGeom& g, int64_t a_lo, int64_t a_hi, int64_t lo, int64_t hi,
               int64_t src_base, int64_t src_ext, const Segment& s, int64_t dst_base,
               int64_t dst_ext, const Segment& d);

// Append `d` to `out`, merging it into the last descriptor when the two continue each other
// (contiguous 1-D runs, or one more batch of rows with the same run length and strides).
void append_merged(std::vector<Desc>& out, const Desc& d);
// The merge step of append_merged: true (and p extended) when d continues p.
bool merge_into(Desc& p, const Desc& d);

}  // namespace real_py
