// SPDX-License-Identifier: Apache-2.0
// Replay driver for the delta decoder's fuzz target, for compilers without libFuzzer (and for
// CTest).
//
//   delta_fuzz_replay [--mutations=N] [--write-seeds=DIR] [--regressions=DIR] [PATH...]
//
// Builds seeds from real encoded blobs: chunk records of every method (same, stored, planes,
// xor, sparse) for every dtype, grouped sparse records with 2, 3 and 4 magnitude groups, in one
// to four spans and in place, and whole encoded versions (keyframes and deltas, one to four
// tensors of mixed dtypes, several chunk sizes), plus crafted hostile records (a sparse group
// claiming more changes than its record). It checks that the seeds cover every method and group
// count, runs LLVMFuzzerTestOneInput on each seed, on every file given (a directory stands for
// the regular files directly inside it) and on N deterministic mutations (fixed seed) of each:
// bit flips, byte substitutions, truncations, insertions, deletions and varint-sized bumps. A
// violated invariant aborts; the signal handler names the input and saves it as
// ./delta-fuzz-crash.bin. --write-seeds=DIR writes the seeds to DIR (a libFuzzer corpus).
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "delta_fuzz.h"
#include "replay.h"

namespace {

namespace fs = std::filesystem;
using weightbus::DType;
using weightbus::kAllDTypes;
using namespace weightbus::internal::delta;
using weightbus::delta_fuzz::FuzzTensor;

size_t g_runs = 0;

void Run(const std::string& name, const std::string& bytes) {
  weightbus::fuzz::ReplayOne(name, bytes);
  ++g_runs;
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "delta_fuzz_replay: %s\n", what.c_str());
  std::exit(1);
}

uint8_t IndexOf(DType dtype) {
  for (size_t i = 0; i < kAllDTypes.size(); ++i) {
    if (kAllDTypes[i] == dtype) return static_cast<uint8_t>(i);
  }
  Fail("dtype not in kAllDTypes");
}

size_t Width(DType dtype) { return std::max<size_t>(1, weightbus::DTypeSize(dtype)); }

bool IsFloat(DType d) {
  return d == DType::kF16 || d == DType::kBF16 || d == DType::kF32 || d == DType::kF64;
}

// The magnitude class the sparse method groups floats by: the top byte of the value rotated
// left by one bit.
uint8_t ClassOf(const std::byte* p, size_t w) {
  uint64_t x = 0;
  std::memcpy(&x, p, w);
  const int bits = static_cast<int>(8 * w);
  const uint64_t mask = bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
  const uint64_t rot = ((x << 1) | (x >> (bits - 1))) & mask;
  return static_cast<uint8_t>(rot >> (bits - 8));
}

enum class Pattern {
  kSame,      // target == base
  kConstant,  // keyframe of a constant: planes of constants
  kRandom,    // keyframe of random bytes: stored
  kFew,       // a few changes: sparse
  kAll,       // every element replaced by random bits: xor
  kSmall,     // changes denser in the smaller magnitude classes: grouped sparse (floats)
  kGraded,    // the same with four bands
};

std::vector<std::byte> Target(const std::vector<std::byte>& base, DType dtype, Pattern p,
                              std::mt19937_64& rng) {
  const size_t w = Width(dtype);
  std::vector<std::byte> t = base;
  switch (p) {
    case Pattern::kSame:
      break;
    case Pattern::kConstant:
      for (size_t i = 0; i < t.size(); ++i) t[i] = std::byte{static_cast<uint8_t>(i % w)};
      break;
    case Pattern::kRandom:
    case Pattern::kAll:
      for (std::byte& b : t) b = static_cast<std::byte>(rng());
      break;
    case Pattern::kFew:
      for (size_t i = 0; i < t.size() / w; i += 37) t[i * w] ^= std::byte{1};
      break;
    case Pattern::kSmall:   // three bands of change density by magnitude class
    case Pattern::kGraded:  // four bands
      for (size_t i = 0; i < t.size() / w; ++i) {
        const uint8_t c = ClassOf(&t[i * w], w);
        const int band = p == Pattern::kSmall ? c / 86 : c / 64;
        static constexpr int kSmallPercent[3] = {90, 25, 0};
        static constexpr int kGradedPercent[4] = {95, 50, 10, 0};
        const int percent = p == Pattern::kSmall ? kSmallPercent[band] : kGradedPercent[band];
        if (static_cast<int>(rng() % 100) < percent) t[i * w] ^= std::byte{1};
      }
      break;
  }
  return t;
}

