// SPDX-License-Identifier: Apache-2.0
#include "weightbus/synthetic_model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "weightbus/bf16.h"
#include "weightbus/random.h"

namespace weightbus::tools {
namespace {

enum class Init { kNormal, kZero, kOne };

Init InitFor(const std::string& name) {
  if (absl::EndsWith(name, ".bias")) return Init::kZero;
  if (absl::StrContains(name, "norm")) return Init::kOne;
  return Init::kNormal;
}

// Writes elements [begin, begin + n) of a tensor to dst[0, n) (Box-Muller over splitmix64,
// keyed by (tensor key, pair index) so any split of the work gives the same values).
void Fill(float* dst, size_t begin, size_t n, Init init, uint64_t key) {
  if (init != Init::kNormal) {
    std::fill(dst, dst + n, init == Init::kOne ? 1.0f : 0.0f);
    return;
  }
  for (size_t i = begin; i < begin + n; ++i) {
    const uint64_t pair = i / 2;
    const uint64_t a = SplitMix64(key ^ (2 * pair)), b = SplitMix64(key ^ (2 * pair + 1));
    const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1)) * 0.02;
    dst[i - begin] = static_cast<float>((i % 2 == 0) ? r * std::cos(2 * M_PI * u2)
                                                     : r * std::sin(2 * M_PI * u2));
  }
}

}  // namespace

absl::StatusOr<std::vector<ShapeSpec>> ReadShapes(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrFormat("cannot open shapes file %s", path));
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.contains("tensors") || !j["tensors"].is_object()) {
    return absl::DataLossError(absl::StrFormat("%s has no \"tensors\" object", path));
  }
  std::vector<ShapeSpec> out;
  for (const auto& [name, shape] : j["tensors"].items()) {
    ShapeSpec s{name, {}};
    if (!shape.is_array()) return absl::DataLossError(absl::StrFormat("%s: %s", path, name));
    for (const auto& d : shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return absl::DataLossError(absl::StrFormat("%s: bad shape for %s", path, name));
      }
      s.shape.push_back(d.get<int64_t>());
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<ShapeSpec> ScaleShapes(std::vector<ShapeSpec> shapes, double fraction) {
  for (ShapeSpec& s : shapes) {
    if (!s.shape.empty()) {
      s.shape[0] = std::max<int64_t>(1, static_cast<int64_t>(std::llround(s.shape[0] * fraction)));
    }
  }
  return shapes;
}

absl::StatusOr<std::vector<OwnedTensor>> MakeSyntheticModel(const std::vector<ShapeSpec>& shapes,
                                                            DType dtype, uint64_t seed,
                                                            int threads) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("synthetic models are F32 or BF16, not %s", DTypeName(dtype)));
  }
  std::vector<OwnedTensor> out(shapes.size());
  struct Piece {
    size_t tensor, begin, n;
  };
  std::vector<Piece> pieces;
  constexpr size_t kPiece = size_t{1} << 20;
  for (size_t t = 0; t < shapes.size(); ++t) {
    size_t n = 1;
    for (int64_t d : shapes[t].shape) n *= static_cast<size_t>(d);
    out[t].name = shapes[t].name;
    out[t].dtype = dtype;
    out[t].shape = shapes[t].shape;
    out[t].bytes.resize(n * DTypeSize(dtype));
    for (size_t b = 0; b < n; b += kPiece) pieces.push_back({t, b, std::min(kPiece, n - b)});
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    std::vector<float> scratch;
    for (size_t p; (p = next.fetch_add(1)) < pieces.size();) {
      const Piece& pc = pieces[p];
      OwnedTensor& t = out[pc.tensor];
      const uint64_t key = SplitMix64(seed ^ SplitMix64(pc.tensor + 1));
      const Init init = InitFor(t.name);
      if (dtype == DType::kF32) {
        Fill(reinterpret_cast<float*>(t.bytes.data()) + pc.begin, pc.begin, pc.n, init, key);
        continue;
      }
      scratch.resize(pc.n);
      Fill(scratch.data(), pc.begin, pc.n, init, key);
      for (size_t i = 0; i < pc.n; ++i) {
        const uint16_t h = FloatToBf16(scratch[i]);
        std::memcpy(t.bytes.data() + 2 * (pc.begin + i), &h, 2);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (std::thread& th : pool) th.join();
  return out;
}

}  // namespace weightbus::tools
