// SPDX-License-Identifier: Apache-2.0
// How `weightbus-bench run --publishers N --tp M` splits the model: which part of each tensor a
// publisher rank owns (FSDP2-style row shards) and which slice a TP subscriber rank asks for
// (vLLM's column- and row-parallel placements), chosen from the store's shapes alone so that the
// parent, the publishers and the subscribers agree without talking.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "wbbench/store.h"
#include "weightbus/manifest.hpp"
#include "weightbus/placement.hpp"
#include "weightbus/types.hpp"

namespace weightbus::bench {

// The views rank `rank` of a group of `world` publishes from `base` (a version laid out as
// `index` says): a 2-D tensor whose rows divide by `world` as a row shard each, anything else
// whole by one rank (tensor i by rank i % world). world 1: every tensor whole.
std::vector<TensorView> RankViews(const StoreIndex& index, const std::byte* base, int rank,
                                  int world);

// The placement a TP group of `tp` gives `t`: o_proj/down_proj (row-parallel) on dimension 1
// and other matrices (column-parallel, the embedding) on dimension 0 when that dimension
// divides by `tp`, else the other one, else replicated; vectors replicated.
Placement TpPlacement(const StoredTensor& t, int tp);
// One exact-name rule per tensor.
std::vector<PlacementRule> TpRules(const StoreIndex& index, int tp);

// Rank `rank` of `tp`'s slice of tensor `t` of the version at `version_path`, row-major, read
// from the file (pread) without reading the rest of the tensor. Errors name the file.
absl::StatusOr<std::vector<std::byte>> ReadSlice(const std::string& version_path,
                                                 const StoredTensor& t, int rank, int tp);

// Bytes of one TP rank's slices (the same for every rank of the group), all tensors.
uint64_t SliceBytes(const StoreIndex& index, int tp);

// The bytes rank `rank` of `tp` must read of version `m` (its manifest, as received): for each
// published part its slices meet, the checksum tiles of the part that the slice's rectangle
// meets (docs/FORMAT.md, "Block checksums": the part's rows of its last dimension, cut into
// tiles of block_rows x block_bytes), the 1-D blocks its byte runs meet (format 1), or the whole
// part (no block checksums): computed here from boxes, independently of the library's planner.
uint64_t ExpectedReadBytes(const Manifest& m, const StoreIndex& index, int rank, int tp);

}  // namespace weightbus::bench
