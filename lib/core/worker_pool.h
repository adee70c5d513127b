// SPDX-License-Identifier: Apache-2.0
// A fixed set of worker threads running submitted tasks in FIFO order, and a counter to wait for
// a batch of them with a deadline. Used for checksums that overlap transfers.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace weightbus::internal {

class WorkerPool {
 public:
  // Starts `threads` workers (1..256). Errors: InvalidArgument out of range; ResourceExhausted
  // when the system refuses a thread.
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(int threads);
  // Finishes queued tasks, then joins the workers.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task`. A task must not throw: the worker does not catch, so an exception ends the
  // process through std::terminate. Dropping it instead would leave whatever waits for the task
  // (several callers wait without a deadline) blocked forever, which is worse than a crash.
  void Submit(std::function<void()> task);
  int size() const { return static_cast<int>(threads_.size()); }
  // Largest pool Create accepts.
  static constexpr int kMaxThreads = 256;

  // Default number of workers for `requested` (0: hardware threads, capped at 8).
  static int DefaultThreads(int requested);

 private:
  WorkerPool() = default;
  void Run();
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// Counts outstanding tasks of one batch. Add before submitting, Done when each finishes.
class TaskCounter {
 public:
  void Add(int n = 1);
  void Done();
  // True when the count reached zero before `deadline`.
  bool WaitUntilZero(absl::Time deadline);

 private:
  absl::Mutex mu_;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightbus::internal
