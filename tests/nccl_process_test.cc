// SPDX-License-Identifier: Apache-2.0
// nccl:// end to end through the public API, over the loopback stand-in backend
// (nccl_loopback_backend.h: host memory for device memory, loopback TCP for NCCL) and the real
// rendezvous over real sockets, between threads of this process and between processes (forked
// before any thread starts, each with its own backend): versions bit-exact at every replica, a
// late joiner rebuilding the communicator, a replica killed mid-transfer (SIGKILL at a fail
// point) failing the publish with its name and bucket while the survivor keeps its previous
// version and receives the next, a publisher killed while replicas wait, a replica whose NCCL
// settings differ refused before any transfer, a replica not receiving, a binding mismatch,
// capability declarations, URI and settings errors, and the real NCCL backend's refusal where no
// GPU exists. The same transport on real GPUs: tests/gpu/.
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/channel_setup.h"
#include "expect_tensors.h"
#include "nccl_loopback_backend.h"
#include "test_model.h"
#include "test_support.h"
#include "transport_stack.h"
#include "transports/nccl/device.h"
#include "transports/nccl/nccl_transport.h"
#include "transports/nccl/plan.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::weightbus::testing::ExpectSameTensors;
using ::weightbus::testing::LoopbackBackend;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::OwnedTensor;
using ::weightbus::testing::Views;

constexpr uint64_t kSeed = 15;
constexpr uint64_t kBytes = 48 << 10;  // with 4 KiB buckets: a dozen buckets and split tensors
constexpr absl::Duration kTimeout = absl::Seconds(30);

// The test channel at `port`, with 4 KiB buckets unless `query` sets bucket_size.
std::string ChannelUri(int port, const std::string& query = "") {
  std::string uri = absl::StrFormat("nccl://127.0.0.1:%d/policy?", port);
  if (!absl::StrContains(query, "bucket_size=")) uri += "bucket_size=4KiB&";
  return uri + query;
}

absl::Status PublishVersion(Publisher& p, uint64_t v, absl::Duration timeout = kTimeout) {
  const std::vector<OwnedTensor> t = MakeVersion(kSeed, v, kBytes);
  return p.Publish(v, Views(t), {}, timeout);
}

// The counters of this process's publisher of ChannelUri(port).
internal::nccl::NcclPublisherCounters Counters(int port) {
  std::optional<internal::nccl::NcclPublisherCounters> c =
      internal::nccl::ChannelCounters(absl::StrFormat("nccl://127.0.0.1:%d/policy", port));
  EXPECT_TRUE(c.has_value()) << "no nccl:// publisher of port " << port << " in this process";
  return c.value_or(internal::nccl::NcclPublisherCounters{});
}

// Each case runs over the loopback backend, installed for this process (and for each child).
class NcclEndToEndTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = testing::MissingTransports({"nccl"}); !why.empty()) {
      GTEST_SKIP() << why;
    }
    port_ = testing::FreePort();
  }
  void TearDown() override { internal::nccl::SetBackendForTesting(nullptr); }
  void UseLoopback(LoopbackBackend::Options options = {}) {
    internal::nccl::SetBackendForTesting(std::make_shared<LoopbackBackend>(options));
  }

  int port_ = 0;
};

// A replica thread: receives versions first..last, checking each against the model.
void Follow(const std::string& uri, uint64_t first, uint64_t last, std::atomic<int>* ok,
            Subscriber* given = nullptr) {
  std::unique_ptr<Subscriber> owned;
  Subscriber* s = given;
  if (s == nullptr) {
    auto opened = Subscriber::Open(uri);
    ASSERT_TRUE(opened.ok()) << opened.status();
    owned = *std::move(opened);
    s = owned.get();
  }
  for (uint64_t v = first; v <= last; ++v) {
    absl::StatusOr<std::unique_ptr<Update>> u = s->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << u.status();
    ASSERT_EQ((*u)->version(), v);
    ExpectSameTensors(**u, MakeVersion(kSeed, v, kBytes));
    ++*ok;
  }
}

