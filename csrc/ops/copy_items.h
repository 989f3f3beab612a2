// The work-item table of the strided copy (torch-free; shared by the CPU op, the CUDA launcher
// and the C++ tests).
//
// Input: descriptors in BYTES with buffer indices, one row of 8 int64:
//   (src_off, dst_off, len, n, src_stride, dst_stride, src_buf, dst_buf)
// run i copies src_bufs[src_buf][src_off + i*src_stride : +len] to
// dst_bufs[dst_buf][dst_off + i*dst_stride : +len].
//
// Output: CopyItems, each one warp's work on the GPU (one task's share on the CPU): either a
// slice of at most `item_bytes` of one long run (count == 1), or `count` consecutive whole runs of
// one descriptor whose bytes add up to at most `item_bytes` (runs shorter than item_bytes). An
// item carries its own addresses and strides, so the kernel reads item i and copies: no search
// over prefix sums, no division, no descriptor lookup. The table is built once per plan on the
// host (copy_items.cpp) and kept on the device (real_py.ops.CopyPlan); per-call ops build it per
// call. Size: 48 bytes per item, at most one item per item_bytes of payload plus one per
// descriptor (0.3% of the payload at 16 KiB items).
#pragma once

#include <cstdint>
#include <vector>

namespace real_py {

constexpr int kDescCols = 8;       // columns of a byte descriptor row (above)
constexpr int kMaxBufs = 64;       // source (and destination) buffers one launch addresses
constexpr int64_t kMaxItemBytes = 16 << 10;
constexpr int64_t kMinItemBytes = 1 << 10;

struct alignas(16) CopyItem {
  int64_t src;         // byte offset of the first run in its source buffer
  int64_t dst;         // byte offset of the first run in its destination buffer
  int64_t src_stride;  // bytes between run starts (count > 1)
  int64_t dst_stride;
  int32_t bytes;       // bytes per run, 1 .. item_bytes
  int32_t count;       // runs, >= 1
  int16_t src_buf;     // index into the launch's source pointers
  int16_t dst_buf;
  int32_t pad;
};
static_assert(sizeof(CopyItem) == 48, "CopyItem is six int64 (the torch side stores it so)");

// Items of about `item_bytes` each (clamped to [16, kMaxItemBytes]); empty descriptors vanish.
// descs: [k, kDescCols] int64 row-major in bytes, already checked (non-negative, buffer indices
// in [0, kMaxBufs)). Appends to `out`, returns the bytes the items copy.
int64_t build_copy_items(const int64_t* descs, int64_t k, int64_t item_bytes,
                         std::vector<CopyItem>* out);

// The item size a table of `total_bytes` uses by default: kMaxItemBytes for large copies; smaller
// for small ones, so a copy of a few MiB still yields several thousand items (enough warps to
// keep a whole GPU busy), never under kMinItemBytes.
int64_t default_item_bytes(int64_t total_bytes);

}  // namespace real_py
