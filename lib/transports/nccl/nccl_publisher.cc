// SPDX-License-Identifier: Apache-2.0
// The nccl:// publisher: the rendezvous server (a thread that accepts replicas, checks their
// handshake and keeps what each reports: ReplicaLinks) and the root of every broadcast (Root,
// root.h, driven by Publish on the caller's thread).
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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
#include "transports/nccl/protocol.h"
#include "transports/nccl/root.h"

namespace weightbus::internal::nccl {
namespace {

using control::Fd;

// Bytes buffered from one replica before its socket is read no further (a frame at most).
constexpr size_t kMaxInput = size_t{kMaxReplicaFrame} + 8;
// Departed replicas remembered for messages (their names and why they left).
constexpr size_t kMaxGone = 4096;
// Accept pauses after running out of descriptors.
constexpr absl::Duration kAcceptBackoffMin = absl::Milliseconds(10);
constexpr absl::Duration kAcceptBackoffMax = absl::Seconds(1);

class NcclPublisher;

// This process's open publishers, by channel (ChannelCounters).
absl::Mutex& LiveMu() {
  static auto* mu = new absl::Mutex;
  return *mu;
}
std::map<std::string, NcclPublisher*, std::less<>>& Live() {
  static auto* live = new std::map<std::string, NcclPublisher*, std::less<>>;
  return *live;
}

struct Conn {
  uint64_t id = 0;
  Fd fd;
  std::string peer;  // "replica at 10.0.0.3 port 40112 (IPv4)", then its own description
  std::string in, out;
  bool greeted = false;
  bool closing = false;  // an ERROR is queued: close once it is written
  bool dead = false;
  bool over_limit = false;
  absl::Time hello_deadline;
  uint64_t replica_id = 0;
  std::string uuid;  // its GPU's
  ReplicaState state;
};

class NcclPublisher final : public TransportPublisher, public ReplicaLinks {
 public:
  NcclPublisher(Endpoint endpoint, NcclOptions options, FailPoints failpoints,
                std::shared_ptr<Backend> backend, std::unique_ptr<Device> device, Fd listener,
                Fd wake)
      : endpoint_(std::move(endpoint)),
        options_(options),
        failpoints_(std::move(failpoints)),
        backend_(std::move(backend)),
        device_(std::move(device)),
        listener_(std::move(listener)),
        wake_(std::move(wake)),
        description_(ProcessDescription()) {
    agreement_.nccl_version = backend_->Info().nccl_version;
    agreement_.settings = NcclEnvironmentSettings();
    root_ =
        std::make_unique<Root>(*backend_, *device_, RealClock(), *this,
                               RootOptions{options_.bucket_size, endpoint_.display, description_});
    thread_ = std::thread([this] { Loop(); });
    absl::MutexLock lock(&LiveMu());
    Live()[endpoint_.display] = this;
  }

  ~NcclPublisher() override {
    {
      absl::MutexLock lock(&LiveMu());
      if (auto it = Live().find(endpoint_.display); it != Live().end() && it->second == this) {
        Live().erase(it);
      }
    }
    Cancel();
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    Wake();
    thread_.join();
    root_.reset();  // aborts the communicator, frees the buckets
  }

  absl::StatusOr<std::optional<uint64_t>> LatestVersion() override {
    absl::MutexLock lock(&mu_);
    return newest_;
  }

