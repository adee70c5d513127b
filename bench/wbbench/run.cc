// SPDX-License-Identifier: Apache-2.0
// `weightbus-bench run`: one publisher and N subscriber processes per transport, the same
// realistic versions through each, baselines in the same run; see main.cc for the usage and
// docs/PERFORMANCE.md for the metrics.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "wbbench/baselines.h"
#include "wbbench/common.h"
#include "wbbench/group_run.h"
#include "wbbench/report.h"
#include "wbbench/results.h"
#include "wbbench/store.h"
#include "wbbench/subcommands.h"
#include "wbbench/svg.h"
#include "wbbench/trace.h"
#include "weightbus/checkpoint.h"
#include "weightbus/flags.h"
#include "weightbus/llama2c.h"
#include "weightbus/llama_forward.h"
#include "weightbus/synthetic_model.h"
#include "weightbus/update_stream.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::bench {
namespace {

namespace fs = std::filesystem;
using tools::FormatSize;

struct RunOptions {
  std::vector<std::string> transports;
  int subscribers = 2;
  int versions = 6;
  int warmup = 1;
  std::string model;   // llama2.c .bin or safetensors file/dir; empty: synthetic
  std::string shapes;  // shapes file for a synthetic model
  uint64_t size = 128ull << 20;
  double lr = 1e-5;
  uint64_t seed = 1;
  std::string dir, store;
  bool keep = false;
  std::vector<std::string> settings;
  absl::Duration timeout = absl::Seconds(120);
  bool baselines = true, torch = true, perftest = true;
  std::string python = "/usr/bin/python3";
  std::string perftest_path = "/usr/bin/ucx_perftest";
  int perftest_reps = 3, torch_reps = 3;
  uint64_t corrupt_version = 0;
  std::optional<std::string> json, csv, trace, plot;
  bool quick = false;
  std::string order = "auto";  // auto, interleaved, sequential
  int64_t row_multiple = 1;    // a synthetic model's matrices get a multiple of this many rows
};

// MemAvailable of /proc/meminfo, bytes (0 if unknown).
uint64_t AvailableMemory() {
  return static_cast<uint64_t>(ProcKiBField("/proc/meminfo", "MemAvailable"));
}

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// ----- the model and its versions -----

// The fp32 master copy the update stream starts from, and a line saying where it came from.
std::vector<tools::OwnedTensor> LoadMaster(const RunOptions& o, std::string* source) {
  if (!o.model.empty() && absl::EndsWith(o.model, ".bin")) {
    tools::Llama2cCheckpoint ckpt = OrDie(tools::ReadLlama2c(o.model));
    *source = o.model + " (llama2.c, converted to Hugging Face layout)";
    return OrDie(tools::ConvertToHf(ckpt, DType::kF32));
  }
  if (!o.model.empty()) {
    tools::Checkpoint ckpt = OrDie(tools::LoadCheckpoint(o.model));
    std::vector<tools::OwnedTensor> out;
    for (const TensorView& t : ckpt.tensors) {
      absl::StatusOr<std::vector<float>> f = tools::TensorToFloats(t);
      if (!f.ok()) {
        Die(
            absl::StrFormat("--model %s: tensor \"%s\" is %s; the update stream needs F32 or "
                            "BF16 tensors",
                            o.model, t.name, DTypeName(t.dtype)));
      }
      tools::OwnedTensor o2{t.name, DType::kF32, t.shape, {}};
      o2.bytes.resize(f->size() * 4);
      std::memcpy(o2.bytes.data(), f->data(), o2.bytes.size());
      out.push_back(std::move(o2));
    }
    *source = o.model + " (safetensors checkpoint)";
    return out;
  }
  std::vector<tools::ShapeSpec> shapes = OrDie(tools::ReadShapes(o.shapes));
  uint64_t base = 0;
  for (const tools::ShapeSpec& s : shapes) {
    uint64_t n = 1;
    for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
    base += 2 * n;
  }
  if (base == 0) Die("--shapes " + o.shapes + " has no elements");
  shapes = tools::ScaleShapes(shapes, static_cast<double>(o.size) / static_cast<double>(base));
  if (o.row_multiple > 1) {  // --publishers/--tp: rows every group size and TP degree divides
    for (tools::ShapeSpec& s : shapes) {
      if (s.shape.size() == 2)
        s.shape[0] = (s.shape[0] + o.row_multiple - 1) / o.row_multiple * o.row_multiple;
    }
  }
  *source = absl::StrFormat("%s scaled to %s (synthetic, N(0, 0.02))",
                            fs::path(o.shapes).filename().string(), HumanBytes(o.size));
  return OrDie(tools::MakeSyntheticModel(shapes, DType::kF32, o.seed));
}

// Writes versions 1..count of the update stream into `dir` (version 1: the master cast to bf16;
// version k+1: after k Adam steps) with their hashes.
StoreIndex GenerateStore(const RunOptions& o, std::vector<tools::OwnedTensor> master,
                         const std::string& dir, bool progress) {
  tools::AdamOptions adam;
  adam.lr = o.lr;
  adam.seed = o.seed;
  tools::UpdateStream stream = OrDie(tools::UpdateStream::Create(master, adam));
  master.clear();
  master.shrink_to_fit();
  StoreIndex index;
  std::vector<tools::OwnedTensor> previous;
  for (int v = 1; v <= o.versions; ++v) {
    if (progress) {
      std::fprintf(stderr, "\r\033[Kgenerating version %d of %d (Adam steps on the fp32 master)", v,
                   o.versions);
    }
    if (v > 1) stream.Step();
    std::vector<tools::OwnedTensor> w = stream.Bf16();
    if (index.tensors.empty()) {
      uint64_t off = 0;
      for (const tools::OwnedTensor& t : w) {
        index.tensors.push_back({t.name, t.dtype, t.shape, off, t.bytes.size()});
        index.tensor_bytes += t.bytes.size();
        off += (t.bytes.size() + 63) & ~uint64_t{63};
      }
      index.file_bytes = std::max<uint64_t>(off, 1);
    }
    std::vector<std::byte> file(index.file_bytes);
    std::vector<uint64_t> hashes;
    for (size_t i = 0; i < w.size(); ++i) {
      std::memcpy(file.data() + index.tensors[i].offset, w[i].bytes.data(), w[i].bytes.size());
      hashes.push_back(Hash(w[i].bytes.data(), w[i].bytes.size()));
    }
    std::ofstream out(index.VersionPath(dir, v), std::ios::binary);
    out.write(reinterpret_cast<const char*>(file.data()),
              static_cast<std::streamsize>(file.size()));
    if (!out) Die("cannot write " + index.VersionPath(dir, v) + ": " + std::strerror(errno));
    index.xxh3.push_back(std::move(hashes));
    index.changed_fraction.push_back(previous.empty() ? 1.0 : tools::ChangedFraction(previous, w));
    previous = std::move(w);
  }
  if (progress) std::fprintf(stderr, "\r\033[K");
  OrDie(WriteIndex(dir, index));
  return index;
}

uint64_t DirectoryBytes(const std::string& path) {
  std::error_code ec;
  uint64_t total = 0;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec)) total += it->file_size(ec);
  }
  return total;
}

// ----- one transport's processes -----

class Session {
 public:
  Session(std::string name, std::string uri, std::string channel_dir)
      : channel_dir_(std::move(channel_dir)) {
    result.name = std::move(name);
    result.uri = std::move(uri);
  }

