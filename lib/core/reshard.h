// SPDX-License-Identifier: Apache-2.0
// Resharding on the subscribe side: from a version's source layout (which publisher rank owns
// which rectangular part of each tensor, at which bytes of its data) and one TP rank's
// placements (weightbus/placement.hpp), the transfer plan of byte ranges that assembles that
// rank's slices, and the executor that applies it to buffers. Pure computation: nothing here
// does I/O or keeps state except PlanCache, so every function may run on any thread at once
// (PlanCache is one object per caller). docs/RESHARDING.md describes the model.
//
// Errors come before any byte moves, and name the tensor, dimension, shapes, ranks and degrees:
//   InvalidArgument     the placements or rank are wrong whatever the layout (a degree that does
//                       not divide a dimension or a head count, a dimension out of range, a
//                       source of another dtype or shape than the fused placement needs)
//   NotFound            a source tensor a placement names is not in the layout
//   FailedPrecondition  the layout cannot serve valid placements: a slice no rank owns (gap),
//                       or overlapping owners under OverlapPolicy::kReject
//   DataLoss            the layout contradicts itself: ranks disagree on a tensor's dtype or
//                       global shape, a part lies outside the global shape, has the wrong byte
//                       size or an owner outside the group; overlapping owners whose checksums
//                       differ (CheckOverlapAgrees)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "weightbus/placement.hpp"
#include "weightbus/types.hpp"

namespace weightbus::internal {

// One rank's part of a tensor, as that rank describes it: the tensor's dtype and global shape
// (each rank's own claim, so that disagreement is detected), the part's offsets (elements, one
// per dimension; empty means all zero) and shape inside the global tensor, and where its
// contiguous row-major bytes lie in the owner's data (byte_offset, byte_size = ByteSize(dtype,
// shape)). A whole tensor is one part with shape = global_shape; a replicated one is a whole
// part on several owners.
struct SourcePart {
  int owner_rank = 0;
  DType dtype = DType::kF32;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
  std::vector<int64_t> shape;
  uint64_t byte_offset = 0;
  uint64_t byte_size = 0;
};

// A tensor of a version and its parts, in any order.
struct SourceTensor {
  std::string name;
  std::vector<SourcePart> parts;
};

// A version's layout: the publisher group's size (owner ranks are in [0, world_size)) and its
// tensors (names unique).
struct SourceLayout {
  int world_size = 1;
  std::vector<SourceTensor> tensors;
};

// A destination tensor and its placement.
struct TensorRequest {
  std::string name;
  Placement placement;
};

// The request for each of `names` (in order): the placement of the first rule whose pattern
// matches the name (fnmatch(3), no flags), Replicate when none does.
// Errors: InvalidArgument for an empty or duplicate name.
absl::StatusOr<std::vector<TensorRequest>> ResolvePlacements(absl::Span<const PlacementRule> rules,
                                                             absl::Span<const std::string> names);

// Copy `length` bytes at `source_offset` of owner `owner_rank`'s data (part `source_part` of
// source tensor `source_tensor`, indices into the SourceLayout) to `dest_offset` of the
// destination tensor's row-major bytes.
struct ByteRange {
  int owner_rank = 0;
  int source_tensor = 0;
  int source_part = 0;
  uint64_t source_offset = 0;
  uint64_t length = 0;
  uint64_t dest_offset = 0;
  friend bool operator==(const ByteRange&, const ByteRange&) = default;
};

// A region of a source tensor that two owners both hold, where the plan reads it from owner a:
// the caller must accept it only when both copies agree (CheckOverlapAgrees over the pairs of
// byte ranges). `offsets`/`shape` are elements of the global tensor; each range pairs bytes of
// owner a's data with the same elements in owner b's data.
struct Overlap {
  struct Range {
    uint64_t offset_a = 0;
    uint64_t offset_b = 0;
    uint64_t length = 0;
    friend bool operator==(const Range&, const Range&) = default;
  };
  std::string tensor;
  int source_tensor = 0;
  int part_a = 0, part_b = 0;  // indices into the tensor's parts
  int rank_a = 0, rank_b = 0;  // their owners
  std::vector<int64_t> offsets;
  std::vector<int64_t> shape;
  std::vector<Range> ranges;
};

// One destination tensor: its local dtype and shape (this rank's slice), nbytes of row-major
// bytes, and the ranges that fill them, sorted by dest_offset, disjoint, covering every byte,
// and merged wherever both sides are contiguous (a dim-0 slice is one range per source part it
// meets; a dim-1 slice one range per row).
struct TensorPlan {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  std::vector<ByteRange> ranges;
};

// The whole plan for one TP rank. Reusable for every version whose layout has the same
// LayoutFingerprint; `fingerprint` also covers the requests, the rank and the options.
struct ReshardPlan {
  std::vector<TensorPlan> tensors;  // in request order
  std::vector<Overlap> overlaps;    // empty under OverlapPolicy::kReject
  // Under AbsentPolicy::kSkip: the destinations none of whose sources the layout has, in
  // request order; they have no TensorPlan.
  std::vector<std::string> skipped;
  uint64_t layout_fingerprint = 0;
  uint64_t fingerprint = 0;

