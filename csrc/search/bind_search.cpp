// pybind11 bindings of the plan search (pybind11 + numpy headers only).
//
// SearchEvaluator(graph: dict, realloc: callable(call, src_opt, dst_opt) -> seconds)
//   graph["options"]: per call a float64 array [num_options, 9] with columns
//     (start, size, dp, tp, pp, time_s, persist_bytes, transient_bytes, weights_bytes)
//   graph["weight_src"], ["deps"], ["dep_bytes"], ["num_gpus"], ["ranks_per_node"],
//   ["intra_bw"], ["inter_bw"], ["intra_lat"], ["inter_lat"], ["mem_limit"], ["iters"];
//   optional ["staleness"] (async RL bound, default 0), ["trains"] (per call: a train call),
//   ["shared_cores"] and ["busy"] (per call a float64 array [num_options, 2]: busy and working
//   ranks of each option, see Option).
// The GIL stays held: the reallocation callback runs Python (cached per option pair).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "search/search.h"

namespace py = pybind11;
namespace rs = real_py::search;
using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

namespace {

rs::Graph graph_from(const py::dict& d) {
  rs::Graph g;
  g.num_gpus = d["num_gpus"].cast<int64_t>();
  g.ranks_per_node = d["ranks_per_node"].cast<int64_t>();
  for (auto item : d["options"].cast<py::list>()) {
    F64 a = item.cast<F64>();
    if (a.ndim() != 2 || a.shape(1) != 9) throw std::invalid_argument("options must be [k, 9] float64");
    std::vector<rs::Option> opts(a.shape(0));
    const double* p = a.data();
    for (py::ssize_t i = 0; i < a.shape(0); ++i, p += 9) {
      auto& o = opts[i];
      o.start = static_cast<int64_t>(p[0]);
      o.size = static_cast<int64_t>(p[1]);
      o.dp = static_cast<int64_t>(p[2]);
      o.tp = static_cast<int64_t>(p[3]);
      o.pp = static_cast<int64_t>(p[4]);
      o.time = p[5];
      o.persist = p[6];
      o.transient = p[7];
      o.weights = p[8];
    }
    g.options.push_back(std::move(opts));
  }
  g.weight_src = d["weight_src"].cast<std::vector<int>>();
  g.deps = d["deps"].cast<std::vector<std::vector<int>>>();
  g.dep_bytes = d["dep_bytes"].cast<std::vector<std::vector<double>>>();
  g.intra_bw = d["intra_bw"].cast<double>();
  g.inter_bw = d["inter_bw"].cast<double>();
  g.intra_lat = d["intra_lat"].cast<double>();
  g.inter_lat = d["inter_lat"].cast<double>();
  g.mem_limit = d["mem_limit"].cast<double>();
  g.iters = d["iters"].cast<int>();
  if (d.contains("staleness")) g.staleness = d["staleness"].cast<int>();
  if (d.contains("shared_cores")) g.shared_cores = d["shared_cores"].cast<double>();
  if (d.contains("busy")) {
    py::list items = d["busy"].cast<py::list>();
    if (items.size() != g.options.size()) throw std::invalid_argument("graph: busy needs one array per call");
    for (size_t c = 0; c < g.options.size(); ++c) {
      F64 a = items[c].cast<F64>();
      if (a.ndim() != 2 || a.shape(1) != 2 || static_cast<size_t>(a.shape(0)) != g.options[c].size())
        throw std::invalid_argument("graph: busy[" + std::to_string(c) + "] must be [num_options, 2] float64");
      for (size_t i = 0; i < g.options[c].size(); ++i) {
        g.options[c][i].busy = a.data()[2 * i];
        g.options[c][i].working = a.data()[2 * i + 1];
      }
    }
  }
  if (d.contains("trains")) {
    for (bool t : d["trains"].cast<std::vector<bool>>()) g.trains.push_back(t ? 1 : 0);
    if (g.trains.size() != g.options.size()) throw std::invalid_argument("graph: trains needs one entry per call");
  }
  return g;
}

py::dict sim_dict(const rs::SimResult& r) {
  py::dict out;
  out["iter_time"] = r.iter_time;
  out["makespan"] = r.makespan;
  out["peak_mem"] = r.peak_mem;
  out["infeasible"] = r.infeasible;
  py::list tasks;
  for (const auto& t : r.tasks) tasks.append(py::make_tuple(t.call, t.iter, t.realloc, t.start, t.end));
  out["tasks"] = tasks;
  return out;
}

}  // namespace

void bind_search(py::module_& m) {
  py::class_<rs::Evaluator>(m, "SearchEvaluator")
      .def(py::init([](const py::dict& graph, py::function realloc) {
             rs::ReallocFn fn = [realloc](int call, int src, int dst) {
               return realloc(call, src, dst).cast<double>();
             };
             return new rs::Evaluator(graph_from(graph), fn);
           }),
           py::arg("graph"), py::arg("realloc"))
      .def("simulate",
           [](rs::Evaluator& ev, const std::vector<int>& plan, bool keep_tasks) {
             return sim_dict(ev.simulate(plan, keep_tasks));
           },
           py::arg("plan"), py::arg("keep_tasks") = false,
           "Iteration time (seconds), makespan, peak memory and optionally the task list.")
      .def("cost", &rs::Evaluator::cost, py::arg("plan"))
      .def_property_readonly("realloc_calls", &rs::Evaluator::realloc_calls)
      .def("anneal",
           [](rs::Evaluator& ev, int chains, double time_budget, int64_t max_steps, double t_start,
              double t_end, uint64_t seed, const std::vector<std::vector<int>>& init,
              int64_t restart_steps) {
             if (chains < 1) throw std::invalid_argument("chains must be >= 1");
             if (!(time_budget > 0)) throw std::invalid_argument("time_budget must be > 0 seconds");
             if (!(t_start > 0 && t_end > 0)) throw std::invalid_argument("temperatures must be > 0");
             rs::AnnealConfig cfg;
             cfg.chains = chains;
             cfg.time_budget = time_budget;
             cfg.max_steps = max_steps;
             cfg.t_start = t_start;
             cfg.t_end = t_end;
             cfg.seed = seed;
             cfg.init = init;
             cfg.restart_steps = restart_steps;
             const rs::AnnealResult r = rs::anneal(ev, cfg);
             py::dict out;
             out["best"] = r.best;
             out["best_cost"] = r.best_cost;
             out["seconds"] = r.seconds;
             out["realloc_calls"] = r.realloc_calls;
             py::list chains_out;
             for (const auto& c : r.chains) {
               py::dict d;
               d["steps"] = c.steps;
               d["accepted"] = c.accepted;
               d["improved"] = c.improved;
               d["infeasible"] = c.infeasible;
               d["restarts"] = c.restarts;
               d["init_cost"] = c.init_cost;
               d["final_cost"] = c.final_cost;
               d["best_cost"] = c.best_cost;
               chains_out.append(d);
             }
             out["chains"] = chains_out;
             return out;
           },
           py::arg("chains") = 4, py::arg("time_budget") = 10.0, py::arg("max_steps") = 0,
           py::arg("t_start") = 0.1, py::arg("t_end") = 0.001, py::arg("seed") = 0,
           py::arg("init") = std::vector<std::vector<int>>{}, py::arg("restart_steps") = 0,
           "Simulated annealing; returns the best plan (option per call) and per-chain statistics.");
}
