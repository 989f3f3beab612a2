// Argument checks shared by every pack/unpack backend. All user errors raise ValueError
// (TORCH_CHECK_VALUE) naming the argument and the values, and all of them run before any byte is
// written, so a rejected call leaves the destination untouched.
//
//   src, dst: 1-D contiguous, same dtype, same device (of the backend's device type), disjoint
//   descs:    [k, 6] int64 CPU contiguous, elements: (src_off, dst_off, len, n, src_stride,
//             dst_stride); every value >= 0, every run inside its buffer; len == 0 or n == 0
//             copies nothing; runs of one descriptor may overlap in src (src_stride < len) but
//             not in dst (n > 1 needs dst_stride >= len: overlapping writes would race).
//
// copy_planned (a compiled CopyPlan, real_py/ops.py): the descriptors were checked when the plan
// was built (bind_ops.cpp); a call checks the buffers against the plan's bounds (bytes each
// buffer must hold), their devices and layouts, and that no source overlaps a destination.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/copy_items.h"

namespace real_py {

// src_name/dst_name: the op's argument names, e.g. "src"/"out" for pack, "packed"/"dst" for unpack.
inline void check_copy_args(const char* op, const at::Tensor& src, const char* src_name,
                            const at::Tensor& descs, const at::Tensor& dst, const char* dst_name,
                            c10::DeviceType device_type) {
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{src, src_name},
                                std::pair<const at::Tensor&, const char*>{dst, dst_name}}) {
    TORCH_CHECK_VALUE(t.device().type() == device_type, op, ": ", name, " is on ", t.device(),
                      " but this kernel runs on ", c10::DeviceTypeName(device_type),
                      "; put src and dst buffers on the same device");
    TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be a 1-D flat buffer, got shape ",
                      t.sizes());
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous, got stride ",
                      t.strides(), " (pass a flat buffer, not a strided view)");
  }
  TORCH_CHECK_VALUE(src.device() == dst.device(), op, ": ", src_name, " is on ", src.device(),
                    " and ", dst_name, " on ", dst.device(), "; both must be on one device");
  TORCH_CHECK_VALUE(src.scalar_type() == dst.scalar_type(), op, ": dtype mismatch, ", src_name,
                    " is ", src.scalar_type(), " and ", dst_name, " is ", dst.scalar_type(),
                    " (descriptors count elements of one dtype; cast first)");
  TORCH_CHECK_VALUE(descs.device().is_cpu(), op, ": descs must be a CPU tensor, got device ",
                    descs.device());
  TORCH_CHECK_VALUE(descs.scalar_type() == at::kLong, op, ": descs must be int64, got ",
                    descs.scalar_type());
  TORCH_CHECK_VALUE(descs.dim() == 2 && descs.size(1) == 6, op,
                    ": descs must be [k, 6] (src_off, dst_off, len, n, src_stride, dst_stride), "
                    "got shape ", descs.sizes());
  TORCH_CHECK_VALUE(descs.is_contiguous(), op, ": descs must be contiguous, got stride ",
                    descs.strides());
  const auto es = static_cast<int64_t>(src.element_size());
  const auto* s0 = static_cast<const char*>(src.const_data_ptr());
  const auto* d0 = static_cast<const char*>(dst.const_data_ptr());
  const bool disjoint = src.numel() == 0 || dst.numel() == 0 || s0 + src.numel() * es <= d0 ||
                        d0 + dst.numel() * es <= s0;
  TORCH_CHECK_VALUE(disjoint, op, ": ", src_name, " and ", dst_name,
                    " share memory; the copy needs two separate buffers");

  const int64_t k = descs.size(0);
  const int64_t* d = descs.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i, d += 6) {
    const int64_t so = d[0], doff = d[1], len = d[2], n = d[3], ss = d[4], ds = d[5];
    TORCH_CHECK_VALUE(so >= 0 && doff >= 0 && len >= 0 && n >= 0 && ss >= 0 && ds >= 0, op,
                      ": descriptor ", i, " (src_off=", so, ", dst_off=", doff, ", len=", len,
                      ", n=", n, ", src_stride=", ss, ", dst_stride=", ds,
                      ") has a negative value");
    if (len == 0 || n == 0) continue;
    // off + (n-1)*stride + len <= numel, written so that it cannot overflow int64.
    for (const auto& [off, stride, numel, name] :
         {std::tuple<int64_t, int64_t, int64_t, const char*>{so, ss, src.numel(), src_name},
          std::tuple<int64_t, int64_t, int64_t, const char*>{doff, ds, dst.numel(), dst_name}}) {
      const bool fits = off <= numel && len <= numel - off &&
                        (n == 1 || stride == 0 || (n - 1) <= (numel - off - len) / stride);
      TORCH_CHECK_VALUE(fits, op, ": descriptor ", i, " (src_off=", so, ", dst_off=", doff,
                        ", len=", len, ", n=", n, ", src_stride=", ss, ", dst_stride=", ds,
                        ") reaches past the end of ", name, " (numel ", numel, ")");
    }
    TORCH_CHECK_VALUE(n == 1 || ds >= len, op, ": descriptor ", i, " (len=", len, ", n=", n,
                      ", dst_stride=", ds, ") writes overlapping runs; dst_stride must be >= len");
  }
}

