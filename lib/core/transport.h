// SPDX-License-Identifier: Apache-2.0
// The interface transports implement (the plugin API; applications use weightbus.hpp).
//
// The core owns everything transport-neutral: validating tensors, packing non-contiguous views,
// computing and verifying XXH3-64 checksums, checking bound destinations against the manifest,
// and never handing over a lower version after a higher one. A transport moves manifests and
// bytes and says when a version is committed. Each transport lives in lib/transports/<scheme>/
// and registers itself (registry.h); the core never names one.
//
// Device memory: a transport that moves CUDA memory itself declares it (publish_memory,
// fetch_memory: kCudaMemory). The core then hands it CUDA tensors as device pointers
// (PackedTensor::device) and bound CUDA destinations as device targets
// (LandingSink::TargetDevice), and checksums them on the device (core/cuda/, docs/FORMAT.md
// "Checksums of device memory"); for every other transport it stages CUDA memory through pinned
// host memory itself. Which of the core's host steps run (packing strided views, checksums,
// staging) follows from these declarations, never from the transport's name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/checksum.h"
#include "weightbus/manifest.hpp"

namespace weightbus::internal {

// What a transport (or a stack of layers over one) can do, declared once per transport by its
// TransportDescriptor::capabilities (registry.h) from its settings: the core reads it instead of
// probing, `weightbus --version` and docs/TRANSPORTS.md list it, and the conformance suite
// (tests/conformance_test.cc) checks that every declared capability holds and that every
// optional method not declared refuses cleanly (Unimplemented, or no effect where so documented).
// Fields say "false" for what a transport must not be assumed to do; new fields get the value
// that is true of every existing transport, so that adding one changes no transport.
struct TransportCapabilities {
  // Kinds of memory, as bits of a set (publish_memory, fetch_memory). Every transport moves host
  // memory; kCudaMemory adds CUDA device memory, which the transport then reads or writes itself
  // (CUDA copies, kernels, NCCL, UCX with CUDA support) without the core copying it through the
  // host (docs/TRANSPORTS.md, "Device memory").
  enum MemoryKind : uint32_t { kHostMemory = 1u << 0, kCudaMemory = 1u << 1 };
  // How bytes reach subscribers: kPull when each subscriber fetches a version when it asks for
  // one (disk, ucx: versions nobody asks for cost subscribers nothing); kPush when the publisher
  // sends every version to every subscriber as it publishes (a collective such as NCCL).
  enum class Delivery { kPull, kPush };

  // -- Publisher side --
  // Publish reads strided views (PackedTensor::data == nullptr) through PublishJob::CopyRange or
  // CopyWithChecksum: the core then hands them over unpacked and needs no memory for them.
  // Otherwise the core packs them into one buffer per Publish (the sum of their sizes, freed
  // when Publish returns).
  bool reads_strided_views = false;
  // Publish stages every tensor with PublishJob::CopyWithChecksum: the core then does not
  // checksum them in a separate pass (any tensor the transport does not copy that way is
  // checksummed by SealedManifest).
  bool copies_with_checksums = false;
  // TransportPublisher::CommittedManifest reads back what the channel holds (a new publisher may
  // then retry the channel's latest version with the same bytes).
  bool committed_manifest = false;
  // TransportPublisher::KeepVersionsFrom keeps a floor of versions beyond retention.
  bool keep_versions_from = false;
  // TransportPublisher::WaitForReceivers counts the subscribers that verified a version.
  bool wait_for_receivers = false;
  // Every subscriber must take part in each Publish (a collective): a Publish waits for all of
  // them, and a subscriber that stops asking stalls the publisher. False: subscribers come, go
  // and skip versions freely.
  bool all_subscribers_take_part = false;
  // A publisher may be one rank of a group (settings `rank`, `world_size` > 1): Publish stores
  // only this rank's parts (manifest tensors with owner = rank) and commits the version once
  // every rank's part is there, all or nothing across ranks, returning DeadlineExceeded naming
  // the missing ranks when they are not there by the deadline (and InvalidArgument when the
  // ranks' parts do not fit together, internal::AssembleParts). Without it the core refuses
  // world_size > 1 at Publisher::Open (Unimplemented).
  bool publisher_groups = false;
  // A publisher group on a channel with a shared secret (docs/SECURITY.md, "Publisher groups"):
  // the committing rank refuses a part without a valid MAC under its key (PermissionDenied
  // naming the rank, for every rank of the set), and the committed group version carries a MAC
  // of the whole (core/secret.h ManifestMac). Without it the core refuses world_size > 1 on a
  // channel with a secret at Publisher::Open (Unimplemented) rather than publish a group
  // version no subscriber can authenticate.
  bool authenticated_groups = false;

