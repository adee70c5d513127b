// SPDX-License-Identifier: Apache-2.0
// The delta layer over a publisher group, subscribing side (README.md, "Over a publisher
// group"): each rank's chain is planned and decoded by a delta subscriber of its own, over a
// view of the group versions beneath that shows only that rank's part (RankPart); the version
// handed to the core is the group version of the original parts, which the core assembles
// (whole or resharded) and verifies as it does without the layer.
#include <algorithm>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/buffer.h"
#include "core/status.h"
#include "transports/delta/delta_transport.h"

namespace weightbus::internal::delta {
namespace {

// Forwards the landings of one tensor (or of one rank's tensors) to the core's sink under their
// index there; tensors without a target there (the core does not need them) land nowhere.
class MappedSink final : public LandingSink {
 public:
  MappedSink(LandingSink& to, std::vector<std::optional<size_t>> map)
      : to_(to), map_(std::move(map)) {}
  void Landed(size_t i) override {
    if (i < map_.size() && map_[i]) to_.Landed(*map_[i]);
  }
  void LandedPrefix(size_t i, uint64_t bytes) override {
    if (i < map_.size() && map_[i]) to_.LandedPrefix(*map_[i], bytes);
  }

 private:
  LandingSink& to_;
  std::vector<std::optional<size_t>> map_;
};

// Rank `rank`'s part of a group version beneath: one blob.
class RankIncoming final : public IncomingVersion {
 public:
  RankIncoming(std::shared_ptr<IncomingVersion> group, Manifest part, size_t blob)
      : group_(std::move(group)), part_(std::move(part)), blob_(blob) {}
  const Manifest& manifest() const override { return part_; }
  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override {
    std::vector<std::byte*> all(group_->manifest().tensors.size(), nullptr);
    all[blob_] = targets.empty() ? nullptr : targets[0];
    std::vector<std::optional<size_t>> map(all.size());
    map[blob_] = 0;
    MappedSink mapped(sink, std::move(map));
    return group_->Fetch(all, mapped, deadline);
  }
  std::string DescribeSource(size_t) const override { return group_->DescribeSource(blob_); }
  // The group version beneath is accepted once, with every rank's part (GroupIncoming).

 private:
  std::shared_ptr<IncomingVersion> group_;
  Manifest part_;
  size_t blob_;
};

class RankView final : public TransportSubscriber {
 public:
  RankView(TransportSubscriber* inner, int rank, std::unique_ptr<TransportSubscriber> owned)
      : inner_(inner), owned_(std::move(owned)), rank_(rank) {}

  // The group version being planned: opened again (OpenVersion of its number) without asking
  // the transport beneath, until cleared.
  void Preset(std::shared_ptr<IncomingVersion> group) { preset_ = std::move(group); }

  absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                  absl::Time deadline) override {
    WB_ASSIGN_OR_RETURN(std::unique_ptr<IncomingVersion> got,
                        inner_->WaitForVersion(min_version, deadline));
    return View(std::move(got));
  }
  absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenVersion(uint64_t version,
                                                               absl::Time deadline) override {
    if (preset_ && preset_->manifest().version == version) return View(preset_);
    WB_ASSIGN_OR_RETURN(std::unique_ptr<IncomingVersion> got,
                        inner_->OpenVersion(version, deadline));
    return View(std::move(got));
  }
  absl::StatusOr<std::vector<uint64_t>> ListVersions() override { return inner_->ListVersions(); }
  void Cancel() override { inner_->Cancel(); }

 private:
  absl::StatusOr<std::unique_ptr<IncomingVersion>> View(std::shared_ptr<IncomingVersion> group) {
    const Manifest& m = group->manifest();
    const std::string source = absl::StrFormat("version %d, rank %d's part", m.version, rank_);
    if (!m.group) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: version %d was published by a single publisher, not by a group whose rank %d "
          "this chain belongs to",
          source, m.version, rank_));
    }
    WB_ASSIGN_OR_RETURN(Manifest part, RankPart(m, rank_, source));
    const std::string blob = RankBlobName(rank_);
    size_t index = 0;
    while (m.tensors[index].name != blob || m.tensors[index].owner != rank_) ++index;
    return std::unique_ptr<IncomingVersion>(
        new RankIncoming(std::move(group), std::move(part), index));
  }

  TransportSubscriber* inner_;
  std::unique_ptr<TransportSubscriber> owned_;
  int rank_;
  std::shared_ptr<IncomingVersion> preset_;
};

