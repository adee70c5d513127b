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
#include "process/process.h"

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

// The directory of version `version` of the disk:// channel at `dir`/channel, as docs/FORMAT.md
// names it (DIR/channel/versions/v<20 digits>).
std::string DiskVersionDir(const ScratchDir& dir, uint64_t version);

// Why this build cannot run a test that needs each of `schemes` (transports and layers as
// weightbus::Transports() names them: "disk", "ucx", "delta"), or "" when it has them all.
// A transport or layer left out at configure time (WEIGHTBUS_WITH_*=OFF) skips the tests that need
// it, with this reason:
//   if (const std::string why = testing::MissingTransports({"delta", "disk"}); !why.empty()) {
//     GTEST_SKIP() << why;
//   }
std::string MissingTransports(const std::vector<std::string>& schemes);

// Environment overrides, child processes and ports: tools/process/process.h, shared with the
// benchmarks. Fail points come only from WEIGHTBUS_FAILPOINTS, read when a channel is opened:
// in-process tests wrap the Open call in a ScopedEnv; child processes get it in their
// environment (Child::Start's `env`).
using ::weightbus::process::Child;
using ::weightbus::process::ExitCode;
using ::weightbus::process::FreePort;
using ::weightbus::process::RunCommand;
using ::weightbus::process::RunResult;
using ::weightbus::process::ScopedEnv;
using ::weightbus::process::ScopedEnvs;

// A `pause` fail point (lib/core/failpoint.h) and the test's side of it: the code at `point`
// announces on its `pass`-th pass (1-based) that it got there, then waits until Release() (at
// most 60 s, then it logs and goes on). Works in this process and in child processes alike, and
// needs only files: the point announces in a private directory that this object owns.
//   testing::PausePoint commit("disk.before_commit");
//   auto child = Child::Start({...}, {{"WEIGHTBUS_FAILPOINTS", commit.Spec()}});  // or ScopedEnv
//   ASSERT_TRUE(commit.WaitReached(absl::Seconds(60)));  // the child is held before LATEST moves
//   ... inspect, kill, publish elsewhere ...
//   commit.Release();                                  // it goes on
// Releasing before the point is reached makes it announce without stopping ("tell me when it
// ran"). Destruction releases and removes the directory (a point hit later does not stop), so
// declare it before the handle whose Open reads Spec(); release it before destroying a handle
// whose own teardown waits for the paused thread (the disk publisher's retention thread).
// Not thread-safe; one object per point and process.
class PausePoint {
 public:
  // FailPoints::kPauseLimit: how long the code waits for Release() before going on.
  static constexpr absl::Duration kLimit = absl::Seconds(60);

  explicit PausePoint(std::string point, int pass = 1);
  ~PausePoint();
  PausePoint(const PausePoint&) = delete;
  PausePoint& operator=(const PausePoint&) = delete;

  // The WEIGHTBUS_FAILPOINTS entry, "POINT=pause:DIR@PASS"; join several with ','.
  std::string Spec() const;
  // Waits up to `timeout` for the point to be reached; true once it has been (now or earlier).
  bool WaitReached(absl::Duration timeout);
  // Whether the point has been reached, without waiting.
  bool Reached() const;
  // The pid of the process that reached the point, or -1 before that.
  pid_t ReachedBy() const;
  // Lets the paused code go on (idempotent).
  void Release();

 private:
  std::string point_;
  int pass_;
  ScratchDir dir_;
};

// Path of a file in ../shared/fixtures (WEIGHTBUS_FIXTURES_DIR at configure time).
std::string FixturePath(const std::string& rel);
// Path of a built executable in the build tree, e.g. BinaryPath("tools/weightbus").
std::string BinaryPath(const std::string& rel);

// Tensor names that a transport must carry as names and never use as paths (docs/TRANSPORTS.md):
// relative and absolute paths that leave a directory (their last component names no file
// anywhere: wb-escape-<pid>-N), "." and "..", the names of a disk:// channel's own files, a name
// with a NUL byte inside, and one of 300 UTF-8 characters of 1 to 4 bytes (803 bytes).
std::vector<std::string> PathLikeTensorNames();

// Every path below `root` (not `root` itself), relative to it, sorted; links are listed, never
// followed.
std::vector<std::string> ListTree(const std::string& root);

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
