// SPDX-License-Identifier: Apache-2.0
// ucx:// with real processes (tests/wb_test_peer and the weightbus CLI), each suite run with
// UCX_TLS set to shared memory and to tcp on loopback: one publisher followed by 1, 2 and 4
// subscriber processes over 50 versions plus a late joiner, a subscriber SIGKILLed mid-transfer,
// a publisher SIGKILLed mid-transfer, and the CLI's --until-subscribers / --serve.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "test_model.h"
#include "test_support.h"
#include "ucx_tls.h"
#include "weightbus/safetensors.hpp"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using ::weightbus::testing::Child;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::ReadFileOrDie;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Views;

using ::weightbus::testing::kShm;
using ::weightbus::testing::kTcp;
using ::weightbus::testing::Tls;

std::string Peer() { return testing::BinaryPath("tests/wb_test_peer"); }
std::string Cli() { return testing::BinaryPath("tools/weightbus"); }

using ::weightbus::testing::FreePort;

using ::weightbus::testing::ExitCode;

// The contents of `path`, or "" when it does not exist yet.
std::string ReadLog(const std::string& path) {
  return std::filesystem::exists(path) ? ReadFileOrDie(path) : "";
}

// Why UCX cannot run here with this process's UCX environment ("" when it can).
std::string UcxUnusable() {
  auto probe = Subscriber::Open(absl::StrFormat("ucx://127.0.0.1:%d/probe", FreePort()));
  return probe.ok() ? "" : std::string(probe.status().message());
}

class UcxFollowTest : public ::testing::TestWithParam<std::tuple<Tls, int>> {};

