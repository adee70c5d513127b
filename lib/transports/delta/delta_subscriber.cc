// SPDX-License-Identifier: Apache-2.0
// Subscribing side of the delta layer. The layer keeps its own copy of the last version the core
// accepted (the base). A version is reconstructed from a chain of encoded versions:
//   - a delta against the base: decoded on top of the base;
//   - anything else (a late joiner, a subscriber that missed versions, a base from another
//     history): the chain back to the newest keyframe or to the base, opened with the inner
//     transport's OpenVersion and decoded in order; a transport that cannot open old versions
//     makes the subscriber wait for the next keyframe instead;
//   - the base's own version again: served from the base, never applied twice;
//   - a version older than the base: refused.
// The core verifies the result against the target manifest's checksums before Accepted() makes
// it the new base.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/buffer.h"
#include "core/checksum.h"
#include "core/failpoint.h"
#include "core/logging.h"
#include "core/status.h"
#include "transports/delta/chunk_store.h"
#include "transports/delta/delta_transport.h"

namespace weightbus::internal::delta {
namespace {

constexpr uint64_t kAlign = 64;
uint64_t AlignUp(uint64_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

// Deltas of versions with fewer tensor bytes are not reported: the publisher sends such versions
// encoded whatever the rates (delta_publisher.cc, Rates::kMinTransfer).
constexpr uint64_t kReportMinBytes = uint64_t{1} << 20;
// Longest chain followed back from a version (a guard against a corrupt channel: every step goes
// to a strictly lower version anyway).
constexpr size_t kMaxChain = 100000;
// Versions of a chain kept open (pinned) from the moment it is found; the others are opened
// again one at a time while fetching, so that long chains do not hold hundreds of files.
constexpr size_t kKeepOpen = 8;

// The version this subscriber holds, in its own memory.
struct Base {
  Manifest manifest;
  uint64_t fingerprint = 0;
  std::unique_ptr<HostBuffer> buffer;
  std::vector<uint64_t> offsets;
  // `buffer` holds the version's bytes: false after a plain version whose record says no delta
  // will follow it directly (its bytes are then not copied; a delta against it is replayed
  // from the channel).
  bool has_bytes = true;
  // A subscriber that read only some byte ranges (FetchRanges) holds only the chunks they meet
  // (`buffer` is then null): a delta whose ranges need other chunks, or a whole receive, is
  // replayed from its keyframe instead.
  std::optional<ChunkStore> partial;

  std::byte* tensor(size_t i) const { return buffer ? buffer->data() + offsets[i] : nullptr; }
  bool whole() const { return has_bytes && !partial; }
};

// Storage for a new base, prepared before decoding so that accepting cannot fail.
struct Storage {
  std::unique_ptr<HostBuffer> buffer;  // null: reuse the current base's buffer
  std::vector<uint64_t> offsets;
};

// One encoded version of a chain.
struct Step {
  uint64_t version = 0;
  Record record;
  Manifest inner;     // the inner manifest (publisher, times, metadata, blob checksum)
  Manifest manifest;  // the version it reconstructs
  std::unique_ptr<IncomingVersion> incoming;  // null until (re)opened for fetching
};

// A LandingSink for fetches whose caller checks whole tensors itself.
struct IgnoreLanding final : public LandingSink {
  void Landed(size_t) override {}
};

// Fetches `incoming` into `targets` (one per tensor of `m`, its manifest or the one it
// reconstructs) and checks every tensor against m's checksum, as the core does for a subscriber.
// `what` names the version and `whose` where the checksum comes from, for the message. Errors:
// DataLoss naming the tensor, its source and both checksums; others from the fetch.
absl::Status FetchVerified(IncomingVersion& incoming, const Manifest& m,
                           absl::Span<std::byte* const> targets, absl::Time deadline,
                           const std::string& uri, const std::string& what,
                           const std::string& whose) {
  IgnoreLanding sink;
  WB_RETURN_IF_ERROR(incoming.Fetch(targets, sink, deadline));
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const uint64_t sum = Xxh3(targets[i], m.tensors[i].nbytes);
    if (sum != m.tensors[i].xxh3) {
      return absl::DataLossError(absl::StrFormat(
          "%s: tensor \"%s\" of %s (%s) fails verification: XXH3-64 of its %d bytes is %016x "
          "but %s says %016x",
          uri, m.tensors[i].name, what, incoming.DescribeSource(i), m.tensors[i].nbytes, sum, whose,
          m.tensors[i].xxh3));
    }
  }
  return absl::OkStatus();
}

// The blob of an encoded version, checked against the XXH3-64 its inner manifest gives.
// Errors: DataLoss naming the version, where its bytes come from and both checksums.
absl::StatusOr<std::shared_ptr<HostBuffer>> FetchBlob(const std::string& uri,
                                                      IncomingVersion& incoming, BufferPool& pool,
                                                      absl::Time deadline) {
  const Manifest& inner = incoming.manifest();
  const TensorInfo& info = inner.tensors[0];
  WB_ASSIGN_OR_RETURN(std::shared_ptr<HostBuffer> blob, pool.Get(info.nbytes));
  struct Counter final : public LandingSink {
    void Landed(size_t) override { ++landed; }
    int landed = 0;
  } counter;
  std::byte* const target[1] = {blob->data()};
  WB_RETURN_IF_ERROR(incoming.Fetch(target, counter, deadline));
  const uint64_t sum = Xxh3(blob->data(), info.nbytes);
  if (counter.landed != 1 || sum != info.xxh3) {
    return absl::DataLossError(absl::StrFormat(
        "%s: the encoded version %d (%s) fails verification: XXH3-64 of its %d bytes is %016x "
        "but its manifest says %016x",
        uri, inner.version, incoming.DescribeSource(0), info.nbytes, sum, info.xxh3));
  }
  return blob;
}

class DeltaSubscriber;

class DeltaIncoming final : public IncomingVersion {
 public:
  // A chain; `from_base`: its first step applies to the subscriber's base.
  DeltaIncoming(DeltaSubscriber* owner, std::vector<Step> steps, bool from_base)
      : owner_(owner), steps_(std::move(steps)), from_base_(from_base) {}
  // The base's own version, delivered again.
  DeltaIncoming(DeltaSubscriber* owner, Manifest manifest)
      : owner_(owner), duplicate_(std::move(manifest)) {}

