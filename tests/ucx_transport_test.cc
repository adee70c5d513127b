// SPDX-License-Identifier: Apache-2.0
// What is particular to the ucx:// transport, in one process (publisher and subscribers as
// separate UCP contexts, talking over real loopback endpoints), parameterized over UCX_TLS:
// shared memory (posix,sysv,cma,self) and tcp on the loopback device. Covers slot reuse, leases,
// a refused binding releasing its slot, a publisher going away, rendezvous address errors,
// KeepVersionsFrom and exact versions in staging memory, chunk-by-chunk verification, Cancel of
// a Publish waiting for a slot, the control framing and the registration cache. The contract
// every transport keeps (round trips, bindings, Poll/Wait, timeouts, restarts, capabilities) is
// tests/conformance_test.cc.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/registry.h"
#include "core/secret.h"
#include "expect_tensors.h"
#include "in_flight.h"
#include "test_model.h"
#include "test_support.h"
#include "transport_stack.h"
#include "transports/ucx/control.h"
#include "transports/ucx/descriptor.h"
#include "transports/ucx/registration_cache.h"
#include "transports/ucx/ucp_util.h"
#include "transports/ucx/ucx_transport.h"
#include "ucx_tls.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::OwnedTensor;
using ::weightbus::testing::Views;
using ::weightbus::testing::Xxh3;

constexpr absl::Duration kTimeout = absl::Seconds(30);

using ::weightbus::testing::kDefault;
using ::weightbus::testing::kShm;
using ::weightbus::testing::kTcp;
using ::weightbus::testing::Tls;

using ::weightbus::testing::FreePort;

// Why UCX cannot run here with the current UCX_* environment, or "" when it can.
std::string UcxUnavailableReason() {
  auto context = internal::ucx::Context::Create(false, "probe", false);
  if (!context.ok()) return std::string(context.status().message());
  auto worker = internal::ucx::Worker::Create(*context, "probe");
  if (!worker.ok()) return std::string(worker.status().message());
  return "";
}

using ::weightbus::testing::ExpectSameTensors;

class UcxTransportTest : public ::testing::TestWithParam<Tls> {
 protected:
  void SetUp() override {
    env_.emplace(GetParam().env);
    const std::string why = UcxUnavailableReason();
    if (!why.empty()) GTEST_SKIP() << "UCX cannot create a worker here: " << why;
    port_ = FreePort();
    ASSERT_GT(port_, 0);
  }

  std::string Uri(const std::string& query = "", const std::string& channel = "policy") const {
    return absl::StrFormat("ucx://127.0.0.1:%d/%s%s", port_, channel,
                           query.empty() ? "" : "?" + query);
  }

  std::optional<testing::ScopedEnvs> env_;  // UCX_TLS of the case, restored after it
  int port_ = -1;
};

TEST_P(UcxTransportTest, FollowsManyVersionsThroughRecycledStagingSlots) {
  for (const char* slots : {"1", "3"}) {
    SCOPED_TRACE(slots);
    port_ = FreePort();
    // Small gets and regions, so versions span several regions and many gets.
    const std::string q = absl::StrFormat(
        "staging_slots=%s&get_chunk_size=64KiB&gets_in_flight=3&max_region=1MiB", slots);
    auto pub = Publisher::Open(Uri(q));
    ASSERT_TRUE(pub.ok()) << pub.status();
    auto a = Subscriber::Open(Uri(q));
    auto b = Subscriber::Open(Uri(q));
    ASSERT_TRUE(a.ok() && b.ok());
    for (uint64_t v = 1; v <= 12; ++v) {
      // Sizes vary, so slots are grown and reused.
      auto tensors = MakeVersion(11, v, (v % 3 + 1) * 700000);
      ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok()) << v;
      for (auto* s : {&*a, &*b}) {
        auto u = (*s)->WaitForVersion(v, kTimeout);
        ASSERT_TRUE(u.ok()) << u.status();
        ASSERT_EQ((*u)->version(), v);
        ExpectSameTensors(**u, tensors);
      }
    }
  }
}

