// SPDX-License-Identifier: Apache-2.0
// Publisher: validates and packs tensors, checksums them concurrently with the transport's
// work, and enforces monotonic versions. Transport-neutral.
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/buffer.h"
#include "core/call_gate.h"
#include "core/channel_setup.h"
#include "core/checksum.h"
#include "core/content.h"
#include "core/cuda/device.h"
#include "core/device_routing.h"
#include "core/failpoint.h"
#include "core/registry.h"
#include "core/spool.h"
#include "core/status.h"
#include "core/system.h"
#include "core/tensor_pack.h"
#include "core/utf8.h"
#include "core/worker_pool.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {

using internal::PackedTensor;

namespace {

// Copies with non-temporal stores where the CPU has them: staged bytes are read next by other
// processes or devices, not by this core, so they need not displace the cache.
void StreamCopy(std::byte* dst, const std::byte* src, size_t n) {
#if defined(__SSE2__)
  if (n >= 4096) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t body = n & ~size_t{63};
    for (size_t k = 0; k < body; k += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 48), d);
    }
    dst += body;
    src += body;
    n -= body;
  }
#endif
  if (n > 0) std::memcpy(dst, src, n);
}

// The core's side of one Publish: the manifest under construction and the packed bytes.
// Checksums come from one of two places: a separate pass over the caller's bytes on the hashing
// pool, started with the job (StartHashing), or, for transports that stage the bytes
// (declaring copies_with_checksums), the copy itself (CopyWithChecksum), which then reads them only
// once.
class Job final : public internal::PublishJob {
 public:
  uint64_t version() const override { return manifest_.version; }
  absl::Span<const PackedTensor> tensors() const override { return packed_; }

  absl::StatusOr<const Manifest*> SealedManifest(absl::Time deadline) override {
    // Tensors the transport did not checksum as it copied or gathered them.
    if (copy_mode_ || deferred_) HashUnclaimed();
    if (!hashing_.WaitUntilZero(deadline)) {
      return absl::DeadlineExceededError(
          absl::StrFormat("version %d: checksums of %d tensors not finished by the deadline",
                          manifest_.version, manifest_.tensors.size()));
    }
    // A checksum that could not be computed (on a CUDA device) leaves the manifest unsealed.
    WB_RETURN_IF_ERROR(HashStatus());
    ApplyChecksums();
    if (manifest_.sealed_unix_ns == 0) manifest_.sealed_unix_ns = absl::ToUnixNanos(absl::Now());
    // A shared-secret channel: the MAC over the sealed manifest, which subscribers check before
    // accepting any byte of the version, whatever the transport beneath (core/secret.h).
    if (key_ != nullptr) {
      manifest_.metadata[std::string(internal::kMacMetadataKey)] =
          internal::ManifestMac(*key_, manifest_);
    }
    return &manifest_;
  }

  void CopyWithChecksum(size_t i, absl::Span<const internal::CopyTarget> pieces) override {
    StageWithChecksum(i, pieces, [](size_t) {});
  }

  void StageWithChecksum(size_t i, absl::Span<const internal::CopyTarget> pieces,
                         absl::FunctionRef<void(size_t)> copied) override {
    // Whoever claims a tensor first computes its checksum.
    const bool hash = !claimed_[i].exchange(true);
    std::optional<internal::TensorHasher> state;
    if (hash) state.emplace(manifest_.tensors[i].nbytes, ChecksumGrid(i));
    const std::byte* src = packed_[i].data;
    uint64_t at = 0;  // bytes of the tensor copied so far
    for (size_t k = 0; k < pieces.size(); ++k) {
      const internal::CopyTarget& p = pieces[k];
      for (uint64_t off = 0; off < p.size; off += kBlock) {
        const uint64_t n = std::min(kBlock, p.size - off);
        if (src != nullptr) {
          StreamCopy(p.data + off, src + at, n);
          if (state) state->Update(src + at, n);
        } else {  // a strided view, gathered straight into place (then hashed from cache)
          CopyRange(i, at, n, p.data + off);
          if (state) state->Update(p.data + off, n);
        }
        at += n;
      }
#if defined(__SSE2__)
      _mm_sfence();  // streaming stores visible before the transport says the piece is there
#endif
      copied(k);
    }
    if (state) SetChecksum(i, state->Finish());
  }

  std::optional<Manifest> UnsealedManifest() const override {
    // Checksums are kept aside (sums_) until SealedManifest, so manifest_ does not change while
    // copies or the hashing pool compute them: a copy of it is the manifest without them.
    Manifest m = manifest_;
    for (TensorInfo& t : m.tensors) {
      t.xxh3 = 0;
      t.block_bytes = 0;
      t.block_xxh3.clear();
    }
    m.sealed_unix_ns = 0;
    m.metadata.erase(std::string(internal::kMacMetadataKey));
    return m;
  }

  void CopyRange(size_t i, uint64_t offset, uint64_t size, std::byte* dst) const override {
    if (size == 0) return;
    if (packed_[i].data != nullptr) {
      std::memcpy(dst, packed_[i].data + offset, size);
      return;
    }
    if (spool_ != nullptr) {  // a streamed version, read back from its spool file
      if (absl::Status s = spool_->Read(i, offset, size, dst); !s.ok()) {
        absl::MutexLock lock(&read_mu_);
        if (read_status_.ok()) read_status_ = s;
      }
      return;
    }
    const TensorView& v = *views_[i];
    internal::PackStridedRange(v.data, DTypeSize(v.dtype), v.shape, v.strides, offset, size, dst);
  }

  // Prepares the job: queues one checksum task per tensor on `pool`, largest first so the long
  // ones start early, unless the transport will compute them while copying (`copy_mode`).
  // Unpacked strided views (data == nullptr) are left to the transport, which checksums them as
  // it gathers them (ClaimChecksum), so their strides are walked once, not twice.
  void StartHashing(internal::WorkerPool& pool, bool copy_mode) {
    pool_ = &pool;
    copy_mode_ = copy_mode;
    claimed_ = std::vector<std::atomic<bool>>(packed_.size());
    HashDeviceTensors();
    if (spool_ != nullptr) {  // checksummed as they were added: nothing left to hash
      for (std::atomic<bool>& c : claimed_) c = true;
      copy_mode_ = false;
      return;
    }
    if (copy_mode_) return;
    for (size_t i = 0; i < packed_.size(); ++i) {
      if (packed_[i].data == nullptr && manifest_.tensors[i].nbytes > 0) deferred_ = true;
    }
    HashUnclaimed(/*skip_strided=*/true);
  }

