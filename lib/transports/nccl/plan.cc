// SPDX-License-Identifier: Apache-2.0
#include "transports/nccl/plan.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/bytes.h"
#include "core/control_plane.h"

namespace weightbus::internal::nccl {
namespace {

uint64_t AlignUp(uint64_t n, uint64_t alignment) { return (n + alignment - 1) & ~(alignment - 1); }

bool IsPowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

std::string Size(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 30) && bytes % (uint64_t{1} << 30) == 0) {
    return absl::StrFormat("%d GiB", bytes >> 30);
  }
  if (bytes >= (uint64_t{1} << 20) && bytes % (uint64_t{1} << 20) == 0) {
    return absl::StrFormat("%d MiB", bytes >> 20);
  }
  if (bytes >= (uint64_t{1} << 10) && bytes % (uint64_t{1} << 10) == 0) {
    return absl::StrFormat("%d KiB", bytes >> 10);
  }
  return absl::StrFormat("%d bytes", bytes);
}

}  // namespace

uint64_t BucketPlan::WireBytes() const {
  uint64_t n = 0;
  for (const Bucket& b : buckets) n += b.bytes;
  return n;
}

absl::StatusOr<BucketPlan> PlanBuckets(const std::vector<uint64_t>& nbytes, uint64_t bucket_size,
                                       uint64_t alignment) {
  if (!IsPowerOfTwo(alignment)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bucket alignment %d is not a power of two", alignment));
  }
  if (bucket_size == 0 || bucket_size % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bucket size %d is not a positive multiple of %d bytes", bucket_size, alignment));
  }
  BucketPlan plan;
  plan.bucket_size = bucket_size;
  plan.alignment = alignment;
  uint64_t used = bucket_size;  // of the current bucket; "full" before the first
  for (uint32_t t = 0; t < nbytes.size(); ++t) {
    uint64_t done = 0;
    while (done < nbytes[t]) {
      uint64_t at = AlignUp(used, alignment);
      if (at >= bucket_size) {
        plan.buckets.emplace_back();
        at = 0;
      }
      Bucket& b = plan.buckets.back();
      const uint64_t length = std::min(nbytes[t] - done, bucket_size - at);
      b.pieces.push_back(Piece{t, done, at, length});
      b.bytes = at + length;
      used = b.bytes;
      done += length;
    }
  }
  return plan;
}

absl::StatusOr<BucketPlan> PlanBucketsFor(const Manifest& manifest, uint64_t bucket_size) {
  std::vector<uint64_t> nbytes;
  nbytes.reserve(manifest.tensors.size());
  for (const TensorInfo& t : manifest.tensors) nbytes.push_back(t.nbytes);
  return PlanBuckets(nbytes, bucket_size);
}

absl::Status CheckPlan(const BucketPlan& plan, const Manifest& manifest) {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrFormat(
        "the bucket plan of version %d does not fit its manifest: %s", manifest.version, what));
  };
  if (!IsPowerOfTwo(plan.alignment) || plan.alignment > plan.bucket_size ||
      plan.bucket_size % plan.alignment != 0) {
    return bad(absl::StrFormat("bucket size %d and alignment %d (a power of two dividing it)",
                               plan.bucket_size, plan.alignment));
  }
  if (plan.buckets.size() > kMaxBuckets) {
    return bad(absl::StrFormat("%d buckets, at most %d", plan.buckets.size(), kMaxBuckets));
  }
  const size_t n = manifest.tensors.size();
  std::vector<uint64_t> covered(n, 0);  // bytes of each tensor carried so far, in order
  size_t next = 0;                      // the first tensor not complete yet
  auto advance = [&] {
    while (next < n && covered[next] == manifest.tensors[next].nbytes) ++next;
  };
  advance();
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    const Bucket& b = plan.buckets[k];
    if (b.pieces.empty()) return bad(absl::StrFormat("bucket %d has no piece", k));
    uint64_t end = 0;
    for (size_t p = 0; p < b.pieces.size(); ++p) {
      const Piece& piece = b.pieces[p];
      const std::string at = absl::StrFormat("bucket %d piece %d", k, p);
      if (piece.tensor >= n) {
        return bad(absl::StrFormat("%s names tensor %d of %d", at, piece.tensor, n));
      }
      const TensorInfo& t = manifest.tensors[piece.tensor];
      if (piece.length == 0 || piece.bucket_offset < end ||
          piece.bucket_offset % plan.alignment != 0 || piece.length > plan.bucket_size ||
          piece.bucket_offset > plan.bucket_size - piece.length) {
        return bad(absl::StrFormat(
            "%s (tensor \"%s\") is bytes [%d, +%d) of a %d-byte bucket whose pieces so far end "
            "at %d (pieces are non-empty, aligned to %d, in order, inside the bucket)",
            at, t.name, piece.bucket_offset, piece.length, plan.bucket_size, end, plan.alignment));
      }
      if (piece.tensor != next) {
        return bad(absl::StrFormat(
            "%s carries tensor %d (\"%s\") but tensor %d is next (tensors travel whole, in "
            "manifest order)",
            at, piece.tensor, t.name, next));
      }
      if (piece.tensor_offset != covered[next] || piece.length > t.nbytes - covered[next]) {
        return bad(absl::StrFormat(
            "%s carries bytes [%d, +%d) of tensor \"%s\" (%d bytes), which continues at byte %d",
            at, piece.tensor_offset, piece.length, t.name, t.nbytes, covered[next]));
      }
      covered[next] += piece.length;
      end = piece.bucket_offset + piece.length;
      advance();
    }
    if (b.bytes != end) {
      return bad(
          absl::StrFormat("bucket %d says %d bytes but its pieces end at %d", k, b.bytes, end));
    }
  }
  if (next < n) {
    return bad(absl::StrFormat("tensor %d (\"%s\") is %d bytes but the plan carries %d", next,
                               manifest.tensors[next].name, manifest.tensors[next].nbytes,
                               covered[next]));
  }
  return absl::OkStatus();
}

