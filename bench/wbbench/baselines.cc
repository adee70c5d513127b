// SPDX-License-Identifier: Apache-2.0
#include "wbbench/baselines.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace weightbus::bench {

double MemcpySeconds(const std::byte* src, std::byte* sink, size_t n) {
  double seconds = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const absl::Time t0 = absl::Now();
    std::memcpy(sink, src, n);
    seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  }
  return seconds;
}

absl::StatusOr<FileTimes> WriteFsyncRead(const std::string& dir, const std::byte* src,
                                         std::byte* sink, size_t n) {
  const std::string path = absl::StrFormat("%s/baseline-%d.bin", dir, getpid());
  FileTimes t;
  const absl::Time t0 = absl::Now();
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrFormat("open %s: %s", path, strerror(errno)));
  for (size_t done = 0; done < n;) {
    const ssize_t w = write(fd, src + done, std::min<size_t>(4 << 20, n - done));
    if (w <= 0) {
      close(fd);
      return absl::InternalError(absl::StrFormat("write %s: %s", path, strerror(errno)));
    }
    done += static_cast<size_t>(w);
  }
  if (fsync(fd) != 0) {
    close(fd);
    return absl::InternalError(absl::StrFormat("fsync %s: %s", path, strerror(errno)));
  }
  close(fd);
  const absl::Time t1 = absl::Now();
  fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrFormat("open %s: %s", path, strerror(errno)));
  for (size_t done = 0; done < n;) {
    const ssize_t r = pread(fd, sink + done, std::min<size_t>(4 << 20, n - done), done);
    if (r <= 0) {
      close(fd);
      return absl::InternalError(absl::StrFormat("pread %s: %s", path, strerror(errno)));
    }
    done += static_cast<size_t>(r);
  }
  close(fd);
  const absl::Time t2 = absl::Now();
  unlink(path.c_str());
  t.write_fsync_s = absl::ToDoubleSeconds(t1 - t0);
  t.read_s = absl::ToDoubleSeconds(t2 - t1);
  return t;
}

absl::StatusOr<double> UcxPerftest(const std::string& perftest, uint64_t bytes, int iterations,
                                   const std::string& log_dir) {
  const int port = FreePort();
  absl::StatusOr<Child> server =
      StartPiped({perftest, "-p", std::to_string(port)}, log_dir + "/ucx_perftest-server.log");
  if (!server.ok()) return server.status();
  if (!process::WaitForListener(port, absl::Now() + absl::Seconds(30))) {
    return absl::UnavailableError(
        absl::StrFormat("the ucx_perftest server did not listen on port %d within 30 s (%s); %s",
                        port, server->WaitOrKill(absl::Now()).Describe(),
                        FileTail(log_dir + "/ucx_perftest-server.log", 400)));
  }
  absl::StatusOr<Child> client =
      StartPiped({perftest, "127.0.0.1", "-p", std::to_string(port), "-t", "ucp_get", "-s",
                  std::to_string(bytes), "-n", std::to_string(iterations), "-w", "2", "-f"},
                 log_dir + "/ucx_perftest-client.log");
  if (!client.ok()) return client.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  std::string last;
  while (std::optional<std::string> line = client->ReadLine(deadline)) {
    if (line->find_first_not_of(" \t") != std::string::npos) last = *line;
  }
  const Child::Exit ce = client->WaitOrKill(deadline);
  const Child::Exit se = server->WaitOrKill(absl::Now() + absl::Seconds(10));
  if (!WIFEXITED(ce.status) || WEXITSTATUS(ce.status) != 0) {
    return absl::UnavailableError(
        absl::StrFormat("ucx_perftest client: %s; %s", ce.Describe(),
                        FileTail(log_dir + "/ucx_perftest-client.log", 300)));
  }
  // Last line: iterations, latency (typical, avg, overall), bandwidth (avg, overall) in MB/s
  // (which ucx_perftest means as MiB/s), message rate.
  std::vector<std::string> f = absl::StrSplit(last, ' ', absl::SkipWhitespace());
  double mib_s = 0;
  if (f.size() < 6 || !absl::SimpleAtod(f[5], &mib_s) || mib_s <= 0) {
    return absl::DataLossError("cannot parse ucx_perftest output: " + last);
  }
  (void)se;
  return mib_s * 1048576.0 / 1e9;
}

bool TorchBaselines::Start(const std::string& python, const std::string& script,
                           const std::string& store, const std::string& dir, int readers,
                           const std::string& log_path, std::string* why) {
  log_path_ = log_path;
  if (access(python.c_str(), X_OK) != 0) {
    *why = python + " not found";
    return false;
  }
  absl::StatusOr<Child> c =
      StartPiped({python, script, "--store", store, "--dir", dir, "--readers",
                  std::to_string(readers), "--port", std::to_string(FreePort())},
                 log_path);
  if (!c.ok()) {
    *why = std::string(c.status().message());
    return false;
  }
  child_ = *std::move(c);
  std::optional<std::string> line = child_->ReadLine(absl::Now() + absl::Seconds(300));
  nlohmann::json j = line ? nlohmann::json::parse(*line, nullptr, false)
                          : nlohmann::json(nlohmann::json::value_t::discarded);
  if (j.is_discarded() || !j.contains("ready")) {
    *why = !j.is_discarded() && j.contains("skipped")
               ? j["skipped"].get<std::string>()
               : "the script did not start: " + FileTail(log_path, 400);
    Stop();
    return false;
  }
  version_ = j.value("torch", "?");
  return true;
}

absl::StatusOr<nlohmann::json> TorchBaselines::Run(const std::string& what,
                                                   absl::Duration timeout) {
  if (!child_ || !child_->Send(what)) return absl::UnavailableError("torch baselines not running");
  std::optional<std::string> line = child_->ReadLine(absl::Now() + timeout);
  nlohmann::json j = line ? nlohmann::json::parse(*line, nullptr, false)
                          : nlohmann::json(nlohmann::json::value_t::discarded);
  if (j.is_discarded() || j.contains("error")) {
    const std::string msg = j.is_discarded() ? FileTail(log_path_, 400) : j["error"].dump();
    Stop();
    return absl::UnavailableError("torch baseline " + what + " failed: " + msg);
  }
  return j;
}

void TorchBaselines::Stop() {
  if (!child_) return;
  child_->Send("quit");
  child_->WaitOrKill(absl::Now() + absl::Seconds(30));
  child_.reset();
}

}  // namespace weightbus::bench
