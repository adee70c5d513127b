// SPDX-License-Identifier: Apache-2.0
#include "test_model.h"

#include <algorithm>
#include <cstring>

#include "test_support.h"

namespace weightbus::testing {

TensorView OwnedTensor::View() const {
  TensorView v;
  v.name = name;
  v.dtype = dtype;
  v.shape = shape;
  v.data = bytes.data();
  return v;
}

std::vector<OwnedTensor> MakeVersion(uint64_t seed, uint64_t version, uint64_t approx_bytes) {
  struct Spec {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  const int64_t rows = std::max<int64_t>(4, static_cast<int64_t>(approx_bytes / (2 * 2 * 1024)));
  std::vector<Spec> specs = {
      {"model.embed_tokens.weight", DType::kBF16, {rows, 1024}},
      {"model.layers.0.self_attn.q_proj.weight", DType::kBF16, {64, 64}},
      {"model.layers.0.self_attn.q_proj.bias", DType::kF32, {64}},
      {"model.norm.weight", DType::kF16, {65}},
      {"scalar.step", DType::kI64, {}},
      {"empty.rows", DType::kF32, {0, 7}},
      {"mask", DType::kBool, {3, 5}},
      {"fp8.e4m3", DType::kF8E4M3, {17}},
      {"fp8.e5m2", DType::kF8E5M2, {3, 3}},
      {"u8", DType::kU8, {11}},
      {"i8", DType::kI8, {2, 3}},
      {"u16", DType::kU16, {5}},
      {"i16", DType::kI16, {5}},
      {"u32", DType::kU32, {3}},
      {"i32", DType::kI32, {3}},
      {"u64", DType::kU64, {2}},
      {"f64", DType::kF64, {2, 2}},
      {"mx.scales", DType::kF8E8M0, {4}},
      {"fp8.e4m3fnuz", DType::kF8E4M3FNUZ, {5}},
      {"fp8.e5m2fnuz", DType::kF8E5M2FNUZ, {3}},
      {"rotary.freqs", DType::kC64, {7}},
      {"mx4.blocks", DType::kF4, {8, 4}},
      {"mx6.e2m3", DType::kF6E2M3, {16, 8}},
      {"mx6.e3m2", DType::kF6E3M2, {4}},
      {"names/with spaces & ünïcödé ✓ " + std::string(300, 'x'), DType::kF32, {2}},
  };
  std::vector<OwnedTensor> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    OwnedTensor t;
    t.name = specs[i].name;
    t.dtype = specs[i].dtype;
    t.shape = specs[i].shape;
    t.bytes = RandomBytes(static_cast<size_t>(*ByteSize(t.dtype, t.shape)),
                          seed * 1000003 + version * 1009 + i);
    if (t.dtype == DType::kBool) {
      for (std::byte& b : t.bytes) b = static_cast<std::byte>(static_cast<uint8_t>(b) & 1);
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<OwnedTensor> MakeDriftVersion(uint64_t seed, uint64_t version, uint64_t approx_bytes) {
  std::vector<OwnedTensor> out = MakeVersion(seed, 1, approx_bytes);
  if (version <= 1) return out;
  for (size_t i = 0; i < out.size(); ++i) {
    std::vector<std::byte>& bytes = out[i].bytes;
    if (bytes.empty()) continue;
    const size_t flips = std::max<size_t>(1, bytes.size() / 256);
    const std::vector<std::byte> at =
        RandomBytes(8 * flips, (seed * 1000003 + version * 1009 + i) ^ 0x5eed);
    for (size_t k = 0; k < flips; ++k) {
      uint64_t r = 0;
      std::memcpy(&r, at.data() + 8 * k, 8);
      bytes[r % bytes.size()] ^= std::byte{1};  // a bool stays 0 or 1
    }
  }
  return out;
}

std::vector<TensorView> Views(const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorView> v;
  for (const OwnedTensor& t : tensors) v.push_back(t.View());
  return v;
}

}  // namespace weightbus::testing
