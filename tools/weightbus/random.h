// SPDX-License-Identifier: Apache-2.0
// The counter-based generator behind the synthetic models and update streams: splitmix64
// (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014), whose
// output depends only on its input, so any split of the work across threads gives the same
// numbers.
#pragma once

#include <cstdint>

namespace weightbus::tools {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace weightbus::tools
