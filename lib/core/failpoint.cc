// SPDX-License-Identifier: Apache-2.0
#include "core/failpoint.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/logging.h"
#include "core/system.h"

namespace weightbus::internal {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// The `pause` action: announces `name` in `dir` and waits for the test's release file (or for
// `dir` to go away: the test is over).
void Pause(std::string_view name, const std::string& dir) {
  const std::string reached = absl::StrFormat("%s/%s.reached", dir, name);
  const std::string release = absl::StrFormat("%s/%s.release", dir, name);
  // Watch before announcing, so a release written right after the announcement is not missed.
  // Without inotify the wait below still looks for the file every second.
  UniqueFd watch(::inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  if (watch.get() >= 0 &&
      ::inotify_add_watch(watch.get(), dir.c_str(), IN_CREATE | IN_MOVED_TO | IN_ATTRIB) < 0) {
    watch = UniqueFd();
  }
  const std::string tmp = absl::StrFormat("%s.%d.tmp", reached, ::getpid());
  const std::string pid_line = absl::StrFormat("%d\n", ::getpid());
  UniqueFd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (out.get() < 0 ||
      ::write(out.get(), pid_line.data(), pid_line.size()) !=
          static_cast<ssize_t>(pid_line.size()) ||
      ::rename(tmp.c_str(), reached.c_str()) != 0) {
    const int err = errno;
    Log(LogLevel::kWarn, "failpoint %s: cannot announce the pause in %s (%s); not pausing", name,
        reached, strerror(err));
    ::unlink(tmp.c_str());
    return;
  }
  out = UniqueFd();
  const absl::Time deadline = absl::Now() + FailPoints::kPauseLimit;
  while (!Exists(release) && Exists(dir)) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      Log(LogLevel::kWarn, "failpoint %s: not released (%s) within %s; going on", name, release,
          absl::FormatDuration(FailPoints::kPauseLimit));
      return;
    }
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(std::min(left, absl::Seconds(1))));
    pollfd p{watch.get(), POLLIN, 0};  // fd -1 is ignored: a plain wait
    if (::poll(&p, 1, ms + 1) > 0) {
      char events[4096];
      while (::read(watch.get(), events, sizeof(events)) > 0) {
      }
    }
  }
}

}  // namespace

absl::StatusOr<FailPoints> FailPoints::Parse(std::string_view spec) {
  FailPoints fp;
  for (absl::string_view entry :
       absl::StrSplit(absl::string_view(spec.data(), spec.size()), ',', absl::SkipEmpty())) {
    auto bad = [&](std::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrFormat("failpoint \"%s\" is malformed (%s); expected "
                          "name=kill|error|delay:<ms>|pause:<absolute dir>[@n]",
                          std::string(entry), why));
    };
    size_t eq = entry.find('=');
    if (eq == absl::string_view::npos || eq == 0) return bad("no name=");
    const std::string name(entry.substr(0, eq));
    if (fp.points_.count(name) != 0) return bad("the point is named twice");
    Point& p = fp.points_[name];
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
    } else if (absl::StartsWith(action, "pause:")) {
      p.action = Action::kPause;
      p.pause_dir = std::string(action.substr(6));
      if (!absl::StartsWith(p.pause_dir, "/")) return bad("pause needs an absolute directory");
      if (name.find('/') != std::string::npos) return bad("a paused point's name has no '/'");
    } else {
      return bad("unknown action");
    }
  }
  return fp;
}

absl::Status FailPoints::Hit(std::string_view name) {
  if (points_.empty()) return absl::OkStatus();
  auto it = points_.find(name);
  if (it == points_.end()) return absl::OkStatus();
  Point& p = it->second;
  if (p.passes.fetch_add(1, std::memory_order_relaxed) + 1 != p.fire_at) return absl::OkStatus();
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
    case Action::kPause:
      Pause(name, p.pause_dir);
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace weightbus::internal
