// Boxes for data-parallel sharded layouts (FSDP2 dim-0 or ZeRO-3 / FSDP1 flat). Torch-free.
//
// A dp-sharded rank holds one contiguous range [lo, hi) of each parameter's local tensor,
// counted row-major over its [A, local_extent, B] view. Such a range is a union of at most five
// boxes; intersecting the boxes of a source and a destination piece gives the descriptors.
#pragma once

#include <cstdint>
#include <vector>

#include "planner/geometry.h"

namespace real_py {

// Rows [a_lo, a_hi) x D-range [x_lo, x_hi) x [b_lo, b_hi) of an [A, D, B] view. Either b spans
// all of B, or the box is a single (a, x) position (one partial run of B).
struct Box {
  int64_t a_lo, a_hi, x_lo, x_hi, b_lo, b_hi;
  int64_t numel() const { return (a_hi - a_lo) * (x_hi - x_lo) * (b_hi - b_lo); }
  bool empty() const { return a_hi <= a_lo || x_hi <= x_lo || b_hi <= b_lo; }
};

// The flat range [lo, hi) of a row-major [A, E, B] tensor as at most five boxes, in order.
std::vector<Box> flat_boxes(int64_t E, int64_t B, int64_t lo, int64_t hi);

// A box in global D coordinates, inside segment `seg` of the rank's segment list.
struct SegBox {
  Box box;
  int64_t seg;
};

// Local boxes (x along the rank's local D axis) -> global boxes, split at segment edges;
// vocab padding (outside every segment) drops out.
std::vector<SegBox> to_global(const std::vector<Box>& local, const std::vector<Segment>& segs);

Box intersect(const Box& a, const Box& b);

// The descriptor copying global box `b` (inside segment s of the source and d of the
// destination) between two local tensors whose element 0 sits at flat offsets src_base /
// dst_base (local extents src_ext / dst_ext).
Desc box_desc(const ParamGeom& g, const Box& b, int64_t src_base, int64_t src_ext, const Segment& s,
              int64_t dst_base, int64_t dst_ext, const Segment& d);

}  // namespace real_py
