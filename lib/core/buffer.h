// SPDX-License-Identifier: Apache-2.0
// Page-aligned host buffers, and a pool that recycles them so that steady-state syncs of the
// same model do not pay page faults on every version.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace weightbus::internal {

// `size` bytes of anonymous memory (mmap), 4096-byte aligned, released on destruction.
class HostBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<HostBuffer>> Allocate(size_t size);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }

  // Page-locks the buffer for copies to and from CUDA devices (core/cuda/device.h RegisterHost),
  // once: a recycled buffer stays pinned until it is freed. Errors: those of RegisterHost
  // (Unimplemented without CUDA support). Not thread-safe with itself.
  absl::Status Pin();
  bool pinned() const { return pinned_; }

 private:
  HostBuffer(std::byte* data, size_t size) : data_(data), size_(size) {}
  std::byte* data_;
  size_t size_;
  bool pinned_ = false;
};

// Hands out buffers of at least a requested size; a buffer returns to the pool when the last
// shared_ptr to it goes away, even after the pool's owner is gone (the pool is shared).
// Keeps at most `max_idle` idle buffers. Thread-safe.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static std::shared_ptr<BufferPool> Create(size_t max_idle = 2);
  // A buffer of at least `size` bytes (exactly `size` when newly allocated).
  // Errors: ResourceExhausted when memory cannot be mapped.
  absl::StatusOr<std::shared_ptr<HostBuffer>> Get(size_t size);

 private:
  explicit BufferPool(size_t max_idle) : max_idle_(max_idle) {}
  void Return(std::unique_ptr<HostBuffer> buffer);
  absl::Mutex mu_;
  std::vector<std::unique_ptr<HostBuffer>> idle_ ABSL_GUARDED_BY(mu_);
  size_t max_idle_;
};

}  // namespace weightbus::internal
