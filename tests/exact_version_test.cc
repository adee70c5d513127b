// SPDX-License-Identifier: Apache-2.0
// Subscriber::ReceiveVersion (exactly one version, never another) over every stack with real
// transports (disk, ucx over shared memory and over TCP, the delta layer over disk and ucx):
// a held version arrives bit-exact while newer ones exist; a retired one is NotFound naming
// the versions the channel holds; a future one is waited for; a version below the current one
// is refused; the timeout and Cancel end the wait. Then the tensor-parallel group: publishes
// raced against the receives of a group whose leader picks the version once, proving that no
// worker of a replica ever holds another version than the others, or a mix of two.
#include <unistd.h>

#include <atomic>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "core/registry.h"
#include "expect_tensors.h"
#include "test_model.h"
#include "test_support.h"
#include "ucx_tls.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::weightbus::testing::ExpectSameTensors;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::PausePoint;
using ::weightbus::testing::ScopedEnv;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Tls;
using ::weightbus::testing::Views;

constexpr absl::Duration kTimeout = absl::Seconds(30);
constexpr uint64_t kSeed = 12;
constexpr uint64_t kBytes = 64 << 10;

// One stack. `uri`: {dir} a fresh directory, {port} a free loopback port, {channel} the
// test's channel name. `keep` and `keep_one`
// are queries that keep at least 8 versions / only the newest one on the channel.
struct Stack {
  std::string name;
  std::string uri;
  std::string keep;
  std::string keep_one;
  Tls env = {};
};
void PrintTo(const Stack& s, std::ostream* os) { *os << s.name; }

const std::vector<Stack>& Stacks() {
  static const auto* stacks = new std::vector<Stack>{
      {"disk", "disk://{dir}/{channel}", "retention=8", "retention=1"},
      {"ucx_shm", "ucx://127.0.0.1:{port}/{channel}", "staging_slots=8", "staging_slots=1",
       testing::kShm},
      {"ucx_tcp", "ucx://127.0.0.1:{port}/{channel}", "staging_slots=8", "staging_slots=1",
       testing::kTcp},
      // Every version a keyframe for keep_one: the layer keeps no chain below the newest.
      {"delta_disk", "delta+disk://{dir}/{channel}", "retention=8",
       "retention=1&keyframe_interval=1"},
      {"delta_ucx", "delta+ucx://127.0.0.1:{port}/{channel}", "staging_slots=8",
       "staging_slots=1&keyframe_interval=1", testing::kShm},
  };
  return *stacks;
}

class ExactVersionTest : public ::testing::TestWithParam<Stack> {
 public:
  void SetUp() override {
    env_.emplace(GetParam().env.env);
    const std::string scheme = GetParam().uri.substr(0, GetParam().uri.find("://"));
    transport_ = scheme.substr(scheme.rfind('+') + 1);
    for (const std::string& s : {transport_, scheme.substr(0, scheme.find('+'))}) {
      if (internal::FindTransport(s) == nullptr) {
        GTEST_SKIP() << "this build has no " << s << " transport or layer";
      }
    }
    if (absl::StrContains(GetParam().uri, "{port}")) port_ = testing::FreePort();
    if (transport_ == "ucx") {
      auto probe = Publisher::Open(Uri());
      if (!probe.ok()) {
        GTEST_SKIP() << "UCX cannot run here with " << GetParam().env.name << ": "
                     << probe.status();
      }
    }
  }

  std::string Uri(const std::string& query = "") const {
    std::string uri = absl::StrReplaceAll(
        GetParam().uri,
        {{"{dir}", dir_.path()}, {"{port}", std::to_string(port_)}, {"{channel}", channel_}});
    if (!query.empty()) uri += (absl::StrContains(uri, "?") ? "&" : "?") + query;
    return uri;
  }