// pack/unpack's [k, 6] element descriptors (checked above) -> [k, kDescCols] byte rows on buffers
// (0, 0), empty ones dropped.
inline std::vector<int64_t> byte_rows(const at::Tensor& descs, int64_t es) {
  const int64_t k = descs.size(0);
  const int64_t* d = descs.const_data_ptr<int64_t>();
  std::vector<int64_t> out;
  out.reserve(kDescCols * k);
  for (int64_t i = 0; i < k; ++i, d += 6) {
    if (d[2] == 0 || d[3] == 0) continue;
    out.insert(out.end(), {d[0] * es, d[1] * es, d[2] * es, d[3], d[4] * es, d[5] * es, 0, 0});
  }
  return out;
}

inline int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// items: [m, 6] int64 (CopyItem rows) on `item_device`; bounds: [2, kMaxBufs] int64 CPU, the
// bytes each source (row 0) and destination (row 1) buffer must hold.
inline void check_planned_args(at::TensorList srcs, at::TensorList dsts, const at::Tensor& items,
                               const at::Tensor& bounds, c10::DeviceType device_type) {
  const char* op = "copy_planned";
  TORCH_CHECK_VALUE(!srcs.empty() && !dsts.empty() && static_cast<int64_t>(srcs.size()) <= kMaxBufs &&
                        static_cast<int64_t>(dsts.size()) <= kMaxBufs,
                    op, ": needs 1 to ", kMaxBufs, " source and destination buffers, got ", srcs.size(),
                    " and ", dsts.size());
  TORCH_CHECK_VALUE(bounds.device().is_cpu() && bounds.scalar_type() == at::kLong && bounds.dim() == 2 &&
                        bounds.size(0) == 2 && bounds.size(1) == kMaxBufs && bounds.is_contiguous(),
                    op, ": bounds must be a contiguous CPU int64 [2, ", kMaxBufs, "] tensor, got ",
                    bounds.sizes(), " ", bounds.scalar_type(), " on ", bounds.device());
  TORCH_CHECK_VALUE(items.scalar_type() == at::kLong && items.dim() == 2 && items.size(1) == 6 &&
                        items.is_contiguous(),
                    op, ": items must be a contiguous int64 [m, 6] tensor (CopyItem rows), got ",
                    items.sizes(), " ", items.scalar_type());
  const int64_t* b = bounds.const_data_ptr<int64_t>();
  // Destinations and items on one device. On a GPU a source may sit on another GPU of the node
  // (a peer's buffer mapped through CUDA IPC): the kernel, launched on the destinations' device,
  // reads it over NVLink / PCIe once peer access is enabled (copy_cuda.cpp).
  const c10::Device device = dsts[0].device();
  const bool cuda = device_type == c10::DeviceType::CUDA;
  for (int side = 0; side < 2; ++side) {
    at::TensorList bufs = side == 0 ? srcs : dsts;
    const char* name = side == 0 ? "source" : "destination";
    for (int64_t i = static_cast<int64_t>(bufs.size()); i < kMaxBufs; ++i) {
      TORCH_CHECK_VALUE(b[side * kMaxBufs + i] == 0, op, ": the plan addresses ", name, " buffer ", i,
                        " but only ", bufs.size(), " were passed");
    }
    for (size_t i = 0; i < bufs.size(); ++i) {
      const at::Tensor& t = bufs[i];
      TORCH_CHECK_VALUE(t.device().type() == device_type && (t.device() == device || (cuda && side == 0)), op,
                        ": ", name, " buffer ", i, " is on ", t.device(), ", expected ", device,
                        " (destinations and items of one call on one device)");
      TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), op, ": ", name, " buffer ", i,
                        " must be a 1-D contiguous flat buffer, got shape ", t.sizes());
      TORCH_CHECK_VALUE(nbytes(t) >= b[side * kMaxBufs + i], op, ": ", name, " buffer ", i, " holds ",
                        nbytes(t), " bytes, the plan reaches byte ", b[side * kMaxBufs + i]);
    }
  }
  const bool items_ok = device_type == c10::DeviceType::CPU ? items.device().is_cpu() : items.device() == device;
  TORCH_CHECK_VALUE(items_ok, op, ": items are on ", items.device(), ", the buffers on ", device,
                    " (build the CopyPlan on the destinations' device)");
  for (size_t i = 0; i < srcs.size(); ++i) {
    const auto* s0 = static_cast<const char*>(srcs[i].const_data_ptr());
    for (size_t j = 0; j < dsts.size(); ++j) {
      const auto* d0 = static_cast<const char*>(dsts[j].const_data_ptr());
      const bool disjoint = nbytes(srcs[i]) == 0 || nbytes(dsts[j]) == 0 || s0 + nbytes(srcs[i]) <= d0 ||
                            d0 + nbytes(dsts[j]) <= s0;
      TORCH_CHECK_VALUE(disjoint, op, ": source buffer ", i, " and destination buffer ", j,
                        " share memory; the copy needs separate buffers");
    }
  }
}

}  // namespace real_py