  bool ClaimChecksum(size_t i) override { return !claimed_[i].exchange(true); }
  void SetChecksum(size_t i, internal::TensorChecksums checksums) override {
    sums_[i] = std::move(checksums);
  }
  // Sizes the checksums kept aside until SealedManifest (one per tensor of manifest_).
  void PrepareChecksums() { sums_.resize(manifest_.tensors.size()); }
  // Moves the checksums into the manifest (once; every checksum is known).
  void ApplyChecksums() {
    if (applied_) return;
    applied_ = true;
    for (size_t i = 0; i < sums_.size() && i < manifest_.tensors.size(); ++i) {
      TensorInfo& t = manifest_.tensors[i];
      internal::TensorChecksums& c = sums_[i];
      t.xxh3 = c.xxh3;
      // Format 1's 1-D blocks are never written: a grid with tiles is recorded as tiles.
      t.block_bytes = c.grid.has_tiles() ? c.grid.tile_bytes : 0;
      t.block_rows = c.grid.has_tiles() ? c.grid.tile_rows : 0;
      t.block_xxh3 = std::move(c.blocks);
    }
  }
  internal::TileGrid ChecksumGrid(size_t i) const override {
    const TensorInfo& t = manifest_.tensors[i];
    return internal::ChooseTiles(t.dtype, t.shape, t.nbytes, checksum_block_);
  }

  // Checksum tasks read the caller's memory: Publish never returns before they end.
  void WaitHashingDone() { hashing_.WaitUntilZero(absl::InfiniteFuture()); }

  // The first error computing a checksum on a CUDA device.
  absl::Status HashStatus() const {
    absl::MutexLock lock(&read_mu_);
    return hash_status_;
  }

  Manifest manifest_;
  std::vector<PackedTensor> packed_;
  std::vector<const TensorView*> views_;  // the caller's views, for gathering strided ones
  std::unique_ptr<internal::HostBuffer> pack_buffer_;
  // Held until Publish returns: strided CUDA views packed on their devices (for a transport that
  // reads device memory), and the pinned host copy of CUDA tensors (for one that does not).
  std::vector<std::unique_ptr<internal::cuda::DeviceBuffer>> device_packs_;
  std::shared_ptr<internal::HostBuffer> cuda_staging_;
  const internal::ChannelKey* key_ = nullptr;  // the channel's, when it has a shared secret
  // A streamed version's bytes (PublishStream), read back with CopyRange where data is nullptr.
  internal::TensorSpool* spool_ = nullptr;

  // The first failure reading a spool back (the transport's CopyRange cannot return one).
  absl::Status ReadStatus() const {
    absl::MutexLock lock(&read_mu_);
    return read_status_;
  }
  uint64_t checksum_block_ = 0;  // setting checksum_block: the largest tile (0: no tiles)

 private:
  static constexpr uint64_t kBlock = 256 * 1024;  // copied or gathered, then hashed from L2

  // Tensors in device memory (handed to a transport that reads it) are checksummed there, one
  // task per device, as the transport works (docs/FORMAT.md, "Checksums of device memory").
  void HashDeviceTensors() {
    std::map<int, std::vector<size_t>> by_device;
    for (size_t i = 0; i < packed_.size(); ++i) {
      if (packed_[i].device.type != DeviceType::kCuda) continue;
      claimed_[i] = true;
      by_device[packed_[i].device.index].push_back(i);
    }
    hashing_.Add(static_cast<int>(by_device.size()));
    for (auto& [device, list] : by_device) {
      pool_->Submit([this, device = device, list = std::move(list)] {
        std::vector<internal::cuda::DeviceBytes> bytes;
        std::vector<internal::TileGrid> grids;
        bytes.reserve(list.size());
        for (size_t i : list) {
          bytes.push_back({packed_[i].data, manifest_.tensors[i].nbytes});
          grids.push_back(ChecksumGrid(i));
        }
        absl::StatusOr<std::vector<internal::TensorChecksums>> sums =
            internal::cuda::Checksum(bytes, grids, device);
        if (sums.ok()) {
          for (size_t k = 0; k < list.size(); ++k) SetChecksum(list[k], std::move((*sums)[k]));
        } else {
          absl::MutexLock lock(&read_mu_);
          if (hash_status_.ok()) {
            hash_status_ = internal::Annotate(
                sums.status(), absl::StrFormat("version %d: checksums of %d tensors on CUDA "
                                               "device %d (first: \"%s\")",
                                               manifest_.version, list.size(), device,
                                               manifest_.tensors[list.front()].name));
          }
        }
        hashing_.Done();
      });
    }
  }

  void HashUnclaimed(bool skip_strided = false) {
    std::vector<size_t> order;
    for (size_t i = 0; i < packed_.size(); ++i) {
      if (skip_strided && packed_[i].data == nullptr && manifest_.tensors[i].nbytes > 0) continue;
      if (!claimed_[i].exchange(true)) order.push_back(i);
    }
    std::sort(order.begin(), order.end(), [this](size_t a, size_t b) {
      return manifest_.tensors[a].nbytes > manifest_.tensors[b].nbytes;
    });
    hashing_.Add(static_cast<int>(order.size()));
    for (size_t i : order) {
      pool_->Submit([this, i] {
        const uint64_t n = manifest_.tensors[i].nbytes;
        if (packed_[i].data != nullptr || n == 0) {
          SetChecksum(i, internal::ChecksumTensor(packed_[i].data, n, ChecksumGrid(i)));
        } else {  // a strided view: gathered block by block into a small scratch buffer
          std::vector<std::byte> scratch(std::min(kBlock, n));
          internal::TensorHasher state(n, ChecksumGrid(i));
          for (uint64_t at = 0; at < n; at += kBlock) {
            const uint64_t len = std::min(kBlock, n - at);
            CopyRange(i, at, len, scratch.data());
            state.Update(scratch.data(), len);
          }
          SetChecksum(i, state.Finish());
        }
        hashing_.Done();
      });
    }
  }

