// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the delta layer's record parser (ParseRecord and TargetManifest,
// lib/transports/delta/record.cc). The input is an inner manifest as the delta layer stores it
// (the weightbus.manifest.json of a delta+disk:// version: one U8 blob tensor and the record as
// JSON text under the "weightbus.delta" metadata key). Every input must be refused (DataLoss, or
// FailedPrecondition for a manifest without a record), or give a record that keeps the chain's
// rules (a keyframe names itself; a delta's base and keyframe lie below it; the blob's size is
// the record's), that RecordToJson writes back to an equal record, and whose target manifest is
// built from it (or refused with DataLoss for a base of another tensor count).
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_check.h"
#include "transports/delta/delta_transport.h"
#include "weightbus/manifest.hpp"

namespace {

using weightbus::internal::delta::Record;

constexpr char kTarget[] = "delta_record_fuzz";
constexpr std::string_view kSource = "fuzz-input inner manifest";

template <typename... Detail>
void Check(bool ok, const char* what, const Detail&... detail) {
  weightbus::fuzz::Check(ok, kTarget, what, detail...);
}

bool SameRecord(const Record& a, const Record& b) {
  return a.keyframe == b.keyframe && a.version == b.version &&
         (a.keyframe || (a.base == b.base && a.base_fingerprint == b.base_fingerprint)) &&
         a.keyframe_version == b.keyframe_version && a.encoded_bytes == b.encoded_bytes &&
         a.tensors == b.tensors && a.xxh3 == b.xxh3 && a.tiles == b.tiles;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightbus::internal::delta;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<weightbus::Manifest> inner = weightbus::Manifest::FromJson(text, kSource);
  if (!inner.ok()) return 0;  // manifest_fuzz covers the manifest parser
  absl::StatusOr<Record> record = ParseRecord(*inner, kSource);
  if (!record.ok()) {
    weightbus::fuzz::CheckRefusal(record.status(),
                                  record.status().code() == absl::StatusCode::kFailedPrecondition
                                      ? absl::StatusCode::kFailedPrecondition
                                      : absl::StatusCode::kDataLoss,
                                  kSource, kTarget);
    return 0;
  }
  const Record& r = *record;
  Check(r.version == inner->version, "record version differs from the manifest's");
  Check(inner->tensors.size() == 1 && inner->tensors[0].nbytes == r.encoded_bytes,
        "blob size differs from encoded_bytes");
  if (r.keyframe) {
    Check(r.keyframe_version == r.version, "a keyframe naming another keyframe");
    Check(r.xxh3.empty(), "a keyframe with delta checksums");
  } else {
    Check(r.base < r.version && r.keyframe_version <= r.base, "a delta not above its base");
    Check(r.tensors.empty(), "a delta with keyframe tensors");
    Check(r.xxh3.size() <= weightbus::kMaxTensors, "more checksums than the tensor limit");
  }

  // RecordToJson writes what ParseRecord reads.
  weightbus::Manifest rewritten = *inner;
  rewritten.metadata[std::string(kRecordKey)] = RecordToJson(r);
  absl::StatusOr<Record> again = ParseRecord(rewritten, "rewritten");
  Check(again.ok(), "RecordToJson's output does not parse",
        again.ok() ? std::string() : again.status().ToString());
  Check(SameRecord(*again, r), "the record changed in a RecordToJson/ParseRecord round trip",
        rewritten.metadata[std::string(kRecordKey)]);

  // The target manifest: a keyframe's own tensors; a delta's base with its checksums. The base's
  // tensors are U8 vectors of one byte, or, where the record gives tiles of B bytes, of as many
  // bytes as make its count of tiles ((count - 1) * B + 1): a delta whose tiles no tensor of at
  // most 2^63 bytes has must be refused.
  weightbus::Manifest base;
  base.version = r.base;
  bool buildable = true;
  for (size_t i = 0; i < r.xxh3.size(); ++i) {
    uint64_t n = 1;
    if (!r.tiles.empty() && r.tiles[i].block_rows > 0) {
      const uint64_t count = r.tiles[i].block_xxh3.size();
      n = 0;
      if (count > 0 && (__builtin_mul_overflow(count - 1, r.tiles[i].block_bytes, &n) ||
                        __builtin_add_overflow(n, 1, &n) || n > static_cast<uint64_t>(INT64_MAX))) {
        buildable = false;
        n = 1;
      } else if (count == 0) {
        n = 0;
      }
    }
    base.tensors.push_back(weightbus::TensorInfo{"t" + std::to_string(i),
                                                 weightbus::DType::kU8,
                                                 {static_cast<int64_t>(n)},
                                                 std::nullopt,
                                                 n,
                                                 0});
  }
  absl::StatusOr<weightbus::Manifest> target =
      TargetManifest(*inner, r, r.keyframe ? nullptr : &base);
  if (!buildable) {
    Check(absl::IsDataLoss(target.status()), "tiles no tensor can have were accepted");
    return 0;
  }
  Check(target.ok(), "no target manifest for a valid record",
        target.ok() ? std::string() : target.status().ToString());
  Check(target->metadata.count(std::string(kRecordKey)) == 0, "the record leaked into the target");
  if (r.keyframe) {
    Check(target->tensors == r.tensors, "keyframe target tensors differ from the record's");
  } else {
    for (size_t i = 0; i < r.xxh3.size(); ++i) {
      Check(target->tensors[i].xxh3 == r.xxh3[i], "delta target checksum differs");
    }
    base.tensors.push_back(
        base.tensors.empty()
            ? weightbus::TensorInfo{"x", weightbus::DType::kU8, {1}, std::nullopt, 1, 0}
            : base.tensors.back());
    absl::StatusOr<weightbus::Manifest> wrong = TargetManifest(*inner, r, &base);
    Check(absl::IsDataLoss(wrong.status()), "a base of another tensor count was accepted");
  }
  return 0;
}
