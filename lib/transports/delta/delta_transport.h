// SPDX-License-Identifier: Apache-2.0
// The delta layer ("delta+<transport>://..."): publishes each version through the transport
// beneath it as one encoded blob (lib/delta/codec.h), a keyframe or a delta against the previous
// version, and reconstructs versions bit-exactly on the subscribing side. Works over any
// transport; replaying a chain for a late joiner uses the optional OpenVersion capability and
// keeping chains alive uses KeepVersionsFrom (transport.h). Format: docs/FORMAT.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/buffer.h"
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
  int64_t keyframe_interval = 0;
  // Most deltas after a keyframe (setting delta_max_chain): a chain never grows longer, so that
  // the versions kept for it (KeepVersionsFrom) stay bounded even with keyframe_interval 0.
  int64_t max_chain = 1000;
  EncodeOptions encode;
  int threads = 0;
  // A new publisher continues the chain of the channel's newest version (setting
  // delta_resume): it reads that version back as the base of its first delta.
  bool resume = true;
  // A version goes plainly when encoding would cost more time than it saves (delta_send_plain).
  bool choose_plain = true;
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
  // A keyframe sent plainly (kind "plain"): the inner manifest holds the version's own tensors,
  // not a blob, because encoding would have cost more time than the bytes it saves.
  bool plain = false;
  // Plain versions: the publisher kept a copy, so the next version may be a delta against this
  // one; subscribers keep one too (otherwise they need not).
  bool keep = false;
  uint64_t version = 0;
  uint64_t base = 0;                // deltas: the version they apply to
  uint64_t keyframe_version = 0;    // the keyframe the chain starts from
  uint64_t base_fingerprint = 0;    // deltas: Fingerprint of the base version's manifest
  uint64_t encoded_bytes = 0;       // size of the blob
  std::vector<TensorInfo> tensors;  // keyframes: the target's tensors
  std::vector<uint64_t> xxh3;       // deltas: the target's checksums, in the base's tensor order
  // Deltas: the target's block checksums (only block_rows, block_bytes and block_xxh3 are used),
  // in the base's tensor order; empty when the record carries none (records written before
  // them: the target's tensors then have no block checksums). Keyframes carry theirs in
  // `tensors`. They let a subscriber that decodes only the chunks its slices meet verify the
  // tiles it reads (README.md, "Partial reads").
  std::vector<TensorInfo> tiles;
  // Why the publisher chose this encoding (for people and logs: "keyframe_interval=50", "the
  // channel holds no version yet", "delta against version 7"); optional, never interpreted.
  std::string reason;

  VersionIds ids() const { return VersionIds{keyframe, version, base, keyframe_version}; }
};

// XXH3-64 over every tensor's name, dtype, shape and checksum (docs/FORMAT.md): two manifests
// with the same fingerprint describe the same bytes.
uint64_t Fingerprint(const Manifest& manifest);

// The record as the text stored under kRecordKey.
std::string RecordToJson(const Record& record);

// Parses and checks the record of an inner manifest (`source` names it for messages): the
// record key, exactly one U8 tensor named kBlobName whose size matches the record (a plain
// version: its tensors, whose sizes add up to it), and a consistent record. Errors:
// FailedPrecondition when the version has no record (it was not published through the delta layer);
// DataLoss for anything malformed.
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

// A subscriber of this layer over `inner` (a subscriber of the transport beneath) that shares
// `parallel`: what the publishing side uses to read its own channel back (ReadChainVersion).
std::unique_ptr<TransportSubscriber> NewReader(std::string uri,
                                               std::unique_ptr<TransportSubscriber> inner,
                                               std::shared_ptr<Parallel> parallel);

// A version of the channel as the layer reconstructed it from the chain the channel holds,
// checked against the version's checksums: what a new publisher continues the chain from.
struct ChainVersion {
  Manifest manifest;                   // the version as subscribers receive it
  Manifest inner;                      // its encoded version's manifest on the channel
  std::unique_ptr<HostBuffer> buffer;  // its tensors, tensor i at offsets[i]
  std::vector<uint64_t> offsets;
  uint64_t keyframe = 0;               // the keyframe its chain starts from
  uint64_t deltas_since_keyframe = 0;  // deltas from that keyframe up to this version
  uint64_t keyframe_bytes = 0;         // the keyframe's encoded size
};

// Reads `version` through `reader` (from NewReader: it never accepts what it reads, so it always
// replays the chain from its keyframe), decodes it and checks every tensor against the XXH3-64
// the channel's records give for it. `layout` is what the caller is about to publish: a version
// of another layout is refused before anything is read. Errors: FailedPrecondition when the
// version was not published through this layer or has another layout (naming the first
// difference); NotFound/Unimplemented when its chain cannot be opened; DataLoss when a blob or
// a reconstructed tensor fails its checksum (naming the tensor, both checksums); others from
// the transport beneath.
absl::StatusOr<ChainVersion> ReadChainVersion(TransportSubscriber& reader, uint64_t version,
                                              const std::vector<TensorInfo>& layout,
                                              absl::Time deadline);

