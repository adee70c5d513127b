// SPDX-License-Identifier: Apache-2.0
// The versions a run publishes, generated once by the parent before any transport runs and read
// by every publisher and subscriber process: DIR/index.json plus DIR/v<N>.bin, each version's
// tensors back to back (64-byte aligned offsets), with the XXH3-64 of every tensor computed here
// with libxxhash, independently of the library's own checksums.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weightbus/types.hpp"

namespace weightbus::bench {

struct StoredTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};

struct StoreIndex {
  std::vector<StoredTensor> tensors;
  uint64_t file_bytes = 0;                  // size of each v<N>.bin
  uint64_t tensor_bytes = 0;                // sum of nbytes
  std::vector<std::vector<uint64_t>> xxh3;  // [version - 1][tensor]
  std::vector<double> changed_fraction;     // [version - 1]

  std::string VersionPath(const std::string& dir, uint64_t version) const;
  // Views of `base` (a buffer of file_bytes bytes laid out as the index says).
  std::vector<TensorView> Views(const std::byte* base) const;
};

absl::Status WriteIndex(const std::string& dir, const StoreIndex& index);
absl::StatusOr<StoreIndex> ReadIndex(const std::string& dir);

// XXH3-64 (seed 0) with libxxhash.
uint64_t Hash(const void* data, size_t n);

// Reads the whole file at `path` into `out` (which must hold its size). Errors name the file.
absl::Status ReadWhole(const std::string& path, std::byte* out, uint64_t size);

}  // namespace weightbus::bench