  const Manifest& manifest() const override {
    return duplicate_ ? *duplicate_ : steps_.back().manifest;
  }
  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override;
  // Partial reads (README.md, "Partial reads"): the first FetchRanges decodes the chunks that
  // the ranges PlanRanges announced meet (every chunk when none were announced) into a
  // ChunkStore, from the subscriber's base when it holds them, else from the keyframe; every
  // call copies its ranges out of the store.
  void PlanRanges(absl::Span<const RangeRead> reads) override;
  absl::Status FetchRanges(absl::Span<const RangeRead> reads, absl::Time deadline) override;
  std::string DescribeSource(size_t tensor_index) const override;
  void Accepted() override;
  // Decoding time and the encoded bytes fetched, over every step of the chain (a duplicate of
  // the base moves nothing: 0 bytes).
  std::optional<CodecStats> FetchCodecStats() const override {
    if (!fetched_) return std::nullopt;
    CodecStats c = codec_;
    c.encoding = Chain();
    return c;
  }
  // The encoded versions this reconstructs from, oldest first (none for a duplicate).
  const std::vector<Step>& steps() const { return steps_; }
  bool from_base() const { return from_base_; }

 private:
  absl::Status FetchStep(size_t k, absl::Span<std::byte* const> targets, LandingSink& sink,
                         absl::Time deadline);
  // Step k's encoded blob, checked against its inner manifest's checksum (read again once when
  // it fails, as bytes damaged on their way come right when read again).
  absl::StatusOr<std::shared_ptr<HostBuffer>> StepBlob(size_t k, absl::Time deadline);
  // Replaces a chain that starts on the subscriber's base (or a delivery of the base's own
  // version) by the chain from the version's keyframe: what a base that lacks bytes needs.
  absl::Status FromKeyframe(absl::Time deadline);
  // Decodes the chunks the announced ranges meet into store_ (FetchRanges' first call).
  absl::Status DecodePartial(absl::Time deadline);
  // A plain version's chunks `store` holds, read from the version beneath.
  absl::Status ReadPlainChunks(Step& step, ChunkStore& store, absl::Time deadline);
  std::string Chain() const;
  // A single plain version whose record says no delta follows it directly: its bytes are not
  // copied into the base.
  bool PlainNotKept() const {
    return !duplicate_ && steps_.size() == 1 && steps_[0].record.plain && !steps_[0].record.keep;
  }

  DeltaSubscriber* owner_;
  std::vector<Step> steps_;
  bool from_base_ = false;
  std::optional<Manifest> duplicate_;
  // Filled by Fetch for Accepted.
  std::vector<std::byte*> targets_;
  std::optional<Storage> storage_;
  std::vector<Chunk> chunks_;    // of a single delta on the base
  std::vector<Method> methods_;  // its chunks' methods
  bool fetched_ = false;
  CodecStats codec_;
  // Partial reads: the announced ranges (none: every byte), and what the first FetchRanges
  // decoded (the version's chunks those ranges meet), or that it serves the base's own store.
  std::optional<std::vector<TensorRange>> planned_;
  std::optional<ChunkStore> store_;
  bool from_base_store_ = false;
  std::unique_ptr<HostBuffer> whole_;  // the version decoded whole instead (targets_ point in)
};

class DeltaSubscriber final : public TransportSubscriber {
 public:
  DeltaSubscriber(std::string uri, std::unique_ptr<TransportSubscriber> inner,
                  std::shared_ptr<Parallel> parallel, BackChannel requests,
                  FailPoints failpoints = {}, bool report_decoding = false)
      : uri_(std::move(uri)),
        inner_(std::move(inner)),
        parallel_(std::move(parallel)),
        requests_(std::move(requests)),
        failpoints_(std::move(failpoints)),
        report_decoding_(report_decoding) {}

  absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                  absl::Time deadline) override;
  absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenVersion(uint64_t version,
                                                               absl::Time deadline) override;
  absl::StatusOr<std::vector<uint64_t>> ListVersions() override { return inner_->ListVersions(); }
  void Cancel() override { inner_->Cancel(); }
  const std::string& uri() const { return uri_; }
  TransportSubscriber& inner() { return *inner_; }
  BufferPool& blobs() { return *blobs_; }

 private:
  friend class DeltaIncoming;

  // What to do with inner version `incoming`: a duplicate, a refusal, or a chain. NotFound or
  // Unimplemented mean the chain cannot be reached through this transport.
  absl::StatusOr<std::unique_ptr<IncomingVersion>> Plan(std::unique_ptr<IncomingVersion> incoming,
                                                        absl::Time deadline);
  // Extends `steps` (newest first, one at least) back to a keyframe, or to a delta on this
  // subscriber's base when `use_base` (then *from_base says whether it got there), then puts
  // them oldest first and fills in the manifest each reconstructs.
  absl::Status CompleteChain(std::vector<Step>& steps, bool use_base, bool* from_base,
                             absl::Time deadline);
  std::string Source(uint64_t version) const {
    return absl::StrFormat("%s version %d", uri_, version);
  }
  // Asks the publisher for a keyframe (BackChannel: disk's files, ucx's control connection):
  // `version` cannot be reconstructed because of `failure` (DataLoss: damaged; NotFound: a
  // version of its chain is gone). Other failures (a deadline, a cancel) ask for nothing; a
  // version is asked about once (a caller that waits again meets the same failure until the
  // keyframe comes).
  void RequestKeyframe(uint64_t version, const absl::Status& failure) {
    if (!(absl::IsDataLoss(failure) || absl::IsNotFound(failure))) return;
    if (requested_ == version) return;
    requested_ = version;
    const std::optional<uint64_t> holds =
        base_ ? std::optional<uint64_t>(base_->manifest.version) : std::nullopt;
    if (absl::Status s = requests_.Ask(*inner_, version, holds, std::string(failure.message()));
        s.ok()) {
      Log(LogLevel::kWarn, "%s: asked the publisher for a keyframe %s: %s", uri_, requests_.Where(),
          failure.message());
      // Fault injection (docs/TESTING.md): a test waits here for the request to have been taken.
      (void)failpoints_.Hit("delta.keyframe_requested");
    } else if (!absl::IsUnimplemented(s)) {
      Log(LogLevel::kWarn, "%s: %s (waiting for the next keyframe instead)", uri_, s.message());
    }
  }
  // Sends the report of the last delta applied (pending_report_), if any, through the back
  // channel; a failure is logged once (the publisher then goes by its own estimate).
  void SendReport() {
    if (!pending_report_) return;
    const DecodingReport report = *std::move(pending_report_);
    pending_report_.reset();
    absl::Status s = requests_.Report(*inner_, report.version, report.ToText());
    if (!s.ok() && !absl::IsUnimplemented(s) && !report_failed_) {
      report_failed_ = true;
      Log(LogLevel::kInfo, "%s: cannot report decoding rates to the publisher: %s", uri_,
          s.message());
    }
  }
  absl::StatusOr<Storage> PrepareStorage(const Manifest& manifest) const;
  // The base becomes `manifest`'s version without its bytes (Base::has_bytes).
  void AdoptManifest(const Manifest& manifest) {
    if (!base_) base_.emplace();
    base_->manifest = manifest;
    base_->fingerprint = Fingerprint(manifest);
    base_->has_bytes = false;
  }
  void AdoptBase(const Manifest& manifest, absl::Span<std::byte* const> targets, Storage* storage,
                 const std::vector<Chunk>& chunks, const std::vector<Method>& methods);
  // The base becomes `manifest`'s version, of which it holds the chunks of `store`.
  void AdoptStore(const Manifest& manifest, ChunkStore store) {
    base_.emplace();
    base_->manifest = manifest;
    base_->fingerprint = Fingerprint(manifest);
    base_->has_bytes = true;
    base_->partial = std::move(store);
  }

