// SPDX-License-Identifier: Apache-2.0
#include "weightbus/update_stream.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/str_format.h"
#include "weightbus/bf16.h"
#include "weightbus/random.h"

namespace weightbus::tools {
namespace {

// Elements per unit of parallel work (even, so that Box-Muller pairs never straddle units).
constexpr size_t kBlock = size_t{1} << 14;

// ln(x) for x in (0, 1], to about 1e-7 relative: x = m * 2^e with m in [sqrt(1/2), sqrt(2)),
// ln(m) = 2 atanh(t) with t = (m - 1) / (m + 1), |t| < 0.172, by its series to t^9.
inline float FastLog(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  int32_t e = static_cast<int32_t>(bits >> 23) - 127;
  float m = std::bit_cast<float>((bits & 0x7fffffu) | 0x3f800000u);  // [1, 2)
  const int big = m > 1.41421356f;  // arithmetic rather than branches: vectorizes
  m *= 1.0f - 0.5f * static_cast<float>(big);
  e += big;
  const float t = (m - 1.0f) / (m + 1.0f);
  const float t2 = t * t;
  const float series =
      t * (2.0f + t2 * (2.0f / 3 + t2 * (2.0f / 5 + t2 * (2.0f / 7 + t2 * (2.0f / 9)))));
  return series + static_cast<float>(e) * 0.69314718f;
}

}  // namespace

void StandardNormals(uint64_t key, uint64_t begin, size_t n, float* out) {
  constexpr size_t kChunk = 256;  // pairs per pass
  float u1[kChunk], u2[kChunk];
  for (size_t done = 0; done < n; done += 2 * kChunk) {
    const size_t pairs = std::min(kChunk, (n - done) / 2);
    const uint64_t first = (begin + done) / 2;
    for (size_t p = 0; p < pairs; ++p) {
      const uint64_t h = SplitMix64(key + (first + p) * 0x9e3779b97f4a7c15ULL);
      // (0, 1] and [0, 1) with 24-bit resolution.
      u1[p] = (static_cast<float>(static_cast<uint32_t>(h >> 40)) + 1.0f) * 0x1.0p-24f;
      u2[p] = static_cast<float>(static_cast<uint32_t>(h >> 8) & 0xffffffu) * 0x1.0p-24f;
    }
    float* o = out + done;
    for (size_t p = 0; p < pairs; ++p) {
      const float r = std::sqrt(-2.0f * FastLog(u1[p]));
      // theta = 2 pi u2 = q pi/2 + a, quadrant q = round(4 u2), |a| <= pi/4.
      const int quadrant_index = static_cast<int>(4.0f * u2[p] + 0.5f);
      const float q = static_cast<float>(quadrant_index);
      const float a = (u2[p] - 0.25f * q) * 6.28318531f;
      const float a2 = a * a;
      // Taylor series to a^9 and a^8: errors below 4e-7 for |a| <= pi/4.
      const float s =
          a * (1.0f +
               a2 * (-1.0f / 6 + a2 * (1.0f / 120 + a2 * (-1.0f / 5040 + a2 * (1.0f / 362880)))));
      const float c =
          1.0f + a2 * (-0.5f + a2 * (1.0f / 24 + a2 * (-1.0f / 720 + a2 * (1.0f / 40320))));
      // Rotation by q quarter turns: (c, s), (-s, c), (-c, -s), (s, -c), without branches.
      const float swap = static_cast<float>(quadrant_index & 1);
      const float cos_sign = 1.0f - 2.0f * static_cast<float>(((quadrant_index + 1) >> 1) & 1);
      const float sin_sign = 1.0f - 2.0f * static_cast<float>((quadrant_index >> 1) & 1);
      const float cos_t = cos_sign * (c + swap * (s - c));
      const float sin_t = sin_sign * (s + swap * (c - s));
      o[2 * p] = r * cos_t;
      o[2 * p + 1] = r * sin_t;
    }
  }
}

namespace {

uint64_t Key(uint64_t seed, uint64_t tensor, uint64_t step) {
  return SplitMix64(SplitMix64(SplitMix64(seed) ^ tensor) ^ step);
}

// Runs fn(task) for task in [0, n) on `threads` threads.
template <typename F>
void ParallelFor(size_t n, int threads, const F& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads && static_cast<size_t>(i) < n; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

int Threads(int requested) {
  if (requested > 0) return requested;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

absl::StatusOr<UpdateStream> UpdateStream::Create(const std::vector<OwnedTensor>& master,
                                                  const AdamOptions& options) {
  return Create(std::vector<OwnedTensor>(master), options);
}

absl::StatusOr<UpdateStream> UpdateStream::Create(std::vector<OwnedTensor>&& master,
                                                  const AdamOptions& options) {
  UpdateStream s;
  s.options_ = options;
  for (const OwnedTensor& t : master) {
    if (t.dtype != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "update stream: master tensor \"%s\" is %s, expected F32", t.name, DTypeName(t.dtype)));
    }
  }
  s.master_ = std::move(master);
  for (const OwnedTensor& t : s.master_) {
    const size_t n = t.bytes.size() / 4;
    s.m_.emplace_back(n, 0.0f);
    s.v_.emplace_back(n, 0.0f);
  }
  return s;
}

void UpdateStream::Step() {
  ++step_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step_));
  const float step_size = static_cast<float>(options_.lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float noise = static_cast<float>(options_.grad_scale);
  const float signal = static_cast<float>(options_.grad_scale * options_.snr);
  const float eps = static_cast<float>(options_.eps);
  const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
  const float gb1 = static_cast<float>(1.0 - b1), gb2 = static_cast<float>(1.0 - b2);
  struct Task {
    size_t tensor, begin, n;
  };
  std::vector<Task> tasks;
  for (size_t t = 0; t < master_.size(); ++t) {
    const size_t n = m_[t].size();
    for (size_t b = 0; b < n; b += kBlock) tasks.push_back({t, b, std::min(kBlock, n - b)});
  }
  ParallelFor(tasks.size(), Threads(options_.threads), [&](size_t k) {
    const Task& task = tasks[k];
    const size_t even = (task.n + 1) & ~size_t{1};
    std::vector<float> fresh(even), persistent(even);
    StandardNormals(Key(options_.seed, task.tensor, step_), task.begin, even, fresh.data());
    StandardNormals(Key(options_.seed, task.tensor, 0), task.begin, even, persistent.data());
    float* w = reinterpret_cast<float*>(master_[task.tensor].bytes.data()) + task.begin;
    float* m = m_[task.tensor].data() + task.begin;
    float* v = v_[task.tensor].data() + task.begin;
    for (size_t i = 0; i < task.n; ++i) {
      const float g = noise * fresh[i] + signal * persistent[i];
      m[i] = fb1 * m[i] + gb1 * g;
      v[i] = fb2 * v[i] + gb2 * g * g;
      w[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
    }
  });
}

void UpdateStream::Bf16Into(std::vector<OwnedTensor>* out) const {
  out->resize(master_.size());
  struct Task {
    size_t tensor, begin, n;
  };
  std::vector<Task> tasks;
  for (size_t t = 0; t < master_.size(); ++t) {
    OwnedTensor& b = (*out)[t];
    b.name = master_[t].name;
    b.dtype = DType::kBF16;
    b.shape = master_[t].shape;
    const size_t n = master_[t].bytes.size() / 4;
    b.bytes.resize(n * 2);
    for (size_t i = 0; i < n; i += kBlock) tasks.push_back({t, i, std::min(kBlock, n - i)});
  }
  ParallelFor(tasks.size(), Threads(options_.threads), [&](size_t k) {
    const Task& task = tasks[k];
    const float* src = reinterpret_cast<const float*>(master_[task.tensor].bytes.data());
    std::byte* dst = (*out)[task.tensor].bytes.data();
    for (size_t i = task.begin; i < task.begin + task.n; ++i) {
      const uint16_t h = FloatToBf16(src[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  });
}

std::vector<OwnedTensor> UpdateStream::Bf16() const {
  std::vector<OwnedTensor> out;
  Bf16Into(&out);
  return out;
}

double ChangedFraction(const std::vector<OwnedTensor>& a, const std::vector<OwnedTensor>& b) {
  uint64_t changed = 0, total = 0;
  for (size_t t = 0; t < a.size() && t < b.size(); ++t) {
    const size_t elem = DTypeSize(a[t].dtype);
    const size_t n = std::min(a[t].bytes.size(), b[t].bytes.size()) / elem;
    for (size_t i = 0; i < n; ++i) {
      changed += std::memcmp(a[t].bytes.data() + i * elem, b[t].bytes.data() + i * elem, elem) != 0;
    }
    total += n;
  }
  return total == 0 ? 0.0 : static_cast<double>(changed) / static_cast<double>(total);
}

StepStatistics CompareVersions(const std::vector<OwnedTensor>& before,
                               const std::vector<OwnedTensor>& after) {
  StepStatistics s;
  // Counts of new values and of changes: flat arrays for 1- and 2-byte elements (the usual
  // case, and 494M of them must be quick), maps otherwise.
  std::vector<uint64_t> values16(65536), changes16(65536);
  std::map<uint64_t, uint64_t> values, changes;
  for (size_t t = 0; t < before.size() && t < after.size(); ++t) {
    const size_t w = DTypeSize(after[t].dtype);
    const size_t n = std::min(before[t].bytes.size(), after[t].bytes.size()) / w;
    const std::byte* a = before[t].bytes.data();
    const std::byte* b = after[t].bytes.data();
    s.elements += n;
    if (w == 2) {
      for (size_t i = 0; i < n; ++i) {
        uint16_t x, y;
        std::memcpy(&x, a + 2 * i, 2);
        std::memcpy(&y, b + 2 * i, 2);
        if (x == y) continue;
        ++values16[y];
        ++changes16[static_cast<uint16_t>(y - x)];
        ++s.changed;
      }
      continue;
    }
    const uint64_t mask = w == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * w)) - 1;
    for (size_t i = 0; i < n; ++i) {
      uint64_t x = 0, y = 0;
      std::memcpy(&x, a + i * w, w);
      std::memcpy(&y, b + i * w, w);
      if (x == y) continue;
      ++values[y];
      ++changes[(y - x) & mask];
      ++s.changed;
    }
  }
  for (uint64_t v = 0; v < 65536; ++v) {
    if (values16[v] > 0) values[v] += values16[v];
    if (changes16[v] > 0) changes[v] += changes16[v];
  }
  auto entropy = [&](const std::map<uint64_t, uint64_t>& counts) {
    double h = 0;
    for (const auto& [value, c] : counts) {
      const double p = static_cast<double>(c) / static_cast<double>(s.changed);
      h -= p * std::log2(p);
    }
    return h;
  };
  if (s.elements > 0 && s.changed > 0) {
    const double p = static_cast<double>(s.changed) / static_cast<double>(s.elements);
    s.mask_bits = p >= 1 ? 0 : -(p * std::log2(p) + (1 - p) * std::log2(1 - p));
    s.value_bits = entropy(values);
    s.change_bits = entropy(changes);
  }
  return s;
}

}  // namespace weightbus::tools