TEST_F(NcclEndToEndTest, EveryReplicaReceivesEveryVersionBitExactOverOneCommunicator) {
  UseLoopback();
  auto pub = Publisher::Open(ChannelUri(port_, "min_replicas=3"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::atomic<int> ok{0};
  std::vector<std::thread> replicas;
  for (int r = 0; r < 3; ++r) replicas.emplace_back(Follow, ChannelUri(port_), 1, 3, &ok, nullptr);
  for (uint64_t v = 1; v <= 3; ++v) {
    absl::Status s = PublishVersion(**pub, v);
    ASSERT_TRUE(s.ok()) << s;
  }
  for (auto& t : replicas) t.join();
  EXPECT_EQ(ok.load(), 9);
  const auto c = Counters(port_);
  EXPECT_EQ(c.epochs, 1u);  // built once, reused
  EXPECT_EQ(c.last_replicas, 3u);
  uint64_t bytes = 0;
  for (const OwnedTensor& t : MakeVersion(kSeed, 3, kBytes)) bytes += t.bytes.size();
  EXPECT_GE(c.last_wire_bytes, bytes);  // the tensors and the alignment padding between them
  // Every replica verified version 3 (ACCEPTED): WaitForReceivers counts them.
  EXPECT_TRUE((*pub)->WaitForReceivers(3, 3, absl::Seconds(10)).ok());
}

TEST_F(NcclEndToEndTest, ALateJoinerGetsTheNextVersionThroughARebuiltCommunicator) {
  UseLoopback();
  auto pub = Publisher::Open(ChannelUri(port_, "min_replicas=1"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::atomic<int> ok{0};
  std::thread first(Follow, ChannelUri(port_), 1, 2, &ok, nullptr);
  ASSERT_TRUE(PublishVersion(**pub, 1).ok());
  EXPECT_EQ(Counters(port_).epochs, 1u);
  // A second replica joins (its first wait connects it); it does not stall version 1's group.
  auto late = Subscriber::Open(ChannelUri(port_));
  ASSERT_TRUE(late.ok());
  std::thread second(Follow, ChannelUri(port_), 2, 2, &ok, late->get());
  ASSERT_TRUE(testing::WaitUntil([&] { return Counters(port_).replicas == 2; }));
  ASSERT_TRUE(PublishVersion(**pub, 2).ok());
  first.join();
  second.join();
  EXPECT_EQ(ok.load(), 3);
  EXPECT_EQ(Counters(port_).epochs, 2u);
  EXPECT_EQ(Counters(port_).last_replicas, 2u);
  // nccl:// pushes: the late joiner never saw version 1.
  EXPECT_EQ((*late)->current_version(), 2u);
}

TEST_F(NcclEndToEndTest, VersionsWithoutBytesTravelWithoutBucketsAndAreCommittedToo) {
  UseLoopback();
  auto pub = Publisher::Open(ChannelUri(port_, "min_replicas=1"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(ChannelUri(port_));
  ASSERT_TRUE(sub.ok());
  std::thread replica([&] {
    auto empty = (*sub)->WaitForVersion(1, kTimeout);
    ASSERT_TRUE(empty.ok()) << empty.status();
    EXPECT_TRUE((*empty)->tensors().empty());
    auto zero = (*sub)->WaitForVersion(2, kTimeout);
    ASSERT_TRUE(zero.ok()) << zero.status();
    ASSERT_EQ((*zero)->tensors().size(), 2u);
    EXPECT_EQ((*zero)->tensors()[0].shape, (std::vector<int64_t>{0, 7}));
    EXPECT_EQ((*zero)->tensors()[1].shape, (std::vector<int64_t>{3, 0}));
  });
  ASSERT_TRUE((*pub)->Publish(1, {}, {}, kTimeout).ok());
  EXPECT_EQ(Counters(port_).last_buckets, 0u);
  const std::vector<TensorView> zero = {{"a", DType::kF32, {0, 7}}, {"b", DType::kBF16, {3, 0}}};
  ASSERT_TRUE((*pub)->Publish(2, zero, {}, kTimeout).ok());
  replica.join();
  EXPECT_EQ(Counters(port_).last_replicas, 1u);
}

TEST_F(NcclEndToEndTest, AReplicaNotReceivingFailsThePublishNamingItAndThenCatchesUp) {
  UseLoopback();
  auto pub = Publisher::Open(ChannelUri(port_));
  ASSERT_TRUE(pub.ok());
  auto sub = Subscriber::Open(ChannelUri(port_));
  ASSERT_TRUE(sub.ok());
  // Its first wait joins the publisher; then it is busy elsewhere.
  EXPECT_TRUE(absl::IsDeadlineExceeded((*sub)->WaitForVersion(1, absl::Milliseconds(10)).status()));
  ASSERT_TRUE(testing::WaitUntil([&] { return Counters(port_).replicas == 1; }));
  const absl::Time start = absl::Now();
  const absl::Status s = PublishVersion(**pub, 1, absl::Milliseconds(500));
  ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr(absl::StrFormat("pid %d", getpid())), HasSubstr("(rank 1)")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // Back in a wait, it takes part in the next version.
  std::atomic<int> ok{0};
  std::thread t(Follow, "", 2, 2, &ok, sub->get());
  absl::Status again = PublishVersion(**pub, 2);
  ASSERT_TRUE(again.ok()) << again;
  t.join();
  EXPECT_EQ(ok.load(), 1);
}

TEST_F(NcclEndToEndTest, AReplicaRefusingAVersionStillLetsTheOthersReceiveIt) {
  UseLoopback();
  auto pub = Publisher::Open(ChannelUri(port_, "min_replicas=2"));
  ASSERT_TRUE(pub.ok());
  auto good = Subscriber::Open(ChannelUri(port_));
  auto picky = Subscriber::Open(ChannelUri(port_));
  ASSERT_TRUE(good.ok() && picky.ok());
  const std::vector<OwnedTensor> v1 = MakeVersion(kSeed, 1, kBytes);
  // A destination of the wrong dtype: the picky replica's core refuses version 1 before any
  // byte; its transport still takes part in the broadcast (into its buckets only).
  std::vector<std::byte> wrong(v1[0].bytes.size() + 64);
  ASSERT_TRUE(
      (*picky)
          ->Bind(v1[0].name, Destination{v1[0].dtype == DType::kU8 ? DType::kI8 : DType::kU8,
                                         {static_cast<int64_t>(v1[0].bytes.size())},
                                         {},
                                         wrong.data(),
                                         {}})
          .ok());
  std::atomic<int> ok{0};
  std::thread g(Follow, "", 1, 2, &ok, good->get());
  std::thread p([&] {
    absl::StatusOr<std::unique_ptr<Update>> u = (*picky)->WaitForVersion(1, kTimeout);
    EXPECT_TRUE(absl::IsInvalidArgument(u.status())) << u.status();
    (*picky)->UnbindAll();
    Follow("", 2, 2, &ok, picky->get());
  });
  ASSERT_TRUE(PublishVersion(**pub, 1).ok());
  ASSERT_TRUE(PublishVersion(**pub, 2).ok());
  g.join();
  p.join();
  EXPECT_EQ(ok.load(), 3);
  EXPECT_EQ(Counters(port_).epochs, 1u);  // the refusal cost no rebuild
}

TEST_F(NcclEndToEndTest, ReplicasOnThePublishersGpuReadItsBucketsAndOneOnAnothersIsRefused) {
  // Devices in the order opened: the publisher's, two replicas on its GPU, one on GPU-b, and one
  // more on GPU-b.
  UseLoopback({.uuids = {"GPU-a", "GPU-a", "GPU-a", "GPU-b", "GPU-b"}});
  auto pub = Publisher::Open(ChannelUri(port_, "min_replicas=3"));
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::vector<std::unique_ptr<Subscriber>> subs;
  for (int i = 0; i < 4; ++i) {
    auto s = Subscriber::Open(ChannelUri(port_));
    ASSERT_TRUE(s.ok()) << s.status();
    subs.push_back(*std::move(s));
  }
  std::atomic<int> ok{0};
  std::vector<std::thread> replicas;
  for (int i = 0; i < 3; ++i) replicas.emplace_back(Follow, "", 1, 2, &ok, subs[i].get());
  ASSERT_TRUE(testing::WaitUntil([&] { return Counters(port_).replicas == 3; }));
  // The fourth is on the third's GPU: refused, naming it.
  const absl::Status refused = subs[3]->WaitForVersion(1, absl::Seconds(5)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()),
              AllOf(HasSubstr("is on the GPU of replica"), HasSubstr("GPU-b")));
  for (uint64_t v = 1; v <= 2; ++v) {
    absl::Status s = PublishVersion(**pub, v);
    ASSERT_TRUE(s.ok()) << s;
  }
  for (auto& t : replicas) t.join();
  EXPECT_EQ(ok.load(), 6);
  EXPECT_EQ(Counters(port_).epochs, 1u);
  EXPECT_EQ(Counters(port_).last_replicas, 3u);
}

TEST_F(NcclEndToEndTest, CancelEndsAReplicasWaitPromptly) {
  UseLoopback();
  auto pub = Publisher::Open(ChannelUri(port_));
  ASSERT_TRUE(pub.ok());
  auto sub = Subscriber::Open(ChannelUri(port_));
  ASSERT_TRUE(sub.ok());
  absl::Status got;
  absl::Time returned;
  std::thread t([&] {
    got = (*sub)->WaitForVersion(1, absl::Seconds(60)).status();
    returned = absl::Now();
  });
  ASSERT_TRUE(testing::WaitUntil([&] { return Counters(port_).replicas == 1; }));
  const absl::Time cancelled = absl::Now();
  (*sub)->Cancel();
  t.join();
  EXPECT_TRUE(absl::IsCancelled(got)) << got;
  EXPECT_LT(returned - cancelled, absl::Seconds(5));
}

TEST_F(NcclEndToEndTest, CapabilitiesAreDeclaredAsTheTransportBehaves) {
  auto caps = testing::StackCapabilitiesOf(ChannelUri(port_));
  ASSERT_TRUE(caps.ok()) << caps.status();
  EXPECT_EQ(caps->delivery, internal::TransportCapabilities::Delivery::kPush);
  EXPECT_TRUE(caps->all_subscribers_take_part);
  EXPECT_FALSE(caps->late_joiners);
  EXPECT_FALSE(caps->durable);
  EXPECT_TRUE(caps->cross_process);
  EXPECT_TRUE(caps->cancel);
  EXPECT_TRUE(caps->wait_for_receivers);
  EXPECT_EQ(caps->publish_memory, internal::TransportCapabilities::kHostMemory |
                                      internal::TransportCapabilities::kCudaMemory);
  EXPECT_EQ(caps->fetch_memory, caps->publish_memory);
  EXPECT_FALSE(caps->publisher_groups);
  EXPECT_FALSE(caps->open_version);
  EXPECT_FALSE(caps->list_versions);
  EXPECT_FALSE(caps->partial_reads);
  EXPECT_FALSE(caps->committed_manifest);
  EXPECT_FALSE(caps->reads_strided_views);
  // What it does not declare is refused: a group, at Open.
  UseLoopback();
  const absl::Status group =
      Publisher::Open(ChannelUri(port_), {{"rank", "0"}, {"world_size", "2"}}).status();
  EXPECT_TRUE(absl::IsUnimplemented(group)) << group;
}

TEST_F(NcclEndToEndTest, UrisAndSettingsAreCheckedAtOpenNamingWhatIsWrong) {
  UseLoopback();
  struct Case {
    std::string uri;
    bool subscriber;
    absl::StatusCode code;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"nccl://127.0.0.1/policy", false, absl::StatusCode::kInvalidArgument, "needs a port"},
      {"nccl:///policy", false, absl::StatusCode::kInvalidArgument, "host and port"},
      {absl::StrFormat("nccl://127.0.0.1:%d/", port_), false, absl::StatusCode::kInvalidArgument,
       "needs a channel name"},
      {absl::StrFormat("nccl://0.0.0.0:%d/policy", port_), true, absl::StatusCode::kInvalidArgument,
       "wildcard address"},
      {ChannelUri(port_, "bucket_size=5000"), false, absl::StatusCode::kInvalidArgument,
       "bucket_size=5000 is not a multiple of 256"},
      {absl::StrFormat("nccl://127.0.0.1:%d/policy?bucket_size=1KiB", port_), false,
       absl::StatusCode::kInvalidArgument, "bucket_size"},
      {ChannelUri(port_, "buckets_in_flight=1"), false, absl::StatusCode::kInvalidArgument,
       "buckets_in_flight"},
      {ChannelUri(port_, "min_replicas=5&max_replicas=2"), false,
       absl::StatusCode::kInvalidArgument, "min_replicas=5 is more than max_replicas=2"},
      {ChannelUri(port_, "no_such_setting=1"), true, absl::StatusCode::kInvalidArgument,
       "no_such_setting"},
  };
  for (const Case& c : cases) {
    const absl::Status s =
        c.subscriber ? Subscriber::Open(c.uri).status() : Publisher::Open(c.uri).status();
    EXPECT_EQ(s.code(), c.code) << c.uri << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.expected)) << c.uri;
  }
  // A port another publisher holds.
  auto first = Publisher::Open(ChannelUri(port_));
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(Publisher::Open(ChannelUri(port_)).status()));
  // A shared secret: refused rather than handing the weights to whoever connects.
  testing::ScratchDir dir;
  testing::WriteFileOrDie(dir / "key", std::string(32, 'k'));
  ASSERT_EQ(::chmod((dir / "key").c_str(), 0600), 0);
  const absl::Status secret =
      Publisher::Open(ChannelUri(testing::FreePort()), {{"secret_file", dir / "key"}}).status();
  EXPECT_TRUE(absl::IsUnimplemented(secret)) << secret;
  EXPECT_THAT(std::string(secret.message()), HasSubstr("does not authenticate"));
}

// The one real path: NCCL and CUDA. Without a GPU, opening refuses with what CUDA said.
TEST_F(NcclEndToEndTest, TheRealBackendWithoutAGpuRefusesAtOpenSayingSo) {
  if (internal::nccl::CudaBackend()->OpenDevice(-1, 2).ok()) {
    GTEST_SKIP() << "a GPU is visible: the real backend is covered by tests/gpu (label gpu)";
  }
  internal::nccl::SetBackendForTesting(nullptr);
  for (bool subscriber : {false, true}) {
    const absl::Status s = subscriber ? Subscriber::Open(ChannelUri(port_)).status()
                                      : Publisher::Open(ChannelUri(port_)).status();
    ASSERT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_THAT(std::string(s.message()),
                AllOf(HasSubstr(subscriber ? "a replica needs a GPU" : "the publisher needs a GPU"),
                      HasSubstr("no CUDA GPU is visible")));
  }
}

// ---------------------------------------------------------------------------------------------
// Processes. Children are forked before this process starts any thread; each installs its own
// loopback backend and reports over a pipe, one line per event.

struct ChildProcess {
  pid_t pid = -1;
  int out = -1;  // read end of its report pipe
  std::string lines;

  // The report so far, waiting up to `timeout` for a line containing `want`.
  bool WaitFor(const std::string& want, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (!absl::StrContains(lines, want) && absl::Now() < deadline) {
      pollfd p{out, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::read(out, buf, sizeof(buf));
      if (n <= 0) break;
      lines.append(buf, static_cast<size_t>(n));
    }
    return absl::StrContains(lines, want);
  }
  // Waits for it to exit and returns its wait status, with the rest of its report read.
  int Wait() {
    int status = 0;
    WaitFor("\x01never", absl::Seconds(60));  // reads to EOF
    ::waitpid(pid, &status, 0);
    ::close(out);
    return status;
  }
};

// Forks a child that runs `body(report)` and exits 0 (1 when `body` returns false).
ChildProcess Fork(const std::function<bool(FILE* report)>& body) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    FILE* report = ::fdopen(fds[1], "w");
    ::setvbuf(report, nullptr, _IOLBF, 0);
    internal::nccl::SetBackendForTesting(std::make_shared<LoopbackBackend>());
    const bool ok = body(report);
    ::fflush(report);
    ::_exit(ok ? 0 : 1);
  }
  ::close(fds[1]);
  return ChildProcess{pid, fds[0], ""};
}