  // -- Subscriber side --
  // TransportSubscriber::OpenVersion opens an exact version the channel still holds.
  bool open_version = false;
  // TransportSubscriber::ListVersions lists the versions the channel holds.
  bool list_versions = false;
  // IncomingVersion::FetchRanges reads byte ranges of tensors, nothing beyond them: a
  // subscriber with placements then reads only its slices, rounded out to checksum blocks,
  // through a bounded staging window (setting staging_window) instead of whole tensors.
  bool partial_reads = false;

  // -- Both sides --
  // Cancel() makes a call waiting in the transport (a WaitForVersion, a Publish waiting for
  // room, a WaitForReceivers) return Cancelled promptly, and every later call too. Without it a
  // call in flight when its handle is destroyed runs to its own deadline.
  bool cancel = false;
  // A back channel from subscribers to the publisher for keyframe requests:
  // TransportSubscriber::RequestKeyframe reaches the publisher's
  // TransportPublisher::TakeKeyframeRequests (the delta layer asks for a keyframe with it when
  // it cannot reconstruct a version). disk:// has its own, in the channel's directory.
  bool keyframe_requests = false;
  // The same back channel for reports: TransportSubscriber::Report reaches the publisher's
  // TransportPublisher::TakeReports (the delta layer's subscribers report how long they took to
  // decode a delta, which the publisher's plain-or-delta choice weighs). disk:// has its own.
  bool subscriber_reports = false;

  // -- The channel --
  // Publisher and subscribers may be different processes (false: one process only).
  bool cross_process = false;
  // Committed versions outlive the Publisher that published them: a subscriber opened after the
  // publisher closed receives them, and a new publisher of the channel continues above them
  // (its LatestVersion is theirs). False: a channel's history lives as long as its publisher.
  bool durable = false;
  // A subscriber opened after versions were published receives the newest one (false: it may
  // have to wait for a version published after it joined, e.g. a layer's next keyframe).
  bool late_joiners = true;