  TransportResult result;

  // `wait_timeout`: how long a subscriber may wait for the next version (a whole round of the
  // other transports and the baselines when interleaved). `settings`: this transport's --set.
  void Start(const RunOptions& o, const std::string& store, const std::string& log_dir,
             absl::Duration wait_timeout, const std::vector<std::string>& settings) {
    std::vector<std::string> common = {
        "--uri",
        result.uri,
        "--store",
        store,
        "--timeout-s",
        absl::StrFormat("%.3f", absl::ToDoubleSeconds(o.timeout)),
        "--parent-pid",
        std::to_string(getpid()),
        "--wait-timeout-s",
        absl::StrFormat("%.3f", absl::ToDoubleSeconds(wait_timeout))};
    for (const std::string& s : settings) {
      common.push_back("--set");
      common.push_back(s);
    }
    const std::string tag = Sanitize(result.name);
    std::vector<std::string> argv = {SelfPath(), "__worker", "publisher"};
    argv.insert(argv.end(), common.begin(), common.end());
    if (o.corrupt_version > 0) {
      argv.push_back("--corrupt-version");
      argv.push_back(std::to_string(o.corrupt_version));
    }
    logs_.push_back(absl::StrFormat("%s/%s-publisher.log", log_dir, tag));
    roles_.push_back("publisher");
    if (!Spawn(argv, logs_.back())) return;
    for (int i = 0; i < o.subscribers; ++i) {
      std::vector<std::string> a = {SelfPath(), "__worker", "subscriber", "--count",
                                    std::to_string(o.versions)};
      a.insert(a.end(), common.begin(), common.end());
      logs_.push_back(absl::StrFormat("%s/%s-subscriber-%d.log", log_dir, tag, i));
      roles_.push_back(absl::StrFormat("subscriber %d", i));
      if (!Spawn(a, logs_.back())) return;
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    for (size_t i = 0; i < procs_.size(); ++i) {
      std::optional<nlohmann::json> j = ReadJson(i, deadline);
      if (!j) return;
      if (j->contains("error") || !j->contains("ready")) {
        Fail(absl::StrFormat("%s could not open the channel: %s", roles_[i],
                             j->value("error", j->dump())));
        return;
      }
    }
  }

  // Publishes `v` and collects every replica's report.
  void Step(uint64_t v, bool measured, const absl::Duration timeout) {
    if (!alive_) return;
    VersionRecord rec;
    rec.version = v;
    rec.expected_replicas = procs_.size() - 1;
    rec.measured = measured;
    const absl::Time deadline = absl::Now() + timeout;
    if (!procs_[0].Send(absl::StrFormat("publish %d", v))) {
      Fail("the publisher's stdin is closed: " + FileTail(logs_[0], 300));
      return;
    }
    std::optional<nlohmann::json> p = ReadJson(0, deadline);
    if (!p) return;
    if (p->contains("error")) {
      rec.error = (*p)["error"].get<std::string>();
      result.versions.push_back(rec);
      Fail(absl::StrFormat("publishing version %d failed: %s", v, rec.error));
      return;
    }
    rec.published = true;
    rec.publish_start_unix_ns = p->value("call_start_unix_ns", int64_t{0});
    rec.stall_s = p->value("stall_s", 0.0);
    rec.pack_s = p->value("pack_s", 0.0);
    rec.transport_s = p->value("transport_s", 0.0);
    rec.checksum_wait_s = p->value("checksum_wait_s", 0.0);
    rec.encode_s = p->value("encode_s", 0.0);
    rec.wire_bytes = p->value("wire_bytes", uint64_t{0});
    rec.encoding = p->value("encoding", std::string());
    if (!channel_dir_.empty()) {
      rec.stored_bytes = DirectoryBytes(absl::StrFormat("%s/versions/v%020d", channel_dir_, v));
    }
    std::vector<size_t> to_check;  // replicas that received and wait to check it
    for (size_t i = 1; i < procs_.size(); ++i) {
      std::optional<nlohmann::json> j = ReadJson(i, deadline);
      if (!j) {
        result.versions.push_back(rec);
        return;
      }
      if (j->value("check_pending", false)) to_check.push_back(rec.replicas.size());
      ReplicaRecord r;
      r.index = static_cast<int>(i) - 1;
      r.ok = j->value("ok", false);
      r.error = j->value("error", std::string());
      r.call_start_unix_ns = j->value("call_start_unix_ns", int64_t{0});
      const int64_t start = j->value("publish_start_unix_ns", int64_t{0});
      const int64_t ready = j->value("ready_unix_ns", int64_t{0});
      if (start > 0) rec.publish_start_unix_ns = start;  // the manifest's own timestamp
      r.ready_s = ready > 0 && start > 0 ? (ready - start) / 1e9 : 0;
      r.wait_s = j->value("wait_s", 0.0);
      r.allocate_s = j->value("allocate_s", 0.0);
      r.fetch_s = j->value("fetch_s", 0.0);
      r.decode_s = j->value("decode_s", 0.0);
      r.verify_s = j->value("verify_s", 0.0);
      r.apply_s = j->value("apply_s", 0.0);
      r.wire_bytes = j->value("wire_bytes", uint64_t{0});
      r.timed_out = j->value("timed_out", false);
      if (j->value("version", uint64_t{0}) != v && r.error.empty()) {
        r.ok = false;
        r.error = absl::StrFormat("reported version %s instead of %d", (*j)["version"].dump(), v);
      }
      if (r.timed_out) {  // not a wrong version: the transport did not deliver in time
        const std::string why =
            absl::StrFormat("%s gave up waiting for version %d: %s", roles_[i], v, r.error);
        rec.replicas.push_back(std::move(r));
        result.versions.push_back(std::move(rec));
        Fail(why);
        return;
      }
      rec.replicas.push_back(std::move(r));
    }
    // Every replica has reported: now each checks what it holds (not before, so that no
    // replica's check competes for the CPU with another's receive).
    for (size_t k : to_check) {
      const size_t proc = static_cast<size_t>(rec.replicas[k].index) + 1;
      if (!procs_[proc].Send("check")) {
        Fail(absl::StrFormat("%s's stdin is closed: %s", roles_[proc], FileTail(logs_[proc], 300)));
        result.versions.push_back(std::move(rec));
        return;
      }
    }
    for (size_t k : to_check) {
      ReplicaRecord& r = rec.replicas[k];
      const size_t proc = static_cast<size_t>(r.index) + 1;
      std::optional<nlohmann::json> j = ReadJson(proc, deadline);
      if (!j) {
        result.versions.push_back(std::move(rec));
        return;
      }
      r.ok = j->value("ok", false);
      if (r.error.empty()) r.error = j->value("error", std::string());
      if (!r.error.empty()) r.ok = false;
    }
    result.versions.push_back(std::move(rec));
  }

  // Stops the processes and records their CPU time and peak RSS.
  void Finish(int expected_versions) {
    std::vector<double> overhead(procs_.size(), 0);
    std::vector<int64_t> peak_rss(procs_.size(), 0);
    if (alive_) {
      procs_[0].Send("quit");
      const absl::Time deadline = absl::Now() + absl::Seconds(60);
      for (size_t i = 0; i < procs_.size(); ++i) {
        std::optional<nlohmann::json> j = ReadJson(i, deadline);
        if (!j) break;
        overhead[i] = j->value("overhead_cpu_s", 0.0);
        peak_rss[i] = j->value("peak_rss_bytes", int64_t{0});
      }
    }
    for (size_t i = 0; i < procs_.size(); ++i) {
      const Child::Exit e = procs_[i].WaitOrKill(absl::Now() + absl::Seconds(30));
      ProcessRecord p;
      p.role = roles_[i];
      p.pid = procs_[i].pid();
      p.exit = e.Describe();
      p.cpu_s = e.cpu_s;
      p.overhead_cpu_s = overhead[i];
      p.peak_rss_bytes = peak_rss[i];  // 0 (unknown) when it did not say
      if (alive_ && !(WIFEXITED(e.status) && WEXITSTATUS(e.status) == 0)) {
        Fail(absl::StrFormat("%s ended with %s: %s", p.role, p.exit, FileTail(logs_[i], 300)));
      }
      result.processes.push_back(std::move(p));
    }
    result.completed =
        result.failure.empty() && static_cast<int>(result.versions.size()) == expected_versions;
  }

 private:
  static std::string Sanitize(const std::string& s) {
    std::string out = s;
    for (char& c : out) {
      if (c == '+') c = '_';
    }
    return out;
  }

  bool Spawn(const std::vector<std::string>& argv, const std::string& log) {
    absl::StatusOr<Child> c = StartPiped(argv, log);
    if (!c.ok()) {
      Fail(std::string(c.status().message()));
      return false;
    }
    procs_.push_back(*std::move(c));
    return true;
  }

  std::optional<nlohmann::json> ReadJson(size_t i, absl::Time deadline) {
    bool timed_out = false;
    std::optional<std::string> line;
    // Libraries may print to stdout too (UCX logs there by default): the protocol's lines are
    // the ones that start with '{'; others go to the process's log.
    while ((line = procs_[i].ReadLine(deadline, &timed_out)) && !absl::StartsWith(*line, "{")) {
      std::ofstream(logs_[i], std::ios::app) << "[stdout] " << *line << "\n";
    }
    if (!line) {
      std::string what = "did not answer in time";
      if (!timed_out) {  // its stdout closed: it ended (or is about to)
        what =
            "ended early (" + procs_[i].WaitOrKill(absl::Now() + absl::Seconds(5)).Describe() + ")";
      }
      const std::string log = FileTail(logs_[i], 300);
      Fail(absl::StrFormat("%s %s%s%s", roles_[i], what, log.empty() ? "" : ": ", log));
      return std::nullopt;
    }
    nlohmann::json j = nlohmann::json::parse(*line, nullptr, false);
    if (j.is_discarded()) {
      Fail(absl::StrFormat("%s printed something that is not JSON: %s", roles_[i], *line));
      return std::nullopt;
    }
    return j;
  }

  void Fail(const std::string& why) {
    if (result.failure.empty()) result.failure = why;
    alive_ = false;
    for (Child& c : procs_) c.Kill();
  }

  std::string channel_dir_;   // disk-backed channels: the channel's directory
  std::vector<Child> procs_;  // [0] publisher, then subscribers
  std::vector<std::string> roles_, logs_;
  bool alive_ = true;
};

// ----- progress -----

class Progress {
 public:
  Progress(bool enabled, int total) : enabled_(enabled), total_(total) {}
  void Update(int done, const std::string& what) {
    if (!enabled_) return;
    const int width = 30;
    const int filled = total_ > 0 ? width * done / total_ : width;
    std::fprintf(stderr, "\r\033[K[%s%s] %d/%d %s", std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), done, total_, what.c_str());
    std::fflush(stderr);
  }
  void Clear() {
    if (enabled_) std::fprintf(stderr, "\r\033[K");
  }

