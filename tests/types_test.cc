// SPDX-License-Identifier: Apache-2.0
#include "weightbus/types.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "nlohmann/json.hpp"
#include "weightbus/manifest.hpp"

namespace weightbus {
namespace {

// Issue 10, item 14: every dtype of safetensors' Dtype enum (safetensors/src/tensor.rs: BOOL,
// F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16,
// F16, BF16, I32, U32, F32, C64, F64, I64, U64) with its bit size (Dtype::bitsize).
TEST(DTypeTest, NamesRoundTripAndSizesMatchSafetensors) {
  const std::map<std::string, size_t> bits = {
      {"BOOL", 8},        {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},
      {"I8", 8},          {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},
      {"F8_E5M2FNUZ", 8}, {"I16", 16},    {"U16", 16},    {"F16", 16},    {"BF16", 16},
      {"I32", 32},        {"U32", 32},    {"F32", 32},    {"C64", 64},    {"F64", 64},
      {"I64", 64},        {"U64", 64}};
  ASSERT_EQ(kAllDTypes.size(), bits.size());
  for (DType dtype : kAllDTypes) {
    std::string name(DTypeName(dtype));
    ASSERT_TRUE(bits.count(name)) << name;
    EXPECT_EQ(DTypeBits(dtype), bits.at(name)) << name;
    EXPECT_EQ(DTypeSize(dtype), (bits.at(name) + 7) / 8) << name;
    EXPECT_EQ(IsSubByte(dtype), bits.at(name) % 8 != 0) << name;
    absl::StatusOr<DType> parsed = DTypeFromName(name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, dtype);
  }
}

// Sub-byte tensors: a whole number of bytes (safetensors refuses the rest as misaligned).
TEST(DTypeTest, SubByteTensorsHoldWholeBytes) {
  EXPECT_EQ(*ByteSize(DType::kF4, {2, 3}), 3u);
  EXPECT_EQ(*ByteSize(DType::kF4, {0}), 0u);
  EXPECT_EQ(*ByteSize(DType::kF6E2M3, {4}), 3u);
  EXPECT_EQ(*ByteSize(DType::kF6E3M2, {2, 8}), 12u);
  EXPECT_EQ(*ByteSize(DType::kC64, {3}), 24u);
  EXPECT_EQ(*ByteSize(DType::kF8E8M0, {5}), 5u);
  for (auto [dtype, shape] : std::vector<std::pair<DType, std::vector<int64_t>>>{
           {DType::kF4, {3}}, {DType::kF4, {}}, {DType::kF6E2M3, {2}}, {DType::kF6E3M2, {1, 5}}}) {
    absl::StatusOr<uint64_t> n = ByteSize(dtype, shape);
    ASSERT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << DTypeName(dtype);
    EXPECT_NE(n.status().message().find("not a whole number of bytes"), absl::string_view::npos)
        << n.status();
    EXPECT_NE(std::string(n.status().message()).find(DTypeName(dtype)), std::string::npos)
        << n.status();
  }
  // 2^62 F4 elements are 2^61 bytes: no overflow on the way.
  EXPECT_EQ(*ByteSize(DType::kF4, {int64_t{1} << 62}), uint64_t{1} << 61);
  EXPECT_EQ(*ByteSize(DType::kF64, {int64_t{1} << 60}), uint64_t{1} << 63);
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

// Issue 10, item 16: integer fields of a manifest holding a float, a fraction, a value beyond 64
// bits, a negative value where none is allowed, or a string are DataLoss naming the field (they
// were converted with undefined behaviour, fractions silently truncated).
namespace manifest_integers {

using nlohmann::ordered_json;

ordered_json GoodManifest() {
  Manifest m;
  m.version = 7;
  m.publisher = PublisherIdentity{"host", 1234, 0, 2, "trainer"};
  m.publish_start_unix_ns = 1700000000000000000;
  m.sealed_unix_ns = 1700000000000000001;
  TensorInfo t;
  t.name = "w";
  t.dtype = DType::kBF16;
  t.shape = {2, 3};
  t.nbytes = 12;
  t.xxh3 = 0x0123456789abcdefULL;
  t.shard = Shard{{4, 3}, {2, 0}};
  m.tensors.push_back(t);
  return ordered_json::parse(m.ToJson());
}

// JSON texts of the values every integer field is tried with.
const std::vector<std::string>& BadValues() {
  static const std::vector<std::string> v = {"1.5",   "1e30", "-1", "18446744073709551616",
                                             "\"7\"", "2.0"};
  return v;
}

// Sets the field at `path` (object keys and array indices) to the JSON text `value`.
std::string WithField(const std::vector<std::variant<std::string, size_t>>& path,
                      const std::string& value) {
  ordered_json j = GoodManifest();
  ordered_json* at = &j;
  for (const auto& p : path) {
    at = std::holds_alternative<std::string>(p) ? &(*at)[std::get<std::string>(p)]
                                                : &(*at)[std::get<size_t>(p)];
  }
  *at = ordered_json::parse(value);
  return j.dump();
}

struct Field {
  std::vector<std::variant<std::string, size_t>> path;
  std::string name;        // as the error names it
  bool signed_64 = false;  // -1 is a valid value
};

TEST(ManifestIntegerFieldsTest, FloatsFractionsOutOfRangeAndStringsAreDataLossNamingTheField) {
  ASSERT_TRUE(Manifest::FromJson(GoodManifest().dump(), "good").ok());
  const std::vector<Field> fields = {
      {{"version"}, ".version"},
      {{"publisher", "pid"}, ".publisher.pid", true},
      {{"publisher", "rank"}, ".publisher.rank"},
      {{"publisher", "world_size"}, ".publisher.world_size"},
      {{"publish_start_unix_ns"}, ".publish_start_unix_ns", true},
      {{"sealed_unix_ns"}, ".sealed_unix_ns", true},
      {{"tensors", size_t{0}, "nbytes"}, ".tensors[0].nbytes"},
      {{"tensors", size_t{0}, "shape", size_t{1}}, ".tensors[0].shape[1]"},
      {{"tensors", size_t{0}, "shard", "global_shape", size_t{0}},
       ".tensors[0].shard.global_shape[0]"},
      {{"tensors", size_t{0}, "shard", "offsets", size_t{0}}, ".tensors[0].shard.offsets[0]"},
  };
  for (const Field& f : fields) {
    for (const std::string& value : BadValues()) {
      SCOPED_TRACE(f.name + " = " + value);
      absl::StatusOr<Manifest> m = Manifest::FromJson(WithField(f.path, value), "test-source");
      if (f.signed_64 && value == "-1") {
        ASSERT_TRUE(m.ok()) << m.status();
        continue;
      }
      EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
      if (m.ok()) continue;
      EXPECT_NE(m.status().message().find("test-source"), absl::string_view::npos) << m.status();
      EXPECT_NE(m.status().message().find("field " + f.name + " "), absl::string_view::npos)
          << m.status();
    }
  }
  // Limits that fit are kept exactly.
  absl::StatusOr<Manifest> big =
      Manifest::FromJson(WithField({"version"}, "18446744073709551615"), "max");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->version, 18446744073709551615ULL);
  absl::StatusOr<Manifest> early =
      Manifest::FromJson(WithField({"publish_start_unix_ns"}, "-9223372036854775808"), "min");
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_EQ(early->publish_start_unix_ns, std::numeric_limits<int64_t>::min());
  absl::StatusOr<Manifest> wide =
      Manifest::FromJson(WithField({"publisher", "rank"}, "2147483648"), "int");
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kDataLoss) << wide.status();
  absl::StatusOr<Manifest> huge_pid =
      Manifest::FromJson(WithField({"publisher", "pid"}, "9223372036854775808"), "pid");
  EXPECT_EQ(huge_pid.status().code(), absl::StatusCode::kDataLoss) << huge_pid.status();
}

// A manifest is read from disk or received from a peer: the limits of types.hpp and the rules
// Publish applies hold for it too, each refused with DataLoss naming the field, the value found
// and the limit or the other side.
// Block checksums (docs/FORMAT.md): written only when recorded, read back exactly, absent in
// older manifests (block_bytes 0), and checked against the tensor's size.
TEST(ManifestBlockChecksumsTest, RoundTripOldManifestsAndMalformedBlocks) {
  const Manifest old = *Manifest::FromJson(GoodManifest().dump(), "old");
  EXPECT_EQ(old.tensors[0].block_bytes, 0u);
  EXPECT_TRUE(old.tensors[0].block_xxh3.empty());
  EXPECT_FALSE(ordered_json::parse(old.ToJson())["tensors"][0].contains("block_bytes"));

  Manifest m = old;
  m.tensors[0].block_bytes = 5;  // 12 bytes: blocks [0, 5), [5, 10), [10, 12)
  m.tensors[0].block_xxh3 = {0x1, 0xfedcba9876543210ULL, 0x0123456789abcdefULL};
  const ordered_json j = ordered_json::parse(m.ToJson());
  EXPECT_EQ(j["tensors"][0]["block_bytes"], 5);
  EXPECT_EQ(j["tensors"][0]["blocks"], "0000000000000001fedcba98765432100123456789abcdef");
  absl::StatusOr<Manifest> back = Manifest::FromJson(m.ToJson(), "blocks");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);

