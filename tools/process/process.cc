// SPDX-License-Identifier: Apache-2.0
#include "process/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

extern char** environ;

namespace weightbus::process {
namespace {

// The live children of this process, for StopAllChildren.
struct Registry {
  absl::Mutex mu;
  std::vector<pid_t> pids ABSL_GUARDED_BY(mu);
};

Registry& Children() {
  static auto* r = new Registry;
  return *r;
}

void Register(pid_t pid) {
  absl::MutexLock lock(&Children().mu);
  Children().pids.push_back(pid);
}

void Forget(pid_t pid) {
  absl::MutexLock lock(&Children().mu);
  std::vector<pid_t>& v = Children().pids;
  v.erase(std::remove(v.begin(), v.end(), pid), v.end());
}

double CpuSeconds(const rusage& u) {
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// Waits for `pid` to become reapable until `deadline`: on a pidfd when the kernel has them
// (5.3+), else by polling every 2 ms.
void AwaitExit(pid_t pid, absl::Time deadline) {
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    const int ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000));
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      if (::poll(&p, 1, ms) > 0) break;
    } else {
      siginfo_t info{};
      if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
          info.si_pid == pid) {
        break;
      }
      ::usleep(2000);
    }
  }
  if (pidfd >= 0) ::close(pidfd);
}

}  // namespace

int ExitCode(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

std::string DescribeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return absl::StrFormat("exit %d", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    return absl::StrFormat("killed by signal %d", WTERMSIG(wait_status));
  }
  return "did not exit";
}

