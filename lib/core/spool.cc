// SPDX-License-Identifier: Apache-2.0
#include "core/spool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "core/tensor_pack.h"

#if defined(WEIGHTBUS_CORE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace weightbus::internal {

namespace {

constexpr uint64_t kAlign = 64;  // tensors start 64-byte aligned in the file (and its mapping)

#if defined(WEIGHTBUS_CORE_CUDA)
absl::Status CudaStatus(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s: %s", what, cudaGetErrorString(e)));
}
#endif

}  // namespace

bool SpoolSupportsCuda() {
#if defined(WEIGHTBUS_CORE_CUDA)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<TensorSpool>> TensorSpool::Create(const std::string& dir,
                                                                 uint64_t bucket_bytes,
                                                                 WorkerPool* pool) {
  int fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    // A filesystem without O_TMPFILE: a named file, unlinked at once.
    std::string path = dir + "/.weightbus-spool-XXXXXX";
    fd = mkostemp(path.data(), O_CLOEXEC);
    if (fd >= 0) unlink(path.c_str());
  }
  if (fd < 0) {
    return ErrnoStatus(errno, absl::StrFormat("creating the streaming publish's spool file in "
                                              "\"%s\" (setting stream_spill_dir)",
                                              dir));
  }
  const uint64_t half = std::max<uint64_t>(bucket_bytes / 2, 4096) & ~uint64_t{4095};
  std::unique_ptr<TensorSpool> spool(new TensorSpool(fd, dir, half, pool));
  for (Bucket& b : spool->buckets_) {
    WB_ASSIGN_OR_RETURN(b.buffer, HostBuffer::Allocate(half));
  }
  return spool;
}

TensorSpool::~TensorSpool() {
  (void)WaitCudaCopy();
  (void)WaitWriter();
#if defined(WEIGHTBUS_CORE_CUDA)
  if (copy_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(copy_event_));
  if (pinned_) {
    for (Bucket& b : buckets_) cudaHostUnregister(b.buffer->data());
  }
#endif
  if (map_ != nullptr) munmap(const_cast<std::byte*>(map_), map_size_);
  close(fd_);
}

absl::Status TensorSpool::BeginTensor() {
  WB_RETURN_IF_ERROR(broken_);
  WB_RETURN_IF_ERROR(WaitCudaCopy());
  Bucket& b = buckets_[current_];
  const uint64_t pos = file_end_ + b.fill;
  const uint64_t pad = (kAlign - pos % kAlign) % kAlign;
  if (b.fill + pad > half_) {
    WB_RETURN_IF_ERROR(Flush());  // half_ is a multiple of kAlign: the next bucket is aligned
  } else {
    std::memset(b.buffer->data() + b.fill, 0, pad);
    b.fill += pad;
  }
  offsets_.push_back(file_end_ + buckets_[current_].fill);
  digests_.emplace_back();
  return absl::OkStatus();
}

absl::StatusOr<std::pair<std::byte*, uint64_t>> TensorSpool::Reserve(uint64_t want) {
  if (buckets_[current_].fill == half_) WB_RETURN_IF_ERROR(Flush());
  Bucket& b = buckets_[current_];
  return std::make_pair(b.buffer->data() + b.fill, std::min(want, half_ - b.fill));
}

void TensorSpool::Claimed(uint64_t n, uint64_t tensor_bytes, const TileGrid& grid, bool first,
                          bool last) {
  Bucket& b = buckets_[current_];
  b.segments.push_back(Segment{offsets_.size() - 1, tensor_bytes, grid, b.fill, n, first, last});
  b.fill += n;
}

