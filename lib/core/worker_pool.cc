// SPDX-License-Identifier: Apache-2.0
#include "core/worker_pool.h"

#include <algorithm>
#include <system_error>

#include "absl/strings/str_format.h"

namespace weightbus::internal {

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Create(int threads) {
  if (threads < 1 || threads > kMaxThreads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d worker threads is outside 1..%d", threads, kMaxThreads));
  }
  std::unique_ptr<WorkerPool> pool(new WorkerPool());
  pool->threads_.reserve(threads);
  try {
    for (int i = 0; i < threads; ++i) pool->threads_.emplace_back([p = pool.get()] { p->Run(); });
  } catch (const std::system_error& e) {
    // The destructor joins the threads already started.
    return absl::ResourceExhaustedError(
        absl::StrFormat("cannot start %d worker threads: %s", threads, e.what()));
  }
  return pool;
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

int WorkerPool::DefaultThreads(int requested) {
  if (requested > 0) return requested;
  int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(hw, 1, 8);
}

void WorkerPool::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

void WorkerPool::Run() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkerPool* p)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stopping_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void TaskCounter::Add(int n) {
  absl::MutexLock lock(&mu_);
  pending_ += n;
}

void TaskCounter::Done() {
  absl::MutexLock lock(&mu_);
  --pending_;
}

bool TaskCounter::WaitUntilZero(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(
                                   +[](int* pending) { return *pending == 0; }, &pending_),
                               deadline);
}

}  // namespace weightbus::internal
