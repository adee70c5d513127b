// SPDX-License-Identifier: Apache-2.0
// What the fuzz targets share: an invariant check that aborts with a message (libFuzzer and the
// replay drivers both report an abort as a failure, with the input), and the check that a
// refusal is the documented status naming its source.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace weightbus::fuzz {

inline void CheckBytes(bool ok, const char* target, const char* what, const char* detail,
                       size_t size) {
  if (ok) return;
  std::fprintf(stderr, "%s: invariant violated: %s %.*s\n", target, what, static_cast<int>(size),
               detail);
  std::fflush(stderr);
  std::abort();
}
inline void Check(bool ok, const char* target, const char* what, const char* detail = "") {
  CheckBytes(ok, target, what, detail, std::strlen(detail));
}
inline void Check(bool ok, const char* target, const char* what, const std::string& detail) {
  CheckBytes(ok, target, what, detail.data(), detail.size());
}
inline void Check(bool ok, const char* target, const char* what, std::string_view detail) {
  CheckBytes(ok, target, what, detail.data(), detail.size());
}
// (Debian's Abseil has a string_view type of its own: the messages of absl::Status are one.)
inline void Check(bool ok, const char* target, const char* what, absl::string_view detail) {
  CheckBytes(ok, target, what, detail.data(), detail.size());
}

// `s` is not OK, has code `code` and a message containing `needle` (the source it names, or
// the message kind).
inline void CheckRefusal(const absl::Status& s, absl::StatusCode code, std::string_view needle,
                         const char* target) {
  const std::string text = s.ToString();
  Check(!s.ok() && s.code() == code, target, "refused with an unexpected code:", text);
  Check(text.find(needle) != std::string::npos, target, "refusal does not name", text);
}

}  // namespace weightbus::fuzz
