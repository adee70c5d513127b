// SPDX-License-Identifier: Apache-2.0
// The ranks of a publisher group as separate processes (wb_test_peer publish-llama, peer_main.cc
// publishing its slices of the stories260K fixture), for the group suites over disk:// and
// delta+disk:// (disk_group_test, delta_group_test).
#pragma once

#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "test_support.h"

namespace weightbus::testing {

inline std::string PeerBinary() { return BinaryPath("tests/wb_test_peer"); }

// Starts the ranks of a group of `world` publishing versions [start, start + versions) of the
// fixture with `layout` ("rows" or "cols"), each logging to dir/<log_tag><rank>.log; with `only`
// >= 0, that rank alone. `failpoints` per rank (WEIGHTBUS_FAILPOINTS); `extra`: more peer
// flags for every rank (e.g. {"--steps", "1", "--set", "keyframe_interval=5"}); `settings`: one
// more --set K=V per rank (e.g. its secret_file).
inline std::vector<Child> StartRanks(const ScratchDir& dir, const std::string& uri, int world,
                                     const std::string& layout, uint64_t start, uint64_t versions,
                                     const std::string& log_tag,
                                     const std::map<int, std::string>& failpoints = {},
                                     double timeout_s = 60, int only = -1,
                                     const std::vector<std::string>& extra = {},
                                     const std::map<int, std::string>& settings = {}) {
  std::vector<Child> ranks;
  for (int r = 0; r < world; ++r) {
    if (only >= 0 && r != only) continue;
    std::map<std::string, std::string> env;
    if (auto it = failpoints.find(r); it != failpoints.end()) {
      env["WEIGHTBUS_FAILPOINTS"] = it->second;
    }
    std::vector<std::string> args = {PeerBinary(),
                                     "publish-llama",
                                     uri,
                                     "--layout",
                                     layout,
                                     "--start",
                                     std::to_string(start),
                                     "--versions",
                                     std::to_string(versions),
                                     "--timeout-s",
                                     absl::StrFormat("%g", timeout_s),
                                     "--set",
                                     absl::StrFormat("rank=%d", r),
                                     "--set",
                                     absl::StrFormat("world_size=%d", world),
                                     "--set",
                                     "poll_interval=5ms",
                                     "--set",
                                     "shard_size=100KiB"};  // several files a rank
    args.insert(args.end(), extra.begin(), extra.end());
    if (auto it = settings.find(r); it != settings.end())
      args.insert(args.end(), {"--set", it->second});
    auto c = Child::Start(args, env, dir / absl::StrFormat("%s%d.log", log_tag, r));
    EXPECT_TRUE(c.ok()) << c.status();
    if (c.ok()) ranks.push_back(*std::move(c));
  }
  return ranks;
}

// Waits for every rank (at most `timeout` each) and returns their exit codes (-1: no exit).
inline std::vector<int> WaitAll(std::vector<Child>& ranks,
                                absl::Duration timeout = absl::Seconds(60)) {
  std::vector<int> codes;
  for (Child& c : ranks) {
    absl::StatusOr<int> s = c.Wait(timeout);
    codes.push_back(s.ok() ? ExitCode(*s) : -1);
  }
  return codes;
}

}  // namespace weightbus::testing
