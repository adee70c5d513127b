// SPDX-License-Identifier: Apache-2.0
// Publishing side of ucx://: copy each version into a staging slot of registered memory (the
// trainer's only stall), then serve it from a background thread that runs the rendezvous
// endpoint: it greets subscribers, grants them the newest version with the slot's packed rkeys,
// and tracks their leases so that a slot is reused only when nobody reads it any more.
//
// Threads: the caller's (Publish, KeepVersionsFrom, WaitForReceivers) and one progress thread
// that owns the UCP worker and every socket. All shared state is guarded by mu_.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <system_error>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/failpoint.h"
#include "core/logging.h"
#include "core/parts.h"
#include "core/status.h"
#include "core/system.h"
#include "core/worker_pool.h"
#include "transports/ucx/control.h"
#include "transports/ucx/descriptor.h"
#include "transports/ucx/registration_cache.h"
#include "transports/ucx/ucp_util.h"
#include "transports/ucx/ucx_transport.h"

#ifdef WEIGHTBUS_UCX_CUDA
#include <cuda_runtime_api.h>
#endif

namespace weightbus::internal::ucx {
namespace {

constexpr uint64_t kTensorAlign = 64;

// Copies `n` bytes from `src` (in 8-byte-aligned memory whose words other threads store
// atomically, such as a version descriptor's readiness words) through atomic loads of the
// aligned words that hold them: a snapshot of each word, never a torn one.
void CopyWordsAtomically(char* dst, const char* src, size_t n) {
  const auto start = reinterpret_cast<uintptr_t>(src);
  for (uintptr_t at = start; at < start + n;) {
    const uintptr_t word = at & ~uintptr_t{7};
    const uint64_t value =
        __atomic_load_n(reinterpret_cast<const uint64_t*>(word), __ATOMIC_ACQUIRE);
    const size_t from = at - word;
    const size_t take = std::min<size_t>(8 - from, start + n - at);
    std::memcpy(dst + (at - start), reinterpret_cast<const char*>(&value) + from, take);
    at += take;
  }
}

// How the publisher cuts each tensor of `m` (the job's manifest) into checksum tiles: what an
// unsealed descriptor leaves room for.
std::vector<TileGrid> ChecksumGrids(const PublishJob& job, const Manifest& m) {
  std::vector<TileGrid> grids;
  grids.reserve(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) grids.push_back(job.ChecksumGrid(i));
  return grids;
}

// What one subscriber connection may make the publisher hold (issue 17: one peer must not
// exhaust the control plane). Honest subscribers stay far below each bound: they keep one WAIT
// and a few leases out, and at most gets_in_flight (<= 1024) READs.
constexpr size_t kMaxInput = size_t{1} << 20;    // bytes read ahead of the frames handled
constexpr size_t kMaxOutput = size_t{32} << 20;  // answers queued before reading stops
constexpr size_t kMaxWaits = 64;                 // WAITs outstanding
constexpr int kMaxLeases = 64;                   // leases held
constexpr size_t kMaxReads = 4096;               // READs outstanding
// Connections accepted beyond max_connections only to answer their HELLO with
// ResourceExhausted; more than this many such at once are closed without a word.
constexpr size_t kMaxRefusing = 16;
// Backoff of accept() at the fd limit (EMFILE, ENFILE) or out of kernel memory.
constexpr absl::Duration kAcceptBackoffMin = absl::Milliseconds(10);
constexpr absl::Duration kAcceptBackoffMax = absl::Seconds(1);

// One piece of a staging slot: registered memory covering [base, base + size()) of the slot's
// byte range.
struct Region {
  uint64_t id = 0;    // unique within this publisher process
  uint64_t base = 0;  // offset of its first byte in the slot
  std::unique_ptr<MemRegion> mem;
  void* cuda_ptr = nullptr;  // cudaMalloc'ed memory behind `mem` (staging_memory=cuda)
  std::string rkey;          // packed once, sent with every grant

  Region() = default;
  Region(Region&&) = default;
  Region& operator=(Region&&) = default;
  ~Region() {
    mem.reset();  // unregister before freeing
#ifdef WEIGHTBUS_UCX_CUDA
    if (cuda_ptr != nullptr) (void)cudaFree(cuda_ptr);
#endif
  }
};

// A version's place in registered memory: its bytes (`regions`, tiling slot bytes [0,
// capacity)) and its version descriptor (descriptor.h) right after them.
struct Slot {
  // kWriting: picked by a Publish, not visible. kStaging: announced before its bytes are staged
  // (pipelining): granted to waiting subscribers, which pull chunks as they become ready.
  // kReady: sealed, the newest or an older version still held.
  enum class State { kFree, kWriting, kStaging, kReady };
  int index = 0;
  uint64_t capacity = 0;
  std::vector<Region> regions;
  // A zero-copy version (publish_mode=zero_copy): the caller's memory, registered in place
  // (registrations owned by UcxPublisher::lent_cache_), tiling [0, capacity) instead of
  // `regions`; valid while its Publish runs.
  struct Lent {
    uint64_t id = 0;
    uint64_t base = 0;
    // The caller's bytes (the registration may report a page-aligned start instead).
    const std::byte* data = nullptr;
    uint64_t length = 0;
    std::string rkey;
    // Memory UCX allocated (Publisher::AllocateHost): its peers on this host map it, so it is not
    // flagged kCrossMemoryAttach.
    bool ucx_allocated = false;
  };
  std::vector<Lent> lent;
  std::optional<Region> descriptor;  // host memory, registered; base = capacity
  State state = State::kFree;
  uint64_t version = 0;      // when kStaging or kReady
  GrantRegion grant_region;  // the descriptor as every GRANT of the version names it
  uint64_t prefix = 0;       // descriptor bytes a subscriber reads first
  uint64_t chunk_bytes = 0;  // readiness granularity of the version
  uint64_t nchunks = 0;
  int leases = 0;  // outstanding leases on this slot's version

  // The descriptor's readiness word of chunk k (host memory, written with release stores).
  uint64_t* ready_word(uint64_t k) const {
    return reinterpret_cast<uint64_t*>(descriptor->mem->data() + ReadyOffset(k));
  }
  // Whether every chunk that slot bytes [offset, offset + length) touch holds `version`.
  bool Ready(uint64_t offset, uint64_t length) const {
    if (state == State::kReady || length == 0) return state != State::kFree;
    for (uint64_t k = offset / chunk_bytes; k <= (offset + length - 1) / chunk_bytes; ++k) {
      if (k >= nchunks || __atomic_load_n(ready_word(k), __ATOMIC_ACQUIRE) != version) {
        return false;
      }
    }
    return true;
  }
};

struct Lease {
  Slot* slot = nullptr;
  uint64_t conn = 0;
  uint64_t version = 0;
  absl::Time expiry;      // MonotonicNow() time
  absl::Time hold_start;  // when it was granted: renewals end lease_max_hold after it
};

// A READ of slot bytes over the control connection (Conn::bytes_over_control).
struct PendingRead {
  uint64_t request = 0;
  uint64_t lease = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct PendingWait {
  uint64_t request = 0;
  uint64_t version = 0;
  bool exact = false;
  bool now = false;  // answer at once: a grant or REFUSED DeadlineExceeded (a poll)
};

// One subscriber's control connection.
struct Conn {
  uint64_t id = 0;
  Fd fd;
  std::string peer;  // "127.0.0.1 port 40000 (IPv4)", then with the subscriber's own words
  std::string in, out;
  bool greeted = false;  // WELCOME sent: the peer may ask for versions and report receipts
  // A shared-secret channel: CHALLENGE sent, PROOF awaited (`greeted` stays false until it
  // checks out), with both sides' nonces.
  bool challenged = false;
  Nonce subscriber_nonce{}, publisher_nonce{};
  bool dead = false;          // close now
  bool closing = false;       // close once `out` is flushed (after an ERROR)
  absl::Time hello_deadline;  // MonotonicNow() time
  uint64_t subscriber_id = 0;
  std::vector<PendingWait> waits;
  // The subscriber reads the bytes with READ over this connection instead of UCP gets: no
  // UCP transport with one-sided hardware support reaches it (see UcxPublisher::HandleHello).
  bool bytes_over_control = false;
  std::deque<PendingRead> reads;
  bool reads_held = false;               // the next READ waits for its chunk to be staged
  uint64_t held_request = ~uint64_t{0};  // the last READ that did (counted once)
  int leases = 0;                        // leases_ entries of this connection
  bool over_limit = false;  // accepted beyond max_connections: HELLO gets ResourceExhausted
  // Frames may wait in `in`, unhandled because `out` held kMaxOutput: handled once it drains,
  // whether or not more bytes arrive.
  bool held_frames = false;
  // Rank 0 of a publisher group: the rank that joined over this connection (JOIN), or -1 for a
  // subscriber.
  int member_rank = -1;
  // Rank 0 on a shared-secret channel: a JOIN whose rank was sent CHALLENGE, completed once its
  // PROOF checks out (its nonce is `subscriber_nonce`).
  std::optional<JoinMsg> pending_join;
  // The subscriber can relay what it receives (RELAY_OFFER).
  std::optional<RelayOfferMsg> relay_offer;
};

// The roles of the proofs a joining rank and rank 0 exchange on a shared-secret channel
// (HandshakeProof), distinct from a subscriber's and a publisher's so that no proof made for a
// subscriber connection passes in a join, or the other way round.
constexpr std::string_view kRankZeroRole = "group rank 0";
constexpr std::string_view kJoinerRole = "group rank";

// This publisher's place in a publisher group (settings `rank`, `world_size`).
struct GroupRole {
  int rank = 0;
  int world_size = 1;
  uint32_t port = 0;  // rank > 0: where it serves its parts (an ephemeral port)
  bool grouped() const { return world_size > 1; }
};

// "rank 2 of the group of 4 did not stage its part", "ranks 1, 3 of the group of 4 ... their".
std::string RanksText(const std::vector<int>& ranks, int world_size, std::string_view what) {
  const bool many = ranks.size() > 1;
  return absl::StrFormat("rank%s %s of the group of %d %s %s part", many ? "s" : "",
                         absl::StrJoin(ranks, ", "), world_size, what, many ? "their" : "its");
}

// Memory handed out by UcxPublisher::AllocateHost, still alive: a zero-copy publish serves a run
// of tensors that lies in one of them with its own registration (allocated by UCX, so shared-
// memory transports map it into a subscriber) instead of registering the caller's memory.
// Shared with the allocations' deleters, which may run after the publisher is gone.
struct HostAllocations {
  struct Entry {
    uintptr_t end = 0;
    uint64_t id = 0;   // names the registration in version layouts while it lives
    std::string rkey;  // packed
  };
  absl::Mutex mu;
  std::map<uintptr_t, Entry> by_begin ABSL_GUARDED_BY(mu);
  // Ids above the staging regions' (from 1) and the registration cache's (from 2^48).
  uint64_t next_id ABSL_GUARDED_BY(mu) = uint64_t{1} << 56;

  // The allocation holding all of [begin, end), if any.
  std::optional<Entry> Find(uintptr_t begin, uintptr_t end) {
    absl::MutexLock lock(&mu);
    auto it = by_begin.upper_bound(begin);
    if (it == by_begin.begin()) return std::nullopt;
    --it;
    if (end > it->second.end) return std::nullopt;
    return it->second;
  }
};

class UcxPublisher final : public TransportPublisher {
 public:
  UcxPublisher(Endpoint endpoint, UcxOptions options, FailPoints failpoints,
               std::shared_ptr<Context> context, std::unique_ptr<Worker> worker, Fd listener,
               Fd wake, int efd, std::string worker_address, std::unique_ptr<WorkerPool> copiers,
               RmaTransports rma, GroupRole group)
      : endpoint_(std::move(endpoint)),
        options_(options),
        failpoints_(std::move(failpoints)),
        context_(std::move(context)),
        worker_(std::move(worker)),
        listener_(std::move(listener)),
        wake_(std::move(wake)),
        efd_(efd),
        worker_address_(std::move(worker_address)),
        copiers_(std::move(copiers)),
        rma_(rma),
        group_(group),
        description_(ProcessDescription()),
        members_(group.world_size) {
    if (options_.zero_copy) {
      // Ids above the staging regions' (which count from 1), unique in this process.
      lent_cache_ = std::make_unique<RegistrationCache>(context_, uint64_t{1} << 48);
    }
  }

  ~UcxPublisher() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    Wake();
    if (thread_.joinable()) thread_.join();
    // Control messages still queued go out before the sockets close, for a short while: a
    // group's rank 0 whose Publish just failed (and whose process exits) must leave the other
    // ranks its OUTCOME, not a broken connection.
    FlushQueued(absl::Now() + absl::Seconds(1));
    // Sockets close with conns_; regions unmap before the worker and context go.
    conns_.clear();
    slots_.clear();
  }

  // Writes what connections still have queued until `deadline` or until nothing is left (a
  // connection that breaks is given up). The progress thread must have stopped.
  void FlushQueued(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    while (absl::Now() < deadline) {
      std::vector<pollfd> fds;
      std::vector<Conn*> pending;
      for (auto& [id, c] : conns_) {
        if (c->out.empty() || c->dead) continue;
        fds.push_back({c->fd.get(), POLLOUT, 0});
        pending.push_back(c.get());
      }
      if (pending.empty()) return;
      const int ms = static_cast<int>(
          std::clamp<int64_t>(absl::ToInt64Milliseconds(deadline - absl::Now()) + 1, 0, 1000));
      if (::poll(fds.data(), fds.size(), ms) <= 0 && errno != EINTR) return;
      for (size_t i = 0; i < pending.size(); ++i) {
        if (fds[i].revents == 0) continue;
        if (!WriteAvailable(pending[i]->fd.get(), pending[i]->out).ok()) pending[i]->dead = true;
      }
    }
  }

  // Starts the progress thread. Errors: ResourceExhausted when no thread can be made.
  absl::Status Start() {
    try {
      thread_ = std::thread([this] { Loop(); });
    } catch (const std::system_error& e) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("%s: cannot start the progress thread: %s", endpoint_.display, e.what()));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::optional<uint64_t>> LatestVersion() override {
    absl::MutexLock lock(&mu_);
    return newest_ ? std::optional<uint64_t>(newest_->version) : std::nullopt;
  }

  absl::Status Publish(PublishJob& job, absl::Time deadline) override;

  UcxPublisherCounters counters() const {
    return UcxPublisherCounters{reads_served_.load(std::memory_order_relaxed),
                                sleeps_with_reads_ready_.load(std::memory_order_relaxed),
                                grants_.load(std::memory_order_relaxed),
                                reads_held_total_.load(std::memory_order_relaxed),
                                control_bytes_sent_.load(std::memory_order_relaxed),
                                lent_runs_allocated_.load(std::memory_order_relaxed),
                                lent_runs_registered_.load(std::memory_order_relaxed)};
  }

