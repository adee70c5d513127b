// SPDX-License-Identifier: Apache-2.0
// The transport contract, once, over every stack this build has (Stacks() below: disk, ucx per
// UCX_TLS, the delta layer over each, mem:// with every optional capability and with none).
// Through the public API: round trips bit-exact, bindings, Poll and WaitForVersion semantics,
// exact versions (ReceiveVersion) and tensor-parallel groups receiving one version while
// publishes race (threads and processes), timeouts, corruption, late joiners, a publisher
// restarting, handles closed mid-call and inherited across fork(). Through the plugin interface
// (lib/core/transport.h): every capability a stack declares holds, and every optional method it
// does not declare refuses cleanly. A transport added later gets all of it with one line in
// Stacks() (docs/TRANSPORTS.md).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/registry.h"
#include "core/tensor_pack.h"
#include "expect_tensors.h"
#include "in_flight.h"
#include "test_model.h"
#include "test_support.h"
#include "transport_stack.h"
#include "ucx_tls.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using internal::TransportCapabilities;
using ::weightbus::testing::ExpectSameTensors;
using ::weightbus::testing::InFlight;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::ManifestOf;
using ::weightbus::testing::OwnedTensor;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Tls;
using ::weightbus::testing::Views;

constexpr absl::Duration kTimeout = absl::Seconds(30);

using ::weightbus::testing::Stack;
using ::weightbus::testing::Stacks;

class ConformanceTest : public ::testing::TestWithParam<Stack> {
 protected:
  void SetUp() override {
    env_.emplace(GetParam().env.env);
    const std::string scheme = GetParam().uri.substr(0, GetParam().uri.find("://"));
    const std::string transport = scheme.substr(scheme.rfind('+') + 1);
    // The transport and every layer over it ("delta+disk": delta and disk).
    if (const std::string why = testing::MissingStackTransports(GetParam()); !why.empty()) {
      GTEST_SKIP() << why;
    }
    static std::atomic<int> channels{0};
    name_ = absl::StrFormat("conformance-%d-%d", getpid(), channels++);
    if (absl::StrContains(GetParam().uri, "{port}")) port_ = testing::FreePort();
    auto caps = testing::StackCapabilitiesOf(Uri());
    ASSERT_TRUE(caps.ok()) << caps.status();
    caps_ = *caps;
    if (port_ != 0) {
      // A networked stack (ucx per UCX_TLS, later nccl) is skipped, with the reason, only when
      // its transport cannot run here with the stack's environment.
      auto probe = Publisher::Open(Uri());
      if (!probe.ok() && !absl::IsFailedPrecondition(probe.status())) {
        GTEST_SKIP() << transport << " cannot run here with " << GetParam().env.name << ": "
                     << probe.status();
      }
    }
  }

  // A query that makes the channel hold only the newest `versions` (under a layer with
  // versions == 1, every version a keyframe, so that no chain keeps older ones).
  std::string KeepOnly(int versions) const {
    std::string query = absl::StrFormat("%s=%d", GetParam().kept, versions);
    if (versions == 1 && absl::StrContains(GetParam().uri, "+")) query += "&keyframe_interval=1";
    return query;
  }

  // The test's channel; `query` is appended to the stack's own.
  std::string Uri(const std::string& query = "") const {
    return testing::StackUri(GetParam(), dir_.path(), port_, name_, query);
  }

  std::optional<testing::ScopedEnvs> env_;  // the stack's environment, restored after the case
  ScratchDir dir_;
  int port_ = 0;
  std::string name_;
  TransportCapabilities caps_;
};

std::unique_ptr<Publisher> OpenPublisher(const std::string& uri) {
  auto p = Publisher::Open(uri);
  EXPECT_TRUE(p.ok()) << uri << ": " << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}
std::unique_ptr<Subscriber> OpenSubscriber(const std::string& uri) {
  auto s = Subscriber::Open(uri);
  EXPECT_TRUE(s.ok()) << uri << ": " << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// ---------------------------------------------------------------------------------------------
// Bytes and bindings.

TEST_P(ConformanceTest, RoundTripsEveryDtypeAndEdgeShapeBitExact) {
  // MakeVersion holds a tensor of every dtype the library knows (sub-byte ones included), so a
  // dtype added later is covered here, on every stack, or this fails.
  std::set<DType> covered;
  for (const OwnedTensor& t : MakeVersion(7, 1, 1 << 20)) covered.insert(t.dtype);
  EXPECT_EQ(covered, std::set<DType>(kAllDTypes.begin(), kAllDTypes.end()));
  auto pub = OpenPublisher(Uri());
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  for (uint64_t v = 1; v <= 3; ++v) {
    auto tensors = MakeVersion(7, v, 1 << 20);
    ASSERT_TRUE(pub->Publish(v, Views(tensors), {{"step", std::to_string(v)}}, kTimeout).ok());
    auto update = sub->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(update.ok()) << update.status();
    EXPECT_EQ((*update)->version(), v);
    EXPECT_EQ((*update)->manifest().metadata, (Metadata{{"step", std::to_string(v)}}));
    EXPECT_EQ((*update)->manifest().publisher.pid, getpid());
    ExpectSameTensors(**update, tensors);
  }
  EXPECT_EQ(sub->current_version(), std::optional<uint64_t>(3));
  EXPECT_EQ(pub->latest_version(), std::optional<uint64_t>(3));
}

TEST_P(ConformanceTest, ZeroSizeScalarAndEmptyVersions) {
  auto pub = OpenPublisher(Uri());
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  const int64_t scalar = -7;
  TensorView s{"scalar", DType::kI64, {}, {}, &scalar};
  TensorView z1{"zero", DType::kF32, {0}, {}, nullptr};
  TensorView z2{"zero.rows", DType::kBF16, {3, 0, 2}, {}, nullptr};
  ASSERT_TRUE(pub->Publish(1, {s, z1, z2}, {}, kTimeout).ok());
  auto u = sub->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_EQ((*u)->tensors().size(), 3u);
  EXPECT_EQ(*static_cast<const int64_t*>((*u)->Find("scalar")->data), -7);
  EXPECT_EQ((*u)->Find("zero.rows")->shape, (std::vector<int64_t>{3, 0, 2}));
  // Only zero-size tensors: a version of zero bytes, and one with no tensors at all.
  ASSERT_TRUE(pub->Publish(2, {z1}, {}, kTimeout).ok());
  u = sub->WaitForVersion(2, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->manifest().total_bytes(), 0u);
  ASSERT_TRUE(pub->Publish(3, {}, {{"empty", "yes"}}, kTimeout).ok());
  u = sub->WaitForVersion(3, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_TRUE((*u)->tensors().empty());
  EXPECT_EQ((*u)->manifest().metadata.at("empty"), "yes");
}

// Strided views are gathered (or packed by the core, for a stack that does not read them) and
// strided destinations filled, in both bind modes.
TEST_P(ConformanceTest, StridedViewsAndStridedDestinations) {
  // A 3x4 F32 matrix published as its transpose, with reversed rows and as a broadcast column.
  std::vector<float> m(12);
  for (int i = 0; i < 12; ++i) m[i] = static_cast<float>(i) + 0.5f;
  const TensorView transposed{"t", DType::kF32, {4, 3}, {1, 4}, m.data()};
  const TensorView reversed{"r", DType::kF32, {3, 4}, {-4, 1}, m.data() + 8};
  const TensorView broadcast{"b", DType::kF32, {2, 3}, {0, 1}, m.data()};
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  ASSERT_TRUE(pub->Publish(1, {transposed, reversed, broadcast}, {}, kTimeout).ok());
  auto values = [](const Update& u, const char* name) {
    const TensorView* v = u.Find(name);
    const float* p = static_cast<const float*>(v->data);
    return std::vector<float>(p, p + *NumElements(v->shape));
  };
  auto plus_half = [](std::vector<float> v) {
    for (float& f : v) f += 0.5f;
    return v;
  };
  for (const char* mode : {"staged", "direct"}) {
    SCOPED_TRACE(mode);
    auto sub = OpenSubscriber(Uri(std::string("bind_mode=") + mode));
    ASSERT_TRUE(sub);
    // "t" lands in a column-major buffer: the transpose of the transpose, i.e. `m` itself.
    std::vector<float> col_major(12, -1.0f);
    ASSERT_TRUE(sub->Bind("t", {DType::kF32, {4, 3}, {1, 4}, col_major.data()}).ok());
    auto u = sub->WaitForVersion(1, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    EXPECT_EQ(col_major, m);
    EXPECT_EQ((*u)->Find("t")->strides, (std::vector<int64_t>{1, 4}));
    EXPECT_EQ(values(**u, "r"), plus_half({8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3}));
    EXPECT_EQ(values(**u, "b"), plus_half({0, 1, 2, 0, 1, 2}));
    std::vector<float> t_rows(12);
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < 3; ++c) t_rows[r * 3 + c] = m[c * 4 + r];
    }
    EXPECT_EQ((*u)->manifest().tensors[0].xxh3, testing::Xxh3(t_rows.data(), 48));
  }
}

// Bound destinations receive each version in place, in both bind modes.
// Tensor names are names, never paths (docs/TRANSPORTS.md): names that look like paths, hold a
// NUL byte or are 300 characters of UTF-8 round-trip exactly, with their bytes, also into
// destinations bound by those names, and nothing appears in the test's directory outside the
// stack's channel (for disk stacks `channel/`; the others keep nothing there).
TEST_P(ConformanceTest, PathLikeNulAndLongUtf8TensorNamesRoundTripAndStayInsideTheChannel) {
  const std::vector<std::string> names = testing::PathLikeTensorNames();
  const std::vector<std::string> before = testing::ListTree(dir_.path());
  std::vector<std::vector<std::byte>> bytes, dest;
  std::vector<TensorView> views;
  for (size_t i = 0; i < names.size(); ++i) {
    bytes.push_back(testing::RandomBytes(64 + i, i));
    dest.emplace_back(bytes.back().size());
  }
  for (size_t i = 0; i < names.size(); ++i) {
    views.push_back(TensorView{
        names[i], DType::kU8, {static_cast<int64_t>(bytes[i].size())}, {}, bytes[i].data()});
  }
  auto pub = OpenPublisher(Uri());
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  for (size_t i = 0; i < names.size(); i += 2) {  // every other one bound
    ASSERT_TRUE(
        sub->Bind(names[i], Destination{DType::kU8, views[i].shape, {}, dest[i].data()}).ok());
  }
  ASSERT_TRUE(pub->Publish(1, views, {}, kTimeout).ok());
  auto u = sub->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_EQ((*u)->manifest().tensors.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(absl::CHexEscape(names[i]));
    EXPECT_EQ((*u)->manifest().tensors[i].name, names[i]);
    const TensorView& got = (*u)->tensors()[i];
    EXPECT_EQ(got.name, names[i]);
    ASSERT_EQ(got.shape, views[i].shape);
    EXPECT_EQ(std::memcmp(got.data, bytes[i].data(), bytes[i].size()), 0);
    if (i % 2 == 0) EXPECT_TRUE(dest[i] == bytes[i]);
  }
  for (const std::string& path : testing::ListTree(dir_.path())) {
    if (std::find(before.begin(), before.end(), path) != before.end()) continue;
    EXPECT_TRUE(path == "channel" || absl::StartsWith(path, "channel/"))
        << absl::CHexEscape(path) << " appeared outside the channel";
  }
}

TEST_P(ConformanceTest, BoundDestinationsReceiveInPlace) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  for (const char* mode : {"staged", "direct"}) {
    SCOPED_TRACE(mode);
    auto sub = OpenSubscriber(Uri(std::string("bind_mode=") + mode));
    ASSERT_TRUE(sub);
    const auto shapes = MakeVersion(11, 1, 1 << 16);
    std::vector<std::vector<std::byte>> dest;
    for (const OwnedTensor& t : shapes) dest.emplace_back(t.bytes.size());
    for (size_t i = 0; i < shapes.size(); ++i) {
      ASSERT_TRUE(sub->Bind(shapes[i].name,
                            Destination{shapes[i].dtype, shapes[i].shape, {}, dest[i].data()})
                      .ok());
    }
    const uint64_t first = pub->latest_version().value_or(0) + 1;
    for (uint64_t v = first; v < first + 2; ++v) {
      auto version = MakeVersion(11, v, 1 << 16);
      ASSERT_TRUE(pub->Publish(v, Views(version), {}, kTimeout).ok());
      auto u = sub->WaitForVersion(v, kTimeout);
      ASSERT_TRUE(u.ok()) << u.status();
      for (size_t i = 0; i < version.size(); ++i) {
        EXPECT_TRUE(dest[i] == version[i].bytes) << version[i].name << " at version " << v;
        if (!dest[i].empty()) EXPECT_EQ((*u)->tensors()[i].data, dest[i].data());
      }
    }
  }
}