// Receives versions in order as a replica, reporting each outcome; ends once it holds `last`.
bool ReplicaMain(FILE* report, const std::string& uri, uint64_t last) {
  auto sub = Subscriber::Open(uri);
  if (!sub.ok()) {
    std::fprintf(report, "open failed: %s\n", std::string(sub.status().message()).c_str());
    return false;
  }
  uint64_t next = 1;
  while (next <= last) {
    absl::StatusOr<std::unique_ptr<Update>> u = (*sub)->WaitForVersion(next, kTimeout);
    if (!u.ok()) {
      std::fprintf(
          report, "error %s: %s; current %s\n", absl::StatusCodeToString(u.status().code()).c_str(),
          std::string(u.status().message()).c_str(),
          (*sub)->current_version() ? std::to_string(*(*sub)->current_version()).c_str() : "none");
      if (absl::IsDeadlineExceeded(u.status()) || absl::IsFailedPrecondition(u.status())) {
        return false;
      }
      continue;
    }
    const uint64_t v = (*u)->version();
    const std::vector<OwnedTensor> want = MakeVersion(kSeed, v, kBytes);
    bool same = (*u)->tensors().size() == want.size();
    for (size_t i = 0; same && i < want.size(); ++i) {
      same = want[i].bytes.empty() ||
             std::memcmp((*u)->tensors()[i].data, want[i].bytes.data(), want[i].bytes.size()) == 0;
    }
    std::fprintf(report, "received %d %s\n", static_cast<int>(v), same ? "ok" : "MISMATCH");
    if (!same) return false;
    next = v + 1;
  }
  return true;
}