  void KeepVersionsFrom(uint64_t version) override {
    absl::MutexLock lock(&mu_);
    keep_from_ = version;
    ++changes_;
  }

  absl::StatusOr<int> WaitForReceivers(uint64_t version, int count, absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    while (Receivers(version) < count && !stopping_ && !cancelled_ && absl::Now() < deadline) {
      AwaitChange(deadline);
    }
    if (cancelled_) return Cancelled();
    return Receivers(version);
  }

  std::vector<KeyframeRequest> TakeKeyframeRequests() override {
    absl::MutexLock lock(&mu_);
    std::vector<KeyframeRequest> out;
    for (auto& [id, r] : keyframe_requests_) out.push_back(std::move(r));
    keyframe_requests_.clear();
    return out;
  }

  std::vector<SubscriberReport> TakeReports() override {
    absl::MutexLock lock(&mu_);
    std::vector<SubscriberReport> out;
    for (auto& [id, r] : reports_) out.push_back(std::move(r));
    reports_.clear();
    return out;
  }

  // With publish_mode=zero_copy: memory allocated and registered by UCX (UCP_MEM_MAP_ALLOCATE),
  // recorded in allocations_ until the returned owner drops it; the owner keeps the UCX context
  // alive through the region. A staged publish copies the tensors wherever they lie, so it gains
  // nothing from UCX's memory (shared memory, counted against /dev/shm): plain memory (nullptr),
  // as when UCX cannot allocate (a zero-copy publish then registers it like any tensor).
  absl::StatusOr<std::shared_ptr<void>> AllocateHost(size_t bytes, std::byte** data) override {
    if (!options_.zero_copy || !failpoints_.Hit("ucx.allocate_host").ok()) return nullptr;
    // A page more: UCX's allocators are page-aligned except its last resort (heap), which may
    // not be, nor zero-filled.
    constexpr size_t kPage = 4096;
    absl::StatusOr<std::unique_ptr<MemRegion>> region =
        MemRegion::Allocate(context_, bytes + kPage, UCS_MEMORY_TYPE_HOST);
    if (!region.ok()) {
      Log(LogLevel::kWarn,
          "%s: UCX could not allocate %d bytes of host memory (%s); AllocateHost hands out plain "
          "memory, which a zero-copy publish registers like any tensor",
          endpoint_.display, bytes + kPage, region.status().ToString());
      return nullptr;
    }
    WB_ASSIGN_OR_RETURN(std::string rkey, (*region)->PackRkey());
    const uintptr_t begin = reinterpret_cast<uintptr_t>((*region)->data());
    const uintptr_t aligned = (begin + kPage - 1) / kPage * kPage;
    // Zero-filled, and every page faulted in now rather than during the first Publish.
    std::memset(reinterpret_cast<void*>(aligned), 0, bytes);
    {
      absl::MutexLock lock(&allocations_->mu);
      const uint64_t id = allocations_->next_id++;
      allocations_->by_begin[begin] =
          HostAllocations::Entry{begin + (*region)->size(), id, std::move(rkey)};
    }
    *data = reinterpret_cast<std::byte*>(aligned);
    std::weak_ptr<HostAllocations> registry = allocations_;
    std::shared_ptr<MemRegion> owner(region->release(), [registry, begin](MemRegion* r) {
      // Forgotten before it is unmapped: no later publish names it.
      if (std::shared_ptr<HostAllocations> live = registry.lock()) {
        absl::MutexLock lock(&live->mu);
        live->by_begin.erase(begin);
      }
      delete r;
    });
    return std::shared_ptr<void>(std::move(owner));
  }

  // Wakes a Publish waiting for a staging slot and a WaitForReceivers at once; they and every
  // later call return Cancelled. The progress thread serves on until destruction.
  void Cancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    ++changes_;
  }

 private:
  absl::Status Cancelled() const {
    return absl::CancelledError(
        absl::StrFormat("%s: the publisher is being closed (Cancel)", endpoint_.display));
  }

