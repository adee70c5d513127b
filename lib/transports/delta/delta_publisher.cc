// SPDX-License-Identifier: Apache-2.0
// Publishing side of the delta layer: encode each version as a keyframe or as a delta against
// the version published before it (whose bytes this layer keeps: one copy of the model), and
// publish the encoded blob through the transport beneath as a one-tensor version whose manifest
// metadata carries the delta record. Keeps the chain from the newest keyframe alive with
// KeepVersionsFrom, so that late joiners can replay it.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/buffer.h"
#include "core/checksum.h"
#include "core/logging.h"
#include "core/registry.h"
#include "core/status.h"
#include "transports/delta/delta_transport.h"

namespace weightbus::internal::delta {
namespace {

constexpr uint64_t kAlign = 64;
uint64_t AlignUp(uint64_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

// The bytes of the last version published: what the next delta is computed against.
struct Base {
  Manifest manifest;
  Manifest inner;      // its encoded version as published on the channel
  bool plain = false;  // sent plainly (kind "plain")
  // `buffer` holds the version's bytes (false after a plain version this publisher did not copy:
  // the next version is then whole).
  bool has_bytes = true;
  uint64_t fingerprint = 0;
  std::unique_ptr<HostBuffer> buffer;
  std::vector<uint64_t> offsets;  // of each tensor in `buffer`

  const std::byte* tensor(size_t i) const { return buffer ? buffer->data() + offsets[i] : nullptr; }
  std::byte* tensor(size_t i) { return buffer ? buffer->data() + offsets[i] : nullptr; }
};

// What this publisher measured: the rates that decide whether a version is worth encoding.
struct Rates {
  // Encoding one kind (delta or keyframe): model bytes per second of wall time with this
  // publisher's threads, and encoded bytes per model byte, of the last encode (0: none yet).
  struct Codec {
    double bytes_per_s = 0;
    double ratio = 0;
    // `fresh`: the measurement replaces the ones before it (a sample of the version about to
    // be sent describes its density of changes better than earlier versions do).
    void Measure(uint64_t bytes, absl::Duration took, uint64_t encoded, bool fresh = false) {
      const double s = std::max(absl::ToDoubleSeconds(took), 1e-9);
      const double rate = static_cast<double>(bytes) / s;
      const double r = bytes == 0 ? 0 : static_cast<double>(encoded) / static_cast<double>(bytes);
      bytes_per_s = fresh ? rate : Smooth(bytes_per_s, rate);
      ratio = fresh ? r : Smooth(ratio, r);
    }
  };
  Codec delta, keyframe;
  // Decoding a delta and applying it: model bytes per second with this publisher's threads,
  // measured by decoding the sample SampleDelta encoded (0: not measured; then decoding is
  // assumed to cost what encoding did). A subscriber's decoding is estimated by this one's.
  double decode_bytes_per_s = 0;
  // The codec's predicted cost must be below the time it saves by this factor: the rates come
  // from a sample on cores that subscribers on the same host share, so a close call goes plainly.
  static constexpr double kMargin = 1.25;
  // Decoding as subscribers report it (DecodingReport, through the back channel): the newest
  // report of each subscriber, by its id. Reports about versions older than kFreshReports
  // versions are not used (the subscriber may be gone, or deltas have not been sent since);
  // then this publisher's own sample stands in.
  struct Reported {
    uint64_t version = 0;
    double bytes_per_s = 0;
    std::string who;
  };
  static constexpr uint64_t kFreshReports = 32;
  std::map<std::string, Reported> reported;
  // Of the fresh reports when this version's choice was made: the slowest subscriber's
  // decoding rate (0: no fresh report) and what to say about it.
  double reported_decode_bytes_per_s = 0;
  std::string reported_by;
  void Report(const std::vector<SubscriberReport>& reports, uint64_t version) {
    for (const SubscriberReport& r : reports) {
      absl::StatusOr<DecodingReport> d = DecodingReport::FromText(r.text);
      if (!d.ok() || d->bytes == 0) continue;
      reported[r.id] = Reported{d->version, d->bytes_per_s(), d->who};
    }
    std::erase_if(reported, [&](const auto& kv) {
      return kv.second.version + 2 * kFreshReports < version;  // gone for long: forgotten
    });
    reported_decode_bytes_per_s = 0;
    reported_by.clear();
    int fresh = 0;
    const Reported* slowest = nullptr;
    for (const auto& [id, r] : reported) {
      if (r.version + kFreshReports < version) continue;
      ++fresh;
      if (slowest == nullptr || r.bytes_per_s < slowest->bytes_per_s) slowest = &r;
    }
    if (slowest != nullptr) {
      reported_decode_bytes_per_s = slowest->bytes_per_s;
      reported_by = absl::StrFormat(
          "reported by %d subscriber%s (the slowest: %s, decoding version %d)", fresh,
          fresh == 1 ? "" : "s", slowest->who.empty() ? "?" : slowest->who, slowest->version);
    }
  }
  // Bytes per second through the transport beneath (its Publish), from publishes of at least
  // kMinTransfer bytes, where fixed costs do not dominate (0: none yet).
  static constexpr uint64_t kMinTransfer = uint64_t{1} << 20;
  double transfer_bytes_per_s = 0;
  // Versions sent plainly in a row: every kProbe-th delta candidate is encoded again to measure
  // the rates afresh (the change density of a run varies).
  static constexpr int kProbe = 16;
  int plain_run = 0;
  void MeasureTransfer(uint64_t bytes, absl::Duration took) {
    if (bytes < kMinTransfer) return;
    transfer_bytes_per_s =
        Smooth(transfer_bytes_per_s,
               static_cast<double>(bytes) / std::max(absl::ToDoubleSeconds(took), 1e-9));
  }
  // Each measurement counts half, the ones before it the other half: one slow version on a
  // shared machine does not flip the choice by itself.
  static double Smooth(double old, double now) { return old <= 0 ? now : (old + now) / 2; }
};

// The rate (bytes per second) of a parallel loop over sampled chunks, `bytes[k]` of them taking
// `seconds[k]` each, the whole loop `wall` on `threads` threads: the median rate of the chunks
// that were not the first their thread coded (`first[k]`: a thread's first chunk pays one-time
// costs, its scratch buffers growing and first touched, 350 ms against 25-45 ms for the next 4
// MiB chunk on this project's 2-core machine, which a sample of 1/16 of a version would charge
// 16 times over: the sampled encoding came out 5-15x slower than whole encodes of the same
// version), times the parallelism the loop achieved on these cores (the chunks' summed time over
// the loop's wall time, 1..threads), which keeps what other work on the cores costs.
double SampledRate(const std::vector<uint64_t>& bytes, const std::vector<double>& seconds,
                   const std::vector<char>& first, absl::Duration wall, int threads) {
  std::vector<double> per_byte, first_per_byte;
  double busy = 0;
  for (size_t k = 0; k < bytes.size(); ++k) {
    busy += seconds[k];
    if (bytes[k] == 0) continue;
    (first[k] ? first_per_byte : per_byte)
        .push_back(std::max(seconds[k], 1e-9) / static_cast<double>(bytes[k]));
  }
  if (per_byte.empty()) per_byte = std::move(first_per_byte);  // only first chunks: take them
  if (per_byte.empty()) return 1;
  std::nth_element(per_byte.begin(), per_byte.begin() + per_byte.size() / 2, per_byte.end());
  const double parallelism = std::clamp(busy / std::max(absl::ToDoubleSeconds(wall), 1e-9), 1.0,
                                        static_cast<double>(std::max(threads, 1)));
  return parallelism / per_byte[per_byte.size() / 2];
}

// Opens a subscriber of this layer over the transport beneath (NewReader), for reading the
// channel back.
using ReaderFactory = std::function<absl::StatusOr<std::unique_ptr<TransportSubscriber>>()>;

// The core's job, handed to the transport beneath unchanged except for the manifest, which
// `finish` completes (the layer's record in its metadata): a version sent plainly is staged,
// copied and checksummed by the transport beneath exactly as without the layer.
class ForwardingJob final : public PublishJob {
 public:
  ForwardingJob(PublishJob& outer, std::function<absl::Status(Manifest&)> finish)
      : outer_(outer), finish_(std::move(finish)) {}
  uint64_t version() const override { return outer_.version(); }
  absl::Span<const PackedTensor> tensors() const override { return outer_.tensors(); }
  absl::StatusOr<const Manifest*> SealedManifest(absl::Time deadline) override {
    if (!manifest_) {
      WB_ASSIGN_OR_RETURN(const Manifest* sealed, outer_.SealedManifest(deadline));
      Manifest m = *sealed;
      WB_RETURN_IF_ERROR(finish_(m));
      manifest_ = std::move(m);
    }
    return &*manifest_;
  }
  void CopyWithChecksum(size_t i, absl::Span<const CopyTarget> pieces) override {
    outer_.CopyWithChecksum(i, pieces);
  }
  void CopyRange(size_t i, uint64_t offset, uint64_t size, std::byte* dst) const override {
    outer_.CopyRange(i, offset, size, dst);
  }
  bool ClaimChecksum(size_t i) override { return outer_.ClaimChecksum(i); }
  void SetChecksum(size_t i, TensorChecksums checksums) override {
    outer_.SetChecksum(i, std::move(checksums));
  }
  TileGrid ChecksumGrid(size_t i) const override { return outer_.ChecksumGrid(i); }

 private:
  PublishJob& outer_;
  std::function<absl::Status(Manifest&)> finish_;
  std::optional<Manifest> manifest_;
};

class DeltaPublisher final : public TransportPublisher {
 public:
  DeltaPublisher(std::string uri, LayerOptions options, std::unique_ptr<TransportPublisher> inner,
                 std::shared_ptr<Parallel> parallel, ReaderFactory open_reader, bool check_at_rest,
                 BackChannel requests, int rank, int world_size)
      : uri_(std::move(uri)),
        options_(options),
        inner_(std::move(inner)),
        parallel_(std::move(parallel)),
        open_reader_(std::move(open_reader)),
        check_at_rest_(check_at_rest),
        requests_(std::move(requests)),
        rank_(rank),
        world_size_(world_size) {}

  absl::StatusOr<std::optional<uint64_t>> LatestVersion() override {
    return inner_->LatestVersion();
  }

  absl::Status Publish(PublishJob& job, absl::Time deadline) override;

  void KeepVersionsFrom(uint64_t version) override {
    outer_floor_ = version;
    ApplyFloor();
  }

  std::optional<CodecStats> LastCodecStats() const override { return last_stats_; }

  // Encoding is not interrupted; the transport beneath returns Cancelled promptly.
  void Cancel() override { inner_->Cancel(); }

  // Encoded versions carry the version numbers of the versions they encode, and a delta
  // subscriber accepts the inner one only once the decoded version passed verification
  // (DeltaIncoming::Accepted), so the transport beneath counts receivers for this layer.
  absl::StatusOr<int> WaitForReceivers(uint64_t version, int count, absl::Time deadline) override {
    return inner_->WaitForReceivers(version, count, deadline);
  }

 private:
  void ApplyFloor() {
    std::optional<uint64_t> floor = keyframe_;
    if (grouped() && group_floor_ && (!floor || *group_floor_ < *floor)) floor = group_floor_;
    if (outer_floor_ && (!floor || *outer_floor_ < *floor)) floor = outer_floor_;
    if (floor) inner_->KeepVersionsFrom(*floor);
  }
  // Where a keyframe's tensors will be kept: allocated before publishing, so that nothing can
  // fail once the version is visible.
  struct Storage {
    std::unique_ptr<HostBuffer> buffer;  // null: reuse the current base's buffer
    std::vector<uint64_t> offsets;
  };
  absl::StatusOr<Storage> PrepareBase(const std::vector<TensorInfo>& tensors);
  // Makes the base hold `manifest`'s tensors: all of them from `data` into `storage` (a
  // keyframe), or only the chunks of `delta` that changed.
  void CommitBase(const Manifest& manifest, absl::Span<const PackedTensor> data, Storage* storage,
                  const EncodedVersion* delta);
  // Before the first version this object publishes: continues the chain of the channel's newest
  // version (published by an earlier publisher: a restarted trainer, each `weightbus publish`)
  // by reading that version back, checked against its checksums, as the base. Returns why not
  // when it cannot (the first version is then a keyframe).
  std::optional<std::string> Resume(uint64_t version, const std::vector<TensorInfo>& layout,
                                    absl::Time deadline);
  // Why this version (of `bytes` tensor bytes, a keyframe or a delta as `keyframe` says) goes
  // plainly: when the measured rates predict that encoding it here and decoding it at a
  // subscriber take longer than sending the bytes it saves. nullopt: encode it.
  // `encoded_why` (optional) receives the rates behind a choice to encode.
  std::optional<std::string> PlainReason(bool keyframe, uint64_t bytes,
                                         std::string* encoded_why = nullptr) const;
  // Publishes the job plainly (record kind "plain", `reason` why) through the transport beneath.
  absl::Status PublishPlain(PublishJob& job, const std::vector<TensorInfo>& infos,
                            const std::string& reason, uint64_t bytes, absl::Time deadline);
  // Before encoding a large delta whose rates are not measured yet, or a probe (PlainReason):
  // encodes one chunk in kSampleStride (spread over the version's bytes) on this publisher's
  // threads, then decodes them, and sets rates_.delta and rates_.decode_bytes_per_s from it.
  // Returns whether it did (false: nothing to sample, or the rates are known).
  bool SampleDelta(const std::vector<TensorLayout>& layout,
                   const std::vector<const std::byte*>& target, uint64_t bytes);
  // The subscriber that reads this channel back, opened on first use.
  absl::StatusOr<TransportSubscriber*> Reader();

  // -- A rank of a publisher group (world_size > 1; README.md "Over a publisher group") --
  bool grouped() const { return world_size_ > 1; }
  // Why the group keyframes `version`: the periodic rules (keyframe_interval, delta_max_chain)
  // counted from the oldest keyframe of the group's chains (group_floor_), the same for every
  // rank, so that the ranks keyframe the same versions. "": none of them.
  std::string GroupKeyframeReason(uint64_t version) const;
  // The record and blob of `inner` (this rank's encoded part) under this rank's names.
  void PlaceForGroup(Manifest& inner) const;
  // After committed group version `version` (published, or the newest one read back on
  // resuming): reads the group's manifest back; sets group_floor_ from every rank's record and,
  // with `base`, the base's inner manifest to this rank's part as subscribers see it (what the
  // check at rest compares). A failure is logged: the floor stays, and the next version is a
  // keyframe (the base's part cannot be checked).
  void ReadGroupState(uint64_t version, Base* base);
  // Keyframe requests: answered by the keyframes of the whole group (single publisher: this
  // publisher's keyframe), or still to be answered by this rank.
  bool RequestAnswered(const KeyframeRequest& r) const;
  bool RequestOpenHere(const KeyframeRequest& r) const;

  std::string uri_;
  LayerOptions options_;
  std::unique_ptr<TransportPublisher> inner_;
  std::shared_ptr<Parallel> parallel_;
  ReaderFactory open_reader_;
  // The transport beneath keeps versions at rest (durable): before a delta against the base,
  // check that the channel still holds the base's encoded version intact.
  bool check_at_rest_ = false;
  // Where subscribers ask for keyframes (disk's files, or the transport beneath's).
  BackChannel requests_;
  std::unique_ptr<TransportSubscriber> reader_;
  bool resume_tried_ = false;
  std::string no_base_reason_ = "the first version of this publisher";
  std::optional<Base> base_;
  std::optional<uint64_t> keyframe_;  // newest keyframe in the chain of base_
  uint64_t deltas_since_keyframe_ = 0;
  uint64_t keyframe_bytes_ = 0;          // its encoded size
  std::optional<uint64_t> outer_floor_;  // from a layer above, if any
  Rates rates_;
  std::optional<CodecStats> last_stats_;  // of the last successful Publish
  int rank_ = 0, world_size_ = 1;
  // A group: the oldest keyframe of its ranks' chains in the newest committed version (the
  // floor every rank keeps, so that each rank's chain stays whole).
  std::optional<uint64_t> group_floor_;
};

std::string DeltaPublisher::GroupKeyframeReason(uint64_t version) const {
  const uint64_t floor = group_floor_ ? *group_floor_ : *keyframe_;
  if (options_.keyframe_interval > 0 &&
      version - floor >= static_cast<uint64_t>(options_.keyframe_interval)) {
    return absl::StrFormat(
        "keyframe_interval=%d, for the whole group (its oldest chain starts at version %d)",
        options_.keyframe_interval, floor);
  }
  if (version - floor > static_cast<uint64_t>(options_.max_chain)) {
    return absl::StrFormat(
        "delta_max_chain=%d, for the whole group (its oldest chain starts at version %d)",
        options_.max_chain, floor);
  }
  return "";
}

void DeltaPublisher::PlaceForGroup(Manifest& inner) const {
  if (!grouped()) return;
  inner.group = true;
  auto record = inner.metadata.find(std::string(kRecordKey));
  inner.metadata[RankRecordKey(rank_)] = std::move(record->second);
  inner.metadata.erase(record);
  inner.tensors[0].name = RankBlobName(rank_);
  inner.tensors[0].owner = rank_;
}

void DeltaPublisher::ReadGroupState(uint64_t version, Base* base) {
  absl::Status failed;
  absl::StatusOr<Manifest> committed = inner_->CommittedManifest(version);
  if (committed.ok()) {
    std::optional<uint64_t> floor;
    for (int r = 0; r < world_size_ && failed.ok(); ++r) {
      absl::StatusOr<Manifest> part = RankPart(*committed, r, uri_);
      absl::StatusOr<Record> record =
          part.ok() ? ParseRecord(*part, uri_) : absl::StatusOr<Record>(part.status());
      if (!record.ok()) {
        failed = record.status();
        break;
      }
      floor = std::min(floor.value_or(record->keyframe_version), record->keyframe_version);
      if (r == rank_ && base != nullptr) base->inner = *std::move(part);
    }
    if (failed.ok()) group_floor_ = floor;
  } else {
    failed = committed.status();
  }
  if (!failed.ok()) {
    if (base != nullptr) base->inner = Manifest{};  // cannot be checked: the next is a keyframe
    Log(LogLevel::kWarn, "%s version %d: the group's committed manifest cannot be read back: %s",
        uri_, version, failed.message());
  }
  ApplyFloor();
}

bool DeltaPublisher::RequestAnswered(const KeyframeRequest& r) const {
  const std::optional<uint64_t> floor = grouped() ? group_floor_ : keyframe_;
  return floor && r.version != 0 && r.version < *floor;
}

bool DeltaPublisher::RequestOpenHere(const KeyframeRequest& r) const {
  // A rank that keyframed after the version asked about has answered it; the request stays
  // until every rank has (RequestAnswered).
  return !grouped() || r.version == 0 || !keyframe_ || r.version >= *keyframe_;
}

absl::StatusOr<DeltaPublisher::Storage> DeltaPublisher::PrepareBase(
    const std::vector<TensorInfo>& tensors) {
  Storage storage;
  uint64_t total = 0;
  for (const TensorInfo& t : tensors) {
    storage.offsets.push_back(total);
    total += AlignUp(t.nbytes);
  }
  // Keyframes of the same model reuse the buffer (it is overwritten only once published).
  if (total > 0 && !(base_ && base_->buffer && base_->buffer->size() >= total)) {
    WB_ASSIGN_OR_RETURN(storage.buffer, HostBuffer::Allocate(total));
  }
  return storage;
}

void DeltaPublisher::CommitBase(const Manifest& manifest, absl::Span<const PackedTensor> data,
                                Storage* storage, const EncodedVersion* delta) {
  if (storage != nullptr) {
    Base b;
    b.offsets = std::move(storage->offsets);
    b.buffer =
        storage->buffer ? std::move(storage->buffer) : (base_ ? std::move(base_->buffer) : nullptr);
    base_ = std::move(b);
    base_->manifest = manifest;
    parallel_->For(data.size(), [&](size_t i) {
      if (manifest.tensors[i].nbytes > 0) {
        std::memcpy(base_->tensor(i), data[i].data, manifest.tensors[i].nbytes);
      }
    });
  } else {
    // A delta: only the chunks that changed.
    base_->manifest = manifest;
    parallel_->For(delta->chunks.size(), [&](size_t c) {
      if (delta->results[c].method == Method::kSame) return;
      for (const Piece& p : delta->chunks[c].pieces) {
        std::memcpy(base_->tensor(p.tensor) + p.offset, data[p.tensor].data + p.offset, p.bytes);
      }
    });
  }
  base_->fingerprint = Fingerprint(manifest);
}

std::optional<std::string> DeltaPublisher::PlainReason(bool keyframe, uint64_t bytes,
                                                       std::string* encoded_why) const {
  if (!options_.choose_plain || bytes < Rates::kMinTransfer) return std::nullopt;
  const double transfer = rates_.transfer_bytes_per_s;
  if (transfer <= 0) {
    // Nothing measured yet: a whole version goes plainly, which costs what the transport beneath
    // costs and measures it; a delta is encoded (and measured).
    if (!keyframe) return std::nullopt;
    return std::string(
        "sent plainly: a whole version before this publisher has measured the transport beneath "
        "(plainly it costs what that transport costs)");
  }
  // A keyframe not measured yet is judged by the delta's figures: it encodes more slowly and
  // saves fewer bytes, so where a delta does not pay, neither does a keyframe.
  const bool judge_keyframe = keyframe && rates_.keyframe.bytes_per_s > 0;
  const Rates::Codec& codec = judge_keyframe ? rates_.keyframe : rates_.delta;
  if (codec.bytes_per_s <= 0) return std::nullopt;  // not measured yet: encode and measure
  if (!keyframe && rates_.plain_run > 0 && rates_.plain_run % Rates::kProbe == 0) {
    return std::nullopt;  // measure again
  }
  const double n = static_cast<double>(bytes);
  // Decoding as the subscribers report it (the slowest of them), else as measured on a sample
  // of a delta here (keyframes, and deltas before either: assumed to cost what encoding did; the
  // codec decodes faster than it encodes per core, BENCHMARKS.md, but a subscriber may have
  // fewer cores free).
  const bool decode_reported = !judge_keyframe && rates_.reported_decode_bytes_per_s > 0;
  const bool decode_measured = !judge_keyframe && rates_.decode_bytes_per_s > 0;
  const double encode_s = n / codec.bytes_per_s;
  const double decode_s = decode_reported   ? n / rates_.reported_decode_bytes_per_s
                          : decode_measured ? n / rates_.decode_bytes_per_s
                                            : encode_s;
  const double codec_s = encode_s + decode_s;
  const double saved_s = (n - n * codec.ratio) / transfer;
  const std::string rates = absl::StrFormat(
      "encoding %.3f s at %.2f GB/s, decoding %.3f s at %.2f GB/s %s, %.1fx fewer bytes saving "
      "%.3f s at the %.2f GB/s measured through the transport beneath",
      encode_s, codec.bytes_per_s / 1e9, decode_s, n / std::max(decode_s, 1e-9) / 1e9,
      decode_reported   ? rates_.reported_by
      : decode_measured ? "measured here"
                        : "assumed as slow",
      codec.ratio > 0 ? 1 / codec.ratio : 0.0, saved_s, transfer / 1e9);
  if (codec_s * Rates::kMargin <= saved_s) {
    if (encoded_why != nullptr) {
      *encoded_why = absl::StrFormat("encoded, by the measured rates: %s", rates);
    }
    return std::nullopt;
  }
  return absl::StrFormat(
      "sent plainly: encoding and decoding a %s would cost more than the time "
      "its fewer bytes save (%s; the saving must be %.2fx the codec's cost)",
      keyframe && !judge_keyframe ? "delta (so a keyframe too)"
      : keyframe                  ? "keyframe"
                                  : "delta",
      rates, Rates::kMargin);
}

bool DeltaPublisher::SampleDelta(const std::vector<TensorLayout>& layout,
                                 const std::vector<const std::byte*>& target, uint64_t bytes) {
  constexpr size_t kSampleStride = 16;
  const bool probe = rates_.plain_run > 0 && rates_.plain_run % Rates::kProbe == 0;
  if (!options_.choose_plain || bytes < Rates::kMinTransfer || rates_.transfer_bytes_per_s <= 0 ||
      !base_ || !base_->has_bytes || (rates_.delta.bytes_per_s > 0 && !probe)) {
    return false;
  }
  const std::vector<Chunk> chunks = PlanChunks(layout, options_.encode.chunk_size);
  if (chunks.empty()) return false;
  // One chunk in kSampleStride (at least one), spread evenly over the version's bytes (so that
  // the tiny chunks of rare dtypes are not what is measured), encoded and then decoded on this
  // publisher's threads, as the whole delta would be: the rates include what running them in
  // parallel on these cores costs.
  std::vector<size_t> sample;
  const size_t want = std::max<size_t>(1, chunks.size() / kSampleStride);
  uint64_t total = 0;
  for (const Chunk& chunk : chunks) total += chunk.bytes;
  for (size_t i = 0, c = 0, end = 0; i < want; ++i) {
    const uint64_t at = (2 * i + 1) * total / (2 * want);  // the middle of the i-th stretch
    while (c < chunks.size() && end + chunks[c].bytes <= at) end += chunks[c++].bytes;
    if (c < chunks.size() && (sample.empty() || sample.back() != c)) sample.push_back(c);
  }
  std::vector<std::vector<std::byte>> records(sample.size());
  std::vector<uint64_t> encoded(sample.size());
  const auto spans_of = [&](const Chunk& chunk) {
    std::vector<ChunkInput> spans;
    for (const Piece& p : chunk.pieces) {
      spans.push_back(
          ChunkInput{base_->tensor(p.tensor) + p.offset, target[p.tensor] + p.offset, p.bytes});
    }
    return spans;
  };
  std::vector<uint64_t> chunk_bytes(sample.size());
  std::vector<double> took(sample.size());
  // Whether a thread of this process has encoded (decoded) a sampled chunk before.
  static thread_local bool encoded_before = false, decoded_before = false;
  std::vector<char> first(sample.size());
  const absl::Time start = absl::Now();
  parallel_->For(sample.size(), [&](size_t k) {
    const Chunk& chunk = chunks[sample[k]];
    const absl::Time chunk_start = absl::Now();
    encoded[k] = EncodeChunk(chunk.dtype, spans_of(chunk), false, options_.encode, &records[k])
                     .encoded_bytes;
    took[k] = absl::ToDoubleSeconds(absl::Now() - chunk_start);
    first[k] = !encoded_before;
    encoded_before = true;
  });
  const absl::Time encoded_at = absl::Now();
  uint64_t raw = 0, encoded_total = 0;
  for (size_t k = 0; k < sample.size(); ++k) {
    chunk_bytes[k] = chunks[sample[k]].bytes;
    raw += chunk_bytes[k];
    encoded_total += encoded[k];
  }
  const double encode_rate =
      SampledRate(chunk_bytes, took, first, encoded_at - start, parallel_->threads());
  rates_.delta.Measure(raw, absl::Seconds(static_cast<double>(raw) / encode_rate), encoded_total,
                       /*fresh=*/true);
  // Decoding the sample into scratch memory (one chunk's worth per thread is not enough for a
  // parallel loop: one buffer per sampled chunk), from the base as a subscriber would. The
  // scratch is touched first (a subscriber decodes into buffers it has used before).
  absl::StatusOr<std::unique_ptr<HostBuffer>> scratch = HostBuffer::Allocate(raw);
  if (!scratch.ok()) return true;  // decoding stays assumed as slow as encoding
  std::memset((*scratch)->data(), 0, raw);
  std::vector<uint64_t> at(sample.size());
  for (size_t k = 1; k < sample.size(); ++k) at[k] = at[k - 1] + chunks[sample[k - 1]].bytes;
  std::atomic<bool> failed{false};
  const absl::Time decode_start = absl::Now();
  parallel_->For(sample.size(), [&](size_t k) {
    const Chunk& chunk = chunks[sample[k]];
    std::vector<ChunkOutput> outs;
    uint64_t offset = at[k];
    for (const Piece& p : chunk.pieces) {
      outs.push_back(
          ChunkOutput{base_->tensor(p.tensor) + p.offset, (*scratch)->data() + offset, p.bytes});
      offset += p.bytes;
    }
    const absl::Time chunk_start = absl::Now();
    if (!DecodeChunk(chunk.dtype, outs, false, records[k]).ok()) failed = true;
    took[k] = absl::ToDoubleSeconds(absl::Now() - chunk_start);
    first[k] = !decoded_before;
    decoded_before = true;
  });
  if (!failed) {
    rates_.decode_bytes_per_s =
        SampledRate(chunk_bytes, took, first, absl::Now() - decode_start, parallel_->threads());
  }
  return true;
}

absl::Status DeltaPublisher::PublishPlain(PublishJob& job, const std::vector<TensorInfo>& infos,
                                          const std::string& reason, uint64_t bytes,
                                          absl::Time deadline) {
  const uint64_t version = job.version();
  last_stats_.reset();
  ++rates_.plain_run;
  // A copy is kept only when the next version may be a delta against this one (the next probe,
  // or no delta measured yet: PlainReason): otherwise a plain version costs this layer no copy
  // at either end.
  const bool keep = rates_.plain_run % Rates::kProbe == 0 || rates_.delta.bytes_per_s <= 0;
  Record record;
  record.plain = true;
  record.keep = keep;
  record.version = version;
  record.keyframe_version = version;
  record.encoded_bytes = bytes;
  record.reason = reason;
  ForwardingJob forward(job, [&](Manifest& m) -> absl::Status {
    if (m.metadata.count(std::string(kRecordKey)) > 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s version %d: metadata key \"%s\" is reserved for the delta layer",
                          uri_, version, kRecordKey));
    }
    m.metadata[std::string(kRecordKey)] = RecordToJson(record);
    m.metadata[std::string(kLayerMetadataKey)] = "delta";
    return absl::OkStatus();
  });
  std::optional<Storage> storage;
  if (keep) {
    WB_ASSIGN_OR_RETURN(storage, PrepareBase(infos));
  }
  const absl::Time start = absl::Now();
  WB_RETURN_IF_ERROR(inner_->Publish(forward, deadline));
  rates_.MeasureTransfer(bytes, absl::Now() - start);
  WB_ASSIGN_OR_RETURN(const Manifest* published, forward.SealedManifest(deadline));
  Manifest target = *published;
  target.metadata.erase(std::string(kRecordKey));
  target.metadata.erase(std::string(kLayerMetadataKey));
  if (keep) {
    CommitBase(target, job.tensors(), &*storage, nullptr);
  } else {
    if (!base_) base_.emplace();
    base_->manifest = target;
    base_->fingerprint = Fingerprint(target);
  }
  base_->inner = *published;
  base_->plain = true;
  base_->has_bytes = keep;
  keyframe_ = version;
  keyframe_bytes_ = bytes;
  deltas_since_keyframe_ = 0;
  ApplyFloor();
  last_stats_ = CodecStats{absl::ZeroDuration(), bytes, absl::StrCat("plain: ", reason)};
  Log(LogLevel::kDebug, "%s version %d: %d bytes sent plainly (%s)", uri_, version, bytes, reason);
  return absl::OkStatus();
}

absl::StatusOr<TransportSubscriber*> DeltaPublisher::Reader() {
  if (!reader_) {
    WB_ASSIGN_OR_RETURN(reader_, open_reader_());
  }
  return reader_.get();
}

std::optional<std::string> DeltaPublisher::Resume(uint64_t version,
                                                  const std::vector<TensorInfo>& layout,
                                                  absl::Time deadline) {
  absl::StatusOr<std::optional<uint64_t>> latest = inner_->LatestVersion();
  if (!latest.ok()) {
    return absl::StrFormat("the channel's newest version cannot be found: %s",
                           latest.status().message());
  }
  if (!*latest) return "the channel holds no version yet";
  const uint64_t from = **latest;
  absl::StatusOr<TransportSubscriber*> reader = Reader();
  absl::StatusOr<ChainVersion> read =
      reader.ok() ? ReadChainVersion(**reader, from, layout, deadline) : reader.status();
  if (!read.ok()) {
    std::string why = absl::StrFormat(
        "a new publisher continues the channel's chain only from its newest version %d as the "
        "channel's checksums describe it, which failed: %s",
        from, read.status().message());
    Log(LogLevel::kWarn, "%s version %d: publishing a keyframe: %s", uri_, version, why);
    return why;
  }
  Base b;
  b.manifest = std::move(read->manifest);
  b.inner = std::move(read->inner);
  b.fingerprint = Fingerprint(b.manifest);
  b.buffer = std::move(read->buffer);
  b.offsets = std::move(read->offsets);
  base_ = std::move(b);
  keyframe_ = read->keyframe;
  keyframe_bytes_ = read->keyframe_bytes;
  deltas_since_keyframe_ = read->deltas_since_keyframe;
  if (grouped()) ReadGroupState(from, nullptr);  // the floor of every rank's chain
  ApplyFloor();  // the chain a late joiner replays stays, whatever retention says
  Log(LogLevel::kInfo,
      "%s: continuing the channel's chain: version %d applies to version %d (keyframe %d + %d "
      "deltas, read back and checked against its checksums)",
      uri_, version, from, *keyframe_, deltas_since_keyframe_);
  return std::nullopt;
}

// `t` without its checksum (xxh3 = 0). Until PublishJob::SealedManifest returns, the core's
// hashing pool may be writing the job's t.xxh3 on another thread: copying the whole entry then
// is a data race (found by ThreadSanitizer, issue 17); the layer needs only the layout here.
TensorInfo LayoutOnly(const TensorInfo& t) {
  return TensorInfo{.name = t.name,
                    .dtype = t.dtype,
                    .shape = t.shape,
                    .shard = t.shard,
                    .nbytes = t.nbytes,
                    .owner = t.owner};
}

absl::Status DeltaPublisher::Publish(PublishJob& job, absl::Time deadline) {
  const uint64_t version = job.version();
  absl::Span<const PackedTensor> packed = job.tensors();
  std::vector<TensorInfo> infos;
  std::vector<const std::byte*> target;
  infos.reserve(packed.size());
  for (const PackedTensor& p : packed) {
    infos.push_back(LayoutOnly(*p.info));  // the checksums come with SealedManifest
    target.push_back(p.data);
  }
  const std::vector<TensorLayout> layout = LayoutOf(infos);

  if (!base_ && !resume_tried_ && options_.resume) {
    resume_tried_ = true;
    if (std::optional<std::string> why = Resume(version, infos, deadline)) {
      no_base_reason_ = *std::move(why);
    }
  }
  // A chain never exceeds max_chain deltas: the floor kept for it (KeepVersionsFrom) then moves
  // on, and the channel holds at most max(retention, max_chain + 2) versions (README.md).
  std::string reason;
  if (!base_) {
    reason = no_base_reason_;
  } else if (!base_->has_bytes) {
    reason = absl::StrFormat("version %d went plainly and this publisher kept no copy of it",
                             base_->manifest.version);
  } else if (!SameLayout(base_->manifest.tensors, infos)) {
    reason =
        absl::StrFormat("the tensor layout differs from version %d's", base_->manifest.version);
  } else if (grouped()) {
    reason = GroupKeyframeReason(version);
  } else if (options_.keyframe_interval > 0 &&
             deltas_since_keyframe_ + 1 >= static_cast<uint64_t>(options_.keyframe_interval)) {
    reason = absl::StrFormat("keyframe_interval=%d", options_.keyframe_interval);
  } else if (deltas_since_keyframe_ >= static_cast<uint64_t>(options_.max_chain)) {
    reason = absl::StrFormat("delta_max_chain=%d deltas after keyframe %d", options_.max_chain,
                             *keyframe_);
  }
  // Subscribers that cannot reconstruct a version of this chain (a delta damaged at rest after
  // it was checked, a version gone) asked for a keyframe: this version is one. A request about
  // a version before the chain's keyframe was answered by that keyframe already.
  std::vector<KeyframeRequest> requests;
  {
    std::vector<KeyframeRequest> answered;
    for (KeyframeRequest& r : requests_.Pending(*inner_)) {
      if (RequestAnswered(r)) {
        answered.push_back(std::move(r));
      } else if (RequestOpenHere(r)) {
        requests.push_back(std::move(r));
      }
    }
    requests_.Answered(answered);
    if (!requests.empty() && reason.empty()) {
      reason =
          absl::StrFormat("%d subscriber%s asked for a keyframe (%s): %s", requests.size(),
                          requests.size() == 1 ? "" : "s", requests_.Where(), requests[0].text);
      Log(LogLevel::kWarn, "%s version %d: publishing a keyframe: %s", uri_, version, reason);
    }
  }
  bool keyframe = !reason.empty();
  // What decoding cost the subscribers (their reports since the last version).
  if (options_.choose_plain) {
    rates_.Report(
        requests_.Reports(
            *inner_, version > 4 * Rates::kFreshReports ? version - 4 * Rates::kFreshReports : 0),
        version);
  }
  uint64_t total_bytes = 0;
  for (const TensorInfo& t : infos) total_bytes += t.nbytes;
  // Sent plainly when encoding and decoding would cost more time than the bytes they save
  // (predicted from this publisher's measured rates); reason says why.
  // Before the first delta (and at each probe) the rates come from a sample of the delta's
  // chunks, encoded and decoded here (SampleDelta), and the transfer rate from the first
  // version, sent plainly: the choice is made before any delta is sent whole.
  std::string encoded_why;
  std::optional<std::string> plain = PlainReason(keyframe, total_bytes, &encoded_why);
  if (!plain && !keyframe && SampleDelta(layout, target, total_bytes)) {
    // The delta's rates, measured afresh on a sample of its chunks rather than by encoding it
    // all: what a probe costs when the answer is "plainly".
    rates_.plain_run = 0;
    plain = PlainReason(false, total_bytes, &encoded_why);
    if (plain) absl::StrAppend(&*plain, " (sampled)");
    if (!encoded_why.empty()) absl::StrAppend(&encoded_why, " (sampled)");
  }
  if (!plain && !keyframe && check_at_rest_) {
    // Subscribers that do not hold the base need the channel's copy of it to apply a delta
    // against it: a corrupt one (a flipped bit at rest, an edited manifest) would stop them
    // until the next keyframe, so the keyframe comes now. Each version is checked once, when it
    // is the base of a delta about to be sent (a delta: a few KB to MB; a keyframe or a plain
    // version once per chain, and only when a delta follows it; never for a version that goes
    // plainly, which needs no base: reading a whole version back then would only slow it).
    absl::StatusOr<TransportSubscriber*> reader = Reader();
    absl::Status intact =
        reader.ok() ? CheckEncodedVersion(**reader, base_->inner, deadline) : reader.status();
    if (!intact.ok()) {
      reason = absl::StrFormat(
          "the channel's copy of version %d, the base of a delta, cannot be read back intact "
          "(subscribers that do not hold it could not apply the delta): %s",
          base_->manifest.version, intact.message());
      Log(LogLevel::kWarn, "%s version %d: publishing a keyframe: %s", uri_, version, reason);
      keyframe = true;
      encoded_why.clear();
      plain = PlainReason(true, total_bytes, &encoded_why);
    }
  }
  if (plain) {
    reason = keyframe ? absl::StrCat(*plain, "; a keyframe was due: ", reason) : *plain;
    WB_RETURN_IF_ERROR(PublishPlain(job, infos, reason, total_bytes, deadline));
    requests_.Answered(requests);  // a plain version needs no base either
    return absl::OkStatus();
  }
  const absl::Time start = absl::Now();
  last_stats_.reset();
  auto encode = [&](bool as_keyframe) -> absl::StatusOr<EncodedVersion> {
    VersionIds ids{as_keyframe, version, as_keyframe ? 0 : base_->manifest.version,
                   as_keyframe ? version : *keyframe_};
    std::vector<const std::byte*> base;
    if (!as_keyframe) {
      for (size_t i = 0; i < infos.size(); ++i) base.push_back(base_->tensor(i));
    }
    return EncodeVersion(ids, layout, base, target, options_.encode, *parallel_);
  };
  WB_ASSIGN_OR_RETURN(EncodedVersion encoded, encode(keyframe));
  (keyframe ? rates_.keyframe : rates_.delta)
      .Measure(total_bytes, absl::Now() - start, encoded.bytes.size());
  if (!keyframe) rates_.plain_run = 0;
  // A delta as large as the last keyframe helps no one: send a keyframe (which also shortens the
  // chain a late joiner replays).
  if (!keyframe && encoded.bytes.size() >= keyframe_bytes_) {
    reason = absl::StrFormat(
        "the delta against version %d (%d bytes) is not smaller than keyframe %d (%d bytes)",
        base_->manifest.version, encoded.bytes.size(), *keyframe_, keyframe_bytes_);
    Log(LogLevel::kInfo, "%s version %d: publishing a keyframe: %s", uri_, version, reason);
    keyframe = true;
    const absl::Time again = absl::Now();
    WB_ASSIGN_OR_RETURN(encoded, encode(true));
    rates_.keyframe.Measure(total_bytes, absl::Now() - again, encoded.bytes.size());
  }
  const absl::Time encoded_at = absl::Now();

  WB_ASSIGN_OR_RETURN(const Manifest* target_manifest, job.SealedManifest(deadline));
  if (target_manifest->metadata.count(std::string(kRecordKey)) > 0 ||
      std::any_of(target_manifest->metadata.begin(), target_manifest->metadata.end(),
                  [](const auto& kv) { return IsRankRecordKey(kv.first); })) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s version %d: metadata keys \"%s\" and \"%s.rank-<rank>\" are "
                        "reserved for the delta layer",
                        uri_, version, kRecordKey, kRecordKey));
  }
  Record record;
  record.keyframe = keyframe;
  record.version = version;
  record.keyframe_version = keyframe ? version : *keyframe_;
  record.encoded_bytes = encoded.bytes.size();
  record.reason =
      keyframe ? reason : absl::StrFormat("delta against version %d", base_->manifest.version);
  if (!encoded_why.empty()) absl::StrAppend(&record.reason, "; ", encoded_why);
  if (keyframe) {
    record.tensors = target_manifest->tensors;
  } else {
    record.base = base_->manifest.version;
    record.base_fingerprint = base_->fingerprint;
    bool tiles = false;
    for (const TensorInfo& t : target_manifest->tensors) {
      record.xxh3.push_back(t.xxh3);
      tiles |= t.block_rows > 0;
      TensorInfo& sums = record.tiles.emplace_back();
      if (t.block_rows > 0) {
        sums.block_rows = t.block_rows;
        sums.block_bytes = t.block_bytes;
        sums.block_xxh3 = t.block_xxh3;
      }
    }
    if (!tiles) record.tiles.clear();
  }
  Manifest inner;
  inner.version = version;
  inner.publisher = target_manifest->publisher;
  inner.publish_start_unix_ns = target_manifest->publish_start_unix_ns;
  inner.sealed_unix_ns = target_manifest->sealed_unix_ns;
  inner.metadata = target_manifest->metadata;
  inner.metadata[std::string(kRecordKey)] = RecordToJson(record);
  inner.metadata[std::string(kLayerMetadataKey)] = "delta";
  inner.tensors.push_back(TensorInfo{std::string(kBlobName),
                                     DType::kU8,
                                     {static_cast<int64_t>(encoded.bytes.size())},
                                     std::nullopt,
                                     encoded.bytes.size(),
                                     Xxh3(encoded.bytes.data(), encoded.bytes.size())});
  PlaceForGroup(inner);
  std::optional<Storage> storage;
  if (keyframe) {
    WB_ASSIGN_OR_RETURN(storage, PrepareBase(infos));
  }
  Manifest published = inner;
  SealedPublishJob sealed(std::move(inner), {encoded.bytes.data()});
  const absl::Time transfer_start = absl::Now();
  WB_RETURN_IF_ERROR(inner_->Publish(sealed, deadline));
  rates_.MeasureTransfer(record.encoded_bytes, absl::Now() - transfer_start);

  // Published: from now on the next delta is against this version.
  CommitBase(*target_manifest, packed, storage ? &*storage : nullptr, &encoded);
  base_->inner = std::move(published);
  base_->plain = false;
  if (keyframe) {
    keyframe_ = version;
    keyframe_bytes_ = record.encoded_bytes;
    deltas_since_keyframe_ = 0;
    ApplyFloor();
  } else {
    ++deltas_since_keyframe_;
  }
  if (grouped()) {
    ReadGroupState(version, &*base_);
    // Requests are removed once every rank has keyframed after them (the group's floor), and
    // unreadable ones by the rank that answered them.
    std::vector<KeyframeRequest> done;
    for (KeyframeRequest& r : requests_.Pending(*inner_)) {
      if (RequestAnswered(r) || (keyframe && r.version == 0)) done.push_back(std::move(r));
    }
    requests_.Answered(done);
  } else if (keyframe) {
    requests_.Answered(requests);
  }
  const char* kind = keyframe ? "keyframe" : "delta";
  last_stats_ = CodecStats{encoded_at - start, record.encoded_bytes,
                           absl::StrFormat("%s: %s", kind, record.reason)};
  Log(LogLevel::kDebug,
      "%s version %d: %s of %d bytes for %d bytes of tensors (%.1fx), %d of %d "
      "elements changed, encoded in %s",
      uri_, version, kind, record.encoded_bytes, target_manifest->total_bytes(),
      static_cast<double>(target_manifest->total_bytes()) /
          static_cast<double>(std::max<uint64_t>(1, record.encoded_bytes)),
      encoded.changed_elements, encoded.total_elements, absl::FormatDuration(encoded_at - start));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransportPublisher>> WrapPublisher(
    const Uri& uri, const Config& config, std::unique_ptr<TransportPublisher> inner) {
  WB_ASSIGN_OR_RETURN(LayerOptions options, ReadLayerOptions(uri, config));
  WB_ASSIGN_OR_RETURN(std::shared_ptr<Parallel> parallel, Parallel::Create(options.threads));
  // The stack beneath this layer, as a subscriber reads it.
  WB_ASSIGN_OR_RETURN(std::vector<const TransportDescriptor*> stack, ResolveStack(uri));
  auto self = std::find_if(stack.begin(), stack.end(),
                           [](const TransportDescriptor* d) { return d->scheme == "delta"; });
  std::vector<const TransportDescriptor*> beneath(self == stack.end() ? self : self + 1,
                                                  stack.end());
  const TransportCapabilities caps =
      beneath.empty() ? TransportCapabilities{} : StackCapabilities(beneath, config);
  const int rank = static_cast<int>(config.Int("rank"));
  const int world_size = static_cast<int>(config.Int("world_size"));
  if (world_size > 1) {
    // (A group beneath without committed manifests is refused by the core: LayerCapabilities.)
    // Each rank always encodes: the plain-or-delta choice is one publisher's, made from its own
    // measurements, and the ranks of a group would choose differently.
    options.choose_plain = false;
  }
  ReaderFactory open_reader =
      [beneath, uri, config, parallel, rank, world_size,
       display = uri.Display()]() -> absl::StatusOr<std::unique_ptr<TransportSubscriber>> {
    if (beneath.empty()) return absl::UnimplementedError("no transport beneath the layer");
    WB_ASSIGN_OR_RETURN(std::unique_ptr<TransportSubscriber> inner,
                        OpenSubscriberStack(beneath, uri, config));
    if (world_size > 1) {
      // A rank reads back only its own part of the group's versions (its chain).
      TransportSubscriber* raw = inner.get();
      inner = NewRankView(raw, rank, std::move(inner));
    }
    return NewReader(display, std::move(inner), parallel);
  };
  return std::unique_ptr<TransportPublisher>(new DeltaPublisher(
      uri.Display(), options, std::move(inner), std::move(parallel), std::move(open_reader),
      caps.durable, BackChannel::ForUri(uri), rank, world_size));
}

}  // namespace weightbus::internal::delta
