// SPDX-License-Identifier: Apache-2.0
// Child processes, environment overrides and loopback ports for the programs around the library:
// the test suites (tests/test_support.h) and the benchmarks (bench/wbbench/common.h) both use
// this one home. Linux only; depends on Abseil, not on the library.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace weightbus::process {

// The exit code of a raw wait status: the code of a normal exit, 128 + the signal number of a
// death by signal (as a shell reports it), -1 otherwise.
int ExitCode(int wait_status);
// "exit 0", "killed by signal 9", "did not exit".
std::string DescribeWaitStatus(int wait_status);

// Sets (or, for nullopt, unsets) an environment variable of this process for its lifetime and
// restores the previous value, or its absence, on destruction, including an early return (a
// failed ASSERT_*). Not thread-safe (setenv is not): use it where no other thread reads the
// environment, e.g. around an Open call.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::optional<std::string>& value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// Several ScopedEnv at once: each entry of `env` is set, an empty value unsets the variable.
class ScopedEnvs {
 public:
  explicit ScopedEnvs(const std::map<std::string, std::string>& env);
  ScopedEnvs(const ScopedEnvs&) = delete;
  ScopedEnvs& operator=(const ScopedEnvs&) = delete;

 private:
  std::vector<std::unique_ptr<ScopedEnv>> entries_;
};

// A child process started with posix_spawn, with every signal unblocked and SIGINT, SIGTERM,
// SIGHUP and SIGPIPE at their default dispositions (whatever this process blocks or ignores).
// Every live child is listed for StopAllChildren. Destruction SIGKILLs and reaps a child that has
// not been waited for. Movable, not copyable; one thread at a time per object.
class Child {
 public:
  struct Options {
    // Added to (or overriding) this process's environment; an empty value is set as empty.
    std::map<std::string, std::string> env;
    // The child's stderr, and its stdout unless piped, go to this file (created 0644, appended
    // to unless `truncate_log`); "" leaves them as this process's.
    std::string log_path;
    bool truncate_log = false;
    bool pipe_stdin = false;   // Send and CloseStdin write to the child's stdin
    bool pipe_stdout = false;  // ReadLine reads the child's stdout
  };
  // Starts `argv[0]` (a path, not searched in PATH) with `argv`. Errors: Internal naming the
  // program and the errno text.
  static absl::StatusOr<Child> Spawn(const std::vector<std::string>& argv, const Options& options);
  // Spawn with `env` and stdout and stderr appended to `log_path` (when non-empty).
  static absl::StatusOr<Child> Start(const std::vector<std::string>& argv,
                                     const std::map<std::string, std::string>& env = {},
                                     const std::string& log_path = "");

  Child() = default;
  Child(Child&& other) noexcept;
  Child& operator=(Child&& other) noexcept;
  ~Child();

  // The child's pid (still the same after it was reaped), -1 for a default-constructed object.
  pid_t pid() const { return pid_; }
  // Waits up to `timeout` for the child to exit and returns its raw wait status (the same again
  // once reaped); DeadlineExceeded, leaving it running, when it has not exited by then. Closes
  // the child's stdin pipe first.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // What WaitOrKill returns: the raw wait status and the child's CPU time.
  struct Exit {
    int status = -1;
    double cpu_s = 0;  // user + system CPU seconds of the child (wait4)
    std::string Describe() const { return DescribeWaitStatus(status); }
  };
  // Waits until `deadline`, then SIGKILLs the child and reaps it.
  Exit WaitOrKill(absl::Time deadline);
  // Sends `sig` to the child unless it was reaped.
  void Kill(int sig = SIGKILL);

  // Writes one line (a newline is added) to the child's stdin pipe. False when there is none or
  // it is closed.
  bool Send(const std::string& line);
  void CloseStdin();
  // The next line of the child's stdout pipe (without the newline), waiting until `deadline`;
  // nullopt at end of file or past the deadline (`timed_out` says which).
  std::optional<std::string> ReadLine(absl::Time deadline, bool* timed_out = nullptr);

 private:
  // Reaps the child if it exits by `deadline` (InfinitePast: only if it already has).
  bool Reap(absl::Time deadline);

  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buffer_;
  bool exited_ = false;
  Exit exit_;
};

// SIGTERM to every live Child of this process, then SIGKILL to those still running after
// `grace`; reaps them all. For a program's cleanup on a signal or a fatal error. Thread-safe.
void StopAllChildren(absl::Duration grace);

// Runs `argv` to completion (up to `timeout`; then it is killed) and returns its exit code
// (ExitCode) and stdout and stderr together. Errors: Internal when it cannot start;
// DeadlineExceeded, with the output so far, when it runs past `timeout`.
struct RunResult {
  int exit_code = -1;
  std::string output;
};
absl::StatusOr<RunResult> RunCommand(const std::vector<std::string>& argv,
                                     absl::Duration timeout = absl::Seconds(120),
                                     const std::map<std::string, std::string>& env = {});

// Runs `command` with /bin/sh -c and returns its stdout and stderr together when it exits 0.
// Errors: Internal naming the command, its exit and output otherwise; as RunCommand.
absl::StatusOr<std::string> RunShell(const std::string& command,
                                     absl::Duration timeout = absl::Seconds(600));

// A TCP port on loopback (127.0.0.1 for AF_INET, ::1 for AF_INET6) reserved for the caller, -1
// on failure. The port is bound, connected to and closed from the listening side, which leaves a
// TIME_WAIT entry on it for the kernel's TIME_WAIT period (60 s on Linux): until then no bind to
// port 0 and no outgoing connection of any process is given this port, while a bind with
// SO_REUSEADDR (every ucx:// publisher sets it, as TCP servers do) takes it at once. So two
// callers, even in concurrently running processes, never get the same port, and nothing else
// takes it between this call and the caller's bind.
int FreePort(int family = 2 /* AF_INET */);

// Waits until some socket of this network namespace listens on TCP `port` (/proc/net/tcp and
// tcp6), e.g. a server child started with that port. True once it does, false at `deadline`.
bool WaitForListener(int port, absl::Time deadline);

}  // namespace weightbus::process
