// SPDX-License-Identifier: Apache-2.0
// weightbus-delta-bench: the delta codec on realistic bf16 update streams (BENCHMARKS.md,
// "delta"), against zstd run in the same process on the same bytes.
//
// Streams (each at learning rates 1e-6, 3e-6 and 1e-5 by default):
//   stories  the real stories260K checkpoint (../shared/fixtures) converted to float32 and
//            trained with real gradients (bench/real_grad_stream.py: torch, Adam 0.9/0.95, a
//            next-token loss on the license texts of the machine), cast to bf16 after each step
//   qwen     a synthetic model with Qwen2.5-0.5B's 290 tensors (494M parameters), initialised
//            like the real one, with Adam on Gaussian-noise-plus-signal gradients
//            (tools/weightbus/update_stream.h), cast to bf16 after each step
//
// Per step: the fraction of unchanged bf16 elements, the entropy floors (docs/PERFORMANCE.md),
// the encoded delta's size as bits per element and as a ratio of the full bf16 bytes, the same
// with magnitude groups off, `zstd -1` and `zstd -3` (the CLI, one thread) of the plain XOR of the
// two versions, and encode and decode rates of one core (bytes of model / CPU seconds of the
// encoding thread). Per stream and rate: the keyframe (and zstd of the full weights), the
// average with a keyframe every --keyframe-interval versions. For stories, the whole stream also
// goes through delta+disk:// to a subscriber, bit-exact, counting the bytes written.
//
//   weightbus-delta-bench [--streams stories,qwen] [--lrs 1e-6,3e-6,1e-5] [--stories-steps N]
//       [--qwen-steps N] [--scale F] [--keyframe-interval K] [--chunk-size BYTES]
//       [--zstd-level L] [--groups G] [--work DIR] [--python PATH] [--no-zstd-cli] [--json FILE]
//       (--help: every flag with its default)
//
// Output follows nccl-tests: '#' lines, a table per stream and rate, and a final "# OK" or
// "# FAILED: ..." line that compares the figures with the targets of the delta issue.
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "delta/codec.h"
#include "nlohmann/json.hpp"
#include "process/process.h"
#include "weightbus/checkpoint.h"
#include "weightbus/fatal.h"
#include "weightbus/flags.h"
#include "weightbus/llama2c.h"
#include "weightbus/llama_forward.h"
#include "weightbus/synthetic_model.h"
#include "weightbus/update_stream.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::tools {
namespace {

namespace codec = ::weightbus::internal::delta;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// CPU time of the calling thread: the measure of "per core" rates, immune to other processes
// sharing the machine (it still counts their cache effects).
double ThreadSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Runs a shell command and returns its combined output; dies on failure.
std::string Shell(const std::string& cmd) { return OrDie(weightbus::process::RunShell(cmd)); }

uint64_t Bytes(const std::vector<OwnedTensor>& v) {
  uint64_t n = 0;
  for (const OwnedTensor& t : v) n += t.bytes.size();
  return n;
}

// zstd (the CLI, one thread) of the concatenated tensors, or of their XOR with `base`.
struct ZstdSizes {
  uint64_t level1 = 0, level3 = 0;
};
ZstdSizes ZstdCli(const std::vector<OwnedTensor>& v, const std::vector<OwnedTensor>* base,
                  const std::string& dir) {
  const std::string path = absl::StrFormat("%s/zstd-input-%d.bin", dir, getpid());
  {
    std::ofstream f(path, std::ios::binary);
    std::vector<std::byte> x;
    for (size_t t = 0; t < v.size(); ++t) {
      const std::vector<std::byte>& b = v[t].bytes;
      if (base == nullptr) {
        f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
        continue;
      }
      x.resize(b.size());
      for (size_t i = 0; i < b.size(); ++i) x[i] = b[i] ^ (*base)[t].bytes[i];
      f.write(reinterpret_cast<const char*>(x.data()), static_cast<std::streamsize>(x.size()));
    }
  }
  ZstdSizes z;
  for (int level : {1, 3}) {
    uint64_t size = 0;
    const std::string out = Shell(absl::StrFormat("zstd -q -%d -T1 -c %s | wc -c", level, path));
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(out), &size)) Die("zstd output: " + out);
    (level == 1 ? z.level1 : z.level3) = size;
  }
  std::filesystem::remove(path);
  return z;
}

struct Timed {
  codec::EncodedVersion encoded;
  double encode_s = 0, decode_s = 0;  // CPU seconds, best of the repetitions
  bool exact = false;
};

