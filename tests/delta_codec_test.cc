// SPDX-License-Identifier: Apache-2.0
// The delta codec (lib/delta/codec.h) on its own: every dtype, empty and 0-d tensors, chunk and
// piece boundaries, every method, adversarial data, determinism, in-place chains and corrupted
// or truncated input.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_format.h"
#include "delta/codec.h"

namespace weightbus::internal::delta {
namespace {

using Bytes = std::vector<std::byte>;

// A version: one byte vector per tensor.
struct Version {
  std::vector<TensorLayout> layout;
  std::vector<Bytes> tensors;

  std::vector<const std::byte*> Pointers() const {
    std::vector<const std::byte*> p;
    for (const Bytes& t : tensors) p.push_back(t.data());
    return p;
  }
};

std::vector<std::byte*> MutablePointers(std::vector<Bytes>& tensors) {
  std::vector<std::byte*> p;
  for (Bytes& t : tensors) p.push_back(t.data());
  return p;
}

uint16_t ToBf16(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Random bytes for any dtype (floats get finite values of realistic magnitudes too).
Bytes RandomTensor(DType dtype, size_t elements, std::mt19937_64& rng) {
  Bytes b(elements * DTypeSize(dtype));
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (size_t i = 0; i < elements; ++i) {
    std::byte* at = b.data() + i * DTypeSize(dtype);
    if (dtype == DType::kBF16) {
      const uint16_t h = ToBf16(normal(rng));
      std::memcpy(at, &h, 2);
    } else if (dtype == DType::kF32) {
      const float f = normal(rng);
      std::memcpy(at, &f, 4);
    } else if (dtype == DType::kF64) {
      const double d = normal(rng);
      std::memcpy(at, &d, 8);
    } else if (dtype == DType::kBool) {
      *at = static_cast<std::byte>(rng() & 1);
    } else {
      const uint64_t r = rng();
      std::memcpy(at, &r, DTypeSize(dtype));
    }
  }
  return b;
}

// Changes about `fraction` of the elements: small integer steps of the bit pattern (what a
// training step does to a float) and, for one change in eight, a random new value.
Bytes Mutate(const Bytes& in, DType dtype, double fraction, std::mt19937_64& rng) {
  Bytes out = in;
  const size_t w = DTypeSize(dtype);
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t i = 0; i < in.size() / w; ++i) {
    if (u(rng) >= fraction) continue;
    std::byte* at = out.data() + i * w;
    uint64_t v = 0;
    std::memcpy(&v, at, w);
    if (rng() % 8 == 0) {
      v = rng();
    } else {
      const int64_t step = static_cast<int64_t>(rng() % 7) - 3;
      v += static_cast<uint64_t>(step == 0 ? 1 : step);
    }
    if (dtype == DType::kBool) v &= 1;
    std::memcpy(at, &v, w);
  }
  return out;
}

std::unique_ptr<Parallel> Threads(int n) {
  auto p = Parallel::Create(n);
  EXPECT_TRUE(p.ok()) << p.status();
  return *std::move(p);
}

EncodedVersion Encode(const VersionIds& ids, const Version& target, const Version* base,
                      const EncodeOptions& options, Parallel& parallel) {
  std::vector<const std::byte*> b;
  if (base != nullptr) b = base->Pointers();
  auto e = EncodeVersion(ids, target.layout, b, target.Pointers(), options, parallel);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : EncodedVersion{};
}

// Decodes into fresh buffers and returns them, or the error.
absl::StatusOr<std::vector<Bytes>> Decode(const EncodedVersion& e, const VersionIds& ids,
                                          const Version& layout_of, const Version* base,
                                          Parallel& parallel,
                                          std::vector<int>* done_counts = nullptr) {
  std::vector<Bytes> out;
  for (const TensorLayout& t : layout_of.layout) out.emplace_back(t.nbytes, std::byte{0x5a});
  std::vector<const std::byte*> b;
  if (base != nullptr) b = base->Pointers();
  std::vector<std::atomic<int>> done(layout_of.layout.size());
  absl::Status s = DecodeVersion(e.bytes, ids, layout_of.layout, b, MutablePointers(out), parallel,
                                 [&](size_t i) { done[i].fetch_add(1); });
  if (done_counts != nullptr) {
    for (auto& d : done) done_counts->push_back(d.load());
  }
  if (!s.ok()) return s;
  return out;
}

constexpr VersionIds kKeyframe{true, 1, 0, 1};
constexpr VersionIds kDelta{false, 2, 1, 1};

TEST(DeltaCodecTest, EveryDtypeRoundTripsAsKeyframeAndDeltaAtEveryDensity) {
  std::mt19937_64 rng(1);
  auto parallel = Threads(2);
  for (DType dtype : kAllDTypes) {
    for (double fraction : {0.0, 0.0005, 0.01, 0.2, 0.6, 1.0}) {
      // 0: the context model; -1: the context model in format version 2; 1, 4: sparse with
      // groups.
      for (int groups : {-1, 0, 1, 4}) {
        SCOPED_TRACE(
            absl::StrFormat("%s, %g changed, %d groups", DTypeName(dtype), fraction, groups));
        Version a, b;
        const size_t elements = 40000 + 7;
        a.layout = b.layout = {{dtype, elements * DTypeSize(dtype)}};
        a.tensors = {RandomTensor(dtype, elements, rng)};
        b.tensors = {Mutate(a.tensors[0], dtype, fraction, rng)};
        EncodeOptions options;
        options.chunk_size = 64 << 10;
        options.context_model = groups <= 0;
        options.format_version = groups < 0 ? 2 : kFormatVersion;
        options.max_groups = std::max(groups, 1);
        auto kf = Decode(Encode(kKeyframe, a, nullptr, options, *parallel), kKeyframe, a, nullptr,
                         *parallel);
        ASSERT_TRUE(kf.ok()) << kf.status();
        EXPECT_TRUE((*kf)[0] == a.tensors[0]);
        const EncodedVersion d = Encode(kDelta, b, &a, options, *parallel);
        auto out = Decode(d, kDelta, b, &a, *parallel);
        ASSERT_TRUE(out.ok()) << out.status();
        EXPECT_TRUE((*out)[0] == b.tensors[0]);
        // Never much larger than the raw bytes, whatever the data.
        EXPECT_LE(d.bytes.size(), b.layout[0].nbytes + 64 + d.results.size() * 8);
        if (fraction == 0.0) {
          for (const ChunkResult& r : d.results) EXPECT_EQ(r.method, Method::kSame);
        }
      }
    }
  }
}

TEST(DeltaCodecTest, EmptyAndZeroDimensionalTensors) {
  std::mt19937_64 rng(2);
  auto parallel = Threads(2);
  Version a;
  a.layout = {{DType::kF32, 0}, {DType::kBF16, 2},   {DType::kI64, 8},
              {DType::kU8, 0},  {DType::kF8E4M3, 1}, {DType::kBool, 1}};
  for (const TensorLayout& t : a.layout) {
    a.tensors.push_back(RandomTensor(t.dtype, t.nbytes / DTypeSize(t.dtype), rng));
  }
  Version b = a;
  for (size_t i = 0; i < b.tensors.size(); ++i) {
    if (!b.tensors[i].empty()) b.tensors[i][0] ^= std::byte{1};
  }
  for (const bool keyframe : {true, false}) {
    const VersionIds ids = keyframe ? kKeyframe : kDelta;
    std::vector<int> done;
    auto out = Decode(Encode(ids, b, keyframe ? nullptr : &a, {}, *parallel), ids, b,
                      keyframe ? nullptr : &a, *parallel, &done);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < b.tensors.size(); ++i) {
      EXPECT_TRUE((*out)[i] == b.tensors[i]) << i;
      EXPECT_EQ(done[i], 1) << "tensor " << i << " reported " << done[i] << " times";
    }
  }
  // A version with no tensors at all.
  Version none;
  auto e = Encode(kKeyframe, none, nullptr, {}, *parallel);
  EXPECT_TRUE(Decode(e, kKeyframe, none, nullptr, *parallel).ok());
}

TEST(DeltaCodecTest, PlanGroupsDtypesAndCutsEveryChunkSize) {
  std::vector<TensorLayout> layout = {{DType::kBF16, 100}, {DType::kF32, 64}, {DType::kBF16, 30},
                                      {DType::kBF16, 0},   {DType::kU8, 5},   {DType::kBF16, 200}};
  const std::vector<Chunk> chunks = PlanChunks(layout, 64);
  // BF16 (330 bytes) in dtype order comes after U8 (kAllDTypes order); every byte exactly once.
  std::map<uint32_t, uint64_t> covered;
  DType last = DType::kBool;
  for (const Chunk& c : chunks) {
    EXPECT_LE(c.bytes, 64u);
    uint64_t sum = 0;
    for (const Piece& p : c.pieces) {
      EXPECT_EQ(layout[p.tensor].dtype, c.dtype);
      EXPECT_EQ(p.offset, covered[p.tensor]) << "pieces of a tensor are in order";
      covered[p.tensor] += p.bytes;
      sum += p.bytes;
    }
    EXPECT_EQ(sum, c.bytes);
    EXPECT_GE(static_cast<int>(c.dtype), static_cast<int>(last));
    last = c.dtype;
  }
  for (size_t t = 0; t < layout.size(); ++t) EXPECT_EQ(covered[t], layout[t].nbytes) << t;
  EXPECT_EQ(chunks.size(), 1u + 1u + 6u);  // U8 (5), BF16 330 -> 6 chunks, F32 (64)
}

TEST(DeltaCodecTest, ChangesAtEveryChunkAndPieceBoundary) {
  std::mt19937_64 rng(3);
  auto parallel = Threads(3);
  Version a;
  for (size_t elements : {1, 31, 32, 33, 63, 64, 65, 127, 500}) {
    a.layout.push_back({DType::kBF16, elements * 2});
    a.tensors.push_back(RandomTensor(DType::kBF16, elements, rng));
  }
  for (uint64_t chunk : {64, 128, 192, 4096}) {
    SCOPED_TRACE(chunk);
    Version b = a;
    // First and last element of every tensor, and the elements around every chunk boundary.
    for (Bytes& t : b.tensors) {
      t.front() ^= std::byte{1};
      t[t.size() - 2] ^= std::byte{1};
    }
    for (const Chunk& c : PlanChunks(a.layout, chunk)) {
      for (const Piece& p : c.pieces) {
        b.tensors[p.tensor][p.offset] ^= std::byte{2};
        b.tensors[p.tensor][p.offset + p.bytes - 1] ^= std::byte{0x80};
      }
    }
    EncodeOptions options;
    options.chunk_size = chunk;
    auto out = Decode(Encode(kDelta, b, &a, options, *parallel), kDelta, b, &a, *parallel);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < b.tensors.size(); ++i) EXPECT_TRUE((*out)[i] == b.tensors[i]) << i;
  }
}