  auto expect = [&](const std::string& key, const ordered_json& value, const std::string& what) {
    ordered_json bad = j;
    bad["tensors"][0][key] = value;
    absl::StatusOr<Manifest> r = Manifest::FromJson(bad.dump(), "b.json");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_EQ(std::string(r.status().message()), "manifest b.json: field .tensors[0]." + what);
  };
  expect("blocks", "0000000000000001fedcba9876543210",
         "blocks has 32 characters, but tensor \"w\" of 12 bytes in blocks of 5 bytes needs 3 "
         "checksums of 16 hex digits");
  expect("blocks", "0000000000000001FEDCBA98765432100123456789abcdef",
         "blocks checksum 1 \"FEDCBA9876543210\" is not 16 hex digits");
  expect("block_bytes", 0, "block_bytes is 0, expected at least 1");
  expect("block_bytes", 2,
         "blocks has 48 characters, but tensor \"w\" of 12 bytes in blocks of 2 bytes needs 6 "
         "checksums of 16 hex digits");
  ordered_json missing = j;
  missing["tensors"][0].erase("blocks");
  EXPECT_EQ(std::string(Manifest::FromJson(missing.dump(), "b.json").status().message()),
            "manifest b.json: field .tensors[0].blocks is missing");
}

// Tiles (checksum format 2): "tile": [rows, bytes] and "tiles", keys older readers ignore (they
// read such a tensor whole); read back exactly, and checked against the tensor's row view.
TEST(ManifestBlockChecksumsTest, TilesRoundTripAndMalformedTilesAreDataLoss) {
  Manifest m = *Manifest::FromJson(GoodManifest().dump(), "old");
  // "w" is BF16 [2, 3]: 2 rows of 6 bytes, in tiles of 1 row x 4 bytes: 2 bands x 2 columns.
  m.tensors[0].block_rows = 1;
  m.tensors[0].block_bytes = 4;
  m.tensors[0].block_xxh3 = {1, 2, 3, 0xfedcba9876543210ULL};
  const ordered_json j = ordered_json::parse(m.ToJson());
  EXPECT_EQ(j["tensors"][0]["tile"], ordered_json::array({1, 4}));
  EXPECT_EQ(j["tensors"][0]["tiles"],
            "000000000000000100000000000000020000000000000003fedcba9876543210");
  EXPECT_FALSE(j["tensors"][0].contains("block_bytes"));
  EXPECT_FALSE(j["tensors"][0].contains("blocks"));
  absl::StatusOr<Manifest> back = Manifest::FromJson(m.ToJson(), "tiles");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);