TEST_P(ConformanceTest, MismatchedBindingFailsBeforeAnyByteIsWritten) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  auto tensors = MakeVersion(2, 1, 1 << 16);
  ASSERT_TRUE(pub->Publish(1, Views(tensors), {}, kTimeout).ok());
  const OwnedTensor& embed = tensors[0];
  for (const char* mode : {"staged", "direct"}) {
    SCOPED_TRACE(mode);
    auto sub = OpenSubscriber(Uri(std::string("bind_mode=") + mode));
    ASSERT_TRUE(sub);
    std::vector<std::byte> ok_dest(tensors[1].bytes.size(), std::byte{0xAB});
    std::vector<std::byte> bad_dest(embed.bytes.size(), std::byte{0xCD});
    ASSERT_TRUE(sub->Bind(tensors[1].name,
                          Destination{tensors[1].dtype, tensors[1].shape, {}, ok_dest.data()})
                    .ok());
    // Right size, wrong dtype: F16 instead of BF16.
    ASSERT_TRUE(
        sub->Bind(embed.name, Destination{DType::kF16, embed.shape, {}, bad_dest.data()}).ok());
    auto update = sub->WaitForVersion(1, kTimeout);
    ASSERT_EQ(update.status().code(), absl::StatusCode::kInvalidArgument) << update.status();
    const std::string msg(update.status().message());
    EXPECT_TRUE(absl::StrContains(msg, embed.name)) << msg;
    EXPECT_TRUE(absl::StrContains(msg, "BF16 [" + std::to_string(embed.shape[0]) + ", 1024]"))
        << msg;
    EXPECT_TRUE(absl::StrContains(msg, "F16 [")) << msg;
    EXPECT_TRUE(absl::StrContains(msg, "nothing was written")) << msg;
    // Wrong shape, then a name the version does not have.
    ASSERT_TRUE(sub->Bind(embed.name,
                          Destination{embed.dtype, {embed.shape[0] * 2, 512}, {}, bad_dest.data()})
                    .ok());
    EXPECT_EQ(sub->WaitForVersion(1, kTimeout).status().code(), absl::StatusCode::kInvalidArgument);
    sub->UnbindAll();
    ASSERT_TRUE(
        sub->Bind("no.such.tensor", Destination{DType::kF32, {1}, {}, ok_dest.data()}).ok());
    update = sub->WaitForVersion(1, kTimeout);
    ASSERT_EQ(update.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(update.status().message(), "no.such.tensor"));
    for (std::byte b : ok_dest) ASSERT_EQ(b, std::byte{0xAB});
    for (std::byte b : bad_dest) ASSERT_EQ(b, std::byte{0xCD});
    EXPECT_FALSE(sub->current_version().has_value());
    sub->UnbindAll();
    auto good = sub->WaitForVersion(1, kTimeout);
    ASSERT_TRUE(good.ok()) << good.status();
    ExpectSameTensors(**good, tensors);
  }
}

// ---------------------------------------------------------------------------------------------
// Versions, Poll and WaitForVersion (weightbus.hpp: a version v >= max(min_version, current)).

TEST_P(ConformanceTest, VersionsMustIncrease) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  auto tensors = MakeVersion(1, 1, 4096), other = MakeVersion(2, 1, 4096);
  ASSERT_TRUE(pub->Publish(5, Views(tensors), {}, kTimeout).ok());
  for (uint64_t v : {5, 4}) {  // 5 with other bytes, and 4
    absl::Status s = pub->Publish(v, Views(other), {}, kTimeout);
    ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), absl::StrFormat("version %d", v))) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "already has version 5")) << s;
  }
  EXPECT_EQ(pub->latest_version(), std::optional<uint64_t>(5));
  EXPECT_TRUE(pub->Publish(6, Views(other), {}, kTimeout).ok());
}

TEST_P(ConformanceTest, PollReturnsAtOnceWithTheNewestCommittedVersion) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  std::unique_ptr<Subscriber> sub = OpenSubscriber(Uri());
  ASSERT_TRUE(sub);
  auto none = sub->Poll(1, kTimeout);  // nothing committed: no error, no update
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  for (uint64_t v = 1; v <= 10; ++v) {
    auto tensors = MakeVersion(13, v, 1 << 12);
    ASSERT_TRUE(pub->Publish(v, Views(tensors), {}, kTimeout).ok()) << v;
    if (v % 4 == 1) sub = OpenSubscriber(Uri());  // now and then one whose first call polls
    auto u = sub->Poll(v, kTimeout);
    ASSERT_TRUE(u.ok()) << v << ": " << u.status();
    ASSERT_NE(*u, nullptr) << "version " << v << " was committed before the poll";
    EXPECT_EQ((*u)->version(), v);
    ExpectSameTensors(**u, tensors);
    auto again = sub->Poll(0, kTimeout);  // the held version is returned again
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_NE(*again, nullptr) << "the held version " << v << " is not returned again";
    EXPECT_EQ((*again)->version(), v);
  }
  // Two versions committed since the last poll: the newest.
  for (uint64_t v = 11; v <= 12; ++v) {
    auto tensors = MakeVersion(13, v, 1 << 12);
    ASSERT_TRUE(pub->Publish(v, Views(tensors), {}, kTimeout).ok()) << v;
  }
  auto newest = sub->Poll(11, kTimeout);
  ASSERT_TRUE(newest.ok()) << newest.status();
  ASSERT_NE(*newest, nullptr);
  ExpectSameTensors(**newest, MakeVersion(13, 12, 1 << 12));
  auto newer = sub->Poll(13, kTimeout);  // asking for one that does not exist
  ASSERT_TRUE(newer.ok()) << newer.status();
  EXPECT_EQ(*newer, nullptr);
  EXPECT_EQ(sub->current_version(), std::optional<uint64_t>(12));
}

TEST_P(ConformanceTest, WaitReturnsTheNewestAtOrAboveTheCurrentVersionAndWakesOnAPublish) {
  auto pub = OpenPublisher(Uri());
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  for (uint64_t v = 1; v <= 2; ++v) {
    auto tensors = MakeVersion(5, v, 1 << 14);
    ASSERT_TRUE(pub->Publish(v, Views(tensors), {}, kTimeout).ok());
  }
  auto u = sub->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->version(), 2u);                // the newest, not the one asked for
  auto held = sub->WaitForVersion(0, kTimeout);  // max(0, current) = 2: the held one again
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ((*held)->version(), 2u);
  ExpectSameTensors(**held, MakeVersion(5, 2, 1 << 14));
  // A wait in flight wakes when a later version is published.
  std::unique_ptr<Update> woken;
  Subscriber* raw = sub.get();
  InFlight wait([raw, &woken]() -> absl::Status {
    WB_ASSIGN_OR_RETURN(woken, raw->WaitForVersion(3, kTimeout));
    return absl::OkStatus();
  });
  auto v3 = MakeVersion(5, 3, 1 << 14);
  ASSERT_TRUE(pub->Publish(3, Views(v3), {}, kTimeout).ok());
  const absl::Status result = wait.Result(kTimeout);
  ASSERT_TRUE(result.ok()) << result;
  EXPECT_EQ(woken->version(), 3u);
  ExpectSameTensors(*woken, v3);
}

// A wait that finds nothing new enough is DeadlineExceeded naming what it waited for, within
// its timeout (the bound only proves "no hang"), and leaves nothing behind that would hold up
// later versions.
TEST_P(ConformanceTest, TimeoutsAreDeadlineExceededAndLeaveNothingBehind) {
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(sub);
  absl::Time start = absl::Now();
  auto early = sub->WaitForVersion(1, absl::Milliseconds(100));  // no publisher yet
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded) << early.status();
  EXPECT_TRUE(absl::StrContains(early.status().message(), ">= 1")) << early.status();
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  auto v1 = MakeVersion(2, 1, 1 << 16);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(sub->WaitForVersion(1, kTimeout).ok());
  start = absl::Now();
  auto late = sub->WaitForVersion(2, absl::Milliseconds(100));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_TRUE(absl::StrContains(late.status().message(), ">= 2")) << late.status();
  EXPECT_EQ(sub->current_version(), std::optional<uint64_t>(1));
  for (uint64_t v = 2; v <= 4; ++v) {
    auto tensors = MakeVersion(2, v, 1 << 16);
    ASSERT_TRUE(pub->Publish(v, Views(tensors), {}, kTimeout).ok());
    auto u = sub->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ExpectSameTensors(**u, tensors);
  }
}

