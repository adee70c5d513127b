// SPDX-License-Identifier: Apache-2.0
// The standalone driver of a fuzz target (LLVMFuzzerTestOneInput) for compilers without libFuzzer
// and for CTest: it replays a seed corpus and the regression inputs, and deterministic mutations
// of each.
//
//   <target>_replay [--mutations=N] [--regressions=DIR] PATH...
//
// Every PATH must exist (a directory stands for the regular files directly inside it, in name
// order) and together they must hold at least one input, so that a seed generator that wrote
// nothing fails the test instead of passing it. --regressions=DIR (tests/fuzz/regressions/<target>)
// may be absent: a target without findings has none. Each input is run as it is and as N
// mutations (default 16, fixed seed): bit flips, byte substitutions, truncations, insertions,
// deletions and duplicated ranges. A violated invariant aborts; the signal handler names the
// input and saves it as ./<target>-crash.bin, to be run with the libFuzzer binary and added to
// tests/fuzz/regressions/<target>/.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "replay.h"

#ifndef WB_FUZZ_TARGET
#error "WB_FUZZ_TARGET must name the fuzz target"
#endif

namespace {

using weightbus::fuzz::Rng;

std::string Mutate(std::string s, Rng& rng) {
  const size_t ops = 1 + rng.Below(3);
  for (size_t i = 0; i < ops; ++i) {
    switch (rng.Below(6)) {
      case 0:  // flip a bit
        if (!s.empty()) s[rng.Below(s.size())] ^= static_cast<char>(1u << rng.Below(8));
        break;
      case 1: {  // substitute a byte: a boundary value or a random one
        static constexpr char kBytes[] = {'\0', '\x01', '\x7f', '\x80', '\xff', '0', '9', '"'};
        if (!s.empty()) {
          s[rng.Below(s.size())] =
              rng.Below(2) ? kBytes[rng.Below(sizeof(kBytes))] : static_cast<char>(rng.Next());
        }
        break;
      }
      case 2:  // truncate
        s.resize(rng.Below(s.size() + 1));
        break;
      case 3: {  // insert 1-8 random bytes
        std::string ins(1 + rng.Below(8), '\0');
        for (char& c : ins) c = static_cast<char>(rng.Next());
        s.insert(rng.Below(s.size() + 1), ins);
        break;
      }
      case 4:  // delete 1-16 bytes
        if (!s.empty()) s.erase(rng.Below(s.size()), 1 + rng.Below(16));
        break;
      case 5:  // duplicate a range elsewhere
        if (!s.empty()) {
          const std::string piece = s.substr(rng.Below(s.size()), 1 + rng.Below(64));
          s.insert(rng.Below(s.size() + 1), piece);
        }
        break;
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const char* tool = WB_FUZZ_TARGET "_replay";
  size_t mutations = 16;
  std::vector<weightbus::fuzz::Input> seeds, regressions;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--mutations=", 0) == 0) {
      mutations = std::strtoul(arg.c_str() + 12, nullptr, 10);
    } else if (arg.rfind("--regressions=", 0) == 0) {
      if (!weightbus::fuzz::ReadInputs(arg.substr(14), /*optional=*/true, tool, &regressions)) {
        return 2;
      }
    } else if (!weightbus::fuzz::ReadInputs(arg, /*optional=*/false, tool, &seeds)) {
      return 2;
    }
  }
  if (seeds.empty()) {
    std::fprintf(stderr, "%s_replay: no seed inputs were given (did the seed generator run?)\n",
                 WB_FUZZ_TARGET);
    return 2;
  }
  const std::string crash_file = std::string(WB_FUZZ_TARGET) + "-crash.bin";
  weightbus::fuzz::InstallReplayCrashHandler(tool, crash_file.c_str());
  size_t runs = 0;
  Rng rng(0xf022ed5eed);
  for (const auto* set : {&seeds, &regressions}) {
    for (const auto& [name, bytes] : *set) {
      weightbus::fuzz::ReplayOne(name, bytes);
      ++runs;
      for (size_t m = 0; m < mutations; ++m) {
        weightbus::fuzz::ReplayOne(name + " (mutation " + std::to_string(m) + ")",
                                   Mutate(bytes, rng));
        ++runs;
      }
    }
  }
  std::printf(
      "%s_replay: %zu inputs (%zu seeds, %zu regressions, %zu mutations each), no failure\n",
      WB_FUZZ_TARGET, runs, seeds.size(), regressions.size(), mutations);
  return 0;
}
