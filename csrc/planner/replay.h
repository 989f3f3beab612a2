// Round-by-round replay of a reallocation schedule on a link model (the inner loop of
// real_py/realloc/simulate.py's `simulate`; see its module docstring for the model).
#pragma once

#include <cstdint>

namespace real_py {

// Hops sorted by round: hop i goes from rank u[i] to rank v[i] over egress link l1[i] and
// ingress link l2[i] with nbytes[i] bytes; round k holds hops [bounds[k], bounds[k + 1]).
// bw: bytes per second of each of `num_links` links; ranks are 0 .. num_ranks - 1.
// A round's hops on a link start when the link is free and both ranks have finished their
// previous round; the link then takes its round's bytes over its bandwidth plus latency_s; a
// hop ends when its slower link does. Returns when the last rank is done (0 without hops).
double replay_rounds(const int64_t* u, const int64_t* v, const int64_t* l1, const int64_t* l2,
                     const double* nbytes, const int64_t* bounds, int64_t num_rounds,
                     const double* bw, int64_t num_links, int64_t num_ranks, double latency_s);

}  // namespace real_py