// Checks that the channel still holds the encoded version `published` (an inner manifest this
// publisher published) intact: the same manifest, and a blob whose bytes match its XXH3-64.
// What a publisher does before sending a delta against it, so that a corrupt version at rest
// costs subscribers one keyframe instead of every version up to the next one. `reader` as for
// ReadChainVersion. Errors: DataLoss naming the version, the file and both checksums (or that
// its manifest changed); NotFound when the channel no longer holds it; others from beneath.
absl::Status CheckEncodedVersion(TransportSubscriber& reader, const Manifest& published,
                                 absl::Time deadline);

// Keyframe requests, the back channel of a channel on disk (requests.cc): the directory inside
// the channel where subscribers leave them, and the one where they leave their reports.
inline constexpr std::string_view kRequestDir = "delta-requests";
inline constexpr std::string_view kReportDir = "delta-reports";

// The requests of one channel on disk. A subscriber's object writes one file (replaced by its
// next request); a publisher reads and removes them. Thread-compatible.
class RequestBox {
 public:
  // The box of `uri` when the transport at the bottom of its stack is disk:// (the channel's
  // directory is the URI's path), else nullopt: other transports have no such channel.
  static std::optional<RequestBox> ForUri(const Uri& uri);

  // Subscriber: asks the publisher for a keyframe because `version` cannot be reconstructed
  // (`why`), while this subscriber holds `holds`. Creates delta-requests/ with the channel's
  // permissions. Errors: PermissionDenied/NotFound/Internal naming the path (a subscriber that
  // cannot write the channel then waits for the next keyframe, as without a back channel).
  absl::Status Leave(uint64_t version, std::optional<uint64_t> holds, std::string_view why) const;
  // Publisher: every request present (unreadable files included, with version 0); each one's
  // id is its file.
  std::vector<KeyframeRequest> Pending() const;
  // Publisher: removes answered requests (a failure is logged, not returned).
  void Remove(const std::vector<KeyframeRequest>& served) const;

  // Subscriber: its report about `version` (SubscriberReport::text), replacing its previous
  // one: delta-reports/<host>-<pid>-<id>.json, written as a request is. Errors as Leave.
  absl::Status Report(uint64_t version, std::string_view text) const;
  // Publisher: every report present (at most kMaxReportText bytes of each are read; unreadable
  // ones are skipped); each one's id is its file. Reports about versions before `stale_before`
  // are removed (their subscribers are gone or have not reported for that long).
  std::vector<SubscriberReport> Reports(uint64_t stale_before) const;

  const std::string& dir() const { return dir_; }

 private:
  explicit RequestBox(std::string root);
  // Writes `text` to <dir>/<name_> through a temporary file (creating <dir> with the channel's
  // permissions).
  absl::Status Write(const std::string& dir, const std::string& text, const char* what) const;
  std::string root_, dir_, report_dir_, name_;
};

// Where the delta layer's subscribers ask for keyframes and its publisher finds the requests,
// whatever the transport beneath: the channel's delta-requests/ directory when disk:// is at the
// bottom of the stack (RequestBox), else the transport beneath's own back channel (capability
// keyframe_requests: ucx's KEYFRAME_REQUEST message), else none (Ask is Unimplemented; the
// subscriber waits for the next keyframe). Thread-compatible.
class BackChannel {
 public:
  static BackChannel ForUri(const Uri& uri) { return BackChannel(RequestBox::ForUri(uri), true); }
  // One that asks for nothing and finds nothing (the publisher's own reader).
  static BackChannel None() { return BackChannel(std::nullopt, false); }

  // Subscriber: asks for a keyframe (`inner`: the transport beneath the layer). Errors as
  // RequestBox::Leave or TransportSubscriber::RequestKeyframe.
  absl::Status Ask(TransportSubscriber& inner, uint64_t version, std::optional<uint64_t> holds,
                   std::string_view why) const;
  // Publisher: the requests not answered yet (those taken from `inner` before and not answered
  // stay until Answered, so a Publish that fails loses none).
  std::vector<KeyframeRequest> Pending(TransportPublisher& inner);
  // Publisher: `served` were answered (a keyframe or a plain version was published, or they
  // were about a chain an earlier keyframe replaced).
  void Answered(const std::vector<KeyframeRequest>& served);
  // For messages: "in <channel>/delta-requests" or "over the transport beneath".
  std::string Where() const;

