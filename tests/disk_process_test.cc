// SPDX-License-Identifier: Apache-2.0
// disk:// with real processes: several subscribers following one publisher, a publisher killed
// mid-publish (between files, before commit), a re-publish over a crashed attempt's leftovers,
// a full disk (a small tmpfs in a private mount namespace) and a > 2 GiB tensor.
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "test_model.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::weightbus::testing::Child;
using ::weightbus::testing::MakeVersion;
using ::weightbus::testing::ScratchDir;
using ::weightbus::testing::Views;

constexpr absl::Duration kTimeout = absl::Seconds(60);

std::string Peer() { return testing::BinaryPath("tests/wb_test_peer"); }

std::string ChannelUri(const ScratchDir& dir) { return "disk://" + dir.path() + "/channel"; }

using ::weightbus::testing::ExitCode;

// Runs `argv` as user `uid` with primary group `gid` (and no other group) and returns its exit
// code; its stderr goes to `log`. Needs root.
int RunAs(uid_t uid, gid_t gid, const std::vector<std::string>& argv, const std::string& log) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {  // only async-signal-safe calls until exec
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (fd >= 0) ::dup2(fd, 2);
    if (::setgroups(1, &gid) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(100);
    ::execv(args[0], args.data());
    ::_exit(101);
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Who can read a channel (docs/TRANSPORTS.md): a subscriber process of another user gets
// nothing from an owner-only channel (PermissionDenied naming the path), and with
// group_access=true one of the publisher's group receives every byte; one of another group still
// gets nothing.
TEST(DiskProcessTest, AnotherUsersSubscriberReadsTheChannelOnlyWithGroupAccess) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a subscriber as another user";
  const uid_t nobody = 65534;
  const gid_t own_group = ::getegid(), other_group = 65534;
  ASSERT_NE(own_group, other_group);
  for (const bool group_access : {false, true}) {
    SCOPED_TRACE(group_access ? "group_access=true" : "owner only");
    ScratchDir dir;
    ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);  // the scratch directory is not the test
    const std::string uri = ChannelUri(dir);
    auto pub = Publisher::Open(uri, {{"group_access", group_access ? "true" : "false"}});
    ASSERT_TRUE(pub.ok()) << pub.status();
    auto tensors = MakeVersion(23, 1, 65536);
    ASSERT_TRUE((*pub)->Publish(1, Views(tensors), {}, kTimeout).ok());
    const std::vector<std::string> subscribe = {Peer(),  "subscribe",   uri,  "--until",
                                                "1",     "--seed",      "23", "--bytes",
                                                "65536", "--timeout-s", "10"};
    const std::string log = dir / "sub.log";
    EXPECT_EQ(RunAs(nobody, own_group, subscribe, log), group_access ? 0 : 1)
        << testing::ReadFileOrDie(log);
    if (!group_access) {
      EXPECT_TRUE(absl::StrContains(testing::ReadFileOrDie(log),
                                    "PERMISSION_DENIED: open channel directory " + dir.path() +
                                        "/channel (a channel is readable by its publisher's user "
                                        "only, or also by its group when published with "
                                        "group_access=true): Permission denied"))
          << testing::ReadFileOrDie(log);
    }
    EXPECT_EQ(RunAs(nobody, other_group, subscribe, log), 1) << testing::ReadFileOrDie(log);
    EXPECT_TRUE(absl::StrContains(testing::ReadFileOrDie(log), "Permission denied"))
        << testing::ReadFileOrDie(log);
  }
}

TEST(DiskProcessTest, TwoSubscriberProcessesFollowAPublisherProcessBitExact) {
  ScratchDir dir;
  const std::string uri = ChannelUri(dir);
  const std::string n = "30";
  std::vector<Child> subs;
  for (int i = 0; i < 2; ++i) {
    auto c = Child::Start({Peer(), "subscribe", uri, "--until", n, "--seed", "21", "--bytes",
                           "262144", "--timeout-s", "60"},
                          {}, dir / absl::StrFormat("sub%d.log", i));
    ASSERT_TRUE(c.ok()) << c.status();
    subs.push_back(*std::move(c));
  }
  auto pub = Child::Start({Peer(), "publish", uri, "--versions", n, "--seed", "21", "--bytes",
                           "262144", "--interval-ms", "20"},
                          {}, dir / "pub.log");
  ASSERT_TRUE(pub.ok());
  auto pub_status = pub->Wait(kTimeout);
  ASSERT_TRUE(pub_status.ok());
  EXPECT_EQ(ExitCode(*pub_status), 0) << testing::ReadFileOrDie(dir / "pub.log");
  for (int i = 0; i < 2; ++i) {
    auto s = subs[i].Wait(kTimeout);
    ASSERT_TRUE(s.ok());
    const std::string log = testing::ReadFileOrDie(dir / absl::StrFormat("sub%d.log", i));
    EXPECT_EQ(ExitCode(*s), 0) << log;
    EXPECT_NE(log.find("received 30 ok"), std::string::npos) << log;
  }
}

