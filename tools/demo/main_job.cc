// SPDX-License-Identifier: Apache-2.0
// weightbus-demo: the main job. A trainer process converts a real llama2.c checkpoint, checks the
// conversion with two independent forward passes, then publishes a sequence of versions (an fp32
// master copy updated Adam-style, cast to bf16) over a transport; replica processes follow the
// channel, receive each version into their own parameter buffers, and check it bit-exact against
// an independent local recomputation. Per version it prints the trainer stall, the time until
// each replica held the verified version, the bytes and the bandwidth.
//
//   weightbus-demo [--checkpoint PATH] [--uri URI] [--versions N] [--replicas R] [--lr LR]
//                  [--seed S] [--workdir DIR] [--keep]      (--help: every flag)
//
// Exit status 0 only when the logits check passed and every replica verified every version.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "process/process.h"
#include "weightbus/bf16.h"
#include "weightbus/fatal.h"
#include "weightbus/flags.h"
#include "weightbus/llama2c.h"
#include "weightbus/llama_forward.h"
#include "weightbus/update_stream.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::tools {
namespace {

constexpr absl::Duration kStepTimeout = absl::Seconds(120);

struct Options {
  std::string checkpoint;
  std::string uri;
  std::string workdir;
  uint64_t versions = 20;
  int replicas = 2;
  double lr = 1e-5;
  uint64_t seed = 1;
  bool keep = false;
  // replica only
  int index = -1;
};

// What the trainer must undo if it dies: its temporary work directory (and the replica
// processes, every live process::Child).
std::string g_temporary_workdir;

// Die's cleanup (tools/weightbus/fatal.h).
void KillReplicasAndRemoveWorkdir() {
  process::StopAllChildren(absl::ZeroDuration());
  if (!g_temporary_workdir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(g_temporary_workdir, ec);
  }
}

// The stream every process derives independently: same checkpoint, seed and options give the
// same versions bit for bit. Version 1 is the converted checkpoint; version k+1 follows k Adam
// steps.
UpdateStream MakeStream(const Options& o) {
  Llama2cCheckpoint ckpt = OrDie(ReadLlama2c(o.checkpoint));
  std::vector<OwnedTensor> master = OrDie(ConvertToHf(ckpt, DType::kF32));
  AdamOptions adam;
  adam.lr = o.lr;
  adam.seed = o.seed;
  return OrDie(UpdateStream::Create(master, adam));
}

std::vector<TensorView> ViewsOf(const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorView> views;
  for (const OwnedTensor& t : tensors) views.push_back(t.view());
  return views;
}

// ----- replica -----

int RunReplica(const Options& o) {
  UpdateStream expected = MakeStream(o);
  std::vector<OwnedTensor> params = expected.Bf16();  // the replica's parameter buffers
  auto sub = OrDie(Subscriber::Open(o.uri));
  for (OwnedTensor& p : params) {
    OrDie(sub->Bind(p.name, Destination{p.dtype, p.shape, {}, p.bytes.data()}));
  }
  uint64_t have = 0;
  while (have < o.versions) {
    auto update = sub->WaitForVersion(have + 1, kStepTimeout);
    if (!update.ok()) {
      std::printf("ERROR %s\n", std::string(update.status().message()).c_str());
      std::fflush(stdout);
      return 1;
    }
    const Update& u = **update;
    const int64_t ready_ns = u.stats().ready_unix_ns;
    // Independent check: recompute the version locally and compare every byte.
    while (expected.step() + 1 < u.version()) expected.Step();
    std::vector<OwnedTensor> want = expected.Bf16();
    bool same = want.size() == params.size();
    for (size_t i = 0; same && i < want.size(); ++i) {
      same = want[i].bytes == params[i].bytes;
    }
    std::printf("READY %llu %lld %s\n", static_cast<unsigned long long>(u.version()),
                static_cast<long long>(ready_ns - u.manifest().publish_start_unix_ns),
                same ? "exact" : "MISMATCH");
    std::fflush(stdout);
    have = u.version();
  }
  return 0;
}

// ----- trainer -----

// A replica process; it reports each verified version on its stdout.
process::Child SpawnReplica(const std::string& self, const Options& o, int index) {
  process::Child::Options options;
  options.pipe_stdout = true;
  absl::StatusOr<process::Child> child = process::Child::Spawn(
      {self, "--role", "replica", "--index", std::to_string(index), "--checkpoint", o.checkpoint,
       "--uri", o.uri, "--versions", std::to_string(o.versions), "--lr",
       absl::StrFormat("%.17g", o.lr), "--seed", std::to_string(o.seed)},
      options);
  if (!child.ok())
    Die(absl::StrFormat("cannot start replica %d: %s", index, child.status().ToString()));
  return *std::move(child);
}

// Reads lines from `r` until one reports `version` (or an error), up to `deadline`.
// Returns {milliseconds from publish start to verified, exact?}.
std::pair<double, bool> AwaitReport(process::Child& r, uint64_t version, absl::Time deadline,
                                    int index) {
  while (true) {
    bool timed_out = false;
    std::optional<std::string> line = r.ReadLine(deadline, &timed_out);
    if (!line.has_value()) {
      Die(timed_out
              ? absl::StrFormat("replica %d did not report version %d in time", index, version)
              : absl::StrFormat("replica %d exited before reporting version %d", index, version));
    }
    std::vector<std::string> parts = absl::StrSplit(*line, ' ');
    if (!parts.empty() && parts[0] == "ERROR") Die(absl::StrFormat("replica %d: %s", index, *line));
    uint64_t v = 0;
    int64_t ns = 0;
    if (parts.size() == 4 && parts[0] == "READY" && absl::SimpleAtoi(parts[1], &v) &&
        absl::SimpleAtoi(parts[2], &ns) && v == version) {
      return {ns / 1e6, parts[3] == "exact"};
    }
  }
}

// The same checkpoint with every weight rounded to bf16 (what a bf16 conversion stores).
Llama2cCheckpoint RoundedToBf16(Llama2cCheckpoint c) {
  for (std::vector<float>* a : {&c.token_embedding, &c.rms_att, &c.wq, &c.wk, &c.wv, &c.wo,
                                &c.rms_ffn, &c.w1, &c.w2, &c.w3, &c.rms_final, &c.wcls}) {
    for (float& x : *a) x = Bf16ToFloat(FloatToBf16(x));
  }
  return c;
}

// Runs llama2.c's own math on the original arrays and the HF-layout forward pass on the
// converted tensors, for f32 and bf16 conversions. With bf16, the reference gets the same
// bf16-rounded weights, so both sides compute the same function and must agree to float
// rounding: a wrong permutation, name or transpose shows up as a large difference.
bool CheckLogits(const Options& o, const std::string& hf_dir) {
  const Llama2cCheckpoint ckpt = OrDie(ReadLlama2c(o.checkpoint));
  const std::vector<int32_t> tokens = {1,   403, 411, 261, 360, 263, 280, 326,
                                       259, 365, 268, 344, 290, 311, 275, 46};
  std::string config_text;
  {
    FILE* f = std::fopen((hf_dir + "/config.json").c_str(), "r");
    if (f == nullptr) Die("cannot read " + hf_dir + "/config.json");
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) config_text.append(buf, n);
    std::fclose(f);
  }
  HfLlamaConfig config = OrDie(ParseHfLlamaConfig(config_text, hf_dir + "/config.json"));
  bool ok = true;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Logits reference =
        OrDie(Llama2cForward(dtype == DType::kF32 ? ckpt : RoundedToBf16(ckpt), tokens));
    std::vector<OwnedTensor> tensors = OrDie(ConvertToHf(ckpt, dtype));
    Logits hf = OrDie(HfLlamaForward(config, ViewsOf(tensors), tokens));
    LogitsComparison c = OrDie(CompareLogits(reference, hf));
    const bool pass = c.max_abs_diff < 1e-3 && c.argmax_matches == c.positions;
    ok &= pass;
    std::printf("# logits check, %s weights: HF-layout forward vs llama2.c reference: %s  %s\n",
                std::string(DTypeName(dtype)).c_str(), c.ToString().c_str(),
                pass ? "OK" : "FAILED");
  }
  return ok;
}

