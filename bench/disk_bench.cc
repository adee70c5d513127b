// SPDX-License-Identifier: Apache-2.0
// weightbus-disk-bench: durable publish and subscribe of a synthetic ~1 GiB bf16 model with
// Qwen2.5-0.5B's tensor shapes over disk://, against baselines measured in the same run on the
// same directory: memcpy of the same bytes, dd write with fsync, dd read and a plain pread loop
// into one buffer (page cache hot, and cold after drop_caches where permitted), and
// torch.save + torch.load of the same tensors (bench/torch_baseline.py, Debian's python3-torch).
//
//   weightbus-disk-bench [--dir DIR] [--shapes FILE] [--scale F] [--reps N] [--json FILE]
//                        [--python PATH] [--no-torch] [--no-cold]   (--help: every flag)
//
// Output follows nccl-tests: a banner, a table whose non-data lines start with '#', and a final
// "# OK" or "# FAILED: ..." line; every figure is a median over --reps repetitions.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "process/process.h"
#include "weightbus/fatal.h"
#include "weightbus/flags.h"
#include "weightbus/synthetic_model.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::tools {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Runs a shell command and returns its combined output; dies on failure.
std::string Shell(const std::string& cmd) { return OrDie(weightbus::process::RunShell(cmd)); }

// dd's own timing ("..., 2.65 s, 405 MB/s"), which excludes process start-up.
double DdSeconds(const std::string& output) {
  size_t s = output.rfind(" s, ");
  size_t c = output.rfind(", ", s - 1);
  double v = 0;
  if (s == std::string::npos || c == std::string::npos ||
      !absl::SimpleAtod(output.substr(c + 2, s - c - 2), &v)) {
    Die("cannot parse dd output: " + output);
  }
  return v;
}

bool DropCaches() {
  ::sync();
  int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (fd < 0) return false;
  bool ok = ::write(fd, "3", 1) == 1;
  ::close(fd);
  return ok;
}

