// Simulated annealing (Metropolis MCMC with a cooling temperature) over per-call options.
//
// The temperature is relative to the chain's current cost: a move that makes the plan x%
// slower is accepted with probability exp(-(x/100) / t), t going geometrically from t_start to
// t_end. So acceptance depends on relative change, never on the time unit (ReaL's search
// mixed ms and us and accepted nearly every move). Equivalent form used below: draw u, accept
// iff new <= cur * (1 - t ln u); a cheap lower bound of `new` rejects most moves early. Chains run round-robin in blocks of steps
// on one thread: the reallocation callback may call into Python.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <tuple>

#include "search/search.h"

namespace real_py::search {
namespace {

using Clock = std::chrono::steady_clock;
using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;

struct Moves {
  // Per call: options sharing a mesh, options sharing (size, dp, tp, pp), and layout -> option.
  std::vector<std::vector<std::vector<int>>> same_mesh, same_strategy;
  std::vector<std::vector<int>> mesh_group, strategy_group;
  std::vector<std::map<Key, int>> by_layout;

  explicit Moves(const Graph& g) {
    const size_t n = g.options.size();
    same_mesh.resize(n);
    same_strategy.resize(n);
    mesh_group.resize(n);
    strategy_group.resize(n);
    by_layout.resize(n);
    for (size_t c = 0; c < n; ++c) {
      std::map<std::pair<int64_t, int64_t>, int> meshes;
      std::map<Key, int> strategies;
      for (size_t i = 0; i < g.options[c].size(); ++i) {
        const Option& o = g.options[c][i];
        auto m = meshes.emplace(std::make_pair(o.start, o.size), static_cast<int>(meshes.size())).first->second;
        auto s = strategies.emplace(Key{o.size, o.dp, o.tp, o.pp, 0}, static_cast<int>(strategies.size())).first->second;
        if (m >= static_cast<int>(same_mesh[c].size())) same_mesh[c].emplace_back();
        if (s >= static_cast<int>(same_strategy[c].size())) same_strategy[c].emplace_back();
        same_mesh[c][m].push_back(static_cast<int>(i));
        same_strategy[c][s].push_back(static_cast<int>(i));
        mesh_group[c].push_back(m);
        strategy_group[c].push_back(s);
        by_layout[c][Key{o.start, o.size, o.dp, o.tp, o.pp}] = static_cast<int>(i);
      }
    }
  }
};

int pick(const std::vector<int>& v, std::mt19937_64& rng) {
  return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
}

// One proposal: changes plan in place.
void propose(const Graph& g, const Moves& mv, std::vector<int>& plan, std::mt19937_64& rng) {
  const int n = static_cast<int>(plan.size());
  const int c = std::uniform_int_distribution<int>(0, n - 1)(rng);
  const double r = std::uniform_real_distribution<double>(0, 1)(rng);
  const int cur = plan[c];
  if (r < 0.35) {
    plan[c] = std::uniform_int_distribution<int>(0, static_cast<int>(g.options[c].size()) - 1)(rng);
  } else if (r < 0.6) {
    plan[c] = pick(mv.same_mesh[c][mv.mesh_group[c][cur]], rng);
  } else if (r < 0.85) {
    plan[c] = pick(mv.same_strategy[c][mv.strategy_group[c][cur]], rng);
  } else {
    // Align a call with the layout holding its weights (or the reverse): removes a reallocation.
    std::vector<int> pairs;
    for (int d = 0; d < n; ++d)
      if (g.weight_src[d] >= 0) pairs.push_back(d);
    if (pairs.empty()) return;
    const int d = pick(pairs, rng), w = g.weight_src[d];
    const bool forward = std::uniform_int_distribution<int>(0, 1)(rng) == 0;
    const int from = forward ? w : d, to = forward ? d : w;
    const Option& o = g.options[from][plan[from]];
    auto it = mv.by_layout[to].find(Key{o.start, o.size, o.dp, o.tp, o.pp});
    if (it != mv.by_layout[to].end()) plan[to] = it->second;
  }
}

}  // namespace

AnnealResult anneal(Evaluator& ev, const AnnealConfig& cfg) {
  const Graph& g = ev.graph();
  const auto t0 = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  const int nc = std::max(1, cfg.chains);
  const int n = static_cast<int>(g.options.size());
  const double inf = std::numeric_limits<double>::infinity();
  Moves mv(g);
  std::vector<std::mt19937_64> rng;
  std::vector<std::vector<int>> cur(nc);
  std::vector<double> cost(nc);
  AnnealResult res;
  res.best_cost = inf;
  res.chains.resize(nc);
  auto random_start = [&](int k) {
    cost[k] = inf;
    cur[k].assign(n, 0);
    for (int tries = 0; tries < 2000 && !std::isfinite(cost[k]); ++tries) {
      for (int c = 0; c < n; ++c)
        cur[k][c] = std::uniform_int_distribution<int>(0, static_cast<int>(g.options[c].size()) - 1)(rng[k]);
      cost[k] = ev.cost(cur[k]);
    }
  };
  for (int k = 0; k < nc; ++k) {
    rng.emplace_back(cfg.seed * 1000003ULL + static_cast<uint64_t>(k));
    // Even chains start from the given plans, odd ones from random feasible plans: starting
    // every chain at a baseline kept all of them in the baseline's basin.
    if (!cfg.init.empty() && (k % 2 == 0 || nc == 1)) {
      cur[k] = cfg.init[(k / 2) % cfg.init.size()];
      if (static_cast<int>(cur[k].size()) != n) throw std::invalid_argument("init plan needs one option per call");
      cost[k] = ev.cost(cur[k]);
    } else {
      random_start(k);
    }
    res.chains[k].init_cost = res.chains[k].best_cost = cost[k];
    if (cost[k] < res.best_cost) res.best_cost = cost[k], res.best = cur[k];
  }
  if (res.best.empty()) res.best = cur[0];
  const double log_ratio = std::log(cfg.t_end / cfg.t_start);
  constexpr int kBlock = 64;
  bool running = true;
  std::vector<int> prop;
  std::vector<int64_t> last_gain(nc, 0);
  while (running) {
    running = false;
    for (int k = 0; k < nc; ++k) {
      ChainStats& st = res.chains[k];
      if (cfg.max_steps > 0 && st.steps >= cfg.max_steps) continue;
      if (elapsed() >= cfg.time_budget) break;
      running = true;
      for (int s = 0; s < kBlock && (cfg.max_steps <= 0 || st.steps < cfg.max_steps); ++s) {
        const double progress = cfg.max_steps > 0 ? static_cast<double>(st.steps) / cfg.max_steps
                                                  : std::min(1.0, elapsed() / cfg.time_budget);
        const double temp = cfg.t_start * std::exp(log_ratio * progress);
        if (cfg.restart_steps > 0 && st.steps - last_gain[k] >= cfg.restart_steps) {
          // Stuck: restart, alternately from a random feasible plan and from the best plan so
          // far kicked by a few random moves (iterated local search); an infeasible start falls
          // back to the best plan.
          if (++st.restarts % 2 == 1) {
            random_start(k);
          } else {
            cur[k] = res.best;
            for (int kick = 0; kick < 3; ++kick) propose(g, mv, cur[k], rng[k]);
            cost[k] = ev.cost(cur[k]);
          }
          if (!std::isfinite(cost[k])) cur[k] = res.best, cost[k] = res.best_cost;
          last_gain[k] = st.steps;
        }
        prop = cur[k];
        propose(g, mv, prop, rng[k]);
        ++st.steps;
        if (prop == cur[k]) continue;
        // Metropolis with the uniform drawn first: accept iff cost <= threshold. A lower bound
        // above the threshold rejects without computing missing reallocations (planner calls).
        double threshold = inf;
        if (std::isfinite(cost[k])) {
          const double u = std::uniform_real_distribution<double>(0, 1)(rng[k]);
          threshold = cost[k] * (1.0 - temp * std::log(std::max(u, 1e-300)));
        }
        const double lb = ev.cost_bound(prop);
        if (!std::isfinite(lb)) {
          ++st.infeasible;
          continue;
        }
        if (lb > threshold) continue;
        const double c = ev.cost(prop);
        const bool accept = c <= threshold;
        if (!accept) continue;
        ++st.accepted;
        if (c < cost[k]) ++st.improved;
        cur[k].swap(prop);
        cost[k] = c;
        if (c < st.best_cost) st.best_cost = c, last_gain[k] = st.steps;
        if (c < res.best_cost) res.best_cost = c, res.best = cur[k];
      }
    }
  }
  for (int k = 0; k < nc; ++k) res.chains[k].final_cost = cost[k];
  res.seconds = elapsed();
  res.realloc_calls = ev.realloc_calls();
  return res;
}

}  // namespace real_py::search