  // Waits until changes_ moves (a slot or lease freed, a receiver counted, shutdown) or `until`.
  void AwaitChange(absl::Time until) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    struct Args {
      const UcxPublisher* p;
      uint64_t seen;
    } args{this, changes_};
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                return a->p->changes_ != a->seen || a->p->stopping_ ||
                                       a->p->cancelled_;
                              },
                              &args),
                          until);
  }

  // Subscribers whose newest verified version is >= `version`.
  int Receivers(uint64_t version) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int n = 0;
    for (const auto& [id, v] : receivers_) n += v >= version;
    return n;
  }

  void Wake() {
    const uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof(one));
  }

  bool Kept(const Slot& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return s.state == Slot::State::kReady && keep_from_ && s.version >= *keep_from_;
  }

  // Drops leases whose holders stopped renewing them.
  void ExpireLeases(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A slot Publish may overwrite now (creating one when fewer than staging_slots exist), or
  // nullptr.
  Slot* PickSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why no slot is free, for DeadlineExceeded.
  std::string DescribeSlots() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecomputeNewest() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Slots beyond staging_slots that nobody needs any more (they were kept for a version floor
  // that has moved on), oldest first, removed from slots_ for the caller to free.
  std::vector<std::unique_ptr<Slot>> TrimSlots() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replaces `slot`'s memory by regions covering `size` bytes.
  absl::StatusOr<std::vector<Region>> AllocateRegions(uint64_t size);
  // Copies every tensor into the slot's regions on copy_threads threads, computing checksums on
  // the way (PublishJob::StageWithChecksum) for host staging; with `report`, marks each chunk
  // ready in the descriptor as soon as its bytes are in place (pipelining).
  absl::Status CopyIntoSlot(const Slot& slot, PublishJob& job, const std::vector<uint64_t>& offsets,
                            bool report);
  // Writes `slot`'s version descriptor (descriptor.h) for the version of `unsealed` (its manifest
  // without checksums), whose `size` bytes lie in the slot at `offsets`: staging, nothing ready
  // (but chunks without a tensor byte), room for a seal with the block checksums of `grids`
  // (PublishJob::ChecksumGrid of each tensor); or, given
  // `seal`, sealed with every chunk ready. Allocates a larger descriptor when needed. Sets the
  // slot's version, grant_region, prefix and chunks. The slot is not visible (kWriting).
  absl::Status WriteDescriptor(Slot& slot, const Manifest& unsealed,
                               const std::vector<uint64_t>& offsets, uint64_t size,
                               const std::vector<TileGrid>& grids, bool in_place,
                               const VersionSeal* seal);
  // A slot nobody reads (kWriting now), waiting for releases or lease expiries up to the
  // deadline. Errors: DeadlineExceeded describing the slots, Cancelled.
  absl::StatusOr<Slot*> TakeSlot(absl::Time deadline);
  // publish_mode=zero_copy: serves the caller's tensors in place (README.md, "Zero-copy
  // publish") and returns when the subscribers connected at the announcement have pulled the
  // version (or left, or did not ask within a lease), or at the deadline or Cancel, when the
  // remaining leases end with ABORTED. OK once the version is sealed.
  absl::Status PublishZeroCopy(PublishJob& job, absl::Time deadline);
  // Whether every subscriber a zero-copy Publish waits for is done with it.
  bool ZeroCopyDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Seals a version announced staging: the seal, then the state.
  absl::Status WriteSeal(Slot& slot, const VersionSeal& seal);
  // A version announced before it was sealed whose Publish failed: the descriptor says so, every
  // lease on it ends with ABORTED (`why`), and the slot is free again.
  void Abort(Slot& slot, const absl::Status& why);

  // The progress thread.
  void Loop();
  void Accept() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Handle(Conn& c, const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleHello(Conn& c, const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A shared-secret channel: checks the PROOF that answers this publisher's CHALLENGE.
  void HandleProof(Conn& c, const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends WELCOME: from now on `c` may ask for versions (and its receipts count).
  void Welcome(Conn& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendError(Conn& c, absl::StatusCode code, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ServeWaits(Conn& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Grant(Conn& c, const PendingWait& w, Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers WAIT `request` with REFUSED.
  void Refuse(Conn& c, uint64_t request, absl::StatusCode code, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers queued READs while the connection's output is short (bounded memory per
  // subscriber: at most kReadBacklog bytes queued beyond one DATA frame).
  void ServeReads(Conn& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Drop(Conn& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // KEYFRAME_REQUEST: kept for TakeKeyframeRequests, the newest per subscriber.
  void HandleKeyframeRequest(Conn& c, const absl::StatusOr<KeyframeRequestMsg>& m)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fan-out (relay_fanout > 0): places `c`, just granted `slot`'s version, in the version's tree
  // of relays: the publisher serves the first relay_fanout subscribers itself, every later one
  // pulls from the first subscriber (in grant order) still holding the version that offered to
  // relay and serves fewer than relay_fanout; `c` may relay in turn when it offered to.
  void AssignRelay(Conn& c, const Slot& slot, GrantMsg& grant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a lease (released, expired, or its connection gone).
  void EndLease(std::map<uint64_t, Lease>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `c` to be closed now, logging why (rate-limited).
  void Disconnect(Conn& c, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Publisher groups (README.md, "Publisher groups") ----
  // Rank 0: a rank joins the group (JOIN), then sends its staged parts (PART) and withdrawals.
  void HandleJoin(Conn& c, const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the rank of `join` a member (after its proof, on a shared-secret channel).
  void AdmitRank(Conn& c, const JoinMsg& join) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleMember(Conn& c, const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rank 0: the ranks whose part of `version` is not in (rank 0 itself unless its Publish of
  // `version` has staged it), leaving out `except`.
  std::vector<int> MissingRanks(uint64_t version, int except = -1) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rank 0: tells every rank whose part of `version` is in how the version ended, and forgets
  // those parts.
  void SendOutcome(uint64_t version, const absl::Status& outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rank 0, in Publish once its own part is staged: waits for every other rank's part, then
  // returns the group version's manifest (MergeGroupParts). Errors: DeadlineExceeded naming the
  // missing ranks, InvalidArgument when the parts do not fit together, Cancelled; each also
  // sent to the ranks whose parts were in.
  absl::StatusOr<Manifest> GatherGroup(const Manifest& own, absl::Time deadline);
  // Rank > 0, in Publish once its part is staged (and servable to subscribers that ask for
  // exactly this version): joins rank 0 if not joined, sends the part and waits for rank 0's
  // word. Past the deadline (or cancelled) it withdraws the part, and reports what rank 0 says.
  absl::Status CommitThroughRankZero(const Manifest& part, absl::Time deadline);
  absl::Status JoinRankZero(absl::Time deadline);

  const Endpoint endpoint_;
  const UcxOptions options_;
  FailPoints failpoints_;
  std::shared_ptr<Context> context_;
  std::unique_ptr<Worker> worker_;  // used by the progress thread only
  Fd listener_;
  Fd wake_;  // eventfd: Publish and the destructor wake the progress thread
  int efd_;  // the worker's event fd (owned by the worker)
  const std::string worker_address_;
  std::unique_ptr<WorkerPool> copiers_;  // copy_threads - 1 helpers (the caller is one more)
  const RmaTransports rma_;
  const GroupRole group_;
  const std::string description_;
  const uint64_t session_id_ = RandomId();
  std::thread thread_;

  absl::Mutex publish_mu_;  // one Publish at a time (the core serializes them too)
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  Slot* newest_ ABSL_GUARDED_BY(mu_) = nullptr;
  // The version being staged after it was announced (kStaging), granted to waiting subscribers.
  Slot* staging_ ABSL_GUARDED_BY(mu_) = nullptr;
  // A zero-copy Publish in flight: its slot, when it was announced, the subscribers connected
  // then (waited for) and those granted the version.
  struct ZeroCopy {
    Slot* slot = nullptr;
    absl::Time announced;  // MonotonicNow()
    std::vector<uint64_t> expected;
    std::set<uint64_t> granted;
  };
  ZeroCopy zero_copy_ ABSL_GUARDED_BY(mu_);
  // Registrations of callers' tensors served in place (publish_mode=zero_copy; Publish only).
  std::unique_ptr<RegistrationCache> lent_cache_;
  const std::shared_ptr<HostAllocations> allocations_ = std::make_shared<HostAllocations>();
  // Fan-out: per version, how many subscribers the publisher serves directly and the relays in
  // grant order with their children (the newest 8 versions).
  struct RelayTree {
    int direct = 0;
    std::vector<std::pair<uint64_t, int>> relays;  // connection id, children
  };
  std::map<uint64_t, RelayTree> relay_trees_ ABSL_GUARDED_BY(mu_);
  // Connections whose next READ waits for its chunk to be staged: copies wake the progress
  // thread as chunks become ready.
  std::atomic<int> reads_held_{0};
  std::optional<uint64_t> keep_from_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> receivers_ ABSL_GUARDED_BY(mu_);  // subscriber id -> version
  // Keyframe requests not taken yet, by subscriber id (at most kMaxKeyframeRequests).
  std::map<uint64_t, KeyframeRequest> keyframe_requests_ ABSL_GUARDED_BY(mu_);
  // Reports not taken yet, the newest per subscriber id (at most kMaxKeyframeRequests).
  std::map<uint64_t, SubscriberReport> reports_ ABSL_GUARDED_BY(mu_);
  uint64_t next_lease_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_conn_ ABSL_GUARDED_BY(mu_) = 1;
  int next_slot_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_region_ = 1;                   // Publish only
  uint64_t changes_ ABSL_GUARDED_BY(mu_) = 0;  // bumped whenever a slot or lease frees up
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int publishes_waiting_ ABSL_GUARDED_BY(mu_) = 0;  // Publish calls waiting for a slot
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // Accepting pauses until then after accept() failed for lack of descriptors or memory.
  absl::Time accept_resume_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration accept_backoff_ ABSL_GUARDED_BY(mu_) = kAcceptBackoffMin;
  // Messages a peer or the system can repeat at will, each at most once per 10 s.
  RateLimitedLog peer_log_;    // a subscriber's misbehaviour that disconnects it
  RateLimitedLog conn_log_;    // subscribers connecting and going away (info)
  RateLimitedLog lease_log_;   // leases expired or held for lease_max_hold
  RateLimitedLog accept_log_;  // accept() failures and connections refused
  RateLimitedLog auth_log_;    // peers refused for lack of the channel's shared secret
  // UcxPublisherCounters (ucx_transport.h); written by the progress thread only.
  std::atomic<uint64_t> reads_served_{0};
  std::atomic<uint64_t> sleeps_with_reads_ready_{0};
  std::atomic<uint64_t> grants_{0};
  std::atomic<uint64_t> reads_held_total_{0};
  std::atomic<uint64_t> lent_runs_allocated_{0};
  std::atomic<uint64_t> lent_runs_registered_{0};
  std::atomic<uint64_t> control_bytes_sent_{0};

  // Rank 0 of a group: where each rank serves its parts (members_[r], from its JOIN), the
  // connection it joined over, the parts staged per version and rank, and the version rank 0's
  // own Publish has staged and waits to commit.
  std::vector<GroupMember> members_ ABSL_GUARDED_BY(mu_);
  std::map<int, uint64_t> member_conns_ ABSL_GUARDED_BY(mu_);  // rank -> Conn::id
  // A part withdrawn (its rank gave up waiting) is nullopt: the version cannot commit.
  std::map<uint64_t, std::map<int, std::optional<Manifest>>> parts_ ABSL_GUARDED_BY(mu_);
  std::optional<uint64_t> gathering_ ABSL_GUARDED_BY(mu_);
  // How the newest 64 versions rank 0 decided on ended (OK: committed), for a late WITHDRAW.
  std::map<uint64_t, absl::Status> outcomes_ ABSL_GUARDED_BY(mu_);
  // Rank > 0: the connection to rank 0 (Publish only).
  ControlStream to_rank_zero_;
};

void UcxPublisher::ExpireLeases(absl::Time now) {
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.expiry > now) {
      ++it;
      continue;
    }
    const Lease& l = it->second;
    auto conn = conns_.find(l.conn);
    lease_log_.Log(
        LogLevel::kWarn,
        "%s: %s held version %d without renewing its lease for %s; the lease expired and the "
        "version's staging slot may be reused",
        endpoint_.display, conn != conns_.end() ? conn->second->peer : "a subscriber", l.version,
        absl::FormatDuration(options_.lease));
    EndLease(it++);
  }
}

void UcxPublisher::EndLease(std::map<uint64_t, Lease>::iterator it) {
  --it->second.slot->leases;
  auto conn = conns_.find(it->second.conn);
  if (conn != conns_.end()) --conn->second->leases;
  ++changes_;
  leases_.erase(it);
}

void UcxPublisher::Disconnect(Conn& c, const std::string& why) {
  peer_log_.Log(LogLevel::kWarn, "%s: %s %s; disconnecting it", endpoint_.display, c.peer, why);
  c.dead = true;
}

Slot* UcxPublisher::PickSlot() {
  ExpireLeases(MonotonicNow());
  Slot* best = nullptr;
  int unkept = 0;
  for (const auto& s : slots_) {
    if (Kept(*s)) continue;
    ++unkept;
    if (s->state == Slot::State::kWriting || s->state == Slot::State::kStaging || s->leases > 0) {
      continue;
    }
    // Free slots first, then the oldest version (the newest is overwritten only when it is the
    // one slot nobody reads).
    if (best == nullptr || (best->state == Slot::State::kReady &&
                            (s->state == Slot::State::kFree || s->version < best->version))) {
      best = s.get();
    }
  }
  if (best != nullptr && best->state == Slot::State::kFree) return best;
  if (unkept < options_.staging_slots) {
    auto slot = std::make_unique<Slot>();
    slot->index = next_slot_++;
    slots_.push_back(std::move(slot));
    return slots_.back().get();
  }
  return best;
}

std::string UcxPublisher::DescribeSlots() const {
  std::vector<std::string> parts;
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kWriting || s->state == Slot::State::kStaging) {
      parts.push_back(absl::StrFormat("slot %d is being written", s->index));
    } else if (s->state == Slot::State::kReady) {
      std::vector<std::string> holders;
      for (const auto& [id, l] : leases_) {
        if (l.slot != s.get()) continue;
        auto c = conns_.find(l.conn);
        holders.push_back(absl::StrFormat(
            "%s (lease ends in %s)", c != conns_.end() ? c->second->peer : "?",
            absl::FormatDuration(absl::Trunc(l.expiry - MonotonicNow(), absl::Milliseconds(1)))));
      }
      parts.push_back(
          absl::StrFormat("slot %d holds version %d%s%s", s->index, s->version,
                          Kept(*s) ? " (kept: KeepVersionsFrom)" : "",
                          holders.empty() ? "" : ", read by " + absl::StrJoin(holders, ", ")));
    }
  }
  return absl::StrJoin(parts, "; ");
}

void UcxPublisher::RecomputeNewest() {
  newest_ = nullptr;
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kReady && (newest_ == nullptr || s->version > newest_->version)) {
      newest_ = s.get();
    }
  }
}

std::vector<std::unique_ptr<Slot>> UcxPublisher::TrimSlots() {
  std::vector<std::unique_ptr<Slot>> out;
  while (true) {
    int unkept = 0;
    Slot* oldest = nullptr;
    for (const auto& s : slots_) {
      if (Kept(*s)) continue;
      ++unkept;
      if (s.get() == newest_ || s->state == Slot::State::kWriting ||
          s->state == Slot::State::kStaging || s->leases > 0) {
        continue;
      }
      if (oldest == nullptr || s->state == Slot::State::kFree ||
          (oldest->state == Slot::State::kReady && s->version < oldest->version)) {
        oldest = s.get();
      }
    }
    if (unkept <= options_.staging_slots || oldest == nullptr) return out;
    Log(LogLevel::kDebug,
        "%s: freeing staging slot %d (version %d): %d slots beyond the %d kept "
        "for versions >= %d",
        endpoint_.display, oldest->index, oldest->version, unkept - options_.staging_slots,
        options_.staging_slots, keep_from_.value_or(0));
    auto it = std::find_if(slots_.begin(), slots_.end(),
                           [&](const auto& s) { return s.get() == oldest; });
    out.push_back(std::move(*it));
    slots_.erase(it);
  }
}

absl::StatusOr<std::vector<Region>> UcxPublisher::AllocateRegions(uint64_t size) {
  std::vector<Region> regions;
  for (uint64_t base = 0; base < size; base += options_.max_region) {
    const uint64_t n = std::min(options_.max_region, size - base);
    Region r;
    r.id = next_region_++;
    r.base = base;
    if (options_.cuda_staging) {
#ifdef WEIGHTBUS_UCX_CUDA
      const cudaError_t e = cudaMalloc(&r.cuda_ptr, n);
      if (e != cudaSuccess) {
        r.cuda_ptr = nullptr;
        return absl::ResourceExhaustedError(
            absl::StrFormat("%s: cudaMalloc of a %d-byte staging region: %s", endpoint_.display, n,
                            cudaGetErrorString(e)));
      }
      WB_ASSIGN_OR_RETURN(r.mem,
                          MemRegion::Register(context_, r.cuda_ptr, n, UCS_MEMORY_TYPE_CUDA));
#endif
    } else {
      WB_ASSIGN_OR_RETURN(r.mem, MemRegion::Allocate(context_, n, UCS_MEMORY_TYPE_HOST));
    }
    WB_ASSIGN_OR_RETURN(r.rkey, r.mem->PackRkey());
    regions.push_back(std::move(r));
  }
  return regions;
}

absl::Status UcxPublisher::CopyIntoSlot(const Slot& slot, PublishJob& job,
                                        const std::vector<uint64_t>& offsets, bool report) {
  absl::Span<const PackedTensor> tensors = job.tensors();
  const std::vector<Region>& regions = slot.regions;
  const uint64_t chunk = slot.chunk_bytes;
  // Each tensor's destination as pieces that cross neither a region nor a readiness chunk
  // boundary, and the tensor bytes each chunk waits for.
  std::vector<std::vector<CopyTarget>> targets(tensors.size());
  std::vector<std::vector<uint64_t>> chunk_of(tensors.size());
  std::vector<std::atomic<uint64_t>> remaining(report ? slot.nchunks : 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint64_t off = offsets[i], done = 0;
    const uint64_t n = tensors[i].info->nbytes;
    while (done < n) {
      const Region& r = regions[static_cast<size_t>(off / options_.max_region)];
      const uint64_t in_region = off - r.base;
      uint64_t len = std::min(n - done, r.mem->size() - in_region);
      if (report) {
        len = std::min(len, (off / chunk + 1) * chunk - off);
        remaining[off / chunk].fetch_add(len, std::memory_order_relaxed);
        chunk_of[i].push_back(off / chunk);
      }
      targets[i].push_back(CopyTarget{r.mem->data() + in_region, len});
      off += len;
      done += len;
    }
  }
  // Piece k of tensor i is in place (its stores fenced): its chunk is ready once every tensor
  // byte of it is.
  const uint64_t version = slot.version;
  auto copied = [&](size_t i, size_t k) {
    if (!report) return;
    const uint64_t c = chunk_of[i][k];
    if (remaining[c].fetch_sub(targets[i][k].size, std::memory_order_acq_rel) ==
        targets[i][k].size) {
      __atomic_store_n(slot.ready_word(c), version, __ATOMIC_RELEASE);
      if (reads_held_.load(std::memory_order_relaxed)) Wake();  // READs wait for it
      // Fault injection: a pause here holds the staging of the rest (announced, chunk ready).
      (void)failpoints_.Hit("ucx.after_chunk");
    }
  };
  const int threads = copiers_ ? copiers_->size() + 1 : 1;
  std::vector<std::vector<size_t>> work(threads);
  if (options_.cuda_staging) {
    // Device memory: cudaMemcpy per piece; the core checksums the source separately.
    for (size_t i = 0; i < tensors.size(); ++i) work[i % threads].push_back(i);
  } else if (report) {
    // Subscribers pull chunks as they become ready, in slot order: whole tensors (a checksum is
    // one sequential pass) taken in slot order by whichever thread is free next, so that the
    // ready chunks advance from the start of the slot.
    std::vector<uint64_t> load(threads, 0);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t t =
          static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      work[t].push_back(i);
      load[t] += tensors[i].info->nbytes + 4096;
    }
  } else {
    // Whole tensors per thread (a checksum is one sequential pass), largest first, each to the
    // least loaded thread.
    std::vector<size_t> order(tensors.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return tensors[a].info->nbytes > tensors[b].info->nbytes;
    });
    std::vector<uint64_t> load(threads, 0);
    for (size_t i : order) {
      const size_t t =
          static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      work[t].push_back(i);
      load[t] += tensors[i].info->nbytes + 4096;  // a little per tensor for its overhead
    }
  }
  std::vector<absl::Status> results(threads);
  auto run = [&](int t) {
    for (size_t i : work[t]) {
      if (!options_.cuda_staging) {
        job.StageWithChecksum(i, targets[i], [&, i](size_t k) { copied(i, k); });
        continue;
      }
      const std::byte* src = tensors[i].data;
      for (size_t k = 0; k < targets[i].size(); ++k) {
        const CopyTarget& p = targets[i][k];
        if (absl::Status s = CopyBytes(p.data, src, p.size); !s.ok()) {
          results[t] = s;
          return;
        }
        src += p.size;
        copied(i, k);
      }
    }
  };
  TaskCounter pending;
  for (int t = 1; t < threads; ++t) {
    if (work[t].empty()) continue;
    pending.Add();
    copiers_->Submit([&, t] {
      run(t);
      pending.Done();
    });
  }
  run(0);
  // Bounded CPU work reading the caller's memory: always outwaited.
  pending.WaitUntilZero(absl::InfiniteFuture());
  for (const absl::Status& s : results) WB_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::Status UcxPublisher::WriteDescriptor(Slot& slot, const Manifest& unsealed,
                                           const std::vector<uint64_t>& offsets, uint64_t size,
                                           const std::vector<TileGrid>& grids, bool in_place,
                                           const VersionSeal* seal) {
  const uint64_t chunk = options_.ready_chunk;
  const uint64_t nchunks = (size + chunk - 1) / chunk;
  VersionLayout layout;
  layout.version = unsealed.version;
  layout.chunk_bytes = chunk;
  layout.data_bytes = slot.capacity;
  if (!slot.lent.empty()) {
    for (const Slot::Lent& r : slot.lent) {
      layout.regions.push_back(LayoutRegion{r.id, r.base, reinterpret_cast<uintptr_t>(r.data),
                                            r.length, r.rkey,
                                            r.ucx_allocated ? 0 : kCrossMemoryAttach});
    }
  } else {
    for (const Region& r : slot.regions) {
      layout.regions.push_back(LayoutRegion{
          r.id, r.base, reinterpret_cast<uintptr_t>(r.mem->data()), r.mem->size(), r.rkey});
    }
  }
  layout.offsets = offsets;
  layout.manifest_json = unsealed.ToJson();
  layout.pid = static_cast<uint64_t>(getpid());
  {
    absl::MutexLock lock(&mu_);
    if (group_.grouped() && group_.rank == 0) layout.members = members_;
    for (const auto& s : slots_) {
      for (const Region& r : s->regions) layout.live.push_back(r.id);
      for (const Slot::Lent& r : s->lent) layout.live.push_back(r.id);
      if (s->descriptor && s.get() != &slot) layout.live.push_back(s->descriptor->id);
    }
  }
  // The descriptor region is this slot's, possibly new: it is live too.
  const std::string encoded_layout_probe = EncodeLayout(layout);
  const uint64_t layout_offset = ReadyOffset(nchunks);
  // Room for the layout with one more live id (the descriptor's own), then the seal.
  const uint64_t layout_bytes_max = encoded_layout_probe.size() + 8;
  const uint64_t seal_offset = (layout_offset + layout_bytes_max + 63) / 64 * 64;
  const uint64_t seal_capacity =
      seal != nullptr ? EncodeSeal(*seal).size() : SealCapacity(unsealed, grids);
  const uint64_t needed = seal_offset + seal_capacity;
  if (!slot.descriptor || slot.descriptor->mem->size() < needed) {
    Region d;
    d.id = next_region_++;
    const uint64_t bytes = std::max<uint64_t>((needed + 4095) / 4096 * 4096, 4096);
    WB_ASSIGN_OR_RETURN(d.mem, MemRegion::Allocate(context_, bytes, UCS_MEMORY_TYPE_HOST));
    WB_ASSIGN_OR_RETURN(d.rkey, d.mem->PackRkey());
    std::optional<Region> old;
    {
      absl::MutexLock lock(&mu_);
      old = std::move(slot.descriptor);
      slot.descriptor = std::move(d);
    }
    old.reset();  // unregistered outside the lock
  }
  layout.live.push_back(slot.descriptor->id);
  const std::string encoded_layout = EncodeLayout(layout);
  std::byte* base = slot.descriptor->mem->data();
  slot.version = unsealed.version;
  slot.chunk_bytes = chunk;
  slot.nchunks = nchunks;
  DescriptorHeader h;
  h.version = unsealed.version;
  h.state = static_cast<uint64_t>(VersionState::kStaging);
  h.nchunks = nchunks;
  h.layout_offset = layout_offset;
  h.layout_bytes = encoded_layout.size();
  h.seal_offset = seal_offset;
  std::memcpy(base + layout_offset, encoded_layout.data(), encoded_layout.size());
  // Readiness: none yet (pipelining), except chunks no tensor byte lies in; all when the bytes
  // are staged already.
  std::vector<bool> has_bytes(nchunks, false);
  for (size_t i = 0; i < offsets.size() && seal == nullptr; ++i) {
    const uint64_t n = unsealed.tensors[i].nbytes;
    if (n == 0) continue;
    for (uint64_t k = offsets[i] / chunk; k <= (offsets[i] + n - 1) / chunk; ++k) {
      has_bytes[k] = true;
    }
  }
  for (uint64_t k = 0; k < nchunks; ++k) {
    const uint64_t word = seal != nullptr || in_place || !has_bytes[k] ? unsealed.version : 0;
    __atomic_store_n(slot.ready_word(k), word, __ATOMIC_RELAXED);
  }
  if (seal != nullptr) {
    const std::string encoded_seal = EncodeSeal(*seal);
    std::memcpy(base + seal_offset, encoded_seal.data(), encoded_seal.size());
    h.seal_bytes = encoded_seal.size();
    h.state = static_cast<uint64_t>(VersionState::kSealed);
  }
  const std::string header = EncodeHeader(h);
  std::memcpy(base, header.data(), header.size());
  std::atomic_thread_fence(std::memory_order_release);
  slot.grant_region =
      GrantRegion{slot.descriptor->id, slot.capacity, reinterpret_cast<uintptr_t>(base),
                  slot.descriptor->mem->size(), slot.descriptor->rkey};
  slot.prefix = layout_offset + encoded_layout.size();
  return absl::OkStatus();
}

absl::Status UcxPublisher::WriteSeal(Slot& slot, const VersionSeal& seal) {
  std::byte* base = slot.descriptor->mem->data();
  absl::StatusOr<DescriptorHeader> h =
      DecodeHeader(std::string_view(reinterpret_cast<const char*>(base), kDescriptorHeaderBytes));
  if (!h.ok()) return absl::InternalError(h.status().message());
  const std::string encoded = EncodeSeal(seal);
  if (h->seal_offset + encoded.size() > slot.descriptor->mem->size()) {
    return absl::InternalError(absl::StrFormat(
        "%s: the seal of version %d (%d bytes) does not fit the room its descriptor reserved",
        endpoint_.display, seal.version, encoded.size()));
  }
  std::memcpy(base + h->seal_offset, encoded.data(), encoded.size());
  // seal_bytes: a header word that subscribers may be reading now (atomically, like the state).
  static_assert(std::endian::native == std::endian::little, "header words are little-endian");
  __atomic_store_n(reinterpret_cast<uint64_t*>(base + 56), uint64_t{encoded.size()},
                   __ATOMIC_RELAXED);
  std::atomic_thread_fence(std::memory_order_release);
  __atomic_store_n(reinterpret_cast<uint64_t*>(base + 16),
                   static_cast<uint64_t>(VersionState::kSealed), __ATOMIC_RELEASE);
  return absl::OkStatus();
}

void UcxPublisher::Abort(Slot& slot, const absl::Status& why) {
  if (slot.descriptor) {
    __atomic_store_n(reinterpret_cast<uint64_t*>(slot.descriptor->mem->data() + 16),
                     static_cast<uint64_t>(VersionState::kAborted), __ATOMIC_RELEASE);
  }
  absl::MutexLock lock(&mu_);
  const std::string message = absl::StrFormat(
      "the publish of version %d failed before it was sealed (%s); nothing of it may be used",
      slot.version, why.message());
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.slot != &slot) {
      ++it;
      continue;
    }
    if (auto c = conns_.find(it->second.conn); c != conns_.end()) {
      c->second->out += Encode(AbortedMsg{it->first, static_cast<uint32_t>(why.code()), message});
    }
    EndLease(it++);
  }
  slot.state = Slot::State::kFree;
  if (staging_ == &slot) staging_ = nullptr;
  ++changes_;
  Wake();
}

absl::StatusOr<Slot*> UcxPublisher::TakeSlot(absl::Time deadline) {
  Slot* slot = nullptr;
  absl::MutexLock lock(&mu_);
  if (cancelled_) return Cancelled();
  // While this Publish waits, no new lease goes to a slot it could take (ServeWaits): they
  // drain within lease_max_hold + lease, however many connections take turns.
  ++publishes_waiting_;
  absl::Cleanup done_waiting = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    --publishes_waiting_;
    Wake();  // deferred WAITs are served again
  };
  while ((slot = PickSlot()) == nullptr) {
    absl::Time wake = deadline;
    const absl::Time mono = MonotonicNow(), now = absl::Now();
    for (const auto& [id, l] : leases_) wake = std::min(wake, now + (l.expiry - mono));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("all %d staging slots are in use until past the deadline (%s); raise "
                          "staging_slots or the timeout, or lower lease",
                          options_.staging_slots, DescribeSlots()));
    }
    if (stopping_) return absl::CancelledError("the publisher is shutting down");
    if (cancelled_) return Cancelled();
    AwaitChange(wake);
    if (cancelled_) return Cancelled();
  }
  slot->state = Slot::State::kWriting;
  if (newest_ == slot) RecomputeNewest();
  return slot;
}

bool UcxPublisher::ZeroCopyDone() const {
  if (zero_copy_.slot == nullptr) return true;
  if (zero_copy_.slot->leases > 0) return false;
  const absl::Time now = MonotonicNow();
  for (uint64_t id : zero_copy_.expected) {
    if (!conns_.contains(id) || zero_copy_.granted.contains(id)) continue;  // gone, or served
    if (now < zero_copy_.announced + options_.lease) return false;          // may still ask
  }
  return true;
}

absl::Status UcxPublisher::PublishZeroCopy(PublishJob& job, absl::Time deadline) {
  const uint64_t version = job.version();
  absl::Span<const PackedTensor> tensors = job.tensors();
  std::optional<Manifest> early = job.UnsealedManifest();
  if (!early) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: publish_mode=zero_copy serves the tensors of a Publish in place, but version %d "
        "came through a layer whose manifest is known only once its bytes are (publish through "
        "ucx:// directly, or with publish_mode=staged)",
        endpoint_.display, version));
  }
  // The caller's memory in runs: tensors by address, neighbours less than a page apart share a
  // registration (as a subscriber registers its targets). Registrations are cached across
  // versions (a trainer's parameters stay put) and dropped when their memory is unmapped.
  constexpr uint64_t kPage = 4096;
  std::vector<size_t> order;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].info->nbytes == 0) continue;
    if (tensors[i].data == nullptr) {
      return absl::InternalError(absl::StrFormat(
          "%s: tensor \"%s\" of version %d has no contiguous bytes to serve in place",
          endpoint_.display, tensors[i].info->name, version));
    }
    order.push_back(i);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors[a].data < tensors[b].data; });
  struct Run {
    const std::byte* begin;
    const std::byte* end;
  };
  std::vector<Run> runs;
  std::vector<size_t> run_of(tensors.size(), 0);
  for (size_t i : order) {
    const std::byte* b = tensors[i].data;
    const std::byte* e = b + tensors[i].info->nbytes;
    if (!runs.empty() && b < runs.back().end + kPage) {
      runs.back().end = std::max(runs.back().end, e);
    } else {
      runs.push_back(Run{b, e});
    }
    run_of[i] = runs.size() - 1;
  }
  std::vector<Slot::Lent> lent;
  uint64_t total = 0;
  for (const Run& r : runs) {
    // A run within memory from AllocateHost: served with that memory's own registration.
    if (std::optional<HostAllocations::Entry> a = allocations_->Find(
            reinterpret_cast<uintptr_t>(r.begin), reinterpret_cast<uintptr_t>(r.end))) {
      lent.push_back(Slot::Lent{a->id, total, r.begin, static_cast<uint64_t>(r.end - r.begin),
                                a->rkey,
                                /*ucx_allocated=*/true});
      total += r.end - r.begin;
      lent_runs_allocated_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    lent_runs_registered_.fetch_add(1, std::memory_order_relaxed);
    absl::StatusOr<RegistrationCache::Served> served =
        lent_cache_->Serve(const_cast<std::byte*>(r.begin), r.end - r.begin);
    if (!served.ok()) {
      return absl::Status(served.status().code(),
                          absl::StrFormat("%s: cannot register the caller's tensors of version %d "
                                          "to serve them in place (publish_mode=zero_copy): %s",
                                          endpoint_.display, version, served.status().message()));
    }
    lent.push_back(Slot::Lent{served->id, total, r.begin, static_cast<uint64_t>(r.end - r.begin),
                              *served->rkey});
    total += r.end - r.begin;
  }
  std::vector<uint64_t> offsets(tensors.size(), 0);
  for (size_t i : order) {
    offsets[i] = lent[run_of[i]].base + (tensors[i].data - runs[run_of[i]].begin);
  }
  WB_ASSIGN_OR_RETURN(Slot * slot, TakeSlot(deadline));
  {
    absl::MutexLock lock(&mu_);
    slot->lent = std::move(lent);
    slot->capacity = total;
  }
  absl::Status status = WriteDescriptor(*slot, *early, offsets, total, ChecksumGrids(job, *early),
                                        /*in_place=*/true, /*seal=*/nullptr);
  if (!status.ok()) {
    absl::MutexLock lock(&mu_);
    slot->lent.clear();
    slot->state = Slot::State::kFree;
    ++changes_;
    return status;
  }
  // Announced with every chunk in place: subscribers pull while the core checksums the same
  // memory. Those connected now are waited for, each at most one lease to ask.
  {
    absl::MutexLock lock(&mu_);
    slot->state = Slot::State::kStaging;
    staging_ = slot;
    zero_copy_ = ZeroCopy{};
    zero_copy_.slot = slot;
    zero_copy_.announced = MonotonicNow();
    for (const auto& [id, c] : conns_) {
      if (c->greeted && c->member_rank < 0 && !c->closing && !c->dead) {
        zero_copy_.expected.push_back(id);
      }
    }
    ++changes_;
    Wake();
  }
  absl::StatusOr<const Manifest*> sealed = job.SealedManifest(deadline);
  if (sealed.ok()) status = failpoints_.Hit("ucx.before_seal");
  if (sealed.ok() && status.ok()) status = WriteSeal(*slot, SealOf(**sealed));
  if (!sealed.ok() || !status.ok()) {
    const absl::Status failure = sealed.ok() ? status : sealed.status();
    Abort(*slot, failure);
    absl::MutexLock lock(&mu_);
    slot->lent.clear();
    zero_copy_ = ZeroCopy{};
    return failure;
  }
  absl::MutexLock lock(&mu_);
  slot->state = Slot::State::kReady;
  staging_ = nullptr;
  newest_ = slot;
  ++changes_;
  Wake();
  while (!ZeroCopyDone() && !stopping_ && !cancelled_ && absl::Now() < deadline) {
    const absl::Duration left_to_ask = zero_copy_.announced + options_.lease - MonotonicNow();
    AwaitChange(std::min(deadline, absl::Now() + std::max(left_to_ask, absl::ZeroDuration()) +
                                       absl::Milliseconds(1)));
  }
  // The caller's memory is the caller's again: leases still held end (ABORTED), and the version
  // is no longer served.
  std::vector<std::string> revoked;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.slot != slot) {
      ++it;
      continue;
    }
    if (auto c = conns_.find(it->second.conn); c != conns_.end()) {
      revoked.push_back(c->second->peer);
      c->second->out += Encode(AbortedMsg{
          it->first, static_cast<uint32_t>(absl::StatusCode::kAborted),
          absl::StrFormat(
              "the zero-copy publish of version %d returned (%s) before this "
              "subscriber finished: the bytes it served are the trainer's again",
              version,
              cancelled_ || stopping_ ? "the publisher is closing" : "its deadline passed")});
    }
    EndLease(it++);
  }
  if (!revoked.empty()) {
    lease_log_.Log(LogLevel::kWarn,
                   "%s: version %d (zero-copy) was still being read by %s when its Publish "
                   "returned; their transfers fail",
                   endpoint_.display, version, absl::StrJoin(revoked, ", "));
  }
  slot->state = Slot::State::kFree;
  slot->lent.clear();
  RecomputeNewest();
  zero_copy_ = ZeroCopy{};
  ++changes_;
  Wake();
  lent_cache_->EndFetch();
  Log(LogLevel::kDebug, "%s: version %d served in place (%d bytes in %d registrations)",
      endpoint_.display, version, total, runs.size());
  return absl::OkStatus();
}