TEST_F(NcclEndToEndTest, AReplicaKilledMidTransferFailsThePublishNamingItAndTheBucket) {
  const std::string uri = ChannelUri(port_);
  // Buckets of one version (the kill comes at the 3rd bucket of version 2).
  const size_t buckets = [] {
    const std::vector<OwnedTensor> t = MakeVersion(kSeed, 1, kBytes);
    std::vector<uint64_t> sizes;
    for (const OwnedTensor& o : t) sizes.push_back(o.bytes.size());
    return internal::nccl::PlanBuckets(sizes, 4096)->buckets.size();
  }();
  ChildProcess victim = Fork([&](FILE* report) {
    ::setenv("WEIGHTBUS_FAILPOINTS",
             absl::StrFormat("nccl.replica_bucket=kill@%d", buckets + 3).c_str(), 1);
    return ReplicaMain(report, uri, 3);
  });
  ChildProcess survivor = Fork([&](FILE* report) { return ReplicaMain(report, uri, 3); });
  UseLoopback();
  auto pub = Publisher::Open(ChannelUri(port_));
  ASSERT_TRUE(pub.ok()) << pub.status();
  ASSERT_TRUE(testing::WaitUntil([&] { return Counters(port_).replicas == 2; }, kTimeout));
  ASSERT_TRUE(PublishVersion(**pub, 1).ok());
  ASSERT_TRUE(victim.WaitFor("received 1 ok", kTimeout)) << victim.lines;
  ASSERT_TRUE(survivor.WaitFor("received 1 ok", kTimeout)) << survivor.lines;

  const absl::Time start = absl::Now();
  const absl::Status s = PublishVersion(**pub, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("version 2"), HasSubstr(absl::StrFormat("pid %d", victim.pid)),
                    HasSubstr("is gone"), HasSubstr("bucket "),
                    HasSubstr(absl::StrFormat(" of %d", buckets))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));  // the death is seen, not timed out
  const int victim_status = victim.Wait();
  EXPECT_TRUE(WIFSIGNALED(victim_status) && WTERMSIG(victim_status) == SIGKILL) << victim.lines;
  // The survivor's receive failed and it kept version 1; the next version rebuilds without the
  // victim and reaches it.
  ASSERT_TRUE(survivor.WaitFor("current 1", kTimeout)) << survivor.lines;
  const absl::Status v3 = PublishVersion(**pub, 3);
  ASSERT_TRUE(v3.ok()) << v3 << "\nsurvivor: " << survivor.lines;
  EXPECT_EQ(survivor.Wait(), 0) << survivor.lines;
  EXPECT_THAT(survivor.lines, AllOf(HasSubstr("received 1 ok"), Not(HasSubstr("received 2")),
                                    HasSubstr("received 3 ok")));
  EXPECT_EQ(Counters(port_).epochs, 2u);
  EXPECT_EQ(Counters(port_).last_replicas, 1u);
}

