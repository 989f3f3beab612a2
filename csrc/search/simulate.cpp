// Fixed-order list scheduler over `iters` PPO iterations; mirrors real_py/search/simulate.py
// (which keeps per-device state; here devices are grouped into segments, same results).
//
// Per iteration, tasks are placed in this order: the reallocation of every call whose layout
// differs from its weights' training layout (in call order), then every call in call order.
// With staleness k > 0 (asynchronous RL) a prologue places the rollout calls of batches
// 0 .. k-1 with the initial weights, then step s places the rollout calls of batch s + k (with
// the weights trained by step s - 1) before the train calls of batch s.
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
  if (g_.staleness < 0) throw std::invalid_argument("graph: staleness must be >= 0");
  if (!g_.trains.empty() && g_.trains.size() != n) throw std::invalid_argument("graph: trains needs one entry per call");
  if (g_.staleness > 0 && g_.trains.empty())
    throw std::invalid_argument("graph: staleness > 0 needs trains (which calls train) to place the async steps");
  for (size_t c = 0; c < n; ++c) {
    all_.push_back(static_cast<int>(c));
    (c < g_.trains.size() && g_.trains[c] ? train_ : roll_).push_back(static_cast<int>(c));
  }
  initial_.assign(n, 0.0);
  rend_.assign(n, 0.0);
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
  // Devices covered by exactly the same meshes behave identically, so the state is kept per
  // segment between consecutive mesh boundaries (at most 2n + 1 segments, not num_gpus).
  cuts_.assign({0, g_.num_gpus});
  for (int c = 0; c < n; ++c) {
    const Option& o = g_.options[c][plan[c]];
    cuts_.push_back(o.start);
    cuts_.push_back(o.start + o.size);
  }
  std::sort(cuts_.begin(), cuts_.end());
  const int64_t* cuts = cuts_.data();
  const int nc = static_cast<int>(std::unique(cuts_.begin(), cuts_.end()) - cuts_.begin());
  const int nseg = nc - 1;
  auto seg_of = [&](int64_t r) { return static_cast<int>(std::upper_bound(cuts, cuts + nc, r) - cuts) - 1; };
  std::vector<std::pair<int, int>> span(n);  // [first, last) segment of each call's mesh
  for (int c = 0; c < n; ++c) {
    const Option& o = g_.options[c][plan[c]];
    span[c] = {seg_of(o.start), seg_of(o.start + o.size - 1) + 1};
  }
  std::fill(persist_.begin(), persist_.begin() + nseg, 0.0);
  std::fill(transient_.begin(), transient_.begin() + nseg, 0.0);
  for (int c = 0; c < n; ++c) {
    const Option& o = g_.options[c][plan[c]];
    const double tr = o.transient + (copy[c] ? o.weights : 0.0);
    for (int s = span[c].first; s < span[c].second; ++s) {
      persist_[s] += o.persist;
      transient_[s] = std::max(transient_[s], tr);
    }
  }
  for (int s = 0; s < nseg; ++s) res.peak_mem = std::max(res.peak_mem, persist_[s] + transient_[s]);
  if (res.peak_mem > g_.mem_limit) {
    res.iter_time = res.makespan = std::numeric_limits<double>::infinity();
    res.infeasible = "memory";
    return res;
  }
  std::fill(gpu_free_.begin(), gpu_free_.begin() + nseg, 0.0);
  auto occupy = [&](int c, double t) {
    for (int s = span[c].first; s < span[c].second; ++s) t = std::max(t, gpu_free_[s]);
    return t;
  };
  auto release = [&](int c, double t) {
    for (int s = span[c].first; s < span[c].second; ++s) gpu_free_[s] = t;
  };
  const int k = g_.staleness;
  // ends_[b * n + c]: end of call c of batch b; the weights of step s are those trained by batch
  // s - 1 (initial_: zeros before the first step). Buffers are members: no allocation per call.
  ends_.assign(static_cast<size_t>(g_.iters + k) * n, 0.0);
  placed_.clear();
  const double cores = g_.shared_cores;
  // o's seconds from `start` beside the calls already placed (shared cores; simulate.py's rule).
  auto stretched = [&](const Option& o, double start) {
    if (cores <= 0 || o.time <= 0) return o.time;
    const double end = start + o.time;
    double w = 0;
    for (const Placed& p : placed_) w += p.working * std::max(0.0, std::min(end, p.end) - std::max(start, p.start));
    w /= o.time;
    return o.time * std::max(1.0, (o.busy + w) / cores) / std::max(1.0, o.busy / cores);
  };
  // Reallocations of `cs` first (in call order), then the calls of `cs`, of batch b at step.
  auto place = [&](int b, const std::vector<int>& cs, const double* wts, int step) {
    double* end = ends_.data() + static_cast<size_t>(b) * n;
    double* rend = rend_.data();
    for (int c : cs) {
      if (!copy[c]) continue;
      const int w = g_.weight_src[c];
      const double start = occupy(c, occupy(w, wts[w]));
      double dur;
      if (bound) {
        auto it = cache_[c].find((static_cast<int64_t>(plan[w]) << 32) | static_cast<int64_t>(plan[c]));
        dur = it == cache_[c].end() ? 0.0 : it->second;
      } else {
        dur = realloc_time(c, plan[w], plan[c]);
      }
      rend[c] = start + dur;
      release(w, rend[c]);
      release(c, rend[c]);
      if (keep_tasks) res.tasks.push_back({c, step, true, start, rend[c]});
    }
    for (int c : cs) {
      const Option& o = g_.options[c][plan[c]];
      const int w = g_.weight_src[c];
      double ready = copy[c] ? rend[c] : (w >= 0 ? wts[w] : 0.0);
      for (size_t i = 0; i < g_.deps[c].size(); ++i) {
        const int d = g_.deps[c][i];
        ready = std::max(ready, end[d] + transfer_time(g_.options[d][plan[d]], o, g_.dep_bytes[c][i]));
      }
      const double start = occupy(c, ready);
      end[c] = start + stretched(o, start);
      placed_.push_back({start, end[c], o.working});
      release(c, end[c]);
      res.makespan = std::max(res.makespan, end[c]);
      if (keep_tasks) res.tasks.push_back({c, step, false, start, end[c]});
    }
  };
  for (int b = 0; b < k; ++b) place(b, roll_, initial_.data(), -1);  // prologue: the initial weights
  const double t0 = res.makespan;
  for (int s = 0; s < g_.iters; ++s) {
    const double* wts = s ? ends_.data() + static_cast<size_t>(s - 1) * n : initial_.data();
    if (k == 0) {
      place(s, all_, wts, s);
    } else {
      place(s + k, roll_, wts, s);
      place(s, train_, wts, s);
    }
  }
  res.iter_time = (res.makespan - t0) / g_.iters;
  return res;
}

}  // namespace real_py::search
