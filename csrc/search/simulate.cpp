// Fixed-order list scheduler over `iters` PPO iterations; mirrors real_py/search/simulate.py.
//
// Per iteration, tasks are placed in this order: the reallocation of every call whose layout
// differs from its weights' training layout (in call order), then every call in call order.
// A task starts when its inputs are ready and all of its devices are free, then holds them
// until it ends. Memory: per device, the persistent bytes of every option on it plus the
// largest transient bytes of any call on it must fit mem_limit.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "search/search.h"

namespace real_py::search {

Evaluator::Evaluator(Graph g, ReallocFn realloc) : g_(std::move(g)), realloc_(std::move(realloc)) {
  const auto n = g_.options.size();
  if (g_.weight_src.size() != n || g_.deps.size() != n || g_.dep_bytes.size() != n)
    throw std::invalid_argument("graph: weight_src, deps and dep_bytes need one entry per call");
  for (size_t c = 0; c < n; ++c) {
    if (g_.options[c].empty()) throw std::invalid_argument("graph: call " + std::to_string(c) + " has no options");
    if (g_.deps[c].size() != g_.dep_bytes[c].size()) throw std::invalid_argument("graph: deps/dep_bytes size mismatch");
    for (int d : g_.deps[c])
      if (d < 0 || static_cast<size_t>(d) >= c) throw std::invalid_argument("graph: deps must point to earlier calls");
    const int w = g_.weight_src[c];
    if (w >= static_cast<int>(n)) throw std::invalid_argument("graph: weight_src out of range");
    for (const auto& o : g_.options[c])
      if (o.start < 0 || o.size < 1 || o.start + o.size > g_.num_gpus)
        throw std::invalid_argument("graph: option mesh outside the cluster");
  }
  if (g_.iters < 1) throw std::invalid_argument("graph: iters must be >= 1");
  cache_.resize(n);
  gpu_free_.resize(g_.num_gpus);
  persist_.resize(g_.num_gpus);
  transient_.resize(g_.num_gpus);
}

bool Evaluator::same_layout(int ca, int oa, int cb, int ob) const {
  const Option& a = g_.options[ca][oa];
  const Option& b = g_.options[cb][ob];
  return a.start == b.start && a.size == b.size && a.dp == b.dp && a.tp == b.tp && a.pp == b.pp;
}

double Evaluator::realloc_time(int call, int src, int dst) {
  const int64_t key = (static_cast<int64_t>(src) << 32) | static_cast<int64_t>(dst);
  auto& cache = cache_[call];
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  ++realloc_misses_;
  const double t = realloc_(call, src, dst);
  cache.emplace(key, t);
  return t;
}

double Evaluator::transfer_time(const Option& a, const Option& b, double bytes) const {
  if (a.start == b.start && a.size == b.size) return 0.0;
  const int64_t rpn = g_.ranks_per_node;
  const int64_t lo = std::min(a.start, b.start);
  const int64_t hi = std::max(a.start + a.size, b.start + b.size) - 1;
  const bool one_node = lo / rpn == hi / rpn;
  const double bw = one_node ? g_.intra_bw : g_.inter_bw;
  const double lat = one_node ? g_.intra_lat : g_.inter_lat;
  return lat + bytes / (bw * static_cast<double>(std::min(a.size, b.size)));
}

SimResult Evaluator::simulate(const std::vector<int>& plan, bool keep_tasks, bool bound) {
  const int n = static_cast<int>(g_.options.size());
  if (static_cast<int>(plan.size()) != n) throw std::invalid_argument("plan needs one option per call");
  for (int c = 0; c < n; ++c)
    if (plan[c] < 0 || plan[c] >= static_cast<int>(g_.options[c].size()))
      throw std::invalid_argument("plan: option index out of range for call " + std::to_string(c));
  SimResult res;
  std::vector<char> copy(n, 0);
  for (int c = 0; c < n; ++c) {
    const int w = g_.weight_src[c];
    copy[c] = w >= 0 && !same_layout(w, plan[w], c, plan[c]);
  }
  std::fill(persist_.begin(), persist_.end(), 0.0);
  std::fill(transient_.begin(), transient_.end(), 0.0);
  for (int c = 0; c < n; ++c) {
    const Option& o = g_.options[c][plan[c]];
    const double tr = o.transient + (copy[c] ? o.weights : 0.0);
    for (int64_t r = o.start; r < o.start + o.size; ++r) {
      persist_[r] += o.persist;
      transient_[r] = std::max(transient_[r], tr);
    }
  }
  for (int64_t r = 0; r < g_.num_gpus; ++r) res.peak_mem = std::max(res.peak_mem, persist_[r] + transient_[r]);
  if (res.peak_mem > g_.mem_limit) {
    res.iter_time = res.makespan = std::numeric_limits<double>::infinity();
    res.infeasible = "memory";
    return res;
  }
  std::fill(gpu_free_.begin(), gpu_free_.end(), 0.0);
  std::vector<double> prev_end(n, 0.0), end(n, 0.0), rend(n, 0.0);
  auto occupy = [&](const Option& o, double t) {
    for (int64_t r = o.start; r < o.start + o.size; ++r) t = std::max(t, gpu_free_[r]);
    return t;
  };
  auto release = [&](const Option& o, double t) {
    for (int64_t r = o.start; r < o.start + o.size; ++r) gpu_free_[r] = t;
  };
  for (int k = 0; k < g_.iters; ++k) {
    for (int c = 0; c < n; ++c) {
      if (!copy[c]) continue;
      const int w = g_.weight_src[c];
      const Option& src = g_.options[w][plan[w]];
      const Option& dst = g_.options[c][plan[c]];
      const double start = occupy(dst, occupy(src, prev_end[w]));
      double dur;
      if (bound) {
        auto it = cache_[c].find((static_cast<int64_t>(plan[w]) << 32) | static_cast<int64_t>(plan[c]));
        dur = it == cache_[c].end() ? 0.0 : it->second;
      } else {
        dur = realloc_time(c, plan[w], plan[c]);
      }
      rend[c] = start + dur;
      release(src, rend[c]);
      release(dst, rend[c]);
      if (keep_tasks) res.tasks.push_back({c, k, true, start, rend[c]});
    }
    for (int c = 0; c < n; ++c) {
      const Option& o = g_.options[c][plan[c]];
      const int w = g_.weight_src[c];
      double ready = copy[c] ? rend[c] : (w >= 0 ? prev_end[w] : 0.0);
      for (size_t i = 0; i < g_.deps[c].size(); ++i) {
        const int d = g_.deps[c][i];
        ready = std::max(ready, end[d] + transfer_time(g_.options[d][plan[d]], o, g_.dep_bytes[c][i]));
      }
      const double start = occupy(o, ready);
      end[c] = start + o.time;
      release(o, end[c]);
      res.makespan = std::max(res.makespan, end[c]);
      if (keep_tasks) res.tasks.push_back({c, k, false, start, end[c]});
    }
    prev_end = end;
  }
  res.iter_time = res.makespan / g_.iters;
  return res;
}

}  // namespace real_py::search