// Encodes `cur` (a keyframe when prev is null, else a delta against prev) and decodes it into
// separate buffers, on one thread, `reps` times; keeps the best times.
Timed EncodeDecode(const std::vector<OwnedTensor>* prev, const std::vector<OwnedTensor>& cur,
                   const codec::EncodeOptions& options, int reps, codec::Parallel& one,
                   std::vector<std::vector<std::byte>>& out) {
  std::vector<codec::TensorLayout> layout;
  std::vector<const std::byte*> base, target;
  out.resize(cur.size());
  std::vector<std::byte*> outs;
  for (size_t i = 0; i < cur.size(); ++i) {
    layout.push_back({cur[i].dtype, cur[i].bytes.size()});
    target.push_back(cur[i].bytes.data());
    if (prev != nullptr) base.push_back((*prev)[i].bytes.data());
    out[i].resize(cur[i].bytes.size());
    outs.push_back(out[i].data());
  }
  const codec::VersionIds ids{prev == nullptr, 2, prev == nullptr ? 0u : 1u,
                              prev == nullptr ? 2u : 1u};
  Timed t;
  t.encode_s = t.decode_s = 1e300;
  for (int r = 0; r < reps; ++r) {
    const double e0 = ThreadSeconds();
    t.encoded = OrDie(codec::EncodeVersion(ids, layout, base, target, options, one));
    const double e1 = ThreadSeconds();
    OrDie(codec::DecodeVersion(t.encoded.bytes, ids, layout, base, outs, one, nullptr));
    const double e2 = ThreadSeconds();
    t.encode_s = std::min(t.encode_s, e1 - e0);
    t.decode_s = std::min(t.decode_s, e2 - e1);
  }
  t.exact = true;
  for (size_t i = 0; i < cur.size(); ++i) t.exact &= out[i] == cur[i].bytes;
  return t;
}

struct StepRow {
  int step = 0;
  StepStatistics stats;
  uint64_t bytes = 0, plain_bytes = 0;  // plain_bytes: with the other method (modeled/sparse)
  double enc_gbs = 0, dec_gbs = 0, other_enc_gbs = 0, other_dec_gbs = 0;
  ZstdSizes xor_zstd;
  bool exact = false;
};

struct Block {
  std::string stream, description;
  double lr = 0;
  uint64_t raw = 0, elements = 0;
  uint64_t keyframe_bytes = 0;
  double keyframe_enc_gbs = 0, keyframe_dec_gbs = 0;
  bool keyframe_exact = false;
  ZstdSizes full_zstd;
  std::vector<StepRow> steps;
  std::string method_note;
  // Summary
  double median_ratio = 0, min_ratio = 0, late_ratio = 0, vs_change_floor = 0, vs_value_floor = 0,
         averaged_ratio = 0, enc_gbs = 0, dec_gbs = 0, plain_ratio = 0, other_enc_gbs = 0,
         other_dec_gbs = 0;
  // The stream average with a keyframe every 50 and 200 versions, and on demand: keyframes only
  // when needed (keyframe_interval=0), one per delta_max_chain deltas in a steady stream.
  double averaged_50 = 0, averaged_200 = 0, averaged_on_demand = 0;
};

// The default delta_max_chain: with keyframes on demand, a steady stream has one keyframe per
// this many deltas plus one.
constexpr int kMaxChain = 1000;

double Ratio(uint64_t raw, uint64_t bytes) { return bytes == 0 ? 0 : double(raw) / double(bytes); }

// "1.283x", or "-" for a figure not measured (--no-zstd-cli).
std::string RatioText(uint64_t raw, uint64_t bytes) {
  return bytes == 0 ? std::string("-") : absl::StrFormat("%.3fx", Ratio(raw, bytes));
}

