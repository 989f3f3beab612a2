// Execution-plan search over a dataflow graph of calls (PPO: 6 calls), torch-free.
//
// Every (call, option) cost is precomputed by the caller (Python cost model) into tables; a
// reallocation cost (weights moved from the training layout to another call's layout) comes
// from a callback, cached here per (call, src option, dst option). The simulator is a fixed-
// order list scheduler over `iters` iterations and must agree with real_py/search/simulate.py.
// Units: seconds and bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace real_py::search {

struct Option {
  int64_t start = 0, size = 1;  // mesh: global ranks [start, start + size)
  int64_t dp = 1, tp = 1, pp = 1;
  double time = 0;       // seconds of the call on this option
  double persist = 0;    // bytes per device held all iteration (training state, frozen weights)
  double transient = 0;  // bytes per device during the call (activations, KV cache)
  double weights = 0;    // bytes per device of a reallocated weight copy (when layouts differ)
  double busy = 1;       // ranks whose core sharing `time` includes (Graph::shared_cores > 0)
  double working = 1;    // ranks computing at once: they slow calls beside this one on shared cores
};

struct Graph {
  int64_t num_gpus = 1, ranks_per_node = 8;
  std::vector<std::vector<Option>> options;  // per call, in topological order
  std::vector<int> weight_src;               // per call: call whose layout holds its weights, or -1
  std::vector<std::vector<int>> deps;        // per call: calls it reads
  std::vector<std::vector<double>> dep_bytes;  // bytes read from each dep
  double intra_bw = 1, inter_bw = 1, intra_lat = 0, inter_lat = 0;
  // Ranks sharing this many cores (0: every device its own processor): a call placed beside
  // calls already placed is stretched by contention(busy + w) / contention(busy), w their working
  // ranks averaged over its interval (simulate.py states the rule).
  double shared_cores = 0;
  double mem_limit = 0;  // bytes per device
  int iters = 3;
  // Asynchronous RL (real_py/rlhf/asyncrl.py): the rollout calls of batch s + staleness run with
  // the weights trained by step s - 1, placed before the train calls of batch s; 0: synchronous.
  int staleness = 0;
  std::vector<char> trains;  // per call: a train call (empty: none; only read when staleness > 0)
};

// seconds to move call c's weights from option `src` of weight_src[c] to option `dst` of c.
using ReallocFn = std::function<double(int call, int src, int dst)>;

struct Task {
  int call;       // call index
  int iter;       // step (-1: the rollouts of the asynchronous prologue)
  bool realloc;   // true: the reallocation before the call
  double start, end;
};

struct SimResult {
  double iter_time = 0;  // seconds per step after the prologue ((makespan - prologue) / iters); +inf when infeasible
  double makespan = 0;
  double peak_mem = 0;   // largest per-device bytes
  std::string infeasible;  // why, empty when feasible
  std::vector<Task> tasks;
};

class Evaluator {
 public:
  Evaluator(Graph g, ReallocFn realloc);
  const Graph& graph() const { return g_; }
  // plan: one option index per call. bound: reallocations not yet computed count as 0 s
  // (never calls the callback); start times only grow with durations, so this is a lower
  // bound of the exact cost.
  SimResult simulate(const std::vector<int>& plan, bool keep_tasks = false, bool bound = false);
  double cost(const std::vector<int>& plan) { return simulate(plan).iter_time; }
  double cost_bound(const std::vector<int>& plan) { return simulate(plan, false, true).iter_time; }
  double realloc_time(int call, int src, int dst);
  bool same_layout(int call_a, int opt_a, int call_b, int opt_b) const;
  int64_t realloc_calls() const { return realloc_misses_; }

 private:
  double transfer_time(const Option& a, const Option& b, double bytes) const;
  Graph g_;
  ReallocFn realloc_;
  std::vector<std::unordered_map<int64_t, double>> cache_;
  int64_t realloc_misses_ = 0;
  std::vector<double> gpu_free_, persist_, transient_;  // per device segment
  std::vector<int64_t> cuts_;
  std::vector<int> all_, roll_, train_;  // call indices: every call, rollout calls, train calls
  std::vector<double> ends_, initial_, rend_;  // per batch x call end times; zeros; realloc ends
  struct Placed {
    double start, end, working;
  };
  std::vector<Placed> placed_;  // calls placed so far in this simulation (shared cores)
};

struct AnnealConfig {
  int chains = 4;
  double time_budget = 10;  // seconds for all chains together
  int64_t max_steps = 0;    // per chain; 0 = only the time budget limits
  double t_start = 0.1, t_end = 0.001;  // temperature relative to the current cost
  int64_t restart_steps = 0;  // restart a chain from a random plan after this many steps without a new chain best; 0 = never
  uint64_t seed = 0;
  std::vector<std::vector<int>> init;  // initial plans for even chains; odd chains start at random
};

struct ChainStats {
  int64_t steps = 0, accepted = 0, improved = 0, infeasible = 0, restarts = 0;
  double init_cost = 0, final_cost = 0, best_cost = 0;
};

struct AnnealResult {
  std::vector<int> best;
  double best_cost = 0;
  double seconds = 0;
  int64_t realloc_calls = 0;
  std::vector<ChainStats> chains;
};

AnnealResult anneal(Evaluator& ev, const AnnealConfig& cfg);

}  // namespace real_py::search