TEST_P(ConformanceTest, LateJoinerReceivesTheNewestVersion) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  // Versions a few bytes apart, as training makes them (a layer sends them as deltas).
  std::vector<OwnedTensor> last = MakeVersion(3, 1, 1 << 16);
  for (uint64_t v = 1; v <= 5; ++v) {
    if (v > 1) last[0].bytes[v * 101] ^= std::byte{0x04};
    ASSERT_TRUE(pub->Publish(v, Views(last), {}, kTimeout).ok());
  }
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(sub);
  if (!caps_.late_joiners) {
    // It waits for a version it can receive whole (a layer's next keyframe), never a torn one.
    auto u = sub->WaitForVersion(0, absl::Milliseconds(200));
    EXPECT_EQ(u.status().code(), absl::StatusCode::kDeadlineExceeded) << u.status();
    return;
  }
  auto u = sub->WaitForVersion(0, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->version(), 5u);
  ExpectSameTensors(**u, last);
}

// ---------------------------------------------------------------------------------------------
// Corruption: bytes that do not match the manifest are DataLoss naming the tensor; the
// subscriber keeps its version and its bound destinations (bind_mode=staged) untouched.

TEST_P(ConformanceTest, CorruptedBytesAreDataLossAndTheSubscriberKeepsItsVersion) {
  auto pub = testing::OpenTransportPublisher(Uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(sub);
  auto v1 = MakeVersion(4, 1, 1 << 16);
  ASSERT_TRUE(testing::PublishSealed(**pub, ManifestOf(1, v1), v1).ok());
  std::vector<std::byte> bound(v1[0].bytes.size());
  ASSERT_TRUE(sub->Bind(v1[0].name, {v1[0].dtype, v1[0].shape, {}, bound.data()}).ok());
  ASSERT_TRUE(sub->WaitForVersion(1, kTimeout).ok());
  // Version 2 whose bytes differ from its checksums: in a large tensor and in a small one.
  for (size_t bad : {size_t{0}, size_t{2}}) {
    SCOPED_TRACE(bad);
    const uint64_t version = 2 + bad;
    auto tensors = MakeVersion(4, version, 1 << 16);
    Manifest m = ManifestOf(version, tensors);
    const uint64_t right = m.tensors[bad].xxh3;
    tensors[bad].bytes[tensors[bad].bytes.size() / 2] ^= std::byte{0x10};
    ASSERT_TRUE(testing::PublishSealed(**pub, m, tensors).ok());
    auto u = sub->WaitForVersion(0, kTimeout);
    ASSERT_EQ(u.status().code(), absl::StatusCode::kDataLoss) << u.status();
    EXPECT_TRUE(absl::StrContains(u.status().message(), tensors[bad].name)) << u.status();
    EXPECT_TRUE(absl::StrContains(u.status().message(), absl::StrFormat("%016x", right)))
        << u.status();
    EXPECT_EQ(sub->current_version(), std::optional<uint64_t>(1));
    EXPECT_TRUE(bound == v1[0].bytes) << "a bound destination was touched";
  }
  auto v5 = MakeVersion(4, 5, 1 << 16);
  ASSERT_TRUE(testing::PublishSealed(**pub, ManifestOf(5, v5), v5).ok());
  auto good = sub->WaitForVersion(5, kTimeout);
  ASSERT_TRUE(good.ok()) << good.status();
  ExpectSameTensors(**good, v5);
  EXPECT_TRUE(bound == v5[0].bytes);
}

// ---------------------------------------------------------------------------------------------
// A publisher that goes away and a new one on the channel.

TEST_P(ConformanceTest, RestartedPublisherContinuesAndSubscribersKeepWhatTheyHad) {
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(sub);
  const auto first = MakeVersion(9, 3, 1 << 16);
  std::vector<std::byte> bound(first[0].bytes.size());
  ASSERT_TRUE(sub->Bind(first[0].name, {first[0].dtype, first[0].shape, {}, bound.data()}).ok());
  {
    auto pub = OpenPublisher(Uri());
    ASSERT_TRUE(pub);
    for (uint64_t v = 1; v <= 3; ++v) {
      auto t = MakeVersion(9, v, 1 << 16);
      ASSERT_TRUE(pub->Publish(v, Views(t), {}, kTimeout).ok());
    }
    ASSERT_TRUE(sub->WaitForVersion(3, kTimeout).ok());
  }
  EXPECT_EQ(sub->current_version(), std::optional<uint64_t>(3));
  EXPECT_TRUE(bound == first[0].bytes);
  if (caps_.durable) {
    // The versions outlive their publisher: a new subscriber receives them.
    auto after = OpenSubscriber(Uri());
    ASSERT_TRUE(after);
    auto u = after->WaitForVersion(3, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ExpectSameTensors(**u, first);
  }
  auto pub = OpenPublisher(Uri());  // a restarted trainer
  ASSERT_TRUE(pub);
  // A durable channel's new publisher continues above what it holds; otherwise it starts afresh.
  EXPECT_EQ(pub->latest_version(), caps_.durable ? std::optional<uint64_t>(3) : std::nullopt);
  if (caps_.durable) {
    EXPECT_EQ(pub->Publish(2, Views(first), {}, kTimeout).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  auto v4 = MakeVersion(9, 4, 1 << 16);
  ASSERT_TRUE(pub->Publish(4, Views(v4), {}, kTimeout).ok());
  auto u = sub->WaitForVersion(4, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->version(), 4u);
  ExpectSameTensors(**u, v4);
  EXPECT_TRUE(bound == v4[0].bytes);
}

// A version number names one content. A non-durable channel's restarted publisher may number
// from where it likes: a subscriber holding version 7 refuses a "version 7" with other content,
// naming both sessions, keeps its bytes and takes the new publisher's higher versions; the same
// bytes from the new session are the same version. A durable channel refuses other bytes under
// its latest number at the publisher instead, and a new publisher may retry the latest version
// with the same bytes where the transport reads the channel's manifest back.
TEST_P(ConformanceTest, AVersionNumberNamesOneContentAcrossPublisherSessions) {
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(sub);
  const auto first = MakeVersion(1, 7, 1 << 16);
  std::vector<std::byte> held(first[0].bytes.size());
  ASSERT_TRUE(sub->Bind(first[0].name, {first[0].dtype, first[0].shape, {}, held.data()}).ok());
  std::string first_session;
  {
    auto pub = OpenPublisher(Uri());
    ASSERT_TRUE(pub);
    ASSERT_TRUE(pub->Publish(7, Views(first), {}, kTimeout).ok());
    auto got = sub->WaitForVersion(7, kTimeout);
    ASSERT_TRUE(got.ok()) << got.status();
    first_session = (*got)->manifest().publisher.session;
    EXPECT_EQ(first_session.size(), 16u);
  }
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  auto reused = MakeVersion(2, 7, 1 << 16);
  if (caps_.durable) {
    const absl::Status refused = pub->Publish(7, Views(reused), {}, kTimeout);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    const absl::Status retried = pub->Publish(7, Views(first), {}, kTimeout);
    if (caps_.committed_manifest) {
      EXPECT_TRUE(retried.ok()) << retried;
      EXPECT_TRUE(absl::StrContains(refused.message(), "\"" + reused[0].name + "\"")) << refused;
    } else {
      EXPECT_EQ(retried.code(), absl::StatusCode::kFailedPrecondition) << retried;
    }
  } else {
    ASSERT_TRUE(pub->Publish(7, Views(reused), {}, kTimeout).ok());
    auto refused = sub->WaitForVersion(0, kTimeout);
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), first_session)) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "stays current")) << refused.status();
    EXPECT_TRUE(held == first[0].bytes) << "the held version was touched";
    EXPECT_EQ(sub->current_version(), std::optional<uint64_t>(7));
    // The same content under the same number from a third session is accepted.
    pub.reset();
    pub = OpenPublisher(Uri());
    ASSERT_TRUE(pub);
    ASSERT_TRUE(pub->Publish(7, Views(first), {}, kTimeout).ok());
    auto same = sub->WaitForVersion(7, kTimeout);
    ASSERT_TRUE(same.ok()) << same.status();
    ExpectSameTensors(**same, first);
    EXPECT_NE((*same)->manifest().publisher.session, first_session);
  }
  auto v8 = MakeVersion(2, 8, 1 << 16);
  ASSERT_TRUE(pub->Publish(8, Views(v8), {}, kTimeout).ok());
  auto got8 = sub->WaitForVersion(8, kTimeout);
  ASSERT_TRUE(got8.ok()) << got8.status();
  EXPECT_NE((*got8)->manifest().publisher.session, first_session);
  EXPECT_TRUE(held == v8[0].bytes);
}

TEST_P(ConformanceTest, RepublishingTheLatestVersionWithTheSameBytesIsANoOp) {
  auto pub = OpenPublisher(Uri());
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  auto v3 = MakeVersion(5, 3, 1 << 16);
  ASSERT_TRUE(pub->Publish(3, Views(v3), {{"try", "1"}}, kTimeout).ok());
  // A retry with the same bytes succeeds and changes nothing (the first metadata stays).
  EXPECT_TRUE(pub->Publish(3, Views(v3), {{"try", "2"}}, kTimeout).ok());
  EXPECT_TRUE(pub->last_stats().unchanged);
  EXPECT_EQ(pub->latest_version(), std::optional<uint64_t>(3));
  auto update = sub->WaitForVersion(3, kTimeout);
  ASSERT_TRUE(update.ok()) << update.status();
  EXPECT_EQ((*update)->manifest().metadata.at("try"), "1");
  ExpectSameTensors(**update, v3);
  // Other bytes under the same number are refused, naming the first tensor that differs.
  auto other = v3;
  other[1].bytes[0] ^= std::byte{1};
  const absl::Status refused = pub->Publish(3, Views(other), {}, kTimeout);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "\"" + other[1].name + "\"")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "other content")) << refused;
  auto again = sub->Poll(0, kTimeout);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_NE(*again, nullptr);
  ExpectSameTensors(**again, v3);
}

// ---------------------------------------------------------------------------------------------
// Closing handles while calls are in flight, and fork() (docs/CONVENTIONS.md, "Closing and
// fork").

TEST_P(ConformanceTest, DestroyingASubscriberEndsItsWaitInFlight) {
  auto pub = OpenPublisher(Uri());
  std::unique_ptr<Subscriber> sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  auto v1 = MakeVersion(1, 1, 4096);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(sub->WaitForVersion(1, kTimeout).ok());  // connected, code paths resolved
  Subscriber* raw = sub.get();
  // Without the cancel capability the wait runs to its own deadline: keep that one short.
  const absl::Duration timeout = caps_.cancel ? absl::Seconds(20) : absl::Milliseconds(200);
  InFlight wait([raw, timeout] { return raw->WaitForVersion(2, timeout).status(); });
  sub.reset();  // destroy while the other thread waits for version 2
  const absl::Status result = wait.Result(kTimeout);
  // Cancelled, not DeadlineExceeded: destroy did not just outwait the call's 20 s.
  EXPECT_EQ(result.code(),
            caps_.cancel ? absl::StatusCode::kCancelled : absl::StatusCode::kDeadlineExceeded)
      << result;
}