std::vector<std::vector<uint32_t>> TensorsCompletedBy(const BucketPlan& plan) {
  std::vector<std::vector<uint32_t>> out(plan.buckets.size());
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    const std::vector<Piece>& pieces = plan.buckets[k].pieces;
    for (size_t p = 0; p < pieces.size(); ++p) {
      // A piece ends its tensor unless the tensor continues in the next bucket: only the last
      // piece of a bucket can continue there.
      const bool last_in_bucket = p + 1 == pieces.size();
      const bool continues = last_in_bucket && k + 1 < plan.buckets.size() &&
                             plan.buckets[k + 1].pieces.front().tensor == pieces[p].tensor;
      if (!continues) out[k].push_back(pieces[p].tensor);
    }
  }
  return out;
}

std::string EncodePlan(const BucketPlan& plan) {
  std::string out;
  ByteWriter w(&out);
  w.U64(plan.bucket_size).U64(plan.alignment).U32(static_cast<uint32_t>(plan.buckets.size()));
  for (const Bucket& b : plan.buckets) {
    w.U64(b.bytes).U32(static_cast<uint32_t>(b.pieces.size()));
    for (const Piece& p : b.pieces) {
      w.U32(p.tensor).U64(p.tensor_offset).U64(p.bucket_offset).U64(p.length);
    }
  }
  return out;
}

absl::StatusOr<BucketPlan> DecodePlan(std::string_view bytes) {
  control::MessageFields f("bucket plan", bytes);
  BucketPlan plan;
  plan.bucket_size = f.U64("the bucket size");
  plan.alignment = f.U64("the alignment");
  constexpr size_t kPieceBytes = 4 + 8 + 8 + 8;
  const uint32_t nbuckets = f.Count("buckets", 8 + 4);
  if (f.ok() && nbuckets > kMaxBuckets) {
    f.Fail(absl::StrFormat("%d buckets, at most %d", nbuckets, kMaxBuckets));
  }
  plan.buckets.reserve(f.ok() ? nbuckets : 0);
  for (uint32_t k = 0; k < nbuckets && f.ok(); ++k) {
    Bucket b;
    b.bytes = f.U64(absl::StrFormat("bucket %d's size", k));
    const uint32_t npieces = f.Count(absl::StrFormat("bucket %d's pieces", k), kPieceBytes);
    b.pieces.reserve(npieces);
    for (uint32_t p = 0; p < npieces && f.ok(); ++p) {
      Piece piece;
      piece.tensor = f.U32("a piece's tensor");
      piece.tensor_offset = f.U64("a piece's tensor offset");
      piece.bucket_offset = f.U64("a piece's bucket offset");
      piece.length = f.U64("a piece's length");
      b.pieces.push_back(piece);
    }
    plan.buckets.push_back(std::move(b));
  }
  return f.Done(std::move(plan));
}

std::string DescribePlan(const BucketPlan& plan) {
  return absl::StrFormat("%d bucket%s of %s (%d bytes in all)", plan.buckets.size(),
                         plan.buckets.size() == 1 ? "" : "s", Size(plan.bucket_size),
                         plan.WireBytes());
}

}  // namespace weightbus::internal::nccl
