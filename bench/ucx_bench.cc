// SPDX-License-Identifier: Apache-2.0
// weightbus-ucx-bench: publish and pull synthetic bf16 models with Qwen2.5-0.5B's tensor shapes
// scaled to 64 MiB .. 2 GiB over ucx://, with 1 and 4 subscriber processes, against baselines
// measured in the same run with the same UCX_TLS: `ucx_perftest -t ucp_get` (Debian's ucx-utils,
// client and server on loopback, message size = the model's bytes) and a plain memcpy of the same
// bytes into one resident buffer.
//
//   weightbus-ucx-bench [--tls LIST]... [--sizes 64MiB,256MiB,1GiB,2GiB] [--subscribers 1,4]
//                       [--multi-max-bytes 1GiB] [--reps N] [--warmup N] [--json FILE]
//                       [--perftest PATH] [--no-perftest] [--shapes FILE] [--read-weights]
//                       (--help: every flag with its default)
//
// --read-weights: each subscriber reads every byte of a version before asking for the next, as a
// replica serving inference does (its receive buffers are then warm when recycled).
//
// Each --tls value is one UCX_TLS setting (default: posix,sysv,cma,self and tcp; tcp runs with
// UCX_NET_DEVICES=lo). Runs with more than one subscriber are limited to --multi-max-bytes
// (default 1 GiB: 4 subscribers x 2 GiB plus the publisher's source and staging copies do not
// fit next to other work in 24 GiB).
//
// Output follows nccl-tests: a banner, a table whose non-data lines start with '#', and a final
// "# OK" or "# FAILED: ..." line. Every figure is a median over --reps versions after --warmup
// versions (first-touch page faults of fresh buffers are not what a steady trainer sees).
//
// Metrics (docs/PERFORMANCE.md): "stall" is Publisher::Publish's wall time; "receive" is the
// subscriber's UpdateStats::fetch (every byte in place; checksums overlap it), "verified" adds
// the checksum tail and allocation; ucx_perftest's figure is its overall bandwidth.
// Targets: receive >= 0.9x ucx_perftest, stall <= 1.1x memcpy.
#include <fcntl.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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

std::string Human(uint64_t b) {
  if (b >= (1ull << 30)) return absl::StrFormat("%.2fGiB", b / double(1ull << 30));
  return absl::StrFormat("%.0fMiB", b / double(1ull << 20));
}

int FreePort() {
  const int port = weightbus::process::FreePort();
  if (port < 0) Die("cannot reserve a free port");
  return port;
}

using weightbus::process::Child;

// A child process whose stdout we read line by line (its stderr is ours).
Child StartReading(const std::vector<std::string>& argv) {
  Child::Options options;
  options.pipe_stdout = true;
  return OrDie(Child::Spawn(argv, options));
}

// The next line of `child`'s stdout, "" at its end (a subscriber answers within its own
// 600 s receive timeout).
std::string NextLine(Child& child) {
  return child.ReadLine(absl::Now() + absl::Seconds(660)).value_or("");
}

// Reaps `child` and returns its exit code (128 + signal for a death by signal).
int WaitExit(Child& child) {
  return weightbus::process::ExitCode(child.Wait(absl::InfiniteDuration()).value_or(-1));
}

std::string Self() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) Die("readlink /proc/self/exe");
  return std::string(buf, n);
}

