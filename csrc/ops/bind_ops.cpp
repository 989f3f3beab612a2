// Python bindings of the copy-plan builder and the kernel's host twin (_C.copy_plan, _C.copy_twin).
//
//   copy_plan(descs [k, 8] int64, elem_size, item_bytes) -> (items [m, 6] int64, bounds [2, 64] int64, bytes)
//     descs in ELEMENTS: (src_off, dst_off, len, n, src_stride, dst_stride, src_buf, dst_buf);
//     checked here once (a plan's calls only check buffers against `bounds`); item_bytes 0: the
//     default for the plan's size (copy_items.h). items: CopyItem rows, bounds: bytes each source
//     (row 0) and destination (row 1) buffer must hold.
//   copy_twin(srcs, dsts, items, warps): the CUDA kernel's lane code (copy_kernel_impl.cuh) run on
//     the host over uint8 numpy buffers, `warps` warps grid-stride, lanes one after another:
//     the kernel's work split and realignment proven without a GPU (tests/test_ops_copy_plan.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/copy_items.h"
#include "ops/copy_kernel_impl.cuh"

namespace py = pybind11;

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using U8 = py::array_t<uint8_t, py::array::c_style>;

std::string row_str(const int64_t* d) {
  std::string s = "(";
  for (int c = 0; c < real_py::kDescCols; ++c) s += std::to_string(d[c]) + (c + 1 < real_py::kDescCols ? ", " : ")");
  return s;
}

py::tuple copy_plan(const I64& descs, int64_t elem_size, int64_t item_bytes) {
  using real_py::kDescCols;
  using real_py::kMaxBufs;
  if (descs.ndim() != 2 || descs.shape(1) != kDescCols) {
    throw std::invalid_argument("copy_plan: descs must be [k, 8] int64 (src_off, dst_off, len, n, "
                                "src_stride, dst_stride, src_buf, dst_buf)");
  }
  if (elem_size < 1 || elem_size > 64) throw std::invalid_argument("copy_plan: elem_size must be 1..64 bytes");
  if (item_bytes < 0) throw std::invalid_argument("copy_plan: item_bytes must be >= 0 (0: default)");
  const int64_t k = descs.shape(0);
  const int64_t* d = descs.data();
  constexpr int64_t kBig = std::numeric_limits<int64_t>::max() / 4;
  std::vector<int64_t> rows;
  rows.reserve(kDescCols * k);
  std::vector<int64_t> bounds(2 * kMaxBufs, 0);
  int64_t total = 0;
  for (int64_t i = 0; i < k; ++i, d += kDescCols) {
    for (int c = 0; c < kDescCols; ++c) {
      if (d[c] < 0) throw std::invalid_argument("copy_plan: descriptor " + std::to_string(i) + " " + row_str(d) + " has a negative value");
    }
    if (d[6] >= kMaxBufs || d[7] >= kMaxBufs) {
      throw std::invalid_argument("copy_plan: descriptor " + std::to_string(i) + " " + row_str(d) +
                                  " names a buffer >= " + std::to_string(kMaxBufs) + " (split the plan)");
    }
    if (d[2] == 0 || d[3] == 0) continue;
    if (d[3] > 1 && d[5] < d[2]) {
      throw std::invalid_argument("copy_plan: descriptor " + std::to_string(i) + " " + row_str(d) +
                                  " writes overlapping runs; dst_stride must be >= len");
    }
    // Ends in bytes, refusing values whose byte products would overflow.
    const int64_t lim = kBig / elem_size;
    if (d[0] > lim || d[1] > lim || d[2] > lim || d[4] > lim || d[5] > lim ||
        (d[3] > 1 && (d[4] > lim / d[3] || d[5] > lim / d[3])) || d[2] > lim / d[3]) {
      throw std::invalid_argument("copy_plan: descriptor " + std::to_string(i) + " " + row_str(d) + " is too large");
    }
    const int64_t es = elem_size;
    const int64_t r[kDescCols] = {d[0] * es, d[1] * es, d[2] * es, d[3], d[4] * es, d[5] * es, d[6], d[7]};
    rows.insert(rows.end(), r, r + kDescCols);
    const int64_t src_end = r[0] + (r[3] - 1) * r[4] + r[2], dst_end = r[1] + (r[3] - 1) * r[5] + r[2];
    bounds[r[6]] = std::max(bounds[r[6]], src_end);
    bounds[kMaxBufs + r[7]] = std::max(bounds[kMaxBufs + r[7]], dst_end);
    total += r[2] * r[3];
  }
  std::vector<real_py::CopyItem> items;
  const int64_t ib = item_bytes > 0 ? item_bytes : real_py::default_item_bytes(total);
  real_py::build_copy_items(rows.data(), static_cast<int64_t>(rows.size()) / kDescCols, ib, &items);
  I64 out({static_cast<py::ssize_t>(items.size()), py::ssize_t{6}});
  if (!items.empty()) std::memcpy(out.mutable_data(), items.data(), items.size() * sizeof(real_py::CopyItem));
  I64 b({py::ssize_t{2}, static_cast<py::ssize_t>(kMaxBufs)});
  std::memcpy(b.mutable_data(), bounds.data(), bounds.size() * sizeof(int64_t));
  return py::make_tuple(out, b, total);
}

