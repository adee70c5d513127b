// SPDX-License-Identifier: Apache-2.0
// The processes `weightbus-bench run` spawns for each transport (the same executable, run as
// `weightbus-bench __worker publisher|subscriber ...`). They talk to the parent in JSON lines:
//
//   publisher:  stdin "publish N" -> loads version N from the store into its weights buffer (the
//               trainer's parameters, updated in place), publishes it, prints its PublishStats;
//               stdin "quit" (or end of file) -> prints {"done": true, ...} and exits.
//   subscriber: binds its own parameter buffers (a replica), receives versions 1..count in order,
//               prints each one's UpdateStats with "check_pending", then waits for stdin "check"
//               (sent once every replica has reported, so that no check takes a core from a
//               replica still receiving), hashes every tensor with libxxhash, compares it with
//               the store's hash of what was published (independently of the library's
//               checksums) and prints the verdict; after the last, {"done": true, ...}.
//               A TP rank (--tp M) checks its slices right away and prints the verdict with
//               its report (no "check_pending").
//
// Both report the CPU time of the bench's own work in them (loading versions, hashing), which
// the parent subtracts from the process's CPU time.
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "wbbench/common.h"
#include "wbbench/store.h"
#include "wbbench/subcommands.h"
#include "wbbench/tp_layout.h"
#include "weightbus/flags.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::bench {
namespace {

void Emit(const nlohmann::ordered_json& j) {
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

// Page-aligned anonymous memory, touched once (a trainer's or replica's resident parameters).
struct Buffer {
  std::byte* data = nullptr;
  size_t size = 0;
  explicit Buffer(size_t n) : size(std::max<size_t>(n, 1)) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) Die(absl::StrFormat("cannot map %d bytes", size));
    data = static_cast<std::byte*>(p);
    std::memset(data, 0, size);
  }
  ~Buffer() { munmap(data, size); }
};

Options ParseSettings(const std::vector<std::string>& sets) {
  Options options;
  for (const std::string& kv : sets) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) Die("--set takes KEY=VALUE, not " + kv);
    options[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return options;
}

// The flags `weightbus-bench run` gives its workers (run.cc, TransportRun::Start).
struct WorkerFlags {
  std::string role;  // publisher or subscriber
  std::string uri, store;
  absl::Duration timeout = absl::Seconds(120);       // publisher: per version
  absl::Duration wait_timeout = absl::Seconds(120);  // subscriber: per version
  uint64_t count = 1;                                // subscriber: versions to receive
  uint64_t corrupt_version = 0;
  uint64_t parent_pid = 0;
  int tp = 0, tp_rank = 0;  // subscriber: rank tp_rank of a TP group of tp (0: a whole replica)
  std::vector<std::string> settings;
};

