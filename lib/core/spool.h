// SPDX-License-Identifier: Apache-2.0
// The staging behind a streaming publish (Publisher::BeginPublish): tensors added one at a time
// are copied into a bounded host bucket and written from there, in the background, to an
// unlinked temporary file, so that a version of any size costs the process the bucket, not the
// model. Nothing in the spool is visible to subscribers; the file has no name, so a process that
// dies leaves nothing behind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/buffer.h"
#include "core/checksum.h"
#include "core/worker_pool.h"
#include "weightbus/types.hpp"

namespace weightbus::internal {

// Whether this build copies CUDA tensors itself (WEIGHTBUS_WITH_CUDA).
bool SpoolSupportsCuda();

// Not thread-safe: one caller adds, seals and reads (its background writer is internal).
class TensorSpool {
 public:
  // A spool in `dir` (an unlinked file there: O_TMPFILE, or a named file removed at once) with
  // two host buckets of `bucket_bytes / 2` bytes each, one filled while the other is written by
  // a task on `pool`. Each tensor's checksums are computed as it is written: XXH3-64 of its
  // bytes and of each tile of the grid it was added with (TensorChecksums, the manifest's
  // `tiles`). Errors: Internal/ResourceExhausted naming the directory.
  static absl::StatusOr<std::unique_ptr<TensorSpool>> Create(const std::string& dir,
                                                             uint64_t bucket_bytes,
                                                             WorkerPool* pool);
  ~TensorSpool();
  TensorSpool(const TensorSpool&) = delete;
  TensorSpool& operator=(const TensorSpool&) = delete;

  // Appends the `nbytes` packed row-major bytes of host tensor `view` (strided views gathered)
  // as tensor number tensor_count(), its checksums cut as `grid` says (core/tiles.h). The bytes
  // are copied before this returns. Errors: the background write's (Internal, ResourceExhausted
  // for a full disk), after which the spool is unusable.
  absl::Status AddHost(const TensorView& view, uint64_t nbytes, const TileGrid& grid);
  // Appends `nbytes` contiguous bytes of CUDA memory at `device_data` (device `device`), copied
  // asynchronously on `cuda_stream` (a cudaStream_t; nullptr: the legacy default stream) into
  // the pinned bucket. Returns once the copy is queued; the memory must stay valid until the
  // next call on this spool returns (each call first waits for the previous copy).
  // Errors: Unimplemented without CUDA support; Internal with the CUDA error text.
  // `grid` as for AddHost.
  absl::Status AddCuda(const void* device_data, uint64_t nbytes, int device, void* cuda_stream,
                       const TileGrid& grid);

  // Writes what is still in the buckets and waits for it. Then, per tensor in order, its file
  // offset and checksums are final. Errors: as AddHost.
  absl::Status Seal();

  size_t tensor_count() const { return offsets_.size(); }
  uint64_t bytes() const { return bytes_; }  // tensor bytes added (padding not counted)
  const TensorChecksums& checksums(size_t i) const { return digests_[i]; }
  uint64_t offset(size_t i) const { return offsets_[i]; }

  // After Seal: bytes [at, at + size) of tensor i (offset(i) + at in the file) into `dst`.
  // Errors: Internal with the system error text.
  absl::Status Read(size_t i, uint64_t at, uint64_t size, std::byte* dst) const;
  // After Seal: the whole file mapped read-only (file-backed pages the kernel may reclaim, not
  // anonymous memory); tensor i at data + offset(i). Valid until the spool is destroyed.
  absl::StatusOr<const std::byte*> Map();

 private:
  struct Segment {
    size_t tensor;
    uint64_t tensor_bytes;  // the whole tensor's, for its hasher
    TileGrid grid;          // its checksum tiles
    uint64_t bucket_offset;
    uint64_t size;
    bool first;
    bool last;
  };
  struct Bucket {
    std::unique_ptr<HostBuffer> buffer;
    uint64_t fill = 0;
    std::vector<Segment> segments;
    std::vector<std::pair<size_t, TensorChecksums>> digests;  // the writer's, per tensor
  };

  TensorSpool(int fd, std::string dir, uint64_t half, WorkerPool* pool)
      : fd_(fd), dir_(std::move(dir)), half_(half), pool_(pool) {}
  // Starts a tensor: pads the file position to 64 bytes and records its offset.
  absl::Status BeginTensor();
  // Room for at most `want` bytes of tensor `index` at the current bucket's end (flushing a
  // full bucket first): where to write them and how many fit.
  absl::StatusOr<std::pair<std::byte*, uint64_t>> Reserve(uint64_t want);
  void Claimed(uint64_t n, uint64_t tensor_bytes, const TileGrid& grid, bool first, bool last);
  // Hands the current bucket to the writer (after the previous write finished) and switches.
  absl::Status Flush();
  absl::Status WaitWriter();
  absl::Status WaitCudaCopy();
  // Pins the buckets (once) and has an event for copies from `device`.
  absl::Status EnsurePinned(int device);

  int fd_;
  std::string dir_;
  uint64_t half_;
  WorkerPool* pool_;
  Bucket buckets_[2];
  int current_ = 0;
  uint64_t file_end_ = 0;  // file offset of the current bucket's first byte
  uint64_t bytes_ = 0;
  std::vector<uint64_t> offsets_;
  std::vector<TensorChecksums> digests_;
  std::unique_ptr<TensorHasher> hash_;  // the tensor the writer is hashing (writer only)
  absl::Status broken_;                 // the first error; every later call returns it

  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status write_status_ ABSL_GUARDED_BY(mu_);

  const std::byte* map_ = nullptr;
  uint64_t map_size_ = 0;

  bool pinned_ = false;
  void* copy_event_ = nullptr;  // cudaEvent_t recorded after the last queued copy
  int event_device_ = -1;       // the device copy_event_ belongs to
  bool copy_pending_ = false;
};

}  // namespace weightbus::internal
