// SPDX-License-Identifier: Apache-2.0
#include "core/bytes.h"

#include "absl/strings/str_format.h"

namespace weightbus::internal {

absl::Status ByteReader::Fail(absl::Status s) {
  if (status_.ok()) status_ = std::move(s);
  p_ = end_;  // nothing more is read after a failure
  return status_;
}

absl::StatusOr<uint64_t> ByteReader::Varint(std::string_view what) {
  if (!status_.ok()) return status_;
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (p_ == end_) return Truncated(what);
    const uint8_t b = static_cast<uint8_t>(*p_++);
    if (shift == 63 && b > 1) break;
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) return v;
  }
  return Fail(absl::DataLossError(absl::StrFormat("%s is not a valid varint", what)));
}

absl::StatusOr<const std::byte*> ByteReader::Bytes(uint64_t n, std::string_view what) {
  if (!status_.ok()) return status_;
  if (n > remaining()) {
    return Fail(absl::DataLossError(
        absl::StrFormat("%s needs %d bytes but only %d remain", what, n, remaining())));
  }
  const std::byte* at = p_;
  p_ += n;
  return at;
}

absl::Status ByteReader::Truncated(std::string_view what) {
  return Fail(absl::DataLossError(absl::StrFormat("truncated before %s", what)));
}

absl::StatusOr<std::string_view> ByteReader::View(uint64_t n, std::string_view what) {
  absl::StatusOr<const std::byte*> p = Bytes(n, what);
  if (!p.ok()) return p.status();
  return std::string_view(reinterpret_cast<const char*>(*p), n);
}

}  // namespace weightbus::internal