// Destroyed while the other thread is receiving (paused at a fail point between finding the
// version and fetching its bytes): destroy waits for the receive, which completes bit-exact.
TEST_P(ConformanceTest, DestroyingASubscriberMidReceiveWaitsForTheReceive) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  testing::PausePoint fetch("core.before_fetch", /*pass=*/2);
  std::unique_ptr<Subscriber> sub;
  {
    testing::ScopedEnv failpoints("WEIGHTBUS_FAILPOINTS", fetch.Spec());
    sub = OpenSubscriber(Uri());
    ASSERT_TRUE(sub);
  }
  auto v1 = MakeVersion(2, 1, 1 << 16), v2 = MakeVersion(2, 2, 1 << 20);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(sub->WaitForVersion(1, kTimeout).ok());  // pass 1 of the fail point
  ASSERT_TRUE(pub->Publish(2, Views(v2), {}, kTimeout).ok());
  Subscriber* raw = sub.get();
  absl::StatusOr<std::unique_ptr<Update>> received;
  std::thread receiver([raw, &received] { received = raw->WaitForVersion(2, kTimeout); });
  ASSERT_TRUE(fetch.WaitReached(kTimeout));  // found version 2, not fetched yet
  {
    InFlight destroy([&sub] {
      sub.reset();
      return absl::OkStatus();
    });
    EXPECT_FALSE(destroy.Returned()) << "destroy did not wait for the receive in flight";
    fetch.Release();
    EXPECT_TRUE(destroy.Result(kTimeout).ok());
  }
  receiver.join();
  ASSERT_TRUE(received.ok()) << received.status();
  ExpectSameTensors(**received, v2);  // the Update outlives its Subscriber
}

// Destroyed while Publish is under way (paused at a fail point before the transport): destroy
// waits; the publish either completes (then the version is there, where the channel outlives
// its publisher) or returns Cancelled (then it is not), never a crash or a torn version.
TEST_P(ConformanceTest, DestroyingAPublisherMidPublishWaitsForIt) {
  testing::PausePoint before("core.before_transport", /*pass=*/2);
  std::unique_ptr<Publisher> pub;
  {
    testing::ScopedEnv failpoints("WEIGHTBUS_FAILPOINTS", before.Spec());
    pub = OpenPublisher(Uri());
    ASSERT_TRUE(pub);
  }
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(sub);
  auto v1 = MakeVersion(3, 1, 1 << 16), v2 = MakeVersion(3, 2, 1 << 16);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(sub->WaitForVersion(1, kTimeout).ok());
  Publisher* raw = pub.get();
  absl::Status result;
  std::thread publisher([raw, &v2, &result] { result = raw->Publish(2, Views(v2), {}, kTimeout); });
  ASSERT_TRUE(before.WaitReached(kTimeout));
  {
    InFlight destroy([&pub] {
      pub.reset();
      return absl::OkStatus();
    });
    EXPECT_FALSE(destroy.Returned()) << "destroy did not wait for the publish in flight";
    before.Release();
    EXPECT_TRUE(destroy.Result(kTimeout).ok());
  }
  publisher.join();
  ASSERT_TRUE(result.ok() || absl::IsCancelled(result)) << result;
  if (result.ok() && caps_.durable) {
    auto update = sub->WaitForVersion(2, kTimeout);
    ASSERT_TRUE(update.ok()) << update.status();
    ExpectSameTensors(**update, v2);
  }
}

TEST_P(ConformanceTest, CancelMakesLaterCallsFailWithCancelled) {
  auto pub = OpenPublisher(Uri());
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  sub->Cancel();
  EXPECT_EQ(sub->Poll(0, kTimeout).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(sub->WaitForVersion(0, kTimeout).status().code(), absl::StatusCode::kCancelled);
  pub->Cancel();
  auto v1 = MakeVersion(1, 1, 4096);
  const absl::Status published = pub->Publish(1, Views(v1), {}, kTimeout);
  EXPECT_EQ(published.code(), absl::StatusCode::kCancelled) << published;
  EXPECT_TRUE(absl::StrContains(published.message(), "being closed")) << published;
}

// What a child process reports through its exit status.
enum ChildResult : int { kChildOk = 0, kChildWrongCode = 1, kChildOther = 2 };

// Forks; the child runs `body` and exits with its result (never returns).
pid_t ForkChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  return pid;
}

int WaitChild(pid_t pid) {
  int status = 0;
  for (int i = 0; i < 6000; ++i) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    absl::SleepFor(absl::Milliseconds(10));  // polling a child's exit, not synchronising
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

TEST_P(ConformanceTest, ForkedChildCannotUseInheritedHandlesAndParentIsUnaffected) {
  auto pub = OpenPublisher(Uri());
  std::unique_ptr<Subscriber> sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  auto v1 = MakeVersion(1, 1, 1 << 16);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(sub->WaitForVersion(1, kTimeout).ok());
  const pid_t child = ForkChild([&] {
    absl::Status wait = sub->WaitForVersion(2, absl::Seconds(3)).status();
    absl::Status poll = sub->Poll(0, absl::Seconds(3)).status();
    auto v2 = MakeVersion(1, 2, 1 << 16);
    absl::Status publish = pub->Publish(2, Views(v2), {}, absl::Seconds(3));
    for (const absl::Status& s : {wait, poll, publish}) {
      if (s.code() != absl::StatusCode::kFailedPrecondition ||
          !absl::StrContains(s.message(), "fork")) {
        fprintf(stderr, "child got: %s\n", s.ToString().c_str());
        return kChildWrongCode;
      }
    }
    if (sub->current_version().has_value() || pub->latest_version().has_value()) {
      return kChildOther;
    }
    sub.reset();  // destroying inherited handles in the child frees nothing of the parent's
    pub.reset();
    return kChildOk;
  });
  ASSERT_GT(child, 0);
  EXPECT_EQ(WaitChild(child), kChildOk);
  // The parent's handles still work.
  for (uint64_t v = 2; v <= 3; ++v) {
    auto tensors = MakeVersion(1, v, 1 << 16);
    ASSERT_TRUE(pub->Publish(v, Views(tensors), {}, kTimeout).ok()) << v;
    auto update = sub->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(update.ok()) << update.status();
    ExpectSameTensors(**update, tensors);
  }
}

// A forked child that lives on (a DataLoader worker) must not keep the parent's channel lock,
// listening port or connections: the parent can close its publisher and open a new one on the
// same channel while the child still runs.
TEST_P(ConformanceTest, AChildThatLivesOnHoldsNoLockOrPortOfTheParent) {
  std::unique_ptr<Publisher> pub = OpenPublisher(Uri());
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  auto v1 = MakeVersion(4, 1, 1 << 16);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(sub->WaitForVersion(1, kTimeout).ok());  // a live control connection on ucx
  int hold[2];
  ASSERT_EQ(pipe(hold), 0);
  const pid_t child = ForkChild([&] {
    close(hold[1]);
    char c;
    (void)!read(hold[0], &c, 1);  // lives until the parent closes its end
    return static_cast<int>(kChildOk);
  });
  ASSERT_GT(child, 0);
  close(hold[0]);
  pub.reset();
  auto reopened = Publisher::Open(Uri());
  EXPECT_TRUE(reopened.ok()) << reopened.status();
  if (reopened.ok()) {
    auto v2 = MakeVersion(4, 2, 1 << 16);
    ASSERT_TRUE((*reopened)->Publish(2, Views(v2), {}, kTimeout).ok());
    auto update = sub->WaitForVersion(2, kTimeout);
    ASSERT_TRUE(update.ok()) << update.status();
    ExpectSameTensors(**update, v2);
  }
  close(hold[1]);
  EXPECT_EQ(WaitChild(child), kChildOk);
}

// ---------------------------------------------------------------------------------------------
// The declared capabilities (lib/core/transport.h), each checked both ways.

TEST_P(ConformanceTest, CrossProcessSubscribersReceiveWhereDeclared) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  auto v1 = MakeVersion(6, 1, 1 << 16);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  // This test binary in another process (ConformanceChild below), with the stack's environment.
  std::map<std::string, std::string> env = GetParam().env.env;
  env["WB_TEST_CHILD_URI"] = Uri();
  env["WB_TEST_CHILD_TIMEOUT_MS"] = caps_.cross_process ? "30000" : "100";
  auto child = testing::Child::Start(
      {"/proc/self/exe", "--gtest_filter=ConformanceChild.DISABLED_ReceivesVersion1",
       "--gtest_also_run_disabled_tests"},
      env, dir_ / "child.log");
  ASSERT_TRUE(child.ok()) << child.status();
  auto status = child->Wait(absl::Seconds(120));
  ASSERT_TRUE(status.ok()) << status.status();
  const std::string log = testing::ReadFileOrDie(dir_ / "child.log");
  ASSERT_TRUE(WIFEXITED(*status)) << log;
  if (caps_.cross_process) {
    EXPECT_EQ(WEXITSTATUS(*status), 0) << log;
    EXPECT_TRUE(absl::StrContains(log, "received version 1 bit-exact")) << log;
  } else {
    // The other process sees no version: it waits and times out, nothing worse.
    EXPECT_TRUE(absl::StrContains(log, "DEADLINE_EXCEEDED")) << log;
  }
}

// Run only from CrossProcessSubscribersReceiveWhereDeclared, in a child process.
TEST(ConformanceChild, DISABLED_ReceivesVersion1) {
  const char* uri = std::getenv("WB_TEST_CHILD_URI");
  const char* timeout_ms = std::getenv("WB_TEST_CHILD_TIMEOUT_MS");
  if (uri == nullptr || timeout_ms == nullptr) GTEST_SKIP() << "run by ConformanceTest only";
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto u = (*sub)->WaitForVersion(1, absl::Milliseconds(std::atoi(timeout_ms)));
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, MakeVersion(6, 1, 1 << 16));
  if (!HasFailure()) printf("received version 1 bit-exact\n");
}