TEST_P(UcxTransportTest, MismatchedBindingIsRejectedBeforeAnyByteMoves) {
  // One slot: a lease left behind by the rejected update would block the next Publish.
  auto pub = Publisher::Open(Uri("staging_slots=1&lease=60s"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto v1 = MakeVersion(5, 1, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  auto sub = Subscriber::Open(Uri());
  ASSERT_TRUE(sub.ok());
  std::vector<float> bias(64, 42.0f);  // manifest: F32 [64]
  struct Case {
    Destination dest;
    std::string mismatch;
  };
  for (const Case& c : {Case{{DType::kF16, {64}, {}, bias.data()}, "F16 [64]"},
                        Case{{DType::kF32, {8, 8}, {}, bias.data()}, "F32 [8, 8]"}}) {
    ASSERT_TRUE((*sub)->Bind("model.layers.0.self_attn.q_proj.bias", c.dest).ok());
    auto u = (*sub)->WaitForVersion(1, kTimeout);
    ASSERT_FALSE(u.ok());
    EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(u.status().message(), HasSubstr("\"model.layers.0.self_attn.q_proj.bias\""));
    EXPECT_THAT(u.status().message(), HasSubstr("F32 [64]"));
    EXPECT_THAT(u.status().message(), HasSubstr(c.mismatch));
    EXPECT_THAT(u.status().message(), HasSubstr("nothing was written"));
    for (float f : bias) ASSERT_EQ(f, 42.0f);
  }
  EXPECT_EQ((*sub)->current_version(), std::nullopt);
  // The refused version's hold was released: the single slot is free for version 2 at once.
  auto v2 = MakeVersion(5, 2, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(2, Views(v2), {}, absl::Seconds(5)).ok());
  ASSERT_TRUE(
      (*sub)
          ->Bind("model.layers.0.self_attn.q_proj.bias", {DType::kF32, {64}, {}, bias.data()})
          .ok());
  auto u = (*sub)->WaitForVersion(2, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(std::memcmp(bias.data(), v2[2].bytes.data(), v2[2].bytes.size()), 0);
}

// A subscriber whose receive of version 1, started on its own thread, is held by a pause point in
// the middle of the transfer (renewing nothing). Destruction releases and joins it.
struct HeldReceive {
  explicit HeldReceive(const std::string& uri)
      : sub([&] {
          testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", mid.Spec());
          return Subscriber::Open(uri);
        }()) {}
  ~HeldReceive() {
    mid.Release();
    if (reader.joinable()) reader.join();
  }
  // Publishes `v1` as version 1 on `pub` and starts the receive; true once it is held
  // mid-transfer.
  bool Start(const absl::StatusOr<std::unique_ptr<Publisher>>& pub,
             const std::vector<OwnedTensor>& v1) {
    if (!pub.ok() || !(*pub)->Publish(1, Views(v1), {}, kTimeout).ok() || !sub.ok()) return false;
    reader = std::thread([this] { got = (*sub)->WaitForVersion(1, kTimeout); });
    return mid.WaitReached(kTimeout);
  }
  // Lets the receive go on and waits for it to return.
  void Finish() {
    mid.Release();
    reader.join();
  }

  testing::PausePoint mid{"ucx.during_get"};
  absl::StatusOr<std::unique_ptr<Subscriber>> sub;
  absl::StatusOr<std::unique_ptr<Update>> got;
  std::thread reader;
};

TEST_P(UcxTransportTest, PublishWaitsForAHeldSlotNoLongerThanItsDeadline) {
  const auto v1 = MakeVersion(4, 1, 1 << 18);
  auto pub = Publisher::Open(Uri("staging_slots=1&lease=60s"));
  HeldReceive held(Uri());
  ASSERT_TRUE(held.Start(pub, v1)) << held.sub.status();
  auto v2 = MakeVersion(4, 2, 1 << 18);
  const absl::Time start = absl::Now();
  absl::Status s = (*pub)->Publish(2, Views(v2), {}, absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("slot 0 holds version 1, read by subscriber pid"));
  held.Finish();
  ASSERT_TRUE(held.got.ok()) << held.got.status();
  ExpectSameTensors(**held.got, v1);
  // Released: now the slot is free.
  ASSERT_TRUE((*pub)->Publish(2, Views(v2), {}, absl::Seconds(5)).ok());
}

TEST_P(UcxTransportTest, ExpiredLeaseLetsPublishProceedAndFailsTheStalledReader) {
  const auto v1 = MakeVersion(4, 1, 1 << 18);
  auto pub = Publisher::Open(Uri("staging_slots=1&lease=300ms"));
  HeldReceive held(Uri());
  ASSERT_TRUE(held.Start(pub, v1)) << held.sub.status();
  // The reader holds the only slot but stops renewing; after its 300 ms lease the slot is
  // reused.
  auto v2 = MakeVersion(4, 2, 1 << 18);
  const absl::Time start = absl::Now();
  ASSERT_TRUE((*pub)->Publish(2, Views(v2), {}, absl::Seconds(20)).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  held.Finish();
  ASSERT_FALSE(held.got.ok());
  EXPECT_EQ(held.got.status().code(), absl::StatusCode::kUnavailable) << held.got.status();
  EXPECT_THAT(held.got.status().message(), HasSubstr("expired"));
  EXPECT_EQ((*held.sub)->current_version(), std::nullopt);
  // It recovers with the next call.
  auto u = (*held.sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->version(), 2u);
  ExpectSameTensors(**u, v2);
}

TEST_P(UcxTransportTest, PublisherGoneIsUnavailableWithinTheTimeoutAndKeepsTheCurrentVersion) {
  auto pub = Publisher::Open(Uri());
  ASSERT_TRUE(pub.ok());
  auto v1 = MakeVersion(8, 1, 1 << 18);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  auto sub = Subscriber::Open(Uri("connect_timeout=1s"));
  ASSERT_TRUE(sub.ok());
  auto first = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(first.ok()) << first.status();
  // The publisher goes away while the subscriber waits for version 2.
  const absl::Time start = absl::Now();
  absl::Status next;
  {
    testing::InFlight wait([&] { return (*sub)->WaitForVersion(2, absl::Seconds(20)).status(); });
    pub->reset();
    next = wait.Result(kTimeout);
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  ASSERT_EQ(next.code(), absl::StatusCode::kUnavailable) << next;
  EXPECT_THAT(next.message(), HasSubstr("127.0.0.1 port"));
  EXPECT_EQ((*sub)->current_version(), std::optional<uint64_t>(1));
  ExpectSameTensors(**first, v1);
  // With nobody listening, a new wait fails within the connect timeout, naming the address.
  const absl::Time again = absl::Now();
  auto none = (*sub)->WaitForVersion(2, absl::Seconds(20));
  EXPECT_LT(absl::Now() - again, absl::Seconds(10));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
  EXPECT_THAT(none.status().message(), HasSubstr(absl::StrFormat("port %d (IPv4)", port_)));
}

TEST_P(UcxTransportTest, ChannelMismatchIsNotFoundNamingBothChannels) {
  auto pub = Publisher::Open(Uri("", "b"));
  ASSERT_TRUE(pub.ok());
  auto sub = Subscriber::Open(Uri("", "a"));
  ASSERT_TRUE(sub.ok());
  auto u = (*sub)->WaitForVersion(0, kTimeout);
  ASSERT_EQ(u.status().code(), absl::StatusCode::kNotFound) << u.status();
  EXPECT_THAT(u.status().message(), HasSubstr("serves channel \"b\", not \"a\""));
}

TEST_P(UcxTransportTest, BracketedIpv6Works) {
  const int port = FreePort(AF_INET6);
  if (port < 0) GTEST_SKIP() << "no IPv6 loopback here";
  const std::string uri = absl::StrFormat("ucx://[::1]:%d/v6", port);
  auto pub = Publisher::Open(uri);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto t = MakeVersion(1, 1, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(1, Views(t), {}, kTimeout).ok());
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok());
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  ExpectSameTensors(**u, t);
}

TEST_P(UcxTransportTest, PortInUseNamesAddressFamilyAndPort) {
  auto first = Publisher::Open(Uri());
  ASSERT_TRUE(first.ok());
  auto second = Publisher::Open(Uri());
  ASSERT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(second.status().message(),
              HasSubstr(absl::StrFormat("127.0.0.1 port %d (IPv4)", port_)));
  EXPECT_THAT(second.status().message(), HasSubstr("in use"));
}

// Issue 17: the mid-transfer fail point fires for every size. A version of at most one burst of
// gets (16) completed inside ucp_get_nbx over shared memory before the point was checked, and
// one whose last read answered it over the control connection ended the loop first: kill tests
// with small models injected nothing. One tensor of 64 bytes (one get), 16 tensors of 4 KiB
// (16 gets) and a 1 MiB one cut in 64 KiB gets each fail with the point's error, and a
// subscriber without it then receives the version bit-exact (nothing was left held).
TEST_P(UcxTransportTest, MidTransferFailPointFiresForEverySize) {
  auto pub = Publisher::Open(Uri("staging_slots=1"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto tensor = [](const std::string& name, size_t n, uint64_t seed) {
    return OwnedTensor{name, DType::kU8, {static_cast<int64_t>(n)}, testing::RandomBytes(n, seed)};
  };
  std::vector<std::vector<OwnedTensor>> versions(3);
  versions[0].push_back(tensor("one", 64, 1));
  for (int i = 0; i < 16; ++i) versions[1].push_back(tensor(absl::StrCat("t", i), 4096, 10 + i));
  versions[2].push_back(tensor("big", 1 << 20, 99));
  for (uint64_t v = 1; v <= versions.size(); ++v) {
    SCOPED_TRACE(v);
    const std::vector<OwnedTensor>& tensors = versions[v - 1];
    ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok());
    auto victim = [&] {
      testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", "ucx.during_get=error");
      return Subscriber::Open(Uri("get_chunk_size=64KiB"));
    }();
    ASSERT_TRUE(victim.ok()) << victim.status();
    auto failed = (*victim)->WaitForVersion(v, kTimeout);
    ASSERT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
    EXPECT_THAT(failed.status().message(), HasSubstr("failpoint ucx.during_get fired (error)"));
    EXPECT_EQ((*victim)->current_version(), std::nullopt);
    auto sub = Subscriber::Open(Uri("get_chunk_size=64KiB"));
    ASSERT_TRUE(sub.ok());
    auto u = (*sub)->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ExpectSameTensors(**u, tensors);
  }
}

// Issue 14, the contract of each bind mode when a transfer fails midway (the fail point
// ucx.during_get on version 2's receive only, after half its bytes were requested and a get
// finished): the version is never reported applied (Internal naming the fail point, version 1
// stays current); with bind_mode=staged the bound destinations still hold version 1 bit-exact;
// with bind_mode=direct they hold part of version 2 (the error says so) and the previous version
// is re-fetched bit-exact with ReceiveVersion(1) while the channel holds it (staging_slots=2).
// Either way the next receive of version 2 lands bit-exact.
TEST_P(UcxTransportTest, MidTransferFailureKeepsThePreviousVersionInEitherBindMode) {
  for (const std::string mode : {"staged", "direct"}) {
    SCOPED_TRACE(mode);
    port_ = FreePort();
    auto pub = Publisher::Open(Uri("staging_slots=2"));
    ASSERT_TRUE(pub.ok()) << pub.status();
    const std::vector<OwnedTensor> v1 = MakeVersion(7, 1, 2 << 20);
    const std::vector<OwnedTensor> v2 = MakeVersion(7, 2, 2 << 20);
    auto sub = [&] {
      testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", "ucx.during_get=error@2");
      return Subscriber::Open(Uri("get_chunk_size=64KiB&bind_mode=" + mode));
    }();
    ASSERT_TRUE(sub.ok()) << sub.status();
    std::vector<std::vector<std::byte>> dest(v1.size());
    for (size_t i = 0; i < v1.size(); ++i) {
      dest[i].resize(v1[i].bytes.size());
      ASSERT_TRUE((*sub)->Bind(v1[i].name, {v1[i].dtype, v1[i].shape, {}, dest[i].data()}).ok());
    }
    auto holds = [&](const std::vector<OwnedTensor>& v) {
      for (size_t i = 0; i < v.size(); ++i) {
        if (dest[i] != v[i].bytes) return false;
      }
      return true;
    };
    ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
    auto u1 = (*sub)->WaitForVersion(1, kTimeout);
    ASSERT_TRUE(u1.ok()) << u1.status();
    EXPECT_TRUE(holds(v1));
    ASSERT_TRUE((*pub)->Publish(2, Views(v2), {}, kTimeout).ok());
    auto failed = (*sub)->WaitForVersion(2, kTimeout);
    ASSERT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
    EXPECT_THAT(failed.status().message(), HasSubstr("failpoint ucx.during_get fired (error)"));
    EXPECT_THAT(failed.status().message(), HasSubstr("version 1 stays current"));
    EXPECT_EQ((*sub)->current_version(), 1u);
    if (mode == "staged") {
      EXPECT_TRUE(holds(v1)) << "a failed staged receive touched a bound destination";
      EXPECT_THAT(std::string(failed.status().message()),
                  ::testing::Not(HasSubstr("partial data")));
    } else {
      EXPECT_FALSE(holds(v1)) << "direct: the gets that finished wrote into the destinations";
      EXPECT_THAT(failed.status().message(),
                  HasSubstr("bind_mode=direct: bound destinations may hold partial data"));
      auto again = (*sub)->ReceiveVersion(1, kTimeout);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_TRUE(holds(v1)) << "re-fetching the previous version restores it";
      EXPECT_EQ((*sub)->current_version(), 1u);
    }
    auto u2 = (*sub)->WaitForVersion(2, kTimeout);
    ASSERT_TRUE(u2.ok()) << u2.status();
    EXPECT_TRUE(holds(v2));
    EXPECT_EQ((*sub)->current_version(), 2u);
  }
}

// Issue 14, pipelining: a Publish that fails after its version was announced (the fail point
// ucx.before_seal on version 2: every byte staged and checksummed, not sealed) fails the
// transfer of a subscriber that was granted it with Aborted: nothing of it is handed over,
// version 1 stays current and its bound destinations (bind_mode=staged) keep it bit-exact; the
// next version is received bit-exact. The subscriber is granted version 2 while its staging is
// held after the second chunk (ucx.after_chunk; ucx.before_grant says when the grant is on its
// way); it fails whether the abort reaches it while it pulls, waits for the seal, or reads the
// version's descriptor.
TEST_P(UcxTransportTest, AnnouncedVersionWhosePublishFailsIsAbortedNeverHandedOver) {
  const std::string q = "ready_chunk=64KiB&copy_threads=1&get_chunk_size=64KiB&lease=60s";
  const std::vector<OwnedTensor> v1 = MakeVersion(17, 1, 1 << 20);
  const std::vector<OwnedTensor> v2 = MakeVersion(17, 2, 1 << 20);
  const std::vector<OwnedTensor> v3 = MakeVersion(17, 3, 1 << 20);
  uint64_t chunks = 0;  // of one version: every tensor starts on a 64-byte boundary
  {
    uint64_t at = 0;
    for (const OwnedTensor& t : v1) at += (t.bytes.size() + 63) / 64 * 64;
    chunks = (at + (64 << 10) - 1) / (64 << 10);
  }
  testing::PausePoint staging("ucx.after_chunk", static_cast<int>(chunks) + 2);
  testing::PausePoint granting("ucx.before_grant", 2);
  auto pub = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", absl::StrCat(staging.Spec(), ",", granting.Spec(),
                                                               ",ucx.before_seal=error@2"));
    return Publisher::Open(Uri(q));
  }();
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(Uri(q));
  ASSERT_TRUE(sub.ok()) << sub.status();
  std::vector<std::vector<std::byte>> dest(v1.size());
  for (size_t i = 0; i < v1.size(); ++i) {
    dest[i].resize(v1[i].bytes.size());
    ASSERT_TRUE((*sub)->Bind(v1[i].name, {v1[i].dtype, v1[i].shape, {}, dest[i].data()}).ok());
  }
  auto holds = [&](const std::vector<OwnedTensor>& v) {
    for (size_t i = 0; i < v.size(); ++i) {
      if (dest[i] != v[i].bytes) return false;
    }
    return true;
  };
  // Version 1: the fail points' first passes, which do nothing.
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  auto u1 = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u1.ok()) << u1.status();
  EXPECT_TRUE(holds(v1));
  testing::InFlight publish([&] { return (*pub)->Publish(2, Views(v2), {}, kTimeout); });
  ASSERT_TRUE(staging.WaitReached(kTimeout)) << "version 2 was not announced and staged in part";
  testing::InFlight receive([&] { return (*sub)->WaitForVersion(2, kTimeout).status(); });
  ASSERT_TRUE(granting.WaitReached(kTimeout)) << "the subscriber was not granted version 2";
  granting.Release();
  staging.Release();
  const absl::Status published = publish.Result(kTimeout);
  EXPECT_THAT(std::string(published.message()),
              HasSubstr("failpoint ucx.before_seal fired (error)"));
  const absl::Status received = receive.Result(kTimeout);
  EXPECT_EQ(received.code(), absl::StatusCode::kAborted) << received;
  EXPECT_THAT(std::string(received.message()), HasSubstr("nothing of it may be used"));
  EXPECT_EQ((*sub)->current_version(), 1u);
  EXPECT_TRUE(holds(v1)) << "an aborted staged receive touched a bound destination";
  ASSERT_TRUE((*pub)->Publish(3, Views(v3), {}, kTimeout).ok());
  auto u3 = (*sub)->WaitForVersion(3, kTimeout);
  ASSERT_TRUE(u3.ok()) << u3.status();
  EXPECT_TRUE(holds(v3));
}

// Issue 14, zero-copy publish (publish_mode=zero_copy): the publisher serves the caller's tensors
// where they are. Two connected subscribers wait for version 1; Publish returns once both have
// pulled it, and each holds it bit-exact. The bytes come from the caller's memory while Publish
// runs: a third subscriber held halfway through its transfer (ucx.during_get) sees a byte the
// test changed in the caller's memory meanwhile, and refuses the version (DataLoss). Once Publish
// returned the version is not served any more: a new subscriber finds nothing.
TEST_P(UcxTransportTest, ZeroCopyPublishServesTheCallersTensorsWhileItRuns) {
  const std::string q = "publish_mode=zero_copy&lease=60s&get_chunk_size=64KiB";
  std::vector<OwnedTensor> v1 = MakeVersion(23, 1, 2 << 20);
  auto pub = Publisher::Open(Uri(q));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto a = Subscriber::Open(Uri(q));
  auto b = Subscriber::Open(Uri(q));
  ASSERT_TRUE(a.ok() && b.ok());
  // Connected before the version is announced: Publish waits for them.
  for (auto* s : {&*a, &*b}) {
    auto none = (*s)->Poll(1, kTimeout);
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_EQ(*none, nullptr);
  }
  std::vector<std::unique_ptr<Update>> got(2);
  testing::InFlight wa([&] {
    auto u = (*a)->WaitForVersion(1, kTimeout);
    if (u.ok()) got[0] = *std::move(u);
    return u.status();
  });
  testing::InFlight wb([&] {
    auto u = (*b)->WaitForVersion(1, kTimeout);
    if (u.ok()) got[1] = *std::move(u);
    return u.status();
  });
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(wa.Result(kTimeout).ok());
  ASSERT_TRUE(wb.Result(kTimeout).ok());
  for (const auto& u : got) ExpectSameTensors(*u, v1);

  // Version 2: a subscriber held halfway through, while the test changes the caller's last byte.
  std::vector<OwnedTensor> v2 = MakeVersion(23, 2, 2 << 20);
  testing::PausePoint halfway("ucx.during_get");
  auto c = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", halfway.Spec());
    return Subscriber::Open(Uri(q));
  }();
  ASSERT_TRUE(c.ok()) << c.status();
  auto none = (*c)->Poll(2, kTimeout);
  ASSERT_TRUE(none.ok()) << none.status();
  testing::InFlight wc([&] { return (*c)->WaitForVersion(2, kTimeout).status(); });
  testing::InFlight wa2([&] { return (*a)->WaitForVersion(2, kTimeout).status(); });
  testing::InFlight wb2([&] { return (*b)->WaitForVersion(2, kTimeout).status(); });
  testing::InFlight publish([&] { return (*pub)->Publish(2, Views(v2), {}, kTimeout); });
  ASSERT_TRUE(halfway.WaitReached(kTimeout));
  const absl::Status ra = wa2.Result(kTimeout), rb = wb2.Result(kTimeout);
  EXPECT_TRUE(ra.ok()) << ra;
  EXPECT_TRUE(rb.ok()) << rb;
  EXPECT_FALSE(publish.Returned()) << "Publish returned while a subscriber was pulling";
#if defined(__SANITIZE_THREAD__)
  // The core's checksums of version 2 ended before `a` and `b` verified it, but what orders the
  // two is UCX's shared memory, which ThreadSanitizer does not see: it would report the change
  // below (a deliberate breach of the zero-copy contract) as a race. It stops here.
  halfway.Release();
  EXPECT_TRUE(wc.Result(kTimeout).ok());
  ASSERT_TRUE(publish.Result(kTimeout).ok());
  GTEST_SKIP() << "the caller's change during a zero-copy Publish is not checked under TSan";
#endif
  // The large tensor's last byte: its own mapping, above the small ones on the heap, so in the
  // second half of the transfer (the slot's bytes are the caller's memory in address order).
  v2.front().bytes.back() ^= std::byte{0x5a};
  halfway.Release();
  const absl::Status changed = wc.Result(kTimeout);
  EXPECT_EQ(changed.code(), absl::StatusCode::kDataLoss) << changed;
  EXPECT_THAT(std::string(changed.message()), HasSubstr(v2.front().name));
  ASSERT_TRUE(publish.Result(kTimeout).ok());
  EXPECT_EQ((*c)->current_version(), std::nullopt);

  auto late = Subscriber::Open(Uri(q));
  ASSERT_TRUE(late.ok()) << late.status();
  auto nothing = (*late)->Poll(1, kTimeout);
  ASSERT_TRUE(nothing.ok()) << nothing.status();
  EXPECT_EQ(*nothing, nullptr) << "a zero-copy version was served after its Publish returned";
}

// Memory from AllocateHost freed in a child forked after the allocation releases nothing of the
// parent's (UCX's registration and mapping, the publisher's record of it): the child still reads
// the memory after freeing it (unmapped, the read would kill it), and the parent publishes from
// it afterwards, bit-exact. The child ends itself by SIGALRM should the free hang (a lock held
// by another thread of the parent at fork), so waitpid returns either way.
TEST_P(UcxTransportTest, HostMemoryFreedInAForkedChildReleasesNothingOfTheParents) {
  const std::string q = "publish_mode=zero_copy&lease=60s";
  auto pub = Publisher::Open(Uri(q));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto mem = (*pub)->AllocateHost(1 << 20);
  ASSERT_TRUE(mem.ok()) << mem.status();
  OwnedTensor w{"w", DType::kU8, {1 << 20}, weightbus::testing::RandomBytes(1 << 20, 5)};
  std::byte* data = (*mem)->data();
  std::memcpy(data, w.bytes.data(), w.bytes.size());

  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    alarm(120);
    mem->reset();
    const bool intact = std::memcmp(data, w.bytes.data(), w.bytes.size()) == 0;
    _exit(intact ? 0 : 3);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus)) << "the child was killed by signal " << WTERMSIG(wstatus);
  EXPECT_EQ(WEXITSTATUS(wstatus), 0);

  auto sub = Subscriber::Open(Uri(q));
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_TRUE((*sub)->Poll(1, kTimeout).ok());  // connected: the zero-copy Publish waits for it
  std::unique_ptr<Update> got;
  testing::InFlight receive([&] {
    auto u = (*sub)->WaitForVersion(1, kTimeout);
    if (u.ok()) got = *std::move(u);
    return u.status();
  });
  const TensorView view{"w", DType::kU8, {1 << 20}, {}, data};
  ASSERT_TRUE((*pub)->Publish(1, {view}, {}, kTimeout).ok());
  ASSERT_TRUE(receive.Result(kTimeout).ok());
  ExpectSameTensors(*got, {w});
}