  // -- Memory --
  // Where Publish may read tensors from (PackedTensor::device). With kCudaMemory the core hands
  // a CUDA tensor over as its device pointer (a strided CUDA view packed on its device first);
  // without it the core copies CUDA tensors into pinned host memory first (builds with CUDA; a
  // build without refuses them with Unimplemented). Must include kHostMemory.
  uint32_t publish_memory = kHostMemory;
  // Where IncomingVersion::Fetch may write tensors (LandingSink::TargetDevice). With kCudaMemory
  // a bound CUDA destination is a Fetch target itself (bind_mode=direct, contiguous) or a device
  // staging buffer on its device (bind_mode=staged); without it the core receives into host
  // memory and copies to the device after verification. Library-owned tensors and host
  // destinations stay host targets either way. Must include kHostMemory.
  uint32_t fetch_memory = kHostMemory;
  Delivery delivery = Delivery::kPull;
};

// One line per declared capability ("cancel, durable, ..."), for messages and `weightbus
// --version`.
std::string DescribeCapabilities(const TransportCapabilities& capabilities);

// One tensor's contiguous row-major bytes, as the core hands them to a transport.
struct PackedTensor {
  const TensorInfo* info = nullptr;  // entry of the job's manifest (checksum may be pending)
  // info->nbytes bytes, valid until Publish returns; nullptr for a strided (non-contiguous)
  // view handed to a transport that declares reads_strided_views: read its bytes with
  // PublishJob::CopyRange or CopyWithChecksum, which gather them from the caller's strides.
  const std::byte* data = nullptr;
  // Where `data` lives: host memory (kCpu), or the memory of CUDA device `device.index` (kCuda),
  // which only a transport whose publish_memory has kCudaMemory is handed. Device bytes are
  // contiguous and complete when Publish is called (the core waited for the caller's CUDA
  // stream), belong to the caller, and are read with CUDA (cudaMemcpyAsync, kernels, NCCL), never
  // dereferenced on the host nor passed to CopyRange / CopyWithChecksum (host memory only); every
  // read of them must have finished when Publish returns. Their checksums are the core's,
  // computed on the device (SealedManifest waits for them as for host ones).
  Device device;
};

// A piece of host memory a tensor's bytes are copied into (see PublishJob::CopyWithChecksum).
struct CopyTarget {
  std::byte* data = nullptr;
  uint64_t size = 0;
};

// One Publish call as a transport sees it. Implemented by the core.
class PublishJob {
 public:
  virtual ~PublishJob() = default;
  virtual uint64_t version() const = 0;
  // In manifest order. The bytes are valid until TransportPublisher::Publish returns.
  virtual absl::Span<const PackedTensor> tensors() const = 0;
  // The manifest with every checksum filled in. Checksums are computed concurrently from the
  // start of the job; this waits for them, up to `deadline` (DeadlineExceeded).
  virtual absl::StatusOr<const Manifest*> SealedManifest(absl::Time deadline) = 0;
  // Copies tensor i's bytes into `pieces` (host memory, in order, sizes summing to its nbytes)
  // and, unless its checksum is already known, computes it from the bytes as they pass through
  // the cache, so that staging a tensor reads the caller's memory once instead of twice. Safe to
  // call from several threads for different tensors. Used by transports that declare
  // copies_with_checksums; this default only copies.
  virtual void CopyWithChecksum(size_t i, absl::Span<const CopyTarget> pieces);
  // CopyWithChecksum, calling `copied(k)` as soon as piece k is in place (its stores fenced),
  // pieces in order, on the calling thread: a transport that announced the version before
  // staging it (UnsealedManifest) marks the pieces ready for subscribers as they land. Default:
  // CopyWithChecksum(i, pieces), then copied(k) for every piece.
  virtual void StageWithChecksum(size_t i, absl::Span<const CopyTarget> pieces,
                                 absl::FunctionRef<void(size_t)> copied);
  // The manifest as it is known before the bytes are staged, for a transport that announces a
  // version before it is sealed (pipelining): every field but the checksums (0, no block
  // checksums), sealed_unix_ns (0) and the MAC, which SealedManifest adds. Subscribers may plan
  // their transfer with it but accept nothing before the sealed manifest is checked
  // (IncomingVersion::sealed). nullopt when the job cannot tell (default; a layer's job).
  virtual std::optional<Manifest> UnsealedManifest() const { return std::nullopt; }
  // Copies bytes [offset, offset + size) of tensor i's contiguous row-major image into `dst`
  // (host memory): a memcpy for contiguous tensors, a gather for strided views. Safe to call
  // from several threads. This default copies from tensors()[i].data.
  virtual void CopyRange(size_t i, uint64_t offset, uint64_t size, std::byte* dst) const;
  // For a strided view (data == nullptr) that the transport gathers with CopyRange in order, all
  // of it: true when the caller is to compute its checksums from the gathered bytes (a
  // TensorHasher(nbytes, ChecksumGrid(i)), core/checksum.h) and report them with SetChecksum
  // before SealedManifest is called (the strides are then walked once); false when the checksum
  // is someone else's. A tensor nobody claims is checksummed by SealedManifest. Defaults: false /
  // no effect (the checksums are known).
  virtual bool ClaimChecksum(size_t i) { return false; }
  virtual void SetChecksum(size_t i, TensorChecksums checksums) {}
  // How tensor i's block checksums are cut (core/tiles.h ChooseTiles under the setting
  // `checksum_block`; no tiles: none).
  virtual TileGrid ChecksumGrid(size_t i) const { return {}; }
};

// A PublishJob whose manifest is complete and whose bytes its creator owns: what a layer (such as
// delta) hands to the transport beneath it. `data[i]` holds manifest.tensors[i].nbytes bytes.
class SealedPublishJob final : public PublishJob {
 public:
  SealedPublishJob(Manifest manifest, std::vector<const std::byte*> data);
  uint64_t version() const override { return manifest_.version; }
  absl::Span<const PackedTensor> tensors() const override { return packed_; }
  absl::StatusOr<const Manifest*> SealedManifest(absl::Time) override { return &manifest_; }

