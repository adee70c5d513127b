// SPDX-License-Identifier: Apache-2.0
// The nccl:// replica. Everything runs on the caller's thread, inside the core's calls: the
// first WaitForVersion connects and joins (HELLO); each call then reads what the publisher sent
// (a GROUP to initialize its rank of a new communicator, OFFERs, ABORTs) and keeps a rank's
// non-blocking initialization going across calls. An OFFER becomes an IncomingVersion; its
// Fetch says READY, waits for START and receives the buckets (pipeline.h) into the core's
// targets. A version the replica does not keep (one below what it waits for, or one the core
// refused before receiving it, e.g. a binding mismatch) is still received, into the bucket
// buffers only, so that the collective completes for the other replicas.
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/control_plane.h"
#include "core/failpoint.h"
#include "core/logging.h"
#include "core/secret.h"
#include "core/status.h"
#include "core/system.h"
#include "transports/nccl/device.h"
#include "transports/nccl/handshake.h"
#include "transports/nccl/nccl_transport.h"
#include "transports/nccl/pipeline.h"
#include "transports/nccl/plan.h"
#include "transports/nccl/protocol.h"

namespace weightbus::internal::nccl {
namespace {

// How long a version the core did not keep is still received (drained) for the others' sake
// beyond the deadline of the call that found it.
constexpr absl::Duration kDrainTimeout = absl::Seconds(60);

struct Offer {
  uint64_t epoch = 0;
  Manifest manifest;
  BucketPlan plan;
};

class NcclIncoming;

class NcclSubscriber final : public TransportSubscriber {
 public:
  NcclSubscriber(Endpoint endpoint, NcclOptions options, FailPoints failpoints,
                 std::shared_ptr<Backend> backend, std::unique_ptr<Device> device)
      : endpoint_(std::move(endpoint)),
        options_(options),
        failpoints_(std::move(failpoints)),
        backend_(std::move(backend)),
        device_(std::move(device)),
        description_(ProcessDescription()) {}

  ~NcclSubscriber() override {
    absl::MutexLock lock(&mu_);
    Disconnect();
    slots_.clear();
  }

  absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                  absl::Time deadline) override;

  void Cancel() override { cancelled_ = true; }

 private:
  friend class NcclIncoming;

