// SPDX-License-Identifier: Apache-2.0
// The fault-injection suite's processes (tests/fault/): a publisher (`wb_test_peer serve`, driven
// through its stdin) and subscribers (`wb_test_peer follow`, which check every version they
// receive byte for byte against test_model.h's copy and outlive faults), read through pipes, with
// every line they print checked as it is read: no torn or unverified version, no version going
// backwards, no wait past its timeout, no error of an unexpected kind. The tallies are the
// figures docs/RELIABILITY.md reports.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "test_support.h"
#include "transport_stack.h"

namespace weightbus::testing::fault {

// The suite's command-line flags (fault_main.cc), read by every case.
struct Flags {
  int iterations = 25;       // --iterations: faults per transport stack
  uint64_t seed = 0;         // --seed: 0 draws one (printed); a printed one replays the run
  int memory_versions = 60;  // --memory-versions: versions of the memory case
  int memory_subscribers = 8;
  uint64_t bytes = 1 << 20;  // --bytes: approximate bytes per version
};
Flags& GlobalFlags();
// The run's seed for `name` (a stack or a case): GlobalFlags().seed, or the one drawn for this
// run, mixed with `name` so that every stack gets its own stream.
uint64_t SeedFor(const std::string& name);

// What every check counted; summed over a run and printed as the "[ figures ]" line.
struct Tally {
  int64_t iterations = 0;
  int64_t kills = 0, publisher_kills = 0;
  int64_t stops = 0, publisher_stops = 0;
  int64_t published = 0, publish_failures = 0;
  int64_t versions_checked = 0;  // versions a subscriber received and compared byte for byte
  int64_t wait_errors = 0;       // waits that ended in an error (counted by code in `errors`)
  int64_t torn = 0;              // "mismatch" or "backwards" lines: must stay 0
  int64_t hangs = 0;             // waits past their timeout, progress that never came
  int64_t crashes = 0;           // a process exiting other than by the test's own SIGKILL
  int64_t restarts = 0;
  std::map<std::string, int64_t> errors;
  std::string Describe() const;
};

// One process of the suite, its stdout piped to the harness (stderr to `log`).
class PeerProcess {
 public:
  enum class Role { kPublisher, kSubscriber };
  PeerProcess(Role role, std::string name, std::vector<std::string> argv,
              std::map<std::string, std::string> env, std::string log, absl::Duration timeout);

  // Starts (or restarts) the process; a publisher is waited for until it says "open".
  absl::Status Start(Tally& tally);
  // The next line, checked and counted (see the top of this file). nullopt at EOF or past the
  // deadline (`*timed_out`). Problems are appended to `problems`.
  std::optional<std::string> Next(absl::Time deadline, Tally& tally, bool* timed_out = nullptr);
  // Reads lines until a publisher has answered every version sent, or a subscriber holds
  // `version` or above. False past `deadline` (a hang) or at EOF.
  bool AwaitAnswered(absl::Time deadline, Tally& tally);
  bool AwaitHolds(uint64_t version, absl::Time deadline, Tally& tally);

  void Send(uint64_t version);  // a publisher: publish `version`
  // SIGKILL; reaps it and reads what it printed before it died. A death other than by this
  // SIGKILL is a crash.
  void KillAndReap(Tally& tally);
  // SIGSTOP, then SIGCONT after `stopped` (a drawn duration: the fault, not a synchronisation).
  void StopFor(absl::Duration stopped, Tally& tally);
  // Closes a publisher's stdin and waits for it, or waits for a subscriber to finish; an exit
  // other than 0 is a crash.
  void Finish(absl::Time deadline, Tally& tally);
  // Whether it still runs; if it ended, that is counted as a crash.
  bool CheckAlive(Tally& tally);

  Role role() const { return role_; }
  const std::string& name() const { return name_; }
  pid_t pid() const { return child_.pid(); }
  uint64_t held() const { return held_; }                   // a subscriber's newest version
  std::optional<uint64_t> first() const { return first_; }  // its first since (re)start
  uint64_t published() const { return published_; }         // a publisher's newest published
  int64_t open_hwm_kib() const { return open_hwm_kib_; }
  int64_t hwm_kib() const { return hwm_kib_; }
  std::map<uint64_t, int64_t>& hwm_at() { return hwm_at_; }  // VmHWM at each version
  const std::vector<std::string>& problems() const { return problems_; }
  const std::vector<std::string>& lines() const { return lines_; }  // every line read
  std::string LogTail() const;

 private:
  void Problem(const std::string& what, Tally& tally, int64_t Tally::*counter);

  Role role_;
  std::string name_;
  std::vector<std::string> argv_;
  std::map<std::string, std::string> env_;
  std::string log_;
  absl::Duration timeout_;
  absl::Duration stopped_total_;  // how long this process was stopped, all in all
  process::Child child_;
  bool running_ = false;
  int64_t sent_ = 0, answered_ = 0;
  uint64_t held_ = 0, published_ = 0;
  std::optional<uint64_t> first_;
  int64_t open_hwm_kib_ = -1, hwm_kib_ = -1;
  std::map<uint64_t, int64_t> hwm_at_;
  std::vector<std::string> problems_;
  std::vector<std::string> lines_;
};

// How much later than its own timeout a wait may return before it counts as a hang: scheduling
// on a loaded machine, not a threshold on the library's speed (its timeouts are 10-20 s).
inline constexpr absl::Duration kWaitGrace = absl::Seconds(5);

// The stacks the suite runs over: every stack of the conformance suite other processes reach.
std::vector<Stack> ProcessStacks();

// A channel of `stack` for one case: its URI (fresh directory and port), its environment, and
// why it cannot run here ("" when it can).
struct Channel {
  std::string uri;
  std::map<std::string, std::string> env;
  std::string skip;
};
Channel MakeChannel(const Stack& stack, const ScratchDir& dir, const std::string& query = "");

}  // namespace weightbus::testing::fault