  // Subscriber: reports on `version` (`text`, the layer's report: DecodingReport) through the
  // same back channel (disk's files, or the transport beneath's: capability subscriber_reports).
  // Errors as RequestBox::Report or TransportSubscriber::Report (Unimplemented: none).
  absl::Status Report(TransportSubscriber& inner, uint64_t version, std::string_view text) const;
  // Publisher: the reports that arrived since the last call (disk: every report file about a
  // version >= `stale_before`, the older ones removed).
  std::vector<SubscriberReport> Reports(TransportPublisher& inner, uint64_t stale_before) const;

 private:
  BackChannel(std::optional<RequestBox> box, bool enabled)
      : box_(std::move(box)), enabled_(enabled) {}
  std::optional<RequestBox> box_;
  bool enabled_ = true;
  std::vector<KeyframeRequest> held_;  // taken from the transport beneath, not answered yet
};

// A subscriber's report of what decoding one delta cost it (SubscriberReport::text, format
// "weightbus.delta-report/1", docs/FORMAT.md): sent for each delta it applied to its copy of
// the version before, of at least 1 MiB of tensors, so that the publisher's plain-or-delta
// choice weighs the decoding rates its subscribers see rather than its own estimate.
struct DecodingReport {
  uint64_t version = 0;
  uint64_t bytes = 0;   // tensor bytes of the version
  double decode_s = 0;  // wall seconds decoding the delta into the core's buffers
  double apply_s = 0;   // wall seconds updating the subscriber's own copy (its next base)
  int threads = 0;      // the subscriber's decoding threads
  std::string who;      // "host (pid P)", for messages (ToText: this process when empty)

  double bytes_per_s() const {
    return static_cast<double>(bytes) / std::max(decode_s + apply_s, 1e-9);
  }
  std::string ToText() const;
  // Errors: InvalidArgument when `text` is not a report of this format.
  static absl::StatusOr<DecodingReport> FromText(std::string_view text);
};

// Publisher groups (group.cc; README.md "Over a publisher group"). Each rank of a group
// encodes its own parts against its own previous parts and publishes, as its part of the group
// version beneath, one U8 blob named RankBlobName(rank) and its record under
// RankRecordKey(rank). The group version commits all or nothing as the group beneath does; a
// subscriber rebuilds each rank's parts from that rank's chain and hands the core the group
// version of the original parts, which it assembles (whole or resharded) as without the layer.
std::string RankRecordKey(int rank);  // "weightbus.delta.rank-<rank>"
std::string RankBlobName(int rank);   // "weightbus.delta.rank-<rank>"
// Whether `key` is a rank's record key (reserved, like kRecordKey).
bool IsRankRecordKey(std::string_view key);

// Rank `rank`'s part of the encoded group version `group` (a group manifest of the transport
// beneath) as a one-publisher encoded version: its blob as kBlobName (owner 0), its record
// under kRecordKey, the group's other metadata without the ranks' records, group = false. What
// the rank's chain is planned, decoded and checked against. Errors: DataLoss naming the
// version and rank when the group version holds no blob or no record of that rank.
absl::StatusOr<Manifest> RankPart(const Manifest& group, int rank, std::string_view source);

// A subscriber of the transport beneath that shows only rank `rank`'s part (RankPart) of the
// group versions `inner` delivers: what a rank's delta chain is read through, by the subscriber
// (one per rank) and by the publisher of that rank (reading its own chain back, never another
// rank's bytes). `inner` must outlive it unless `owned` holds it.
std::unique_ptr<TransportSubscriber> NewRankView(TransportSubscriber* inner, int rank,
                                                 std::unique_ptr<TransportSubscriber> owned = {});

// A delta subscriber (as WrapSubscriber makes) over `inner`, asking for keyframes through
// `requests`: one per rank of a group (over NewRankView).
std::unique_ptr<TransportSubscriber> NewRankSubscriber(std::string uri,
                                                       std::unique_ptr<TransportSubscriber> inner,
                                                       std::shared_ptr<Parallel> parallel,
                                                       BackChannel requests);

// The subscriber's side of a group: one delta subscriber per rank over a rank view of the
// subscriber beneath. Thread-compatible (used by one DeltaSubscriber).
class GroupReceiver {
 public:
  virtual ~GroupReceiver() = default;
  // The version the core receives for encoded group version `incoming` (a group manifest from
  // beneath): every rank's parts planned from that rank's chain (a delta on what this
  // subscriber holds of the rank, the chain back to the rank's keyframe, or the rank's parts
  // again). Errors as a single publisher's plan, prefixed with the rank (NotFound/Unimplemented
  // when a rank's chain cannot be reached: the caller waits for the next version).
  virtual absl::StatusOr<std::unique_ptr<IncomingVersion>> Plan(
      std::unique_ptr<IncomingVersion> incoming, absl::Time deadline) = 0;
};
std::unique_ptr<GroupReceiver> NewGroupReceiver(std::string uri, TransportSubscriber* inner,
                                                std::shared_ptr<Parallel> parallel,
                                                BackChannel requests);

}  // namespace weightbus::internal::delta