// A group version as the core receives it: every rank's parts, each reconstructed by its rank's
// delta subscriber.
class GroupIncoming final : public IncomingVersion {
 public:
  GroupIncoming(std::shared_ptr<IncomingVersion> group,
                std::vector<std::unique_ptr<IncomingVersion>> ranks)
      : group_(std::move(group)), ranks_(std::move(ranks)) {
    const Manifest& g = group_->manifest();
    manifest_.version = g.version;
    manifest_.group = true;
    manifest_.publisher = g.publisher;
    manifest_.publish_start_unix_ns = g.publish_start_unix_ns;
    manifest_.sealed_unix_ns = g.sealed_unix_ns;
    for (const auto& [key, value] : g.metadata) {
      if (!IsRankRecordKey(key) && key != kRecordKey && key != kLayerMetadataKey) {
        manifest_.metadata.emplace(key, value);
      }
    }
    for (size_t r = 0; r < ranks_.size(); ++r) {
      first_.push_back(manifest_.tensors.size());
      for (TensorInfo t : ranks_[r]->manifest().tensors) {
        t.owner = static_cast<int>(r);
        manifest_.tensors.push_back(std::move(t));
      }
    }
    first_.push_back(manifest_.tensors.size());
  }

  const Manifest& manifest() const override { return manifest_; }

  // Every rank's parts are decoded (a rank's chain needs all of them as its next base); those the
  // core does not need go to scratch memory, released with this object.
  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override {
    scratch_.clear();
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const std::vector<TensorInfo>& tensors = ranks_[r]->manifest().tensors;
      uint64_t missing = 0;
      for (size_t j = 0; j < tensors.size(); ++j) {
        if (targets[first_[r] + j] == nullptr) missing += AlignUp(tensors[j].nbytes);
      }
      std::unique_ptr<HostBuffer> scratch;
      if (missing > 0) {
        WB_ASSIGN_OR_RETURN(scratch, HostBuffer::Allocate(missing));
      }
      std::vector<std::byte*> local(tensors.size());
      std::vector<std::optional<size_t>> map(tensors.size());
      uint64_t at = 0;
      for (size_t j = 0; j < tensors.size(); ++j) {
        const size_t i = first_[r] + j;
        if (targets[i] != nullptr) {
          local[j] = targets[i];
          map[j] = i;
        } else if (tensors[j].nbytes > 0) {
          local[j] = scratch->data() + at;
          at += AlignUp(tensors[j].nbytes);
        }
      }
      if (scratch) scratch_.push_back(std::move(scratch));
      MappedSink mapped(sink, std::move(map));
      WB_RETURN_IF_ERROR(ranks_[r]->Fetch(local, mapped, deadline));
    }
    return absl::OkStatus();
  }

  // Partial reads: each rank's delta subscriber decodes only the chunks of its parts that the
  // ranges meet (none, and reads no blob, when they meet none of its parts).
  void PlanRanges(absl::Span<const RangeRead> reads) override {
    const std::vector<std::vector<RangeRead>> by_rank = ByRank(reads);
    for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->PlanRanges(by_rank[r]);
  }
  absl::Status FetchRanges(absl::Span<const RangeRead> reads, absl::Time deadline) override {
    // Every rank, even with nothing to read here: its first call decodes (or, needing nothing,
    // skips) its version, which it then adopts when the version is accepted.
    const std::vector<std::vector<RangeRead>> by_rank = ByRank(reads);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      WB_RETURN_IF_ERROR(ranks_[r]->FetchRanges(by_rank[r], deadline));
    }
    return absl::OkStatus();
  }

  std::string DescribeSource(size_t i) const override {
    const size_t r = std::upper_bound(first_.begin(), first_.end(), i) - first_.begin() - 1;
    return absl::StrFormat("rank %d's part: %s", r, ranks_[r]->DescribeSource(i - first_[r]));
  }

  void Accepted() override {
    for (auto& rank : ranks_) rank->Accepted();
    group_->Accepted();
  }

  std::optional<CodecStats> FetchCodecStats() const override {
    CodecStats total;
    std::vector<std::string> how;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      std::optional<CodecStats> c = ranks_[r]->FetchCodecStats();
      if (!c) return std::nullopt;
      total.time += c->time;
      total.wire_bytes += c->wire_bytes;
      how.push_back(absl::StrFormat("rank %d: %s", r, c->encoding));
    }
    total.encoding = absl::StrJoin(how, "; ");
    return total;
  }

 private:
  static uint64_t AlignUp(uint64_t n) { return (n + 63) & ~uint64_t{63}; }

  // `reads` of the group's tensors split by the rank that owns them, as indices of its parts.
  std::vector<std::vector<RangeRead>> ByRank(absl::Span<const RangeRead> reads) const {
    std::vector<std::vector<RangeRead>> out(ranks_.size());
    for (RangeRead read : reads) {
      const size_t r =
          std::upper_bound(first_.begin(), first_.end(), read.tensor) - first_.begin() - 1;
      read.tensor -= first_[r];
      out[r].push_back(read);
    }
    return out;
  }

  std::shared_ptr<IncomingVersion> group_;
  std::vector<std::unique_ptr<IncomingVersion>> ranks_;
  Manifest manifest_;
  std::vector<size_t> first_;  // index of each rank's first tensor in manifest_, then the end
  std::vector<std::unique_ptr<HostBuffer>> scratch_;
};