// Publishes version 1 in-process, then runs a publisher process for version 2 that kills itself
// at `failpoint`; returns the channel for inspection.
void CrashDuringPublish(const ScratchDir& dir, const std::string& failpoint) {
  {
    auto pub = Publisher::Open(ChannelUri(dir));
    ASSERT_TRUE(pub.ok());
    auto v1 = MakeVersion(3, 1, 1 << 18);
    ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  }
  // Small shards so that version 2 spans several files.
  auto crashed =
      Child::Start({Peer(), "publish", ChannelUri(dir), "--start", "2", "--versions", "1", "--seed",
                    "3", "--bytes", "262144", "--set", "shard_size=64KiB"},
                   {{"WEIGHTBUS_FAILPOINTS", failpoint + "=kill"}}, dir / "crash.log");
  ASSERT_TRUE(crashed.ok());
  auto status = crashed->Wait(kTimeout);
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(ExitCode(*status), 128 + SIGKILL) << testing::ReadFileOrDie(dir / "crash.log");
}

void ExpectSubscriberSeesVersion(const ScratchDir& dir, uint64_t version, uint64_t seed) {
  auto sub = Subscriber::Open(ChannelUri(dir));
  ASSERT_TRUE(sub.ok());
  auto u = (*sub)->WaitForVersion(0, kTimeout);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->version(), version);
  auto expected = MakeVersion(seed, version, 1 << 18);
  for (const auto& t : expected) {
    const TensorView* got = (*u)->Find(t.name);
    ASSERT_NE(got, nullptr) << t.name;
    if (!t.bytes.empty()) {
      EXPECT_EQ(std::memcmp(got->data, t.bytes.data(), t.bytes.size()), 0) << t.name;
    }
  }
}

TEST(DiskProcessTest, WriterKilledBetweenFilesLeavesPreviousVersionAndRepublishWorks) {
  ScratchDir dir;
  CrashDuringPublish(dir, "disk.after_file");
  // The crash left a partial temporary directory, invisible to subscribers.
  bool leftover = false;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() + "/channel/versions")) {
    leftover |= absl::StartsWith(e.path().filename().string(), ".tmp-");
  }
  EXPECT_TRUE(leftover);
  EXPECT_EQ(testing::ReadFileOrDie(dir.path() + "/channel/LATEST"), "1\n");
  ExpectSubscriberSeesVersion(dir, 1, 3);

  // A new publisher process cleans up and publishes version 2 (different content: seed 4).
  auto ok =
      testing::RunCommand({Peer(), "publish", ChannelUri(dir), "--start", "2", "--versions", "1",
                           "--seed", "4", "--bytes", "262144", "--set", "shard_size=64KiB"});
  ASSERT_TRUE(ok.ok());
  ASSERT_EQ(ok->exit_code, 0) << ok->output;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() + "/channel/versions")) {
    EXPECT_FALSE(absl::StartsWith(e.path().filename().string(), ".tmp-")) << e.path();
  }
  ExpectSubscriberSeesVersion(dir, 2, 4);
}

TEST(DiskProcessTest, WriterKilledAfterRenameBeforeCommitIsInvisibleAndReplaced) {
  ScratchDir dir;
  CrashDuringPublish(dir, "disk.before_commit");
  // Version 2's directory is complete and in place, but LATEST was never moved to it.
  EXPECT_TRUE(
      std::filesystem::exists(testing::DiskVersionDir(dir, 2) + "/weightbus.manifest.json"));
  EXPECT_EQ(testing::ReadFileOrDie(dir.path() + "/channel/LATEST"), "1\n");
  ExpectSubscriberSeesVersion(dir, 1, 3);
  auto ok = testing::RunCommand({Peer(), "publish", ChannelUri(dir), "--start", "2", "--versions",
                                 "1", "--seed", "4", "--bytes", "262144"});
  ASSERT_TRUE(ok.ok());
  ASSERT_EQ(ok->exit_code, 0) << ok->output;
  ExpectSubscriberSeesVersion(dir, 2, 4);
}

