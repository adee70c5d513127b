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

std::vector<TensorView> Views(const std::vector<OwnedTensor>& tensors);

}  // namespace weightbus::testing
