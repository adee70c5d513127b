// SPDX-License-Identifier: Apache-2.0
// Subscribing side of ucx://: connect to the publisher's rendezvous endpoint (lazily, retrying
// within connect_timeout), ask for the newest version >= N, and pull the granted version's bytes
// with pipelined one-sided gets (ucp_get_nbx) straight into the core's targets; then release the
// lease and learn from the publisher whether it held for the whole transfer.
//
// Thread safety: every call is serialized by mu_; the UCP worker is progressed only by the
// calling thread (no background thread). UcxVersion objects must not outlive their subscriber.
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/failpoint.h"
#include "core/logging.h"
#include "core/status.h"
#include "core/system.h"
#include "transports/ucx/control.h"
#include "transports/ucx/descriptor.h"
#include "transports/ucx/registration_cache.h"
#include "transports/ucx/ucp_util.h"
#include "transports/ucx/ucx_transport.h"

namespace weightbus::internal::ucx {
namespace {

// One connection to the publisher: the control stream and the UCP endpoint to its worker, with
// the remote keys unpacked on it (cached by region id: unpacking may map shared memory).
struct Session {
  ControlStream control;
  uint64_t generation = 0;
  uint64_t session_id = 0;
  std::string publisher;  // "publisher pid 12 on host-a at 10.0.0.1 port 5555 (IPv4)"
  absl::Duration lease;
  std::optional<uint64_t> newest;  // as of the greeting
  ucp_ep_h ep = nullptr;
  // UCP_ERR_HANDLING_MODE_PEER: UCX reports a dead peer and can cancel outstanding gets
  // (UCP_EP_CLOSE_FLAG_FORCE). Shared-memory transports of UCX 1.13 lack it; without it the
  // control connection alone detects a dead publisher.
  bool peer_errors = false;
  ucs_status_t ep_status = UCS_OK;  // set by the endpoint's error handler
  // The publisher serves the bytes over the control connection (READ/DATA) instead of UCP gets
  // (WELCOME says so where only software-emulated RMA would reach it); no UCP endpoint then.
  bool bytes_over_control = false;
  std::map<uint64_t, std::unique_ptr<RemoteKey>> rkeys;
  bool local = false;  // the publisher is on this host
  // Whether regions flagged kCrossMemoryAttach of process `attach_pid` can be read with
  // process_vm_readv (probed once per process: nullopt until then).
  uint64_t attach_pid = 0;
  std::optional<bool> attach;
};

// What one PullBytes moves: pieces of the slot into targets. For a Fetch each piece is one
// manifest tensor (size 0 and no target for one the core does not want, or that another rank
// of a group serves); for a FetchRanges each is one range of a tensor.
struct Pieces {
  std::vector<uint64_t> offsets;  // in the slot
  std::vector<uint64_t> sizes;
  std::vector<std::byte*> targets;
  std::vector<size_t> tensor;  // the manifest tensor each piece is of (for messages)
};

// A LandingSink that is told nothing (FetchRanges: the core verifies ranges by blocks).
struct NoLanding final : public LandingSink {
  void Landed(size_t) override {}
};

// One get of a Fetch: a contiguous run of slot bytes into a contiguous run of target bytes,
// crossing neither a remote region nor a local registration boundary. Neighbouring tensors that
// are contiguous on both sides share gets (small tensors cost one get per chunk, not one each):
// it covers tensors [first, last] of the manifest.
struct GetOp {
  size_t first;
  size_t last;
  ucp_rkey_h rkey;
  uint64_t remote;
  std::byte* local;
  uint64_t length;
  uint64_t slot_offset;  // where the bytes start in the slot (READ over the control connection)
  ucp_mem_h memh;
  bool attach = false;  // read with process_vm_readv (a kCrossMemoryAttach region on this host)
  // From the relay (RelayLink) instead of the publisher: where the bytes are in its memory.
  bool relay = false;
  uint64_t relay_remote = 0;
  size_t relay_region = 0;
};

// A relay's side of a version it may serve to other subscribers (GrantMsg::relay): its relay
// descriptor (this process's UCX-allocated memory, descriptor.h) and the chunks it holds.
// Touched by the fetching thread only.
struct RelayServe {
  std::byte* desc = nullptr;
  uint64_t version = 0;
  uint64_t chunk_bytes = 0;
  std::vector<uint64_t> left;  // per chunk: bytes of gets not complete yet

  uint64_t* word(uint64_t offset) const { return reinterpret_cast<uint64_t*>(desc + offset); }
  uint64_t Load(uint64_t offset) const { return __atomic_load_n(word(offset), __ATOMIC_SEQ_CST); }
  void SetState(RelayState s) const {
    __atomic_store_n(word(16), static_cast<uint64_t>(s), __ATOMIC_SEQ_CST);
  }
  // A get of [slot_offset, +length) (within one chunk) is in place.
  void Landed(uint64_t slot_offset, uint64_t length) {
    const uint64_t c = slot_offset / chunk_bytes;
    if (c >= left.size() || left[c] == 0) return;
    left[c] -= std::min(left[c], length);
    if (left[c] == 0) __atomic_store_n(word(kRelayReadyOffset + 8 * c), version, __ATOMIC_RELEASE);
  }
  // Children that said they read this version from here and have not said they are done:
  // (slot, heartbeat) each.
  std::vector<std::pair<uint64_t, uint64_t>> Readers() const {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (uint64_t k = 0; k < kMaxRelayChildren; ++k) {
      if (Load(RelayChildOffset(k)) == version && Load(RelayChildOffset(k) + 8) != version) {
        out.emplace_back(k, Load(RelayChildOffset(k) + 16));
      }
    }
    return out;
  }
};

// A relay a subscriber pulls from: an endpoint to its worker and the keys unpacked on it.
struct RelayPeer {
  uint64_t serial = 0;  // which endpoint this is: a link's keys belong to one
  ucp_ep_h ep = nullptr;
  bool peer_errors = false;
  ucs_status_t ep_status = UCS_OK;  // set by the endpoint's error handler
  uint64_t desc_address = 0;        // the relay descriptor `desc_rkey` is for
  std::unique_ptr<RemoteKey> desc_rkey;
  std::map<uint64_t, std::unique_ptr<RemoteKey>> rkeys;  // its regions, by id
  std::optional<bool> attach;  // its regions can be read with process_vm_readv from here
};

// One Fetch's use of a relay (GrantMsg::source).
struct RelayLink {
  RelayPeer* peer = nullptr;
  RelaySource source;
  uint64_t version = 0;
  std::vector<LayoutRegion> regions;  // the relay's memory, by slot offset
  std::vector<ucp_rkey_h> rkeys;      // per region, when not read by cross-memory attach
  uint64_t peer_serial = 0;           // the endpoint `rkeys` were unpacked on (RelayPeer::serial)
  bool attach = false;
  std::vector<bool> ready;   // chunks the relay holds, as last read
  bool dead = false;         // fell back to the publisher
  bool unreachable = false;  // dead because the relay could not be read or written
  std::string why;           // why it fell back
  uint64_t bytes = 0;        // read from the relay and confirmed
  uint64_t heartbeat = 0;
  absl::Time progress;  // the relay's last progress: a chunk it newly held, a read confirmed
};

// The gets of one Fetch and their completion bookkeeping (touched only by the fetching thread:
// UCX calls completions from inside ucp_worker_progress).
struct Pull {
  std::vector<GetOp> ops;             // in slot order within each run of tensors
  std::vector<uint32_t> remaining;    // per tensor: gets not yet complete
  std::vector<size_t> next_in_order;  // per tensor: its first get not yet complete
  std::vector<size_t> end_op;         // per tensor: one past its last get
  std::vector<bool> done;             // per get
  const Pieces* pieces = nullptr;
  uint64_t inflight = 0;
  absl::Status error;
  LandingSink* sink = nullptr;
  const Manifest* manifest = nullptr;
  std::string source;           // for messages: "ucx://h:p/c: ... from publisher ..."
  bool midpoint = false;        // the fail point ucx.during_get was passed
  RelayServe* serve = nullptr;  // this subscriber relays the version: chunks it holds

  // The fail point ucx.during_get, once per version: when half of the `total` bytes are
  // requested (`issued_bytes` by the first `issued` gets) and at least one get has finished.
  // Called after every get issued and every completion seen, so that it fires for any size
  // (shared-memory gets complete inside ucp_get_nbx: a version of at most one burst of gets is
  // all here before the first progress call; a read's DATA may complete the last one).
  absl::Status Midpoint(FailPoints& failpoints, uint64_t issued_bytes, uint64_t total,
                        size_t issued) {
    if (midpoint || issued_bytes * 2 < total || inflight >= issued) return absl::OkStatus();
    midpoint = true;
    return failpoints.Hit("ucx.during_get");
  }

