// SPDX-License-Identifier: Apache-2.0
// weightbus-disk-small-bench: publish time of a version made of many small tensors against the
// same bytes in few tensors, over disk:// (issue 10, item 11; BENCHMARKS.md).
//
//   weightbus-disk-small-bench [--dir DIR] [--small N] [--big K] [--big-bytes B] [--reps R]
//                              [--fsync true|false] [--only many|few]
//
// "many": N tensors of 4..64 KiB (uniform, fixed seed) plus K tensors of B bytes (default 20,000,
// 20 and 64 MiB, the shape); "few": the same bytes as K + 1 tensors (the K big ones and
// one holding all the small ones' bytes). Both point into the same memory, so only the tensor
// count differs. Each rep publishes one version of each, alternating, each into a fresh channel
// (removed afterwards, untimed); figures are medians. Count io_uring submissions with
//   strace -f -c -e trace=io_uring_enter weightbus-disk-small-bench ...
// (one io_uring_enter per submit-and-wait).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "weightbus/fatal.h"
#include "weightbus/flags.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::tools {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Main(int argc, char** argv) {
  SetFatalErrorPolicy({"weightbus-disk-small-bench", 1, nullptr});
  std::string dir;
  uint64_t small = 20000, big = 20, big_bytes = uint64_t{64} << 20;
  int reps = 3;
  std::string fsync = "true";
  std::string only;  // "many" or "few": that case alone
  Command app(
      "weightbus-disk-small-bench",
      "weightbus-disk-small-bench: publish time over disk:// of a version made of many small "
      "tensors against the same bytes in few tensors.");
  app.Add("dir", &dir, "where the channels go (default: $TMPDIR/wb-small-bench-PID)")
      .TypeName("DIR");
  app.Add("small", &small, "small tensors (4..64 KiB each) in the \"many\" case");
  app.Add("big", &big, "big tensors in both cases");
  app.AddSize("big-bytes", &big_bytes, "bytes of each big tensor");
  app.Add("reps", &reps, "repetitions (median)").InRange(1, 100000);
  app.Add("fsync", &fsync, "the channels' fsync setting").OneOf({"true", "false"});
  app.Add("only", &only, "run one case alone").OneOf({"many", "few"});
  if (std::optional<int> exit_status = app.Parse(argc, argv)) return *exit_status;
  if (dir.empty()) {
    dir = (std::filesystem::temp_directory_path() / absl::StrFormat("wb-small-bench-%d", getpid()))
              .string();
  }
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);

  std::mt19937_64 rng(7);
  std::uniform_int_distribution<uint64_t> size(4096, 65536);
  std::vector<uint64_t> small_sizes(small);
  uint64_t small_total = 0;
  for (uint64_t& s : small_sizes) small_total += (s = size(rng));
  const uint64_t total = small_total + big * big_bytes;
  std::vector<std::byte> memory(total);
  for (size_t i = 0; i < memory.size(); i += 8) {
    const uint64_t x = rng();
    std::memcpy(memory.data() + i, &x, std::min<size_t>(8, memory.size() - i));
  }
  auto view = [&](std::string name, uint64_t offset, uint64_t n) {
    return TensorView{
        std::move(name), DType::kU8, {static_cast<int64_t>(n)}, {}, memory.data() + offset};
  };
  std::vector<TensorView> many, few;
  for (uint64_t k = 0; k < big; ++k) {
    many.push_back(view(absl::StrFormat("big.%d", k), small_total + k * big_bytes, big_bytes));
    few.push_back(many.back());
  }
  uint64_t at = 0;
  for (uint64_t k = 0; k < small; ++k) {
    many.push_back(view(absl::StrFormat("small.%d", k), at, small_sizes[k]));
    at += small_sizes[k];
  }
  if (small_total > 0) few.push_back(view("small.all", 0, small_total));

  std::printf("# weightbus-disk-small-bench (weightbus %s)\n",
              std::string(LibraryVersion()).c_str());
  std::printf(
      "# many: %zu tensors (%llu of 4..64 KiB + %llu of %llu bytes); few: %zu tensors; "
      "%llu bytes (%.2f GiB) each\n",
      many.size(), static_cast<unsigned long long>(small), static_cast<unsigned long long>(big),
      static_cast<unsigned long long>(big_bytes), few.size(),
      static_cast<unsigned long long>(total), total / double(1 << 30));
  std::printf("# dir: %s; fsync=%s; %d reps, medians\n", dir.c_str(), fsync.c_str(), reps);
  std::vector<double> many_s, few_s;
  // Each publish goes to a fresh channel that is removed afterwards (untimed), so both cases
  // start from the same state and a tmpfs --dir holds one version at a time.
  const std::string uri = "disk://" + dir + "/channel?fsync=" + fsync;
  for (int r = 0; r < reps; ++r) {
    for (auto* which : {&many, &few}) {
      if (!only.empty() && (which == &many) != (only == "many")) continue;
      auto pub = OrDie(Publisher::Open(uri));
      const absl::Time t0 = absl::Now();
      absl::Status s = pub->Publish(1, *which, {}, absl::Minutes(10));
      const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
      if (!s.ok()) Die(std::string(s.message()));
      (which == &many ? many_s : few_s).push_back(seconds);
      pub.reset();
      std::filesystem::remove_all(dir + "/channel");
    }
  }
  const double m = Median(many_s), f = Median(few_s);  // 0 for a case left out by --only
  auto least = [](const std::vector<double>& v) {
    return v.empty() ? 0 : *std::min_element(v.begin(), v.end());
  };
  std::printf("%-6s %10s %10s %10s %10s\n", "# case", "tensors", "median_s", "min_s", "GB/s");
  std::printf("%-6s %10zu %10.3f %10.3f %10.2f\n", "many", many.size(), m, least(many_s),
              total / m / 1e9);
  std::printf("%-6s %10zu %10.3f %10.3f %10.2f\n", "few", few.size(), f, least(few_s),
              total / f / 1e9);
  std::printf("# many/few publish time: median %.3f, min %.3f\n", m / f,
              least(many_s) / least(few_s));
  std::filesystem::remove_all(dir);
  std::printf("# OK\n");
  return 0;
}

}  // namespace
}  // namespace weightbus::tools

int main(int argc, char** argv) { return weightbus::tools::Main(argc, argv); }
