// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the test suites: scratch directories, fixtures, child processes, bytes.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace weightbus::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

// Sets an environment variable for its lifetime and restores the previous value (or its absence)
// on destruction. Fail points come only from WEIGHTBUS_FAILPOINTS, read when a channel is opened:
// in-process tests wrap the Open call in one; child processes get it in their environment.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::string& value) : name_(std::move(name)) {
    if (const char* old = ::getenv(name_.c_str())) old_ = old;
    ::setenv(name_.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// Path of a file in ../shared/fixtures (WEIGHTBUS_FIXTURES_DIR at configure time).
std::string FixturePath(const std::string& rel);
// Path of a built executable in the build tree, e.g. BinaryPath("tools/weightbus").
std::string BinaryPath(const std::string& rel);

// A child process started with posix_spawn; killed (SIGKILL) and reaped on destruction if it
// is still running.
class Child {
 public:
  // Starts `argv[0]` (a path) with `argv`; `env` entries are added to (or override) this
  // process's environment. stdout and stderr go to `log_path` when non-empty.
  static absl::StatusOr<Child> Start(const std::vector<std::string>& argv,
                                     const std::map<std::string, std::string>& env = {},
                                     const std::string& log_path = "");
  Child(Child&& other) noexcept;
  Child& operator=(Child&& other) noexcept;
  ~Child();

  pid_t pid() const { return pid_; }
  // Waits up to `timeout` for exit; returns the raw wait status, or DeadlineExceeded.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  void Kill(int sig);

 private:
  explicit Child(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
};

// Runs `argv` to completion (up to `timeout`) and returns {exit code, stdout+stderr}.
// An exit by signal is reported as 128 + signal number.
struct RunResult {
  int exit_code = -1;
  std::string output;
};
absl::StatusOr<RunResult> RunCommand(const std::vector<std::string>& argv,
                                     absl::Duration timeout = absl::Seconds(120),
                                     const std::map<std::string, std::string>& env = {});

// A loopback TCP port nobody listens on right now (binds port 0 and reads it back), for tests
// that start rendezvous servers; -1 on failure. `family` is AF_INET or AF_INET6.
int FreePort(int family = 2 /* AF_INET */);

// Deterministic pseudo-random bytes (splitmix64 of `seed`).
std::vector<std::byte> RandomBytes(size_t n, uint64_t seed);
// XXH3-64 (seed 0) of `n` bytes at `data`, computed with libxxhash directly.
uint64_t Xxh3(const void* data, size_t n);

// Polls `condition` every few milliseconds until it holds (true) or `timeout` passes (false).
// For effects that happen in the background, such as retention deleting old versions.
bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout = absl::Seconds(10));

// The scheduler state letter of process or thread `pid` from /proc/PID/stat ('R' running, 'S'
// asleep in the kernel, 'T' stopped, ...), or '?' when it cannot be read. A thread id works too.
char ProcessState(pid_t pid);

std::string ReadFileOrDie(const std::string& path);
void WriteFileOrDie(const std::string& path, const std::string& contents);

}  // namespace weightbus::testing
