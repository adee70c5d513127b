// SPDX-License-Identifier: Apache-2.0
#include "wbbench/group_run.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "wbbench/common.h"
#include "wbbench/tp_layout.h"

namespace weightbus::bench {
namespace {

namespace fs = std::filesystem;

// The figures of one (N, M) pair.
struct PairResult {
  int publishers = 1, tp = 1;
  uint64_t slice_bytes = 0;      // one TP rank's slices
  uint64_t read_max = 0;         // the most bytes one TP rank read in a version
  uint64_t read_min = ~0ull;     // the fewest
  std::vector<double> last_s;    // per measured version: first publisher call to last rank ready
  std::vector<double> commit_s;  // per measured version: first publisher call to the last
                                 // rank's Publish returning (the group commit)
  double control_files = 0;      // per version (median): disk's metadata files, or ucx's
                                 // group-commit messages (PART and OUTCOME per rank > 0)
  int64_t subscriber_rss = 0;    // the largest peak RSS of a TP rank
  // Per measured version: the bytes every rank published through the stack beneath (its wire
  // bytes: under delta, what each rank encoded its parts to), summed over the ranks, and the
  // most one rank published.
  std::vector<double> wire_bytes, wire_max;
  uint64_t wire_all = 0;  // over every version, the first (a keyframe under delta) included
  int wrong = 0;          // slices that differed from the store, or versions that failed
  std::string failure;
};

// Metadata files a committed disk version holds (everything but tensor data), plus the LATEST
// file that commits it: what the group writes to agree on a version, and what subscribers read
// before any tensor byte.
int ControlFiles(const std::string& version_dir) {
  int n = 1;  // LATEST
  std::error_code ec;
  for (fs::recursive_directory_iterator it(version_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->is_regular_file(ec) && !absl::EndsWith(it->path().string(), ".safetensors")) ++n;
  }
  return n;
}

class Pair {
 public:
  Pair(const GroupRunConfig& c, const StoreIndex& index, int publishers, int tp) : c_(c) {
    r.publishers = publishers;
    r.tp = tp;
    r.slice_bytes = SliceBytes(index, tp);
    channel_ = absl::StrFormat("%s/group-p%d-tp%d", c.dir, publishers, tp);
  }

  PairResult r;