 private:
  Manifest manifest_;
  std::vector<PackedTensor> packed_;
};

// A layer marks the inner manifests it publishes with its scheme under this metadata key and
// removes it from the manifests it hands up. A manifest that reaches the core still marked was
// published through a layer the subscriber lacks (its tensors are the layer's encoding, not the
// model's): the core refuses it, naming the URI to use. Users' metadata may not use the key.
inline constexpr std::string_view kLayerMetadataKey = "weightbus.layer";

// What a layer (such as delta) did to one version on its way: surfaced as PublishStats::encode /
// UpdateStats::decode and the wire_bytes of both.
struct CodecStats {
  absl::Duration time;      // encoding (publisher) or decoding (subscriber) time
  uint64_t wire_bytes = 0;  // bytes of the version as the transport beneath carried it
  std::string encoding;     // what the layer did with the version and why (PublishStats::encoding)
};

// A subscriber's request for a keyframe, as the publisher receives it
// (TransportPublisher::TakeKeyframeRequests).
struct KeyframeRequest {
  // Who asked, the same for every request of one subscriber object (a newer request of the same
  // subscriber replaces its older one); disk://'s back channel: the request's file.
  std::string id;
  uint64_t version = 0;  // the version the subscriber could not reconstruct (0: not known)
  std::string text;      // who asked and why, for the keyframe's reason and logs
};

// What a layer at a subscriber tells the layer at its publisher about a version it received
// (TransportSubscriber::Report, TransportPublisher::TakeReports): the delta layer's decoding
// time. Transports carry `text` without reading it.
struct SubscriberReport {
  // Who reported, the same for every report of one subscriber object (a newer report of the
  // same subscriber replaces its older one).
  std::string id;
  uint64_t version = 0;  // the version the report is about
  std::string text;      // the layer's report (its own format), at most kMaxReportText bytes
};
inline constexpr size_t kMaxReportText = 1024;

class TransportPublisher {
 public:
  virtual ~TransportPublisher() = default;
  // The newest committed version on the channel, if any.
  virtual absl::StatusOr<std::optional<uint64_t>> LatestVersion() = 0;
  // Makes job.version() available to subscribers, all or nothing. On error, nothing of the job
  // may ever become visible and earlier versions must be intact.
  virtual absl::Status Publish(PublishJob& job, absl::Time deadline) = 0;

