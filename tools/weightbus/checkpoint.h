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

// Keys of model.safetensors' __metadata__ that tie it to its weightbus.manifest.json.
inline constexpr char kVersionKey[] = "weightbus.version";
inline constexpr char kManifestHashKey[] = "weightbus.manifest_xxh3";  // of the file's bytes

// Writes `tensors` as `dir`/model.safetensors (created atomically) and, when `manifest` is
// given, `dir`/weightbus.manifest.json (atomically, after the model). The two cannot be replaced
// together by one rename, so the model's metadata records the manifest's version and the XXH3-64
// of its bytes: a pair left by a writer killed between the two renames (new model, previous
// manifest) is detected by VerifyCheckpointPair. Creates `dir` if needed.
absl::Status SaveCheckpoint(const std::string& dir, absl::Span<const TensorView> tensors,
                            const Manifest* manifest);

// DataLoss naming both files and both versions when `model` (whose header records a manifest
// hash) was written with a different manifest than `manifest_json`; OK when it matches or the
// model records none.
absl::Status VerifyCheckpointPair(const safetensors::Header& model, const std::string& model_path,
                                  const std::string& manifest_json,
                                  const std::string& manifest_path, uint64_t manifest_version);

}  // namespace weightbus::tools