  void Run() {
    const bool ucx = c_.transport == "ucx";
    const std::string uri =
        ucx ? absl::StrFormat("ucx://127.0.0.1:%d/group-p%d-tp%d", FreePort(), r.publishers, r.tp)
            : c_.transport + "://" + channel_;
    std::vector<std::string> common = {"--uri",
                                       uri,
                                       "--store",
                                       c_.store,
                                       "--timeout-s",
                                       absl::StrFormat("%.3f", absl::ToDoubleSeconds(c_.timeout)),
                                       "--wait-timeout-s",
                                       absl::StrFormat("%.3f", absl::ToDoubleSeconds(c_.timeout)),
                                       "--parent-pid",
                                       std::to_string(getpid())};
    for (const std::string& s : c_.settings) {
      common.push_back("--set");
      common.push_back(s);
    }
    for (int rank = 0; rank < r.publishers; ++rank) {
      std::vector<std::string> a = {SelfPath(), "__worker", "publisher"};
      a.insert(a.end(), common.begin(), common.end());
      for (const std::string& s :
           {absl::StrFormat("rank=%d", rank), absl::StrFormat("world_size=%d", r.publishers)}) {
        a.push_back("--set");
        a.push_back(s);
      }
      if (!Spawn(a, absl::StrFormat("publisher-%d", rank))) return;
    }
    for (int rank = 0; rank < r.tp; ++rank) {
      std::vector<std::string> a = {SelfPath(),
                                    "__worker",
                                    "subscriber",
                                    "--count",
                                    std::to_string(c_.versions),
                                    "--tp",
                                    std::to_string(r.tp),
                                    "--tp-rank",
                                    std::to_string(rank)};
      a.insert(a.end(), common.begin(), common.end());
      if (!Spawn(a, absl::StrFormat("tp-rank-%d", rank))) return;
    }
    const absl::Time ready_by = absl::Now() + absl::Seconds(60);
    for (size_t i = 0; i < procs_.size(); ++i) {
      std::optional<nlohmann::json> j = ReadJson(i, ready_by);
      if (!j) return;
      if (!j->contains("ready")) return Fail(names_[i] + ": " + j->value("error", j->dump()));
    }
    std::vector<double> control;
    for (int v = 1; v <= c_.versions; ++v) {
      const absl::Time deadline = absl::Now() + c_.timeout;
      // Every rank is told at once; they publish concurrently and the last commits.
      for (int p = 0; p < r.publishers; ++p) {
        if (!procs_[p].Send(absl::StrFormat("publish %d", v))) {
          return Fail(names_[p] + "'s stdin is closed");
        }
      }
      int64_t start_ns = 0, committed_ns = 0;
      uint64_t wire = 0, wire_max = 0;
      for (int p = 0; p < r.publishers; ++p) {
        std::optional<nlohmann::json> j = ReadJson(p, deadline);
        if (!j) return;
        if (j->contains("error")) {
          return Fail(absl::StrFormat("%s: version %d: %s", names_[p], v,
                                      (*j)["error"].get<std::string>()));
        }
        const int64_t s = j->value("call_start_unix_ns", int64_t{0});
        start_ns = start_ns == 0 ? s : std::min(start_ns, s);
        committed_ns =
            std::max(committed_ns, s + static_cast<int64_t>(j->value("stall_s", 0.0) * 1e9));
        const uint64_t w = j->value("wire_bytes", uint64_t{0});
        wire += w;
        wire_max = std::max(wire_max, w);
      }
      int64_t last_ns = 0;
      for (int t = 0; t < r.tp; ++t) {
        std::optional<nlohmann::json> j = ReadJson(r.publishers + t, deadline);
        if (!j) return;
        if (!j->value("ok", false)) {
          ++r.wrong;
          if (r.failure.empty()) {
            r.failure = absl::StrFormat("%s: version %d: %s", names_[r.publishers + t], v,
                                        j->value("error", std::string("?")));
          }
          continue;
        }
        const uint64_t bytes = j->value("bytes", uint64_t{0});
        r.read_max = std::max(r.read_max, bytes);
        r.read_min = std::min(r.read_min, bytes);
        last_ns = std::max(last_ns, j->value("ready_unix_ns", int64_t{0}));
      }
      if (v > c_.warmup && last_ns > 0) {
        r.last_s.push_back((last_ns - start_ns) / 1e9);
        r.commit_s.push_back((committed_ns - start_ns) / 1e9);
        r.wire_bytes.push_back(static_cast<double>(wire));
        r.wire_max.push_back(static_cast<double>(wire_max));
      }
      r.wire_all += wire;
      control.push_back(ucx ? 2.0 * (r.publishers - 1)
                            : ControlFiles(absl::StrFormat("%s/versions/v%020d", channel_, v)));
    }
    r.control_files = Median(control);
    for (int p = 0; p < r.publishers; ++p) procs_[p].Send("quit");
    const absl::Time done_by = absl::Now() + absl::Seconds(60);
    for (size_t i = 0; i < procs_.size(); ++i) {
      std::optional<nlohmann::json> j = ReadJson(i, done_by);
      if (!j) return;
      if (i >= static_cast<size_t>(r.publishers)) {
        r.subscriber_rss = std::max(r.subscriber_rss, j->value("peak_rss_bytes", int64_t{0}));
      }
    }
    for (Child& child : procs_) child.WaitOrKill(absl::Now() + absl::Seconds(30));
    std::error_code ec;
    fs::remove_all(channel_, ec);  // the next pair needs the room, not this channel
  }

 private:
  bool Spawn(const std::vector<std::string>& argv, const std::string& name) {
    const std::string log =
        absl::StrFormat("%s/group-p%d-tp%d-%s.log", c_.log_dir, r.publishers, r.tp, name);
    absl::StatusOr<Child> child = StartPiped(argv, log);
    if (!child.ok()) {
      Fail(std::string(child.status().message()));
      return false;
    }
    procs_.push_back(*std::move(child));
    names_.push_back(name);
    logs_.push_back(log);
    return true;
  }

  std::optional<nlohmann::json> ReadJson(size_t i, absl::Time deadline) {
    std::optional<std::string> line;
    while ((line = procs_[i].ReadLine(deadline)) && !absl::StartsWith(*line, "{")) {
      std::ofstream(logs_[i], std::ios::app) << "[stdout] " << *line << "\n";
    }
    if (!line) {
      Fail(absl::StrFormat("%s did not answer in time or ended: %s", names_[i],
                           FileTail(logs_[i], 300)));
      return std::nullopt;
    }
    nlohmann::json j = nlohmann::json::parse(*line, nullptr, false);
    if (j.is_discarded()) {
      Fail(names_[i] + " printed something that is not JSON: " + *line);
      return std::nullopt;
    }
    return j;
  }

  void Fail(const std::string& why) {
    if (r.failure.empty()) r.failure = why;
    ++r.wrong;
    for (Child& child : procs_) child.Kill();
  }

