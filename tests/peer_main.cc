// SPDX-License-Identifier: Apache-2.0
// wb_test_peer: a publisher or subscriber process for multi-process tests.
//   wb_test_peer publish URI --versions N [--start S] [--seed X] [--bytes B] [--interval-ms M]
//                [--until-subscribers K] [--serve-ms M] [--timeout-s T] [--set K=V]...
// A publisher keeps serving after its last version until K subscribers received it
// (Publisher::WaitForReceivers) and then for M more milliseconds (transports such as ucx://
// serve versions from the publisher's process).
//   wb_test_peer subscribe URI --until N [--seed X] [--bytes B] [--timeout-s T] [--set K=V]...
// The subscriber regenerates each version it receives (test_model.h) and compares bytes, so
// delivery is checked independently of the library's own checksums. Prints one line per version.
//   wb_test_peer receive URI [--seed X] [--bytes B] [--timeout-s T] [--set K=V]...
// A worker of a tensor-parallel group: reads version numbers from stdin, one per line, receives
// exactly each (Subscriber::ReceiveVersion), checks its bytes as subscribe does and answers
// "received V ok", or "notfound V: MESSAGE" when the channel no longer holds V; ends at EOF.
//   wb_test_peer publish-llama URI --layout rows|cols [--versions N] [--start S] [--timeout-s T]
//                [--steps 1] [--set rank=R --set world_size=W]...
// One rank of a publisher group publishing its slices of the stories260K fixture (converted to
// Hugging Face Llama, F32), `versions` times with the same bytes: `rows` shards every matrix on
// dimension 0 (FSDP2), `cols` on dimension 1 (Megatron column slices, published as strided
// views of the whole matrix) with model.embed_tokens.weight owned whole by the last rank; norm
// vectors are replicated (every rank publishes them whole). With --steps 1 each version is
// that version's training step of the fixture (model_steps.h) instead of the same bytes.
//   wb_test_peer serve URI [--seed X] [--bytes B] [--timeout-s T] [--set K=V]...
// A publisher driven through stdin (the fault-injection suite, tests/fault/): prints "open" once
// the channel is open ("open hwm_kb=H"), then publishes each version number read from stdin, one
// per line, and answers "published V ms=M hwm_kb=H" or "failed V ms=M CODE: MESSAGE" (M: the wall
// time of the Publish call, in milliseconds; a failure does not end it); ends at EOF. Under a
// layer the published line ends with " encoding=" and the layer's choice (PublishStats::encoding).
//   wb_test_peer follow URI --until N [--seed X] [--bytes B] [--timeout-s T] [--set K=V]...
// A subscriber that outlives faults: as subscribe, but a wait that fails prints
// "error ms=M CODE: MESSAGE" and it waits again; each version prints
// "received V ok ms=M hwm_kb=H" (M: the wall time of the wait that returned it, H: this process's
// peak resident set, VmHWM; under a layer followed by " encoding=" and UpdateStats::encoding); a
// version whose bytes differ prints "mismatch V: WHY", one going backwards "backwards V after W",
// and it ends with 3. Ends with 0 once it holds N or above. Exit codes: 0 all good, 1 error, 3
// content mismatch or a version going backwards.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "model_steps.h"
#include "test_model.h"
#include "test_support.h"
#include "weightbus/llama2c.h"
#include "weightbus/weightbus.hpp"

namespace {

struct Flags {
  std::string role, uri;
  std::string layout = "rows";
  uint64_t versions = 1, start = 1, seed = 1, bytes = 1 << 16, until = 1;
  int interval_ms = 0;
  int steps = 0;  // publish-llama: version v is StepLlama(fixture, v)
  int drift = 0;  // publish, serve, subscribe, follow: versions of MakeDriftVersion
  int until_subscribers = 0;
  int first_subscribers = 0;  // after the first version: wait until this many hold it
  int serve_ms = 0;
  double timeout_s = 30;
  weightbus::Options options;
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  if (argc < 3) return false;
  f->role = argv[1];
  f->uri = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    bool ok = true;
    if (k == "--versions")
      ok = absl::SimpleAtoi(v, &f->versions);
    else if (k == "--start")
      ok = absl::SimpleAtoi(v, &f->start);
    else if (k == "--seed")
      ok = absl::SimpleAtoi(v, &f->seed);
    else if (k == "--bytes")
      ok = absl::SimpleAtoi(v, &f->bytes);
    else if (k == "--until")
      ok = absl::SimpleAtoi(v, &f->until);
    else if (k == "--steps")
      ok = absl::SimpleAtoi(v, &f->steps);
    else if (k == "--drift")
      ok = absl::SimpleAtoi(v, &f->drift);
    else if (k == "--interval-ms")
      ok = absl::SimpleAtoi(v, &f->interval_ms);
    else if (k == "--until-subscribers")
      ok = absl::SimpleAtoi(v, &f->until_subscribers);
    else if (k == "--first-subscribers")
      ok = absl::SimpleAtoi(v, &f->first_subscribers);
    else if (k == "--serve-ms")
      ok = absl::SimpleAtoi(v, &f->serve_ms);
    else if (k == "--layout")
      f->layout = v;
    else if (k == "--timeout-s")
      ok = absl::SimpleAtod(v, &f->timeout_s);
    else if (k == "--set") {
      size_t eq = v.find('=');
      if (eq == std::string::npos) return false;
      f->options[v.substr(0, eq)] = v.substr(eq + 1);
    } else {
      return false;
    }
    if (!ok) return false;
  }
  return true;
}

