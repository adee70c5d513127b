// SPDX-License-Identifier: Apache-2.0
// The realistic update streams of the delta benchmark: the synthetic Adam stream
// (tools/weightbus/update_stream.h) and the real-gradient stories260K stream
// (bench/real_grad_stream.py, Debian's python3-torch): Gaussian noise, Adam's first step,
// determinism for any thread count and seed, and the per-step statistics.
#include "weightbus/update_stream.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_format.h"
#include "test_support.h"
#include "weightbus/llama2c.h"

namespace weightbus::tools {
namespace {

using ::weightbus::testing::ScratchDir;

TEST(UpdateStreamTest, StandardNormalsHaveTheMomentsOfAGaussian) {
  constexpr size_t n = 2'000'000;
  std::vector<float> z(n);
  StandardNormals(12345, 0, n, z.data());
  double sum = 0, sum2 = 0, sum4 = 0;
  size_t beyond3 = 0;
  for (float x : z) {
    sum += x;
    sum2 += double{x} * x;
    sum4 += double{x} * x * x * x;
    beyond3 += std::abs(x) > 3;
  }
  const double mean = sum / n, var = sum2 / n - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.003);
  EXPECT_NEAR(var, 1.0, 0.005);
  EXPECT_NEAR(sum4 / n / (var * var), 3.0, 0.03);                    // kurtosis
  EXPECT_NEAR(static_cast<double>(beyond3) / n, 0.0026998, 0.0003);  // two-sided 3 sigma
  // Any split of the range gives the same values.
  std::vector<float> part(1000);
  StandardNormals(12345, 777'000, part.size(), part.data());
  EXPECT_EQ(std::memcmp(part.data(), z.data() + 777'000, part.size() * 4), 0);
}

std::vector<OwnedTensor> SmallMaster(int64_t rows) {
  std::vector<OwnedTensor> master;
  for (int k = 0; k < 3; ++k) {
    OwnedTensor t{absl::StrFormat("w%d", k), DType::kF32, {rows + k, 33}, {}};
    t.bytes.resize(static_cast<size_t>((rows + k) * 33) * 4);
    std::vector<float> v(t.bytes.size() / 4);
    StandardNormals(k + 1, 0, v.size() & ~size_t{1}, v.data());
    for (float& x : v) x *= 0.02f;
    std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    master.push_back(std::move(t));
  }
  return master;
}

TEST(UpdateStreamTest, SameSeedSameStreamForAnyThreadCount) {
  auto run = [](int threads, uint64_t seed) {
    AdamOptions o;
    o.lr = 1e-5;
    o.seed = seed;
    o.threads = threads;
    UpdateStream s = *UpdateStream::Create(SmallMaster(3000), o);
    for (int i = 0; i < 3; ++i) s.Step();
    return s.Bf16();
  };
  const auto one = run(1, 7), three = run(3, 7), other = run(2, 8);
  ASSERT_EQ(one.size(), three.size());
  for (size_t t = 0; t < one.size(); ++t) EXPECT_TRUE(one[t].bytes == three[t].bytes) << t;
  EXPECT_GT(ChangedFraction(one, other), 0.1);
}

TEST(UpdateStreamTest, FirstAdamStepMovesEveryWeightByTheLearningRate) {
  // With bias correction the first step is lr * g / (|g| + eps'), i.e. lr against the gradient.
  AdamOptions o;
  o.lr = 1e-3;
  UpdateStream s = *UpdateStream::Create(SmallMaster(1000), o);
  const std::vector<OwnedTensor> before = s.master();
  s.Step();
  size_t off = 0, n = 0;
  for (size_t t = 0; t < before.size(); ++t) {
    const float* a = reinterpret_cast<const float*>(before[t].bytes.data());
    const float* b = reinterpret_cast<const float*>(s.master()[t].bytes.data());
    for (size_t i = 0; i < before[t].bytes.size() / 4; ++i, ++n) {
      off += std::abs(std::abs(b[i] - a[i]) - 1e-3) > 1e-5;
    }
  }
  EXPECT_LT(off, n / 1000) << off << " of " << n << " elements did not move by lr";
  EXPECT_EQ(s.step(), 1u);
}

TEST(UpdateStreamTest, StepStatisticsAndEntropyFloors) {
  auto bf16 = [](std::vector<uint16_t> v) {
    OwnedTensor t{"t", DType::kBF16, {static_cast<int64_t>(v.size())}, {}};
    t.bytes.resize(v.size() * 2);
    std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    return std::vector<OwnedTensor>{t};
  };
  const StepStatistics s = CompareVersions(bf16({10, 20, 30, 40}), bf16({11, 20, 30, 43}));
  EXPECT_EQ(s.elements, 4u);
  EXPECT_EQ(s.changed, 2u);
  EXPECT_DOUBLE_EQ(s.changed_fraction(), 0.5);
  EXPECT_DOUBLE_EQ(s.mask_bits, 1.0);    // H(1/2)
  EXPECT_DOUBLE_EQ(s.value_bits, 1.0);   // {11, 43}
  EXPECT_DOUBLE_EQ(s.change_bits, 1.0);  // {+1, +3}
  EXPECT_DOUBLE_EQ(s.floor_bits(), 1.5);
  const StepStatistics same = CompareVersions(bf16({1, 2}), bf16({1, 2}));
  EXPECT_EQ(same.changed, 0u);
  EXPECT_DOUBLE_EQ(same.change_floor_bits(), 0.0);
  // Wrapping changes: 0xffff -> 0x0001 is +2.
  const StepStatistics wrap = CompareVersions(bf16({0xffff, 0xffff}), bf16({1, 1}));
  EXPECT_DOUBLE_EQ(wrap.change_bits, 0.0);
  EXPECT_DOUBLE_EQ(wrap.mask_bits, 0.0);
}

// bench/real_grad_stream.py: the same seed gives byte-identical versions, another seed others.
TEST(UpdateStreamTest, RealGradientStreamIsReproducible) {
  const std::string python = "/usr/bin/python3";
  auto probe = testing::RunCommand({python, "-c", "import torch, numpy"}, absl::Seconds(60));
  if (!probe.ok() || probe->exit_code != 0) {
    GTEST_SKIP() << "Debian's python3-torch is not importable by " << python;
  }
  ScratchDir dir;
  ASSERT_TRUE(
      ConvertLlama2c(testing::FixturePath("stories260K.bin"), dir / "hf", DType::kF32).ok());
  auto run = [&](const std::string& out, int seed) {
    auto r = testing::RunCommand(
        {python, std::string(WEIGHTBUS_SOURCE_DIR) + "/bench/real_grad_stream.py", "--model",
         dir / "hf", "--out", dir / out, "--lr", "1e-5", "--steps", "2", "--batch", "2",
         "--seq-len", "32", "--seed", std::to_string(seed)},
        absl::Seconds(120));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->exit_code, 0) << r->output;
  };
  run("a", 1);
  run("b", 1);
  run("c", 2);
  auto file = [&](const std::string& out, int v) {
    return testing::ReadFileOrDie(dir / absl::StrFormat("%s/v%05d.safetensors", out, v));
  };
  for (int v = 0; v <= 2; ++v) EXPECT_EQ(file("a", v), file("b", v)) << "version " << v;
  EXPECT_EQ(file("a", 0), file("c", 0));  // the converted model itself
  EXPECT_NE(file("a", 2), file("c", 2));
  EXPECT_NE(file("a", 1), file("a", 2));
  EXPECT_TRUE(std::filesystem::exists(dir / "a/stream.json"));
}

}  // namespace
}  // namespace weightbus::tools
