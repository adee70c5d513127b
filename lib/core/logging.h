// SPDX-License-Identifier: Apache-2.0
// Minimal leveled logging to stderr. The threshold comes from WEIGHTBUS_LOG_LEVEL
// (error|warn|info|debug, default warn), read once. UCX's rule applies: log an error once, where
// it is first found; returned statuses carry the detail.
#pragma once

#include <string_view>

#include "absl/strings/str_format.h"

namespace weightbus::internal {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, std::string_view message);

template <typename... Args>
void Log(LogLevel level, const absl::FormatSpec<Args...>& format, const Args&... args) {
  if (LogEnabled(level)) LogLine(level, absl::StrFormat(format, args...));
}

}  // namespace weightbus::internal
