// SPDX-License-Identifier: Apache-2.0
#include "fault/fault_harness.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::testing::fault {

Flags& GlobalFlags() {
  static Flags flags;
  return flags;
}

uint64_t SeedFor(const std::string& name) {
  // Stable across processes and builds (absl::Hash is salted per process): FNV-1a of the name,
  // mixed with the run's seed by splitmix64's finaliser.
  uint64_t h = 14695981039346656037ull;
  for (const char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  uint64_t z = GlobalFlags().seed ^ h;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) | 1;
}

std::string Tally::Describe() const {
  std::vector<std::string> codes;
  for (const auto& [code, n] : errors) codes.push_back(absl::StrFormat("%s=%d", code, n));
  return absl::StrFormat(
      "iterations=%d faults=%d kills=%d (publisher %d) stops=%d (publisher %d) restarts=%d "
      "published=%d publish_failures=%d versions_checked=%d wait_errors=%d torn=%d hangs=%d "
      "crashes=%d errors{%s}",
      iterations, kills + stops, kills, publisher_kills, stops, publisher_stops, restarts,
      published, publish_failures, versions_checked, wait_errors, torn, hangs, crashes,
      absl::StrJoin(codes, " "));
}

PeerProcess::PeerProcess(Role role, std::string name, std::vector<std::string> argv,
                         std::map<std::string, std::string> env, std::string log,
                         absl::Duration timeout)
    : role_(role),
      name_(std::move(name)),
      argv_(std::move(argv)),
      env_(std::move(env)),
      log_(std::move(log)),
      timeout_(timeout) {}

absl::Status PeerProcess::Start(Tally& tally) {
  process::Child::Options options;
  options.env = env_;
  options.log_path = log_;
  options.pipe_stdin = role_ == Role::kPublisher;
  options.pipe_stdout = true;
  auto child = process::Child::Spawn(argv_, options);
  if (!child.ok()) return child.status();
  child_ = *std::move(child);
  running_ = true;
  sent_ = answered_ = 0;
  held_ = 0;
  first_.reset();
  if (role_ != Role::kPublisher) return absl::OkStatus();
  const absl::Time deadline = absl::Now() + timeout_ + kWaitGrace;
  while (true) {
    bool timed_out = false;
    std::optional<std::string> line = Next(deadline, tally, &timed_out);
    if (!line) {
      return absl::UnavailableError(absl::StrFormat("%s did not open (%s): %s", name_,
                                                    timed_out ? "timed out" : "ended", LogTail()));
    }
    if (absl::StartsWith(*line, "open")) break;
  }
  return absl::OkStatus();
}

namespace {

// The number after `key` ("ms=") in `line`, or -1.
int64_t Field(const std::string& line, std::string_view key) {
  const size_t at = line.find(key);
  if (at == std::string::npos) return -1;
  std::string_view rest = std::string_view(line).substr(at + key.size());
  rest = rest.substr(0, rest.find(' '));
  int64_t n = -1;
  return absl::SimpleAtoi(absl::string_view(rest.data(), rest.size()), &n) ? n : -1;
}

// The status code word of "... CODE: message" after the "ms=M " field.
std::string CodeOf(const std::string& line) {
  const size_t ms = line.find("ms=");
  if (ms == std::string::npos) return "?";
  const size_t space = line.find(' ', ms);
  if (space == std::string::npos) return "?";
  const size_t colon = line.find(':', space);
  return line.substr(space + 1, colon == std::string::npos ? std::string::npos : colon - space - 1);
}

}  // namespace

void PeerProcess::Problem(const std::string& what, Tally& tally, int64_t Tally::*counter) {
  if (counter != nullptr) ++(tally.*counter);
  problems_.push_back(absl::StrFormat("%s (pid %d): %s", name_, child_.pid(), what));
}

std::optional<std::string> PeerProcess::Next(absl::Time deadline, Tally& tally, bool* timed_out) {
  bool late = false;
  std::optional<std::string> line = child_.ReadLine(deadline, &late);
  if (timed_out != nullptr) *timed_out = late;
  if (!line) return line;
  lines_.push_back(*line);
  const int64_t ms = Field(*line, "ms=");
  const int64_t hwm = Field(*line, "hwm_kb=");
  if (hwm >= 0) hwm_kib_ = hwm;
  if (ms >= 0 && absl::Milliseconds(ms) > timeout_ + kWaitGrace + stopped_total_) {
    Problem(absl::StrFormat("a call took %d ms, past its timeout of %s: %s", ms,
                            absl::FormatDuration(timeout_), *line),
            tally, &Tally::hangs);
  }
  std::vector<std::string> words = absl::StrSplit(*line, ' ');
  uint64_t v = 0;
  const bool numbered = words.size() > 1 && absl::SimpleAtoi(words[1], &v);
  if (words[0] == "open") {
    open_hwm_kib_ = hwm;
  } else if (words[0] == "published" && numbered) {
    ++answered_;
    ++tally.published;
    published_ = v;
  } else if (words[0] == "failed" && numbered) {
    ++answered_;
    ++tally.publish_failures;
    ++tally.errors["publish " + CodeOf(*line)];
  } else if (words[0] == "received" && numbered) {
    if (v <= held_) Problem("went backwards: " + *line, tally, &Tally::torn);
    held_ = v;
    if (!first_) first_ = v;
    hwm_at_[v] = hwm;
    ++tally.versions_checked;
  } else if (words[0] == "error") {
    const std::string code = CodeOf(*line);
    ++tally.wait_errors;
    ++tally.errors[code];
    // What a fault may cost a wait: its publisher gone or stopped (Unavailable, DeadlineExceeded)
    // or a version refused whole (DataLoss). Anything else is a defect.
    if (code != "UNAVAILABLE" && code != "DEADLINE_EXCEEDED" && code != "DATA_LOSS") {
      Problem("unexpected error: " + *line, tally, nullptr);
    }
  } else if (words[0] == "mismatch" || words[0] == "backwards") {
    Problem(*line, tally, &Tally::torn);
  } else {
    Problem("unexpected line: " + *line, tally, nullptr);
  }
  return line;
}

