// SPDX-License-Identifier: Apache-2.0
// Bulk file I/O at depth: many byte ranges read or written in chunks with many requests in
// flight, every wait bounded by a deadline. Two engines:
//   uring  io_uring (liburing): chunks submitted up to queue_depth at a time; timeouts cancel
//          what is in flight (IORING_OP_ASYNC_CANCEL). A submission queue with no free entry
//          after submitting is an Internal error, never dereferenced; one whose shared state
//          was moved by another process (a forked child using the ring) is replaced by a fresh
//          ring at the start of the next call.
//   psync  pread/pwrite, one chunk at a time, for kernels or sandboxes without io_uring (Docker's
//          default seccomp profile blocks it); deadlines are checked between chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace weightbus::internal {

// One contiguous byte range of a file and the memory it goes to (read) or comes from (write).
struct IoRequest {
  int fd = -1;
  uint64_t file_offset = 0;
  std::byte* buffer = nullptr;  // for writes, only read from
  uint64_t length = 0;
};

// What an engine has done since it was created, for tests and benchmarks.
struct FileIoCounters {
  uint64_t operations = 0;   // reads/writes (each a chunk or a batch of small ranges) and fsyncs
  uint64_t submissions = 0;  // io_uring_submit calls that submitted something (psync: syscalls)
};

class FileIo {
 public:
  // `engine` is "uring" (falls back to psync, logging once, when io_uring cannot be set up) or
  // "psync". `queue_depth` >= 1 chunks in flight; `chunk_bytes` >= 4096 bytes per operation.
  // Errors: InvalidArgument for an unknown engine or bad sizes.
  static absl::StatusOr<std::unique_ptr<FileIo>> Create(std::string_view engine,
                                                        unsigned queue_depth, uint64_t chunk_bytes);
  virtual ~FileIo() = default;

  // Which engine is in use: "uring" or "psync".
  virtual std::string_view name() const = 0;
  // Not thread-safe with a call in flight (like every method: one call at a time).
  virtual FileIoCounters counters() const = 0;

  // Reads every request completely. Requests that are contiguous in one file (the next starts
  // where the previous ends, same fd) and smaller than the chunk are moved together, up to a
  // chunk (and 1024 ranges) per vectored operation, so the number of operations follows the
  // bytes, not the number of requests. `on_complete(i)` runs on this thread as soon as request i
  // is complete. End of file before a request is complete is DataLoss ("truncated").
  // Errors name `describe(i)` of the failing request: errno status, DataLoss, or
  // DeadlineExceeded (in-flight operations are cancelled before returning).
  absl::Status Read(absl::Span<const IoRequest> requests, absl::Time deadline,
                    absl::FunctionRef<void(size_t)> on_complete,
                    absl::FunctionRef<std::string(size_t)> describe) {
    return Transfer(/*write=*/false, requests, deadline, on_complete, describe);
  }

  // Writes every request completely; otherwise as Read. ENOSPC is ResourceExhausted.
  absl::Status Write(absl::Span<const IoRequest> requests, absl::Time deadline,
                     absl::FunctionRef<void(size_t)> on_complete,
                     absl::FunctionRef<std::string(size_t)> describe) {
    return Transfer(/*write=*/true, requests, deadline, on_complete, describe);
  }

  // fsync(fd), bounded by `deadline`. `what` names the file in errors.
  virtual absl::Status Fsync(int fd, absl::Time deadline, std::string_view what) = 0;

 protected:
  // Read or Write, as the engine does it.
  virtual absl::Status Transfer(bool write, absl::Span<const IoRequest> requests,
                                absl::Time deadline, absl::FunctionRef<void(size_t)> on_complete,
                                absl::FunctionRef<std::string(size_t)> describe) = 0;
};

}  // namespace weightbus::internal
