// SPDX-License-Identifier: Apache-2.0
#include "test_support.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "xxhash.h"

extern char** environ;

namespace weightbus::testing {

ScratchDir::ScratchDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat(tmp && *tmp ? tmp : "/tmp", "/weightbus-test-XXXXXX");
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = buf.data();
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

PausePoint::PausePoint(std::string point, int pass) : point_(std::move(point)), pass_(pass) {}

PausePoint::~PausePoint() { Release(); }

std::string PausePoint::Spec() const {
  return absl::StrFormat("%s=pause:%s@%d", point_, dir_.path(), pass_);
}

bool PausePoint::WaitReached(absl::Duration timeout) {
  return WaitUntil([&] { return Reached(); }, timeout);
}

bool PausePoint::Reached() const {
  return std::filesystem::exists(dir_ / (point_ + ".reached"));
}

pid_t PausePoint::ReachedBy() const {
  if (!Reached()) return -1;
  int pid = -1;
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFileOrDie(dir_ / (point_ + ".reached"))),
                          &pid)
             ? pid
             : -1;
}

void PausePoint::Release() {
  const std::string release = dir_ / (point_ + ".release");
  if (!std::filesystem::exists(release)) WriteFileOrDie(release, "");
}

std::string FixturePath(const std::string& rel) {
  return absl::StrCat(WEIGHTBUS_FIXTURES_DIR, "/", rel);
}

std::string BinaryPath(const std::string& rel) {
  return absl::StrCat(WEIGHTBUS_BINARY_DIR, "/", rel);
}

absl::StatusOr<Child> Child::Start(const std::vector<std::string>& argv,
                                   const std::map<std::string, std::string>& env,
                                   const std::string& log_path) {
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    size_t eq = kv.find('=');
    if (eq != std::string::npos) merged[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : env) merged[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : merged) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> argp;
  for (auto& s : args) argp.push_back(s.data());
  argp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!log_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                     0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  }
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argp[0], &actions, nullptr, argp.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(absl::StrFormat("posix_spawn %s: %s", argv[0], strerror(rc)));
  }
  return Child(pid);
}

Child::Child(Child&& other) noexcept : pid_(other.pid_) { other.pid_ = -1; }

Child& Child::operator=(Child&& other) noexcept {
  if (this != &other) {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    pid_ = other.pid_;
    other.pid_ = -1;
  }
  return *this;
}

Child::~Child() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

absl::StatusOr<int> Child::Wait(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return status;
    }
    if (r < 0) return absl::InternalError(absl::StrCat("waitpid: ", strerror(errno)));
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrFormat("child %d still running after %s", pid_, absl::FormatDuration(timeout)));
    }
    usleep(2000);
  }
}

void Child::Kill(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

absl::StatusOr<RunResult> RunCommand(const std::vector<std::string>& argv, absl::Duration timeout,
                                     const std::map<std::string, std::string>& env) {
  char tmpl[] = "/tmp/weightbus-run-XXXXXX";
  int fd = mkstemp(tmpl);
  if (fd < 0) return absl::InternalError("mkstemp failed");
  close(fd);
  std::string log = tmpl;
  absl::StatusOr<Child> child = Child::Start(argv, env, log);
  if (!child.ok()) return child.status();
  absl::StatusOr<int> status = child->Wait(timeout);
  RunResult result;
  result.output = ReadFileOrDie(log);
  unlink(log.c_str());
  if (!status.ok()) {
    return absl::DeadlineExceededError(
        absl::StrCat(status.status().message(), "; output so far:\n", result.output));
  }
  if (WIFEXITED(*status)) {
    result.exit_code = WEXITSTATUS(*status);
  } else if (WIFSIGNALED(*status)) {
    result.exit_code = 128 + WTERMSIG(*status);
  }
  return result;
}

int FreePort(int family) {
  int fd = socket(family, SOCK_STREAM, 0);
  if (fd < 0) return -1;
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
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&ss), len) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0;
  close(fd);
  if (!ok) return -1;
  return ntohs(family == AF_INET ? reinterpret_cast<sockaddr_in*>(&ss)->sin_port
                                 : reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
}

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::vector<std::byte> out(n);
  uint64_t x = seed;
  for (size_t i = 0; i < n; i += 8) {
    x += 0x9e3779b97f4a7c15ULL;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    std::memcpy(out.data() + i, &z, std::min<size_t>(8, n - i));
  }
  return out;
}

uint64_t Xxh3(const void* data, size_t n) { return XXH3_64bits(data, n); }

char ProcessState(pid_t pid) {
  std::ifstream in(absl::StrFormat("/proc/%d/stat", pid));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');  // the command name may contain spaces and parentheses
  return paren != std::string::npos && paren + 2 < text.size() ? text[paren + 2] : '?';
}

bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFileOrDie(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << contents;
}

}  // namespace weightbus::testing
