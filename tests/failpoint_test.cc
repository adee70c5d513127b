// SPDX-License-Identifier: Apache-2.0
// Fail points (core/failpoint.h): taken only from WEIGHTBUS_FAILPOINTS, fired on the n-th pass.
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/failpoint.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::internal {
namespace {

// Fail points come only from the environment (WEIGHTBUS_FAILPOINTS): a URI query or an Options
// entry that names them is refused before anything is opened, so a URI can never make a process
// kill itself (issue 10, item 20). The rule is the core's, so any transport shows it (mem://).
TEST(FailPointsTest, ComeOnlyFromTheEnvironmentNeverFromAUriOrOptions) {
  const std::string uri = "mem:///failpoints-from-the-environment";
  auto from_uri = Publisher::Open(uri + "?failpoints=core.before_transport%3Dkill");
  ASSERT_EQ(from_uri.status().code(), absl::StatusCode::kInvalidArgument) << from_uri.status();
  EXPECT_NE(from_uri.status().message().find("WEIGHTBUS_FAILPOINTS"), absl::string_view::npos)
      << from_uri.status();
  auto sub_from_uri = Subscriber::Open(uri + "?failpoints=disk.before_read%3Dkill");
  EXPECT_EQ(sub_from_uri.status().code(), absl::StatusCode::kInvalidArgument);
  auto from_options = Publisher::Open(uri, {{"failpoints", "core.before_transport=kill"}});
  ASSERT_EQ(from_options.status().code(), absl::StatusCode::kInvalidArgument)
      << from_options.status();
  EXPECT_NE(from_options.status().message().find("WEIGHTBUS_FAILPOINTS"), absl::string_view::npos);

  // From the environment they fire.
  auto pub = [&] {
    const testing::ScopedEnv env("WEIGHTBUS_FAILPOINTS", "core.before_transport=error");
    return Publisher::Open(uri);
  }();
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::vector<std::byte> bytes = testing::RandomBytes(64, 3);
  TensorView t{"t", DType::kU8, {64}, {}, bytes.data()};
  absl::Status s = (*pub)->Publish(1, {t}, {}, absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("failpoint core.before_transport fired"), absl::string_view::npos)
      << s;
}

TEST(FailPointsTest, FiresOnTheNthPassOnly) {
  auto fp = FailPoints::Parse("a=error@2,b=delay:1");
  ASSERT_TRUE(fp.ok());
  EXPECT_TRUE(fp->Hit("a").ok());
  EXPECT_EQ(fp->Hit("a").code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(fp->Hit("a").ok());
  EXPECT_TRUE(fp->Hit("b").ok());
  EXPECT_TRUE(fp->Hit("unlisted").ok());
  EXPECT_FALSE(FailPoints::Parse("a=explode").ok());
  EXPECT_FALSE(FailPoints::Parse("a=error@0").ok());
  EXPECT_FALSE(FailPoints::Parse("=kill").ok());
}

}  // namespace
}  // namespace weightbus::internal
