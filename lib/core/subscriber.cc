// SPDX-License-Identifier: Apache-2.0
// Subscriber: checks bound destinations against the manifest before any byte moves, receives
// through the transport, verifies every checksum (overlapped with the transfer) and hands over
// whole versions only, never a lower one after a higher one. Transport-neutral.
#include <atomic>
#include <cstring>
#include <future>
#include <map>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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
#include "core/parts.h"
#include "core/registry.h"
#include "core/reshard.h"
#include "core/status.h"
#include "core/tensor_pack.h"
#include "core/tile_reads.h"
#include "core/worker_pool.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

constexpr uint64_t kAlign = 64;
uint64_t AlignUp(uint64_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

// Verifies tensors as the transport reports them complete. A transport that also reports
// growing prefixes of a tensor (LandedPrefix) gets that tensor hashed chunk by chunk right
// behind the transfer, while the bytes are still in cache, instead of in one pass at the end.
class Verifier final : public internal::LandingSink {
 public:
  // `needed[i]` false: tensor i is not fetched (a replica read from another rank) and not checked.
  // `devices[i]`: where targets[i] lives (empty: every target is host memory); device targets
  // are checksummed on their device.
  Verifier(const Manifest& manifest, const std::vector<std::byte*>& targets,
           const std::vector<bool>& needed, const std::vector<Device>& devices,
           internal::WorkerPool& pool)
      : manifest_(manifest),
        targets_(targets),
        needed_(needed),
        devices_(devices),
        pool_(pool),
        actual_(manifest.tensors.size(), 0),
        landed_(manifest.tensors.size()),
        progress_(manifest.tensors.size()) {}

  Device TargetDevice(size_t i) const override {
    return i < devices_.size() ? devices_[i] : Device{};
  }

  void Landed(size_t i) override {
    if (!needed_[i] || landed_[i].exchange(true))
      return;  // a transport reporting twice is harmless
    if (progress_[i] != nullptr) {
      Advance(i, manifest_.tensors[i].nbytes, /*complete=*/true);
      return;
    }
    pending_.Add();
    if (const Device d = TargetDevice(i); d.type == DeviceType::kCuda) {
      pool_.Submit([this, i, d] {
        const internal::cuda::DeviceBytes bytes{targets_[i], manifest_.tensors[i].nbytes};
        absl::StatusOr<std::vector<internal::TensorChecksums>> sums =
            internal::cuda::Checksum({&bytes, 1}, {internal::TileGrid{}}, d.index);
        if (sums.ok()) {
          actual_[i] = (*sums)[0].xxh3;
        } else {
          absl::MutexLock lock(&error_mu_);
          if (error_.ok()) {
            error_ = internal::Annotate(sums.status(),
                                        absl::StrFormat("verifying tensor \"%s\" on CUDA device %d",
                                                        manifest_.tensors[i].name, d.index));
          }
        }
        pending_.Done();
      });
      return;
    }
    pool_.Submit([this, i] {
      actual_[i] = internal::Xxh3(targets_[i], manifest_.tensors[i].nbytes);
      pending_.Done();
    });
  }

  void LandedPrefix(size_t i, uint64_t bytes) override {
    if (!needed_[i] || landed_[i].load() || bytes == 0 || bytes >= manifest_.tensors[i].nbytes ||
        TargetDevice(i).type == DeviceType::kCuda)
      return;
    if (progress_[i] == nullptr) progress_[i] = std::make_unique<Progress>();
    Advance(i, bytes, /*complete=*/false);
  }

  // Waits for every queued checksum (they read buffers the caller may free afterwards).
  void Drain() { pending_.WaitUntilZero(absl::InfiniteFuture()); }

  // After Drain: a checksum that could not be computed (on a CUDA device).
  absl::Status error() const {
    absl::MutexLock lock(&error_mu_);
    return error_;
  }

  // After Drain: the first tensor never reported or whose checksum differs, or -1.
  std::optional<size_t> FirstFailure(bool* never_landed) const {
    for (size_t i = 0; i < actual_.size(); ++i) {
      if (!needed_[i]) continue;
      if (!landed_[i].load()) {
        *never_landed = true;
        return i;
      }
      if (actual_[i] != manifest_.tensors[i].xxh3) {
        *never_landed = false;
        return i;
      }
    }
    return std::nullopt;
  }
  uint64_t actual(size_t i) const { return actual_[i]; }

 private:
  // Streaming state of one tensor reported by prefixes. At most one pool task hashes it at a
  // time (`running`), catching up with `landed` until it is complete.
  struct Progress {
    absl::Mutex mu;
    uint64_t landed ABSL_GUARDED_BY(mu) = 0;
    uint64_t hashed ABSL_GUARDED_BY(mu) = 0;
    bool complete ABSL_GUARDED_BY(mu) = false;
    bool running ABSL_GUARDED_BY(mu) = false;
    internal::Xxh3Stream stream;  // used by the running task only
  };

  void Advance(size_t i, uint64_t bytes, bool complete) {
    Progress& p = *progress_[i];
    {
      absl::MutexLock lock(&p.mu);
      p.landed = std::max(p.landed, bytes);
      p.complete |= complete;
      if (p.running) return;
      p.running = true;
    }
    pending_.Add();
    pool_.Submit([this, i] {
      Progress& p = *progress_[i];
      while (true) {
        uint64_t from, to;
        {
          absl::MutexLock lock(&p.mu);
          if (p.hashed == p.landed) {
            if (p.complete) actual_[i] = p.stream.Digest();
            p.running = false;
            break;
          }
          from = p.hashed;
          to = p.landed;
        }
        p.stream.Update(targets_[i] + from, to - from);
        absl::MutexLock lock(&p.mu);
        p.hashed = to;
      }
      pending_.Done();
    });
  }

  const Manifest& manifest_;
  const std::vector<std::byte*>& targets_;
  const std::vector<bool>& needed_;
  const std::vector<Device>& devices_;
  internal::WorkerPool& pool_;
  mutable absl::Mutex error_mu_;
  absl::Status error_ ABSL_GUARDED_BY(error_mu_);
  std::vector<uint64_t> actual_;
  std::vector<std::atomic<bool>> landed_;
  // Set by the transport's thread before the tensor's first prefix task; read by tasks after.
  std::vector<std::unique_ptr<Progress>> progress_;
  internal::TaskCounter pending_;
};

struct Binding {
  Destination dest;
  uint64_t nbytes = 0;
  bool cuda() const { return dest.device.type == DeviceType::kCuda; }
};

// Copies verified bytes into CUDA destinations (docs/TRANSPORTS.md, "Device memory"), on one
// stream of the core's per device, and waits for them in Finish (or on destruction). Not
// thread-safe.
class CudaCopyOut {
 public:
  // Copies the `nbytes` packed row-major bytes of a tensor (or a part of one) of `shape` at
  // `src` (host memory, or device memory when `src_on_device`) into the destination whose
  // element for the first of them is at `dst` with element `strides` (empty: row-major), on
  // CUDA device `device`: one copy when the destination is contiguous, else the scatter kernel
  // (from host memory through a device scratch buffer of at most 64 MiB, a chunk at a time).
  absl::Status Copy(const std::byte* src, bool src_on_device, DType dtype,
                    const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                    uint64_t nbytes, void* dst, int device) {
    if (nbytes == 0) return absl::OkStatus();
    std::unique_ptr<internal::cuda::Stream>& stream = streams_[device];
    if (stream == nullptr) {
      WB_ASSIGN_OR_RETURN(stream, internal::cuda::Stream::Create(device));
    }
    const std::string what = absl::StrFormat(
        "copying %d verified bytes into a destination on CUDA device %d", nbytes, device);
    if (IsContiguous(shape, strides)) {
      return internal::cuda::CopyAsync(dst, src, nbytes, *stream, what);
    }
    const size_t elem = DTypeSize(dtype);
    uint64_t count = 1;
    for (int64_t d : shape) count *= static_cast<uint64_t>(d);
    if (src_on_device) {
      return internal::cuda::Scatter(src, elem, shape, strides, 0, count, dst, *stream);
    }
    constexpr uint64_t kChunk = uint64_t{64} << 20;
    std::unique_ptr<internal::cuda::DeviceBuffer>& scratch = scratch_[device];
    const uint64_t want = std::min(kChunk, nbytes);
    if (scratch == nullptr || scratch->size() < want) {
      WB_RETURN_IF_ERROR(stream->Synchronize(what));  // the old scratch may still be read
      scratch.reset();
      WB_ASSIGN_OR_RETURN(scratch, internal::cuda::DeviceBuffer::Allocate(want, device));
    }
    const uint64_t per_chunk = std::max<uint64_t>(1, scratch->size() / elem);
    for (uint64_t first = 0; first < count; first += per_chunk) {
      const uint64_t n = std::min(per_chunk, count - first);
      WB_RETURN_IF_ERROR(
          internal::cuda::CopyAsync(scratch->data(), src + first * elem, n * elem, *stream, what));
      WB_RETURN_IF_ERROR(
          internal::cuda::Scatter(scratch->data(), elem, shape, strides, first, n, dst, *stream));
    }
    return absl::OkStatus();
  }

  // Waits for every copy queued.
  absl::Status Finish() {
    for (auto& [device, stream] : streams_) {
      WB_RETURN_IF_ERROR(stream->Synchronize(
          absl::StrFormat("waiting for the copies into destinations on CUDA device %d", device)));
    }
    return absl::OkStatus();
  }

 private:
  // Declared first: the streams (whose destructors wait for their work) go before the scratch.
  std::map<int, std::unique_ptr<internal::cuda::DeviceBuffer>> scratch_;
  std::map<int, std::unique_ptr<internal::cuda::Stream>> streams_;
};

}  // namespace

