// SPDX-License-Identifier: Apache-2.0
#include "core/status.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace weightbus::internal {

absl::StatusCode ErrnoToCode(int err) {
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::StatusCode::kPermissionDenied;
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EFBIG:
      return absl::StatusCode::kResourceExhausted;
    case ETIMEDOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case EEXIST:
      return absl::StatusCode::kAlreadyExists;
    case EINVAL:
      return absl::StatusCode::kInvalidArgument;
    case ECONNREFUSED:
    case ECONNRESET:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case EPIPE:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status ErrnoStatus(int err, std::string what) {
  char buf[256];
  // GNU strerror_r returns the message pointer (which may or may not be `buf`).
  const char* text = strerror_r(err, buf, sizeof(buf));
  return absl::Status(ErrnoToCode(err), absl::StrCat(what, ": ", text, " (errno ", err, ")"));
}

absl::Status Annotate(const absl::Status& status, std::string_view prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(absl::string_view(prefix.data(), prefix.size()),
                                                  ": ", status.message()));
}

}  // namespace weightbus::internal