int RunTrainer(const std::string& self, Options o) {
  const bool own_workdir = o.workdir.empty();
  if (own_workdir) {
    o.workdir = absl::StrFormat("%s/weightbus-demo-%d",
                                std::filesystem::temp_directory_path().string(), getpid());
  }
  if (own_workdir && !o.keep) g_temporary_workdir = o.workdir;
  std::filesystem::remove_all(o.workdir + "/channel");
  std::filesystem::create_directories(o.workdir);
  if (o.uri.empty()) o.uri = "disk://" + o.workdir + "/channel";

  const std::string hf_dir = o.workdir + "/stories260K-hf";
  OrDie(ConvertLlama2c(o.checkpoint, hf_dir, DType::kBF16));
  UpdateStream stream = MakeStream(o);
  uint64_t params = 0;
  for (const OwnedTensor& t : stream.master()) params += t.bytes.size() / 4;
  std::printf("# weightbus main job: %s -> %s\n", o.checkpoint.c_str(), o.uri.c_str());
  std::printf(
      "# converted to %s (Hugging Face Llama, %llu parameters); %d replicas, %llu "
      "versions, Adam lr %.3g, bf16\n",
      hf_dir.c_str(), static_cast<unsigned long long>(params), o.replicas,
      static_cast<unsigned long long>(o.versions), o.lr);
  const bool logits_ok = CheckLogits(o, hf_dir);

  auto pub = OrDie(Publisher::Open(o.uri));
  std::vector<process::Child> replicas;
  for (int i = 0; i < o.replicas; ++i) replicas.push_back(SpawnReplica(self, o, i));

  std::string header = "# version  changed%      bytes  stall_ms";
  for (int i = 0; i < o.replicas; ++i) header += absl::StrFormat("  replica%d_ms", i);
  header += "  last_ms  GB/s  verified";
  std::printf("%s\n", header.c_str());
  std::vector<double> stalls, lasts;
  uint64_t exact = 0, expected_reports = 0;
  std::vector<OwnedTensor> previous;
  for (uint64_t v = 1; v <= o.versions; ++v) {
    if (v > 1) stream.Step();
    std::vector<OwnedTensor> weights = stream.Bf16();
    const double changed = previous.empty() ? 1.0 : ChangedFraction(previous, weights);
    OrDie(
        pub->Publish(v, ViewsOf(weights), {{"step", std::to_string(stream.step())}}, kStepTimeout));
    const PublishStats st = pub->last_stats();
    const absl::Time deadline = absl::Now() + kStepTimeout;
    std::string row = absl::StrFormat("%9d  %7.3f%%  %9d  %8.2f", v, 100 * changed, st.bytes,
                                      absl::ToDoubleMilliseconds(st.stall));
    double last = 0;
    int ok_here = 0;
    for (int i = 0; i < o.replicas; ++i) {
      auto [ms, same] = AwaitReport(replicas[i], v, deadline, i);
      row += absl::StrFormat("  %11.2f", ms);
      last = std::max(last, ms);
      ok_here += same;
    }
    exact += ok_here;
    expected_reports += o.replicas;
    row += absl::StrFormat("  %7.2f  %4.2f  %d/%d", last, st.bytes / 1e9 / (last / 1e3), ok_here,
                           o.replicas);
    std::printf("%s\n", row.c_str());
    std::fflush(stdout);
    stalls.push_back(absl::ToDoubleMilliseconds(st.stall));
    lasts.push_back(last);
    previous = std::move(weights);
  }
  bool replicas_exited = true;
  for (size_t i = 0; i < replicas.size(); ++i) {
    const process::Child::Exit exit = replicas[i].WaitOrKill(absl::Now() + kStepTimeout);
    if (process::ExitCode(exit.status) != 0) {
      std::fprintf(stderr, "weightbus-demo: replica %zu: %s\n", i, exit.Describe().c_str());
      replicas_exited = false;
    }
  }
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x.empty() ? 0.0 : x[x.size() / 2];
  };
  std::printf("# median trainer stall %.2f ms; median time to last replica %.2f ms (max %.2f)\n",
              median(stalls), median(lasts), *std::max_element(lasts.begin(), lasts.end()));
  const bool all_exact = exact == expected_reports && replicas_exited;
  std::printf("# %s: %llu/%llu replica versions bit-exact, logits check %s\n",
              all_exact && logits_ok ? "OK" : "FAILED", static_cast<unsigned long long>(exact),
              static_cast<unsigned long long>(expected_reports), logits_ok ? "passed" : "FAILED");
  if (own_workdir && !o.keep) std::filesystem::remove_all(o.workdir);
  return all_exact && logits_ok ? 0 : 1;
}

}  // namespace
}  // namespace weightbus::tools