  // Optional methods (defaults: not supported / no effect). A transport that implements one
  // declares it in its TransportCapabilities.
  // Keep every committed version >= `version` whatever the retention setting says (a delta
  // chain needs its keyframe and every delta after it). A later call replaces the floor.
  virtual void KeepVersionsFrom(uint64_t version) {}
  // Waits until at least `count` distinct subscribers have received and verified `version` or
  // a newer one, or until `deadline`, and returns how many have (possibly fewer than `count`).
  // Only a transport that talks to its subscribers can tell (default: Unimplemented).
  virtual absl::StatusOr<int> WaitForReceivers(uint64_t version, int count, absl::Time deadline);
  // The manifest of committed version `version` as subscribers receive it, if the channel still
  // holds it (NotFound otherwise): the core compares a re-publish of the latest version with it
  // (the same tensors are a no-op success). Default: Unimplemented (the core then compares only
  // with what its own Publisher object published last).
  virtual absl::StatusOr<Manifest> CommittedManifest(uint64_t version);
  // A layer's figures for its last successful Publish (default: none; the core then reports the
  // tensor bytes as wire bytes for a plain transport and 0, unknown, under a layer).
  virtual std::optional<CodecStats> LastCodecStats() const { return std::nullopt; }
  // The keyframe requests subscribers sent since the last call (capability keyframe_requests),
  // at most one per subscriber (its newest); taken, so a second call returns only newer ones.
  // Thread-safe. Default: none.
  virtual std::vector<KeyframeRequest> TakeKeyframeRequests() { return {}; }
  // The reports subscribers sent since the last call (capability subscriber_reports), at most
  // one per subscriber (its newest); taken, as TakeKeyframeRequests. Thread-safe. Default: none.
  virtual std::vector<SubscriberReport> TakeReports() { return {}; }
  // Host memory the transport serves fastest when a Publish's tensors lie in it
  // (Publisher::AllocateHost): `bytes` bytes, 4096-byte aligned and zero-filled, at `*data`,
  // owned by the returned pointer, which must keep whatever the memory needs alive (it may be
  // dropped after the transport is destroyed). nullptr: the transport has no such memory (the
  // core then maps plain memory). Thread-safe. Layers forward it beneath only where their own
  // Publish hands the caller's tensors on unchanged.
  virtual absl::StatusOr<std::shared_ptr<void>> AllocateHost(size_t bytes, std::byte** data) {
    return nullptr;
  }
  // Called from another thread when the Publisher is being destroyed while a call may be in
  // flight: a Publish or WaitForReceivers waiting (for staging slots, receivers, ...) should
  // return Cancelled promptly (within about 100 ms), and so should every later call. Bytes
  // already being written may finish first. Must be safe to call concurrently with any other
  // method, and more than once. Layers forward it beneath. Default: no effect.
  virtual void Cancel() {}
};

// Receives notice that a tensor's bytes are complete, so verification overlaps the transfer.
// Implemented by the core; Landed may be called from any thread, once per tensor.
class LandingSink {
 public:
  virtual ~LandingSink() = default;
  virtual void Landed(size_t tensor_index) = 0;
  // Optional finer notice: the first `bytes` bytes of tensor i are in place. Calls for one
  // tensor come from the thread that calls its Landed, with growing values; the core then
  // checksums the tensor piece by piece right behind the transfer, while the bytes are still in
  // cache. A transport that never calls it gets whole tensors checksummed after Landed.
  virtual void LandedPrefix(size_t tensor_index, uint64_t bytes) {}
  // Where target `tensor_index` of the Fetch this sink was passed to lives: host memory (kCpu,
  // always for a transport whose fetch_memory lacks kCudaMemory), or the memory of CUDA device
  // `index` (kCuda). A transport writes a device target with CUDA (cudaMemcpyAsync, kernels, NCCL
  // into it or its own buffer) and calls Landed(i) only once those writes are complete (their
  // stream or event synchronized): the core then checksums the target on the device, on a
  // stream of its own. LandedPrefix is not used for device targets (whole tensors are
  // checksummed after Landed), and Fetch must not return while a write into any target is in
  // flight. Thread-safe, constant during the Fetch.
  virtual Device TargetDevice(size_t tensor_index) const { return Device{}; }
};

// One byte range of a manifest tensor and the host memory it is read into
// (IncomingVersion::FetchRanges).
struct RangeRead {
  size_t tensor = 0;            // index into manifest().tensors
  uint64_t offset = 0;          // bytes into the tensor's contiguous row-major image
  uint64_t length = 0;          // offset + length <= the tensor's nbytes
  std::byte* target = nullptr;  // `length` bytes of host memory, caller owned
};

// A committed version a subscriber has found and may now receive. Holding it may pin the
// version against retention (disk); destroying it releases the pin.
class IncomingVersion {
 public:
  virtual ~IncomingVersion() = default;
  virtual const Manifest& manifest() const = 0;
  // False for a version found before its publisher sealed it (pipelining; only after
  // TransportSubscriber::AcceptUnsealedVersions): manifest() then has every field but the
  // checksums (0, no block checksums), sealed_unix_ns and the MAC, enough to check bindings and
  // plan the transfer. Fetch lands the bytes as the publisher stages them and returns OK only
  // once every byte is in place and the version is sealed; sealed() is then true and manifest()
  // the sealed manifest, which the core checks (the same layout as announced, its MAC on a
  // shared-secret channel, every checksum) before it hands anything over. A version whose
  // Publish failed makes Fetch fail with Aborted. FetchRanges needs a sealed version.
  virtual bool sealed() const { return true; }
  // Writes tensor i's manifest().tensors[i].nbytes bytes to targets[i] (contiguous, caller
  // owned; host memory, or device memory where sink.TargetDevice(i) says so, for a transport
  // whose fetch_memory has kCudaMemory), calling sink.Landed(i) when each is complete. Errors
  // name the tensor and source.
  // A null targets[i] for a tensor with bytes means the core does not need it (a replica of a
  // group version's part that it reads from another rank): skip it, and do not call Landed.
  virtual absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                             absl::Time deadline) = 0;
  // Reads exactly the bytes of `reads` (and no others of the version) into their targets, by
  // `deadline`; may be called several times (the core reads a version window by window). The
  // core verifies them against block checksums; no LandingSink. Only a transport that declares
  // partial_reads (default: Unimplemented). Errors name the tensor and source, as Fetch.
  virtual absl::Status FetchRanges(absl::Span<const RangeRead> reads, absl::Time deadline);
  // Announces, before the first FetchRanges, every range the core will read of this version
  // (`target`s null): a layer that must reconstruct the bytes it serves (delta) then decodes
  // only what they need. Called at most once; the FetchRanges calls that follow read only
  // within these ranges. Optional: the default ignores it.
  virtual void PlanRanges(absl::Span<const RangeRead> reads) {}
  // Where tensor i's bytes come from, for messages, e.g. "/ch/v1/model.safetensors bytes [8, 24)".
  virtual std::string DescribeSource(size_t tensor_index) const = 0;
  // Called by the core after every tensor passed verification, just before the version is
  // handed over (a delta layer advances its base here). Not called for a rejected version.
  virtual void Accepted() {}
  // A layer's figures for the Fetch that just finished (default: none, as LastCodecStats).
  virtual std::optional<CodecStats> FetchCodecStats() const { return std::nullopt; }
};