  void Complete(size_t k, ucs_status_t status) {
    --inflight;
    const GetOp& op = ops[k];
    if (status != UCS_OK) {
      if (error.ok()) {
        error = UcsError(
            status, absl::StrFormat("get of %d bytes of tensor \"%s\" (version %d) "
                                    "%s failed",
                                    op.length, manifest->tensors[pieces->tensor[op.first]].name,
                                    manifest->version, source));
      }
      return;
    }
    done[k] = true;
    if (serve != nullptr) serve->Landed(op.slot_offset, op.length);
    for (size_t t = op.first; t <= op.last; ++t) {
      const uint64_t nbytes = pieces->sizes[t];
      if (nbytes == 0) continue;  // landed before the first get, or not wanted
      if (--remaining[t] == 0) {
        sink->Landed(t);
        continue;
      }
      // Report the complete prefix (gets over tcp may complete out of order).
      size_t& next = next_in_order[t];
      if (next != k) continue;
      while (next < end_op[t] && done[next]) ++next;
      const GetOp& last = ops[next - 1];
      sink->LandedPrefix(t, std::min(nbytes, last.slot_offset + last.length - pieces->offsets[t]));
    }
  }
};

struct GetContext {
  Pull* pull;
  size_t op;
};

// Reads `length` bytes at `remote` in process `pid` into `local` (process_vm_readv, which may
// copy less than asked: it is called again for the rest). The owner gone is UCS_ERR_UNREACHABLE
// (Unavailable), other failures UCS_ERR_IO_ERROR.
ucs_status_t AttachRead(uint64_t pid, std::byte* local, uint64_t remote, uint64_t length) {
  while (length > 0) {
    iovec l{local, length};
    iovec r{reinterpret_cast<void*>(remote), length};
    const ssize_t n = ::process_vm_readv(static_cast<pid_t>(pid), &l, 1, &r, 1, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return n < 0 && errno == ESRCH ? UCS_ERR_UNREACHABLE : UCS_ERR_IO_ERROR;
    }
    local += n;
    remote += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  return UCS_OK;
}

void OnGetDone(void* request, ucs_status_t status, void* user_data) {
  auto* c = static_cast<GetContext*>(user_data);
  c->pull->Complete(c->op, status);
  ucp_request_free(request);
}

class UcxSubscriber;
class GroupVersion;

// ProcessBytesByRank's counts.
constexpr int kCountedRanks = 256;
std::atomic<uint64_t> process_bytes[kCountedRanks];

class UcxVersion final : public IncomingVersion {
 public:
  UcxVersion(UcxSubscriber* owner, uint64_t generation, uint64_t lease_id, Manifest manifest,
             std::vector<LayoutRegion> regions, std::vector<uint64_t> offsets, std::string source,
             absl::Time asked)
      : owner_(owner),
        generation_(generation),
        lease_id_(lease_id),
        manifest_(std::move(manifest)),
        regions_(std::move(regions)),
        offsets_(std::move(offsets)),
        source_(std::move(source)),
        lease_base_(asked) {}
  ~UcxVersion() override;

  const Manifest& manifest() const override { return manifest_; }
  bool sealed() const override { return sealed_; }
  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override;
  absl::Status FetchRanges(absl::Span<const RangeRead> reads, absl::Time deadline) override;
  std::string DescribeSource(size_t i) const override {
    return absl::StrFormat("%s, staging bytes [%d, %d) of version %d", source_, offsets_[i],
                           offsets_[i] + manifest_.tensors[i].nbytes, manifest_.version);
  }
  void Accepted() override;

 private:
  friend class UcxSubscriber;
  friend class GroupVersion;
  UcxSubscriber* owner_;
  uint64_t generation_;
  uint64_t lease_id_;
  Manifest manifest_;                  // as announced; the sealed manifest once sealed_
  std::vector<LayoutRegion> regions_;  // ascending base, contiguous from 0
  std::vector<uint64_t> offsets_;      // per tensor, in the slot's byte range
  // The version descriptor (descriptor.h): where it is, its readiness granularity, which chunks
  // are known to be staged (all of them once sealed_), and whether the seal is in.
  GrantRegion descriptor_;
  uint64_t chunk_bytes_ = 0;
  uint64_t nchunks_ = 0;
  std::vector<bool> ready_;
  uint64_t ready_count_ = 0;
  bool sealed_ = false;
  bool all_ready() const { return ready_count_ == nchunks_; }
  std::string source_;
  std::vector<GroupMember> members_;  // of a group version (VersionLayout::members)
  uint64_t pid_ = 0;                  // VersionLayout::pid
  // Fan-out (GrantMsg): the grantee may relay the version; pull from this relay first. During
  // a Fetch, what it serves and the relay it reads.
  bool relay_ = false;
  std::optional<RelaySource> relay_source_;
  RelayServe* serve_ = nullptr;
  RelayLink* link_ = nullptr;
  // The publisher's lease runs from when it granted the version or from the last renewal it
  // accepted (RENEWED valid); both happened after we sent the request or that renewal, so the
  // lease certainly lasts until lease_base_ + lease, by our own MonotonicNow() clock.
  absl::Time lease_base_;
  bool released_ = false;
};

class UcxSubscriber final : public TransportSubscriber {
 public:
  UcxSubscriber(Endpoint endpoint, UcxOptions options, FailPoints failpoints,
                std::shared_ptr<Context> context, std::unique_ptr<Worker> worker, int rank = 0)
      : rank_(rank),
        endpoint_(std::move(endpoint)),
        options_(options),
        failpoints_(std::move(failpoints)),
        context_(std::move(context)),
        worker_(std::move(worker)),
        rma_(ContextRmaTransports(*context_)),
        registrations_(context_),
        description_(ProcessDescription()) {}

  ~UcxSubscriber() override {
    absl::MutexLock lock(&mu_);
    CloseSession();
    for (auto& [address, peer] : relay_peers_) ClosePeer(*peer);
    relay_peers_.clear();
    relay_regs_.reset();
    relay_desc_.reset();
  }

  absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                  absl::Time deadline) override {
    return Request(min_version, /*exact=*/false, deadline);
  }
  absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenVersion(uint64_t version,
                                                               absl::Time deadline) override {
    return Request(version, /*exact=*/true, deadline);
  }
  absl::StatusOr<std::vector<uint64_t>> ListVersions() override;
  // One KEYFRAME_REQUEST over the control connection, followed by a LIST whose answer shows
  // that the publisher has handled it (it handles one connection's frames in order): when this
  // returns OK, the publisher's next version answers it. Errors: Unavailable when the publisher
  // cannot be reached (the request is not kept: a later failure asks again); Cancelled.
  absl::Status RequestKeyframe(uint64_t version, std::optional<uint64_t> holds,
                               std::string_view why) override;
  // One REPORT over the control connection of the current session (none: Unavailable, no
  // connection is made for it); not acknowledged.
  absl::Status Report(uint64_t version, std::string_view text) override;
  // A wait in flight returns Cancelled within about 50 ms (Await receives in slices and checks
  // the flag); so does every later call. Only sets an atomic flag: safe from any thread.
  void Cancel() override { cancelled_.store(true); }
  void AcceptUnsealedVersions() override { accept_unsealed_.store(true); }
  UcxSubscriberCounters counters() {
    UcxSubscriberCounters c;
    {
      absl::MutexLock lock(&mu_);
      c.registrations = registrations_.registrations();
      c.gets = gets_.load(std::memory_order_relaxed);
      c.bytes_by_rank = {bytes_.load(std::memory_order_relaxed)};
      c.control_bytes_sent = control_sent_ + (session_ ? session_->control.bytes_sent() : 0);
      c.control_bytes_received =
          control_received_ + (session_ ? session_->control.bytes_received() : 0);
      c.descriptor_bytes = descriptor_bytes_;
      c.bytes_from_relays = relay_bytes_.load(std::memory_order_relaxed);
    }
    absl::MutexLock lock(&members_mu_);
    for (const auto& [rank, sub] : member_of_rank_) {
      const UcxSubscriberCounters m = sub->counters();
      c.registrations += m.registrations;
      c.gets += m.gets;
      c.control_bytes_sent += m.control_bytes_sent;
      c.control_bytes_received += m.control_bytes_received;
      c.descriptor_bytes += m.descriptor_bytes;
      c.bytes_from_relays += m.bytes_from_relays;
      if (c.bytes_by_rank.size() <= static_cast<size_t>(rank)) c.bytes_by_rank.resize(rank + 1, 0);
      c.bytes_by_rank[rank] += m.bytes_by_rank[0];
    }
    return c;
  }

  absl::Status Fetch(UcxVersion& v, absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline);
  // Fetch's transfer, seal and release, into `pieces`' targets.
  absl::Status FetchPieces(UcxVersion& v, const Pieces& pieces, LandingSink& sink,
                           absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FetchRanges(UcxVersion& v, absl::Span<const RangeRead> reads, absl::Time deadline);
  void Release(UcxVersion& v);
  // A group version's rank `rank` > 0 serves its parts at `member`: the subscriber that reads
  // them (one per address, kept across versions; a restarted rank has a new port). Errors: those
  // of opening a UCP worker.
  absl::StatusOr<UcxSubscriber*> MemberSubscriber(int rank, const GroupMember& member);
  const Endpoint& endpoint() const { return endpoint_; }
  void Accepted(UcxVersion& v);

 private:
  absl::StatusOr<std::unique_ptr<IncomingVersion>> Request(uint64_t version, bool exact,
                                                           absl::Time deadline);
  // Connects (or reuses a live connection). Errors as Connect, plus the publisher's ERROR; but
  // when `deadline` comes before connect_timeout ends and no publisher could be reached by
  // then, DeadlineExceeded naming `waiting_for` ("version >= 3") and the connect error (unless
  // `waiting_for` is empty). `once`: a single connect attempt (a poll).
  absl::Status EnsureSession(absl::Time deadline, std::string_view waiting_for = "",
                             bool once = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseSession() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A frame nobody waits for: a grant for a request given up on is released at once.
  void HandleStray(const Frame& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Receives frames until `want` says one is the answer (it may return an error). Stray frames
  // are handled; a broken connection closes the session.
  absl::StatusOr<Frame> Await(absl::Time deadline, const std::function<bool(const Frame&)>& want)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the session after `why` broke it. The message is prefixed with the URI unless
  // `in_fetch` (the core prefixes Fetch errors itself).
  absl::Status SessionLost(const absl::Status& why, std::string_view during, bool in_fetch = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The version a GRANT leases: reads its descriptor's header, readiness words and layout (and
  // its seal once sealed), checks them, and, unless unsealed versions are accepted, waits for
  // the seal. A failure releases the lease.
  absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenGrant(const Frame& f, absl::Time asked,
                                                             absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Descriptor bytes [offset, offset + length) of the version leased as `lease` (one get, or
  // READs over the control connection), by `deadline`. Errors as a transfer's.
  absl::StatusOr<std::string> ReadDescriptor(uint64_t lease, const GrantRegion& descriptor,
                                             uint64_t offset, uint64_t length, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads the seal of `v`, sealed as `header` says, and applies it to v's manifest.
  absl::Status ReadSeal(UcxVersion& v, const DescriptorHeader& header, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls v's descriptor header until the version is sealed (then reads the seal), keeping the
  // lease and watching the control connection. Errors: Aborted (its Publish failed),
  // DeadlineExceeded, Unavailable.
  absl::Status AwaitSeal(UcxVersion& v, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a transfer of `v` does between gets: handles the control frames that arrived (RENEWED,
  // ABORTED, ERROR, strays) and renews the lease every quarter of it (`renew_sent`: a RENEW
  // awaiting its RENEWED).
  absl::Status ServiceControl(UcxVersion& v, std::optional<absl::Time>& renew_sent,
                              absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The status of a lease ended by ABORTED (`message`), or OK.
  absl::Status AbortedStatus(const UcxVersion& v) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The unpacked remote key of region `id` on the session's endpoint (unpacked once).
  absl::StatusOr<ucp_rkey_h> RkeyOf(uint64_t id, const std::string& packed, std::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ---- Fan-out (README.md, "Fan-out") ----
  // Offers the publisher this subscriber's relay descriptor (allocated on first use, or larger
  // when `need` bytes do not fit). Errors: those of registering memory or sending.
  absl::Status OfferRelay(absl::Time deadline, uint64_t need = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prepares serving v (a grant with GrantMsg::relay) while it is received into `pc`'s targets:
  // the relay descriptor's layout maps the slot to them, then its header names the version.
  // False when this Fetch cannot be served (not every tensor wanted, no descriptor).
  bool BeginServing(UcxVersion& v, const Pieces& pc, RelayServe& serve)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After the Fetch: (when `ok`) waits for the children still reading (each until it is done or
  // its heartbeat stopped for relay_stall), then closes (descriptor.h's handshake).
  void FinishServing(RelayServe& serve, bool ok, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Says in the relay descriptor that `version` is not (or no longer) served from here, so that
  // children placed under this subscriber fall back to the publisher at once instead of waiting
  // relay_stall for it to begin (a version released unfetched, read in ranges, or not servable).
  void CloseRelay(uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The relay `src` names: an endpoint to its worker (created once, replaced when it failed;
  // at most 8 kept), or nullptr.
  RelayPeer* PeerFor(const RelaySource& src) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops `p`'s remote keys and closes its endpoint (forced where peer failures are reported).
  void ClosePeer(RelayPeer& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One blocking get (or put, `put`) of `len` bytes at `remote` of relay `src` by `deadline`,
  // with `rkey` (default: the relay descriptor's key); a relay that does not answer is forgotten
  // (its endpoint closed). `serial` nonzero: only on that endpoint (RelayPeer::serial, the one
  // `rkey` was unpacked on), Unavailable once it is gone instead of opening another.
  absl::Status PeerIo(const RelaySource& src, bool put, uint64_t remote, void* buf, size_t len,
                      absl::Time deadline, ucp_rkey_h rkey = nullptr, uint64_t serial = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts pulling v from its relay: says so in its child slot, waits (at most relay_stall) for
  // the relay to name the version, reads its layout. nullopt: pull from the publisher.
  std::optional<RelayLink> OpenRelay(UcxVersion& v, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The relay's header and a window of its readiness words from chunk `from`: false (and the
  // link dead, saying why) when it no longer serves the version.
  bool PollRelay(UcxVersion& v, RelayLink& link, uint64_t from, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the relay this subscriber reads no more of the version from it.
  void LeaveRelay(RelayLink& link, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether v's kCrossMemoryAttach regions can be read with process_vm_readv from here: the
  // publisher is on this host and a probe read of v's descriptor header that way matches it.
  bool CanAttach(const UcxVersion& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Force-closes the session's endpoint and waits until `*inflight` gets are complete (they
  // write into the caller's memory), then closes the session.
  void AbandonGets(const uint64_t* inflight) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PullBytes(UcxVersion& v, const Pieces& pieces, LandingSink& sink,
                         absl::Time deadline, uint64_t* inflight_left)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PullBytes, then the registrations' bookkeeping; a failure releases `v`, closing a broken or
  // abandoned session.
  absl::Status PullPieces(UcxVersion& v, const Pieces& pieces, LandingSink& sink,
                          absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks that `v`'s lease is still held, renewing it when it may be near its end.
  absl::Status ConfirmLease(UcxVersion& v, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PullBytes for a session with bytes_over_control: READs, gets_in_flight outstanding, each
  // answered by a DATA frame copied into its target.
  absl::Status ReadOverControl(UcxVersion& v, Pull& pull, uint64_t total, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    static_cast<Session*>(arg)->ep_status = status;
  }

  const int rank_;  // of the publisher group, for a group's rank > 0; else 0
  const Endpoint endpoint_;
  const UcxOptions options_;
  FailPoints failpoints_;
  std::shared_ptr<Context> context_;
  std::unique_ptr<Worker> worker_;
  const uint64_t subscriber_id_ = RandomId();
  const RmaTransports rma_;  // this process's one-sided transports (Session::bytes_over_control)

  absl::Mutex mu_;
  RegistrationCache registrations_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Session> session_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_request_ ABSL_GUARDED_BY(mu_) = 1;
  bool try_peer_errors_ ABSL_GUARDED_BY(mu_) = true;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> accept_unsealed_{false};
  // Leases the publisher ended with ABORTED while nobody was transferring them: lease id ->
  // the status (Aborted, its message), until the version is released.
  std::map<uint64_t, absl::Status> aborted_ ABSL_GUARDED_BY(mu_);
  // Counters of sessions already closed, and of descriptor reads.
  uint64_t control_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t control_received_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t descriptor_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Fan-out: this subscriber's relay descriptor (UCX-allocated; offered once per session), the
  // registrations of the receive buffers it serves (kept apart from the receive cache so that
  // neither evicts the other's ranges), and the relays it pulls from, by worker address.
  std::unique_ptr<MemRegion> relay_desc_ ABSL_GUARDED_BY(mu_);
  std::string relay_rkey_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<RegistrationCache> relay_regs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<RelayPeer>> relay_peers_ ABSL_GUARDED_BY(mu_);
  uint64_t relay_peer_serial_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> relay_bytes_{0};  // UcxSubscriberCounters::bytes_from_relays
  std::atomic<uint64_t> gets_{0};         // UcxSubscriberCounters::gets
  std::atomic<uint64_t> bytes_{0};        // UcxSubscriberCounters::bytes_by_rank (this publisher's)
  // The subscribers of a group's other ranks, by address ("host port").
  absl::Mutex members_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::map<std::string, std::unique_ptr<UcxSubscriber>> member_subs_ ABSL_GUARDED_BY(members_mu_);
  std::map<int, UcxSubscriber*> member_of_rank_ ABSL_GUARDED_BY(members_mu_);
  absl::Status CancelledStatus() const {
    return absl::CancelledError(
        absl::StrFormat("%s: the subscriber is being closed (Cancel)", endpoint_.display));
  }
  const std::string description_;
};

UcxVersion::~UcxVersion() {
  if (!released_) owner_->Release(*this);
}

absl::Status UcxVersion::Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                               absl::Time deadline) {
  return owner_->Fetch(*this, targets, sink, deadline);
}

absl::Status UcxVersion::FetchRanges(absl::Span<const RangeRead> reads, absl::Time deadline) {
  return owner_->FetchRanges(*this, reads, deadline);
}

// A group version as rank 0 granted it: its manifest lists every rank's parts; rank 0's own
// are read through `rank0_`, every other rank's straight from that rank (the address in the
// grant), which grants exactly this version with its own lease. Each rank is read on its own
// thread (each has its own subscriber, hence its own UCP worker).
class GroupVersion final : public IncomingVersion {
 public:
  GroupVersion(UcxSubscriber* owner, std::unique_ptr<UcxVersion> rank0)
      : owner_(owner), rank0_(std::move(rank0)), parts_(rank0_->manifest().publisher.world_size) {}

  const Manifest& manifest() const override { return rank0_->manifest(); }

  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override {
    const Manifest& m = manifest();
    std::vector<std::byte*> own(targets.begin(), targets.end());
    std::vector<bool> wanted(parts_.size(), false);
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      const int r = m.tensors[i].owner;
      if (r == 0) continue;
      own[i] = nullptr;
      if (targets[i] != nullptr && m.tensors[i].nbytes > 0) wanted[r] = true;
    }
    return ForRanks(wanted, /*rank0=*/true, [&](int r) -> absl::Status {
      if (r == 0) return rank0_->Fetch(own, sink, deadline);
      WB_ASSIGN_OR_RETURN(Part * part, OpenPart(r, deadline));
      std::vector<std::byte*> theirs(part->group_index.size(), nullptr);
      for (size_t j = 0; j < theirs.size(); ++j) theirs[j] = targets[part->group_index[j]];
      struct Mapped final : public LandingSink {
        LandingSink* sink;
        const Part* part;
        const Manifest* m;
        void Landed(size_t j) override {
          // Tensors without bytes were landed with rank 0's (its Fetch lands all of them).
          if (m->tensors[part->group_index[j]].nbytes > 0) sink->Landed(part->group_index[j]);
        }
        void LandedPrefix(size_t j, uint64_t bytes) override {
          sink->LandedPrefix(part->group_index[j], bytes);
        }
      } mapped;
      mapped.sink = &sink;
      mapped.part = part;
      mapped.m = &m;
      return part->version->Fetch(theirs, mapped, deadline);
    });
  }

  absl::Status FetchRanges(absl::Span<const RangeRead> reads, absl::Time deadline) override {
    const Manifest& m = manifest();
    std::vector<std::vector<RangeRead>> by_rank(parts_.size());
    std::vector<bool> wanted(parts_.size(), false);
    for (const RangeRead& r : reads) {
      if (r.tensor >= m.tensors.size()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("range of tensor %d of %d", r.tensor, m.tensors.size()));
      }
      const int owner = m.tensors[r.tensor].owner;
      by_rank[owner].push_back(r);
      wanted[owner] = true;
    }
    const bool rank0 = wanted[0];
    wanted[0] = false;
    return ForRanks(wanted, rank0, [&](int r) -> absl::Status {
      if (r == 0) return rank0_->FetchRanges(by_rank[0], deadline);
      WB_ASSIGN_OR_RETURN(Part * part, OpenPart(r, deadline));
      for (RangeRead& read : by_rank[r]) read.tensor = part->part_index[read.tensor];
      return part->version->FetchRanges(by_rank[r], deadline);
    });
  }

  std::string DescribeSource(size_t i) const override {
    const int r = manifest().tensors[i].owner;
    if (r == 0 || parts_[r].version == nullptr) {
      return r == 0 ? rank0_->DescribeSource(i)
                    : absl::StrFormat("rank %d of the group at %s port %d", r,
                                      rank0_->members_[r].host, rank0_->members_[r].port);
    }
    return parts_[r].version->DescribeSource(parts_[r].part_index.at(i));
  }

  void Accepted() override {
    rank0_->Accepted();
    for (const Part& p : parts_) {
      if (p.version != nullptr) p.version->Accepted();
    }
  }

 private:
  struct Part {
    std::unique_ptr<IncomingVersion> version;  // the rank's own grant of this version
    std::vector<size_t> group_index;           // per tensor of its manifest: the group's index
    std::map<size_t, size_t> part_index;       // group index -> index in its manifest
  };

  // fetch(r), with an exception (an allocation failing) as an Internal error: on a thread of
  // its own it would end the process, and on this one leave the others' threads unjoined.
  static absl::Status Guarded(const std::function<absl::Status(int)>& fetch, int r) {
    try {
      return fetch(r);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrFormat("rank %d's part: %s", r, e.what()));
    }
  }

  // Runs `fetch` for rank 0 (when `rank0`) on this thread and for every rank `wanted` on one
  // thread each; the first error (by rank) wins.
  absl::Status ForRanks(const std::vector<bool>& wanted, bool rank0,
                        const std::function<absl::Status(int)>& fetch) {
    std::vector<absl::Status> results(parts_.size());
    std::vector<std::thread> threads;
    for (size_t r = 1; r < parts_.size(); ++r) {
      if (!wanted[r]) continue;
      try {
        threads.emplace_back([&, r] { results[r] = Guarded(fetch, static_cast<int>(r)); });
      } catch (const std::system_error& e) {
        results[r] = Guarded(fetch, static_cast<int>(r));  // no thread to be had: on this one
      }
    }
    if (rank0) results[0] = Guarded(fetch, 0);
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : results) WB_RETURN_IF_ERROR(s);
    return absl::OkStatus();
  }

  // Rank r's grant of this version (opened once), checked against the group manifest: its
  // parts must be exactly the ones the manifest says it owns.
  absl::StatusOr<Part*> OpenPart(int r, absl::Time deadline) {
    Part& part = parts_[r];
    if (part.version != nullptr) return &part;
    const Manifest& m = manifest();
    const GroupMember& member = rank0_->members_[r];
    WB_ASSIGN_OR_RETURN(UcxSubscriber * sub, owner_->MemberSubscriber(r, member));
    absl::StatusOr<std::unique_ptr<IncomingVersion>> v = sub->OpenVersion(m.version, deadline);
    if (!v.ok()) {
      return absl::Status(
          v.status().code(),
          absl::StrFormat("rank %d of the group (at %s port %d), which holds parts "
                          "of version %d: %s",
                          r, member.host, member.port, m.version, v.status().message()));
    }
    std::vector<size_t> owned;
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      if (m.tensors[i].owner == r) owned.push_back(i);
    }
    const Manifest& theirs = (*v)->manifest();
    auto same = [](const TensorInfo& a, const TensorInfo& b) {
      return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.shard == b.shard &&
             a.nbytes == b.nbytes && a.xxh3 == b.xxh3 && a.owner == b.owner;
    };
    bool match = theirs.tensors.size() == owned.size();
    for (size_t j = 0; match && j < owned.size(); ++j) {
      match = same(theirs.tensors[j], m.tensors[owned[j]]);
    }
    if (!match) {
      return absl::DataLossError(absl::StrFormat(
          "rank %d of the group (at %s port %d) serves a version %d whose %d parts are not the "
          "%d the group's manifest lists for it (a rank restarted with other bytes?)",
          r, member.host, member.port, m.version, theirs.tensors.size(), owned.size()));
    }
    part.group_index = owned;
    for (size_t j = 0; j < owned.size(); ++j) part.part_index[owned[j]] = j;
    part.version = *std::move(v);
    return &part;
  }

  UcxSubscriber* owner_;
  std::unique_ptr<UcxVersion> rank0_;
  std::vector<Part> parts_;  // by rank; [0] unused (rank 0's parts are rank0_'s)
};

void UcxVersion::Accepted() { owner_->Accepted(*this); }

void UcxSubscriber::CloseSession() {
  if (!session_) return;
  Session& s = *session_;
  control_sent_ += s.control.bytes_sent();
  control_received_ += s.control.bytes_received();
  s.rkeys.clear();  // before the endpoint, as UCX requires
  if (s.ep != nullptr) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = s.peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    const ucs_status_t st =
        WaitRequest(worker_->get(), ucp_ep_close_nbx(s.ep, &param), absl::Now() + absl::Seconds(5));
    if (st != UCS_OK && st != UCS_ERR_CANCELED && st != UCS_ERR_CONNECTION_RESET &&
        st != UCS_ERR_ENDPOINT_TIMEOUT) {
      Log(LogLevel::kDebug, "%s: closing the endpoint to %s: %s", endpoint_.display, s.publisher,
          ucs_status_string(st));
    }
  }
  session_.reset();
}

absl::Status UcxSubscriber::SessionLost(const absl::Status& why, std::string_view during,
                                        bool in_fetch) {
  CloseSession();
  if (absl::IsDeadlineExceeded(why)) return why;
  return absl::Status(
      absl::IsUnavailable(why) || absl::IsDataLoss(why) ? absl::StatusCode::kUnavailable
                                                        : why.code(),
      absl::StrFormat("%s%s %s", in_fetch ? "" : endpoint_.display + ": ", why.message(), during));
}

absl::Status UcxSubscriber::EnsureSession(absl::Time deadline, std::string_view waiting_for,
                                          bool once) {
  if (session_) {
    // A live connection may have ended since the last call (publisher exited or restarted).
    absl::Status alive = session_->ep_status == UCS_OK
                             ? absl::OkStatus()
                             : UcsError(session_->ep_status, "the UCX endpoint failed");
    while (alive.ok()) {
      absl::StatusOr<std::optional<Frame>> f = session_->control.Poll();
      if (!f.ok()) {
        alive = f.status();
        break;
      }
      if (!f->has_value()) break;
      HandleStray(**f);
      if (!session_) break;  // an ERROR frame ended the session: reconnect below
    }
    if (alive.ok() && session_) return absl::OkStatus();
    Log(LogLevel::kInfo, "%s: reconnecting (%s)", endpoint_.display, std::string(alive.message()));
    CloseSession();
  }
  const absl::Time connect_end = absl::Now() + options_.connect_timeout;
  const absl::Time connect_deadline = std::min(deadline, connect_end);
  absl::StatusOr<Fd> connected = Connect(endpoint_.host, endpoint_.port, connect_deadline,
                                         endpoint_.display, once, &cancelled_);
  if (!connected.ok()) {
    // The caller's deadline, not connect_timeout, ended the attempts: nobody is there yet, so
    // this is a wait that timed out (callers that wait in slices keep waiting), not a
    // publisher that went away.
    if (absl::IsUnavailable(connected.status()) && !waiting_for.empty() &&
        (once || deadline < connect_end)) {
      return absl::DeadlineExceededError(
          absl::StrFormat("%s: no %s by the deadline: no publisher could be reached yet (%s)",
                          endpoint_.display, waiting_for, connected.status().message()));
    }
    return connected.status();
  }
  Fd fd = *std::move(connected);
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  std::string where = "?";
  if (::getpeername(fd.get(), reinterpret_cast<sockaddr*>(&peer), &len) == 0) {
    where = DescribeSockaddr(reinterpret_cast<sockaddr*>(&peer), len);
  }
  auto s = std::make_unique<Session>();
  s->control = ControlStream(std::move(fd), "the publisher at " + where);
  s->generation = ++generation_;
  const Nonce nonce = RandomNonce();
  HelloMsg hello{kMagic, kProtocolVersion, endpoint_.channel, subscriber_id_, description_};
  if (options_.key) hello.nonce = std::string(AsText(nonce));
  absl::Status sent = s->control.Send(Encode(hello), connect_deadline);
  absl::StatusOr<Frame> answer =
      sent.ok() ? s->control.Receive(connect_deadline) : absl::StatusOr<Frame>(sent);
  if (answer.ok() && answer->type == MsgType::kChallenge) {
    // A shared-secret channel: the publisher proves the secret first, then this subscriber.
    if (!options_.key) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: %s requires the channel's shared secret: configure secret_file or secret_env",
          endpoint_.display, s->control.peer()));
    }
    absl::StatusOr<ChallengeMsg> challenge = DecodeChallenge(answer->payload);
    Nonce publisher_nonce{};
    const bool sized =
        challenge.ok() && challenge->publisher_nonce.size() == publisher_nonce.size();
    if (sized) std::memcpy(publisher_nonce.data(), challenge->publisher_nonce.data(), 32);
    if (!sized || !ProofMatches(HandshakeProof(*options_.key, "publisher", nonce, publisher_nonce),
                                challenge->proof)) {
      return absl::PermissionDeniedError(absl::StrFormat(
          "%s: %s failed to prove the channel's shared secret (a publisher with another "
          "secret, or another process on its port); refusing it",
          endpoint_.display, s->control.peer()));
    }
    const auto proof = HandshakeProof(*options_.key, "subscriber", publisher_nonce, nonce);
    sent = s->control.Send(Encode(ProofMsg{std::string(AsText(proof))}), connect_deadline);
    answer = sent.ok() ? s->control.Receive(connect_deadline) : absl::StatusOr<Frame>(sent);
  } else if (answer.ok() && answer->type == MsgType::kWelcome && options_.key) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: %s did not authenticate itself with the channel's shared secret (WELCOME without "
        "CHALLENGE: a publisher without the secret, or another process on its port); refusing "
        "it",
        endpoint_.display, s->control.peer()));
  }
  if (!answer.ok()) {
    return absl::UnavailableError(absl::StrFormat(
        "%s: %s accepted the connection but did not greet within the connect timeout: %s",
        endpoint_.display, s->control.peer(), answer.status().message()));
  }
  if (answer->type == MsgType::kError) {
    return ErrorStatus(answer->payload, absl::StrFormat("%s: ", endpoint_.display));
  }
  if (answer->type != MsgType::kWelcome) {
    return absl::UnavailableError(absl::StrFormat(
        "%s: %s answered the greeting with %s, not WELCOME (is it a weightbus publisher?)",
        endpoint_.display, s->control.peer(), MsgTypeName(answer->type)));
  }
  absl::StatusOr<WelcomeMsg> welcome = DecodeWelcome(answer->payload);
  if (!welcome.ok() || welcome->protocol != kProtocolVersion || welcome->worker_address.empty()) {
    return absl::UnavailableError(absl::StrFormat(
        "%s: %s sent a malformed WELCOME (%s)", endpoint_.display, s->control.peer(),
        welcome.ok()
            ? absl::StrFormat("protocol %d, expected %d%s", welcome->protocol, kProtocolVersion,
                              welcome->worker_address.empty() ? ", no worker address" : "")
            : std::string(welcome.status().message())));
  }
  s->session_id = welcome->session_id;
  s->lease = absl::Nanoseconds(static_cast<int64_t>(welcome->lease_ns));
  const std::string& worker_address = welcome->worker_address;
  // The publisher says so when only software RMA reaches this subscriber from its side; this
  // subscriber's own transports may be the limit instead (UCX_TLS differs between the two).
  s->bytes_over_control = welcome->bytes_over_control;
  if (!s->bytes_over_control) {
    const bool local = PeerIsLocal(s->control.fd());
    s->bytes_over_control = local ? !(rma_.one_host || rma_.network) : !rma_.network;
  }
  if (welcome->has_newest) s->newest = welcome->newest;
  s->local = PeerIsLocal(s->control.fd());
  s->publisher = absl::StrFormat("publisher %s at %s", welcome->description, where);
  s->control.set_peer(s->publisher);
  if (s->bytes_over_control) {
    session_ = std::move(s);
    Log(LogLevel::kInfo, "%s: connected to %s (bytes over the control connection)",
        endpoint_.display, session_->publisher);
    return absl::OkStatus();
  }

  // Peer failure handling when the transports allow it (see Session::peer_errors); once a
  // publisher turned out unreachable that way, later sessions skip the attempt.
  ucs_status_t st = UCS_ERR_UNREACHABLE;
  for (const bool peer : {true, false}) {
    if (peer && !try_peer_errors_) continue;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
    params.err_mode = peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer) {
      params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.err_handler.cb = &OnEndpointError;
      params.err_handler.arg = s.get();
    }
    {
      std::optional<QuietUcxErrors> quiet;
      if (peer) quiet.emplace();
      st = ucp_ep_create(worker_->get(), &params, &s->ep);
    }
    if (st == UCS_OK) {
      s->peer_errors = peer;
      break;
    }
    s->ep = nullptr;
    if (st != UCS_ERR_UNREACHABLE) break;
    if (peer) {
      try_peer_errors_ = false;
      Log(LogLevel::kInfo,
          "%s: the UCX transports reaching %s cannot report a dead peer (shared memory in this "
          "UCX); the control connection watches the publisher instead",
          endpoint_.display, s->publisher);
    }
  }
  if (st != UCS_OK) {
    absl::Status e =
        UcsError(st, absl::StrFormat("%s: no UCX transport reaches %s from here (check UCX_TLS and "
                                     "UCX_NET_DEVICES on both sides)",
                                     endpoint_.display, s->publisher));
    return absl::Status(absl::StatusCode::kUnavailable, e.message());
  }
  session_ = std::move(s);
  Log(LogLevel::kInfo, "%s: connected to %s", endpoint_.display, session_->publisher);
  if (absl::Status offered = OfferRelay(connect_deadline); !offered.ok()) {
    Log(LogLevel::kInfo, "%s: not offering to relay versions to other subscribers: %s",
        endpoint_.display, std::string(offered.message()));
  }
  return absl::OkStatus();
}

void UcxSubscriber::HandleStray(const Frame& f) {
  switch (f.type) {
    case MsgType::kGrant: {
      // A grant answering a request given up on: its lease is released unused.
      if (absl::StatusOr<GrantMsg> g = DecodeGrant(f.payload); g.ok()) {
        (void)session_->control.Send(Encode(ReleaseMsg{g->lease, false}),
                                     absl::Now() + absl::Seconds(1));
      }
      break;
    }
    case MsgType::kAborted: {
      // A version whose Publish failed (or a zero-copy Publish that returned): its transfer
      // fails when it looks (AbortedStatus).
      if (absl::StatusOr<AbortedMsg> a = DecodeAborted(f.payload); a.ok()) {
        aborted_[a->lease] =
            absl::AbortedError(absl::StrFormat("%s: %s", session_->publisher, a->message));
        if (aborted_.size() > 4096) aborted_.erase(aborted_.begin());
      }
      break;
    }
    case MsgType::kError: {
      Log(LogLevel::kWarn, "%s: %s ended the session: %s", endpoint_.display, session_->publisher,
          ErrorStatus(f.payload, "").ToString());
      CloseSession();
      break;
    }
    default:  // late answers (RELEASED, VERSIONS, REFUSED) to requests given up on
      break;
  }
}

absl::StatusOr<Frame> UcxSubscriber::Await(absl::Time deadline,
                                           const std::function<bool(const Frame&)>& want) {
  while (true) {
    if (!session_) return absl::UnavailableError("the session ended");
    if (cancelled_.load()) return CancelledStatus();
    absl::StatusOr<Frame> f =
        session_->control.Receive(std::min(deadline, absl::Now() + absl::Milliseconds(50)));
    if (absl::IsDeadlineExceeded(f.status()) && absl::Now() < deadline) continue;
    if (!f.ok()) return f.status();
    if (want(*f)) return f;
    if (f->type == MsgType::kError) {
      const std::string publisher = session_->publisher;
      CloseSession();
      return ErrorStatus(f->payload, absl::StrFormat("%s: %s: ", endpoint_.display, publisher));
    }
    HandleStray(*f);
  }
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> UcxSubscriber::Request(uint64_t version,
                                                                        bool exact,
                                                                        absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (cancelled_.load()) return CancelledStatus();
  // A deadline already past is a poll: it still gets one round trip to the publisher (bounded
  // by connect_timeout), which answers at once with the newest version >= `version` or says
  // there is none, so that a version committed before the poll is found by it.
  const bool poll = !exact && deadline <= absl::Now();
  if (poll) deadline = absl::Now() + options_.connect_timeout;
  const std::string waiting_for = absl::StrFormat("version %s %d", exact ? "==" : ">=", version);
  WB_RETURN_IF_ERROR(EnsureSession(deadline, waiting_for, poll));
  const uint64_t request = next_request_++;
  const absl::Time asked = MonotonicNow();
  const uint8_t mode = exact ? kWaitExact : poll ? kWaitNewestNow : kWaitNewest;
  absl::Status sent = session_->control.Send(Encode(WaitMsg{request, version, mode}), deadline);
  if (!sent.ok()) return SessionLost(sent, "while asking for a version");
  absl::StatusOr<Frame> f = Await(deadline, [&](const Frame& f) {
    if (f.type != MsgType::kGrant && f.type != MsgType::kRefused) return false;
    return LeadingId(f.payload) == request;
  });
  if (!f.ok()) {
    if (absl::IsDeadlineExceeded(f.status()) && session_) {
      // The publisher may still grant it later; the late grant is then released unused.
      (void)session_->control.Send(Encode(CancelMsg{request}),
                                   absl::Now() + absl::Milliseconds(100));
      const std::optional<uint64_t> newest = session_->newest;
      return absl::DeadlineExceededError(absl::StrFormat(
          "%s: %s published no version %s %d by the deadline (newest when connected: %s)",
          endpoint_.display, session_->publisher, exact ? "==" : ">=", version,
          newest ? std::to_string(*newest) : "none"));
    }
    if (!session_ && !absl::IsUnavailable(f.status()) && !absl::IsDataLoss(f.status())) {
      return f.status();  // the publisher's ERROR, already worded
    }
    return SessionLost(f.status(), absl::StrFormat("while waiting for version %s %d",
                                                   exact ? "==" : ">=", version));
  }
  if (f->type == MsgType::kRefused) {
    absl::StatusOr<RefusedMsg> refused = DecodeRefused(f->payload);
    if (!refused.ok()) {
      return absl::DataLossError(absl::StrFormat("%s: %s sent a %s", endpoint_.display,
                                                 session_->publisher, refused.status().message()));
    }
    return absl::Status(
        StatusCodeFromWire(refused->code, absl::StatusCode::kInternal),
        absl::StrFormat("%s: %s: %s", endpoint_.display, session_->publisher, refused->message));
  }
  return OpenGrant(*f, asked, deadline);
}

absl::StatusOr<ucp_rkey_h> UcxSubscriber::RkeyOf(uint64_t id, const std::string& packed,
                                                 std::string_view what) {
  Session& s = *session_;
  auto it = s.rkeys.find(id);
  if (it == s.rkeys.end()) {
    WB_ASSIGN_OR_RETURN(std::unique_ptr<RemoteKey> key, RemoteKey::Unpack(s.ep, packed, what));
    it = s.rkeys.emplace(id, std::move(key)).first;
  }
  return it->second->get();
}

void UcxSubscriber::AbandonGets(const uint64_t* inflight) {
  ucp_worker_h worker = worker_->get();
  Session* gone = session_.get();
  const std::string publisher = gone->publisher;
  gone->rkeys.clear();
  if (gone->ep != nullptr) {
    // Force-close the endpoint now, while the targets are alive: every outstanding get
    // completes (canceled) inside this.
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = gone->peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    (void)WaitRequest(worker, ucp_ep_close_nbx(gone->ep, &param), absl::Now() + absl::Seconds(5));
    gone->ep = nullptr;
  }
  // Without FORCE the close flushes: the gets complete or fail. Bounded CPU wait after that.
  const absl::Time limit = absl::Now() + absl::Seconds(5);
  while (*inflight > 0 && absl::Now() < limit) {
    if (ucp_worker_progress(worker) == 0) absl::SleepFor(absl::Microseconds(50));
  }
  if (*inflight > 0) {
    // Cannot happen with UCX's documented close semantics; never return while gets may
    // still write into the caller's buffers.
    Log(LogLevel::kError,
        "%s: %d gets still outstanding 5 s after closing the endpoint to %s; waiting for them",
        endpoint_.display, *inflight, publisher);
    while (*inflight > 0) {
      if (ucp_worker_progress(worker) == 0) absl::SleepFor(absl::Milliseconds(1));
    }
  }
  CloseSession();
}

namespace {

// One get whose completion a blocking caller waits for.
struct PendingGet {
  uint64_t inflight = 0;
  ucs_status_t status = UCS_OK;
};

void OnPendingGetDone(void* request, ucs_status_t status, void* user_data) {
  auto* g = static_cast<PendingGet*>(user_data);
  if (status != UCS_OK) g->status = status;
  --g->inflight;
  ucp_request_free(request);
}

}  // namespace

namespace {

void OnRelayEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  static_cast<RelayPeer*>(arg)->ep_status = status;
}

// Bytes of a relay descriptor: header, child slots, readiness words of up to 64 Ki chunks (256
// GiB in 4 MiB chunks) and a layout of about 4,000 regions; grown when a version needs more.
constexpr uint64_t kRelayDescriptorBytes = uint64_t{1} << 20;

}  // namespace

absl::Status UcxSubscriber::OfferRelay(absl::Time deadline, uint64_t need) {
  if (!options_.relay || !session_ || session_->bytes_over_control || rank_ != 0) {
    return absl::OkStatus();
  }
  if (!relay_desc_ || relay_desc_->size() < need) {
    const uint64_t bytes = std::max(kRelayDescriptorBytes, (need + 4095) / 4096 * 4096);
    WB_ASSIGN_OR_RETURN(std::unique_ptr<MemRegion> desc,
                        MemRegion::Allocate(context_, bytes, UCS_MEMORY_TYPE_HOST));
    WB_ASSIGN_OR_RETURN(relay_rkey_, desc->PackRkey());
    std::memset(desc->data(), 0, desc->size());
    // Serving nothing yet: a child placed here before the first version begins waits for it.
    DescriptorHeader h;
    h.magic = kRelayMagic;
    h.state = static_cast<uint64_t>(RelayState::kClosed);
    const std::string header = EncodeHeader(h);
    std::memcpy(desc->data(), header.data(), header.size());
    relay_desc_ = std::move(desc);
    if (!relay_regs_) relay_regs_ = std::make_unique<RegistrationCache>(context_, 1);
  }
  WB_ASSIGN_OR_RETURN(std::string address, worker_->Address());
  return session_->control.Send(
      Encode(RelayOfferMsg{address, reinterpret_cast<uintptr_t>(relay_desc_->data()),
                           relay_desc_->size(), relay_rkey_, static_cast<uint64_t>(getpid())}),
      deadline);
}

void UcxSubscriber::CloseRelay(uint64_t version) {
  if (!relay_desc_) return;
  auto* words = reinterpret_cast<uint64_t*>(relay_desc_->data());
  if (__atomic_load_n(&words[1], __ATOMIC_SEQ_CST) == version &&
      __atomic_load_n(&words[2], __ATOMIC_SEQ_CST) >= static_cast<uint64_t>(RelayState::kClosing)) {
    return;  // closed already (FinishServing)
  }
  // State first: a child that sees the version sees it closed.
  __atomic_store_n(&words[2], static_cast<uint64_t>(RelayState::kClosed), __ATOMIC_SEQ_CST);
  __atomic_store_n(&words[1], version, __ATOMIC_SEQ_CST);
}

bool UcxSubscriber::BeginServing(UcxVersion& v, const Pieces& pc, RelayServe& serve) {
  if (!v.relay_ || !relay_desc_) return false;
  if (session_->bytes_over_control || v.chunk_bytes_ == 0) {
    CloseRelay(v.manifest_.version);
    return false;
  }
  for (size_t i = 0; i < pc.sizes.size(); ++i) {
    if (v.manifest_.tensors[i].nbytes > 0 && pc.sizes[i] == 0) {  // not all here
      CloseRelay(v.manifest_.version);
      return false;
    }
  }
  // The relay's memory by slot offset: runs contiguous in the slot and in the targets.
  VersionLayout layout;
  layout.version = v.manifest_.version;
  layout.chunk_bytes = v.chunk_bytes_;
  layout.pid = static_cast<uint64_t>(getpid());
  std::vector<size_t> order;
  for (size_t i = 0; i < pc.sizes.size(); ++i) {
    if (pc.sizes[i] > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return pc.offsets[a] < pc.offsets[b]; });
  for (size_t i : order) {
    if (!layout.regions.empty()) {
      LayoutRegion& last = layout.regions.back();
      if (last.base + last.length == pc.offsets[i] &&
          last.address + last.length == reinterpret_cast<uintptr_t>(pc.targets[i])) {
        last.length += pc.sizes[i];
        continue;
      }
    }
    layout.regions.push_back(LayoutRegion{0, pc.offsets[i],
                                          reinterpret_cast<uintptr_t>(pc.targets[i]), pc.sizes[i],
                                          "", kCrossMemoryAttach});
  }
  // Remote keys for children on other hosts (one-sided reads of registered memory).
  for (LayoutRegion& r : layout.regions) {
    absl::StatusOr<RegistrationCache::Served> served =
        relay_regs_->Serve(reinterpret_cast<std::byte*>(r.address), r.length);
    if (!served.ok()) {
      CloseRelay(v.manifest_.version);
      return false;
    }
    r.id = served->id;
    r.rkey = *served->rkey;
  }
  const std::string encoded = EncodeLayout(layout);
  const uint64_t layout_offset = kRelayReadyOffset + 8 * v.nchunks_;
  if (layout_offset + encoded.size() > relay_desc_->size()) {
    // Larger next time (a new descriptor, offered again); this version goes unserved.
    CloseRelay(v.manifest_.version);
    (void)OfferRelay(absl::Now() + absl::Seconds(1), layout_offset + encoded.size());
    return false;
  }
  serve.desc = relay_desc_->data();
  serve.version = v.manifest_.version;
  serve.chunk_bytes = v.chunk_bytes_;
  serve.left.assign(v.nchunks_, 0);
  std::memcpy(serve.desc + layout_offset, encoded.data(), encoded.size());
  // Stale readiness words and child slots hold older versions: nothing to clear.
  DescriptorHeader h;
  h.magic = kRelayMagic;
  h.version = 0;  // written last
  h.state = static_cast<uint64_t>(RelayState::kReceiving);
  h.nchunks = v.nchunks_;
  h.layout_offset = layout_offset;
  h.layout_bytes = encoded.size();
  const std::string header = EncodeHeader(h);
  std::memcpy(serve.desc, header.data(), header.size());
  __atomic_store_n(serve.word(8), serve.version, __ATOMIC_SEQ_CST);
  return true;
}

void UcxSubscriber::FinishServing(RelayServe& serve, bool ok, absl::Time deadline) {
  // Children still reading this version: each until it is done, or its heartbeat stopped for
  // relay_stall (a child stopped or gone: it reads the rest from the publisher), or the
  // deadline.
  auto wait_for_readers = [&] {
    std::map<uint64_t, std::pair<uint64_t, absl::Time>> seen;  // slot -> heartbeat, since
    while (absl::Now() < deadline) {
      const std::vector<std::pair<uint64_t, uint64_t>> readers = serve.Readers();
      const absl::Time now = absl::Now();
      bool waiting = false;
      for (const auto& [slot, beat] : readers) {
        auto [it, fresh] = seen.try_emplace(slot, beat, now);
        if (fresh || it->second.first != beat) {
          it->second = {beat, now};
        } else if (now - it->second.second > options_.relay_stall) {
          continue;  // stopped reading: not waited for
        }
        waiting = true;
      }
      if (!waiting) return;
      absl::SleepFor(absl::Microseconds(100));
    }
  };
  if (ok) {
    serve.SetState(RelayState::kComplete);
    wait_for_readers();
  }
  serve.SetState(RelayState::kClosing);  // seq_cst: ordered before reading the child slots
  if (ok) wait_for_readers();
  serve.SetState(RelayState::kClosed);
}

RelayPeer* UcxSubscriber::PeerFor(const RelaySource& src) {
  auto it = relay_peers_.find(src.worker_address);
  if (it != relay_peers_.end() && it->second->ep_status == UCS_OK) return it->second.get();
  if (it != relay_peers_.end()) {  // its endpoint failed: a new one
    ClosePeer(*it->second);
    relay_peers_.erase(it);
  }
  while (relay_peers_.size() >= 8) {
    ClosePeer(*relay_peers_.begin()->second);
    relay_peers_.erase(relay_peers_.begin());
  }
  auto peer = std::make_unique<RelayPeer>();
  peer->serial = ++relay_peer_serial_;
  for (const bool peer_mode : {true, false}) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.address = reinterpret_cast<const ucp_address_t*>(src.worker_address.data());
    params.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer_mode) {
      params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.err_handler.cb = &OnRelayEndpointError;
      params.err_handler.arg = peer.get();
    }
    std::optional<QuietUcxErrors> quiet;
    if (peer_mode) quiet.emplace();
    if (ucp_ep_create(worker_->get(), &params, &peer->ep) == UCS_OK) {
      peer->peer_errors = peer_mode;
      RelayPeer* raw = peer.get();
      relay_peers_[src.worker_address] = std::move(peer);
      return raw;
    }
    peer->ep = nullptr;
  }
  return nullptr;
}

void UcxSubscriber::ClosePeer(RelayPeer& p) {
  p.desc_rkey.reset();
  p.rkeys.clear();
  if (p.ep == nullptr) return;
  ucp_request_param_t close{};
  close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  close.flags = p.peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  (void)WaitRequest(worker_->get(), ucp_ep_close_nbx(p.ep, &close), absl::Now() + absl::Seconds(1));
  p.ep = nullptr;
}

absl::Status UcxSubscriber::PeerIo(const RelaySource& src, bool put, uint64_t remote, void* buf,
                                   size_t len, absl::Time deadline, ucp_rkey_h rkey,
                                   uint64_t serial) {
  RelayPeer* p = nullptr;
  if (serial == 0) {
    p = PeerFor(src);
  } else if (auto it = relay_peers_.find(src.worker_address); it != relay_peers_.end() &&
                                                              it->second->serial == serial &&
                                                              it->second->ep_status == UCS_OK) {
    p = it->second.get();
  }
  if (p == nullptr) return absl::UnavailableError("no UCX endpoint reaches the relay");
  if (!p->desc_rkey || p->desc_address != src.address) {
    absl::StatusOr<std::unique_ptr<RemoteKey>> key =
        RemoteKey::Unpack(p->ep, src.rkey, "a relay's descriptor");
    if (!key.ok()) return key.status();
    p->desc_rkey = *std::move(key);
    p->desc_address = src.address;
  }
  PendingGet op;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OnPendingGetDone;
  param.user_data = &op;
  ++op.inflight;
  if (rkey == nullptr) rkey = p->desc_rkey->get();
  ucs_status_ptr_t req = put ? ucp_put_nbx(p->ep, buf, len, remote, rkey, &param)
                             : ucp_get_nbx(p->ep, buf, len, remote, rkey, &param);
  if (req == nullptr) {
    --op.inflight;
  } else if (UCS_PTR_IS_ERR(req)) {
    --op.inflight;
    op.status = UCS_PTR_STATUS(req);
  }
  if (put && op.inflight == 0 && op.status == UCS_OK) {
    // Completed locally; flushed so that it is visible before this subscriber's next read.
    ucp_request_param_t flush{};
    op.status = WaitRequest(worker_->get(), ucp_ep_flush_nbx(p->ep, &flush), deadline);
  }
  while (op.inflight > 0) {
    if (ucp_worker_progress(worker_->get()) != 0) continue;
    if (p->ep_status != UCS_OK || absl::Now() > deadline) {
      // Gone or stopped: forget it, after its outstanding operation is done (force-closed).
      ClosePeer(*p);
      while (op.inflight > 0) {
        if (ucp_worker_progress(worker_->get()) == 0) absl::SleepFor(absl::Microseconds(50));
      }
      relay_peers_.erase(src.worker_address);
      return absl::UnavailableError("the relay did not answer");
    }
  }
  if (op.status != UCS_OK) return UcsError(op.status, "reading a relay's descriptor");
  return absl::OkStatus();
}

bool UcxSubscriber::PollRelay(UcxVersion& v, RelayLink& link, uint64_t from, absl::Time deadline) {
  const RelaySource& src = link.source;
  char header[kDescriptorHeaderBytes];
  const absl::Time until = std::min(deadline, absl::Now() + options_.relay_stall);
  absl::Status s =
      PeerIo(src, false, src.address, header, sizeof(header), until, nullptr, link.peer_serial);
  absl::StatusOr<DescriptorHeader> h =
      s.ok() ? DecodeHeader(std::string_view(header, sizeof(header)), kRelayMagic)
             : absl::StatusOr<DescriptorHeader>(s);
  if (!h.ok() || h->version != link.version ||
      h->state >= static_cast<uint64_t>(RelayState::kClosing) || h->nchunks != link.ready.size()) {
    link.dead = true;
    link.unreachable = !s.ok();
    link.why = !h.ok()                      ? std::string(h.status().message())
               : h->version != link.version ? "it moved on to another version"
                                            : "it closed";
    return false;
  }
  const uint64_t to = std::min<uint64_t>(link.ready.size(), from + 512);
  if (to > from) {
    std::vector<uint64_t> words(to - from);
    s = PeerIo(src, false, src.address + kRelayReadyOffset + 8 * from, words.data(),
               8 * words.size(), until, nullptr, link.peer_serial);
    if (!s.ok()) {
      link.dead = true;
      link.unreachable = true;
      link.why = std::string(s.message());
      return false;
    }
    for (uint64_t c = from; c < to; ++c) {
      if (!link.ready[c] && words[c - from] == link.version) {
        link.ready[c] = true;
        link.progress = absl::Now();
      }
    }
  }
  return true;
}

std::optional<RelayLink> UcxSubscriber::OpenRelay(UcxVersion& v, absl::Time deadline) {
  if (!v.relay_source_ || session_->bytes_over_control || v.nchunks_ == 0) return std::nullopt;
  RelayLink link;
  link.source = *v.relay_source_;
  link.version = v.manifest_.version;
  if (link.source.child >= kMaxRelayChildren) return std::nullopt;
  const uint64_t slot = link.source.address + RelayChildOffset(link.source.child);
  // Attach first, then look: a relay that was not closing when we looked waits for us.
  uint64_t attach = link.version;
  const absl::Time until = std::min(deadline, absl::Now() + options_.relay_stall);
  if (!PeerIo(link.source, true, slot, &attach, 8, until).ok()) return std::nullopt;
  if (!failpoints_.Hit("ucx.relay_attached").ok()) {
    LeaveRelay(link, until);
    return std::nullopt;
  }
  link.ready.assign(v.nchunks_, false);
  link.progress = absl::Now();
  absl::Duration backoff = absl::Microseconds(50);
  DescriptorHeader h;
  while (true) {
    char header[kDescriptorHeaderBytes];
    if (!PeerIo(link.source, false, link.source.address, header, sizeof(header), until).ok()) {
      return std::nullopt;
    }
    absl::StatusOr<DescriptorHeader> got =
        DecodeHeader(std::string_view(header, sizeof(header)), kRelayMagic);
    if (!got.ok()) {
      LeaveRelay(link, until);
      return std::nullopt;
    }
    h = *got;
    if (h.version == link.version) break;
    if (absl::Now() + backoff > until) {
      LeaveRelay(link, until);
      return std::nullopt;  // it has not begun receiving the version: the publisher serves it
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(5));
  }
  // The header is another process's memory: its size is checked before anything is allocated.
  const bool sane = h.state < static_cast<uint64_t>(RelayState::kClosing) &&
                    h.nchunks == v.nchunks_ && h.layout_bytes <= (uint64_t{64} << 20);
  std::string encoded(sane ? h.layout_bytes : 0, '\0');
  absl::StatusOr<VersionLayout> layout = absl::DataLossError("no layout");
  if (sane && PeerIo(link.source, false, link.source.address + h.layout_offset, encoded.data(),
                     encoded.size(), until)
                  .ok()) {
    layout = DecodeLayout(encoded);
  }
  if (!layout.ok() || layout->version != link.version) {
    LeaveRelay(link, until);
    return std::nullopt;
  }
  link.regions = std::move(layout->regions);
  for (size_t k = 1; k < link.regions.size(); ++k) {
    if (link.regions[k].base < link.regions[k - 1].base + link.regions[k - 1].length) {
      LeaveRelay(link, until);
      return std::nullopt;  // overlapping: not a layout a relay writes
    }
  }
  link.peer = PeerFor(link.source);
  if (link.peer == nullptr) return std::nullopt;
  link.peer_serial = link.peer->serial;
  // Its memory: with process_vm_readv on this host when that works (a probe of its descriptor
  // header), else one-sided gets with its keys.
  if (!link.peer->attach) {
    char probe[kDescriptorHeaderBytes];
    iovec local{probe, sizeof(probe)};
    iovec remote{reinterpret_cast<void*>(link.source.address), sizeof(probe)};
    link.peer->attach = session_->local && link.source.pid > 0 &&
                        link.source.pid <= static_cast<uint64_t>(INT32_MAX) &&
                        ::process_vm_readv(static_cast<pid_t>(link.source.pid), &local, 1, &remote,
                                           1, 0) == static_cast<ssize_t>(sizeof(probe)) &&
                        DecodeHeader(std::string_view(probe, sizeof(probe)), kRelayMagic).ok();
  }
  link.attach = *link.peer->attach;
  if (!link.attach) {
    for (const LayoutRegion& r : link.regions) {
      auto it = link.peer->rkeys.find(r.id);
      if (it == link.peer->rkeys.end()) {
        absl::StatusOr<std::unique_ptr<RemoteKey>> key =
            RemoteKey::Unpack(link.peer->ep, r.rkey, "a relay's receive buffer");
        if (!key.ok()) {
          LeaveRelay(link, until);
          return std::nullopt;
        }
        it = link.peer->rkeys.emplace(r.id, *std::move(key)).first;
      }
      link.rkeys.push_back(it->second->get());
    }
  }
  return link;
}

void UcxSubscriber::LeaveRelay(RelayLink& link, absl::Time deadline) {
  uint64_t done = link.version;
  (void)PeerIo(link.source, true, link.source.address + RelayChildOffset(link.source.child) + 8,
               &done, 8, std::min(deadline, absl::Now() + options_.relay_stall));
}

bool UcxSubscriber::CanAttach(const UcxVersion& v) {
  Session& s = *session_;
  if (s.attach && s.attach_pid == v.pid_) return *s.attach;
  s.attach_pid = v.pid_;
  s.attach = false;
  if (!s.local || v.pid_ == 0 || v.pid_ > static_cast<uint64_t>(INT32_MAX)) return false;
  // The publisher's pid as it sees it names the same process here only in the same pid
  // namespace: a probe read of the version's descriptor header must give what UCX gave.
  char probe[kDescriptorHeaderBytes];
  iovec local{probe, sizeof(probe)};
  iovec remote{reinterpret_cast<void*>(v.descriptor_.address), sizeof(probe)};
  const ssize_t n = ::process_vm_readv(static_cast<pid_t>(v.pid_), &local, 1, &remote, 1, 0);
  const int err = errno;
  absl::StatusOr<DescriptorHeader> h =
      n == static_cast<ssize_t>(sizeof(probe))
          ? DecodeHeader(std::string_view(probe, sizeof(probe)))
          : absl::StatusOr<DescriptorHeader>(absl::UnavailableError(strerror(err)));
  s.attach = h.ok() && h->version == v.manifest_.version;
  if (!*s.attach) {
    Log(LogLevel::kWarn,
        "%s: cannot read the memory of %s (pid %d) with process_vm_readv (%s): its zero-copy "
        "regions are read with UCX's software-emulated gets, through its progress thread "
        "(slow; allow ptrace between the processes, e.g. the same user and no Yama restriction)",
        endpoint_.display, s.publisher, v.pid_,
        h.ok() ? "another process with that pid" : std::string(h.status().message()));
  }
  return *s.attach;
}

absl::StatusOr<std::string> UcxSubscriber::ReadDescriptor(uint64_t lease,
                                                          const GrantRegion& descriptor,
                                                          uint64_t offset, uint64_t length,
                                                          absl::Time deadline) {
  uint64_t end = 0;
  if (__builtin_add_overflow(offset, length, &end) || end > descriptor.length) {
    return absl::DataLossError(
        absl::StrFormat("version descriptor bytes [%d, +%d) lie outside its region of %d bytes",
                        offset, length, descriptor.length));
  }
  // The publisher's header sizes what is read: bounded before it is allocated (as the prefix).
  constexpr uint64_t kMaxRead = uint64_t{1} << 30;
  if (length > kMaxRead) {
    return absl::DataLossError(
        absl::StrFormat("a version descriptor read of %d bytes at offset %d (at most %d)", length,
                        offset, kMaxRead));
  }
  std::string out(length, '\0');
  descriptor_bytes_ += length;
  if (length == 0) return out;
  Session& s = *session_;
  if (s.bytes_over_control) {
    // READs of at most 16 MiB (a DATA frame is held whole on both sides).
    constexpr uint64_t kPiece = uint64_t{16} << 20;
    for (uint64_t at = 0; at < length; at += kPiece) {
      const uint64_t n = std::min(kPiece, length - at);
      const uint64_t request = next_request_++;
      absl::Status sent = s.control.Send(
          Encode(ReadMsg{request, lease, descriptor.base + offset + at, n}), deadline);
      if (!sent.ok()) return sent;
      WB_ASSIGN_OR_RETURN(Frame f, Await(deadline, [&](const Frame& f) {
                            return f.type == MsgType::kData && LeadingId(f.payload) == request;
                          }));
      WB_ASSIGN_OR_RETURN(DataMsg data, DecodeData(f.payload));
      if (auto aborted = aborted_.find(lease); !data.ok && aborted != aborted_.end()) {
        return aborted->second;  // the lease ended with ABORTED before this READ was answered
      }
      if (!data.ok || data.bytes.size() != n) {
        return absl::UnavailableError(
            absl::StrFormat("%s could not serve the version descriptor: %s", s.publisher,
                            data.ok ? absl::StrFormat("%d bytes for %d", data.bytes.size(), n)
                                    : std::string(data.bytes)));
      }
      std::memcpy(out.data() + at, data.bytes.data(), n);
    }
    return out;
  }
  WB_ASSIGN_OR_RETURN(ucp_rkey_h rkey,
                      RkeyOf(descriptor.id, descriptor.rkey,
                             absl::StrFormat("the version descriptor (region %d) of %s",
                                             descriptor.id, s.publisher)));
  PendingGet get;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OnPendingGetDone;
  param.user_data = &get;
  ++get.inflight;
  ucs_status_ptr_t req =
      ucp_get_nbx(s.ep, out.data(), length, descriptor.address + offset, rkey, &param);
  if (req == nullptr) {
    --get.inflight;
  } else if (UCS_PTR_IS_ERR(req)) {
    --get.inflight;
    get.status = UCS_PTR_STATUS(req);
  }
  while (get.inflight > 0) {
    if (ucp_worker_progress(worker_->get()) != 0) continue;
    if (s.ep_status != UCS_OK || absl::Now() > deadline) {
      const bool late = s.ep_status == UCS_OK;
      AbandonGets(&get.inflight);
      if (late) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "reading the version descriptor from %s did not finish by the deadline", s.publisher));
      }
      return absl::UnavailableError("the UCX endpoint to the publisher failed");
    }
  }
  if (get.status != UCS_OK) {
    return UcsError(get.status,
                    absl::StrFormat("reading the version descriptor from %s", s.publisher));
  }
  return out;
}

absl::Status UcxSubscriber::AbortedStatus(const UcxVersion& v) const {
  auto it = aborted_.find(v.lease_id_);
  return it == aborted_.end() ? absl::OkStatus() : it->second;
}

absl::Status UcxSubscriber::ReadSeal(UcxVersion& v, const DescriptorHeader& header,
                                     absl::Time deadline) {
  WB_ASSIGN_OR_RETURN(
      std::string bytes,
      ReadDescriptor(v.lease_id_, v.descriptor_, header.seal_offset, header.seal_bytes, deadline));
  absl::StatusOr<VersionSeal> seal = DecodeSeal(bytes);
  absl::StatusOr<Manifest> sealed =
      seal.ok() ? ApplySeal(v.manifest_, *seal) : absl::StatusOr<Manifest>(seal.status());
  if (!sealed.ok()) {
    return absl::DataLossError(absl::StrFormat("%s sealed version %d with a %s", v.source_,
                                               v.manifest_.version, sealed.status().message()));
  }
  v.manifest_ = *std::move(sealed);
  v.sealed_ = true;
  v.ready_.assign(v.nchunks_, true);
  v.ready_count_ = v.nchunks_;
  return absl::OkStatus();
}

absl::Status UcxSubscriber::ServiceControl(UcxVersion& v, std::optional<absl::Time>& renew_sent,
                                           absl::Time deadline) {
  Session& s = *session_;
  const uint64_t version = v.manifest_.version;
  while (true) {
    absl::StatusOr<std::optional<Frame>> f = s.control.Poll();
    if (!f.ok()) {
      return absl::UnavailableError(
          absl::StrFormat("%s while version %d was being received", f.status().message(), version));
    }
    if (!f->has_value()) break;
    const Frame& frame = **f;
    if (frame.type == MsgType::kRenewed) {
      absl::StatusOr<RenewedMsg> renewed = DecodeRenewed(frame.payload);
      if (!renewed.ok()) {
        return absl::DataLossError(
            absl::StrFormat("%s sent a %s while version %d was being received", s.publisher,
                            renewed.status().message(), version));
      }
      if (renewed->lease == v.lease_id_ && renew_sent) {
        if (!renewed->valid) {
          WB_RETURN_IF_ERROR(AbortedStatus(v));
          return absl::UnavailableError(absl::StrFormat(
              "the hold on version %d expired before the transfer finished (lease %s); %s may "
              "have reused its memory, so the bytes are not trusted",
              version, absl::FormatDuration(s.lease), s.publisher));
        }
        v.lease_base_ = *renew_sent;
        renew_sent.reset();
      }
      continue;
    }
    if (frame.type == MsgType::kError) {
      return absl::UnavailableError(
          absl::StrFormat("%s ended the session while version %d was being received: %s",
                          s.publisher, version, ErrorStatus(frame.payload, "").message()));
    }
    const std::string publisher_name = s.publisher;
    HandleStray(frame);  // ABORTED is recorded there
    if (!session_) {
      return absl::UnavailableError(
          absl::StrFormat("the session with %s ended while version %d was being received",
                          publisher_name, version));
    }
    WB_RETURN_IF_ERROR(AbortedStatus(v));
  }
  const absl::Time mono = MonotonicNow();
  if (!renew_sent && mono - v.lease_base_ > s.lease / 4) {
    WB_RETURN_IF_ERROR(
        s.control.Send(Encode(RenewMsg{v.lease_id_}), std::min(deadline, absl::Now() + s.lease)));
    renew_sent = mono;
  }
  return absl::OkStatus();
}

absl::Status UcxSubscriber::AwaitSeal(UcxVersion& v, absl::Time deadline) {
  const uint64_t version = v.manifest_.version;
  absl::Duration backoff = absl::Microseconds(20);
  std::optional<absl::Time> renew_sent;
  while (true) {
    WB_RETURN_IF_ERROR(AbortedStatus(v));
    WB_ASSIGN_OR_RETURN(std::string bytes, ReadDescriptor(v.lease_id_, v.descriptor_, 0,
                                                          kDescriptorHeaderBytes, deadline));
    absl::StatusOr<DescriptorHeader> h = DecodeHeader(bytes);
    if (!h.ok()) {
      return absl::DataLossError(absl::StrFormat("%s: the descriptor of version %d: %s", v.source_,
                                                 version, h.status().message()));
    }
    if (h->version != version || h->state == static_cast<uint64_t>(VersionState::kAborted)) {
      WB_RETURN_IF_ERROR(ServiceControl(v, renew_sent, deadline));  // its ABORTED, if in
      return absl::AbortedError(absl::StrFormat(
          "%s gave up publishing version %d before sealing it (its Publish failed); nothing of "
          "it may be used",
          v.source_, version));
    }
    if (h->state == static_cast<uint64_t>(VersionState::kSealed)) {
      return ReadSeal(v, *h, deadline);
    }
    if (backoff == absl::Microseconds(20)) {
      // Fault injection: every byte asked for is in (or not needed), the seal is not.
      WB_RETURN_IF_ERROR(failpoints_.Hit("ucx.seal_wait"));
    }
    WB_RETURN_IF_ERROR(ServiceControl(v, renew_sent, deadline));
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "version %d was announced by %s but not sealed by the deadline (its publisher is still "
          "staging or checksumming it)",
          version, v.source_));
    }
    if (cancelled_.load()) return CancelledStatus();
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(1));
  }
}

absl::StatusOr<std::unique_ptr<IncomingVersion>> UcxSubscriber::OpenGrant(const Frame& f,
                                                                          absl::Time asked,
                                                                          absl::Time deadline) {
  const std::string source = session_->publisher;
  absl::StatusOr<GrantMsg> grant = DecodeGrant(f.payload);
  if (!grant.ok()) {
    // Its lease id, when the message has one, is released.
    if (f.payload.size() >= 16) {
      (void)session_->control.Send(
          Encode(ReleaseMsg{LoadLe<uint64_t>(f.payload.data() + 8), false}),
          absl::Now() + absl::Seconds(1));
    }
    return absl::DataLossError(
        absl::StrFormat("%s: %s sent a %s", endpoint_.display, source, grant.status().message()));
  }
  const uint64_t lease = grant->lease;
  const uint64_t version = grant->version;
  const GrantRegion& d = grant->descriptor;
  session_->lease = absl::Nanoseconds(static_cast<int64_t>(grant->lease_ns));
  auto release = [&] {
    if (session_) {
      (void)session_->control.Send(Encode(ReleaseMsg{lease, false}),
                                   absl::Now() + absl::Seconds(1));
    }
    aborted_.erase(lease);
  };
  auto malformed = [&](const std::string& why) {
    release();
    return absl::DataLossError(absl::StrFormat("%s: %s sent a malformed grant of version %d: %s",
                                               endpoint_.display, source, version, why));
  };
  // Failures of reading what the grant points at: the lease goes back (a broken or abandoned
  // connection is closed, the next call reconnects).
  auto failed = [&](const absl::Status& why) {
    if (!session_ || absl::IsUnavailable(why) || absl::IsDeadlineExceeded(why)) {
      const absl::Status s = SessionLost(why, absl::StrFormat("while opening version %d", version));
      aborted_.erase(lease);
      return s;
    }
    release();
    return absl::Status(why.code(), absl::StrFormat("%s: %s", endpoint_.display, why.message()));
  };
  uint64_t end = 0;
  constexpr uint64_t kMaxPrefix = uint64_t{1} << 30;
  if (d.length < kDescriptorHeaderBytes || grant->prefix < kDescriptorHeaderBytes ||
      grant->prefix > d.length || grant->prefix > kMaxPrefix ||
      __builtin_add_overflow(d.address, d.length, &end)) {
    return malformed(absl::StrFormat("a version descriptor of %d bytes at 0x%x with a prefix of %d",
                                     d.length, d.address, grant->prefix));
  }
  absl::StatusOr<std::string> prefix = ReadDescriptor(lease, d, 0, grant->prefix, deadline);
  if (!prefix.ok()) return failed(prefix.status());
  absl::StatusOr<DescriptorHeader> header =
      DecodeHeader(std::string_view(*prefix).substr(0, kDescriptorHeaderBytes));
  if (!header.ok()) return malformed(std::string(header.status().message()));
  const DescriptorHeader& h = *header;
  uint64_t layout_end = 0;
  if (h.version != version || h.nchunks > (h.layout_offset - kDescriptorHeaderBytes) / 8 ||
      h.layout_offset < kDescriptorHeaderBytes ||
      __builtin_add_overflow(h.layout_offset, h.layout_bytes, &layout_end) ||
      layout_end > prefix->size()) {
    return malformed(absl::StrFormat(
        "its descriptor describes version %d with %d chunks and a layout at [%d, +%d) of a "
        "%d-byte prefix",
        h.version, h.nchunks, h.layout_offset, h.layout_bytes, prefix->size()));
  }
  absl::StatusOr<VersionLayout> layout =
      DecodeLayout(std::string_view(*prefix).substr(h.layout_offset, h.layout_bytes));
  if (!layout.ok()) return malformed(std::string(layout.status().message()));
  absl::StatusOr<Manifest> manifest = Manifest::FromJson(
      layout->manifest_json, absl::StrFormat("the manifest granted by %s", source));
  if (!manifest.ok()) return malformed(std::string(manifest.status().message()));
  std::vector<uint64_t>& offsets = layout->offsets;
  if (layout->version != version || manifest->version != version ||
      manifest->tensors.size() != offsets.size()) {
    return malformed(absl::StrFormat(
        "layout of version %d, manifest of version %d with %d "
        "tensors for %d offsets",
        layout->version, manifest->version, manifest->tensors.size(), offsets.size()));
  }
  // Every sum below is checked for wrapping around 64 bits: a region or tensor whose end
  // overflows would pass a plain comparison.
  uint64_t covered = 0;
  for (const LayoutRegion& g : layout->regions) {
    if (g.base != covered || g.length == 0) return malformed("regions do not tile the slot");
    uint64_t region_end = 0;
    if (__builtin_add_overflow(covered, g.length, &covered) ||
        __builtin_add_overflow(g.address, g.length, &region_end)) {
      return malformed(
          absl::StrFormat("region %d (base %d, address 0x%x, %d bytes) ends beyond 2^64", g.id,
                          g.base, g.address, g.length));
    }
  }
  // A group version (granted by rank 0) says where each rank serves its parts; rank 0's own
  // lie in this slot, every other rank's in that rank's.
  std::vector<GroupMember>& members = layout->members;
  const bool group = !members.empty();
  if (group && (!manifest->group || manifest->publisher.world_size < 2 ||
                members.size() != static_cast<size_t>(manifest->publisher.world_size))) {
    return malformed(absl::StrFormat("%d group members for a manifest of world_size %d%s",
                                     members.size(), manifest->publisher.world_size,
                                     manifest->group ? "" : " (not a group version)"));
  }
  const uint64_t chunk = layout->chunk_bytes;
  for (size_t i = 0; i < offsets.size(); ++i) {
    const uint64_t n = manifest->tensors[i].nbytes;
    if (group && manifest->tensors[i].owner != 0) continue;
    if (n > 0 && (offsets[i] > covered || n > covered - offsets[i] ||
                  (offsets[i] + n - 1) / chunk >= h.nchunks)) {
      return malformed(absl::StrFormat("tensor \"%s\" lies outside the slot or its chunks",
                                       manifest->tensors[i].name));
    }
  }
  // Forget remote keys of regions the publisher has freed (a mapped segment stays mapped until
  // its key is destroyed).
  const std::vector<uint64_t>& live = layout->live;
  std::erase_if(session_->rkeys, [&](const auto& kv) {
    return std::find(live.begin(), live.end(), kv.first) == live.end();
  });
  auto v =
      std::make_unique<UcxVersion>(this, session_->generation, lease, *std::move(manifest),
                                   std::move(layout->regions), std::move(offsets), source, asked);
  v->descriptor_ = d;
  v->pid_ = layout->pid;
  v->relay_ = grant->relay;
  v->relay_source_ = grant->source;
  v->chunk_bytes_ = chunk;
  v->nchunks_ = h.nchunks;
  v->ready_.assign(h.nchunks, false);
  for (uint64_t k = 0; k < h.nchunks; ++k) {
    if (LoadLe<uint64_t>(prefix->data() + ReadyOffset(k)) == version) {
      v->ready_[k] = true;
      ++v->ready_count_;
    }
  }
  absl::Status opened;
  if (h.state == static_cast<uint64_t>(VersionState::kSealed)) {
    opened = ReadSeal(*v, h, deadline);
  } else if (h.state == static_cast<uint64_t>(VersionState::kAborted)) {
    opened = absl::AbortedError(absl::StrFormat(
        "%s gave up publishing version %d before sealing it; nothing of it may be used", source,
        version));
  } else if (h.state != static_cast<uint64_t>(VersionState::kStaging)) {
    return malformed(absl::StrFormat("its descriptor is in state %d", h.state));
  } else if (group || !accept_unsealed_.load()) {
    // The caller checks manifests before any byte moves (a layer, placements): the version is
    // handed over once sealed.
    opened = AwaitSeal(*v, deadline);
  }
  if (!opened.ok()) {
    v->released_ = true;  // released below, or its session is gone
    return failed(opened);
  }
  if (!group) return std::unique_ptr<IncomingVersion>(std::move(v));
  v->members_ = std::move(members);
  return std::unique_ptr<IncomingVersion>(new GroupVersion(this, std::move(v)));
}

absl::StatusOr<std::vector<uint64_t>> UcxSubscriber::ListVersions() {
  absl::MutexLock lock(&mu_);
  if (cancelled_.load()) return CancelledStatus();
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  WB_RETURN_IF_ERROR(EnsureSession(deadline));
  const uint64_t request = next_request_++;
  absl::Status sent = session_->control.Send(Encode(ListMsg{request}), deadline);
  if (!sent.ok()) return SessionLost(sent, "while listing versions");
  absl::StatusOr<Frame> f = Await(deadline, [&](const Frame& f) {
    return f.type == MsgType::kVersions && LeadingId(f.payload) == request;
  });
  if (!f.ok()) return SessionLost(f.status(), "while listing versions");
  absl::StatusOr<VersionsMsg> versions = DecodeVersions(f->payload);
  if (!versions.ok()) {
    return absl::DataLossError(absl::StrFormat("%s: %s sent a %s", endpoint_.display,
                                               session_->publisher, versions.status().message()));
  }
  return std::move(versions->versions);
}

absl::Status UcxSubscriber::RequestKeyframe(uint64_t version, std::optional<uint64_t> holds,
                                            std::string_view why) {
  absl::MutexLock lock(&mu_);
  if (cancelled_.load()) return CancelledStatus();
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  WB_RETURN_IF_ERROR(EnsureSession(deadline));
  const uint64_t request = next_request_++;
  absl::Status sent = session_->control.Send(
      Encode(KeyframeRequestMsg{version, holds.has_value(), holds.value_or(0), std::string(why)}) +
          Encode(ListMsg{request}),
      deadline);
  if (!sent.ok()) return SessionLost(sent, "while asking for a keyframe");
  absl::StatusOr<Frame> f = Await(deadline, [&](const Frame& f) {
    return f.type == MsgType::kVersions && LeadingId(f.payload) == request;
  });
  if (!f.ok()) return SessionLost(f.status(), "while asking for a keyframe");
  return absl::OkStatus();
}

absl::Status UcxSubscriber::Report(uint64_t version, std::string_view text) {
  if (text.size() > kMaxReport) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: a report of %d bytes (at most %d)",
                                                      endpoint_.display, text.size(), kMaxReport));
  }
  absl::MutexLock lock(&mu_);
  if (cancelled_.load()) return CancelledStatus();
  if (!session_) {
    return absl::UnavailableError(
        absl::StrFormat("%s: no connection to the publisher to report on", endpoint_.display));
  }
  absl::Status sent = session_->control.Send(Encode(ReportMsg{version, std::string(text)}),
                                             absl::Now() + absl::Seconds(1));
  if (!sent.ok()) return SessionLost(sent, "while reporting");
  return absl::OkStatus();
}

absl::Status UcxSubscriber::Fetch(UcxVersion& v, absl::Span<std::byte* const> targets,
                                  LandingSink& sink, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (v.released_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: version %d was already fetched or released", endpoint_.display, v.manifest_.version));
  }
  if (!session_ || session_->generation != v.generation_) {
    v.released_ = true;
    return absl::UnavailableError(absl::StrFormat(
        "the connection to %s ended after version %d was granted (its hold on the version went "
        "with it)",
        v.source_, v.manifest_.version));
  }
  if (absl::Status aborted = AbortedStatus(v); !aborted.ok()) {
    v.released_ = true;
    aborted_.erase(v.lease_id_);
    return aborted;
  }
  const Manifest& m = v.manifest_;
  const size_t n = m.tensors.size();
  if (targets.size() != n) {
    return absl::InternalError(absl::StrFormat("%d targets for %d tensors", targets.size(), n));
  }
  // One piece per tensor; one without a target is not wanted (a group version's replica read
  // from another rank, or another rank's part).
  Pieces pieces{v.offsets_, std::vector<uint64_t>(n, 0), {targets.begin(), targets.end()}, {}};
  pieces.tensor.resize(n);
  for (size_t i = 0; i < n; ++i) {
    pieces.tensor[i] = i;
    if (targets[i] != nullptr) pieces.sizes[i] = m.tensors[i].nbytes;
  }
  for (size_t i = 0; i < n; ++i) {
    if (m.tensors[i].nbytes == 0) sink.Landed(i);
  }
  // Fan-out: serve the version to other subscribers while receiving it (when granted so), and
  // read it from a relay first (when granted one). A relay hands its own version over once its
  // children have read it (or stopped).
  RelayServe serve;
  const bool serving = BeginServing(v, pieces, serve);
  std::optional<RelayLink> link = OpenRelay(v, deadline);
  v.serve_ = serving ? &serve : nullptr;
  v.link_ = link ? &*link : nullptr;
  absl::Status fetched = FetchPieces(v, pieces, sink, deadline);
  v.serve_ = nullptr;
  v.link_ = nullptr;
  if (link && !link->unreachable) LeaveRelay(*link, deadline);
  if (serving) FinishServing(serve, fetched.ok(), deadline);
  return fetched;
}

absl::Status UcxSubscriber::FetchPieces(UcxVersion& v, const Pieces& pieces, LandingSink& sink,
                                        absl::Time deadline) {
  WB_RETURN_IF_ERROR(PullPieces(v, pieces, sink, deadline));
  if (!v.sealed_) {
    // Pipelined: every byte is here; the version counts once its publisher sealed it.
    absl::Status sealed = AwaitSeal(v, deadline);
    if (!sealed.ok()) {
      v.released_ = true;
      aborted_.erase(v.lease_id_);
      if (!session_ || absl::IsUnavailable(sealed) || absl::IsDeadlineExceeded(sealed)) {
        CloseSession();
      } else {
        (void)session_->control.Send(Encode(ReleaseMsg{v.lease_id_, false}),
                                     absl::Now() + absl::Seconds(1));
      }
      return sealed;
    }
  }
  // Every byte is here. If the lease certainly held until now (see UcxVersion::lease_base_,
  // with a 5% margin for clock rates), release it without waiting. Otherwise release it and
  // learn from the publisher whether it held throughout: if it expired, the publisher may have
  // reused the memory while we read it.
  v.released_ = true;
  if (MonotonicNow() < v.lease_base_ + session_->lease * 0.95) {
    absl::Status sent = session_->control.Send(Encode(ReleaseMsg{v.lease_id_, false}), deadline);
    if (!sent.ok()) return SessionLost(sent, "after the transfer", true);
    return absl::OkStatus();
  }
  absl::Status sent = session_->control.Send(Encode(ReleaseMsg{v.lease_id_, true}), deadline);
  if (!sent.ok()) return SessionLost(sent, "before the transfer was confirmed", true);
  absl::StatusOr<Frame> f = Await(deadline, [&](const Frame& f) {
    return f.type == MsgType::kReleased && LeadingId(f.payload) == v.lease_id_;
  });
  if (!f.ok()) {
    return SessionLost(f.status(), "before the transfer was confirmed", true);
  }
  absl::StatusOr<ReleasedMsg> released = DecodeReleased(f->payload);
  if (!released.ok()) {
    return absl::DataLossError(
        absl::StrFormat("%s sent a %s; the bytes of version %d are not "
                        "trusted",
                        v.source_, released.status().message(), v.manifest_.version));
  }
  if (!released->valid) {
    WB_RETURN_IF_ERROR(AbortedStatus(v));
    return absl::UnavailableError(absl::StrFormat(
        "the hold on version %d expired before the transfer finished (lease %s); %s may have "
        "reused its memory, so the bytes are not trusted",
        v.manifest_.version, absl::FormatDuration(session_->lease), v.source_));
  }
  return absl::OkStatus();
}

absl::Status UcxSubscriber::PullPieces(UcxVersion& v, const Pieces& pieces, LandingSink& sink,
                                       absl::Time deadline) {
  uint64_t inflight = 0;
  absl::Status pulled = PullBytes(v, pieces, sink, deadline, &inflight);
  registrations_.EndFetch();
  if (pulled.ok()) return pulled;
  v.released_ = true;
  if (!session_ || absl::IsUnavailable(pulled) || absl::IsDeadlineExceeded(pulled)) {
    CloseSession();  // a broken or abandoned connection: the next call reconnects
  } else {
    (void)session_->control.Send(Encode(ReleaseMsg{v.lease_id_, false}),
                                 absl::Now() + absl::Seconds(1));
  }
  return pulled;
}

absl::Status UcxSubscriber::ConfirmLease(UcxVersion& v, absl::Time deadline) {
  if (MonotonicNow() < v.lease_base_ + session_->lease * 0.5) return absl::OkStatus();
  const absl::Time sent_at = MonotonicNow();
  absl::Status sent = session_->control.Send(Encode(RenewMsg{v.lease_id_}), deadline);
  if (!sent.ok()) return SessionLost(sent, "while renewing a lease", true);
  absl::StatusOr<Frame> f = Await(deadline, [&](const Frame& f) {
    return f.type == MsgType::kRenewed && LeadingId(f.payload) == v.lease_id_;
  });
  if (!f.ok()) return SessionLost(f.status(), "while renewing a lease", true);
  absl::StatusOr<RenewedMsg> renewed = DecodeRenewed(f->payload);
  if (!renewed.ok() || !renewed->valid) {
    return absl::UnavailableError(absl::StrFormat(
        "the hold on version %d expired between reads (lease %s); %s may have reused its "
        "memory, so the bytes are not trusted",
        v.manifest_.version, absl::FormatDuration(session_->lease), v.source_));
  }
  v.lease_base_ = sent_at;
  return absl::OkStatus();
}

absl::Status UcxSubscriber::FetchRanges(UcxVersion& v, absl::Span<const RangeRead> reads,
                                        absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (v.released_ || !session_ || session_->generation != v.generation_) {
    v.released_ = true;
    return absl::UnavailableError(absl::StrFormat(
        "the hold on version %d from %s ended before these reads (a failed read, or the "
        "connection ended)",
        v.manifest_.version, v.source_));
  }
  if (!v.sealed_) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: byte ranges of version %d read before it was sealed",
                        endpoint_.display, v.manifest_.version));
  }
  const Manifest& m = v.manifest_;
  Pieces pieces;
  for (const RangeRead& r : reads) {
    uint64_t end = 0;
    if (r.tensor >= m.tensors.size() || __builtin_add_overflow(r.offset, r.length, &end) ||
        end > m.tensors[r.tensor].nbytes || (r.length > 0 && r.target == nullptr)) {
      return absl::InternalError(absl::StrFormat(
          "a read of bytes [%d, +%d) of tensor %d is not within the version's tensors", r.offset,
          r.length, r.tensor));
    }
    if (r.length == 0) continue;
    pieces.offsets.push_back(v.offsets_[r.tensor] + r.offset);
    pieces.sizes.push_back(r.length);
    pieces.targets.push_back(r.target);
    pieces.tensor.push_back(r.tensor);
  }
  WB_RETURN_IF_ERROR(ConfirmLease(v, deadline));
  NoLanding sink;
  WB_RETURN_IF_ERROR(PullPieces(v, pieces, sink, deadline));
  // The bytes are trusted only if the lease held throughout (as Fetch's release confirms).
  return ConfirmLease(v, deadline);
}

