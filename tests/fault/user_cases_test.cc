// SPDX-License-Identifier: Apache-2.0
// Faults named after what users hit (issue 17), with real processes (fault_harness.h), over
// every stack they apply to; the cases other suites already cover are listed in
// docs/RELIABILITY.md under their names, pointing at those tests.
#include <signal.h>

#include <filesystem>
#include <memory>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "fault/fault_harness.h"
#include "test_model.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::testing::fault {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(30);
constexpr uint64_t kSeed = 17;
constexpr uint64_t kBytes = 1 << 18;

std::vector<std::string> PeerArgs(const std::string& role, const std::string& uri,
                                  std::vector<std::string> more) {
  std::vector<std::string> argv = {BinaryPath("tests/wb_test_peer"),
                                   role,
                                   uri,
                                   "--seed",
                                   std::to_string(kSeed),
                                   "--bytes",
                                   std::to_string(kBytes)};
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

class UserCaseTest : public ::testing::TestWithParam<Stack> {
 protected:
  void SetUp() override {
    channel_ = MakeChannel(GetParam(), dir_);
    if (!channel_.skip.empty()) GTEST_SKIP() << channel_.skip;
    env_.emplace(GetParam().env.env);
  }
  bool OnDisk() const { return absl::StrContains(GetParam().uri, "disk://"); }
  // The pause point where a subscriber holds a version it has begun to read: disk pinned it,
  // ucx holds a lease on it with half of its bytes requested.
  std::string ReadingPoint() const { return OnDisk() ? "disk.before_read" : "ucx.during_get"; }
  // The query that makes the channel hold only its newest version.
  std::string KeepOne() const {
    std::string q = GetParam().kept + "=1";
    if (absl::StrContains(GetParam().uri, "+")) q += "&keyframe_interval=1";
    return q;
  }

  // A `wb_test_peer serve` process on `c`, not started.
  PeerProcess Publisher(const Channel& c, const std::string& name,
                        std::map<std::string, std::string> extra_env = {}) const {
    std::map<std::string, std::string> env = c.env;
    env.insert(extra_env.begin(), extra_env.end());
    return PeerProcess(PeerProcess::Role::kPublisher, name,
                       PeerArgs("serve", c.uri, {"--timeout-s", "30"}), env, dir_ / (name + ".log"),
                       kTimeout);
  }
  // Starts `pub` and has it publish `version`.
  static void StartAndPublish(PeerProcess& pub, uint64_t version, Tally& tally) {
    ASSERT_TRUE(pub.Start(tally).ok()) << pub.LogTail();
    pub.Send(version);
    ASSERT_TRUE(pub.AwaitAnswered(absl::Now() + kTimeout, tally)) << pub.LogTail();
    ASSERT_EQ(pub.published(), version) << pub.LogTail();
  }

  ScratchDir dir_;
  Channel channel_;
  std::optional<ScopedEnvs> env_;
};

// A subscriber much slower than the others: held in the middle of reading version 1 (a pause
// point; it renews no lease), on a channel that keeps one version (one staging slot) with a
// 1 s lease. The publisher publishes versions 2..9 meanwhile and two other subscribers receive
// each one, all while the slow one is still held: it slowed them by at most its lease. Released,
// it hands over version 1 whole or refuses it (its lease expired), never torn, and catches up.
TEST_P(UserCaseTest, ASubscriberMuchSlowerThanTheOthersSlowsThemAtMostByItsLease) {
  Channel c = MakeChannel(GetParam(), dir_, KeepOne() + "&lease=1s");
  if (OnDisk()) c = MakeChannel(GetParam(), dir_, KeepOne());
  Tally tally;
  PeerProcess pub = Publisher(c, "publisher");
  ASSERT_NO_FATAL_FAILURE(StartAndPublish(pub, 1, tally));
  PausePoint reading(ReadingPoint());
  auto slow_env = c.env;
  slow_env["WEIGHTBUS_FAILPOINTS"] = reading.Spec();
  PeerProcess slow(PeerProcess::Role::kSubscriber, "slow",
                   PeerArgs("follow", c.uri, {"--until", "9", "--timeout-s", "30"}), slow_env,
                   dir_ / "slow.log", kTimeout);
  ASSERT_TRUE(slow.Start(tally).ok());
  ASSERT_TRUE(reading.WaitReached(kTimeout)) << slow.LogTail();
  std::vector<std::unique_ptr<PeerProcess>> fast;
  for (int i = 0; i < 2; ++i) {
    fast.push_back(std::make_unique<PeerProcess>(
        PeerProcess::Role::kSubscriber, absl::StrFormat("fast%d", i),
        PeerArgs("follow", c.uri, {"--until", "9", "--timeout-s", "30"}), c.env,
        dir_ / absl::StrFormat("fast%d.log", i), kTimeout));
    ASSERT_TRUE(fast.back()->Start(tally).ok());
  }
  for (uint64_t v = 2; v <= 9; ++v) {
    pub.Send(v);
    ASSERT_TRUE(pub.AwaitAnswered(absl::Now() + kTimeout, tally)) << pub.LogTail();
    ASSERT_EQ(pub.published(), v) << "publish refused while a subscriber is slow: "
                                  << pub.LogTail();
    for (auto& f : fast) ASSERT_TRUE(f->AwaitHolds(v, absl::Now() + kTimeout, tally));
  }
  EXPECT_EQ(slow.held(), 0u) << "still held at " << ReadingPoint();
  EXPECT_TRUE(slow.CheckAlive(tally));
  reading.Release();
  ASSERT_TRUE(slow.AwaitHolds(9, absl::Now() + kTimeout, tally)) << slow.LogTail();
  const absl::Time deadline = absl::Now() + kTimeout;
  for (auto& f : fast) f->Finish(deadline, tally);
  slow.Finish(deadline, tally);
  pub.Finish(deadline, tally);
  for (const PeerProcess* p : {&pub, &slow, fast[0].get(), fast[1].get()}) {
    EXPECT_TRUE(p->problems().empty()) << p->problems()[0];
  }
  EXPECT_EQ(tally.torn + tally.hangs + tally.crashes, 0) << tally.Describe();
  absl::PrintF("[ case ] %s slow subscriber: %s\n", GetParam().name, tally.Describe());
}

// Publishes racing a pause: a subscriber process paused (a pause point) after it picked version
// 1 and before it fetches it, on a channel that keeps one version (one staging slot, a 1 s
// lease): the publisher publishes versions 2..6 meanwhile, each within its timeout. Released, the
// subscriber hands over version 1 whole or refuses it (its pin or lease outlived, DataLoss or
// Unavailable), never torn, and then receives version 6.
TEST_P(UserCaseTest, PublishesRacingAPausedSubscriberNeverTearItsVersion) {
  Channel c = MakeChannel(GetParam(), dir_, KeepOne() + (OnDisk() ? "" : "&lease=1s"));
  Tally tally;
  PeerProcess pub = Publisher(c, "publisher");
  ASSERT_NO_FATAL_FAILURE(StartAndPublish(pub, 1, tally));
  PausePoint fetch("core.before_fetch");
  auto env = c.env;
  env["WEIGHTBUS_FAILPOINTS"] = fetch.Spec();
  PeerProcess sub(PeerProcess::Role::kSubscriber, "paused",
                  PeerArgs("follow", c.uri, {"--until", "6", "--timeout-s", "30"}), env,
                  dir_ / "sub.log", kTimeout);
  ASSERT_TRUE(sub.Start(tally).ok());
  ASSERT_TRUE(fetch.WaitReached(kTimeout)) << sub.LogTail();
  for (uint64_t v = 2; v <= 6; ++v) pub.Send(v);
  ASSERT_TRUE(pub.AwaitAnswered(absl::Now() + kTimeout, tally)) << pub.LogTail();
  EXPECT_EQ(pub.published(), 6u) << pub.LogTail();
  EXPECT_EQ(tally.publish_failures, 0) << pub.LogTail();
  fetch.Release();
  ASSERT_TRUE(sub.AwaitHolds(6, absl::Now() + kTimeout, tally)) << sub.LogTail();
  sub.Finish(absl::Now() + kTimeout, tally);
  pub.Finish(absl::Now() + kTimeout, tally);
  for (const PeerProcess* p : {&pub, &sub}) {
    EXPECT_TRUE(p->problems().empty()) << p->problems()[0];
  }
  EXPECT_EQ(tally.torn + tally.hangs + tally.crashes, 0) << tally.Describe();
  absl::PrintF("[ case ] %s publishes racing a pause: %s; subscriber saw: %s\n", GetParam().name,
               tally.Describe(), absl::StrJoin(sub.lines(), " | "));
}

// A stale session left by a crashed trainer: the trainer process SIGKILLed in the middle of
// publishing version 2 (disk: its files written, not renamed; ucx: staged, not yet visible),
// leaving its lock, temporary files or port behind. A new trainer process takes over cleanly: it
// opens the channel, publishes version 3, and a subscriber that held version 1 from the dead one
// receives version 3 whole; on disk nothing of the crashed attempt is left.
TEST_P(UserCaseTest, AStaleSessionOfACrashedTrainerIsTakenOverByTheNextTrainer) {
  Tally tally;
  // Once per version: version 2's files are written, or its bytes staged.
  PausePoint mid(OnDisk() ? "disk.before_rename" : "ucx.after_copy", 2);
  PeerProcess crashed = Publisher(channel_, "crashed", {{"WEIGHTBUS_FAILPOINTS", mid.Spec()}});
  ASSERT_NO_FATAL_FAILURE(StartAndPublish(crashed, 1, tally));
  PeerProcess sub(PeerProcess::Role::kSubscriber, "subscriber",
                  PeerArgs("follow", channel_.uri, {"--until", "3", "--timeout-s", "30"}),
                  channel_.env, dir_ / "sub.log", kTimeout);
  ASSERT_TRUE(sub.Start(tally).ok());
  ASSERT_TRUE(sub.AwaitHolds(1, absl::Now() + kTimeout, tally)) << sub.LogTail();
  crashed.Send(2);
  ASSERT_TRUE(mid.WaitReached(kTimeout)) << crashed.LogTail();
  crashed.KillAndReap(tally);
  if (OnDisk()) {
    EXPECT_EQ(ReadFileOrDie(dir_.path() + "/channel/LATEST"), "1\n");
  }
  PeerProcess next = Publisher(channel_, "next");
  ASSERT_NO_FATAL_FAILURE(StartAndPublish(next, 3, tally));
  ASSERT_TRUE(sub.AwaitHolds(3, absl::Now() + kTimeout, tally)) << sub.LogTail();
  if (OnDisk()) {
    for (const std::string& path : ListTree(dir_.path() + "/channel")) {
      EXPECT_FALSE(absl::StrContains(path, ".tmp-")) << path << " left by the crashed trainer";
    }
  }
  sub.Finish(absl::Now() + kTimeout, tally);
  next.Finish(absl::Now() + kTimeout, tally);
  for (const PeerProcess* p : {&crashed, &next, &sub}) {
    EXPECT_TRUE(p->problems().empty()) << p->problems()[0];
  }
  EXPECT_EQ(tally.torn + tally.hangs + tally.crashes, 0) << tally.Describe();
}

// A barrier reused across rounds (Publisher::WaitForReceivers: the version is the round's key):
// two subscriber processes acknowledge rounds 1 and 2; one is stopped (SIGSTOP) before round 3,
// whose barrier must then not be met by that subscriber's receipt of round 2 (DeadlineExceeded
// naming 1 of the 2), and is met once it runs again (SIGCONT).
TEST_P(UserCaseTest, ABarrierReusedAcrossRoundsCountsOnlyThisRoundsReceivers) {
  auto caps = StackCapabilitiesOf(channel_.uri);
  ASSERT_TRUE(caps.ok()) << caps.status();
  if (!caps->wait_for_receivers) {
    GTEST_SKIP() << GetParam().name << " declares no wait_for_receivers (no receipts to count)";
  }
  auto pub = Publisher::Open(channel_.uri);
  ASSERT_TRUE(pub.ok()) << pub.status();
  Tally tally;
  std::vector<std::unique_ptr<PeerProcess>> subs;
  for (int i = 0; i < 2; ++i) {
    subs.push_back(std::make_unique<PeerProcess>(
        PeerProcess::Role::kSubscriber, absl::StrFormat("subscriber%d", i),
        PeerArgs("follow", channel_.uri, {"--until", "4", "--timeout-s", "30"}), channel_.env,
        dir_ / absl::StrFormat("sub%d.log", i), kTimeout));
    ASSERT_TRUE(subs.back()->Start(tally).ok());
  }
  auto round = [&](uint64_t v) {
    auto t = MakeVersion(kSeed, v, kBytes);
    return (*pub)->Publish(v, Views(t), {}, kTimeout);
  };
  for (uint64_t v = 1; v <= 2; ++v) {
    ASSERT_TRUE(round(v).ok());
    ASSERT_TRUE((*pub)->WaitForReceivers(v, 2, kTimeout).ok()) << "round " << v;
    for (auto& s : subs) ASSERT_TRUE(s->AwaitHolds(v, absl::Now() + kTimeout, tally));
  }
  ::kill(subs[1]->pid(), SIGSTOP);
  ASSERT_TRUE(round(3).ok());
  ASSERT_TRUE(subs[0]->AwaitHolds(3, absl::Now() + kTimeout, tally));
  const absl::Status short_wait = (*pub)->WaitForReceivers(3, 2, absl::Milliseconds(300));
  EXPECT_EQ(short_wait.code(), absl::StatusCode::kDeadlineExceeded) << short_wait;
  EXPECT_TRUE(absl::StrContains(short_wait.message(), "1 of the 2")) << short_wait;
  ::kill(subs[1]->pid(), SIGCONT);
  EXPECT_TRUE((*pub)->WaitForReceivers(3, 2, kTimeout).ok());
  ASSERT_TRUE(round(4).ok());
  EXPECT_TRUE((*pub)->WaitForReceivers(4, 2, kTimeout).ok());
  for (auto& s : subs) s->Finish(absl::Now() + kTimeout, tally);
  EXPECT_EQ(tally.torn + tally.hangs + tally.crashes, 0) << tally.Describe();
  for (auto& s : subs) EXPECT_TRUE(s->problems().empty()) << s->problems()[0];
}

// The channel directory deleted (rm -r) under a subscriber process waiting for the next
// version: its waits go on ending within their timeout (DeadlineExceeded), it does not crash,
// and once a new publisher recreates the channel and publishes, it receives that version whole.
TEST_P(UserCaseTest, TheChannelDirectoryDeletedUnderAWaitingSubscriber) {
  if (!OnDisk()) GTEST_SKIP() << GetParam().name << " has no channel directory";
  Tally tally;
  {
    auto pub = Publisher::Open(channel_.uri);
    ASSERT_TRUE(pub.ok()) << pub.status();
    auto t = MakeVersion(kSeed, 1, kBytes);
    ASSERT_TRUE((*pub)->Publish(1, Views(t), {}, kTimeout).ok());
  }
  PeerProcess sub(PeerProcess::Role::kSubscriber, "subscriber",
                  PeerArgs("follow", channel_.uri, {"--until", "5", "--timeout-s", "1"}),
                  channel_.env, dir_ / "sub.log", absl::Seconds(1));
  ASSERT_TRUE(sub.Start(tally).ok());
  ASSERT_TRUE(sub.AwaitHolds(1, absl::Now() + kTimeout, tally)) << sub.LogTail();
  // Waiting for version 2: each wait ends in DeadlineExceeded after its 1 s; one has.
  auto await_wait_error = [&] {
    const size_t before = tally.wait_errors;
    while (tally.wait_errors == static_cast<int64_t>(before)) {
      if (!sub.Next(absl::Now() + kTimeout, tally)) return false;
    }
    return true;
  };
  ASSERT_TRUE(await_wait_error()) << sub.LogTail();
  const std::string channel_dir = dir_.path() + "/channel";
  std::filesystem::remove_all(channel_dir);
  ASSERT_FALSE(std::filesystem::exists(channel_dir));
  ASSERT_TRUE(await_wait_error()) << "a wait on the deleted directory never ended";
  {
    auto pub = Publisher::Open(channel_.uri);  // a new trainer recreates it
    ASSERT_TRUE(pub.ok()) << pub.status();
    auto t = MakeVersion(kSeed, 5, kBytes);
    ASSERT_TRUE((*pub)->Publish(5, Views(t), {}, kTimeout).ok());
  }
  const bool received = sub.AwaitHolds(5, absl::Now() + absl::Seconds(8), tally);
  std::string lines;
  for (const auto& l : sub.lines()) lines += l + "\n";
  EXPECT_TRUE(received) << lines << sub.LogTail();
  sub.Finish(absl::Now() + kTimeout, tally);
  EXPECT_EQ(tally.torn + tally.hangs + tally.crashes, 0) << tally.Describe();
  EXPECT_TRUE(sub.problems().empty()) << sub.problems()[0];
  absl::PrintF("[ case ] %s channel deleted: %s\n", GetParam().name, tally.Describe());
}

INSTANTIATE_TEST_SUITE_P(Stacks, UserCaseTest, ::testing::ValuesIn(ProcessStacks()),
                         [](const ::testing::TestParamInfo<Stack>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace weightbus::testing::fault