  std::unique_ptr<Publisher> OpenPublisher(const std::string& query) {
    auto p = Publisher::Open(Uri(query));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
  std::unique_ptr<Subscriber> OpenSubscriber() {
    auto s = Subscriber::Open(Uri());
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  std::optional<testing::ScopedEnvs> env_;
  ScratchDir dir_;
  int port_ = 0;
  std::string channel_ = "channel";
  std::string transport_;
};

absl::Status PublishVersion(Publisher& pub, uint64_t v) {
  const auto tensors = MakeVersion(kSeed, v, kBytes);
  return pub.Publish(v, Views(tensors), {{"step", std::to_string(v)}}, kTimeout);
}

TEST_P(ExactVersionTest, HeldVersionArrivesBitExactWhileNewerExist) {
  auto pub = OpenPublisher(GetParam().keep);
  auto sub = OpenSubscriber();
  ASSERT_TRUE(pub && sub);
  for (uint64_t v = 1; v <= 4; ++v) ASSERT_TRUE(PublishVersion(*pub, v).ok());

  auto two = sub->ReceiveVersion(2, kTimeout);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ((*two)->version(), 2u);
  EXPECT_EQ((*two)->manifest().metadata.at("step"), "2");
  ExpectSameTensors(**two, MakeVersion(kSeed, 2, kBytes));
  EXPECT_EQ(sub->current_version(), 2u);

  // WaitForVersion(2) would hand over the newest (4); ReceiveVersion(3) gives 3.
  auto three = sub->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(three.ok()) << three.status();
  ExpectSameTensors(**three, MakeVersion(kSeed, 3, kBytes));

  // The same version again: an engine reloading what it holds gets the same bytes.
  auto again = sub->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSameTensors(**again, MakeVersion(kSeed, 3, kBytes));

  // Below the current version: refused, naming both; version 3 stays current.
  auto back = sub->ReceiveVersion(2, kTimeout);
  ASSERT_EQ(back.status().code(), absl::StatusCode::kFailedPrecondition) << back.status();
  EXPECT_TRUE(absl::StrContains(back.status().message(), "cannot receive version 2"))
      << back.status();
  EXPECT_TRUE(absl::StrContains(back.status().message(), "holds version 3")) << back.status();
  EXPECT_EQ(sub->current_version(), 3u);

  // A fresh subscriber can go straight to an older held version, with bindings.
  auto late = OpenSubscriber();
  ASSERT_TRUE(late);
  const auto expected = MakeVersion(kSeed, 1, kBytes);
  std::vector<std::vector<std::byte>> dest;
  for (const auto& t : expected) {
    dest.emplace_back(t.bytes.size(), std::byte{0x5a});
    ASSERT_TRUE(late->Bind(t.name, Destination{t.dtype, t.shape, {}, dest.back().data()}).ok());
  }
  auto one = late->ReceiveVersion(1, kTimeout);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ((*one)->version(), 1u);
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(dest[i], expected[i].bytes) << expected[i].name;
  }
}

TEST_P(ExactVersionTest, RetiredVersionIsNotFoundNamingWhatTheChannelHolds) {
  auto pub = OpenPublisher(GetParam().keep_one);
  auto sub = OpenSubscriber();
  ASSERT_TRUE(pub && sub);
  // Three versions: the delta layer over ucx lets the slot of a keyframe go only at the publish
  // after the next keyframe.
  for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE(PublishVersion(*pub, v).ok());
  // A disk publisher finishes its pending retention pass when destroyed (versions stay); a
  // ucx one must stay to serve.
  if (absl::StrContains(transport_, "disk")) pub.reset();
  auto one = sub->ReceiveVersion(1, kTimeout);
  ASSERT_EQ(one.status().code(), absl::StatusCode::kNotFound) << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "version 1 is no longer on the channel"))
      << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "3; newest seen: 3)")) << one.status();
  EXPECT_TRUE(absl::StrContains(one.status().message(), "version none stays current"))
      << one.status();
  EXPECT_EQ(sub->current_version(), std::nullopt);
  // The subscriber is intact: the held version still comes.
  auto three = sub->ReceiveVersion(3, kTimeout);
  ASSERT_TRUE(three.ok()) << three.status();
  ExpectSameTensors(**three, MakeVersion(kSeed, 3, kBytes));
}

