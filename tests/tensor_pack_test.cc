// SPDX-License-Identifier: Apache-2.0
// Strided packing (core/tensor_pack.h): PackStridedRange's windows of a strided tensor's packed
// image equal that slice of PackStrided's output, for transposed, negative, zero and padded
// strides and every element size, with windows that start and end inside elements; PackStrided
// and UnpackStrided are inverse; UTF-8 validation of names.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "core/tensor_pack.h"

namespace weightbus::internal {
namespace {

struct Layout {
  std::vector<int64_t> shape, strides;  // strides in elements
  int64_t first = 0;                    // element [0..0]'s offset in the source buffer
  int64_t span = 1;                     // elements the source buffer needs
};

// A random layout: a permutation of padded row-major strides, some negated or zeroed.
Layout RandomLayout(std::mt19937_64& rng) {
  Layout l;
  const int rank = static_cast<int>(rng() % 4) + 1;
  for (int d = 0; d < rank; ++d) l.shape.push_back(static_cast<int64_t>(rng() % 6) + 1);
  std::vector<int64_t> padded(rank);
  int64_t s = 1;
  for (int d = rank; d-- > 0;) {
    padded[d] = s;
    s *= l.shape[d] + static_cast<int64_t>(rng() % 2);
  }
  std::vector<int> perm(rank);
  for (int d = 0; d < rank; ++d) perm[d] = d;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int d = 0; d < rank; ++d) {
    int64_t stride = padded[perm[d]];
    if (rng() % 5 == 0) stride = -stride;
    if (rng() % 9 == 0) stride = 0;
    l.strides.push_back(stride);
  }
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < rank; ++d) {
    const int64_t reach = (l.shape[d] - 1) * l.strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  l.first = -lo;
  l.span = hi - lo + 1;
  return l;
}

TEST(TensorPackTest, EveryWindowOfAStridedTensorMatchesItsPackedImage) {
  std::mt19937_64 rng(20261201);
  for (int trial = 0; trial < 400; ++trial) {
    const Layout l = RandomLayout(rng);
    const size_t es = size_t{1} << (rng() % 4);  // 1, 2, 4, 8 bytes
    std::vector<std::byte> source(static_cast<size_t>(l.span) * es);
    for (auto& b : source) b = static_cast<std::byte>(rng());
    const void* element0 = source.data() + l.first * static_cast<int64_t>(es);
    uint64_t n = es;
    for (int64_t d : l.shape) n *= static_cast<uint64_t>(d);
    std::vector<std::byte> whole(n);
    PackStrided(element0, es, l.shape, l.strides, whole.data());
    for (int w = 0; w < 20; ++w) {
      const uint64_t first = rng() % n;
      const uint64_t count = rng() % (n - first + 1);
      std::vector<std::byte> window(count + 1, std::byte{0x5a});
      PackStridedRange(element0, es, l.shape, l.strides, first, count, window.data());
      ASSERT_EQ(std::memcmp(window.data(), whole.data() + first, count), 0)
          << absl::StrFormat("trial %d: bytes [%d, %d) of %d", trial, first, first + count, n);
      ASSERT_EQ(window[count], std::byte{0x5a}) << "wrote past the window";
    }
    // Windows that tile the image reproduce it exactly.
    std::vector<std::byte> tiled(n);
    for (uint64_t at = 0, step = 1 + rng() % 7; at < n; at += step) {
      PackStridedRange(element0, es, l.shape, l.strides, at, std::min(step, n - at),
                       tiled.data() + at);
    }
    ASSERT_EQ(tiled, whole) << "trial " << trial;
  }
}

TEST(TensorPackTest, ZeroDimensionalAndRowMajorDefaults) {
  const double scalar = 2.5;
  std::byte out[8];
  PackStridedRange(&scalar, 8, {}, {}, 3, 5, out);
  EXPECT_EQ(std::memcmp(out, reinterpret_cast<const std::byte*>(&scalar) + 3, 5), 0);
  const int32_t m[2][3] = {{1, 2, 3}, {4, 5, 6}};
  int32_t row[3];
  PackStridedRange(m, 4, {2, 3}, {}, 12, 12, reinterpret_cast<std::byte*>(row));
  EXPECT_EQ(row[0], 4);
  EXPECT_EQ(row[2], 6);
}

TEST(TensorPackTest, PackAndUnpackAreInverseForAnyStrides) {
  // A 2x3x4 int32 tensor viewed with permuted axes and a reversed middle axis.
  std::vector<int32_t> base(24);
  std::iota(base.begin(), base.end(), 0);
  const std::vector<int64_t> shape = {4, 3, 2};      // permute (2, 1, 0)
  const std::vector<int64_t> strides = {1, -4, 12};  // middle axis reversed
  const int32_t* origin = base.data() + 8;           // element [0, 0, 0] = base[0*1 + 2*4]
  std::vector<int32_t> packed(24);
  PackStrided(origin, 4, shape, strides, reinterpret_cast<std::byte*>(packed.data()));
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t j = 0; j < 3; ++j) {
      for (int64_t k = 0; k < 2; ++k) {
        EXPECT_EQ(packed[(i * 3 + j) * 2 + k], origin[i * 1 + j * -4 + k * 12]);
      }
    }
  }
  std::vector<int32_t> back(24, -1);
  UnpackStrided(reinterpret_cast<const std::byte*>(packed.data()), 4, shape, strides,
                back.data() + 8);
  EXPECT_EQ(back, base);
  // 0-d and zero-size shapes.
  int64_t scalar = 42, out = 0;
  PackStrided(&scalar, 8, {}, {}, reinterpret_cast<std::byte*>(&out));
  EXPECT_EQ(out, 42);
  PackStrided(nullptr, 4, {0, 3}, {3, 1}, nullptr);  // nothing to touch
}

// Publish refuses what every parser would refuse (types.hpp limits): a name of more than
// kMaxTensorNameBytes bytes and a shape of rank above kMaxRank, each at the limit accepted.
TEST(TensorPackTest, ValidateViewAppliesTheNameAndRankLimits) {
  uint8_t byte = 7;
  TensorView view{std::string(kMaxTensorNameBytes + 1, 'n'), DType::kU8, {1}, {}, &byte};
  absl::StatusOr<uint64_t> v = ValidateView(view);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(v.status().message()),
            absl::StrFormat("tensor name \"%s...\" is 4097 bytes long, more than the limit of 4096",
                            std::string(64, 'n')));
  view.name.pop_back();
  EXPECT_TRUE(ValidateView(view).ok());
  view.name = "w";
  view.shape.assign(kMaxRank + 1, 1);
  v = ValidateView(view);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(v.status().message()),
            "tensor \"w\" has a shape of rank 65, more than the limit of 64");
  view.shape.pop_back();
  EXPECT_TRUE(ValidateView(view).ok());
}

TEST(TensorPackTest, Utf8Validation) {
  size_t at = 0;
  EXPECT_TRUE(IsValidUtf8("plain.ascii/name with spaces"));
  EXPECT_TRUE(IsValidUtf8("ünïcödé ✓ 😀"));
  EXPECT_FALSE(IsValidUtf8("a\xff", &at));
  EXPECT_EQ(at, 1u);
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // surrogate
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xe2\x9c"));          // truncated
}

}  // namespace
}  // namespace weightbus::internal
