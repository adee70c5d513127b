// SPDX-License-Identifier: Apache-2.0
// A deterministic synthetic model for tests: the same (seed, version) always gives the same
// tensors, so a subscriber process can check what it received against its own copy.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weightbus/types.hpp"

namespace weightbus::testing {

struct OwnedTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;  // contiguous row-major
  TensorView View() const;
};

// Tensors covering every dtype and edge shape (0-d, zero-size, odd sizes, a long non-ASCII name),
// scaled so the whole version has roughly `approx_bytes` bytes (at least a few KiB).
std::vector<OwnedTensor> MakeVersion(uint64_t seed, uint64_t version, uint64_t approx_bytes);

// The same tensors changing as a training run's do: version 1 is MakeVersion(seed, 1, ...), and
// every later version is version 1 with the lowest bit flipped in about 1/256 of each tensor's
// bytes (at least one byte of every tensor with bytes), at positions drawn from (seed, version).
// Versions v - 1 and v therefore differ in about 1/128 of their bytes: a delta between them is
// a small fraction of a version, and any version can be made without the ones before it.
std::vector<OwnedTensor> MakeDriftVersion(uint64_t seed, uint64_t version, uint64_t approx_bytes);

std::vector<TensorView> Views(const std::vector<OwnedTensor>& tensors);

}  // namespace weightbus::testing