TEST_P(ExactVersionTest, FutureVersionIsWaitedForAndNotSkipped) {
  auto pub = OpenPublisher(GetParam().keep);
  ASSERT_TRUE(pub);
  ASSERT_TRUE(PublishVersion(*pub, 1).ok());
  // Announces when the subscriber has found version 2 not committed yet and starts waiting.
  PausePoint waiting("core.before_version_wait");
  waiting.Release();
  std::unique_ptr<Subscriber> sub;
  {
    const ScopedEnv env("WEIGHTBUS_FAILPOINTS", waiting.Spec());
    sub = OpenSubscriber();
  }
  ASSERT_TRUE(sub);
  absl::StatusOr<std::unique_ptr<Update>> got;
  std::jthread receiver([&] { got = sub->ReceiveVersion(2, kTimeout); });
  ASSERT_TRUE(waiting.WaitReached(kTimeout));
  // 2 and then 3 land while it waits: it must hand over 2, not the newest.
  ASSERT_TRUE(PublishVersion(*pub, 2).ok());
  ASSERT_TRUE(PublishVersion(*pub, 3).ok());
  receiver.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->version(), 2u);
  ExpectSameTensors(**got, MakeVersion(kSeed, 2, kBytes));
}

TEST_P(ExactVersionTest, TimeoutAndCancelEndTheWait) {
  auto pub = OpenPublisher(GetParam().keep);
  ASSERT_TRUE(pub);
  ASSERT_TRUE(PublishVersion(*pub, 1).ok());
  PausePoint waiting("core.before_version_wait", /*pass=*/2);
  waiting.Release();
  std::unique_ptr<Subscriber> sub;
  {
    const ScopedEnv env("WEIGHTBUS_FAILPOINTS", waiting.Spec());
    sub = OpenSubscriber();
  }
  ASSERT_TRUE(sub);
  auto early = sub->ReceiveVersion(5, absl::Milliseconds(50));
  ASSERT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded) << early.status();
  EXPECT_TRUE(absl::StrContains(early.status().message(), "version 5 was not committed"))
      << early.status();
  // The two-bound form: nothing found within the find bound is DeadlineExceeded too.
  auto found_late = sub->ReceiveVersion(5, absl::Milliseconds(50), kTimeout);
  ASSERT_EQ(found_late.status().code(), absl::StatusCode::kDeadlineExceeded);

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

// ---------------------------------------------------------------------------------------------
// A tensor-parallel group: N workers, each its own Subscriber (as each vLLM worker process has
// one), and a leader that picks the version once per round.

class Group {
 public:
  Group(ExactVersionTest& test, int workers) {
    for (int i = 0; i < workers; ++i) {
      auto s = Subscriber::Open(test.Uri());
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
    std::vector<std::thread> threads;
    for (size_t i = 1; i < workers_.size(); ++i) {
      threads.emplace_back([&, i] {
        auto u = workers_[i]->ReceiveVersion(v, kTimeout);
        if (!u.ok()) {
          status[i] = u.status();
          return;
        }
        EXPECT_EQ((*u)->version(), v) << "worker " << i;
        ExpectSameTensors(**u, MakeVersion(kSeed, v, kBytes));
      });
    }
    for (auto& t : threads) t.join();
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

TEST_P(ExactVersionTest, GroupGetsTheLeadersVersionWhenPublishesLandBetweenReceives) {
  auto pub = OpenPublisher(GetParam().keep);
  ASSERT_TRUE(pub);
  Group group(*this, 3);
  ASSERT_EQ(group.size(), 3u);
  auto bystander = OpenSubscriber();  // what a worker calling WaitForVersion(v) would get
  ASSERT_TRUE(bystander);
  uint64_t next = 1;
  ASSERT_TRUE(PublishVersion(*pub, next++).ok());
  for (int round = 0; round < 5; ++round) {
    auto picked = group.leader().WaitForVersion(group.leader().current_version().value_or(0) + 1,
                                                kTimeout);
    ASSERT_TRUE(picked.ok()) << picked.status();
    const uint64_t v = (*picked)->version();
    ExpectSameTensors(**picked, MakeVersion(kSeed, v, kBytes));
    // A publish lands after the leader's receive, before the other workers'.
    ASSERT_TRUE(PublishVersion(*pub, next++).ok());
    auto newest = bystander->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(newest.ok()) << newest.status();
    ASSERT_GT((*newest)->version(), v) << "the old API would have mixed versions " << v << " and "
                                       << (*newest)->version();
    ASSERT_TRUE(group.ReceiveAll(v).ok());
    group.ExpectAllHold(v);
    ASSERT_TRUE(PublishVersion(*pub, next++).ok());
  }
}

// Publishes versions 2..`last` on its own thread, `kBurst` more each time the group's leader has
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
            if (absl::Status s = PublishVersion(pub, v); !s.ok()) {
              absl::MutexLock lock(&mu_);
              status_ = s;
              return;
            }
          }
        }) {}

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
  ~RacingPublisher() { (void)Finish(); }

 private:
  bool MayPublish() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return allowed_ >= next_; }

  absl::Mutex mu_;
  uint64_t allowed_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 2;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::jthread thread_;
};