// Modeled records of 2-byte elements are decoded with a scan of the base chosen at run time
// (AVX2 and POPCNT where the CPU has them, else the baseline), which also copies the base into
// the output as it goes: both scans give the same bytes, out of place and in place, for float
// and integer dtypes, many tensors of odd sizes (spans that end mid-block) and every density the
// modeled method takes, in both modeled formats.
TEST(DeltaCodecTest, TheBaselineAndTheRuntimeChosenScanDecodeTheSame) {
  std::mt19937_64 rng(16);
  auto parallel = Threads(2);
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kU16, DType::kF32}) {
    for (double fraction : {0.0005, 0.01, 0.1}) {
      for (uint8_t format : {uint8_t{2}, kFormatVersion}) {
        SCOPED_TRACE(
            absl::StrFormat("%s, %g changed, format %d", DTypeName(dtype), fraction, format));
        Version a, b;
        for (size_t elements : {1, 31, 33, 95, 4096 + 17, 20000, 3}) {
          a.layout.push_back({dtype, elements * DTypeSize(dtype)});
          a.tensors.push_back(RandomTensor(dtype, elements, rng));
          b.layout.push_back(a.layout.back());
          b.tensors.push_back(Mutate(a.tensors.back(), dtype, fraction, rng));
        }
        EncodeOptions options;
        options.chunk_size = 16 << 10;
        options.format_version = format;
        const EncodedVersion d = Encode(kDelta, b, &a, options, *parallel);
        bool modeled = false;
        for (const ChunkResult& r : d.results) {
          modeled |= r.method == Method::kModeled || r.method == Method::kModeledRans;
        }
        EXPECT_TRUE(modeled);
        for (bool baseline : {true, false}) {
          DecodeWithBaselineScanForTesting(baseline);
          auto out = Decode(d, kDelta, b, &a, *parallel);
          ASSERT_TRUE(out.ok()) << out.status();
          for (size_t i = 0; i < b.tensors.size(); ++i) {
            EXPECT_TRUE((*out)[i] == b.tensors[i]) << i << (baseline ? " baseline" : "");
          }
          // In place: the base is the output.
          std::vector<Bytes> in_place = a.tensors;
          std::vector<const std::byte*> base;
          for (const Bytes& t : in_place) base.push_back(t.data());
          ASSERT_TRUE(DecodeVersion(d.bytes, kDelta, a.layout, base, MutablePointers(in_place),
                                    *parallel, nullptr)
                          .ok());
          for (size_t i = 0; i < b.tensors.size(); ++i) {
            EXPECT_TRUE(in_place[i] == b.tensors[i]) << i << (baseline ? " baseline" : "");
          }
        }
        DecodeWithBaselineScanForTesting(false);
      }
    }
  }
}