  mutable absl::Mutex read_mu_;
  mutable absl::Status read_status_ ABSL_GUARDED_BY(read_mu_);
  absl::Status hash_status_ ABSL_GUARDED_BY(read_mu_);
  internal::WorkerPool* pool_ = nullptr;
  bool copy_mode_ = false;
  bool deferred_ = false;  // strided views left for the transport to checksum
  std::vector<std::atomic<bool>> claimed_;
  internal::TaskCounter hashing_;
  // Each tensor's checksums as they are computed (SetChecksum), moved into manifest_ when it is
  // sealed: until then manifest_ is read concurrently (UnsealedManifest) and never written.
  std::vector<internal::TensorChecksums> sums_;
  bool applied_ = false;
};

}  // namespace

// What a PublishStream and its Publisher share: the Publisher clears `owner` when it is
// destroyed, after which the stream's calls return Cancelled.
// Lock order: a stream's `mu` before its Publisher's.
struct StreamLink {
  explicit StreamLink(Publisher::Impl* publisher) : owner(publisher) {}
  absl::Mutex mu;
  Publisher::Impl* owner ABSL_GUARDED_BY(mu) = nullptr;
};

class Publisher::Impl : public internal::ChannelSetup {
 public:
  std::unique_ptr<internal::TransportPublisher> backend;
  std::unique_ptr<internal::CallGate> gate;
  PublisherIdentity identity;

  mutable absl::Mutex mu;
  std::optional<uint64_t> latest ABSL_GUARDED_BY(mu);
  PublishStats stats ABSL_GUARDED_BY(mu);
  // The manifest of this object's last successful Publish (its tensors, for retries).
  std::optional<Manifest> last_manifest ABSL_GUARDED_BY(mu);
  // The open PublishStream's link, if any (a Publisher has at most one).
  std::shared_ptr<StreamLink> stream ABSL_GUARDED_BY(mu);
  std::optional<uint64_t> stream_version ABSL_GUARDED_BY(mu);

  // Host copies of CUDA tensors for a transport that reads host memory only: pinned once, reused
  // by the next publishes (a trainer publishes the same sizes every step).
  std::shared_ptr<internal::BufferPool> cuda_staging_pool = internal::BufferPool::Create(1);

  absl::Status Publish(uint64_t version, absl::Span<const TensorView> tensors,
                       const Metadata& metadata, absl::Duration timeout, void* cuda_stream);
  // Hands the job's CUDA tensors (tensors[i] with a kCuda device) over by what the stack reads
  // (publish_memory): their device pointers (strided views packed on their device first), or
  // copies in pinned host memory. Waits for the caller's `cuda_stream` first, and for every
  // copy and kernel it queued before it returns. Errors name the tensor: NotBuilt, those of
  // cuda::CheckDevicePointer, ResourceExhausted, Internal with CUDA's error.
  absl::Status PrepareCudaTensors(Job& job, absl::Span<const TensorView> tensors, void* cuda_stream,
                                  const std::string& where);
  // FailedPrecondition when `version` is below the channel's latest, naming both.
  absl::Status CheckVersion(uint64_t version) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // InvalidArgument for a reserved metadata key or one that is not valid UTF-8.
  absl::Status CheckMetadata(uint64_t version, const Metadata& metadata) const;
  // The largest tile of a new version's block checksums (setting checksum_block; 0: none;
  // core/tiles.h ChooseTiles cuts each tensor). Block checksums serve readers of byte ranges;
  // through a layer (delta) they go into its records, so that a subscriber decoding only the
  // chunks its slices meet verifies the tiles it reads.
  uint64_t ChecksumBlock() const { return config->Bytes("checksum_block"); }
  // The manifest of a new job for `version`, without tensors.
  Manifest NewManifest(uint64_t version, const Metadata& metadata, absl::Time start) const;
  // Hands a built job to the transport (to Republish for the latest version) and records its
  // figures; `start` is when the caller's call began, `pack_time` what packing took.
  absl::Status PublishBuiltJob(Job& job, absl::Time start, absl::Duration pack_time,
                               absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Publish of the version the channel already has as its latest: OK, writing nothing, when
  // `job` holds the same tensors; FailedPrecondition naming the first difference otherwise.
  absl::Status Republish(Job& job, absl::Time start, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

namespace {

// The manifest entry of `view`, validated as Publish validates each tensor (`stream`: for a
// PublishStream, whose CUDA tensors must be contiguous), its name added to `names`
// (InvalidArgument when already there). `where` prefixes errors ("<uri> version 7").
absl::StatusOr<TensorInfo> CheckTensor(const TensorView& view, bool stream, int owner,
                                       absl::flat_hash_set<std::string>& names,
                                       std::string_view where) {
  absl::StatusOr<uint64_t> nbytes = internal::ValidateView(view);
  if (nbytes.ok() && stream && view.device.type == DeviceType::kCuda &&
      !IsContiguous(view.shape, view.strides)) {
    nbytes = absl::InvalidArgumentError(absl::StrFormat(
        "tensor \"%s\": a CUDA tensor added to a stream must be contiguous (make it so on the "
        "device first, or publish it with Publish, which packs strided CUDA views)",
        view.name));
  }
  if (!nbytes.ok()) return internal::Annotate(nbytes.status(), where);
  if (!names.insert(view.name).second) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tensor name \"%s\" appears twice", where, view.name));
  }
  return TensorInfo{view.name, view.dtype, view.shape, view.shard, *nbytes, 0, owner};
}

}  // namespace