std::vector<std::pair<std::string, std::string>> Seeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  std::map<Method, int> methods;
  // Hostile records first, while the decoder's scratch buffers are still empty (as in a fresh
  // subscriber), so that overflowing them overflows the heap: a sparse group claiming 2^14
  // changes in a record of 1 (issue 10, item 15), and a second group claiming more than the
  // first left.
  {
    const std::vector<std::byte> r = {
        std::byte{4},    std::byte{1}, std::byte{1},    std::byte{0x80}, std::byte{0x80},
        std::byte{0x01}, std::byte{1}, std::byte{0x80}, std::byte{0x80}, std::byte{0x01},
        std::byte{0},    std::byte{0}, std::byte{0},    std::byte{1}};
    seeds.emplace_back(
        "hostile: group claims 16384 of 1",
        weightbus::delta_fuzz::ChunkInput(IndexOf(DType::kU8), false, 1, false, 1, 16384, r));
    std::vector<std::byte> r2;
    for (int b : {4,    2,    2, 100,                     // sparse, 2 changes, 2 groups, threshold
                  1,    1,    1, 1,    5,    0, 0, 0, 0,  // group 0: 1 change at rank 5
                  0x80, 0x40, 1, 0x80, 0x40, 0, 0,        // group 1: 8192 changes, gaps 0
                  0,    0,    0, 0}) {
      r2.push_back(static_cast<std::byte>(b));
    }
    seeds.emplace_back(
        "hostile: second group claims 8192 of 1",
        weightbus::delta_fuzz::ChunkInput(IndexOf(DType::kBF16), false, 1, false, 2, 16384, r2));
  }
  std::set<int> groups;
  std::mt19937_64 rng(10);
  const std::vector<std::pair<Pattern, bool>> patterns = {
      {Pattern::kSame, false},   {Pattern::kConstant, true}, {Pattern::kRandom, true},
      {Pattern::kFew, false},    {Pattern::kAll, false},     {Pattern::kSmall, false},
      {Pattern::kGraded, false}, {Pattern::kConstant, false}};
  for (DType dtype : kAllDTypes) {
    for (const auto& [pattern, keyframe] : patterns) {
      // 0: the context model (modeled-rans records); -1: the context model in format version 2
      // (modeled records).
      for (int max_groups : {-1, 0, 1, 2, 3, 4}) {
        if (max_groups > 1 &&
            (!IsFloat(dtype) || (pattern != Pattern::kSmall && pattern != Pattern::kGraded))) {
          continue;
        }
        for (int spans : {1, 3}) {
          const bool in_place = spans == 3 && !keyframe;
          const uint64_t chunk = spans == 1 ? 65536 : 4096 + 192;
          const uint8_t seed = static_cast<uint8_t>(seeds.size());
          const std::vector<std::byte> base = weightbus::delta_fuzz::Base(chunk, seed, 0);
          const std::vector<std::byte> target = Target(base, dtype, pattern, rng);
          std::vector<ChunkInput> inputs;
          uint64_t at = 0;
          for (uint64_t piece : weightbus::delta_fuzz::SpanSizes(chunk, spans)) {
            inputs.push_back(
                ChunkInput{keyframe ? nullptr : base.data() + at, target.data() + at, piece});
            at += piece;
          }
          EncodeOptions options;
          options.context_model = max_groups <= 0;
          options.format_version = max_groups < 0 ? 2 : kFormatVersion;
          options.max_groups = std::max(max_groups, 1);
          std::vector<std::byte> record;
          const ChunkResult r = EncodeChunk(dtype, inputs, keyframe, options, &record);
          ++methods[r.method];
          if (r.method == Method::kSparse) {
            // [method][count varint][groups]
            size_t g = 1;
            while (static_cast<uint8_t>(record[g]) & 0x80) ++g;
            groups.insert(static_cast<uint8_t>(record[g + 1]));
          }
          seeds.emplace_back(
              absl::StrFormat("chunk %s %s%s groups<=%d spans=%d method=%s",
                              weightbus::DTypeName(dtype), keyframe ? "keyframe " : "",
                              std::to_string(static_cast<int>(pattern)), max_groups, spans,
                              MethodName(r.method)),
              weightbus::delta_fuzz::ChunkInput(IndexOf(dtype), keyframe, spans, in_place, seed,
                                                chunk, record));
        }
      }
    }
  }
  for (Method m : {Method::kSame, Method::kStored, Method::kPlanes, Method::kXor, Method::kSparse,
                   Method::kModeled, Method::kModeledRans}) {
    if (methods[m] == 0) Fail(absl::StrFormat("no seed uses method %s", MethodName(m)));
  }
  for (int g : {1, 2, 3, 4}) {
    if (groups.count(g) == 0) Fail(absl::StrFormat("no sparse seed has %d groups", g));
  }

  // Whole versions: keyframes and deltas of mixed layouts, several chunk sizes.
  const std::vector<std::vector<FuzzTensor>> layouts = {
      {{IndexOf(DType::kBF16), 3000}},
      {{IndexOf(DType::kF32), 700}, {IndexOf(DType::kU8), 100}, {IndexOf(DType::kBF16), 1500}},
      {{IndexOf(DType::kI64), 64},
       {IndexOf(DType::kBool), 0},
       {IndexOf(DType::kF16), 2048},
       {IndexOf(DType::kBF16), 5000}},
  };
  auto parallel = Parallel::Create(1);
  if (!parallel.ok()) Fail(std::string(parallel.status().message()));
  for (size_t l = 0; l < layouts.size(); ++l) {
    const std::vector<TensorLayout> layout = weightbus::delta_fuzz::LayoutOf(layouts[l]);
    for (uint64_t chunk : {64, 1024, 65536}) {
      for (int max_groups : {-1, 0, 1, 4}) {  // 0: the context model; -1: in format version 2
        const uint8_t seed = static_cast<uint8_t>(l * 7 + chunk % 251);
        std::vector<std::vector<std::byte>> base, target;
        std::vector<const std::byte*> bp, tp;
        for (size_t t = 0; t < layout.size(); ++t) {
          base.push_back(weightbus::delta_fuzz::Base(layout[t].nbytes, seed, t));
          target.push_back(Target(base.back(), layout[t].dtype,
                                  t % 2 == 0 ? Pattern::kSmall : Pattern::kFew, rng));
        }
        for (size_t t = 0; t < layout.size(); ++t) {
          bp.push_back(base[t].data());
          tp.push_back(target[t].data());
        }
        EncodeOptions options;
        options.chunk_size = chunk;
        options.context_model = max_groups <= 0;
        options.format_version = max_groups < 0 ? 2 : kFormatVersion;
        options.max_groups = std::max(max_groups, 1);
        for (bool keyframe : {true, false}) {
          const VersionIds ids{keyframe, 7, keyframe ? 0u : 6u, keyframe ? 7u : 3u};
          auto e = EncodeVersion(ids, layout, bp, tp, options, **parallel);
          if (!e.ok()) Fail(std::string(e.status().message()));
          seeds.emplace_back(absl::StrFormat("version layout=%d chunk=%d groups<=%d %s", l, chunk,
                                             max_groups, keyframe ? "keyframe" : "delta"),
                             weightbus::delta_fuzz::VersionInput(layouts[l], seed, e->bytes));
        }
      }
    }
  }

  return seeds;
}