TEST(DiskProcessTest, SubscriberKilledMidReadDoesNotBlockRetention) {
  ScratchDir dir;
  const std::string uri = ChannelUri(dir) + "?retention=1";
  {
    auto pub = Publisher::Open(uri);
    ASSERT_TRUE(pub.ok()) << pub.status();
    auto v1 = MakeVersion(2, 1, 1 << 18);
    ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
  }
  // A subscriber process pins version 1 and is held there; we kill it there.
  testing::PausePoint read("disk.before_read");
  auto sub = Child::Start(
      {Peer(), "subscribe", ChannelUri(dir), "--until", "1", "--seed", "2", "--bytes", "262144"},
      {{"WEIGHTBUS_FAILPOINTS", read.Spec()}}, dir / "sub.log");
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(read.WaitReached(kTimeout)) << testing::ReadFileOrDie(dir / "sub.log");
  // This publisher's first retention pass is the one after version 2; it only announces.
  testing::PausePoint retained("disk.after_retention");
  retained.Release();
  auto pub = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", retained.Spec());
    return Publisher::Open(uri);
  }();
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto v2 = MakeVersion(2, 2, 1 << 18);
  ASSERT_TRUE((*pub)->Publish(2, Views(v2), {}, kTimeout).ok());
  ASSERT_TRUE(retained.WaitReached(kTimeout)) << "no retention pass after version 2";
  const std::string v1_dir = testing::DiskVersionDir(dir, 1);
  const std::string v2_dir = testing::DiskVersionDir(dir, 2);
  EXPECT_TRUE(std::filesystem::exists(v1_dir)) << "pinned by a live reader";
  EXPECT_TRUE(std::filesystem::exists(v2_dir));
  sub->Kill(SIGKILL);
  ASSERT_TRUE(sub->Wait(kTimeout).ok());
  auto v3 = MakeVersion(2, 3, 1 << 18);
  ASSERT_TRUE((*pub)->Publish(3, Views(v3), {}, kTimeout).ok());
  pub->reset();  // finishes the retention pass after version 3 before it returns
  EXPECT_FALSE(std::filesystem::exists(v1_dir)) << "a dead reader's pin must not last";
  EXPECT_FALSE(std::filesystem::exists(v2_dir));
  ExpectSubscriberSeesVersion(dir, 3, 2);
}

// The `pause` fail point itself (testing::PausePoint), in this process: the publishing thread
// is held after the rename, before LATEST moves, until the test releases it.
TEST(PausePointTest, HoldsAnInProcessPublisherAtThePointUntilReleased) {
  ScratchDir dir;
  testing::PausePoint commit("disk.before_commit", 2);
  auto pub = [&] {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", commit.Spec());
    return Publisher::Open(ChannelUri(dir));
  }();
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto v1 = MakeVersion(6, 1, 1 << 16);
  ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());  // pass 1 does not stop
  EXPECT_FALSE(commit.Reached());
  auto v2 = MakeVersion(6, 2, 1 << 16);
  std::atomic<bool> returned{false};
  absl::Status published;
  std::thread publisher([&] {
    published = (*pub)->Publish(2, Views(v2), {}, kTimeout);
    returned = true;
  });
  ASSERT_TRUE(commit.WaitReached(kTimeout));
  EXPECT_EQ(commit.ReachedBy(), ::getpid());
  // Held: version 2 is in place but not committed, and Publish has not returned.
  EXPECT_TRUE(
      std::filesystem::exists(testing::DiskVersionDir(dir, 2) + "/weightbus.manifest.json"));
  EXPECT_EQ(testing::ReadFileOrDie(dir.path() + "/channel/LATEST"), "1\n");
  EXPECT_FALSE(returned);
  auto sub = Subscriber::Open(ChannelUri(dir));
  ASSERT_TRUE(sub.ok());
  auto seen = (*sub)->Poll(0, kTimeout);
  ASSERT_TRUE(seen.ok()) << seen.status();
  ASSERT_NE(*seen, nullptr);
  EXPECT_EQ((*seen)->version(), 1u);
  commit.Release();
  publisher.join();
  EXPECT_TRUE(published.ok()) << published;
  EXPECT_EQ(testing::ReadFileOrDie(dir.path() + "/channel/LATEST"), "2\n");
}