absl::StatusOr<std::unique_ptr<Publisher>> Publisher::Open(std::string_view uri_text,
                                                           const Options& options) {
  auto impl = std::make_unique<Impl>();
  WB_ASSIGN_OR_RETURN(static_cast<internal::ChannelSetup&>(*impl),
                      internal::SetUpChannel(uri_text, options));
  const internal::Config& c = *impl->config;
  const internal::Uri& uri = impl->uri;
  const int64_t rank = c.Int("rank"), world_size = c.Int("world_size");
  if (rank >= world_size) {  // rank >= 0 and world_size >= 1: CoreSettings
    return absl::InvalidArgumentError(absl::StrFormat("%s: rank %d is not in [0, world_size=%d)",
                                                      uri.Display(), rank, world_size));
  }
  if (const uint64_t block = c.Bytes("checksum_block"); block != 0 && block < 4096) {
    // Not a range: 0 (none) is allowed below the least block size.
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: checksum_block=%d is neither 0 (no block checksums) nor at least 4KiB (each block "
        "costs 16 bytes of manifest)",
        uri.Display(), block));
  }
  if (world_size > 1 && !impl->capabilities.publisher_groups) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: world_size=%d asks for a publisher group (rank %d), which this transport stack does "
        "not implement (capabilities: %s); publish through a single publisher (world_size=1) or "
        "use a transport that declares publisher_groups (docs/TRANSPORTS.md, \"Capabilities\", "
        "lists each transport's)",
        uri.Display(), world_size, rank, internal::DescribeCapabilities(impl->capabilities)));
  }
  if (world_size > 1 && impl->key && !impl->capabilities.authenticated_groups) {
    // Its group versions would carry no MAC of the whole: refused rather than published
    // unauthenticated (disk:// authenticates groups; docs/SECURITY.md, "Publisher groups").
    return absl::UnimplementedError(absl::StrFormat(
        "%s: a publisher group (world_size=%d, rank %d) on a channel with a shared secret needs "
        "a transport stack that authenticates group versions, which this one does not "
        "(capabilities: %s); publish the group over disk://, through a single publisher, or "
        "leave secret_file/secret_env unset",
        uri.Display(), world_size, rank, internal::DescribeCapabilities(impl->capabilities)));
  }
  const std::string& publisher_name = c.String("publisher_name");
  if (size_t bad = 0; !internal::IsValidUtf8(publisher_name, &bad)) {
    // Every manifest records it as JSON text, which cannot hold those bytes.
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: publisher_name \"%s\" is not valid UTF-8 (bad byte at offset %d)",
                        uri.Display(), absl::CHexEscape(publisher_name), bad));
  }
  impl->identity = PublisherIdentity{
      internal::HostName(),         getpid(),       static_cast<int>(rank),
      static_cast<int>(world_size), publisher_name, absl::StrFormat("%016x", internal::RandomId())};
  impl->gate = std::make_unique<internal::CallGate>(uri.Display() + " publisher");
  WB_ASSIGN_OR_RETURN(impl->backend, internal::OpenPublisherStack(impl->stack, uri, c));
  WB_ASSIGN_OR_RETURN(std::optional<uint64_t> latest, impl->backend->LatestVersion());
  {
    absl::MutexLock lock(&impl->mu);
    impl->latest = latest;
  }
  return std::unique_ptr<Publisher>(new Publisher(std::move(impl)));
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() {
  if (impl_->gate->Forked()) {
    // A copy inherited across fork(): its threads do not exist here and its locks may be held,
    // so it is left as it is (the parent's publisher is unaffected).
    (void)impl_.release();
    return;
  }
  Cancel();
  // An open PublishStream: its calls in flight end first (Cancel made a Commit waiting in the
  // transport return), later ones return Cancelled. Its version is dropped.
  std::shared_ptr<StreamLink> stream;
  {
    absl::MutexLock lock(&impl_->mu);
    stream = impl_->stream;
  }
  if (stream) {
    absl::MutexLock lock(&stream->mu);
    stream->owner = nullptr;
  }
  impl_->gate->CloseAndWait();
}

void Publisher::Cancel() {
  if (impl_->gate->Forked()) return;
  impl_->gate->MarkClosing();
  impl_->backend->Cancel();
}

absl::Status Publisher::Publish(uint64_t version, absl::Span<const TensorView> tensors,
                                const Metadata& metadata, absl::Duration timeout) {
  return Publish(version, tensors, metadata, timeout, /*cuda_stream=*/nullptr);
}

absl::Status Publisher::Publish(uint64_t version, absl::Span<const TensorView> tensors,
                                const Metadata& metadata, absl::Duration timeout,
                                void* cuda_stream) {
  internal::CallScope scope(*impl_->gate, "Publish");
  if (!scope.status().ok()) return scope.status();
  return impl_->Publish(version, tensors, metadata, timeout, cuda_stream);
}

absl::Status Publisher::Impl::CheckVersion(uint64_t version) const {
  if (latest && version < *latest) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: cannot publish version %d: the channel already has version %d (versions must "
        "increase)",
        uri.Display(), version, *latest));
  }
  return absl::OkStatus();
}

absl::Status Publisher::Impl::CheckMetadata(uint64_t version, const Metadata& metadata) const {
  for (const auto& [key, value] : metadata) {
    if (key == internal::kLayerMetadataKey || key == internal::kMacMetadataKey) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s version %d: metadata key \"%s\" is reserved for %s", uri.Display(), version, key,
          key == internal::kMacMetadataKey ? "the manifest MAC" : "layers"));
    }
    if (!internal::IsValidUtf8(key) || !internal::IsValidUtf8(value)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s version %d: metadata key \"%s\" or its value is not valid UTF-8",
                          uri.Display(), version, key));
    }
  }
  return absl::OkStatus();
}

Manifest Publisher::Impl::NewManifest(uint64_t version, const Metadata& metadata,
                                      absl::Time start) const {
  Manifest m;
  m.version = version;
  m.publisher = identity;
  m.publish_start_unix_ns = absl::ToUnixNanos(start);
  m.metadata = metadata;
  m.group = identity.world_size > 1;  // this rank's part of a group version
  return m;
}

