// SPDX-License-Identifier: Apache-2.0
// core/worker_pool: tasks run in FIFO order on the workers; a task that throws is dropped
// without ending the process, and what waits for it reaches its deadline.
#include "core/worker_pool.h"

#include <gtest/gtest.h>

#include <new>
#include <stdexcept>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace weightbus::internal {
namespace {

TEST(WorkerPoolTest, RunsTasksInOrderOnOneWorker) {
  auto pool = WorkerPool::Create(1);
  ASSERT_TRUE(pool.ok()) << pool.status();
  std::vector<int> order;
  TaskCounter counter;
  counter.Add(3);
  for (int i = 0; i < 3; ++i) {
    (*pool)->Submit([&, i] {
      order.push_back(i);
      counter.Done();
    });
  }
  ASSERT_TRUE(counter.WaitUntilZero(absl::InfiniteFuture()));
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
}

TEST(WorkerPoolTest, ATaskThatThrowsIsDroppedAndTheWorkerGoesOn) {
  auto pool = WorkerPool::Create(1);
  ASSERT_TRUE(pool.ok()) << pool.status();
  TaskCounter thrown;
  thrown.Add(2);
  (*pool)->Submit([] { throw std::bad_alloc(); });
  (*pool)->Submit([] { throw 42; });  // not a std::exception
  absl::Notification after;
  (*pool)->Submit([&] { after.Notify(); });
  // The same (only) worker runs the task after the two that threw.
  EXPECT_TRUE(after.WaitForNotificationWithTimeout(absl::Seconds(60)));
  // Their counter never reaches zero: its waiter gets its deadline, not a hang.
  EXPECT_FALSE(thrown.WaitUntilZero(absl::Now() + absl::Milliseconds(1)));
}

TEST(WorkerPoolTest, CreateRefusesThreadCountsOutsideItsRange) {
  EXPECT_EQ(WorkerPool::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkerPool::Create(WorkerPool::kMaxThreads + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightbus::internal
