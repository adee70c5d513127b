// SPDX-License-Identifier: Apache-2.0
// Synthetic models with the tensor names and shapes of a real one (the standard workload is
// ../shared/fixtures/qwen2.5-0.5b-shapes.json: Qwen2.5-0.5B, 290 tensors, 494M parameters),
// initialised as the fixture says: weights of linear layers and embeddings ~ Normal(0, 0.02),
// biases 0, RMSNorm weights 1.0. Deterministic for a given seed; filled in parallel.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weightbus/llama2c.h"

namespace weightbus::tools {

struct ShapeSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Reads {"tensors": {name: shape, ...}} from a shapes file, in file order.
// Errors: NotFound for a missing file, DataLoss naming the file for malformed JSON.
absl::StatusOr<std::vector<ShapeSpec>> ReadShapes(const std::string& path);

// Scales every shape's first dimension by `fraction` (at least 1 row), so tests and quick
// benchmarks can use the same names and layout at a smaller size.
std::vector<ShapeSpec> ScaleShapes(std::vector<ShapeSpec> shapes, double fraction);

// Tensors of `shapes` in `dtype` (F32 or BF16), initialised as described above, using up to
// `threads` threads. Errors: InvalidArgument for another dtype.
absl::StatusOr<std::vector<OwnedTensor>> MakeSyntheticModel(const std::vector<ShapeSpec>& shapes,
                                                            DType dtype, uint64_t seed,
                                                            int threads = 2);

}  // namespace weightbus::tools
