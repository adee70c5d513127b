// SPDX-License-Identifier: Apache-2.0
// The publisher's side of nccl:// (rank 0, the root of every broadcast), as a state machine over
// three interfaces: ReplicaLinks (the replicas, over their control connections: the publisher's
// server in nccl_publisher.cc, a fake in tests), the Backend/Device/Communicator of device.h
// and a Clock. Everything here runs on the thread that calls Publish.
//
// One Publish:
//   1. Membership. The replicas connected now (and greeted: their handshake agreed) are the
//      version's members. If the communicator does not exist, was aborted, or its members are
//      not exactly these replicas (one left, one joined), it is rebuilt: a new epoch, a new
//      ncclUniqueId, GROUP to each member with its rank (by join order, after the publisher's
//      0), every rank initializing non-blocking, until every GROUP_READY is in. Members on the
//      publisher's own GPU are no rank (NCCL puts one rank per GPU): GROUP gives them rank 0
//      and SLOTS the root's bucket buffers, which they read through CUDA IPC as each bucket is
//      complete (BUCKET); with only such members the communicator has the root's one rank. A
//      replica that joins while a version is on its way waits for the next Publish: it costs the
//      others nothing now and one rebuild then.
//   2. Offer. The sealed manifest and the bucket plan go to every member (OFFER); each answers
//      READY once its application is receiving (Subscriber::Receive and friends). A member
//      that is not receiving by the deadline fails the Publish (DeadlineExceeded naming it;
//      nothing was transferred and the communicator stays as it is).
//   3. Broadcast (pipeline.h). Any failure, timeout or peer death aborts the communicator
//      (ncclCommAbort) and sends ABORT to the members still connected: their receive fails and
//      they keep the version they had. The error names the bucket and the replicas behind.
//   4. Commit. Once every member has received every bucket, COMMIT tells them to keep the
//      version (a replica's Fetch returns only then), so a failed Publish leaves every replica
//      with the version it had, even one that had all of the new version's bytes.
// A member whose connection closes at any step fails that step at once (Unavailable naming it)
// instead of at the deadline.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transports/nccl/device.h"
#include "transports/nccl/pipeline.h"
#include "transports/nccl/plan.h"
#include "weightbus/manifest.hpp"

namespace weightbus::internal::nccl {

// What the root knows of one replica at a moment.
struct ReplicaState {
  bool alive = false;  // connected and greeted
  // On the publisher's own GPU: no rank of the communicator; it copies each bucket out of the
  // root's bucket buffers (CUDA IPC), told by BUCKET messages.
  bool colocated = false;
  std::string name;          // "replica pid 40 on infer-3 (GPU 1, NVIDIA H200, ...)"
  std::string gone;          // why it is not alive (its connection closed, ...), when known
  uint64_t group_ready = 0;  // the newest epoch it reported initialized (GROUP_READY ok)
  // A failure it reported (GROUP_READY with an error, FAILED) for `failed_epoch` and
  // `failed_version` (0: the communicator's init).
  std::optional<absl::Status> failed;
  uint64_t failed_epoch = 0;
  uint64_t failed_version = 0;
  uint64_t ready = 0;             // the newest version it said READY for
  uint64_t received_version = 0;  // RECEIVED: of this version...
  uint64_t received_buckets = 0;  // ...this many buckets
};

// The replicas, as the root reaches them. Thread-safe (the server thread updates what Publish
// reads).
class ReplicaLinks {
 public:
  virtual ~ReplicaLinks() = default;
  // The ids of the replicas connected and greeted now, in the order they joined.
  virtual std::vector<uint64_t> Alive() = 0;
  // A replica's state (alive false for one gone or never seen).
  virtual ReplicaState State(uint64_t id) = 0;
  // Queues a frame to a replica; dropped when it is gone.
  virtual void Send(uint64_t id, std::string frame) = 0;
  // Non-OK once the publisher is being closed (Cancelled): every wait ends with it.
  virtual absl::Status Cancelled() = 0;
};

// Why the communicator whose ranks 1.. are `ranks` (epoch 0: none yet; `usable` false once it
// was aborted) must be rebuilt for `alive`, or nullopt when it serves as it is. Pure, for tests.
std::optional<std::string> RebuildReason(uint64_t epoch, bool usable,
                                         const std::vector<uint64_t>& ranks,
                                         const std::vector<uint64_t>& alive, ReplicaLinks& links);

struct RootOptions {
  uint64_t bucket_size = 0;
  std::string display;      // the channel, for messages: "nccl://trainer:29600/policy"
  std::string description;  // the publisher, for messages: "pid 12 on trainer-0"
};

// Figures of the last successful Publish.
struct RootStats {
  size_t replicas = 0;
  bool rebuilt = false;
  absl::Duration rebuild;
  absl::Duration offer;  // OFFER until every READY
  BroadcastStats broadcast;
};

class Root {
 public:
  // `device` must outlive the Root; `slots` (buckets_in_flight bucket buffers) are allocated at
  // the first Publish that has replicas.
  Root(Backend& backend, Device& device, Clock& clock, ReplicaLinks& links, RootOptions options);
  ~Root();

  // Delivers `manifest`'s version (sealed: checksums known) to every replica connected now;
  // `sources[i]` is tensor i's bytes (nullptr only for a tensor without bytes). With no
  // replica connected it delivers to nobody and succeeds. Errors as the steps above, naming the
  // version, the step, the bucket and the replicas concerned.
  absl::Status Publish(const Manifest& manifest, absl::Span<const std::byte* const> sources,
                       absl::Time deadline);

  const RootStats& last_stats() const { return stats_; }
  uint64_t epoch() const { return epoch_; }
  // Whether a communicator exists and was not aborted.
  bool usable() const { return comm_ != nullptr; }
  // The replica ids at ranks 1.. of the current communicator.
  const std::vector<uint64_t>& ranks() const { return ranks_; }

 private:
  absl::Status Rebuild(const std::vector<uint64_t>& members, absl::Time deadline,
                       const std::string& why);
  // Aborts the communicator (when there is one) and tells `members` still connected that
  // version `version` (0: the communicator) is given up, with `why`.
  void GiveUp(const std::vector<uint64_t>& members, uint64_t version, const absl::Status& why);
  absl::Status EnsureSlots();

  Backend& backend_;
  Device& device_;
  Clock& clock_;
  ReplicaLinks& links_;
  RootOptions options_;
  std::unique_ptr<Communicator> comm_;  // null: none, or aborted
  uint64_t epoch_ = 0;
  std::vector<uint64_t> ranks_;
  std::vector<std::shared_ptr<void>> slots_;
  RootStats stats_;
};

}  // namespace weightbus::internal::nccl
