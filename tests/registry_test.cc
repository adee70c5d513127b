// SPDX-License-Identifier: Apache-2.0
// The transport registry (core/registry.h): schemes and stacks, the capabilities a stack
// declares (a layer's derived from the transport beneath it), and the codec figures a transport
// or layer reports surfacing in PublishStats/UpdateStats.
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/registry.h"
#include "core/uri.h"
#include "mem_transport.h"
#include "test_support.h"
#include "transport_stack.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::internal {
namespace {

TEST(RegistryTest, DiskIsRegisteredWithItsSettings) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const TransportDescriptor* disk = FindTransport("disk");
  ASSERT_NE(disk, nullptr);
  ASSERT_NE(disk->settings, nullptr);
  EXPECT_EQ(disk->settings->scope, "disk");
  auto uri = ParseUri("nope:///x");
  EXPECT_EQ(ResolveStack(*uri).status().code(), absl::StatusCode::kUnimplemented);
  auto layered = ParseUri("disk+disk:///x");
  EXPECT_EQ(ResolveStack(*layered).status().code(), absl::StatusCode::kInvalidArgument);
  auto plain = ParseUri("disk:///x");
  auto stack = ResolveStack(*plain);
  ASSERT_TRUE(stack.ok());
  ASSERT_EQ(stack->size(), 1u);
  EXPECT_EQ((*stack)[0], disk);
}

TEST(RegistryTest, EveryTransportDeclaresItsCapabilitiesAndLayersDeriveTheirs) {
  for (const TransportDescriptor* t : RegisteredTransports()) {
    EXPECT_TRUE(static_cast<bool>(t->capabilities)) << t->scheme;
  }
  if (const std::string why = testing::MissingTransports({"disk", "delta"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  testing::ScratchDir dir;
  auto disk = testing::StackCapabilitiesOf("disk://" + dir.path() + "/ch");
  ASSERT_TRUE(disk.ok()) << disk.status();
  EXPECT_EQ(DescribeCapabilities(*disk),
            "reads_strided_views, committed_manifest, keep_versions_from, publisher_groups, "
            "authenticated_groups, open_version, list_versions, partial_reads, cancel, "
            "cross_process, durable, late_joiners");
  // The delta layer keeps what it forwards and drops what it does itself; it carries disk's
  // publisher groups (each rank encodes its own parts) but not their authentication, and reads
  // byte ranges from what it decodes (a layer declares these itself).
  auto delta = testing::StackCapabilitiesOf("delta+disk://" + dir.path() + "/ch");
  ASSERT_TRUE(delta.ok()) << delta.status();
  EXPECT_EQ(DescribeCapabilities(*delta),
            "keep_versions_from, publisher_groups, open_version, list_versions, partial_reads, "
            "cancel, cross_process, durable, late_joiners");
  if (FindTransport("ucx") != nullptr) {
    auto host = testing::StackCapabilitiesOf("ucx://127.0.0.1:9/ch");
    ASSERT_TRUE(host.ok()) << host.status();
    EXPECT_TRUE(host->reads_strided_views && host->copies_with_checksums);
    EXPECT_FALSE(host->durable);
    // Staging in GPU memory reads neither strided views nor checksums as it copies.
    auto cuda = testing::StackCapabilitiesOf("ucx://127.0.0.1:9/ch?staging_memory=cuda");
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    EXPECT_FALSE(cuda->reads_strided_views || cuda->copies_with_checksums);
  }
}

// A transport (here mem://, told to report figures as a layer would) that reports codec figures
// has them surfaced in PublishStats/UpdateStats; a plain transport reports its tensor bytes.
TEST(CodecStatsTest, ReportedFiguresSurfaceAndPlainTransportsReportTheirBytes) {
  std::vector<std::byte> bytes = testing::RandomBytes(256, 3);
  const TensorView t{"w", DType::kU8, {256}, {}, bytes.data()};
  for (const bool reporting : {false, true}) {
    SCOPED_TRACE(reporting ? "reporting" : "plain");
    const std::string name = reporting ? "codec-reporting" : "codec-plain";
    if (reporting) {
      testing::mem::MemChannel(name).ReportCodecStats({absl::Milliseconds(7), 42},
                                                      {absl::Milliseconds(3), 43});
    }
    auto pub = Publisher::Open("mem:///" + name);
    auto sub = Subscriber::Open("mem:///" + name);
    ASSERT_TRUE(pub.ok() && sub.ok());
    ASSERT_TRUE((*pub)->Publish(1, {t}, {}, absl::Seconds(10)).ok());
    auto u = (*sub)->WaitForVersion(1, absl::Seconds(10));
    ASSERT_TRUE(u.ok()) << u.status();
    const PublishStats p = (*pub)->last_stats();
    const UpdateStats& s = (*u)->stats();
    EXPECT_EQ(p.bytes, 256u);
    EXPECT_EQ(s.bytes, 256u);
    EXPECT_EQ(p.wire_bytes, reporting ? 42u : 256u);
    EXPECT_EQ(p.encode, reporting ? absl::Milliseconds(7) : absl::ZeroDuration());
    EXPECT_EQ(s.wire_bytes, reporting ? 43u : 256u);
    EXPECT_EQ(s.decode, reporting ? absl::Milliseconds(3) : absl::ZeroDuration());
  }
}

// An exception out of a transport's Publish (an allocation failing) is an Internal error of
// that version, not the end of the trainer's process; the publisher waits for its hashing tasks
// first (they write into the version's job, which a skipped wait freed under them), and the
// next Publish goes on.
TEST(TransportExceptionTest, AThrowingTransportIsAnInternalErrorAndThePublisherGoesOn) {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<TensorView> views;
  for (int i = 0; i < 32; ++i) bytes.push_back(testing::RandomBytes(size_t{1} << 20, 10 + i));
  for (int i = 0; i < 32; ++i) {
    views.push_back(
        TensorView{"w" + std::to_string(i), DType::kU8, {1 << 20}, {}, bytes[i].data()});
  }
  testing::mem::MemChannel channel("throwing");
  channel.ThrowNextPublish();
  // Checksums on the pool (not in the copy): tasks in flight when the transport throws.
  auto pub = Publisher::Open("mem:///throwing?copies_with_checksums=false");
  auto sub = Subscriber::Open("mem:///throwing");
  ASSERT_TRUE(pub.ok() && sub.ok());
  const absl::Status thrown = (*pub)->Publish(1, views, {}, absl::Seconds(30));
  EXPECT_EQ(thrown.code(), absl::StatusCode::kInternal) << thrown;
  EXPECT_EQ(std::string(thrown.message()),
            "mem:///throwing: publish of version 1 failed: the transport threw: std::bad_alloc");
  EXPECT_TRUE(channel.Versions().empty());
  ASSERT_TRUE((*pub)->Publish(1, views, {}, absl::Seconds(30)).ok());
  auto u = (*sub)->WaitForVersion(1, absl::Seconds(30));
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_EQ((*u)->tensors().size(), views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorView& got = (*u)->tensors()[i];
    EXPECT_EQ(got.name, views[i].name);
    EXPECT_EQ(std::memcmp(got.data, bytes[i].data(), bytes[i].size()), 0) << got.name;
  }
}

}  // namespace
}  // namespace weightbus::internal