absl::Status UcxSubscriber::PullBytes(UcxVersion& v, const Pieces& pc, LandingSink& sink,
                                      absl::Time deadline, uint64_t* inflight_left) {
  const absl::Time fetch_start = absl::Now();
  Session& s = *session_;
  const Manifest& m = v.manifest_;
  const size_t n = pc.sizes.size();
  absl::Span<std::byte* const> targets = pc.targets;
  // Remote keys, unpacked once per region and session.
  std::vector<ucp_rkey_h> rkeys(v.regions_.size());
  std::vector<bool> attach(v.regions_.size(), false);
  for (size_t k = 0; k < v.regions_.size() && !s.bytes_over_control; ++k) {
    const LayoutRegion& g = v.regions_[k];
    if ((g.flags & kCrossMemoryAttach) != 0 && CanAttach(v)) {
      attach[k] = true;  // process_vm_readv: no remote key needed
      continue;
    }
    WB_ASSIGN_OR_RETURN(
        rkeys[k],
        RkeyOf(g.id, g.rkey, absl::StrFormat("staging region %d of %s", g.id, s.publisher)));
  }

  Pull pull;
  pull.remaining.assign(n, 0);
  pull.next_in_order.assign(n, 0);
  pull.sink = &sink;
  pull.manifest = &m;
  pull.source = absl::StrFormat("from %s", s.publisher);
  pull.pieces = &pc;
  pull.end_op.assign(n, 0);
  uint64_t total = 0;
  // A DATA frame carries at most 16 MiB (frames are held whole in memory on both sides).
  const uint64_t chunk = s.bytes_over_control
                             ? std::min<uint64_t>(options_.get_chunk_size, 16 << 20)
                             : options_.get_chunk_size;
  // Pipelining: while chunks are still being staged, gets wait for their chunk's readiness word
  // and never cross a chunk boundary. Over the control connection the publisher holds each READ
  // until its bytes are staged.
  const bool gated = !v.all_ready() && !s.bytes_over_control;
  const uint64_t ready_chunk = v.chunk_bytes_;
  // Fan-out: this subscriber relays the version (its readiness words count whole chunks), or
  // reads it from a relay (whose readiness it follows). Either way gets stay within one chunk.
  RelayLink* link = v.link_;
  RelayServe* serve = v.serve_;
  pull.serve = serve;
  const bool by_chunk = gated || serve != nullptr || link != nullptr;

  // Registrations: one per run of targets that ascend with gaps under a page (every byte of such
  // a gap lies on a page the neighbouring targets occupy, so the run is mapped memory: the
  // core's library buffer, a replica's parameters bound in one allocation), cut at max_region.
  // Gets: one per chunk of a run of tensors contiguous both in the slot and in the targets.
  constexpr uint64_t kPage = 4096;
  std::byte* reg_begin = nullptr;  // the registration run the current tensor lies in
  std::byte* reg_end = nullptr;
  std::vector<std::pair<std::byte*, std::byte*>> reg_runs;  // [begin, end) per run
  std::vector<size_t> reg_run_of(n, 0);
  for (size_t i = 0; i < n && !s.bytes_over_control; ++i) {
    const uint64_t nbytes = pc.sizes[i];
    if (nbytes == 0) continue;
    std::byte* t = targets[i];
    if (reg_begin != nullptr && t >= reg_end && t - reg_end < static_cast<ptrdiff_t>(kPage)) {
      reg_runs.back().second = reg_end = t + nbytes;
    } else {
      reg_runs.emplace_back(t, t + nbytes);
      reg_begin = t;
      reg_end = t + nbytes;
    }
    reg_run_of[i] = reg_runs.size() - 1;
  }
  // The registration of the max_region piece of run `r` that holds `p`, and where it ends.
  auto registration = [&](size_t r, std::byte* p) -> std::pair<ucp_mem_h, std::byte*> {
    const auto [begin, end] = reg_runs[r];
    std::byte* piece = begin + (p - begin) / options_.max_region * options_.max_region;
    const uint64_t len = std::min<uint64_t>(options_.max_region, end - piece);
    return {registrations_.Get(piece, len), piece + len};
  };
  std::vector<uint64_t> op_chunk;  // per get, its readiness chunk (gated)
  for (size_t i = 0; i < n;) {
    if (pc.sizes[i] == 0) {
      ++i;
      continue;
    }
    // The run [i, j): each tensor starts where the previous one ends, in the slot and the
    // targets (zero-byte tensors between them are skipped over).
    size_t j = i + 1, last = i;
    uint64_t run_len = pc.sizes[i];
    while (j < n) {
      const uint64_t nb = pc.sizes[j];
      if (nb != 0) {
        if (pc.offsets[j] != pc.offsets[i] + run_len || targets[j] != targets[i] + run_len ||
            (!s.bytes_over_control && reg_run_of[j] != reg_run_of[i])) {
          break;
        }
        run_len += nb;
        last = j;
      }
      ++j;
    }
    size_t t = i;  // the first tensor the next get touches
    for (uint64_t done = 0; done < run_len;) {
      const uint64_t off = pc.offsets[i] + done;
      std::byte* local = targets[i] + done;
      auto region = std::upper_bound(v.regions_.begin(), v.regions_.end(), off,
                                     [](uint64_t o, const LayoutRegion& g) { return o < g.base; });
      const size_t k = static_cast<size_t>(region - v.regions_.begin()) - 1;
      const LayoutRegion& g = v.regions_[k];
      uint64_t len = std::min({chunk, run_len - done, g.base + g.length - off});
      if (by_chunk) len = std::min(len, (off / ready_chunk + 1) * ready_chunk - off);
      // From the relay where it holds these slot bytes (within one of its regions).
      bool from_relay = false;
      uint64_t relay_remote = 0;
      size_t relay_region = 0;
      if (link != nullptr) {
        auto r = std::upper_bound(link->regions.begin(), link->regions.end(), off,
                                  [](uint64_t o, const LayoutRegion& x) { return o < x.base; });
        if (r != link->regions.begin() && off < (r - 1)->base + (r - 1)->length) {
          const LayoutRegion& x = *(r - 1);
          len = std::min(len, x.base + x.length - off);
          from_relay = true;
          relay_remote = x.address + (off - x.base);
          relay_region = static_cast<size_t>(r - 1 - link->regions.begin());
        }
      }
      ucp_mem_h memh = nullptr;
      if (!s.bytes_over_control) {
        const auto [handle, piece_end] = registration(reg_run_of[i], local);
        memh = handle;
        len = std::min<uint64_t>(len, piece_end - local);
      }
      while (pc.sizes[t] == 0 || pc.offsets[t] + pc.sizes[t] <= off) ++t;
      size_t u = t;  // the last tensor it touches
      while (u < last && (pc.sizes[u + 1] == 0 || pc.offsets[u + 1] < off + len)) ++u;
      while (pc.sizes[u] == 0) --u;
      const size_t op = pull.ops.size();
      for (size_t w = t; w <= u; ++w) {
        if (pc.sizes[w] == 0) continue;
        if (pull.remaining[w] == 0) pull.next_in_order[w] = op;
        ++pull.remaining[w];
        pull.end_op[w] = op + 1;
      }
      pull.ops.push_back(GetOp{
          t, u, s.bytes_over_control ? nullptr : rkeys[k], g.address + (off - g.base), local, len,
          off, memh, !s.bytes_over_control && attach[k], from_relay, relay_remote, relay_region});
      if (by_chunk) op_chunk.push_back(off / ready_chunk);
      done += len;
      total += len;
    }
    i = j;
  }
  std::vector<GetContext> contexts(pull.ops.size());
  pull.done.assign(pull.ops.size(), false);
  if (serve != nullptr) {
    // The bytes each chunk waits for; a chunk without any is held at once.
    for (size_t k = 0; k < pull.ops.size(); ++k) serve->left[op_chunk[k]] += pull.ops[k].length;
    for (uint64_t c = 0; c < serve->left.size(); ++c) {
      if (serve->left[c] == 0) {
        __atomic_store_n(serve->word(kRelayReadyOffset + 8 * c), serve->version, __ATOMIC_RELEASE);
      }
    }
  }
  gets_.fetch_add(pull.ops.size(), std::memory_order_relaxed);
  bytes_.fetch_add(total, std::memory_order_relaxed);
  process_bytes[std::min(rank_, kCountedRanks - 1)].fetch_add(total, std::memory_order_relaxed);
  const absl::Time planned = absl::Now();
  if (s.bytes_over_control) {
    absl::Status status = ReadOverControl(v, pull, total, deadline);
    *inflight_left = 0;  // nothing but this thread writes into the targets
    Log(LogLevel::kDebug, "%s: version %d: %d reads of %d bytes over the control connection in %s",
        endpoint_.display, m.version, pull.ops.size(), total,
        absl::FormatDuration(absl::Now() - planned));
    return status;
  }

  ucp_worker_h worker = worker_->get();
  const uint64_t window = static_cast<uint64_t>(options_.gets_in_flight);
  std::vector<bool> issued(pull.ops.size(), false);
  size_t first_unissued = 0;  // every get before it is issued
  size_t issued_count = 0;
  uint64_t issued_bytes = 0;
  std::optional<absl::Time> renew_sent;  // a RENEW awaiting its RENEWED
  absl::Time last_check = absl::InfinitePast();
  // Readiness polls (gated): the header and a window of readiness words, read asynchronously.
  constexpr uint64_t kPollWords = 1024;
  std::string poll_header(kDescriptorHeaderBytes, '\0'), poll_words(8 * kPollWords, '\0');
  PendingGet poll;
  uint64_t poll_lo = 0, poll_hi = 0;
  absl::Duration backoff = absl::Microseconds(20);
  absl::Time next_poll = absl::InfinitePast();
  uint64_t polls = 0, waits = 0;
  // Reads from the relay not yet counted, and when the relay was last looked at.
  std::vector<size_t> unconfirmed;
  absl::Time last_confirm = absl::InfinitePast(), next_relay_poll = absl::InfinitePast();
  absl::Duration relay_backoff = absl::Microseconds(20);
  ucp_rkey_h descriptor_rkey = nullptr;
  if (gated) {
    WB_ASSIGN_OR_RETURN(descriptor_rkey,
                        RkeyOf(v.descriptor_.id, v.descriptor_.rkey,
                               absl::StrFormat("the version descriptor of %s", s.publisher)));
  }
  absl::Status status;
  while (true) {
    // Issue a bounded burst: shared-memory gets complete inside ucp_get_nbx, and the checks
    // below must still run while a large version streams in. Gets go in slot order, each once
    // its chunk is staged (a look-ahead of a few hundred past a chunk not staged yet).
    bool blocked = false;  // a get waits for its chunk
    uint64_t wanted_chunk = 0;
    bool relay_blocked = false;  // a get waits for the relay to hold its chunk
    uint64_t relay_wanted = 0;
    int burst = 0;
    for (size_t k = first_unissued; k < pull.ops.size() && k < first_unissued + 256 && burst < 16 &&
                                    pull.error.ok() && pull.inflight < window;
         ++k) {
      if (issued[k]) continue;
      GetOp& op = pull.ops[k];
      if (op.relay && link->dead) op.relay = false;  // fell back: the publisher serves the rest
      if (op.relay) {
        if (!link->ready[op_chunk[k]]) {
          if (!relay_blocked) relay_wanted = op_chunk[k];
          relay_blocked = true;
          continue;
        }
        // Read now (into the target), counted once a later look at the relay finds it open.
        ++pull.inflight;
        issued[k] = true;
        ++issued_count;
        ++burst;
        absl::Status read = absl::OkStatus();
        if (link->attach) {
          if (AttachRead(link->source.pid, op.local, op.relay_remote, op.length) != UCS_OK) {
            read = absl::UnavailableError("the relay's memory cannot be read (it exited?)");
          }
        } else {
          read = PeerIo(link->source, false, op.relay_remote, op.local, op.length,
                        std::min(deadline, absl::Now() + options_.relay_stall),
                        link->rkeys[op.relay_region], link->peer_serial);
        }
        if (read.ok()) {
          unconfirmed.push_back(k);
          issued_bytes += op.length;
          continue;
        }
        link->dead = true;
        link->unreachable = true;
        link->why = std::string(read.message());
        --pull.inflight;
        issued[k] = false;
        --issued_count;
        op.relay = false;
        continue;
      }
      if (gated && !v.ready_[op_chunk[k]]) {
        if (!blocked) wanted_chunk = op_chunk[k];
        blocked = true;
        continue;
      }
      contexts[k] = GetContext{&pull, k};
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &OnGetDone;
      param.user_data = &contexts[k];
      if (op.memh != nullptr) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        param.memh = op.memh;
      }
      ++pull.inflight;
      issued[k] = true;
      ++issued_count;
      ++burst;
      if (op.attach) {
        pull.Complete(k, AttachRead(v.pid_, op.local, op.remote, op.length));
      } else {
        ucs_status_ptr_t req = ucp_get_nbx(s.ep, op.local, op.length, op.remote, op.rkey, &param);
        if (req == nullptr) {
          pull.Complete(k, UCS_OK);
        } else if (UCS_PTR_IS_ERR(req)) {
          pull.Complete(k, UCS_PTR_STATUS(req));
        }
      }
      issued_bytes += op.length;
      status = pull.Midpoint(failpoints_, issued_bytes, total, issued_count);
      if (!status.ok()) break;
    }
    while (first_unissued < pull.ops.size() && issued[first_unissued]) ++first_unissued;
    if (!status.ok() || !pull.error.ok()) break;
    if (issued_count == pull.ops.size() && pull.inflight == 0) break;
    if (link != nullptr) {
      // Reads from the relay count once a look at it, after them, finds it still serving the
      // version (a relay closes only once its children are done or stopped); it stalls when it
      // holds no new chunk for relay_stall while this subscriber waits: the publisher serves
      // the rest. The relay is told of progress (heartbeat) and, at the end, that we are done.
      const absl::Time now = absl::Now();
      const bool settle =
          !unconfirmed.empty() && (now - last_confirm >= absl::Milliseconds(1) ||
                                   (burst == 0 && pull.inflight == unconfirmed.size()));
      if (settle || (relay_blocked && !link->dead && now >= next_relay_poll)) {
        const bool open =
            !link->dead && PollRelay(v, *link, relay_blocked ? relay_wanted : 0, deadline);
        if (settle) {
          last_confirm = now;
          for (size_t k : unconfirmed) {
            if (open) {
              pull.Complete(k, UCS_OK);
              link->bytes += pull.ops[k].length;
            } else {  // read again from the publisher
              --pull.inflight;
              issued[k] = false;
              --issued_count;
              issued_bytes -= pull.ops[k].length;
              pull.ops[k].relay = false;
              first_unissued = std::min(first_unissued, k);
            }
          }
          if (open) {
            link->progress = now;
            uint64_t beat = ++link->heartbeat;
            (void)PeerIo(link->source, true,
                         link->source.address + RelayChildOffset(link->source.child) + 16, &beat, 8,
                         std::min(deadline, now + options_.relay_stall), nullptr,
                         link->peer_serial);
          }
          unconfirmed.clear();
        }
        if (!link->dead && relay_blocked && now - link->progress > options_.relay_stall) {
          link->dead = true;
          link->why = absl::StrFormat("it held no new chunk for %s",
                                      absl::FormatDuration(options_.relay_stall));
        }
        relay_backoff = link->progress == now
                            ? absl::Microseconds(20)
                            : std::min(relay_backoff * 2, absl::Microseconds(500));
        next_relay_poll = now + relay_backoff;
        continue;
      }
    }
    if (first_unissued < pull.ops.size() && !blocked && burst == 0 && pull.inflight < window) {
      // Every get in the look-ahead is issued but later ones wait: the first unissued one.
      blocked = gated && !v.ready_[op_chunk[first_unissued]];
      wanted_chunk = gated ? op_chunk[first_unissued] : 0;
    }
    // Readiness: poll the descriptor for chunks staged since (with a backoff while nothing new
    // comes), and take in the answer of the poll in flight.
    if (gated && poll.inflight == 0 && poll_hi > poll_lo) {
      if (poll.status != UCS_OK) {
        status = UcsError(poll.status, absl::StrFormat("reading readiness of version %d from %s",
                                                       m.version, s.publisher));
        break;
      }
      absl::StatusOr<DescriptorHeader> h = DecodeHeader(poll_header);
      if (!h.ok() || h->version != m.version ||
          h->state == static_cast<uint64_t>(VersionState::kAborted)) {
        status = AbortedStatus(v);
        if (status.ok()) {
          status = absl::AbortedError(absl::StrFormat(
              "%s gave up publishing version %d before sealing it (its Publish failed); nothing "
              "of it may be used",
              v.source_, m.version));
        }
        break;
      }
      bool fresh = false;
      for (uint64_t c = poll_lo; c < poll_hi; ++c) {
        if (!v.ready_[c] && LoadLe<uint64_t>(poll_words.data() + 8 * (c - poll_lo)) == m.version) {
          v.ready_[c] = true;
          ++v.ready_count_;
          fresh = true;
        }
      }
      backoff = fresh ? absl::Microseconds(20) : std::min(backoff * 2, absl::Microseconds(500));
      next_poll = absl::Now() + (fresh ? absl::ZeroDuration() : backoff);
      poll_lo = poll_hi = 0;
      continue;
    }
    const absl::Time before_progress = absl::Now();
    if (blocked && poll.inflight == 0 && before_progress >= next_poll) {
      poll_lo = wanted_chunk;
      poll_hi = std::min(v.nchunks_, poll_lo + kPollWords);
      ++polls;
      for (auto [offset, length, into] :
           {std::tuple{uint64_t{0}, kDescriptorHeaderBytes, poll_header.data()},
            std::tuple{ReadyOffset(poll_lo), 8 * (poll_hi - poll_lo), poll_words.data()}}) {
        ucp_request_param_t param{};
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = &OnPendingGetDone;
        param.user_data = &poll;
        ++poll.inflight;
        ucs_status_ptr_t req = ucp_get_nbx(s.ep, into, length, v.descriptor_.address + offset,
                                           descriptor_rkey, &param);
        if (req == nullptr) {
          --poll.inflight;
        } else if (UCS_PTR_IS_ERR(req)) {
          --poll.inflight;
          poll.status = UCS_PTR_STATUS(req);
        }
      }
      descriptor_bytes_ += kDescriptorHeaderBytes + 8 * (poll_hi - poll_lo);
      continue;
    }
    const unsigned progressed = ucp_worker_progress(worker);
    status = pull.Midpoint(failpoints_, issued_bytes, total, issued_count);
    if (!status.ok()) break;
    if (progressed == 0 && (blocked || relay_blocked) && pull.inflight == unconfirmed.size() &&
        poll.inflight == 0) {
      // Nothing to do until the publisher stages more: sleep until the next poll instead of
      // spinning (the publisher's copy threads may need this core).
      if (waits++ == 0) {
        // Fault injection: every staged byte asked for, the rest not staged yet.
        status = failpoints_.Hit("ucx.chunk_wait");
        if (!status.ok()) break;
      }
      const absl::Time wake = blocked && relay_blocked ? std::min(next_poll, next_relay_poll)
                              : relay_blocked          ? next_relay_poll
                                                       : next_poll;
      absl::SleepFor(std::max(absl::Microseconds(10), wake - absl::Now()));
    }
    // Every millisecond (or when idle): the deadline, the publisher's liveness, the lease.
    const absl::Time now = absl::Now();
    if (progressed != 0 && now - last_check < absl::Milliseconds(1)) continue;
    last_check = now;
    if (s.ep_status != UCS_OK) {
      status = UcsError(s.ep_status,
                        absl::StrFormat("the UCX endpoint to %s failed while version %d was "
                                        "being received",
                                        s.publisher, m.version));
      break;
    }
    if (now > deadline) {
      status = absl::DeadlineExceededError(absl::StrFormat(
          "receiving version %d from %s did not finish by the deadline (%d of %d bytes "
          "requested%s)",
          m.version, s.publisher, issued_bytes, total,
          gated ? absl::StrFormat(", %d of %d chunks staged", v.ready_count_, v.nchunks_) : ""));
      break;
    }
    status = ServiceControl(v, renew_sent, deadline);
    if (!status.ok()) break;
  }
  if (status.ok()) status = pull.error;
  pull.inflight -= unconfirmed.size();  // read already (synchronously): nothing outstanding
  unconfirmed.clear();
  if (link != nullptr) {
    relay_bytes_.fetch_add(link->bytes, std::memory_order_relaxed);
    Log(LogLevel::kDebug, "%s: version %d: %d bytes from relay %016x%s, %d from %s",
        endpoint_.display, m.version, link->bytes, link->source.relay,
        link->dead ? " (then fell back: " + link->why + ")" : "", total - link->bytes, s.publisher);
  }
  *inflight_left = pull.inflight + poll.inflight;
  Log(LogLevel::kDebug, "%s: version %d: %d gets of %d bytes in %s (%.2f GB/s), planned in %s%s",
      endpoint_.display, m.version, pull.ops.size(), total,
      absl::FormatDuration(absl::Now() - planned),
      total / 1e9 / std::max(1e-9, absl::ToDoubleSeconds(absl::Now() - planned)),
      absl::FormatDuration(planned - fetch_start),
      gated ? absl::StrFormat("; pipelined: %d readiness polls, %d waits", polls, waits) : "");
  if (!status.ok() && *inflight_left > 0) {
    // Outstanding gets (and a poll) write into memory that must stay alive: abandon them first.
    ucp_worker_h w = worker_->get();
    Session* gone = session_.get();
    gone->rkeys.clear();
    if (gone->ep != nullptr) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = gone->peer_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      (void)WaitRequest(w, ucp_ep_close_nbx(gone->ep, &param), absl::Now() + absl::Seconds(5));
      gone->ep = nullptr;
    }
    const absl::Time limit = absl::Now() + absl::Seconds(5);
    while (pull.inflight + poll.inflight > 0 && absl::Now() < limit) {
      if (ucp_worker_progress(w) == 0) absl::SleepFor(absl::Microseconds(50));
    }
    if (pull.inflight + poll.inflight > 0) {
      // Cannot happen with UCX's documented close semantics; never return while gets may
      // still write into the caller's buffers.
      Log(LogLevel::kError,
          "%s: %d gets still outstanding 5 s after closing the endpoint to %s; waiting for them",
          endpoint_.display, pull.inflight + poll.inflight, s.publisher);
      while (pull.inflight + poll.inflight > 0) {
        if (ucp_worker_progress(w) == 0) absl::SleepFor(absl::Milliseconds(1));
      }
    }
    *inflight_left = 0;
    CloseSession();
  }
  return status;
}