// Opens a publisher or subscriber (`Handle`) on the channel, or says why not ("open: ...") on
// stderr and returns nullptr.
template <typename Handle>
std::unique_ptr<Handle> Open(const Flags& f) {
  auto h = Handle::Open(f.uri, f.options);
  if (!h.ok()) {
    std::fprintf(stderr, "open: %s\n", h.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(h);
}

// Version `v`'s tensors: MakeVersion, or with --drift 1 MakeDriftVersion (each version a few
// changed bytes away from the one before, as training steps are: what the delta layer sends as
// deltas).
std::vector<weightbus::testing::OwnedTensor> Content(const Flags& f, uint64_t v) {
  return f.drift ? weightbus::testing::MakeDriftVersion(f.seed, v, f.bytes)
                 : weightbus::testing::MakeVersion(f.seed, v, f.bytes);
}

// Publishes version `v` and prints "published V", or prints why not and returns false.
bool PublishOne(weightbus::Publisher& pub, uint64_t v,
                absl::Span<const weightbus::TensorView> views, const weightbus::Metadata& metadata,
                const Flags& f) {
  absl::Status s = pub.Publish(v, views, metadata, absl::Seconds(f.timeout_s));
  if (!s.ok()) {
    std::fprintf(stderr, "publish %llu: %s\n", static_cast<unsigned long long>(v),
                 s.ToString().c_str());
    return false;
  }
  std::printf("published %llu\n", static_cast<unsigned long long>(v));
  std::fflush(stdout);
  return true;
}

// After the last version: with --until-subscribers, waits until that many subscribers verified
// it (a transport that serves from the publisher's memory, such as ucx, serves until then);
// with --serve-ms, serves that long. Returns the exit code.
int ServeUntilDone(weightbus::Publisher& pub, const Flags& f) {
  if (f.until_subscribers > 0) {
    const uint64_t last = f.start + f.versions - 1;
    absl::Status s = pub.WaitForReceivers(last, f.until_subscribers, absl::Seconds(f.timeout_s));
    if (!s.ok()) {
      std::fprintf(stderr, "wait for %d subscribers: %s\n", f.until_subscribers,
                   s.ToString().c_str());
      return 1;
    }
    std::printf("%d subscribers have %llu\n", f.until_subscribers,
                static_cast<unsigned long long>(last));
    std::fflush(stdout);
  }
  if (f.serve_ms > 0) absl::SleepFor(absl::Milliseconds(f.serve_ms));
  return 0;
}

int Publish(const Flags& f) {
  auto pub = Open<weightbus::Publisher>(f);
  if (pub == nullptr) return 1;
  for (uint64_t v = f.start; v < f.start + f.versions; ++v) {
    auto tensors = Content(f, v);
    if (!PublishOne(*pub, v, weightbus::testing::Views(tensors), {{"peer", "test"}}, f)) {
      return 1;
    }
    if (v == f.start && f.first_subscribers > 0) {
      // Every subscriber is in before the rest: none of them can miss versions by starting late.
      absl::Status s = pub->WaitForReceivers(v, f.first_subscribers, absl::Seconds(f.timeout_s));
      if (!s.ok()) {
        std::fprintf(stderr, "wait for %d subscribers of the first version: %s\n",
                     f.first_subscribers, s.ToString().c_str());
        return 1;
      }
    }
    if (f.interval_ms > 0) absl::SleepFor(absl::Milliseconds(f.interval_ms));
  }
  return ServeUntilDone(*pub, f);
}

int PublishLlama(const Flags& f) {
  auto ckpt = weightbus::tools::ReadLlama2c(weightbus::testing::FixturePath("stories260K.bin"));
  if (!ckpt.ok()) {
    std::fprintf(stderr, "fixture: %s\n", ckpt.status().ToString().c_str());
    return 1;
  }
  auto model = weightbus::tools::ConvertToHf(*ckpt, weightbus::DType::kF32);
  if (!model.ok()) {
    std::fprintf(stderr, "convert: %s\n", model.status().ToString().c_str());
    return 1;
  }
  int rank = 0, world = 1;
  if (auto it = f.options.find("rank"); it != f.options.end())
    (void)absl::SimpleAtoi(it->second, &rank);
  if (auto it = f.options.find("world_size"); it != f.options.end()) {
    (void)absl::SimpleAtoi(it->second, &world);
  }
  const bool cols = f.layout == "cols";
  std::vector<weightbus::TensorView> views;
  for (const weightbus::tools::OwnedTensor& t : *model) {
    weightbus::TensorView v = t.view();
    if (t.shape.size() == 2) {
      if (cols && t.name == "model.embed_tokens.weight") {
        if (rank != world - 1) continue;  // owned whole by one rank
      } else {
        const size_t d = cols ? 1 : 0;
        const int64_t n = t.shape[d] / world;
        if (t.shape[d] % world != 0) {
          std::fprintf(stderr, "%s: dimension %zu of %lld does not split %d ways\n", t.name.c_str(),
                       d, static_cast<long long>(t.shape[d]), world);
          return 1;
        }
        weightbus::Shard shard{t.shape, {0, 0}};
        shard.offsets[d] = n * rank;
        v.shape[d] = n;
        if (cols) {
          v.strides = {t.shape[1], 1};
          v.data = t.bytes.data() + n * rank * 4;
        } else {
          v.data = t.bytes.data() + n * rank * t.shape[1] * 4;
        }
        v.shard = shard;
      }
    }
    views.push_back(std::move(v));
  }
  auto pub = Open<weightbus::Publisher>(f);
  if (pub == nullptr) return 1;
  const std::vector<weightbus::tools::OwnedTensor> fixture = *model;
  for (uint64_t v = f.start; v < f.start + f.versions; ++v) {
    if (f.steps != 0) {
      // In place: the views point into these bytes.
      for (size_t t = 0; t < model->size(); ++t) {
        std::memcpy((*model)[t].bytes.data(), fixture[t].bytes.data(), fixture[t].bytes.size());
      }
      weightbus::testing::StepLlama(*model, v);
    }
    if (!PublishOne(*pub, v, views, {{"step", std::to_string(v)}}, f)) return 1;
  }
  return ServeUntilDone(*pub, f);
}

// "" when `u` holds exactly the tensors of its version (test_model.h), byte for byte; which
// tensor differs otherwise.
std::string DiffersFromExpected(const Flags& f, const weightbus::Update& u) {
  const uint64_t v = u.version();
  auto expected = Content(f, v);
  if (u.tensors().size() != expected.size()) {
    return absl::StrFormat("version %d has %d tensors, expected %d", v, u.tensors().size(),
                           expected.size());
  }
  for (const auto& e : expected) {
    const weightbus::TensorView* got = u.Find(e.name);
    if (got == nullptr || got->dtype != e.dtype || got->shape != e.shape ||
        (!e.bytes.empty() && std::memcmp(got->data, e.bytes.data(), e.bytes.size()) != 0)) {
      return absl::StrFormat("version %d: tensor %s differs", v, e.name);
    }
  }
  return "";
}

// Whether `u` holds exactly the tensors of its version; says which tensor differs otherwise.
bool SameAsExpected(const Flags& f, const weightbus::Update& u) {
  const std::string why = DiffersFromExpected(f, u);
  if (!why.empty()) std::fprintf(stderr, "%s\n", why.c_str());
  return why.empty();
}

int Subscribe(const Flags& f) {
  auto sub = Open<weightbus::Subscriber>(f);
  if (sub == nullptr) return 1;
  uint64_t last = 0;
  while (last < f.until) {
    auto u = sub->WaitForVersion(last + 1, absl::Seconds(f.timeout_s));
    if (!u.ok()) {
      std::fprintf(stderr, "wait for > %llu: %s\n", static_cast<unsigned long long>(last),
                   u.status().ToString().c_str());
      return 1;
    }
    const uint64_t v = (*u)->version();
    if (v <= last) {
      std::fprintf(stderr, "version went from %llu to %llu\n",
                   static_cast<unsigned long long>(last), static_cast<unsigned long long>(v));
      return 3;
    }
    if (!SameAsExpected(f, **u)) return 3;
    std::printf("received %llu ok\n", static_cast<unsigned long long>(v));
    std::fflush(stdout);
    last = v;
  }
  return 0;
}

// The next version number on stdin, one per line; nullopt at EOF, or after saying on stderr
// that a line is not a number (then `*malformed`).
std::optional<uint64_t> NextVersionLine(bool* malformed) {
  char line[64];
  if (std::fgets(line, sizeof(line), stdin) == nullptr) return std::nullopt;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &v)) {
    std::fprintf(stderr, "not a version: %s\n", line);
    *malformed = true;
    return std::nullopt;
  }
  return v;
}