TEST(DeltaCodecTest, RandomDataIsStoredNotExpanded) {
  std::mt19937_64 rng(4);
  auto parallel = Threads(2);
  Version a, b;
  for (DType dtype : {DType::kU8, DType::kU16, DType::kU32, DType::kU64}) {
    a.layout.push_back({dtype, 300000});
    Bytes r(300000);
    for (std::byte& x : r) x = static_cast<std::byte>(rng());
    a.tensors.push_back(r);
    for (std::byte& x : r) x = static_cast<std::byte>(rng());
    b.tensors.push_back(r);
  }
  b.layout = a.layout;
  EncodeOptions options;
  options.chunk_size = 128 << 10;
  for (const bool keyframe : {true, false}) {
    const EncodedVersion e =
        Encode(keyframe ? kKeyframe : kDelta, b, keyframe ? nullptr : &a, options, *parallel);
    for (const ChunkResult& r : e.results) {
      EXPECT_EQ(r.method, Method::kStored);
      EXPECT_EQ(r.encoded_bytes, r.raw_bytes + 1);
    }
    auto out = Decode(e, keyframe ? kKeyframe : kDelta, b, keyframe ? nullptr : &a, *parallel);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(*out == b.tensors);
  }
}

// A bf16 "training step": an fp32 master moves by a small Gaussian step and is cast again.
struct Bf16Stream {
  explicit Bf16Stream(size_t n, uint64_t seed) : rng(seed), master(n) {
    std::normal_distribution<float> init(0.0f, 0.02f);
    for (float& m : master) m = init(rng);
  }
  Version Next(double step) {
    std::normal_distribution<float> noise(0.0f, static_cast<float>(step));
    for (float& m : master) m += noise(rng);
    Version v;
    v.layout = {{DType::kBF16, master.size() * 2}};
    Bytes b(master.size() * 2);
    for (size_t i = 0; i < master.size(); ++i) {
      const uint16_t h = ToBf16(master[i]);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
    v.tensors = {std::move(b)};
    return v;
  }
  std::mt19937_64 rng;
  std::vector<float> master;
};

TEST(DeltaCodecTest, MagnitudeGroupsShrinkRealisticDeltas) {
  Bf16Stream stream(1 << 20, 5);
  auto parallel = Threads(2);
  const Version a = stream.Next(1e-6), b = stream.Next(1e-6);
  EncodeOptions plain, grouped;
  plain.context_model = grouped.context_model = false;
  grouped.max_groups = 4;
  const EncodedVersion p = Encode(kDelta, b, &a, plain, *parallel);
  const EncodedVersion g = Encode(kDelta, b, &a, grouped, *parallel);
  const double changed = static_cast<double>(g.changed_elements) / g.total_elements;
  EXPECT_GT(changed, 0.005);
  EXPECT_LT(changed, 0.2);
  EXPECT_LT(g.bytes.size(), p.bytes.size() * 0.9)
      << "grouped " << g.bytes.size() << " vs " << p.bytes.size();
  for (const EncodedVersion* e : {&p, &g}) {
    for (const ChunkResult& r : e->results) EXPECT_EQ(r.method, Method::kSparse);
    auto out = Decode(*e, kDelta, b, &a, *parallel);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE((*out)[0] == b.tensors[0]);
  }
}

// The context model (the default) against the sparse form on the same delta: smaller, coded as
// modeled-rans chunks (modeled ones in format version 2, within 5% of the same size),
// bit-exact. (On this random walk, unlike the real-gradient stream of BENCHMARKS.md, sparse with
// 4 magnitude groups is about 5% smaller still: printed.)
TEST(DeltaCodecTest, ContextModelIsSmallerThanSparse) {
  Bf16Stream stream(1 << 20, 5);
  auto parallel = Threads(2);
  const Version a = stream.Next(1e-6), b = stream.Next(1e-6);
  EncodeOptions modeled, plain, grouped, version2;
  plain.context_model = grouped.context_model = false;
  grouped.max_groups = 4;
  version2.format_version = 2;
  const EncodedVersion m = Encode(kDelta, b, &a, modeled, *parallel);
  const EncodedVersion m2 = Encode(kDelta, b, &a, version2, *parallel);
  const EncodedVersion p = Encode(kDelta, b, &a, plain, *parallel);
  const EncodedVersion g = Encode(kDelta, b, &a, grouped, *parallel);
  std::printf(
      "modeled-rans %zu bytes, modeled (format 2) %zu, sparse %zu, sparse with 4 groups %zu\n",
      m.bytes.size(), m2.bytes.size(), p.bytes.size(), g.bytes.size());
  EXPECT_LT(m.bytes.size(), p.bytes.size() * 0.9)
      << "modeled " << m.bytes.size() << " vs sparse " << p.bytes.size();
  EXPECT_LT(m.bytes.size(), m2.bytes.size() * 1.05)
      << "modeled-rans " << m.bytes.size() << " vs modeled " << m2.bytes.size();
  EXPECT_EQ(static_cast<int>(m.bytes[4]), 3);
  EXPECT_EQ(static_cast<int>(m2.bytes[4]), 2);
  for (const ChunkResult& r : m.results) EXPECT_EQ(r.method, Method::kModeledRans);
  for (const ChunkResult& r : m2.results) EXPECT_EQ(r.method, Method::kModeled);
  for (const EncodedVersion* e : {&m, &m2}) {
    auto out = Decode(*e, kDelta, b, &a, *parallel);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE((*out)[0] == b.tensors[0]);
  }
}

// Encoders write format versions 2 and 3 only.
TEST(DeltaCodecTest, OtherFormatVersionsAreNotWritten) {
  Bf16Stream stream(5000, 12);
  auto parallel = Threads(1);
  const Version a = stream.Next(1e-6), b = stream.Next(1e-6);
  const std::vector<const std::byte*> base = a.Pointers(), target = b.Pointers();
  for (const uint8_t version : {uint8_t{1}, static_cast<uint8_t>(kFormatVersion + 1)}) {
    EncodeOptions options;
    options.format_version = version;
    auto e = EncodeVersion(kDelta, b.layout, base, target, options, *parallel);
    EXPECT_TRUE(absl::IsInvalidArgument(e.status())) << e.status();
  }
}

// The modeled record codes classes in a 5-bit window from the smallest class of a change, or in
// 8 bits; the modeled-rans record in a window of 15 classes, the others escaped: changes whose
// classes fit a window near the top (class 250: huge magnitudes), span just over a window, or
// span every class all round-trip, in both format versions.
TEST(DeltaCodecTest, ContextModelClassWindowsAtTheEdges) {
  auto parallel = Threads(1);
  for (const std::pair<int, int>& classes : std::vector<std::pair<int, int>>{
           {250, 255}, {241, 255}, {224, 255}, {200, 232}, {0, 14}, {0, 31}, {0, 255}}) {
    for (const uint8_t version : {uint8_t{2}, uint8_t{3}}) {
      SCOPED_TRACE(absl::StrFormat("classes %d..%d, format version %d", classes.first,
                                   classes.second, version));
      Version a, b;
      const size_t n = 4096;
      a.layout = b.layout = {{DType::kBF16, n * 2}};
      Bytes x(n * 2), y(n * 2);
      for (size_t i = 0; i < n; ++i) {
        const int c = classes.first + static_cast<int>(i % (classes.second - classes.first + 1));
        const uint16_t v = static_cast<uint16_t>((c << 7) | (i % 97));      // ClassOf(v) == c
        const uint16_t w = i % 10 == 0 ? static_cast<uint16_t>(v ^ 1) : v;  // 10% changed
        std::memcpy(x.data() + 2 * i, &v, 2);
        std::memcpy(y.data() + 2 * i, &w, 2);
      }
      a.tensors = {x};
      b.tensors = {y};
      EncodeOptions options;
      options.format_version = version;
      const EncodedVersion e = Encode(kDelta, b, &a, options, *parallel);
      ASSERT_EQ(e.results.size(), 1u);
      EXPECT_EQ(e.results[0].method, version == 2 ? Method::kModeled : Method::kModeledRans);
      auto out = Decode(e, kDelta, b, &a, *parallel);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_TRUE((*out)[0] == b.tensors[0]);
    }
  }
}

TEST(DeltaCodecTest, OutputIsTheSameForAnyThreadCount) {
  Bf16Stream stream(300000, 6);
  const Version a = stream.Next(1e-5), b = stream.Next(1e-5);
  EncodeOptions options;
  options.chunk_size = 64 << 10;
  options.max_groups = 4;
  auto one = Threads(1), four = Threads(4);
  for (const bool keyframe : {true, false}) {
    const VersionIds ids = keyframe ? kKeyframe : kDelta;
    const EncodedVersion x = Encode(ids, b, keyframe ? nullptr : &a, options, *one);
    const EncodedVersion y = Encode(ids, b, keyframe ? nullptr : &a, options, *four);
    EXPECT_TRUE(x.bytes == y.bytes);
  }
}

TEST(DeltaCodecTest, HundredChainedDeltasInPlaceAreBitExact) {
  Bf16Stream stream(50000, 7);
  auto parallel = Threads(2);
  Version first = stream.Next(3e-6);
  std::vector<Bytes> state = first.tensors;  // decoded in place, version after version
  Version previous = first;
  EncodeOptions options;
  options.chunk_size = 4096;
  options.max_groups = 4;
  for (uint64_t v = 2; v <= 100; ++v) {
    options.context_model = v % 2 == 0;  // every method, in place
    options.format_version = v % 4 == 0 ? 2 : kFormatVersion;
    const Version next = stream.Next(3e-6);
    const VersionIds ids{false, v, v - 1, 1};
    const EncodedVersion e = Encode(ids, next, &previous, options, *parallel);
    std::vector<std::byte*> out = MutablePointers(state);
    std::vector<const std::byte*> base(out.begin(), out.end());
    ASSERT_TRUE(DecodeVersion(e.bytes, ids, next.layout, base, out, *parallel, nullptr).ok());
    ASSERT_TRUE(state == next.tensors) << "version " << v;
    previous = next;
  }
}

TEST(DeltaCodecTest, HeaderMustMatchWhatIsExpected) {
  Bf16Stream stream(5000, 8);
  auto parallel = Threads(1);
  const Version a = stream.Next(1e-4), b = stream.Next(1e-4);
  const EncodedVersion e = Encode(kDelta, b, &a, {}, *parallel);
  // Another target, base or kind.
  for (const VersionIds& wrong : {VersionIds{false, 3, 1, 1}, VersionIds{false, 2, 0, 1},
                                  VersionIds{true, 2, 1, 1}, VersionIds{false, 2, 1, 2}}) {
    auto out = Decode(e, wrong, b, &a, *parallel);
    EXPECT_TRUE(absl::IsDataLoss(out.status())) << out.status();
  }
  // A layout that is not the encoded one.
  Version other = b;
  other.layout.push_back({DType::kU8, 3});
  other.tensors.push_back(Bytes(3));
  EXPECT_TRUE(absl::IsDataLoss(Decode(e, kDelta, other, &a, *parallel).status()));
  Version bigger = b;
  bigger.layout[0].nbytes += 2;
  bigger.tensors[0].resize(bigger.layout[0].nbytes);
  auto bigger_base = a;
  bigger_base.tensors[0].resize(bigger.layout[0].nbytes);
  EXPECT_TRUE(absl::IsDataLoss(Decode(e, kDelta, bigger, &bigger_base, *parallel).status()));
  // Newer format versions are refused as such.
  EncodedVersion newer = e;
  newer.bytes[4] = std::byte{kFormatVersion + 1};
  EXPECT_TRUE(absl::IsUnimplemented(Decode(newer, kDelta, b, &a, *parallel).status()));
  EncodedVersion magic = e;
  magic.bytes[0] = std::byte{'X'};
  EXPECT_TRUE(absl::IsDataLoss(Decode(magic, kDelta, b, &a, *parallel).status()));
}

TEST(DeltaCodecTest, TruncationAndExtraBytesAreDataLoss) {
  Bf16Stream stream(20000, 9);
  auto parallel = Threads(1);
  const Version a = stream.Next(1e-5), b = stream.Next(1e-5);
  EncodeOptions options;
  options.chunk_size = 8192;
  const EncodedVersion e = Encode(kDelta, b, &a, options, *parallel);
  for (size_t len = 0; len < e.bytes.size(); len += std::max<size_t>(1, e.bytes.size() / 300)) {
    EncodedVersion cut = e;
    cut.bytes.resize(len);
    EXPECT_TRUE(absl::IsDataLoss(Decode(cut, kDelta, b, &a, *parallel).status())) << len;
  }
  EncodedVersion longer = e;
  longer.bytes.push_back(std::byte{0});
  EXPECT_TRUE(absl::IsDataLoss(Decode(longer, kDelta, b, &a, *parallel).status()));
}

// Little-endian base-128, as the format writes sizes and counts.
void AppendVarint(Bytes* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<std::byte>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<std::byte>(v));
}

