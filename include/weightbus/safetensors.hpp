// SPDX-License-Identifier: Apache-2.0
// Reader and writer for the safetensors format, following the specification in
// https://github.com/huggingface/safetensors (README "Format"):
//
//   [8 bytes: N, little-endian uint64][N bytes: UTF-8 JSON header][data region]
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} with
// offsets relative to the start of the data region, plus an optional "__metadata__" object of
// string to string. The offsets of all tensors must cover the data region exactly: no holes,
// no overlaps, nothing after the last tensor.
//
// Thread safety: all functions are reentrant; no shared state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "weightbus/export.h"
#include "weightbus/manifest.hpp"
#include "weightbus/types.hpp"

namespace weightbus::safetensors {

// Largest header accepted, as in the reference implementation (100,000,000 bytes).
inline constexpr uint64_t kMaxHeaderSize = 100'000'000;

// One tensor as declared by a header.
struct Entry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets[0]: byte offset from the start of the data region
  uint64_t end = 0;    // data_offsets[1]: one past the last byte
  uint64_t nbytes() const { return end - begin; }
};

// A validated header.
struct WB_EXPORT Header {
  uint64_t header_size = 0;    // N: JSON bytes including any trailing space padding
  uint64_t data_start = 0;     // 8 + N: file offset of the data region
  uint64_t data_size = 0;      // bytes in the data region
  Metadata metadata;           // "__metadata__", empty when absent
  std::vector<Entry> tensors;  // in the header's order

  // The entry named `name`, or nullptr. Linear time.
  const Entry* Find(std::string_view name) const;
};

// Parses and validates a header against every rule of the format. `prefix` holds the file's
// first bytes (at least the 8-byte length and the N header bytes); `file_size` is the size of
// the whole file in bytes; `source` names the file in messages.
//
// Errors (all DataLoss, one distinct message per rule, each naming `source` and, where one is
// involved, the tensor): file shorter than 8 bytes; header length beyond the file or above
// kMaxHeaderSize; header not valid UTF-8 (with the byte offset); header not a JSON object;
// duplicate tensor names; more than kMaxTensors tensors; a name longer than kMaxTensorNameBytes;
// a shape of rank above kMaxRank (types.hpp); missing or ill-typed fields; unknown dtype;
// negative dimension; a shape whose byte size overflows 64 bits;
// data_offsets with begin > end; byte size not equal to dtype size x element count; offsets
// beyond the data region; overlapping offsets; a hole between tensors; bytes after the last
// tensor; "__metadata__" not an object of strings.
WB_EXPORT absl::StatusOr<Header> ParseHeader(std::string_view prefix, uint64_t file_size,
                                             std::string_view source);

// Reads (pread) and validates the header of an open file of `file_size` bytes.
// Errors: as ParseHeader, plus the errno text of a failed read (Internal) naming `source`.
WB_EXPORT absl::StatusOr<Header> ReadHeader(int fd, uint64_t file_size, std::string_view source);

// Opens `path` and reads its header. Errors: NotFound / PermissionDenied naming the path, or as
// ReadHeader.
WB_EXPORT absl::StatusOr<Header> ReadHeader(const std::string& path);

// What the writer needs to know of a tensor.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

// Where each tensor goes in a file about to be written.
struct Layout {
  // The first data_start bytes of the file: the 8-byte length and the JSON header, padded with
  // spaces so that the data region starts at a multiple of 8 bytes.
  std::string prefix;
  uint64_t data_start = 0;      // == prefix.size()
  uint64_t data_size = 0;       // bytes in the data region
  std::vector<uint64_t> begin;  // per input tensor: offset in the data region
  uint64_t file_size() const { return data_start + data_size; }
};

// Plans a file holding `tensors` (in any order) and `metadata`. Data is ordered by element size,
// largest first, keeping the input order among equal sizes, so that every tensor starts at a
// multiple of its element size (as the reference writer does). Header keys appear in data
// order after "__metadata__" (omitted when `metadata` is empty).
// Errors: InvalidArgument for an empty, non-UTF-8 or duplicate name, the reserved name
// "__metadata__", a negative dimension, a size overflow, or one of the limits of types.hpp
// (kMaxTensors, kMaxTensorNameBytes, kMaxRank).
WB_EXPORT absl::StatusOr<Layout> PlanFile(absl::Span<const TensorSpec> tensors,
                                          const Metadata& metadata);

// A whole file read into memory (for tools and tests; transports stream instead).
struct WB_EXPORT File {
  Header header;
  std::string data;  // the data region, header.data_size bytes
  // The bytes of `entry` (which must belong to `header`).
  std::span<const std::byte> Bytes(const Entry& entry) const;
};

// Reads and validates a whole file, including that its size matches the header exactly.
// Errors: as ReadHeader.
WB_EXPORT absl::StatusOr<File> ReadFile(const std::string& path);

// Parses a whole file held in memory (`bytes` is the complete file). Used by fuzzing and tests.
WB_EXPORT absl::StatusOr<File> ParseFile(std::string_view bytes, std::string_view source);

// Writes `tensors` (packing non-contiguous views) and `metadata` to `path` with plain writes,
// through a temporary file in the same directory (`<path>.tmp.<host>.<pid>`) that is fsynced and
// renamed into place, so a crash never leaves a partial file at `path`; temporaries that killed
// processes of this host left next to `path` are removed first. CPU tensors only.
// Errors: InvalidArgument as PlanFile or for a non-CPU tensor; the errno text of a failed
// open/write/fsync/rename (ResourceExhausted for ENOSPC, Internal otherwise) naming the path.
WB_EXPORT absl::Status WriteFile(const std::string& path, absl::Span<const TensorView> tensors,
                                 const Metadata& metadata);

}  // namespace weightbus::safetensors
