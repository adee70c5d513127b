// SPDX-License-Identifier: Apache-2.0
// Random faults over every transport stack other processes reach (ProcessStacks: disk, ucx over
// shared memory and tcp, delta over disk and ucx): a publisher process and subscriber processes
// (fault_harness.h), and in each iteration one of them SIGKILLed (then restarted) or SIGSTOPped
// (then SIGCONTed) at a random point of a burst of publishes. After each: no version torn or
// unverified, none going backwards, no wait past its timeout, nobody crashed (the exit status of
// every process is checked), every survivor goes on to the next version and a restarted process
// catches up. Also: 8 subscribers x N versions with every process's peak RSS flat.
// The seed is printed; `fault_test --seed S` replays the draws (docs/RELIABILITY.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "fault/fault_harness.h"
#include "test_model.h"

namespace weightbus::testing::fault {
namespace {

constexpr absl::Duration kSubscriberTimeout = absl::Seconds(10);
constexpr absl::Duration kPublisherTimeout = absl::Seconds(20);
// How long progress may take after a fault before it counts as a hang: well past every timeout.
constexpr absl::Duration kProgress = absl::Seconds(90);
// The version that ends a run: every subscriber follows until it holds it.
constexpr uint64_t kFinal = uint64_t{1} << 40;

class FaultTest : public ::testing::TestWithParam<Stack> {
 protected:
  void SetUp() override {
    channel_ = MakeChannel(GetParam(), dir_);
    if (!channel_.skip.empty()) GTEST_SKIP() << channel_.skip;
  }

  std::unique_ptr<PeerProcess> Publisher(const std::string& name) {
    return std::make_unique<PeerProcess>(
        PeerProcess::Role::kPublisher, name,
        std::vector<std::string>{BinaryPath("tests/wb_test_peer"), "serve", channel_.uri, "--seed",
                                 std::to_string(seed_), "--bytes",
                                 std::to_string(GlobalFlags().bytes), "--timeout-s",
                                 absl::StrFormat("%g", absl::ToDoubleSeconds(kPublisherTimeout))},
        channel_.env, dir_ / (name + ".log"), kPublisherTimeout);
  }
  std::unique_ptr<PeerProcess> Subscriber(const std::string& name, uint64_t until) {
    return std::make_unique<PeerProcess>(
        PeerProcess::Role::kSubscriber, name,
        std::vector<std::string>{BinaryPath("tests/wb_test_peer"), "follow", channel_.uri,
                                 "--until", std::to_string(until), "--seed", std::to_string(seed_),
                                 "--bytes", std::to_string(GlobalFlags().bytes), "--timeout-s",
                                 absl::StrFormat("%g", absl::ToDoubleSeconds(kSubscriberTimeout))},
        channel_.env, dir_ / (name + ".log"), kSubscriberTimeout);
  }

  // Every problem any process reported, one per line ("" when none).
  static std::string Problems(const std::vector<PeerProcess*>& all) {
    std::vector<std::string> lines;
    for (const PeerProcess* p : all) {
      lines.insert(lines.end(), p->problems().begin(), p->problems().end());
    }
    return absl::StrJoin(lines, "\n");
  }
  // The problems and the end of every process's log, for a failure message.
  static std::string Explain(const std::vector<PeerProcess*>& all) {
    std::string out = Problems(all);
    for (const PeerProcess* p : all) {
      out += absl::StrFormat("\n%s holds %d, published %d; %s", p->name(), p->held(),
                             p->published(), p->LogTail());
    }
    return out;
  }