class TransportSubscriber {
 public:
  virtual ~TransportSubscriber() = default;
  // Waits until the channel's newest committed version is >= min_version and returns it.
  // Errors: DeadlineExceeded naming the channel, min_version and the newest version seen;
  // DataLoss when the committed version's manifest or layout is corrupt.
  virtual absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                          absl::Time deadline) = 0;

  // Optional methods (defaults: Unimplemented), declared in TransportCapabilities when
  // implemented.
  // Exactly version `version`, if the channel still holds it (NotFound otherwise, also for one
  // not committed yet): a delta layer replays a chain from its keyframe with it, and
  // Subscriber::ReceiveVersion opens the version it is asked for (telling "gone" from "not yet"
  // with ListVersions).
  virtual absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenVersion(uint64_t version,
                                                                       absl::Time deadline);
  // The committed versions the channel holds now, ascending.
  virtual absl::StatusOr<std::vector<uint64_t>> ListVersions();
  // Asks the publisher for a keyframe (capability keyframe_requests): this subscriber cannot
  // reconstruct `version` (`why`, cut to a bounded length by the transport) and holds `holds`.
  // Does not wait for an answer; the publisher's next version answers it. Errors: Unavailable
  // when the publisher cannot be reached now; Unimplemented by default.
  virtual absl::Status RequestKeyframe(uint64_t version, std::optional<uint64_t> holds,
                                       std::string_view why);
  // Sends a layer's report about `version` to the publisher (capability subscriber_reports):
  // `text` (at most kMaxReportText bytes; longer is InvalidArgument) reaches its TakeReports.
  // Does not wait for an answer and never connects for it. Errors: Unavailable when the
  // publisher cannot be reached now; Unimplemented by default.
  virtual absl::Status Report(uint64_t version, std::string_view text);
  // Lets WaitForVersion hand over versions that are not sealed yet (IncomingVersion::sealed),
  // so that their bytes move while the publisher still stages and checksums them. Called once,
  // before the first WaitForVersion, by the core on the top of its stack when it can verify
  // after the transfer (a subscriber without placements); a layer does not forward it, so a
  // transport beneath a layer hands over sealed versions only. Default: no effect (every version
  // handed over is sealed).
  virtual void AcceptUnsealedVersions() {}
  // Called from another thread when the Subscriber is being destroyed while a call may be in
  // flight: a WaitForVersion (or OpenVersion) waiting for a version should return Cancelled
  // promptly (within about 100 ms), and so should every later call. A Fetch under way may run
  // to its deadline. Must be safe to call concurrently with any other method, and more than
  // once. Layers forward it to the transport beneath. Default: no effect (a wait in flight
  // runs to its deadline).
  virtual void Cancel() {}
};

}  // namespace weightbus::internal
