// SPDX-License-Identifier: Apache-2.0
// Loading and saving Hugging Face style safetensors checkpoints as whole files in memory, for the
// CLI and the demo (transports stream instead).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weightbus/manifest.hpp"
#include "weightbus/safetensors.hpp"
#include "weightbus/types.hpp"

namespace weightbus::tools {

// Every tensor of a checkpoint, with views into the loaded files.
struct Checkpoint {
  std::vector<safetensors::File> files;
  std::vector<TensorView> tensors;  // point into `files`; valid while this object lives
  std::vector<std::string> file_paths;
};

// Loads `path`: a .safetensors file, or a directory holding model.safetensors or
// model.safetensors.index.json with its shards. Tensor names must be unique across files.
// Errors: NotFound naming the path; DataLoss from the safetensors reader; InvalidArgument for a
// directory with no checkpoint.
absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& path);

// Writes `tensors` as `dir`/model.safetensors (created atomically) and, when `manifest` is
// given, `dir`/weightbus.manifest.json. Creates `dir` if needed.
absl::Status SaveCheckpoint(const std::string& dir, absl::Span<const TensorView> tensors,
                            const Manifest* manifest);

}  // namespace weightbus::tools