class Update::Impl {
 public:
  Manifest manifest;
  std::vector<TensorView> views;
  absl::flat_hash_map<std::string, size_t> index;
  std::shared_ptr<internal::HostBuffer> buffer;  // library-owned tensors
  UpdateStats stats;
};

// Hands over slice `t` of a TP rank's plan (`tp`): its bound destination when it has one, else
// `home` (library memory), row-major, with no shard.
static void AddSliceView(Update::Impl& impl, const internal::TensorPlan& tp, size_t t,
                         std::byte* home, const Binding* bound) {
  TensorView v{tp.name, tp.dtype, tp.shape, {}, home, Device{}, std::nullopt};
  if (bound != nullptr) {
    v.data = bound->dest.data;
    v.strides = bound->dest.strides;
    v.device = bound->dest.device;
  }
  impl.index.emplace(tp.name, t);
  impl.views.push_back(std::move(v));
}

Update::Update(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Update::~Update() = default;
uint64_t Update::version() const { return impl_->manifest.version; }
const Manifest& Update::manifest() const { return impl_->manifest; }
absl::Span<const TensorView> Update::tensors() const { return impl_->views; }
const UpdateStats& Update::stats() const { return impl_->stats; }
const TensorView* Update::Find(std::string_view name) const {
  auto it = impl_->index.find(absl::string_view(name.data(), name.size()));
  return it == impl_->index.end() ? nullptr : &impl_->views[it->second];
}

class Subscriber::Impl : public internal::ChannelSetup {
 public:
  std::unique_ptr<internal::TransportSubscriber> backend;
  std::unique_ptr<internal::CallGate> gate;
  std::shared_ptr<internal::BufferPool> pool = internal::BufferPool::Create(3);
  bool staged = true;

  mutable absl::Mutex mu;
  std::map<std::string, Binding, std::less<>> bindings ABSL_GUARDED_BY(mu);
  std::optional<uint64_t> current ABSL_GUARDED_BY(mu);
  // What the current version holds, to refuse other content under the same version number.
  std::string held_session ABSL_GUARDED_BY(mu);
  std::vector<TensorInfo> held_tensors ABSL_GUARDED_BY(mu);
  // Set at Open for one worker of a TP group; its plan is kept across versions.
  std::optional<SubscribePlacements> placements;
  internal::PlanCache plans ABSL_GUARDED_BY(mu);

  // When a receive passed each stage, for UpdateStats.
  struct Times {
    absl::Time start, found, allocated, fetched, verified, end;
  };

  // Finds a version >= max(min_version, current) by `find_deadline` and receives it by
  // `receive_deadline`. With `poll`, finding none by find_deadline returns nullptr.
  absl::StatusOr<std::unique_ptr<Update>> Wait(uint64_t min_version, absl::Time find_deadline,
                                               absl::Time receive_deadline, bool poll)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Subscriber::ReceiveVersion: finds exactly `version` by `find_deadline` and receives it by
  // `receive_deadline`.
  absl::StatusOr<std::unique_ptr<Update>> ReceiveExact(uint64_t version, absl::Time find_deadline,
                                                       absl::Time receive_deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Opens exactly `version`: where the transport still holds it, or once it is committed.
  absl::StatusOr<std::unique_ptr<internal::IncomingVersion>> FindExact(uint64_t version,
                                                                       absl::Time find_deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Checks, receives and verifies `incoming`, just found by a call that began at `start`, by
  // `deadline` and makes it current. `wanted` is what the call asked for, to check that the
  // transport kept to it: a version >= wanted.first, or exactly it when wanted.second.
  absl::StatusOr<std::unique_ptr<Update>> Receive(
      std::unique_ptr<internal::IncomingVersion> incoming, std::pair<uint64_t, bool> wanted,
      absl::Time start, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Receive for a subscriber with placements, after the manifest checks: plans this worker's
  // slices of `wholes` (what version impl->manifest hands over), fetches the parts the plan
  // reads and assembles the slices.
  absl::StatusOr<std::unique_ptr<Update>> ReceiveResharded(
      std::unique_ptr<internal::IncomingVersion> incoming, std::unique_ptr<Update::Impl> impl,
      const std::vector<internal::AssembledTensor>& wholes, Times times, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // ReceiveResharded on a transport with partial_reads, every part the plan reads having block
  // checksums: reads only the blocks the plan's ranges touch, window by window (setting
  // staging_window), verifies each block and copies its ranges into the slices.
  // `part_index[t][p]` is the manifest index of part p of layout tensor t.
  absl::StatusOr<std::unique_ptr<Update>> ReceivePartial(
      std::unique_ptr<internal::IncomingVersion> incoming, std::unique_ptr<Update::Impl> impl,
      const internal::SourceLayout& layout, const std::vector<std::vector<size_t>>& part_index,
      const internal::ReshardPlan& plan, Times times, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Fetches the parts with a non-null target (`mapped` bytes of buffers were allocated for
  // them) and verifies those `needed`; accepted, and the transport's pin released, only when
  // all are. `direct_note` explains the state of bound destinations on failure. Fills
  // times->fetched and times->verified, and *codec.
  // `devices[i]` says where targets[i] lives (empty: all host memory).
  // A version found unsealed (IncomingVersion::sealed) is checked here once Fetch returned:
  // its sealed manifest must have the layout `m` announced, a valid MAC on a shared-secret
  // channel and, under a version number held, the held content; `m` then becomes it (its MAC
  // entry removed) and the checksums are compared against it.
  absl::Status FetchVerified(std::unique_ptr<internal::IncomingVersion> incoming, Manifest& m,
                             const std::vector<std::byte*>& targets,
                             const std::vector<bool>& needed, const std::vector<Device>& devices,
                             uint64_t mapped, const std::string& direct_note, absl::Time deadline,
                             Times* times, std::optional<internal::CodecStats>* codec)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Makes impl's version current and hands it over (its views set; `library` the buffer they
  // point into, `fetched_bytes` received).
  std::unique_ptr<Update> HandOver(std::unique_ptr<Update::Impl> impl,
                                   std::shared_ptr<internal::HostBuffer> library,
                                   uint64_t fetched_bytes, const Times& times,
                                   const std::optional<internal::CodecStats>& codec)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Whether slice `tp` bound to `b` is assembled in host scratch and copied into `b` afterwards
  // (CopySlice): a strided destination, or one on a CUDA device (the placement paths read host
  // memory only).
  bool ScratchSlice(const internal::TensorPlan& tp, const Binding& b) const {
    if (b.cuda()) {  // kHostStaging: placements read host memory
      return tp.nbytes > 0 && internal::RouteCudaDestination(capabilities, staged, tp.shape, b.dest,
                                                             /*placements=*/true) ==
                                  internal::CudaDestinationRoute::kHostStaging;
    }
    return tp.nbytes > 0 && !IsContiguous(tp.shape, b.dest.strides);
  }
  // Copies the verified row-major slice at `scratch` into its destination `b` (a host one at
  // once; a CUDA one queued on `cuda_out`, waited for by FinishCopies).
  absl::Status CopySlice(CudaCopyOut& cuda_out, uint64_t version, const internal::TensorPlan& tp,
                         const std::byte* scratch, const Binding& b) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  absl::Status FinishCopies(CudaCopyOut& cuda_out, uint64_t version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  std::string CurrentText() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return current ? std::to_string(*current) : "none";
  }
  // The checks of a manifest's MAC and content that need its checksums: made when a version is
  // found sealed, or after its transfer (FetchVerified) when it was found unsealed.
  absl::Status CheckSealed(const Manifest& m) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Lets the transport hand over unsealed versions (once, before the first wait) unless this
  // subscriber has placements (it plans partial reads with block checksums before any byte).
  void PrepareBackend() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (prepared || placements) return;
    prepared = true;
    backend->AcceptUnsealedVersions();
  }
  bool prepared ABSL_GUARDED_BY(mu) = false;
  // `tensors`: what version `version` hands over (the manifest's tensors, or a group version's
  // assembled ones).
  absl::Status CheckBindings(uint64_t version,
                             const std::vector<internal::AssembledTensor>& tensors) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

absl::StatusOr<std::unique_ptr<Subscriber>> Subscriber::Open(std::string_view uri_text,
                                                             const Options& options) {
  auto impl = std::make_unique<Impl>();
  WB_ASSIGN_OR_RETURN(static_cast<internal::ChannelSetup&>(*impl),
                      internal::SetUpChannel(uri_text, options));
  impl->staged = impl->config->String("bind_mode") == "staged";
  impl->gate = std::make_unique<internal::CallGate>(impl->uri.Display() + " subscriber");
  WB_ASSIGN_OR_RETURN(impl->backend,
                      internal::OpenSubscriberStack(impl->stack, impl->uri, *impl->config));
  return std::unique_ptr<Subscriber>(new Subscriber(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Subscriber>> Subscriber::Open(std::string_view uri_text,
                                                             const Options& options,
                                                             SubscribePlacements placements) {
  const TensorParallelRank& r = placements.rank;
  if (r.size < 1 || r.rank < 0 || r.rank >= r.size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: placements for TP rank %d of a group of size %d: the size must be >= 1 and the "
        "rank in [0, size)",
        uri_text, r.rank, r.size));
  }
  WB_ASSIGN_OR_RETURN(std::unique_ptr<Subscriber> sub, Open(uri_text, options));
  sub->impl_->placements = std::move(placements);
  return sub;
}

Subscriber::Subscriber(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Subscriber::~Subscriber() {
  if (impl_->gate->Forked()) {
    // A copy inherited across fork(): its threads do not exist here and its locks may be held,
    // so it is left as it is (the parent's subscriber is unaffected).
    (void)impl_.release();
    return;
  }
  Cancel();
  impl_->gate->CloseAndWait();
}

void Subscriber::Cancel() {
  if (impl_->gate->Forked()) return;
  impl_->gate->MarkClosing();
  impl_->backend->Cancel();
}

absl::Status Subscriber::Bind(std::string name, Destination dest) {
  internal::CallScope scope(*impl_->gate, "Bind");
  if (!scope.status().ok()) return scope.status();
  absl::StatusOr<uint64_t> nbytes = internal::ValidateDestination(name, dest);
  if (!nbytes.ok()) return nbytes.status();
  if (dest.device.type == DeviceType::kCuda) {
    const std::string what =
        absl::StrFormat("%s: destination for tensor \"%s\"", impl_->uri.Display(), name);
    WB_RETURN_IF_ERROR(*nbytes > 0
                           ? internal::cuda::CheckDevicePointer(dest.data, dest.device.index, what)
                           : internal::cuda::CheckDevice(dest.device.index, what));
  }
  absl::MutexLock lock(&impl_->mu);
  impl_->bindings[std::move(name)] = Binding{std::move(dest), *nbytes};
  return absl::OkStatus();
}

void Subscriber::Unbind(std::string_view name) {
  internal::CallScope scope(*impl_->gate, "Unbind");
  if (!scope.status().ok()) return;
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->bindings.find(name);
  if (it != impl_->bindings.end()) impl_->bindings.erase(it);
}

void Subscriber::UnbindAll() {
  internal::CallScope scope(*impl_->gate, "UnbindAll");
  if (!scope.status().ok()) return;
  absl::MutexLock lock(&impl_->mu);
  impl_->bindings.clear();
}

std::optional<uint64_t> Subscriber::current_version() const {
  if (impl_->gate->Forked()) return std::nullopt;
  absl::MutexLock lock(&impl_->mu);
  return impl_->current;
}

const std::string& Subscriber::uri() const { return impl_->uri_text; }

absl::StatusOr<std::unique_ptr<Update>> Subscriber::WaitForVersion(uint64_t min_version,
                                                                   absl::Duration timeout) {
  internal::CallScope scope(*impl_->gate, "WaitForVersion");
  if (!scope.status().ok()) return scope.status();
  absl::MutexLock lock(&impl_->mu);
  const absl::Time deadline = absl::Now() + timeout;
  return impl_->Wait(min_version, deadline, deadline, /*poll=*/false);
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::WaitForVersion(uint64_t min_version,
                                                                   absl::Duration find_timeout,
                                                                   absl::Duration receive_timeout) {
  internal::CallScope scope(*impl_->gate, "WaitForVersion");
  if (!scope.status().ok()) return scope.status();
  absl::MutexLock lock(&impl_->mu);
  const absl::Time find_deadline = absl::Now() + find_timeout;
  return impl_->Wait(min_version, find_deadline, find_deadline + receive_timeout,
                     /*poll=*/false);
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::ReceiveVersion(uint64_t version,
                                                                   absl::Duration timeout) {
  return ReceiveVersion(version, timeout, absl::ZeroDuration());  // one deadline for both
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::ReceiveVersion(uint64_t version,
                                                                   absl::Duration find_timeout,
                                                                   absl::Duration receive_timeout) {
  internal::CallScope scope(*impl_->gate, "ReceiveVersion");
  if (!scope.status().ok()) return scope.status();
  absl::MutexLock lock(&impl_->mu);
  const absl::Time find_deadline = absl::Now() + find_timeout;
  return impl_->ReceiveExact(version, find_deadline, find_deadline + receive_timeout);
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::Poll(uint64_t min_version,
                                                         absl::Duration receive_timeout) {
  internal::CallScope scope(*impl_->gate, "Poll");
  if (!scope.status().ok()) return scope.status();
  absl::MutexLock lock(&impl_->mu);
  const absl::Time now = absl::Now();
  return impl_->Wait(min_version, now, now + receive_timeout, /*poll=*/true);
}

absl::Status Subscriber::Impl::CheckBindings(
    uint64_t version, const std::vector<internal::AssembledTensor>& tensors) const {
  absl::flat_hash_map<absl::string_view, const internal::AssembledTensor*> by_name;
  for (const internal::AssembledTensor& t : tensors) by_name.emplace(t.name, &t);
  for (const auto& [name, binding] : bindings) {
    auto found = by_name.find(name);
    if (found == by_name.end()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor \"%s\" is bound but version %d has no tensor of that name (it has %d "
          "tensors); nothing was written",
          uri.Display(), name, version, tensors.size()));
    }
    const internal::AssembledTensor* info = found->second;
    const Destination& d = binding.dest;
    if (d.dtype != info->dtype || d.shape != info->shape) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor \"%s\" of version %d is %s %s but its bound destination is %s %s; "
          "nothing was written",
          uri.Display(), name, version, DTypeName(info->dtype), ShapeString(info->shape),
          DTypeName(d.dtype), ShapeString(d.shape)));
    }
  }
  return absl::OkStatus();
}

// Checks what a transport handed over before trusting it for sizes and offsets.
static absl::Status CheckManifest(const internal::Uri& uri, const Manifest& m) {
  absl::flat_hash_set<absl::string_view> names;
  for (const TensorInfo& t : m.tensors) {
    absl::StatusOr<uint64_t> n = ByteSize(t.dtype, t.shape);
    if (!n.ok() || *n != t.nbytes) {
      return absl::DataLossError(absl::StrFormat(
          "%s version %d: manifest entry \"%s\" claims %d bytes for %s %s", uri.Display(),
          m.version, t.name, t.nbytes, DTypeName(t.dtype), ShapeString(t.shape)));
    }
    if (t.block_xxh3.size() != internal::GridOf(t).count()) {
      return absl::DataLossError(absl::StrFormat(
          "%s version %d: manifest entry \"%s\" of %d bytes has %d block checksums for blocks "
          "of %d bytes (%d rows each)",
          uri.Display(), m.version, t.name, t.nbytes, t.block_xxh3.size(), t.block_bytes,
          t.block_rows));
    }
    if (!m.group && !names.insert(t.name).second) {
      return absl::DataLossError(absl::StrFormat(
          "%s version %d: manifest names tensor \"%s\" twice", uri.Display(), m.version, t.name));
    }
  }
  return absl::OkStatus();
}

// What version `m` hands over: its tensors, or a group version's tensors assembled from their
// parts (checked to fit together; a manifest whose parts do not is DataLoss).
static absl::StatusOr<std::vector<internal::AssembledTensor>> HandedOver(const internal::Uri& uri,
                                                                         const Manifest& m) {
  if (m.group) {
    absl::StatusOr<std::vector<internal::AssembledTensor>> a =
        internal::AssembleParts(m.tensors, m.publisher.world_size);
    if (!a.ok()) {
      return absl::DataLossError(absl::StrFormat("%s version %d: the group's parts do not fit: %s",
                                                 uri.Display(), m.version, a.status().message()));
    }
    return a;
  }
  std::vector<internal::AssembledTensor> out;
  out.reserve(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorInfo& t = m.tensors[i];
    out.push_back(internal::AssembledTensor{t.name, t.dtype, t.shape, t.nbytes, {i}});
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::Impl::Wait(uint64_t min_version,
                                                               absl::Time find_deadline,
                                                               absl::Time receive_deadline,
                                                               bool poll) {
  WB_RETURN_IF_ERROR(gate->CheckNotClosing(poll ? "Poll" : "WaitForVersion"));
  PrepareBackend();
  const absl::Time start = absl::Now();
  const uint64_t floor = std::max(min_version, current.value_or(0));

  absl::StatusOr<std::unique_ptr<internal::IncomingVersion>> found_version =
      backend->WaitForVersion(floor, find_deadline);
  if (poll && absl::IsDeadlineExceeded(found_version.status())) {
    return std::unique_ptr<Update>();  // nothing new enough yet: not an error when polling
  }
  if (!found_version.ok()) return found_version.status();
  return Receive(*std::move(found_version), {floor, false}, start, receive_deadline);
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::Impl::ReceiveExact(
    uint64_t version, absl::Time find_deadline, absl::Time receive_deadline) {
  WB_RETURN_IF_ERROR(gate->CheckNotClosing("ReceiveVersion"));
  PrepareBackend();
  const absl::Time start = absl::Now();
  if (current && version < *current) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: cannot receive version %d: this subscriber holds version %d already, and the "
        "versions it hands over never decrease; open a new Subscriber to go back to version %d",
        uri.Display(), version, *current, version));
  }
  WB_ASSIGN_OR_RETURN(std::unique_ptr<internal::IncomingVersion> incoming,
                      FindExact(version, find_deadline));
  return Receive(std::move(incoming), {version, true}, start, receive_deadline);
}

// "1, 2, 3" (or "none"); a long list shows its ends.
static std::string VersionList(const std::vector<uint64_t>& versions) {
  if (versions.empty()) return "none";
  constexpr size_t kShown = 8;
  if (versions.size() <= kShown) return absl::StrJoin(versions, ", ");
  const std::vector<uint64_t> head(versions.begin(), versions.begin() + kShown / 2);
  const std::vector<uint64_t> tail(versions.end() - kShown / 2, versions.end());
  return absl::StrFormat("%s, ... (%d versions) ..., %s", absl::StrJoin(head, ", "),
                         versions.size(), absl::StrJoin(tail, ", "));
}

absl::StatusOr<std::unique_ptr<internal::IncomingVersion>> Subscriber::Impl::FindExact(
    uint64_t version, absl::Time find_deadline) {
  // Open it where the transport holds it; otherwise tell "gone" (a newer version is on the
  // channel) from "not yet" (wait for the channel to reach it, then open it). A stack without
  // OpenVersion can hand over only the newest version, found by waiting.
  const bool can_open = capabilities.open_version;
  std::optional<uint64_t> newer;  // a version above `version` seen on the channel
  absl::Status open_error = absl::NotFoundError("the transport opens only the newest version");
  bool reopened = false;
  while (true) {
    WB_RETURN_IF_ERROR(gate->CheckNotClosing("ReceiveVersion"));
    if (can_open) {
      absl::StatusOr<std::unique_ptr<internal::IncomingVersion>> opened =
          backend->OpenVersion(version, find_deadline);
      if (opened.ok() || !absl::IsNotFound(opened.status())) return opened;
      open_error = opened.status();
    }
    std::vector<uint64_t> held;
    if (capabilities.list_versions) {
      WB_ASSIGN_OR_RETURN(held, backend->ListVersions());
      if (!held.empty() && held.back() > version) newer = std::max(newer.value_or(0), held.back());
      if (can_open && std::binary_search(held.begin(), held.end(), version)) {
        // Committed between the two calls: open it again, once. Listed but still not opened:
        // the transport's own reason (e.g. a delta whose chain is gone).
        if (reopened) return open_error;
        reopened = true;
        continue;
      }
    }
    if (newer) {
      return absl::NotFoundError(absl::StrFormat(
          "%s: version %d is no longer on the channel (%s; newest seen: %d): it was "
          "retired before this subscriber opened it (%s). Keep more versions (disk: retention, "
          "ucx: staging_slots) for the time a group of replicas takes to receive one, or pick a "
          "version every replica can still open; version %s stays current",
          uri.Display(), version,
          capabilities.list_versions ? "it holds " + VersionList(held)
                                     : std::string("it holds versions this transport cannot list"),
          *newer, open_error.message(), CurrentText()));
    }
    // Not committed yet (or the transport cannot list): wait until the channel reaches it.
    WB_RETURN_IF_ERROR(failpoints.Hit("core.before_version_wait"));
    absl::StatusOr<std::unique_ptr<internal::IncomingVersion>> found =
        backend->WaitForVersion(version, find_deadline);
    if (!found.ok()) {
      if (!absl::IsDeadlineExceeded(found.status())) return found.status();
      return absl::DeadlineExceededError(
          absl::StrFormat("%s: version %d was not committed by the deadline: %s; version %s "
                          "stays current",
                          uri.Display(), version, found.status().message(), CurrentText()));
    }
    if ((*found)->manifest().version == version) return found;
    // The channel moved past it while we waited: open it where still held, else it is gone.
    newer = (*found)->manifest().version;
  }
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::Impl::Receive(
    std::unique_ptr<internal::IncomingVersion> incoming, std::pair<uint64_t, bool> wanted,
    absl::Time start, absl::Time deadline) {
  const absl::Time found = absl::Now();
  auto impl = std::make_unique<Update::Impl>();
  impl->manifest = incoming->manifest();
  Manifest& m = impl->manifest;
  const auto [floor, exact] = wanted;
  if (exact ? m.version != floor : m.version < floor) {
    return absl::InternalError(
        absl::StrFormat("%s: transport offered version %d while waiting for %s %d", uri.Display(),
                        m.version, exact ? "==" : ">=", floor));
  }
  WB_RETURN_IF_ERROR(CheckManifest(uri, m));
  if (auto layer = m.metadata.find(std::string(internal::kLayerMetadataKey));
      layer != m.metadata.end()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: version %d was published through the \"%s\" layer, which this subscriber does not "
        "have (its tensors are the layer's encoding, not the model); subscribe to %s+%s",
        uri.Display(), m.version, layer->second, layer->second, uri.Display()));
  }
  // A sealed version is checked now: nothing of a version without a valid MAC is accepted on a
  // shared-secret channel. An unsealed one (pipelined) is checked the same way once its bytes
  // are in and its publisher sealed it (FetchVerified), before anything is handed over.
  if (incoming->sealed()) {
    WB_RETURN_IF_ERROR(CheckSealed(m));
    impl->manifest.metadata.erase(std::string(internal::kMacMetadataKey));
  }
  WB_ASSIGN_OR_RETURN(const std::vector<internal::AssembledTensor> wholes, HandedOver(uri, m));
  Times times;
  times.start = start;
  times.found = found;
  if (placements) {
    return ReceiveResharded(std::move(incoming), std::move(impl), wholes, times, deadline);
  }
  WB_RETURN_IF_ERROR(CheckBindings(m.version, wholes));

  // Decide where each tensor handed over lives (its home): library memory (kept by the Update)
  // or a bound destination. Each part read (a tensor is its own one part, except in a group
  // version) lands straight in its home when it is a contiguous run of it (library memory, or a
  // contiguous destination with bind_mode=direct), else in staging, from which it is copied
  // (scattered, for a column slice) into its home after every part is verified.
  const size_t n = m.tensors.size();  // parts
  const size_t nw = wholes.size();    // tensors handed over
  std::vector<const Binding*> bound(nw, nullptr);
  std::vector<uint64_t> home_offset(nw, 0);  // in the library buffer
  uint64_t library_bytes = 0, staging_bytes = 0;
  for (size_t w = 0; w < nw; ++w) {
    if (auto it = bindings.find(wholes[w].name); it != bindings.end()) {
      bound[w] = &it->second;
    } else {
      home_offset[w] = library_bytes;
      library_bytes += AlignUp(wholes[w].nbytes);
    }
  }
  // A CUDA destination on a stack that writes device memory (fetch_memory) is a target in place
  // (direct, contiguous) or gets device staging on its device; on any other stack it is staged
  // in host memory and copied to the device after verification (docs/TRANSPORTS.md, "Device
  // memory").
  enum class Place { kSkip, kDirect, kStaging, kDeviceStaging };
  std::vector<Place> place(n, Place::kSkip);
  std::vector<size_t> whole_of(n, 0);
  std::vector<std::optional<uint64_t>> part_offset(n);  // in its tensor, when contiguous there
  std::vector<uint64_t> staging_offset(n, 0);           // in staging or its device's staging
  std::map<int, uint64_t> device_staging_bytes;
  bool host_staged_cuda = false;  // host staging copied to a device afterwards
  for (size_t w = 0; w < nw; ++w) {
    const Binding* b = bound[w];
    const bool cuda_dest = b != nullptr && b->cuda();
    const internal::CudaDestinationRoute route =
        cuda_dest ? internal::RouteCudaDestination(capabilities, staged, wholes[w].shape, b->dest,
                                                   /*placements=*/false)
                  : internal::CudaDestinationRoute::kHostStaging;
    const bool direct_home =
        b == nullptr || (cuda_dest ? route == internal::CudaDestinationRoute::kInPlace
                                   : !staged && IsContiguous(wholes[w].shape, b->dest.strides));
    for (size_t i : wholes[w].parts) {
      whole_of[i] = w;
      part_offset[i] = m.group ? internal::ContiguousOffset(m.tensors[i]) : uint64_t{0};
      if (direct_home && part_offset[i]) {
        place[i] = Place::kDirect;
      } else if (cuda_dest && route != internal::CudaDestinationRoute::kHostStaging) {
        place[i] = Place::kDeviceStaging;
        uint64_t& bytes = device_staging_bytes[b->dest.device.index];
        staging_offset[i] = bytes;
        bytes += AlignUp(m.tensors[i].nbytes);
      } else {
        place[i] = Place::kStaging;
        host_staged_cuda |= cuda_dest && m.tensors[i].nbytes > 0;
        staging_offset[i] = staging_bytes;
        staging_bytes += AlignUp(m.tensors[i].nbytes);
      }
    }
  }
  std::shared_ptr<internal::HostBuffer> library, staging;
  if (library_bytes > 0) {
    WB_ASSIGN_OR_RETURN(library, pool->Get(library_bytes));
  }
  if (staging_bytes > 0) {
    WB_ASSIGN_OR_RETURN(staging, pool->Get(staging_bytes));
    // Pinned (once per pooled buffer) for the copies to devices; unpinned still works, slower.
    if (host_staged_cuda) (void)staging->Pin();
  }
  std::map<int, std::unique_ptr<internal::cuda::DeviceBuffer>> device_staging;
  for (const auto& [device, bytes] : device_staging_bytes) {
    absl::StatusOr<std::unique_ptr<internal::cuda::DeviceBuffer>> buffer =
        internal::cuda::DeviceBuffer::Allocate(bytes, device);
    if (!buffer.ok()) {
      return internal::Annotate(
          buffer.status(),
          absl::StrFormat("%s version %d: staging bound CUDA destinations (bind_mode=staged; "
                          "bind_mode=direct receives contiguous ones in place); version %s "
                          "stays current",
                          uri.Display(), m.version, CurrentText()));
    }
    device_staging[device] = *std::move(buffer);
  }
  // Where tensor w's element [0, ..., 0] is (nullptr for an empty library tensor).
  auto home = [&](size_t w) -> std::byte* {
    if (bound[w] != nullptr) return static_cast<std::byte*>(bound[w]->dest.data);
    return library ? library->data() + home_offset[w] : nullptr;
  };
  std::vector<std::byte*> targets(n, nullptr);
  std::vector<Device> devices(n);
  std::vector<bool> needed(n, false);
  uint64_t fetched_bytes = 0;
  bool any_direct = false;  // into a bound destination
  for (size_t i = 0; i < n; ++i) {
    // Parts without bytes are "fetched" (and checked) as any tensor; a skipped replica is not.
    needed[i] = place[i] != Place::kSkip || m.tensors[i].nbytes == 0;
    if (place[i] == Place::kSkip) continue;
    fetched_bytes += m.tensors[i].nbytes;
    const Binding* b = bound[whole_of[i]];
    any_direct |= place[i] == Place::kDirect && b != nullptr;
    if (b != nullptr && b->cuda() && place[i] != Place::kStaging) devices[i] = b->dest.device;
    std::byte* base = nullptr;
    switch (place[i]) {
      case Place::kDirect:
        base = home(whole_of[i]);
        break;
      case Place::kStaging:
        base = staging ? staging->data() : nullptr;
        break;
      case Place::kDeviceStaging:
        base = device_staging[b->dest.device.index]->data();
        break;
      case Place::kSkip:
        break;
    }
    const uint64_t off = place[i] == Place::kDirect ? *part_offset[i] : staging_offset[i];
    targets[i] = base == nullptr ? nullptr : base + off;
  }
  const std::string direct_note =
      any_direct ? " (bind_mode=direct: bound destinations may hold partial data of this version)"
                 : "";
  std::optional<internal::CodecStats> codec;
  WB_RETURN_IF_ERROR(FetchVerified(std::move(incoming), m, targets, needed, devices,
                                   library_bytes + staging_bytes, direct_note, deadline, &times,
                                   &codec));

  // Everything verified: only now touch staged destinations, and place staged parts.
  CudaCopyOut cuda_out;
  absl::Status copied;
  for (size_t i = 0; i < n && copied.ok(); ++i) {
    if (place[i] == Place::kSkip || place[i] == Place::kDirect || m.tensors[i].nbytes == 0) {
      continue;
    }
    const size_t w = whole_of[i];
    const TensorInfo& part = m.tensors[i];
    const std::vector<int64_t>& strides = bound[w] != nullptr && !bound[w]->dest.strides.empty()
                                              ? bound[w]->dest.strides
                                              : internal::RowMajorStrides(wholes[w].shape);
    const bool cuda_dest = bound[w] != nullptr && bound[w]->cuda();
    if (part_offset[i] && IsContiguous(wholes[w].shape, strides)) {
      if (cuda_dest) {
        copied =
            cuda_out.Copy(targets[i], place[i] == Place::kDeviceStaging, part.dtype, part.shape, {},
                          part.nbytes, home(w) + *part_offset[i], bound[w]->dest.device.index);
      } else {
        std::memcpy(home(w) + *part_offset[i], targets[i], part.nbytes);
      }
      continue;
    }
    // A slice scattered into its tensor (element strides of the home), from its first element.
    const std::vector<int64_t> offsets =
        m.group ? internal::Offsets(part) : std::vector<int64_t>(part.shape.size(), 0);
    int64_t first = 0;
    for (size_t d = 0; d < offsets.size(); ++d) first += offsets[d] * strides[d];
    const size_t elem = DTypeSize(part.dtype);
    std::byte* at = home(w) + first * static_cast<int64_t>(elem);
    if (cuda_dest) {
      copied = cuda_out.Copy(targets[i], place[i] == Place::kDeviceStaging, part.dtype, part.shape,
                             strides, part.nbytes, at, bound[w]->dest.device.index);
    } else {
      internal::UnpackStrided(targets[i], elem, part.shape, strides, at);
    }
  }
  if (copied.ok()) copied = cuda_out.Finish();
  if (!copied.ok()) {
    return absl::Status(
        copied.code(),
        absl::StrFormat("%s: version %d was received and verified, but copying it into its bound "
                        "CUDA destinations failed: %s; bound destinations may hold a mix of "
                        "versions, version %s stays current (the next receive writes every byte "
                        "of every bound tensor)",
                        uri.Display(), m.version, copied.message(), CurrentText()));
  }
  staging.reset();
  device_staging.clear();
  times.end = absl::Now();

  impl->views.reserve(nw);
  for (size_t w = 0; w < nw; ++w) {
    const internal::AssembledTensor& t = wholes[w];
    // A group version's tensors are handed over whole; a single publisher's keep their shard.
    std::optional<Shard> shard = m.group ? std::nullopt : m.tensors[t.parts.front()].shard;
    TensorView v{t.name, t.dtype, t.shape, {}, home(w), Device{}, std::move(shard)};
    if (bound[w] != nullptr) {
      v.strides = bound[w]->dest.strides;
      v.device = bound[w]->dest.device;
    }
    impl->index.emplace(t.name, w);
    impl->views.push_back(std::move(v));
  }
  return HandOver(std::move(impl), std::move(library), fetched_bytes, times, codec);
}

absl::Status Subscriber::Impl::CheckSealed(const Manifest& m) const {
  WB_RETURN_IF_ERROR(
      internal::CheckManifestMac(key ? &*key : nullptr, m, uri.Display(), CurrentText()));
  if (current && m.version == *current) {
    if (std::optional<std::string> diff =
            internal::ContentDifference(m.tensors, "offered", held_tensors, "held")) {
      auto session = [](const std::string& id) { return id.empty() ? "(unnamed)" : id.c_str(); };
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: version %d offered by publisher session %s (pid %d on %s) is not the version %d "
          "this subscriber holds, from session %s: %s. A publisher reused a version number (a "
          "restarted ucx:// publisher keeps no history); it must publish above version %d, or "
          "open a new Subscriber to follow a new history; version %d stays current",
          uri.Display(), m.version, session(m.publisher.session), m.publisher.pid, m.publisher.host,
          *current, session(held_session), *diff, *current, *current));
    }
  }
  return absl::OkStatus();
}

// The first difference between what a version announced before it was sealed and its sealed
// manifest, other than what sealing adds (checksums, sealed_unix_ns, the MAC), or nullopt.
static std::optional<std::string> LayoutDifference(const Manifest& announced,
                                                   const Manifest& sealed) {
  if (announced.version != sealed.version || announced.group != sealed.group ||
      !(announced.publisher == sealed.publisher) ||
      announced.publish_start_unix_ns != sealed.publish_start_unix_ns) {
    return absl::StrFormat(
        "version %d (publisher session %s) was sealed as version %d (session %s)",
        announced.version, announced.publisher.session, sealed.version, sealed.publisher.session);
  }
  Metadata metadata = sealed.metadata;
  metadata.erase(std::string(internal::kMacMetadataKey));
  if (metadata != announced.metadata) return std::string("its metadata changed");
  if (announced.tensors.size() != sealed.tensors.size()) {
    return absl::StrFormat("%d tensors were announced, %d sealed", announced.tensors.size(),
                           sealed.tensors.size());
  }
  for (size_t i = 0; i < sealed.tensors.size(); ++i) {
    const TensorInfo& a = announced.tensors[i];
    const TensorInfo& b = sealed.tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.shard != b.shard ||
        a.nbytes != b.nbytes || a.owner != b.owner) {
      return absl::StrFormat("tensor %d was announced as \"%s\" %s %s and sealed as \"%s\" %s %s",
                             i, a.name, DTypeName(a.dtype), ShapeString(a.shape), b.name,
                             DTypeName(b.dtype), ShapeString(b.shape));
    }
  }
  return std::nullopt;
}

absl::Status Subscriber::Impl::FetchVerified(std::unique_ptr<internal::IncomingVersion> incoming,
                                             Manifest& m, const std::vector<std::byte*>& targets,
                                             const std::vector<bool>& needed,
                                             const std::vector<Device>& devices, uint64_t mapped,
                                             const std::string& direct_note, absl::Time deadline,
                                             Times* times,
                                             std::optional<internal::CodecStats>* codec) {
  times->allocated = absl::Now();
  if (times->allocated > deadline) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s: version %d found, but mapping %d bytes of receive buffers took until past the "
        "deadline; version %s stays current",
        uri.Display(), m.version, mapped, CurrentText()));
  }
  const bool sealed_first = incoming->sealed();
  Verifier verifier(m, targets, needed, devices, *hashers);
  absl::Status fetch = failpoints.Hit("core.before_fetch");
  if (fetch.ok()) fetch = incoming->Fetch(targets, verifier, deadline);
  times->fetched = absl::Now();
  verifier.Drain();
  times->verified = absl::Now();
  if (!fetch.ok()) {
    return absl::Status(fetch.code(), absl::StrFormat("%s: receiving version %d failed: %s%s; "
                                                      "version %s stays current",
                                                      uri.Display(), m.version, fetch.message(),
                                                      direct_note, CurrentText()));
  }
  if (absl::Status e = verifier.error(); !e.ok()) {
    return absl::Status(
        e.code(), absl::StrFormat("%s: version %d: %s; version %s stays current", uri.Display(),
                                  m.version, e.message(), CurrentText()));
  }
  if (!sealed_first) {
    // Found before it was sealed: the sealed manifest (the transport's now) must describe what
    // was announced, and pass the checks a sealed version passes when found; the checksums
    // below are then its.
    if (!incoming->sealed()) {
      return absl::InternalError(absl::StrFormat(
          "%s version %d: the transport finished the transfer without the sealed manifest; "
          "version %s stays current",
          uri.Display(), m.version, CurrentText()));
    }
    const Manifest& sealed = incoming->manifest();
    if (std::optional<std::string> diff = LayoutDifference(m, sealed)) {
      return absl::DataLossError(absl::StrFormat(
          "%s version %d: the sealed manifest differs from the one announced before the "
          "transfer: %s%s; version %s stays current",
          uri.Display(), m.version, *diff, direct_note, CurrentText()));
    }
    WB_RETURN_IF_ERROR(CheckManifest(uri, sealed));
    WB_RETURN_IF_ERROR(CheckSealed(sealed));
    m = sealed;  // same layout: the targets and the verifier's sizes stay valid
    m.metadata.erase(std::string(internal::kMacMetadataKey));
  }
  bool never_landed = false;
  if (std::optional<size_t> bad = verifier.FirstFailure(&never_landed)) {
    const TensorInfo& t = m.tensors[*bad];
    if (never_landed) {
      return absl::InternalError(
          absl::StrFormat("%s version %d: transport finished without delivering tensor \"%s\"",
                          uri.Display(), m.version, t.name));
    }
    return absl::DataLossError(absl::StrFormat(
        "%s version %d: tensor \"%s\" from %s fails verification: XXH3-64 of the received %d "
        "bytes is %016x but the manifest says %016x%s; version %s stays current",
        uri.Display(), m.version, t.name, incoming->DescribeSource(*bad), t.nbytes,
        verifier.actual(*bad), t.xxh3, direct_note, CurrentText()));
  }
  incoming->Accepted();
  *codec = incoming->FetchCodecStats();
  incoming.reset();  // releases the transport's pin on the version
  return absl::OkStatus();
}

std::unique_ptr<Update> Subscriber::Impl::HandOver(
    std::unique_ptr<Update::Impl> impl, std::shared_ptr<internal::HostBuffer> library,
    uint64_t fetched_bytes, const Times& times, const std::optional<internal::CodecStats>& codec) {
  const Manifest& m = impl->manifest;
  impl->buffer = std::move(library);
  impl->stats = UpdateStats{};
  impl->stats.bytes = fetched_bytes;
  impl->stats.wait = times.found - times.start;
  impl->stats.allocate = times.allocated - times.found;
  impl->stats.fetch = times.fetched - times.allocated;
  impl->stats.verify_wait = times.verified - times.fetched;
  impl->stats.copy_out = times.end - times.verified;
  impl->stats.ready_unix_ns = absl::ToUnixNanos(times.end);
  // Wire bytes: the tensors' own for a plain transport; a layer reports its encoded size.
  if (codec) {
    impl->stats.decode = codec->time;
    impl->stats.wire_bytes = codec->wire_bytes;
    impl->stats.encoding = codec->encoding;
  } else if (stack.size() == 1) {
    impl->stats.wire_bytes = fetched_bytes;
  }
  current = m.version;
  held_session = m.publisher.session;
  held_tensors = m.tensors;
  return std::make_unique<Update>(std::move(impl));
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::Impl::ReceiveResharded(
    std::unique_ptr<internal::IncomingVersion> incoming, std::unique_ptr<Update::Impl> impl,
    const std::vector<internal::AssembledTensor>& wholes, Times times, absl::Time deadline) {
  Manifest& m = impl->manifest;
  const TensorParallelRank rank = placements->rank;
  // The layout the planner reads: each tensor's parts as AssembleParts chose them (the one
  // home of the manifest's consistency rules: owners, dtypes, global shapes, fit, gaps, and
  // replicas read once after their checksums were compared), each at its byte offset in a
  // virtual space per owner (its parts one after another). A single publisher is rank 0 of a
  // group of one, owning every tensor whole.
  internal::SourceLayout layout;
  layout.world_size = m.group ? m.publisher.world_size : 1;
  std::vector<std::vector<size_t>> part_index(wholes.size());  // [tensor][part]: manifest index
  std::vector<uint64_t> owner_bytes(layout.world_size, 0);
  layout.tensors.reserve(wholes.size());
  for (size_t w = 0; w < wholes.size(); ++w) {
    internal::SourceTensor& st = layout.tensors.emplace_back();
    st.name = wholes[w].name;
    for (size_t i : wholes[w].parts) {
      const TensorInfo& p = m.tensors[i];
      const int owner = m.group ? p.owner : 0;
      st.parts.push_back(internal::SourcePart{
          owner, p.dtype, wholes[w].shape,
          m.group ? internal::Offsets(p) : std::vector<int64_t>(p.shape.size(), 0), p.shape,
          owner_bytes[owner], p.nbytes});
      owner_bytes[owner] += p.nbytes;
      part_index[w].push_back(i);
    }
  }
  std::vector<std::string> names = placements->tensors;
  if (names.empty()) {
    for (const internal::AssembledTensor& t : wholes) names.push_back(t.name);
  }
  auto refuse = [&](const absl::Status& why) {
    return absl::Status(
        why.code(), absl::StrFormat("%s version %d: cannot plan the slices of TP rank %d of %d: "
                                    "%s; nothing was fetched, version %s stays current",
                                    uri.Display(), m.version, rank.rank, rank.size, why.message(),
                                    CurrentText()));
  };
  absl::StatusOr<std::vector<internal::TensorRequest>> requests =
      internal::ResolvePlacements(placements->rules, names);
  if (!requests.ok()) return refuse(requests.status());
  internal::PlanOptions plan_options;
  if (placements->skip_absent) plan_options.absent = internal::AbsentPolicy::kSkip;
  absl::StatusOr<const internal::ReshardPlan*> planned =
      plans.Get(layout, *requests, rank, plan_options);
  if (!planned.ok()) return refuse(planned.status());
  const internal::ReshardPlan& plan = **planned;

  std::vector<internal::AssembledTensor> slices;
  slices.reserve(plan.tensors.size());
  for (const internal::TensorPlan& t : plan.tensors) {
    slices.push_back(internal::AssembledTensor{t.name, t.dtype, t.shape, t.nbytes, {}});
  }
  WB_RETURN_IF_ERROR(CheckBindings(m.version, slices));

  // Partial reads: only the blocks the plan touches, through a bounded window.
  bool partial = capabilities.partial_reads;
  for (const internal::TensorPlan& t : plan.tensors) {
    for (const internal::ByteRange& r : t.ranges) {
      partial &= m.tensors[part_index[r.source_tensor][r.source_part]].block_bytes > 0;
    }
  }
  if (partial) {
    return ReceivePartial(std::move(incoming), std::move(impl), layout, part_index, plan, times,
                          deadline);
  }

  // Staging holds the parts the plan reads; each slice is assembled from it into its home
  // (library memory, or a bound destination; a strided one through a row-major scratch slice
  // in staging) once every part is verified.
  const size_t n = m.tensors.size();
  std::vector<bool> read(n, false);
  for (const internal::TensorPlan& t : plan.tensors) {
    for (const internal::ByteRange& r : t.ranges) {
      read[part_index[r.source_tensor][r.source_part]] = true;
    }
  }
  std::vector<uint64_t> staging_offset(n, 0);
  uint64_t staging_bytes = 0, fetched_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!read[i]) continue;
    staging_offset[i] = staging_bytes;
    staging_bytes += AlignUp(m.tensors[i].nbytes);
    fetched_bytes += m.tensors[i].nbytes;
  }
  const size_t nt = plan.tensors.size();
  std::vector<const Binding*> bound(nt, nullptr);
  std::vector<uint64_t> home_offset(nt, 0);  // in library, or staging for a scratch slice
  uint64_t library_bytes = 0;
  bool any_cuda = false;  // a scratch slice copied to a device
  for (size_t t = 0; t < nt; ++t) {
    const internal::TensorPlan& tp = plan.tensors[t];
    if (auto it = bindings.find(tp.name); it != bindings.end()) {
      bound[t] = &it->second;
      if (ScratchSlice(tp, *bound[t])) {
        home_offset[t] = staging_bytes;
        staging_bytes += AlignUp(tp.nbytes);
        any_cuda |= bound[t]->cuda();
      }
    } else {
      home_offset[t] = library_bytes;
      library_bytes += AlignUp(tp.nbytes);
    }
  }
  std::shared_ptr<internal::HostBuffer> library, staging;
  if (library_bytes > 0) {
    WB_ASSIGN_OR_RETURN(library, pool->Get(library_bytes));
  }
  if (staging_bytes > 0) {
    WB_ASSIGN_OR_RETURN(staging, pool->Get(staging_bytes));
    if (any_cuda) (void)staging->Pin();  // for the copies to devices; unpinned works, slower
  }
  std::vector<std::byte*> targets(n, nullptr);
  std::vector<bool> needed(n, false);
  for (size_t i = 0; i < n; ++i) {
    needed[i] = read[i] || m.tensors[i].nbytes == 0;  // as Receive: empty parts are checked
    if (read[i]) targets[i] = staging->data() + staging_offset[i];
  }
  std::optional<internal::CodecStats> codec;
  WB_RETURN_IF_ERROR(FetchVerified(std::move(incoming), m, targets, needed, {},
                                   library_bytes + staging_bytes, "", deadline, &times, &codec));

  // Every part read is verified: assemble the slices. The plan's source offsets are in the
  // virtual per-owner space; each range is moved to where its part lies in staging.
  const absl::Span<const std::byte> staged =
      staging ? absl::Span<const std::byte>(staging->data(), staging_bytes)
              : absl::Span<const std::byte>();
  const std::vector<absl::Span<const std::byte>> rank_data(layout.world_size, staged);
  impl->views.reserve(nt);
  CudaCopyOut cuda_out;
  for (size_t t = 0; t < nt; ++t) {
    internal::TensorPlan tp = plan.tensors[t];
    for (internal::ByteRange& r : tp.ranges) {
      const size_t i = part_index[r.source_tensor][r.source_part];
      r.source_offset = r.source_offset -
                        layout.tensors[r.source_tensor].parts[r.source_part].byte_offset +
                        staging_offset[i];
    }
    const bool scratch = bound[t] != nullptr && ScratchSlice(tp, *bound[t]);
    std::byte* home = bound[t] != nullptr && !scratch ? static_cast<std::byte*>(bound[t]->dest.data)
                      : scratch                       ? staging->data() + home_offset[t]
                      : library                       ? library->data() + home_offset[t]
                                                      : nullptr;
    if (absl::Status s = internal::ApplyPlan(tp, rank_data, {home, tp.nbytes}); !s.ok()) {
      return absl::InternalError(
          absl::StrFormat("%s version %d: %s", uri.Display(), m.version, s.message()));
    }
    if (scratch) WB_RETURN_IF_ERROR(CopySlice(cuda_out, m.version, tp, home, *bound[t]));
    AddSliceView(*impl, tp, t, home, bound[t]);
  }
  WB_RETURN_IF_ERROR(FinishCopies(cuda_out, m.version));
  staging.reset();
  times.end = absl::Now();
  return HandOver(std::move(impl), std::move(library), fetched_bytes, times, codec);
}

