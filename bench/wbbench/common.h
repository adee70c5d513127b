// SPDX-License-Identifier: Apache-2.0
// Small helpers shared by weightbus-bench's subcommands: errors, statistics, sizes, child
// processes talking JSON lines over pipes (tools/process/process.h, shared with the tests).
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
#include "process/process.h"
#include "weightbus/fatal.h"

namespace weightbus::bench {

// Die and OrDie: tools/weightbus/fatal.h (main sets "weightbus-bench", status 2 for a usage or
// set-up error, and RunCleanup below; measurement failures end in "# FAILED: ..." and status 1).
using tools::Die;
using tools::OrDie;

// What the parent process leaves behind when it ends early: directories to remove and child
// processes to stop (every live process::Child: SIGTERM, SIGKILL after 10 s). Die() and the
// signals below run it; a normal end removes what it made itself. Thread-safe.
void RemoveOnExit(const std::string& path);
void RunCleanup();
// The status to end with: `status`, unless a signal (HandleSignalsWithCleanup) is stopping the
// run; then the calling thread waits for the signal's thread to exit with 128 + the signal, so a
// run stopped by a signal always ends with that status, also when stopping its workers made a
// measurement fail first.
int ExitStatus(int status);
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
// A TCP port on 127.0.0.1 reserved for the caller (process::FreePort); dies when there is none.
int FreePort();

// CPU time (user + system) and peak resident set of this process so far.
double SelfCpuSeconds();
// Peak resident set of this process since it started (VmHWM of /proc/self/status), bytes; 0 if
// unreadable. (wait4's ru_maxrss is not used for children: it keeps the parent's peak from
// before exec.)
int64_t SelfPeakRssBytes();
// A "Key: N kB" line of a /proc file (/proc/meminfo, /proc/self/status) in bytes; 0 if absent.
int64_t ProcKiBField(const std::string& file, const std::string& key);

// Child processes: process::Child. Every live one is stopped by RunCleanup.
using process::Child;
// Starts argv[0] (a path) with pipes to its stdin (Child::Send) and from its stdout
// (Child::ReadLine); its stderr goes to `log_path` (truncated).
absl::StatusOr<Child> StartPiped(const std::vector<std::string>& argv, const std::string& log_path);

// The last `max_bytes` bytes of a file (for error messages), "" when unreadable.
std::string FileTail(const std::string& path, size_t max_bytes = 2000);

}  // namespace weightbus::bench