absl::Status TensorSpool::AddHost(const TensorView& view, uint64_t nbytes, const TileGrid& grid) {
  WB_RETURN_IF_ERROR(BeginTensor());
  if (nbytes == 0) {
    digests_.back() = ChecksumTensor(nullptr, 0, grid);
    return absl::OkStatus();
  }
  const bool contiguous = IsContiguous(view.shape, view.strides);
  const size_t elem = DTypeSize(view.dtype);
  for (uint64_t at = 0; at < nbytes;) {
    absl::StatusOr<std::pair<std::byte*, uint64_t>> room = Reserve(nbytes - at);
    if (!room.ok()) return broken_ = room.status();
    auto [dst, n] = *room;
    if (contiguous) {
      std::memcpy(dst, static_cast<const std::byte*>(view.data) + at, n);
    } else {
      PackStridedRange(view.data, elem, view.shape, view.strides, at, n, dst);
    }
    Claimed(n, nbytes, grid, at == 0, at + n == nbytes);
    at += n;
  }
  bytes_ += nbytes;
  return absl::OkStatus();
}

absl::Status TensorSpool::AddCuda(const void* device_data, uint64_t nbytes, int device,
                                  void* cuda_stream, const TileGrid& grid) {
#if defined(WEIGHTBUS_CORE_CUDA)
  WB_RETURN_IF_ERROR(BeginTensor());
  if (nbytes == 0) {
    digests_.back() = ChecksumTensor(nullptr, 0, grid);
    return absl::OkStatus();
  }
  // The caller's current device is restored on return (the copy runs on `device`).
  int previous = 0;
  absl::Status status = CudaStatus(cudaGetDevice(&previous), "cudaGetDevice");
  if (status.ok()) status = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  if (!status.ok()) return broken_ = status;
  absl::Cleanup restore = [previous] { (void)cudaSetDevice(previous); };
  status = EnsurePinned(device);
  if (!status.ok()) return broken_ = status;
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  for (uint64_t at = 0; at < nbytes;) {
    // Reserve may flush a full bucket; the copies queued into it are waited for first.
    if (buckets_[current_].fill == half_) {
      if (absl::Status s = WaitCudaCopy(); !s.ok()) return broken_ = s;
    }
    absl::StatusOr<std::pair<std::byte*, uint64_t>> room = Reserve(nbytes - at);
    if (!room.ok()) return broken_ = room.status();
    auto [dst, n] = *room;
    status = CudaStatus(cudaMemcpyAsync(dst, static_cast<const std::byte*>(device_data) + at, n,
                                        cudaMemcpyDeviceToHost, stream),
                        absl::StrFormat("cudaMemcpyAsync of %d bytes to pinned host memory", n));
    if (status.ok()) {
      status = CudaStatus(cudaEventRecord(static_cast<cudaEvent_t>(copy_event_), stream),
                          "cudaEventRecord");
    }
    if (!status.ok()) return broken_ = status;
    copy_pending_ = true;
    Claimed(n, nbytes, grid, at == 0, at + n == nbytes);
    at += n;
  }
  bytes_ += nbytes;
  return absl::OkStatus();
#else
  (void)device_data;
  (void)nbytes;
  (void)device;
  (void)cuda_stream;
  (void)grid;
  return absl::UnimplementedError(
      "CUDA tensors: this build of weightbus has no CUDA support (configure with "
      "-DWEIGHTBUS_WITH_CUDA=ON), so copy them to host memory first");
#endif
}

