// SPDX-License-Identifier: Apache-2.0
#include "transports/nccl/root.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "transports/nccl/protocol.h"

namespace weightbus::internal::nccl {
namespace {

bool Contains(const std::vector<uint64_t>& v, uint64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// Watches the members of one step: any that is gone, or that reported a failure for this
// epoch and `version` (0: the communicator's init), ends the wait; so does closing the
// publisher.
class MembersWatch : public ReplicaProgress {
 public:
  MembersWatch(ReplicaLinks& links, const std::vector<uint64_t>& members, uint64_t epoch,
               uint64_t version)
      : links_(links), members_(members), epoch_(epoch), version_(version) {
    // Ranks 1.. in member order, skipping the members on rank 0's GPU.
    int rank = 0;
    for (uint64_t id : members_) {
      const bool colocated = links_.State(id).colocated;
      colocated_.push_back(colocated);
      labels_.push_back(colocated ? std::string("on rank 0's GPU")
                                  : absl::StrFormat("rank %d", ++rank));
    }
  }

  absl::Status Check() override {
    if (absl::Status c = links_.Cancelled(); !c.ok()) return c;
    for (size_t r = 0; r < members_.size(); ++r) {
      const ReplicaState s = links_.State(members_[r]);
      if (!s.alive) {
        return absl::UnavailableError(
            absl::StrFormat("%s is gone%s", Who(s, r), s.gone.empty() ? "" : ": " + s.gone));
      }
      if (s.failed && s.failed_epoch == epoch_ &&
          (s.failed_version == version_ || s.failed_version == 0)) {
        return absl::Status(s.failed->code(),
                            absl::StrFormat("%s failed: %s", Who(s, r), s.failed->message()));
      }
    }
    return absl::OkStatus();
  }

  bool AllReceived(size_t buckets) override { return Behind(buckets).empty(); }

  void BucketReady(size_t bucket, size_t slot) override {
    std::string frame;
    for (size_t r = 0; r < members_.size(); ++r) {
      if (!colocated_[r]) continue;
      if (frame.empty()) frame = Encode(BucketMsg{version_, bucket, static_cast<uint32_t>(slot)});
      links_.Send(members_[r], frame);
    }
  }

  bool SlotFree(size_t bucket) override {
    for (size_t r = 0; r < members_.size(); ++r) {
      if (!colocated_[r]) continue;
      const ReplicaState s = links_.State(members_[r]);
      const uint64_t got = s.received_version == version_ ? s.received_buckets : 0;
      if (got <= bucket) return false;
    }
    return true;
  }

  std::vector<std::string> Behind(size_t buckets) override {
    std::vector<std::string> out;
    for (size_t r = 0; r < members_.size(); ++r) {
      const ReplicaState s = links_.State(members_[r]);
      const uint64_t got = s.received_version == version_ ? s.received_buckets : 0;
      if (got >= buckets) continue;
      out.push_back(absl::StrFormat("%s has received %d of them", Who(s, r), got));
    }
    return out;
  }

  // The members that have not said READY for the version.
  std::vector<std::string> NotReady() {
    std::vector<std::string> out;
    for (size_t r = 0; r < members_.size(); ++r) {
      const ReplicaState s = links_.State(members_[r]);
      if (s.ready < version_) out.push_back(Who(s, r));
    }
    return out;
  }

  // The members that have not reported this epoch's rank initialized.
  std::vector<std::string> NotInitialized() {
    std::vector<std::string> out;
    for (size_t r = 0; r < members_.size(); ++r) {
      const ReplicaState s = links_.State(members_[r]);
      if (s.group_ready < epoch_) out.push_back(Who(s, r));
    }
    return out;
  }

 private:
  // "replica pid 40 on infer-3 (GPU 1 ...) (rank 2)".
  std::string Who(const ReplicaState& s, size_t r) const {
    return absl::StrFormat("%s (%s)",
                           s.name.empty() ? absl::StrFormat("replica %d", members_[r]) : s.name,
                           labels_[r]);
  }

  ReplicaLinks& links_;
  std::vector<bool> colocated_;
  std::vector<std::string> labels_;
  const std::vector<uint64_t>& members_;
  uint64_t epoch_;
  uint64_t version_;
};

}  // namespace

std::optional<std::string> RebuildReason(uint64_t epoch, bool usable,
                                         const std::vector<uint64_t>& ranks,
                                         const std::vector<uint64_t>& alive, ReplicaLinks& links) {
  if (epoch == 0) return std::string("no communicator exists yet");
  if (!usable) return absl::StrFormat("the communicator of epoch %d was aborted", epoch);
  std::vector<std::string> changes;
  for (uint64_t id : alive) {
    if (!Contains(ranks, id)) changes.push_back(links.State(id).name + " joined");
  }
  for (uint64_t id : ranks) {
    if (!Contains(alive, id)) {
      const ReplicaState s = links.State(id);
      changes.push_back(absl::StrFormat("%s left%s", s.name.empty() ? "a replica" : s.name,
                                        s.gone.empty() ? "" : " (" + s.gone + ")"));
    }
  }
  if (changes.empty() && ranks == alive) return std::nullopt;
  if (changes.empty()) changes.push_back("the replicas' order changed");
  return absl::StrJoin(changes, "; ");
}

Root::Root(Backend& backend, Device& device, Clock& clock, ReplicaLinks& links, RootOptions options)
    : backend_(backend),
      device_(device),
      clock_(clock),
      links_(links),
      options_(std::move(options)) {}

Root::~Root() {
  if (comm_ != nullptr) comm_->Abort();
  comm_.reset();
  device_.Synchronize();
  slots_.clear();
}

absl::Status Root::EnsureSlots() {
  if (slots_.size() == static_cast<size_t>(device_.streams())) return absl::OkStatus();
  slots_.clear();
  for (int s = 0; s < device_.streams(); ++s) {
    absl::StatusOr<std::shared_ptr<void>> slot = device_.Allocate(options_.bucket_size);
    if (!slot.ok()) {
      slots_.clear();
      return absl::Status(
          slot.status().code(),
          absl::StrFormat("%s: allocating bucket %d of %d (bucket_size %d bytes, "
                          "buckets_in_flight %d) on %s: %s",
                          options_.display, s + 1, device_.streams(), options_.bucket_size,
                          device_.streams(), device_.Describe(), slot.status().message()));
    }
    slots_.push_back(*std::move(slot));
  }
  return absl::OkStatus();
}

void Root::GiveUp(const std::vector<uint64_t>& members, uint64_t version, const absl::Status& why) {
  if (comm_ != nullptr) {
    comm_->Abort();
    comm_.reset();
    device_.Synchronize();
  }
  const std::string abort = Encode(
      AbortMsg{epoch_, version, static_cast<uint32_t>(why.code()), std::string(why.message())});
  for (uint64_t id : members) links_.Send(id, abort);
}

absl::Status Root::Rebuild(const std::vector<uint64_t>& members, absl::Time deadline,
                           const std::string& why) {
  const absl::Time start = clock_.Now();
  if (comm_ != nullptr) {
    comm_->Abort();
    comm_.reset();
  }
  ranks_.clear();
  ++epoch_;
  // Members on the root's GPU are no rank; the others are ranks 1.. in join order.
  std::vector<uint64_t> ranked;
  for (uint64_t id : members) {
    if (!links_.State(id).colocated) ranked.push_back(id);
  }
  const int nranks = static_cast<int>(ranked.size()) + 1;
  auto fail = [&](const absl::Status& s) {
    GiveUp(members, 0, s);
    return absl::Status(
        s.code(),
        absl::StrFormat("%s: building the communicator of epoch %d (%d ranks; %s) failed: %s",
                        options_.display, epoch_, nranks, why, s.message()));
  };
  absl::StatusOr<UniqueId> id = backend_.NewUniqueId();
  if (!id.ok()) return fail(id.status());
  std::vector<std::string> who = {
      absl::StrFormat("rank 0: the publisher (%s, %s)", options_.description, device_.Describe())};
  for (size_t r = 0; r < ranked.size(); ++r) {
    who.push_back(absl::StrFormat("rank %d: %s", r + 1, links_.State(ranked[r]).name));
  }
  for (uint64_t m : members) {
    if (links_.State(m).colocated) {
      who.push_back(absl::StrFormat("on rank 0's GPU: %s", links_.State(m).name));
    }
  }
  const std::string members_text = absl::StrJoin(who, "; ");
  const std::string unique_id(reinterpret_cast<const char*>(id->data()), id->size());
  std::optional<std::string> slots_frame;
  for (uint64_t m : members) {
    const auto rank = std::find(ranked.begin(), ranked.end(), m);
    const uint32_t r = rank == ranked.end() ? 0 : static_cast<uint32_t>(rank - ranked.begin() + 1);
    links_.Send(
        m, Encode(GroupMsg{epoch_, r, static_cast<uint32_t>(nranks), unique_id, members_text}));
    if (r != 0) continue;
    if (!slots_frame) {
      SlotsMsg slots{epoch_, options_.bucket_size, {}};
      for (const std::shared_ptr<void>& slot : slots_) {
        absl::StatusOr<std::string> h = device_.ExportBuffer(slot);
        if (!h.ok()) return fail(h.status());
        slots.handles.push_back(*std::move(h));
      }
      slots_frame = Encode(slots);
    }
    links_.Send(m, *slots_frame);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      backend_.StartCommunicator(device_, *id, nranks, 0);
  if (!comm.ok()) return fail(comm.status());
  comm_ = *std::move(comm);
  MembersWatch watch(links_, members, epoch_, 0);
  absl::Status ready = PollUntil(
      clock_, deadline, nullptr, &watch,
      [&]() -> absl::StatusOr<bool> {
        absl::StatusOr<bool> mine = comm_->Poll();
        if (!mine.ok()) {
          return absl::Status(mine.status().code(), absl::StrFormat("rank 0 (the publisher): %s",
                                                                    mine.status().message()));
        }
        return *mine && watch.NotInitialized().empty();
      },
      [&] {
        std::vector<std::string> late = watch.NotInitialized();
        absl::StatusOr<bool> mine = comm_->Poll();
        if (!mine.ok() || !*mine) late.insert(late.begin(), "rank 0 (the publisher)");
        return absl::StrFormat(
            "not every rank was initialized by the deadline: %s did not report "
            "ready",
            absl::StrJoin(late, ", "));
      });
  if (!ready.ok()) return fail(ready);
  ranks_ = members;
  stats_.rebuilt = true;
  stats_.rebuild = clock_.Now() - start;
  return absl::OkStatus();
}

absl::Status Root::Publish(const Manifest& manifest, absl::Span<const std::byte* const> sources,
                           absl::Time deadline) {
  stats_ = RootStats{};
  const std::vector<uint64_t> members = links_.Alive();
  stats_.replicas = members.size();
  if (members.empty()) return absl::OkStatus();
  const std::string what = absl::StrFormat("%s version %d", options_.display, manifest.version);
  // The bucket buffers first: a rebuild hands them to the replicas on this GPU.
  if (absl::Status s = EnsureSlots(); !s.ok()) {
    GiveUp(members, manifest.version, s);
    return s;
  }
  if (std::optional<std::string> why =
          RebuildReason(epoch_, comm_ != nullptr, ranks_, members, links_)) {
    WB_RETURN_IF_ERROR(Rebuild(members, deadline, *why));
  }
  WB_ASSIGN_OR_RETURN(BucketPlan plan, PlanBucketsFor(manifest, options_.bucket_size));

  // Offer, and wait until every member is receiving.
  const absl::Time offered = clock_.Now();
  const std::string offer =
      Encode(OfferMsg{epoch_, manifest.version, manifest.ToJson(), EncodePlan(plan)});
  for (uint64_t id : members) links_.Send(id, offer);
  MembersWatch watch(links_, members, epoch_, manifest.version);
  absl::Status ready = PollUntil(
      clock_, deadline, comm_.get(), &watch,
      [&]() -> absl::StatusOr<bool> { return watch.NotReady().empty(); },
      [&] {
        return absl::StrFormat(
            "%s was not received by the deadline: %s did not start receiving it (every "
            "subscriber takes part in each version of an nccl:// channel: call Receive, or close "
            "the subscriber); nothing was transferred",
            what, absl::StrJoin(watch.NotReady(), ", "));
      });
  if (!ready.ok()) {
    // A member that is gone or failed leaves the communicator unusable; one that was merely not
    // receiving in time leaves it intact (nobody posted a broadcast: START never went out).
    const bool intact = absl::IsDeadlineExceeded(ready);
    if (intact) {
      const std::string abort =
          Encode(AbortMsg{epoch_, manifest.version, static_cast<uint32_t>(ready.code()),
                          std::string(ready.message())});
      for (uint64_t id : members) links_.Send(id, abort);
      return ready;
    }
    GiveUp(members, manifest.version, ready);
    return absl::Status(ready.code(),
                        absl::StrFormat("%s: before any transfer: %s", what, ready.message()));
  }
  stats_.offer = clock_.Now() - offered;

  // Broadcast.
  const std::string start = Encode(StartMsg{epoch_, manifest.version});
  for (uint64_t id : members) links_.Send(id, start);
  absl::Status sent = BroadcastBuckets(device_, *comm_, clock_, watch, plan, sources, slots_,
                                       deadline, what, &stats_.broadcast);
  if (!sent.ok()) {
    // BroadcastBuckets aborted the communicator.
    comm_.reset();
    GiveUp(members, manifest.version, sent);
    return sent;
  }
  // Every member has every bucket: they may keep the version now (and not before, so that a
  // failed publish leaves every replica with the version it had).
  const std::string commit = Encode(CommitMsg{epoch_, manifest.version});
  for (uint64_t id : members) links_.Send(id, commit);
  return absl::OkStatus();
}

}  // namespace weightbus::internal::nccl
