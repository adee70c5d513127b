// SPDX-License-Identifier: Apache-2.0
// The small interface through which nccl:// drives NCCL and CUDA: a Backend opens a Device (a
// GPU: its memory, a few streams, one event per stream) and starts Communicators (one rank of
// an NCCL communicator, created non-blocking). Two implementations exist:
//   * cuda_backend.cc: NCCL and the CUDA runtime (the transport's one real path);
//   * tests/nccl_loopback_backend.h: a stand-in over host memory and loopback sockets with the
//     same semantics (operations enqueued in order, a broadcast that waits for every rank, an
//     abort that ends what is in flight), so that everything above this interface runs in CI on
//     machines without a GPU.
// A Clock is injected the same way: deadlines are tested against a fake one.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace weightbus::internal::nccl {

// An ncclUniqueId: opaque bytes created by the root and handed to every rank.
inline constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using UniqueId = std::array<uint8_t, kUniqueIdBytes>;

// One rank of one communicator, created non-blocking (ncclCommInitRankConfig with blocking = 0).
// A call may return while NCCL is still enqueuing it: Poll() then says "in progress", and no
// other call may be made on the communicator until Poll() says ready (NCCL's rule for
// non-blocking communicators). Not thread-safe: one thread drives a communicator.
class Communicator {
 public:
  virtual ~Communicator() = default;
  // ncclCommGetAsyncError: true when the communicator is ready for the next call (initialized,
  // the last call enqueued), false while one is in progress.
  // Errors: the communicator failed (a peer is gone, a network error, a failed kernel), with
  // NCCL's text (ncclGetErrorString and ncclGetLastError); it must then be aborted.
  virtual absl::StatusOr<bool> Poll() = 0;
  // Enqueues ncclBroadcast, in place, of `bytes` bytes at `buffer` (this rank's device memory)
  // from rank `root` on stream `stream`. Errors: the call was refused (bad arguments, a failed
  // communicator).
  virtual absl::Status Broadcast(void* buffer, uint64_t bytes, int root, int stream) = 0;
  // ncclCommAbort: ends every operation in flight on this rank and frees the communicator;
  // returns once done. Later calls fail. Safe to call more than once.
  virtual void Abort() = 0;
  virtual int rank() const = 0;
  virtual int nranks() const = 0;
};

// One GPU as the transport uses it: device memory, `streams` streams and one event per stream.
// Operations enqueued on one stream run in order; on different streams they may overlap. Not
// thread-safe: one thread drives a device at a time.
class Device {
 public:
  virtual ~Device() = default;
  // "GPU 0 (NVIDIA H200, PCI 0000:1b:00.0)".
  virtual std::string Describe() const = 0;
  // The GPU's UUID ("GPU-5f3c..."): the same physical GPU in every process.
  virtual std::string Uuid() const = 0;
  virtual int streams() const = 0;
  // `bytes` bytes of device memory (at least 256-byte aligned), freed with the returned
  // handle (which may outlive the Device object only until the Device is destroyed).
  // Errors: ResourceExhausted naming the size and the GPU.
  virtual absl::StatusOr<std::shared_ptr<void>> Allocate(uint64_t bytes) = 0;
  // Enqueues a copy of `bytes` bytes from `src` to `dst` on stream `stream`; either may be
  // host or device memory (cudaMemcpyAsync with cudaMemcpyDefault). Host memory must stay
  // valid until the stream's next Record is Done.
  virtual absl::Status Copy(void* dst, const void* src, uint64_t bytes, int stream) = 0;
  // Records stream `stream`'s event after everything enqueued on it so far.
  virtual absl::Status Record(int stream) = 0;
  // Whether the work before stream `stream`'s last Record has finished (cudaEventQuery).
  // Errors: a copy or kernel before it failed.
  virtual absl::StatusOr<bool> Done(int stream) = 0;
  // Waits until every stream is idle. Used after Communicator::Abort (which ends the
  // broadcasts), so that no copy touches a caller's memory after the call that enqueued it
  // returned.
  virtual void Synchronize() = 0;
  // Whether `p` points into device memory (a CUDA tensor) rather than host memory.
  virtual bool IsDeviceMemory(const void* p) const = 0;
  // A handle to `buffer` (from Allocate) that another process on the same GPU opens with
  // ImportBuffer (cudaIpcGetMemHandle, with this process's id and the pointer, so that this
  // process opens its own handles as the pointer itself).
  virtual absl::StatusOr<std::string> ExportBuffer(const std::shared_ptr<void>& buffer) = 0;
  // The buffer a handle from ExportBuffer names, mapped into this process until the returned
  // pointer is released (cudaIpcOpenMemHandle / cudaIpcCloseMemHandle). Errors: InvalidArgument
  // for a malformed handle, Unavailable when it cannot be opened (another GPU, the exporting
  // process gone).
  virtual absl::StatusOr<std::shared_ptr<void>> ImportBuffer(const std::string& handle) = 0;
};

// What the two sides compare before building a communicator (protocol.h HELLO).
struct BackendInfo {
  std::string name;           // "NCCL 2.28.9 over CUDA 13.0"
  uint32_t nccl_version = 0;  // ncclGetVersion, e.g. 22809
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendInfo Info() = 0;
  // Opens GPU `ordinal` (-1: the calling thread's current one) with `streams` streams.
  // Errors: FailedPrecondition when there is no such GPU or no GPU at all (naming what CUDA
  // said), Internal for other CUDA errors.
  virtual absl::StatusOr<std::unique_ptr<Device>> OpenDevice(int ordinal, int streams) = 0;
  // ncclGetUniqueId.
  virtual absl::StatusOr<UniqueId> NewUniqueId() = 0;
  // Starts rank `rank` of `nranks` of communicator `id` on `device` (which must outlive it),
  // non-blocking: Poll() until ready.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> StartCommunicator(Device& device,
                                                                          const UniqueId& id,
                                                                          int nranks, int rank) = 0;
};

// NCCL and CUDA (cuda_backend.cc).
std::shared_ptr<Backend> CudaBackend();

// The backend nccl:// publishers and subscribers opened from now on use: CudaBackend(), unless a
// test installed another with SetBackendForTesting (nullptr restores it). Thread-safe.
std::shared_ptr<Backend> CurrentBackend();
void SetBackendForTesting(std::shared_ptr<Backend> backend);

// Time for deadlines and polling. The transport's waits read Now() and sleep with SleepFor
// between polls; tests substitute a fake clock whose SleepFor advances its time.
class Clock {
 public:
  virtual ~Clock() = default;
  // In the time base of the deadlines the core hands the transport (absl::Now()).
  virtual absl::Time Now() = 0;
  virtual void SleepFor(absl::Duration d) = 0;
};
// absl::Now and absl::SleepFor.
Clock& RealClock();

}  // namespace weightbus::internal::nccl
