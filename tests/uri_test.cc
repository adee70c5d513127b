// SPDX-License-Identifier: Apache-2.0
// URIs (core/uri.h): the forms each transport takes, malformed ones, and paths that would climb
// out of the directory they name.
#include <gtest/gtest.h>

#include "core/uri.h"

namespace weightbus::internal {
namespace {

TEST(UriTest, Forms) {
  auto disk = ParseUri("disk:///mnt/shared/my%20policy?retention=4&fsync=false");
  ASSERT_TRUE(disk.ok()) << disk.status();
  EXPECT_EQ(disk->scheme, "disk");
  EXPECT_EQ(disk->authority, "");
  EXPECT_EQ(disk->path, "/mnt/shared/my policy");
  EXPECT_EQ(disk->query.at("retention"), "4");
  EXPECT_EQ(disk->query.at("fsync"), "false");
  EXPECT_EQ(disk->Display(), "disk:///mnt/shared/my policy");

  auto ucx = ParseUri("ucx://10.0.0.1:13337/policy");
  ASSERT_TRUE(ucx.ok());
  EXPECT_EQ(ucx->host, "10.0.0.1");
  EXPECT_EQ(ucx->port, 13337);
  EXPECT_EQ(ucx->path, "/policy");
  auto v6 = ParseUri("delta+ucx://[fe80::1%25eth0]:9000/p");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->scheme, "delta+ucx");
  EXPECT_EQ(v6->host, "fe80::1%25eth0");
  EXPECT_EQ(v6->port, 9000);

  // A port without a host means this machine's loopback (issue 17: listeners bind to loopback
  // unless the URI names another address), for the publisher and its subscribers alike.
  auto local = ParseUri("ucx://:13337/policy");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(local->host, "localhost");
  EXPECT_EQ(local->port, 13337);
  EXPECT_EQ(local->Display(), "ucx://:13337/policy");
  auto no_authority = ParseUri("ucx:///policy");
  ASSERT_TRUE(no_authority.ok()) << no_authority.status();
  EXPECT_EQ(no_authority->host, "");  // no authority at all: the transport says what it needs

  for (const char* bad : {"/no/scheme", "ucx://:/c", "disk:/x", "ucx://h:99999/c", "ucx://::1:9/c",
                          "ucx://[::1/c", "disk:///x%zz", "disk:///x%2", "disk:///x?a=1&a=2"}) {
    auto u = ParseUri(bad);
    EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(u.status().message().find(bad), absl::string_view::npos) << u.status();
  }
}

// Decoded path segments are checked: an encoded '/' or NUL, or a "." or ".." segment (encoded or
// not), would let a channel name leave the directory it names (issue 10, item 20).
TEST(UriTest, PathsThatClimbOutOfTheirBaseAreRefused) {
  for (const char* bad :
       {"disk:///base/ch%2F..%2F..%2Fetc", "disk:///base/ch%2f..%2fx", "disk:///base/%2E%2E/x",
        "disk:///base/../x", "disk:///base/./x", "disk:///base/..", "disk:///base/x%00y",
        "ucx://h:9/%2E%2E%2Fetc", "delta+disk:///base/..%2Fx"}) {
    auto u = ParseUri(bad);
    EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(u.status().message().find(bad), absl::string_view::npos) << u.status();
  }
  // Dots inside a name and percent-encoded ordinary characters stay fine.
  for (const char* good :
       {"disk:///base/a..b/.hidden/v1.2", "disk:///base/my%20ch%2Dx", "ucx://h:9/policy.v2"}) {
    EXPECT_TRUE(ParseUri(good).ok()) << good << ": " << ParseUri(good).status();
  }
}

}  // namespace
}  // namespace weightbus::internal