  std::string uri_;
  std::unique_ptr<TransportSubscriber> inner_;
  std::shared_ptr<Parallel> parallel_;
  BackChannel requests_;
  FailPoints failpoints_;
  std::optional<uint64_t> requested_;  // the version last asked about
  // Reports what decoding deltas costs (a single publisher's subscriber: the publisher weighs
  // it in its plain-or-delta choice; a group's ranks always encode).
  bool report_decoding_ = false;
  std::optional<DecodingReport> pending_report_;  // of the last delta applied, not sent yet
  bool report_failed_ = false;
  std::optional<Base> base_;
  std::shared_ptr<BufferPool> blobs_ = BufferPool::Create(1);
  std::unique_ptr<GroupReceiver> group_;  // for group versions, made by the first one
};

absl::StatusOr<std::unique_ptr<IncomingVersion>> DeltaSubscriber::WaitForVersion(
    uint64_t min_version, absl::Time deadline) {
  SendReport();
  uint64_t want = min_version;
  std::string skipped;
  while (true) {
    absl::StatusOr<std::unique_ptr<IncomingVersion>> got = inner_->WaitForVersion(want, deadline);
    if (!got.ok()) {
      if (absl::IsDeadlineExceeded(got.status()) && !skipped.empty()) {
        return absl::DeadlineExceededError(absl::StrFormat("%s; waiting for a keyframe since: %s",
                                                           got.status().message(), skipped));
      }
      return got.status();
    }
    const uint64_t version = (*got)->manifest().version;
    absl::StatusOr<std::unique_ptr<IncomingVersion>> planned = Plan(*std::move(got), deadline);
    if (!planned.ok()) RequestKeyframe(version, planned.status());
    if (planned.ok() ||
        !(absl::IsNotFound(planned.status()) || absl::IsUnimplemented(planned.status()))) {
      return planned;
    }
    // The chain cannot be reached (the transport cannot open old versions, or no longer holds
    // them): the next keyframe, or a delta on this subscriber's base, will do.
    skipped = std::string(planned.status().message());
    Log(LogLevel::kInfo, "%s", skipped);
    want = version + 1;
  }
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> DeltaSubscriber::OpenVersion(uint64_t version,
                                                                              absl::Time deadline) {
  WB_ASSIGN_OR_RETURN(std::unique_ptr<IncomingVersion> incoming,
                      inner_->OpenVersion(version, deadline));
  return Plan(std::move(incoming), deadline);
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> DeltaSubscriber::Plan(
    std::unique_ptr<IncomingVersion> incoming, absl::Time deadline) {
  if (incoming->manifest().group) {
    // A publisher group's version: each rank's parts from that rank's chain (group.cc).
    if (!group_) group_ = NewGroupReceiver(uri_, inner_.get(), parallel_, requests_);
    return group_->Plan(std::move(incoming), deadline);
  }
  const uint64_t version = incoming->manifest().version;
  WB_ASSIGN_OR_RETURN(Record record, ParseRecord(incoming->manifest(), Source(version)));

  if (base_ && version < base_->manifest.version) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: refusing version %d, older than version %d which this subscriber holds (out of "
        "order)",
        uri_, version, base_->manifest.version));
  }
  if (base_ && base_->has_bytes && version == base_->manifest.version) {
    // Delivered again: the same bytes if its tensors and checksums are the base's.
    bool same;
    if (record.keyframe) {
      Manifest again;
      again.tensors = record.tensors;
      same = Fingerprint(again) == base_->fingerprint;
    } else {
      same = record.xxh3.size() == base_->manifest.tensors.size() &&
             std::equal(record.xxh3.begin(), record.xxh3.end(), base_->manifest.tensors.begin(),
                        [](uint64_t x, const TensorInfo& t) { return x == t.xxh3; });
    }
    if (same) {
      Manifest m = base_->manifest;
      m.publisher = incoming->manifest().publisher;
      m.publish_start_unix_ns = incoming->manifest().publish_start_unix_ns;
      m.sealed_unix_ns = incoming->manifest().sealed_unix_ns;
      m.metadata = incoming->manifest().metadata;
      m.metadata.erase(std::string(kRecordKey));
      m.metadata.erase(std::string(kLayerMetadataKey));
      return std::unique_ptr<IncomingVersion>(new DeltaIncoming(this, std::move(m)));
    }
  }

  std::vector<Step> steps;
  steps.push_back(Step{version, std::move(record), incoming->manifest(), {}, std::move(incoming)});
  bool from_base = false;
  WB_RETURN_IF_ERROR(CompleteChain(steps, /*use_base=*/true, &from_base, deadline));
  return std::unique_ptr<IncomingVersion>(new DeltaIncoming(this, std::move(steps), from_base));
}

absl::Status DeltaSubscriber::CompleteChain(std::vector<Step>& steps, bool use_base,
                                            bool* from_base, absl::Time deadline) {
  // Follow the chain back to a keyframe, or to a delta on this subscriber's base.
  const uint64_t version = steps.front().version;
  *from_base = false;
  while (true) {
    const Record& r = steps.back().record;
    if (r.keyframe) break;
    if (use_base && base_ && base_->has_bytes && r.base == base_->manifest.version &&
        r.base_fingerprint == base_->fingerprint) {
      *from_base = true;
      break;
    }
    if (steps.size() >= kMaxChain) {
      return absl::DataLossError(absl::StrFormat(
          "%s: no keyframe within %d versions below version %d", uri_, kMaxChain, version));
    }
    const uint64_t base = r.base;
    absl::StatusOr<std::unique_ptr<IncomingVersion>> previous = inner_->OpenVersion(base, deadline);
    if (!previous.ok()) {
      return absl::Status(
          previous.status().code(),
          absl::StrFormat("%s: version %d is a delta against version %d, which this subscriber "
                          "does not hold (it holds %s) and cannot open: %s",
                          uri_, steps.back().version, base,
                          base_ ? std::to_string(base_->manifest.version) : "none",
                          previous.status().message()));
    }
    WB_ASSIGN_OR_RETURN(Record pr, ParseRecord((*previous)->manifest(), Source(base)));
    if (pr.version != base) {
      return absl::DataLossError(
          absl::StrFormat("%s: asked for version %d, got version %d", uri_, base, pr.version));
    }
    Manifest inner = (*previous)->manifest();
    if (steps.size() >= kKeepOpen) previous->reset();  // opened again when fetched
    steps.push_back(Step{base, std::move(pr), std::move(inner), {}, *std::move(previous)});
  }
  std::reverse(steps.begin(), steps.end());

  // The manifest each step reconstructs; every delta must have been made against the bytes its
  // predecessor reconstructs.
  const Manifest* previous = *from_base ? &base_->manifest : nullptr;
  for (Step& step : steps) {
    if (!step.record.keyframe && Fingerprint(*previous) != step.record.base_fingerprint) {
      return absl::DataLossError(absl::StrFormat(
          "%s: the chain to version %d is broken: version %d is a delta against other bytes of "
          "version %d than the channel holds",
          uri_, version, step.version, step.record.base));
    }
    WB_ASSIGN_OR_RETURN(step.manifest, TargetManifest(step.inner, step.record, previous));
    previous = &step.manifest;
  }
  return absl::OkStatus();
}

absl::StatusOr<Storage> DeltaSubscriber::PrepareStorage(const Manifest& manifest) const {
  Storage storage;
  uint64_t total = 0;
  for (const TensorInfo& t : manifest.tensors) {
    storage.offsets.push_back(total);
    total += AlignUp(t.nbytes);
  }
  if (total > 0 && !(base_ && base_->buffer && base_->buffer->size() >= total)) {
    WB_ASSIGN_OR_RETURN(storage.buffer, HostBuffer::Allocate(total));
  }
  return storage;
}

void DeltaSubscriber::AdoptBase(const Manifest& manifest, absl::Span<std::byte* const> targets,
                                Storage* storage, const std::vector<Chunk>& chunks,
                                const std::vector<Method>& methods) {
  if (storage != nullptr) {
    Base b;
    b.offsets = std::move(storage->offsets);
    b.buffer =
        storage->buffer ? std::move(storage->buffer) : (base_ ? std::move(base_->buffer) : nullptr);
    base_ = std::move(b);
    parallel_->For(manifest.tensors.size(), [&](size_t i) {
      if (manifest.tensors[i].nbytes > 0) {
        std::memcpy(base_->tensor(i), targets[i], manifest.tensors[i].nbytes);
      }
    });
  } else {
    // A single delta on the base: only the chunks that changed.
    parallel_->For(chunks.size(), [&](size_t c) {
      if (methods[c] == Method::kSame) return;
      for (const Piece& p : chunks[c].pieces) {
        std::memcpy(base_->tensor(p.tensor) + p.offset, targets[p.tensor] + p.offset, p.bytes);
      }
    });
  }
  base_->manifest = manifest;
  base_->fingerprint = Fingerprint(manifest);
  base_->has_bytes = true;
}

absl::Status DeltaIncoming::Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                                  absl::Time deadline) {
  targets_.assign(targets.begin(), targets.end());
  // A base that holds only some chunks (after partial reads) cannot serve a whole version.
  if ((duplicate_ || from_base_) && !owner_->base_->whole()) {
    WB_RETURN_IF_ERROR(FromKeyframe(deadline));
  }
  const Manifest& m = manifest();
  if (duplicate_) {
    const Base& base = *owner_->base_;
    owner_->parallel_->For(m.tensors.size(), [&](size_t i) {
      if (m.tensors[i].nbytes > 0) std::memcpy(targets[i], base.tensor(i), m.tensors[i].nbytes);
      sink.Landed(i);
    });
    fetched_ = true;
    return absl::OkStatus();
  }
  // A single delta on the base only refreshes the chunks it changes; anything else replaces the
  // whole base.
  if (!(from_base_ && steps_.size() == 1) && !PlainNotKept()) {
    WB_ASSIGN_OR_RETURN(storage_, owner_->PrepareStorage(m));
  }
  for (size_t k = 0; k < steps_.size(); ++k) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("%s: the deadline passed after %d of the %d encoded versions of %s",
                          owner_->uri_, k, steps_.size(), Chain()));
    }
    if (absl::Status s = FetchStep(k, targets, sink, deadline); !s.ok()) {
      owner_->RequestKeyframe(steps_.back().version, s);
      return s;
    }
  }
  fetched_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<HostBuffer>> DeltaIncoming::StepBlob(size_t k, absl::Time deadline) {
  Step& step = steps_[k];
  if (!step.incoming) {
    absl::StatusOr<std::unique_ptr<IncomingVersion>> again =
        owner_->inner_->OpenVersion(step.version, deadline);
    if (!again.ok()) {
      return absl::Status(again.status().code(),
                          absl::StrFormat("%s: version %d of %s is gone: %s", owner_->uri_,
                                          step.version, Chain(), again.status().message()));
    }
    if ((*again)->manifest() != step.inner) {
      return absl::DataLossError(absl::StrFormat(
          "%s: version %d changed while its chain was being read", owner_->uri_, step.version));
    }
    step.incoming = *std::move(again);
  }
  if (step.record.plain) return std::shared_ptr<HostBuffer>();  // no blob: its own tensors
  // The encoded blob, checked against the checksum its inner manifest carries.
  absl::StatusOr<std::shared_ptr<HostBuffer>> fetched =
      FetchBlob(owner_->uri_, *step.incoming, *owner_->blobs_, deadline);
  if (absl::IsDataLoss(fetched.status())) {
    // Repair from the channel: bytes damaged on their way (a transfer, a read) come right when
    // read again; bytes damaged at rest fail again, and the subscriber keeps its version.
    absl::StatusOr<std::unique_ptr<IncomingVersion>> again =
        owner_->inner_->OpenVersion(step.version, deadline);
    if (again.ok() && (*again)->manifest() == step.inner) {
      absl::StatusOr<std::shared_ptr<HostBuffer>> second =
          FetchBlob(owner_->uri_, **again, *owner_->blobs_, deadline);
      if (second.ok()) {
        Log(LogLevel::kWarn, "%s (read again: intact)", fetched.status().message());
        step.incoming = *std::move(again);
        fetched = std::move(second);
      }
    }
  }
  if (fetched.ok()) codec_.wire_bytes += step.inner.tensors[0].nbytes;
  return fetched;
}

