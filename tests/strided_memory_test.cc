// SPDX-License-Identifier: Apache-2.0
// Publishing non-contiguous views costs at most a bounded window of extra memory, not the sum of
// their sizes, and nothing stays allocated after Publish returns. Measured with the kernel's
// peak resident set size (VmHWM, reset through /proc/self/clear_refs) around one Publish of
// strided views, against the same Publish of contiguous copies of the same bytes.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "expect_tensors.h"
#include "test_support.h"
#include "ucx_tls.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::weightbus::testing::ScratchDir;

constexpr absl::Duration kTimeout = absl::Seconds(120);
constexpr int64_t kRows = 2048, kCols = 4096;  // 32 MiB of F32 per tensor
constexpr int kTensors = 5;

// A /proc/self/status field in bytes (VmRSS, VmHWM).
int64_t StatusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// Resets VmHWM to the current RSS (Linux >= 4.0); false where the kernel does not allow it.
bool ResetPeak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good();
}

// Peak memory above the resident size at the start of `publish`.
int64_t ExtraPeak(const std::function<void()>& publish) {
  if (!ResetPeak()) return -1;
  const int64_t before = StatusBytes("VmRSS");
  publish();
  return StatusBytes("VmHWM") - before;
}

class StridedMemoryTest : public ::testing::TestWithParam<std::string> {};

TEST_P(StridedMemoryTest, StridedViewsNeedOnlyAWindowOfExtraMemory) {
  if (const std::string why = testing::MissingTransports({GetParam()}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  std::string uri;
  std::optional<testing::ScopedEnvs> tls_env;  // restored on every exit
  if (GetParam() == "ucx") {
    tls_env.emplace(testing::kShm.env);
    uri = absl::StrFormat("ucx://127.0.0.1:%d/strided", testing::FreePort());
  } else {
    uri = absl::StrFormat("%s://%s/channel", GetParam(), dir.path());
  }
  // Row-major [kRows, kCols] sources, published as their transposes [kCols, kRows] (strides
  // {1, kCols}: non-contiguous), and as contiguous packed copies of those transposes.
  std::vector<std::vector<float>> sources(kTensors), packed(kTensors);
  for (int t = 0; t < kTensors; ++t) {
    sources[t].resize(kRows * kCols);
    for (int64_t i = 0; i < kRows * kCols; ++i) sources[t][i] = static_cast<float>(i * (t + 1));
    packed[t].resize(kRows * kCols);
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kCols; ++c) packed[t][c * kRows + r] = sources[t][r * kCols + c];
    }
  }
  std::vector<TensorView> strided, contiguous;
  for (int t = 0; t < kTensors; ++t) {
    const std::string name = absl::StrFormat("layers.%d.weight", t);
    strided.push_back(TensorView{
        name, DType::kF32, {kCols, kRows}, {1, kCols}, sources[t].data(), Device{}, std::nullopt});
    contiguous.push_back(TensorView{
        name, DType::kF32, {kCols, kRows}, {}, packed[t].data(), Device{}, std::nullopt});
  }
  auto pub = Publisher::Open(uri);
  ASSERT_TRUE(pub.ok()) << pub.status();
  auto sub = Subscriber::Open(uri);
  ASSERT_TRUE(sub.ok()) << sub.status();
  uint64_t version = 0;
  auto publish = [&](const std::vector<TensorView>& views) {
    ++version;
    const absl::Status s = (*pub)->Publish(version, views, {}, kTimeout);
    ASSERT_TRUE(s.ok()) << s;
  };
  // Warm up: every staging slot and buffer that steady state reuses is allocated.
  for (int i = 0; i < 3; ++i) publish(contiguous);
  const int64_t contiguous_extra = ExtraPeak([&] { publish(contiguous); });
  const int64_t strided_extra = ExtraPeak([&] { publish(strided); });
  if (contiguous_extra < 0 || strided_extra < 0) GTEST_SKIP() << "cannot reset VmHWM here";
  const int64_t largest = kRows * kCols * 4;
  EXPECT_LT(strided_extra - contiguous_extra, largest)
      << "strided publish peaked " << strided_extra << " bytes above its start, contiguous "
      << contiguous_extra << "; all strided views together are " << largest * kTensors;
  // Nothing stays allocated: RSS after is back within a window of RSS before another publish.
  const int64_t rss_before = StatusBytes("VmRSS");
  publish(strided);
  EXPECT_LT(StatusBytes("VmRSS") - rss_before, largest) << "memory stayed allocated";

  // And the bytes are the packed image.
  auto update = (*sub)->WaitForVersion(version, kTimeout);
  ASSERT_TRUE(update.ok()) << update.status();
  for (int t = 0; t < kTensors; ++t) {
    const TensorView* v = (*update)->Find(strided[t].name);
    ASSERT_NE(v, nullptr);
    ASSERT_EQ(std::memcmp(v->data, packed[t].data(), packed[t].size() * 4), 0) << v->name;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, StridedMemoryTest, ::testing::Values("disk", "ucx"));

}  // namespace
}  // namespace weightbus