ScopedEnv::ScopedEnv(std::string name, const std::optional<std::string>& value)
    : name_(std::move(name)) {
  if (const char* old = ::getenv(name_.c_str())) old_ = old;
  if (value) {
    ::setenv(name_.c_str(), value->c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

ScopedEnv::~ScopedEnv() {
  if (old_) {
    ::setenv(name_.c_str(), old_->c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

ScopedEnvs::ScopedEnvs(const std::map<std::string, std::string>& env) {
  entries_.reserve(env.size());
  for (const auto& [k, v] : env) {
    entries_.push_back(
        std::make_unique<ScopedEnv>(k, v.empty() ? std::nullopt : std::optional<std::string>(v)));
  }
}

absl::StatusOr<Child> Child::Spawn(const std::vector<std::string>& argv, const Options& options) {
  if (argv.empty()) return absl::InvalidArgumentError("no program to start");
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq != std::string_view::npos) merged[std::string(kv.substr(0, eq))] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : options.env) merged[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : merged) env_strings.push_back(absl::StrCat(k, "=", v));
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> argp;
  for (std::string& s : args) argp.push_back(s.data());
  argp.push_back(nullptr);

  int in[2] = {-1, -1}, out[2] = {-1, -1};
  auto close_pipes = [&] {
    for (int fd : {in[0], in[1], out[0], out[1]}) {
      if (fd >= 0) ::close(fd);
    }
  };
  if ((options.pipe_stdin && ::pipe2(in, O_CLOEXEC) != 0) ||
      (options.pipe_stdout && ::pipe2(out, O_CLOEXEC) != 0)) {
    const int err = errno;
    close_pipes();
    return absl::InternalError(
        absl::StrFormat("cannot start %s: pipe: %s", argv[0], strerror(err)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (options.pipe_stdin) posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  if (options.pipe_stdout) posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  if (!options.log_path.empty()) {
    const int flags = O_WRONLY | O_CREAT | (options.truncate_log ? O_TRUNC : O_APPEND);
    posix_spawn_file_actions_addopen(&actions, 2, options.log_path.c_str(), flags, 0644);
    if (!options.pipe_stdout) posix_spawn_file_actions_adddup2(&actions, 2, 1);
  }
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaddset(&defaults, s);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argp[0], &actions, &attr, argp.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    close_pipes();
    return absl::InternalError(absl::StrFormat("cannot start %s: %s", argv[0], strerror(rc)));
  }
  Register(pid);
  Child c;
  c.pid_ = pid;
  if (options.pipe_stdin) {
    ::close(in[0]);
    c.in_ = in[1];
  }
  if (options.pipe_stdout) {
    ::close(out[1]);
    c.out_ = out[0];
  }
  return c;
}

absl::StatusOr<Child> Child::Start(const std::vector<std::string>& argv,
                                   const std::map<std::string, std::string>& env,
                                   const std::string& log_path) {
  Options options;
  options.env = env;
  options.log_path = log_path;
  return Spawn(argv, options);
}

Child::Child(Child&& o) noexcept
    : pid_(o.pid_),
      in_(o.in_),
      out_(o.out_),
      buffer_(std::move(o.buffer_)),
      exited_(o.exited_),
      exit_(o.exit_) {
  o.pid_ = -1;
  o.in_ = o.out_ = -1;
}

Child& Child::operator=(Child&& o) noexcept {
  if (this != &o) {
    this->~Child();
    new (this) Child(std::move(o));
  }
  return *this;
}

Child::~Child() {
  if (pid_ > 0 && !exited_) {
    ::kill(pid_, SIGKILL);
    Reap(absl::InfiniteFuture());
  }
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
}

bool Child::Reap(absl::Time deadline) {
  if (exited_) return true;
  if (pid_ <= 0) return false;
  if (deadline > absl::InfinitePast()) AwaitExit(pid_, deadline);
  int status = 0;
  rusage u{};
  pid_t r;
  do {
    r = ::wait4(pid_, &status, WNOHANG, &u);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return false;
  // r < 0 (ECHILD): reaped elsewhere (a cleanup that ran); nothing more can be learnt.
  exited_ = true;
  exit_.status = r == pid_ ? status : -1;
  exit_.cpu_s = r == pid_ ? CpuSeconds(u) : 0;
  Forget(pid_);
  return true;
}

absl::StatusOr<int> Child::Wait(absl::Duration timeout) {
  CloseStdin();
  if (!Reap(absl::Now() + timeout)) {
    return absl::DeadlineExceededError(
        absl::StrFormat("child %d still running after %s", pid_, absl::FormatDuration(timeout)));
  }
  return exit_.status;
}

Child::Exit Child::WaitOrKill(absl::Time deadline) {
  CloseStdin();
  if (!Reap(deadline)) {
    ::kill(pid_, SIGKILL);
    Reap(absl::InfiniteFuture());
  }
  return exit_;
}

void Child::Kill(int sig) {
  if (pid_ > 0 && !exited_) ::kill(pid_, sig);
}

bool Child::Send(const std::string& line) {
  if (in_ < 0) return false;
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(in_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

void Child::CloseStdin() {
  if (in_ >= 0) ::close(in_);
  in_ = -1;
}

std::optional<std::string> Child::ReadLine(absl::Time deadline, bool* timed_out) {
  if (timed_out != nullptr) *timed_out = false;
  while (true) {
    if (size_t nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    if (out_ < 0) {
      if (buffer_.empty()) return std::nullopt;
      return std::exchange(buffer_, "");  // a last unterminated line
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      if (timed_out != nullptr) *timed_out = true;
      return std::nullopt;
    }
    pollfd p{out_, POLLIN, 0};
    const int ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000));
    if (::poll(&p, 1, ms) <= 0) continue;
    char buf[65536];
    const ssize_t n = ::read(out_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(out_);
      out_ = -1;
      continue;
    }
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

void StopAllChildren(absl::Duration grace) {
  std::vector<pid_t> pids;
  {
    absl::MutexLock lock(&Children().mu);
    pids.swap(Children().pids);
  }
  for (pid_t pid : pids) ::kill(pid, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  for (pid_t pid : pids) {
    AwaitExit(pid, deadline);
    if (::waitpid(pid, nullptr, WNOHANG) == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
}

absl::StatusOr<RunResult> RunCommand(const std::vector<std::string>& argv, absl::Duration timeout,
                                     const std::map<std::string, std::string>& env) {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat(tmp && *tmp ? tmp : "/tmp", "/weightbus-run-XXXXXX");
  const int fd = ::mkstemp(tmpl.data());
  if (fd < 0) return absl::InternalError(absl::StrCat("mkstemp: ", strerror(errno)));
  ::close(fd);
  auto read_log = [&] {
    std::ifstream in(tmpl, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    ::unlink(tmpl.c_str());
    return ss.str();
  };
  absl::StatusOr<Child> child = Child::Start(argv, env, tmpl);
  if (!child.ok()) {
    read_log();
    return child.status();
  }
  absl::StatusOr<int> status = child->Wait(timeout);
  if (!status.ok()) {
    child->WaitOrKill(absl::InfinitePast());
    return absl::DeadlineExceededError(
        absl::StrCat(argv[0], ": ", status.status().message(), "; output so far:\n", read_log()));
  }
  RunResult result;
  result.exit_code = ExitCode(*status);
  result.output = read_log();
  return result;
}

absl::StatusOr<std::string> RunShell(const std::string& command, absl::Duration timeout) {
  absl::StatusOr<RunResult> r = RunCommand({"/bin/sh", "-c", command}, timeout);
  if (!r.ok()) return r.status();
  if (r->exit_code != 0) {
    return absl::InternalError(
        absl::StrFormat("command failed (exit code %d): %s\n%s", r->exit_code, command, r->output));
  }
  return std::move(r->output);
}

int FreePort(int family) {
  if (family != AF_INET && family != AF_INET6) return -1;
  sockaddr_storage ss{};
  socklen_t len;
  if (family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    len = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_loopback;
    len = sizeof(*a);
  }
  const int listener = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int client = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int accepted = -1;
  int port = -1;
  const int one = 1;  // the TIME_WAIT entry inherits it: SO_REUSEADDR binds may then take the port
  if (listener >= 0 && client >= 0 &&
      ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0 &&
      ::bind(listener, reinterpret_cast<sockaddr*>(&ss), len) == 0 &&
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&ss), &len) == 0 &&
      ::listen(listener, 1) == 0 && ::connect(client, reinterpret_cast<sockaddr*>(&ss), len) == 0 &&
      (accepted = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC)) >= 0) {
    port = ntohs(family == AF_INET ? reinterpret_cast<sockaddr_in*>(&ss)->sin_port
                                   : reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  }
  // The accepted end (local port `port`) closes first, so it is the one left in TIME_WAIT.
  if (accepted >= 0) ::close(accepted);
  if (client >= 0) ::close(client);
  if (listener >= 0) ::close(listener);
  return port;
}

bool WaitForListener(int port, absl::Time deadline) {
  auto listening = [port] {
    for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
      std::ifstream in(table);
      std::string line;
      std::getline(in, line);  // the header
      while (std::getline(in, line)) {
        // "  0: 0100007F:1F90 00000000:0000 0A ...": local address:port (hex), remote, state.
        std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
        if (f.size() < 4 || f[3] != "0A") continue;  // 0A: LISTEN
        const size_t colon = f[1].rfind(':');
        int local = 0;
        if (colon != absl::string_view::npos &&
            absl::SimpleHexAtoi(f[1].substr(colon + 1), &local) && local == port) {
          return true;
        }
      }
    }
    return false;
  };
  while (!listening()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));  // /proc has no change notification
  }
  return true;
}

}  // namespace weightbus::process