// Sequential pread of `path` in 4 MiB chunks into `buffer` (the raw cost of loading the bytes
// into memory that stays resident, as a loader does).
double PreadSeconds(const std::string& path, std::vector<std::byte>& buffer) {
  const absl::Time t0 = absl::Now();
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) Die("open " + path);
  size_t done = 0;
  while (done < buffer.size()) {
    ssize_t n =
        ::pread(fd, buffer.data() + done, std::min<size_t>(4 << 20, buffer.size() - done), done);
    if (n <= 0) Die("pread " + path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return absl::ToDoubleSeconds(absl::Now() - t0);
}

// One comment line with where the time of a publish and a subscribe went.
void PrintStats(const char* what, int rep, const Update& u, const PublishStats& p) {
  const UpdateStats& s = u.stats();
  std::printf(
      "# rep %d %-4s publish %.3f s (transport %.3f, checksum wait %.3f); subscribe: "
      "wait %.3f allocate %.3f fetch %.3f verify %.3f copy %.3f s\n",
      rep, what, absl::ToDoubleSeconds(p.stall), absl::ToDoubleSeconds(p.transport),
      absl::ToDoubleSeconds(p.checksum_wait), absl::ToDoubleSeconds(s.wait),
      absl::ToDoubleSeconds(s.allocate), absl::ToDoubleSeconds(s.fetch),
      absl::ToDoubleSeconds(s.verify_wait), absl::ToDoubleSeconds(s.copy_out));
}

// write(2) of the model's bytes, tensor after tensor in 4 MiB pieces, then fsync: the raw cost of
// making the same bytes durable in one file.
double RawWriteSeconds(const std::string& path, const std::vector<OwnedTensor>& model) {
  const absl::Time t0 = absl::Now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) Die("open " + path);
  for (const OwnedTensor& t : model) {
    size_t done = 0;
    while (done < t.bytes.size()) {
      ssize_t n =
          ::write(fd, t.bytes.data() + done, std::min<size_t>(4 << 20, t.bytes.size() - done));
      if (n <= 0) Die("write " + path);
      done += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) Die("fsync " + path);
  ::close(fd);
  return absl::ToDoubleSeconds(absl::Now() - t0);
}

// bench/torch_baseline.py, kept running so its runs interleave with ours.
class TorchBaseline {
 public:
  // Starts the script; returns false (with `why`) when it cannot run or torch is missing.
  bool Start(const std::string& python, const std::string& args, std::string* why) {
    weightbus::process::Child::Options options;
    options.pipe_stdin = true;
    options.pipe_stdout = true;
    absl::StatusOr<weightbus::process::Child> c =
        weightbus::process::Child::Spawn({"/bin/sh", "-c", python + " " + args}, options);
    if (!c.ok()) {
      *why = std::string(c.status().message());
      return false;
    }
    child_ = *std::move(c);
    nlohmann::json first = ReadLine();
    if (first.is_discarded() || !first.contains("ready")) {
      *why = first.is_discarded() ? "the script did not start" : first.dump();
      return false;
    }
    version_ = first.value("torch", "?");
    return true;
  }
  nlohmann::json Run() {
    if (!child_.Send("run")) return nlohmann::json::value_t::discarded;
    return ReadLine();
  }
  // The script ends at the end of its stdin; one that does not within 30 s is killed.
  ~TorchBaseline() { child_.WaitOrKill(absl::Now() + absl::Seconds(30)); }
  const std::string& version() const { return version_; }

 private:
  nlohmann::json ReadLine() {
    std::optional<std::string> line = child_.ReadLine(absl::Now() + absl::Seconds(600));
    if (!line) return nlohmann::json::value_t::discarded;
    return nlohmann::json::parse(*line, nullptr, false);
  }
  weightbus::process::Child child_;
  std::string version_;
};

struct Row {
  std::string op, what;
  double seconds;
  uint64_t bytes;
  std::string ratio;
};

int Main(int argc, char** argv) {
  SetFatalErrorPolicy({"weightbus-disk-bench", 1, nullptr});
  std::string dir, json;
  std::string shapes_path = WEIGHTBUS_SHAPES_FILE;
  double scale = 1.0;
  int reps = 3;
  std::string python = "/usr/bin/python3";
  bool no_torch = false, no_cold = false;
  Command app(
      "weightbus-disk-bench",
      "weightbus-disk-bench: durable publish and subscribe of a synthetic ~1 GiB bf16 model with "
      "Qwen2.5-0.5B's tensor shapes over disk://, against memcpy, dd, pread and torch.save/load "
      "on the same directory in the same run. Output follows nccl-tests and ends with \"# OK\" "
      "or \"# FAILED: ...\".");
  app.Add("dir", &dir, "where the channel and baselines write (default: $TMPDIR/wb-disk-bench-PID)")
      .TypeName("DIR");
  app.Add("shapes", &shapes_path, "tensor shapes (JSON)").TypeName("FILE");
  app.Add("scale", &scale, "scale every tensor's elements by this factor").Positive();
  app.Add("reps", &reps, "repetitions per figure (median)").InRange(1, 100000);
  app.Add("json", &json, "write every row to this file").TypeName("FILE");
  app.Add("python", &python, "interpreter with torch for the torch baseline").TypeName("PATH");
  app.AddSwitch("no-torch", &no_torch, "leave the torch.save/torch.load baseline out");
  app.AddSwitch("no-cold", &no_cold, "leave the cold page cache figures out");
  if (std::optional<int> exit_status = app.Parse(argc, argv)) return *exit_status;
  if (dir.empty()) {
    dir = (std::filesystem::temp_directory_path() / absl::StrFormat("wb-disk-bench-%d", getpid()))
              .string();
  }
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);

  std::vector<ShapeSpec> shapes = ScaleShapes(OrDie(ReadShapes(shapes_path)), scale);
  std::vector<OwnedTensor> model = OrDie(MakeSyntheticModel(shapes, DType::kBF16, 42));
  std::vector<TensorView> views;
  uint64_t bytes = 0;
  for (const OwnedTensor& t : model) {
    views.push_back(t.view());
    bytes += t.bytes.size();
  }
  utsname u;
  uname(&u);
  std::printf("# weightbus-disk-bench (weightbus %s)\n", std::string(LibraryVersion()).c_str());
  std::printf("# model: %s x%.3g, %zu tensors, BF16, %llu bytes (%.2f GiB)\n", shapes_path.c_str(),
              scale, model.size(), static_cast<unsigned long long>(bytes), bytes / double(1 << 30));
  std::printf("# dir: %s; kernel %s; %u cores; %d reps, medians\n", dir.c_str(), u.release,
              std::thread::hardware_concurrency(), reps);

  // memcpy of the same bytes into one resident buffer (after a first touch).
  std::vector<std::byte> sink(bytes);
  std::vector<double> memcpy_s;
  for (int r = 0; r < reps; ++r) {
    const absl::Time t0 = absl::Now();
    size_t off = 0;
    for (const OwnedTensor& t : model) {
      std::memcpy(sink.data() + off, t.bytes.data(), t.bytes.size());
      off += t.bytes.size();
    }
    memcpy_s.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
  }

  // Nothing is deleted while timing: deleting 1 GiB files (discard on many mounts) stalls
  // concurrent fsyncs on shared storage, so every rep writes new files and all go at the end.
  const std::string uri = "disk://" + dir + "/channel?retention=1000";
  // The same bytes in a tmpfs file, as dd's input for a write of the same bytes.
  const std::string shm = absl::StrFormat("/dev/shm/wb-disk-bench-%d.bin", getpid());
  {
    int fd = ::open(shm.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) Die("open " + shm);
    for (const OwnedTensor& t : model) {
      if (::write(fd, t.bytes.data(), t.bytes.size()) != static_cast<ssize_t>(t.bytes.size())) {
        Die("write " + shm);
      }
    }
    ::close(fd);
  }
  std::vector<double> raw_write, dd_write, publish, dd_read_hot, pread_hot, sub_hot, dd_read_cold,
      pread_cold, sub_cold;
  bool cold = !no_cold;
  auto pub = OrDie(Publisher::Open(uri));
  auto sub = OrDie(Subscriber::Open(uri));
  // The same sync without durability (fsync=false): what a trainer that keeps its own
  // checkpoints needs, and the like-for-like comparison with torch.save (which does not fsync).
  const std::string fast_uri = "disk://" + dir + "/channel-nofsync?retention=1000&fsync=false";
  auto fast_pub = OrDie(Publisher::Open(fast_uri));
  auto fast_sub = OrDie(Subscriber::Open(fast_uri));
  std::vector<double> fast_publish, fast_subscribe, torch_save, torch_save_fsync, torch_load;
  TorchBaseline torch;
  bool torch_ok = false;
  if (!no_torch) {
    std::string why;
    torch_ok = torch.Start(python,
                           absl::StrFormat("%s/torch_baseline.py --shapes %s --scale %.17g "
                                           "--dir %s",
                                           WEIGHTBUS_BENCH_DIR, shapes_path, scale, dir),
                           &why);
    if (!torch_ok) std::printf("# torch rows skipped: %s\n", why.c_str());
  }
  uint64_t version = 0;
  for (int r = 0; r < reps; ++r) {
    // The three writes of a rep run in a rotating order, each after a sync: on shared storage a
    // write that follows others is often slower (the host's cache is still draining), and
    // rotation spreads that over all three alike.
    const std::string raw = absl::StrFormat("%s/raw-%d.bin", dir, r);
    for (int k = 0; k < 3; ++k) {
      ::sync();
      switch ((r + k) % 3) {
        case 0:
          dd_write.push_back(DdSeconds(
              Shell(absl::StrFormat("dd if=%s of=%s/dd-%d.bin bs=4M conv=fsync", shm, dir, r))));
          break;
        case 1:
          raw_write.push_back(RawWriteSeconds(raw, model));
          break;
        case 2: {
          const absl::Time t0 = absl::Now();
          OrDie(pub->Publish(++version, views, {}, absl::Seconds(600)));
          publish.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
          break;
        }
      }
    }

    // Not durable: our fsync=false channel against torch.save + torch.load, rotated likewise.
    for (int k = 0; k < 2; ++k) {
      ::sync();
      if ((r + k) % 2 == 0) {
        const absl::Time t0 = absl::Now();
        OrDie(fast_pub->Publish(r + 1, views, {}, absl::Seconds(600)));
        const absl::Time t1 = absl::Now();
        auto update = OrDie(fast_sub->WaitForVersion(r + 1, absl::Seconds(600)));
        fast_publish.push_back(absl::ToDoubleSeconds(t1 - t0));
        fast_subscribe.push_back(absl::ToDoubleSeconds(absl::Now() - t1));
      } else if (torch_ok) {
        nlohmann::json t = torch.Run();
        if (t.is_discarded() || !t.contains("save_s")) Die("torch baseline run failed");
        torch_save.push_back(t["save_s"]);
        torch_save_fsync.push_back(t["save_fsync_s"]);
        torch_load.push_back(t["load_s"]);
      }
    }

    dd_read_hot.push_back(DdSeconds(Shell(absl::StrFormat("dd if=%s of=/dev/null bs=4M", raw))));
    pread_hot.push_back(PreadSeconds(raw, sink));
    {
      const absl::Time s0 = absl::Now();
      auto update = OrDie(sub->WaitForVersion(version, absl::Seconds(600)));
      sub_hot.push_back(absl::ToDoubleSeconds(absl::Now() - s0));
      PrintStats("hot", r, *update, pub->last_stats());
    }
    if (cold) {
      if (!DropCaches()) {
        cold = false;
        std::printf("# cold-cache rows skipped: cannot write /proc/sys/vm/drop_caches\n");
        continue;
      }
      dd_read_cold.push_back(DdSeconds(Shell(absl::StrFormat("dd if=%s of=/dev/null bs=4M", raw))));
      DropCaches();
      pread_cold.push_back(PreadSeconds(raw, sink));
      // Publishing the same bytes as a new version, then dropping caches, gives a cold read.
      OrDie(pub->Publish(++version, views, {}, absl::Seconds(600)));
      DropCaches();
      const absl::Time s0 = absl::Now();
      auto update = OrDie(sub->WaitForVersion(version, absl::Seconds(600)));
      sub_cold.push_back(absl::ToDoubleSeconds(absl::Now() - s0));
      PrintStats("cold", r, *update, pub->last_stats());
    }
  }
  pub.reset();
  sub.reset();
  fast_pub.reset();
  fast_sub.reset();
  ::unlink(shm.c_str());
  const double write_base = std::min(Median(raw_write), Median(dd_write));

  std::vector<Row> rows;
  auto ratio = [](double ours, double base) { return absl::StrFormat("%.2fx", base / ours); };
  rows.push_back({"memcpy", "baseline: one copy of the bytes", Median(memcpy_s), bytes, ""});
  rows.push_back({"write+fsync", "baseline: dd bs=4M conv=fsync", Median(dd_write), bytes, ""});
  rows.push_back({"write+fsync", "baseline: write(2) 4MiB + fsync", Median(raw_write), bytes, ""});
  rows.push_back({"publish", "weightbus disk:// (durable)", Median(publish), bytes,
                  ratio(Median(publish), write_base) + " of the faster baseline"});
  rows.push_back({"read, hot", "baseline: dd bs=4M to /dev/null", Median(dd_read_hot), bytes, ""});
  rows.push_back(
      {"read, hot", "baseline: pread 4MiB into one buffer", Median(pread_hot), bytes, ""});
  rows.push_back({"subscribe, hot", "weightbus (verified)", Median(sub_hot), bytes,
                  ratio(Median(sub_hot), Median(pread_hot)) + " of pread, " +
                      ratio(Median(sub_hot), Median(dd_read_hot)) + " of dd"});
  if (cold && !sub_cold.empty()) {
    rows.push_back(
        {"read, cold", "baseline: dd bs=4M to /dev/null", Median(dd_read_cold), bytes, ""});
    rows.push_back(
        {"read, cold", "baseline: pread 4MiB into one buffer", Median(pread_cold), bytes, ""});
    rows.push_back({"subscribe, cold", "weightbus (verified)", Median(sub_cold), bytes,
                    ratio(Median(sub_cold), Median(pread_cold)) + " of pread, " +
                        ratio(Median(sub_cold), Median(dd_read_cold)) + " of dd"});
  }
  rows.push_back(
      {"publish", "weightbus, fsync=false (not durable)", Median(fast_publish), bytes, ""});
  rows.push_back(
      {"subscribe", "weightbus, fsync=false channel", Median(fast_subscribe), bytes, ""});
  if (torch_ok) {
    const double save = Median(torch_save), load = Median(torch_load);
    const double save_fsync = Median(torch_save_fsync);
    rows.push_back({"torch.save", "baseline: torch.save (no fsync)", save, bytes, ""});
    rows.push_back({"torch.save", "baseline: torch.save + fsync", save_fsync, bytes, ""});
    rows.push_back({"torch.load", "baseline: torch.load", load, bytes, ""});
    const double durable = Median(publish) + Median(sub_hot);
    const double fast = Median(fast_publish) + Median(fast_subscribe);
    rows.push_back(
        {"round trip", "baseline: torch.save + fsync + load", save_fsync + load, bytes, ""});
    rows.push_back({"round trip", "weightbus durable publish + subscribe", durable, bytes,
                    absl::StrFormat("%.2fx faster", (save_fsync + load) / durable)});
    rows.push_back({"round trip", "baseline: torch.save + torch.load", save + load, bytes, ""});
    rows.push_back({"round trip", "weightbus fsync=false publish+subscribe", fast, bytes,
                    absl::StrFormat("%.2fx faster", (save + load) / fast)});
  }

  std::printf("#\n# %-16s %-38s %9s %9s  %s\n", "operation", "what", "time", "rate", "ratio");
  std::printf("# %-16s %-38s %9s %9s  %s\n", "", "", "(s)", "(GB/s)", "(ours vs baseline)");
  for (const Row& r : rows) {
    std::printf("  %-16s %-38s %9.3f %9.2f  %s\n", r.op.c_str(), r.what.c_str(), r.seconds,
                r.bytes / 1e9 / r.seconds, r.ratio.c_str());
  }
  std::vector<std::string> failures;
  if (Median(publish) > write_base / 0.9) failures.push_back("publish < 0.9x raw write");
  if (Median(sub_hot) > Median(pread_hot) / 0.9) failures.push_back("hot subscribe < 0.9x pread");
  if (cold && !sub_cold.empty() && Median(sub_cold) > Median(pread_cold) / 0.9) {
    failures.push_back("cold subscribe < 0.9x pread");
  }
  if (torch_ok) {
    // Like for like: a durable publish against a durable torch.save (both fsync).
    const double torch_rt = Median(torch_save_fsync) + Median(torch_load);
    if (torch_rt < 5 * (Median(publish) + Median(sub_hot))) {
      failures.push_back("durable round trip < 5x faster than torch.save + fsync + torch.load");
    }
  }
  if (const std::string* path = json.empty() ? nullptr : &json) {
    nlohmann::ordered_json j;
    j["bytes"] = bytes;
    j["tensors"] = model.size();
    j["reps"] = reps;
    for (const Row& r : rows) {
      j["rows"].push_back({{"operation", r.op},
                           {"what", r.what},
                           {"seconds", r.seconds},
                           {"gb_per_s", r.bytes / 1e9 / r.seconds},
                           {"ratio", r.ratio}});
    }
    if (torch_ok) j["torch_version"] = torch.version();
    FILE* f = std::fopen(path->c_str(), "w");
    if (f != nullptr) {
      std::fputs(j.dump(1).c_str(), f);
      std::fclose(f);
    }
  }
  std::filesystem::remove_all(dir);
  if (failures.empty()) {
    std::printf("# OK\n");
    return 0;
  }
  std::string all;
  for (const std::string& f : failures) all += (all.empty() ? "" : "; ") + f;
  std::printf("# FAILED: %s\n", all.c_str());
  return 1;
}

}  // namespace
}  // namespace weightbus::tools

int main(int argc, char** argv) { return weightbus::tools::Main(argc, argv); }