  absl::Status Publish(PublishJob& job, absl::Time deadline) override {
    absl::MutexLock publishing(&publish_mu_);
    WB_RETURN_IF_ERROR(Cancelled());
    absl::StatusOr<const Manifest*> sealed = job.SealedManifest(deadline);
    if (!sealed.ok()) return sealed.status();
    const Manifest& manifest = **sealed;
    if (options_.min_replicas > 0) {
      WB_RETURN_IF_ERROR(PollUntil(
          RealClock(), deadline, nullptr, nullptr,
          [&]() -> absl::StatusOr<bool> {
            WB_RETURN_IF_ERROR(Cancelled());
            return Alive().size() >= static_cast<size_t>(options_.min_replicas);
          },
          [&] {
            return absl::StrFormat(
                "%s: version %d was not published: %d replica(s) connected by the deadline, "
                "min_replicas is %d",
                endpoint_.display, manifest.version, Alive().size(), options_.min_replicas);
          }));
    }
    std::vector<const std::byte*> sources;
    sources.reserve(job.tensors().size());
    for (const PackedTensor& t : job.tensors()) sources.push_back(t.data);
    absl::Status s = root_->Publish(manifest, sources, deadline);
    const RootStats& stats = root_->last_stats();
    absl::MutexLock lock(&mu_);
    counters_.epochs = root_->epoch();
    if (!s.ok()) return s;
    newest_ = manifest.version;
    counters_.last_replicas = stats.replicas;
    counters_.last_rebuild = stats.rebuilt ? stats.rebuild : absl::ZeroDuration();
    counters_.last_offer = stats.offer;
    counters_.last_pack = stats.broadcast.pack;
    counters_.last_broadcast = stats.broadcast.broadcast;
    counters_.last_wire_bytes = stats.broadcast.wire_bytes;
    counters_.last_buckets = stats.broadcast.buckets;
    return absl::OkStatus();
  }

  absl::StatusOr<int> WaitForReceivers(uint64_t version, int count, absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    auto counted = [&] {
      int n = 0;
      for (const auto& [id, v] : accepted_) n += v >= version ? 1 : 0;
      return n;
    };
    while (counted() < count && !cancelled_ && absl::Now() < deadline) {
      mu_.AwaitWithDeadline(absl::Condition(
                                +[](bool* changed) { return *changed; }, &changed_),
                            std::min(deadline, absl::Now() + absl::Milliseconds(100)));
      changed_ = false;
    }
    if (cancelled_)
      return absl::CancelledError(absl::StrFormat("%s: cancelled", endpoint_.display));
    return counted();
  }

  void Cancel() override {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      changed_ = true;
    }
    Wake();
  }

  // ReplicaLinks.
  std::vector<uint64_t> Alive() override {
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> out;
    for (const auto& [id, c] : conns_) {
      if (c->greeted && !c->dead && !c->closing) out.push_back(id);
    }
    return out;  // ids grow with each connection: join order
  }

  ReplicaState State(uint64_t id) override {
    absl::MutexLock lock(&mu_);
    if (auto it = conns_.find(id); it != conns_.end()) {
      ReplicaState s = it->second->state;
      s.alive = it->second->greeted && !it->second->dead && !it->second->closing;
      return s;
    }
    if (auto it = gone_.find(id); it != gone_.end()) return it->second;
    return ReplicaState{};
  }

  void Send(uint64_t id, std::string frame) override {
    absl::MutexLock lock(&mu_);
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second->dead) return;
    Conn& c = *it->second;
    c.out += frame;
    if (absl::Status s = control::WriteAvailable(c.fd.get(), c.out); !s.ok()) {
      MarkDead(c, std::string(s.message()));
    }
    if (!c.out.empty() || c.dead) Wake();
  }

  absl::Status Cancelled() override {
    absl::MutexLock lock(&mu_);
    if (!cancelled_) return absl::OkStatus();
    return absl::CancelledError(
        absl::StrFormat("%s: the publisher is being closed", endpoint_.display));
  }

  NcclPublisherCounters Counters() const {
    absl::MutexLock lock(&mu_);
    NcclPublisherCounters c = counters_;
    c.replicas = 0;
    for (const auto& [id, conn] : conns_) c.replicas += conn->greeted && !conn->dead;
    return c;
  }