// Zero-copy publish waits for a connected subscriber that does not ask for the version at most
// one lease, and for one that stops pulling at most until its lease ends, which then fails its
// transfer (ABORTED, Aborted). The other subscriber is not held back.
TEST_P(UcxTransportTest, ZeroCopyPublishHoldsTheCallerAtMostALeasePerSubscriber) {
  // A lease long enough for `active` to renew through a loaded machine under ThreadSanitizer
  // (300 ms expired there mid-pull, failing its transfer), short enough to wait out twice.
  const std::string q = "publish_mode=zero_copy&lease=2s&get_chunk_size=64KiB";
  const std::vector<OwnedTensor> v1 = MakeVersion(29, 1, 1 << 20);
  auto pub = Publisher::Open(Uri(q));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto idle = Subscriber::Open(Uri(q));
  auto active = Subscriber::Open(Uri(q));
  ASSERT_TRUE(idle.ok() && active.ok());
  for (auto* s : {&*idle, &*active}) ASSERT_TRUE((*s)->Poll(1, kTimeout).ok());
  testing::InFlight receive([&] { return (*active)->WaitForVersion(1, kTimeout).status(); });
  // `idle` never asks: Publish returns once `active` has the version and a lease has passed.
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(receive.Result(kTimeout).ok());
  EXPECT_EQ((*active)->current_version(), 1u);

  testing::PausePoint stalled("ucx.during_get");
  auto slow = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", stalled.Spec());
    return Subscriber::Open(Uri(q));
  }();
  ASSERT_TRUE(slow.ok()) << slow.status();
  ASSERT_TRUE((*slow)->Poll(2, kTimeout).ok());
  const std::vector<OwnedTensor> v2 = MakeVersion(29, 2, 1 << 20);
  testing::InFlight held([&] { return (*slow)->WaitForVersion(2, kTimeout).status(); });
  testing::InFlight other([&] { return (*active)->WaitForVersion(2, kTimeout).status(); });
  testing::InFlight publish([&] { return (*pub)->Publish(2, Views(v2), {}, kTimeout); });
  ASSERT_TRUE(stalled.WaitReached(kTimeout));
  // The stalled subscriber renews nothing while held: its lease ends and Publish returns.
  ASSERT_TRUE(publish.Result(kTimeout).ok());
  ASSERT_TRUE(other.Result(kTimeout).ok());
  stalled.Release();
  const absl::Status failed = held.Result(kTimeout);
  EXPECT_TRUE(absl::IsAborted(failed) || absl::IsUnavailable(failed)) << failed;
  EXPECT_EQ((*slow)->current_version(), std::nullopt);
  EXPECT_EQ((*active)->current_version(), 2u);
}

// Item 4 of issue 10: a wait whose deadline comes before connect_timeout ends while no
// publisher is reachable yet is DeadlineExceeded (naming channel, version and connect error),
// so that callers waiting in slices keep waiting; a publisher that comes up is then found.
TEST_P(UcxTransportTest, WaitInSlicesBeforeThePublisherStartsIsDeadlineExceededUntilItIsUp) {
  auto sub = Subscriber::Open(Uri("connect_timeout=60s"));
  ASSERT_TRUE(sub.ok());
  std::unique_ptr<Publisher> pub;
  std::vector<OwnedTensor> v1;
  for (int slice = 0;; ++slice) {
    ASSERT_LT(slice, 1000);
    auto u = (*sub)->WaitForVersion(1, absl::Milliseconds(100));
    if (u.ok()) {
      ASSERT_NE(pub, nullptr) << "a version before any publisher";
      EXPECT_EQ((*u)->version(), 1u);
      ExpectSameTensors(**u, v1);
      break;
    }
    ASSERT_EQ(u.status().code(), absl::StatusCode::kDeadlineExceeded) << u.status();
    if (pub == nullptr) {
      EXPECT_THAT(u.status().message(), HasSubstr(Uri("connect_timeout=60s").substr(0, 6)));
      EXPECT_THAT(u.status().message(), HasSubstr("/policy"));
      EXPECT_THAT(u.status().message(), HasSubstr("version >= 1"));
      EXPECT_THAT(u.status().message(), HasSubstr("refused"));
    }
    if (slice == 3) {  // the publisher comes up after three slices ran out
      auto p = Publisher::Open(Uri());
      ASSERT_TRUE(p.ok()) << p.status();
      pub = *std::move(p);
      v1 = MakeVersion(14, 1, 1 << 14);
      ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
    }
  }
  // A poll with nobody listening finds nothing (it is not an error to poll early).
  pub.reset();
  auto early = Subscriber::Open(Uri());
  ASSERT_TRUE(early.ok());
  auto none = (*early)->Poll(0, kTimeout);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxTransportTest, ::testing::Values(kShm, kTcp, kDefault),
                         [](const ::testing::TestParamInfo<Tls>& info) { return info.param.name; });

// Rendezvous address errors: these fail before any UCX transfer, so one transport suffices.
class UcxAddressTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_.emplace(kTcp.env);
    const std::string why = UcxUnavailableReason();
    if (!why.empty()) GTEST_SKIP() << "UCX cannot create a worker here: " << why;
  }
  std::optional<testing::ScopedEnvs> env_;
};

TEST_F(UcxAddressTest, WildcardAddressIsRefusedAsAConnectTarget) {
  for (const char* uri : {"ucx://0.0.0.0:7000/p", "ucx://[::]:7000/p"}) {
    auto sub = Subscriber::Open(uri);
    ASSERT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument) << uri;
    EXPECT_THAT(sub.status().message(), HasSubstr("wildcard")) << uri;
  }
  // A publisher may listen on every interface.
  const int port = FreePort();
  auto pub = Publisher::Open(absl::StrFormat("ucx://0.0.0.0:%d/p", port));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto t = MakeVersion(1, 1, 1 << 12);
  ASSERT_TRUE((*pub)->Publish(1, Views(t), {}, kTimeout).ok());
  auto sub = Subscriber::Open(absl::StrFormat("ucx://localhost:%d/p", port));
  ASSERT_TRUE(sub.ok());
  auto u = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
}

TEST_F(UcxAddressTest, RefusedPortFailsWithinTheConnectTimeoutNamingIt) {
  const int port = FreePort();
  auto sub = Subscriber::Open(absl::StrFormat("ucx://127.0.0.1:%d/p?connect_timeout=500ms", port));
  ASSERT_TRUE(sub.ok());
  const absl::Time start = absl::Now();
  auto u = (*sub)->WaitForVersion(1, absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_EQ(u.status().code(), absl::StatusCode::kUnavailable) << u.status();
  EXPECT_THAT(u.status().message(), HasSubstr(absl::StrFormat("127.0.0.1 port %d (IPv4)", port)));
  EXPECT_THAT(u.status().message(), HasSubstr("refused"));
}

TEST_F(UcxAddressTest, UnreachableHostFailsWithinTheConnectTimeoutNamingIt) {
  // 192.0.2.1 is TEST-NET-1 (RFC 5737): never routed, so the connect times out or is refused by
  // the network stack at once.
  auto sub = Subscriber::Open("ucx://192.0.2.1:7/p?connect_timeout=700ms");
  ASSERT_TRUE(sub.ok());
  const absl::Time start = absl::Now();
  auto u = (*sub)->WaitForVersion(1, absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));
  ASSERT_EQ(u.status().code(), absl::StatusCode::kUnavailable) << u.status();
  EXPECT_THAT(u.status().message(), HasSubstr("192.0.2.1 port 7 (IPv4)"));
}

TEST_F(UcxAddressTest, MalformedUrisAndSettingsAreInvalidArguments) {
  for (const char* uri :
       {"ucx://127.0.0.1/p", "ucx://127.0.0.1:0/p", "ucx://127.0.0.1:7000", "ucx://127.0.0.1:7000/",
        "ucx:///p", "ucx://[]:7000/p", "ucx://127.0.0.1:7000/p?staging_slots=0",
        "ucx://127.0.0.1:7000/p?gets_in_flight=0", "ucx://127.0.0.1:7000/p?get_chunk_size=1",
        "ucx://127.0.0.1:7000/p?max_region=4KiB", "ucx://127.0.0.1:7000/p?retention=2"}) {
    auto sub = Subscriber::Open(uri);
    EXPECT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument) << uri << sub.status();
  }
}

}  // namespace
}  // namespace weightbus