TEST_P(ConformanceTest, WaitForReceiversCountsSubscribersWhereDeclared) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  auto v1 = MakeVersion(6, 1, 1 << 16);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  EXPECT_EQ(pub->WaitForReceivers(1, 0, kTimeout).code(), absl::StatusCode::kInvalidArgument);
  if (!caps_.wait_for_receivers) {
    const absl::Status s = pub->WaitForReceivers(1, 1, absl::Milliseconds(10));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    return;
  }
  std::vector<std::unique_ptr<Subscriber>> subs;
  for (int i = 0; i < 2; ++i) {
    subs.push_back(OpenSubscriber(Uri()));
    ASSERT_TRUE(subs.back());
    ASSERT_TRUE(subs.back()->WaitForVersion(1, kTimeout).ok());
  }
  EXPECT_TRUE(pub->WaitForReceivers(1, 2, kTimeout).ok());
  subs.clear();  // a subscriber that received the version and left still counts
  EXPECT_TRUE(pub->WaitForReceivers(1, 2, kTimeout).ok());
  const absl::Time start = absl::Now();
  const absl::Status three = pub->WaitForReceivers(1, 3, absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(three.code(), absl::StatusCode::kDeadlineExceeded) << three;
  EXPECT_TRUE(absl::StrContains(three.message(), "2 of the 3")) << three;
  EXPECT_EQ(pub->WaitForReceivers(2, 1, absl::Milliseconds(50)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_P(ConformanceTest, OpenVersionListVersionsAndCommittedManifestWhereDeclared) {
  auto pub = testing::OpenTransportPublisher(Uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = testing::OpenTransportSubscriber(Uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  std::vector<std::vector<OwnedTensor>> versions(4);
  for (uint64_t v = 1; v <= 3; ++v) {
    versions[v] = MakeVersion(8, v, 1 << 14);
    ASSERT_TRUE(testing::PublishSealed(**pub, ManifestOf(v, versions[v]), versions[v]).ok());
  }
  const absl::Time deadline = absl::Now() + kTimeout;

  auto listed = (*sub)->ListVersions();
  if (caps_.list_versions) {
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_FALSE(listed->empty());
    EXPECT_TRUE(std::is_sorted(listed->begin(), listed->end()));
    EXPECT_EQ(listed->back(), 3u);
  } else {
    EXPECT_EQ(listed.status().code(), absl::StatusCode::kUnimplemented) << listed.status();
  }

  auto opened = (*sub)->OpenVersion(2, deadline);
  if (caps_.open_version) {
    ASSERT_TRUE(opened.ok()) << opened.status();
    auto fetched = testing::FetchAndVerify(**opened);
    ASSERT_TRUE(fetched.ok()) << fetched.status();
    EXPECT_EQ(fetched->manifest.version, 2u);
    for (size_t i = 0; i < versions[2].size(); ++i) {
      EXPECT_TRUE(fetched->tensors[i] == versions[2][i].bytes) << versions[2][i].name;
    }
    opened->reset();
    EXPECT_EQ((*sub)->OpenVersion(9, deadline).status().code(), absl::StatusCode::kNotFound);
  } else {
    EXPECT_EQ(opened.status().code(), absl::StatusCode::kUnimplemented) << opened.status();
  }
  // The newest version, as the core receives it, after the old one.
  auto newest = (*sub)->WaitForVersion(3, deadline);
  ASSERT_TRUE(newest.ok()) << newest.status();
  auto fetched = testing::FetchAndVerify(**newest);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->manifest.version, 3u);

  auto committed = (*pub)->CommittedManifest(3);
  if (caps_.committed_manifest) {
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(committed->tensors, ManifestOf(3, versions[3]).tensors);
    EXPECT_EQ((*pub)->CommittedManifest(9).status().code(), absl::StatusCode::kNotFound);
  } else {
    EXPECT_EQ(committed.status().code(), absl::StatusCode::kUnimplemented) << committed.status();
  }
}

// partial_reads: FetchRanges reads exactly the byte ranges asked for, in several calls on one
// version (the core reads window by window); without it, Unimplemented.
TEST_P(ConformanceTest, FetchRangesReadsByteRangesWhereDeclared) {
  auto pub = testing::OpenTransportPublisher(Uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = testing::OpenTransportSubscriber(Uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::vector<OwnedTensor> v1 = MakeVersion(9, 1, 1 << 15);
  ASSERT_TRUE(testing::PublishSealed(**pub, ManifestOf(1, v1), v1).ok());
  auto incoming = (*sub)->WaitForVersion(1, absl::Now() + kTimeout);
  ASSERT_TRUE(incoming.ok()) << incoming.status();
  const Manifest& m = (*incoming)->manifest();
  // Of every tensor of at least 3 bytes: its middle, then (second call) its first byte.
  std::vector<std::vector<std::byte>> middle(m.tensors.size()), first(m.tensors.size());
  std::vector<internal::RangeRead> reads, firsts;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const uint64_t n = m.tensors[i].nbytes;
    if (n < 3) continue;
    middle[i].assign(n - 2, std::byte{0xee});
    first[i].assign(1, std::byte{0xee});
    reads.push_back(internal::RangeRead{i, 1, n - 2, middle[i].data()});
    firsts.push_back(internal::RangeRead{i, 0, 1, first[i].data()});
  }
  ASSERT_FALSE(reads.empty());
  const absl::Status s = (*incoming)->FetchRanges(reads, absl::Now() + kTimeout);
  if (!caps_.partial_reads) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    return;
  }
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE((*incoming)->FetchRanges(firsts, absl::Now() + kTimeout).ok());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (middle[i].empty()) continue;
    const std::vector<std::byte>& bytes = v1[i].bytes;
    EXPECT_TRUE(std::equal(middle[i].begin(), middle[i].end(), bytes.begin() + 1)) << v1[i].name;
    EXPECT_EQ(first[i][0], bytes[0]) << v1[i].name;
  }
}

// A PublishJob whose strided tensors come as views (data == nullptr), as the core hands them to
// a stack that declares reads_strided_views, and which counts the copies made through it.
class StridedJob final : public internal::PublishJob {
 public:
  StridedJob(Manifest manifest, std::vector<TensorView> views)
      : manifest_(std::move(manifest)), views_(std::move(views)), copies_(views_.size()) {
    for (size_t i = 0; i < views_.size(); ++i) {
      const bool contiguous = IsContiguous(views_[i].shape, views_[i].strides);
      packed_.push_back({&manifest_.tensors[i],
                         contiguous ? static_cast<const std::byte*>(views_[i].data) : nullptr});
    }
  }
  uint64_t version() const override { return manifest_.version; }
  absl::Span<const internal::PackedTensor> tensors() const override { return packed_; }
  absl::StatusOr<const Manifest*> SealedManifest(absl::Time) override { return &manifest_; }
  void CopyWithChecksum(size_t i, absl::Span<const internal::CopyTarget> pieces) override {
    ++copies_[i];
    uint64_t at = 0;
    for (const internal::CopyTarget& p : pieces) {
      CopyRange(i, at, p.size, p.data);
      at += p.size;
    }
  }
  void CopyRange(size_t i, uint64_t offset, uint64_t size, std::byte* dst) const override {
    const TensorView& v = views_[i];
    internal::PackStridedRange(v.data, DTypeSize(v.dtype), v.shape, v.strides, offset, size, dst);
  }
  int copies(size_t i) const { return copies_[i].load(); }

 private:
  Manifest manifest_;
  std::vector<TensorView> views_;
  std::vector<internal::PackedTensor> packed_;
  std::vector<std::atomic<int>> copies_;
};

TEST_P(ConformanceTest, PublishJobHooksAreUsedWhereDeclared) {
  if (!caps_.reads_strided_views && !caps_.copies_with_checksums) {
    GTEST_SKIP() << "declares neither reads_strided_views nor copies_with_checksums (the core "
                    "packs and checksums for it: StridedViewsAndStridedDestinations)";
  }
  auto pub = testing::OpenTransportPublisher(Uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(sub);
  std::vector<int32_t> base(24);
  for (int i = 0; i < 24; ++i) base[i] = i * 7 - 50;
  // A 4x6 int32 matrix and its transpose (a strided view of the same memory).
  const TensorView plain{"plain", DType::kI32, {4, 6}, {}, base.data()};
  const TensorView transposed{"transposed", DType::kI32, {6, 4}, {1, 6}, base.data()};
  std::vector<int32_t> transposed_rows(24);
  for (int r = 0; r < 6; ++r) {
    for (int c = 0; c < 4; ++c) transposed_rows[r * 4 + c] = base[c * 6 + r];
  }
  Manifest m;
  m.version = 1;
  m.tensors = {
      TensorInfo{"plain", DType::kI32, {4, 6}, std::nullopt, 96, testing::Xxh3(base.data(), 96)},
      TensorInfo{"transposed",
                 DType::kI32,
                 {6, 4},
                 std::nullopt,
                 96,
                 testing::Xxh3(transposed_rows.data(), 96)}};
  if (!caps_.reads_strided_views) m.tensors.pop_back();  // the core would pack it
  StridedJob job(m, caps_.reads_strided_views ? std::vector<TensorView>{plain, transposed}
                                              : std::vector<TensorView>{plain});
  ASSERT_TRUE((*pub)->Publish(job, absl::Now() + kTimeout).ok());
  if (caps_.copies_with_checksums) {
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      EXPECT_GE(job.copies(i), 1) << m.tensors[i].name << " was not staged with CopyWithChecksum";
    }
  }
  auto u = sub->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(std::memcmp((*u)->Find("plain")->data, base.data(), 96), 0);
  if (caps_.reads_strided_views) {
    EXPECT_EQ(std::memcmp((*u)->Find("transposed")->data, transposed_rows.data(), 96), 0);
  }
}

// Cancel on the plugin interface: with the capability a wait in flight returns Cancelled long
// before its deadline, and so does every later call; without it Cancel has no effect.
TEST_P(ConformanceTest, TransportCancelEndsWaitsInFlightWhereDeclared) {
  auto sub = testing::OpenTransportSubscriber(Uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  const absl::Duration timeout = caps_.cancel ? absl::Seconds(120) : absl::Milliseconds(200);
  internal::TransportSubscriber* raw = sub->get();
  InFlight wait([raw, timeout] { return raw->WaitForVersion(1, absl::Now() + timeout).status(); });
  (*sub)->Cancel();
  const absl::Status waited = wait.Result(kTimeout);
  if (caps_.cancel) {
    EXPECT_EQ(waited.code(), absl::StatusCode::kCancelled) << waited;
    EXPECT_EQ((*sub)->WaitForVersion(1, absl::Now() + absl::Seconds(5)).status().code(),
              absl::StatusCode::kCancelled);
  } else {
    EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  }
}

// Every rank of a TP group of 2 opened with placements receives only its slices (docs/
// RESHARDING.md, "Subscribing with placements"): a column-parallel [4, 6] matrix cut on its
// rows, a row-parallel one on its columns, a vector whole; two versions through one plan.
TEST_P(ConformanceTest, SubscribersWithPlacementsReceiveTheirSlices) {
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  auto values = [](uint64_t v) {
    std::vector<float> m(24);
    for (int i = 0; i < 24; ++i) m[i] = static_cast<float>(i) + 100.0f * static_cast<float>(v);
    return m;
  };
  const SubscribePlacements placements{
      {{"col", Placement::Shard(0)}, {"row", Placement::Shard(1)}}, {2, 0}, {}};
  std::vector<std::unique_ptr<Subscriber>> subs;
  for (int r = 0; r < 2; ++r) {
    SubscribePlacements p = placements;
    p.rank.rank = r;
    auto sub = Subscriber::Open(Uri(), {}, p);
    ASSERT_TRUE(sub.ok()) << sub.status();
    subs.push_back(*std::move(sub));
  }
  for (uint64_t v : {1, 2}) {
    const std::vector<float> m = values(v);
    ASSERT_TRUE(pub->Publish(v,
                             {TensorView{"col", DType::kF32, {4, 6}, {}, m.data()},
                              TensorView{"row", DType::kF32, {4, 6}, {}, m.data()},
                              TensorView{"norm", DType::kF32, {6}, {}, m.data()}},
                             {}, kTimeout)
                    .ok());
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE(absl::StrFormat("version %d, TP rank %d of 2", v, r));
      auto u = subs[r]->ReceiveVersion(v, kTimeout);
      ASSERT_TRUE(u.ok()) << u.status();
      auto got = [&](const char* name) {
        const TensorView* t = (*u)->Find(name);
        const float* p = static_cast<const float*>(t->data);
        return std::make_pair(t->shape, std::vector<float>(p, p + *NumElements(t->shape)));
      };
      std::vector<float> col(m.begin() + 12 * r, m.begin() + 12 * (r + 1)), row;
      for (int i = 0; i < 4; ++i) {
        row.insert(row.end(), m.begin() + 6 * i + 3 * r, m.begin() + 6 * i + 3 * (r + 1));
      }
      EXPECT_EQ(got("col"), std::make_pair(std::vector<int64_t>{2, 6}, col));
      EXPECT_EQ(got("row"), std::make_pair(std::vector<int64_t>{4, 3}, row));
      EXPECT_EQ(got("norm"), std::make_pair(std::vector<int64_t>{6},
                                            std::vector<float>(m.begin(), m.begin() + 6)));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Exact versions (Subscriber::ReceiveVersion) and tensor-parallel groups whose leader picks the
// version once (README, "One version per tensor-parallel group").

constexpr uint64_t kExactSeed = 12;
constexpr uint64_t kExactBytes = 64 << 10;

absl::Status PublishExact(Publisher& pub, uint64_t v) {
  const auto tensors = MakeVersion(kExactSeed, v, kExactBytes);
  return pub.Publish(v, Views(tensors), {{"step", std::to_string(v)}}, kTimeout);
}

// A held one while newer ones exist where the stack declares OpenVersion (elsewhere NotFound:
// only the newest can be handed over); a future one waited for; the current one again; a lower
// one refused; the timeout.
TEST_P(ConformanceTest, ReceiveVersionTakesExactlyTheVersionAskedFor) {
  auto pub = OpenPublisher(Uri());
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE(PublishExact(*pub, v).ok());
  auto two = sub->ReceiveVersion(2, kTimeout);
  if (caps_.open_version) {
    ASSERT_TRUE(two.ok()) << two.status();
    EXPECT_EQ((*two)->version(), 2u);
    EXPECT_EQ((*two)->manifest().metadata.at("step"), "2");
    ExpectSameTensors(**two, MakeVersion(kExactSeed, 2, kExactBytes));
  } else {
    ASSERT_EQ(two.status().code(), absl::StatusCode::kNotFound) << two.status();
    EXPECT_TRUE(absl::StrContains(two.status().message(), "version 2")) << two.status();
    EXPECT_EQ(sub->current_version(), std::nullopt);
  }
  auto three = sub->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(three.ok()) << three.status();
  ExpectSameTensors(**three, MakeVersion(kExactSeed, 3, kExactBytes));
  // Not committed yet: waited for.
  std::unique_ptr<Update> four;
  Subscriber* raw = sub.get();
  InFlight wait([raw, &four]() -> absl::Status {
    WB_ASSIGN_OR_RETURN(four, raw->ReceiveVersion(4, kTimeout));
    return absl::OkStatus();
  });
  ASSERT_TRUE(PublishExact(*pub, 4).ok());
  const absl::Status result = wait.Result(kTimeout);
  ASSERT_TRUE(result.ok()) << result;
  EXPECT_EQ(four->version(), 4u);
  ExpectSameTensors(*four, MakeVersion(kExactSeed, 4, kExactBytes));
  auto again = sub->ReceiveVersion(4, kTimeout);  // the current version again: a reload
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSameTensors(**again, MakeVersion(kExactSeed, 4, kExactBytes));
  auto lower = sub->ReceiveVersion(3, kTimeout);
  ASSERT_EQ(lower.status().code(), absl::StatusCode::kFailedPrecondition) << lower.status();
  EXPECT_TRUE(absl::StrContains(lower.status().message(), "cannot receive version 3"))
      << lower.status();
  EXPECT_TRUE(absl::StrContains(lower.status().message(), "holds version 4 already"))
      << lower.status();
  const absl::Time start = absl::Now();
  auto late = sub->ReceiveVersion(9, absl::Milliseconds(100));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_TRUE(absl::StrContains(late.status().message(), "version 9 was not committed"))
      << late.status();
  // The two-bound form: nothing found within the find bound is DeadlineExceeded, however long
  // the receive bound.
  auto found_late = sub->ReceiveVersion(9, absl::Milliseconds(50), kTimeout);
  ASSERT_EQ(found_late.status().code(), absl::StatusCode::kDeadlineExceeded) << found_late.status();
  EXPECT_EQ(sub->current_version(), std::optional<uint64_t>(4));
}

TEST_P(ConformanceTest, ReceiveVersionOfARetiredVersionIsNotFoundNamingWhatTheChannelHolds) {
  auto pub = OpenPublisher(Uri(KeepOnly(1)));
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  // Three versions: the delta layer over ucx lets the slot of a keyframe go only at the publish
  // after the next keyframe.
  for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE(PublishExact(*pub, v).ok());
  // A durable channel outlives its publisher, which finishes its pending retention pass when
  // destroyed (disk); the others' publishers must stay to serve.
  if (caps_.durable) pub.reset();
  auto one = sub->ReceiveVersion(1, kTimeout);
  ASSERT_EQ(one.status().code(), absl::StatusCode::kNotFound) << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "version 1 is no longer on the channel"))
      << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), caps_.list_versions
                                                            ? "3; newest seen: 3)"
                                                            : "cannot list; newest seen: 3)"))
      << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "version none stays current"))
      << one.status();
  EXPECT_EQ(sub->current_version(), std::nullopt);
  // The subscriber is intact: the held version still comes.
  auto three = sub->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(three.ok()) << three.status();
  ExpectSameTensors(**three, MakeVersion(kExactSeed, 3, kExactBytes));
}

