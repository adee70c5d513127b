// SPDX-License-Identifier: Apache-2.0
// Small helpers shared by weightbus-bench's subcommands: errors, statistics, sizes, child
// processes talking JSON lines over pipes.
#pragma once

#include <sys/resource.h>
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "weightbus/fatal.h"

namespace weightbus::bench {

// Die and OrDie: tools/weightbus/fatal.h (main sets "weightbus-bench", status 2 for a usage or
// set-up error, and RunCleanup below; measurement failures end in "# FAILED: ..." and status 1).
using tools::Die;
using tools::OrDie;

// What the parent process leaves behind when it ends early: directories to remove and child
// processes to kill. Die() and the signals below run it; a normal end removes what it made
// itself. Thread-safe.
void RemoveOnExit(const std::string& path);
void RunCleanup();
// Blocks SIGINT, SIGTERM and SIGHUP in this process and starts a thread that waits for them,
// runs the cleanup and exits with 128 + the signal. Call before starting other threads or
// children (children start with every signal unblocked again).
void HandleSignalsWithCleanup();

// Median (the mean of the two middle values for an even count) and nearest-rank percentile
// (p in (0, 100]: the smallest value with at least p% of the values at or below it); NaN when
// empty.
double Median(std::vector<double> v);
double Percentile(std::vector<double> v, double p);

// 134217728 -> "128.0 MiB".
std::string HumanBytes(double bytes);

// This executable's path (/proc/self/exe).
std::string SelfPath();
// A TCP port on 127.0.0.1 that was free a moment ago.
int FreePort();

// CPU time (user + system) and peak resident set of this process so far.
double SelfCpuSeconds();
// Peak resident set of this process since it started (VmHWM of /proc/self/status), bytes; 0 if
// unreadable. (wait4's ru_maxrss is not used for children: it keeps the parent's peak from
// before exec.)
int64_t SelfPeakRssBytes();
// A "Key: N kB" line of a /proc file (/proc/meminfo, /proc/self/status) in bytes; 0 if absent.
int64_t ProcKiBField(const std::string& file, const std::string& key);

// A child process with pipes to its stdin and from its stdout; stderr goes to a log file.
class Child {
 public:
  // Starts argv[0] (a path). `log_path`: the child's stderr (and nothing else).
  static absl::StatusOr<Child> Start(const std::vector<std::string>& argv,
                                     const std::string& log_path);
  Child() = default;
  Child(Child&& other) noexcept;
  Child& operator=(Child&& other) noexcept;
  ~Child();

  pid_t pid() const { return pid_; }
  // Writes one line (a newline is added). False when the child's stdin is closed.
  bool Send(const std::string& line);
  void CloseStdin();
  // Reads the next line of the child's stdout (without the newline) until `deadline`; nullopt
  // at end of file or past the deadline (`timed_out` says which).
  std::optional<std::string> ReadLine(absl::Time deadline, bool* timed_out = nullptr);
  // Waits for the child to exit (SIGKILL after `deadline`) and collects its resource usage;
  // once it has, returns the same again.
  struct Exit {
    int status = -1;               // raw wait status
    double cpu_s = 0;              // user + system CPU seconds of the child
    std::string Describe() const;  // "exit 0", "killed by signal 9", ...
  };
  Exit Wait(absl::Time deadline);
  void Kill();

 private:
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buffer_;
  bool exited_ = false;
  Exit exit_;
};

// Starts argv[0] (a path) with this process's stdin, stdout and stderr, all signals unblocked,
// registered for the cleanup above. WaitChild waits for it (retrying on EINTR) and returns the
// raw wait status.
absl::StatusOr<pid_t> SpawnInheriting(const std::vector<std::string>& argv);
int WaitChild(pid_t pid);

// The last `max_bytes` bytes of a file (for error messages), "" when unreadable.
std::string FileTail(const std::string& path, size_t max_bytes = 2000);

}  // namespace weightbus::bench