 private:
  void Wake() {
    const uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof(one));
  }

  void MarkDead(Conn& c, std::string why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (c.dead) return;
    c.dead = true;
    c.state.alive = false;
    if (c.state.gone.empty()) c.state.gone = std::move(why);
    changed_ = true;
  }

  void Loop();
  void Accept() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Handle(Conn& c, const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleHello(Conn& c, const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendError(Conn& c, absl::StatusCode code, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    c.out += Encode(ErrorMsg{static_cast<uint32_t>(code), message});
    c.closing = true;
    changed_ = true;
  }
  void Drop(Conn& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!c.greeted) return;
    ReplicaState s = c.state;
    s.alive = false;
    if (s.gone.empty()) s.gone = "its connection closed";
    if (gone_.size() >= kMaxGone) gone_.erase(gone_.begin());
    gone_[c.id] = std::move(s);
    conn_log_.Log(LogLevel::kInfo, "%s: %s left (%s)", endpoint_.display, c.state.name,
                  gone_[c.id].gone);
  }

  const Endpoint endpoint_;
  const NcclOptions options_;
  FailPoints failpoints_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Device> device_;
  Fd listener_;
  Fd wake_;  // eventfd: Send and the destructor wake the server thread
  const std::string description_;
  const uint64_t session_id_ = RandomId();
  Agreement agreement_;
  std::unique_ptr<Root> root_;
  absl::Mutex publish_mu_;  // one Publish at a time

  mutable absl::Mutex mu_;
  std::map<uint64_t, std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, ReplicaState> gone_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> accepted_ ABSL_GUARDED_BY(mu_);  // replica id -> newest ACCEPTED
  uint64_t next_conn_ ABSL_GUARDED_BY(mu_) = 1;
  std::optional<uint64_t> newest_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time accept_resume_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration accept_backoff_ ABSL_GUARDED_BY(mu_) = kAcceptBackoffMin;
  NcclPublisherCounters counters_ ABSL_GUARDED_BY(mu_);
  RateLimitedLog conn_log_, accept_log_, refuse_log_;
  std::thread thread_;

  friend std::optional<NcclPublisherCounters> PublisherCounters(const TransportPublisher&);
  friend std::optional<NcclPublisherCounters> ChannelCounters(std::string_view);
};

