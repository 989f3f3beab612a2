// Descriptor list -> byte tiles grouped into balanced work units (see tiles.h).
#include "ops/tiles.h"

#include <algorithm>

namespace real_py {

TileList make_tiles(const int64_t* descs, int64_t k, int64_t elem_size, int64_t tile_bytes) {
  TileList out;
  out.group_ptr.push_back(0);
  int64_t group_cost = 0;
  auto add = [&](const CopyTile& t) {
    out.tiles.push_back(t);
    out.bytes += t.len * t.n;
    group_cost += (t.len + kRunCostBytes) * t.n;
    if (group_cost >= tile_bytes) {
      out.group_ptr.push_back(static_cast<int64_t>(out.tiles.size()));
      group_cost = 0;
    }
  };
  for (int64_t i = 0; i < k; ++i) {
    const int64_t* d = descs + 6 * i;
    const int64_t len = d[2] * elem_size, n = d[3];
    const int64_t src = d[0] * elem_size, dst = d[1] * elem_size;
    const int64_t ss = d[4] * elem_size, ds = d[5] * elem_size;
    if (len == 0 || n == 0) continue;
    if (len >= tile_bytes) {
      // Long runs: one tile per piece, so a single huge run still feeds every worker.
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t b = 0; b < len; b += tile_bytes) {
          add({src + r * ss + b, dst + r * ds + b, std::min(tile_bytes, len - b), 1, ss, ds});
        }
      }
    } else {
      // Short runs: batch as many runs of this descriptor as fit in one tile.
      const int64_t per_tile = std::max<int64_t>(1, tile_bytes / (len + kRunCostBytes));
      for (int64_t r = 0; r < n; r += per_tile) {
        add({src + r * ss, dst + r * ds, len, std::min(per_tile, n - r), ss, ds});
      }
    }
  }
  if (out.group_ptr.back() != static_cast<int64_t>(out.tiles.size())) {
    out.group_ptr.push_back(static_cast<int64_t>(out.tiles.size()));
  }
  return out;
}

}  // namespace real_py