  absl::Status CheckCancelled() const {
    if (!cancelled_) return absl::OkStatus();
    return absl::CancelledError(
        absl::StrFormat("%s: the subscriber is being closed", endpoint_.display));
  }
  // Connects and greets the publisher (HELLO, WELCOME) when not connected.
  absl::Status Connect() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the publisher: its connection, the communicator, what it offered.
  void Disconnect() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads and handles what the publisher sent so far, and advances a rank's initialization.
  // Errors: the publisher is gone (Unavailable naming it; the replica is then disconnected),
  // cancelled.
  absl::Status Pump() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Handle(const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SendNow(std::string frame) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sleeps until the publisher's connection is readable or `wait` passed (at most).
  void Idle(absl::Duration wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The version the publisher aborted (ABORT for `version`) or that can no longer be received
  // on this connection, if so.
  std::optional<absl::Status> AbortOf(uint64_t epoch, uint64_t version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Receives `offer` into `targets` (all null: drain), reporting each bucket (on_bucket). The
  // whole of a Fetch: READY, START, the buckets.
  absl::Status Receive(const Offer& offer, absl::Span<std::byte* const> targets,
                       const std::function<void(size_t)>& landed, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnsureSlots(uint64_t bucket_size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A co-located replica's receive: each bucket copied out of the root's buffer once BUCKET
  // says it is there (targets all null: nothing copied).
  absl::Status ReceiveColocated(const Offer& offer, absl::Span<std::byte* const> targets,
                                Watch& watch, const std::function<absl::Status(size_t)>& on_bucket,
                                absl::Time deadline, const std::string& what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Aborts the communicator. While a receive drives it (`receiving_`) the object stays, aborted,
  // until the receive returns; otherwise it is freed.
  void DropCommunicator() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Endpoint endpoint_;
  const NcclOptions options_;
  FailPoints failpoints_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Device> device_;
  const std::string description_;
  const uint64_t replica_id_ = RandomId();
  std::atomic<bool> cancelled_{false};

  absl::Mutex mu_;
  Stream stream_ ABSL_GUARDED_BY(mu_);
  std::string publisher_ ABSL_GUARDED_BY(mu_);  // "the publisher pid 12 on trainer-0, GPU 0 (...)"
  std::unique_ptr<Communicator> comm_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool comm_ready_ ABSL_GUARDED_BY(mu_) = false;    // initialized, not aborted
  bool initializing_ ABSL_GUARDED_BY(mu_) = false;  // StartCommunicator done, not yet ready
  std::string members_ ABSL_GUARDED_BY(mu_);
  std::deque<Offer> offers_ ABSL_GUARDED_BY(mu_);
  // ABORTs received: (epoch, version) -> why (version 0: the communicator of that epoch).
  std::map<std::pair<uint64_t, uint64_t>, absl::Status> aborts_ ABSL_GUARDED_BY(mu_);
  std::optional<std::pair<uint64_t, uint64_t>> started_ ABSL_GUARDED_BY(mu_);    // START
  std::optional<std::pair<uint64_t, uint64_t>> committed_ ABSL_GUARDED_BY(mu_);  // COMMIT
  std::vector<std::shared_ptr<void>> slots_ ABSL_GUARDED_BY(mu_);
  uint64_t slot_size_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t newest_seen_ ABSL_GUARDED_BY(mu_) = 0;
  bool receiving_ ABSL_GUARDED_BY(mu_) = false;  // ReceiveBuckets holds *comm_
  // On the publisher's own GPU (GROUP rank 0): no rank; the root's bucket buffers (SLOTS), and
  // which bucket is in which (BUCKET: (version, bucket) -> buffer).
  bool colocated_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<void>> shared_slots_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint64_t, uint64_t>, uint32_t> ready_buckets_ ABSL_GUARDED_BY(mu_);
};

class NcclIncoming final : public IncomingVersion {
 public:
  NcclIncoming(NcclSubscriber* sub, Offer offer, absl::Time deadline)
      : sub_(sub), offer_(std::move(offer)), deadline_(deadline) {}

  ~NcclIncoming() override {
    if (fetched_) return;
    // The core did not receive it (it refused the version before any byte, or gave up): the
    // collective still needs this rank, so the buckets are received and dropped.
    absl::MutexLock lock(&sub_->mu_);
    std::vector<std::byte*> none(offer_.manifest.tensors.size(), nullptr);
    absl::Status s = sub_->Receive(
        offer_, none, [](size_t) {}, std::max(deadline_, absl::Now() + kDrainTimeout));
    if (!s.ok()) {
      Log(LogLevel::kWarn,
          "%s: version %d, which this replica did not keep, could not be "
          "received for the rest of the communicator: %s",
          sub_->endpoint_.display, offer_.manifest.version, s.message());
    }
  }

  const Manifest& manifest() const override { return offer_.manifest; }

  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override {
    fetched_ = true;
    absl::MutexLock lock(&sub_->mu_);
    const std::vector<std::vector<uint32_t>> completes = TensorsCompletedBy(offer_.plan);
    // Tensors without bytes are complete before any bucket (their target may be null: a null
    // target means "not needed" only for a tensor with bytes).
    for (size_t i = 0; i < offer_.manifest.tensors.size(); ++i) {
      if (offer_.manifest.tensors[i].nbytes == 0) sink.Landed(i);
    }
    return sub_->Receive(
        offer_, targets,
        [&](size_t bucket) {
          for (uint32_t t : completes[bucket]) {
            if (targets[t] != nullptr) sink.Landed(t);
          }
        },
        deadline);
  }

  std::string DescribeSource(size_t i) const override {
    const BucketPlan& plan = offer_.plan;
    for (size_t k = 0; k < plan.buckets.size(); ++k) {
      for (const Piece& p : plan.buckets[k].pieces) {
        if (p.tensor != i) continue;
        return absl::StrFormat(
            "%s version %d, broadcast from %s in bucket %d of %d (bytes "
            "[%d, %d) of the bucket)",
            sub_->endpoint_.display, offer_.manifest.version, publisher_, k + 1,
            plan.buckets.size(), p.bucket_offset, p.bucket_offset + p.length);
      }
    }
    return absl::StrFormat("%s version %d (no bytes)", sub_->endpoint_.display,
                           offer_.manifest.version);
  }

  void Accepted() override {
    absl::MutexLock lock(&sub_->mu_);
    (void)sub_->SendNow(Encode(AcceptedMsg{offer_.manifest.version}));
  }

  std::string publisher_;

 private:
  NcclSubscriber* sub_;
  Offer offer_;
  absl::Time deadline_;
  bool fetched_ = false;
};

absl::Status NcclSubscriber::SendNow(std::string frame) {
  return stream_.Send(std::move(frame), absl::Now() + options_.connect_timeout);
}

void NcclSubscriber::Disconnect() {
  DropCommunicator();
  comm_ready_ = false;
  epoch_ = 0;
  offers_.clear();
  aborts_.clear();
  started_.reset();
  stream_.Close();
}

void NcclSubscriber::DropCommunicator() {
  comm_ready_ = false;
  initializing_ = false;
  if (comm_ == nullptr) return;
  comm_->Abort();
  if (receiving_) return;
  comm_.reset();
  device_->Synchronize();
}

absl::Status NcclSubscriber::Connect() {
  if (stream_.connected()) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  WB_ASSIGN_OR_RETURN(control::Fd fd,
                      control::Connect(endpoint_.host, endpoint_.port, deadline, endpoint_.display,
                                       /*once=*/false, &cancelled_));
  Stream stream(std::move(fd),
                absl::StrFormat("the publisher at %s port %d", endpoint_.host, endpoint_.port),
                kMaxFrame);
  HelloMsg hello{kMagic,
                 kProtocolVersion,
                 endpoint_.channel,
                 replica_id_,
                 description_,
                 device_->Describe(),
                 device_->Uuid(),
                 backend_->Info().nccl_version,
                 NcclEnvironmentSettings()};
  WB_RETURN_IF_ERROR(stream.Send(Encode(hello), deadline));
  absl::StatusOr<Frame> answer = stream.Receive(deadline);
  if (!answer.ok()) {
    return absl::UnavailableError(absl::StrFormat("%s: joining the publisher failed: %s",
                                                  endpoint_.display, answer.status().message()));
  }
  if (answer->type == MsgType::kError) {
    absl::StatusOr<ErrorMsg> e = DecodeError(answer->payload);
    if (!e.ok()) return absl::UnavailableError(e.status().message());
    return WireStatus(
        e->code, e->message, absl::StatusCode::kUnavailable,
        absl::StrFormat("%s: the publisher refused this replica: ", endpoint_.display));
  }
  absl::StatusOr<WelcomeMsg> welcome =
      answer->type == MsgType::kWelcome
          ? DecodeWelcome(answer->payload)
          : absl::StatusOr<WelcomeMsg>(absl::DataLossError(
                absl::StrFormat("answered HELLO with %s", MsgTypeName(answer->type))));
  if (!welcome.ok()) {
    return absl::UnavailableError(absl::StrFormat("%s: %s: %s", endpoint_.display, stream.peer(),
                                                  welcome.status().message()));
  }
  publisher_ = absl::StrFormat("the publisher %s", welcome->description);
  stream.set_peer(publisher_);
  stream_ = std::move(stream);
  Log(LogLevel::kDebug, "%s: joined %s", endpoint_.display, publisher_);
  return absl::OkStatus();
}

std::optional<absl::Status> NcclSubscriber::AbortOf(uint64_t epoch, uint64_t version) const {
  if (auto it = aborts_.find({epoch, version}); it != aborts_.end()) return it->second;
  if (auto it = aborts_.find({epoch, 0}); it != aborts_.end()) return it->second;
  return std::nullopt;
}

absl::Status NcclSubscriber::Handle(const Frame& f) {
  auto malformed = [&](const absl::Status& s) {
    return absl::UnavailableError(absl::StrFormat("%s: %s sent a malformed message (%s)",
                                                  endpoint_.display, publisher_, s.message()));
  };
  switch (f.type) {
    case MsgType::kGroup: {
      absl::StatusOr<GroupMsg> m = DecodeGroup(f.payload);
      if (!m.ok()) return malformed(m.status());
      if (receiving_) {
        return malformed(absl::DataLossError("a GROUP while a version is being received"));
      }
      DropCommunicator();  // the publisher rebuilds: the old communicator is done with
      epoch_ = m->epoch;
      comm_ready_ = false;
      members_ = m->members;
      shared_slots_.clear();
      ready_buckets_.clear();
      // Offers of older epochs can no longer be received.
      offers_.erase(std::remove_if(offers_.begin(), offers_.end(),
                                   [&](const Offer& o) { return o.epoch < epoch_; }),
                    offers_.end());
      absl::Status failed = failpoints_.Hit("nccl.replica_group");
      colocated_ = m->rank == 0;
      if (colocated_) {
        // No rank: ready once SLOTS' buffers are open.
        if (!failed.ok()) {
          return SendNow(Encode(GroupReadyMsg{epoch_, static_cast<uint32_t>(failed.code()),
                                              std::string(failed.message())}));
        }
        return absl::OkStatus();
      }
      UniqueId id;
      std::copy(m->unique_id.begin(), m->unique_id.end(), reinterpret_cast<char*>(id.data()));
      absl::StatusOr<std::unique_ptr<Communicator>> comm =
          failed.ok() ? backend_->StartCommunicator(*device_, id, static_cast<int>(m->nranks),
                                                    static_cast<int>(m->rank))
                      : absl::StatusOr<std::unique_ptr<Communicator>>(failed);
      if (!comm.ok()) {
        return SendNow(Encode(GroupReadyMsg{epoch_, static_cast<uint32_t>(comm.status().code()),
                                            std::string(comm.status().message())}));
      }
      comm_ = *std::move(comm);
      initializing_ = true;
      return absl::OkStatus();
    }
    case MsgType::kSlots: {
      absl::StatusOr<SlotsMsg> m = DecodeSlots(f.payload);
      if (!m.ok()) return malformed(m.status());
      if (!colocated_ || m->epoch != epoch_) return absl::OkStatus();  // a stale one
      shared_slots_.clear();
      absl::Status opened;
      for (const std::string& h : m->handles) {
        absl::StatusOr<std::shared_ptr<void>> slot = device_->ImportBuffer(h);
        if (!slot.ok()) {
          opened = absl::Status(slot.status().code(),
                                absl::StrFormat("opening the publisher's bucket buffer %d of %d "
                                                "on this GPU: %s",
                                                shared_slots_.size() + 1, m->handles.size(),
                                                slot.status().message()));
          shared_slots_.clear();
          break;
        }
        shared_slots_.push_back(*std::move(slot));
      }
      if (opened.ok() && shared_slots_.empty()) {
        opened = absl::DataLossError("SLOTS without a buffer");
      }
      comm_ready_ = opened.ok();
      return SendNow(Encode(GroupReadyMsg{epoch_, static_cast<uint32_t>(opened.code()),
                                          std::string(opened.message())}));
    }
    case MsgType::kBucket: {
      absl::StatusOr<BucketMsg> m = DecodeBucket(f.payload);
      if (!m.ok()) return malformed(m.status());
      if (m->slot >= shared_slots_.size()) {
        return malformed(absl::DataLossError(
            absl::StrFormat("BUCKET names buffer %d of %d", m->slot, shared_slots_.size())));
      }
      if (ready_buckets_.size() >= 65536) ready_buckets_.erase(ready_buckets_.begin());
      ready_buckets_[{m->version, m->bucket}] = m->slot;
      return absl::OkStatus();
    }
    case MsgType::kOffer: {
      absl::StatusOr<OfferMsg> m = DecodeOffer(f.payload);
      if (!m.ok()) return malformed(m.status());
      const std::string source = absl::StrFormat("%s version %d", endpoint_.display, m->version);
      absl::StatusOr<Manifest> manifest = Manifest::FromJson(m->manifest_json, source);
      absl::StatusOr<BucketPlan> plan = DecodePlan(m->plan);
      absl::Status checked = !manifest.ok() ? manifest.status()
                             : !plan.ok()   ? plan.status()
                                            : CheckPlan(*plan, *manifest);
      if (!checked.ok()) {
        // Nobody can receive this version here: say so (the publisher aborts it) and go on.
        return SendNow(Encode(FailedMsg{m->epoch, m->version,
                                        static_cast<uint32_t>(absl::StatusCode::kDataLoss),
                                        std::string(checked.message())}));
      }
      if (manifest->version != m->version) {
        return SendNow(Encode(
            FailedMsg{m->epoch, m->version, static_cast<uint32_t>(absl::StatusCode::kDataLoss),
                      absl::StrFormat("the OFFER of version %d carries the manifest of version %d",
                                      m->version, manifest->version)}));
      }
      newest_seen_ = std::max(newest_seen_, m->version);
      offers_.push_back(Offer{m->epoch, *std::move(manifest), *std::move(plan)});
      return absl::OkStatus();
    }
    case MsgType::kStart: {
      absl::StatusOr<StartMsg> m = DecodeStart(f.payload);
      if (!m.ok()) return malformed(m.status());
      started_ = std::make_pair(m->epoch, m->version);
      return absl::OkStatus();
    }
    case MsgType::kCommit: {
      absl::StatusOr<CommitMsg> m = DecodeCommit(f.payload);
      if (!m.ok()) return malformed(m.status());
      committed_ = std::make_pair(m->epoch, m->version);
      return absl::OkStatus();
    }
    case MsgType::kAbort: {
      absl::StatusOr<AbortMsg> m = DecodeAbort(f.payload);
      if (!m.ok()) return malformed(m.status());
      if (aborts_.size() >= 1024) aborts_.erase(aborts_.begin());
      aborts_[{m->epoch, m->version}] =
          WireStatus(m->code, m->message, absl::StatusCode::kUnavailable,
                     absl::StrFormat("%s gave up %s: ", publisher_,
                                     m->version == 0 ? std::string("the communicator")
                                                     : absl::StrFormat("version %d", m->version)));
      if (m->version == 0 && m->epoch == epoch_ && initializing_) {
        DropCommunicator();  // its initialization will not complete
      }
      offers_.erase(std::remove_if(offers_.begin(), offers_.end(),
                                   [&](const Offer& o) {
                                     return AbortOf(o.epoch, o.manifest.version).has_value();
                                   }),
                    offers_.end());
      return absl::OkStatus();
    }
    case MsgType::kError: {
      absl::StatusOr<ErrorMsg> e = DecodeError(f.payload);
      if (!e.ok()) return malformed(e.status());
      return WireStatus(e->code, e->message, absl::StatusCode::kUnavailable,
                        absl::StrFormat("%s: %s: ", endpoint_.display, publisher_));
    }
    case MsgType::kHello:
    case MsgType::kWelcome:
    case MsgType::kGroupReady:
    case MsgType::kReady:
    case MsgType::kReceived:
    case MsgType::kFailed:
    case MsgType::kAccepted:
      break;
  }
  return malformed(
      absl::DataLossError(absl::StrFormat("an unexpected %s message", MsgTypeName(f.type))));
}

absl::Status NcclSubscriber::Pump() {
  WB_RETURN_IF_ERROR(CheckCancelled());
  while (true) {
    absl::StatusOr<std::optional<Frame>> f = stream_.Poll();
    absl::Status s = f.ok() ? absl::OkStatus() : f.status();
    if (s.ok() && f->has_value()) s = Handle(**f);
    if (!s.ok()) {
      Disconnect();
      return absl::Status(absl::IsDataLoss(s) ? absl::StatusCode::kUnavailable : s.code(),
                          absl::StrFormat("%s: %s", endpoint_.display, s.message()));
    }
    if (!f->has_value()) break;
  }
  // A rank being initialized: report once it is (or failed).
  if (initializing_) {
    absl::StatusOr<bool> ready = comm_->Poll();
    if (!ready.ok()) {
      const absl::Status why = ready.status();
      DropCommunicator();
      return SendNow(Encode(
          GroupReadyMsg{epoch_, static_cast<uint32_t>(why.code()), std::string(why.message())}));
    }
    if (*ready) {
      comm_ready_ = true;
      initializing_ = false;
      return SendNow(Encode(GroupReadyMsg{epoch_, 0, ""}));
    }
  }
  return absl::OkStatus();
}

void NcclSubscriber::Idle(absl::Duration wait) {
  // While a rank initializes, look often; otherwise sleep on the socket.
  if (initializing_) wait = std::min(wait, absl::Milliseconds(1));
  wait = std::clamp(wait, absl::ZeroDuration(), absl::Milliseconds(100));  // Cancel within 100 ms
  pollfd p{stream_.fd(), POLLIN, 0};
  mu_.Unlock();
  (void)::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(wait + absl::Microseconds(999))));
  mu_.Lock();
}

absl::Status NcclSubscriber::EnsureSlots(uint64_t bucket_size) {
  if (slot_size_ == bucket_size && slots_.size() == static_cast<size_t>(device_->streams())) {
    return absl::OkStatus();
  }
  slots_.clear();
  slot_size_ = 0;
  for (int s = 0; s < device_->streams(); ++s) {
    absl::StatusOr<std::shared_ptr<void>> slot = device_->Allocate(bucket_size);
    if (!slot.ok()) {
      slots_.clear();
      return absl::Status(
          slot.status().code(),
          absl::StrFormat("allocating bucket buffer %d of %d (%d bytes, the publisher's "
                          "bucket_size) on %s: %s",
                          s + 1, device_->streams(), bucket_size, device_->Describe(),
                          slot.status().message()));
    }
    slots_.push_back(*std::move(slot));
  }
  slot_size_ = bucket_size;
  return absl::OkStatus();
}

absl::Status NcclSubscriber::Receive(const Offer& offer, absl::Span<std::byte* const> targets,
                                     const std::function<void(size_t)>& landed,
                                     absl::Time deadline) {
  const uint64_t version = offer.manifest.version;
  const std::string what = absl::StrFormat("%s version %d", endpoint_.display, version);
  WB_RETURN_IF_ERROR(Pump());
  if (std::optional<absl::Status> aborted = AbortOf(offer.epoch, version)) return *aborted;
  if (offer.epoch != epoch_ || !comm_ready_ || (!colocated_ && comm_ == nullptr)) {
    return absl::UnavailableError(absl::StrFormat(
        "%s: the communicator of epoch %d it was offered in is gone", what, offer.epoch));
  }
  // Tell the publisher why, where the failure is this replica's own.
  auto report = [&](const absl::Status& s) {
    if (stream_.connected() && !AbortOf(offer.epoch, version).has_value()) {
      (void)SendNow(Encode(FailedMsg{offer.epoch, version, static_cast<uint32_t>(s.code()),
                                     std::string(s.message())}));
    }
    return s;
  };
  if (!colocated_) {
    if (absl::Status s = EnsureSlots(offer.plan.bucket_size); !s.ok()) {
      return report(absl::Status(s.code(), absl::StrFormat("%s: %s", what, s.message())));
    }
  }
  WB_RETURN_IF_ERROR(failpoints_.Hit("nccl.replica_ready"));
  WB_RETURN_IF_ERROR(SendNow(Encode(ReadyMsg{version})));
  receiving_ = true;
  absl::Cleanup done = [this] {
    receiving_ = false;
    if (comm_ != nullptr && (!stream_.connected() || !comm_ready_)) {
      comm_.reset();  // aborted while the receive held it
      device_->Synchronize();
    }
  };

  // Watches the publisher while waiting: its messages, an ABORT of this version, its connection.
  class PublisherWatch : public Watch {
   public:
    PublisherWatch(NcclSubscriber& sub, const Offer& offer) : sub_(sub), offer_(offer) {}
    absl::Status Check() override ABSL_NO_THREAD_SAFETY_ANALYSIS {
      WB_RETURN_IF_ERROR(sub_.Pump());
      if (auto a = sub_.AbortOf(offer_.epoch, offer_.manifest.version)) return *a;
      return absl::OkStatus();
    }

   private:
    NcclSubscriber& sub_;
    const Offer& offer_;
  } watch(*this, offer);

  absl::Status started = PollUntil(
      RealClock(), deadline, nullptr, &watch,
      [&]() -> absl::StatusOr<bool> { return started_ == std::make_pair(offer.epoch, version); },
      [&] {
        return absl::StrFormat(
            "%s: %s did not start the broadcast by the deadline (another "
            "replica was not receiving yet)",
            what, publisher_);
      });
  if (!started.ok()) {
    // Nothing was posted yet: the communicator stays usable unless the publisher is gone.
    return report(started);
  }
  if (!comm_ready_ || (!colocated_ && comm_ == nullptr)) {
    return report(absl::UnavailableError(
        absl::StrFormat("%s: the communicator was given up before the broadcast", what)));
  }
  const auto on_bucket = [&](size_t bucket) -> absl::Status {
    landed(bucket);
    WB_RETURN_IF_ERROR(failpoints_.Hit("nccl.replica_bucket"));
    return SendNow(Encode(ReceivedMsg{version, bucket + 1}));
  };
  absl::Status received = colocated_
                              ? ReceiveColocated(offer, targets, watch, on_bucket, deadline, what)
                              : ReceiveBuckets(*device_, *comm_, RealClock(), watch, offer.plan,
                                               targets, slots_, on_bucket, deadline, what);
  if (!received.ok()) {
    comm_ready_ = false;  // ReceiveBuckets aborted it (freed on return); the publisher rebuilds
    return report(received);
  }
  if (offer.plan.buckets.empty()) WB_RETURN_IF_ERROR(SendNow(Encode(ReceivedMsg{version, 0})));
  // Kept only once every member has every bucket (COMMIT); an ABORT instead means the publish
  // failed elsewhere, and this replica keeps the version it had.
  return PollUntil(
      RealClock(), deadline, nullptr, &watch,
      [&]() -> absl::StatusOr<bool> { return committed_ == std::make_pair(offer.epoch, version); },
      [&] {
        return absl::StrFormat(
            "%s: every bucket arrived, but %s did not confirm by the deadline "
            "that every replica has them",
            what, publisher_);
      });
}

absl::Status NcclSubscriber::ReceiveColocated(const Offer& offer,
                                              absl::Span<std::byte* const> targets, Watch& watch,
                                              const std::function<absl::Status(size_t)>& on_bucket,
                                              absl::Time deadline, const std::string& what) {
  const uint64_t version = offer.manifest.version;
  const size_t nbuckets = offer.plan.buckets.size();
  for (size_t k = 0; k < nbuckets; ++k) {
    const Bucket& bucket = offer.plan.buckets[k];
    uint32_t slot = 0;
    absl::Status s = PollUntil(
        RealClock(), deadline, nullptr, &watch,
        [&]() -> absl::StatusOr<bool> {
          auto it = ready_buckets_.find({version, k});
          if (it == ready_buckets_.end()) return false;
          slot = it->second;
          return true;
        },
        [&] {
          return absl::StrFormat(
              "bucket %d of %d was not in the publisher's buffer by the "
              "deadline (the publisher or a replica of the communicator is "
              "stalled)",
              k + 1, nbuckets);
        });
    const int stream = static_cast<int>(k % device_->streams());
    bool copied = false;
    for (const Piece& piece : bucket.pieces) {
      if (!s.ok()) break;
      std::byte* target = targets[piece.tensor];
      if (target == nullptr) continue;
      s = device_->Copy(
          target + piece.tensor_offset,
          static_cast<const std::byte*>(shared_slots_[slot].get()) + piece.bucket_offset,
          piece.length, stream);
      copied = true;
    }
    if (s.ok() && copied) {
      s = device_->Record(stream);
      if (s.ok()) {
        s = PollUntil(
            RealClock(), deadline, nullptr, &watch, [&] { return device_->Done(stream); },
            [&] {
              return absl::StrFormat(
                  "copying bucket %d of %d out of the publisher's buffer did "
                  "not finish by the deadline",
                  k + 1, nbuckets);
            });
      }
    }
    ready_buckets_.erase({version, k});
    if (s.ok()) s = on_bucket(k);
    if (!s.ok()) {
      device_->Synchronize();  // no copy into a target after the receive returns
      return absl::Status(
          s.code(), absl::StrFormat("%s: receiving bucket %d of %d (%s) from the "
                                    "publisher's buffer on this GPU failed: %s",
                                    what, k + 1, nbuckets, DescribePlan(offer.plan), s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> NcclSubscriber::WaitForVersion(
    uint64_t min_version, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  WB_RETURN_IF_ERROR(CheckCancelled());
  WB_RETURN_IF_ERROR(Connect());
  while (true) {
    WB_RETURN_IF_ERROR(Pump());
    while (!offers_.empty()) {
      Offer offer = std::move(offers_.front());
      offers_.pop_front();
      if (AbortOf(offer.epoch, offer.manifest.version)) continue;
      if (offer.manifest.version >= min_version) {
        auto incoming = std::make_unique<NcclIncoming>(this, std::move(offer), deadline);
        incoming->publisher_ = publisher_;
        return std::unique_ptr<IncomingVersion>(std::move(incoming));
      }
      // Below what the caller waits for: received and dropped, for the others' sake.
      std::vector<std::byte*> none(offer.manifest.tensors.size(), nullptr);
      absl::Status drained = Receive(
          offer, none, [](size_t) {}, std::max(deadline, absl::Now() + kDrainTimeout));
      if (!drained.ok()) {
        Log(LogLevel::kWarn,
            "%s: version %d (below version %d, which this replica waits for) "
            "could not be received for the rest of the communicator: %s",
            endpoint_.display, offer.manifest.version, min_version, drained.message());
      }
      WB_RETURN_IF_ERROR(CheckCancelled());
      if (!stream_.connected()) WB_RETURN_IF_ERROR(Connect());
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "%s: no version >= %d was offered by %s by the deadline (newest offered: %s; nccl:// "
          "delivers the versions published while a replica is connected)",
          endpoint_.display, min_version, publisher_,
          newest_seen_ == 0 ? std::string("none") : absl::StrCat(newest_seen_)));
    }
    Idle(deadline - now);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenNcclSubscriber(const Uri& uri,
                                                                        const Config& config) {
  WB_ASSIGN_OR_RETURN(Endpoint endpoint, ParseEndpoint(uri, /*for_subscriber=*/true));
  WB_ASSIGN_OR_RETURN(NcclOptions options, ReadOptions(endpoint, config));
  WB_ASSIGN_OR_RETURN(std::optional<ChannelKey> key, LoadChannelKey(config, endpoint.display));
  if (key) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: nccl:// does not authenticate its peers yet, so it refuses a channel with a shared "
        "secret (secret_file / secret_env); use ucx:// or disk:// for such a channel",
        endpoint.display));
  }
  WB_ASSIGN_OR_RETURN(FailPoints failpoints, FailPoints::Parse(config.String("failpoints")));
  std::shared_ptr<Backend> backend = CurrentBackend();
  absl::StatusOr<std::unique_ptr<Device>> device =
      backend->OpenDevice(options.cuda_device, options.buckets_in_flight);
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        absl::StrFormat("%s: a replica needs a GPU: %s", endpoint.display,
                                        device.status().message()));
  }
  return std::unique_ptr<TransportSubscriber>(std::make_unique<NcclSubscriber>(
      std::move(endpoint), options, std::move(failpoints), std::move(backend), *std::move(device)));
}

}  // namespace weightbus::internal::nccl