TEST_F(NcclEndToEndTest, APublisherKilledWhileReplicasWaitFailsThemPromptly) {
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  ChildProcess publisher = Fork([&](FILE* report) {
    auto pub = Publisher::Open(ChannelUri(port_, "min_replicas=1"));
    if (!pub.ok()) return false;
    std::fprintf(report, "open\n");
    // Version 1 reaches the replica; then it dies in the middle of nothing.
    if (!PublishVersion(**pub, 1).ok()) return false;
    std::fprintf(report, "published 1\n");
    ::pause();
    return true;
  });
  ASSERT_TRUE(publisher.WaitFor("open", kTimeout)) << publisher.lines;
  UseLoopback();
  auto sub = Subscriber::Open(ChannelUri(port_));
  ASSERT_TRUE(sub.ok());
  auto v1 = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(v1.ok()) << v1.status();
  absl::Status waited;
  absl::Time returned;
  std::thread t([&] {
    waited = (*sub)->WaitForVersion(2, absl::Seconds(60)).status();
    returned = absl::Now();
  });
  ASSERT_TRUE(publisher.WaitFor("published 1", kTimeout));
  absl::SleepFor(absl::Milliseconds(50));  // the replica is back in its wait (no signal for it)
  const absl::Time killed = absl::Now();
  ::kill(publisher.pid, SIGKILL);
  publisher.Wait();
  t.join();
  EXPECT_TRUE(absl::IsUnavailable(waited)) << waited;
  EXPECT_THAT(std::string(waited.message()), HasSubstr("the publisher"));
  EXPECT_LT(returned - killed, absl::Seconds(5));
  EXPECT_EQ((*sub)->current_version(), 1u);
  ::close(go[0]);
  ::close(go[1]);
}