absl::Status UcxPublisher::Publish(PublishJob& job, absl::Time deadline) {
  absl::MutexLock publish_lock(&publish_mu_);
  const uint64_t version = job.version();
  absl::Span<const PackedTensor> tensors = job.tensors();
  std::vector<uint64_t> offsets(tensors.size());
  uint64_t size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    offsets[i] = size;
    size += (tensors[i].info->nbytes + kTensorAlign - 1) / kTensorAlign * kTensorAlign;
  }

  if (options_.zero_copy) return PublishZeroCopy(job, deadline);
  WB_ASSIGN_OR_RETURN(Slot * slot, TakeSlot(deadline));
  bool published = false, announced = false;
  absl::Status failure;  // why the publish failed, once announced (subscribers are told)
  absl::Cleanup give_back = [&] {
    if (published) return;
    if (announced) {
      Abort(*slot, failure.ok() ? absl::InternalError("unknown failure") : failure);
      return;
    }
    absl::MutexLock lock(&mu_);
    slot->state = Slot::State::kFree;
    ++changes_;
  };
  auto fail = [&](absl::Status s) {
    failure = s;
    return s;
  };

  // Staging memory is registered once and reused; it grows only for a larger version.
  if (slot->capacity < size) {
    WB_ASSIGN_OR_RETURN(std::vector<Region> regions, AllocateRegions(size));
    std::vector<Region> old;
    {
      absl::MutexLock lock(&mu_);
      old = std::move(slot->regions);
      slot->regions = std::move(regions);
      slot->capacity = size;
    }
    old.clear();  // unregistered outside the lock
  }
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError("deadline passed before copying into the staging slot");
  }
  // Pipelining: announce the version before staging it, its manifest without checksums, so that
  // subscribers pull each chunk as soon as it is staged; the seal follows the last chunk. A
  // group's versions are announced by rank 0 once every rank's part is in, sealed.
  std::optional<Manifest> early;
  if (options_.pipeline && !group_.grouped()) early = job.UnsealedManifest();
  if (early) {
    WB_RETURN_IF_ERROR(WriteDescriptor(*slot, *early, offsets, size, ChecksumGrids(job, *early),
                                       /*in_place=*/false, /*seal=*/nullptr));
    absl::MutexLock lock(&mu_);
    slot->state = Slot::State::kStaging;
    staging_ = slot;
    announced = true;
    ++changes_;
    Wake();
  } else {
    slot->version = version;
    slot->chunk_bytes = options_.ready_chunk;
    slot->nchunks = 0;
  }
  if (absl::Status s = CopyIntoSlot(*slot, job, offsets, /*report=*/early.has_value()); !s.ok()) {
    return fail(s);
  }
  if (absl::Status s = failpoints_.Hit("ucx.after_copy"); !s.ok()) return fail(s);
  absl::StatusOr<const Manifest*> sealed = job.SealedManifest(deadline);
  if (!sealed.ok()) return fail(sealed.status());
  const Manifest* manifest = *sealed;
  // Fault injection (docs/TESTING.md): `error` here damages the staged bytes after they were
  // copied and checksummed, as memory damaged at rest would be (the first byte of the first
  // tensor with bytes gets one bit flipped; host staging only). Every read of the version then
  // fails verification.
  if (!failpoints_.Hit("ucx.damage_staged").ok()) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].info->nbytes == 0) continue;
      for (const Region& r : slot->regions) {
        if (r.cuda_ptr == nullptr && offsets[i] >= r.base && offsets[i] < r.base + r.mem->size()) {
          r.mem->data()[offsets[i] - r.base] ^= std::byte{1};
        }
      }
      break;
    }
  }
  // A group's rank 0 commits the version once every rank's part is in; its layout then carries
  // the group's manifest (every rank's parts, its own first, in the slot at `offsets`) and where
  // each rank serves its parts.
  std::optional<Manifest> merged;
  if (group_.grouped() && group_.rank == 0) {
    WB_ASSIGN_OR_RETURN(merged, GatherGroup(*manifest, deadline));
    offsets.resize(merged->tensors.size(), 0);
    // Fault injection (docs/TESTING.md): `error` here alters the group's manifest after its MAC,
    // as someone between rank 0 and a subscriber would: the owners of two parts of one tensor
    // swapped (else the metadata changed). Subscribers must refuse the version before any byte.
    if (!failpoints_.Hit("ucx.tamper_group_manifest").ok()) {
      std::vector<TensorInfo>& t = merged->tensors;
      bool swapped = false;
      for (size_t i = 0; i < t.size() && !swapped; ++i) {
        for (size_t k = i + 1; k < t.size() && !swapped; ++k) {
          if (t[i].name == t[k].name && t[i].owner != t[k].owner) {
            std::swap(t[i].owner, t[k].owner);
            swapped = true;
          }
        }
      }
      if (!swapped) merged->metadata["tampered"] = "by ucx.tamper_group_manifest";
    }
  }
  const Manifest& final_manifest = merged ? *merged : *manifest;
  const VersionSeal seal = SealOf(final_manifest);
  if (early) {
    // Fault injection: announced, every byte staged and checksummed, not sealed.
    if (absl::Status s = failpoints_.Hit("ucx.before_seal"); !s.ok()) return fail(s);
    if (absl::Status s = WriteSeal(*slot, seal); !s.ok()) return fail(s);
  } else {
    absl::Status s = WriteDescriptor(*slot, Unsealed(final_manifest), offsets, size,
                                     /*grids=*/{}, /*in_place=*/true, &seal);
    if (!s.ok()) {
      if (merged) {
        absl::MutexLock lock(&mu_);
        SendOutcome(version, s);
      }
      return s;
    }
  }
  std::vector<std::unique_ptr<Slot>> surplus;
  {
    absl::MutexLock lock(&mu_);
    slot->state = Slot::State::kReady;
    if (staging_ == slot) staging_ = nullptr;
    newest_ = slot;
    ++changes_;
    if (merged) SendOutcome(version, absl::OkStatus());
    surplus = TrimSlots();
  }
  surplus.clear();  // unregistered and freed outside the lock
  published = true;
  Wake();
  if (group_.grouped() && group_.rank > 0) {
    // Servable (to subscribers asking for exactly this version) from here on; committed only
    // when rank 0 says so. Not committed: the slot goes back, nothing of it was visible.
    absl::Status s = CommitThroughRankZero(*manifest, deadline);
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      slot->state = Slot::State::kFree;
      RecomputeNewest();
      ++changes_;
      return s;
    }
  }
  Log(LogLevel::kDebug, "%s: version %d staged in slot %d (%d bytes)", endpoint_.display, version,
      slot->index, size);
  return absl::OkStatus();
}