absl::Status TensorSpool::EnsurePinned(int device) {
#if defined(WEIGHTBUS_CORE_CUDA)
  if (!pinned_) {
    // Portable: the pinned buckets serve copies from every device.
    for (Bucket& b : buckets_) {
      WB_RETURN_IF_ERROR(
          CudaStatus(cudaHostRegister(b.buffer->data(), b.buffer->size(), cudaHostRegisterPortable),
                     absl::StrFormat("pinning the %d-byte staging bucket (cudaHostRegister)",
                                     b.buffer->size())));
    }
    pinned_ = true;
  }
  if (copy_event_ != nullptr && event_device_ == device) return absl::OkStatus();
  // An event is recorded on streams of its own device: a tensor on another device than the
  // last one's gets a new event (the previous copy was waited for by BeginTensor).
  if (copy_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(copy_event_));
  copy_event_ = nullptr;
  cudaEvent_t event;
  WB_RETURN_IF_ERROR(
      CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
  copy_event_ = event;
  event_device_ = device;
#else
  (void)device;
#endif
  return absl::OkStatus();
}

absl::Status TensorSpool::WaitCudaCopy() {
  if (!copy_pending_) return absl::OkStatus();
  copy_pending_ = false;
#if defined(WEIGHTBUS_CORE_CUDA)
  absl::Status s = CudaStatus(cudaEventSynchronize(static_cast<cudaEvent_t>(copy_event_)),
                              "waiting for the copy of a CUDA tensor to pinned host memory");
  if (!s.ok()) broken_ = s;
  return s;
#else
  return absl::OkStatus();
#endif
}

absl::Status TensorSpool::WaitWriter() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](bool* writing) { return !*writing; }, &writing_));
  for (Bucket& b : buckets_) {  // the writer's results, now that it is idle
    for (auto& [tensor, digest] : b.digests) digests_[tensor] = std::move(digest);
    b.digests.clear();
  }
  return write_status_;
}

absl::Status TensorSpool::Flush() {
  WB_RETURN_IF_ERROR(WaitWriter());
  Bucket& b = buckets_[current_];
  const uint64_t file_offset = file_end_;
  file_end_ += b.fill;
  current_ ^= 1;
  buckets_[current_].fill = 0;
  buckets_[current_].segments.clear();
  if (b.fill == 0) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    writing_ = true;
  }
  // One write in flight at a time, in file order: the tensor hash runs across buckets in order.
  pool_->Submit([this, &b, file_offset] {
    for (const Segment& s : b.segments) {
      if (s.first) hash_ = std::make_unique<TensorHasher>(s.tensor_bytes, s.grid);
      hash_->Update(b.buffer->data() + s.bucket_offset, s.size);
      if (s.last) b.digests.emplace_back(s.tensor, hash_->Finish());
    }
    absl::Status status;
    for (uint64_t done = 0; done < b.fill;) {
      const ssize_t n = pwrite(fd_, b.buffer->data() + done, b.fill - done,
                               static_cast<off_t>(file_offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        status = ErrnoStatus(n < 0 ? errno : ENOSPC,
                             absl::StrFormat("writing %d bytes of the streaming publish's spool "
                                             "file in \"%s\" (setting stream_spill_dir)",
                                             b.fill - done, dir_));
        break;
      }
      done += static_cast<uint64_t>(n);
    }
    absl::MutexLock lock(&mu_);
    if (write_status_.ok()) write_status_ = status;
    writing_ = false;
  });
  return absl::OkStatus();
}

absl::Status TensorSpool::Seal() {
  WB_RETURN_IF_ERROR(broken_);
  absl::Status status = WaitCudaCopy();
  if (status.ok()) status = Flush();
  if (status.ok()) status = WaitWriter();
  if (!status.ok()) broken_ = status;
  return status;
}

absl::Status TensorSpool::Read(size_t i, uint64_t at, uint64_t size, std::byte* dst) const {
  const uint64_t base = offsets_[i] + at;
  for (uint64_t done = 0; done < size;) {
    const ssize_t n = pread(fd_, dst + done, size - done, static_cast<off_t>(base + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return ErrnoStatus(n < 0 ? errno : EIO,
                         absl::StrFormat("reading back %d bytes of the streaming publish's "
                                         "spool file in \"%s\"",
                                         size - done, dir_));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<const std::byte*> TensorSpool::Map() {
  if (map_ != nullptr || file_end_ == 0) return map_;
  void* p = mmap(nullptr, file_end_, PROT_READ, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    return ErrnoStatus(
        errno, absl::StrFormat("mapping the %d-byte spool file in \"%s\"", file_end_, dir_));
  }
  map_ = static_cast<const std::byte*>(p);
  map_size_ = file_end_;
  return map_;
}

}  // namespace weightbus::internal
