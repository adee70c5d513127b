// SPDX-License-Identifier: Apache-2.0
// tools/process (the child processes, environment overrides and ports that the tests and the
// benchmarks share), with real processes and sockets: pipes both ways, exit codes and signals,
// waits that give up, cleanup of every child, environment restored on early return, reserved
// ports that no ephemeral bind or connect is given (checked exhaustively in a private network
// namespace with a small port range).
#include <arpa/inet.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "process/process.h"
#include "test_support.h"

namespace weightbus::process {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(60);

TEST(ChildTest, PipesBothWaysAndReportsTheExit) {
  Child::Options options;
  options.pipe_stdin = true;
  options.pipe_stdout = true;
  auto cat = Child::Spawn({"/bin/cat"}, options);
  ASSERT_TRUE(cat.ok()) << cat.status();
  ASSERT_TRUE(cat->Send("first line"));
  ASSERT_TRUE(cat->Send("second"));
  EXPECT_EQ(cat->ReadLine(absl::Now() + kTimeout), "first line");
  EXPECT_EQ(cat->ReadLine(absl::Now() + kTimeout), "second");
  bool timed_out = false;
  EXPECT_EQ(cat->ReadLine(absl::Now(), &timed_out), std::nullopt);  // nothing more yet
  EXPECT_TRUE(timed_out);
  auto running = cat->Wait(absl::ZeroDuration());  // closes its stdin: cat then ends
  if (!running.ok()) {
    EXPECT_EQ(running.status().code(), absl::StatusCode::kDeadlineExceeded) << running.status();
  }
  auto status = cat->Wait(kTimeout);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(ExitCode(*status), 0);
  EXPECT_EQ(cat->ReadLine(absl::Now() + kTimeout, &timed_out), std::nullopt);  // end of file
  EXPECT_FALSE(timed_out);
  EXPECT_EQ(cat->Wait(kTimeout).value_or(-1), *status) << "the same status again";
}

TEST(ChildTest, EnvironmentLogAndExitCodes) {
  testing::ScratchDir dir;
  const std::string log = dir / "child.log";
  auto child = Child::Start({"/bin/sh", "-c", "echo out=$WB_PROCESS_TEST; echo err >&2; exit 7"},
                            {{"WB_PROCESS_TEST", "value"}}, log);
  ASSERT_TRUE(child.ok()) << child.status();
  auto status = child->Wait(kTimeout);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(ExitCode(*status), 7);
  EXPECT_EQ(DescribeWaitStatus(*status), "exit 7");
  EXPECT_EQ(testing::ReadFileOrDie(log), "out=value\nerr\n");
  EXPECT_EQ(std::getenv("WB_PROCESS_TEST"), nullptr) << "only the child's environment";

  auto missing = Child::Start({dir / "no-such-program"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(missing.status().message().find("no-such-program"), absl::string_view::npos);
}

TEST(ChildTest, WaitGivesUpWaitOrKillKillsAndStopAllChildrenEndsEveryChild) {
  auto sleeper = Child::Start({"/bin/sleep", "600"});
  ASSERT_TRUE(sleeper.ok());
  EXPECT_EQ(sleeper->Wait(absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  const Child::Exit e = sleeper->WaitOrKill(absl::Now());
  EXPECT_EQ(ExitCode(e.status), 128 + SIGKILL) << e.Describe();
  EXPECT_EQ(e.Describe(), "killed by signal 9");

  auto term = Child::Start({"/bin/sleep", "600"});
  ASSERT_TRUE(term.ok());
  term->Kill(SIGTERM);
  auto status = term->Wait(kTimeout);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(ExitCode(*status), 128 + SIGTERM);

  std::vector<Child> children;
  for (int i = 0; i < 3; ++i) {
    auto c = Child::Start({"/bin/sleep", "600"});
    ASSERT_TRUE(c.ok());
    children.push_back(*std::move(c));
  }
  StopAllChildren(kTimeout);
  for (Child& c : children) {
    EXPECT_EQ(::kill(c.pid(), 0), -1) << "pid " << c.pid() << " still there";
    EXPECT_EQ(errno, ESRCH);
    EXPECT_TRUE(c.Wait(absl::ZeroDuration()).ok()) << "already reaped";
  }
}

TEST(RunCommandTest, OutputExitCodeAndTimeout) {
  auto r = RunCommand({"/bin/sh", "-c", "echo hello; echo world >&2; exit 3"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 3);
  EXPECT_EQ(r->output, "hello\nworld\n");
  auto killed = RunCommand({"/bin/sh", "-c", "kill -9 $$"});
  ASSERT_TRUE(killed.ok());
  EXPECT_EQ(killed->exit_code, 128 + SIGKILL);
  // `timeout` is a bound the command cannot meet: it waits for a signal that never comes.
  auto slow = RunCommand({"/bin/sh", "-c", "echo started; exec sleep 600"}, absl::Seconds(1));
  EXPECT_EQ(slow.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(slow.status().message().find("started"), absl::string_view::npos) << slow.status();
}

TEST(ScopedEnvTest, RestoresTheValueOrItsAbsenceOnEveryExit) {
  ASSERT_EQ(::setenv("WB_SCOPED_A", "before", 1), 0);
  ::unsetenv("WB_SCOPED_B");
  auto early_return = [] {
    ScopedEnvs env({{"WB_SCOPED_A", ""}, {"WB_SCOPED_B", "set"}});
    if (std::getenv("WB_SCOPED_A") != nullptr) return false;  // "" unsets
    const char* b = std::getenv("WB_SCOPED_B");
    return b != nullptr && std::string(b) == "set";
  };
  EXPECT_TRUE(early_return());
  EXPECT_STREQ(std::getenv("WB_SCOPED_A"), "before");
  EXPECT_EQ(std::getenv("WB_SCOPED_B"), nullptr);
  {
    ScopedEnv a("WB_SCOPED_A", "inside");
    ScopedEnv b("WB_SCOPED_B", std::nullopt);
    EXPECT_STREQ(std::getenv("WB_SCOPED_A"), "inside");
  }
  EXPECT_STREQ(std::getenv("WB_SCOPED_A"), "before");
  ::unsetenv("WB_SCOPED_A");
}

// Binds a TCP socket to 127.0.0.1:`port` (0: any), with SO_REUSEADDR when `reuse`, and returns
// it, or -errno.
int BindLoopback(int port, bool reuse) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    const int err = errno;
    ::close(fd);
    return -err;
  }
  return fd;
}

int LocalPort(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return ntohs(a.sin_port);
}

TEST(FreePortTest, IsReservedForAReuseAddrBindAndListenedOnThen) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  EXPECT_NE(FreePort(), port);
  EXPECT_EQ(BindLoopback(port, /*reuse=*/false), -EADDRINUSE) << "a plain bind must not take it";
  EXPECT_FALSE(WaitForListener(port, absl::Now()));
  const int fd = BindLoopback(port, /*reuse=*/true);  // as a ucx:// publisher binds
  ASSERT_GE(fd, 0) << strerror(-fd);
  ASSERT_EQ(::listen(fd, 1), 0);
  EXPECT_TRUE(WaitForListener(port, absl::Now() + kTimeout));
  ::close(fd);
  const int port6 = FreePort(AF_INET6);
  if (port6 < 0) GTEST_SKIP() << "no IPv6 loopback";
  EXPECT_GT(port6, 0);
}

// In a private network namespace with a 64-port range, every port but the reserved one is
// handed out to ephemeral binds and connects until the range runs out: the reserved one never.
TEST(FreePortTest, NoEphemeralBindOrConnectIsGivenAReservedPort) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(pipe_fds[0]);
    auto report = [&](int code, const std::string& what) {
      (void)!::write(pipe_fds[1], what.data(), what.size());
      _exit(code);
    };
    const uid_t uid = ::getuid();
    if (::unshare(CLONE_NEWNET | (uid != 0 ? CLONE_NEWUSER : 0)) != 0) {
      report(90, absl::StrFormat("unshare: %s", strerror(errno)));
    }
    if (uid != 0) {
      const std::string map = absl::StrFormat("0 %d 1", uid);
      const int fd = ::open("/proc/self/uid_map", O_WRONLY);
      if (fd < 0 || ::write(fd, map.data(), map.size()) < 0) report(90, "uid_map");
      ::close(fd);
    }
    {  // bring lo up
      const int s = ::socket(AF_INET, SOCK_DGRAM, 0);
      ifreq ifr{};
      std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
      if (::ioctl(s, SIOCGIFFLAGS, &ifr) != 0) report(90, "SIOCGIFFLAGS");
      ifr.ifr_flags |= IFF_UP;
      if (::ioctl(s, SIOCSIFFLAGS, &ifr) != 0) report(90, "SIOCSIFFLAGS");
      ::close(s);
    }
    const int range = ::open("/proc/sys/net/ipv4/ip_local_port_range", O_WRONLY);
    if (range < 0 || ::write(range, "40000 40063", 11) != 11) report(90, "ip_local_port_range");
    ::close(range);

    const int port = FreePort();
    if (port < 40000 || port > 40063) report(1, absl::StrFormat("FreePort gave %d", port));
    std::vector<int> fds;
    int binds = 0;
    for (int fd; (fd = BindLoopback(0, /*reuse=*/binds % 2 == 1)) >= 0; ++binds) {
      if (LocalPort(fd) == port) report(2, "an ephemeral bind was given the reserved port");
      fds.push_back(fd);
    }
    if (binds != 63) report(3, absl::StrFormat("%d ephemeral binds, expected 63", binds));
    for (int fd : fds) ::close(fd);
    fds.clear();
    const int server = BindLoopback(40000 + (port == 40000 ? 1 : 0), true);
    if (server < 0 || ::listen(server, 128) != 0) report(4, "server");
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    to.sin_port = htons(static_cast<uint16_t>(LocalPort(server)));
    int connects = 0;
    while (true) {
      const int c = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (::connect(c, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) break;
      if (LocalPort(c) == port) report(5, "a connect was given the reserved port");
      fds.push_back(c);
      ++connects;
    }
    if (connects < 60) report(6, absl::StrFormat("only %d connects", connects));
    const int taken = BindLoopback(port, /*reuse=*/true);
    if (taken < 0 || ::listen(taken, 1) != 0) report(7, "a SO_REUSEADDR bind could not take it");
    report(0,
           absl::StrFormat("port %d: %d binds and %d connects avoided it", port, binds, connects));
  }
  ::close(pipe_fds[1]);
  std::string what;
  char buf[256];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof(buf))) > 0;) what.append(buf, n);
  ::close(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  if (ExitCode(status) == 90) GTEST_SKIP() << "no private network namespace here: " << what;
  EXPECT_EQ(ExitCode(status), 0) << what;
}

}  // namespace
}  // namespace weightbus::process
