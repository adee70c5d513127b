// SPDX-License-Identifier: Apache-2.0
#include "transports/nccl/pipeline.h"

#include <algorithm>
#include <deque>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace weightbus::internal::nccl {
namespace {

absl::Status WithContext(const absl::Status& s, const std::string& context) {
  return absl::Status(s.code(), absl::StrFormat("%s: %s", context, s.message()));
}

std::byte* At(const std::shared_ptr<void>& slot, uint64_t offset) {
  return static_cast<std::byte*>(slot.get()) + offset;
}

}  // namespace

absl::Status PollUntil(Clock& clock, absl::Time deadline, Communicator* comm, Watch* watch,
                       absl::FunctionRef<absl::StatusOr<bool>()> done,
                       absl::FunctionRef<std::string()> timeout_message) {
  absl::Duration sleep = absl::Microseconds(2);
  while (true) {
    absl::StatusOr<bool> finished = done();
    if (!finished.ok()) return finished.status();
    if (*finished) return absl::OkStatus();
    if (comm != nullptr) {
      if (absl::StatusOr<bool> r = comm->Poll(); !r.ok()) return r.status();
    }
    if (watch != nullptr) {
      if (absl::Status s = watch->Check(); !s.ok()) return s;
    }
    const absl::Time now = clock.Now();
    if (now >= deadline) {
      finished = done();
      if (finished.ok() && *finished) return absl::OkStatus();
      return absl::DeadlineExceededError(timeout_message());
    }
    clock.SleepFor(std::min(sleep, deadline - now));
    sleep = std::min(sleep * 2, kMaxPollSleep);
  }
}

absl::Status WaitReady(Clock& clock, absl::Time deadline, Communicator& comm, Watch* watch,
                       absl::FunctionRef<std::string()> timeout_message) {
  return PollUntil(
      clock, deadline, nullptr, watch, [&] { return comm.Poll(); }, timeout_message);
}

absl::Status BroadcastBuckets(Device& device, Communicator& comm, Clock& clock,
                              ReplicaProgress& replicas, const BucketPlan& plan,
                              absl::Span<const std::byte* const> sources,
                              absl::Span<const std::shared_ptr<void>> slots, absl::Time deadline,
                              const std::string& what, BroadcastStats* stats) {
  const size_t nbuckets = plan.buckets.size();
  const size_t nslots = slots.size();
  const absl::Time start = clock.Now();
  *stats = BroadcastStats{};
  stats->wire_bytes = plan.WireBytes();
  stats->buckets = nbuckets;
  if (nbuckets == 0) return absl::OkStatus();
  size_t posted = 0;  // buckets enqueued
  // The bucket a failure is about: the first one posted that some replica has not received
  // (`bucket` itself when every replica has every bucket up to it).
  auto first_missing = [&](size_t bucket) {
    for (size_t j = 0; j < std::min(posted, bucket + 1); ++j) {
      if (!replicas.AllReceived(j + 1)) return j;
    }
    return bucket;
  };
  auto fail = [&](const absl::Status& s, size_t bucket) {
    // A peer's death may reach NCCL (a failed send) before its control connection's end reaches
    // the publisher: give the latter a moment (never past the deadline) so that the error names
    // the replica, not only NCCL's rank.
    absl::Status peer = replicas.Check();
    const absl::Time until = std::min(deadline, clock.Now() + kPeerGrace);
    while (peer.ok() && !absl::IsDeadlineExceeded(s) && clock.Now() < until) {
      clock.SleepFor(kMaxPollSleep);
      peer = replicas.Check();
    }
    const size_t at = first_missing(bucket);
    comm.Abort();
    device.Synchronize();
    absl::Status out = s;
    if (!peer.ok() && !absl::StrContains(s.message(), peer.message())) {
      out = absl::Status(peer.code(), absl::StrFormat("%s (%s)", peer.message(), s.message()));
    }
    return WithContext(
        out, absl::StrFormat("%s: broadcasting bucket %d of %d (%s) failed; the communicator was "
                             "aborted and the next publish rebuilds it from the replicas still "
                             "connected",
                             what, at + 1, nbuckets, DescribePlan(plan)));
  };
  auto not_received = [&](size_t bucket) {
    return [&, bucket] {
      const size_t at = first_missing(bucket);
      const std::vector<std::string> late = replicas.Behind(at + 1);
      return absl::StrFormat("bucket %d was not received by the deadline: %s", at + 1,
                             late.empty()
                                 ? std::string("every replica reports it received, this rank's "
                                               "broadcast did not complete")
                                 : absl::StrJoin(late, "; "));
    };
  };
  // Buckets enqueued whose buffer is not yet known to be free again, oldest first; the first
  // `ready` of all buckets were reported complete (BucketReady).
  std::deque<size_t> outstanding;
  size_t ready = 0;
  // Reports, in order, the buckets whose broadcast has completed on this rank, without waiting.
  auto report_ready = [&]() -> absl::Status {
    while (ready < posted) {
      absl::StatusOr<bool> done = device.Done(ready % nslots);
      if (!done.ok()) return done.status();
      // An event tells about the newest work on its stream only: a bucket whose buffer was
      // reposted (ready + nslots posted) was reported before it was.
      if (!*done) break;
      replicas.BucketReady(ready, ready % nslots);
      ++ready;
    }
    return absl::OkStatus();
  };
  auto retire_oldest = [&]() -> absl::Status {
    const size_t b = outstanding.front();
    absl::Status s = PollUntil(
        clock, deadline, &comm, &replicas,
        [&]() -> absl::StatusOr<bool> {
          WB_RETURN_IF_ERROR(report_ready());
          return ready > b && replicas.SlotFree(b);
        },
        not_received(b));
    if (!s.ok()) return fail(s, b);
    outstanding.pop_front();
    return absl::OkStatus();
  };
  for (size_t k = 0; k < nbuckets; ++k) {
    const size_t s = k % nslots;
    if (outstanding.size() == nslots) {
      if (absl::Status r = retire_oldest(); !r.ok()) return r;
    }
    const Bucket& bucket = plan.buckets[k];
    const absl::Time pack_start = clock.Now();
    for (const Piece& piece : bucket.pieces) {
      absl::Status c = device.Copy(At(slots[s], piece.bucket_offset),
                                   sources[piece.tensor] + piece.tensor_offset, piece.length, s);
      if (!c.ok()) return fail(c, k);
    }
    stats->pack += clock.Now() - pack_start;
    if (absl::Status b = comm.Broadcast(slots[s].get(), bucket.bytes, /*root=*/0, s); !b.ok()) {
      return fail(b, k);
    }
    posted = k + 1;
    absl::Status enqueued = WaitReady(clock, deadline, comm, &replicas, [&] {
      return absl::StrFormat("NCCL did not enqueue the broadcast of bucket %d by the deadline",
                             k + 1);
    });
    if (!enqueued.ok()) return fail(enqueued, k);
    if (absl::Status r = device.Record(s); !r.ok()) return fail(r, k);
    outstanding.push_back(k);
    if (absl::Status r = report_ready(); !r.ok()) return fail(r, k);
  }
  while (!outstanding.empty()) {
    if (absl::Status r = retire_oldest(); !r.ok()) return r;
  }
  // This rank is done; the version is delivered once every replica has every bucket.
  absl::Status all = PollUntil(
      clock, deadline, &comm, &replicas, [&] { return replicas.AllReceived(nbuckets); },
      not_received(nbuckets - 1));
  if (!all.ok()) return fail(all, nbuckets - 1);
  stats->broadcast = clock.Now() - start;
  return absl::OkStatus();
}

