// SPDX-License-Identifier: Apache-2.0
// Training steps of the stories260K fixture for tests of the delta layer: version v is the
// fixture with a sparse, deterministic set of F32 elements changed in their lowest mantissa
// bits (one element in 64 of every tensor, at positions and by amounts that depend on v), so
// that consecutive versions differ as small learning-rate steps do (about 3% of the elements)
// and a process can rebuild any version from the fixture alone.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "weightbus/llama2c.h"

namespace weightbus::testing {

// Makes `model` (the converted fixture, F32, unchanged) version `version` of the steps.
inline void StepLlama(std::vector<tools::OwnedTensor>& model, uint64_t version) {
  for (size_t t = 0; t < model.size(); ++t) {
    std::vector<std::byte>& bytes = model[t].bytes;
    const size_t n = bytes.size() / 4;
    for (size_t i = (version * 7 + t) % 64; i < n; i += 64) {
      uint32_t x;
      std::memcpy(&x, bytes.data() + 4 * i, 4);
      x ^= static_cast<uint32_t>(version % 7 + 1);
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    }
  }
}

}  // namespace weightbus::testing