// --role subscriber: receives versions 1..count, one JSON line of figures per version. With
// `read_weights`, it reads every byte of each version before asking for the next, as an
// inference replica does with its weights (the receive buffers are then recycled warm).
int SubscriberMain(const std::string& uri, uint64_t count, bool read_weights) {
  auto sub = OrDie(Subscriber::Open(uri));
  std::unique_ptr<Update> previous;
  for (uint64_t v = 1; v <= count; ++v) {
    if (previous != nullptr && read_weights) {
      uint64_t sum = 0;
      for (const TensorView& t : previous->tensors()) {
        const auto* p = static_cast<const uint64_t*>(t.data);
        const uint64_t n = previous->manifest().Find(t.name)->nbytes / 8;
        for (uint64_t k = 0; k < n; k += 8) sum += p[k];
      }
      static volatile uint64_t sink;
      sink = sum;
    }
    previous.reset();
    auto u = (*sub).WaitForVersion(v, absl::Seconds(600));
    if (!u.ok()) {
      std::printf("{\"error\": %s}\n",
                  nlohmann::json(std::string(u.status().message())).dump().c_str());
      std::fflush(stdout);
      return 1;
    }
    const UpdateStats& s = (*u)->stats();
    nlohmann::json j = {{"version", (*u)->version()},
                        {"bytes", s.bytes},
                        {"wait", absl::ToDoubleSeconds(s.wait)},
                        {"allocate", absl::ToDoubleSeconds(s.allocate)},
                        {"fetch", absl::ToDoubleSeconds(s.fetch)},
                        {"verify", absl::ToDoubleSeconds(s.verify_wait)},
                        {"copy", absl::ToDoubleSeconds(s.copy_out)}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
    previous = *std::move(u);
  }
  return 0;
}

// ucx_perftest -t ucp_get between two processes on loopback, `bytes` per get; GB/s (10^9).
double Perftest(const std::string& perftest, uint64_t bytes, int iters, std::string* why) {
  const std::string port = std::to_string(FreePort());
  Child server = StartReading({perftest, "-p", port});
  if (!weightbus::process::WaitForListener(std::stoi(port), absl::Now() + absl::Seconds(30))) {
    *why = "the ucx_perftest server did not listen on port " + port + " within 30 s";
    return 0;
  }
  Child client =
      StartReading({perftest, "127.0.0.1", "-p", port, "-t", "ucp_get", "-s", std::to_string(bytes),
                    "-n", std::to_string(iters), "-w", "2", "-f"});
  std::string last, line;
  while (!(line = NextLine(client)).empty()) {
    if (line.find_first_not_of(" \t\n") != std::string::npos) last = line;
  }
  const int rc = WaitExit(client);
  if (rc != 0) {
    *why = absl::StrFormat("ucx_perftest client exited with %d", rc);
    return 0;  // destroying `server` kills it
  }
  WaitExit(server);
  std::vector<std::string> f = absl::StrSplit(last, ' ', absl::SkipWhitespace());
  double mib_s = 0;  // ucx_perftest's "MB/s" is MiB/s
  if (f.size() < 6 || !absl::SimpleAtod(f[5], &mib_s)) {
    *why = "cannot parse ucx_perftest output: " + last;
    return 0;
  }
  return mib_s * 1048576.0 / 1e9;
}

struct Row {
  std::string tls, op, what;
  uint64_t bytes;
  double seconds;
  double gbps;
  std::string ratio;
};

int Main(int argc, char** argv) {
  SetFatalErrorPolicy({"weightbus-ucx-bench", 1, nullptr});
  struct {
    std::vector<std::string> tls = {"posix,sysv,cma,self", "tcp"};
    std::vector<uint64_t> sizes = {64ull << 20, 256ull << 20, 1ull << 30, 2ull << 30};
    std::vector<int> subscribers = {1, 4};
    uint64_t multi_max_bytes = 1ull << 30;
    int reps = 5, warmup = 2;
    std::string json, perftest = "/usr/bin/ucx_perftest", shapes = WEIGHTBUS_SHAPES_FILE;
    bool no_perftest = false, read_weights = false;
    // --role subscriber (the bench's own child processes)
    std::string role, uri;
    uint64_t count = 1;
  } flags;
  Command app(
      "weightbus-ucx-bench",
      "weightbus-ucx-bench: ucx:// publish and pull of synthetic bf16 models with "
      "Qwen2.5-0.5B's tensor shapes, against ucx_perftest and memcpy in the same run, per UCX_TLS "
      "setting. Output follows nccl-tests and ends with \"# OK\" or \"# FAILED: ...\".");
  app.AddRepeated("tls", &flags.tls,
                  "one UCX_TLS setting per flag (repeatable; tcp runs with UCX_NET_DEVICES=lo)")
      .DefaultText("posix,sysv,cma,self and tcp");
  app.AddSizeList("sizes", &flags.sizes, "model sizes");
  app.AddList("subscribers", &flags.subscribers, "subscriber process counts")
      .InRange(1, 1000)
      .TypeName("N,...")
      .DefaultText("1,4");
  app.AddSize("multi-max-bytes", &flags.multi_max_bytes,
              "runs with more than one subscriber only up to this model size");
  app.Add("reps", &flags.reps, "measured versions per figure (median)").InRange(1, 100000);
  app.Add("warmup", &flags.warmup, "versions before the measured ones").InRange(0, 100000);
  app.Add("json", &flags.json, "write every row to this file").TypeName("FILE");
  app.Add("perftest", &flags.perftest, "ucx_perftest (Debian's ucx-utils)").TypeName("PATH");
  app.AddSwitch("no-perftest", &flags.no_perftest, "leave the ucx_perftest baseline out");
  app.Add("shapes", &flags.shapes, "tensor shapes (JSON) to scale").TypeName("FILE");
  app.AddSwitch("read-weights", &flags.read_weights,
                "each subscriber reads every byte of a version before asking for the next");
  app.Add("role", &flags.role, "").OneOf({"subscriber"}).Hidden();
  app.Add("uri", &flags.uri, "").Hidden();
  app.Add("count", &flags.count, "").Hidden();
  if (std::optional<int> exit_status = app.Parse(argc, argv)) return *exit_status;
  if (flags.role == "subscriber") return SubscriberMain(flags.uri, flags.count, flags.read_weights);
  const std::vector<std::string>& tls_list = flags.tls;
  const std::vector<uint64_t>& sizes = flags.sizes;
  const std::vector<int>& sub_counts = flags.subscribers;
  const uint64_t multi_max = flags.multi_max_bytes;
  const int reps = flags.reps;
  const int warmup = flags.warmup;
  const std::string& perftest = flags.perftest;
  const bool run_perftest = !flags.no_perftest && access(perftest.c_str(), X_OK) == 0;
  const std::string& shapes_path = flags.shapes;
  const std::vector<ShapeSpec> base_shapes = OrDie(ReadShapes(shapes_path));
  uint64_t base_bytes = 0;
  for (const ShapeSpec& s : base_shapes) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    base_bytes += static_cast<uint64_t>(n) * 2;
  }

  utsname u;
  uname(&u);
  std::printf("# weightbus-ucx-bench (weightbus %s, UCX from libucx-dev)\n",
              std::string(LibraryVersion()).c_str());
  std::printf(
      "# model: %s scaled to each size, BF16; kernel %s; %u cores; %d reps after %d "
      "warm-up versions, medians\n",
      shapes_path.c_str(), u.release, std::thread::hardware_concurrency(), reps, warmup);
  std::printf("# perftest: %s\n", run_perftest ? (perftest + " -t ucp_get -s <model bytes>, "
                                                             "client and server on 127.0.0.1, "
                                                             "once per round")
                                                     .c_str()
                                               : "skipped");
  std::printf("# checksums: XXH3-64 (%s); rounds interleave memcpy, ucx_perftest and ours\n",
              "see docs/PERFORMANCE.md");
  std::fflush(stdout);

  std::vector<Row> rows;
  std::vector<std::string> failures;
  for (const std::string& tls : tls_list) {
    // For this transport's rounds (subscribers inherit it), restored after them.
    const weightbus::process::ScopedEnvs tls_env(
        {{"UCX_TLS", tls}, {"UCX_NET_DEVICES", tls.find("tcp") != std::string::npos ? "lo" : ""}});
    for (uint64_t target : sizes) {
      std::vector<OwnedTensor> model = OrDie(MakeSyntheticModel(
          ScaleShapes(base_shapes, double(target) / base_bytes), DType::kBF16, 42));
      std::vector<TensorView> views;
      uint64_t bytes = 0;
      for (const OwnedTensor& t : model) {
        views.push_back(t.view());
        bytes += t.bytes.size();
      }
      const std::string label = Human(target);
      std::printf("# %s %s: %zu tensors, %llu bytes\n", tls.c_str(), label.c_str(), model.size(),
                  static_cast<unsigned long long>(bytes));
      std::fflush(stdout);

      // Every round measures, in this order: one ucx_perftest run, a memcpy of the bytes into
      // one resident buffer, and one version published to each subscriber configuration, so
      // that the machine's slow and fast moments hit baselines and ours alike. The first
      // `warmup` rounds are not recorded (first-touch page faults, UCX start-up).
      struct Config {
        int nsub;
        std::unique_ptr<Publisher> pub;
        std::vector<Child> subs;
        std::vector<double> stall, transport, checksum_wait, fetch, verified, aggregate;
      };
      std::vector<Config> configs;
      for (int nsub : sub_counts) {
        if (nsub > 1 && target > multi_max) {
          std::printf("# %s %s: %d subscribers skipped (above --multi-max-bytes %s)\n", tls.c_str(),
                      label.c_str(), nsub, Human(multi_max).c_str());
          continue;
        }
        Config c;
        c.nsub = nsub;
        const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/bench", FreePort());
        c.pub = OrDie(Publisher::Open(uri));
        for (int i = 0; i < nsub; ++i) {
          std::vector<std::string> argv = {Self(),
                                           "--role",
                                           "subscriber",
                                           "--uri",
                                           uri,
                                           "--count",
                                           std::to_string(warmup + reps)};
          if (flags.read_weights) argv.push_back("--read-weights");
          c.subs.push_back(StartReading(argv));
        }
        configs.push_back(std::move(c));
      }
      std::vector<std::byte> sink(bytes);
      std::memset(sink.data(), 1, sink.size());
      std::vector<double> memcpy_s, perf;
      std::string perf_why;
      const int perf_iters = static_cast<int>(std::clamp<uint64_t>((2ull << 30) / bytes, 3, 20));
      for (int round = 0; round < warmup + reps; ++round) {
        const bool record = round >= warmup;
        if (run_perftest && record) {
          const double g = Perftest(perftest, bytes, perf_iters, &perf_why);
          if (g > 0) perf.push_back(g);
        }
        // Twice, timing the second: on this VM memory left idle for a second or two is slow
        // to touch again (host-level reclaim), which is not what a memcpy costs.
        for (int pass = 0; pass < 2; ++pass) {
          const absl::Time t0 = absl::Now();
          size_t off = 0;
          for (const OwnedTensor& t : model) {
            std::memcpy(sink.data() + off, t.bytes.data(), t.bytes.size());
            off += t.bytes.size();
          }
          if (record && pass == 1) memcpy_s.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
        }
        const uint64_t v = round + 1;
        for (Config& c : configs) {
          OrDie(c.pub->Publish(v, views, {}, absl::Seconds(600)));
          const PublishStats ps = c.pub->last_stats();
          double slowest = 0;
          for (Child& p : c.subs) {
            const std::string line = NextLine(p);
            nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
            if (j.is_discarded() || j.contains("error") || j["version"] != v) {
              Die("subscriber failed: " + line);
            }
            const double f = j["fetch"];
            const double all = double(j["allocate"]) + f + double(j["verify"]) + double(j["copy"]);
            if (record) {
              c.fetch.push_back(f);
              c.verified.push_back(all);
            }
            slowest = std::max(slowest, f);
          }
          if (record) {
            c.stall.push_back(absl::ToDoubleSeconds(ps.stall));
            c.transport.push_back(absl::ToDoubleSeconds(ps.transport));
            c.checksum_wait.push_back(absl::ToDoubleSeconds(ps.checksum_wait));
            c.aggregate.push_back(slowest);
          }
        }
      }
      const double memcpy_t = Median(memcpy_s);
      rows.push_back({tls, label, "baseline: memcpy of the bytes", bytes, memcpy_t,
                      bytes / 1e9 / memcpy_t, ""});
      const double perf_gbps = Median(perf);
      if (perf_gbps > 0) {
        rows.push_back({tls, label, "baseline: ucx_perftest ucp_get", bytes,
                        bytes / 1e9 / perf_gbps, perf_gbps, ""});
      } else if (run_perftest) {
        std::printf("# ucx_perftest failed: %s\n", perf_why.c_str());
      }
      for (Config& c : configs) {
        for (Child& p : c.subs) {
          if (WaitExit(p) != 0) Die("a subscriber process failed");
        }
        c.pub.reset();
        const int nsub = c.nsub;
        const double st = Median(c.stall);
        if (&c == &configs.front()) {
          rows.push_back({tls, label, "weightbus: trainer stall (Publish)", bytes, st,
                          bytes / 1e9 / st, absl::StrFormat("%.2fx memcpy", st / memcpy_t)});
          if (st > 1.1 * memcpy_t) {
            failures.push_back(
                absl::StrFormat("%s %s stall %.2fx memcpy", tls, label, st / memcpy_t));
          }
        }
        const double f = Median(c.fetch), all = Median(c.verified);
        const std::string who =
            absl::StrFormat("weightbus: receive, %d sub%s", nsub, nsub > 1 ? "s (each)" : "");
        rows.push_back(
            {tls, label, who, bytes, f, bytes / 1e9 / f,
             perf_gbps > 0 ? absl::StrFormat("%.2fx perftest", bytes / 1e9 / f / perf_gbps) : ""});
        rows.push_back({tls, label, who + ", verified", bytes, all, bytes / 1e9 / all, ""});
        if (nsub > 1) {
          const double agg = Median(c.aggregate);
          rows.push_back({tls, label, absl::StrFormat("weightbus: receive, %d subs (total)", nsub),
                          bytes * nsub, agg, bytes * nsub / 1e9 / agg,
                          perf_gbps > 0 ? absl::StrFormat("%.2fx perftest",
                                                          bytes * nsub / 1e9 / agg / perf_gbps)
                                        : ""});
        }
        if (nsub == 1 && perf_gbps > 0 && bytes / 1e9 / f < 0.9 * perf_gbps) {
          failures.push_back(absl::StrFormat("%s %s receive %.2fx perftest", tls, label,
                                             bytes / 1e9 / f / perf_gbps));
        }
        std::printf(
            "#   %s %s %d sub: stall %.4f s (transport %.4f, checksum wait %.4f; memcpy "
            "%.4f), receive %.4f s, verified %.4f s%s\n",
            tls.c_str(), label.c_str(), nsub, st, Median(c.transport), Median(c.checksum_wait),
            memcpy_t, f, all,
            perf_gbps > 0 ? absl::StrFormat(" (perftest %.2f GB/s)", perf_gbps).c_str() : "");
        std::fflush(stdout);
      }
    }
  }

  std::printf("#\n# %-20s %-9s %-40s %9s %8s  %s\n", "UCX_TLS", "size", "what", "time", "rate",
              "ratio");
  std::printf("# %-20s %-9s %-40s %9s %8s  %s\n", "", "", "", "(s)", "(GB/s)", "");
  for (const Row& r : rows) {
    std::printf("  %-20s %-9s %-40s %9.4f %8.2f  %s\n", r.tls.c_str(), r.op.c_str(), r.what.c_str(),
                r.seconds, r.gbps, r.ratio.c_str());
  }
  if (const std::string* path = flags.json.empty() ? nullptr : &flags.json) {
    nlohmann::ordered_json j;
    for (const Row& r : rows) {
      j["rows"].push_back({{"tls", r.tls},
                           {"size", r.op},
                           {"what", r.what},
                           {"bytes", r.bytes},
                           {"seconds", r.seconds},
                           {"gb_per_s", r.gbps},
                           {"ratio", r.ratio}});
    }
    FILE* f = std::fopen(path->c_str(), "w");
    if (f != nullptr) {
      std::fputs(j.dump(1).c_str(), f);
      std::fclose(f);
    }
  }
  if (failures.empty()) {
    std::printf("# OK\n");
    return 0;
  }
  std::printf("# FAILED: %s\n", absl::StrJoin(failures, "; ").c_str());
  return 1;
}

}  // namespace
}  // namespace weightbus::tools

int main(int argc, char** argv) { return weightbus::tools::Main(argc, argv); }
