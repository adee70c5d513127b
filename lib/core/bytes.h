// SPDX-License-Identifier: Apache-2.0
// Byte codecs of every binary format of the library: little-endian fixed-width integers and
// unsigned LEB128 varints (docs/FORMAT.md: the ucx:// control messages, the delta codec's
// version header and records, the delta fingerprint, the safetensors length prefix). Writers
// append to a std::string or a std::vector<std::byte>; ByteReader reads a bounds-checked span.
// Every multi-byte integer of those formats is little-endian whatever the host's byte order.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace weightbus::internal {
namespace bytes_internal {
template <typename T>
constexpr T ToFromLittleEndian(T v) {
  if constexpr (std::endian::native == std::endian::little || sizeof(T) == 1) {
    return v;
  } else if constexpr (sizeof(T) == 2) {
    return __builtin_bswap16(v);
  } else if constexpr (sizeof(T) == 4) {
    return __builtin_bswap32(v);
  } else {
    return __builtin_bswap64(v);
  }
}
}  // namespace bytes_internal

// The unsigned integer stored little-endian in the sizeof(T) bytes at `p` (any alignment).
template <typename T>
T LoadLe(const void* p) {
  static_assert(std::is_unsigned_v<T>);
  T v;
  std::memcpy(&v, p, sizeof(T));
  return bytes_internal::ToFromLittleEndian(v);
}

// Stores `v` little-endian in the sizeof(T) bytes at `p` (any alignment).
template <typename T>
void StoreLe(T v, void* p) {
  static_assert(std::is_unsigned_v<T>);
  v = bytes_internal::ToFromLittleEndian(v);
  std::memcpy(p, &v, sizeof(T));
}

// Bytes of `v` as an unsigned LEB128 varint: 1 (below 128) to 10.
constexpr size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Appending to `Buffer`, a std::string or a std::vector<std::byte> (anything with push_back and
// insert of its char-sized elements). Not thread-safe; the buffer stays the caller's.
template <typename Buffer>
class BasicByteWriter {
 public:
  explicit BasicByteWriter(Buffer* out) : out_(out) {}

  BasicByteWriter& U8(uint8_t v) {
    out_->push_back(static_cast<typename Buffer::value_type>(v));
    return *this;
  }
  BasicByteWriter& U32(uint32_t v) { return Fixed(v); }
  BasicByteWriter& U64(uint64_t v) { return Fixed(v); }
  // Unsigned LEB128: 7 bits a byte, least significant first, the high bit set on all but the last.
  BasicByteWriter& Varint(uint64_t v) {
    while (v >= 0x80) {
      U8(static_cast<uint8_t>(v) | 0x80);
      v >>= 7;
    }
    return U8(static_cast<uint8_t>(v));
  }
  // `n` bytes at `data` as they are (no length prefix).
  BasicByteWriter& Bytes(const void* data, size_t n) {
    const auto* p = static_cast<const typename Buffer::value_type*>(data);
    out_->insert(out_->end(), p, p + n);  // no zero-filling first, unlike resize
    return *this;
  }
  BasicByteWriter& Bytes(std::string_view s) { return Bytes(s.data(), s.size()); }

  Buffer& buffer() { return *out_; }

 private:
  template <typename T>
  BasicByteWriter& Fixed(T v) {
    char bytes[sizeof(T)];
    StoreLe(v, bytes);
    return Bytes(bytes, sizeof(T));
  }
  Buffer* out_;
};

using ByteWriter = BasicByteWriter<std::string>;
using ByteVectorWriter = BasicByteWriter<std::vector<std::byte>>;

// Bounds-checked reading of a byte span. Every read names what it reads (`what`, e.g. "the chunk
// count"); a failure is DataLoss naming it ("truncated before the chunk count", "the record size
// is not a valid varint", "the blob needs 9 bytes but only 4 remain"). The first failure sticks:
// later reads fail with it too, so a caller may also read a whole message and check status()
// once. Not thread-safe; the bytes must outlive the reader.
class ByteReader {
 public:
  ByteReader(const void* data, size_t n) : p_(static_cast<const std::byte*>(data)), end_(p_ + n) {}
  explicit ByteReader(std::string_view bytes) : ByteReader(bytes.data(), bytes.size()) {}

  size_t remaining() const { return static_cast<size_t>(end_ - p_); }
  bool at_end() const { return p_ == end_; }
  const std::byte* position() const { return p_; }
  // OK, or the first failure.
  const absl::Status& status() const { return status_; }

  absl::StatusOr<uint8_t> U8(std::string_view what) { return Fixed<uint8_t>(what); }
  absl::StatusOr<uint32_t> U32(std::string_view what) { return Fixed<uint32_t>(what); }
  absl::StatusOr<uint64_t> U64(std::string_view what) { return Fixed<uint64_t>(what); }
  // An unsigned LEB128 varint of at most 64 bits (10 bytes; the 10th may only be 0 or 1).
  absl::StatusOr<uint64_t> Varint(std::string_view what);
  // The next `n` bytes, in place.
  absl::StatusOr<const std::byte*> Bytes(uint64_t n, std::string_view what);
  // The next `n` bytes as text, in place.
  absl::StatusOr<std::string_view> View(uint64_t n, std::string_view what);

 private:
  template <typename T>
  absl::StatusOr<T> Fixed(std::string_view what) {
    if (!status_.ok()) return status_;
    if (remaining() < sizeof(T)) return Truncated(what);
    const T v = LoadLe<T>(p_);
    p_ += sizeof(T);
    return v;
  }
  absl::Status Truncated(std::string_view what);
  absl::Status Fail(absl::Status s);

  const std::byte* p_;
  const std::byte* end_;
  absl::Status status_;
};

}  // namespace weightbus::internal
