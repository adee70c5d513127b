// SPDX-License-Identifier: Apache-2.0
#include "weightbus/update_stream.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "weightbus/bf16.h"

namespace weightbus::tools {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Standard normal samples from a counter-based stream (splitmix64 + Box-Muller).
class Normal {
 public:
  explicit Normal(uint64_t key) : state_(SplitMix64(key)) {}
  float Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // Two uniforms in (0, 1] from the top 53 bits.
    const double u1 = (static_cast<double>(SplitMix64(state_++) >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(SplitMix64(state_++) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double theta = 2.0 * M_PI * u2;
    spare_ = static_cast<float>(r * std::sin(theta));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(theta));
  }

 private:
  uint64_t state_;
  float spare_ = 0;
  bool has_spare_ = false;
};

uint64_t Key(uint64_t seed, uint64_t tensor, uint64_t step) {
  return SplitMix64(SplitMix64(SplitMix64(seed) ^ tensor) ^ step);
}

}  // namespace

absl::StatusOr<UpdateStream> UpdateStream::Create(const std::vector<OwnedTensor>& master,
                                                  const AdamOptions& options) {
  UpdateStream s;
  s.options_ = options;
  for (const OwnedTensor& t : master) {
    if (t.dtype != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "update stream: master tensor \"%s\" is %s, expected F32", t.name, DTypeName(t.dtype)));
    }
    s.master_.push_back(t);
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
  for (size_t t = 0; t < master_.size(); ++t) {
    float* w = reinterpret_cast<float*>(master_[t].bytes.data());
    float* m = m_[t].data();
    float* v = v_[t].data();
    const size_t n = m_[t].size();
    Normal fresh(Key(options_.seed, t, step_));
    Normal persistent(Key(options_.seed, t, 0));  // the same draws every step
    for (size_t i = 0; i < n; ++i) {
      const float g = noise * fresh.Next() + signal * persistent.Next();
      m[i] = static_cast<float>(b1) * m[i] + static_cast<float>(1.0 - b1) * g;
      v[i] = static_cast<float>(b2) * v[i] + static_cast<float>(1.0 - b2) * g * g;
      w[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
    }
  }
}

std::vector<OwnedTensor> UpdateStream::Bf16() const {
  std::vector<OwnedTensor> out;
  out.reserve(master_.size());
  for (const OwnedTensor& t : master_) {
    OwnedTensor b;
    b.name = t.name;
    b.dtype = DType::kBF16;
    b.shape = t.shape;
    const size_t n = t.bytes.size() / 4;
    b.bytes.resize(n * 2);
    const float* src = reinterpret_cast<const float*>(t.bytes.data());
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = FloatToBf16(src[i]);
      std::memcpy(b.bytes.data() + 2 * i, &h, 2);
    }
    out.push_back(std::move(b));
  }
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

}  // namespace weightbus::tools
