#include "planner/replay.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace real_py {

double replay_rounds(const int64_t* u, const int64_t* v, const int64_t* l1, const int64_t* l2,
                     const double* nbytes, const int64_t* bounds, int64_t num_rounds,
                     const double* bw, int64_t num_links, int64_t num_ranks, double latency_s) {
  std::vector<double> ready(num_ranks, 0.0), link_free(num_links, 0.0), start(num_links, 0.0),
      load(num_links, 0.0);
  std::vector<char> seen(num_links, 0);
  std::vector<int64_t> used;
  const auto check = [](int64_t x, int64_t n, const char* what) {
    if (x < 0 || x >= n)
      throw std::out_of_range(std::string("replay_rounds: ") + what + " " + std::to_string(x) +
                              " outside [0, " + std::to_string(n) + ")");
  };
  bool any = false;
  for (int64_t k = 0; k < num_rounds; ++k) {
    const int64_t a = bounds[k], b = bounds[k + 1];
    if (a > b) throw std::invalid_argument("replay_rounds: bounds must not decrease");
    used.clear();
    // Each link starts at the latest of its own free time and its hops' ranks' ready times,
    // and carries the sum of its hops' bytes (hop order, as numpy's add.at).
    for (int64_t i = a; i < b; ++i) {
      check(u[i], num_ranks, "rank");
      check(v[i], num_ranks, "rank");
      const double s = std::max(ready[u[i]], ready[v[i]]);
      for (const int64_t l : {l1[i], l2[i]}) {
        check(l, num_links, "link");
        if (!seen[l]) {
          seen[l] = 1;
          used.push_back(l);
          start[l] = link_free[l];
          load[l] = 0.0;
        }
        start[l] = std::max(start[l], s);
      }
      load[l1[i]] += nbytes[i];
    }
    for (int64_t i = a; i < b; ++i) load[l2[i]] += nbytes[i];
    for (const int64_t l : used) {
      link_free[l] = start[l] + load[l] / bw[l] + latency_s;
      seen[l] = 0;
    }
    for (int64_t i = a; i < b; ++i) {
      const double end = std::max(link_free[l1[i]], link_free[l2[i]]);
      ready[u[i]] = std::max(ready[u[i]], end);
      ready[v[i]] = std::max(ready[v[i]], end);
      any = true;
    }
  }
  return any ? *std::max_element(ready.begin(), ready.end()) : 0.0;
}

}  // namespace real_py
