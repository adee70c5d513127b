// SPDX-License-Identifier: Apache-2.0
#include "core/logging.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace weightbus::internal {
namespace {

LogLevel Threshold() {
  static const LogLevel level = [] {
    const char* env = std::getenv("WEIGHTBUS_LOG_LEVEL");
    if (env == nullptr) return LogLevel::kWarn;
    if (std::strcmp(env, "error") == 0) return LogLevel::kError;
    if (std::strcmp(env, "warn") == 0) return LogLevel::kWarn;
    if (std::strcmp(env, "info") == 0) return LogLevel::kInfo;
    if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
    std::fprintf(stderr,
                 "weightbus: WEIGHTBUS_LOG_LEVEL=\"%s\" is not error|warn|info|debug; "
                 "using warn\n",
                 env);
    return LogLevel::kWarn;
  }();
  return level;
}

}  // namespace

bool LogEnabled(LogLevel level) { return level <= Threshold(); }

void LogLine(LogLevel level, std::string_view message) {
  static const char* kNames[] = {"E", "W", "I", "D"};
  std::string line = absl::StrFormat(
      "%s %s weightbus[%d] %s\n", kNames[static_cast<int>(level)],
      absl::FormatTime("%H:%M:%E6S", absl::Now(), absl::LocalTimeZone()), getpid(), message);
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

bool RateLimitedLog::Admit(absl::Time now, uint64_t* held_back, absl::Duration* over) {
  absl::MutexLock lock(&mu_);
  if (last_ != absl::InfinitePast() && now - last_ < interval_) {
    ++held_;
    ++suppressed_;
    return false;
  }
  *held_back = held_;
  *over = last_ == absl::InfinitePast() ? absl::ZeroDuration() : now - last_;
  held_ = 0;
  last_ = now;
  ++logged_;
  return true;
}

uint64_t RateLimitedLog::logged() const {
  absl::MutexLock lock(&mu_);
  return logged_;
}

uint64_t RateLimitedLog::suppressed() const {
  absl::MutexLock lock(&mu_);
  return suppressed_;
}

}  // namespace weightbus::internal