// The same in a child process (wb_test_peer, which links only libweightbus.so): the test sees
// the child held at the point, and the child finishes once released.
TEST(PausePointTest, HoldsAChildProcessAtThePointUntilReleased) {
  ScratchDir dir;
  testing::PausePoint file("disk.after_file", 3);
  auto pub = Child::Start({Peer(), "publish", ChannelUri(dir), "--versions", "1", "--seed", "7",
                           "--bytes", "262144", "--set", "shard_size=64KiB"},
                          {{"WEIGHTBUS_FAILPOINTS", file.Spec()}}, dir / "pub.log");
  ASSERT_TRUE(pub.ok()) << pub.status();
  ASSERT_TRUE(file.WaitReached(kTimeout)) << testing::ReadFileOrDie(dir / "pub.log");
  EXPECT_EQ(file.ReachedBy(), pub->pid());
  // Held after its third data file: nothing committed, the process still there.
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/channel/LATEST"));
  EXPECT_EQ(pub->Wait(absl::ZeroDuration()).status().code(), absl::StatusCode::kDeadlineExceeded);
  file.Release();
  auto status = pub->Wait(kTimeout);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(ExitCode(*status), 0) << testing::ReadFileOrDie(dir / "pub.log");
  ExpectSubscriberSeesVersion(dir, 1, 7);
}