absl::Status DeltaIncoming::FetchStep(size_t k, absl::Span<std::byte* const> targets,
                                      LandingSink& sink, absl::Time deadline) {
  Step& step = steps_[k];
  const bool last = k + 1 == steps_.size();
  absl::StatusOr<std::shared_ptr<HostBuffer>> fetched = StepBlob(k, deadline);
  if (fetched.ok() && step.record.plain) {
    // The version's own tensors: straight into the targets (verified by the core, for the last
    // step as they land).
    IgnoreLanding ignore;
    WB_RETURN_IF_ERROR(step.incoming->Fetch(targets, last ? sink : ignore, deadline));
    codec_.wire_bytes += step.inner.total_bytes();
    if (!last) step.incoming.reset();
    return absl::OkStatus();
  }
  WB_ASSIGN_OR_RETURN(std::shared_ptr<HostBuffer> blob, std::move(fetched));
  const absl::Span<const std::byte> bytes(blob->data(), step.inner.tensors[0].nbytes);
  const absl::Time decode_start = absl::Now();
  const std::vector<TensorLayout> layout = LayoutOf(step.manifest.tensors);
  std::vector<const std::byte*> base;
  if (!step.record.keyframe) {
    for (size_t i = 0; i < layout.size(); ++i) {
      base.push_back(k == 0 ? owner_->base_->tensor(i) : targets[i]);
    }
  }
  absl::Status decoded =
      DecodeVersion(bytes, step.record.ids(), layout, base, targets, *owner_->parallel_,
                    last ? std::function<void(size_t)>([&sink](size_t i) { sink.Landed(i); })
                         : std::function<void(size_t)>());
  codec_.time += absl::Now() - decode_start;
  if (!decoded.ok()) {
    return absl::Status(
        decoded.code(),
        absl::StrFormat("%s: encoded version %d (%s, part of %s): %s", owner_->uri_, step.version,
                        step.incoming->DescribeSource(0), Chain(), decoded.message()));
  }
  if (last && from_base_ && steps_.size() == 1) {
    WB_ASSIGN_OR_RETURN(VersionHeader header, ParseHeader(bytes));
    chunks_ = PlanChunks(layout, header.chunk_size);
    methods_ = ChunkMethods(bytes, header);
  }
  if (!last) step.incoming.reset();  // releases the inner version's pin
  return absl::OkStatus();
}