absl::Status Subscriber::Impl::CopySlice(CudaCopyOut& cuda_out, uint64_t version,
                                         const internal::TensorPlan& tp, const std::byte* scratch,
                                         const Binding& b) const {
  const Destination& d = b.dest;
  if (!b.cuda()) {
    if (IsContiguous(tp.shape, d.strides)) {
      std::memcpy(d.data, scratch, tp.nbytes);
    } else {
      internal::UnpackStrided(scratch, DTypeSize(tp.dtype), tp.shape, d.strides, d.data);
    }
    return absl::OkStatus();
  }
  absl::Status s = cuda_out.Copy(scratch, /*src_on_device=*/false, tp.dtype, tp.shape, d.strides,
                                 tp.nbytes, d.data, d.device.index);
  if (s.ok()) return s;
  return absl::Status(
      s.code(), absl::StrFormat("%s: version %d was received and verified, but copying tensor "
                                "\"%s\" into its bound CUDA destination failed: %s; bound "
                                "destinations may hold a mix of versions, version %s stays "
                                "current",
                                uri.Display(), version, tp.name, s.message(), CurrentText()));
}

absl::Status Subscriber::Impl::FinishCopies(CudaCopyOut& cuda_out, uint64_t version) const {
  absl::Status s = cuda_out.Finish();
  if (s.ok()) return s;
  return absl::Status(
      s.code(), absl::StrFormat("%s: version %d was received and verified, but copying it into "
                                "its bound CUDA destinations failed: %s; bound destinations may "
                                "hold a mix of versions, version %s stays current",
                                uri.Display(), version, s.message(), CurrentText()));
}