absl::Status UcxSubscriber::ReadOverControl(UcxVersion& v, Pull& pull, uint64_t total,
                                            absl::Time deadline) {
  Session& s = *session_;
  const Manifest& m = v.manifest_;
  const uint64_t window = static_cast<uint64_t>(options_.gets_in_flight);
  // Request ids unique within the session: DATA still arriving for an earlier Fetch that failed
  // is told apart and ignored.
  const uint64_t base = next_request_;
  next_request_ += pull.ops.size();
  size_t next = 0;
  uint64_t issued_bytes = 0;
  std::optional<absl::Time> renew_sent;
  while (pull.error.ok() && (next < pull.ops.size() || pull.inflight > 0)) {
    while (pull.inflight < window && next < pull.ops.size()) {
      const GetOp& op = pull.ops[next];
      absl::Status sent = s.control.Send(
          Encode(ReadMsg{base + next, v.lease_id_, op.slot_offset, op.length}), deadline);
      if (!sent.ok()) return sent;
      ++pull.inflight;
      issued_bytes += op.length;
      ++next;
    }
    WB_RETURN_IF_ERROR(pull.Midpoint(failpoints_, issued_bytes, total, next));
    const absl::Time mono = MonotonicNow();
    if (!renew_sent && mono - v.lease_base_ > s.lease / 4) {
      WB_RETURN_IF_ERROR(
          s.control.Send(Encode(RenewMsg{v.lease_id_}), std::min(deadline, absl::Now() + s.lease)));
      renew_sent = mono;
    }
    // Wake at least every quarter lease to renew it.
    absl::StatusOr<Frame> f = s.control.Receive(
        std::min(deadline, absl::Now() + std::max(s.lease / 8, absl::Milliseconds(1))));
    if (!f.ok()) {
      if (absl::IsDeadlineExceeded(f.status()) && absl::Now() < deadline) continue;
      if (absl::IsDeadlineExceeded(f.status())) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "receiving version %d from %s did not finish by the deadline (%d of %d bytes "
            "requested)",
            m.version, s.publisher, issued_bytes, total));
      }
      return absl::UnavailableError(absl::StrFormat("%s while version %d was being received",
                                                    f.status().message(), m.version));
    }
    if (f->type == MsgType::kData) {
      absl::StatusOr<DataMsg> data = DecodeData(f->payload);
      if (!data.ok()) {
        return absl::DataLossError(
            absl::StrFormat("%s sent a %s while version %d was being received", s.publisher,
                            data.status().message(), m.version));
      }
      const uint64_t id = data->request;
      const bool ok = data->ok;
      const std::string_view bytes = data->bytes;
      if (id < base || id - base >= pull.ops.size()) continue;  // an earlier Fetch's
      const uint64_t k = id - base;
      if (k >= next || pull.done[k] || (ok && bytes.size() != pull.ops[k].length)) {
        return absl::DataLossError(absl::StrFormat(
            "%s sent a DATA message for read %d (%d bytes) that was not asked for, was answered "
            "already or does not match its request, while version %d was being received",
            s.publisher, k, bytes.size(), m.version));
      }
      if (!ok) {
        WB_RETURN_IF_ERROR(AbortedStatus(v));
        return absl::UnavailableError(
            absl::StrFormat("%s could not serve bytes of version %d: %s; the bytes are not trusted",
                            s.publisher, m.version, bytes));
      }
      WB_RETURN_IF_ERROR(CopyBytes(pull.ops[k].local, bytes.data(), bytes.size()));
      pull.Complete(k, UCS_OK);
      WB_RETURN_IF_ERROR(pull.Midpoint(failpoints_, issued_bytes, total, next));
    } else if (f->type == MsgType::kRenewed) {
      absl::StatusOr<RenewedMsg> renewed = DecodeRenewed(f->payload);
      if (!renewed.ok()) {
        return absl::DataLossError(
            absl::StrFormat("%s sent a %s while version %d was being "
                            "received",
                            s.publisher, renewed.status().message(), m.version));
      }
      if (renewed->lease == v.lease_id_ && renew_sent) {
        if (!renewed->valid) {
          return absl::UnavailableError(absl::StrFormat(
              "the hold on version %d expired before the transfer finished (lease %s); %s may "
              "have reused its memory, so the bytes are not trusted",
              m.version, absl::FormatDuration(s.lease), s.publisher));
        }
        v.lease_base_ = *renew_sent;
        renew_sent.reset();
      }
    } else if (f->type == MsgType::kError) {
      return absl::UnavailableError(
          absl::StrFormat("%s ended the session while version %d was being received: %s",
                          s.publisher, m.version, ErrorStatus(f->payload, "").message()));
    } else {
      const std::string publisher_name = s.publisher;
      HandleStray(*f);
      if (!session_) {
        return absl::UnavailableError(
            absl::StrFormat("the session with %s ended while version %d was being received",
                            publisher_name, m.version));
      }
      WB_RETURN_IF_ERROR(AbortedStatus(v));
    }
  }
  return pull.error;
}

