// Work list for the pack/unpack kernels (torch-free, shared by the CPU and CUDA paths).
//
// A descriptor [6] int64 in ELEMENTS, (src_off, dst_off, len, n, src_stride, dst_stride), copies
// n runs: run i is src[src_off + i*src_stride : +len] -> dst[dst_off + i*dst_stride : +len].
// make_tiles() rewrites a descriptor list into tiles: the same six fields in BYTES, where a long
// run is cut into pieces of at most tile_bytes (one tile each, n == 1) and short runs are batched
// (one tile holds up to tile_bytes / len runs of one descriptor). Consecutive tiles are then
// grouped so that each group costs about tile_bytes (a run counts its bytes plus kRunCostBytes
// for its fixed overhead). One group is the unit of parallel work: one CPU task or one CUDA
// block, so one long run and many short runs both spread over every thread.
#pragma once

#include <cstdint>
#include <vector>

namespace real_py {

struct CopyTile {
  int64_t src;         // byte offset of the first run in the source buffer
  int64_t dst;         // byte offset of the first run in the destination buffer
  int64_t len;         // bytes per run, > 0
  int64_t n;           // runs, > 0
  int64_t src_stride;  // bytes between run starts in the source
  int64_t dst_stride;  // bytes between run starts in the destination
};
static_assert(sizeof(CopyTile) == 6 * sizeof(int64_t), "CopyTile must be six packed int64");

// Fixed cost of one run, in bytes of copying, when balancing groups of short runs.
constexpr int64_t kRunCostBytes = 64;

struct TileList {
  std::vector<CopyTile> tiles;
  std::vector<int64_t> group_ptr;  // [num_groups + 1]: group g is tiles[group_ptr[g]:group_ptr[g+1]]
  int64_t bytes = 0;               // bytes copied in total
  int64_t num_groups() const { return static_cast<int64_t>(group_ptr.size()) - 1; }
};

// descs: [k, 6] int64 row-major, elements, already bounds-checked; elem_size: bytes per element;
// tile_bytes: target bytes per tile and per group (> 0). Empty runs (len == 0 or n == 0) vanish.
TileList make_tiles(const int64_t* descs, int64_t k, int64_t elem_size, int64_t tile_bytes);

}  // namespace real_py