// Released before it is reached, a pause point only announces ("tell me when it ran"); once its
// PausePoint is gone (the test is over) it does not stop at all; a malformed one is refused.
TEST(PausePointTest, AnnouncesWithoutStoppingWhenReleasedEarlyAndNeverOutlivesItsTest) {
  ScratchDir dir;
  testing::PausePoint early("disk.before_commit");
  early.Release();
  std::string gone_spec;
  {
    testing::PausePoint gone("disk.before_rename");
    gone_spec = gone.Spec();
  }
  {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", early.Spec() + "," + gone_spec);
    auto pub = Publisher::Open(ChannelUri(dir));
    ASSERT_TRUE(pub.ok()) << pub.status();
    auto v1 = MakeVersion(8, 1, 1 << 16);
    // Bounded by the 60 s limit of a pause; well within the test's own timeout either way.
    const absl::Time start = absl::Now();
    ASSERT_TRUE((*pub)->Publish(1, Views(v1), {}, kTimeout).ok());
    EXPECT_LT(absl::Now() - start, testing::PausePoint::kLimit) << "a pause point blocked";
  }
  EXPECT_TRUE(early.Reached());
  EXPECT_EQ(early.ReachedBy(), ::getpid());

  for (const std::string bad : {"disk.before_commit=pause:relative/dir",
                                "disk.before_commit=pause:", "disk.before_commit=pause:/tmp@0",
                                "disk.before_commit=error,disk.before_commit=pause:/tmp"}) {
    testing::ScopedEnv fp("WEIGHTBUS_FAILPOINTS", bad);
    auto pub = Publisher::Open(ChannelUri(dir));
    EXPECT_EQ(pub.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(pub.status().message().find("failpoint"), absl::string_view::npos) << pub.status();
  }
}

// Runs `body` in a child process inside a private mount namespace with a `size`-byte tmpfs
// mounted at `mountpoint`. Returns the child's exit code, or -1 when namespaces are unavailable.
int RunWithSmallFilesystem(const std::string& mountpoint, const std::string& size,
                           const std::function<int()>& body, std::string* why) {
  pid_t pid = fork();
  if (pid == 0) {
    int flags = CLONE_NEWNS;
    if (geteuid() != 0) flags |= CLONE_NEWUSER;
    if (unshare(flags) != 0) _exit(90);
    if (flags & CLONE_NEWUSER) {
      // Map ourselves to root inside the namespace so we may mount.
      char map[64];
      std::snprintf(map, sizeof(map), "0 %d 1", getuid());
      int fd = open("/proc/self/setgroups", O_WRONLY);
      if (fd >= 0) {
        (void)!write(fd, "deny", 4);
        close(fd);
      }
      fd = open("/proc/self/uid_map", O_WRONLY);
      if (fd < 0 || write(fd, map, strlen(map)) < 0) _exit(91);
      close(fd);
    }
    if (mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(92);
    std::string opts = "size=" + size;
    if (mount("tmpfs", mountpoint.c_str(), "tmpfs", 0, opts.c_str()) != 0) _exit(93);
    _exit(body());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  const int code = ExitCode(status);
  if (code >= 90 && code <= 93) {
    *why = absl::StrFormat("cannot create a private mount namespace with a tmpfs (step %d)",
                           code - 90);
    return -1;
  }
  return code;
}

TEST(DiskProcessTest, FullDiskFailsPublishAndKeepsPreviousVersion) {
  ScratchDir dir;
  const std::string mnt = dir / "small";
  std::filesystem::create_directories(mnt);
  const std::string log = dir / "enospc.log";
  std::string why;
  // The child checks everything and reports through its exit code and a log outside the tmpfs.
  int code = RunWithSmallFilesystem(
      mnt, "4m",
      [&]() -> int {
        FILE* out = fopen(log.c_str(), "w");
        auto fail = [&](int c, const std::string& msg) {
          fprintf(out, "%s\n", msg.c_str());
          fclose(out);
          return c;
        };
        const std::string uri = "disk://" + mnt + "/channel";
        auto pub = Publisher::Open(uri);
        if (!pub.ok()) return fail(10, pub.status().ToString());
        auto v1 = MakeVersion(5, 1, 1 << 20);  // ~1 MiB fits
        if (absl::Status s = (*pub)->Publish(1, Views(v1), {}, kTimeout); !s.ok()) {
          return fail(11, s.ToString());
        }
        auto v2 = MakeVersion(5, 2, 8 << 20);  // ~8 MiB does not
        absl::Status s = (*pub)->Publish(2, Views(v2), {}, kTimeout);
        if (s.code() != absl::StatusCode::kResourceExhausted) return fail(12, s.ToString());
        if (s.message().find("No space left on device") == absl::string_view::npos ||
            s.message().find("version 2") == absl::string_view::npos ||
            s.message().find("the channel holds 1 version directory (retention=") ==
                absl::string_view::npos ||
            s.message().find("free space on the filesystem of") == absl::string_view::npos) {
          return fail(13, s.ToString());
        }
        auto sub = Subscriber::Open(uri);
        auto u = (*sub)->WaitForVersion(0, kTimeout);
        if (!u.ok()) return fail(14, u.status().ToString());
        if ((*u)->version() != 1) return fail(15, "subscriber did not get version 1");
        for (const auto& t : v1) {
          const TensorView* got = (*u)->Find(t.name);
          if (got == nullptr ||
              (!t.bytes.empty() && std::memcmp(got->data, t.bytes.data(), t.bytes.size()) != 0)) {
            return fail(16, "version 1 differs: " + t.name);
          }
        }
        // The failed attempt left nothing behind, so a smaller version 2 now fits.
        auto small = MakeVersion(5, 2, 1 << 20);
        if (absl::Status s2 = (*pub)->Publish(2, Views(small), {}, kTimeout); !s2.ok()) {
          return fail(17, s2.ToString());
        }
        return fail(0, "ok: " + s.ToString());
      },
      &why);
  if (code == -1) GTEST_SKIP() << why;
  EXPECT_EQ(code, 0) << testing::ReadFileOrDie(log);
}

TEST(DiskProcessTest, TensorLargerThanTwoGiB) {
  const uint64_t n = (uint64_t{1} << 31) + 4096 * 3 + 17;
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) GTEST_SKIP() << "cannot map " << n << " bytes";
  auto* bytes = static_cast<uint8_t*>(p);
  // A pattern that differs in every 4 KiB page, so misplaced chunks change the checksum.
  for (uint64_t i = 0; i < n; i += 4096)
    std::memset(bytes + i, static_cast<int>(i / 4096), std::min<uint64_t>(4096, n - i));
  const uint64_t expected = testing::Xxh3(bytes, n);
  ScratchDir dir;
  {
    auto pub = Publisher::Open(ChannelUri(dir) + "?fsync=false");
    ASSERT_TRUE(pub.ok());
    TensorView big{"huge", DType::kU8, {static_cast<int64_t>(n)}, {}, bytes};
    ASSERT_TRUE((*pub)->Publish(1, {big}, {}, absl::Seconds(300)).ok());
  }
  munmap(p, n);
  auto sub = Subscriber::Open(ChannelUri(dir));
  auto u = (*sub)->WaitForVersion(1, absl::Seconds(300));
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ((*u)->manifest().tensors[0].nbytes, n);
  EXPECT_EQ((*u)->manifest().tensors[0].xxh3, expected);
  EXPECT_EQ(testing::Xxh3((*u)->tensors()[0].data, n), expected);
}

}  // namespace
}  // namespace weightbus