void UcxPublisher::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  ucp_worker_h worker = worker_->get();
  // Transports without one-sided hardware support (tcp) serve gets in this thread: while gets
  // are streaming, keep polling the worker instead of sleeping on its event fd between
  // messages, for up to kSpin after the last one.
  constexpr absl::Duration kSpin = absl::Microseconds(500);
  absl::Time last_busy = absl::InfinitePast();
  while (true) {
    bool busy = false;
    while (ucp_worker_progress(worker) != 0) busy = true;
    if (busy) last_busy = MonotonicNow();
    const bool spinning = MonotonicNow() - last_busy < kSpin;
    int timeout_ms = 1000;
    bool reads_ready = false;  // a connection has READs queued and nothing to send
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      fds.clear();
      ids.clear();
      const absl::Time mono = MonotonicNow();
      absl::Time next = mono + absl::Seconds(1);
      fds.push_back({wake_.get(), POLLIN, 0});
      // While accepting is paused (no descriptors left), the listener is not polled: its queued
      // connections would wake poll at once, for ever.
      const bool accepting = mono >= accept_resume_;
      if (!accepting) next = std::min(next, accept_resume_);
      fds.push_back({accepting ? listener_.get() : -1, POLLIN, 0});
      fds.push_back({efd_, POLLIN, 0});
      int held = 0;
      for (const auto& [id, c] : conns_) {
        // A connection with kMaxOutput queued is read no further until its peer reads.
        short events = c->out.size() < kMaxOutput ? POLLIN : 0;
        // Queued READs are served as the socket drains (none is left behind with `out` empty);
        // one waiting for its chunk to be staged is served when a copy wakes this thread.
        const bool reads = !c->reads.empty() && !c->reads_held;
        if (!c->out.empty() || reads) events |= POLLOUT;
        if (reads && c->out.empty()) reads_ready = true;
        if (c->reads_held) {
          ++held;
          next = std::min(next, mono + absl::Milliseconds(1));  // a wake-up may cross the store
        }
        fds.push_back({c->fd.get(), events, 0});
        ids.push_back(id);
        if (!c->greeted) next = std::min(next, c->hello_deadline);
        if (c->held_frames && c->out.size() < kMaxOutput) next = mono;
      }
      reads_held_.store(held, std::memory_order_seq_cst);
      for (const auto& [id, l] : leases_) next = std::min(next, l.expiry);
      timeout_ms = static_cast<int>(
          std::clamp<int64_t>(absl::ToInt64Milliseconds(next - mono) + 1, 0, 1000));
    }
    // Sleep on the worker's event fd only when it is armed; otherwise it has more to do.
    const ucs_status_t armed = spinning ? UCS_ERR_BUSY : ucp_worker_arm(worker);
    if (armed == UCS_ERR_BUSY) {
      timeout_ms = 0;
    } else if (armed != UCS_OK) {
      timeout_ms = std::min(timeout_ms, 1);
    }
    if (reads_ready && timeout_ms > 0) {
      sleeps_with_reads_ready_.fetch_add(1, std::memory_order_relaxed);
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
      if (fds[k + 3].revents == 0 && !(c.held_frames && c.out.size() < kMaxOutput)) continue;
      absl::StatusOr<bool> open = true;
      const bool member = c.member_rank >= 0;
      if (c.out.size() < kMaxOutput) {
        open = ReadAvailable(c.fd.get(), c.in, member ? kMaxMemberFrame + size_t{8} : kMaxInput);
      }
      while (!c.dead && c.out.size() < kMaxOutput) {
        absl::StatusOr<std::optional<Frame>> f =
            TakeFrame(c.in, c.member_rank >= 0 ? kMaxMemberFrame : kMaxRequestFrame);
        if (!f.ok()) {
          Disconnect(c, absl::StrFormat("sent a malformed message (%s)", f.status().message()));
          break;
        }
        if (!f->has_value()) break;
        Handle(c, **f);
      }
      c.held_frames = !c.dead && c.out.size() >= kMaxOutput;
      if (!open.ok() || !*open) {
        conn_log_.Log(LogLevel::kInfo, "%s: %s disconnected%s", endpoint_.display, c.peer,
                      open.ok() ? "" : " (" + std::string(open.status().message()) + ")");
        c.dead = true;
      }
    }
    const absl::Time now = MonotonicNow();
    ExpireLeases(now);
    for (auto it = conns_.begin(); it != conns_.end();) {
      Conn& c = *it->second;
      if (!c.greeted && now > c.hello_deadline && !c.dead) {
        conn_log_.Log(LogLevel::kInfo, "%s: %s did not greet within %s; disconnecting it",
                      endpoint_.display, c.peer, absl::FormatDuration(options_.connect_timeout));
        c.dead = true;
      }
      if (!c.dead && c.greeted && !c.closing) ServeWaits(c);
      // Answer READs and write until the socket takes no more or no READ is left. A pass that
      // wrote all it had queued must not leave READs behind: poll would get no POLLOUT for them
      // and sleep until a timeout (up to 1 s) unless another frame arrived.
      while (!c.dead) {
        const bool serving = c.greeted && !c.closing;
        if (serving) ServeReads(c);
        if (c.out.empty()) break;
        const size_t queued = c.out.size();
        absl::Status s = WriteAvailable(c.fd.get(), c.out);
        control_bytes_sent_.fetch_add(queued - c.out.size(), std::memory_order_relaxed);
        if (!s.ok()) {
          c.dead = true;
          break;
        }
        if (!serving || !c.out.empty() || c.reads.empty()) break;
      }
      if (c.closing && c.out.empty()) c.dead = true;
      if (c.dead) {
        Drop(c);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void UcxPublisher::Accept() {
  while (true) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &len,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR) return;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // Out of descriptors or kernel memory: stop accepting for a while (doubling up to
        // kAcceptBackoffMax) and serve the connections there are; the new ones wait in the
        // listen queue.
        accept_resume_ = MonotonicNow() + accept_backoff_;
        accept_log_.Log(LogLevel::kWarn,
                        "%s: accept: %s (%d connections open, max_connections %d); not accepting "
                        "for %s, serving the connected subscribers meanwhile (raise the fd "
                        "limit, ulimit -n, or lower max_connections)",
                        endpoint_.display, strerror(err), conns_.size(), options_.max_connections,
                        absl::FormatDuration(accept_backoff_));
        accept_backoff_ = std::min(accept_backoff_ * 2, kAcceptBackoffMax);
        return;
      }
      accept_log_.Log(LogLevel::kWarn, "%s: accept: %s", endpoint_.display, strerror(err));
      return;
    }
    accept_backoff_ = kAcceptBackoffMin;
    const std::string peer =
        "subscriber at " + DescribeSockaddr(reinterpret_cast<sockaddr*>(&addr), len);
    const bool over_limit = conns_.size() >= static_cast<size_t>(options_.max_connections);
    if (over_limit &&
        conns_.size() >= static_cast<size_t>(options_.max_connections) + kMaxRefusing) {
      accept_log_.Log(LogLevel::kWarn,
                      "%s: closing the connection of %s at once: %d connections are open "
                      "(max_connections %d) and %d more wait to be refused",
                      endpoint_.display, peer, conns_.size(), options_.max_connections,
                      kMaxRefusing);
      ::close(fd);
      continue;
    }
    int one = 1;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_unique<Conn>();
    c->id = next_conn_++;
    c->fd = Fd(fd);
    c->fd.CloseInForkedChildren();  // the subscriber sees the connection close with us
    c->peer = peer;
    c->over_limit = over_limit;
    c->hello_deadline = MonotonicNow() + options_.connect_timeout;
    conns_[c->id] = std::move(c);
  }
}

void UcxPublisher::SendError(Conn& c, absl::StatusCode code, const std::string& message) {
  c.out += Encode(ErrorMsg{static_cast<uint32_t>(code), message});
  c.closing = true;
}

void UcxPublisher::HandleHello(Conn& c, const Frame& f) {
  absl::StatusOr<HelloMsg> hello = DecodeHello(f.payload);
  if (!hello.ok() || hello->magic != kMagic) {
    conn_log_.Log(LogLevel::kInfo, "%s: %s is not a weightbus subscriber; disconnecting it",
                  endpoint_.display, c.peer);
    c.dead = true;
    return;
  }
  const uint32_t protocol = hello->protocol;
  const std::string& channel = hello->channel;
  const std::string& who = hello->description;
  c.peer = absl::StrFormat("subscriber %s at %s", who, c.peer.substr(strlen("subscriber at ")));
  if (protocol != kProtocolVersion) {
    SendError(c, absl::StatusCode::kFailedPrecondition,
              absl::StrFormat("publisher %s speaks ucx control protocol %d, the subscriber %d",
                              description_, kProtocolVersion, protocol));
    return;
  }
  if (c.over_limit) {
    accept_log_.Log(LogLevel::kWarn, "%s: refusing %s: %d connections are open (max_connections)",
                    endpoint_.display, c.peer, options_.max_connections);
    SendError(c, absl::StatusCode::kResourceExhausted,
              absl::StrFormat("the publisher at port %d (%s) already serves %d subscriber "
                              "connections, its max_connections; try again later",
                              endpoint_.port, description_, options_.max_connections));
    return;
  }
  if (channel != endpoint_.channel) {
    SendError(c, absl::StatusCode::kNotFound,
              absl::StrFormat("the publisher at port %d (%s) serves channel \"%s\", not \"%s\"",
                              endpoint_.port, description_, endpoint_.channel, channel));
    return;
  }
  c.subscriber_id = hello->subscriber_id;
  if (options_.key) {
    // A shared-secret channel: the subscriber's nonce ends its HELLO; nothing but CHALLENGE
    // goes to it until its PROOF checks out (no manifest, no rkey, no receipt counted).
    const std::string& nonce = hello->nonce;
    if (nonce.size() != c.subscriber_nonce.size()) {
      auth_log_.Log(LogLevel::kWarn,
                    "%s: refusing %s: it did not authenticate (this channel has a shared secret)",
                    endpoint_.display, c.peer);
      SendError(c, absl::StatusCode::kPermissionDenied,
                absl::StrFormat("the publisher at port %d (%s) of channel \"%s\" requires the "
                                "channel's shared secret: configure secret_file or secret_env",
                                endpoint_.port, description_, endpoint_.channel));
      return;
    }
    std::memcpy(c.subscriber_nonce.data(), nonce.data(), nonce.size());
    c.publisher_nonce = RandomNonce();
    const auto proof =
        HandshakeProof(*options_.key, "publisher", c.subscriber_nonce, c.publisher_nonce);
    c.out +=
        Encode(ChallengeMsg{std::string(AsText(c.publisher_nonce)), std::string(AsText(proof))});
    c.challenged = true;
    return;
  }
  Welcome(c);
}

