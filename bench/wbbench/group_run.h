// SPDX-License-Identifier: Apache-2.0
// `weightbus-bench run --publishers N[,N...] --tp M[,M...]`: publisher groups of N ranks and
// tensor-parallel replicas of M ranks over disk://, every process on this host (issue 12).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "wbbench/store.h"

namespace weightbus::bench {

struct GroupRunConfig {
  std::vector<int> publishers;  // group sizes, each a whole run
  std::vector<int> tp;          // TP degrees, each a whole run with every group size
  int versions = 6, warmup = 1;
  std::string dir, store, log_dir;  // the run's directories (channels go in dir)
  absl::Duration timeout = absl::Seconds(120);
  std::vector<std::string> settings;  // --set KEY=VALUE, to every process
  std::string transport =
      "disk";  // "disk", "delta+disk" or "ucx" (on 127.0.0.1, a free port per pair)
  std::optional<std::string> json;
};

// Runs every (N, M) pair, one after the other, each with a fresh channel: N publisher processes
// (ranks of one group, row shards: tp_layout.h) and M subscriber processes (one TP group with
// vLLM's placements), `versions` versions from the store. Prints an nccl-tests-style table (a
// row per pair) and a final OK/FAILED line; returns 0 when every slice of every version matched
// the store, 1 otherwise.
int RunGroups(const GroupRunConfig& config, const StoreIndex& index);

}  // namespace weightbus::bench