absl::Status DeltaIncoming::FromKeyframe(absl::Time deadline) {
  const uint64_t version = manifest().version;
  const std::vector<TensorInfo> planned = manifest().tensors;  // before steps_ is moved from
  std::vector<Step> steps;
  if (duplicate_) {
    WB_ASSIGN_OR_RETURN(std::unique_ptr<IncomingVersion> incoming,
                        owner_->inner_->OpenVersion(version, deadline));
    WB_ASSIGN_OR_RETURN(Record record, ParseRecord(incoming->manifest(), owner_->Source(version)));
    Manifest inner = incoming->manifest();
    steps.push_back(Step{version, std::move(record), std::move(inner), {}, std::move(incoming)});
  } else {
    steps.push_back(std::move(steps_.back()));
  }
  bool from_base = false;
  WB_RETURN_IF_ERROR(owner_->CompleteChain(steps, /*use_base=*/false, &from_base, deadline));
  const std::vector<TensorInfo>& replayed = steps.back().manifest.tensors;
  for (size_t i = 0; i < std::max(replayed.size(), planned.size()); ++i) {
    if (i < replayed.size() && i < planned.size() && replayed[i] == planned[i]) continue;
    return absl::DataLossError(absl::StrFormat(
        "%s: version %d replayed from keyframe %d has other tensors than the version this "
        "subscriber's copy gave (tensor %d: \"%s\" XXH3-64 %016x there, \"%s\" %016x here)",
        owner_->uri_, version, steps.front().version, i,
        i < replayed.size() ? replayed[i].name : "", i < replayed.size() ? replayed[i].xxh3 : 0,
        i < planned.size() ? planned[i].name : "", i < planned.size() ? planned[i].xxh3 : 0));
  }
  Log(LogLevel::kInfo,
      "%s: version %d: this subscriber holds only the chunks its slices met of version %d; "
      "replaying from keyframe %d",
      owner_->uri_, version, owner_->base_->manifest.version, steps.front().version);
  steps_ = std::move(steps);
  from_base_ = false;
  duplicate_.reset();
  return absl::OkStatus();
}