bool PeerProcess::AwaitAnswered(absl::Time deadline, Tally& tally) {
  while (answered_ < sent_) {
    if (!Next(deadline, tally)) return false;
  }
  return true;
}

bool PeerProcess::AwaitHolds(uint64_t version, absl::Time deadline, Tally& tally) {
  while (held_ < version) {
    if (!Next(deadline, tally)) return false;
  }
  return true;
}

void PeerProcess::Send(uint64_t version) {
  ++sent_;
  (void)child_.Send(std::to_string(version));
}

void PeerProcess::KillAndReap(Tally& tally) {
  // Whether it was still there when the signal was sent: otherwise it died by itself.
  if (!CheckAlive(tally)) return;
  child_.Kill(SIGKILL);
  ++tally.kills;
  if (role_ == Role::kPublisher) ++tally.publisher_kills;
  auto status = child_.Wait(absl::Seconds(60));
  // What it printed before it died still counts (and is checked).
  while (Next(absl::Now() + absl::Seconds(60), tally)) {
  }
  running_ = false;
  if (!status.ok()) {
    Problem("not reaped after SIGKILL: " + status.status().ToString(), tally, &Tally::hangs);
  } else if (process::ExitCode(*status) != 128 + SIGKILL) {
    Problem("ended with " + process::DescribeWaitStatus(*status) + " instead of our SIGKILL", tally,
            &Tally::crashes);
  }
}

void PeerProcess::StopFor(absl::Duration stopped, Tally& tally) {
  if (!CheckAlive(tally)) return;
  child_.Kill(SIGSTOP);
  ++tally.stops;
  if (role_ == Role::kPublisher) ++tally.publisher_stops;
  absl::SleepFor(stopped);  // the fault itself: how long the process is held
  stopped_total_ += stopped + absl::Milliseconds(1);
  child_.Kill(SIGCONT);
}

bool PeerProcess::CheckAlive(Tally& tally) {
  if (!running_) return false;
  // Child::Wait would close a publisher's stdin: look at the process instead ('Z': it ended and
  // waits to be reaped).
  const char state = ProcessState(child_.pid());
  if (state != 'Z' && state != '?') return true;
  auto status = child_.Wait(absl::Seconds(10));
  if (!status.ok()) return true;
  running_ = false;
  // Finish() is the only place an exit is expected.
  Problem("ended by itself: " + process::DescribeWaitStatus(*status) + "; " + LogTail(), tally,
          &Tally::crashes);
  return false;
}

void PeerProcess::Finish(absl::Time deadline, Tally& tally) {
  if (!running_) return;
  if (role_ == Role::kPublisher) {
    (void)AwaitAnswered(deadline, tally);
    child_.CloseStdin();
  }
  while (Next(deadline, tally)) {
  }
  auto status = child_.Wait(std::max(deadline - absl::Now(), absl::ZeroDuration()));
  running_ = false;
  if (!status.ok()) {
    Problem("did not finish: " + status.status().ToString(), tally, &Tally::hangs);
    child_.Kill(SIGKILL);
  } else if (process::ExitCode(*status) != 0) {
    Problem("ended with " + process::DescribeWaitStatus(*status) + "; " + LogTail(), tally,
            &Tally::crashes);
  }
}

std::string PeerProcess::LogTail() const {
  if (!std::filesystem::exists(log_)) return "(no log)";
  std::string log = ReadFileOrDie(log_);
  if (log.size() > 2000) log = "..." + log.substr(log.size() - 2000);
  return log_ + ": " + log;
}

std::vector<Stack> ProcessStacks() {
  std::vector<Stack> stacks;
  for (const Stack& s : Stacks()) {
    if (s.cross_process) stacks.push_back(s);
  }
  return stacks;
}

Channel MakeChannel(const Stack& stack, const ScratchDir& dir, const std::string& query) {
  Channel c;
  c.skip = MissingStackTransports(stack);
  if (!c.skip.empty()) return c;
  const int port = absl::StrContains(stack.uri, "{port}") ? FreePort() : 0;
  static std::atomic<int> channels{0};
  c.uri = StackUri(stack, dir.path(), port, absl::StrFormat("fault-%d-%d", getpid(), channels++),
                   query);
  for (const auto& [k, v] : stack.env.env) c.env[k] = v;
  if (port != 0) {
    // A networked stack is skipped, with the reason, only when its transport cannot run here
    // with the stack's environment (as in the conformance suite).
    const ScopedEnvs env(stack.env.env);
    auto probe = Publisher::Open(StackUri(stack, dir.path(), FreePort(), "probe"));
    if (!probe.ok() && !absl::IsFailedPrecondition(probe.status())) {
      c.skip = absl::StrFormat("%s cannot run here: %s", stack.name, probe.status().ToString());
    }
  }
  return c;
}

}  // namespace weightbus::testing::fault
