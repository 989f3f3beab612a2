// Python bindings for the torch-free C++ core (planner, search). Ops are registered separately
// with TORCH_LIBRARY in csrc/ops/; this file only needs pybind11 and numpy, so it compiles in
// seconds. Arrays cross the boundary as int64 numpy arrays (zero-copy on the way out).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "planner/planner.h"
#include "planner/replay.h"
#include "planner/rank_schedule.h"

void bind_search(pybind11::module_& m);  // csrc/search/bind_search.cpp
void bind_ops(pybind11::module_& m);     // csrc/ops/bind_ops.cpp

namespace py = pybind11;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

namespace {

std::vector<int64_t> to_vec(const I64& a) { return {a.data(), a.data() + a.size()}; }

// Hands a vector's storage to numpy without copying.
template <typename T>
py::array own(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  py::capsule free_when_done(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array(py::dtype::of<int64_t>(), shape, reinterpret_cast<int64_t*>(heap->data()),
                   free_when_done);
}

py::array own1(std::vector<int64_t>&& v) {
  const auto n = static_cast<py::ssize_t>(v.size());
  return own(std::move(v), {n});
}

real_py::LayoutIn layout_from(const py::dict& d) {
  real_py::LayoutIn l;
  l.dp = d["dp"].cast<int64_t>();
  l.tp = d["tp"].cast<int64_t>();
  l.pp = d["pp"].cast<int64_t>();
  l.grid = to_vec(d["grid"].cast<I64>());
  l.entry_param = to_vec(d["entry_param"].cast<I64>());
  l.entry_stage = to_vec(d["entry_stage"].cast<I64>());
  l.entry_offset = to_vec(d["entry_offset"].cast<I64>());
  if (d.contains("entry_range")) l.entry_range = to_vec(d["entry_range"].cast<I64>());
  if (d.contains("param_groups")) l.param_groups = to_vec(d["param_groups"].cast<I64>());
  if (d.contains("param_vocab_multiple"))
    l.param_vocab_multiple = to_vec(d["param_vocab_multiple"].cast<I64>());
  if (d.contains("param_replicate_units"))
    l.param_replicate_units = to_vec(d["param_replicate_units"].cast<I64>());
  return l;
}

// geom: [P, 4] int64 (A, D, B, kind); block_ptr: [P + 1]; blocks: [block_ptr[P]] sizes, or
// [block_ptr[P], 2] (size, unit count) rows (the unit counts a replicate_units format reads).
std::vector<real_py::ParamGeom> params_from(const I64& geom, const I64& block_ptr, const I64& blocks) {
  if (geom.ndim() != 2 || geom.shape(1) != 4) throw std::invalid_argument("geom must be [P, 4]");
  const auto P = geom.shape(0);
  if (block_ptr.size() != P + 1) throw std::invalid_argument("block_ptr must be [P + 1]");
  const bool with_units = blocks.ndim() == 2;
  if (with_units ? blocks.shape(1) != 2 : blocks.ndim() != 1)
    throw std::invalid_argument("blocks must be [num_blocks] or [num_blocks, 2]");
  const int64_t num_blocks = blocks.shape(0);
  std::vector<real_py::ParamGeom> params(P);
  const int64_t* g = geom.data();
  const int64_t* ptr = block_ptr.data();
  const int64_t* b = blocks.data();
  for (py::ssize_t i = 0; i < P; ++i) {
    auto& p = params[i];
    p.A = g[4 * i];
    p.D = g[4 * i + 1];
    p.B = g[4 * i + 2];
    p.kind = static_cast<real_py::TPKind>(g[4 * i + 3]);
    if (ptr[i] < 0 || ptr[i] > ptr[i + 1] || ptr[i + 1] > num_blocks)
      throw std::invalid_argument("block_ptr must rise from 0 to the number of blocks");
    for (int64_t j = ptr[i]; j < ptr[i + 1]; ++j) {
      p.blocks.push_back(with_units ? b[2 * j] : b[j]);
      if (with_units) p.units.push_back(b[2 * j + 1]);
    }
  }
  return params;
}

real_py::PlanOptions options_from(int mode, int64_t ranks_per_node, int64_t min_split_elems) {
  real_py::PlanOptions opt;
  opt.mode = static_cast<real_py::Mode>(mode);
  opt.ranks_per_node = ranks_per_node;
  opt.min_split_elems = min_split_elems;
  return opt;
}

py::array own_descs(std::vector<real_py::Desc>&& v) {
  const auto n = static_cast<py::ssize_t>(v.size());
  return own(std::move(v), {n, 6});
}

py::dict plan(const I64& geom, const I64& block_ptr, const I64& blocks, const py::dict& src,
              const py::dict& dst, int mode, int64_t ranks_per_node, int64_t min_split_elems) {
  const auto params = params_from(geom, block_ptr, blocks);
  const auto opt = options_from(mode, ranks_per_node, min_split_elems);
  // The layouts are read from Python dicts, so with the GIL held; only the planner runs without.
  const auto src_l = layout_from(src), dst_l = layout_from(dst);
  real_py::Plan pl;
  {
    py::gil_scoped_release release;
    pl = real_py::make_plan(params, src_l, dst_l, opt);
  }
  const auto nd = static_cast<py::ssize_t>(pl.descs.size());
  py::dict out;
  out["descs"] = own(std::move(pl.descs), {nd, 6});
  out["msg_sender"] = own1(std::move(pl.msg_sender));
  out["msg_recv_ptr"] = own1(std::move(pl.msg_recv_ptr));
  out["msg_receivers"] = own1(std::move(pl.msg_receivers));
  out["msg_desc_ptr"] = own1(std::move(pl.msg_desc_ptr));
  out["msg_numel"] = own1(std::move(pl.msg_numel));
  out["local_rank"] = own1(std::move(pl.local_rank));
  out["local_desc_ptr"] = own1(std::move(pl.local_desc_ptr));
  out["local_numel"] = own1(std::move(pl.local_numel));
  return out;
}

// One rank's plan and schedule (planner/rank_schedule.h): no other rank's descriptors.
py::dict plan_rank(const I64& geom, const I64& block_ptr, const I64& blocks, const py::dict& src,
                   const py::dict& dst, int mode, int64_t ranks_per_node, int64_t min_split_elems,
                   int64_t rank, int64_t round_elems, int64_t direct_min_elems) {
  const auto params = params_from(geom, block_ptr, blocks);
  const auto opt = options_from(mode, ranks_per_node, min_split_elems);
  real_py::ScheduleOptions sopt;
  sopt.round_elems = round_elems;
  sopt.direct_min_elems = direct_min_elems;
  const auto src_l = layout_from(src), dst_l = layout_from(dst);
  real_py::RankSchedule rs;
  {
    py::gil_scoped_release release;
    rs = real_py::make_rank_schedule(params, src_l, dst_l, opt, rank, sopt);
  }
  py::dict out;
  out["num_rounds"] = rs.num_rounds;
  out["summary_count"] = rs.summary_count;
  out["held_bytes"] = rs.held_bytes;
  out["msg_sender"] = own1(std::move(rs.msg_sender));
  out["msg_recv_ptr"] = own1(std::move(rs.msg_recv_ptr));
  out["msg_receivers"] = own1(std::move(rs.msg_receivers));
  out["msg_numel"] = own1(std::move(rs.msg_numel));
  out["local"] = own_descs(std::move(rs.local));
  out["all_msg"] = own1(std::move(rs.all_msg));
  out["all_round"] = own1(std::move(rs.all_round));
  out["all_numel"] = own1(std::move(rs.all_numel));
  out["chunk_msg"] = own1(std::move(rs.chunk_msg));
  out["chunk_round"] = own1(std::move(rs.chunk_round));
  out["chunk_side"] = own1(std::move(rs.chunk_side));
  out["chunk_numel"] = own1(std::move(rs.chunk_numel));
  out["chunk_slot"] = own1(std::move(rs.chunk_slot));
  out["chunk_desc_ptr"] = own1(std::move(rs.chunk_desc_ptr));
  out["chunk_descs"] = own_descs(std::move(rs.chunk_descs));
  out["round_index"] = own1(std::move(rs.round_index));
  out["round_chunk_ptr"] = own1(std::move(rs.round_chunk_ptr));
  out["round_pack_ptr"] = own1(std::move(rs.round_pack_ptr));
  out["round_unpack_ptr"] = own1(std::move(rs.round_unpack_ptr));
  out["round_staging"] = own1(std::move(rs.round_staging));
  out["pack_descs"] = own_descs(std::move(rs.pack_descs));
  out["unpack_descs"] = own_descs(std::move(rs.unpack_descs));
  return out;
}

using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

double replay_rounds(const I64& u, const I64& v, const I64& l1, const I64& l2, const F64& nbytes,
                     const I64& bounds, const F64& bw, int64_t num_ranks, double latency_s) {
  const auto n = u.size();
  if (v.size() != n || l1.size() != n || l2.size() != n || nbytes.size() != n)
    throw std::invalid_argument("replay_rounds: u, v, l1, l2 and nbytes must have one entry per hop");
  if (bounds.size() < 1 || bounds.data()[0] != 0 || bounds.data()[bounds.size() - 1] != n)
    throw std::invalid_argument("replay_rounds: bounds must run from 0 to the number of hops");
  // Checked before any hop is read: a decreasing pair would index past the arrays.
  for (py::ssize_t k = 0; k + 1 < bounds.size(); ++k)
    if (bounds.data()[k] > bounds.data()[k + 1])
      throw std::invalid_argument("replay_rounds: bounds must not decrease (round " +
                                  std::to_string(k) + ")");
  if (num_ranks < 0) throw std::invalid_argument("replay_rounds: num_ranks must be >= 0");
  py::gil_scoped_release release;
  return real_py::replay_rounds(u.data(), v.data(), l1.data(), l2.data(), nbytes.data(),
                                bounds.data(), bounds.size() - 1, bw.data(), bw.size(), num_ranks,
                                latency_s);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "real_py C++ core: exact transfer planner (and search)";
  static_assert(sizeof(real_py::Desc) == 6 * sizeof(int64_t), "Desc must be six packed int64");
  m.def("plan", &plan, py::arg("geom"), py::arg("block_ptr"), py::arg("blocks"), py::arg("src"),
        py::arg("dst"), py::arg("mode"), py::arg("ranks_per_node"), py::arg("min_split_elems"),
        "Exact transfer plan between two layouts; returns a dict of int64 arrays.");
  m.def("plan_rank", &plan_rank, py::arg("geom"), py::arg("block_ptr"), py::arg("blocks"),
        py::arg("src"), py::arg("dst"), py::arg("mode"), py::arg("ranks_per_node"),
        py::arg("min_split_elems"), py::arg("rank"), py::arg("round_elems"),
        py::arg("direct_min_elems"),
        "One rank's plan and bucket schedule (its chunks, rounds, pack/unpack descriptors, local "
        "copies) plus the global message table; no other rank's descriptors are built.");
  m.def("replay_rounds", &replay_rounds, py::arg("u"), py::arg("v"), py::arg("l1"), py::arg("l2"),
        py::arg("nbytes"), py::arg("bounds"), py::arg("bw"), py::arg("num_ranks"),
        py::arg("latency_s"),
        "Round-by-round replay of a schedule's hops on a link model (realloc/simulate.py); "
        "returns the seconds until the last rank is done.");
  bind_search(m);
  bind_ops(m);
}