  const GroupRunConfig& c_;
  std::string channel_;
  std::vector<Child> procs_;  // publishers, then TP ranks
  std::vector<std::string> names_, logs_;
};

}  // namespace

int RunGroups(const GroupRunConfig& c, const StoreIndex& index) {
  std::printf(
      "# publisher groups and TP replicas over %s://: N publisher processes (rank r publishes "
      "row shards of every matrix whose rows divide by N, other tensors whole, tensor i by rank "
      "i %% N), M subscriber processes (one TP group: o_proj/down_proj on dimension 1, other "
      "matrices on dimension 0, vectors replicated); every TP rank checks its slices against "
      "the store and the bytes it read against the checksum tiles its slices meet (computed "
      "from the version's manifest and the slices' boxes); round%%: read/rank over slices, "
      "minus 100\n",
      c.transport.c_str());
  std::printf("# %d versions, the first %d not measured; settings: %s\n", c.versions, c.warmup,
              c.settings.empty() ? "defaults" : absl::StrJoin(c.settings, " ").c_str());
  std::printf(
      "# wire/ver: bytes all ranks published through the stack beneath per version (median; "
      "under delta their encoded parts), wire/rank the most one rank published, ratio model "
      "bytes / wire/ver, stream: model bytes x versions / wire bytes of every version (the "
      "first included)\n#\n");
  std::printf("# %3s %3s %12s %12s %12s %7s %7s %8s %10s %8s %10s %12s %12s %7s %7s %6s\n", "N",
              "M", "model", "slices", "read/rank", "read%", "round%", "commit", "last-rank",
              "control", "rss/rank", "wire/ver", "wire/rank", "ratio", "stream", "#wrong");
  std::printf("# %3s %3s %12s %12s %12s %7s %7s %8s %10s %8s %10s %12s %12s %7s %7s %6s\n", "", "",
              "(B)", "(B)", "(B)", "(%)", "(%)", "(s)", "(s)",
              c.transport == "ucx" ? "(msgs)" : "(files)", "(MiB)", "(B)", "(B)", "(x)", "(x)", "");
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  int wrong = 0;
  std::string failure;
  for (int n : c.publishers) {
    for (int m : c.tp) {
      Pair pair(c, index, n, m);
      pair.Run();
      const PairResult& r = pair.r;
      wrong += r.wrong;
      if (failure.empty() && !r.failure.empty()) {
        failure = absl::StrFormat("N=%d M=%d: %s", n, m, r.failure);
      }
      const double last = Median(r.last_s);
      const double wire = Median(r.wire_bytes);
      std::printf(
          "  %3d %3d %12llu %12llu %12llu %7.1f %7.2f %8.4f %10.4f %8.0f %10.1f %12.0f %12.0f "
          "%7.1f %7.1f %6d\n",
          n, m, static_cast<unsigned long long>(index.tensor_bytes),
          static_cast<unsigned long long>(r.slice_bytes),
          static_cast<unsigned long long>(r.read_max),
          100.0 * r.read_max / std::max<uint64_t>(index.tensor_bytes, 1),
          100.0 * r.read_max / std::max<uint64_t>(r.slice_bytes, 1) - 100.0, Median(r.commit_s),
          last, r.control_files, r.subscriber_rss / 1048576.0, wire, Median(r.wire_max),
          wire > 0 ? static_cast<double>(index.tensor_bytes) / wire : 0.0,
          r.wire_all > 0 ? static_cast<double>(index.tensor_bytes) * c.versions / r.wire_all : 0.0,
          r.wrong);
      std::fflush(stdout);
      rows.push_back({{"publishers", n},
                      {"tp", m},
                      {"model_bytes", index.tensor_bytes},
                      {"slice_bytes_per_rank", r.slice_bytes},
                      {"read_bytes_per_rank_max", r.read_max},
                      {"read_bytes_per_rank_min", r.read_min == ~0ull ? 0 : r.read_min},
                      {"last_rank_s_median", last},
                      {"last_rank_s", r.last_s},
                      {"commit_s_median", Median(r.commit_s)},
                      {"commit_s", r.commit_s},
                      {"control_files_per_version", r.control_files},
                      {"wire_bytes_per_version_median", wire},
                      {"wire_bytes_per_rank_max_median", Median(r.wire_max)},
                      {"wire_bytes_all_versions", r.wire_all},
                      {"subscriber_peak_rss_bytes", r.subscriber_rss},
                      {"wrong", r.wrong},
                      {"failure", r.failure}});
    }
  }
  if (c.json) {
    std::ofstream(*c.json) << nlohmann::ordered_json{{"groups", rows}}.dump(1) << "\n";
  }
  if (wrong > 0) {
    std::printf("# FAILED: %s\n", failure.c_str());
    return 1;
  }
  std::printf("# OK\n");
  return 0;
}

}  // namespace weightbus::bench
