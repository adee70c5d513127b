// SPDX-License-Identifier: Apache-2.0
// Fault injection at named points in the code (in the manner of FreeBSD fail(9) and TiKV's
// fail-rs), so tests can prove failure paths with real processes: a writer killed between two
// files, a commit that errors, a transfer that stalls, a process held at a named place while the
// test looks at (or kills) it. Configured per channel, when it is opened, from the environment
// variable WEIGHTBUS_FAILPOINTS (the core setting `failpoints`, which a URI query or Options may
// not set), e.g. "disk.after_file=kill@2,disk.before_commit=error".
#pragma once

#include <atomic>
#include <map>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace weightbus::internal {

class FailPoints {
 public:
  // How long a `pause` waits for its release before it logs a warning and goes on, so that a
  // test that never releases (or died) cannot hang the process for ever.
  static constexpr absl::Duration kPauseLimit = absl::Seconds(60);

  FailPoints() = default;
  FailPoints(FailPoints&&) = default;
  FailPoints& operator=(FailPoints&&) = default;

  // Parses "name=action[@n],...". `n` is the 1-based pass that fires (default 1); passes before
  // and after it do nothing. Actions:
  //   kill          SIGKILL this process.
  //   error         Hit returns Internal ("failpoint NAME fired (error)").
  //   delay:<ms>    sleep that many milliseconds.
  //   pause:<dir>   announce and wait: create <dir>/NAME.reached (its content: this process's pid
  //                 and a newline; written to a temporary name and renamed, so it appears whole),
  //                 then block until <dir>/NAME.release exists (at once if it already does) or
  //                 <dir> is gone, at most kPauseLimit, after which a warning is logged and the
  //                 code goes on. <dir>
  //                 must be an absolute path to an existing directory, without ',' or '@'. If
  //                 NAME.reached cannot be created, a warning is logged and nothing blocks.
  //                 tests/test_support.h's testing::PausePoint writes the entry and waits for,
  //                 inspects and releases the point.
  // Errors: InvalidArgument for a malformed entry.
  static absl::StatusOr<FailPoints> Parse(std::string_view spec);

  // Called by code at point `name`. OK unless an `error` action fires. Thread-safe: passes are
  // counted atomically, so exactly one caller fires the n-th pass.
  absl::Status Hit(std::string_view name);

 private:
  enum class Action { kKill, kError, kDelay, kPause };
  struct Point {
    Action action = Action::kError;
    int delay_ms = 0;
    std::string pause_dir;
    int fire_at = 1;
    std::atomic<int> passes{0};
  };
  std::map<std::string, Point, std::less<>> points_;
};

}  // namespace weightbus::internal