TEST_P(UcxFollowTest, SubscriberProcessesFollowFiftyVersionsBitExactAndALateJoinerGetsTheNewest) {
  const auto& [tls, subscribers] = GetParam();
  const testing::ScopedEnvs tls_env(tls.env);
  if (std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << "UCX unusable: " << why;
  ScratchDir dir;
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/follow", FreePort());
  const std::vector<std::string> model = {"--seed", "21", "--bytes", "262144"};
  auto args = [&](std::vector<std::string> a) {
    a.insert(a.end(), model.begin(), model.end());
    return a;
  };
  // The publisher serves until every subscriber and the late joiner verified version 50.
  auto pub = Child::Start(
      args({Peer(), "publish", uri, "--versions", "50", "--interval-ms", "10",
            "--until-subscribers", std::to_string(subscribers + 1), "--timeout-s", "60"}),
      tls.env, dir / "pub.log");
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::vector<Child> subs;
  for (int i = 0; i < subscribers; ++i) {
    auto c = Child::Start(args({Peer(), "subscribe", uri, "--until", "50", "--timeout-s", "60"}),
                          tls.env, dir / absl::StrFormat("sub%d.log", i));
    ASSERT_TRUE(c.ok()) << c.status();
    subs.push_back(*std::move(c));
  }
  ASSERT_TRUE(testing::WaitUntil(
      [&] { return absl::StrContains(ReadLog(dir / "pub.log"), "published 50"); },
      absl::Seconds(60)))
      << ReadLog(dir / "pub.log");
  auto late = Child::Start(args({Peer(), "subscribe", uri, "--until", "50", "--timeout-s", "30"}),
                           tls.env, dir / "late.log");
  ASSERT_TRUE(late.ok());
  for (int i = 0; i < subscribers; ++i) {
    auto s = subs[i].Wait(absl::Seconds(90));
    ASSERT_TRUE(s.ok()) << s.status();
    const std::string log = ReadLog(dir / absl::StrFormat("sub%d.log", i));
    EXPECT_EQ(ExitCode(*s), 0) << log;
    EXPECT_THAT(log, HasSubstr("received 50 ok"));
  }
  auto l = late->Wait(absl::Seconds(60));
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(ExitCode(*l), 0) << ReadLog(dir / "late.log");
  EXPECT_THAT(ReadLog(dir / "late.log"), ::testing::StartsWith("received 50 ok"));
  auto p = pub->Wait(absl::Seconds(60));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(ExitCode(*p), 0) << ReadLog(dir / "pub.log");
  EXPECT_THAT(ReadLog(dir / "pub.log"),
              HasSubstr(absl::StrFormat("%d subscribers have 50", subscribers + 1)));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxFollowTest,
                         ::testing::Combine(::testing::Values(kShm, kTcp),
                                            ::testing::Values(1, 2, 4)),
                         [](const ::testing::TestParamInfo<std::tuple<Tls, int>>& info) {
                           return absl::StrFormat("%s_%dsubscribers", std::get<0>(info.param).name,
                                                  std::get<1>(info.param));
                         });

class UcxProcessTest : public ::testing::TestWithParam<Tls> {
 protected:
  void SetUp() override {
    tls_env_.emplace(GetParam().env);
    if (std::string why = UcxUnusable(); !why.empty()) {
      GTEST_SKIP() << "UCX unusable: " << why;
    }
    uri_ = absl::StrFormat("ucx://127.0.0.1:%d/policy", FreePort());
  }
  std::optional<testing::ScopedEnvs> tls_env_;  // for the whole test, restored after it
  std::string uri_;
  ScratchDir dir_;
};

TEST_P(UcxProcessTest, SubscriberKilledMidTransferBlocksNeitherThePublisherNorOthers) {
  // One staging slot and a 60 s lease: if the dead subscriber's hold outlived its connection,
  // the publisher could not publish its next version for a minute.
  const std::vector<std::string> model = {"--seed", "5", "--bytes", "1048576"};
  auto args = [&](std::vector<std::string> a) {
    a.insert(a.end(), model.begin(), model.end());
    return a;
  };
  const absl::Time start = absl::Now();
  // Both subscribers hold version 1 before the rest is published, so the victim's second fetch
  // (where its fail point kills it) is always a transfer, however late it started.
  auto pub =
      Child::Start(args({Peer(), "publish", uri_, "--versions", "20", "--interval-ms", "20",
                         "--first-subscribers", "2", "--until-subscribers", "1", "--timeout-s",
                         "40", "--set", "staging_slots=1", "--set", "lease=60s"}),
                   GetParam().env, dir_ / "pub.log");
  ASSERT_TRUE(pub.ok());
  auto victim_env = GetParam().env;  // fail points come only from the environment
  victim_env["WEIGHTBUS_FAILPOINTS"] = "ucx.during_get=kill@2";
  auto victim = Child::Start(args({Peer(), "subscribe", uri_, "--until", "20"}), victim_env,
                             dir_ / "victim.log");
  auto survivor = Child::Start(args({Peer(), "subscribe", uri_, "--until", "20"}), GetParam().env,
                               dir_ / "survivor.log");
  ASSERT_TRUE(victim.ok() && survivor.ok());
  auto v = victim->Wait(absl::Seconds(60));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(ExitCode(*v), 128 + SIGKILL) << ReadLog(dir_ / "victim.log");
  auto s = survivor->Wait(absl::Seconds(60));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(ExitCode(*s), 0) << ReadLog(dir_ / "survivor.log");
  EXPECT_THAT(ReadLog(dir_ / "survivor.log"), HasSubstr("received 20 ok"));
  auto p = pub->Wait(absl::Seconds(60));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(ExitCode(*p), 0) << ReadLog(dir_ / "pub.log");
  EXPECT_THAT(ReadLog(dir_ / "pub.log"), HasSubstr("published 20"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(50)) << "the dead subscriber's lease held";
}

TEST_P(UcxProcessTest, PublisherKilledMidTransferFailsSubscribersInTimeKeepingTheirVersion) {
  // The publisher process serves versions 1 and 2 (2 only once this process holds 1); this
  // process receives 1, then is held in the middle of receiving 2 (half of its bytes requested,
  // a get finished), where the publisher is SIGKILLed; then it goes on.
  auto pub = Child::Start({Peer(), "publish", uri_, "--versions", "2", "--first-subscribers", "1",
                           "--seed", "8", "--bytes", "1048576", "--serve-ms", "60000"},
                          GetParam().env, dir_ / "pub.log");
  ASSERT_TRUE(pub.ok());
  testing::PausePoint mid_get("ucx.during_get", 2);
  auto sub = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", mid_get.Spec());
    return Subscriber::Open(uri_);
  }();
  ASSERT_TRUE(sub.ok());
  auto first = (*sub)->WaitForVersion(1, absl::Seconds(30));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ((*first)->version(), 1u);
  auto v1 = MakeVersion(8, 1, 1048576);
  absl::StatusOr<std::unique_ptr<Update>> second;
  absl::Time done;
  std::thread waiter([&] {
    second = (*sub)->WaitForVersion(2, absl::Seconds(20));
    done = absl::Now();
  });
  if (!mid_get.WaitReached(absl::Seconds(30))) {
    mid_get.Release();
    waiter.join();
    FAIL() << "version 2's transfer never reached its middle: " << second.status() << "\n"
           << ReadLog(dir_ / "pub.log");
  }
  const absl::Time killed = absl::Now();
  pub->Kill(SIGKILL);
  const absl::StatusOr<int> reaped = pub->Wait(absl::Seconds(10));
  mid_get.Release();
  waiter.join();
  ASSERT_TRUE(reaped.ok()) << reaped.status();
  ASSERT_FALSE(second.ok()) << "version 2 handed over from a publisher killed mid-transfer";
  EXPECT_THAT(second.status().code(),
              ::testing::AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << second.status();
  EXPECT_LT(done - killed, absl::Seconds(20)) << "must fail within its timeout";
  EXPECT_EQ((*sub)->current_version(), std::optional<uint64_t>(1));
  for (const auto& t : v1) {
    const TensorView* got = (*first)->Find(t.name);
    ASSERT_NE(got, nullptr);
    if (!t.bytes.empty()) {
      EXPECT_EQ(std::memcmp(got->data, t.bytes.data(), t.bytes.size()), 0) << t.name;
    }
  }
}

// testing::FreePort reserves its port (tools/process/process.h): no plain bind takes it, the
// publisher's SO_REUSEADDR bind does.
TEST_P(UcxProcessTest, APublisherListensOnAReservedPortThatAPlainBindCannotTake) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_NE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  EXPECT_EQ(errno, EADDRINUSE);
  ::close(fd);
  auto pub = Publisher::Open(absl::StrFormat("ucx://127.0.0.1:%d/reserved", port));
  ASSERT_TRUE(pub.ok()) << pub.status();
  EXPECT_TRUE(process::WaitForListener(port, absl::Now() + absl::Seconds(30)));
}

TEST_P(UcxProcessTest, CliPublishServesUntilSubscribersHoldTheVersion) {
  const std::string model = dir_ / "model.safetensors";
  auto tensors = MakeVersion(12, 1, 1 << 20);
  ASSERT_TRUE(safetensors::WriteFile(model, Views(tensors), {{"format", "pt"}}).ok());
  auto pub = Child::Start({Cli(), "publish", uri_, "--from", model, "--version", "3",
                           "--until-subscribers", "2", "--timeout", "60"},
                          GetParam().env, dir_ / "pub.log");
  ASSERT_TRUE(pub.ok());
  for (int i = 0; i < 2; ++i) {
    auto sub = testing::RunCommand({Cli(), "subscribe", uri_, "--to",
                                    dir_ / absl::StrFormat("replica%d", i), "--timeout", "30"},
                                   absl::Seconds(60), GetParam().env);
    ASSERT_TRUE(sub.ok()) << sub.status();
    ASSERT_EQ(sub->exit_code, 0) << sub->output;
    EXPECT_THAT(sub->output, HasSubstr(absl::StrFormat("version 3: %d tensors", tensors.size())));
    auto received = safetensors::ReadFile(dir_ / absl::StrFormat("replica%d/model.safetensors", i));
    ASSERT_TRUE(received.ok()) << received.status();
    for (const auto& t : tensors) {
      const safetensors::Entry* e = received->header.Find(t.name);
      ASSERT_NE(e, nullptr) << t.name;
      auto b = received->Bytes(*e);
      ASSERT_TRUE(std::equal(b.begin(), b.end(), t.bytes.begin(), t.bytes.end())) << t.name;
    }
  }
  auto p = pub->Wait(absl::Seconds(30));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(ExitCode(*p), 0) << ReadLog(dir_ / "pub.log");
  EXPECT_THAT(ReadLog(dir_ / "pub.log"), HasSubstr("2 subscriber(s) hold version 3"));

  // --serve keeps a publisher up for a while, then it exits on its own.
  const absl::Time start = absl::Now();
  auto served = testing::RunCommand(
      {Cli(), "publish", uri_, "--from", model, "--version", "1", "--serve", "0.5"},
      absl::Seconds(30), GetParam().env);
  ASSERT_TRUE(served.ok());
  EXPECT_EQ(served->exit_code, 0) << served->output;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(500));
  // A transport that cannot count receivers says so.
  auto disk = testing::RunCommand({Cli(), "publish", "disk://" + dir_.path() + "/ch", "--from",
                                   model, "--version", "1", "--until-subscribers", "1"},
                                  absl::Seconds(30), GetParam().env);
  ASSERT_TRUE(disk.ok());
  EXPECT_EQ(disk->exit_code, 1) << disk->output;
  EXPECT_THAT(disk->output, HasSubstr("UNIMPLEMENTED"));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxProcessTest, ::testing::Values(kShm, kTcp),
                         [](const ::testing::TestParamInfo<Tls>& info) { return info.param.name; });

}  // namespace
}  // namespace weightbus

