// SPDX-License-Identifier: Apache-2.0
#include "wbbench/common.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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

namespace weightbus::bench {

namespace {

struct Cleanup {
  absl::Mutex mu;
  std::vector<std::string> paths ABSL_GUARDED_BY(mu);
};

Cleanup& TheCleanup() {
  static auto* c = new Cleanup;
  return *c;
}

}  // namespace

void RemoveOnExit(const std::string& path) {
  absl::MutexLock lock(&TheCleanup().mu);
  TheCleanup().paths.push_back(path);
}

void RunCleanup() {
  // SIGTERM first (a child `run` of a sweep then cleans up after itself), SIGKILL after 10 s.
  process::StopAllChildren(absl::Seconds(10));
  Cleanup& c = TheCleanup();
  absl::MutexLock lock(&c.mu);
  for (const std::string& p : c.paths) {
    std::error_code ec;
    std::filesystem::remove_all(p, ec);
  }
  c.paths.clear();
}

namespace {
std::atomic<int> stop_signal{0};  // the signal being handled, 0 while none
}  // namespace

int ExitStatus(int status) {
  if (stop_signal.load() != 0) {
    for (;;) pause();  // every handled signal is blocked here: the signal's thread exits
  }
  return status;
}

void HandleSignalsWithCleanup() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, s);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) return;
    stop_signal.store(sig);
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
  const int port = process::FreePort();
  if (port < 0) Die("cannot reserve a free TCP port on 127.0.0.1");
  return port;
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

absl::StatusOr<Child> StartPiped(const std::vector<std::string>& argv,
                                 const std::string& log_path) {
  Child::Options options;
  options.log_path = log_path;
  options.truncate_log = true;
  options.pipe_stdin = true;
  options.pipe_stdout = true;
  return Child::Spawn(argv, options);
}

std::string FileTail(const std::string& path, size_t max_bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  std::ostringstream read;  // not istreambuf_iterator, which lets a read error throw
  read << f.rdbuf();
  std::string s = read.str();
  if (s.size() > max_bytes) s = "..." + s.substr(s.size() - max_bytes);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace weightbus::bench