void UcxPublisher::HandleProof(Conn& c, const Frame& f) {
  absl::StatusOr<ProofMsg> proof = DecodeProof(f.payload);
  if (c.pending_join) {  // a rank joining the group (kJoinerRole: not a subscriber's proof)
    const auto expected =
        HandshakeProof(*options_.key, kJoinerRole, c.publisher_nonce, c.subscriber_nonce);
    if (!proof.ok() || !ProofMatches(expected, proof->proof)) {
      auth_log_.Log(LogLevel::kWarn,
                    "%s: refusing %s: its proof of the channel's shared secret is wrong",
                    endpoint_.display, c.peer);
      SendError(c, absl::StatusCode::kPermissionDenied,
                absl::StrFormat("rank 0 (%s) of channel \"%s\" refused rank %d: its proof of the "
                                "channel's shared secret is wrong (the ranks hold different "
                                "secrets: check secret_file or secret_env on both)",
                                description_, endpoint_.channel, c.pending_join->rank));
      return;
    }
    const JoinMsg join = *std::move(c.pending_join);
    c.pending_join.reset();
    AdmitRank(c, join);
    return;
  }
  const auto expected =
      HandshakeProof(*options_.key, "subscriber", c.publisher_nonce, c.subscriber_nonce);
  if (!proof.ok() || !ProofMatches(expected, proof->proof)) {
    auth_log_.Log(LogLevel::kWarn,
                  "%s: refusing %s: its proof of the channel's shared secret is wrong",
                  endpoint_.display, c.peer);
    SendError(c, absl::StatusCode::kPermissionDenied,
              absl::StrFormat("the publisher at port %d (%s) of channel \"%s\" refused this "
                              "subscriber: its proof of the channel's shared secret is wrong (a "
                              "different secret)",
                              endpoint_.port, description_, endpoint_.channel));
    return;
  }
  Welcome(c);
}

void UcxPublisher::Welcome(Conn& c) {
  c.greeted = true;
  // Where UCP would emulate gets in software (tcp, ud), this worker would answer them, and UCX
  // 1.13 aborts the process when it answers a get of a subscriber that is gone (a get request
  // still queued on the socket of a subscriber that timed out or was killed while this process
  // was stalled: ucs_fatal "unexpected error: Endpoint timeout" in ucp_get_req_handler, or an
  // assertion in uct_tcp_ep_pending_purge). Such a subscriber reads the bytes over this
  // connection instead, and no UCP endpoint connects the two.
  const bool local = PeerIsLocal(c.fd.get());
  c.bytes_over_control = local ? !(rma_.one_host || rma_.network) : !rma_.network;
  c.out += Encode(WelcomeMsg{kProtocolVersion, session_id_, worker_address_,
                             static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.lease)),
                             newest_ != nullptr, newest_ ? newest_->version : 0, description_,
                             c.bytes_over_control});
  conn_log_.Log(LogLevel::kInfo, "%s: %s connected", endpoint_.display, c.peer);
}

void UcxPublisher::HandleKeyframeRequest(Conn& c, const absl::StatusOr<KeyframeRequestMsg>& m) {
  // Subscribers that never take a request (a plain ucx:// publisher) cannot grow this without
  // bound: one entry per subscriber id, and no more than a publisher has connections.
  constexpr size_t kMaxKeyframeRequests = 4096;
  if (!m.ok()) return;  // Handle disconnects the sender
  if (keyframe_requests_.size() >= kMaxKeyframeRequests &&
      keyframe_requests_.count(c.subscriber_id) == 0) {
    return;
  }
  KeyframeRequest& r = keyframe_requests_[c.subscriber_id];
  r.id = absl::StrFormat("ucx subscriber %016x", c.subscriber_id);
  r.version = m->version;
  r.text = absl::StrFormat("%s cannot reconstruct version %d%s: %s", c.peer, m->version,
                           m->has_holds ? absl::StrFormat(" (it holds version %d)", m->holds) : "",
                           m->reason);
}

void UcxPublisher::Handle(Conn& c, const Frame& f) {
  if (c.closing) return;  // an ERROR is on its way out: what the peer sent after it is moot
  if (c.member_rank >= 0) {
    HandleMember(c, f);
    return;
  }
  if (!c.greeted) {
    if (!c.challenged && f.type == MsgType::kJoin) {
      HandleJoin(c, f);
    } else if (c.challenged && f.type == MsgType::kProof) {
      HandleProof(c, f);
    } else if (!c.challenged && f.type == MsgType::kHello) {
      HandleHello(c, f);
    } else {
      c.dead = true;  // anything else before WELCOME: not a subscriber (or not an honest one)
    }
    return;
  }
  // A malformed message disconnects its sender (logged with the decoder's words).
  absl::Status malformed;
  auto decoded = [&](auto m) {
    if (!m.ok()) malformed = m.status();
    return m;
  };
  switch (f.type) {
    case MsgType::kWait: {
      absl::StatusOr<WaitMsg> m = decoded(DecodeWait(f.payload));
      if (!m.ok()) break;
      PendingWait w;
      w.request = m->request;
      w.version = m->version;
      w.exact = m->mode == kWaitExact;
      w.now = m->mode == kWaitNewestNow;
      if (c.waits.size() >= kMaxWaits) {
        Disconnect(c, absl::StrFormat("has more than %d WAITs outstanding", kMaxWaits));
        break;
      }
      c.waits.push_back(w);
      break;
    }
    case MsgType::kCancel: {
      absl::StatusOr<CancelMsg> m = decoded(DecodeCancel(f.payload));
      if (!m.ok()) break;
      std::erase_if(c.waits, [&](const PendingWait& w) { return w.request == m->request; });
      break;
    }
    case MsgType::kRenew: {
      absl::StatusOr<RenewMsg> m = decoded(DecodeRenew(f.payload));
      if (!m.ok()) break;
      const uint64_t id = m->lease;
      auto it = leases_.find(id);
      const absl::Time now = MonotonicNow();
      bool valid = it != leases_.end() && it->second.conn == c.id;
      // A renewal is one more full lease, within lease_max_hold of the grant.
      if (valid && now + options_.lease > it->second.hold_start + options_.lease_max_hold) {
        lease_log_.Log(
            LogLevel::kWarn,
            "%s: %s has held version %d for %s, lease_max_hold %s; its lease is not "
            "renewed (the version's staging slot frees when it expires)",
            endpoint_.display, c.peer, it->second.version,
            absl::FormatDuration(absl::Trunc(now - it->second.hold_start, absl::Milliseconds(1))),
            absl::FormatDuration(options_.lease_max_hold));
        valid = false;
      }
      if (valid) it->second.expiry = now + options_.lease;
      c.out += Encode(RenewedMsg{id, valid});
      break;
    }
    case MsgType::kRelease: {
      absl::StatusOr<ReleaseMsg> m = decoded(DecodeRelease(f.payload));
      if (!m.ok()) break;
      const uint64_t id = m->lease;
      auto it = leases_.find(id);
      const bool valid = it != leases_.end() && it->second.conn == c.id;
      if (valid) EndLease(it);
      if (m->ack) c.out += Encode(ReleasedMsg{id, valid});
      break;
    }
    case MsgType::kAccepted: {
      absl::StatusOr<AcceptedMsg> m = decoded(DecodeAccepted(f.payload));
      if (!m.ok()) break;
      auto [it, inserted] = receivers_.emplace(c.subscriber_id, m->version);
      if (!inserted) it->second = std::max(it->second, m->version);
      ++changes_;
      break;
    }
    case MsgType::kKeyframeRequest:
      HandleKeyframeRequest(c, decoded(DecodeKeyframeRequest(f.payload)));
      break;
    case MsgType::kReport: {
      // Bounded as keyframe requests are: one per subscriber id, at most 4096 subscribers.
      absl::StatusOr<ReportMsg> m = decoded(DecodeReport(f.payload));
      if (!m.ok() || (reports_.size() >= 4096 && reports_.count(c.subscriber_id) == 0)) break;
      reports_[c.subscriber_id] = SubscriberReport{
          absl::StrFormat("ucx subscriber %016x", c.subscriber_id), m->version, m->text};
      break;
    }
    case MsgType::kRelayOffer: {
      absl::StatusOr<RelayOfferMsg> m = decoded(DecodeRelayOffer(f.payload));
      if (!m.ok()) break;
      // Kept only where relays can be used: a subscriber reading over this connection cannot
      // serve others with one-sided reads.
      if (!c.bytes_over_control && m->length >= kRelayReadyOffset) c.relay_offer = *std::move(m);
      break;
    }
    case MsgType::kRead: {
      absl::StatusOr<ReadMsg> m = decoded(DecodeRead(f.payload));
      if (!m.ok()) break;
      PendingRead read;
      read.request = m->request;
      read.lease = m->lease;
      read.offset = m->offset;
      read.length = m->length;
      if (c.reads.size() >= kMaxReads) {
        Disconnect(c, absl::StrFormat("has more than %d READs outstanding", kMaxReads));
        break;
      }
      c.reads.push_back(read);
      break;
    }
    case MsgType::kList: {
      absl::StatusOr<ListMsg> m = decoded(DecodeList(f.payload));
      if (!m.ok()) break;
      VersionsMsg answer{m->request, {}};
      for (const auto& s : slots_) {
        if (s->state == Slot::State::kReady) answer.versions.push_back(s->version);
      }
      std::sort(answer.versions.begin(), answer.versions.end());
      c.out += Encode(answer);
      break;
    }
    default:
      Disconnect(c, absl::StrFormat("sent an unexpected %s message", MsgTypeName(f.type)));
      break;
  }
  if (!malformed.ok()) {
    Disconnect(c, absl::StrFormat("sent a %s", malformed.message()));
  }
}

void UcxPublisher::HandleJoin(Conn& c, const Frame& f) {
  absl::StatusOr<JoinMsg> join = DecodeJoin(f.payload);
  if (!join.ok() || join->magic != kMagic) {
    conn_log_.Log(LogLevel::kInfo, "%s: %s is not a weightbus publisher rank; disconnecting it",
                  endpoint_.display, c.peer);
    c.dead = true;
    return;
  }
  const std::string at = c.peer.substr(strlen("subscriber at "));
  c.peer = absl::StrFormat("rank %d (%s) at %s", join->rank, join->description, at);
  auto refuse = [&](absl::StatusCode code, const std::string& why) {
    peer_log_.Log(LogLevel::kWarn, "%s: refusing %s: %s", endpoint_.display, c.peer, why);
    SendError(c, code, why);
  };
  if (join->protocol != kProtocolVersion) {
    return refuse(absl::StatusCode::kFailedPrecondition,
                  absl::StrFormat("rank 0 (%s) speaks ucx control protocol %d, rank %d %d",
                                  description_, kProtocolVersion, join->rank, join->protocol));
  }
  if (join->channel != endpoint_.channel) {
    return refuse(absl::StatusCode::kNotFound,
                  absl::StrFormat("the publisher at port %d (%s) serves channel \"%s\", not \"%s\"",
                                  endpoint_.port, description_, endpoint_.channel, join->channel));
  }
  if (!group_.grouped() || group_.rank != 0) {
    return refuse(absl::StatusCode::kFailedPrecondition,
                  absl::StrFormat("the publisher at port %d (%s) is %s, not rank 0 of a group: "
                                  "rank %d of a group of %d cannot join it (the ranks disagree "
                                  "on world_size)",
                                  endpoint_.port, description_,
                                  group_.grouped() ? absl::StrFormat("rank %d", group_.rank)
                                                   : "a single publisher (world_size=1)",
                                  join->rank, join->world_size));
  }
  if (join->world_size != static_cast<uint32_t>(group_.world_size)) {
    return refuse(absl::StatusCode::kFailedPrecondition,
                  absl::StrFormat("rank %d publishes with world_size %d, rank 0 (%s) with %d: the "
                                  "ranks disagree on world_size",
                                  join->rank, join->world_size, description_, group_.world_size));
  }
  if (join->rank == 0 || join->rank >= join->world_size || join->port == 0 || join->port > 65535) {
    return refuse(absl::StatusCode::kInvalidArgument,
                  absl::StrFormat("rank %d (port %d) cannot join a group of %d at its rank 0",
                                  join->rank, join->port, group_.world_size));
  }
  if (options_.key) {
    // A shared-secret channel: the rank proves it holds the secret (and rank 0 that it does)
    // before it becomes a member: no part of a rank that did not is ever taken, and no address
    // of one goes to subscribers.
    if (join->nonce.size() != c.subscriber_nonce.size()) {
      return refuse(absl::StatusCode::kPermissionDenied,
                    absl::StrFormat("rank 0 (%s) of channel \"%s\" requires the channel's shared "
                                    "secret of every rank: rank %d joins without it (configure "
                                    "secret_file or secret_env on every rank)",
                                    description_, endpoint_.channel, join->rank));
    }
    std::memcpy(c.subscriber_nonce.data(), join->nonce.data(), join->nonce.size());
    c.publisher_nonce = RandomNonce();
    const auto proof =
        HandshakeProof(*options_.key, kRankZeroRole, c.subscriber_nonce, c.publisher_nonce);
    c.out +=
        Encode(ChallengeMsg{std::string(AsText(c.publisher_nonce)), std::string(AsText(proof))});
    c.challenged = true;
    c.pending_join = *std::move(join);
    return;
  }
  AdmitRank(c, *join);
}