  // Bytes this rank receives in all (its slices), and of those from owner `rank`.
  uint64_t total_bytes() const;
  uint64_t BytesFrom(int owner_rank) const;
  size_t total_ranges() const;
};

// What to do when two owners hold the same elements that a plan reads.
enum class OverlapPolicy : uint8_t {
  kReject,  // FailedPrecondition naming the tensor, both ranks and the region
  kReport,  // read from one owner (rotating with the TP rank) and list every pair in
            // ReshardPlan::overlaps for the caller to verify before trusting the bytes
};

// What to do with a destination none of whose source tensors the layout has.
enum class AbsentPolicy : uint8_t {
  kError,  // NotFound naming the destination and the missing source
  kSkip,   // leave it out of the plan (ReshardPlan::skipped), as vLLM's load_weights leaves a
           // parameter the checkpoint does not name; a destination with some of its sources but
           // not all (q and k of a qkv_proj, not v) is still NotFound, and so is a plan that
           // would skip every requested destination
};

struct PlanOptions {
  OverlapPolicy overlaps = OverlapPolicy::kReject;
  AbsentPolicy absent = AbsentPolicy::kError;
};

// A cheap fingerprint (XXH3-64) of everything in `layout` that a plan depends on: names,
// dtypes, shapes, offsets, owners, byte offsets and sizes, world size. Equal fingerprints mean
// the same plan; it changes whenever the manifest's layout does.
uint64_t LayoutFingerprint(const SourceLayout& layout);

// The plan that gives `rank` the slices `requests` ask for from `layout`. Only the tensors the
// requests name are validated. Errors as the header comment says, before any byte moves.
absl::StatusOr<ReshardPlan> ComputePlan(const SourceLayout& layout,
                                        absl::Span<const TensorRequest> requests,
                                        TensorParallelRank rank, PlanOptions options = {});

// Applies `plan` for one tensor: copies each range from `rank_data[owner_rank]` (the owner's
// data, the byte space of SourcePart::byte_offset) into `dest` (the tensor's row-major bytes,
// plan.nbytes long). Checks every range against the buffers first and copies nothing when one
// does not fit. Not synchronised: the caller keeps the buffers alive and unwritten meanwhile.
// Errors: InvalidArgument naming the tensor, the rank, the range and the buffer's size.
absl::Status ApplyPlan(const TensorPlan& plan,
                       absl::Span<const absl::Span<const std::byte>> rank_data,
                       absl::Span<std::byte> dest);

// OK when the two owners' checksums of an overlap's bytes agree (the caller computes them over
// the overlap's ranges, or compares whole-part checksums for whole replicated parts); DataLoss
// naming the tensor, both ranks, the region and both checksums otherwise.
absl::Status CheckOverlapAgrees(const Overlap& overlap, uint64_t checksum_a, uint64_t checksum_b);

// Keeps the last plan and recomputes it only when the layout's fingerprint, the requests, the
// rank or the options change. Not thread-safe; one per subscriber rank.
class PlanCache {
 public:
  // The plan for these arguments, computed now or reused. The pointer stays valid until the
  // next call. Errors as ComputePlan (an error keeps no plan).
  absl::StatusOr<const ReshardPlan*> Get(const SourceLayout& layout,
                                         absl::Span<const TensorRequest> requests,
                                         TensorParallelRank rank, PlanOptions options = {});
  // How many times Get computed a plan.
  int computations() const { return computations_; }

 private:
  bool have_ = false;
  ReshardPlan plan_;
  int computations_ = 0;
};

}  // namespace weightbus::internal
