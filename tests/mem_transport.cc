// SPDX-License-Identifier: Apache-2.0
#include "mem_transport.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <new>
#include <optional>
#include <set>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/cuda/device.h"
#include "core/registry.h"
#include "core/status.h"

namespace weightbus::testing::mem {

using internal::CodecStats;
using internal::Config;
using internal::IncomingVersion;
using internal::LandingSink;
using internal::PublishJob;
using internal::TransportCapabilities;
using internal::TransportPublisher;
using internal::TransportSubscriber;
using internal::Uri;

// One committed version: its manifest and a copy of each tensor's bytes.
struct Entry {
  Manifest manifest;
  std::vector<std::vector<std::byte>> bytes;
};

struct ChannelState {
  std::string name;
  std::map<uint64_t, std::shared_ptr<Entry>> versions;
  bool publisher_live = false;
  std::optional<uint64_t> keep_from;
  std::map<uint64_t, std::set<uint64_t>> receivers;  // version -> subscriber ids that accepted it
  // Test-side controls (MemChannel).
  std::optional<absl::Status> fail_next_publish;
  bool throw_next_publish = false;
  std::deque<uint64_t> deliveries;
  std::optional<CodecStats> publish_codec, fetch_codec;
  std::string read_from;
  std::vector<Seen> published_from, fetched_into;
};

namespace {

// Every channel, and every change to any of them, is guarded by one mutex: waits re-check their
// condition whenever anything changed (`changes`), cancellation included.
absl::Mutex& Mu() {
  static absl::Mutex* mu = new absl::Mutex();
  return *mu;
}
uint64_t changes ABSL_GUARDED_BY(Mu()) = 0;

std::map<std::string, std::shared_ptr<ChannelState>>& Channels()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(Mu()) {
  static auto* channels = new std::map<std::string, std::shared_ptr<ChannelState>>();
  return *channels;
}

std::shared_ptr<ChannelState> Find(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(Mu()) {
  std::shared_ptr<ChannelState>& s = Channels()[name];
  if (s == nullptr) {
    s = std::make_shared<ChannelState>();
    s->name = name;
  }
  return s;
}

// Copies `n` bytes between host and device memory (either side) with a stream of `device`'s, and
// waits: what a transport that moves device memory does with the pointers it is handed.
absl::Status CudaCopy(void* dst, const void* src, uint64_t n, int device, std::string_view what) {
  WB_ASSIGN_OR_RETURN(std::unique_ptr<internal::cuda::Stream> stream,
                      internal::cuda::Stream::Create(device));
  WB_RETURN_IF_ERROR(internal::cuda::CopyAsync(dst, src, n, *stream, what));
  return stream->Synchronize(what);
}

// Waits until `changes` moves past `seen` or `deadline` passes (false).
bool AwaitChange(uint64_t seen, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(Mu()) {
  struct Arg {
    uint64_t seen;
  } arg{seen};
  return Mu().AwaitWithDeadline(
      absl::Condition(
          +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return changes != a->seen; }, &arg),
      deadline);
}

std::string VersionList(const ChannelState& s) {
  std::vector<uint64_t> held;
  for (const auto& [v, e] : s.versions) held.push_back(v);
  return held.empty() ? "none" : absl::StrJoin(held, ", ");
}

// The switches of one channel's settings.
struct Switches {
  bool cancel, committed_manifest, reads_strided_views, copies_with_checksums, keep_versions_from,
      wait_for_receivers, open_version, list_versions, durable, cuda_memory;
  int64_t retention;
  uint64_t link_rate;  // bytes per second a Publish moves at most (0: as fast as memcpy)

  explicit Switches(const Config& c)
      : cancel(c.Bool("cancel")),
        committed_manifest(c.Bool("committed_manifest")),
        reads_strided_views(c.Bool("reads_strided_views")),
        copies_with_checksums(c.Bool("copies_with_checksums")),
        keep_versions_from(c.Bool("keep_versions_from")),
        wait_for_receivers(c.Bool("wait_for_receivers")),
        open_version(c.Bool("open_version")),
        list_versions(c.Bool("list_versions")),
        durable(c.Bool("durable")),
        cuda_memory(c.Bool("cuda_memory")),
        retention(c.Int("retention")),
        link_rate(c.Bytes("link_rate")) {}
};

TransportCapabilities MemCapabilities(const Config& config, const TransportCapabilities&) {
  const Switches s(config);
  TransportCapabilities c;
  c.reads_strided_views = s.reads_strided_views;
  c.copies_with_checksums = s.copies_with_checksums;
  c.committed_manifest = s.committed_manifest;
  c.keep_versions_from = s.keep_versions_from;
  c.wait_for_receivers = s.wait_for_receivers;
  c.open_version = s.open_version;
  c.list_versions = s.list_versions;
  c.cancel = s.cancel;
  c.cross_process = false;  // the channels are this process's memory
  c.durable = s.durable;
  c.late_joiners = true;
  if (s.cuda_memory) {
    c.publish_memory = c.fetch_memory =
        TransportCapabilities::kHostMemory | TransportCapabilities::kCudaMemory;
  }
  return c;
}

absl::StatusOr<std::string> ChannelName(const Uri& uri) {
  if (!uri.authority.empty() || uri.path.size() < 2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "URI \"%s\": mem:// takes a channel name and no host: mem:///NAME", uri.text));
  }
  return uri.path.substr(1);
}

// Cancel() of a publisher or subscriber (with the cancel setting; without it, no effect) and the
// check every later call makes.
class Cancellation {
 public:
  Cancellation(bool enabled, std::string what) : enabled_(enabled), what_(std::move(what)) {}
  void Cancel() {
    if (!enabled_) return;
    absl::MutexLock lock(&Mu());
    cancelled_ = true;
    ++changes;
  }
  absl::Status Check() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(Mu()) {
    if (!cancelled_) return absl::OkStatus();
    return absl::CancelledError(absl::StrFormat("%s was cancelled (it is being destroyed)", what_));
  }