void UcxPublisher::AdmitRank(Conn& c, const JoinMsg& join) {
  const int rank = static_cast<int>(join.rank);
  if (auto old = member_conns_.find(rank); old != member_conns_.end()) {
    // A restarted rank whose old connection has not been seen closing yet (or a second process
    // configured with the same rank): the newest one is the rank.
    if (auto oc = conns_.find(old->second); oc != conns_.end()) {
      Disconnect(*oc->second, absl::StrFormat("was replaced by %s", c.peer));
      Drop(*oc->second);
    }
  }
  c.member_rank = rank;
  c.greeted = true;
  member_conns_[rank] = c.id;
  members_[rank] = GroupMember{SocketHost(c.fd.get()), join.port};
  c.out += Encode(JoinedMsg{static_cast<uint32_t>(group_.world_size), description_});
  conn_log_.Log(LogLevel::kInfo, "%s: %s joined the group (serving its parts at port %d)",
                endpoint_.display, c.peer, join.port);
}

void UcxPublisher::HandleMember(Conn& c, const Frame& f) {
  const int rank = c.member_rank;
  switch (f.type) {
    case MsgType::kPart: {
      absl::StatusOr<PartMsg> m = DecodePart(f.payload);
      if (!m.ok()) return Disconnect(c, absl::StrFormat("sent a %s", m.status().message()));
      absl::StatusOr<Manifest> part = Manifest::FromJson(
          m->manifest_json, absl::StrFormat("the part of rank %d of version %d", rank, m->version));
      absl::Status bad = part.status();
      if (bad.ok() && (part->version != m->version || part->publisher.rank != rank ||
                       part->publisher.world_size != group_.world_size)) {
        bad = absl::FailedPreconditionError(absl::StrFormat(
            "rank %d sent a part of version %d published as rank %d of world_size %d (rank 0 "
            "has world_size %d): the ranks disagree",
            rank, m->version, part->publisher.rank, part->publisher.world_size, group_.world_size));
      }
      if (bad.ok() && newest_ != nullptr && m->version <= newest_->version) {
        bad = absl::FailedPreconditionError(
            absl::StrFormat("version %d is not above the group's newest committed version %d",
                            m->version, newest_->version));
      }
      if (!bad.ok()) {
        c.out += Encode(
            OutcomeMsg{m->version, static_cast<uint32_t>(bad.code()), std::string(bad.message())});
        return;
      }
      parts_[m->version][rank] = *std::move(part);
      ++changes_;
      return;
    }
    case MsgType::kWithdraw: {
      absl::StatusOr<WithdrawMsg> m = DecodeWithdraw(f.payload);
      if (!m.ok()) return Disconnect(c, absl::StrFormat("sent a %s", m.status().message()));
      if (auto done = outcomes_.find(m->version); done != outcomes_.end()) {
        c.out += Encode(OutcomeMsg{m->version, static_cast<uint32_t>(done->second.code()),
                                   std::string(done->second.message())});
        return;
      }
      const std::vector<int> missing = MissingRanks(m->version, rank);
      parts_[m->version][rank] = std::nullopt;
      ++changes_;
      const std::string why =
          missing.empty()
              ? absl::StrFormat("rank %d withdrew its part", rank)
              : RanksText(missing, group_.world_size, "did not stage") + " by the deadline";
      c.out += Encode(
          OutcomeMsg{m->version, static_cast<uint32_t>(absl::StatusCode::kDeadlineExceeded),
                     absl::StrFormat("version %d was not committed: %s; nothing of it is visible",
                                     m->version, why)});
      return;
    }
    default:
      return Disconnect(c, absl::StrFormat("sent an unexpected %s message", MsgTypeName(f.type)));
  }
}

std::vector<int> UcxPublisher::MissingRanks(uint64_t version, int except) const {
  std::vector<int> missing;
  if (gathering_ != version && except != 0) missing.push_back(0);
  auto it = parts_.find(version);
  for (int r = 1; r < group_.world_size; ++r) {
    if (r == except) continue;
    if (it == parts_.end() || !it->second.contains(r)) missing.push_back(r);
  }
  return missing;
}

void UcxPublisher::SendOutcome(uint64_t version, const absl::Status& outcome) {
  outcomes_[version] = outcome;
  if (outcomes_.size() > 64) outcomes_.erase(outcomes_.begin());
  auto it = parts_.find(version);
  if (it == parts_.end()) return;
  for (const auto& [rank, part] : it->second) {
    if (!part) continue;  // withdrawn: its rank has its answer
    auto conn = member_conns_.find(rank);
    if (conn == member_conns_.end()) continue;
    auto c = conns_.find(conn->second);
    if (c == conns_.end()) continue;
    c->second->out += Encode(
        OutcomeMsg{version, static_cast<uint32_t>(outcome.code()), std::string(outcome.message())});
  }
  parts_.erase(it);
  // Parts of older versions can never commit now.
  while (!parts_.empty() && parts_.begin()->first < version) {
    const uint64_t old = parts_.begin()->first;
    SendOutcome(old, absl::FailedPreconditionError(absl::StrFormat(
                         "version %d was not committed: rank 0 committed version %d above it", old,
                         version)));
  }
  Wake();
}

absl::StatusOr<Manifest> UcxPublisher::GatherGroup(const Manifest& own, absl::Time deadline) {
  const uint64_t version = own.version;
  absl::MutexLock lock(&mu_);
  gathering_ = version;
  absl::Cleanup done = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { gathering_.reset(); };
  auto fail = [&](absl::Status error) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    SendOutcome(version, error);
    return error;
  };
  // Ranks that gave up waiting: the version cannot commit without them.
  auto withdrawn = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    std::vector<int> out;
    for (const auto& [rank, part] : parts_[version]) {
      if (!part) out.push_back(rank);
    }
    return out;
  };
  while (true) {
    const std::vector<int> missing = MissingRanks(version);
    const std::vector<int> gave_up = withdrawn();
    if (!gave_up.empty()) {
      std::string why = RanksText(gave_up, group_.world_size, "gave up waiting and withdrew");
      if (!missing.empty()) {
        why = RanksText(missing, group_.world_size, "did not stage") + " by the deadline; " + why;
      }
      return fail(absl::DeadlineExceededError(
          absl::StrFormat("%s: version %d was not committed: %s; nothing of version %d is visible",
                          endpoint_.display, version, why, version)));
    }
    if (missing.empty()) break;
    if (cancelled_ || stopping_) {
      return fail(absl::CancelledError(absl::StrFormat(
          "%s: version %d was not committed: rank 0 was closed (Cancel) while %s",
          endpoint_.display, version, RanksText(missing, group_.world_size, "had not staged"))));
    }
    if (absl::Now() >= deadline) {
      return fail(absl::DeadlineExceededError(
          absl::StrFormat("%s: version %d was not committed: %s by the deadline; nothing of "
                          "version %d is visible",
                          endpoint_.display, version,
                          RanksText(missing, group_.world_size, "did not stage"), version)));
    }
    AwaitChange(deadline);
  }
  std::vector<Manifest> parts{own};
  for (const auto& [rank, part] : parts_[version]) parts.push_back(*part);
  // On a channel with a secret no part counts unless its rank MACed it with the channel's key
  // (a forged or altered part, or a rank with another secret or none, refuses the whole set;
  // docs/SECURITY.md, "Publisher groups"), as disk's committing rank does.
  const ChannelKey* key = options_.key ? &*options_.key : nullptr;
  for (const Manifest& part : parts) {
    absl::Status refused = CheckPartMac(
        key, part, /*committer=*/0, absl::StrFormat("%s version %d", endpoint_.display, version));
    if (!refused.ok()) {
      return fail(absl::Status(
          refused.code(),
          absl::StrFormat("%s; nothing of version %d was committed", refused.message(), version)));
    }
  }
  absl::StatusOr<Manifest> merged = MergeGroupParts(version, parts, /*committer=*/0);
  if (!merged.ok()) {
    return fail(absl::Status(
        merged.status().code(),
        absl::StrFormat("%s version %d: the group's parts do not fit together, nothing was "
                        "committed: %s",
                        endpoint_.display, version, merged.status().message())));
  }
  // The MAC of the whole (every rank's tensors, shards, owners and checksums, under rank 0's
  // session), which subscribers check before accepting any byte.
  if (key != nullptr) merged->metadata[std::string(kMacMetadataKey)] = ManifestMac(*key, *merged);
  return merged;
}

absl::Status UcxPublisher::JoinRankZero(absl::Time deadline) {
  if (to_rank_zero_.connected()) {
    // A connection rank 0 closed (it restarted) shows as EOF on a poll: join again.
    absl::StatusOr<std::optional<Frame>> f = to_rank_zero_.Poll();
    while (f.ok() && f->has_value()) f = to_rank_zero_.Poll();  // stale OUTCOMEs
    if (f.ok()) return absl::OkStatus();
    to_rank_zero_.Close();
  }
  WB_ASSIGN_OR_RETURN(Fd fd, Connect(endpoint_.host, endpoint_.port, deadline, endpoint_.display));
  ControlStream stream(std::move(fd), absl::StrFormat("rank 0 of the group at %s port %d",
                                                      endpoint_.host, endpoint_.port));
  JoinMsg join{kMagic,
               kProtocolVersion,
               endpoint_.channel,
               static_cast<uint32_t>(group_.rank),
               static_cast<uint32_t>(group_.world_size),
               group_.port,
               description_,
               {}};
  const Nonce nonce = RandomNonce();
  if (options_.key) join.nonce = std::string(AsText(nonce));
  WB_RETURN_IF_ERROR(stream.Send(Encode(join), deadline));
  WB_ASSIGN_OR_RETURN(Frame answer, stream.Receive(deadline));
  if (answer.type == MsgType::kChallenge) {
    // A shared-secret channel: rank 0 proves it holds the secret first, then this rank.
    if (!options_.key) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s requires the channel's shared secret, which this rank (%d) lacks: configure "
          "secret_file or secret_env on every rank",
          stream.peer(), group_.rank));
    }
    absl::StatusOr<ChallengeMsg> challenge = DecodeChallenge(answer.payload);
    Nonce rank_zero_nonce{};
    const bool sized =
        challenge.ok() && challenge->publisher_nonce.size() == rank_zero_nonce.size();
    if (sized) std::memcpy(rank_zero_nonce.data(), challenge->publisher_nonce.data(), 32);
    if (!sized ||
        !ProofMatches(HandshakeProof(*options_.key, kRankZeroRole, nonce, rank_zero_nonce),
                      challenge->proof)) {
      return absl::PermissionDeniedError(absl::StrFormat(
          "%s could not prove it holds the channel's shared secret: rank 0 and this rank (%d) "
          "hold different secrets (check secret_file or secret_env on both), or it is not rank "
          "0 of this group",
          stream.peer(), group_.rank));
    }
    const auto proof = HandshakeProof(*options_.key, kJoinerRole, rank_zero_nonce, nonce);
    WB_RETURN_IF_ERROR(stream.Send(Encode(ProofMsg{std::string(AsText(proof))}), deadline));
    WB_ASSIGN_OR_RETURN(answer, stream.Receive(deadline));
  } else if (answer.type == MsgType::kJoined && options_.key) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s let this rank (%d) join without authenticating: rank 0 has no shared secret, but "
        "this rank's channel requires one (configure the same secret on every rank)",
        stream.peer(), group_.rank));
  }
  if (answer.type == MsgType::kError) {
    return ErrorStatus(answer.payload,
                       absl::StrFormat("%s refused rank %d: ", stream.peer(), group_.rank));
  }
  if (answer.type != MsgType::kJoined || !DecodeJoined(answer.payload).ok()) {
    return absl::DataLossError(absl::StrFormat("%s answered JOIN with a %s message", stream.peer(),
                                               MsgTypeName(answer.type)));
  }
  to_rank_zero_ = std::move(stream);
  return absl::OkStatus();
}

absl::Status UcxPublisher::CommitThroughRankZero(const Manifest& part, absl::Time deadline) {
  const uint64_t version = part.version;
  const std::string where =
      absl::StrFormat("rank 0 of the group at %s port %d", endpoint_.host, endpoint_.port);
  auto not_committed = [&](const absl::Status& why) {
    return absl::Status(
        why.code(),
        absl::StrFormat("%s: version %d was not committed: %s; this rank's (%d) "
                        "part was withdrawn and nothing of version %d is visible",
                        endpoint_.display, version, why.message(), group_.rank, version));
  };
  if (absl::Status s = JoinRankZero(deadline); !s.ok()) {
    to_rank_zero_.Close();
    return not_committed(absl::Status(
        absl::IsDeadlineExceeded(s) || absl::IsUnavailable(s) ? absl::StatusCode::kDeadlineExceeded
                                                              : s.code(),
        absl::StrFormat("rank 0 (%s) could not be joined: %s", where, s.message())));
  }
  auto lost = [&](const absl::Status& s) {
    to_rank_zero_.Close();
    return not_committed(absl::UnavailableError(absl::StrFormat(
        "the connection to %s broke while the version waited for its commit (rank 0 is gone: "
        "%s)",
        where, s.message())));
  };
  // Fault injection (docs/TESTING.md): `error` here sends rank 0 this rank's part with one
  // tensor's checksum changed after the part was MACed, as a part altered on its way (or forged
  // by someone without the key) would arrive; rank 0 must refuse the whole set.
  std::string part_json = part.ToJson();
  if (!failpoints_.Hit("ucx.tamper_part").ok()) {
    Manifest altered = part;
    if (!altered.tensors.empty()) altered.tensors[0].xxh3 ^= 1;
    altered.metadata["tampered"] = "by ucx.tamper_part";
    part_json = altered.ToJson();
  }
  if (absl::Status s = to_rank_zero_.Send(Encode(PartMsg{version, part_json}), deadline); !s.ok()) {
    return lost(s);
  }
  // Rank 0's word on `version`, waiting until `until` in slices (so that Cancel is seen).
  auto outcome = [&](absl::Time until, bool watch_cancel) -> absl::StatusOr<OutcomeMsg> {
    while (true) {
      if (watch_cancel) {
        absl::MutexLock lock(&mu_);
        if (cancelled_ || stopping_) return Cancelled();
      }
      const absl::Time now = absl::Now();
      if (now >= until) return absl::DeadlineExceededError("no word from rank 0");
      absl::StatusOr<Frame> f =
          to_rank_zero_.Receive(std::min(until, now + absl::Milliseconds(50)));
      if (absl::IsDeadlineExceeded(f.status())) continue;
      if (!f.ok()) return f.status();
      if (f->type == MsgType::kError) return ErrorStatus(f->payload, where + ": ");
      if (f->type != MsgType::kOutcome) continue;
      absl::StatusOr<OutcomeMsg> m = DecodeOutcome(f->payload);
      if (!m.ok()) return m.status();
      if (m->version == version) return m;
    }
  };
  auto status_of = [](const OutcomeMsg& m) {
    return m.code == 0
               ? absl::OkStatus()
               : absl::Status(StatusCodeFromWire(m.code, absl::StatusCode::kUnknown), m.message);
  };
  absl::StatusOr<OutcomeMsg> word = outcome(deadline, /*watch_cancel=*/true);
  if (word.ok()) {
    if (word->code == 0) return absl::OkStatus();
    return absl::Status(StatusCodeFromWire(word->code, absl::StatusCode::kUnknown),
                        absl::StrFormat("%s: %s", endpoint_.display, word->message));
  }
  if (!absl::IsDeadlineExceeded(word.status()) && !absl::IsCancelled(word.status())) {
    return lost(word.status());
  }
  // Past the deadline (or cancelled): withdraw, so that rank 0 cannot commit the version
  // without this part later, and learn from rank 0 whether it committed meanwhile and which
  // ranks it still misses.
  const bool cancelled = absl::IsCancelled(word.status());
  constexpr absl::Duration kWithdrawGrace = absl::Seconds(2);
  const absl::Time grace = absl::Now() + kWithdrawGrace;
  if (absl::Status s = to_rank_zero_.Send(Encode(WithdrawMsg{version}), grace); !s.ok()) {
    return lost(s);
  }
  absl::StatusOr<OutcomeMsg> last = outcome(grace, /*watch_cancel=*/false);
  if (!last.ok()) {
    to_rank_zero_.Close();
    return not_committed(absl::DeadlineExceededError(absl::StrFormat(
        "%s did not commit it by the deadline and did not answer its withdrawal (%s)", where,
        last.status().message())));
  }
  if (last->code == 0) return absl::OkStatus();  // committed before the withdrawal arrived
  absl::Status s = status_of(*last);
  if (cancelled) {
    return absl::CancelledError(
        absl::StrFormat("%s: the publisher was cancelled while waiting for its group: %s",
                        endpoint_.display, s.message()));
  }
  return absl::DeadlineExceededError(absl::StrFormat("%s: %s (rank %d withdrew its part)",
                                                     endpoint_.display, s.message(), group_.rank));
}