namespace weightbus::internal {
namespace {

using ::weightbus::testing::OpenTransportPublisher;
using ::weightbus::testing::OpenTransportSubscriber;

using ::testing::HasSubstr;

// Publishes `version` as U8 tensors "t0", "t1", ... of `sizes` bytes, tensor i's bytes random
// from seed `seed + i`; returns the bytes.
std::vector<std::vector<std::byte>> PublishRandomTensors(TransportPublisher& pub, uint64_t version,
                                                         const std::vector<uint64_t>& sizes,
                                                         uint64_t seed) {
  Manifest m;
  m.version = version;
  std::vector<std::vector<std::byte>> bytes;
  for (uint64_t size : sizes) {
    bytes.push_back(weightbus::testing::RandomBytes(size, seed + bytes.size()));
    m.tensors.push_back(TensorInfo{absl::StrFormat("t%d", bytes.size() - 1),
                                   DType::kU8,
                                   {static_cast<int64_t>(size)},
                                   std::nullopt,
                                   size,
                                   weightbus::testing::Xxh3(bytes.back().data(), size)});
  }
  std::vector<const std::byte*> sources;
  for (const auto& b : bytes) sources.push_back(b.data());
  SealedPublishJob job(m, sources);
  const absl::Status published = pub.Publish(job, absl::Now() + absl::Seconds(30));
  EXPECT_TRUE(published.ok()) << published;
  return bytes;
}

class UcxInternalTest : public ::testing::TestWithParam<weightbus::testing::Tls> {
 protected:
  void SetUp() override {
    env_.emplace(GetParam().env);
    const std::string why = weightbus::UcxUnavailableReason();
    if (!why.empty()) GTEST_SKIP() << "UCX cannot create a worker here: " << why;
  }
  std::optional<weightbus::testing::ScopedEnvs> env_;
};

// The back channel a delta layer's subscribers report their decoding through (issue 16): REPORT
// messages reach TakeReports, the newest per subscriber, once each; too long a report is
// refused before it is sent, and a subscriber without a session reports nothing (no connection
// is made for a report).
TEST_P(UcxInternalTest, ReportsReachThePublisherNewestPerSubscriber) {
  const std::string uri_text = absl::StrFormat("ucx://127.0.0.1:%d/reports", weightbus::FreePort());
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::vector<std::unique_ptr<TransportSubscriber>> subs;
  for (int i = 0; i < 2; ++i) {
    auto sub = OpenTransportSubscriber(uri_text);
    ASSERT_TRUE(sub.ok()) << sub.status();
    EXPECT_TRUE(absl::IsUnavailable((*sub)->Report(1, "before any session"))) << i;
    subs.push_back(*std::move(sub));
  }
  PublishRandomTensors(**pub, 1, {4096}, 1);
  for (auto& sub : subs) {
    ASSERT_TRUE(sub->WaitForVersion(1, absl::Now() + absl::Seconds(10)).ok());
  }
  ASSERT_TRUE(subs[0]->Report(1, "first").ok());
  ASSERT_TRUE(subs[0]->Report(2, "second, replaces the first").ok());
  ASSERT_TRUE(subs[1]->Report(1, std::string(kMaxReportText, 'x')).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(subs[1]->Report(1, std::string(kMaxReportText + 1, 'x'))));
  // The publisher handles one connection's frames in order: once LIST is answered, the reports
  // sent before it have been taken in.
  for (auto& sub : subs) ASSERT_TRUE(sub->ListVersions().ok());
  std::vector<SubscriberReport> reports = (*pub)->TakeReports();
  ASSERT_EQ(reports.size(), 2u);
  std::sort(reports.begin(), reports.end(),
            [](const auto& a, const auto& b) { return a.text.size() < b.text.size(); });
  EXPECT_EQ(reports[0].version, 2u);
  EXPECT_EQ(reports[0].text, "second, replaces the first");
  EXPECT_EQ(reports[1].version, 1u);
  EXPECT_EQ(reports[1].text.size(), kMaxReportText);
  EXPECT_NE(reports[0].id, reports[1].id);
  EXPECT_TRUE((*pub)->TakeReports().empty());  // taken
}

// The capabilities a delta layer stacks on: a version floor kept beyond staging_slots, exact
// versions, and the list of versions held.
TEST_P(UcxInternalTest, KeepVersionsFromOpenVersionAndListVersions) {
  const int port = weightbus::FreePort();
  const std::string uri_text =
      absl::StrFormat("ucx://127.0.0.1:%d/delta?staging_slots=2&lease=60s", port);
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto bytes_of = [](uint64_t v) { return testing::RandomBytes(100000, v); };
  std::vector<std::vector<std::byte>> kept(10);
  auto publish = [&](uint64_t v) {
    kept[v] = bytes_of(v);
    Manifest m;
    m.version = v;
    m.tensors.push_back(TensorInfo{
        "t", DType::kU8, {100000}, std::nullopt, 100000, testing::Xxh3(kept[v].data(), 100000)});
    SealedPublishJob job(m, {kept[v].data()});
    ASSERT_TRUE((*pub)->Publish(job, absl::Now() + absl::Seconds(10)).ok()) << v;
  };
  auto listed = [&] {
    auto l = (*sub)->ListVersions();
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? *l : std::vector<uint64_t>{};
  };
  publish(1);
  (*pub)->KeepVersionsFrom(2);
  for (uint64_t v = 2; v <= 5; ++v) publish(v);
  // 2..5 are kept beyond the two staging slots (1 still holds one of the two).
  EXPECT_EQ(listed(), (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  struct Sink : LandingSink {
    std::vector<size_t> landed;
    void Landed(size_t i) override { landed.push_back(i); }
  };
  for (uint64_t v : {2, 4}) {
    auto opened = (*sub)->OpenVersion(v, absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_EQ((*opened)->manifest().version, v);
    std::vector<std::byte> out(100000);
    std::byte* target = out.data();
    Sink sink;
    ASSERT_TRUE((*opened)->Fetch({&target, 1}, sink, absl::Now() + absl::Seconds(10)).ok());
    EXPECT_EQ(sink.landed, std::vector<size_t>{0});
    EXPECT_EQ(out, kept[v]);
  }
  // Moving the floor returns the older slots to rotation (two of them, staging_slots) and frees
  // the surplus; 5 and every later version are kept.
  (*pub)->KeepVersionsFrom(5);
  publish(6);
  EXPECT_EQ(listed(), (std::vector<uint64_t>{3, 4, 5, 6}));
  publish(7);
  EXPECT_EQ(listed(), (std::vector<uint64_t>{4, 5, 6, 7}));
  auto gone = (*sub)->OpenVersion(2, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  EXPECT_THAT(gone.status().message(), HasSubstr("holds: 4, 5, 6, 7"));
  // An unfetched grant is released when dropped: with the floor gone, both slots are usable.
  auto dropped = (*sub)->OpenVersion(7, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(dropped.ok());
  dropped->reset();
  (*pub)->KeepVersionsFrom(100);
  // The release travels over the control connection, so the publisher may see it only after a
  // publish or two; once it has, both slots rotate and only the newest two versions remain.
  uint64_t next = 8;
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        publish(next++);
        return listed() == std::vector<uint64_t>{next - 2, next - 1};
      },
      absl::Seconds(10)))
      << "the dropped grant of version 7 was never released";
}

// Bytes that do not match the manifest's checksum are caught by the chunk-by-chunk verification
// of large tensors as well as by whole-tensor checks of small ones; nothing is handed over.
TEST_P(UcxInternalTest, CorruptedBytesAreDataLossNamingTheTensor) {
  const int port = weightbus::FreePort();
  const std::string uri_text =
      absl::StrFormat("ucx://127.0.0.1:%d/corrupt?get_chunk_size=64KiB&max_region=1MiB", port);
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = weightbus::Subscriber::Open(uri_text);
  ASSERT_TRUE(sub.ok());
  for (const uint64_t size : {uint64_t{3 << 20}, uint64_t{1000}}) {
    SCOPED_TRACE(size);
    const uint64_t version = size;  // increasing
    std::vector<std::byte> bytes = testing::RandomBytes(size, 5);
    Manifest m;
    m.version = version;
    const uint64_t right = testing::Xxh3(bytes.data(), size);
    m.tensors.push_back(
        TensorInfo{"big", DType::kU8, {static_cast<int64_t>(size)}, std::nullopt, size, right ^ 1});
    SealedPublishJob job(m, {bytes.data()});
    ASSERT_TRUE((*pub)->Publish(job, absl::Now() + absl::Seconds(10)).ok());
    auto u = (*sub)->WaitForVersion(0, absl::Seconds(30));
    ASSERT_EQ(u.status().code(), absl::StatusCode::kDataLoss) << u.status();
    EXPECT_THAT(u.status().message(), HasSubstr("tensor \"big\""));
    EXPECT_THAT(u.status().message(), HasSubstr(absl::StrFormat("%016x", right)));
  }
  EXPECT_EQ((*sub)->current_version(), std::nullopt);
}

// TransportSubscriber/TransportPublisher::Cancel (lib/core/transport.h): a wait in flight, a
// Publish waiting for a staging slot and a WaitForReceivers return Cancelled long before their
// deadlines, and so does every later call. (Cancel may land before or after the call starts.)
TEST_P(UcxInternalTest, CancelEndsWaitsInFlightAndEveryLaterCall) {
  const int port = weightbus::FreePort();
  const std::string uri_text =
      absl::StrFormat("ucx://127.0.0.1:%d/cancel?staging_slots=1&lease=60s", port);
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(sub.ok()) << sub.status();
  std::vector<std::byte> bytes = testing::RandomBytes(4096, 1);
  Manifest m;
  m.version = 1;
  m.tensors.push_back(
      TensorInfo{"t", DType::kU8, {4096}, std::nullopt, 4096, testing::Xxh3(bytes.data(), 4096)});
  SealedPublishJob job1(m, {bytes.data()});
  ASSERT_TRUE((*pub)->Publish(job1, absl::Now() + absl::Seconds(10)).ok());

  // The subscriber waits for a version nobody publishes.
  absl::StatusOr<std::unique_ptr<IncomingVersion>> waited;
  std::thread waiter([&] { waited = (*sub)->WaitForVersion(2, absl::Now() + absl::Seconds(120)); });
  (*sub)->Cancel();
  waiter.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kCancelled) << waited.status();
  EXPECT_EQ((*sub)->WaitForVersion(1, absl::Now() + absl::Seconds(5)).status().code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ((*sub)->ListVersions().status().code(), absl::StatusCode::kCancelled);

  // A subscriber still trying to reach a publisher that is not up (connect_timeout 120 s).
  auto lonely = OpenTransportSubscriber(
      absl::StrFormat("ucx://127.0.0.1:%d/cancel?connect_timeout=120s", weightbus::FreePort()));
  ASSERT_TRUE(lonely.ok()) << lonely.status();
  absl::StatusOr<std::unique_ptr<IncomingVersion>> connecting;
  std::thread dialer(
      [&] { connecting = (*lonely)->WaitForVersion(1, absl::Now() + absl::Seconds(120)); });
  (*lonely)->Cancel();
  dialer.join();
  EXPECT_EQ(connecting.status().code(), absl::StatusCode::kCancelled) << connecting.status();

  // A grant held by a second subscriber pins the only slot: Publish waits for it.
  auto holder = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(holder.ok());
  auto held = (*holder)->WaitForVersion(1, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(held.ok()) << held.status();
  m.version = 2;
  SealedPublishJob job2(m, {bytes.data()});
  absl::Status published;
  absl::StatusOr<int> receivers;
  std::thread publisher([&] {
    published = (*pub)->Publish(job2, absl::Now() + absl::Seconds(120));
    receivers = (*pub)->WaitForReceivers(1, 5, absl::Now() + absl::Seconds(120));
  });
  (*pub)->Cancel();
  publisher.join();
  EXPECT_EQ(published.code(), absl::StatusCode::kCancelled) << published;
  EXPECT_EQ(receivers.status().code(), absl::StatusCode::kCancelled) << receivers.status();
  held->reset();
  EXPECT_EQ((*pub)->Publish(job2, absl::Now() + absl::Seconds(5)).code(),
            absl::StatusCode::kCancelled);
}

// Bytes over the control connection (UCX_TLS=tcp): the publisher's progress thread never goes to
// sleep in poll() while a subscriber's READs are queued and its connection has nothing left to
// send. Before the fix it did whenever one pass wrote the whole queued output (up to 4 MiB) into
// the socket: no POLLOUT was armed for the READs left behind, and the transfer stalled until the
// 1 s poll timeout (256 MiB versions took 1.09 s instead of 0.17 s in weightbus-ucx-bench).
// Several versions of tensors large and small (many READs of 4 MiB and of a few KiB), each
// received bit-exact.
TEST_P(UcxInternalTest, ProgressThreadNeverSleepsWithReadsReady) {
  const int port = weightbus::FreePort();
  const std::string uri_text = absl::StrFormat("ucx://127.0.0.1:%d/reads?lease=60s", port);
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(sub.ok()) << sub.status();
  // 40 tensors, 71 MiB: 9 MiB, 3 KiB, 700 KiB, 4 MiB + 1, ... (chunks of 4 MiB and tails).
  const std::vector<uint64_t> sizes = {9 << 20, 3 << 10, 700 << 10, (4 << 20) + 1, 123,
                                       2 << 20, 5000,    1 << 20,   64 << 10,      (1 << 20) - 7};
  constexpr int kRepeats = 4;
  constexpr uint64_t kVersions = 4;
  for (uint64_t v = 1; v <= kVersions; ++v) {
    SCOPED_TRACE(v);
    std::vector<uint64_t> repeated;
    for (int r = 0; r < kRepeats; ++r) repeated.insert(repeated.end(), sizes.begin(), sizes.end());
    const std::vector<std::vector<std::byte>> bytes =
        PublishRandomTensors(**pub, v, repeated, v * 1000);
    auto incoming = (*sub)->WaitForVersion(v, absl::Now() + kTimeout);
    ASSERT_TRUE(incoming.ok()) << incoming.status();
    ASSERT_EQ((*incoming)->manifest().version, v);
    std::vector<std::vector<std::byte>> out;
    std::vector<std::byte*> targets;
    for (const auto& b : bytes) out.emplace_back(b.size());
    for (auto& o : out) targets.push_back(o.data());
    struct Sink : LandingSink {
      size_t landed = 0;
      void Landed(size_t) override { ++landed; }
    } sink;
    absl::Status fetched = (*incoming)->Fetch(targets, sink, absl::Now() + kTimeout);
    ASSERT_TRUE(fetched.ok()) << fetched;
    EXPECT_EQ(sink.landed, bytes.size());
    for (size_t i = 0; i < bytes.size(); ++i) EXPECT_TRUE(out[i] == bytes[i]) << "tensor " << i;
    incoming->reset();
  }
  const std::optional<ucx::UcxPublisherCounters> counters = ucx::PublisherCounters(**pub);
  ASSERT_TRUE(counters.has_value());
  if (GetParam().name == weightbus::testing::kTcp.name) {
    EXPECT_GE(counters->reads_served, kVersions * kRepeats * sizes.size());
  } else {
    EXPECT_EQ(counters->reads_served, 0u) << "shared memory moves the bytes with UCP gets";
  }
  EXPECT_EQ(counters->sleeps_with_reads_ready, 0u);
}

// Issue 14, control bytes: a GRANT points at the version descriptor in the publisher's registered
// memory, which each subscriber reads with a get, so the control connection carries the same few
// frames per version and subscriber whatever the tensor count (8 tensors or 4,000: the same
// bytes), and the publisher's control bytes grow with subscribers only by that much each.
// Before (protocol 3) every GRANT carried the whole manifest and every tensor's offset (3.05 MB
// per version for 20,020 tensors, BENCHMARKS.md). Shared memory only: over tcp the bytes
// themselves travel on the control connection.
TEST_P(UcxInternalTest, ControlBytesPerVersionDoNotGrowWithTensorsOrSubscribers) {
  if (GetParam().name == weightbus::testing::kTcp.name) {
    GTEST_SKIP() << "bytes over the control connection";
  }
  const int port = weightbus::FreePort();
  const std::string uri_text = absl::StrFormat("ucx://127.0.0.1:%d/ctl?lease=60s", port);
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::vector<std::unique_ptr<TransportSubscriber>> subs;
  for (int i = 0; i < 3; ++i) {
    auto sub = OpenTransportSubscriber(uri_text);
    ASSERT_TRUE(sub.ok()) << sub.status();
    subs.push_back(*std::move(sub));
  }
  struct Sink : LandingSink {
    void Landed(size_t) override {}
  } sink;
  uint64_t version = 0;
  // Publisher control bytes for one version received by the first `n` subscribers; the
  // subscribers' own control bytes for it, and descriptor bytes, summed.
  auto one_version = [&](size_t tensors, size_t n, uint64_t* sub_control, uint64_t* descriptor) {
    ++version;
    const std::vector<std::vector<std::byte>> bytes =
        PublishRandomTensors(**pub, version, std::vector<uint64_t>(tensors, 256), version << 20);
    const uint64_t before = ucx::PublisherCounters(**pub)->control_bytes_sent;
    *sub_control = *descriptor = 0;
    for (size_t k = 0; k < n; ++k) {
      const ucx::UcxSubscriberCounters c0 = *ucx::SubscriberCounters(*subs[k]);
      auto incoming = subs[k]->WaitForVersion(version, absl::Now() + kTimeout);
      EXPECT_TRUE(incoming.ok()) << incoming.status();
      if (!incoming.ok()) return uint64_t{0};
      std::vector<std::vector<std::byte>> out(tensors, std::vector<std::byte>(256));
      std::vector<std::byte*> targets;
      for (auto& o : out) targets.push_back(o.data());
      EXPECT_TRUE((*incoming)->Fetch(targets, sink, absl::Now() + kTimeout).ok());
      EXPECT_EQ(out, bytes);
      incoming->reset();
      const ucx::UcxSubscriberCounters c1 = *ucx::SubscriberCounters(*subs[k]);
      *sub_control += (c1.control_bytes_sent + c1.control_bytes_received) -
                      (c0.control_bytes_sent + c0.control_bytes_received);
      *descriptor += c1.descriptor_bytes - c0.descriptor_bytes;
    }
    // The last RELEASE is on its way: wait for the publisher to have answered nothing more.
    return ucx::PublisherCounters(**pub)->control_bytes_sent - before;
  };
  // Every subscriber connects and greets first.
  uint64_t sub_control = 0, descriptor = 0;
  one_version(1, 3, &sub_control, &descriptor);
  uint64_t small_sub = 0, big_sub = 0, small_desc = 0, big_desc = 0, three_sub = 0;
  const uint64_t small = one_version(8, 1, &small_sub, &small_desc);
  const uint64_t big = one_version(4000, 1, &big_sub, &big_desc);
  const uint64_t three = one_version(4000, 3, &three_sub, &descriptor);
  EXPECT_EQ(small, big) << "publisher control bytes per version grew with the tensor count";
  EXPECT_EQ(small_sub, big_sub) << "subscriber control bytes grew with the tensor count";
  EXPECT_EQ(three, 3 * big) << "each subscriber costs the publisher the same control bytes";
  EXPECT_LT(big, 1024u) << "a GRANT is a few dozen bytes";
  EXPECT_GT(big_desc, 4000u * 20) << "the manifest is read from the descriptor instead";
  absl::PrintF(
      "[ figures ] control bytes per version per subscriber: publisher %d, subscriber %d "
      "(8 and 4000 tensors alike); descriptor bytes read: %d (8 tensors), %d (4000)\n",
      big, big_sub, small_desc, big_desc);
}

// A PublishJob whose manifest is known before its bytes are staged, as the core's is
// (PublishJob::UnsealedManifest): the transport may announce its version unsealed.
class AnnouncingJob final : public PublishJob {
 public:
  AnnouncingJob(Manifest manifest, std::vector<const std::byte*> data)
      : manifest_(std::move(manifest)), inner_(manifest_, std::move(data)) {}
  uint64_t version() const override { return inner_.version(); }
  absl::Span<const PackedTensor> tensors() const override { return inner_.tensors(); }
  absl::StatusOr<const Manifest*> SealedManifest(absl::Time deadline) override {
    return inner_.SealedManifest(deadline);
  }
  std::optional<Manifest> UnsealedManifest() const override { return ucx::Unsealed(manifest_); }

 private:
  Manifest manifest_;
  SealedPublishJob inner_;
};

// Issue 14, pipelining: a version is announced before it is staged and a subscriber pulls each
// chunk as soon as it is staged. The publisher holds its staging after the third of 8 chunks
// (ucx.after_chunk); the subscriber, granted the version meanwhile, finds it unsealed (no
// checksums yet), lands exactly the 3 staged tensors (one per chunk) and no other while the
// publisher is held; once it goes on, Fetch returns with the version sealed: the manifest the
// publisher sealed, every tensor landed once, the bytes exact. Over tcp the publisher holds the
// READs of chunks not staged yet (UcxPublisherCounters::reads_held).
TEST_P(UcxInternalTest, AnnouncedVersionIsPulledChunkByChunkAsItIsStagedThenSealed) {
  const int port = weightbus::FreePort();
  const std::string uri_text = absl::StrFormat(
      "ucx://127.0.0.1:%d/pipe?ready_chunk=64KiB&copy_threads=1&get_chunk_size=64KiB&lease=60s",
      port);
  weightbus::testing::PausePoint held("ucx.after_chunk", 3);
  auto pub = [&] {
    weightbus::testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", held.Spec());
    return OpenTransportPublisher(uri_text);
  }();
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(sub.ok()) << sub.status();
  (*sub)->AcceptUnsealedVersions();
  constexpr size_t kTensors = 8;
  constexpr uint64_t kBytes = 64 << 10;  // one chunk each
  Manifest m;
  m.version = 1;
  std::vector<std::vector<std::byte>> bytes;
  for (size_t i = 0; i < kTensors; ++i) {
    bytes.push_back(weightbus::testing::RandomBytes(kBytes, 40 + i));
    m.tensors.push_back(TensorInfo{absl::StrFormat("t%d", i),
                                   DType::kU8,
                                   {static_cast<int64_t>(kBytes)},
                                   std::nullopt,
                                   kBytes,
                                   weightbus::testing::Xxh3(bytes.back().data(), kBytes)});
  }
  std::vector<const std::byte*> sources;
  for (const auto& b : bytes) sources.push_back(b.data());
  AnnouncingJob job(m, sources);
  weightbus::testing::InFlight publish(
      [&] { return (*pub)->Publish(job, absl::Now() + kTimeout); });
  ASSERT_TRUE(held.WaitReached(kTimeout)) << "the publisher did not stage 3 chunks";
  auto incoming = (*sub)->WaitForVersion(1, absl::Now() + kTimeout);
  ASSERT_TRUE(incoming.ok()) << incoming.status();
  EXPECT_FALSE((*incoming)->sealed());
  EXPECT_EQ((*incoming)->manifest(), ucx::Unsealed(m));
  struct Sink : LandingSink {
    std::array<std::atomic<int>, kTensors> landed{};
    std::atomic<int> count{0};
    absl::Notification three;
    void Landed(size_t i) override {
      ++landed[i];
      if (++count == 3) three.Notify();
    }
  } sink;
  std::vector<std::vector<std::byte>> out(kTensors, std::vector<std::byte>(kBytes));
  std::vector<std::byte*> targets;
  for (auto& o : out) targets.push_back(o.data());
  weightbus::testing::InFlight fetch(
      [&] { return (*incoming)->Fetch(targets, sink, absl::Now() + kTimeout); });
  ASSERT_TRUE(sink.three.WaitForNotificationWithTimeout(kTimeout))
      << "the staged chunks were not pulled while the publisher staged the rest";
  for (size_t i = 0; i < kTensors; ++i) {
    EXPECT_EQ(sink.landed[i].load(), i < 3 ? 1 : 0) << "tensor " << i;
  }
  EXPECT_FALSE(fetch.Returned());
  held.Release();
  ASSERT_TRUE(publish.Result(kTimeout).ok());
  const absl::Status fetched = fetch.Result(kTimeout);
  ASSERT_TRUE(fetched.ok()) << fetched;
  EXPECT_TRUE((*incoming)->sealed());
  EXPECT_EQ((*incoming)->manifest(), m);
  for (size_t i = 0; i < kTensors; ++i) {
    EXPECT_EQ(sink.landed[i].load(), 1) << "tensor " << i;
    EXPECT_EQ(out[i], bytes[i]) << "tensor " << i;
  }
  if (GetParam().name == weightbus::testing::kTcp.name) {
    auto counters = ucx::PublisherCounters(**pub);
    ASSERT_TRUE(counters.has_value());
    EXPECT_GT(counters->reads_held, 0u) << "no READ waited for its chunk to be staged";
  }
}

// Issue 14, fan-out (relay_fanout=1: a chain). Three subscribers are granted each version in
// turn: the publisher serves the first, which relays what it receives to the second, which
// relays it to the third. The fetches start from the end of the chain, each once its
// subscriber said to its relay that it reads from it (the fail point ucx.relay_attached), so
// that no relay finishes before its child began: then every byte the second and third hold
// came from their relays, the publisher sent each byte once, and all three hold the version
// bit-exact. The first subscriber stays for three versions (its relay descriptor, child slots
// and readiness words still name older versions when the next one begins); the others are new
// each time.
TEST_P(UcxInternalTest, RelaysPassEachChunkOnAndThePublisherSendsEachByteOnce) {
  if (GetParam().name == weightbus::testing::kTcp.name) {
    GTEST_SKIP() << "bytes over the control connection: no relays";
  }
  const int port = weightbus::FreePort();
  const std::string uri_text = absl::StrFormat(
      "ucx://127.0.0.1:%d/relay?relay_fanout=1&relay_stall=20s&lease=60s&ready_chunk=64KiB&"
      "get_chunk_size=64KiB",
      port);
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto head = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(head.ok()) << head.status();
  const std::vector<uint64_t> sizes = {3 << 20, 4096, 17, 1 << 20, 0, 65536};
  uint64_t total = 0;
  for (uint64_t n : sizes) total += n;
  struct Sink : LandingSink {
    void Landed(size_t) override {}
  };
  for (uint64_t version = 1; version <= 3; ++version) {
    SCOPED_TRACE(version);
    const std::vector<std::vector<std::byte>> bytes =
        PublishRandomTensors(**pub, version, sizes, version * 100);
    // subs[0] is the head of the chain; subs[1] and subs[2] pause once attached to their relay.
    std::vector<TransportSubscriber*> subs = {head->get()};
    std::vector<std::unique_ptr<TransportSubscriber>> opened;
    std::vector<std::unique_ptr<weightbus::testing::PausePoint>> attached;
    std::vector<std::unique_ptr<IncomingVersion>> incoming;
    for (int i = 0; i < 3; ++i) {
      if (i > 0) {
        attached.push_back(std::make_unique<weightbus::testing::PausePoint>("ucx.relay_attached"));
        weightbus::testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", attached.back()->Spec());
        auto sub = OpenTransportSubscriber(uri_text);
        ASSERT_TRUE(sub.ok()) << sub.status();
        opened.push_back(*std::move(sub));
        subs.push_back(opened.back().get());
      }
      // Granted in this order: the publisher places each in the chain as it grants it.
      auto got = subs[i]->WaitForVersion(version, absl::Now() + kTimeout);
      ASSERT_TRUE(got.ok()) << got.status();
      incoming.push_back(*std::move(got));
    }
    std::vector<std::vector<std::vector<std::byte>>> out(3);
    std::vector<uint64_t> before(3);
    std::vector<std::unique_ptr<weightbus::testing::InFlight>> fetches(3);
    for (int i = 2; i >= 0; --i) {
      before[i] = ucx::SubscriberCounters(*subs[i])->bytes_from_relays;
      for (uint64_t n : sizes) out[i].emplace_back(n);
      fetches[i] = std::make_unique<weightbus::testing::InFlight>([&, i] {
        Sink sink;
        std::vector<std::byte*> targets;
        for (auto& o : out[i]) {
          targets.push_back(o.empty() ? reinterpret_cast<std::byte*>(&sink) : o.data());
        }
        return incoming[i]->Fetch(targets, sink, absl::Now() + kTimeout);
      });
      if (i > 0) {
        ASSERT_TRUE(attached[i - 1]->WaitReached(kTimeout)) << "subscriber " << i;
        attached[i - 1]->Release();
      }
    }
    for (int i = 0; i < 3; ++i) {
      const absl::Status fetched = fetches[i]->Result(kTimeout);
      ASSERT_TRUE(fetched.ok()) << "subscriber " << i << ": " << fetched;
      EXPECT_EQ(out[i], bytes) << "subscriber " << i;
      incoming[i].reset();
    }
    EXPECT_EQ(ucx::SubscriberCounters(*subs[0])->bytes_from_relays - before[0], 0u);
    EXPECT_EQ(ucx::SubscriberCounters(*subs[1])->bytes_from_relays - before[1], total);
    EXPECT_EQ(ucx::SubscriberCounters(*subs[2])->bytes_from_relays - before[2], total);
  }
}

// A relay that stops serving midway (held by the fail point ucx.during_get once half of its
// gets are issued, as a stopped process would be) holds its child no longer than relay_stall:
// the child reads what the relay holds, pulls the rest from the publisher and holds the version
// bit-exact; so does the relay once it goes on.
TEST_P(UcxInternalTest, AStalledRelayHoldsItsChildNoLongerThanRelayStall) {
  if (GetParam().name == weightbus::testing::kTcp.name) {
    GTEST_SKIP() << "bytes over the control connection: no relays";
  }
  const int port = weightbus::FreePort();
  const std::string uri_text = absl::StrFormat(
      "ucx://127.0.0.1:%d/stall?relay_fanout=1&relay_stall=200ms&lease=60s&ready_chunk=64KiB&"
      "get_chunk_size=64KiB",
      port);
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  weightbus::testing::PausePoint stalled("ucx.during_get");
  auto relay = [&] {
    weightbus::testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", stalled.Spec());
    return OpenTransportSubscriber(uri_text);
  }();
  ASSERT_TRUE(relay.ok()) << relay.status();
  auto child = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(child.ok()) << child.status();
  constexpr uint64_t kBytes = 8 << 20;
  const std::vector<std::vector<std::byte>> bytes =
      PublishRandomTensors(**pub, 1, {kBytes / 2, kBytes / 2}, 77);
  struct Sink : LandingSink {
    void Landed(size_t) override {}
  } sink;
  // The relay is granted first, so the child is placed under it.
  auto relay_version = (*relay)->WaitForVersion(1, absl::Now() + kTimeout);
  ASSERT_TRUE(relay_version.ok()) << relay_version.status();
  auto child_version = (*child)->WaitForVersion(1, absl::Now() + kTimeout);
  ASSERT_TRUE(child_version.ok()) << child_version.status();
  std::vector<std::vector<std::byte>> relay_out(2, std::vector<std::byte>(kBytes / 2));
  weightbus::testing::InFlight relay_fetch([&] {
    std::vector<std::byte*> targets = {relay_out[0].data(), relay_out[1].data()};
    return (*relay_version)->Fetch(targets, sink, absl::Now() + kTimeout);
  });
  ASSERT_TRUE(stalled.WaitReached(kTimeout));
  std::vector<std::vector<std::byte>> child_out(2, std::vector<std::byte>(kBytes / 2));
  std::vector<std::byte*> targets = {child_out[0].data(), child_out[1].data()};
  const absl::Status fetched = (*child_version)->Fetch(targets, sink, absl::Now() + kTimeout);
  ASSERT_TRUE(fetched.ok()) << fetched;
  EXPECT_EQ(child_out, bytes);
  const uint64_t from_relay = ucx::SubscriberCounters(**child)->bytes_from_relays;
  EXPECT_GT(from_relay, 0u) << "the child never read from its relay";
  EXPECT_LT(from_relay, kBytes) << "the child should have pulled the rest from the publisher";
  child_version->reset();
  stalled.Release();
  const absl::Status relayed = relay_fetch.Result(kTimeout);
  EXPECT_TRUE(relayed.ok()) << relayed;
  EXPECT_EQ(relay_out, bytes);
}

// Issue 14: registrations and gets grow with a version's bytes, not its tensor count. 3000
// tensors of 4 KiB plus two of 3 MiB, received into one buffer where they lie back to back (as
// a replica's parameters do): one registration over shared memory (none over the control
// connection) and one get per 1 MiB chunk of the 17.7 MiB; then the same bytes into targets
// with a gap after every 100th tensor (each run of 100 gets its own gets, still one
// registration: gaps under a page) and into separate allocations (a registration and gets per
// allocation). Every tensor lands once, prefixes grow, the bytes are exact.
TEST_P(UcxInternalTest, RegistrationsAndGetsScaleWithBytesNotTensors) {
  const int port = weightbus::FreePort();
  const std::string uri_text =
      absl::StrFormat("ucx://127.0.0.1:%d/small?get_chunk_size=1MiB&lease=60s", port);
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(sub.ok()) << sub.status();
  constexpr size_t kSmall = 3000;
  std::vector<uint64_t> sizes(kSmall, 4096);
  sizes.insert(sizes.begin() + 1000, 3 << 20);
  sizes.push_back(3 << 20);
  sizes.insert(sizes.begin() + 7, 0);  // an empty tensor inside a run
  uint64_t total = 0;
  for (uint64_t n : sizes) total += n;
  const bool over_control = GetParam().name == weightbus::testing::kTcp.name;
  enum class Layout { kBackToBack, kGapEvery100, kSeparate };
  // The targets, alive to the end (as a replica's parameters are).
  std::vector<std::byte> one(total + 64 * sizes.size());
  std::vector<std::vector<std::byte>> separate;
  uint64_t version = 0;
  for (Layout layout : {Layout::kBackToBack, Layout::kGapEvery100, Layout::kSeparate}) {
    SCOPED_TRACE(static_cast<int>(layout));
    ++version;
    const std::vector<std::vector<std::byte>> bytes =
        PublishRandomTensors(**pub, version, sizes, version * 100000);
    std::vector<std::byte*> targets;
    uint64_t at = 0;
    separate.assign(sizes.size(), {});
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (layout == Layout::kSeparate) {
        // 64 bytes past each target: no allocator can place the next one right after it.
        separate[i].resize(sizes[i] + 64);
        targets.push_back(separate[i].data());
        continue;
      }
      targets.push_back(one.data() + at);
      at += sizes[i] + (layout == Layout::kGapEvery100 && i % 100 == 99 ? 64 : 0);
    }
    auto incoming = (*sub)->WaitForVersion(version, absl::Now() + kTimeout);
    ASSERT_TRUE(incoming.ok()) << incoming.status();
    struct Sink : LandingSink {
      std::vector<int> landed;
      std::vector<uint64_t> prefix;
      bool prefixes_grow = true;
      void Landed(size_t i) override { ++landed[i]; }
      void LandedPrefix(size_t i, uint64_t bytes) override {
        prefixes_grow &= bytes > prefix[i];
        prefix[i] = bytes;
      }
    } sink;
    sink.landed.assign(sizes.size(), 0);
    sink.prefix.assign(sizes.size(), 0);
    const ucx::UcxSubscriberCounters before = *ucx::SubscriberCounters(**sub);
    absl::Status fetched = (*incoming)->Fetch(targets, sink, absl::Now() + kTimeout);
    ASSERT_TRUE(fetched.ok()) << fetched;
    const ucx::UcxSubscriberCounters after = *ucx::SubscriberCounters(**sub);
    EXPECT_EQ(sink.landed, std::vector<int>(sizes.size(), 1));
    EXPECT_TRUE(sink.prefixes_grow);
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] == 0) continue;  // an empty one's bytes may be null: memcmp may not see them
      ASSERT_EQ(std::memcmp(targets[i], bytes[i].data(), sizes[i]), 0) << "tensor " << i;
    }
    const uint64_t chunks = (total + (1 << 20) - 1) >> 20;
    const uint64_t gets = after.gets - before.gets;
    const uint64_t registrations = after.registrations - before.registrations;
    switch (layout) {
      case Layout::kBackToBack:
        EXPECT_EQ(gets, chunks);
        EXPECT_EQ(registrations, over_control ? 0u : 1u);
        break;
      case Layout::kGapEvery100:
        // 31 runs (30 of 100 or 101 tensors with the big ones, and the last): at most one
        // partial chunk more each.
        EXPECT_GE(gets, chunks);
        EXPECT_LE(gets, chunks + 31);
        EXPECT_EQ(registrations, over_control ? 0u : 1u);
        break;
      case Layout::kSeparate:
        EXPECT_EQ(gets, kSmall + 2 * 3);  // one per small tensor, 3 per 3 MiB one
        EXPECT_LE(registrations, over_control ? 0u : kSmall + 2);
        break;
    }
    incoming->reset();
  }
}

// A complete manifest and its bytes, announced before its checksums are known (as the core's job
// is): what a zero-copy publish of the transport alone needs.
class AnnouncedPublishJob final : public PublishJob {
 public:
  AnnouncedPublishJob(Manifest manifest, std::vector<const std::byte*> data)
      : manifest_(std::move(manifest)) {
    for (size_t i = 0; i < manifest_.tensors.size(); ++i) {
      packed_.push_back(PackedTensor{&manifest_.tensors[i], data[i], Device{}});
    }
  }
  uint64_t version() const override { return manifest_.version; }
  absl::Span<const PackedTensor> tensors() const override { return packed_; }
  absl::StatusOr<const Manifest*> SealedManifest(absl::Time) override { return &manifest_; }
  std::optional<Manifest> UnsealedManifest() const override {
    Manifest m = manifest_;
    for (TensorInfo& t : m.tensors) t.xxh3 = 0;
    return m;
  }