// Runs one stream at one rate: `next(k)` fills version k (0 = the starting point).
template <typename Next>
Block RunBlock(const std::string& stream, const std::string& description, double lr, int steps,
               Next&& next, const codec::EncodeOptions& options, int keyframe_interval,
               bool zstd_cli, const std::string& dir, bool sample_zstd) {
  auto one = OrDie(codec::Parallel::Create(1));
  Block b;
  b.stream = stream;
  b.description = description;
  b.lr = lr;
  std::vector<OwnedTensor> prev, cur;
  next(0, &prev);
  b.raw = Bytes(prev);
  for (const OwnedTensor& t : prev) b.elements += t.bytes.size() / DTypeSize(t.dtype);
  std::vector<std::vector<std::byte>> out;
  const int reps = b.raw < (uint64_t{64} << 20) ? 5 : 2;
  {
    Timed kf = EncodeDecode(nullptr, prev, options, reps, *one, out);
    b.keyframe_bytes = kf.encoded.bytes.size();
    b.keyframe_enc_gbs = b.raw / 1e9 / kf.encode_s;
    b.keyframe_dec_gbs = b.raw / 1e9 / kf.decode_s;
    b.keyframe_exact = kf.exact;
    if (zstd_cli) b.full_zstd = ZstdCli(prev, nullptr, dir);
  }
  std::printf("#\n# %s, lr %g: %s; %llu bf16 elements, %llu bytes; %d steps\n", stream.c_str(), lr,
              description.c_str(), static_cast<unsigned long long>(b.elements),
              static_cast<unsigned long long>(b.raw), steps);
  // The other side of the size/speed trade-off: the sparse method (zstd planes) when the context
  // model is on, else the context model.
  const std::string other_groups = options.context_model ? "sparse" : "modeled";
  std::printf("# %4s %10s %14s %8s %8s %9s %9s %9s %9s %8s %8s %6s\n", "step", "unchanged",
              "floor: values", "changes", "ours", "ours/", "ratio", other_groups.c_str(),
              "XOR zstd", "enc", "dec", "exact");
  std::printf("# %4s %10s %14s %8s %8s %9s %9s %9s %9s %8s %8s %6s\n", "", "(%)", "(bits/el)",
              "(bits/el)", "(bits/el)", "floor", "(x)", "(x)", "-1/-3 (x)", "(GB/s)", "(GB/s)", "");
  const std::string full_zstd = b.full_zstd.level1 == 0
                                    ? std::string("-")
                                    : absl::StrFormat("%.3f/%.3f", Ratio(b.raw, b.full_zstd.level1),
                                                      Ratio(b.raw, b.full_zstd.level3));
  std::printf("  %4s %10s %14s %8s %8.4f %9s %9.3f %9s %9s %8.2f %8.2f %6s\n", "key", "-", "-", "-",
              8.0 * b.keyframe_bytes / b.elements, "-", Ratio(b.raw, b.keyframe_bytes), "-",
              full_zstd.c_str(), b.keyframe_enc_gbs, b.keyframe_dec_gbs,
              b.keyframe_exact ? "yes" : "NO");
  // The other side of the trade-off, for the "other" column.
  codec::EncodeOptions plain = options;
  plain.context_model = !options.context_model;
  std::vector<std::vector<std::byte>> scratch;
  for (int k = 1; k <= steps; ++k) {
    next(k, &cur);
    StepRow row;
    row.step = k;
    row.stats = CompareVersions(prev, cur);
    Timed t = EncodeDecode(&prev, cur, options, reps, *one, out);
    row.bytes = t.encoded.bytes.size();
    row.enc_gbs = b.raw / 1e9 / t.encode_s;
    row.dec_gbs = b.raw / 1e9 / t.decode_s;
    row.exact = t.exact;
    {
      Timed other = EncodeDecode(&prev, cur, plain, reps, *one, scratch);
      row.plain_bytes = other.encoded.bytes.size();
      row.other_enc_gbs = b.raw / 1e9 / other.encode_s;
      row.other_dec_gbs = b.raw / 1e9 / other.decode_s;
    }
    if (zstd_cli && (!sample_zstd || k == 1 || k == steps || k == (steps + 1) / 2)) {
      row.xor_zstd = ZstdCli(cur, &prev, dir);
    }
    if (k == steps) {
      // Which method wins, with every method tried on every chunk.
      codec::EncodeOptions all = options;
      all.try_all_methods = true;
      codec::EncodedVersion e = EncodeDecode(&prev, cur, all, 1, *one, scratch).encoded;
      int sparse_wins = 0, both = 0, modeled_wins = 0, modeled_both = 0;
      double lo = 1e300, hi = 0, mlo = 1e300, mhi = 0;
      for (const codec::ChunkResult& r : e.results) {
        if (r.sparse_bytes != 0 && r.modeled_bytes != 0) {
          ++modeled_both;
          modeled_wins += r.modeled_bytes <= r.sparse_bytes;
          mlo = std::min(mlo, double(r.sparse_bytes) / r.modeled_bytes);
          mhi = std::max(mhi, double(r.sparse_bytes) / r.modeled_bytes);
        }
        if (r.sparse_bytes == 0 || r.xor_bytes == 0) continue;
        ++both;
        sparse_wins += r.sparse_bytes <= r.xor_bytes;
        lo = std::min(lo, double(r.xor_bytes) / r.sparse_bytes);
        hi = std::max(hi, double(r.xor_bytes) / r.sparse_bytes);
      }
      b.method_note = absl::StrFormat(
          "method choice at step %d (every method tried): sparse smaller than XOR in %d of %d "
          "chunks; XOR/sparse size %.2fx..%.2fx; modeled smaller than sparse in %d of %d chunks, "
          "sparse/modeled size %.2fx..%.2fx",
          k, sparse_wins, both, both ? lo : 0, hi, modeled_wins, modeled_both,
          modeled_both ? mlo : 0, mhi);
    }
    const double ours = 8.0 * row.bytes / b.elements;
    const std::string zstd_text =
        row.xor_zstd.level1 == 0 ? std::string("-")
                                 : absl::StrFormat("%.0f/%.0f", Ratio(b.raw, row.xor_zstd.level1),
                                                   Ratio(b.raw, row.xor_zstd.level3));
    std::printf("  %4d %9.3f%% %14.4f %8.4f %8.4f %9.3f %9.1f %9.1f %9s %8.2f %8.2f %6s\n", k,
                100.0 * (1 - row.stats.changed_fraction()), row.stats.floor_bits(),
                row.stats.change_floor_bits(), ours,
                row.stats.change_floor_bits() > 0 ? ours / row.stats.change_floor_bits() : 0,
                Ratio(b.raw, row.bytes), Ratio(b.raw, row.plain_bytes), zstd_text.c_str(),
                row.enc_gbs, row.dec_gbs, row.exact ? "yes" : "NO");
    std::fflush(stdout);
    b.steps.push_back(row);
    std::swap(prev, cur);
  }
  std::vector<double> ratios, late, vs_change, vs_value, enc, dec, plain_ratios, other_enc,
      other_dec;
  double delta_bytes = 0;
  for (const StepRow& r : b.steps) {
    ratios.push_back(Ratio(b.raw, r.bytes));
    plain_ratios.push_back(Ratio(b.raw, r.plain_bytes));
    if (r.step > steps / 2) late.push_back(Ratio(b.raw, r.bytes));
    const double ours = 8.0 * r.bytes / b.elements;
    vs_change.push_back(ours / r.stats.change_floor_bits());
    vs_value.push_back(ours / r.stats.floor_bits());
    enc.push_back(r.enc_gbs);
    dec.push_back(r.dec_gbs);
    other_enc.push_back(r.other_enc_gbs);
    other_dec.push_back(r.other_dec_gbs);
    delta_bytes += r.bytes;
  }
  b.median_ratio = Median(ratios);
  b.min_ratio = *std::min_element(ratios.begin(), ratios.end());
  b.late_ratio = Median(late);
  b.plain_ratio = Median(plain_ratios);
  b.vs_change_floor = Median(vs_change);
  b.vs_value_floor = Median(vs_value);
  b.enc_gbs = Median(enc);
  b.dec_gbs = Median(dec);
  b.other_enc_gbs = Median(other_enc);
  b.other_dec_gbs = Median(other_dec);
  // One keyframe and K - 1 deltas of the measured mean size per K versions.
  const double mean_delta = delta_bytes / b.steps.size();
  auto averaged = [&](int interval) {
    const double k = std::max(1, interval);
    return k * b.raw / (b.keyframe_bytes + (k - 1) * mean_delta);
  };
  b.averaged_ratio = averaged(keyframe_interval == 0 ? kMaxChain + 1 : keyframe_interval);
  b.averaged_50 = averaged(50);
  b.averaged_200 = averaged(200);
  b.averaged_on_demand = averaged(kMaxChain + 1);
  std::printf("# %s\n", b.method_note.c_str());
  std::printf(
      "# summary: per-step ratio median %.1fx (min %.1fx, second half %.1fx; with %s "
      "%.1fx, encoded at %.2f and decoded at %.2f GB/s); ours / floor: %.3f of the change "
      "floor, %.3f of the value floor (medians)\n",
      b.median_ratio, b.min_ratio, b.late_ratio, other_groups.c_str(), b.plain_ratio,
      b.other_enc_gbs, b.other_dec_gbs, b.vs_change_floor, b.vs_value_floor);
  std::printf(
      "# summary: keyframe %.3fx (zstd -1 %s, -3 %s of the same bytes); with a "
      "keyframe every %d versions %.1fx on average; one core encodes deltas at %.2f "
      "GB/s and decodes them at %.2f GB/s (keyframes %.2f / %.2f GB/s)\n",
      Ratio(b.raw, b.keyframe_bytes), RatioText(b.raw, b.full_zstd.level1).c_str(),
      RatioText(b.raw, b.full_zstd.level3).c_str(), keyframe_interval, b.averaged_ratio, b.enc_gbs,
      b.dec_gbs, b.keyframe_enc_gbs, b.keyframe_dec_gbs);
  std::printf(
      "# summary: stream average, keyframes included: every 50 versions %.1fx, every 200 %.1fx, "
      "on demand (keyframe_interval=0: one keyframe per delta_max_chain=%d deltas) %.1fx\n",
      b.averaged_50, b.averaged_200, kMaxChain, b.averaged_on_demand);
  return b;
}