// A delta version (kDelta) of `layout` in one chunk whose record is `record`, with a correct
// header: what a hostile or broken publisher can put on the wire.
Bytes CraftVersion(absl::Span<const TensorLayout> layout, uint64_t chunk_size,
                   const Bytes& record) {
  Bytes out;
  for (char c : kMagic) out.push_back(static_cast<std::byte>(c));
  out.push_back(std::byte{kFormatVersion});
  out.push_back(std::byte{1});  // delta
  AppendVarint(&out, kDelta.target);
  AppendVarint(&out, kDelta.base);
  AppendVarint(&out, kDelta.keyframe_version);
  AppendVarint(&out, chunk_size);
  AppendVarint(&out, layout.size());
  const uint64_t sum = LayoutChecksum(layout);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>(sum >> (8 * i)));
  AppendVarint(&out, 1);
  AppendVarint(&out, record.size());
  out.insert(out.end(), record.begin(), record.end());
  return out;
}

// Issue 10, item 15: a sparse record claiming one change whose only group claims 2^20 of them
// (ranks 0, 1, 2, ... from a constant gap stream). The ranks buffer was sized from the record's
// total and the group's count checked only after writing 2^20 ranks into it: a heap overflow
// ("malloc(): corrupted top size"). It must be DataLoss before anything is written.
Bytes OverclaimingSparseRecord() {
  Bytes r;
  r.push_back(std::byte{static_cast<uint8_t>(Method::kSparse)});
  AppendVarint(&r, 1);        // the record's changes
  r.push_back(std::byte{1});  // groups
  AppendVarint(&r, 1 << 20);  // group 0's changes
  r.push_back(std::byte{1});  // gap width
  AppendVarint(&r, 1 << 20);  // gap entries
  r.push_back(std::byte{0});  // gap plane: constant...
  r.push_back(std::byte{0});  // ...0
  r.push_back(std::byte{0});  // value plane: constant...
  r.push_back(std::byte{1});  // ...1
  return r;
}