std::string Mutate(const std::string& in, std::mt19937_64& rng) {
  std::string s = in;
  if (s.empty()) return s;
  // Mutations concentrate on the first bytes of the record or header, where counts and sizes
  // live, but reach anywhere.
  auto pos = [&] {
    if (rng() % 2 == 0) return static_cast<size_t>(rng() % std::min<size_t>(s.size(), 48));
    return static_cast<size_t>(rng() % s.size());
  };
  const int edits = 1 + static_cast<int>(rng() % 3);
  for (int k = 0; k < edits && !s.empty(); ++k) {
    switch (rng() % 7) {
      case 0:
        s[pos()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:
        s[pos()] = static_cast<char>(rng());
        break;
      case 2:
        s.resize(rng() % s.size());
        break;
      case 3:
        s.insert(pos(), 1, static_cast<char>(rng()));
        break;
      case 4:
        s.erase(pos(), 1 + rng() % 4);
        break;
      case 5: {  // a varint-sized bump: a byte that continues into the next
        const size_t p = pos();
        s[p] = static_cast<char>(0x80 | (rng() & 0x7f));
        break;
      }
      default: {
        const char special[] = {0, 1, 2, 4, 0x7f, static_cast<char>(0x80), static_cast<char>(0xff)};
        s[pos()] = special[rng() % sizeof(special)];
        break;
      }
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  weightbus::fuzz::InstallReplayCrashHandler("delta_fuzz_replay", "delta-fuzz-crash.bin");
  size_t mutations = 200;
  std::string write_seeds;
  std::vector<std::pair<std::string, bool>> paths;  // path, optional
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--mutations=", 0) == 0) {
      mutations = std::stoul(a.substr(12));
    } else if (a.rfind("--write-seeds=", 0) == 0) {
      write_seeds = a.substr(14);
    } else if (a.rfind("--regressions=", 0) == 0) {
      paths.emplace_back(a.substr(14), true);
    } else {
      paths.emplace_back(a, false);
    }
  }
  std::vector<std::pair<std::string, std::string>> inputs = Seeds();
  const size_t seeds = inputs.size();
  if (!write_seeds.empty()) {
    fs::create_directories(write_seeds);
    for (size_t i = 0; i < seeds; ++i) {
      std::ofstream(fs::path(write_seeds) / absl::StrFormat("seed-%04d", i), std::ios::binary)
          << inputs[i].second;
    }
  }
  for (const auto& [path, optional] : paths) {
    if (!weightbus::fuzz::ReadInputs(path, optional, "delta_fuzz_replay", &inputs)) return 2;
  }
  std::mt19937_64 rng(2026);
  for (const auto& [name, bytes] : inputs) {
    Run(name, bytes);
    for (size_t m = 0; m < mutations; ++m) Run(name + " (mutated)", Mutate(bytes, rng));
  }
  std::printf("delta_fuzz_replay: %zu seeds, %zu inputs, %zu runs, no invariant violated\n", seeds,
              inputs.size(), g_runs);
  return 0;
}