 private:
  bool enabled_;
  int total_;
};

// Writes `text` to `path`; the reason (strerror) if it cannot.
std::optional<std::string> WriteText(const std::string& path, const std::string& text) {
  errno = 0;
  std::ofstream f(path, std::ios::binary);
  f << text;
  f.close();
  if (f) return std::nullopt;
  return errno != 0 ? std::strerror(errno) : "write failed";
}

std::string FsType(const std::string& path) {
  std::string best;
  size_t best_len = 0;
  std::ifstream m("/proc/mounts");
  std::string dev, mnt, type, rest;
  while (m >> dev >> mnt >> type && std::getline(m, rest)) {
    if (absl::StartsWith(path, mnt) && mnt.size() >= best_len) {
      best = type;
      best_len = mnt.size();
    }
  }
  return best.empty() ? "?" : best;
}

}  // namespace

namespace {

// `weightbus-bench run`'s flags: RunOptions, and what needs to know whether a flag was given.
struct RunFlags {
  RunOptions o;
  std::string transports;
  std::vector<uint64_t> sizes;
  uint64_t min_size = 0, max_size = 0, factor = 2;
  std::string dir, store;
  bool no_baselines = false, no_torch = false, no_perftest = false;
  std::string publishers, tp;  // group sizes and TP degrees (comma-separated)
  std::optional<tools::Flag> model_flag, shapes_flag, size_flag, min_size_flag, max_size_flag,
      factor_flag, versions_flag, perftest_reps_flag, torch_reps_flag, transports_flag, dir_flag,
      store_flag, publishers_flag, tp_flag;
};

// "1,2,4" -> {1, 2, 4}: each at least 1. Dies naming the flag otherwise.
std::vector<int> CountList(const char* flag, const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1 || n > 64) {
      Die(absl::StrFormat("--%s %s: \"%s\" is not a count in [1, 64]", flag, text, part));
    }
    out.push_back(n);
  }
  return out;
}

// The sizes of a sweep: --size A,B,C, or --min-size/--max-size/--factor (nccl-tests' -b/-e/-f:
// min, min x factor, ... up to max). Empty without either; one size for a plain --size.
std::vector<uint64_t> SweepSizes(const RunFlags& f) {
  std::vector<uint64_t> sizes;
  const bool range = f.min_size_flag->given() || f.max_size_flag->given() || f.factor_flag->given();
  if (range && f.size_flag->given()) Die("--size or --min-size/--max-size/--factor, not both");
  if (range) {
    if (!f.min_size_flag->given() || !f.max_size_flag->given()) {
      Die("a sweep takes --min-size and --max-size (and --factor, default 2)");
    }
    const uint64_t lo = f.min_size, hi = f.max_size, factor = f.factor;
    if (lo < 1024 || hi < lo) Die("--min-size must be at least 1KiB and at most --max-size");
    if (factor < 2) Die("--factor must be at least 2");
    for (uint64_t x = lo; x <= hi; x = x > hi / factor ? hi + 1 : x * factor) sizes.push_back(x);
  } else if (f.size_flag->given()) {
    sizes = f.sizes;
  }
  if (sizes.size() > 1 && f.model_flag->given())
    Die("a sweep of sizes is of synthetic models, not --model");
  if (sizes.size() > 1 && f.o.quick) Die("--quick is one size (stories260K)");
  return sizes;
}

// "64MiB", "1.5GiB": a size as a file name part.
std::string SizeTag(uint64_t bytes) {
  std::string t = HumanBytes(static_cast<double>(bytes));
  t.erase(std::remove(t.begin(), t.end(), ' '), t.end());
  return t;
}