TEST(DeltaCodecTest, SparseGroupClaimingMoreChangesThanTheRecordIsDataLoss) {
  const Bytes record = OverclaimingSparseRecord();
  ASSERT_EQ(record.size(), 14u);
  const size_t n = size_t{1} << 20;
  Bytes base(n, std::byte{7}), out(n, std::byte{0});
  // A fresh thread has fresh (empty) scratch buffers, as a subscriber's decoding threads do.
  absl::Status chunk_status;
  std::thread([&] {
    const ChunkOutput span{base.data(), out.data(), n};
    chunk_status = DecodeChunk(DType::kU8, {&span, 1}, /*keyframe=*/false, record);
  }).join();
  EXPECT_TRUE(absl::IsDataLoss(chunk_status)) << chunk_status;
  EXPECT_NE(chunk_status.message().find("claims 1048576 changes"), std::string::npos)
      << chunk_status;

  // The same through the version decoder, for every element size.
  for (DType dtype : {DType::kU8, DType::kBF16, DType::kF32, DType::kU64}) {
    SCOPED_TRACE(DTypeName(dtype));
    const uint64_t bytes = n * DTypeSize(dtype);
    const std::vector<TensorLayout> layout = {{dtype, bytes}};
    Bytes rec = record;
    // One value plane per byte of the element: append the missing constant planes.
    for (size_t b = 1; b < DTypeSize(dtype); ++b) {
      rec.push_back(std::byte{0});
      rec.push_back(std::byte{0});
    }
    const Bytes blob = CraftVersion(layout, bytes, rec);
    Bytes b2(bytes, std::byte{7}), o2(bytes);
    const std::byte* bp = b2.data();
    std::byte* op = o2.data();
    absl::Status s;
    std::thread([&] {
      auto parallel = Threads(1);
      s = DecodeVersion(blob, kDelta, layout, {&bp, 1}, {&op, 1}, *parallel, nullptr);
    }).join();
    EXPECT_TRUE(absl::IsDataLoss(s)) << s;
    EXPECT_NE(s.message().find("chunk 0"), std::string::npos) << s;
  }
}