 private:
  Manifest manifest_;
  std::vector<PackedTensor> packed_;
};

// Publisher::AllocateHost on ucx://: memory UCX allocated and registered, 4096-byte aligned and
// zero-filled, which a zero-copy publish serves with that registration (shared memory that this
// host's subscribers map) instead of registering the caller's memory, while a tensor outside it
// is registered as before; both arrive bit-exact. Memory freed between publishes is not named
// again, and memory that outlives its publisher stays usable and is freed after it.
TEST_P(UcxInternalTest, ZeroCopyPublishServesAllocatedHostMemoryWithItsOwnRegistration) {
  const std::string uri_text = absl::StrFormat(
      "ucx://127.0.0.1:%d/alloc?publish_mode=zero_copy&lease=60s&"
      "get_chunk_size=256KiB",
      weightbus::FreePort());
  auto pub = OpenTransportPublisher(uri_text);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_TRUE((*sub)->ListVersions().ok());  // connected: the zero-copy Publish waits for it
  struct Sink : LandingSink {
    void Landed(size_t) override {}
  } sink;
  std::vector<std::byte> outside = weightbus::testing::RandomBytes(300 << 10, 7);
  // Publishes `sources` (U8 tensors of `sizes` bytes) as `version`; the subscriber receives it.
  auto round = [&](uint64_t version, const std::vector<const std::byte*>& sources,
                   const std::vector<uint64_t>& sizes) {
    Manifest m;
    m.version = version;
    for (size_t i = 0; i < sizes.size(); ++i) {
      m.tensors.push_back(TensorInfo{absl::StrFormat("t%d", i),
                                     DType::kU8,
                                     {static_cast<int64_t>(sizes[i])},
                                     std::nullopt,
                                     sizes[i],
                                     weightbus::testing::Xxh3(sources[i], sizes[i])});
    }
    AnnouncedPublishJob job(m, sources);
    testing::InFlight publish([&] { return (*pub)->Publish(job, absl::Now() + kTimeout); });
    auto incoming = (*sub)->WaitForVersion(version, absl::Now() + kTimeout);
    ASSERT_TRUE(incoming.ok()) << incoming.status();
    std::vector<std::vector<std::byte>> out;
    std::vector<std::byte*> targets;
    for (uint64_t n : sizes) out.emplace_back(n);
    for (auto& o : out) targets.push_back(o.data());
    const absl::Status fetched = (*incoming)->Fetch(targets, sink, absl::Now() + kTimeout);
    ASSERT_TRUE(fetched.ok()) << fetched;
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(std::memcmp(out[i].data(), sources[i], sizes[i]), 0)
          << "version " << version << ", tensor " << i;
    }
    incoming->reset();
    const absl::Status published = publish.Result(kTimeout);
    ASSERT_TRUE(published.ok()) << published;
  };