 private:
  const bool enabled_;
  const std::string what_;
  bool cancelled_ ABSL_GUARDED_BY(Mu()) = false;
};

class MemIncoming final : public IncomingVersion {
 public:
  MemIncoming(std::shared_ptr<ChannelState> channel, std::shared_ptr<Entry> entry,
              uint64_t subscriber)
      : channel_(std::move(channel)),
        entry_(std::move(entry)),
        subscriber_(subscriber),
        manifest_(entry_->manifest) {}

  const Manifest& manifest() const override { return manifest_; }

  absl::Status Fetch(absl::Span<std::byte* const> targets, LandingSink& sink,
                     absl::Time deadline) override {
    absl::MutexLock lock(&Mu());
    if (entry_->bytes.size() != manifest_.tensors.size()) {
      return absl::DataLossError(
          absl::StrFormat("mem:///%s version %d: %d tensors stored, %d named", channel_->name,
                          manifest_.version, entry_->bytes.size(), manifest_.tensors.size()));
    }
    channel_->fetched_into.clear();
    for (size_t i = 0; i < targets.size(); ++i) {
      const std::vector<std::byte>& b = entry_->bytes[i];
      if (b.size() != manifest_.tensors[i].nbytes) {
        return absl::DataLossError(absl::StrFormat("%s holds %d bytes, the manifest says %d",
                                                   DescribeSource(i), b.size(),
                                                   manifest_.tensors[i].nbytes));
      }
      const Device device = sink.TargetDevice(i);
      if (targets[i] != nullptr || b.empty()) {
        channel_->fetched_into.push_back(Seen{manifest_.tensors[i].name, targets[i], device});
      }
      if (device.type == DeviceType::kCuda) {
        WB_RETURN_IF_ERROR(
            CudaCopy(targets[i], b.data(), b.size(), device.index,
                     absl::StrFormat("%s into CUDA device %d", DescribeSource(i), device.index)));
      } else if (!b.empty()) {
        std::memcpy(targets[i], b.data(), b.size());
      }
      sink.Landed(i);
    }
    fetch_codec_ = channel_->fetch_codec;
    return absl::OkStatus();
  }

  std::string DescribeSource(size_t i) const override {
    return absl::StrFormat("mem:///%s version %d tensor %d", channel_->name, manifest_.version, i);
  }

  void Accepted() override {
    absl::MutexLock lock(&Mu());
    channel_->receivers[manifest_.version].insert(subscriber_);
    ++changes;
  }

  std::optional<CodecStats> FetchCodecStats() const override { return fetch_codec_; }

 private:
  std::shared_ptr<ChannelState> channel_;
  std::shared_ptr<Entry> entry_;  // kept alive (pinned) while this version is held
  uint64_t subscriber_;
  Manifest manifest_;
  std::optional<CodecStats> fetch_codec_;
};

class MemPublisher final : public TransportPublisher {
 public:
  MemPublisher(std::shared_ptr<ChannelState> channel, Switches switches)
      : channel_(std::move(channel)), switches_(switches) {}

  ~MemPublisher() override {
    absl::MutexLock lock(&Mu());
    channel_->publisher_live = false;
    if (!switches_.durable) {
      channel_->versions.clear();
      channel_->receivers.clear();
      channel_->keep_from.reset();
    }
    ++changes;
  }