void copy_twin(const std::vector<U8>& srcs, std::vector<U8> dsts, const I64& items, int64_t warps) {
  using namespace real_py::pack_detail;
  if (srcs.empty() || dsts.empty() || srcs.size() > real_py::kMaxBufs || dsts.size() > real_py::kMaxBufs) {
    throw std::invalid_argument("copy_twin: 1 to 64 source and destination buffers");
  }
  if (items.ndim() != 2 || items.shape(1) != 6) throw std::invalid_argument("copy_twin: items must be [m, 6]");
  if (warps < 1) throw std::invalid_argument("copy_twin: warps must be >= 1");
  const auto* it = reinterpret_cast<const real_py::CopyItem*>(items.data());
  const int64_t m = items.shape(0);
  for (int64_t i = 0; i < m; ++i) {  // bounds, so a bad table cannot write outside the buffers
    const auto& c = it[i];
    const bool ok = c.src_buf >= 0 && c.dst_buf >= 0 && static_cast<size_t>(c.src_buf) < srcs.size() &&
                    static_cast<size_t>(c.dst_buf) < dsts.size() && c.count >= 1 && c.bytes >= 1 &&
                    c.src + (c.count - 1) * c.src_stride + c.bytes <= srcs[c.src_buf].size() &&
                    c.dst + (c.count - 1) * c.dst_stride + c.bytes <= dsts[c.dst_buf].size();
    if (!ok) throw std::invalid_argument("copy_twin: item " + std::to_string(i) + " is outside its buffers");
  }
  BufTable t{};
  for (size_t i = 0; i < srcs.size(); ++i) t.src[i] = reinterpret_cast<const char*>(srcs[i].data());
  for (size_t i = 0; i < dsts.size(); ++i) t.dst[i] = reinterpret_cast<char*>(dsts[i].mutable_data());
  for (int64_t w = 0; w < warps; ++w) {
    for (int lane = 0; lane < 32; ++lane) warp_copy_items(it, m, t, w, warps, lane);
  }
}

}  // namespace

void bind_ops(py::module_& m) {
  m.def("copy_plan", &copy_plan, py::arg("descs"), py::arg("elem_size"), py::arg("item_bytes") = 0,
        "Work items of a copy plan: (items [m, 6], bounds [2, 64], bytes); see csrc/ops/bind_ops.cpp");
  m.def("copy_twin", &copy_twin, py::arg("srcs"), py::arg("dsts"), py::arg("items"), py::arg("warps"),
        "The CUDA copy kernel's lane code run on the host (tests)");
}