  auto expect = [&](const std::string& key, const ordered_json& value, const std::string& what) {
    ordered_json bad = j;
    bad["tensors"][0][key] = value;
    absl::StatusOr<Manifest> r = Manifest::FromJson(bad.dump(), "t.json");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_EQ(std::string(r.status().message()), "manifest t.json: field .tensors[0]" + what);
  };
  expect("tiles", "0000000000000001",
         ".tiles has 16 characters, but tensor \"w\" of 2 rows of 6 bytes in tiles of 1 rows x 4 "
         "bytes needs 4 checksums of 16 hex digits");
  expect("tile", ordered_json::array({2, 6}),
         ".tiles has 64 characters, but tensor \"w\" of 2 rows of 6 bytes in tiles of 2 rows x 6 "
         "bytes needs 1 checksums of 16 hex digits");
  expect("tile", ordered_json::array({0, 4}), ".tile[0] is 0, expected at least 1");
  expect("tile", ordered_json::array({1}), ".tile is not [rows, bytes]");
  expect("tile", ordered_json::array({1, -4}), ".tile[1] is -4, outside [0, 18446744073709551615]");
  expect("block_bytes", 4, " has both \"tile\" and \"block_bytes\" (one kind of block checksums)");
}

TEST(ManifestLimitsTest, NamesRanksCountsShardsAndTotalsBeyondTheLimitsAreDataLoss) {
  auto expect = [](const std::string& json, const std::string& message) {
    absl::StatusOr<Manifest> m = Manifest::FromJson(json, "limits.json");
    EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
    EXPECT_EQ(std::string(m.status().message()), message);
  };
  const std::string long_name(kMaxTensorNameBytes + 1, 'n');
  expect(WithField({"tensors", size_t{0}, "name"}, "\"" + long_name + "\""),
         "manifest limits.json: field .tensors[0].name is 4097 bytes long, more than the limit "
         "of 4096 (it starts \"" +
             std::string(64, 'n') + "\")");
  EXPECT_TRUE(Manifest::FromJson(
                  WithField({"tensors", size_t{0}, "name"}, "\"" + long_name.substr(1) + "\""),
                  "at the limit")
                  .ok());
  expect(WithField({"tensors", size_t{0}, "name"}, "\"\""),
         "manifest limits.json: field .tensors[0].name is empty");

  // world_size sizes a reader's per-rank state (a vector of parts): bounded, and rank below it.
  expect(WithField({"publisher", "world_size"}, "65537"),
         "manifest limits.json: field .publisher.world_size is 65537, outside [1, 65536]");
  expect(WithField({"publisher", "world_size"}, "2147483647"),
         "manifest limits.json: field .publisher.world_size is 2147483647, outside [1, 65536]");
  expect(WithField({"publisher", "world_size"}, "0"),
         "manifest limits.json: field .publisher.world_size is 0, outside [1, 65536]");
  expect(WithField({"publisher", "rank"}, "2"),
         "manifest limits.json: field .publisher.rank is 2, not a rank below world_size 2");
  EXPECT_TRUE(
      Manifest::FromJson(WithField({"publisher", "world_size"}, "65536"), "at the limit").ok());

  ordered_json two = GoodManifest();
  two["tensors"].push_back(two["tensors"][0]);
  expect(two.dump(),
         "manifest limits.json: field .tensors[1].name \"w\" is also the name of .tensors[0]");

  std::string dims = "[1";
  for (size_t d = 1; d <= kMaxRank; ++d) dims += ",1";
  dims += "]";
  expect(WithField({"tensors", size_t{0}, "shape"}, dims),
         "manifest limits.json: field .tensors[0].shape has 65 dimensions, more than the limit "
         "of 64");

  ordered_json many = GoodManifest();
  many["tensors"] = ordered_json::array();
  for (size_t i = 0; i <= kMaxTensors; ++i) many["tensors"].push_back(ordered_json::object());
  expect(many.dump(),
         "manifest limits.json: field .tensors has 1048577 entries, more than the limit of "
         "1048576");

  expect(WithField({"tensors", size_t{0}, "shard", "offsets"}, "[2]"),
         "manifest limits.json: field .tensors[0].shard has global_shape [4, 3] and offsets [2], "
         "which must have the rank of shape [2, 3]");
  expect(WithField({"tensors", size_t{0}, "shard", "offsets"}, "[3, 0]"),
         "manifest limits.json: field .tensors[0].shard places shape [2, 3] at offsets [3, 0], "
         "outside global_shape [4, 3] (dimension 0)");

  // Two tensors of 2^63 bytes each: each fits, their sum does not.
  ordered_json big = GoodManifest();
  big["tensors"][0] = {{"name", "a"},
                       {"dtype", "U16"},
                       {"shape", {uint64_t{1} << 62}},
                       {"nbytes", uint64_t{1} << 63},
                       {"xxh3", "0000000000000000"}};
  big["tensors"].push_back(big["tensors"][0]);
  big["tensors"][1]["name"] = "b";
  expect(big.dump(),
         "manifest limits.json: field .tensors[1].nbytes is 9223372036854775808: the tensors' "
         "total size overflows 64 bits");
  // A shape whose byte size overflows 64 bits names the shape and what nbytes claims.
  ordered_json wide = GoodManifest();
  wide["tensors"][0]["dtype"] = "F64";
  wide["tensors"][0]["shape"] = {uint64_t{1} << 31, uint64_t{1} << 31};
  wide["tensors"][0].erase("shard");
  expect(wide.dump(),
         "manifest limits.json: field .tensors[0].nbytes is 12 but tensor \"w\" of F64 "
         "[2147483648, 2147483648] needs shape [2147483648, 2147483648] of F64 overflows a "
         "64-bit byte count");
}

}  // namespace manifest_integers
}  // namespace
}  // namespace weightbus
