// SPDX-License-Identifier: Apache-2.0
// RateLimitedLog (core/logging.h): a repeated message goes out at most once per interval, and
// the next line that goes out counts the ones held back.
#include <gtest/gtest.h>

#include "core/logging.h"

namespace weightbus::internal {
namespace {

TEST(RateLimitedLogTest, LetsOneLinePerIntervalOutAndCountsTheOthers) {
  RateLimitedLog log(absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t held = 99;
  absl::Duration over;
  ASSERT_TRUE(log.Admit(t0, &held, &over));  // the first occurrence at once
  EXPECT_EQ(held, 0u);
  EXPECT_EQ(over, absl::ZeroDuration());
  for (int i = 0; i < 100000; ++i) {
    ASSERT_FALSE(log.Admit(t0 + absl::Milliseconds(i % 9999), &held, &over)) << i;
  }
  ASSERT_TRUE(log.Admit(t0 + absl::Seconds(10), &held, &over));
  EXPECT_EQ(held, 100000u);
  EXPECT_EQ(over, absl::Seconds(10));
  EXPECT_FALSE(log.Admit(t0 + absl::Seconds(15), &held, &over));
  ASSERT_TRUE(log.Admit(t0 + absl::Seconds(60), &held, &over));
  EXPECT_EQ(held, 1u);  // the count restarts after each line
  EXPECT_EQ(over, absl::Seconds(50));
  EXPECT_EQ(log.logged(), 3u);
  EXPECT_EQ(log.suppressed(), 100001u);
}

}  // namespace
}  // namespace weightbus::internal