void UcxSubscriber::Release(UcxVersion& v) {
  absl::MutexLock lock(&mu_);
  aborted_.erase(v.lease_id_);
  if (v.released_) return;
  v.released_ = true;
  if (v.relay_) CloseRelay(v.manifest_.version);
  if (!session_ || session_->generation != v.generation_) return;
  (void)session_->control.Send(Encode(ReleaseMsg{v.lease_id_, false}),
                               absl::Now() + absl::Seconds(1));
}

absl::StatusOr<UcxSubscriber*> UcxSubscriber::MemberSubscriber(int rank,
                                                               const GroupMember& member) {
  absl::MutexLock lock(&members_mu_);
  const std::string key = absl::StrFormat("%s %d", member.host, member.port);
  auto it = member_subs_.find(key);
  if (it == member_subs_.end()) {
    if (member.host.empty() || member.port == 0 || member.port > 65535) {
      return absl::DataLossError(absl::StrFormat(
          "%s: the group's rank 0 gave no usable address for rank %d (\"%s\" port %d)",
          endpoint_.display, rank, member.host, member.port));
    }
    Endpoint e;
    e.host = member.host;
    e.port = static_cast<int>(member.port);
    e.channel = endpoint_.channel;
    const bool v6 = member.host.find(':') != std::string::npos;
    e.display = absl::StrFormat("%s (rank %d at %s%s%s port %d)", endpoint_.display, rank,
                                v6 ? "[" : "", member.host, v6 ? "]" : "", member.port);
    WB_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, Worker::Create(context_, e.display));
    // A rank's earlier subscriber (it restarted on another port) stays: versions granted
    // through it may still be alive, and hold it.
    it = member_subs_
             .emplace(key, std::make_unique<UcxSubscriber>(std::move(e), options_, FailPoints(),
                                                           context_, std::move(worker), rank))
             .first;
  }
  member_of_rank_[rank] = it->second.get();
  return it->second.get();
}

