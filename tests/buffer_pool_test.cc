// SPDX-License-Identifier: Apache-2.0
// The receive buffer pool (core/buffer.h): buffers recycled after their last user lets go.
#include <gtest/gtest.h>

#include "core/buffer.h"

namespace weightbus::internal {
namespace {

TEST(BufferPoolTest, RecyclesBuffersAfterTheLastUserLetsGo) {
  auto pool = BufferPool::Create(2);
  std::byte* first = nullptr;
  {
    auto a = pool->Get(1 << 20);
    ASSERT_TRUE(a.ok());
    first = (*a)->data();
    first[0] = std::byte{1};
  }
  auto b = pool->Get(1000);  // fits in the returned buffer
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->data(), first);
  auto c = pool->Get(2 << 20);  // does not fit: fresh
  ASSERT_TRUE(c.ok());
  EXPECT_NE((*c)->data(), first);
  EXPECT_EQ((*c)->size(), 2u << 20);
  // Buffers outliving the pool are freed, not returned.
  pool.reset();
  b->reset();
}

}  // namespace
}  // namespace weightbus::internal