namespace weightbus {
namespace {

// UCX's own log handler prints to stdout, the host program's (a vLLM server's, a trainer's):
// its warnings must reach weightbus's log on stderr instead.
TEST(UcxLogTest, UcxWarningsGoToStderrNotTheHostsStdout) {
  const testing::ScopedEnvs tls_env(kShm.env);
  if (const std::string why = UcxUnusable(); !why.empty()) GTEST_SKIP() << why;
  testing::ScratchDir dir;
  const std::string err = dir.path() + "/stderr.txt";
  std::map<std::string, std::string> env = kShm.env;
  env["UCX_WB_TEST_UNUSED_VARIABLE"] = "1";  // UCX warns about unknown UCX_* variables
  auto run = testing::RunCommand(
      {"/bin/sh", "-c",
       absl::StrFormat("%s subscribe ucx://127.0.0.1:%d/none --to %s/replica --timeout 1 2>%s",
                       Cli(), FreePort(), dir.path(), err)},
      absl::Seconds(60), env);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->exit_code, 1) << run->output;  // nobody publishes there
  EXPECT_THAT(run->output, ::testing::Not(HasSubstr("UCX_WB_TEST_UNUSED_VARIABLE")));
  EXPECT_THAT(ReadLog(err), HasSubstr("unused env variable: UCX_WB_TEST_UNUSED_VARIABLE"));
}

}  // namespace
}  // namespace weightbus