absl::Status ReceiveBuckets(Device& device, Communicator& comm, Clock& clock, Watch& watch,
                            const BucketPlan& plan, absl::Span<std::byte* const> targets,
                            absl::Span<const std::shared_ptr<void>> slots,
                            const std::function<absl::Status(size_t bucket)>& on_bucket,
                            absl::Time deadline, const std::string& what) {
  const size_t nbuckets = plan.buckets.size();
  const size_t nslots = slots.size();
  const bool drain =
      std::all_of(targets.begin(), targets.end(), [](const std::byte* t) { return t == nullptr; });
  auto fail = [&](const absl::Status& s, size_t bucket) {
    comm.Abort();
    device.Synchronize();
    return WithContext(s, absl::StrFormat("%s: receiving bucket %d of %d (%s) failed", what,
                                          bucket + 1, nbuckets, DescribePlan(plan)));
  };
  std::deque<size_t> outstanding;
  auto retire_oldest = [&]() -> absl::Status {
    const size_t b = outstanding.front();
    absl::Status s = PollUntil(
        clock, deadline, &comm, &watch, [&] { return device.Done(b % nslots); },
        [&] {
          return absl::StrFormat(
              "bucket %d did not arrive by the deadline (the publisher or another replica of "
              "the communicator is stalled)",
              b + 1);
        });
    if (s.ok()) s = on_bucket(b);
    if (!s.ok()) return fail(s, b);
    outstanding.pop_front();
    return absl::OkStatus();
  };
  for (size_t k = 0; k < nbuckets; ++k) {
    const size_t s = k % nslots;
    if (outstanding.size() == nslots) {
      if (absl::Status r = retire_oldest(); !r.ok()) return r;
    }
    const Bucket& bucket = plan.buckets[k];
    if (absl::Status b = comm.Broadcast(slots[s].get(), bucket.bytes, /*root=*/0, s); !b.ok()) {
      return fail(b, k);
    }
    absl::Status enqueued = WaitReady(clock, deadline, comm, &watch, [&] {
      return absl::StrFormat("NCCL did not enqueue the broadcast of bucket %d by the deadline",
                             k + 1);
    });
    if (!enqueued.ok()) return fail(enqueued, k);
    if (!drain) {
      for (const Piece& piece : bucket.pieces) {
        std::byte* target = targets[piece.tensor];
        if (target == nullptr) continue;  // a tensor the core does not need
        absl::Status c = device.Copy(target + piece.tensor_offset,
                                     At(slots[s], piece.bucket_offset), piece.length, s);
        if (!c.ok()) return fail(c, k);
      }
    }
    if (absl::Status r = device.Record(s); !r.ok()) return fail(r, k);
    outstanding.push_back(k);
  }
  while (!outstanding.empty()) {
    if (absl::Status r = retire_oldest(); !r.ok()) return r;
  }
  return absl::OkStatus();
}

}  // namespace weightbus::internal::nccl