absl::Status Publisher::Impl::Publish(uint64_t version, absl::Span<const TensorView> tensors,
                                      const Metadata& metadata, absl::Duration timeout,
                                      void* cuda_stream) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  absl::MutexLock lock(&mu);
  WB_RETURN_IF_ERROR(gate->CheckNotClosing("Publish"));
  WB_RETURN_IF_ERROR(CheckVersion(version));
  if (tensors.size() > kMaxTensors) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s version %d has %d tensors, more than the limit of %d", uri.Display(),
                        version, tensors.size(), kMaxTensors));
  }
  Job job;
  job.key_ = key ? &*key : nullptr;
  job.checksum_block_ = ChecksumBlock();
  Manifest& m = job.manifest_;
  m = NewManifest(version, metadata, start);
  m.tensors.reserve(tensors.size());
  const std::string where = absl::StrFormat("%s version %d", uri.Display(), version);
  absl::flat_hash_set<std::string> names;
  uint64_t pack_bytes = 0;
  for (const TensorView& view : tensors) {
    WB_ASSIGN_OR_RETURN(TensorInfo info,
                        CheckTensor(view, /*stream=*/false, identity.rank, names, where));
    if (view.device.type == DeviceType::kCpu && !IsContiguous(view.shape, view.strides)) {
      pack_bytes += (info.nbytes + 63) & ~uint64_t{63};
    }
    m.tensors.push_back(std::move(info));
  }
  WB_RETURN_IF_ERROR(CheckMetadata(version, metadata));

  // Contiguous views are used in place. Strided ones are gathered by the transport as it reads
  // them (reads_strided_views: no extra memory), or else packed into one buffer that lives only
  // as long as this call.
  const absl::Time pack_start = absl::Now();
  const bool pack = pack_bytes > 0 && !capabilities.reads_strided_views;
  if (pack) {
    WB_ASSIGN_OR_RETURN(job.pack_buffer_, internal::HostBuffer::Allocate(pack_bytes));
  }
  job.packed_.resize(tensors.size());
  job.views_.resize(tensors.size());
  job.PrepareChecksums();
  uint64_t pack_offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& v = tensors[i];
    job.packed_[i].info = &m.tensors[i];
    job.views_[i] = &v;
    if (v.device.type == DeviceType::kCuda) continue;  // PrepareCudaTensors
    if (IsContiguous(v.shape, v.strides)) {
      job.packed_[i].data = static_cast<const std::byte*>(v.data);
      continue;
    }
    if (!pack) continue;  // data stays nullptr: read through CopyRange
    std::byte* dst = job.pack_buffer_->data() + pack_offset;
    internal::PackStrided(v.data, DTypeSize(v.dtype), v.shape, v.strides, dst);
    job.packed_[i].data = dst;
    pack_offset += (m.tensors[i].nbytes + 63) & ~uint64_t{63};
  }
  WB_RETURN_IF_ERROR(PrepareCudaTensors(job, tensors, cuda_stream, where));
  return PublishBuiltJob(job, start, absl::Now() - pack_start, deadline);
}

absl::Status Publisher::Impl::PrepareCudaTensors(Job& job, absl::Span<const TensorView> tensors,
                                                 void* cuda_stream, const std::string& where) {
  namespace cuda = internal::cuda;
  std::vector<size_t> on_cuda;
  std::set<int> devices;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& v = tensors[i];
    if (v.device.type != DeviceType::kCuda) continue;
    const std::string what = absl::StrFormat("%s: tensor \"%s\"", where, v.name);
    WB_RETURN_IF_ERROR(job.manifest_.tensors[i].nbytes > 0
                           ? cuda::CheckDevicePointer(v.data, v.device.index, what)
                           : cuda::CheckDevice(v.device.index, what));
    on_cuda.push_back(i);
    devices.insert(v.device.index);
  }
  if (on_cuda.empty()) return absl::OkStatus();
  // The caller's work that produces the tensors: its stream, or each device's legacy default
  // stream. Everything below then runs on the core's own streams.
  if (cuda_stream != nullptr) {
    WB_RETURN_IF_ERROR(cuda::SynchronizeCallerStream(
        cuda_stream, *devices.begin(),
        absl::StrFormat("%s: waiting for the caller's CUDA stream", where)));
  } else {
    for (int d : devices) {
      WB_RETURN_IF_ERROR(cuda::SynchronizeCallerStream(
          nullptr, d,
          absl::StrFormat("%s: waiting for the legacy default stream of CUDA device %d", where,
                          d)));
    }
  }
  auto elements = [&](size_t i) {
    return tensors[i].shape.empty() ? uint64_t{1}
                                    : job.manifest_.tensors[i].nbytes / DTypeSize(tensors[i].dtype);
  };
  auto aligned = [](uint64_t n) { return (n + 255) & ~uint64_t{255}; };
  // Declared before the streams, so that the streams (whose destructors wait for their work)
  // go first on every return: nothing queued outlives the scratch it writes.
  std::map<int, std::unique_ptr<cuda::DeviceBuffer>> scratch;
  std::map<int, std::unique_ptr<cuda::Stream>> streams;
  for (int d : devices) {
    WB_ASSIGN_OR_RETURN(streams[d], cuda::Stream::Create(d));
  }
  // Sizes first: device buffers for strided views packed on their device, pinned host memory
  // for every copy to the host, and a device scratch chunk for views gathered into it.
  constexpr uint64_t kChunk = uint64_t{64} << 20;
  std::vector<internal::CudaTensorRoute> route(tensors.size());
  std::map<int, uint64_t> pack_bytes, chunk_bytes;
  uint64_t staging_bytes = 0;
  for (size_t i : on_cuda) {
    const TensorView& v = tensors[i];
    const uint64_t n = job.manifest_.tensors[i].nbytes;
    route[i] = internal::RouteCudaTensor(capabilities, v);
    switch (route[i]) {
      case internal::CudaTensorRoute::kInPlace:
        break;
      case internal::CudaTensorRoute::kPackOnDevice:
        pack_bytes[v.device.index] += aligned(n);
        break;
      case internal::CudaTensorRoute::kGatherToPinned:
        chunk_bytes[v.device.index] = std::max(chunk_bytes[v.device.index], std::min(kChunk, n));
        [[fallthrough]];
      case internal::CudaTensorRoute::kCopyToPinned:
        staging_bytes += aligned(n);
        break;
    }
  }
  std::map<int, std::byte*> pack_at;
  for (const auto& [d, bytes] : pack_bytes) {
    WB_ASSIGN_OR_RETURN(std::unique_ptr<cuda::DeviceBuffer> buffer,
                        cuda::DeviceBuffer::Allocate(bytes, d));
    pack_at[d] = buffer->data();
    job.device_packs_.push_back(std::move(buffer));
  }
  for (const auto& [d, bytes] : chunk_bytes) {
    WB_ASSIGN_OR_RETURN(scratch[d], cuda::DeviceBuffer::Allocate(bytes, d));
  }
  std::byte* staged_at = nullptr;
  if (staging_bytes > 0) {
    WB_ASSIGN_OR_RETURN(job.cuda_staging_, cuda_staging_pool->Get(staging_bytes));
    // Unpinned memory still works (the driver stages it), only slower and synchronously.
    (void)job.cuda_staging_->Pin();
    staged_at = job.cuda_staging_->data();
  }
  for (size_t i : on_cuda) {
    const TensorView& v = tensors[i];
    const uint64_t n = job.manifest_.tensors[i].nbytes;
    const size_t elem = DTypeSize(v.dtype);
    const cuda::Stream& stream = *streams[v.device.index];
    PackedTensor& p = job.packed_[i];
    const std::string what =
        absl::StrFormat("%s: tensor \"%s\" (%d bytes on CUDA device %d, %s)", where, v.name, n,
                        v.device.index, internal::RouteName(route[i]));
    switch (route[i]) {
      case internal::CudaTensorRoute::kInPlace:
        p.data = static_cast<const std::byte*>(v.data);
        p.device = v.device;
        break;
      case internal::CudaTensorRoute::kPackOnDevice: {
        std::byte* dst = pack_at[v.device.index];
        pack_at[v.device.index] += aligned(n);
        WB_RETURN_IF_ERROR(internal::Annotate(
            cuda::Gather(v.data, elem, v.shape, v.strides, 0, elements(i), dst, stream), what));
        p.data = dst;
        p.device = v.device;
        break;
      }
      case internal::CudaTensorRoute::kCopyToPinned:
        WB_RETURN_IF_ERROR(cuda::CopyAsync(staged_at, v.data, n, stream, what));
        p.data = staged_at;
        p.device = Device{};
        staged_at += aligned(n);
        break;
      case internal::CudaTensorRoute::kGatherToPinned: {
        const cuda::DeviceBuffer& chunk = *scratch[v.device.index];
        const uint64_t per_chunk = std::max<uint64_t>(1, chunk.size() / elem);
        for (uint64_t first = 0; first < elements(i); first += per_chunk) {
          const uint64_t count = std::min(per_chunk, elements(i) - first);
          WB_RETURN_IF_ERROR(internal::Annotate(
              cuda::Gather(v.data, elem, v.shape, v.strides, first, count, chunk.data(), stream),
              what));
          WB_RETURN_IF_ERROR(
              cuda::CopyAsync(staged_at + first * elem, chunk.data(), count * elem, stream, what));
        }
        p.data = staged_at;
        p.device = Device{};
        staged_at += aligned(n);
        break;
      }
    }
  }
  for (auto& [d, stream] : streams) {
    WB_RETURN_IF_ERROR(stream->Synchronize(
        absl::StrFormat("%s: waiting for the copies of CUDA tensors on device %d", where, d)));
  }
  return absl::OkStatus();
}

