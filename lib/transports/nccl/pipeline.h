// SPDX-License-Identifier: Apache-2.0
// Moving one version through its buckets, on the root (publisher) and on a replica, over the
// Device and Communicator interfaces (device.h), with every wait polled against a deadline.
//
// Pipelining: bucket k uses slot k % S (S = the device's streams, the setting
// buckets_in_flight, >= 2), a bucket-sized device buffer with its own stream. On the root,
// packing bucket k (copies from the tensors into slot k % S) is enqueued on that slot's stream
// while the broadcast of bucket k - 1 runs on another, and NCCL runs a communicator's broadcasts
// in the order they were enqueued; a replica enqueues broadcast k and the copies out of it
// (unpacking into its destinations) on slot k % S's stream, so unpacking bucket k overlaps the
// broadcast of bucket k + 1. A slot is reused only after the work of the bucket it held is done
// (its stream's event).
//
// Never hangs: no call here blocks on the GPU or the network. Each wait polls the communicator's
// asynchronous error (ncclCommGetAsyncError), the device's events and a Watch (the peers, over
// the control connection) until its deadline; on any failure the communicator is aborted
// (ncclCommAbort), the device synchronized (so that no copy touches caller memory afterwards),
// and the error names the version, the bucket and, on the root, the replicas that had not
// received it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transports/nccl/device.h"
#include "transports/nccl/plan.h"

namespace weightbus::internal::nccl {

// What a wait watches besides the communicator and the device, checked at every poll.
class Watch {
 public:
  virtual ~Watch() = default;
  // Non-OK ends the wait with this status: a peer is gone or failed, the version was aborted
  // by the publisher, the handle was cancelled.
  virtual absl::Status Check() = 0;
};

// Polls `done` until it returns true. Between polls it sleeps, starting at a few microseconds
// and growing to kMaxPollSleep (a wait for a broadcast of hundreds of MiB costs nothing; a
// short one is seen within microseconds). Each round it also checks `comm`'s asynchronous error
// (when not null) and `watch` (when not null). Errors: what `done`, `comm` or `watch` return;
// DeadlineExceeded with `timeout_message()` once `clock` reaches `deadline` (`done` is polled
// once more first: a wait whose work finished in time succeeds).
inline constexpr absl::Duration kMaxPollSleep = absl::Microseconds(200);
// How long a failed broadcast waits (never past its deadline) for the control connections to
// say which replica is gone, to name it.
inline constexpr absl::Duration kPeerGrace = absl::Milliseconds(250);
absl::Status PollUntil(Clock& clock, absl::Time deadline, Communicator* comm, Watch* watch,
                       absl::FunctionRef<absl::StatusOr<bool>()> done,
                       absl::FunctionRef<std::string()> timeout_message);

// Waits for a non-blocking communicator call to be enqueued (or a new communicator to be ready):
// PollUntil over comm.Poll().
absl::Status WaitReady(Clock& clock, absl::Time deadline, Communicator& comm, Watch* watch,
                       absl::FunctionRef<std::string()> timeout_message);

// The root's view of its replicas during a broadcast (the publisher over its control
// connections; fakes in tests). Check() fails when a replica is gone or reported a failure.
class ReplicaProgress : public Watch {
 public:
  // Whether every replica has received `buckets` buckets of the version.
  virtual bool AllReceived(size_t buckets) = 0;
  // The replicas that have received fewer than `buckets` buckets, described for messages
  // ("replica pid 40 on infer-3, rank 2, GPU 1 (...), which has received 2 of 12 buckets").
  virtual std::vector<std::string> Behind(size_t buckets) = 0;
  // Replicas on the root's own GPU (no rank: they copy each bucket out of the root's buffer):
  // bucket `bucket` is complete in buffer `slot` (called once per bucket, in order), and whether
  // every such replica has taken bucket `bucket` out of its buffer, which may then be reused.
  // Defaults: none.
  virtual void BucketReady(size_t bucket, size_t slot) {}
  virtual bool SlotFree(size_t bucket) { return true; }
};

struct BroadcastStats {
  absl::Duration pack;       // time spent enqueuing the copies into buckets (host side)
  absl::Duration broadcast;  // from the first pack to every replica having every bucket
  uint64_t wire_bytes = 0;   // bytes broadcast (buckets, padding included)
  size_t buckets = 0;
};

// The root's side of one version: packs each bucket from `sources` (tensor i's bytes, host or
// device memory, manifest order; nullptr only for a tensor without bytes) into its slot and
// broadcasts it, then waits until every replica has received every bucket (a buffer is reused
// only once the replicas on the root's GPU took the bucket it held: BucketReady, SlotFree).
// `slots` holds the
// device's streams() bucket buffers of plan.bucket_size bytes each. `what` names the version
// for messages ("nccl://trainer:29600/policy version 7"). On failure the communicator is aborted
// and the error names the bucket and the replicas behind: DeadlineExceeded ("... bucket 3 of 12
// was not received by the deadline: replica ... has received 2 of 12 buckets"), Unavailable or
// the replica's own status when a replica is gone or failed, or the communicator's error.
absl::Status BroadcastBuckets(Device& device, Communicator& comm, Clock& clock,
                              ReplicaProgress& replicas, const BucketPlan& plan,
                              absl::Span<const std::byte* const> sources,
                              absl::Span<const std::shared_ptr<void>> slots, absl::Time deadline,
                              const std::string& what, BroadcastStats* stats);

// A replica's side of one version: receives each bucket into its slot and unpacks it into
// `targets` (tensor i's nbytes, host or device memory; all null: a drain, the bytes are
// received and dropped so that the collective completes). After bucket k's copies are done,
// `on_bucket(k)` is called (the replica reports RECEIVED and tells the core which tensors
// landed); its error ends the receive like any other. `watch` watches the publisher (an ABORT,
// its connection). On failure the communicator is aborted and the error names `what`, the
// bucket and the root.
absl::Status ReceiveBuckets(Device& device, Communicator& comm, Clock& clock, Watch& watch,
                            const BucketPlan& plan, absl::Span<std::byte* const> targets,
                            absl::Span<const std::shared_ptr<void>> slots,
                            const std::function<absl::Status(size_t bucket)>& on_bucket,
                            absl::Time deadline, const std::string& what);

}  // namespace weightbus::internal::nccl
