// SPDX-License-Identifier: Apache-2.0
// Status helpers used across the library: propagation macros and errno conversion.
#pragma once

#include <cerrno>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define WB_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status wb_status_ = (expr);      \
    if (!wb_status_.ok()) return wb_status_; \
  } while (0)

#define WB_STATUS_CONCAT_INNER_(a, b) a##b
#define WB_STATUS_CONCAT_(a, b) WB_STATUS_CONCAT_INNER_(a, b)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error.
#define WB_ASSIGN_OR_RETURN(lhs, expr) \
  WB_ASSIGN_OR_RETURN_IMPL_(WB_STATUS_CONCAT_(wb_statusor_, __LINE__), lhs, expr)
#define WB_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return std::move(tmp).status();  \
  lhs = std::move(tmp).value()

namespace weightbus::internal {

// The absl::StatusCode that best describes `err` (an errno value): ENOENT -> NotFound,
// EACCES/EPERM -> PermissionDenied, ENOSPC/EDQUOT/ENOMEM -> ResourceExhausted,
// ETIMEDOUT -> DeadlineExceeded, EEXIST -> AlreadyExists, others -> Internal.
absl::StatusCode ErrnoToCode(int err);

// A status of ErrnoToCode(err) whose message is `what` followed by ": " and strerror(err).
absl::Status ErrnoStatus(int err, std::string what);

// Returns `status` with `prefix + ": "` put in front of its message (same code). OK stays OK.
absl::Status Annotate(const absl::Status& status, std::string_view prefix);

}  // namespace weightbus::internal