  std::byte* data = nullptr;
  auto first = (*pub)->AllocateHost(3 << 20, &data);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_NE(*first, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % 4096, 0u);
  EXPECT_TRUE(std::all_of(data, data + (3 << 20), [](std::byte b) { return b == std::byte{0}; }));
  const std::vector<std::byte> random = weightbus::testing::RandomBytes(3 << 20, 1);
  std::memcpy(data, random.data(), random.size());
  // Two tensors in the allocation (less than a page apart: one run), one outside it.
  ASSERT_NO_FATAL_FAILURE(round(1, {data, data + (1 << 20) + 64, outside.data()},
                                {1 << 20, (2 << 20) - 64 - 8, outside.size()}));
  ucx::UcxPublisherCounters c = *ucx::PublisherCounters(**pub);
  EXPECT_EQ(c.lent_runs_allocated, 1u);
  EXPECT_EQ(c.lent_runs_registered, 1u);

  // Freed, then another allocation (possibly at the same address): served with its own.
  first->reset();
  auto second = (*pub)->AllocateHost(1 << 20, &data);
  ASSERT_TRUE(second.ok()) << second.status();
  const std::vector<std::byte> more = weightbus::testing::RandomBytes(1 << 20, 2);
  std::memcpy(data, more.data(), more.size());
  ASSERT_NO_FATAL_FAILURE(round(2, {data + 64}, {(1 << 20) - 64}));
  c = *ucx::PublisherCounters(**pub);
  EXPECT_EQ(c.lent_runs_allocated, 2u);
  EXPECT_EQ(c.lent_runs_registered, 1u);

  // The memory outlives the transport: still the caller's to use, then freed.
  sub->reset();
  pub->reset();
  data[0] = std::byte{1};
  EXPECT_EQ(data[0], std::byte{1});
  second->reset();
}

