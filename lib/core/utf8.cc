// SPDX-License-Identifier: Apache-2.0
#include "core/utf8.h"

#include <cstdint>
#include <cstring>

namespace weightbus::internal {

// Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF.
std::optional<Utf8Error> FindInvalidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, p + i, 8);
      if (word & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf;  // allowed range of the second byte
    const char* range_reason = "";
    if (c < 0xc2) {
      if (c < 0xc0) return Utf8Error{i, "unexpected continuation byte"};
      return Utf8Error{i, "overlong encoding"};
    } else if (c < 0xe0) {
      len = 2;
    } else if (c < 0xf0) {
      len = 3;
      if (c == 0xe0) {
        lo = 0xa0;
        range_reason = "overlong encoding";
      } else if (c == 0xed) {
        hi = 0x9f;
        range_reason = "UTF-16 surrogate code point";
      }
    } else if (c < 0xf5) {
      len = 4;
      if (c == 0xf0) {
        lo = 0x90;
        range_reason = "overlong encoding";
      } else if (c == 0xf4) {
        hi = 0x8f;
        range_reason = "code point above U+10FFFF";
      }
    } else {
      return Utf8Error{i, "code point above U+10FFFF or invalid lead byte"};
    }
    if (i + len > n) return Utf8Error{i, "truncated multi-byte sequence"};
    const unsigned char c1 = p[i + 1];
    if (c1 < 0x80 || c1 > 0xbf) return Utf8Error{i, "missing continuation byte"};
    if (c1 < lo || c1 > hi) return Utf8Error{i, range_reason};
    for (size_t k = 2; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return Utf8Error{i, "missing continuation byte"};
    }
    i += len;
  }
  return std::nullopt;
}

bool IsValidUtf8(std::string_view s, size_t* bad_offset) {
  const std::optional<Utf8Error> bad = FindInvalidUtf8(s);
  if (bad && bad_offset != nullptr) *bad_offset = bad->offset;
  return !bad;
}

}  // namespace weightbus::internal
