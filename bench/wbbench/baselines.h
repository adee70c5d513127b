// SPDX-License-Identifier: Apache-2.0
// The baselines `weightbus-bench run` measures in the same run, on the same bytes: memcpy (the
// memory-bandwidth limit), write(2)+fsync and pread through the run's directory (the disk limit),
// ucx_perftest at the model's size (the UCX limit), and torch.save/torch.load through the same
// directory plus torch.distributed broadcast over gloo (what users do without weightbus).
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "nlohmann/json.hpp"
#include "wbbench/common.h"

namespace weightbus::bench {

// One memcpy of `n` bytes into `sink`, timed on the second of two back-to-back passes (memory
// left idle for a while is slow to touch again on VMs, which is not what a copy costs).
double MemcpySeconds(const std::byte* src, std::byte* sink, size_t n);

// write(2) of `n` bytes in 4 MiB pieces to a new file in `dir`, fsync, then pread it back into
// `sink` (page cache hot, as a reader on the same host finds it); the file is removed after.
struct FileTimes {
  double write_fsync_s = 0;
  double read_s = 0;
};
absl::StatusOr<FileTimes> WriteFsyncRead(const std::string& dir, const std::byte* src,
                                         std::byte* sink, size_t n);

// `ucx_perftest -t ucp_get -s <bytes>` between a server and a client on 127.0.0.1 (the same
// UCX_TLS as ours); its overall bandwidth in GB/s. Errors name what failed.
absl::StatusOr<double> UcxPerftest(const std::string& perftest, uint64_t bytes, int iterations,
                                   const std::string& log_dir);

// bench/wbbench/torch_baselines.py kept running (ranks 0..readers over gloo on 127.0.0.1), so
// that its repetitions interleave with ours.
class TorchBaselines {
 public:
  // Starts the script; false with `why` when it cannot run or torch is missing.
  bool Start(const std::string& python, const std::string& script, const std::string& store,
             const std::string& dir, int readers, const std::string& log_path, std::string* why);
  // One repetition: "save" (torch.save + fsync by rank 0, torch.load by every reader) or
  // "broadcast" (dist.broadcast of every tensor from rank 0). The script's JSON line.
  absl::StatusOr<nlohmann::json> Run(const std::string& what, absl::Duration timeout);
  void Stop();
  const std::string& version() const { return version_; }

 private:
  std::optional<Child> child_;
  std::string version_;
  std::string log_path_;
};

}  // namespace weightbus::bench
