// SPDX-License-Identifier: Apache-2.0
// Handle lifecycle through the public API on every transport: closing a handle while another
// thread is inside a call on it, handles inherited across fork(), a version number reused with
// other content (a restarted publisher), and re-publishing the latest version (a retry).
// Real files, real UCX endpoints over loopback shared memory, real child processes.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "expect_tensors.h"
#include "test_model.h"
#include "test_support.h"
#include "ucx_tls.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::weightbus::testing::ExpectSameTensors;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::OwnedTensor;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Views;
using ::weightbus::testing::WaitUntil;

constexpr absl::Duration kTimeout = absl::Seconds(30);

// One channel of a transport, as a URI.
class Channel {
 public:
  explicit Channel(const std::string& scheme) : scheme_(scheme) {
    if (absl::EndsWith(scheme, "ucx")) {
      testing::ApplyEnv(testing::kShm);
      port_ = testing::FreePort();
    }
  }
  std::string uri() const {
    if (absl::EndsWith(scheme_, "ucx")) {
      return absl::StrFormat("%s://127.0.0.1:%d/lifecycle", scheme_, port_);
    }
    return absl::StrFormat("%s://%s/channel", scheme_, dir_.path());
  }

 private:
  std::string scheme_;
  ScratchDir dir_;
  int port_ = 0;
};

// Runs `call` on a new thread and returns once that thread is blocked inside it (asleep in the
// kernel after announcing the call: nothing else between the announcement and the call
// blocks), so the caller can close the handle while the call is in flight.
class InFlight {
 public:
  explicit InFlight(std::function<absl::Status()> call)
      : thread_([this, call = std::move(call)] {
          tid_ = gettid();
          started_.Notify();
          result_ = call();
          done_.Notify();
        }) {
    started_.WaitForNotification();
    EXPECT_TRUE(WaitUntil([&] { return testing::ProcessState(tid_) == 'S'; }, kTimeout));
  }
  ~InFlight() { thread_.join(); }
  // The call's status once it returned (waits up to `timeout`).
  absl::Status Result(absl::Duration timeout) {
    if (!done_.WaitForNotificationWithTimeout(timeout)) {
      return absl::InternalError("the call in flight did not return");
    }
    return result_;
  }

 private:
  absl::Notification started_, done_;
  pid_t tid_ = 0;
  absl::Status result_;
  std::thread thread_;
};

class LifecycleTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LifecycleTest, DestroyingASubscriberCancelsItsWaitInFlight) {
  Channel channel(GetParam());
  auto pub = Publisher::Open(channel.uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(channel.uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto v1 = MakeVersion(1, 1, 4096);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE((*sub)->WaitForVersion(1, kTimeout).ok());  // connected, code paths resolved
  Subscriber* raw = sub->get();
  InFlight wait([raw] { return raw->WaitForVersion(2, absl::Seconds(20)).status(); });
  sub->reset();  // destroy while the other thread waits for version 2
  const absl::Status result = wait.Result(kTimeout);
  // Cancelled, not DeadlineExceeded: destroy did not just outwait the call's 20 s.
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled) << result;
}

// Destroyed while the other thread is receiving (held in a fail point between finding the
// version and fetching its bytes): destroy waits for the receive, which completes bit-exact.
TEST_P(LifecycleTest, DestroyingASubscriberMidReceiveWaitsForTheReceive) {
  Channel channel(GetParam());
  auto pub = Publisher::Open(channel.uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::unique_ptr<Subscriber> sub;
  {
    testing::ScopedEnv failpoints("WEIGHTBUS_FAILPOINTS", "core.before_fetch=delay:1500@2");
    auto opened = Subscriber::Open(channel.uri());
    ASSERT_TRUE(opened.ok()) << opened.status();
    sub = std::move(*opened);
  }
  auto v1 = MakeVersion(2, 1, 1 << 16), v2 = MakeVersion(2, 2, 1 << 20);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE(sub->WaitForVersion(1, kTimeout).ok());  // pass 1 of the fail point
  ASSERT_TRUE((*pub)->Publish(2, Views(v2), {}, kTimeout).ok());
  Subscriber* raw = sub.get();
  std::unique_ptr<Update> received;
  InFlight wait([raw, &received]() -> absl::Status {
    auto update = raw->WaitForVersion(2, kTimeout);  // sleeps in pass 2 of the fail point
    if (!update.ok()) return update.status();
    received = std::move(*update);
    return absl::OkStatus();
  });
  sub.reset();
  const absl::Status result = wait.Result(kTimeout);
  ASSERT_TRUE(result.ok()) << result;
  ExpectSameTensors(*received, v2);  // the Update outlives its Subscriber
}

// Destroyed while Publish is under way (held in a fail point before the transport): destroy
// waits; the publish either completes (then the version is there) or returns Cancelled (then it
// is not), never a crash or a torn version.
TEST_P(LifecycleTest, DestroyingAPublisherMidPublishWaitsForIt) {
  Channel channel(GetParam());
  std::unique_ptr<Publisher> pub;
  {
    testing::ScopedEnv failpoints("WEIGHTBUS_FAILPOINTS", "core.before_transport=delay:1500@2");
    auto opened = Publisher::Open(channel.uri());
    ASSERT_TRUE(opened.ok()) << opened.status();
    pub = std::move(*opened);
  }
  auto sub = Subscriber::Open(channel.uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto v1 = MakeVersion(3, 1, 1 << 16), v2 = MakeVersion(3, 2, 1 << 16);
  ASSERT_TRUE(pub->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE((*sub)->WaitForVersion(1, kTimeout).ok());
  Publisher* raw = pub.get();
  InFlight publish([raw, &v2] { return raw->Publish(2, Views(v2), {}, kTimeout); });
  pub.reset();
  const absl::Status result = publish.Result(kTimeout);
  ASSERT_TRUE(result.ok() || absl::IsCancelled(result)) << result;
  if (result.ok() && !absl::EndsWith(GetParam(), "ucx")) {  // ucx serves only while it lives
    auto update = (*sub)->WaitForVersion(2, kTimeout);
    ASSERT_TRUE(update.ok()) << update.status();
    ExpectSameTensors(**update, v2);
  }
}

TEST_P(LifecycleTest, CancelMakesLaterCallsFailWithCancelled) {
  Channel channel(GetParam());
  auto pub = Publisher::Open(channel.uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(channel.uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  (*sub)->Cancel();
  EXPECT_EQ((*sub)->Poll(0, kTimeout).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ((*sub)->WaitForVersion(0, kTimeout).status().code(), absl::StatusCode::kCancelled);
  (*pub)->Cancel();
  auto v1 = MakeVersion(1, 1, 4096);
  const absl::Status published = (*pub)->Publish(1, Views(v1), {}, kTimeout);
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
  for (int i = 0; i < 600; ++i) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    absl::SleepFor(absl::Milliseconds(100));  // polling a child's exit, not synchronising
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

TEST_P(LifecycleTest, ForkedChildCannotUseInheritedHandlesAndParentIsUnaffected) {
  Channel channel(GetParam());
  auto pub = Publisher::Open(channel.uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(channel.uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto v1 = MakeVersion(1, 1, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  auto got1 = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(got1.ok()) << got1.status();

  const pid_t child = ForkChild([&] {
    absl::Status wait = (*sub)->WaitForVersion(2, absl::Seconds(3)).status();
    absl::Status poll = (*sub)->Poll(0, absl::Seconds(3)).status();
    auto v2 = MakeVersion(1, 2, 1 << 16);
    absl::Status publish = (*pub)->Publish(2, Views(v2), {}, absl::Seconds(3));
    for (const absl::Status& s : {wait, poll, publish}) {
      if (s.code() != absl::StatusCode::kFailedPrecondition ||
          !absl::StrContains(s.message(), "fork")) {
        fprintf(stderr, "child got: %s\n", s.ToString().c_str());
        return kChildWrongCode;
      }
    }
    if ((*sub)->current_version().has_value() || (*pub)->latest_version().has_value()) {
      return kChildOther;
    }
    sub->reset();  // destroying inherited handles in the child frees nothing of the parent's
    pub->reset();
    return kChildOk;
  });
  ASSERT_GT(child, 0);
  EXPECT_EQ(WaitChild(child), kChildOk);

  // The parent's handles still work.
  for (uint64_t v = 2; v <= 3; ++v) {
    auto tensors = MakeVersion(1, v, 1 << 16);
    ASSERT_TRUE((*pub)->Publish(v, Views(tensors), {}, kTimeout).ok()) << v;
    auto update = (*sub)->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(update.ok()) << update.status();
    ExpectSameTensors(**update, tensors);
  }
}

// A forked child that lives on (a DataLoader worker) must not keep the parent's channel lock,
// listening port or connections: the parent can close its publisher and open a new one on the
// same channel while the child still runs (it could not: flock held by the child's copy of the
// lock file, port held by its copy of the listening socket).
TEST_P(LifecycleTest, AChildThatLivesOnHoldsNoLockOrPortOfTheParent) {
  Channel channel(GetParam());
  auto pub = Publisher::Open(channel.uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(channel.uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto v1 = MakeVersion(4, 1, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  ASSERT_TRUE((*sub)->WaitForVersion(1, kTimeout).ok());  // a live control connection on ucx
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
  pub->reset();
  auto reopened = Publisher::Open(channel.uri());
  EXPECT_TRUE(reopened.ok()) << reopened.status();
  if (reopened.ok()) {
    auto v2 = MakeVersion(4, 2, 1 << 16);
    ASSERT_TRUE((*reopened)->Publish(2, Views(v2), {}, kTimeout).ok());
    auto update = (*sub)->WaitForVersion(2, kTimeout);
    ASSERT_TRUE(update.ok()) << update.status();
    ExpectSameTensors(**update, v2);
  }
  close(hold[1]);
  EXPECT_EQ(WaitChild(child), kChildOk);
}

TEST_P(LifecycleTest, RepublishingTheLatestVersionWithTheSameBytesIsANoOp) {
  Channel channel(GetParam());
  auto pub = Publisher::Open(channel.uri());
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(channel.uri());
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto v3 = MakeVersion(5, 3, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(3, Views(v3), {{"try", "1"}}, kTimeout).ok());
  // A retry with the same bytes succeeds and changes nothing (the first metadata stays).
  EXPECT_TRUE((*pub)->Publish(3, Views(v3), {{"try", "2"}}, kTimeout).ok());
  EXPECT_EQ((*pub)->latest_version(), std::optional<uint64_t>(3));
  auto update = (*sub)->WaitForVersion(3, kTimeout);
  ASSERT_TRUE(update.ok()) << update.status();
  EXPECT_EQ((*update)->manifest().metadata.at("try"), "1");
  ExpectSameTensors(**update, v3);

  // Other bytes under the same number are refused, naming the first tensor that differs.
  auto other = v3;
  other[1].bytes[0] ^= std::byte{1};
  const absl::Status refused = (*pub)->Publish(3, Views(other), {}, kTimeout);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "\"" + other[1].name + "\"")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "other content")) << refused;
  // A lower version stays refused whatever its bytes.
  const absl::Status lower = (*pub)->Publish(2, Views(v3), {}, kTimeout);
  EXPECT_EQ(lower.code(), absl::StatusCode::kFailedPrecondition) << lower;

  auto again = (*sub)->Poll(0, kTimeout);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_NE(*again, nullptr);
  ExpectSameTensors(**again, v3);
}

INSTANTIATE_TEST_SUITE_P(Transports, LifecycleTest,
                         ::testing::Values("disk", "ucx", "delta+disk", "delta+ucx"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '+', '_');
                           return name;
                         });

TEST(LifecycleDiskTest, ANewPublisherMayRetryTheLatestVersionWithTheSameBytes) {
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel";
  auto v7 = MakeVersion(9, 7, 1 << 16);
  {
    auto pub = Publisher::Open(uri);
    ASSERT_TRUE(pub.ok()) << pub.status();
    ASSERT_TRUE((*pub)->Publish(7, Views(v7), {}, kTimeout).ok());
  }
  struct stat before {};
  ASSERT_EQ(stat(absl::StrFormat("%s/channel/versions/v%020d", dir.path(), 7).c_str(), &before), 0);
  auto pub = Publisher::Open(uri);  // a restarted trainer retrying its last publish
  ASSERT_TRUE(pub.ok()) << pub.status();
  const absl::Status retried = (*pub)->Publish(7, Views(v7), {}, kTimeout);
  EXPECT_TRUE(retried.ok()) << retried;
  struct stat after {};
  ASSERT_EQ(stat(absl::StrFormat("%s/channel/versions/v%020d", dir.path(), 7).c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino) << "the version directory was rewritten";
  auto other = v7;
  other[0].bytes[3] ^= std::byte{0x80};
  const absl::Status refused = (*pub)->Publish(7, Views(other), {}, kTimeout);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "\"" + other[0].name + "\"")) << refused;
}

// A ucx:// publisher keeps no history: restarted, it numbers from where the trainer says. A
// subscriber holding version 7 refuses a "version 7" with other content, naming both sessions,
// keeps its bytes, and takes the new publisher's higher versions.
TEST(LifecycleUcxTest, SubscriberRefusesOtherContentUnderAVersionItHolds) {
  testing::ApplyEnv(testing::kShm);
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/restart", testing::FreePort());
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto first = MakeVersion(1, 7, 1 << 16);
  OwnedTensor held = first[0];
  Destination dest{held.dtype, held.shape, {}, held.bytes.data(), Device{}};
  ASSERT_TRUE((*sub)->Bind(held.name, dest).ok());
  std::string first_session;
  {
    auto pub = Publisher::Open(uri);
    ASSERT_TRUE(pub.ok()) << pub.status();
    ASSERT_TRUE((*pub)->Publish(7, Views(first), {}, kTimeout).ok());
    auto got = (*sub)->WaitForVersion(7, kTimeout);
    ASSERT_TRUE(got.ok()) << got.status();
    first_session = (*got)->manifest().publisher.session;
    EXPECT_EQ(first_session.size(), 16u);
  }
  const std::vector<std::byte> held_bytes = held.bytes;

  auto pub = Publisher::Open(uri);  // restarted: no memory of version 7
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto reused = MakeVersion(2, 7, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(7, Views(reused), {}, kTimeout).ok());
  auto refused = (*sub)->WaitForVersion(0, kTimeout);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  const std::string message(refused.status().message());
  EXPECT_TRUE(absl::StrContains(message, first_session)) << message;
  EXPECT_TRUE(absl::StrContains(message, "stays current")) << message;
  EXPECT_EQ(held.bytes, held_bytes) << "the held version was touched";
  EXPECT_EQ((*sub)->current_version(), std::optional<uint64_t>(7));

  auto v8 = MakeVersion(2, 8, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(8, Views(v8), {}, kTimeout).ok());
  auto got8 = (*sub)->WaitForVersion(8, kTimeout);
  ASSERT_TRUE(got8.ok()) << got8.status();
  EXPECT_NE((*got8)->manifest().publisher.session, first_session);
  EXPECT_EQ(held.bytes, v8[0].bytes);
}

// The same bytes under the same number from another session are the same version.
TEST(LifecycleUcxTest, SameContentFromANewSessionIsAccepted) {
  testing::ApplyEnv(testing::kShm);
  const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/same", testing::FreePort());
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto v5 = MakeVersion(3, 5, 1 << 16);
  {
    auto pub = Publisher::Open(uri);
    ASSERT_TRUE(pub.ok()) << pub.status();
    ASSERT_TRUE((*pub)->Publish(5, Views(v5), {}, kTimeout).ok());
    ASSERT_TRUE((*sub)->WaitForVersion(5, kTimeout).ok());
  }
  auto pub = Publisher::Open(uri);
  ASSERT_TRUE(pub.ok()) << pub.status();
  ASSERT_TRUE((*pub)->Publish(5, Views(v5), {}, kTimeout).ok());
  auto again = (*sub)->WaitForVersion(5, kTimeout);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSameTensors(**again, v5);
}

}  // namespace
}  // namespace weightbus