class GroupReceiverImpl final : public GroupReceiver {
 public:
  GroupReceiverImpl(std::string uri, TransportSubscriber* inner, std::shared_ptr<Parallel> parallel,
                    BackChannel requests)
      : uri_(std::move(uri)),
        inner_(inner),
        parallel_(std::move(parallel)),
        requests_(std::move(requests)) {}

  absl::StatusOr<std::unique_ptr<IncomingVersion>> Plan(std::unique_ptr<IncomingVersion> incoming,
                                                        absl::Time deadline) override {
    std::shared_ptr<IncomingVersion> group(std::move(incoming));
    const Manifest& m = group->manifest();
    const int world = m.publisher.world_size;
    if (world < 1) {
      return absl::DataLossError(
          absl::StrFormat("%s: group version %d has world_size %d", uri_, m.version, world));
    }
    if (static_cast<size_t>(world) != ranks_.size()) {
      // Another group (or the first): each rank's chain starts afresh.
      views_.clear();
      ranks_.clear();
      for (int r = 0; r < world; ++r) {
        auto view = std::make_unique<RankView>(inner_, r, nullptr);
        views_.push_back(view.get());
        ranks_.push_back(NewRankSubscriber(absl::StrFormat("%s (rank %d)", uri_, r),
                                           std::move(view), parallel_, requests_));
      }
    }
    std::vector<std::unique_ptr<IncomingVersion>> parts;
    for (int r = 0; r < world; ++r) {
      views_[r]->Preset(group);
      absl::StatusOr<std::unique_ptr<IncomingVersion>> part =
          ranks_[r]->OpenVersion(m.version, deadline);
      views_[r]->Preset(nullptr);
      if (!part.ok()) return part.status();
      parts.push_back(*std::move(part));
    }
    return std::unique_ptr<IncomingVersion>(new GroupIncoming(std::move(group), std::move(parts)));
  }

 private:
  std::string uri_;
  TransportSubscriber* inner_;
  std::shared_ptr<Parallel> parallel_;
  BackChannel requests_;
  std::vector<RankView*> views_;  // owned by ranks_
  std::vector<std::unique_ptr<TransportSubscriber>> ranks_;
};

}  // namespace

std::unique_ptr<TransportSubscriber> NewRankView(TransportSubscriber* inner, int rank,
                                                 std::unique_ptr<TransportSubscriber> owned) {
  return std::make_unique<RankView>(inner, rank, std::move(owned));
}

std::unique_ptr<GroupReceiver> NewGroupReceiver(std::string uri, TransportSubscriber* inner,
                                                std::shared_ptr<Parallel> parallel,
                                                BackChannel requests) {
  return std::make_unique<GroupReceiverImpl>(std::move(uri), inner, std::move(parallel),
                                             std::move(requests));
}

}  // namespace weightbus::internal::delta