std::vector<OwnedTensor> LoadBf16(const std::string& path) {
  Checkpoint ckpt = OrDie(LoadCheckpoint(path));
  std::vector<OwnedTensor> out;
  for (const TensorView& v : ckpt.tensors) {
    OwnedTensor t{v.name, v.dtype, v.shape, {}};
    const uint64_t n = OrDie(ByteSize(v.dtype, v.shape));
    const std::byte* p = static_cast<const std::byte*>(v.data);
    t.bytes.assign(p, p + n);
    out.push_back(std::move(t));
  }
  return out;
}

// The stories stream at `lr`: generated by bench/real_grad_stream.py once, then reused.
std::string StoriesStream(const std::string& work, const std::string& python,
                          const std::string& f32_dir, double lr, int steps, uint64_t seed) {
  const std::string dir = absl::StrFormat("%s/stories-lr%g-steps%d-seed%d", work, lr, steps, seed);
  if (std::filesystem::exists(dir + "/stream.json")) return dir;
  const std::string cmd = absl::StrFormat(
      "%s %s/real_grad_stream.py --model %s --out %s --lr %g --steps %d --seed %d --batch 8 "
      "--seq-len 128 > %s/generator.log",
      python, WEIGHTBUS_BENCH_DIR, f32_dir, dir, lr, steps, seed, work);
  std::filesystem::create_directories(dir);
  if (std::system(cmd.c_str()) != 0) {
    Die("the real-gradient stream generator failed: " + cmd + " (see " + work + "/generator.log)");
  }
  return dir;
}