// AllocateHost hands out UCX's memory only where a publish gains from it (publish_mode=
// zero_copy); a staged publisher, or one whose UCX cannot allocate (the fail point), answers
// nullptr, and Publisher::AllocateHost then gives plain memory.
TEST_P(UcxInternalTest, AllocateHostIsPlainMemoryWhereUcxMemoryGainsNothingOrCannotBeHad) {
  for (const char* mode : {"staged", "zero_copy"}) {
    SCOPED_TRACE(mode);
    const bool zero_copy = std::string_view(mode) == "zero_copy";
    std::optional<weightbus::testing::ScopedEnv> fp;
    if (zero_copy) fp.emplace("WEIGHTBUS_FAILPOINTS", "ucx.allocate_host=error");
    auto pub = OpenTransportPublisher(
        absl::StrFormat("ucx://127.0.0.1:%d/plain?publish_mode=%s", weightbus::FreePort(), mode));
    ASSERT_TRUE(pub.ok()) << pub.status();
    std::byte* data = nullptr;
    auto served = (*pub)->AllocateHost(1 << 20, &data);
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_EQ(*served, nullptr);
    if (zero_copy) {  // the fail point fires once: the next allocation is UCX's
      auto next = (*pub)->AllocateHost(1 << 20, &data);
      ASSERT_TRUE(next.ok()) << next.status();
      EXPECT_NE(*next, nullptr);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxInternalTest,
                         ::testing::Values(weightbus::testing::kShm, weightbus::testing::kTcp),
                         [](const ::testing::TestParamInfo<weightbus::testing::Tls>& info) {
                           return info.param.name;
                         });

// Item 3 of issue 10: a publisher process stalled (SIGSTOP) while a subscriber asks it for bytes;
// the subscriber gives up and goes away during the stall (it exits, or is SIGKILLed); when the
// publisher resumes it must keep publishing and serving others. With UCX_TLS=tcp the old data
// path (a UCP endpoint with software-emulated gets) made the resumed publisher abort 3 of 3
// times: ucp_request.c:684 "got REP message", or "unexpected error: Endpoint timeout" in
// ucp_get_req_handler while it answered the vanished subscriber's queued get requests.
class UcxStallTest : public UcxInternalTest {
 protected:
  static constexpr uint64_t kBytes = 8 << 20;

  void SetUp() override {
    UcxInternalTest::SetUp();
    if (IsSkipped()) return;
    uri_ = absl::StrFormat("ucx://127.0.0.1:%d/stall", weightbus::FreePort());
    // Version 1, then versions 2 and 3 once one subscriber holds version 1 (none does until the
    // survivor below: the victim never completes its transfer).
    auto pub = testing::Child::Start(
        {testing::BinaryPath("tests/wb_test_peer"), "publish", uri_, "--versions", "3", "--bytes",
         std::to_string(kBytes), "--first-subscribers", "1", "--until-subscribers", "1",
         "--timeout-s", "60"},
        GetParam().env, dir_ / "pub.log");
    ASSERT_TRUE(pub.ok()) << pub.status();
    pub_.emplace(*std::move(pub));
  }

  // The victim's URI: small reads, so that many are outstanding when it gives up.
  std::string VictimUri() const { return uri_ + "?get_chunk_size=64KiB&gets_in_flight=16"; }

  void StopPublisher() {
    pub_->Kill(SIGSTOP);
    ASSERT_TRUE(testing::WaitUntil([&] { return testing::ProcessState(pub_->pid()) == 'T'; }));
  }

  // Resumes the publisher; it must publish versions 2 and 3, serve them to a new subscriber
  // process, and exit 0.
  void ExpectPublisherServesOnAfterResuming() {
    pub_->Kill(SIGCONT);
    auto survivor = testing::Child::Start(
        {testing::BinaryPath("tests/wb_test_peer"), "subscribe", uri_, "--until", "3", "--bytes",
         std::to_string(kBytes), "--timeout-s", "60"},
        GetParam().env, dir_ / "survivor.log");
    ASSERT_TRUE(survivor.ok());
    auto s = survivor->Wait(absl::Seconds(120));
    ASSERT_TRUE(s.ok()) << s.status();
    const std::string survivor_log = testing::ReadFileOrDie(dir_ / "survivor.log");
    EXPECT_TRUE(WIFEXITED(*s) && WEXITSTATUS(*s) == 0) << survivor_log;
    EXPECT_THAT(survivor_log, HasSubstr("received 3 ok"));
    auto p = pub_->Wait(absl::Seconds(60));
    ASSERT_TRUE(p.ok()) << p.status();
    const std::string pub_log = testing::ReadFileOrDie(dir_ / "pub.log");
    EXPECT_TRUE(WIFEXITED(*p) && WEXITSTATUS(*p) == 0)
        << "the publisher ended with wait status " << *p << ":\n"
        << pub_log;
    EXPECT_THAT(pub_log, HasSubstr("published 3"));
    EXPECT_THAT(pub_log, HasSubstr("1 subscribers have 3"));
  }

  testing::ScratchDir dir_;
  std::string uri_;
  std::optional<testing::Child> pub_;
};

struct NoSink : LandingSink {
  void Landed(size_t) override {}
};

// Buffers for every tensor of `m`, and pointers to them.
struct Targets {
  explicit Targets(const Manifest& m) {
    for (const TensorInfo& t : m.tensors) {
      buffers.emplace_back(t.nbytes);
      pointers.push_back(buffers.back().data());
    }
  }
  std::vector<std::vector<std::byte>> buffers;
  std::vector<std::byte*> pointers;
};

TEST_P(UcxStallTest, SubscriberThatTimesOutAndExitsDuringTheStall) {
  const std::string victim_uri_text = VictimUri();
  auto victim = OpenTransportSubscriber(victim_uri_text);
  ASSERT_TRUE(victim.ok()) << victim.status();
  auto granted = (*victim)->WaitForVersion(1, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(granted.ok()) << granted.status();
  ASSERT_EQ((*granted)->manifest().version, 1u);
  StopPublisher();
  NoSink sink;
  Targets targets((*granted)->manifest());
  // Over tcp nothing can arrive from a stopped publisher; shared memory needs no help from it.
  absl::Status fetched =
      (*granted)->Fetch(targets.pointers, sink, absl::Now() + absl::Milliseconds(500));
  if (GetParam().name == "tcp") {
    EXPECT_EQ(fetched.code(), absl::StatusCode::kDeadlineExceeded) << fetched;
  }
  granted->reset();
  victim->reset();  // what its exit does: every connection to the publisher closes
  ExpectPublisherServesOnAfterResuming();
}

TEST_P(UcxStallTest, SubscriberSigkilledDuringTheStallWithATransferOutstanding) {
  // The victim is this test binary running the victim case below in another process.
  const std::string go = dir_ / "go";
  std::map<std::string, std::string> env = GetParam().env;
  env["WB_TEST_VICTIM_URI"] = VictimUri();
  env["WB_TEST_VICTIM_GO"] = go;
  auto victim =
      testing::Child::Start({"/proc/self/exe", "--gtest_filter=UcxVictim.DISABLED_FetchesWhenTold",
                             "--gtest_also_run_disabled_tests"},
                            env, dir_ / "victim.log");
  ASSERT_TRUE(victim.ok()) << victim.status();
  ASSERT_TRUE(testing::WaitUntil(
      [&] { return absl::StrContains(testing::ReadFileOrDie(dir_ / "victim.log"), "granted 1"); },
      absl::Seconds(60)))
      << testing::ReadFileOrDie(dir_ / "victim.log");
  StopPublisher();
  { std::ofstream(go) << "go"; }
  // Its requests are out once it sleeps in poll() waiting for their answers (reads over the
  // control connection), or while it spins progressing its UCP worker (gets).
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        std::ifstream wchan(absl::StrFormat("/proc/%d/wchan", victim->pid()));
        std::string w;
        wchan >> w;
        return absl::StrContains(testing::ReadFileOrDie(dir_ / "victim.log"), "fetching") &&
               (absl::StrContains(w, "poll") || w == "0" || GetParam().name != "tcp");
      },
      absl::Seconds(60)))
      << testing::ReadFileOrDie(dir_ / "victim.log");
  victim->Kill(SIGKILL);
  auto v = victim->Wait(absl::Seconds(30));
  ASSERT_TRUE(v.ok());
  ExpectPublisherServesOnAfterResuming();
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxStallTest,
                         ::testing::Values(weightbus::testing::kShm, weightbus::testing::kTcp),
                         [](const ::testing::TestParamInfo<weightbus::testing::Tls>& info) {
                           return info.param.name;
                         });

// The victim process of SubscriberSigkilledDuringTheStallWithATransferOutstanding (run only
// from there: its URI and go-file come from the environment): takes a grant of version 1, then,
// once the go-file exists, fetches it with a long deadline (it is killed meanwhile).
TEST(UcxVictim, DISABLED_FetchesWhenTold) {
  const char* uri_text = std::getenv("WB_TEST_VICTIM_URI");
  const char* go = std::getenv("WB_TEST_VICTIM_GO");
  if (uri_text == nullptr || go == nullptr) GTEST_SKIP() << "run by UcxStallTest only";
  auto sub = OpenTransportSubscriber(uri_text);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto granted = (*sub)->WaitForVersion(1, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(granted.ok()) << granted.status();
  std::printf("granted %llu\n", static_cast<unsigned long long>((*granted)->manifest().version));
  std::fflush(stdout);
  ASSERT_TRUE(testing::WaitUntil([&] { return std::ifstream(go).good(); }, absl::Seconds(60)));
  std::printf("fetching\n");
  std::fflush(stdout);
  NoSink sink;
  Targets targets((*granted)->manifest());
  absl::Status fetched =
      (*granted)->Fetch(targets.pointers, sink, absl::Now() + absl::Seconds(120));
  std::printf("fetched: %s\n", fetched.ToString().c_str());
}

// A publisher with shared memory and a subscriber of the same host limited to tcp (UCX_TLS
// differs): the subscriber reads the bytes over the control connection (it would otherwise use
// software-emulated gets, item 3), and the publisher serves them.
TEST(UcxMixedTlsTest, TcpOnlySubscriberOfAShmPublisherReceivesBitExact) {
  std::optional<testing::ScopedEnvs> env;
  env.emplace(weightbus::testing::kShm.env);
  if (const std::string why = weightbus::UcxUnavailableReason(); !why.empty()) GTEST_SKIP() << why;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/mixed", weightbus::FreePort());
  auto pub = weightbus::Publisher::Open(uri);
  ASSERT_TRUE(pub.ok()) << pub.status();
  env.reset();
  env.emplace(weightbus::testing::kTcp.env);
  auto sub = weightbus::Subscriber::Open(uri + "?get_chunk_size=64KiB");
  ASSERT_TRUE(sub.ok()) << sub.status();
  for (uint64_t v = 1; v <= 3; ++v) {
    auto tensors = testing::MakeVersion(17, v, 1 << 20);
    ASSERT_TRUE((*pub)->Publish(v, testing::Views(tensors), {}, weightbus::kTimeout).ok());
    auto u = (*sub)->WaitForVersion(v, weightbus::kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    EXPECT_EQ((*u)->version(), v);
    weightbus::testing::ExpectSameTensors(**u, tensors);
  }
}

TEST(UcxEndpointTest, OnlyLoopbackHostsCountAsOneHost) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "::1", "localhost"}) {
    EXPECT_TRUE(ucx::IsLoopback(host)) << host;
  }
  for (const char* host : {"128.0.0.1", "10.0.0.1", "0.0.0.0", "::", "::ffff:10.0.0.1",
                           "localhost.example.com", "fe80::1"}) {
    EXPECT_FALSE(ucx::IsLoopback(host)) << host;
  }
}

TEST(UcxControlTest, FramesRoundTripAndMalformedOnesAreDataLoss) {
  using namespace ucx;
  std::string wire = Writer(MsgType::kWait).U64(7).U64(uint64_t{1} << 40).U8(1).Finish();
  wire += Writer(MsgType::kError).U32(5).Str("gone \xe2\x9c\x93").Finish();
  std::string partial = wire.substr(0, 10);
  auto none = TakeFrame(partial);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  auto f = TakeFrame(wire);
  ASSERT_TRUE(f.ok() && f->has_value());
  EXPECT_EQ((*f)->type, MsgType::kWait);
  Reader r((*f)->payload);
  EXPECT_EQ(r.U64(), 7u);
  EXPECT_EQ(r.U64(), uint64_t{1} << 40);
  EXPECT_EQ(r.U8(), 1);
  EXPECT_TRUE(r.ok() && r.at_end());
  r.U8();
  EXPECT_FALSE(r.ok());  // reading past the end
  f = TakeFrame(wire);
  ASSERT_TRUE(f.ok() && f->has_value());
  Reader e((*f)->payload);
  EXPECT_EQ(e.U32(), 5u);
  EXPECT_EQ(e.Str(), "gone \xe2\x9c\x93");
  EXPECT_TRUE(wire.empty());
  std::string huge("\xff\xff\xff\x7f\x01", 5);
  EXPECT_EQ(TakeFrame(huge).status().code(), absl::StatusCode::kDataLoss);
  std::string empty("\0\0\0\0", 4);
  EXPECT_EQ(TakeFrame(empty).status().code(), absl::StatusCode::kDataLoss);
  // A Reader views its payload: the bytes must outlive it.
  const std::string lying_bytes("\xff\xff\x00\x00", 4);
  Reader lying(lying_bytes);
  EXPECT_EQ(lying.Str(), "");
  EXPECT_FALSE(lying.ok());
}

