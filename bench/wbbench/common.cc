// SPDX-License-Identifier: Apache-2.0
#include "wbbench/common.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

extern char** environ;

namespace weightbus::bench {

namespace {

struct Cleanup {
  absl::Mutex mu;
  std::vector<std::string> paths ABSL_GUARDED_BY(mu);
  std::vector<pid_t> children ABSL_GUARDED_BY(mu);
};

Cleanup& TheCleanup() {
  static auto* c = new Cleanup;
  return *c;
}

// Drops `pid` from the children the cleanup would stop (it was waited for).
void ForgetChild(pid_t pid) {
  absl::MutexLock lock(&TheCleanup().mu);
  std::vector<pid_t>& v = TheCleanup().children;
  v.erase(std::remove(v.begin(), v.end(), pid), v.end());
}

// posix_spawn of argv[0] (a path) with `actions` (may be null), registered for the cleanup. The
// child starts with every signal unblocked and default dispositions for the ones the parent
// handles (HandleSignalsWithCleanup blocks them here).
absl::StatusOr<pid_t> SpawnWith(const std::vector<std::string>& argv,
                                const posix_spawn_file_actions_t* actions) {
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaddset(&defaults, s);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0].c_str(), actions, &attr, args.data(), environ);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::InternalError(absl::StrFormat("cannot start %s: %s", argv[0], strerror(rc)));
  }
  absl::MutexLock lock(&TheCleanup().mu);
  TheCleanup().children.push_back(pid);
  return pid;
}

}  // namespace

void RemoveOnExit(const std::string& path) {
  absl::MutexLock lock(&TheCleanup().mu);
  TheCleanup().paths.push_back(path);
}

void RunCleanup() {
  Cleanup& c = TheCleanup();
  absl::MutexLock lock(&c.mu);
  // SIGTERM first (a child `run` of a sweep then cleans up after itself), SIGKILL after 10 s.
  for (pid_t pid : c.children) kill(pid, SIGTERM);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (pid_t pid : c.children) {
    while (waitpid(pid, nullptr, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  c.children.clear();
  for (const std::string& p : c.paths) {
    std::error_code ec;
    std::filesystem::remove_all(p, ec);
  }
  c.paths.clear();
}

void HandleSignalsWithCleanup() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, s);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) return;
    std::fprintf(stderr,
                 "\nweightbus-bench: %s: stopping the processes, removing the run's "
                 "directories\n",
                 strsignal(sig));
    RunCleanup();
    _exit(128 + sig);
  }).detach();
}

double Median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, double(v.size()))) - 1;
  return v[index];
}

std::string HumanBytes(double b) {
  if (b >= 1099511627776.0) return absl::StrFormat("%.2f TiB", b / 1099511627776.0);
  if (b >= 1073741824.0) return absl::StrFormat("%.2f GiB", b / 1073741824.0);
  if (b >= 1048576.0) return absl::StrFormat("%.1f MiB", b / 1048576.0);
  if (b >= 1024.0) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrFormat("%.0f B", b);
}

std::string SelfPath() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) Die("readlink /proc/self/exe failed");
  return std::string(buf, static_cast<size_t>(n));
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    Die("cannot find a free TCP port on 127.0.0.1");
  }
  close(fd);
  return ntohs(a.sin_port);
}

int64_t ProcKiBField(const std::string& file, const std::string& key) {
  std::ifstream f(file);
  std::string word;
  int64_t kib = 0;
  while (f >> word) {
    if (word == key + ":") {
      f >> kib;
      return kib * 1024;
    }
    std::getline(f, word);
  }
  return 0;
}

int64_t SelfPeakRssBytes() { return ProcKiBField("/proc/self/status", "VmHWM"); }

double SelfCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec / 1e6;
}

absl::StatusOr<Child> Child::Start(const std::vector<std::string>& argv,
                                   const std::string& log_path) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrFormat("pipe: %s", strerror(errno)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addopen(&actions, 2, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  absl::StatusOr<pid_t> pid = SpawnWith(argv, &actions);
  posix_spawn_file_actions_destroy(&actions);
  close(in[0]);
  close(out[1]);
  if (!pid.ok()) {
    close(in[1]);
    close(out[0]);
    return pid.status();
  }
  Child c;
  c.pid_ = *pid;
  c.in_ = in[1];
  c.out_ = out[0];
  return c;
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
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    ForgetChild(pid_);
  }
  if (in_ >= 0) close(in_);
  if (out_ >= 0) close(out_);
}

bool Child::Send(const std::string& line) {
  if (in_ < 0) return false;
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = write(in_, data.data() + done, data.size() - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

void Child::CloseStdin() {
  if (in_ >= 0) close(in_);
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
    if (out_ < 0) return std::nullopt;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      if (timed_out != nullptr) *timed_out = true;
      return std::nullopt;
    }
    pollfd p{out_, POLLIN, 0};
    const int ms = static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000));
    if (poll(&p, 1, ms) <= 0) continue;
    char buf[65536];
    const ssize_t n = read(out_, buf, sizeof(buf));
    if (n <= 0) {
      close(out_);
      out_ = -1;
      continue;  // returns a last unterminated line, if any, then end of file
    }
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

Child::Exit Child::Wait(absl::Time deadline) {
  if (pid_ <= 0 || exited_) return exit_;
  Exit e;
  CloseStdin();
  rusage u{};
  int status = 0;
  while (true) {
    const pid_t r = wait4(pid_, &status, absl::Now() < deadline ? WNOHANG : 0, &u);
    if (r == pid_) break;
    if (r < 0 && errno != EINTR) break;
    if (absl::Now() >= deadline) {
      kill(pid_, SIGKILL);
    } else {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  exited_ = true;
  ForgetChild(pid_);
  e.status = status;
  e.cpu_s =
      u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec / 1e6;
  exit_ = e;
  return e;
}

void Child::Kill() {
  if (pid_ > 0 && !exited_) kill(pid_, SIGKILL);
}

std::string Child::Exit::Describe() const {
  if (WIFEXITED(status)) return absl::StrFormat("exit %d", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrFormat("killed by signal %d", WTERMSIG(status));
  return "did not exit";
}

absl::StatusOr<pid_t> SpawnInheriting(const std::vector<std::string>& argv) {
  return SpawnWith(argv, nullptr);
}

int WaitChild(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ForgetChild(pid);
  return status;
}

std::string FileTail(const std::string& path, size_t max_bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (s.size() > max_bytes) s = "..." + s.substr(s.size() - max_bytes);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace weightbus::bench