  absl::StatusOr<std::optional<uint64_t>> LatestVersion() override {
    absl::MutexLock lock(&Mu());
    if (channel_->versions.empty()) return std::optional<uint64_t>();
    return channel_->versions.rbegin()->first;
  }

  absl::Status Publish(PublishJob& job, absl::Time deadline) override {
    {
      absl::MutexLock lock(&Mu());
      WB_RETURN_IF_ERROR(CheckCancelled());
      if (channel_->fail_next_publish) {
        absl::Status s = *std::move(channel_->fail_next_publish);
        channel_->fail_next_publish.reset();
        return s;
      }
      if (channel_->throw_next_publish) {
        channel_->throw_next_publish = false;
        throw std::bad_alloc();
      }
    }
    auto entry = std::make_shared<Entry>();
    const absl::Span<const internal::PackedTensor> tensors = job.tensors();
    entry->bytes.resize(tensors.size());
    std::vector<Seen> seen;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const uint64_t n = tensors[i].info->nbytes;
      std::vector<std::byte>& dst = entry->bytes[i];
      dst.resize(n);
      seen.push_back(Seen{tensors[i].info->name, tensors[i].data, tensors[i].device});
      if (tensors[i].device.type == DeviceType::kCuda) {  // declared with cuda_memory only
        WB_RETURN_IF_ERROR(
            CudaCopy(dst.data(), tensors[i].data, n, tensors[i].device.index,
                     absl::StrFormat("mem:///%s: tensor \"%s\" from CUDA device %d", channel_->name,
                                     tensors[i].info->name, tensors[i].device.index)));
      } else if (switches_.copies_with_checksums) {
        const internal::CopyTarget piece{dst.data(), n};
        job.CopyWithChecksum(i, {&piece, 1});
      } else if (n > 0) {
        job.CopyRange(i, 0, n, dst.data());  // gathers strided views (data == nullptr)
      }
    }
    WB_ASSIGN_OR_RETURN(const Manifest* sealed, job.SealedManifest(deadline));
    entry->manifest = *sealed;
    if (switches_.link_rate > 0) {
      // The time the bytes would take on the link (a model of bandwidth, not a synchronisation).
      absl::SleepFor(absl::Seconds(static_cast<double>(sealed->total_bytes()) /
                                   static_cast<double>(switches_.link_rate)));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("mem:///%s: version %d was not committed by the deadline", channel_->name,
                          job.version()));
    }
    absl::MutexLock lock(&Mu());
    WB_RETURN_IF_ERROR(CheckCancelled());
    channel_->published_from = std::move(seen);
    channel_->versions[job.version()] = std::move(entry);
    if (switches_.retention > 0) {
      while (static_cast<int64_t>(channel_->versions.size()) > switches_.retention) {
        auto oldest = channel_->versions.begin();
        if (channel_->keep_from && oldest->first >= *channel_->keep_from) break;
        channel_->versions.erase(oldest);  // subscribers holding it keep their copy alive
      }
    }
    ++changes;
    return absl::OkStatus();
  }

  absl::StatusOr<Manifest> CommittedManifest(uint64_t version) override {
    if (!switches_.committed_manifest) return TransportPublisher::CommittedManifest(version);
    absl::MutexLock lock(&Mu());
    auto it = channel_->versions.find(version);
    if (it == channel_->versions.end()) {
      return absl::NotFoundError(absl::StrFormat("mem:///%s: version %d is not held (holds: %s)",
                                                 channel_->name, version, VersionList(*channel_)));
    }
    return it->second->manifest;
  }

  void KeepVersionsFrom(uint64_t version) override {
    if (!switches_.keep_versions_from) return;
    absl::MutexLock lock(&Mu());
    channel_->keep_from = version;
  }

  absl::StatusOr<int> WaitForReceivers(uint64_t version, int count, absl::Time deadline) override {
    if (!switches_.wait_for_receivers) {
      return TransportPublisher::WaitForReceivers(version, count, deadline);
    }
    absl::MutexLock lock(&Mu());
    while (true) {
      WB_RETURN_IF_ERROR(CheckCancelled());
      std::set<uint64_t> have;
      for (auto it = channel_->receivers.lower_bound(version); it != channel_->receivers.end();
           ++it) {
        have.insert(it->second.begin(), it->second.end());
      }
      if (static_cast<int>(have.size()) >= count || !AwaitChange(changes, deadline)) {
        return static_cast<int>(have.size());
      }
    }
  }

  std::optional<CodecStats> LastCodecStats() const override {
    absl::MutexLock lock(&Mu());
    return channel_->publish_codec;
  }

  void Cancel() override { cancellation_.Cancel(); }

 private:
  absl::Status CheckCancelled() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(Mu()) {
    return cancellation_.Check();
  }

  std::shared_ptr<ChannelState> channel_;
  const Switches switches_;
  Cancellation cancellation_{switches_.cancel, "mem:///" + channel_->name + ": the publisher"};
};