// Every message has one decoder (control.h): a message claiming more than it carries (a count,
// a string length), one with bytes after its fields, and flags or modes out of range are
// DataLoss naming the message, the field, the claim and what is there; status codes from the
// wire never read as OK.
TEST(UcxControlTest, MessagesClaimingMoreThanTheyCarryAreDataLossNamingBothSides) {
  using namespace ucx;
  auto expect = [](const absl::Status& s, const std::string& message) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_EQ(std::string(s.message()), message);
  };
  // GRANT: request, lease, lease_ns, version, the descriptor's id, base, address, length, then
  // an rkey far longer than the rest.
  std::string grant = Writer(MsgType::kGrant)
                          .U64(1)
                          .U64(2)
                          .U64(3)
                          .U64(4)
                          .U64(5)
                          .U64(6)
                          .U64(7)
                          .U64(8)
                          .U32(1000000)
                          .Raw("short")
                          .Body();
  expect(DecodeGrant(grant).status(),
         "malformed GRANT message (73 bytes): the descriptor rkey needs 1000000 bytes but only 5 "
         "remain");
  // The version descriptor's layout (descriptor.h), read from registered memory, is held to the
  // same rules.
  std::string layout;
  internal::BasicByteWriter<std::string>(&layout).U64(1).U64(4096).U64(0).U32(1000000).U64(0);
  expect(DecodeLayout(layout).status(),
         "malformed version layout (36 bytes): claims 1000000 regions of at least 44 bytes each "
         "but only 8 bytes remain");
  expect(
      DecodeVersions(Writer(MsgType::kVersions).U64(5).U32(4000000).U64(6).U64(7).Body()).status(),
      "malformed VERSIONS message (28 bytes): claims 4000000 versions of at least 8 bytes each "
      "but only 16 bytes remain");
  expect(
      DecodeRefused(Writer(MsgType::kRefused).U64(1).U32(5).U32(300).Raw("short").Body()).status(),
      "malformed REFUSED message (21 bytes): the message needs 300 bytes but only 5 remain");
  expect(DecodeRenew(Writer(MsgType::kRenew).U64(1).U8(0).Body()).status(),
         "malformed RENEW message (9 bytes): 1 bytes follow the last field");
  expect(DecodeRead(Writer(MsgType::kRead).U64(1).U64(2).Body()).status(),
         "malformed READ message (16 bytes): truncated before the offset");
  expect(DecodeRelease(Writer(MsgType::kRelease).U64(1).U8(2).Body()).status(),
         "malformed RELEASE message (9 bytes): ack is 2, expected 0 or 1");
  expect(DecodeWait(Writer(MsgType::kWait).U64(1).U64(2).U8(3).Body()).status(),
         "malformed WAIT message (17 bytes): mode 3, expected 0 (newest), 1 (exact) or 2 (newest "
         "now)");
  // HELLO may carry fields of a later protocol after its own.
  HelloMsg hello{kMagic, kProtocolVersion + 1, "c", 9, "sub"};
  auto decoded = DecodeHello(Encode(hello).substr(5) + "later fields");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->protocol, kProtocolVersion + 1);
  EXPECT_EQ(decoded->description, "sub");

  // A GRANT, a layout and a seal round-trip; a seal applied to the unsealed manifest gives the
  // sealed one back.
  GrantMsg g{7, 8, 9, 10, {1, 4096, 0x1000, 8192, "rkey"}, 640};
  auto back = DecodeGrant(Encode(g).substr(5));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->descriptor, g.descriptor);
  EXPECT_EQ(back->prefix, 640u);
  Manifest m;
  m.version = 10;
  // "a": format 1's 1-D blocks; "b": tiles of 2 rows x 8 bytes of its 4 rows of 16 bytes.
  m.tensors = {
      TensorInfo{"a", DType::kF32, {4}, std::nullopt, 16, 0x1234, 0, 8, 0, {5, 6}},
      TensorInfo{"b", DType::kF32, {4, 4}, std::nullopt, 64, 0x5678, 0, 8, 2, {7, 8, 9, 10}}};
  m.sealed_unix_ns = 99;
  m.metadata[std::string(internal::kMacMetadataKey)] = std::string(64, 'f');
  VersionLayout l{10,  4096, 8192,   {{1, 0, 0x2000, 8192, "rkey"}},
                  {0}, {},   {1, 2}, Unsealed(m).ToJson()};
  auto l2 = DecodeLayout(EncodeLayout(l));
  ASSERT_TRUE(l2.ok()) << l2.status();
  EXPECT_EQ(*l2, l);
  auto seal = DecodeSeal(EncodeSeal(SealOf(m)));
  ASSERT_TRUE(seal.ok()) << seal.status();
  auto sealed = ApplySeal(Unsealed(m), *seal);
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  EXPECT_EQ(*sealed, m);
  seal->tensors[0].blocks.pop_back();  // 16 bytes in blocks of 8 need 2 block checksums
  EXPECT_EQ(ApplySeal(Unsealed(m), *seal).status().code(), absl::StatusCode::kDataLoss);
  seal->tensors[0].blocks.push_back(6);
  ASSERT_TRUE(ApplySeal(Unsealed(m), *seal).ok());
  seal->tensors[1].block_rows = 4;  // one band of 2 columns: 2 tiles, not the 4 it carries
  EXPECT_EQ(ApplySeal(Unsealed(m), *seal).status().code(), absl::StatusCode::kDataLoss);
  seal->tensors[1].block_rows = 2;
  seal->tensors[1].block_bytes = 0;  // tile rows without tile bytes
  EXPECT_EQ(ApplySeal(Unsealed(m), *seal).status().code(), absl::StatusCode::kDataLoss);

  // Code 0 (OK) or an unknown code from a peer is the fallback, never success.
  EXPECT_EQ(StatusCodeFromWire(0, absl::StatusCode::kUnavailable), absl::StatusCode::kUnavailable);
  EXPECT_EQ(StatusCodeFromWire(99, absl::StatusCode::kInternal), absl::StatusCode::kInternal);
  EXPECT_EQ(StatusCodeFromWire(5, absl::StatusCode::kInternal), absl::StatusCode::kNotFound);
  const absl::Status zero = ErrorStatus(Encode(ErrorMsg{0, "all fine"}).substr(5), "pub: ");
  EXPECT_EQ(zero.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(std::string(zero.message()), "pub: all fine");
  const absl::Status cut = ErrorStatus(std::string("\x05\0\0", 3), "pub: ");
  EXPECT_EQ(cut.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(std::string(cut.message()),
            "pub: the publisher sent a malformed ERROR message (3 bytes): truncated before the "
            "status code");
}

// A publisher that speaks the control protocol by hand (this thread's own UCX worker supplies a
// real address and a real 4 KiB registration), so that a test can send grants no real publisher
// would: one crafted GRANT per WAIT, then it keeps the connection open until told to stop.
class HandwrittenPublisher {
 public:
  // `grant_body` follows the lease fields of a GRANT (see UcxPublisher::Grant): the version, the
  // descriptor region and the prefix; it may write a descriptor into the registered region.
  using GrantBody = std::function<std::string(const ucx::MemRegion& region)>;

  static std::unique_ptr<HandwrittenPublisher> Start(int port, GrantBody body) {
    auto p = std::unique_ptr<HandwrittenPublisher>(new HandwrittenPublisher);
    auto context = ucx::Context::Create(false, "handwritten", true);
    EXPECT_TRUE(context.ok()) << context.status();
    if (!context.ok()) return nullptr;
    p->context_ = *context;
    auto worker = ucx::Worker::Create(p->context_, "handwritten");
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return nullptr;
    p->worker_ = *std::move(worker);
    auto region = ucx::MemRegion::Allocate(p->context_, 4096, UCS_MEMORY_TYPE_HOST);
    EXPECT_TRUE(region.ok()) << region.status();
    if (!region.ok()) return nullptr;
    p->region_ = *std::move(region);
    auto listener = ucx::Listen("127.0.0.1", port, "handwritten");
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (!listener.ok()) return nullptr;
    p->listener_ = *std::move(listener);
    p->body_ = std::move(body);
    p->thread_ = std::thread([q = p.get()] { q->Serve(); });
    return p;
  }
  ~HandwrittenPublisher() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  const ucx::MemRegion& region() const { return *region_; }

 private:
  HandwrittenPublisher() = default;
  void Serve() {
    using namespace ucx;
    const absl::Time end = absl::Now() + absl::Seconds(60);
    while (!stop_ && absl::Now() < end) {
      pollfd p{listener_.get(), POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) continue;
      ControlStream c(Fd(fd), "the test's subscriber");
      auto address = worker_->Address();
      auto rkey = region_->PackRkey();
      if (!address.ok() || !rkey.ok()) return;
      while (!stop_) {
        absl::StatusOr<Frame> f = c.Receive(absl::Now() + absl::Milliseconds(20));
        if (absl::IsDeadlineExceeded(f.status())) continue;
        if (!f.ok()) break;
        Reader r(f->payload);
        if (f->type == MsgType::kHello) {
          Writer w(MsgType::kWelcome);
          w.U32(kProtocolVersion).U64(1).Str(*address).U64(absl::ToInt64Nanoseconds(kTimeout));
          w.U8(1).U64(1).Str("handwritten publisher").U8(/*bytes_over_control=*/0);
          (void)c.Send(std::move(w).Finish(), absl::Now() + absl::Seconds(5));
        } else if (f->type == MsgType::kWait) {
          Writer g(MsgType::kGrant);
          g.U64(r.U64()).U64(/*lease=*/7).U64(absl::ToInt64Nanoseconds(kTimeout));
          g.Raw(body_(*region_));
          (void)c.Send(std::move(g).Finish(), absl::Now() + absl::Seconds(5));
        }
      }
    }
  }
  std::shared_ptr<ucx::Context> context_;
  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<ucx::MemRegion> region_;
  ucx::Fd listener_;
  GrantBody body_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A grant whose regions' lengths, or a region's address plus its length, wrap around 64 bits
// must not pass the bounds check: the subscriber refuses it with DataLoss before any get.
TEST(UcxGrantTest, RegionSumsThatWrapAround64BitsAreDataLoss) {
  const testing::ScopedEnvs env(weightbus::testing::kShm.env);
  if (const std::string why = weightbus::UcxUnavailableReason(); !why.empty()) GTEST_SKIP() << why;
  const std::vector<std::byte> bytes = testing::RandomBytes(8, 3);
  Manifest m;
  m.version = 1;
  m.tensors.push_back(
      TensorInfo{"t", DType::kU8, {8}, std::nullopt, 8, testing::Xxh3(bytes.data(), 8)});
  struct Case {
    std::string name;
    std::vector<std::array<uint64_t, 3>> regions;  // base, address (0: the real one), length
    std::string why;
  };
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  for (const Case& c : {
           // The first two regions' lengths sum to 2^64: the running end wraps to 0, where a
           // third region then "tiles" on, and the tensor seems to lie inside the slot.
           Case{"lengths", {{0, 0, 16}, {16, 1, max - 15}, {0, 0, 16}}, "ends beyond 2^64"},
           // One region whose address plus length wraps.
           Case{"address", {{0, max - 3, 4096}}, "ends beyond 2^64"},
       }) {
    SCOPED_TRACE(c.name);
    const int port = weightbus::FreePort();
    auto pub = HandwrittenPublisher::Start(port, [&](const ucx::MemRegion& region) {
      // The registered 4 KiB: the version descriptor in its first 3 KiB, the bytes after it.
      constexpr uint64_t kData = 3072;
      std::memcpy(region.data() + kData, bytes.data(), bytes.size());
      auto rkey = region.PackRkey();
      const uintptr_t base = reinterpret_cast<uintptr_t>(region.data());
      ucx::VersionLayout layout;
      layout.version = 1;
      layout.chunk_bytes = 4096;
      uint64_t id = 1, covered = 0;
      for (const auto& [offset, address, length] : c.regions) {
        layout.regions.push_back(
            {id++, offset, address != 0 ? address : base + kData, length, rkey.ok() ? *rkey : ""});
        covered += length;
      }
      layout.data_bytes = covered;
      layout.offsets = {0};
      layout.live = {1, 2, 3, 100};
      layout.manifest_json = ucx::Unsealed(m).ToJson();
      const std::string encoded = ucx::EncodeLayout(layout);
      const std::string seal = ucx::EncodeSeal(ucx::SealOf(m));
      ucx::DescriptorHeader h;
      h.version = 1;
      h.state = static_cast<uint64_t>(ucx::VersionState::kSealed);
      h.nchunks = 1;
      h.layout_offset = ucx::ReadyOffset(1);
      h.layout_bytes = encoded.size();
      h.seal_offset = 2048;
      h.seal_bytes = seal.size();
      const std::string header = ucx::EncodeHeader(h);
      std::memcpy(region.data(), header.data(), header.size());
      internal::StoreLe<uint64_t>(1, region.data() + ucx::ReadyOffset(0));
      std::memcpy(region.data() + h.layout_offset, encoded.data(), encoded.size());
      std::memcpy(region.data() + h.seal_offset, seal.data(), seal.size());
      ucx::Writer w(ucx::MsgType::kGrant);
      w.U64(1).U64(100).U64(/*base=*/1 << 20).U64(base).U64(kData).Str(rkey.ok() ? *rkey : "");
      w.U64(h.layout_offset + encoded.size());
      w.U8(/*relay=*/0).U8(/*has a relay source=*/0);
      return std::move(w).Body();
    });
    ASSERT_NE(pub, nullptr);
    auto sub = weightbus::Subscriber::Open(absl::StrFormat("ucx://127.0.0.1:%d/p", port));
    ASSERT_TRUE(sub.ok()) << sub.status();
    auto u = (*sub)->WaitForVersion(0, absl::Seconds(20));
    ASSERT_EQ(u.status().code(), absl::StatusCode::kDataLoss) << u.status();
    EXPECT_THAT(u.status().message(), HasSubstr("malformed grant of version 1"));
    EXPECT_THAT(u.status().message(), HasSubstr(c.why));
    EXPECT_EQ((*sub)->current_version(), std::nullopt);
  }
}

TEST(UcxRegistrationCacheTest, RegistersOnceAndDropsRegistrationsOfUnmappedMemory) {
  const testing::ScopedEnvs env(weightbus::testing::kTcp.env);
  auto context = ucx::Context::Create(false, "test", false);
  if (!context.ok()) GTEST_SKIP() << context.status();
  ucx::RegistrationCache cache(*context);
  const size_t n = 1 << 20;
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  auto* b = static_cast<std::byte*>(p);
  ASSERT_NE(cache.Get(b, n), nullptr);
  ASSERT_NE(cache.Get(b, n), nullptr);
  cache.EndFetch();
  if (!cache.persistent()) GTEST_SKIP() << "UCX memory events are off here (UCX_MEM_EVENTS)";
  EXPECT_EQ(cache.registrations(), 1u);
  ASSERT_NE(cache.Get(b, n), nullptr);
  EXPECT_EQ(cache.registrations(), 1u);  // recycled buffer: no new registration
  ASSERT_EQ(munmap(p, n), 0);
  // Whatever is mapped at that address now is other memory: it must be registered anew.
  void* q = mmap(p, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(q, MAP_FAILED);
  ASSERT_NE(cache.Get(static_cast<std::byte*>(q), n), nullptr);
  EXPECT_EQ(cache.registrations(), 2u);
  munmap(q, n);
}

}  // namespace
}  // namespace weightbus::internal
