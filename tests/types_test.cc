// SPDX-License-Identifier: Apache-2.0
#include "weightbus/types.hpp"

#include <gtest/gtest.h>

namespace weightbus {
namespace {

TEST(DTypeTest, NamesRoundTripAndSizesMatchSafetensors) {
  const std::map<std::string, size_t> expected = {
      {"BOOL", 1}, {"U8", 1},   {"I8", 1},  {"U16", 2},     {"I16", 2},
      {"F16", 2},  {"BF16", 2}, {"U32", 4}, {"I32", 4},     {"F32", 4},
      {"U64", 8},  {"I64", 8},  {"F64", 8}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  ASSERT_EQ(kAllDTypes.size(), expected.size());
  for (DType dtype : kAllDTypes) {
    std::string name(DTypeName(dtype));
    ASSERT_TRUE(expected.count(name)) << name;
    EXPECT_EQ(DTypeSize(dtype), expected.at(name)) << name;
    absl::StatusOr<DType> parsed = DTypeFromName(name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, dtype);
  }
}

TEST(DTypeTest, UnknownNameIsInvalidArgumentListingNames) {
  absl::StatusOr<DType> parsed = DTypeFromName("bf16");
  ASSERT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("\"bf16\""), absl::string_view::npos);
  EXPECT_NE(parsed.status().message().find("BF16"), absl::string_view::npos);
}

TEST(ShapeTest, ElementsAndBytes) {
  EXPECT_EQ(*NumElements({}), 1);
  EXPECT_EQ(*NumElements({0, 5}), 0);
  EXPECT_EQ(*NumElements({3, 4}), 12);
  EXPECT_EQ(*ByteSize(DType::kBF16, {3, 4}), 24u);
  EXPECT_EQ(NumElements({2, -1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NumElements({int64_t{1} << 40, int64_t{1} << 40}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ByteSize(DType::kF64, {int64_t{1} << 62}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShapeString({}), "[]");
  EXPECT_EQ(ShapeString({2, 3}), "[2, 3]");
}

TEST(ShapeTest, Contiguity) {
  EXPECT_TRUE(IsContiguous({2, 3}, {}));
  EXPECT_TRUE(IsContiguous({2, 3}, {3, 1}));
  EXPECT_FALSE(IsContiguous({2, 3}, {1, 2}));  // transposed
  EXPECT_TRUE(IsContiguous({1, 3}, {99, 1}));  // size-1 dims carry any stride
  EXPECT_TRUE(IsContiguous({0, 3}, {7, 7}));   // zero-size
  EXPECT_FALSE(IsContiguous({4}, {2}));        // every other element
  EXPECT_FALSE(IsContiguous({2, 3}, {1}));     // rank mismatch
}

}  // namespace
}  // namespace weightbus