int PublisherMain(const WorkerFlags& flags) {
  const std::string& uri = flags.uri;
  const std::string& store = flags.store;
  const absl::Duration timeout = flags.timeout;
  const uint64_t corrupt = flags.corrupt_version;
  StoreIndex index = OrDie(ReadIndex(store));
  const Options settings = ParseSettings(flags.settings);
  // One rank of a publisher group (--publishers N: settings rank and world_size) publishes its
  // shards only (tp_layout.h).
  int rank = 0, world = 1;
  if (auto it = settings.find("rank"); it != settings.end())
    (void)absl::SimpleAtoi(it->second, &rank);
  if (auto it = settings.find("world_size"); it != settings.end()) {
    (void)absl::SimpleAtoi(it->second, &world);
  }
  absl::StatusOr<std::unique_ptr<Publisher>> pub = Publisher::Open(uri, settings);
  if (!pub.ok()) {
    Emit({{"error", std::string(pub.status().message())}});
    return 1;
  }
  // The trainer's weights, in the memory its publisher serves fastest (AllocateHost: on ucx://
  // memory UCX allocated, which a zero-copy publish serves to this host's subscribers through
  // shared memory; elsewhere plain anonymous memory).
  absl::StatusOr<std::unique_ptr<HostMemory>> memory =
      (*pub)->AllocateHost(std::max<uint64_t>(index.file_bytes, 1));
  if (!memory.ok()) {
    Emit({{"error", std::string(memory.status().message())}});
    return 1;
  }
  std::byte* const weights = (*memory)->data();
  const std::vector<TensorView> views = RankViews(index, weights, rank, world);
  Emit({{"ready", true}, {"pid", getpid()}});
  double overhead = 0;
  char line[256];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    std::vector<std::string> words =
        absl::StrSplit(line, absl::ByAnyChar(" \n"), absl::SkipEmpty());
    if (words.empty()) continue;
    if (words[0] == "quit") break;
    uint64_t v = 0;
    if (words[0] != "publish" || words.size() != 2 || !absl::SimpleAtoi(words[1], &v)) {
      Emit({{"error", absl::StrFormat("bad command: %s", line)}});
      return 1;
    }
    // The trainer's step: new weights in place (not timed, not counted as sync CPU).
    const double c0 = SelfCpuSeconds();
    if (absl::Status s = ReadWhole(index.VersionPath(store, v), weights, index.file_bytes);
        !s.ok()) {
      Emit({{"version", v}, {"error", std::string(s.message())}});
      return 1;
    }
    if (v == corrupt && !index.tensors.empty()) {
      // Testing the correctness column: publish bytes that differ from the store's hashes.
      weights[index.tensors.back().offset] ^= std::byte{0x01};
    }
    overhead += SelfCpuSeconds() - c0;
    const int64_t start_ns = absl::ToUnixNanos(absl::Now());
    absl::Status s = (*pub)->Publish(v, views, {{"weightbus-bench", "1"}}, timeout);
    if (!s.ok()) {
      Emit({{"version", v}, {"error", std::string(s.message())}});
      continue;
    }
    const PublishStats st = (*pub)->last_stats();
    Emit({{"version", v},
          {"call_start_unix_ns", start_ns},
          {"stall_s", absl::ToDoubleSeconds(st.stall)},
          {"pack_s", absl::ToDoubleSeconds(st.pack)},
          {"transport_s", absl::ToDoubleSeconds(st.transport)},
          {"checksum_wait_s", absl::ToDoubleSeconds(st.checksum_wait)},
          {"encode_s", absl::ToDoubleSeconds(st.encode)},
          {"bytes", st.bytes},
          {"wire_bytes", st.wire_bytes},
          {"encoding", st.encoding}});
  }
  pub->reset();
  Emit({{"done", true}, {"overhead_cpu_s", overhead}, {"peak_rss_bytes", SelfPeakRssBytes()}});
  return 0;
}

// Reports a receive of version `want` that failed; false when the subscriber is to give up (it
// timed out: the transport did not deliver), true when the next version may be fine.
bool EmitFailure(uint64_t want, int64_t call_ns, const absl::Status& status) {
  Emit({{"version", want},
        {"call_start_unix_ns", call_ns},
        {"ok", false},
        {"timed_out", absl::IsDeadlineExceeded(status)},
        {"error", std::string(status.message())}});
  return !absl::IsDeadlineExceeded(status);
}