// Publishes land while a ReceiveVersion waits for a version not committed yet (announced by
// the core.before_version_wait point): it hands over that version, not the newest.
TEST_P(ConformanceTest, ReceiveVersionWaitsForAFutureVersionAndDoesNotSkipIt) {
  auto pub = OpenPublisher(Uri(KeepOnly(8)));
  ASSERT_TRUE(pub);
  ASSERT_TRUE(PublishExact(*pub, 1).ok());
  testing::PausePoint waiting("core.before_version_wait");
  waiting.Release();  // announces only
  std::unique_ptr<Subscriber> sub;
  {
    const testing::ScopedEnv env("WEIGHTBUS_FAILPOINTS", waiting.Spec());
    sub = OpenSubscriber(Uri());
  }
  ASSERT_TRUE(sub);
  absl::StatusOr<std::unique_ptr<Update>> got;
  std::jthread receiver([&] { got = sub->ReceiveVersion(2, kTimeout); });
  ASSERT_TRUE(waiting.WaitReached(kTimeout));
  ASSERT_TRUE(PublishExact(*pub, 2).ok());
  // Without OpenVersion only the newest can be handed over: 3 waits until 2 is received.
  if (caps_.open_version) ASSERT_TRUE(PublishExact(*pub, 3).ok());
  receiver.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->version(), 2u);
  ExpectSameTensors(**got, MakeVersion(kExactSeed, 2, kExactBytes));
}

TEST_P(ConformanceTest, CancelEndsAReceiveVersionWaitingForItsVersion) {
  if (!caps_.cancel) GTEST_SKIP() << "the stack declares no cancel: a wait runs to its deadline";
  auto pub = OpenPublisher(Uri());
  ASSERT_TRUE(pub);
  ASSERT_TRUE(PublishExact(*pub, 1).ok());
  testing::PausePoint waiting("core.before_version_wait");
  waiting.Release();
  std::unique_ptr<Subscriber> sub;
  {
    const testing::ScopedEnv env("WEIGHTBUS_FAILPOINTS", waiting.Spec());
    sub = OpenSubscriber(Uri());
  }
  ASSERT_TRUE(sub);
  absl::StatusOr<std::unique_ptr<Update>> got;
  std::jthread receiver([&] { got = sub->ReceiveVersion(5, absl::Seconds(120)); });
  ASSERT_TRUE(waiting.WaitReached(kTimeout));
  const absl::Time cancelled = absl::Now();
  sub->Cancel();
  receiver.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kCancelled) << got.status();
  EXPECT_LT(absl::Now() - cancelled, absl::Seconds(60)) << "Cancel did not end the wait";
  EXPECT_EQ(sub->ReceiveVersion(1, kTimeout).status().code(), absl::StatusCode::kCancelled);
}

// N workers, each its own Subscriber (as each vLLM worker process has one); the first is the
// leader, which picks the version once per round.
class Group {
 public:
  Group(const std::string& uri, int workers) {
    for (int i = 0; i < workers; ++i) {
      auto s = Subscriber::Open(uri);
      EXPECT_TRUE(s.ok()) << s.status();
      if (s.ok()) workers_.push_back(*std::move(s));
    }
  }
  size_t size() const { return workers_.size(); }
  Subscriber& leader() { return *workers_[0]; }

  // Every worker but the leader receives exactly `v` at the same time; each worker's bytes are
  // checked against version v's. Returns the first error (NotFound: the group must re-pick).
  absl::Status ReceiveAll(uint64_t v) {
    std::vector<absl::Status> status(workers_.size());
    std::vector<std::jthread> threads;
    for (size_t i = 1; i < workers_.size(); ++i) {
      threads.emplace_back([&, i] {
        auto u = workers_[i]->ReceiveVersion(v, kTimeout);
        if (!u.ok()) {
          status[i] = u.status();
          return;
        }
        EXPECT_EQ((*u)->version(), v) << "worker " << i;
        ExpectSameTensors(**u, MakeVersion(kExactSeed, v, kExactBytes));
      });
    }
    threads.clear();  // joins
    for (const absl::Status& s : status) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // The group's invariant: every worker holds `v`.
  void ExpectAllHold(uint64_t v) {
    for (size_t i = 0; i < workers_.size(); ++i) {
      EXPECT_EQ(workers_[i]->current_version(), v) << "worker " << i;
    }
  }

 private:
  std::vector<std::unique_ptr<Subscriber>> workers_;
};

// Publishes versions 2..`last` on its own thread, kBurst more each time the group's leader has
// picked a version (Picked): those publishes then race the workers' receives of that version
// every round, however fast either side is (no sleeps; a ucx:// publisher is otherwise done
// before the workers start, a disk:// one too slow to overlap them).
class RacingPublisher {
 public:
  static constexpr uint64_t kBurst = 2;