void NcclPublisher::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  while (true) {
    int timeout_ms = 1000;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      fds.clear();
      ids.clear();
      const absl::Time now = control::MonotonicNow();
      absl::Time next = now + absl::Seconds(1);
      fds.push_back({wake_.get(), POLLIN, 0});
      const bool accepting = now >= accept_resume_;
      if (!accepting) next = std::min(next, accept_resume_);
      fds.push_back({accepting ? listener_.get() : -1, POLLIN, 0});
      for (const auto& [id, c] : conns_) {
        short events = c->in.size() < kMaxInput ? POLLIN : 0;
        if (!c->out.empty()) events |= POLLOUT;
        fds.push_back({c->fd.get(), events, 0});
        ids.push_back(id);
        if (!c->greeted) next = std::min(next, c->hello_deadline);
      }
      timeout_ms =
          static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(next - now) + 1, 0, 1000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      Log(LogLevel::kError, "%s: poll: %s", endpoint_.display, strerror(errno));
      absl::SleepFor(absl::Milliseconds(10));
    }
    absl::MutexLock lock(&mu_);
    if (fds[0].revents != 0) {
      uint64_t n;
      (void)!::read(wake_.get(), &n, sizeof(n));
    }
    if (fds[1].revents != 0) Accept();
    for (size_t k = 0; k < ids.size(); ++k) {
      auto it = conns_.find(ids[k]);
      if (it == conns_.end()) continue;
      Conn& c = *it->second;
      if (fds[k + 2].revents == 0 || c.dead) continue;
      absl::StatusOr<bool> open = control::ReadAvailable(c.fd.get(), c.in, kMaxInput);
      while (!c.dead && !c.closing) {
        absl::StatusOr<std::optional<Frame>> f =
            control::TakeFrame<MsgType>(c.in, kMaxReplicaFrame);
        if (!f.ok()) {
          refuse_log_.Log(LogLevel::kWarn, "%s: %s sent a malformed message (%s); disconnecting it",
                          endpoint_.display, c.peer, f.status().message());
          MarkDead(c, absl::StrFormat("it sent a malformed message (%s)", f.status().message()));
          break;
        }
        if (!f->has_value()) break;
        Handle(c, **f);
      }
      if (!open.ok() || !*open) {
        MarkDead(c, open.ok()
                        ? "its connection closed (the process exited or crashed)"
                        : absl::StrFormat("its connection broke (%s)", open.status().message()));
      }
    }
    const absl::Time now = control::MonotonicNow();
    for (auto it = conns_.begin(); it != conns_.end();) {
      Conn& c = *it->second;
      if (!c.greeted && !c.dead && !c.closing && now > c.hello_deadline) {
        conn_log_.Log(LogLevel::kInfo, "%s: %s did not greet within %s; disconnecting it",
                      endpoint_.display, c.peer, absl::FormatDuration(options_.connect_timeout));
        MarkDead(c, "it did not greet in time");
      }
      if (!c.dead && !c.out.empty()) {
        if (absl::Status s = control::WriteAvailable(c.fd.get(), c.out); !s.ok()) {
          MarkDead(c, absl::StrFormat("its connection broke (%s)", s.message()));
        }
      }
      if (c.closing && c.out.empty()) MarkDead(c, c.state.gone.empty() ? "refused" : c.state.gone);
      if (c.dead) {
        Drop(c);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void NcclPublisher::Accept() {
  while (true) {
    absl::StatusOr<std::optional<control::Accepted>> a = control::AcceptOne(listener_.get());
    if (!a.ok()) {
      if (absl::IsResourceExhausted(a.status())) {
        accept_resume_ = control::MonotonicNow() + accept_backoff_;
        accept_log_.Log(LogLevel::kWarn,
                        "%s: %s (%d connections open); not accepting for %s (raise the fd "
                        "limit, ulimit -n)",
                        endpoint_.display, a.status().message(), conns_.size(),
                        absl::FormatDuration(accept_backoff_));
        accept_backoff_ = std::min(accept_backoff_ * 2, kAcceptBackoffMax);
      } else {
        accept_log_.Log(LogLevel::kWarn, "%s: %s", endpoint_.display, a.status().message());
      }
      return;
    }
    if (!a->has_value()) return;
    accept_backoff_ = kAcceptBackoffMin;
    const bool over_limit = conns_.size() >= static_cast<size_t>(options_.max_replicas);
    if (over_limit && conns_.size() >= static_cast<size_t>(options_.max_replicas) + 64) {
      accept_log_.Log(LogLevel::kWarn,
                      "%s: closing the connection of %s at once: %d connections are open "
                      "(max_replicas %d)",
                      endpoint_.display, (*a)->peer, conns_.size(), options_.max_replicas);
      continue;  // the Fd closes
    }
    auto c = std::make_unique<Conn>();
    c->id = next_conn_++;
    c->fd = std::move((*a)->fd);
    c->peer = "replica at " + (*a)->peer;
    c->over_limit = over_limit;
    c->hello_deadline = control::MonotonicNow() + options_.connect_timeout;
    c->state.name = c->peer;
    conns_[c->id] = std::move(c);
  }
}

void NcclPublisher::HandleHello(Conn& c, const Frame& f) {
  absl::StatusOr<HelloMsg> hello = DecodeHello(f.payload);
  if (!hello.ok() || hello->magic != kMagic) {
    refuse_log_.Log(LogLevel::kInfo, "%s: %s is not a weightbus nccl:// replica; disconnecting it",
                    endpoint_.display, c.peer);
    MarkDead(c, "it is not a weightbus nccl:// replica");
    return;
  }
  c.peer = absl::StrFormat("replica %s (%s)", hello->description, hello->device);
  c.state.name = c.peer;
  if (hello->protocol != kProtocolVersion) {
    SendError(c, absl::StatusCode::kFailedPrecondition,
              absl::StrFormat("publisher %s speaks nccl control protocol %d, the replica %d",
                              description_, kProtocolVersion, hello->protocol));
    return;
  }
  if (c.over_limit) {
    SendError(c, absl::StatusCode::kResourceExhausted,
              absl::StrFormat("the publisher at port %d (%s) already serves %d replicas, its "
                              "max_replicas; try again later",
                              endpoint_.port, description_, options_.max_replicas));
    return;
  }
  if (hello->channel != endpoint_.channel) {
    SendError(c, absl::StatusCode::kNotFound,
              absl::StrFormat("the publisher at port %d (%s) serves channel \"%s\", not \"%s\"",
                              endpoint_.port, description_, endpoint_.channel, hello->channel));
    return;
  }
  const std::string publisher_name = absl::StrFormat("%s, %s", description_, device_->Describe());
  absl::Status agreed =
      CompareAgreement(agreement_, publisher_name, Agreement{hello->nccl_version, hello->settings},
                       absl::StrFormat("%s (%s)", hello->description, hello->device));
  if (!agreed.ok()) {
    refuse_log_.Log(LogLevel::kWarn, "%s: refusing %s: %s", endpoint_.display, c.peer,
                    agreed.message());
    SendError(c, agreed.code(), std::string(agreed.message()));
    return;
  }
  // NCCL puts one rank per GPU (two on one GPU fail its init, with every rank waiting). A replica
  // on the publisher's own GPU is no rank: it reads the root's buckets (co-located); one on
  // another replica's GPU is refused.
  const bool colocated = hello->device_uuid == device_->Uuid();
  for (const auto& [id, other] : conns_) {
    if (!colocated && other.get() != &c && other->greeted && !other->dead &&
        other->uuid == hello->device_uuid) {
      SendError(c, absl::StatusCode::kFailedPrecondition,
                absl::StrFormat("%s is on the GPU of %s (%s): NCCL does not put two ranks of a "
                                "communicator on one GPU; give the replica another GPU (setting "
                                "cuda_device, or CUDA_VISIBLE_DEVICES)",
                                c.peer, other->peer, hello->device_uuid));
      return;
    }
  }
  c.state.colocated = colocated;
  c.uuid = hello->device_uuid;
  c.replica_id = hello->replica_id;
  c.greeted = true;
  c.state.alive = true;
  changed_ = true;
  c.out += Encode(WelcomeMsg{kProtocolVersion, session_id_, publisher_name, newest_.has_value(),
                             newest_.value_or(0)});
  conn_log_.Log(LogLevel::kInfo, "%s: %s joined%s (it takes part from the next version)",
                endpoint_.display, c.peer,
                colocated ? " on the publisher's own GPU (it reads the publisher's buckets)" : "");
}

void NcclPublisher::Handle(Conn& c, const Frame& f) {
  if (!c.greeted) {
    if (f.type == MsgType::kHello) return HandleHello(c, f);
    MarkDead(c, absl::StrFormat("it sent %s before HELLO", MsgTypeName(f.type)));
    return;
  }
  changed_ = true;
  auto malformed = [&](const absl::Status& s) {
    refuse_log_.Log(LogLevel::kWarn, "%s: %s: %s; disconnecting it", endpoint_.display, c.peer,
                    s.message());
    MarkDead(c, absl::StrFormat("it sent a malformed message (%s)", s.message()));
  };
  switch (f.type) {
    case MsgType::kGroupReady: {
      absl::StatusOr<GroupReadyMsg> m = DecodeGroupReady(f.payload);
      if (!m.ok()) return malformed(m.status());
      if (m->code == 0) {
        c.state.group_ready = std::max(c.state.group_ready, m->epoch);
      } else {
        c.state.failed = WireStatus(m->code, m->message, absl::StatusCode::kUnavailable,
                                    "initializing its rank: ");
        c.state.failed_epoch = m->epoch;
        c.state.failed_version = 0;
      }
      return;
    }
    case MsgType::kReady: {
      absl::StatusOr<ReadyMsg> m = DecodeReady(f.payload);
      if (!m.ok()) return malformed(m.status());
      c.state.ready = std::max(c.state.ready, m->version);
      return;
    }
    case MsgType::kReceived: {
      absl::StatusOr<ReceivedMsg> m = DecodeReceived(f.payload);
      if (!m.ok()) return malformed(m.status());
      c.state.received_version = m->version;
      c.state.received_buckets = m->buckets;
      return;
    }
    case MsgType::kFailed: {
      absl::StatusOr<FailedMsg> m = DecodeFailed(f.payload);
      if (!m.ok()) return malformed(m.status());
      c.state.failed = WireStatus(m->code, m->message, absl::StatusCode::kUnavailable, "");
      c.state.failed_epoch = m->epoch;
      c.state.failed_version = m->version;
      return;
    }
    case MsgType::kAccepted: {
      absl::StatusOr<AcceptedMsg> m = DecodeAccepted(f.payload);
      if (!m.ok()) return malformed(m.status());
      if (accepted_.size() < 65536 || accepted_.count(c.replica_id) > 0) {
        uint64_t& v = accepted_[c.replica_id];
        v = std::max(v, m->version);
      }
      return;
    }
    case MsgType::kHello:
    case MsgType::kWelcome:
    case MsgType::kError:
    case MsgType::kGroup:
    case MsgType::kOffer:
    case MsgType::kAbort:
    case MsgType::kStart:
    case MsgType::kCommit:
    case MsgType::kSlots:
    case MsgType::kBucket:
      break;
  }
  malformed(absl::DataLossError(absl::StrFormat("an unexpected %s message", MsgTypeName(f.type))));
}

}  // namespace

std::optional<NcclPublisherCounters> ChannelCounters(std::string_view display) {
  absl::MutexLock lock(&LiveMu());
  auto it = Live().find(display);
  if (it == Live().end()) return std::nullopt;
  return it->second->Counters();
}

std::optional<NcclPublisherCounters> PublisherCounters(const TransportPublisher& publisher) {
  const auto* p = dynamic_cast<const NcclPublisher*>(&publisher);
  if (p == nullptr) return std::nullopt;
  return p->Counters();
}

absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenNcclPublisher(const Uri& uri,
                                                                      const Config& config) {
  WB_ASSIGN_OR_RETURN(Endpoint endpoint, ParseEndpoint(uri, /*for_subscriber=*/false));
  WB_ASSIGN_OR_RETURN(NcclOptions options, ReadOptions(endpoint, config));
  WB_ASSIGN_OR_RETURN(std::optional<ChannelKey> key, LoadChannelKey(config, endpoint.display));
  if (key) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: nccl:// does not authenticate replicas yet, so it refuses a channel with a shared "
        "secret (secret_file / secret_env) rather than hand the weights to whoever connects; "
        "use ucx:// or disk:// for such a channel",
        endpoint.display));
  }
  WB_ASSIGN_OR_RETURN(FailPoints failpoints, FailPoints::Parse(config.String("failpoints")));
  std::shared_ptr<Backend> backend = CurrentBackend();
  absl::StatusOr<std::unique_ptr<Device>> device =
      backend->OpenDevice(options.cuda_device, options.buckets_in_flight);
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        absl::StrFormat("%s: the publisher needs a GPU: %s", endpoint.display,
                                        device.status().message()));
  }
  WB_ASSIGN_OR_RETURN(Fd listener, control::Listen(endpoint.host, endpoint.port, endpoint.display));
  Fd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake) return ErrnoStatus(errno, absl::StrFormat("%s: eventfd", endpoint.display));
  const std::string display = endpoint.display;
  try {  // the constructor starts the progress thread
    return std::unique_ptr<TransportPublisher>(std::make_unique<NcclPublisher>(
        std::move(endpoint), options, std::move(failpoints), std::move(backend), *std::move(device),
        std::move(listener), std::move(wake)));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s: cannot start the progress thread: %s", display, e.what()));
  }
}

}  // namespace weightbus::internal::nccl
