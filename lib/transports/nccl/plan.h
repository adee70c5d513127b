// SPDX-License-Identifier: Apache-2.0
// The bucket plan of one nccl:// version: which bytes of which tensors travel in which
// fixed-size GPU bucket, and where in the bucket. The publisher makes it (PlanBuckets) and sends
// it with the manifest in the OFFER (protocol.h); replicas check it against the manifest
// (CheckPlan) and follow it, never inferring one of their own.
//
// Tensors are laid out in manifest order. Every piece starts at a multiple of the plan's
// alignment inside its bucket (kPieceAlignment: the CUDA allocation granularity, so that copies
// into and out of a bucket run at full speed); a tensor that does not fit in what is left of a
// bucket continues in the next one (a tensor larger than a bucket spans several); a tensor
// without bytes has no piece. A bucket carries `bytes` bytes: the end of its last piece (the
// last bucket is usually shorter than bucket_size).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "weightbus/manifest.hpp"

namespace weightbus::internal::nccl {

inline constexpr uint64_t kPieceAlignment = 256;
// Most buckets and pieces a received plan may have (a hostile or corrupt OFFER is refused
// before anything is sized by it): 2^24 buckets of at least 1 byte, and one piece per tensor and
// bucket boundary.
inline constexpr uint64_t kMaxBuckets = uint64_t{1} << 24;

struct Piece {
  uint32_t tensor = 0;         // index into the manifest's tensors
  uint64_t tensor_offset = 0;  // bytes into the tensor's contiguous row-major image
  uint64_t bucket_offset = 0;  // bytes into the bucket
  uint64_t length = 0;         // > 0
  friend bool operator==(const Piece&, const Piece&) = default;
};

struct Bucket {
  uint64_t bytes = 0;  // broadcast size: the end of its last piece
  std::vector<Piece> pieces;
  friend bool operator==(const Bucket&, const Bucket&) = default;
};

struct BucketPlan {
  uint64_t bucket_size = 0;  // every bucket's buffer size (bytes <= bucket_size)
  uint64_t alignment = kPieceAlignment;
  std::vector<Bucket> buckets;
  friend bool operator==(const BucketPlan&, const BucketPlan&) = default;

  // Sum of the buckets' bytes (what each broadcast moves, alignment padding included).
  uint64_t WireBytes() const;
};

// Lays tensors of `nbytes` (in manifest order) out in buckets of `bucket_size` bytes (a
// multiple of `alignment`, which is a power of two). Zero-byte tensors get no piece.
// Errors: InvalidArgument when bucket_size is 0 or not a multiple of alignment.
absl::StatusOr<BucketPlan> PlanBuckets(const std::vector<uint64_t>& nbytes, uint64_t bucket_size,
                                       uint64_t alignment = kPieceAlignment);

// The plan for `manifest`'s tensors.
absl::StatusOr<BucketPlan> PlanBucketsFor(const Manifest& manifest, uint64_t bucket_size);

// Checks a received plan against the manifest it came with: bucket_size and alignment sane,
// at most kMaxBuckets buckets, every piece inside its bucket and its tensor, pieces of a bucket
// in order without overlap, each bucket's bytes the end of its last piece, and every tensor's
// bytes covered exactly once, in order. Errors: DataLoss naming the bucket, the piece, the
// tensor and what is wrong.
absl::Status CheckPlan(const BucketPlan& plan, const Manifest& manifest);

// For each bucket, the tensors whose last byte travels in it (a tensor has landed once its last
// bucket has): what a replica reports to the core after each bucket. Tensors without bytes are
// in none.
std::vector<std::vector<uint32_t>> TensorsCompletedBy(const BucketPlan& plan);

// Binary form, inside the OFFER message (protocol.h): bucket_size u64, alignment u64, bucket
// count u32, then per bucket: bytes u64, piece count u32, then per piece: tensor u32,
// tensor_offset u64, bucket_offset u64, length u64. Little-endian.
std::string EncodePlan(const BucketPlan& plan);
// Errors: DataLoss for a truncated or oversized encoding (naming the field and the claim),
// before anything is allocated for what it claims.
absl::StatusOr<BucketPlan> DecodePlan(std::string_view bytes);

// "12 buckets of 256 MiB (3.0 GB in all)".
std::string DescribePlan(const BucketPlan& plan);

}  // namespace weightbus::internal::nccl
