// Byte descriptors -> copy work items (see copy_items.h).
#include "ops/copy_items.h"

#include <algorithm>
#include <limits>

namespace real_py {

int64_t default_item_bytes(int64_t total_bytes) {
  // About 16K items: four per resident warp of a 132-SM GPU (132 SMs x 32 warps), rounded
  // down to a multiple of 16 bytes.
  const int64_t want = total_bytes / (16 << 10);
  return std::clamp<int64_t>(want & ~int64_t{15}, kMinItemBytes, kMaxItemBytes);
}

int64_t build_copy_items(const int64_t* descs, int64_t k, int64_t item_bytes,
                         std::vector<CopyItem>* out) {
  item_bytes = std::clamp<int64_t>(item_bytes, 16, kMaxItemBytes);
  int64_t bytes = 0;
  constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();
  for (int64_t i = 0; i < k; ++i) {
    const int64_t* d = descs + kDescCols * i;
    const int64_t so = d[0], doff = d[1], len = d[2], n = d[3], ss = d[4], ds = d[5];
    const auto sb = static_cast<int16_t>(d[6]), db = static_cast<int16_t>(d[7]);
    if (len == 0 || n == 0) continue;
    bytes += len * n;
    if (len > item_bytes) {
      // Long runs: slices of item_bytes; the last slice of a run takes the remainder.
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t b = 0; b < len; b += item_bytes) {
          const auto piece = static_cast<int32_t>(std::min(item_bytes, len - b));
          out->push_back({so + r * ss + b, doff + r * ds + b, ss, ds, piece, 1, sb, db, 0});
        }
      }
    } else {
      // Short runs: as many whole runs of this descriptor as fit in item_bytes.
      const int64_t per = std::min(std::max<int64_t>(1, item_bytes / len), kMaxCount);
      for (int64_t r = 0; r < n; r += per) {
        const auto count = static_cast<int32_t>(std::min(per, n - r));
        out->push_back({so + r * ss, doff + r * ds, ss, ds, static_cast<int32_t>(len), count, sb, db, 0});
      }
    }
  }
  return bytes;
}

}  // namespace real_py