void DeltaIncoming::PlanRanges(absl::Span<const RangeRead> reads) {
  std::vector<TensorRange> ranges;
  ranges.reserve(reads.size());
  for (const RangeRead& r : reads) ranges.push_back(TensorRange{r.tensor, r.offset, r.length});
  planned_ = std::move(ranges);
}

absl::Status DeltaIncoming::ReadPlainChunks(Step& step, ChunkStore& store, absl::Time deadline) {
  std::vector<RangeRead> reads;
  for (size_t c = 0; c < store.chunks().size(); ++c) {
    if (!store.Has(c)) continue;
    uint64_t in_chunk = 0;
    for (const Piece& p : store.chunks()[c].pieces) {
      reads.push_back(RangeRead{p.tensor, p.offset, p.bytes, store.chunk(c) + in_chunk});
      in_chunk += p.bytes;
      codec_.wire_bytes += p.bytes;
    }
  }
  absl::Status read = step.incoming->FetchRanges(reads, deadline);
  if (!absl::IsUnimplemented(read)) return read;
  // A transport beneath without partial reads: the tensors the chunks meet, whole.
  std::vector<std::unique_ptr<HostBuffer>> whole(step.manifest.tensors.size());
  std::vector<std::byte*> targets(whole.size(), nullptr);
  for (const RangeRead& r : reads) {
    if (whole[r.tensor]) continue;
    WB_ASSIGN_OR_RETURN(whole[r.tensor],
                        HostBuffer::Allocate(step.manifest.tensors[r.tensor].nbytes));
    targets[r.tensor] = whole[r.tensor]->data();
  }
  IgnoreLanding ignore;
  WB_RETURN_IF_ERROR(step.incoming->Fetch(targets, ignore, deadline));
  for (const RangeRead& r : reads) std::memcpy(r.target, targets[r.tensor] + r.offset, r.length);
  return absl::OkStatus();
}

absl::Status DeltaIncoming::DecodePartial(absl::Time deadline) {
  const Manifest& m = manifest();
  const std::vector<TensorLayout> layout = LayoutOf(m.tensors);
  std::vector<TensorRange> ranges;
  if (planned_) {
    ranges = *planned_;
  } else {
    for (size_t i = 0; i < layout.size(); ++i)
      ranges.push_back(TensorRange{i, 0, layout[i].nbytes});
  }
  const absl::Time start = absl::Now();
  fetched_ = true;
  if (std::none_of(ranges.begin(), ranges.end(),
                   [](const TensorRange& r) { return r.length > 0; })) {
    // Nothing of this version is read (a group rank none of whose parts the slices meet): no
    // blob is fetched, and the base keeps no bytes.
    WB_ASSIGN_OR_RETURN(store_, ChunkStore::Create(layout, EncodeOptions{}.chunk_size, {}));
    return absl::OkStatus();
  }
  Base* base = owner_->base_ ? &*owner_->base_ : nullptr;
  // The chunk plan of this version's encoding (an encoded version's header gives its size; a
  // plain version has none, and its store is cut as the layer's default cuts).
  uint64_t chunk_size = EncodeOptions{}.chunk_size;
  if (duplicate_) {
    if (base->whole()) {
      from_base_store_ = true;  // served from the base's whole copy
      return absl::OkStatus();
    }
    const ChunkStore& held = *base->partial;
    if (held.layout() == layout && held.HasAll(ChunksMeeting(layout, held.chunk_size(), ranges))) {
      from_base_store_ = true;
      return absl::OkStatus();
    }
    WB_RETURN_IF_ERROR(FromKeyframe(deadline));
  }
  // Blobs are fetched step by step; the first's header gives the chunk size.
  std::vector<std::shared_ptr<HostBuffer>> blobs(steps_.size());
  auto header = [&](size_t k) -> absl::StatusOr<VersionHeader> {
    return ParseHeader(
        absl::Span<const std::byte>(blobs[k]->data(), steps_[k].inner.tensors[0].nbytes));
  };
  size_t first_encoded = steps_[0].record.plain ? 1 : 0;
  if (first_encoded < steps_.size()) {
    WB_ASSIGN_OR_RETURN(blobs[first_encoded], StepBlob(first_encoded, deadline));
    WB_ASSIGN_OR_RETURN(VersionHeader h, header(first_encoded));
    chunk_size = h.chunk_size;
  }
  std::vector<bool> wanted = ChunksMeeting(layout, chunk_size, ranges);
  // A delta on the base: the base's store must hold every chunk this one needs, cut alike.
  std::optional<ChunkStore> previous;
  if (from_base_) {
    if (base->whole()) {
      WB_ASSIGN_OR_RETURN(previous, ChunkStore::Create(layout, chunk_size, wanted));
      for (size_t c = 0; c < previous->chunks().size(); ++c) {
        if (!previous->Has(c)) continue;
        uint64_t in_chunk = 0;
        for (const Piece& p : previous->chunks()[c].pieces) {
          std::memcpy(previous->chunk(c) + in_chunk, base->tensor(p.tensor) + p.offset, p.bytes);
          in_chunk += p.bytes;
        }
      }
    } else if (!(base->partial->chunk_size() == chunk_size && base->partial->layout() == layout &&
                 base->partial->HasAll(wanted))) {
      WB_RETURN_IF_ERROR(FromKeyframe(deadline));
      return DecodePartial(deadline);  // now from the keyframe
    }
  }
  const ChunkStore* prev = previous ? &*previous : from_base_ ? &*base->partial : nullptr;
  for (size_t k = 0; k < steps_.size(); ++k) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("%s: the deadline passed after %d of the %d encoded versions of %s",
                          owner_->uri_, k, steps_.size(), Chain()));
    }
    Step& step = steps_[k];
    WB_ASSIGN_OR_RETURN(ChunkStore next, ChunkStore::Create(layout, chunk_size, wanted));
    if (step.record.plain) {
      if (!step.incoming) WB_RETURN_IF_ERROR(StepBlob(k, deadline).status());  // reopens
      WB_RETURN_IF_ERROR(ReadPlainChunks(step, next, deadline));
    } else {
      if (!blobs[k]) {
        WB_ASSIGN_OR_RETURN(blobs[k], StepBlob(k, deadline));
      }
      WB_ASSIGN_OR_RETURN(VersionHeader h, header(k));
      if (h.chunk_size != chunk_size) {
        // A chain whose versions were cut differently (the publisher's delta_chunk_size changed
        // within it): their chunks do not line up; the caller decodes it whole.
        return absl::UnimplementedError(absl::StrFormat(
            "%s: the chain of %s mixes chunk sizes (%d and %d bytes); partial decoding needs one",
            owner_->uri_, Chain(), chunk_size, h.chunk_size));
      }
      const absl::Span<const std::byte> bytes(blobs[k]->data(), step.inner.tensors[0].nbytes);
      absl::Status decoded =
          DecodeChunks(bytes, step.record.ids(), step.record.keyframe ? nullptr : prev, next,
                       *owner_->parallel_);
      if (!decoded.ok()) {
        return absl::Status(decoded.code(), absl::StrFormat("%s: encoded version %d (%s, part of "
                                                            "%s): %s",
                                                            owner_->uri_, step.version,
                                                            step.incoming->DescribeSource(0),
                                                            Chain(), decoded.message()));
      }
      blobs[k].reset();
    }
    if (k + 1 < steps_.size()) step.incoming.reset();  // releases the inner version's pin
    previous = std::move(next);
    prev = &*previous;
  }
  store_ = std::move(previous);
  codec_.time += absl::Now() - start;
  return absl::OkStatus();
}

