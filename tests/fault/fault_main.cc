// SPDX-License-Identifier: Apache-2.0
// fault_test's main: GoogleTest's flags plus the suite's own (fault_harness.h's Flags):
//   --iterations N        faults per transport stack (CTest: the small default; the long run
//                         scripts/fault.sh --iterations 200)
//   --seed S              replay the draws of a run that printed seed S (0 or absent: a new one)
//   --memory-versions N   versions of the memory case (default 60; the long run 500)
//   --bytes B             approximate bytes per version (default 1 MiB)
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "fault/fault_harness.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);  // removes the flags GoogleTest knows
  weightbus::testing::fault::Flags& f = weightbus::testing::fault::GlobalFlags();
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const bool has_value = i + 1 < argc;
    bool ok = has_value;
    if (flag == "--iterations" && has_value) {
      ok = absl::SimpleAtoi(argv[++i], &f.iterations) && f.iterations >= 0;
    } else if (flag == "--seed" && has_value) {
      ok = absl::SimpleAtoi(argv[++i], &f.seed);
    } else if (flag == "--memory-versions" && has_value) {
      ok = absl::SimpleAtoi(argv[++i], &f.memory_versions);
    } else if (flag == "--bytes" && has_value) {
      ok = absl::SimpleAtoi(argv[++i], &f.bytes) && f.bytes > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: %s [gtest flags] [--iterations N] [--seed S] [--memory-versions N] "
                   "[--bytes B]\n",
                   argv[0]);
      return 2;
    }
  }
  if (f.seed == 0) f.seed = std::random_device{}() | 1;
  std::printf("[ fault ] seed %llu (replay with --seed %llu)\n",
              static_cast<unsigned long long>(f.seed), static_cast<unsigned long long>(f.seed));
  return RUN_ALL_TESTS();
}