// Runs `weightbus-bench run` once per size with the same arguments (less the size flags; output
// files get the size before their extension: run.json -> run-64.0MiB.json), each a complete run
// with its own banner, table and final line, its stdout and stderr passed through. The status
// is the worst of them.
int RunSweep(const std::vector<std::string>& argv, const std::vector<uint64_t>& sizes) {
  static const std::vector<std::string> kSizeFlags = {"--size", "--min-size", "--max-size",
                                                      "--factor"};
  static const std::vector<std::string> kOutputs = {"--json", "--csv", "--trace", "--plot"};
  HandleSignalsWithCleanup();  // stops the run in progress on SIGINT/SIGTERM/SIGHUP
  int worst = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const uint64_t size = sizes[k];
    std::vector<std::string> a = {SelfPath(), "run", "--size", std::to_string(size)};
    for (size_t i = 0; i < argv.size(); ++i) {
      const std::string& tok = argv[i];
      const std::string name = tok.substr(0, tok.find('='));
      const bool inline_value = tok.find('=') != std::string::npos;
      if (Contains(kSizeFlags, name)) {
        if (!inline_value) ++i;
        continue;
      }
      if (Contains(kOutputs, name)) {
        std::string path = inline_value ? tok.substr(tok.find('=') + 1) : argv.at(++i);
        const fs::path p(path);
        path =
            (p.parent_path() / (p.stem().string() + "-" + SizeTag(size) + p.extension().string()))
                .string();
        a.push_back(name);
        a.push_back(path);
        continue;
      }
      a.push_back(tok);
    }
    std::printf("# sweep: %s (%zu of %zu)\n", HumanBytes(static_cast<double>(size)).c_str(), k + 1,
                sizes.size());
    std::fflush(stdout);
    absl::StatusOr<Child> run = Child::Spawn(a, {});  // this process's stdin, stdout, stderr
    if (!run.ok()) Die(std::string(run.status().message()));
    const int code = process::ExitCode(run->Wait(absl::InfiniteDuration()).value_or(-1));
    worst = std::max(worst, code);
    if (code >= 2) break;  // a set-up error repeats at every size
  }
  return worst;
}

}  // namespace