int Receive(const Flags& f) {
  auto sub = Open<weightbus::Subscriber>(f);
  if (sub == nullptr) return 1;
  bool malformed = false;
  while (std::optional<uint64_t> next = NextVersionLine(&malformed)) {
    const uint64_t v = *next;
    auto u = sub->ReceiveVersion(v, absl::Seconds(f.timeout_s));
    if (absl::IsNotFound(u.status())) {
      std::printf("notfound %llu: %s\n", static_cast<unsigned long long>(v),
                  std::string(u.status().message()).c_str());
    } else if (!u.ok()) {
      std::fprintf(stderr, "receive %llu: %s\n", static_cast<unsigned long long>(v),
                   u.status().ToString().c_str());
      return 1;
    } else if ((*u)->version() != v || !SameAsExpected(f, **u)) {
      std::fprintf(stderr, "asked for version %llu, got version %llu\n",
                   static_cast<unsigned long long>(v),
                   static_cast<unsigned long long>((*u)->version()));
      return 3;
    } else {
      std::printf("received %llu ok\n", static_cast<unsigned long long>(v));
    }
    std::fflush(stdout);
  }
  return malformed ? 1 : 0;
}

// This process's peak resident set (VmHWM of /proc/self/status) in KiB, -1 if unreadable.
int64_t PeakRssKib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    int64_t kib = -1;
    if (absl::StartsWith(line, "VmHWM:") &&
        absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(line.substr(6)), " kB"),
                         &kib)) {
      return kib;
    }
  }
  return -1;
}

