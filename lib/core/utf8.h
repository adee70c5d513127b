// SPDX-License-Identifier: Apache-2.0
// UTF-8 validation, for every text that crosses a format boundary: tensor names and metadata
// published through the API, safetensors headers, names and metadata read from files.
// Strict RFC 3629: no overlong forms, no UTF-16 surrogates (U+D800..U+DFFF), nothing above
// U+10FFFF. NUL bytes are valid UTF-8 (callers that refuse them say so themselves).
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace weightbus::internal {

// Where and why a text is not UTF-8.
struct Utf8Error {
  size_t offset = 0;        // of the first byte of the offending sequence
  const char* reason = "";  // e.g. "overlong encoding", "truncated multi-byte sequence"
};

// The first invalid sequence of `s`, or nullopt when `s` is valid UTF-8. Thread-safe.
std::optional<Utf8Error> FindInvalidUtf8(std::string_view s);

// True when `s` is valid UTF-8; on failure `*bad_offset` (if given) receives the offset of the
// first byte of the offending sequence.
bool IsValidUtf8(std::string_view s, size_t* bad_offset = nullptr);

}  // namespace weightbus::internal