class MemSubscriber final : public TransportSubscriber {
 public:
  MemSubscriber(std::string name, Switches switches) : name_(std::move(name)), switches_(switches) {
    static std::atomic<uint64_t> next_id{1};
    id_ = next_id.fetch_add(1);
  }

  absl::StatusOr<std::unique_ptr<IncomingVersion>> WaitForVersion(uint64_t min_version,
                                                                  absl::Time deadline) override {
    absl::MutexLock lock(&Mu());
    while (true) {
      WB_RETURN_IF_ERROR(CheckCancelled());
      std::shared_ptr<ChannelState> c = Source();
      while (!c->deliveries.empty()) {
        const uint64_t v = c->deliveries.front();
        c->deliveries.pop_front();
        if (auto it = c->versions.find(v); it != c->versions.end()) return Open(c, it->second);
      }
      if (!c->versions.empty() && c->versions.rbegin()->first >= min_version) {
        return Open(c, c->versions.rbegin()->second);
      }
      if (!AwaitChange(changes, deadline)) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "mem:///%s: no version >= %d by the deadline (newest committed: %s)", name_,
            min_version,
            c->versions.empty() ? "none" : std::to_string(c->versions.rbegin()->first)));
      }
    }
  }

  absl::StatusOr<std::unique_ptr<IncomingVersion>> OpenVersion(uint64_t version,
                                                               absl::Time deadline) override {
    if (!switches_.open_version) return TransportSubscriber::OpenVersion(version, deadline);
    absl::MutexLock lock(&Mu());
    WB_RETURN_IF_ERROR(CheckCancelled());
    std::shared_ptr<ChannelState> c = Source();
    auto it = c->versions.find(version);
    if (it == c->versions.end()) {
      return absl::NotFoundError(absl::StrFormat("mem:///%s: version %d is not held (holds: %s)",
                                                 name_, version, VersionList(*c)));
    }
    return Open(c, it->second);
  }

  absl::StatusOr<std::vector<uint64_t>> ListVersions() override {
    if (!switches_.list_versions) return TransportSubscriber::ListVersions();
    absl::MutexLock lock(&Mu());
    WB_RETURN_IF_ERROR(CheckCancelled());
    std::vector<uint64_t> out;
    for (const auto& [v, e] : Source()->versions) out.push_back(v);
    return out;
  }

  void Cancel() override { cancellation_.Cancel(); }

 private:
  // The channel this subscriber reads now (MemChannel::ReadFrom).
  std::shared_ptr<ChannelState> Source() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(Mu()) {
    std::shared_ptr<ChannelState> own = Find(name_);
    return own->read_from.empty() ? own : Find(own->read_from);
  }
  std::unique_ptr<IncomingVersion> Open(std::shared_ptr<ChannelState> c,
                                        std::shared_ptr<Entry> e) const {
    return std::make_unique<MemIncoming>(std::move(c), std::move(e), id_);
  }
  absl::Status CheckCancelled() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(Mu()) {
    return cancellation_.Check();
  }

  std::string name_;
  const Switches switches_;
  uint64_t id_ = 0;
  Cancellation cancellation_{switches_.cancel, "mem:///" + name_ + ": the subscriber"};
};

absl::StatusOr<std::unique_ptr<TransportPublisher>> OpenMemPublisher(const Uri& uri,
                                                                     const Config& config) {
  WB_ASSIGN_OR_RETURN(std::string name, ChannelName(uri));
  const Switches switches(config);
  if (switches.retention < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: setting retention=%d is outside 0..",
                                                      uri.Display(), switches.retention));
  }
  absl::MutexLock lock(&Mu());
  std::shared_ptr<ChannelState> c = Find(name);
  if (c->publisher_live) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: the channel already has a live publisher", uri.Display()));
  }
  c->publisher_live = true;
  return std::make_unique<MemPublisher>(std::move(c), switches);
}

absl::StatusOr<std::unique_ptr<TransportSubscriber>> OpenMemSubscriber(const Uri& uri,
                                                                       const Config& config) {
  WB_ASSIGN_OR_RETURN(std::string name, ChannelName(uri));
  return std::make_unique<MemSubscriber>(std::move(name), Switches(config));
}

}  // namespace