int main(int argc, char** argv) {
  using namespace weightbus::tools;
  SetFatalErrorPolicy({"weightbus-demo", 1, KillReplicasAndRemoveWorkdir});
  Options o;
  o.checkpoint = WEIGHTBUS_DEFAULT_CHECKPOINT;
  std::string role = "trainer";
  Command app(
      "weightbus-demo",
      "weightbus-demo: the main job. A trainer converts a llama2.c checkpoint, checks the "
      "conversion with two forward passes, and publishes a sequence of Adam-updated bf16 "
      "versions; replica processes receive each one and check it bit-exact. Exit status 0 only "
      "when the logits check passed and every replica verified every version.");
  app.Add("checkpoint", &o.checkpoint, "llama2.c checkpoint").TypeName("PATH");
  app.Add("uri", &o.uri, "channel (default: disk://<workdir>/channel)").TypeName("URI");
  app.Add("versions", &o.versions,
          "versions to publish (1 to 1000000); version 1 is the converted checkpoint, each later "
          "one follows one Adam step")
      .InRange(1, 1000000);
  app.Add("replicas", &o.replicas, "replica processes (1 to 1000)").InRange(1, 1000);
  app.Add("lr", &o.lr, "Adam learning rate (above 0)").Positive();
  app.Add("seed", &o.seed, "the update stream's random seed");
  app.Add("workdir", &o.workdir,
          "where to convert and keep the channel (default: a temporary directory, removed at the "
          "end unless --keep)")
      .TypeName("DIR");
  app.AddSwitch("keep", &o.keep, "keep the temporary work directory");
  // A replica process, started by the trainer with the trainer's flags.
  app.Add("role", &role, "").OneOf({"trainer", "replica"}).Hidden();
  app.Add("index", &o.index, "").Hidden();
  if (std::optional<int> exit_status = app.Parse(argc, argv)) return *exit_status;
  if (role == "replica") return RunReplica(o);
  signal(SIGPIPE, SIG_IGN);
  return RunTrainer(argv[0][0] == '/' ? argv[0] : std::filesystem::absolute(argv[0]).string(), o);
}