namespace {

void AddRunFlags(tools::Command& cmd, RunFlags& f) {
  cmd.Footer(R"(
One publisher and N subscriber processes per transport (disk, ucx, delta+disk, delta+ucx:
whichever this build has), the same realistic versions through each, and the baselines (memcpy,
write+fsync/read, ucx_perftest, torch.save/load, gloo broadcast) in the same run. Output in the
style of nccl-tests; ends with "# OK" or "# FAILED: reason". Metrics: docs/PERFORMANCE.md.)");
  RunOptions& o = f.o;
  o.shapes = WEIGHTBUS_SHAPES_FILE;
  f.transports_flag =
      cmd.Add("transports", &f.transports, "comma-separated subset (default: every one built)")
          .TypeName("LIST");
  cmd.Add("subscribers", &o.subscribers, "replica processes per transport (1 to 1000)")
      .InRange(1, 1000);
  f.versions_flag =
      cmd.Add("versions", &o.versions, "versions to publish (--quick: 4)").InRange(1, 1000000);
  cmd.Add("warmup", &o.warmup, "of them, not measured").InRange(0, 1000000);
  f.model_flag = cmd.Add("model", &o.model,
                         "a llama2.c .bin or safetensors file/directory (the weights to sync)")
                     .TypeName("PATH");
  f.shapes_flag = cmd.Add("shapes", &o.shapes,
                          "tensor shapes (JSON) of the synthetic model (default: Qwen2.5-0.5B's)")
                      .TypeName("FILE");
  f.size_flag = cmd.AddSizeList("size", &f.sizes,
                                "a synthetic model of this size, shaped like --shapes; a list "
                                "(64MiB,1GiB) is a sweep: one whole run per size")
                    .DefaultText(FormatSize(o.size));
  f.min_size_flag =
      cmd.AddSize("min-size", &f.min_size,
                  "a sweep: --min-size A --max-size B [--factor F] runs A, A x F, ... up to B; "
                  "output files get the size in their name (run.json -> run-64.0MiB.json); the "
                  "status is the worst")
          .DefaultText("");
  f.max_size_flag =
      cmd.AddSize("max-size", &f.max_size, "the sweep's largest size").DefaultText("");
  f.factor_flag = cmd.Add("factor", &f.factor, "the sweep's factor (at least 2)");
  cmd.Add("lr", &o.lr, "the update stream: Adam steps of this learning rate").Positive();
  cmd.Add("seed", &o.seed, "the update stream's seed");
  f.dir_flag = cmd.Add("dir", &f.dir,
                       "where channels and baselines write (in DIR/wbbench-PID; default $TMPDIR)")
                   .TypeName("DIR");
  f.store_flag = cmd.Add("store", &f.store,
                         "the pre-generated versions (in DIR/wbbench-PID; default /dev/shm)")
                     .TypeName("DIR");
  cmd.AddSwitch("keep", &o.keep, "keep --dir and --store afterwards");
  cmd.AddRepeated("set", &o.settings,
                  "a channel setting (repeatable), given to every transport whose stack "
                  "has it (core settings to all; `weightbus settings` lists them)")
      .TypeName("KEY=VALUE");
  cmd.AddDuration("timeout", &o.timeout, "per version (at least 1s)");
  cmd.AddSwitch("no-baselines", &f.no_baselines, "leave every baseline out");
  cmd.AddSwitch("no-torch", &f.no_torch, "leave the torch baselines out");
  cmd.AddSwitch("no-perftest", &f.no_perftest, "leave the ucx_perftest baseline out");
  cmd.Add("python", &o.python, "interpreter with torch for its baselines").TypeName("PATH");
  cmd.Add("perftest", &o.perftest_path, "ucx_perftest").TypeName("PATH");
  f.perftest_reps_flag =
      cmd.Add("perftest-reps", &o.perftest_reps, "repetitions of ucx_perftest (--quick: 1)")
          .InRange(1, 100000);
  f.torch_reps_flag =
      cmd.Add("torch-reps", &o.torch_reps, "repetitions of the torch baselines (--quick: 1)")
          .InRange(1, 100000);
  cmd.Add("corrupt-version", &o.corrupt_version,
          "fault injection: every publisher flips one bit of version N before publishing it, so "
          "replicas receive bytes that differ from what the store says was meant (the "
          "correctness column must catch it: FAILED); 0: none");
  for (auto [name, out, what] :
       {std::tuple{"json", &o.json, "every figure (JSON)"},
        std::tuple{"csv", &o.csv, "every figure (CSV)"},
        std::tuple{"trace", &o.trace, "a Chrome/Perfetto trace of every phase"},
        std::tuple{"plot", &o.plot,
                   "a bar chart (SVG) of time until the last replica, "
                   "with the baselines"}}) {
    cmd.Add(name, out, what).TypeName("FILE");
  }
  f.publishers_flag =
      cmd.Add("publishers", &f.publishers,
              "publisher groups of N ranks over disk:// (or delta+disk:// with --transports "
              "delta+disk; a list, 1,2,4: each with every --tp), "
              "each rank publishing its row shards; with --tp, instead of the transports' table")
          .TypeName("N[,N...]");
  f.tp_flag = cmd.Add("tp", &f.tp,
                      "tensor-parallel replicas of M subscriber ranks (a list), each receiving its "
                      "slices with placements: bytes read per rank, time to the last rank, "
                      "control files per version")
                  .TypeName("M[,M...]");
  cmd.AddSwitch("quick", &o.quick,
                "the stories260K checkpoint, 4 versions, 1 rep of each baseline");
  cmd.Add("order", &o.order,
          "interleaved: each version through every transport and the baselines in turn (all "
          "processes alive at once: noise hits all alike); sequential: one transport after the "
          "other; auto: interleaved when it fits in memory (about 5 model sizes per process)")
      .OneOf({"auto", "interleaved", "sequential"});
}

int Run(RunFlags& f, const std::vector<std::string>& argv) {
  RunOptions& o = f.o;
  // A sweep of sizes: one whole run per size, one after the other (see RunSweep).
  const std::vector<uint64_t> sizes = SweepSizes(f);
  if (sizes.size() > 1) return RunSweep(argv, sizes);
  if (o.quick) {
    if (!f.model_flag->given()) o.model = WEIGHTBUS_STORIES_FILE;
    if (!f.versions_flag->given()) o.versions = 4;
    if (!f.perftest_reps_flag->given()) o.perftest_reps = 1;
    if (!f.torch_reps_flag->given()) o.torch_reps = 1;
  }
  if (f.model_flag->given() && (f.shapes_flag->given() || f.size_flag->given())) {
    Die("--size and --shapes describe a synthetic model: not with --model");
  }
  if (f.shapes_flag->given() || !sizes.empty()) o.model.clear();
  if (!sizes.empty()) o.size = sizes[0];
  o.baselines = !f.no_baselines;
  o.torch = o.baselines && !f.no_torch;
  o.perftest = o.baselines && !f.no_perftest;
  if (o.warmup >= o.versions) {
    Die("--versions must be at least 1 and above --warmup (the warm-up versions are not measured)");
  }
  if (o.size < 1024) Die("--size must be at least 1KiB");
  if (o.timeout < absl::Seconds(1)) Die("--timeout must be at least 1 second (per version)");
  if (o.corrupt_version > static_cast<uint64_t>(o.versions)) {
    Die(absl::StrFormat("--corrupt-version %d: the run publishes versions 1 to %d",
                        o.corrupt_version, o.versions));
  }
  // Every output file writable before anything runs (opened without truncating; a file this
  // creates is overwritten at the end).
  for (const std::optional<std::string>& path : {o.json, o.csv, o.trace, o.plot}) {
    if (!path) continue;
    const int fd = ::open(path->c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) Die(absl::StrFormat("cannot write %s: %s", *path, std::strerror(errno)));
    ::close(fd);
  }
  // --set KEY=VALUE goes to the transports whose stack has the setting (core settings to all);
  // a key no measured transport knows is an error now, not when the channels open.
  std::map<std::string, std::string> scope_of;  // setting name -> "core" or a scheme
  for (const SettingInfo& info : DescribeSettings()) scope_of[info.name] = info.scope;
  for (const std::string& s : o.settings) {
    const size_t eq = s.find('=');
    if (eq == std::string::npos) Die("--set takes KEY=VALUE, not " + s);
    if (s.substr(0, eq) == "failpoints") {
      Die("--set failpoints: fail points come only from the environment; run with "
          "WEIGHTBUS_FAILPOINTS=" +
          s.substr(eq + 1) + " (every role inherits it)");
    }
    if (scope_of.count(s.substr(0, eq)) == 0) {
      Die(absl::StrFormat("--set %s: no setting \"%s\" (`weightbus settings` lists them)", s,
                          s.substr(0, eq)));
    }
  }
  auto settings_for = [&](const std::string& transport) {
    std::vector<std::string> out;
    const std::vector<std::string> stack = absl::StrSplit(transport, '+');
    for (const std::string& s : o.settings) {
      const std::string& scope = scope_of[s.substr(0, s.find('='))];
      if (scope == "core" || Contains(stack, scope)) out.push_back(s);
    }
    return out;
  };

  // What this build can run.
  const std::vector<std::string> built = Transports();
  const bool have_disk = Contains(built, "disk"), have_ucx = Contains(built, "ucx");
  const bool have_delta = Contains(built, "delta");
  std::vector<std::string> available;
  RunResult r;
  if (have_disk) available.push_back("disk");
  if (have_ucx) available.push_back("ucx");
  if (have_delta && have_disk) available.push_back("delta+disk");
  if (have_delta && have_ucx) available.push_back("delta+ucx");
  // nccl:// needs GPUs, one per rank: weightbus-nccl-bench (next to this program) measures it
  // against a plain ncclBroadcast loop of the same bytes on them, after the transports below.
  int gpus = 0;
  while (access(absl::StrFormat("/dev/nvidia%d", gpus).c_str(), F_OK) == 0) ++gpus;
  const std::string nccl_bench =
      std::filesystem::path(SelfPath()).parent_path() / "weightbus-nccl-bench";
  const bool run_nccl =
      Contains(built, "nccl") && gpus > 0 && access(nccl_bench.c_str(), X_OK) == 0;
  if (!Contains(built, "nccl")) {
    r.skipped.push_back({"nccl", "not built (WEIGHTBUS_WITH_NCCL: a build with CUDA and NCCL)"});
  } else if (gpus == 0) {
    r.skipped.push_back({"nccl", "no GPU on this machine (/dev/nvidia0)"});
  } else if (!run_nccl) {
    r.skipped.push_back({"nccl", nccl_bench + " not built (WEIGHTBUS_BUILD_BENCH)"});
  }
  if (!have_delta) {
    r.skipped.push_back({"delta+disk, delta+ucx", "no delta layer in this build"});
  }
  if (!have_ucx) r.skipped.push_back({"ucx", "not built (WEIGHTBUS_WITH_UCX)"});
  if (f.transports_flag->given()) {
    for (const std::string& t : std::vector<std::string>(absl::StrSplit(f.transports, ','))) {
      if (!Contains(available, t)) {
        Die(absl::StrFormat("--transports: \"%s\" is not available in this build (available: %s)",
                            t, absl::StrJoin(available, ", ")));
      }
      if (!Contains(o.transports, t)) o.transports.push_back(t);
    }
  } else {
    o.transports = available;
  }
  if (o.transports.empty()) Die("no transport to measure in this build");
  if (f.publishers_flag->given() || f.tp_flag->given()) {
    // Publisher groups: over disk (default), delta+disk (each rank encodes its own parts) or ucx,
    // one at a time (--transports).
    if (f.transports_flag->given()) {
      const std::vector<std::vector<std::string>> groups = {{"disk"}, {"delta+disk"}, {"ucx"}};
      if (std::find(groups.begin(), groups.end(), o.transports) == groups.end()) {
        Die("--publishers/--tp run over one of disk://, delta+disk:// and ucx:// (--transports "
            "disk, delta+disk or ucx)");
      }
    } else {
      if (!have_disk) Die("--publishers/--tp run over disk:// by default, which this build lacks");
      o.transports = {"disk"};
    }
  }
  for (const std::string& s : o.settings) {
    bool used = false;
    for (const std::string& t : o.transports) used = used || Contains(settings_for(t), s);
    if (!used) {
      Die(absl::StrFormat("--set %s: a %s setting, and no %s transport is measured", s,
                          scope_of[s.substr(0, s.find('='))], scope_of[s.substr(0, s.find('='))]));
    }
  }

  // Directories.
  const std::string tmp = fs::temp_directory_path().string();
  // A fresh wbbench-PID directory inside --dir and --store (or $TMPDIR and /dev/shm), removed
  // afterwards unless --keep: nothing else in the user's directories is touched.
  const std::string run_name = absl::StrFormat("wbbench-%d", getpid());
  auto parent_dir = [](const char* flag, const std::string& path) {
    std::error_code ec;
    if (!fs::is_directory(path, ec)) {
      Die(absl::StrFormat("--%s %s: not an existing directory", flag, path));
    }
    return fs::absolute(path, ec).lexically_normal().string();
  };
  o.dir = (f.dir_flag->given() ? parent_dir("dir", f.dir) : tmp) + "/" + run_name;
  const bool shm = fs::is_directory("/dev/shm");
  o.store = f.store_flag->given() ? parent_dir("store", f.store) + "/" + run_name
            : shm                 ? "/dev/shm/" + run_name
                                  : o.dir + "/store";
  if (fs::exists(o.dir) || fs::exists(o.store)) Die(o.dir + " or " + o.store + " exists already");
  // From here on an early end (an error, Ctrl-C) removes what this run made.
  HandleSignalsWithCleanup();
  std::error_code ec;
  fs::create_directory(o.dir, ec);
  if (ec) Die("cannot create " + o.dir + ": " + ec.message());
  if (!o.keep) RemoveOnExit(o.dir);
  fs::create_directories(o.store, ec);
  if (ec) Die("cannot create " + o.store + ": " + ec.message());
  if (!o.keep) RemoveOnExit(o.store);
  const std::string log_dir = o.dir + "/logs";
  fs::create_directories(log_dir);
  const bool progress = isatty(STDOUT_FILENO) && isatty(STDERR_FILENO);

  // The model and its versions.
  if (f.publishers_flag->given() || f.tp_flag->given()) o.row_multiple = 64;  // as vLLM pads vocab
  std::string source;
  std::vector<tools::OwnedTensor> master = LoadMaster(o, &source);
  uint64_t params = 0;
  for (const tools::OwnedTensor& t : master) params += t.bytes.size() / 4;
  const StoreIndex index = GenerateStore(o, std::move(master), o.store, progress);
  if (f.publishers_flag->given() || f.tp_flag->given()) {
    GroupRunConfig gc;
    gc.publishers = CountList("publishers", f.publishers_flag->given() ? f.publishers : "1");
    gc.tp = CountList("tp", f.tp_flag->given() ? f.tp : "1");
    gc.versions = o.versions;
    gc.warmup = o.warmup;
    gc.dir = o.dir;
    gc.store = o.store;
    gc.log_dir = log_dir;
    gc.timeout = o.timeout;
    gc.settings = o.settings;
    gc.transport = o.transports.front();
    gc.json = o.json;
    gc.transport = o.transports.front();
    absl::PrintF(
        "# weightbus-bench run (weightbus %s): model %s: %d tensors, BF16, %d bytes (%s)\n",
        std::string(LibraryVersion()), source, index.tensors.size(), index.tensor_bytes,
        HumanBytes(index.tensor_bytes));
    return ExitStatus(RunGroups(gc, index));
  }
  r.model_bytes = index.tensor_bytes;
  r.tensors = static_cast<int>(index.tensors.size());
  r.subscribers = o.subscribers;
  r.versions = o.versions;
  r.warmup = o.warmup;
  r.changed_fraction = index.changed_fraction;
  std::vector<double> changed_measured(index.changed_fraction.begin() + 1,
                                       index.changed_fraction.end());

  // Banner.
  utsname u{};
  uname(&u);
  const double mem_gib = sysconf(_SC_PHYS_PAGES) * double(sysconf(_SC_PAGESIZE)) / (1 << 30);
  const char* ucx_tls = getenv("UCX_TLS");
  std::string banner;
  absl::StrAppendFormat(&banner,
                        "# weightbus-bench run (weightbus %s): one publisher and %d subscriber "
                        "processes per transport, baselines in the same run\n",
                        std::string(LibraryVersion()), o.subscribers);
  absl::StrAppendFormat(&banner, "# host: %s %s %s, %u cores, %.1f GiB; dir %s (%s); store %s\n",
                        u.sysname, u.release, u.machine, std::thread::hardware_concurrency(),
                        mem_gib, o.dir, FsType(o.dir), o.store);
  absl::StrAppendFormat(&banner, "# model: %s: %d tensors, BF16, %d bytes (%s), %d parameters\n",
                        source, r.tensors, r.model_bytes, HumanBytes(r.model_bytes), params);
  absl::StrAppendFormat(
      &banner,
      "# versions: %d from the update stream (fp32 master, Adam lr %g, betas 0.9/0.95, seed %d, "
      "cast to bf16), the first %d not measured; elements changed per version: median %.3f%%\n",
      o.versions, o.lr, o.seed, o.warmup,
      changed_measured.empty() ? 100.0 : 100 * Median(changed_measured));
  absl::StrAppendFormat(
      &banner,
      "# replicas: each subscriber binds its own parameter buffers; once every replica has a "
      "version, each hashes every tensor (XXH3, libxxhash) against the published bytes "
      "(#wrong)\n");
  absl::StrAppendFormat(&banner, "# transports: %s (built: %s); settings: %s; UCX_TLS=%s\n",
                        absl::StrJoin(o.transports, " "), absl::StrJoin(built, ", "),
                        o.settings.empty() ? "defaults" : absl::StrJoin(o.settings, " "),
                        ucx_tls != nullptr ? ucx_tls : "(UCX default)");
  r.config = {{"weightbus", std::string(LibraryVersion())},
              {"host",
               {{"system", u.sysname},
                {"release", u.release},
                {"machine", u.machine},
                {"cores", std::thread::hardware_concurrency()},
                {"memory_gib", mem_gib}}},
              {"dir", o.dir},
              {"filesystem", FsType(o.dir)},
              {"store", o.store},
              {"model", {{"source", source}, {"parameters", params}, {"dtype", "BF16"}}},
              {"stream", {{"lr", o.lr}, {"beta1", 0.9}, {"beta2", 0.95}, {"seed", o.seed}}},
              {"transports", o.transports},
              {"built", built},
              {"settings", o.settings},
              {"ucx_tls", ucx_tls != nullptr ? ucx_tls : ""},
              {"timeout_s", absl::ToDoubleSeconds(o.timeout)}};

  // Baselines' set-up.
  std::vector<std::byte> src(index.file_bytes), sink(index.file_bytes);
  OrDie(ReadWhole(index.VersionPath(o.store, 1), src.data(), index.file_bytes));
  std::memset(sink.data(), 1, sink.size());
  const bool want_perftest =
      o.perftest && (Contains(o.transports, "ucx") || Contains(o.transports, "delta+ucx"));
  BaselineResult b_memcpy{"memcpy", "one memcpy of the bytes into a resident buffer"};
  BaselineResult b_file{"write+read", "write(2)+fsync of the bytes to a file in dir, pread back"};
  BaselineResult b_perf{"ucx_perftest",
                        absl::StrFormat("%s -t ucp_get -s <bytes>, 127.0.0.1", o.perftest_path)};
  BaselineResult b_save{"torch.save",
                        "torch.save+fsync by rank 0, torch.load by every reader, same dir"};
  BaselineResult b_bcast{"gloo bcast", "torch.distributed.broadcast over gloo from rank 0"};
  std::vector<double> memcpy_s, file_write, file_last, file_read, perf_gbs;
  std::vector<double> save_stall, save_first, save_last, save_load, bcast_stall, bcast_first,
      bcast_last;
  int file_wrong = 0;
  TorchBaselines torch;
  bool torch_ok = false;
  if (!o.baselines) {
    for (BaselineResult* b : {&b_memcpy, &b_file, &b_perf, &b_save, &b_bcast}) {
      b->note = "--no-baselines";
    }
  }
  if (o.torch) {
    std::string why;
    torch_ok = torch.Start(o.python, std::string(WEIGHTBUS_BENCH_DIR) + "/torch_baselines.py",
                           o.store, o.dir, o.subscribers, log_dir + "/torch.log", &why);
    if (!torch_ok) b_save.note = b_bcast.note = why;
  } else if (o.baselines) {
    b_save.note = b_bcast.note = "--no-torch";
  }
  if (o.baselines && !want_perftest) {
    b_perf.note = o.perftest ? "no ucx transport measured" : "--no-perftest";
  } else if (want_perftest && access(o.perftest_path.c_str(), X_OK) != 0) {
    b_perf.note = o.perftest_path + " not found (Debian package ucx-utils)";
  }
  const bool perftest_ok = want_perftest && b_perf.note.empty();
  // Every transport's processes alive at once (interleaved) need about 5 model-sized buffers
  // each at their peak (parameters, staging or receive buffers, a delta layer's base and its
  // encoded versions: measured peak RSS 2x to 5x the model); if that does not fit, one transport
  // runs after the other.
  const uint64_t available_memory = AvailableMemory();
  const uint64_t need = o.transports.size() * (1 + o.subscribers) * 5 * index.file_bytes;
  const bool interleaved =
      o.order == "interleaved" ||
      (o.order == "auto" && (available_memory == 0 || need <= available_memory * 8 / 10));
  r.config["order"] = interleaved ? "interleaved" : "sequential";
  std::string baseline_line = "# baselines:";
  if (o.baselines) {
    baseline_line += " memcpy; write(2)+fsync and pread";
    if (perftest_ok) baseline_line += "; ucx_perftest -t ucp_get";
    if (torch_ok) {
      baseline_line += absl::StrFormat("; torch %s save/load and gloo broadcast (%s)",
                                       torch.version(), o.python);
    }
  } else {
    baseline_line += " none (--no-baselines)";
  }
  banner += baseline_line + "\n";
  banner += interleaved
                ? "# order: each version goes through every transport and the baselines in turn, "
                  "rotating the order from version to version\n#\n"
                : absl::StrFormat(
                      "# order: one transport after the other, then the baselines (%s)\n#\n",
                      o.order == "sequential"
                          ? "--order sequential"
                          : absl::StrFormat("their processes need about %s together, more than "
                                            "80%% of the %s available; --order interleaved to "
                                            "insist",
                                            HumanBytes(need), HumanBytes(available_memory)));
  std::fputs(banner.c_str(), stdout);
  std::fflush(stdout);

  // Processes.
  std::vector<std::unique_ptr<Session>> sessions;
  for (const std::string& t : o.transports) {
    std::string uri, channel_dir;
    if (absl::EndsWith(t, "disk")) {
      channel_dir = absl::StrFormat("%s/%s", o.dir, t == "disk" ? "disk-channel" : "delta-channel");
      uri = t + "://" + channel_dir;
    } else {
      uri = absl::StrFormat("%s://127.0.0.1:%d/wbbench", t, FreePort());
    }
    sessions.push_back(std::make_unique<Session>(t, uri, channel_dir));
  }

  // One round of the baselines (measured versions only).
  int perftest_runs = 0, torch_runs = 0;
  auto baseline_round = [&]() {
    memcpy_s.push_back(MemcpySeconds(src.data(), sink.data(), src.size()));
    absl::StatusOr<FileTimes> f = WriteFsyncRead(o.dir, src.data(), sink.data(), src.size());
    if (f.ok()) {
      file_write.push_back(f->write_fsync_s);
      file_read.push_back(f->read_s);
      file_last.push_back(f->write_fsync_s + f->read_s);
      file_wrong += std::memcmp(src.data(), sink.data(), src.size()) != 0;
    } else {
      b_file.note = std::string(f.status().message());
    }
    if (perftest_ok && perftest_runs < o.perftest_reps) {
      ++perftest_runs;
      const int iters = static_cast<int>(
          std::clamp<uint64_t>((1ull << 30) / std::max<uint64_t>(index.tensor_bytes, 1), 3, 200));
      absl::StatusOr<double> g = UcxPerftest(o.perftest_path, index.tensor_bytes, iters, log_dir);
      if (g.ok()) {
        perf_gbs.push_back(*g);
      } else {
        b_perf.note = std::string(g.status().message());
      }
    }
    if (torch_ok && torch_runs < o.torch_reps) {
      ++torch_runs;
      for (const char* what : {"save", "broadcast"}) {
        absl::StatusOr<nlohmann::json> j = torch.Run(what, o.timeout);
        if (!j.ok()) {
          torch_ok = false;
          b_save.note = b_bcast.note = std::string(j.status().message());
          break;
        }
        const std::vector<double> ready = (*j)["ready_s"].get<std::vector<double>>();
        const std::vector<bool> ok = (*j)["ok"].get<std::vector<bool>>();
        const bool all_ok = std::all_of(ok.begin(), ok.end(), [](bool b) { return b; });
        BaselineResult& b = std::string(what) == "save" ? b_save : b_bcast;
        b.wrong += all_ok ? 0 : 1;
        const double stall = (*j)["stall_s"];
        (std::string(what) == "save" ? save_stall : bcast_stall).push_back(stall);
        (std::string(what) == "save" ? save_first : bcast_first)
            .push_back(*std::min_element(ready.begin(), ready.end()));
        (std::string(what) == "save" ? save_last : bcast_last)
            .push_back(*std::max_element(ready.begin(), ready.end()));
        if (std::string(what) == "save") {
          for (double x : ready) save_load.push_back(x - stall);
        }
        b.raw["reps"].push_back(nlohmann::ordered_json::parse(j->dump()));
      }
    }
  };

  // The versions: interleaved, every transport and the baselines in turn for each version, or
  // (when their processes would not fit in memory together) one transport after the other.
  const int units = static_cast<int>(sessions.size()) + 1;  // the last unit: the baselines
  Progress bar(progress, o.versions * units);
  int done = 0;
  auto step = [&](int unit, int v) {
    const bool measured = v > o.warmup;
    if (unit < static_cast<int>(sessions.size())) {
      Session& s = *sessions[unit];
      bar.Update(done, absl::StrFormat("%s version %d", s.result.name, v));
      s.Step(v, measured, o.timeout);
    } else if (o.baselines && measured) {
      bar.Update(done, absl::StrFormat("baselines, round %d", v));
      baseline_round();
    }
    ++done;
  };
  if (interleaved) {
    // A subscriber waits for its next version while every other unit takes its turn.
    const absl::Duration wait = o.timeout * (units + 3);
    for (auto& s : sessions) s->Start(o, o.store, log_dir, wait, settings_for(s->result.name));
    for (int v = 1; v <= o.versions; ++v) {
      for (int k = 0; k < units; ++k) step((k + v - 1) % units, v);
    }
    bar.Update(done, "stopping processes");
    for (auto& s : sessions) s->Finish(o.versions);
  } else {
    for (int unit = 0; unit < units; ++unit) {
      if (unit < static_cast<int>(sessions.size())) {
        bar.Update(done, "starting " + sessions[unit]->result.name);
        sessions[unit]->Start(o, o.store, log_dir, o.timeout,
                              settings_for(sessions[unit]->result.name));
      }
      for (int v = 1; v <= o.versions; ++v) step(unit, v);
      if (unit < static_cast<int>(sessions.size())) sessions[unit]->Finish(o.versions);
    }
  }
  torch.Stop();
  bar.Clear();

  // Results.
  for (auto& s : sessions) {
    Summarize(s->result, r.model_bytes, o.versions);
    r.transports.push_back(std::move(s->result));
  }
  const double bytes = static_cast<double>(r.model_bytes);
  if (!memcpy_s.empty()) {
    b_memcpy.ran = true;
    b_memcpy.last = SummaryOf(memcpy_s);
    b_memcpy.rate_gbs = bytes / 1e9 / Median(memcpy_s);
    b_memcpy.raw["seconds"] = memcpy_s;
  }
  if (!file_last.empty()) {
    b_file.ran = true;
    b_file.readers = 1;
    b_file.stall = SummaryOf(file_write);
    b_file.first = b_file.last = SummaryOf(file_last);
    b_file.rate_gbs = bytes / 1e9 / Median(file_read);
    b_file.wrong = file_wrong;
    b_file.raw["write_fsync_s"] = file_write;
    b_file.raw["read_s"] = file_read;
    b_file.raw["write_gbs"] = bytes / 1e9 / Median(file_write);
    b_file.raw["read_gbs"] = bytes / 1e9 / Median(file_read);
  }
  if (!perf_gbs.empty()) {
    b_perf.ran = true;
    b_perf.readers = 1;
    std::vector<double> t;
    for (double g : perf_gbs) t.push_back(bytes / 1e9 / g);
    b_perf.first = b_perf.last = SummaryOf(t);
    b_perf.rate_gbs = Median(perf_gbs);
    b_perf.raw["gbs"] = perf_gbs;
  }
  // torch.save's rate is the loads' (the save is its stall); the broadcast's, the whole.
  auto torch_result = [&](BaselineResult& b, const std::vector<double>& stall,
                          const std::vector<double>& first, const std::vector<double>& last,
                          const std::vector<double>& rate_times) {
    if (last.empty()) return;
    b.ran = true;
    b.readers = o.subscribers;
    b.stall = SummaryOf(stall);
    b.first = SummaryOf(first);
    b.last = SummaryOf(last);
    b.rate_gbs = bytes / 1e9 / Median(rate_times);
    b.raw["torch"] = torch.version();
  };
  torch_result(b_save, save_stall, save_first, save_last, save_load);
  torch_result(b_bcast, bcast_stall, bcast_first, bcast_last, bcast_last);
  if (o.baselines) {
    r.baselines = {b_memcpy, b_file};
    if (want_perftest) r.baselines.push_back(b_perf);
    if (o.torch) {
      r.baselines.push_back(b_save);
      r.baselines.push_back(b_bcast);
    }
  }
  if (run_nccl) {
    // nccl:// and its own baseline (ncclBroadcast of the same bytes), GPU to GPU, at the
    // default bucket size: reported as one row, with both figures in its raw JSON.
    BaselineResult n{"nccl:// vs ncclBroadcast",
                     "weightbus-nccl-bench: the model's bytes from GPU 0 to every other GPU"};
    const std::string json = absl::StrFormat("%s/nccl-bench.json", o.dir);
    absl::StatusOr<process::RunResult> ran = process::RunCommand(
        {nccl_bench, "--size", std::to_string(std::max<uint64_t>(r.model_bytes, 1 << 20)),
         "--buckets", "256MiB", "--reps", std::to_string(o.quick ? 2 : 5), "--warmup", "1",
         "--json", json},
        absl::Minutes(10));
    nlohmann::ordered_json j;
    if (ran.ok() && ran->exit_code == 0) {
      std::ifstream in(json);
      j = nlohmann::ordered_json::parse(in, nullptr, false);
    }
    if (!j.is_discarded() && j.contains("rows") && !j["rows"].empty()) {
      const auto& row = j["rows"][0];
      n.ran = true;
      n.readers = j.value("replicas", 0);
      n.raw = j;
      const double t = row.value("nccl_uri_s", 0.0), base = row.value("ncclbroadcast_s", 0.0);
      n.wrong = row.value("wrong", 0);
      if (t > 0) {
        n.last = SummaryOf({t});
        n.rate_gbs = j.value("bytes", uint64_t{0}) / 1e9 / t;
        n.note = absl::StrFormat("%.3fx the ncclBroadcast loop (%.2f GB/s)", base / t,
                                 j.value("bytes", uint64_t{0}) / 1e9 / base);
      } else {
        n.note = "one GPU: NCCL refuses two ranks on one GPU, no broadcast measured";
      }
    } else {
      n.note = ran.ok() ? absl::StrFormat("weightbus-nccl-bench exited %d: %s", ran->exit_code,
                                          ran->output.substr(0, 400))
                        : std::string(ran.status().message());
    }
    r.baselines.push_back(std::move(n));
  }

  // Verdict.
  for (const TransportResult& t : r.transports) {
    if (!t.failure.empty()) r.failures.push_back(t.name + ": " + t.failure);
    if (t.wrong_versions > 0) {
      std::string first;
      for (const VersionRecord& v : t.versions) {
        for (const ReplicaRecord& p : v.replicas) {
          if (!p.ok && first.empty()) {
            first = absl::StrFormat("version %d, replica %d: %s", v.version, p.index, p.error);
          }
        }
      }
      r.failures.push_back(absl::StrFormat("%s: %d of %d versions failed verification (%s)", t.name,
                                           t.wrong_versions, t.versions.size(), first));
    }
  }
  for (const BaselineResult& b : r.baselines) {
    if (b.wrong > 0) {
      r.failures.push_back(
          absl::StrFormat("baseline %s: %d repetitions delivered wrong bytes", b.name, b.wrong));
    }
  }

  std::fputs(FormatTable(r).c_str(), stdout);
  std::fflush(stdout);
  bool io_ok = true;
  auto write = [&](const std::optional<std::string>& path, const std::string& text) {
    if (!path) return;
    if (std::optional<std::string> why = WriteText(*path, text)) {
      std::fprintf(stderr, "weightbus-bench: cannot write %s: %s\n", path->c_str(), why->c_str());
      io_ok = false;
    }
  };
  write(o.json, ToJson(r).dump(1) + "\n");
  write(o.csv, ToCsv(r));
  write(o.trace, ChromeTrace(r).dump() + "\n");
  write(o.plot, BarChartSvg(absl::StrFormat("weightbus-bench run: %s BF16 model, %d subscribers",
                                            HumanBytes(r.model_bytes), o.subscribers),
                            BarsOf(r)));
  RunCleanup();  // the run's directories, unless --keep
  if (!io_ok) return 2;
  return r.failures.empty() ? 0 : 1;
}

}  // namespace

Subcommand AddRunCommand(tools::Command& command) {
  auto flags = std::make_shared<RunFlags>();
  AddRunFlags(command, *flags);
  return [flags](const std::vector<std::string>& argv) { return Run(*flags, argv); };
}

}  // namespace weightbus::bench