TEST_P(ExactVersionTest, GroupNeverMixesVersionsWhilePublishesRace) {
  // Publishes race every round's receives (RacingPublisher). With a channel that keeps too few
  // versions a worker may ask too late (NotFound): the group then re-picks, as README's "One
  // version per tensor-parallel group" says; either way no round ends with workers on
  // different versions.
  for (const std::string& query : {GetParam().keep, GetParam().keep_one}) {
    SCOPED_TRACE(query);
    channel_ = query == GetParam().keep ? "kept" : "kept_one";  // a fresh channel (and port)
    if (transport_ == "ucx") port_ = testing::FreePort();
    auto pub = OpenPublisher(query);
    ASSERT_TRUE(pub);
    ASSERT_TRUE(PublishVersion(*pub, 1).ok());
    Group group(*this, 4);
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
      ExpectSameTensors(**picked, MakeVersion(kSeed, v, kBytes));
      absl::Status all = group.ReceiveAll(v);
      if (absl::IsNotFound(all)) {
        ++repicked;  // v went before a worker opened it: the next round picks a newer one
        held = v;
        continue;
      }
      ASSERT_TRUE(all.ok()) << all;
      group.ExpectAllHold(v);
      held = v;
      ++rounds;
    }
    ASSERT_TRUE(publisher.Finish().ok());
    group.ExpectAllHold(kVersions);
    EXPECT_GE(rounds, 1);
    std::cout << GetParam().name << " " << query << ": " << rounds
              << " rounds, " << repicked << " re-picked\n";
  }
}

// The same with the workers as real processes (tests/peer_main.cc `receive`), as vLLM runs
// one per GPU: the leader (this process) picks the version and sends it to every worker.
TEST_P(ExactVersionTest, GroupOfProcessesNeverMixesVersionsWhilePublishesRace) {
  auto pub = OpenPublisher(GetParam().keep_one);  // only the newest kept: rounds may re-pick
  ASSERT_TRUE(pub);
  ASSERT_TRUE(PublishVersion(*pub, 1).ok());
  auto leader = OpenSubscriber();
  ASSERT_TRUE(leader);
  std::vector<testing::Child> workers;
  for (int i = 0; i < 3; ++i) {
    testing::Child::Options options;
    options.pipe_stdin = options.pipe_stdout = true;
    options.log_path = dir_ / absl::StrFormat("worker%d.log", i);
    auto child = testing::Child::Spawn(
        {testing::BinaryPath("tests/wb_test_peer"), "receive", Uri(), "--seed",
         std::to_string(kSeed), "--bytes", std::to_string(kBytes)},
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
      ASSERT_TRUE(answer.has_value())
          << "worker " << i << " gave no answer for version " << v << ": "
          << testing::ReadFileOrDie(dir_ / absl::StrFormat("worker%d.log", i));
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
        << testing::ReadFileOrDie(dir_ / absl::StrFormat("worker%d.log", i));
  }
  EXPECT_GE(rounds, 1);
  std::cout << GetParam().name << ": " << rounds << " rounds, " << repicked << " re-picked\n";
}

INSTANTIATE_TEST_SUITE_P(Stacks, ExactVersionTest, ::testing::ValuesIn(Stacks()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace weightbus
