// SPDX-License-Identifier: Apache-2.0
// The core's use of CUDA devices: checking a device, streams, device and pinned memory, copies,
// checksums of device memory and the packing kernels (core/cuda/kernels.cu). Compiled into every
// build: without CUDA support (WEIGHTBUS_WITH_CUDA off or no toolkit) every call that would
// touch a device returns Unimplemented naming the missing capability, so the core's callers need
// no #if of their own.
//
// Thread safety: every function may be called from any thread; the objects are not shared
// between threads unless stated. Functions that take a `device` make it current for their
// duration and restore the caller's current device before returning.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/checksum.h"
#include "weightbus/types.hpp"

namespace weightbus::internal::cuda {

// Whether this build has CUDA support (SupportsCudaTensors()).
bool Built();

// The Unimplemented error of a build without CUDA support for `what` (e.g. `tensor "w" on CUDA
// device 0`), naming the capability and the build option.
absl::Status NotBuilt(std::string_view what);

// Checks that CUDA device `device` can be used by this process. Errors: NotBuilt(what) without
// CUDA support; FailedPrecondition naming `what`, the device, how many devices this process sees
// and CUDA's error (no driver, no such device).
absl::Status CheckDevice(int device, std::string_view what);

// Checks that `data` (non-null) is memory CUDA device `device` reads and writes as its own:
// device memory of that device, or managed memory. Errors: InvalidArgument naming `what` and
// where the memory is instead (host memory, another device); CheckDevice's.
absl::Status CheckDevicePointer(const void* data, int device, std::string_view what);

// A stream of the core's on one device (non-blocking with respect to the legacy default
// stream). Destroying it waits for its work.
class Stream {
 public:
  // Errors: NotBuilt; Internal with CUDA's error text.
  static absl::StatusOr<std::unique_ptr<Stream>> Create(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  void* get() const { return stream_; }  // a cudaStream_t
  int device() const { return device_; }
  // Waits for the work queued on it. Errors: Internal naming `what` and CUDA's error.
  absl::Status Synchronize(std::string_view what) const;

 private:
  Stream(void* stream, int device) : stream_(stream), device_(device) {}
  void* stream_;
  int device_;
};

// Waits for the work queued on the caller's `stream` (a cudaStream_t; nullptr: the legacy
// default stream) of `device`. Errors: NotBuilt; Internal naming `what` and CUDA's error.
absl::Status SynchronizeCallerStream(void* stream, int device, std::string_view what);

// Queues a copy of `n` bytes between any two memories (host, pinned, device; cudaMemcpyDefault)
// on `stream`; complete once the stream is synchronized. Errors: Internal naming `what`.
absl::Status CopyAsync(void* dst, const void* src, uint64_t n, const Stream& stream,
                       std::string_view what);

// `size` bytes of memory of CUDA device `device` (cudaMalloc), freed on destruction.
class DeviceBuffer {
 public:
  // Errors: NotBuilt; ResourceExhausted naming the size and device when the device is full;
  // Internal for other CUDA errors.
  static absl::StatusOr<std::unique_ptr<DeviceBuffer>> Allocate(uint64_t size, int device);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  int device() const { return device_; }

 private:
  DeviceBuffer(std::byte* data, uint64_t size, int device)
      : data_(data), size_(size), device_(device) {}
  std::byte* data_;
  uint64_t size_;
  int device_;
};

// Page-locks `size` bytes of host memory at `data` for every device (cudaHostRegister,
// portable), so that copies between it and devices run at the bus's speed and asynchronously.
// Errors: NotBuilt; Internal with CUDA's error. UnregisterHost undoes it (no effect on memory
// that is not registered).
absl::Status RegisterHost(void* data, size_t size);
void UnregisterHost(void* data);

// Device memory to checksum: `size` bytes at `data`.
struct DeviceBytes {
  const std::byte* data = nullptr;
  uint64_t size = 0;
};

// The checksums of each of `tensors` (memory of `device`), as ChecksumTensor (core/checksum.h)
// computes them on the host from the same bytes: XXH3-64 of the whole and of each tile of
// `grids[i]` (one grid per tensor; an empty grid: the whole checksum only; docs/FORMAT.md,
// "Checksums of device memory"). Tiles that are contiguous (1-D blocks, whole rows) are hashed in
// place; tiles of several columns are gathered, bands at a time, into device scratch of at most
// 64 MiB (or one band, if larger) first. Synchronous; runs on a stream of its own after every
// write the device had completed when it was called. Device scratch (stream-ordered,
// cudaMallocAsync where the device supports memory pools): at most 16 MiB plus 120 bytes per
// checksum, plus the gather scratch. Errors: NotBuilt; InvalidArgument for a grid count other
// than the tensors'; ResourceExhausted; Internal with CUDA's error text.
absl::StatusOr<std::vector<TensorChecksums>> Checksum(absl::Span<const DeviceBytes> tensors,
                                                      absl::Span<const TileGrid> grids, int device);

// Queues the gather of elements [first, first + count) of the row-major walk of the strided
// view at `src` (element [0, ..., 0]; `shape`, `strides` in elements, empty strides row-major;
// `elem` bytes per element) into `dst` (count * elem bytes) on `stream`; Scatter is the inverse
// (dst a view whose elements do not overlap). Memory of the stream's device. Errors: NotBuilt;
// Internal with CUDA's error text.
absl::Status Gather(const void* src, size_t elem, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, uint64_t first, uint64_t count, void* dst,
                    const Stream& stream);
absl::Status Scatter(const void* src, size_t elem, const std::vector<int64_t>& shape,
                     const std::vector<int64_t>& strides, uint64_t first, uint64_t count, void* dst,
                     const Stream& stream);

}  // namespace weightbus::internal::cuda
