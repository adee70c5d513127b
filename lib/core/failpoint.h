// SPDX-License-Identifier: Apache-2.0
// Fault injection at named points in the code (in the manner of FreeBSD fail(9) and TiKV's
// fail-rs), so tests can prove failure paths with real processes: a writer killed between two
// files, a commit that errors, a transfer that stalls. Configured per channel, when it is opened,
// from the environment variable WEIGHTBUS_FAILPOINTS (the core setting `failpoints`, which a URI
// query or Options may not set), e.g. "disk.after_file=kill@2,disk.before_commit=error".
#pragma once

#include <atomic>
#include <map>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace weightbus::internal {

class FailPoints {
 public:
  FailPoints() = default;
  // Parses "name=action[@n],...". Actions: kill (SIGKILL this process), error (Hit returns
  // Internal), delay:<ms> (sleep). `n` is the 1-based pass that fires (default 1); passes before
  // and after it do nothing. Errors: InvalidArgument for a malformed entry.
  static absl::StatusOr<FailPoints> Parse(std::string_view spec);

  // Called by code at point `name`. OK unless an `error` action fires.
  absl::Status Hit(std::string_view name);

 private:
  enum class Action { kKill, kError, kDelay };
  struct Point {
    Action action = Action::kError;
    int delay_ms = 0;
    int fire_at = 1;
    int passes = 0;
  };
  std::map<std::string, Point, std::less<>> points_;
};

}  // namespace weightbus::internal