absl::Status DeltaIncoming::FetchRanges(absl::Span<const RangeRead> reads, absl::Time deadline) {
  if (!store_ && !from_base_store_ && !whole_) {
    absl::Status s = DecodePartial(deadline);
    if (absl::IsUnimplemented(s)) {
      // Decoded whole instead, as Fetch decodes (and Accepted then adopts) a version.
      Log(LogLevel::kInfo, "%s; decoding the whole version instead", s.message());
      codec_ = CodecStats{};
      uint64_t total = 0;
      std::vector<uint64_t> offsets;
      for (const TensorInfo& t : manifest().tensors) {
        offsets.push_back(total);
        total += AlignUp(t.nbytes);
      }
      absl::StatusOr<std::unique_ptr<HostBuffer>> whole = HostBuffer::Allocate(total);
      s = whole.status();
      if (s.ok()) {
        whole_ = *std::move(whole);
        std::vector<std::byte*> targets;
        for (uint64_t o : offsets) targets.push_back(whole_->data() + o);
        IgnoreLanding ignore;
        s = Fetch(targets, ignore, deadline);  // asks for a keyframe itself when it fails
        if (!s.ok()) return s;
      }
    }
    if (!s.ok()) {
      store_.reset();
      owner_->RequestKeyframe(manifest().version, s);
      return s;
    }
  }
  const Manifest& m = manifest();
  for (const RangeRead& r : reads) {
    if (r.tensor >= m.tensors.size() || r.offset > m.tensors[r.tensor].nbytes ||
        r.length > m.tensors[r.tensor].nbytes - r.offset) {
      return absl::InternalError(absl::StrFormat("%s: range [%d, %d) asked of tensor %d of %s",
                                                 owner_->uri_, r.offset, r.offset + r.length,
                                                 r.tensor, Chain()));
    }
    if (r.length == 0) continue;
    if (whole_) {
      std::memcpy(r.target, targets_[r.tensor] + r.offset, r.length);
      continue;
    }
    const Base& base = *owner_->base_;
    if (from_base_store_ && base.whole()) {
      std::memcpy(r.target, base.tensor(r.tensor) + r.offset, r.length);
      continue;
    }
    const ChunkStore& store = from_base_store_ ? *base.partial : *store_;
    WB_RETURN_IF_ERROR(store.CopyOut(TensorRange{r.tensor, r.offset, r.length}, r.target));
  }
  return absl::OkStatus();
}

void DeltaIncoming::Accepted() {
  if (duplicate_ || !fetched_ || from_base_store_) return;
  if (store_) {  // partial reads: the chunks decoded become the base
    if (PlainNotKept()) {
      owner_->AdoptManifest(manifest());
    } else {
      owner_->AdoptStore(manifest(), std::move(*store_));
    }
    store_.reset();
    if (steps_.back().incoming) steps_.back().incoming->Accepted();
    return;
  }
  const absl::Time apply_start = absl::Now();
  if (PlainNotKept()) {
    owner_->AdoptManifest(manifest());
  } else {
    owner_->AdoptBase(manifest(), targets_, storage_ ? &*storage_ : nullptr, chunks_, methods_);
  }
  // A delta on this subscriber's copy of the version before, large enough for the publisher's
  // plain-or-delta choice to weigh: what decoding it cost here goes back to the publisher (sent
  // before the next wait, off the path of this version).
  if (owner_->report_decoding_ && from_base_ && steps_.size() == 1 && !steps_[0].record.keyframe &&
      !steps_[0].record.plain && manifest().total_bytes() >= kReportMinBytes) {
    DecodingReport report;
    report.version = manifest().version;
    report.bytes = manifest().total_bytes();
    report.decode_s = absl::ToDoubleSeconds(codec_.time);
    report.apply_s = absl::ToDoubleSeconds(absl::Now() - apply_start);
    report.threads = owner_->parallel_->threads();
    owner_->pending_report_ = std::move(report);
  }
  // The encoded version of the one delivered (not the chain's earlier ones) is accepted beneath
  // too: a transport that reports receipts to its publisher (ucx) counts this subscriber.
  if (steps_.back().incoming) steps_.back().incoming->Accepted();
}

std::string DeltaIncoming::Chain() const {
  if (duplicate_) {
    return absl::StrFormat(
        "this subscriber's copy of version %d (delivered again, not applied "
        "again)",
        duplicate_->version);
  }
  const uint64_t first = steps_.front().version, last = steps_.back().version;
  if (from_base_) {
    return steps_.size() == 1
               ? absl::StrFormat("delta %d on this subscriber's copy of version %d", last,
                                 steps_.front().record.base)
               : absl::StrFormat("deltas %d..%d on this subscriber's copy of version %d", first,
                                 last, steps_.front().record.base);
  }
  const char* start = steps_.front().record.plain ? "plain version" : "keyframe";
  return steps_.size() == 1
             ? absl::StrFormat("%s %d", start, first)
             : absl::StrFormat("%s %d + %d deltas up to %d", start, first, steps_.size() - 1, last);
}

