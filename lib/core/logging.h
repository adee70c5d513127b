// SPDX-License-Identifier: Apache-2.0
// Minimal leveled logging to stderr. The threshold comes from WEIGHTBUS_LOG_LEVEL
// (error|warn|info|debug, default warn), read once. UCX's rule applies: log an error once, where
// it is first found; returned statuses carry the detail.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace weightbus::internal {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, std::string_view message);

template <typename... Args>
void Log(LogLevel level, const absl::FormatSpec<Args...>& format, const Args&... args) {
  if (LogEnabled(level)) LogLine(level, absl::StrFormat(format, args...));
}

// One call site's repeated message, logged at most once per `interval`: the first occurrence at
// once, later ones within the interval only counted, and the next line that goes out ends with
// how many were held back ("(1234 more like this in the last 10s)"). For what a peer or the
// system can repeat at will (a malformed message per connection, `accept` failing at the fd
// limit), so that it cannot flood stderr. A line whose level is disabled is neither logged nor
// counted. Thread-safe; typically a member or a function-local static of the code that logs.
class RateLimitedLog {
 public:
  static constexpr absl::Duration kDefaultInterval = absl::Seconds(10);
  explicit RateLimitedLog(absl::Duration interval = kDefaultInterval) : interval_(interval) {}
  RateLimitedLog(const RateLimitedLog&) = delete;
  RateLimitedLog& operator=(const RateLimitedLog&) = delete;

  template <typename... Args>
  void Log(LogLevel level, const absl::FormatSpec<Args...>& format, const Args&... args) {
    if (!LogEnabled(level)) return;
    uint64_t held_back = 0;
    absl::Duration over;
    if (!Admit(absl::Now(), &held_back, &over)) return;
    std::string line = absl::StrFormat(format, args...);
    if (held_back > 0) {
      absl::StrAppendFormat(&line, " (%d more like this in the last %s)", held_back,
                            absl::FormatDuration(absl::Trunc(over, absl::Seconds(1))));
    }
    LogLine(level, line);
  }

  // Whether a line may go out at `now`. When it may, `*held_back` is the number of lines held
  // back since the previous one went out and `*over` the time since then.
  bool Admit(absl::Time now, uint64_t* held_back, absl::Duration* over);

  // Lines let out and lines held back so far.
  uint64_t logged() const;
  uint64_t suppressed() const;

 private:
  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t held_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t logged_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightbus::internal