  RacingPublisher(Publisher& pub, uint64_t last)
      : thread_([this, &pub, last] {
          for (uint64_t v = 2; v <= last; ++v) {
            {
              absl::MutexLock lock(&mu_);
              next_ = v;
              mu_.Await(absl::Condition(this, &RacingPublisher::MayPublish));
            }
            if (absl::Status s = PublishExact(pub, v); !s.ok()) {
              absl::MutexLock lock(&mu_);
              status_ = s;
              return;
            }
          }
        }) {}
  ~RacingPublisher() { (void)Finish(); }

  // The leader picked `v`: let the publisher go on to v + kBurst.
  void Picked(uint64_t v) {
    absl::MutexLock lock(&mu_);
    allowed_ = std::max(allowed_, v + kBurst);
  }
  // Lets it publish the rest and waits for it; its first error.
  absl::Status Finish() {
    Picked(UINT64_MAX - kBurst);
    if (thread_.joinable()) thread_.join();
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  bool MayPublish() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return allowed_ >= next_; }

  absl::Mutex mu_;
  uint64_t allowed_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 2;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::jthread thread_;
};

TEST_P(ConformanceTest, GroupGetsTheLeadersVersionWhenPublishesLandBetweenReceives) {
  if (!caps_.open_version) GTEST_SKIP() << "without open_version only the newest is handed over";
  auto pub = OpenPublisher(Uri(KeepOnly(8)));
  ASSERT_TRUE(pub);
  Group group(Uri(), 3);
  ASSERT_EQ(group.size(), 3u);
  auto bystander = OpenSubscriber(Uri());  // what a worker calling WaitForVersion(v) would get
  ASSERT_TRUE(bystander);
  uint64_t next = 1;
  ASSERT_TRUE(PublishExact(*pub, next++).ok());
  for (int round = 0; round < 5; ++round) {
    auto picked =
        group.leader().WaitForVersion(group.leader().current_version().value_or(0) + 1, kTimeout);
    ASSERT_TRUE(picked.ok()) << picked.status();
    const uint64_t v = (*picked)->version();
    ExpectSameTensors(**picked, MakeVersion(kExactSeed, v, kExactBytes));
    // A publish lands after the leader's receive, before the other workers'.
    ASSERT_TRUE(PublishExact(*pub, next++).ok());
    auto newest = bystander->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(newest.ok()) << newest.status();
    ASSERT_GT((*newest)->version(), v)
        << "the old API would have mixed versions " << v << " and " << (*newest)->version();
    ASSERT_TRUE(group.ReceiveAll(v).ok());
    group.ExpectAllHold(v);
    ASSERT_TRUE(PublishExact(*pub, next++).ok());
  }
}

// Publishes race every round's receives (RacingPublisher). With a channel that keeps too few
// versions a worker may ask too late (NotFound): the group then re-picks, as README says;
// either way no round ends with workers on different versions.
void RaceGroupAgainstPublishes(const std::string& publisher_uri, const std::string& uri) {
  auto pub = OpenPublisher(publisher_uri);
  ASSERT_TRUE(pub);
  ASSERT_TRUE(PublishExact(*pub, 1).ok());
  Group group(uri, 4);
  ASSERT_EQ(group.size(), 4u);
  constexpr uint64_t kVersions = 40;
  RacingPublisher publisher(*pub, kVersions);
  int rounds = 0, repicked = 0;
  uint64_t held = 0;
  while (held < kVersions) {
    auto picked = group.leader().WaitForVersion(held + 1, kTimeout);
    ASSERT_TRUE(picked.ok()) << picked.status();
    const uint64_t v = (*picked)->version();
    publisher.Picked(v);
    ExpectSameTensors(**picked, MakeVersion(kExactSeed, v, kExactBytes));
    absl::Status all = group.ReceiveAll(v);
    held = v;
    if (absl::IsNotFound(all)) {
      ++repicked;  // v went before a worker opened it: the next round picks a newer one
      continue;
    }
    ASSERT_TRUE(all.ok()) << all;
    group.ExpectAllHold(v);
    ++rounds;
  }
  ASSERT_TRUE(publisher.Finish().ok());
  group.ExpectAllHold(kVersions);
  std::cout << publisher_uri << ": " << rounds << " rounds, " << repicked << " re-picked\n";
}

TEST_P(ConformanceTest, GroupNeverMixesVersionsWhilePublishesRaceAChannelKeepingEight) {
  if (!caps_.open_version) GTEST_SKIP() << "without open_version only the newest is handed over";
  RaceGroupAgainstPublishes(Uri(KeepOnly(8)), Uri());
}

TEST_P(ConformanceTest, GroupNeverMixesVersionsWhilePublishesRaceAChannelKeepingOne) {
  if (!caps_.open_version) GTEST_SKIP() << "without open_version only the newest is handed over";
  RaceGroupAgainstPublishes(Uri(KeepOnly(1)), Uri());
}

// The same with the workers as real processes (tests/peer_main.cc `receive`), as vLLM runs
// one per GPU: the leader (this process) picks the version and sends it to every worker.
TEST_P(ConformanceTest, GroupOfProcessesNeverMixesVersionsWhilePublishesRace) {
  if (!caps_.open_version || !caps_.cross_process) {
    GTEST_SKIP() << "needs open_version and cross_process";
  }
  auto pub = OpenPublisher(Uri(KeepOnly(1)));  // only the newest kept: rounds may re-pick
  ASSERT_TRUE(pub);
  ASSERT_TRUE(PublishExact(*pub, 1).ok());
  auto leader = OpenSubscriber(Uri());
  ASSERT_TRUE(leader);
  auto log = [&](size_t i) { return dir_ / absl::StrFormat("worker%d.log", i); };
  std::vector<testing::Child> workers;
  for (size_t i = 0; i < 3; ++i) {
    testing::Child::Options options;
    options.pipe_stdin = options.pipe_stdout = true;
    options.log_path = log(i);
    auto child = testing::Child::Spawn(
        {testing::BinaryPath("tests/wb_test_peer"), "receive", Uri(), "--seed",
         std::to_string(kExactSeed), "--bytes", std::to_string(kExactBytes)},
        options);
    ASSERT_TRUE(child.ok()) << child.status();
    workers.push_back(*std::move(child));
  }
  constexpr uint64_t kVersions = 30;
  RacingPublisher publisher(*pub, kVersions);
  int rounds = 0, repicked = 0;
  uint64_t held = 0;
  while (held < kVersions) {
    auto picked = leader->WaitForVersion(held + 1, kTimeout);
    ASSERT_TRUE(picked.ok()) << picked.status();
    const uint64_t v = (*picked)->version();
    publisher.Picked(v);
    for (auto& w : workers) ASSERT_TRUE(w.Send(std::to_string(v)));
    bool all = true;
    for (size_t i = 0; i < workers.size(); ++i) {
      std::optional<std::string> answer = workers[i].ReadLine(absl::Now() + kTimeout);
      ASSERT_TRUE(answer.has_value()) << "worker " << i << " gave no answer for version " << v
                                      << ": " << testing::ReadFileOrDie(log(i));
      if (absl::StartsWith(*answer, absl::StrFormat("notfound %d:", v))) {
        all = false;  // v went before this worker opened it: the group re-picks
        continue;
      }
      ASSERT_EQ(*answer, absl::StrFormat("received %d ok", v)) << "worker " << i;
    }
    held = v;
    all ? ++rounds : ++repicked;
  }
  ASSERT_TRUE(publisher.Finish().ok());
  for (size_t i = 0; i < workers.size(); ++i) {
    auto status = workers[i].Wait(kTimeout);  // closes its stdin: the worker ends
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(process::DescribeWaitStatus(*status), process::DescribeWaitStatus(0))
        << testing::ReadFileOrDie(log(i));
  }
  std::cout << GetParam().name << ": " << rounds << " rounds, " << repicked << " re-picked\n";
}

// ---------------------------------------------------------------------------------------------
// Streaming publish (Publisher::BeginPublish): tensor by tensor, all or nothing.

// Names in `dir` (a spool file has none: O_TMPFILE, or unlinked at once).
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().string());
  return out;
}

// Adds each tensor from a scratch copy that is overwritten as soon as Add returns: what the
// subscriber receives was copied during Add, not read later.
void AddEach(PublishStream& stream, const std::vector<OwnedTensor>& tensors) {
  for (const OwnedTensor& t : tensors) {
    OwnedTensor scratch = t;
    ASSERT_TRUE(stream.Add(scratch.View()).ok()) << t.name;
    std::fill(scratch.bytes.begin(), scratch.bytes.end(), std::byte{0xAA});
  }
}

