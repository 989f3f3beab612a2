// C++ unit tests for the plan simulator and annealer (search/search.h) on a hand-built graph.
// A failure points to the list scheduler (ordering, reallocation, readiness), memory check or annealer.
#include <cmath>
#include <cstdio>

#include "search/search.h"

using namespace real_py::search;

#include "tests/check.h"
#define NEAR(a, b) CHECK(std::fabs((a) - (b)) < 1e-12)

// 4 GPUs: gen (weights from train), inf (reads gen), train (reads gen and inf).
static Graph small_graph() {
  Graph g;
  g.num_gpus = 4;
  g.ranks_per_node = 4;
  Option gen0{0, 2, 2, 1, 1, 1.0, 0, 5, 3};
  Option gen1{0, 4, 4, 1, 1, 0.5, 0, 5, 3};
  Option inf0{2, 2, 2, 1, 1, 2.0, 0, 1, 0};
  Option train0{0, 4, 4, 1, 1, 3.0, 10, 1, 0};
  g.options = {{gen0, gen1}, {inf0}, {train0}};
  g.weight_src = {2, -1, -1};
  g.deps = {{}, {0}, {0, 1}};
  g.dep_bytes = {{}, {0.0}, {0.0, 0.0}};
  g.mem_limit = 100;
  g.iters = 1;
  return g;
}

static void test_timeline() {
  int calls = 0;
  Evaluator ev(small_graph(), [&](int, int, int) { ++calls; return 0.25; });
  auto r = ev.simulate({0, 0, 0}, true);
  // realloc 0-0.25 on GPUs 0-3, gen 0.25-1.25, inf 1.25-3.25, train 3.25-6.25.
  CHECK(r.tasks.size() == 4);
  CHECK(r.tasks[0].realloc && r.tasks[0].call == 0);
  NEAR(r.tasks[0].end, 0.25);
  NEAR(r.tasks[1].start, 0.25);
  NEAR(r.tasks[2].start, 1.25);
  NEAR(r.tasks[3].start, 3.25);
  NEAR(r.iter_time, 6.25);
  // Same layout as training: no reallocation, gen starts at 0.
  NEAR(ev.cost({1, 0, 0}), 5.5);
  CHECK(calls == 1);  // cached
}

static void test_iterations_and_memory() {
  Graph g = small_graph();
  g.iters = 2;
  Evaluator ev(g, [](int, int, int) { return 0.25; });
  // Second iteration's reallocation waits for the first iteration's train (ends 6.25).
  auto r = ev.simulate({0, 0, 0}, true);
  NEAR(r.makespan, 12.5);
  NEAR(r.iter_time, 6.25);
  g.iters = 1;
  g.mem_limit = 17;  // GPU 0: train 10 + gen 5 + copy 3 = 18 > 17; without the copy 15.
  Evaluator ev2(g, [](int, int, int) { return 0.25; });
  CHECK(std::isinf(ev2.cost({0, 0, 0})));
  NEAR(ev2.cost({1, 0, 0}), 5.5);
}

static void test_anneal() {
  Evaluator ev(small_graph(), [](int, int, int) { return 0.25; });
  AnnealConfig cfg;
  cfg.chains = 2;
  cfg.max_steps = 200;
  cfg.time_budget = 10;
  auto r = anneal(ev, cfg);
  NEAR(r.best_cost, 5.5);
  CHECK(r.best[0] == 1);
  CHECK(r.chains.size() == 2 && r.chains[0].steps == 200);
}

int main() {
  test_timeline();
  test_iterations_and_memory();
  test_anneal();
  if (failures) std::fprintf(stderr, "%d failures\n", failures);
  else std::printf("test_search: all passed\n");
  return failures ? 1 : 0;
}
