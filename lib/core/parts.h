// SPDX-License-Identifier: Apache-2.0
// The parts of a group version (Manifest::group): checking that the ranks' parts fit together
// into whole tensors, and which part goes where when a subscriber assembles them. The one home
// of these rules: the disk group commit checks them before a version becomes visible, and the
// subscriber again before any byte moves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weightbus/manifest.hpp"

namespace weightbus::internal {

// One tensor of a group version as a whole-model subscriber receives it.
struct AssembledTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // the global shape
  uint64_t nbytes = 0;         // of the whole tensor, contiguous row-major
  // Indices (into the manifest's tensors) of the parts to read, one per slice: of replicated
  // parts (the same slice from several ranks, equal checksums) only the first listed, and no
  // part without elements.
  std::vector<size_t> parts;
};

// Checks the parts of a group version of `world_size` ranks and returns its tensors in order
// of first appearance. Rules: every owner is a rank below world_size; the parts of one name
// agree on dtype and global shape (a part without a Shard is the whole tensor); each part lies
// inside its global shape; parts overlap only as replicas (the same slice with the same
// checksum); and together they cover every element (no gaps). Sub-byte tensors (F4, F6_*) may
// be split only into byte-aligned contiguous runs.
// Errors: InvalidArgument naming the tensor, the ranks, their shapes and offsets (the caller
// turns it into DataLoss for a manifest read from a channel).
absl::StatusOr<std::vector<AssembledTensor>> AssembleParts(const std::vector<TensorInfo>& parts,
                                                           int world_size);

// The manifest of group version `version` from its ranks' parts (parts[r]: rank r's part, its
// tensors owned by r): every rank's tensors in rank order, the metadata of all (a key several
// ranks give must have one value; each part's own MAC, weightbus.mac, is left out), the earliest
// publish start and the latest seal, and
// `publisher` of rank `committer`; checked with AssembleParts. The one home of how a group
// version is put together (disk's and ucx's group commits).
// Errors: InvalidArgument naming a metadata key with both values and ranks, or AssembleParts'.
absl::StatusOr<Manifest> MergeGroupParts(uint64_t version, const std::vector<Manifest>& parts,
                                         int committer);

// The shape of the tensor `part` is a slice of, and where the slice starts (zeros without a
// Shard).
const std::vector<int64_t>& GlobalShape(const TensorInfo& part);
std::vector<int64_t> Offsets(const TensorInfo& part);

// The byte offset of `part` inside its whole tensor's row-major bytes when the part is one
// contiguous run of them (a whole tensor, a slice of whole rows such as an FSDP dim-0 shard),
// else nullopt (e.g. a column slice, which is scattered with row-major strides).
std::optional<uint64_t> ContiguousOffset(const TensorInfo& part);

// Row-major strides (elements) of `shape`.
std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& shape);

}  // namespace weightbus::internal