void UcxPublisher::ServeWaits(Conn& c) {
  for (auto it = c.waits.begin(); it != c.waits.end();) {
    const PendingWait w = *it;
    Slot* slot = nullptr;
    if (group_.rank > 0 && !w.exact) {
      Refuse(c, w.request, absl::StatusCode::kFailedPrecondition,
             absl::StrFormat("this is rank %d of a publisher group of %d, which serves the parts "
                             "of exact versions only; subscribe at the group's address %s",
                             group_.rank, group_.world_size, endpoint_.display));
      it = c.waits.erase(it);
      continue;
    }
    if (w.exact) {
      for (const auto& s : slots_) {
        if (s->state == Slot::State::kReady && s->version == w.version) slot = s.get();
      }
      // Fault injection (docs/TESTING.md): `error` here answers this request for an exact
      // version as if the version had left staging memory (NotFound), as a version of a delta
      // chain that is gone.
      if (slot != nullptr && !failpoints_.Hit("ucx.lose_version").ok()) slot = nullptr;
      if (slot == nullptr) {
        std::vector<uint64_t> held;
        for (const auto& s : slots_) {
          if (s->state == Slot::State::kReady) held.push_back(s->version);
        }
        std::sort(held.begin(), held.end());
        Refuse(c, w.request, absl::StatusCode::kNotFound,
               absl::StrFormat("the publisher no longer holds version %d (it holds: %s)", w.version,
                               held.empty() ? "none" : absl::StrJoin(held, ", ")));
        it = c.waits.erase(it);
        continue;
      }
    } else if (!w.now && staging_ != nullptr && staging_->version >= w.version &&
               (newest_ == nullptr || staging_->version > newest_->version)) {
      slot = staging_;  // announced, still being staged: pulled chunk by chunk as it lands
    } else if (newest_ != nullptr && newest_->version >= w.version) {
      slot = newest_;
    } else if (w.now) {
      Refuse(c, w.request, absl::StatusCode::kDeadlineExceeded,
             absl::StrFormat("no version >= %d yet (newest: %s)", w.version,
                             newest_ ? std::to_string(newest_->version) : "none"));
      it = c.waits.erase(it);
      continue;
    }
    if (slot == nullptr) {
      ++it;
      continue;
    }
    // While a Publish waits for a slot, no new lease goes to a slot it could take (every slot
    // but the newest's, and that one too when it is the only one): they drain within
    // lease_max_hold + lease however many connections take turns. A wait is answered once the
    // Publish is through; a poll now, as if no version were there yet.
    if (publishes_waiting_ > 0 && !Kept(*slot) &&
        (slot != newest_ || options_.staging_slots == 1)) {
      if (!w.now) {
        ++it;
        continue;
      }
      Refuse(c, w.request, absl::StatusCode::kDeadlineExceeded,
             absl::StrFormat("version %d is about to be replaced (a publish waits for its "
                             "staging slot)",
                             slot->version));
      it = c.waits.erase(it);
      continue;
    }
    if (c.leases >= kMaxLeases) {
      Disconnect(c, absl::StrFormat("holds %d leases and asks for more", kMaxLeases));
      return;
    }
    it = c.waits.erase(it);
    Grant(c, w, *slot);
  }
}

void UcxPublisher::Refuse(Conn& c, uint64_t request, absl::StatusCode code,
                          const std::string& why) {
  c.out += Encode(RefusedMsg{request, static_cast<uint32_t>(code), why});
}

void UcxPublisher::Grant(Conn& c, const PendingWait& w, Slot& slot) {
  if (absl::Status s = failpoints_.Hit("ucx.before_grant"); !s.ok()) {
    Refuse(c, w.request, s.code(), std::string(s.message()));
    return;
  }
  const absl::Time now = MonotonicNow();
  const uint64_t id = next_lease_++;
  leases_[id] = Lease{&slot, c.id, slot.version, now + options_.lease, now};
  ++slot.leases;
  ++c.leases;
  if (&slot == zero_copy_.slot) zero_copy_.granted.insert(c.id);
  GrantMsg grant{w.request,
                 id,
                 static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.lease)),
                 slot.version,
                 slot.grant_region,
                 slot.prefix,
                 /*relay=*/false,
                 /*source=*/std::nullopt};
  AssignRelay(c, slot, grant);
  c.out += Encode(grant);
  grants_.fetch_add(1, std::memory_order_relaxed);
}

void UcxPublisher::AssignRelay(Conn& c, const Slot& slot, GrantMsg& grant) {
  if (options_.relay_fanout <= 0 || c.bytes_over_control || group_.grouped()) return;
  const int fanout = static_cast<int>(options_.relay_fanout);
  RelayTree& tree = relay_trees_[slot.version];
  // The newest 8 versions' trees (never the one in use: an older version granted late stays).
  for (auto it = relay_trees_.begin(); relay_trees_.size() > 8 && it->first != slot.version;) {
    it = relay_trees_.erase(it);
  }
  if (tree.direct >= fanout) {
    for (auto& [id, children] : tree.relays) {
      if (children >= fanout || id == c.id) continue;
      auto parent = conns_.find(id);
      if (parent == conns_.end() || parent->second->dead || !parent->second->relay_offer) continue;
      // It must still hold the version (its lease, so its bytes are this version's).
      const bool holds = std::any_of(leases_.begin(), leases_.end(), [&](const auto& l) {
        return l.second.conn == id && l.second.slot == &slot;
      });
      if (!holds) continue;
      const RelayOfferMsg& o = *parent->second->relay_offer;
      grant.source = RelaySource{
          parent->second->subscriber_id,  o.worker_address, o.address, o.length, o.rkey, o.pid,
          static_cast<uint32_t>(children)};
      ++children;
      break;
    }
  }
  if (!grant.source) ++tree.direct;
  if (c.relay_offer) {
    grant.relay = true;
    tree.relays.emplace_back(c.id, 0);
  }
}

void UcxPublisher::ServeReads(Conn& c) {
  constexpr size_t kReadBacklog = size_t{4} << 20;
  c.reads_held = false;
  while (!c.reads.empty() && c.out.size() < kReadBacklog) {
    const PendingRead read = c.reads.front();
    c.reads.pop_front();
    auto refuse = [&](const std::string& why) {
      c.out += Encode(DataMsg{read.request, false, why});
    };
    auto it = leases_.find(read.lease);
    if (it == leases_.end() || it->second.conn != c.id) {
      refuse(absl::StrFormat("lease %d is not held (it expired or was released)", read.lease));
      continue;
    }
    const Slot& slot = *it->second.slot;
    // One region holds the whole read (subscribers split reads at region boundaries); every
    // sum is checked against wrapping. The version descriptor follows the bytes.
    const std::byte* region = nullptr;  // the region's bytes, and where they lie in the slot
    uint64_t region_base = 0, region_size = 0;
    for (const Region& g : slot.regions) {
      if (read.offset >= g.base && read.offset - g.base < g.mem->size()) {
        region = g.mem->data();
        region_base = g.base;
        region_size = g.mem->size();
      }
    }
    for (const Slot::Lent& g : slot.lent) {
      if (read.offset >= g.base && read.offset - g.base < g.length) {
        region = g.data;
        region_base = g.base;
        region_size = g.length;
      }
    }
    const bool descriptor = region == nullptr && slot.descriptor && read.offset >= slot.capacity &&
                            read.offset - slot.capacity < slot.descriptor->mem->size();
    if (descriptor) {
      region = slot.descriptor->mem->data();
      region_base = slot.capacity;
      region_size = slot.descriptor->mem->size();
    }
    uint64_t end = 0;
    if (region == nullptr || read.length == 0 || read.length > kMaxFrame / 2 ||
        __builtin_add_overflow(read.offset - region_base, read.length, &end) || end > region_size) {
      refuse(absl::StrFormat("bytes [%d, +%d) are not within one region of the slot of version %d",
                             read.offset, read.length, slot.version));
      continue;
    }
    if (!descriptor && !slot.Ready(read.offset, read.length)) {
      // Announced, not staged yet: answered once its chunks are (the copies wake this thread).
      c.reads.push_front(read);
      if (c.held_request != read.request) {
        c.held_request = read.request;
        reads_held_total_.fetch_add(1, std::memory_order_relaxed);
      }
      c.reads_held = true;
      break;
    }
    const char* bytes = reinterpret_cast<const char*>(region) + (read.offset - region_base);
    std::string host;  // GPU staging memory is copied to the host first
    if (descriptor) {
      // The descriptor's readiness words and state change under atomic stores while it is read
      // (as a one-sided get reads it): copied word by word with atomic loads.
      host.resize(read.length);
      CopyWordsAtomically(host.data(), bytes, read.length);
      bytes = host.data();
    } else if (options_.cuda_staging) {
      host.resize(read.length);
      if (absl::Status s = CopyBytes(host.data(), bytes, read.length); !s.ok()) {
        refuse(std::string(s.message()));
        continue;
      }
      bytes = host.data();
    }
    c.out += Encode(DataMsg{read.request, true, std::string_view(bytes, read.length)});
    reads_served_.fetch_add(1, std::memory_order_relaxed);
  }
}

void UcxPublisher::Drop(Conn& c) {
  ++changes_;  // a zero-copy Publish may be waiting for it
  if (c.member_rank >= 0) {
    // A rank gone (killed, or restarted and joined again): its staged parts went with it.
    auto m = member_conns_.find(c.member_rank);
    if (m != member_conns_.end() && m->second == c.id) {
      member_conns_.erase(m);
      for (auto& [version, ranks] : parts_) ranks.erase(c.member_rank);
      ++changes_;
      conn_log_.Log(LogLevel::kInfo, "%s: %s left the group", endpoint_.display, c.peer);
    }
  }
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.conn == c.id) {
      EndLease(it++);
    } else {
      ++it;
    }
  }
}

}  // namespace

std::optional<UcxPublisherCounters> PublisherCounters(const TransportPublisher& publisher) {
  const auto* ucx = dynamic_cast<const UcxPublisher*>(&publisher);
  if (ucx == nullptr) return std::nullopt;
  return ucx->counters();
}

absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenUcxPublisher(const Uri& uri,
                                                                     const Config& config) {
  WB_ASSIGN_OR_RETURN(Endpoint endpoint, ParseEndpoint(uri, /*for_subscriber=*/false));
  WB_ASSIGN_OR_RETURN(UcxOptions options, ReadOptions(endpoint, config));
  if (options.cuda_staging && !CudaSupported()) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: staging_memory=cuda needs a build with CUDA and a visible GPU", endpoint.display));
  }
  WB_ASSIGN_OR_RETURN(FailPoints failpoints, FailPoints::Parse(config.String("failpoints")));
  WB_ASSIGN_OR_RETURN(
      std::shared_ptr<Context> context,
      Context::Create(/*wakeup=*/true, endpoint.display, IsLoopback(endpoint.host),
                      TcpInterfacesFor(endpoint.host, endpoint.port, /*listening=*/true)));
  WB_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, Worker::Create(context, endpoint.display));
  WB_ASSIGN_OR_RETURN(std::string address, worker->Address());
  WB_ASSIGN_OR_RETURN(int efd, worker->EventFd());
  const RmaTransports rma = ContextRmaTransports(*context);
  GroupRole group;
  group.rank = static_cast<int>(config.Int("rank"));  // below world_size: checked by the core
  group.world_size = static_cast<int>(config.Int("world_size"));
  if (group.grouped() && options.zero_copy) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: a ucx:// publisher group (world_size=%d, rank %d) with publish_mode=zero_copy is not "
        "implemented: its ranks stage their parts (publish_mode=staged)",
        endpoint.display, group.world_size, group.rank));
  }
  // Rank 0 serves the group's rendezvous on the URI's address; every other rank its own parts
  // on an ephemeral port of the same host (it tells rank 0 which when it joins).
  WB_ASSIGN_OR_RETURN(Fd listener,
                      Listen(endpoint.host, group.rank > 0 ? 0 : endpoint.port, endpoint.display));
  if (group.rank > 0) group.port = static_cast<uint32_t>(LocalPort(listener.get()));
  Fd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake) return ErrnoStatus(errno, absl::StrFormat("%s: eventfd", endpoint.display));
  std::unique_ptr<WorkerPool> copiers;
  if (options.copy_threads > 1) {
    WB_ASSIGN_OR_RETURN(copiers, WorkerPool::Create(static_cast<int>(options.copy_threads - 1)));
  }
  auto publisher = std::make_unique<UcxPublisher>(
      std::move(endpoint), options, std::move(failpoints), std::move(context), std::move(worker),
      std::move(listener), std::move(wake), efd, std::move(address), std::move(copiers), rma,
      group);
  WB_RETURN_IF_ERROR(publisher->Start());
  return std::unique_ptr<TransportPublisher>(std::move(publisher));
}

}  // namespace weightbus::internal::ucx