// Every single-bit flip of a small delta (modeled-rans, modeled or grouped sparse, xor and
// stored chunks) is either refused by the decoder or gives different bytes, which the manifest
// checksum then refuses; none crashes or reads out of bounds. Flips that decode to the right bytes
// (harmless bits, such as zstd's reserved ones) are counted and must be rare. The parameter: 0
// sparse, 2 the context model in format version 2, 3 in format version 3.
class FlippedBits : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Models, FlippedBits, ::testing::Values(0, 2, 3), [](const auto& info) {
  return info.param == 0 ? std::string("sparse") : absl::StrFormat("context%d", info.param);
});
TEST_P(FlippedBits, AreRefusedOrChangeTheOutput) {
  Bf16Stream stream(6000, 10);
  auto parallel = Threads(1);
  Version a = stream.Next(1e-4);
  // Sparser for the context model, which codes chunks of at most 1/8 changed elements.
  Version b = stream.Next(GetParam() ? 1e-6 : 1e-4);
  std::mt19937_64 rng(11);
  a.layout.push_back({DType::kU32, 2000});
  a.tensors.push_back(RandomTensor(DType::kU32, 500, rng));
  b.layout.push_back(a.layout.back());
  b.tensors.push_back(Mutate(a.tensors.back(), DType::kU32, 0.9, rng));
  EncodeOptions options;
  options.chunk_size = 4096;
  options.max_groups = 4;
  options.context_model = GetParam() != 0;
  options.format_version = GetParam() == 2 ? 2 : kFormatVersion;
  const EncodedVersion e = Encode(kDelta, b, &a, options, *parallel);
  std::map<Method, int> methods;
  for (const ChunkResult& r : e.results) ++methods[r.method];
  const Method expected = GetParam() == 0   ? Method::kSparse
                          : GetParam() == 2 ? Method::kModeled
                                            : Method::kModeledRans;
  EXPECT_GT(methods[expected], 0);
  int refused = 0, different = 0, harmless = 0;
  for (size_t bit = 0; bit < e.bytes.size() * 8; ++bit) {
    EncodedVersion bad = e;
    bad.bytes[bit / 8] ^= static_cast<std::byte>(1 << (bit % 8));
    auto out = Decode(bad, kDelta, b, &a, *parallel);
    if (!out.ok()) {
      EXPECT_TRUE(absl::IsDataLoss(out.status()) || absl::IsUnimplemented(out.status()))
          << out.status();
      ++refused;
    } else if (*out != b.tensors) {
      ++different;
    } else {
      ++harmless;
    }
  }
  std::printf("bit flips: %d refused, %d decoded differently, %d harmless\n", refused, different,
              harmless);
  // The last bytes a range coder flushes are partly redundant (up to about 3 of the 5 per
  // stream; modeled records have two streams): flips there decode right.
  EXPECT_LT(harmless, static_cast<int>(e.bytes.size() * 8 / (GetParam() ? 33 : 100)));
}

}  // namespace
}  // namespace weightbus::internal::delta
