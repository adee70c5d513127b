// SPDX-License-Identifier: Apache-2.0
// core/worker_pool: tasks run in FIFO order on the workers; a batch's counter reaches zero once
// every task of it ran; Create refuses thread counts outside its range.
#include "core/worker_pool.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/time/clock.h"

namespace weightbus::internal {
namespace {

// The pool is declared after what its tasks touch, so it joins its workers before those die,
// even when an assertion returns early.
TEST(WorkerPoolTest, RunsTasksInOrderOnOneWorker) {
  std::vector<int> order;
  TaskCounter counter;
  counter.Add(3);
  auto pool = WorkerPool::Create(1);
  ASSERT_TRUE(pool.ok()) << pool.status();
  for (int i = 0; i < 3; ++i) {
    (*pool)->Submit([&, i] {
      order.push_back(i);
      counter.Done();
    });
  }
  ASSERT_TRUE(counter.WaitUntilZero(absl::Now() + absl::Seconds(60)));
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
}

TEST(WorkerPoolTest, ABatchCounterReachesZeroOnceEveryTaskOfItRanOnManyWorkers) {
  constexpr int kTasks = 64;
  std::vector<int> ran(kTasks, 0);
  TaskCounter counter;
  counter.Add(kTasks);
  auto pool = WorkerPool::Create(4);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->size(), 4);
  for (int i = 0; i < kTasks; ++i) {
    (*pool)->Submit([&, i] {
      ran[i] += 1;
      counter.Done();
    });
  }
  ASSERT_TRUE(counter.WaitUntilZero(absl::Now() + absl::Seconds(60)));
  EXPECT_EQ(ran, std::vector<int>(kTasks, 1));
}

TEST(WorkerPoolTest, CreateRefusesThreadCountsOutsideItsRange) {
  EXPECT_EQ(WorkerPool::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkerPool::Create(WorkerPool::kMaxThreads + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightbus::internal