// The torch forward pass of the generator against weightbus's HF-layout reference.
std::string CheckGeneratorForward(const std::string& f32_dir, const std::string& stream_dir,
                                  double* max_abs_diff) {
  std::ifstream cfg_file(f32_dir + "/config.json");
  std::stringstream cfg;
  cfg << cfg_file.rdbuf();
  HfLlamaConfig config = OrDie(ParseHfLlamaConfig(cfg.str(), f32_dir + "/config.json"));
  Checkpoint ckpt = OrDie(LoadCheckpoint(f32_dir));
  std::ifstream tf(stream_dir + "/check_tokens.i32", std::ios::binary);
  std::vector<int32_t> tokens(32);
  tf.read(reinterpret_cast<char*>(tokens.data()), 32 * 4);
  Logits ours = OrDie(HfLlamaForward(config, ckpt.tensors, tokens));
  Logits theirs = ours;
  std::ifstream lf(stream_dir + "/check_logits.f32", std::ios::binary);
  lf.read(reinterpret_cast<char*>(theirs.values.data()),
          static_cast<std::streamsize>(theirs.values.size() * 4));
  if (!tf || !lf) Die("cannot read the generator's check files in " + stream_dir);
  LogitsComparison c = OrDie(CompareLogits(ours, theirs));
  *max_abs_diff = c.max_abs_diff;
  return c.ToString();
}

// The whole stories stream through delta+disk:// to a subscriber: bit-exact, and the bytes the
// disk transport wrote per version (data file, and manifest with the delta record).
std::string EndToEnd(const std::string& work, const std::string& stream_dir, int steps,
                     int keyframe_interval, const codec::EncodeOptions& options, bool* exact) {
  const std::string channel = work + "/e2e-channel";
  std::filesystem::remove_all(channel);
  const std::string uri = absl::StrFormat(
      "delta+disk://%s?fsync=false&keyframe_interval=%d&delta_groups=%d&delta_chunk_size=%d&"
      "delta_zstd_level=%d&delta_model=%s",
      channel, keyframe_interval, options.max_groups, options.chunk_size, options.zstd_level,
      options.context_model ? "context" : "sparse");
  auto pub = OrDie(Publisher::Open(uri));
  auto sub = OrDie(Subscriber::Open(uri));
  uint64_t data = 0, manifest = 0, raw = 0, plain_manifest = 0;
  int ok = 0;
  for (int k = 0; k <= steps; ++k) {
    std::vector<OwnedTensor> v = LoadBf16(absl::StrFormat("%s/v%05d.safetensors", stream_dir, k));
    std::vector<TensorView> views;
    for (const OwnedTensor& t : v) views.push_back(t.view());
    OrDie(pub->Publish(k + 1, views, {{"step", std::to_string(k)}}, absl::Seconds(60)));
    auto update = OrDie(sub->WaitForVersion(k + 1, absl::Seconds(60)));
    bool same = update->version() == static_cast<uint64_t>(k + 1);
    for (size_t i = 0; i < v.size() && same; ++i) {
      same = std::memcmp(update->tensors()[i].data, v[i].bytes.data(), v[i].bytes.size()) == 0;
    }
    ok += same;
    const std::string vdir = absl::StrFormat("%s/versions/v%020d", channel, k + 1);
    if (k > 0) {
      data += std::filesystem::file_size(vdir + "/model.safetensors");
      manifest += std::filesystem::file_size(vdir + "/weightbus.manifest.json");
      raw += Bytes(v);
      Manifest m = update->manifest();
      plain_manifest += m.ToJson().size();
    }
  }
  pub.reset();
  sub.reset();
  std::filesystem::remove_all(channel);
  *exact = ok == steps + 1;
  const double n = steps;
  return absl::StrFormat(
      "delta+disk:// end to end, %d versions (keyframe every %d): %d/%d received bit-exact; per "
      "version after the first, %.0f bytes of safetensors data file (the encoded blob in a "
      "one-tensor safetensors file; %.1fx less than the %.0f raw bytes) and a %.0f-byte "
      "manifest with the delta record (a plain disk:// manifest of these tensors: %.0f bytes)",
      steps + 1, keyframe_interval, ok, steps + 1, data / n, raw / data, raw / n, manifest / n,
      plain_manifest / n);
}