TEST_P(ConformanceTest, StreamedVersionsAreAllOrNothingAndBitExact) {
  ScratchDir spill;
  // A bucket far smaller than the version: tensors span bucket halves and many writes.
  const std::string query = "stream_bucket=16KiB&stream_spill_dir=" + spill.path();
  auto pub = OpenPublisher(Uri(query));
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(pub && sub);
  for (uint64_t v = 1; v <= 2; ++v) {
    auto tensors = MakeVersion(11, v, 1 << 18);
    auto stream = pub->BeginPublish(v, {{"step", std::to_string(v)}});
    ASSERT_TRUE(stream.ok()) << stream.status();
    AddEach(**stream, tensors);
    // A strided view (the transpose of a 3x5 matrix), gathered as it is added.
    std::vector<int32_t> m(15);
    for (int i = 0; i < 15; ++i) m[i] = i * 7 - 3;
    ASSERT_TRUE(
        (*stream)->Add(TensorView{"transposed", DType::kI32, {5, 3}, {1, 5}, m.data()}).ok());
    EXPECT_EQ((*stream)->tensor_count(), tensors.size() + 1);
    // Nothing is visible before Commit, and the spool has no name in its directory.
    auto early = sub->Poll(0, kTimeout);
    ASSERT_TRUE(early.ok()) << early.status();
    if (v == 1) EXPECT_EQ(*early, nullptr);
    if (v == 2) EXPECT_TRUE(*early == nullptr || (*early)->version() == 1);
    EXPECT_EQ(Entries(spill.path()), std::vector<std::string>{});
    ASSERT_TRUE((*stream)->Commit(kTimeout).ok());
    EXPECT_EQ(pub->latest_version(), std::optional<uint64_t>(v));
    EXPECT_EQ(pub->last_stats().version, v);
    auto u = sub->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    EXPECT_EQ((*u)->version(), v);
    EXPECT_EQ((*u)->manifest().metadata, (Metadata{{"step", std::to_string(v)}}));
    const TensorView* t = (*u)->Find("transposed");
    ASSERT_NE(t, nullptr);
    std::vector<int32_t> expect;
    for (int r = 0; r < 5; ++r) {
      for (int c = 0; c < 3; ++c) expect.push_back(m[c * 5 + r]);
    }
    EXPECT_EQ(std::vector<int32_t>(static_cast<const int32_t*>(t->data),
                                   static_cast<const int32_t*>(t->data) + 15),
              expect);
    // Every other tensor bit-exact, in the order added.
    ASSERT_EQ((*u)->tensors().size(), tensors.size() + 1);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorView& got = (*u)->tensors()[i];
      EXPECT_EQ(got.name, tensors[i].name);
      EXPECT_EQ(got.shape, tensors[i].shape);
      const auto* got_bytes = static_cast<const std::byte*>(got.data);
      EXPECT_TRUE(std::equal(tensors[i].bytes.begin(), tensors[i].bytes.end(), got_bytes))
          << got.name;  // (not memcmp: an empty tensor's data may be null)
    }
    // A call after the end is FailedPrecondition naming the version.
    absl::Status late = (*stream)->Add(tensors[0].View());
    EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
    EXPECT_TRUE(absl::StrContains(late.message(), absl::StrFormat("version %d", v))) << late;
  }

  // Aborted, destroyed uncommitted, or failed: nothing of version 3 is ever visible.
  auto a = pub->BeginPublish(3);
  ASSERT_TRUE(a.ok()) << a.status();
  AddEach(**a, MakeVersion(12, 3, 1 << 16));
  // One open stream per Publisher, and versions below the latest are refused at once.
  auto second = pub->BeginPublish(4);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "version 3 is still being streamed"))
      << second.status();
  (*a)->Abort();
  auto low = pub->BeginPublish(1);
  EXPECT_EQ(low.status().code(), absl::StatusCode::kFailedPrecondition) << low.status();
  EXPECT_TRUE(absl::StrContains(low.status().message(), "already has version 2")) << low.status();
  {
    auto dropped = pub->BeginPublish(3);
    ASSERT_TRUE(dropped.ok()) << dropped.status();
    AddEach(**dropped, MakeVersion(13, 3, 1 << 16));
  }  // destroyed uncommitted
  {
    auto bad = pub->BeginPublish(3);
    ASSERT_TRUE(bad.ok()) << bad.status();
    auto tensors = MakeVersion(14, 3, 1 << 16);
    AddEach(**bad, tensors);
    // A tensor Publish would refuse is refused naming it and the version; the stream stays open.
    absl::Status twice = (*bad)->Add(tensors[0].View());
    EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument) << twice;
    EXPECT_TRUE(absl::StrContains(twice.message(), "version 3")) << twice;
    EXPECT_TRUE(absl::StrContains(twice.message(), "\"" + tensors[0].name + "\"")) << twice;
    TensorView null_data{"null.data", DType::kF32, {4}, {}, nullptr};
    absl::Status null_status = (*bad)->Add(null_data);
    EXPECT_EQ(null_status.code(), absl::StatusCode::kInvalidArgument) << null_status;
    EXPECT_TRUE(absl::StrContains(null_status.message(), "null.data")) << null_status;
    // Another Publish takes version 3 meanwhile, with other bytes: the commit is refused.
    auto other = MakeVersion(15, 3, 1 << 16);
    ASSERT_TRUE(pub->Publish(3, Views(other), {}, kTimeout).ok());
    absl::Status commit = (*bad)->Commit(kTimeout);
    EXPECT_EQ(commit.code(), absl::StatusCode::kFailedPrecondition) << commit;
    auto u = sub->WaitForVersion(3, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ExpectSameTensors(**u, other);
  }
  auto after = sub->Poll(4, kTimeout);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, nullptr);
  EXPECT_EQ(sub->current_version(), std::optional<uint64_t>(3));
  EXPECT_EQ(pub->latest_version(), std::optional<uint64_t>(3));
  EXPECT_EQ(Entries(spill.path()), std::vector<std::string>{});

  // The Publisher destroyed under an open stream: its calls return Cancelled, nothing shows.
  auto orphan = pub->BeginPublish(4);
  ASSERT_TRUE(orphan.ok()) << orphan.status();
  AddEach(**orphan, MakeVersion(16, 4, 1 << 16));
  pub.reset();
  auto v4 = MakeVersion(16, 4, 1 << 16);
  EXPECT_EQ((*orphan)->Add(v4[0].View()).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ((*orphan)->Commit(kTimeout).code(), absl::StatusCode::kCancelled);
  orphan->reset();

  // A process that dies mid-stream leaves nothing a subscriber or a later publisher sees. (Not
  // under ThreadSanitizer, which kills a child forked from a multi-threaded process as soon as
  // it starts a thread: "starting new threads after multi-threaded fork is not supported".)
#if defined(__SANITIZE_THREAD__)
  constexpr bool kForkedChildMayStartThreads = false;
#elif defined(__has_feature)
  constexpr bool kForkedChildMayStartThreads = !__has_feature(thread_sanitizer);
#else
  constexpr bool kForkedChildMayStartThreads = true;
#endif
  const std::string uri = Uri(query);
  if (kForkedChildMayStartThreads) {
    const pid_t child = ForkChild([&] {
      auto p = Publisher::Open(uri);
      if (!p.ok()) return int{kChildOther};
      auto s = (*p)->BeginPublish(4);
      if (!s.ok()) return int{kChildOther};
      for (const OwnedTensor& t : MakeVersion(17, 4, 1 << 18)) {
        if (!(*s)->Add(t.View()).ok()) return int{kChildOther};
      }
      raise(SIGKILL);
      return int{kChildOther};
    });
    EXPECT_EQ(WaitChild(child), 128 + SIGKILL);
  }
  EXPECT_EQ(Entries(spill.path()), std::vector<std::string>{});
  auto none = sub->Poll(4, absl::Seconds(1));
  if (none.ok()) EXPECT_EQ(*none, nullptr);  // ucx: the publisher is gone (Unavailable)
  pub = OpenPublisher(Uri(query));
  ASSERT_TRUE(pub);
  if (caps_.durable) EXPECT_EQ(pub->latest_version(), std::optional<uint64_t>(3));
  auto stream = pub->BeginPublish(4);
  ASSERT_TRUE(stream.ok()) << stream.status();
  AddEach(**stream, v4);
  ASSERT_TRUE((*stream)->Commit(kTimeout).ok());
  auto fresh = OpenSubscriber(Uri());
  ASSERT_TRUE(fresh);
  auto u = fresh->WaitForVersion(4, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, v4);
}

// A group rank's stream is its part: every rank streams its slices, the version appears whole
// once every rank committed, and not before.
TEST_P(ConformanceTest, StreamedGroupPartsCommitOneVersionWhereDeclared) {
  if (!caps_.publisher_groups) GTEST_SKIP() << "no publisher groups on this stack";
  auto r0 = OpenPublisher(Uri("rank=0&world_size=2&stream_bucket=8KiB"));
  auto r1 = OpenPublisher(Uri("rank=1&world_size=2&stream_bucket=8KiB"));
  auto sub = OpenSubscriber(Uri());
  ASSERT_TRUE(r0 && r1 && sub);
  std::vector<float> whole(64 * 32);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(i) * 0.25f;
  const float bias = 3.5f;
  auto s0 = r0->BeginPublish(1);
  auto s1 = r1->BeginPublish(1);
  ASSERT_TRUE(s0.ok() && s1.ok()) << s0.status() << s1.status();
  for (int rank = 0; rank < 2; ++rank) {
    PublishStream& s = rank == 0 ? **s0 : **s1;
    ASSERT_TRUE(s.Add(TensorView{"w",
                                 DType::kF32,
                                 {32, 32},
                                 {},
                                 whole.data() + rank * 32 * 32,
                                 {},
                                 Shard{{64, 32}, {rank * 32, 0}}})
                    .ok());
    ASSERT_TRUE(s.Add(TensorView{"bias", DType::kF32, {}, {}, &bias}).ok());  // replicated
  }
  ASSERT_TRUE((*s0)->Commit(absl::Milliseconds(1)).code() == absl::StatusCode::kDeadlineExceeded);
  auto nothing = sub->Poll(0, kTimeout);
  ASSERT_TRUE(nothing.ok()) << nothing.status();
  EXPECT_EQ(*nothing, nullptr);
  // Again, both ranks at once.
  s0 = r0->BeginPublish(1);
  ASSERT_TRUE(s0.ok()) << s0.status();
  ASSERT_TRUE((*s0)
                  ->Add(TensorView{
                      "w", DType::kF32, {32, 32}, {}, whole.data(), {}, Shard{{64, 32}, {0, 0}}})
                  .ok());
  ASSERT_TRUE((*s0)->Add(TensorView{"bias", DType::kF32, {}, {}, &bias}).ok());
  absl::Status status0;
  std::thread t([&] { status0 = (*s0)->Commit(kTimeout); });
  const absl::Status status1 = (*s1)->Commit(kTimeout);
  t.join();
  ASSERT_TRUE(status0.ok()) << status0;
  ASSERT_TRUE(status1.ok()) << status1;
  auto u = sub->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  const TensorView* w = (*u)->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(std::memcmp(w->data, whole.data(), whole.size() * sizeof(float)), 0);
  ASSERT_NE((*u)->Find("bias"), nullptr);
  EXPECT_EQ(*static_cast<const float*>((*u)->Find("bias")->data), bias);
}

INSTANTIATE_TEST_SUITE_P(Stacks, ConformanceTest, ::testing::ValuesIn(Stacks()),
                         [](const ::testing::TestParamInfo<Stack>& info) {
                           return info.param.name;
                         });

// mem:// declares what its settings switch on; the suite above relies on it.
TEST(MemTransportTest, DeclaredCapabilitiesFollowTheSettings) {
  auto all = testing::StackCapabilitiesOf("mem:///x");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(internal::DescribeCapabilities(*all),
            "reads_strided_views, copies_with_checksums, committed_manifest, keep_versions_from, "
            "wait_for_receivers, open_version, list_versions, cancel, durable, late_joiners");
  auto bare =
      testing::StackCapabilitiesOf(absl::StrReplaceAll(testing::kBareMem, {{"{name}", "x"}}));
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(internal::DescribeCapabilities(*bare), "late_joiners");
  if (!testing::MissingTransports({"delta"}).empty()) return;  // a layer over it: delta's
  auto layered = testing::StackCapabilitiesOf(
      absl::StrReplaceAll(std::string("delta+") + testing::kBareMem, {{"{name}", "x"}}));
  ASSERT_TRUE(layered.ok()) << layered.status();
  // No late joiners without OpenVersion; byte ranges served from what the layer decodes.
  EXPECT_EQ(internal::DescribeCapabilities(*layered), "partial_reads");
}

}  // namespace
}  // namespace weightbus