// One TP rank of a replica (--tp M): subscribes with placements (tp_layout.h), receives into
// library memory (its slices only) and checks every slice against the same slice read from the
// store's file.
int TpSubscriberMain(const WorkerFlags& flags, const StoreIndex& index) {
  absl::StatusOr<std::unique_ptr<Subscriber>> sub = Subscriber::Open(
      flags.uri, ParseSettings(flags.settings),
      SubscribePlacements{TpRules(index, flags.tp), {flags.tp, flags.tp_rank}, {}});
  if (!sub.ok()) {
    Emit({{"error", std::string(sub.status().message())}});
    return 1;
  }
  Emit({{"ready", true}, {"pid", getpid()}});
  double overhead = 0;
  for (uint64_t want = 1; want <= flags.count; ++want) {
    const int64_t call_ns = absl::ToUnixNanos(absl::Now());
    absl::StatusOr<std::unique_ptr<Update>> u = (*sub)->ReceiveVersion(want, flags.wait_timeout);
    if (!u.ok()) {
      if (!EmitFailure(want, call_ns, u.status())) return 1;
      continue;
    }
    const UpdateStats& st = (*u)->stats();
    nlohmann::ordered_json j = {{"version", (*u)->version()},
                                {"call_start_unix_ns", call_ns},
                                {"publish_start_unix_ns", (*u)->manifest().publish_start_unix_ns},
                                {"ready_unix_ns", st.ready_unix_ns},
                                {"fetch_s", absl::ToDoubleSeconds(st.fetch)},
                                {"bytes", st.bytes},
                                {"slice_bytes", SliceBytes(index, flags.tp)}};
    const double c0 = SelfCpuSeconds();
    std::string bad;
    // What it must read: its slices rounded out to the tiles of the parts they meet.
    const uint64_t expect = ExpectedReadBytes((*u)->manifest(), index, flags.tp_rank, flags.tp);
    j["expect_bytes"] = expect;
    if (st.bytes != expect) {
      bad = absl::StrFormat(
          "TP rank %d read %d bytes, but its slices meet %d bytes of checksum "
          "tiles",
          flags.tp_rank, st.bytes, expect);
    }
    for (const StoredTensor& t : index.tensors) {
      if (!bad.empty()) break;
      const TensorView* v = (*u)->Find(t.name);
      absl::StatusOr<std::vector<std::byte>> want_bytes =
          ReadSlice(index.VersionPath(flags.store, want), t, flags.tp_rank, flags.tp);
      if (!want_bytes.ok()) {
        bad = std::string(want_bytes.status().message());
      } else if (v == nullptr) {
        bad = absl::StrFormat("tensor \"%s\" is missing", t.name);
      } else if (std::memcmp(v->data, want_bytes->data(), want_bytes->size()) != 0) {
        bad = absl::StrFormat("TP rank %d's slice of tensor \"%s\" differs from the store's",
                              flags.tp_rank, t.name);
      }
      if (!bad.empty()) break;
    }
    overhead += SelfCpuSeconds() - c0;
    j["ok"] = bad.empty();
    j["error"] = bad;
    Emit(j);
  }
  Emit({{"done", true}, {"overhead_cpu_s", overhead}, {"peak_rss_bytes", SelfPeakRssBytes()}});
  return 0;
}