absl::Status Publisher::Impl::PublishBuiltJob(Job& job, absl::Time start, absl::Duration pack_time,
                                              absl::Time deadline) {
  const Manifest& m = job.manifest_;
  const uint64_t version = m.version;
  if (latest && version == *latest) return Republish(job, start, deadline);
  const absl::Time transport_start = absl::Now();
  job.StartHashing(*hashers, capabilities.copies_with_checksums);
  absl::Status status = failpoints.Hit("core.before_transport");
  if (status.ok()) {
    // An exception out of a transport must not skip WaitHashingDone: the hashing tasks write
    // into `job`, which ends with this call.
    try {
      status = backend->Publish(job, deadline);
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrFormat("the transport threw: %s", e.what()));
    }
  }
  const absl::Time transport_end = absl::Now();
  job.WaitHashingDone();
  job.ApplyChecksums();  // for last_manifest, whether or not the transport sealed it
  if (status.ok()) status = job.ReadStatus();
  if (!status.ok()) {
    return internal::Annotate(
        status, absl::StrFormat("%s: publish of version %d failed", uri.Display(), version));
  }
  latest = version;
  last_manifest = m;
  const absl::Time end = absl::Now();
  stats = PublishStats{};
  stats.version = version;
  stats.bytes = m.total_bytes();
  stats.stall = end - start;
  stats.pack = pack_time;
  stats.checksum_wait = end - transport_end;
  stats.transport = transport_end - transport_start;
  // Wire bytes: the tensors' own for a plain transport; a layer reports what it encoded them to.
  if (std::optional<internal::CodecStats> codec = backend->LastCodecStats()) {
    stats.encode = codec->time;
    stats.wire_bytes = codec->wire_bytes;
    stats.encoding = codec->encoding;
  } else if (this->stack.size() == 1) {
    stats.wire_bytes = m.total_bytes();
  }
  return absl::OkStatus();
}

absl::Status Publisher::Impl::Republish(Job& job, absl::Time start, absl::Time deadline) {
  const uint64_t version = job.version();
  absl::StatusOr<Manifest> committed = absl::UnimplementedError("");
  if (last_manifest && last_manifest->version == version) {
    committed = *last_manifest;
  } else {
    committed = backend->CommittedManifest(version);
  }
  if (committed.ok() && committed->group) {
    // A group version: this rank's own parts are what a retry of this rank must match.
    std::erase_if(committed->tensors,
                  [this](const TensorInfo& t) { return t.owner != identity.rank; });
  }
  if (!committed.ok()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: cannot publish version %d: the channel already has version %d (versions must "
        "increase; a retry of the same bytes is accepted only where the channel's manifest of "
        "that version can be read: %s)",
        uri.Display(), version, version,
        committed.status().message().empty() ? "not by this transport"
                                             : committed.status().message()));
  }
  job.StartHashing(*hashers, /*copy_mode=*/false);
  absl::StatusOr<const Manifest*> sealed = job.SealedManifest(deadline);
  job.WaitHashingDone();
  if (!sealed.ok()) return internal::Annotate(sealed.status(), uri.Display());
  if (std::optional<std::string> diff = internal::ContentDifference(
          (*sealed)->tensors, "this call", committed->tensors, "published")) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: cannot publish version %d: the channel already has version %d with other "
        "content: %s; it keeps the version it has (publish new weights as a higher version)",
        uri.Display(), version, version, *diff));
  }
  // The same tensors: a retry (e.g. after a timeout whose publish did commit). Nothing is
  // written; the version keeps its first manifest, metadata included.
  stats = PublishStats{};
  stats.version = version;
  stats.bytes = (*sealed)->total_bytes();
  stats.stall = absl::Now() - start;
  stats.unchanged = true;
  return absl::OkStatus();
}