TEST_F(NcclEndToEndTest, AReplicaWhoseNcclSettingsDifferIsRefusedBeforeAnyTransfer) {
  const std::string uri = ChannelUri(port_);
  testing::ScopedEnv unset("NCCL_CUMEM_ENABLE", std::nullopt);
  ChildProcess replica = Fork([&](FILE* report) {
    ::setenv("NCCL_CUMEM_ENABLE", "0", 1);
    auto sub = Subscriber::Open(uri);
    if (!sub.ok()) return false;
    const absl::Status s = (*sub)->WaitForVersion(1, kTimeout).status();
    std::fprintf(report, "%s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
                 std::string(s.message()).c_str());
    return absl::IsFailedPrecondition(s);
  });
  UseLoopback();
  auto pub = Publisher::Open(uri);
  ASSERT_TRUE(pub.ok());
  EXPECT_EQ(replica.Wait(), 0) << replica.lines;
  EXPECT_THAT(replica.lines, AllOf(HasSubstr("the publisher refused this replica"),
                                   HasSubstr("NCCL_CUMEM_ENABLE is unset on the publisher"),
                                   HasSubstr("but \"0\" on replica"),
                                   HasSubstr(absl::StrFormat("pid %d", replica.pid)),
                                   HasSubstr("before any transfer")));
  // Never a member: the publisher's versions go on without it.
  EXPECT_EQ(Counters(port_).replicas, 0u);
  ASSERT_TRUE(PublishVersion(**pub, 1).ok());
  EXPECT_EQ(Counters(port_).epochs, 0u);
}

}  // namespace
}  // namespace weightbus