std::string DeltaIncoming::DescribeSource(size_t tensor_index) const {
  const Step* last = duplicate_ ? nullptr : &steps_.back();
  return absl::StrFormat(
      "tensor %d decoded from %s%s", tensor_index, Chain(),
      last && last->incoming ? absl::StrFormat(" (%s)", last->incoming->DescribeSource(0)) : "");
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransportSubscriber>> WrapSubscriber(
    const Uri& uri, const Config& config, std::unique_ptr<TransportSubscriber> inner) {
  WB_ASSIGN_OR_RETURN(LayerOptions options, ReadLayerOptions(uri, config));
  WB_ASSIGN_OR_RETURN(std::unique_ptr<Parallel> parallel, Parallel::Create(options.threads));
  WB_ASSIGN_OR_RETURN(FailPoints failpoints, FailPoints::Parse(config.String("failpoints")));
  return std::unique_ptr<TransportSubscriber>(
      new DeltaSubscriber(uri.Display(), std::move(inner), std::move(parallel),
                          BackChannel::ForUri(uri), std::move(failpoints),
                          /*report_decoding=*/true));
}

std::unique_ptr<TransportSubscriber> NewReader(std::string uri,
                                               std::unique_ptr<TransportSubscriber> inner,
                                               std::shared_ptr<Parallel> parallel) {
  // The publisher's own reader asks for nothing: it sends a keyframe itself when reading fails.
  return std::unique_ptr<TransportSubscriber>(new DeltaSubscriber(
      std::move(uri), std::move(inner), std::move(parallel), BackChannel::None()));
}

std::unique_ptr<TransportSubscriber> NewRankSubscriber(std::string uri,
                                                       std::unique_ptr<TransportSubscriber> inner,
                                                       std::shared_ptr<Parallel> parallel,
                                                       BackChannel requests) {
  return std::unique_ptr<TransportSubscriber>(new DeltaSubscriber(
      std::move(uri), std::move(inner), std::move(parallel), std::move(requests)));
}

absl::Status CheckEncodedVersion(TransportSubscriber& reader, const Manifest& published,
                                 absl::Time deadline) {
  auto& delta = static_cast<DeltaSubscriber&>(reader);
  WB_ASSIGN_OR_RETURN(std::unique_ptr<IncomingVersion> incoming,
                      delta.inner().OpenVersion(published.version, deadline));
  if (incoming->manifest() != published) {
    return absl::DataLossError(absl::StrFormat(
        "%s: the manifest of version %d on the channel is not the one this publisher published",
        delta.uri(), published.version));
  }
  const Manifest& m = incoming->manifest();
  if (m.tensors.size() == 1 && m.tensors[0].name == kBlobName) {
    return FetchBlob(delta.uri(), *incoming, delta.blobs(), deadline).status();
  }
  // A plain version: its own tensors, each against its checksum.
  WB_ASSIGN_OR_RETURN(std::shared_ptr<HostBuffer> buffer, delta.blobs().Get(m.total_bytes()));
  std::vector<std::byte*> targets;
  uint64_t at = 0;
  for (const TensorInfo& t : m.tensors) {
    targets.push_back(buffer->data() + at);
    at += t.nbytes;
  }
  return FetchVerified(*incoming, m, targets, deadline, delta.uri(),
                       absl::StrFormat("the plain version %d", m.version), "its manifest");
}

absl::StatusOr<ChainVersion> ReadChainVersion(TransportSubscriber& reader, uint64_t version,
                                              const std::vector<TensorInfo>& layout,
                                              absl::Time deadline) {
  auto& delta = static_cast<DeltaSubscriber&>(reader);
  WB_ASSIGN_OR_RETURN(std::unique_ptr<IncomingVersion> opened,
                      delta.OpenVersion(version, deadline));
  auto& incoming = static_cast<DeltaIncoming&>(*opened);
  const Manifest& m = incoming.manifest();
  if (incoming.steps().empty() || incoming.from_base()) {
    return absl::InternalError(absl::StrFormat(
        "%s: version %d was not planned from its keyframe (the reader holds a version)",
        delta.uri(), version));
  }
  if (!SameLayout(m.tensors, layout)) {
    std::string diff = absl::StrFormat("%d tensors, this call %d", m.tensors.size(), layout.size());
    for (size_t i = 0; i < std::min(m.tensors.size(), layout.size()); ++i) {
      if (!SameLayout({m.tensors[i]}, {layout[i]})) {
        diff = absl::StrFormat("tensor %d is \"%s\" %s %s there, \"%s\" %s %s in this call", i,
                               m.tensors[i].name, DTypeName(m.tensors[i].dtype),
                               ShapeString(m.tensors[i].shape), layout[i].name,
                               DTypeName(layout[i].dtype), ShapeString(layout[i].shape));
        break;
      }
    }
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: version %d has another tensor layout (%s)", delta.uri(), version, diff));
  }
  ChainVersion out;
  uint64_t total = 0;
  for (const TensorInfo& t : m.tensors) {
    out.offsets.push_back(total);
    total += AlignUp(t.nbytes);
  }
  if (total > 0) {
    WB_ASSIGN_OR_RETURN(out.buffer, HostBuffer::Allocate(total));
  }
  std::vector<std::byte*> targets;
  for (uint64_t offset : out.offsets)
    targets.push_back(out.buffer ? out.buffer->data() + offset : nullptr);
  WB_RETURN_IF_ERROR(
      FetchVerified(incoming, m, targets, deadline, delta.uri(),
                    absl::StrFormat("version %d as reconstructed from the channel", version),
                    "the channel's record of the version"));
  out.manifest = m;
  out.inner = incoming.steps().back().inner;
  out.keyframe = incoming.steps().front().version;
  out.deltas_since_keyframe = incoming.steps().size() - 1;
  out.keyframe_bytes = incoming.steps().front().record.encoded_bytes;
  return out;
}

}  // namespace weightbus::internal::delta