int SubscriberMain(const WorkerFlags& flags) {
  const std::string& uri = flags.uri;
  const std::string& store = flags.store;
  // Waiting for the next version may take a whole round of the other transports and the
  // baselines; the parent bounds each of them by --timeout itself.
  const absl::Duration timeout = flags.wait_timeout;
  const uint64_t count = flags.count;
  StoreIndex index = OrDie(ReadIndex(store));
  if (flags.tp > 0) return TpSubscriberMain(flags, index);
  Buffer params(index.file_bytes);
  absl::StatusOr<std::unique_ptr<Subscriber>> sub =
      Subscriber::Open(uri, ParseSettings(flags.settings));
  if (!sub.ok()) {
    Emit({{"error", std::string(sub.status().message())}});
    return 1;
  }
  for (const StoredTensor& t : index.tensors) {
    absl::Status s =
        (*sub)->Bind(t.name, Destination{t.dtype, t.shape, {}, params.data + t.offset, {}});
    if (!s.ok()) {
      Emit({{"error", std::string(s.message())}});
      return 1;
    }
  }
  Emit({{"ready", true}, {"pid", getpid()}});
  double overhead = 0;
  for (uint64_t want = 1; want <= count; ++want) {
    const int64_t call_ns = absl::ToUnixNanos(absl::Now());
    absl::StatusOr<std::unique_ptr<Update>> u = (*sub)->WaitForVersion(want, timeout);
    if (!u.ok()) {
      if (!EmitFailure(want, call_ns, u.status())) return 1;
      continue;  // a bad version: the next one may be fine
    }
    const Update& up = **u;
    const UpdateStats& st = up.stats();
    nlohmann::ordered_json j = {{"version", up.version()},
                                {"call_start_unix_ns", call_ns},
                                {"publish_start_unix_ns", up.manifest().publish_start_unix_ns},
                                {"ready_unix_ns", st.ready_unix_ns},
                                {"wait_s", absl::ToDoubleSeconds(st.wait)},
                                {"allocate_s", absl::ToDoubleSeconds(st.allocate)},
                                {"fetch_s", absl::ToDoubleSeconds(st.fetch)},
                                {"decode_s", absl::ToDoubleSeconds(st.decode)},
                                {"verify_s", absl::ToDoubleSeconds(st.verify_wait)},
                                {"apply_s", absl::ToDoubleSeconds(st.copy_out)},
                                {"bytes", st.bytes},
                                {"wire_bytes", st.wire_bytes},
                                {"check_pending", true}};
    Emit(j);
    // The independent check, once the parent says every replica has reported (so that hashing
    // here does not take a core from replicas still receiving): every tensor of the replica's
    // buffers against the store's hashes.
    char line[64];
    if (std::fgets(line, sizeof(line), stdin) == nullptr) return 1;  // the bench is gone
    const double c0 = SelfCpuSeconds();
    std::string bad;
    if (up.version() != want) {
      bad = absl::StrFormat("received version %d while waiting for %d", up.version(), want);
    } else if (want > index.xxh3.size()) {
      bad = absl::StrFormat("version %d is not in the store", want);
    } else {
      for (size_t i = 0; i < index.tensors.size() && bad.empty(); ++i) {
        const StoredTensor& t = index.tensors[i];
        const uint64_t h = Hash(params.data + t.offset, t.nbytes);
        if (h != index.xxh3[want - 1][i]) {
          bad = absl::StrFormat(
              "tensor \"%s\" differs from what was published (XXH3 %016x, "
              "expected %016x)",
              t.name, h, index.xxh3[want - 1][i]);
        }
      }
    }
    overhead += SelfCpuSeconds() - c0;
    Emit({{"version", up.version()}, {"ok", bad.empty()}, {"error", bad}});
    want = std::max(want, up.version());
  }
  Emit({{"done", true}, {"overhead_cpu_s", overhead}, {"peak_rss_bytes", SelfPeakRssBytes()}});
  return 0;
}

int RunWorker(const WorkerFlags& flags) {
  // A worker never outlives the bench: killed with it, even by SIGKILL.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (flags.parent_pid != 0 && getppid() != static_cast<pid_t>(flags.parent_pid)) return 1;
  return flags.role == "publisher" ? PublisherMain(flags) : SubscriberMain(flags);
}

}  // namespace

Subcommand AddWorkerCommand(tools::Command& command) {
  auto flags = std::make_shared<WorkerFlags>();
  command.AddPositional("ROLE", &flags->role, "publisher or subscriber")
      .Required()
      .OneOf({"publisher", "subscriber"});
  command.Add("uri", &flags->uri, "the channel");
  command.Add("store", &flags->store, "the pre-generated versions");
  command.AddDuration("timeout-s", &flags->timeout, "publisher: per version");
  command.AddDuration("wait-timeout-s", &flags->wait_timeout, "subscriber: per version");
  command.Add("count", &flags->count, "subscriber: versions to receive");
  command.Add("corrupt-version", &flags->corrupt_version,
              "publisher: flip one bit of this version");
  command.Add("parent-pid", &flags->parent_pid, "exit at once unless this is the parent");
  command.Add("tp", &flags->tp, "subscriber: one rank of a TP group of this size (0: none)");
  command.Add("tp-rank", &flags->tp_rank, "subscriber: its rank in the TP group");
  command.AddRepeated("set", &flags->settings, "a channel setting (repeatable)");
  return [flags](const std::vector<std::string>&) { return RunWorker(*flags); };
}

}  // namespace weightbus::bench
