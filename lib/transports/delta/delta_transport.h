// SPDX-License-Identifier: Apache-2.0
// The delta layer ("delta+<transport>://..."): publishes each version through the transport
// beneath it as one encoded blob (lib/delta/codec.h), a keyframe or a delta against the previous
// version, and reconstructs versions bit-exactly on the subscribing side. Works over any
// transport; replaying a chain for a late joiner uses the optional OpenVersion capability and
// keeping chains alive uses KeepVersionsFrom (transport.h). Format: docs/FORMAT.md.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/transport.h"
#include "core/uri.h"
#include "delta/codec.h"

namespace weightbus::internal::delta {

// The metadata key of the inner manifest that holds the delta record, and the name of the one
// inner tensor (U8) that holds the encoded version. The key is reserved: a Publish whose
// metadata uses it is refused.
inline constexpr std::string_view kRecordKey = "weightbus.delta";
inline constexpr std::string_view kBlobName = "weightbus.delta";
inline constexpr std::string_view kRecordFormat = "weightbus.delta/1";

const SettingTable& DeltaSettings();

struct LayerOptions {
  int64_t keyframe_interval = 50;
  // Most deltas after a keyframe (setting delta_max_chain): a chain never grows longer, so that
  // the versions kept for it (KeepVersionsFrom) stay bounded even with keyframe_interval 0.
  int64_t max_chain = 1000;
  EncodeOptions encode;
  int threads = 0;
};

// The layer's settings (ranges checked by Config::Resolve). Errors: InvalidArgument naming the
// URI when delta_chunk_size is not a multiple of 64.
absl::StatusOr<LayerOptions> ReadLayerOptions(const Uri& uri, const Config& config);

absl::StatusOr<std::unique_ptr<TransportPublisher>> WrapPublisher(
    const Uri& uri, const Config& config, std::unique_ptr<TransportPublisher> inner);
absl::StatusOr<std::unique_ptr<TransportSubscriber>> WrapSubscriber(
    const Uri& uri, const Config& config, std::unique_ptr<TransportSubscriber> inner);

// What the inner manifest's metadata says about an encoded version (docs/FORMAT.md).
struct Record {
  bool keyframe = true;
  uint64_t version = 0;
  uint64_t base = 0;                // deltas: the version they apply to
  uint64_t keyframe_version = 0;    // the keyframe the chain starts from
  uint64_t base_fingerprint = 0;    // deltas: Fingerprint of the base version's manifest
  uint64_t encoded_bytes = 0;       // size of the blob
  std::vector<TensorInfo> tensors;  // keyframes: the target's tensors
  std::vector<uint64_t> xxh3;       // deltas: the target's checksums, in the base's tensor order

  VersionIds ids() const { return VersionIds{keyframe, version, base, keyframe_version}; }
};

// XXH3-64 over every tensor's name, dtype, shape and checksum (docs/FORMAT.md): two manifests
// with the same fingerprint describe the same bytes.
uint64_t Fingerprint(const Manifest& manifest);

// The record as the text stored under kRecordKey.
std::string RecordToJson(const Record& record);

// Parses and checks the record of an inner manifest (`source` names it for messages): the
// record key, exactly one U8 tensor named kBlobName whose size matches the record, and a
// consistent record. Errors: FailedPrecondition when the version has no record (it was not
// published through the delta layer); DataLoss for anything malformed.
absl::StatusOr<Record> ParseRecord(const Manifest& inner, std::string_view source);

// The target manifest of a version: `inner`'s version, publisher, times and metadata (without
// kRecordKey); tensors from the record (keyframes) or from `base` with the record's checksums
// (deltas; `base` must be the manifest of record.base). Errors: DataLoss when a delta's
// checksums do not match the base's tensors.
absl::StatusOr<Manifest> TargetManifest(const Manifest& inner, const Record& record,
                                        const Manifest* base);

// The layout (dtype and size of each tensor) the codec needs.
std::vector<TensorLayout> LayoutOf(const std::vector<TensorInfo>& tensors);

// Names, dtypes and shapes (not checksums) equal: a delta between them is possible.
bool SameLayout(const std::vector<TensorInfo>& a, const std::vector<TensorInfo>& b);

}  // namespace weightbus::internal::delta