absl::StatusOr<std::unique_ptr<Update>> Subscriber::Impl::ReceivePartial(
    std::unique_ptr<internal::IncomingVersion> incoming, std::unique_ptr<Update::Impl> impl,
    const internal::SourceLayout& layout, const std::vector<std::vector<size_t>>& part_index,
    const internal::ReshardPlan& plan, Times times, absl::Time deadline) {
  const Manifest& m = impl->manifest;
  const size_t nt = plan.tensors.size();

  // Each slice's home: library memory (unbound), its bound destination (bind_mode=direct and
  // contiguous), or a row-major scratch slice copied into the destination once every block is
  // verified (bind_mode=staged, or a strided destination): a failed update never touches it.
  std::vector<const Binding*> bound(nt, nullptr);
  std::vector<bool> scratch(nt, false);
  std::vector<uint64_t> home_offset(nt, 0);  // in library or scratch
  uint64_t library_bytes = 0, scratch_bytes = 0;
  bool any_cuda = false;  // a scratch slice copied to a device
  for (size_t t = 0; t < nt; ++t) {
    const internal::TensorPlan& tp = plan.tensors[t];
    if (auto it = bindings.find(tp.name); it != bindings.end()) {
      bound[t] = &it->second;
      scratch[t] = tp.nbytes > 0 && (staged || ScratchSlice(tp, *bound[t]));
      any_cuda |= scratch[t] && bound[t]->cuda();
      if (scratch[t]) {
        home_offset[t] = scratch_bytes;
        scratch_bytes += AlignUp(tp.nbytes);
      }
    } else {
      home_offset[t] = library_bytes;
      library_bytes += AlignUp(tp.nbytes);
    }
  }

  // Every range the plan copies, as (part, offset in the part, length, destination), and the
  // checksum tiles they touch (core/tile_reads.h), packed into windows of two buffers of half of
  // staging_window each (at least the largest tile): the next window is read into one while the
  // other is verified and copied out.
  std::vector<internal::WantedRange> pieces;
  for (size_t t = 0; t < nt; ++t) {
    for (const internal::ByteRange& r : plan.tensors[t].ranges) {
      if (r.length == 0) continue;
      const internal::SourcePart& sp = layout.tensors[r.source_tensor].parts[r.source_part];
      pieces.push_back(internal::WantedRange{part_index[r.source_tensor][r.source_part],
                                             r.source_offset - sp.byte_offset, r.length, t,
                                             r.dest_offset});
    }
  }
  std::vector<internal::TileGrid> grids(m.tensors.size());
  uint64_t largest_tile = 0;
  for (const internal::WantedRange& p : pieces) {
    internal::TileGrid& g = grids[p.part];
    if (g.has_tiles()) continue;
    g = internal::GridOf(m.tensors[p.part]);
    if (g.count() > 0) largest_tile = std::max(largest_tile, g.tile(0).size());  // the largest
  }
  const uint64_t window_limit = std::max(config->Bytes("staging_window") / 2, largest_tile);
  const internal::TileReadPlan reads = internal::PlanTileReads(grids, pieces, window_limit);
  const std::vector<std::vector<internal::TileChunk>>& windows = reads.windows;
  const uint64_t window_bytes = reads.window_bytes, read_bytes = reads.read_bytes;

  std::shared_ptr<internal::HostBuffer> library, scratch_buffer, window_buffers[2];
  if (library_bytes > 0) {
    WB_ASSIGN_OR_RETURN(library, pool->Get(library_bytes));
  }
  if (scratch_bytes > 0) {
    WB_ASSIGN_OR_RETURN(scratch_buffer, pool->Get(scratch_bytes));
    if (any_cuda) (void)scratch_buffer->Pin();  // for the copies to devices
  }
  for (size_t b = 0; b < std::min<size_t>(windows.size(), 2); ++b) {
    WB_ASSIGN_OR_RETURN(window_buffers[b], pool->Get(window_bytes));
  }
  auto home = [&](size_t t) -> std::byte* {
    if (scratch[t]) return scratch_buffer->data() + home_offset[t];
    if (bound[t] != nullptr) return static_cast<std::byte*>(bound[t]->dest.data);
    return library ? library->data() + home_offset[t] : nullptr;
  };
  times.allocated = absl::Now();
  if (times.allocated > deadline) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s: version %d found, but mapping %d bytes of receive buffers took until past the "
        "deadline; version %s stays current",
        uri.Display(), m.version, library_bytes + scratch_bytes + 2 * window_bytes, CurrentText()));
  }
  const bool any_direct = [&] {
    for (size_t t = 0; t < nt; ++t) {
      if (bound[t] != nullptr && !scratch[t] && plan.tensors[t].nbytes > 0) return true;
    }
    return false;
  }();
  const std::string direct_note =
      any_direct ? " (bind_mode=direct: bound destinations may hold partial data of this version)"
                 : "";
  auto failed = [&](const absl::Status& s) {
    return absl::Status(
        s.code(),
        absl::StrFormat("%s: receiving version %d failed: %s%s; version %s stays "
                        "current",
                        uri.Display(), m.version, s.message(), direct_note, CurrentText()));
  };

  absl::Status status = failpoints.Hit("core.before_fetch");
  if (!status.ok()) return failed(status);
  {  // Every range about to be read, for a transport that reconstructs what it serves (delta).
    std::vector<internal::RangeRead> all;
    for (const std::vector<internal::TileChunk>& chunks : windows) {
      for (const internal::TileChunk& c : chunks) {
        internal::ForEachChunkRead(c, grids[c.part], [&](uint64_t at, uint64_t n, uint64_t) {
          all.push_back(internal::RangeRead{c.part, at, n, nullptr});
        });
      }
    }
    incoming->PlanRanges(all);
  }
  // Window w is read into window_buffers[w % 2] by `reading` while window w - 1 is checked.
  auto read_window = [&](size_t w) {
    std::vector<internal::RangeRead> reads;
    for (const internal::TileChunk& c : windows[w]) {
      internal::ForEachChunkRead(c, grids[c.part], [&](uint64_t at, uint64_t n, uint64_t to) {
        reads.push_back(internal::RangeRead{c.part, at, n, window_buffers[w % 2]->data() + to});
      });
    }
    return incoming->FetchRanges(reads, deadline);
  };
  // A thread when one can be started, else inline at get(); never left running on return (it
  // writes into the window buffers through `incoming`).
  std::future<absl::Status> reading;
  absl::Cleanup wait_reading = [&] {
    if (reading.valid()) reading.wait();
  };
  if (!windows.empty()) {
    reading = std::async(std::launch::async | std::launch::deferred, read_window, size_t{0});
  }
  const internal::RangeCopier copier(grids, pieces);
  for (size_t w = 0; w < windows.size(); ++w) {
    const std::vector<internal::TileChunk>& chunks = windows[w];
    const std::shared_ptr<internal::HostBuffer>& window = window_buffers[w % 2];
    if (absl::Status s = reading.get(); !s.ok()) return failed(s);
    if (w + 1 < windows.size()) {
      reading = std::async(std::launch::async | std::launch::deferred, read_window, w + 1);
    }
    // Verify every tile of the window on the hashing pool, then copy what the plan needs.
    struct Check {
      size_t part;
      uint64_t tile, at, rows, width, stride;
      uint64_t actual = 0;
    };
    std::vector<Check> checks;
    for (const internal::TileChunk& c : chunks) {
      internal::ForEachChunkTile(
          c, grids[c.part],
          [&](uint64_t k, uint64_t at, uint64_t rows, uint64_t width, uint64_t stride) {
            checks.push_back(Check{c.part, k, at, rows, width, stride});
          });
    }
    internal::TaskCounter pending;
    pending.Add(static_cast<int>(checks.size()));
    for (Check& check : checks) {
      hashers->Submit([&] {
        check.actual =
            internal::Xxh3Strided(window->data() + check.at, check.rows, check.width, check.stride);
        pending.Done();
      });
    }
    pending.WaitUntilZero(absl::InfiniteFuture());  // the tasks read `window` and `checks`
    for (const Check& check : checks) {
      const TensorInfo& t = m.tensors[check.part];
      if (check.actual == t.block_xxh3[check.tile]) continue;
      return absl::DataLossError(absl::StrFormat(
          "%s version %d: tensor \"%s\" (the part of source rank %d) fails verification in %s: "
          "XXH3-64 of the bytes read is %016x but the manifest says %016x%s; version %s stays "
          "current",
          uri.Display(), m.version, t.name, m.group ? t.owner : 0,
          grids[check.part].Describe(check.tile, t.block_rows == 0,
                                     incoming->DescribeSource(check.part)),
          check.actual, t.block_xxh3[check.tile], direct_note, CurrentText()));
    }
    // Copy the pieces of the ranges that lie in this window's chunks.
    for (const internal::TileChunk& c : chunks) {
      copier.ForEach(c, [&](size_t q, uint64_t into, uint64_t at, uint64_t n) {
        const internal::WantedRange& p = pieces[q];
        std::memcpy(home(p.dest) + p.dest_offset + into, window->data() + at, n);
      });
    }
  }
  times.fetched = times.verified = absl::Now();
  std::move(wait_reading).Invoke();
  incoming->Accepted();
  std::optional<internal::CodecStats> codec = incoming->FetchCodecStats();
  incoming.reset();  // releases the transport's pin on the version
  for (auto& b : window_buffers) b.reset();

  // Every block verified: only now touch staged destinations.
  impl->views.reserve(nt);
  CudaCopyOut cuda_out;
  for (size_t t = 0; t < nt; ++t) {
    const internal::TensorPlan& tp = plan.tensors[t];
    if (scratch[t]) WB_RETURN_IF_ERROR(CopySlice(cuda_out, m.version, tp, home(t), *bound[t]));
    AddSliceView(*impl, tp, t, home(t), bound[t]);
  }
  WB_RETURN_IF_ERROR(FinishCopies(cuda_out, m.version));
  scratch_buffer.reset();
  times.end = absl::Now();
  return HandOver(std::move(impl), std::move(library), read_bytes, times, codec);
}

}  // namespace weightbus
