// Minimal check macro shared by the C++ unit tests (ctest): a failed CHECK prints its location
// and condition and counts; main() returns non-zero when `failures` > 0.
#pragma once

#include <cstdio>

static int failures = 0;
#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                            \
    }                                                                        \
  } while (0)