  ScratchDir dir_;
  Channel channel_;
  uint64_t seed_ = 1;
};

TEST_P(FaultTest, RandomKillsAndStopsNeverTearAVersionNorHangNorCrashASurvivor) {
  const uint64_t seed = SeedFor(GetParam().name);
  seed_ = seed % 1000 + 1;  // the model's seed
  std::mt19937_64 rng(seed);
  const std::string replay = absl::StrFormat(
      "replay: build/tests/fault/fault_test --seed %d --iterations %d "
      "--gtest_filter='*Random*/%s' (stack seed %d)",
      GlobalFlags().seed, GlobalFlags().iterations, GetParam().name, seed);
  absl::PrintF("[ fault ] %s: %d iterations; %s\n", GetParam().name, GlobalFlags().iterations,
               replay);
  SCOPED_TRACE(replay);
  Tally tally;
  auto pub = Publisher("publisher");
  std::vector<std::unique_ptr<PeerProcess>> subs;
  for (int i = 0; i < 2; ++i)
    subs.push_back(Subscriber(absl::StrFormat("subscriber%d", i), kFinal));
  std::vector<PeerProcess*> all = {pub.get()};
  for (auto& s : subs) all.push_back(s.get());
  ASSERT_TRUE(pub->Start(tally).ok()) << pub->LogTail();
  for (auto& s : subs) ASSERT_TRUE(s->Start(tally).ok());

  uint64_t next = 1;
  // Publishes one version and waits until every subscriber holds it: the survivors go on, a
  // restarted one caught up. False (a hang) when that does not happen in kProgress.
  auto progress = [&]() -> bool {
    const absl::Time deadline = absl::Now() + kProgress;
    for (int attempt = 0; attempt < 3; ++attempt) {
      const uint64_t v = next++;
      pub->Send(v);
      if (!pub->AwaitAnswered(deadline, tally)) return false;
      if (pub->published() != v) continue;  // refused (counted); the next one must go
      for (auto& s : subs) {
        if (!s->AwaitHolds(v, deadline, tally)) return false;
      }
      return true;
    }
    return false;
  };
  ASSERT_TRUE(progress()) << Explain(all);
  absl::Duration burst = absl::Milliseconds(50);  // how long the last burst took
  for (int it = 0; it < GlobalFlags().iterations; ++it) {
    ++tally.iterations;
    // The draws: who, what, when (a fraction of a burst), and for how long a stop lasts.
    PeerProcess* victim = rng() % 2 == 0 ? pub.get() : subs[rng() % subs.size()].get();
    const bool kill = rng() % 2 == 0;
    const double when = std::uniform_real_distribution<double>(0, 1.2)(rng);
    const absl::Duration stop = absl::Milliseconds(rng() % 400);
    const int versions = 2 + static_cast<int>(rng() % 5);
    const uint64_t newest_before = pub->published();
    SCOPED_TRACE(absl::StrFormat("iteration %d: %s %s after %.2f of a burst of %d versions", it,
                                 kill ? "SIGKILL" : "SIGSTOP", victim->name(), when, versions));
    const absl::Time start = absl::Now();
    for (int i = 0; i < versions; ++i) pub->Send(next++);
    absl::SleepFor(burst * when);  // the random point of the fault (injection, not a wait)
    if (kill) {
      victim->KillAndReap(tally);
      ++tally.restarts;
      ASSERT_TRUE(victim->Start(tally).ok()) << victim->LogTail() << "\n" << Problems(all);
    } else {
      victim->StopFor(stop, tally);
    }
    if (victim != pub.get() || !kill) {
      ASSERT_TRUE(pub->AwaitAnswered(absl::Now() + kProgress, tally))
          << "the burst was never answered\n"
          << Problems(all) << pub->LogTail();
    }
    burst = std::max(absl::Milliseconds(5), absl::Now() - start);
    for (PeerProcess* p : all) EXPECT_TRUE(p->CheckAlive(tally)) << p->name();
    ASSERT_TRUE(progress()) << "no progress after the fault\n" << Explain(all);
    if (kill && victim != pub.get()) {
      // Caught up: the restarted subscriber's first version is at least what was published
      // before its restart (it never handed over anything older than the channel had).
      ASSERT_TRUE(victim->first().has_value());
      EXPECT_GE(*victim->first(), newest_before) << victim->name();
    }
    ASSERT_EQ(Problems(all), "");
  }
  pub->Send(kFinal);
  const absl::Time deadline = absl::Now() + kProgress;
  ASSERT_TRUE(pub->AwaitAnswered(deadline, tally)) << Problems(all);
  EXPECT_EQ(pub->published(), kFinal) << pub->LogTail();
  for (auto& s : subs) s->Finish(deadline, tally);
  pub->Finish(deadline, tally);
  absl::PrintF("[ figures ] stack=%s seed=%d %s\n", GetParam().name, seed, tally.Describe());
  EXPECT_EQ(Problems(all), "");
  EXPECT_EQ(tally.torn, 0);
  EXPECT_EQ(tally.hangs, 0);
  EXPECT_EQ(tally.crashes, 0);
  EXPECT_EQ(tally.kills + tally.stops, GlobalFlags().iterations) << "every fault injected";
}

// 8 subscriber processes receive every one of N versions (each checked byte for byte); every
// process's peak resident set (VmHWM) must be flat: from version N/2 to N it grows by less than
// one version, or under a delta layer by less than its keyframe interval's worth of versions
// (kKeyframeInterval: its base and the chain since a keyframe, whose peaks can still land in
// the second half of a short run); a leak of a tensor per version exceeds either. The growth
// from version 10 to N is reported.
TEST_P(FaultTest, EverySubscribersPeakRssStaysFlatOverManyVersions) {
  constexpr int kKeyframeInterval = 8;
  const bool layered = absl::StrContains(GetParam().uri, "+");
  if (layered) {
    channel_ =
        MakeChannel(GetParam(), dir_, absl::StrFormat("keyframe_interval=%d", kKeyframeInterval));
  }
  seed_ = SeedFor(GetParam().name) % 1000 + 1;
  const int n = std::max(GlobalFlags().memory_versions, 11);
  Tally tally;
  auto pub = Publisher("publisher");
  std::vector<std::unique_ptr<PeerProcess>> subs;
  for (int i = 0; i < GlobalFlags().memory_subscribers; ++i) {
    subs.push_back(Subscriber(absl::StrFormat("subscriber%d", i), n));
  }
  std::vector<PeerProcess*> all = {pub.get()};
  for (auto& s : subs) all.push_back(s.get());
  ASSERT_TRUE(pub->Start(tally).ok()) << pub->LogTail();
  for (auto& s : subs) ASSERT_TRUE(s->Start(tally).ok());
  std::map<uint64_t, int64_t> publisher_hwm;
  for (uint64_t v = 1; v <= static_cast<uint64_t>(n); ++v) {
    const absl::Time deadline = absl::Now() + kProgress;
    pub->Send(v);
    ASSERT_TRUE(pub->AwaitAnswered(deadline, tally)) << Problems(all);
    ASSERT_EQ(pub->published(), v) << pub->LogTail();
    publisher_hwm[v] = pub->hwm_kib();
    // Lockstep: every subscriber receives every version.
    for (auto& s : subs) ASSERT_TRUE(s->AwaitHolds(v, deadline, tally)) << Problems(all);
  }
  const absl::Time deadline = absl::Now() + kProgress;
  for (auto& s : subs) s->Finish(deadline, tally);
  pub->Finish(deadline, tally);
  EXPECT_EQ(Problems(all), "");
  EXPECT_EQ(tally.versions_checked, int64_t{n} * GlobalFlags().memory_subscribers);

  int64_t largest = 0, total = 0;
  for (const OwnedTensor& t : MakeVersion(seed_, 1, GlobalFlags().bytes)) {
    largest = std::max<int64_t>(largest, t.bytes.size());
    total += t.bytes.size();
  }
  const int64_t version_kib = (layered ? kKeyframeInterval : 1) * (total + 1023) / 1024;
  std::vector<std::string> growth;
  auto check = [&](const std::string& name, std::map<uint64_t, int64_t>& hwm) {
    const int64_t at10 = hwm[10], half = hwm[n / 2], last = hwm[n];
    growth.push_back(absl::StrFormat("%s %d->%d KiB (+%d; +%d from version %d)", name, at10, last,
                                     last - at10, last - half, n / 2));
    EXPECT_GT(at10, 0) << name;
    EXPECT_LE(last - half, version_kib) << name << ": peak RSS grew from version " << n / 2
                                        << " to " << n << " by more than one version";
  };
  check("publisher", publisher_hwm);
  for (auto& s : subs) check(s->name(), s->hwm_at());
  absl::PrintF(
      "[ memory ] stack=%s subscribers=%d versions=%d version_bytes=%d largest_tensor=%d "
      "publisher_open=%d KiB publisher_peak=%d KiB; %s\n",
      GetParam().name, GlobalFlags().memory_subscribers, n, total, largest, pub->open_hwm_kib(),
      pub->hwm_kib(), absl::StrJoin(growth, ", "));
}

INSTANTIATE_TEST_SUITE_P(Stacks, FaultTest, ::testing::ValuesIn(ProcessStacks()),
                         [](const ::testing::TestParamInfo<Stack>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace weightbus::testing::fault