void UcxSubscriber::Accepted(UcxVersion& v) {
  absl::MutexLock lock(&mu_);
  if (!session_ || session_->generation != v.generation_) return;
  (void)session_->control.Send(Encode(AcceptedMsg{v.manifest_.version}),
                               absl::Now() + absl::Seconds(1));
}

}  // namespace

std::vector<uint64_t> ProcessBytesByRank() {
  std::vector<uint64_t> out(kCountedRanks);
  for (int r = 0; r < kCountedRanks; ++r) out[r] = process_bytes[r].load(std::memory_order_relaxed);
  while (out.size() > 1 && out.back() == 0) out.pop_back();
  return out;
}

std::optional<UcxSubscriberCounters> SubscriberCounters(TransportSubscriber& subscriber) {
  auto* ucx = dynamic_cast<UcxSubscriber*>(&subscriber);
  if (ucx == nullptr) return std::nullopt;
  return ucx->counters();
}

absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenUcxSubscriber(const Uri& uri,
                                                                       const Config& config) {
  WB_ASSIGN_OR_RETURN(Endpoint endpoint, ParseEndpoint(uri, /*for_subscriber=*/true));
  WB_ASSIGN_OR_RETURN(UcxOptions options, ReadOptions(endpoint, config));
  WB_ASSIGN_OR_RETURN(FailPoints failpoints, FailPoints::Parse(config.String("failpoints")));
  WB_ASSIGN_OR_RETURN(
      std::shared_ptr<Context> context,
      Context::Create(/*wakeup=*/false, endpoint.display, IsLoopback(endpoint.host),
                      TcpInterfacesFor(endpoint.host, endpoint.port, /*listening=*/false)));
  WB_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, Worker::Create(context, endpoint.display));
  return std::unique_ptr<TransportSubscriber>(new UcxSubscriber(
      std::move(endpoint), options, std::move(failpoints), std::move(context), std::move(worker)));
}

}  // namespace weightbus::internal::ucx