int64_t MillisSince(absl::Time start) { return absl::ToInt64Milliseconds(absl::Now() - start); }

void PrintLine(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

int Serve(const Flags& f) {
  auto pub = Open<weightbus::Publisher>(f);
  if (pub == nullptr) return 1;
  PrintLine(absl::StrFormat("open hwm_kb=%d", PeakRssKib()));
  bool malformed = false;
  while (std::optional<uint64_t> next = NextVersionLine(&malformed)) {
    const uint64_t v = *next;
    auto tensors = Content(f, v);
    const absl::Time start = absl::Now();
    const absl::Status s = pub->Publish(v, weightbus::testing::Views(tensors), {{"peer", "serve"}},
                                        absl::Seconds(f.timeout_s));
    const int64_t ms = MillisSince(start);
    // A layer's choice comes last, after every numbered field ("encoding=keyframe: ...").
    const std::string encoding = s.ok() ? pub->last_stats().encoding : "";
    PrintLine(s.ok() ? absl::StrFormat("published %d ms=%d hwm_kb=%d%s", v, ms, PeakRssKib(),
                                       encoding.empty() ? "" : " encoding=" + encoding)
                     : absl::StrFormat("failed %d ms=%d %s", v, ms, s.ToString()));
  }
  return malformed ? 1 : 0;
}

int Follow(const Flags& f) {
  auto sub = Open<weightbus::Subscriber>(f);
  if (sub == nullptr) return 1;
  uint64_t last = 0;
  while (last < f.until) {
    const absl::Time start = absl::Now();
    auto u = sub->WaitForVersion(last + 1, absl::Seconds(f.timeout_s));
    const int64_t ms = MillisSince(start);
    if (!u.ok()) {
      PrintLine(absl::StrFormat("error ms=%d %s", ms, u.status().ToString()));
      continue;
    }
    const uint64_t v = (*u)->version();
    if (v <= last) {
      PrintLine(absl::StrFormat("backwards %d after %d", v, last));
      return 3;
    }
    if (const std::string why = DiffersFromExpected(f, **u); !why.empty()) {
      PrintLine(absl::StrFormat("mismatch %d: %s", v, why));
      return 3;
    }
    const std::string& encoding = (*u)->stats().encoding;
    PrintLine(absl::StrFormat("received %d ok ms=%d hwm_kb=%d%s", v, ms, PeakRssKib(),
                              encoding.empty() ? "" : " encoding=" + encoding));
    last = v;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  if (!ParseFlags(argc, argv, &f)) {
    std::fprintf(
        stderr,
        "usage: wb_test_peer publish|publish-llama|subscribe|receive|serve|follow URI [flags]\n");
    return 2;
  }
  if (f.role == "publish") return Publish(f);
  if (f.role == "publish-llama") return PublishLlama(f);
  if (f.role == "subscribe") return Subscribe(f);
  if (f.role == "receive") return Receive(f);
  if (f.role == "serve") return Serve(f);
  if (f.role == "follow") return Follow(f);
  return 2;
}