const internal::SettingTable& MemSettings() {
  using internal::SettingType;
  static const internal::SettingTable* table = new internal::SettingTable{
      "mem",
      {
          {"cancel", SettingType::kBool, "true",
           "Cancel() wakes calls waiting in the transport (false: they run to their deadline)"},
          {"committed_manifest", SettingType::kBool, "true",
           "CommittedManifest reads back a held version's manifest"},
          {"reads_strided_views", SettingType::kBool, "true",
           "Publish gathers strided views itself (false: the core packs them)"},
          {"copies_with_checksums", SettingType::kBool, "true",
           "Publish copies with PublishJob::CopyWithChecksum"},
          {"keep_versions_from", SettingType::kBool, "true",
           "KeepVersionsFrom keeps a floor beyond retention"},
          {"wait_for_receivers", SettingType::kBool, "true",
           "WaitForReceivers counts the subscribers that accepted a version"},
          {"open_version", SettingType::kBool, "true", "OpenVersion opens an exact held version"},
          {"list_versions", SettingType::kBool, "true", "ListVersions lists the held versions"},
          {"durable", SettingType::kBool, "true",
           "versions outlive their publisher (false: cleared when it closes, as on ucx://)"},
          {"retention", SettingType::kInt, "0", "versions kept (0: all)"},
          {"cuda_memory", SettingType::kBool, "false",
           "declare kCudaMemory (publish_memory, fetch_memory): CUDA tensors reach Publish and "
           "Fetch as device pointers, copied with CUDA (needs a GPU)"},
          {"link_rate", SettingType::kBytes, "0",
           "a slow link: Publish takes at least the version's bytes / this many bytes per "
           "second (0: no limit), for the delta layer's choice on a low-bandwidth path"},
      }};
  return *table;
}

MemChannel::MemChannel(const std::string& name) {
  absl::MutexLock lock(&Mu());
  state_ = Find(name);
}

std::vector<uint64_t> MemChannel::Versions() const {
  absl::MutexLock lock(&Mu());
  std::vector<uint64_t> out;
  for (const auto& [v, e] : state_->versions) out.push_back(v);
  return out;
}

Manifest MemChannel::ManifestOf(uint64_t version) const {
  absl::MutexLock lock(&Mu());
  return state_->versions.at(version)->manifest;
}

void MemChannel::CorruptByte(uint64_t version, size_t tensor, uint64_t offset, std::byte mask) {
  absl::MutexLock lock(&Mu());
  state_->versions.at(version)->bytes.at(tensor).at(offset) ^= mask;
  ++changes;
}

void MemChannel::EditManifest(uint64_t version, const std::function<void(Manifest&)>& edit) {
  absl::MutexLock lock(&Mu());
  edit(state_->versions.at(version)->manifest);
  ++changes;
}

void MemChannel::FailNextPublish(absl::Status status) {
  absl::MutexLock lock(&Mu());
  state_->fail_next_publish = std::move(status);
}

void MemChannel::ThrowNextPublish() {
  absl::MutexLock lock(&Mu());
  state_->throw_next_publish = true;
}

void MemChannel::DeliverNext(std::vector<uint64_t> versions) {
  absl::MutexLock lock(&Mu());
  state_->deliveries.assign(versions.begin(), versions.end());
  ++changes;
}

void MemChannel::ReportCodecStats(internal::CodecStats publish, internal::CodecStats fetch) {
  absl::MutexLock lock(&Mu());
  state_->publish_codec = publish;
  state_->fetch_codec = fetch;
}

std::vector<Seen> MemChannel::PublishedFrom() const {
  absl::MutexLock lock(&Mu());
  return state_->published_from;
}

std::vector<Seen> MemChannel::FetchedInto() const {
  absl::MutexLock lock(&Mu());
  return state_->fetched_into;
}

void MemChannel::ReadFrom(const std::string& target) {
  absl::MutexLock lock(&Mu());
  state_->read_from = target;
  ++changes;
}

}  // namespace weightbus::testing::mem

WEIGHTBUS_REGISTER_TRANSPORT(
    mem, (::weightbus::internal::TransportDescriptor{
             "mem",
             "tests only: channels in this process's memory, every optional capability "
             "switchable (tests/mem_transport.h)",
             &::weightbus::testing::mem::MemSettings(), ::weightbus::testing::mem::OpenMemPublisher,
             ::weightbus::testing::mem::OpenMemSubscriber, /*wrap_publisher=*/nullptr,
             /*wrap_subscriber=*/nullptr, ::weightbus::testing::mem::MemCapabilities}))
