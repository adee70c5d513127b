// SPDX-License-Identifier: Apache-2.0
#include "core/failpoint.h"

#include <signal.h>
#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace weightbus::internal {

absl::StatusOr<FailPoints> FailPoints::Parse(std::string_view spec) {
  FailPoints fp;
  for (absl::string_view entry :
       absl::StrSplit(absl::string_view(spec.data(), spec.size()), ',', absl::SkipEmpty())) {
    auto bad = [&](std::string_view why) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "failpoint \"%s\" is malformed (%s); expected name=kill|error|delay:<ms>[@n]",
          std::string(entry), why));
    };
    size_t eq = entry.find('=');
    if (eq == absl::string_view::npos || eq == 0) return bad("no name=");
    Point p;
    absl::string_view action = entry.substr(eq + 1);
    if (size_t at = action.find('@'); at != absl::string_view::npos) {
      if (!absl::SimpleAtoi(action.substr(at + 1), &p.fire_at) || p.fire_at < 1) {
        return bad("@n must be a positive integer");
      }
      action = action.substr(0, at);
    }
    if (action == "kill") {
      p.action = Action::kKill;
    } else if (action == "error") {
      p.action = Action::kError;
    } else if (absl::StartsWith(action, "delay:")) {
      p.action = Action::kDelay;
      if (!absl::SimpleAtoi(action.substr(6), &p.delay_ms) || p.delay_ms < 0) {
        return bad("delay needs milliseconds");
      }
    } else {
      return bad("unknown action");
    }
    fp.points_[std::string(entry.substr(0, eq))] = p;
  }
  return fp;
}

absl::Status FailPoints::Hit(std::string_view name) {
  if (points_.empty()) return absl::OkStatus();
  auto it = points_.find(name);
  if (it == points_.end()) return absl::OkStatus();
  Point& p = it->second;
  if (++p.passes != p.fire_at) return absl::OkStatus();
  switch (p.action) {
    case Action::kKill:
      ::kill(::getpid(), SIGKILL);
      ::pause();
      return absl::OkStatus();
    case Action::kError:
      return absl::InternalError(absl::StrFormat("failpoint %s fired (error)", name));
    case Action::kDelay:
      absl::SleepFor(absl::Milliseconds(p.delay_ms));
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace weightbus::internal
