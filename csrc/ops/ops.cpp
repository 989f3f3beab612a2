// The one op library of real_py: schemas only. Backends register kernels with
// TORCH_LIBRARY_IMPL in copy_cpu.cpp (CPU) and copy_cuda.cpp (CUDA); the fake (meta) kernels
// live in real_py/ops.py. Only one TORCH_LIBRARY(real_py, ...) block may exist per process.
//
// All three ops are strided byte copies, destination-passing, returning ():
//   pack(src, descs, out):      src [S] flat buffer -> out [P] packed buffer
//   unpack(packed, descs, dst): packed [P] -> dst [D] flat buffer (also local flat -> flat copies)
//     descs: [k, 6] int64 on the CPU, in elements of the buffers' dtype:
//            (src_off, dst_off, len, n, src_stride, dst_stride); run i copies
//            src[src_off + i*src_stride : +len] -> dst[dst_off + i*dst_stride : +len].
//   copy_planned(srcs, dsts, items, bounds): a compiled plan (real_py.ops.CopyPlan) over up to 64
//     source and 64 destination buffers in one call (one kernel launch on a GPU); items [m, 6]
//     int64 CopyItem rows (copy_items.h) on the buffers' device, built once per plan by
//     _C.copy_plan; bounds [2, 64] int64 CPU, the bytes each buffer must hold.
#include <ATen/ATen.h>
#include <torch/library.h>

TORCH_LIBRARY(real_py, m) {
  m.def("pack(Tensor src, Tensor descs, Tensor(a!) out) -> ()");
  m.def("unpack(Tensor packed, Tensor descs, Tensor(a!) dst) -> ()");
  m.def("copy_planned(Tensor[] srcs, Tensor(a!)[] dsts, Tensor items, Tensor bounds) -> ()");
}