int Main(int argc, char** argv) {
  SetFatalErrorPolicy({"weightbus-delta-bench", 1, nullptr});
  std::vector<std::string> streams = {"stories", "qwen"};
  std::vector<double> lrs = {1e-6, 3e-6, 1e-5};
  int stories_steps = 40, qwen_steps = 30, keyframe_interval = 0;
  double scale = 1.0;
  uint64_t seed = 1;
  codec::EncodeOptions options;
  std::string python = "/usr/bin/python3";
  bool no_zstd_cli = false;
  std::string work = (std::filesystem::temp_directory_path() / "wb-delta-bench").string();
  std::string json;
  Command app(
      "weightbus-delta-bench",
      "weightbus-delta-bench: the delta codec on realistic bf16 update streams (stories260K with "
      "real gradients, a synthetic Qwen2.5-0.5B with Adam), against zstd on the same bytes. "
      "Output follows nccl-tests and ends with \"# OK\" or \"# FAILED: ...\".");
  app.AddList("streams", &streams, "update streams to run")
      .OneOf({"stories", "qwen"})
      .TypeName("NAME,...")
      .DefaultText("stories,qwen");
  app.AddList("lrs", &lrs, "Adam learning rates, one stream each")
      .Positive()
      .TypeName("LR,...")
      .DefaultText("1e-6,3e-6,1e-5");
  app.Add("stories-steps", &stories_steps, "training steps of the stories stream")
      .InRange(1, 1000000);
  app.Add("qwen-steps", &qwen_steps, "steps of the qwen stream").InRange(1, 1000000);
  app.Add("scale", &scale, "scale the qwen model's tensors by this factor").Positive();
  app.Add("keyframe-interval", &keyframe_interval,
          "a keyframe every K versions in the end-to-end run and the average of the table (0: on "
          "demand, the default of keyframe_interval)")
      .InRange(0, 1000000);
  app.AddSize("chunk-size", &options.chunk_size, "the codec's chunk");
  app.Add("zstd-level", &options.zstd_level,
          "0: the codec's own zstd configuration; 1..22: that zstd level")
      .InRange(0, 22);
  app.Add("groups", &options.max_groups, "most magnitude groups of the sparse method (1..4)")
      .InRange(1, 4);
  bool sparse = false;
  app.AddSwitch("sparse", &sparse,
                "code deltas with the sparse method (delta_model=sparse) instead of the context "
                "model (the default)");
  int format_version = codec::kFormatVersion;
  app.Add("format-version", &format_version,
          "encoded format version to write: 3 codes the context model with rANS (modeled-rans), "
          "2 with the binary range coder of format version 2 (modeled)")
      .InRange(2, static_cast<int>(codec::kFormatVersion));
  app.Add("seed", &seed, "the update streams' random seed");
  app.Add("work", &work, "scratch directory").TypeName("DIR");
  app.Add("python", &python, "interpreter with torch for the stories stream").TypeName("PATH");
  app.AddSwitch("no-zstd-cli", &no_zstd_cli, "leave the zstd CLI baseline out");
  app.Add("json", &json, "write every figure to this file").TypeName("FILE");
  if (std::optional<int> exit_status = app.Parse(argc, argv)) return *exit_status;
  const bool zstd_cli = !no_zstd_cli;
  options.context_model = !sparse;
  options.format_version = static_cast<uint8_t>(format_version);
  std::filesystem::create_directories(work);
  const std::string shm = std::filesystem::exists("/dev/shm") ? "/dev/shm" : work;

  utsname u;
  uname(&u);
  std::printf("# weightbus-delta-bench (weightbus %s); kernel %s; %u cores\n",
              std::string(LibraryVersion()).c_str(), u.release,
              std::thread::hardware_concurrency());
  std::printf(
      "# codec: %s, format version %d, chunk %llu bytes, zstd level %d%s, at most %d magnitude "
      "groups; rates "
      "are one core's: model bytes / CPU seconds of the one thread that encodes or "
      "decodes (best of 5 runs for stories, 2 for qwen)\n",
      options.context_model ? "delta_model=context" : "delta_model=sparse", format_version,
      static_cast<unsigned long long>(options.chunk_size), options.zstd_level,
      options.zstd_level == 0 ? " (entropy mode)" : "", options.max_groups);
  std::printf(
      "# floors (bits per element, zero-order): values = H(p) + p H(new values of the "
      "changed elements), changes = H(p) + p H(new - old); ours = encoded bits per "
      "element; ratio = bf16 bytes / encoded bytes\n");

  std::vector<Block> blocks;
  std::vector<std::string> failures;
  std::string forward_check, e2e;
  for (const std::string& stream : streams) {
    if (stream == "stories") {
      const std::string f32 = work + "/stories260K-f32";
      if (!std::filesystem::exists(f32 + "/model.safetensors")) {
        OrDie(ConvertLlama2c(WEIGHTBUS_STORIES_FILE, f32, DType::kF32));
      }
      for (double lr : lrs) {
        const std::string dir = StoriesStream(work, python, f32, lr, stories_steps, seed);
        if (forward_check.empty()) {
          double diff = 0;
          forward_check = CheckGeneratorForward(f32, dir, &diff);
          std::printf(
              "# stories generator: its torch forward pass vs weightbus's HF-layout "
              "reference (tools/weightbus/llama_forward.h), float32 weights, first "
              "sequence: %s\n",
              forward_check.c_str());
          if (diff > 1e-3) failures.push_back("torch forward of the stories generator disagrees");
        }
        std::ifstream sj(dir + "/stream.json");
        nlohmann::json meta = nlohmann::json::parse(sj);
        const auto& loss = meta["loss"];
        const std::string description = absl::StrFormat(
            "stories260K, real gradients (torch %s, batch 8 x 128 byte tokens of %d license "
            "texts, loss %.3f -> %.3f)",
            meta["torch"].get<std::string>(), meta["text"].size(), loss.front().get<double>(),
            loss.back().get<double>());
        blocks.push_back(RunBlock(
            "stories", description, lr, stories_steps,
            [&](int k, std::vector<OwnedTensor>* out) {
              *out = LoadBf16(absl::StrFormat("%s/v%05d.safetensors", dir, k));
            },
            options, keyframe_interval, zstd_cli, shm, /*sample_zstd=*/false));
        if (lr == lrs.front()) {
          bool exact = false;
          e2e = EndToEnd(work, dir, stories_steps, keyframe_interval, options, &exact);
          std::printf("# %s\n", e2e.c_str());
          if (!exact) failures.push_back("delta+disk end-to-end run not bit-exact");
        }
      }
    } else if (stream == "qwen") {
      const std::vector<ShapeSpec> shapes =
          ScaleShapes(OrDie(ReadShapes(WEIGHTBUS_SHAPES_FILE)), scale);
      for (double lr : lrs) {
        std::unique_ptr<UpdateStream> s;
        {
          std::vector<OwnedTensor> master = OrDie(MakeSyntheticModel(
              shapes, DType::kF32, seed, static_cast<int>(std::thread::hardware_concurrency())));
          AdamOptions adam;
          adam.lr = lr;
          adam.seed = seed;
          s = std::make_unique<UpdateStream>(OrDie(UpdateStream::Create(std::move(master), adam)));
        }
        const std::string description = absl::StrFormat(
            "synthetic Qwen2.5-0.5B shapes x%g (290 tensors, N(0, 0.02), norms 1, biases 0), Adam "
            "on Gaussian noise + persistent signal (snr 0.1)",
            scale);
        blocks.push_back(RunBlock(
            "qwen", description, lr, qwen_steps,
            [&](int k, std::vector<OwnedTensor>* out) {
              if (k > 0) s->Step();
              s->Bf16Into(out);
            },
            options, keyframe_interval, zstd_cli, shm, /*sample_zstd=*/true));
      }
    } else {
      Die("unknown stream \"" + stream + "\" (stories, qwen)");
    }
  }

  // Overall table and the targets.
  std::printf("#\n# %-8s %7s %10s %8s %8s %9s %9s %9s %9s %9s\n", "stream", "lr", "per-step", "min",
              "ours/", "keyframe", "avg w/ kf", "zstd -3", "enc", "dec");
  std::printf("# %-8s %7s %10s %8s %8s %9s %9s %9s %9s %9s\n", "", "", "median(x)", "(x)", "floor",
              "(x)", "(x)", "XOR (x)", "(GB/s)", "(GB/s)");
  for (const Block& b : blocks) {
    std::vector<double> z3;
    for (const StepRow& r : b.steps) {
      if (r.xor_zstd.level3 > 0) z3.push_back(Ratio(b.raw, r.xor_zstd.level3));
    }
    std::printf("  %-8s %7g %10.1f %8.1f %8.3f %9.3f %9.1f %9.1f %9.2f %9.2f\n", b.stream.c_str(),
                b.lr, b.median_ratio, b.min_ratio, b.vs_change_floor,
                Ratio(b.raw, b.keyframe_bytes), b.averaged_ratio, Median(z3), b.enc_gbs, b.dec_gbs);
    bool all_exact = b.keyframe_exact;
    for (const StepRow& r : b.steps) all_exact &= r.exact;
    if (!all_exact) failures.push_back(b.stream + ": not bit-exact");
    if (Ratio(b.raw, b.keyframe_bytes) < 1.45) {
      failures.push_back(
          absl::StrFormat("%s keyframe %.3fx < 1.45x", b.stream, Ratio(b.raw, b.keyframe_bytes)));
    }
    // Issue 16: what users pay over a run, on the real-gradient stream.
    if (b.stream == "stories" && b.lr == 1e-6 && b.averaged_on_demand < 200) {
      failures.push_back(
          absl::StrFormat("stories lr 1e-6: stream average %.1fx < 200x", b.averaged_on_demand));
    }
    if (b.stream == "stories" && b.lr == 1e-5 && b.averaged_on_demand < 50) {
      failures.push_back(
          absl::StrFormat("stories lr 1e-5: stream average %.1fx < 50x", b.averaged_on_demand));
    }
    if (b.lr == 1e-6) {
      if (b.median_ratio < 100) {
        failures.push_back(
            absl::StrFormat("%s lr 1e-6: per-step ratio %.1fx < 100x", b.stream, b.median_ratio));
      }
      if (b.vs_change_floor > 1.2) {
        failures.push_back(absl::StrFormat("%s lr 1e-6: %.2fx the entropy floor > 1.2x", b.stream,
                                           b.vs_change_floor));
      }
      if (b.enc_gbs < 2) {
        failures.push_back(
            absl::StrFormat("%s lr 1e-6: encode %.2f GB/s < 2", b.stream, b.enc_gbs));
      }
      if (b.dec_gbs < 4) {
        failures.push_back(
            absl::StrFormat("%s lr 1e-6: decode %.2f GB/s < 4", b.stream, b.dec_gbs));
      }
    }
  }
  if (const std::string* path = json.empty() ? nullptr : &json) {
    nlohmann::ordered_json j;
    j["chunk_size"] = options.chunk_size;
    j["zstd_level"] = options.zstd_level;
    j["groups"] = options.max_groups;
    j["delta_model"] = options.context_model ? "context" : "sparse";
    j["other_method"] = options.context_model ? "sparse" : "context";
    j["keyframe_interval"] = keyframe_interval;
    j["forward_check"] = forward_check;
    j["end_to_end"] = e2e;
    for (const Block& b : blocks) {
      nlohmann::ordered_json jb;
      jb["stream"] = b.stream;
      jb["lr"] = b.lr;
      jb["description"] = b.description;
      jb["raw_bytes"] = b.raw;
      jb["keyframe_bytes"] = b.keyframe_bytes;
      jb["keyframe_zstd1"] = b.full_zstd.level1;
      jb["keyframe_zstd3"] = b.full_zstd.level3;
      jb["keyframe_encode_gbs"] = b.keyframe_enc_gbs;
      jb["keyframe_decode_gbs"] = b.keyframe_dec_gbs;
      jb["averaged_ratio"] = b.averaged_ratio;
      jb["averaged_ratio_interval_50"] = b.averaged_50;
      jb["averaged_ratio_interval_200"] = b.averaged_200;
      jb["averaged_ratio_on_demand"] = b.averaged_on_demand;
      jb["method_choice"] = b.method_note;
      for (const StepRow& r : b.steps) {
        jb["steps"].push_back({{"step", r.step},
                               {"changed", r.stats.changed},
                               {"elements", r.stats.elements},
                               {"floor_values_bits", r.stats.floor_bits()},
                               {"floor_changes_bits", r.stats.change_floor_bits()},
                               {"bytes", r.bytes},
                               {"bytes_other_method", r.plain_bytes},
                               {"other_encode_gbs", r.other_enc_gbs},
                               {"other_decode_gbs", r.other_dec_gbs},
                               {"xor_zstd1", r.xor_zstd.level1},
                               {"xor_zstd3", r.xor_zstd.level3},
                               {"encode_gbs", r.enc_gbs},
                               {"decode_gbs", r.dec_gbs},
                               {"exact", r.exact}});
      }
      j["blocks"].push_back(std::move(jb));
    }
    std::ofstream(*path) << j.dump(1) << "\n";
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
