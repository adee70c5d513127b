// SPDX-License-Identifier: Apache-2.0
// The one home of each low-level encoding: little-endian and varint byte codecs (core/bytes.h),
// UTF-8 validation (core/utf8.h) and percent-decoding (core/uri.h), and the callers that must
// keep using them (the ucx:// control codec, the delta fingerprint, the safetensors writer's
// strided packing). (The core XXH3 that the delta layer now uses has its own test,
// ChecksumTest.VectorizedXxh3MatchesLibxxhashInOneGoAndInPieces.)
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/bytes.h"
#include "core/tensor_pack.h"
#include "core/uri.h"
#include "core/utf8.h"
#include "test_support.h"
#include "transports/ucx/control.h"
#include "weightbus/safetensors.hpp"

namespace weightbus::internal {
namespace {

std::string Hex(std::string_view s) {
  std::string out;
  for (unsigned char c : s) absl::StrAppendFormat(&out, "%02x", c);
  return out;
}

TEST(ByteCodecTest, WritesLittleEndianAndVarintsBitExact) {
  std::string out;
  ByteWriter(&out)
      .U8(0xab)
      .U32(0x01020304)
      .U64(0x1122334455667788ULL)
      .Varint(0)
      .Varint(127)
      .Varint(128)
      .Varint(300)
      .Varint(UINT64_MAX)
      .Bytes("xy");
  EXPECT_EQ(Hex(out),
            "ab"
            "04030201"
            "8877665544332211"
            "00"
            "7f"
            "8001"
            "ac02"
            "ffffffffffffffffff01"
            "7879");
  std::vector<std::byte> v;
  ByteVectorWriter(&v).U32(0x01020304).Varint(300);
  EXPECT_EQ(Hex(std::string_view(reinterpret_cast<const char*>(v.data()), v.size())),
            "04030201ac02");
  EXPECT_EQ(VarintSize(0), 1u);
  EXPECT_EQ(VarintSize(127), 1u);
  EXPECT_EQ(VarintSize(128), 2u);
  EXPECT_EQ(VarintSize(UINT64_MAX), 10u);
  char raw[8];
  StoreLe(uint64_t{0x0102030405060708ULL}, raw);
  EXPECT_EQ(Hex(std::string_view(raw, 8)), "0807060504030201");
  EXPECT_EQ(LoadLe<uint64_t>(raw), 0x0102030405060708ULL);
  EXPECT_EQ(LoadLe<uint32_t>(raw + 1), 0x04050607u);  // unaligned
}

TEST(ByteCodecTest, ReaderRoundTripsWhatTheWriterWrote) {
  std::string out;
  ByteWriter(&out)
      .U8(7)
      .U32(0xdeadbeef)
      .U64(1ULL << 63)
      .Varint(1ULL << 40)
      .Varint(UINT64_MAX)
      .Bytes("tail");
  ByteReader r(out);
  EXPECT_EQ(*r.U8("a"), 7);
  EXPECT_EQ(*r.U32("b"), 0xdeadbeefu);
  EXPECT_EQ(*r.U64("c"), 1ULL << 63);
  EXPECT_EQ(*r.Varint("d"), 1ULL << 40);
  EXPECT_EQ(*r.Varint("e"), UINT64_MAX);
  EXPECT_EQ(r.remaining(), 4u);
  EXPECT_EQ(*r.View(4, "f"), "tail");
  EXPECT_TRUE(r.at_end());
  EXPECT_TRUE(r.status().ok());
}

TEST(ByteCodecTest, ReaderFailuresAreDataLossNamingTheFieldAndStick) {
  {
    ByteReader r(std::string_view("\x01\x02", 2));
    absl::StatusOr<uint32_t> v = r.U32("the tensor count");
    ASSERT_EQ(v.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(v.status().message(), "truncated before the tensor count");
    // The first failure sticks: a read that would fit now fails with it.
    EXPECT_EQ(r.U8("a byte").status().message(), "truncated before the tensor count");
    EXPECT_EQ(r.status().message(), "truncated before the tensor count");
  }
  {
    ByteReader r(std::string_view("abc"));
    absl::StatusOr<const std::byte*> b = r.Bytes(9, "the blob");
    ASSERT_EQ(b.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(b.status().message(), "the blob needs 9 bytes but only 3 remain");
  }
  {
    // 10 bytes whose last carries more than the 64th bit; and a varint cut short.
    ByteReader r(std::string_view("\xff\xff\xff\xff\xff\xff\xff\xff\xff\x02", 10));
    EXPECT_EQ(r.Varint("the base version").status().message(),
              "the base version is not a valid varint");
    ByteReader cut(std::string_view("\x80\x80", 2));
    EXPECT_EQ(cut.Varint("a record size").status().message(), "truncated before a record size");
  }
}

// The ucx:// control messages are built on the same codec (docs/FORMAT.md, "ucx://"): a frame
// is a u32 payload length, the type byte, then the fields.
TEST(ByteCodecTest, UcxControlFramesAreUnchanged) {
  const std::string frame =
      ucx::Writer(ucx::MsgType::kWait).U64(5).U64(0x0102).U8(1).Str("ch").Finish();
  EXPECT_EQ(Hex(frame),
            "18000000"  // payload length 24
            "04"        // WAIT
            "0500000000000000"
            "0201000000000000"
            "01"
            "02000000"
            "6368");
  std::string buffer = frame + "x";  // and the start of the next frame
  absl::StatusOr<std::optional<ucx::Frame>> f = ucx::TakeFrame(buffer);
  ASSERT_TRUE(f.ok() && f->has_value()) << f.status();
  EXPECT_EQ(buffer, "x");
  ucx::Reader r((*f)->payload);
  EXPECT_EQ(r.U64(), 5u);
  EXPECT_EQ(r.U64(), 0x0102u);
  EXPECT_EQ(r.U8(), 1u);
  EXPECT_EQ(r.Str(), "ch");
  EXPECT_TRUE(r.ok() && r.at_end());
  EXPECT_EQ(r.U32(), 0u);  // past the end: 0, and not ok from then on
  EXPECT_FALSE(r.ok());
  // A string whose length exceeds the payload.
  std::string oversized;
  ByteWriter(&oversized).U32(1000).Bytes("abc");
  ucx::Reader bad(oversized);
  EXPECT_EQ(bad.Str(), "");
  EXPECT_FALSE(bad.ok());
}

TEST(Utf8Test, AcceptsRfc3629AndNamesTheFirstBadSequence) {
  for (std::string_view good :
       {std::string_view(""), std::string_view("plain.ascii/name with spaces"),
        std::string_view("ünïcödé ✓ 😀"), std::string_view("\x7f\xc2\x80\xdf\xbf"),
        std::string_view("\xe0\xa0\x80\xed\x9f\xbf\xee\x80\x80"),
        std::string_view("\xf0\x90\x80\x80\xf4\x8f\xbf\xbf"), std::string_view("a\0b", 3)}) {
    EXPECT_FALSE(FindInvalidUtf8(good).has_value()) << Hex(good);
    EXPECT_TRUE(IsValidUtf8(good)) << Hex(good);
  }
  struct Case {
    std::string_view text;
    size_t offset;
    std::string_view reason;
  };
  const Case bad[] = {
      {"a\xff", 1, "code point above U+10FFFF or invalid lead byte"},
      {"abcdefgh\x80", 8, "unexpected continuation byte"},  // past the 8-byte ASCII fast path
      {"\xc0\xaf", 0, "overlong encoding"},                 // '/' in two bytes
      {"x\xe0\x80\xaf", 1, "overlong encoding"},
      {"\xf0\x80\x80\xaf", 0, "overlong encoding"},
      {"\xed\xa0\x80", 0, "UTF-16 surrogate code point"},
      {"\xf4\x90\x80\x80", 0, "code point above U+10FFFF"},
      {"ok \xe2\x9c", 3, "truncated multi-byte sequence"},
      {"\xe2\x28\xa1", 0, "missing continuation byte"},
      {"\xe2\x9c\x28", 0, "missing continuation byte"},
  };
  for (const Case& c : bad) {
    std::optional<Utf8Error> e = FindInvalidUtf8(c.text);
    ASSERT_TRUE(e.has_value()) << Hex(c.text);
    EXPECT_EQ(e->offset, c.offset) << Hex(c.text);
    EXPECT_EQ(std::string_view(e->reason), c.reason) << Hex(c.text);
    size_t at = 99;
    EXPECT_FALSE(IsValidUtf8(c.text, &at));
    EXPECT_EQ(at, c.offset);
  }
}

// The publisher's name check and the safetensors reader use the same validator: a name refused
// by one is refused by the other.
TEST(Utf8Test, PublishedViewsAndSafetensorsFilesShareTheValidator) {
  float x = 1;
  TensorView view{"w\xed\xa0\x80", DType::kF32, {1}, {}, &x};
  absl::StatusOr<uint64_t> v = ValidateView(view);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("not valid UTF-8 (bad byte at offset 1)"),
            absl::string_view::npos)
      << v.status();
  testing::ScratchDir dir;
  const absl::Status w = safetensors::WriteFile(dir / "bad.safetensors", {view}, {});
  EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(w.message().find("not valid UTF-8 at byte 1 (UTF-16 surrogate code point)"),
            absl::string_view::npos)
      << w;
}

TEST(PercentDecodeTest, DecodesEscapesOfEitherCaseAndKeepsTheRest) {
  EXPECT_EQ(*PercentDecode("u", "a%20b%2fc%2Fd+e%25"), "a b/c/d+e%");
  EXPECT_EQ(*PercentDecode("u", ""), "");
  EXPECT_EQ(*PercentDecode("u", "%00"), std::string(1, '\0'));
  for (std::string_view bad : {"%", "%4", "x%zz", "%g0", "%0 "}) {
    absl::StatusOr<std::string> d = PercentDecode("disk:///q", bad);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(d.status().message().find("URI \"disk:///q\""), absl::string_view::npos)
        << d.status();
  }
  // URI parsing decodes path and query with it; the host stays as written (ucx:// decodes it).
  absl::StatusOr<Uri> u = ParseUri("ucx://[fe80::1%25eth0]:9/a%20b?k%3D=v%26w");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->host, "fe80::1%25eth0");
  EXPECT_EQ(*PercentDecode(u->text, u->host), "fe80::1%eth0");
  EXPECT_EQ(u->path, "/a b");
  EXPECT_EQ(u->query.at("k="), "v&w");
}

// The safetensors writer packs strided tensors with the core's PackStridedRange: the file holds
// the row-major bytes, also for views larger than the writer's 1 MiB buffer and negative strides.
TEST(StridedPackingTest, SafetensorsWriterPacksLikeTheCore) {
  testing::ScratchDir dir;
  // 700 x 500 float32 (1.4 MB) viewed transposed, and a reversed row.
  std::vector<float> base(700 * 500);
  std::iota(base.begin(), base.end(), 0.0f);
  std::vector<int64_t> shape = {500, 700}, strides = {1, 500};
  std::vector<float> reversed_src = {1, 2, 3, 4, 5};
  std::vector<TensorView> views = {
      {"t", DType::kF32, shape, strides, base.data()},
      {"r", DType::kF32, {5}, {-1}, reversed_src.data() + 4},
  };
  const std::string path = dir / "strided.safetensors";
  ASSERT_TRUE(safetensors::WriteFile(path, views, {}).ok());
  absl::StatusOr<safetensors::File> file = safetensors::ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<std::byte> packed(base.size() * 4);
  PackStrided(base.data(), 4, shape, strides, packed.data());
  bool found_t = false, found_r = false;
  for (const safetensors::Entry& t : file->header.tensors) {
    const std::span<const std::byte> bytes = file->Bytes(t);
    if (t.name == "t") {
      found_t = true;
      ASSERT_EQ(bytes.size(), packed.size());
      EXPECT_EQ(std::memcmp(bytes.data(), packed.data(), packed.size()), 0);
      float first_row_second;
      std::memcpy(&first_row_second, bytes.data() + 4, 4);
      EXPECT_EQ(first_row_second, 500.0f);  // element [0, 1] of the transpose
    }
    if (t.name == "r") {
      found_r = true;
      std::vector<float> got(5);
      ASSERT_EQ(bytes.size(), 20u);
      std::memcpy(got.data(), bytes.data(), 20);
      EXPECT_EQ(got, (std::vector<float>{5, 4, 3, 2, 1}));
    }
  }
  EXPECT_TRUE(found_t && found_r);
}

}  // namespace
}  // namespace weightbus::internal