// -- PublishStream --

class PublishStream::Impl {
 public:
  enum class State { kOpen, kCommitted, kAborted, kFailed };

  std::shared_ptr<StreamLink> link;
  uint64_t version = 0;
  Metadata metadata;
  std::string where;  // "<uri> version 7", for messages
  std::unique_ptr<internal::TensorSpool> spool;
  std::vector<TensorInfo> tensors;
  absl::flat_hash_set<std::string> names;
  State state = State::kOpen;

  // The stream's Publisher, or Cancelled once it is gone; FailedPrecondition unless open.
  absl::StatusOr<Publisher::Impl*> Owner(std::string_view call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(link->mu) {
    if (link->owner == nullptr) {
      return absl::CancelledError(absl::StrFormat(
          "%s: PublishStream::%s: the Publisher was cancelled or destroyed; the version was "
          "dropped",
          where, call));
    }
    if (state != State::kOpen) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: PublishStream::%s after the stream %s", where, call,
          state == State::kCommitted ? "was committed"
                                     : (state == State::kAborted ? "was aborted" : "failed")));
    }
    return link->owner;
  }

  // Ends the stream: frees the spool and lets the Publisher open another.
  void Finish(Publisher::Impl* owner, State end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(link->mu) {
    state = end;
    spool.reset();
    if (owner == nullptr) return;
    absl::MutexLock lock(&owner->mu);
    if (owner->stream == link) {
      owner->stream.reset();
      owner->stream_version.reset();
    }
  }
};

absl::StatusOr<std::unique_ptr<PublishStream>> Publisher::BeginPublish(uint64_t version,
                                                                       const Metadata& metadata) {
  internal::CallScope scope(*impl_->gate, "BeginPublish");
  if (!scope.status().ok()) return scope.status();
  Impl& p = *impl_;
  auto stream = std::make_unique<PublishStream::Impl>();
  stream->version = version;
  stream->metadata = metadata;
  stream->where = absl::StrFormat("%s version %d", p.uri.Display(), version);
  absl::MutexLock lock(&p.mu);
  WB_RETURN_IF_ERROR(p.gate->CheckNotClosing("BeginPublish"));
  WB_RETURN_IF_ERROR(p.CheckVersion(version));
  if (p.stream) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: cannot begin a streaming publish of version %d: version %d is still being streamed "
        "by this Publisher (commit or abort it first)",
        p.uri.Display(), version, *p.stream_version));
  }
  WB_RETURN_IF_ERROR(p.CheckMetadata(version, metadata));
  std::string dir = p.config->String("stream_spill_dir");
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");  // the system's convention, not a setting
    dir = (tmp != nullptr && *tmp != '\0') ? tmp : "/tmp";
  }
  absl::StatusOr<std::unique_ptr<internal::TensorSpool>> spool =
      internal::TensorSpool::Create(dir, p.config->Bytes("stream_bucket"), p.hashers.get());
  if (!spool.ok()) return internal::Annotate(spool.status(), stream->where);
  stream->spool = *std::move(spool);
  stream->link = std::make_shared<StreamLink>(impl_.get());
  p.stream = stream->link;
  p.stream_version = version;
  return std::make_unique<PublishStream>(std::move(stream));
}

PublishStream::PublishStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PublishStream::~PublishStream() { Abort(); }

absl::Status PublishStream::Add(const TensorView& tensor, void* cuda_stream) {
  Impl& s = *impl_;
  absl::MutexLock lock(&s.link->mu);
  WB_ASSIGN_OR_RETURN(Publisher::Impl * owner, s.Owner("Add"));
  internal::CallScope scope(*owner->gate, "PublishStream::Add");
  if (!scope.status().ok()) return internal::Annotate(scope.status(), s.where);
  if (s.tensors.size() >= kMaxTensors) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tensor \"%s\" would be tensor %d, above the limit of %d", s.where,
                        tensor.name, s.tensors.size() + 1, kMaxTensors));
  }
  WB_ASSIGN_OR_RETURN(TensorInfo info,
                      CheckTensor(tensor, /*stream=*/true, owner->identity.rank, s.names, s.where));
  if (tensor.device.type == DeviceType::kCuda && info.nbytes > 0) {
    // A device this process cannot use, or memory that is not the device's: nothing was added
    // and the stream stays open.
    if (absl::Status usable = internal::cuda::CheckDevicePointer(
            tensor.data, tensor.device.index,
            absl::StrFormat("%s: tensor \"%s\"", s.where, tensor.name));
        !usable.ok()) {
      s.names.erase(tensor.name);
      return usable;
    }
  }
  // Hashed by the spool's writer as it writes, tile by tile (the grid Commit's job records).
  const internal::TileGrid grid =
      internal::ChooseTiles(info.dtype, info.shape, info.nbytes, owner->ChecksumBlock());
  absl::Status status =
      tensor.device.type == DeviceType::kCuda
          ? s.spool->AddCuda(tensor.data, info.nbytes, tensor.device.index, cuda_stream, grid)
          : s.spool->AddHost(tensor, info.nbytes, grid);
  if (!status.ok()) {
    s.names.erase(tensor.name);
    if (status.code() == absl::StatusCode::kUnimplemented) {  // nothing added; stays open
      return internal::Annotate(status, absl::StrFormat("%s: tensor \"%s\"", s.where, tensor.name));
    }
    s.Finish(owner, Impl::State::kFailed);
    return internal::Annotate(
        status, absl::StrFormat("%s: adding tensor \"%s\" failed (the version was dropped)",
                                s.where, tensor.name));
  }
  s.tensors.push_back(std::move(info));
  return absl::OkStatus();
}

absl::Status PublishStream::Commit(absl::Duration timeout) {
  Impl& s = *impl_;
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  absl::MutexLock lock(&s.link->mu);
  WB_ASSIGN_OR_RETURN(Publisher::Impl * owner, s.Owner("Commit"));
  internal::CallScope scope(*owner->gate, "PublishStream::Commit");
  if (!scope.status().ok()) {
    s.Finish(owner, Impl::State::kFailed);
    return internal::Annotate(scope.status(), s.where);
  }
  absl::Status status = s.spool->Seal();
  if (!status.ok()) {
    s.Finish(owner, Impl::State::kFailed);
    return internal::Annotate(status, absl::StrFormat("%s: commit failed", s.where));
  }
  Job job;
  Publisher::Impl& p = *owner;
  job.key_ = p.key ? &*p.key : nullptr;
  job.spool_ = s.spool.get();
  Manifest& m = job.manifest_;
  m = p.NewManifest(s.version, s.metadata, start);
  m.tensors = std::move(s.tensors);
  job.checksum_block_ = p.ChecksumBlock();  // what the spool's hashers used
  job.PrepareChecksums();
  for (size_t i = 0; i < m.tensors.size(); ++i) job.SetChecksum(i, s.spool->checksums(i));
  // Transports that read views piecewise get them from the spool file through CopyRange (no
  // memory for the model); the others read a read-only mapping of it.
  const std::byte* mapped = nullptr;
  if (!p.capabilities.reads_strided_views) {
    absl::StatusOr<const std::byte*> map = s.spool->Map();
    if (!map.ok()) {
      s.Finish(owner, Impl::State::kFailed);
      return internal::Annotate(map.status(), absl::StrFormat("%s: commit failed", s.where));
    }
    mapped = *map;
  }
  job.packed_.resize(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    job.packed_[i].info = &m.tensors[i];
    if (mapped != nullptr) job.packed_[i].data = mapped + s.spool->offset(i);
  }
  {
    absl::MutexLock publisher_lock(&p.mu);
    status = p.gate->CheckNotClosing("PublishStream::Commit");
    if (status.ok()) status = p.CheckVersion(s.version);
    if (status.ok()) status = p.PublishBuiltJob(job, start, absl::ZeroDuration(), deadline);
  }
  s.Finish(owner, status.ok() ? Impl::State::kCommitted : Impl::State::kFailed);
  return status;
}

void PublishStream::Abort() {
  Impl& s = *impl_;
  absl::MutexLock lock(&s.link->mu);
  if (s.state != Impl::State::kOpen) return;
  s.Finish(s.link->owner, Impl::State::kAborted);
}

uint64_t PublishStream::version() const { return impl_->version; }

size_t PublishStream::tensor_count() const {
  absl::MutexLock lock(&impl_->link->mu);
  return impl_->tensors.size();
}

uint64_t PublishStream::bytes() const {
  absl::MutexLock lock(&impl_->link->mu);
  return impl_->spool ? impl_->spool->bytes() : 0;
}

bool SupportsCudaTensors() { return internal::cuda::Built(); }

class HostMemory::Impl {
 public:
  std::shared_ptr<void> owner;  // the transport's allocation, or a HostBuffer
  std::byte* data = nullptr;
  uint64_t size = 0;
  pid_t pid = getpid();  // the process that allocated it
};

HostMemory::HostMemory(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HostMemory::~HostMemory() {
  // In a child forked after the allocation, the transport's state it would release (UCX's
  // registration, a registry lock another thread of the parent may have held at fork) is a
  // copy that is not the child's to touch: the mapping is left to the child's exit.
  if (impl_ != nullptr && impl_->pid != getpid()) {
    (void)impl_.release();  // leaked on purpose, as Publisher::~Publisher does in a child
  }
}
std::byte* HostMemory::data() const { return impl_->data; }
uint64_t HostMemory::size() const { return impl_->size; }

absl::StatusOr<std::unique_ptr<HostMemory>> Publisher::AllocateHost(uint64_t bytes) {
  internal::CallScope scope(*impl_->gate, "AllocateHost");
  if (!scope.status().ok()) return scope.status();
  if (bytes == 0 || bytes > (uint64_t{1} << 62)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: AllocateHost needs between 1 and 2^62 bytes, got %d", impl_->uri.Display(), bytes));
  }
  auto impl = std::make_unique<HostMemory::Impl>();
  impl->size = bytes;
  absl::StatusOr<std::shared_ptr<void>> served = impl_->backend->AllocateHost(bytes, &impl->data);
  if (!served.ok()) return internal::Annotate(served.status(), impl_->uri.Display());
  if (*served != nullptr) {
    impl->owner = *std::move(served);
  } else {
    absl::StatusOr<std::unique_ptr<internal::HostBuffer>> plain =
        internal::HostBuffer::Allocate(bytes);
    if (!plain.ok()) return internal::Annotate(plain.status(), impl_->uri.Display());
    impl->data = (*plain)->data();
    impl->owner = std::shared_ptr<internal::HostBuffer>(*std::move(plain));
  }
  return std::make_unique<HostMemory>(std::move(impl));
}

absl::Status Publisher::WaitForReceivers(uint64_t version, int count, absl::Duration timeout) {
  internal::CallScope scope(*impl_->gate, "WaitForReceivers");
  if (!scope.status().ok()) return scope.status();
  if (count < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: WaitForReceivers needs a count of at least 1, got %d", impl_->uri.Display(), count));
  }
  // Not under mu: Publish calls may go on while this waits.
  absl::StatusOr<int> have =
      impl_->backend->WaitForReceivers(version, count, absl::Now() + timeout);
  if (!have.ok()) {
    return internal::Annotate(have.status(), impl_->uri.Display());
  }
  if (*have < count) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s: %d of the %d subscribers waited for had received version %d after %s",
        impl_->uri.Display(), *have, count, version, absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

std::optional<uint64_t> Publisher::latest_version() const {
  if (impl_->gate->Forked()) return std::nullopt;
  absl::MutexLock lock(&impl_->mu);
  return impl_->latest;
}

PublishStats Publisher::last_stats() const {
  if (impl_->gate->Forked()) return PublishStats{};
  absl::MutexLock lock(&impl_->mu);
  return impl_->stats;
}

const std::string& Publisher::uri() const { return impl_->uri_text; }

}  // namespace weightbus
