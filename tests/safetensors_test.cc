// SPDX-License-Identifier: Apache-2.0
// Tests of the safetensors reader and writer, through the public API only.
#include "weightbus/safetensors.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "expect_tensors.h"
#include "test_model.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::safetensors {
namespace {

namespace fs = std::filesystem;
using weightbus::testing::FixturePath;
using weightbus::testing::ReadFileOrDie;
using weightbus::testing::ScratchDir;
using weightbus::testing::WriteFileOrDie;

// ----------------------------------------------------------------------------------------------
// Helpers

std::string Le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// A file made of the 8-byte length of `header`, `header` and `data`.
std::string MakeFile(std::string_view header, std::string_view data = {}) {
  std::string out = Le64(header.size());
  out.append(header);
  out.append(data);
  return out;
}

std::string Zeros(size_t n) { return std::string(n, '\0'); }

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

void ExpectStatus(const absl::Status& s, absl::StatusCode code,
                  std::initializer_list<std::string_view> parts) {
  EXPECT_EQ(s.code(), code) << s;
  const std::string msg = Msg(s);
  for (std::string_view part : parts) {
    EXPECT_NE(msg.find(part), std::string::npos) << "\"" << part << "\" not in: " << msg;
  }
}

#define EXPECT_STATUS(status, code, ...)           \
  do {                                             \
    SCOPED_TRACE("EXPECT_STATUS(" #status ")");    \
    ExpectStatus((status), (code), {__VA_ARGS__}); \
  } while (0)

// Checks that every entry point rejects `file` with DataLoss and a message naming the file and
// holding every string of `parts`: ParseFile and ParseHeader in memory, ReadHeader and ReadFile
// from disk.
void ExpectRejected(const std::string& file, std::initializer_list<std::string_view> parts) {
  const std::string source = "bad.safetensors";
  const absl::Status parsed = ParseFile(file, source).status();
  ExpectStatus(parsed, absl::StatusCode::kDataLoss, parts);
  EXPECT_NE(Msg(parsed).find(source), std::string::npos) << parsed;
  EXPECT_EQ(ParseHeader(file, file.size(), source).status(), parsed);

  ScratchDir dir;
  const std::string path = dir / "bad.safetensors";
  WriteFileOrDie(path, file);
  for (const absl::Status& s : {ReadHeader(path).status(), ReadFile(path).status()}) {
    ExpectStatus(s, absl::StatusCode::kDataLoss, parts);
    EXPECT_NE(Msg(s).find(path), std::string::npos) << s;
  }
}

#define EXPECT_REJECTED(file, ...)              \
  do {                                          \
    SCOPED_TRACE("EXPECT_REJECTED(" #file ")"); \
    ExpectRejected((file), {__VA_ARGS__});      \
  } while (0)

// Parses `file` in memory and from disk and checks both agree; returns the in-memory result.
File ParseOk(const std::string& file) {
  absl::StatusOr<File> parsed = ParseFile(file, "good.safetensors");
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  if (!parsed.ok()) return File();
  ScratchDir dir;
  const std::string path = dir / "good.safetensors";
  WriteFileOrDie(path, file);
  absl::StatusOr<File> read = ReadFile(path);
  EXPECT_TRUE(read.ok()) << read.status();
  if (read.ok()) {
    EXPECT_EQ(read->data, parsed->data);
    EXPECT_EQ(read->header.tensors.size(), parsed->header.tensors.size());
    EXPECT_EQ(read->header.data_start, parsed->header.data_start);
  }
  return *std::move(parsed);
}

std::string BytesOf(const File& file, const Entry& e) {
  std::span<const std::byte> b = file.Bytes(e);
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

template <typename T>
std::string RawBytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Decodes an IEEE 754 binary16 value.
double HalfToDouble(uint16_t h) {
  const int sign = h >> 15;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  double v;
  if (exponent == 0) {
    v = std::ldexp(mantissa, -24);
  } else if (exponent == 31) {
    v = mantissa == 0 ? INFINITY : NAN;
  } else {
    v = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -v : v;
}

// Decodes little-endian elements of `dtype` to doubles (exact for the fixtures' values).
std::vector<double> Decode(DType dtype, std::span<const std::byte> bytes) {
  const size_t size = DTypeSize(dtype);
  std::vector<double> out;
  for (size_t off = 0; off + size <= bytes.size(); off += size) {
    uint64_t u = 0;
    for (size_t k = 0; k < size; ++k) {
      u |= static_cast<uint64_t>(std::to_integer<uint8_t>(bytes[off + k])) << (8 * k);
    }
    const int bits = static_cast<int>(8 * size);
    switch (dtype) {
      case DType::kI8:
      case DType::kI16:
      case DType::kI32:
      case DType::kI64: {
        int64_t s = static_cast<int64_t>(u);
        if (bits < 64 && (u >> (bits - 1)) != 0) {
          s = static_cast<int64_t>(u - (uint64_t{1} << bits));
        }
        out.push_back(static_cast<double>(s));
        break;
      }
      case DType::kU8:
      case DType::kU16:
      case DType::kU32:
      case DType::kU64:
        out.push_back(static_cast<double>(u));
        break;
      case DType::kF16:
        out.push_back(HalfToDouble(static_cast<uint16_t>(u)));
        break;
      case DType::kF32: {
        uint32_t w = static_cast<uint32_t>(u);
        float f;
        std::memcpy(&f, &w, 4);
        out.push_back(f);
        break;
      }
      case DType::kF64: {
        double d;
        std::memcpy(&d, &u, 8);
        out.push_back(d);
        break;
      }
      default:
        ADD_FAILURE() << "no decoder for " << DTypeName(dtype);
        return out;
    }
  }
  return out;
}

// The fixture values -3..2 as stored in `dtype` (unsigned types wrap modulo 2^bits).
std::vector<double> ExpectedFixtureValues(DType dtype) {
  std::vector<double> out;
  for (int v = -3; v <= 2; ++v) {
    double x = v;
    if ((dtype == DType::kU8 || dtype == DType::kU16 || dtype == DType::kU32) && v < 0) {
      x += std::ldexp(1.0, static_cast<int>(8 * DTypeSize(dtype)));
    }
    out.push_back(x);
  }
  return out;
}

struct FixtureCase {
  std::string code;  // numpy type code, also the file and tensor name
  DType dtype;
};

const std::vector<FixtureCase>& FixtureCases() {
  static const auto* cases =
      new std::vector<FixtureCase>{{"b", DType::kI8},  {"B", DType::kU8},  {"h", DType::kI16},
                                   {"H", DType::kU16}, {"i", DType::kI32}, {"I", DType::kU32},
                                   {"e", DType::kF16}, {"f", DType::kF32}, {"d", DType::kF64}};
  return *cases;
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// The packed row-major bytes of a strided view, computed naively element by element.
std::string NaivePack(const TensorView& v) {
  const size_t elem = DTypeSize(v.dtype);
  int64_t count = 1;
  for (int64_t d : v.shape) count *= d;
  std::string out;
  for (int64_t linear = 0; linear < count; ++linear) {
    int64_t rest = linear;
    int64_t offset = 0;
    for (size_t d = v.shape.size(); d-- > 0;) {
      offset += (rest % v.shape[d]) * v.strides[d];
      rest /= v.shape[d];
    }
    out.append(static_cast<const char*>(v.data) + offset * static_cast<int64_t>(elem), elem);
  }
  return out;
}

TensorView View(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
                std::vector<int64_t> strides = {}) {
  TensorView v;
  v.name = std::move(name);
  v.dtype = dtype;
  v.shape = std::move(shape);
  v.strides = std::move(strides);
  v.data = data;
  return v;
}

// ----------------------------------------------------------------------------------------------
// Fixtures

TEST(SafetensorsFixtureTest, EverySingleTensorFixtureDecodesToTheReadmeValues) {
  for (const FixtureCase& c : FixtureCases()) {
    SCOPED_TRACE(c.code);
    const std::string path = FixturePath("safetensors-samples/" + c.code + ".safetensors");
    absl::StatusOr<File> file = ReadFile(path);
    ASSERT_TRUE(file.ok()) << file.status();
    const Header& h = file->header;
    ASSERT_EQ(h.tensors.size(), 1u);
    const Entry& e = h.tensors[0];
    EXPECT_EQ(e.name, c.code);
    EXPECT_EQ(e.dtype, c.dtype);
    EXPECT_EQ(e.shape, std::vector<int64_t>{6});
    EXPECT_EQ(e.begin, 0u);
    EXPECT_EQ(e.end, 6 * DTypeSize(c.dtype));
    EXPECT_EQ(h.data_start, 8 + h.header_size);
    EXPECT_EQ(h.data_size, 6 * DTypeSize(c.dtype));
    EXPECT_EQ(h.data_start + h.data_size, fs::file_size(path));
    EXPECT_EQ(h.metadata, (Metadata{{"test", "a"}}));
    EXPECT_EQ(Decode(e.dtype, file->Bytes(e)), ExpectedFixtureValues(c.dtype));
    EXPECT_EQ(h.Find(c.code), &h.tensors[0]);
    EXPECT_EQ(h.Find("missing"), nullptr);
  }
}

TEST(SafetensorsFixtureTest, Float16FixtureHasTheExpectedHalfBits) {
  absl::StatusOr<File> file = ReadFile(FixturePath("safetensors-samples/e.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  const Entry& e = file->header.tensors.at(0);
  // -3, -2, -1, 0, 1, 2 in binary16: 0xC200, 0xC000, 0xBC00, 0x0000, 0x3C00, 0x4000.
  EXPECT_EQ(BytesOf(*file, e), std::string("\x00\xc2\x00\xc0\x00\xbc\x00\x00\x00\x3c\x00\x40", 12));
  EXPECT_EQ(HalfToDouble(0x3555), 0.333251953125);        // the decoder itself, on a fraction
  EXPECT_EQ(HalfToDouble(0x0001), std::ldexp(1.0, -24));  // and a subnormal
}

TEST(SafetensorsFixtureTest, OverallHoldsEveryTensorUnalignedInHeaderOrder) {
  const std::string path = FixturePath("safetensors-samples/overall.safetensors");
  absl::StatusOr<File> file = ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const Header& h = file->header;
  EXPECT_EQ(h.metadata, (Metadata{{"test", "a"}}));
  std::vector<std::string> names;
  for (const Entry& e : h.tensors) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"B", "H", "I", "b", "d", "e", "f", "h", "i"}));
  EXPECT_EQ(h.header_size, 526u);
  EXPECT_EQ(h.data_start, 534u);
  EXPECT_EQ(h.data_size, 168u);
  // The fixture is not aligned: "I" (U32) starts at 18.
  ASSERT_NE(h.Find("I"), nullptr);
  EXPECT_EQ(h.Find("I")->begin, 18u);
  for (const FixtureCase& c : FixtureCases()) {
    SCOPED_TRACE(c.code);
    const Entry* e = h.Find(c.code);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->dtype, c.dtype);
    EXPECT_EQ(e->shape, std::vector<int64_t>{6});
    EXPECT_EQ(Decode(e->dtype, file->Bytes(*e)), ExpectedFixtureValues(c.dtype));
    // The same bytes as the single-tensor fixture.
    absl::StatusOr<File> single =
        ReadFile(FixturePath("safetensors-samples/" + c.code + ".safetensors"));
    ASSERT_TRUE(single.ok()) << single.status();
    EXPECT_EQ(BytesOf(*file, *e), BytesOf(*single, single->header.tensors[0]));
  }
}

TEST(SafetensorsFixtureTest, AllEntryPointsAgreeOnEveryFixture) {
  const std::string dir = FixturePath("safetensors-samples");
  int count = 0;
  for (const std::string& name : FilesIn(dir)) {
    if (!absl::EndsWith(name, ".safetensors")) continue;
    SCOPED_TRACE(name);
    ++count;
    const std::string path = dir + "/" + name;
    const std::string bytes = ReadFileOrDie(path);
    absl::StatusOr<File> parsed = ParseFile(bytes, name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    absl::StatusOr<File> read = ReadFile(path);
    ASSERT_TRUE(read.ok()) << read.status();
    absl::StatusOr<Header> header = ReadHeader(path);
    ASSERT_TRUE(header.ok()) << header.status();
    absl::StatusOr<Header> in_memory = ParseHeader(bytes, bytes.size(), name);
    ASSERT_TRUE(in_memory.ok()) << in_memory.status();
    // Only the prefix is needed by ParseHeader.
    absl::StatusOr<Header> prefix_only =
        ParseHeader(std::string_view(bytes).substr(0, header->data_start), bytes.size(), name);
    ASSERT_TRUE(prefix_only.ok()) << prefix_only.status();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    absl::StatusOr<Header> from_fd = ReadHeader(fd, bytes.size(), path);
    ::close(fd);
    ASSERT_TRUE(from_fd.ok()) << from_fd.status();

    EXPECT_EQ(parsed->data, read->data);
    EXPECT_EQ(parsed->data, bytes.substr(header->data_start));
    for (const Header* h :
         {&parsed->header, &read->header, &*in_memory, &*prefix_only, &*from_fd}) {
      EXPECT_EQ(h->header_size, header->header_size);
      EXPECT_EQ(h->data_start, header->data_start);
      EXPECT_EQ(h->data_size, header->data_size);
      EXPECT_EQ(h->metadata, header->metadata);
      ASSERT_EQ(h->tensors.size(), header->tensors.size());
      for (size_t i = 0; i < h->tensors.size(); ++i) {
        EXPECT_EQ(h->tensors[i].name, header->tensors[i].name);
        EXPECT_EQ(h->tensors[i].dtype, header->tensors[i].dtype);
        EXPECT_EQ(h->tensors[i].shape, header->tensors[i].shape);
        EXPECT_EQ(h->tensors[i].begin, header->tensors[i].begin);
        EXPECT_EQ(h->tensors[i].end, header->tensors[i].end);
      }
    }
  }
  EXPECT_EQ(count, 10);
}

TEST(SafetensorsRoundTripTest, OverallTensorsAndMetadataRoundTripThroughTheWriter) {
  absl::StatusOr<File> overall = ReadFile(FixturePath("safetensors-samples/overall.safetensors"));
  ASSERT_TRUE(overall.ok()) << overall.status();
  std::vector<TensorView> views;
  for (const Entry& e : overall->header.tensors) {
    views.push_back(View(e.name, e.dtype, e.shape, overall->Bytes(e).data()));
  }
  ScratchDir dir;
  const std::string path = dir / "overall.safetensors";
  ASSERT_TRUE(WriteFile(path, views, overall->header.metadata).ok());
  EXPECT_EQ(FilesIn(dir.path()), std::vector<std::string>{"overall.safetensors"});

  absl::StatusOr<File> back = ReadFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->header.metadata, (Metadata{{"test", "a"}}));
  ASSERT_EQ(back->header.tensors.size(), overall->header.tensors.size());
  for (const Entry& e : overall->header.tensors) {
    SCOPED_TRACE(e.name);
    const Entry* b = back->header.Find(e.name);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->dtype, e.dtype);
    EXPECT_EQ(b->shape, e.shape);
    EXPECT_EQ(BytesOf(*back, *b), BytesOf(*overall, e));
    EXPECT_EQ(Decode(b->dtype, back->Bytes(*b)), ExpectedFixtureValues(b->dtype));
    // The writer aligns every tensor to its element size.
    EXPECT_EQ(b->begin % DTypeSize(b->dtype), 0u);
  }
  // Data (and header) order: largest element first, stable among equal sizes.
  std::vector<std::string> names;
  for (const Entry& e : back->header.tensors) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"d", "I", "f", "i", "H", "e", "h", "B", "b"}));
  EXPECT_EQ(back->header.data_start % 8, 0u);
  const std::string bytes = ReadFileOrDie(path);
  EXPECT_TRUE(
      absl::StartsWith(bytes.substr(8), R"({"__metadata__":{"test":"a"},"d":{"dtype":"F64")"))
      << bytes.substr(8, 80);
  EXPECT_EQ(bytes.size(), back->header.data_start + 168);
}

// ----------------------------------------------------------------------------------------------
// Valid edge cases of the format

TEST(SafetensorsParseTest, EmptyHeaderWithoutDataIsAValidEmptyFile) {
  for (const std::string header : {"{}", "{}      ", "{ }", "{}\n"}) {
    SCOPED_TRACE(header);
    File file = ParseOk(MakeFile(header));
    EXPECT_TRUE(file.header.tensors.empty());
    EXPECT_TRUE(file.header.metadata.empty());
    EXPECT_EQ(file.header.header_size, header.size());
    EXPECT_EQ(file.header.data_start, 8 + header.size());
    EXPECT_EQ(file.header.data_size, 0u);
    EXPECT_TRUE(file.data.empty());
  }
  File md = ParseOk(MakeFile(R"({"__metadata__":{}})"));
  EXPECT_TRUE(md.header.metadata.empty());
}

TEST(SafetensorsParseTest, HeaderPaddedWithSpacesAndUnknownFieldsAreAccepted) {
  const std::string header =
      R"({"w":{"extra":{"nested":[1,{"x":null}]},"dtype":"F32","shape":[2],)"
      R"("data_offsets":[0,8],"more":"ignored"},"__metadata__":{"k":"v","":""}})"
      "        ";
  File file = ParseOk(MakeFile(header, Zeros(8)));
  ASSERT_EQ(file.header.tensors.size(), 1u);
  EXPECT_EQ(file.header.tensors[0].name, "w");
  EXPECT_EQ(file.header.tensors[0].shape, std::vector<int64_t>{2});
  EXPECT_EQ(file.header.metadata, (Metadata{{"k", "v"}, {"", ""}}));
  EXPECT_EQ(file.header.header_size, header.size());
}

TEST(SafetensorsParseTest, ZeroSizeTensorsMaySitAtTheSameOffsetAndAtTheEnds) {
  const std::string header = R"({"z0":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                             R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                             R"("z1":{"dtype":"F64","shape":[3,0],"data_offsets":[4,4]},)"
                             R"("z2":{"dtype":"I16","shape":[0,7],"data_offsets":[4,4]},)"
                             R"("b":{"dtype":"U8","shape":[2,2],"data_offsets":[4,8]},)"
                             R"("z3":{"dtype":"BOOL","shape":[0],"data_offsets":[8,8]}})";
  File file = ParseOk(MakeFile(header, "abcdefgh"));
  ASSERT_EQ(file.header.tensors.size(), 6u);
  std::vector<std::string> names;
  for (const Entry& e : file.header.tensors) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"z0", "a", "z1", "z2", "b", "z3"}));
  EXPECT_EQ(BytesOf(file, *file.header.Find("a")), "abcd");
  EXPECT_EQ(BytesOf(file, *file.header.Find("b")), "efgh");
  EXPECT_EQ(BytesOf(file, *file.header.Find("z2")), "");
  EXPECT_EQ(file.header.data_size, 8u);
}

TEST(SafetensorsParseTest, ScalarAndEveryDTypeParse) {
  std::vector<std::string> fields;
  uint64_t offset = 0;
  // Scalars, but 4 elements of the sub-byte dtypes (one would not fill a byte).
  auto shape_of = [](DType dtype) {
    return IsSubByte(dtype) ? std::vector<int64_t>{4} : std::vector<int64_t>{};
  };
  for (DType dtype : kAllDTypes) {
    const uint64_t size = *ByteSize(dtype, shape_of(dtype));
    fields.push_back(absl::StrFormat(R"("t_%s":{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]})",
                                     DTypeName(dtype), DTypeName(dtype),
                                     ShapeString(shape_of(dtype)), offset, offset + size));
    offset += size;
  }
  File file = ParseOk(MakeFile("{" + absl::StrJoin(fields, ",") + "}", Zeros(offset)));
  ASSERT_EQ(file.header.tensors.size(), kAllDTypes.size());
  for (size_t i = 0; i < kAllDTypes.size(); ++i) {
    EXPECT_EQ(file.header.tensors[i].dtype, kAllDTypes[i]);
    EXPECT_EQ(file.header.tensors[i].shape, shape_of(kAllDTypes[i]));
    EXPECT_EQ(file.header.tensors[i].nbytes(), *ByteSize(kAllDTypes[i], shape_of(kAllDTypes[i])));
  }
}

// Issue 10, item 14: files with the dtypes safetensors added (F8_E8M0 scales as in
// DeepSeek-V3.2, MXFP4's F4, F6, C64, the FNUZ FP8 variants) were refused with DataLoss. They
// parse, with sizes from their bits (F4: 2 elements per byte, F6: 4 per 3 bytes), and their bytes
// are handed over as they are.
TEST(SafetensorsParseTest, NewSafetensorsDTypesParseWithTheirBytes) {
  const std::vector<std::tuple<std::string, std::string, uint64_t>> tensors = {
      {"scale", "F8_E8M0", 3},     {"mx4", "F4", 3},    {"mx6a", "F6_E2M3", 3},
      {"mx6b", "F6_E3M2", 6},      {"cplx", "C64", 16}, {"e4fnuz", "F8_E4M3FNUZ", 1},
      {"e5fnuz", "F8_E5M2FNUZ", 2}};
  const std::vector<std::string> shapes = {"[3]", "[2,3]", "[4]", "[2,4]", "[2]", "[]", "[1,2]"};
  std::vector<std::string> fields;
  std::string data;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, dtype, bytes] = tensors[i];
    fields.push_back(absl::StrFormat(R"("%s":{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]})",
                                     name, dtype, shapes[i], data.size(), data.size() + bytes));
    for (uint64_t b = 0; b < bytes; ++b) data.push_back(static_cast<char>(0x11 * (i + 1) + b));
  }
  const std::string text = MakeFile("{" + absl::StrJoin(fields, ",") + "}", data);
  absl::StatusOr<File> file = ParseFile(text, "new-dtypes.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->header.tensors.size(), tensors.size());
  uint64_t at = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, dtype, bytes] = tensors[i];
    const Entry* e = file->header.Find(name);
    ASSERT_NE(e, nullptr) << name;
    EXPECT_EQ(DTypeName(e->dtype), dtype);
    EXPECT_EQ(e->nbytes(), bytes) << name;
    EXPECT_EQ(BytesOf(*file, *e), data.substr(at, bytes)) << name;
    at += bytes;
  }
  // Written back by the writer and read again: the same.
  ScratchDir dir;
  std::vector<TensorView> views;
  for (const Entry& e : file->header.tensors) {
    views.push_back(TensorView{e.name, e.dtype, e.shape, {}, file->Bytes(e).data()});
  }
  const std::string path = dir.path() + "/new.safetensors";
  ASSERT_TRUE(WriteFile(path, views, {}).ok());
  absl::StatusOr<File> again = ReadFile(path);
  ASSERT_TRUE(again.ok()) << again.status();
  for (const Entry& e : file->header.tensors) {
    const Entry* f = again->header.Find(e.name);
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(f->dtype, e.dtype);
    EXPECT_EQ(f->shape, e.shape);
    EXPECT_EQ(BytesOf(*again, *f), BytesOf(*file, e));
  }
}

TEST(SafetensorsMalformedTest, SubByteTensorsOfPartialBytesAreDataLoss) {
  // 3 F4 elements are 12 bits: safetensors refuses such a tensor as misaligned.
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", Zeros(2)),
                  "tensor 'w'", "F4", "not a whole number of bytes");
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"F6_E3M2","shape":[1,2],"data_offsets":[0,2]}})", Zeros(2)),
      "tensor 'w'", "F6_E3M2", "not a whole number of bytes");
  // The right number of bytes for its bits, or DataLoss as for any dtype.
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"F4","shape":[4],"data_offsets":[0,4]}})", Zeros(4)),
                  "tensor 'w'", "= 2 bytes");
}

TEST(SafetensorsWriteTest, NonContiguousSubByteViewsAreUnimplemented) {
  ScratchDir dir;
  const std::string bytes(4, '\x5a');
  const TensorView v{"packed", DType::kF4, {2, 4}, {1, 2}, bytes.data()};
  const absl::Status s = WriteFile(dir.path() + "/x.safetensors", {&v, 1}, {});
  ASSERT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "'packed'")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "F4")) << s;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/x.safetensors"));
}

TEST(SafetensorsParseTest, ValidUtf8EdgeCodePointsAreAccepted) {
  // U+0080, U+07FF, U+0800, U+D7FF, U+E000, U+FFFF, U+10000, U+10FFFF, and an escaped NUL.
  const std::vector<std::string> names = {"\xc2\x80",         "\xdf\xbf",        "\xe0\xa0\x80",
                                          "\xed\x9f\xbf",     "\xee\x80\x80",    "\xef\xbf\xbf",
                                          "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf"};
  std::vector<std::string> fields;
  for (size_t i = 0; i < names.size(); ++i) {
    fields.push_back(absl::StrFormat(R"("%s":{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]})",
                                     names[i], i, i + 1));
  }
  fields.push_back(R"("nul\u0000byte":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})");
  File file = ParseOk(MakeFile("{" + absl::StrJoin(fields, ",") + "}", Zeros(names.size())));
  ASSERT_EQ(file.header.tensors.size(), names.size() + 1);
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(file.header.tensors[i].name, names[i]);
  EXPECT_EQ(file.header.tensors.back().name, std::string("nul\0byte", 8));
}

TEST(SafetensorsParseTest, TensorLargerThan2GiBInASparseFileIsAccepted) {
  const uint64_t big = (uint64_t{1} << 31) + 16;
  const std::string header =
      absl::StrFormat(R"({"big":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]},)"
                      R"("tail":{"dtype":"F32","shape":[2,2],"data_offsets":[%d,%d]}})",
                      big, big, big, big + 16);
  const std::string prefix = MakeFile(header);
  const uint64_t file_size = prefix.size() + big + 16;

  absl::StatusOr<Header> in_memory = ParseHeader(prefix, file_size, "big.safetensors");
  ASSERT_TRUE(in_memory.ok()) << in_memory.status();
  EXPECT_EQ(in_memory->data_size, big + 16);

  ScratchDir dir;
  const std::string path = dir / "big.safetensors";
  WriteFileOrDie(path, prefix);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(file_size)), 0) << strerror(errno);
  absl::StatusOr<Header> h = ReadHeader(path);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->data_start, prefix.size());
  EXPECT_EQ(h->data_size, big + 16);
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].nbytes(), big);
  EXPECT_EQ(h->tensors[0].shape, std::vector<int64_t>{static_cast<int64_t>(big)});
  EXPECT_EQ(h->tensors[1].begin, big);

  // The planner produces the same kind of layout without overflowing anything.
  absl::StatusOr<Layout> layout =
      PlanFile({TensorSpec{"big", DType::kU8, {static_cast<int64_t>(big)}}}, {});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->data_size, big);
  EXPECT_TRUE(ParseHeader(layout->prefix, layout->file_size(), "planned").ok());
}

TEST(SafetensorsParseTest, ParsingManyTensorsIsFast) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 50000; ++i) {
    specs.push_back(TensorSpec{absl::StrFormat("model.layers.%d.mlp.weight", i),
                               i % 3 == 0 ? DType::kBF16 : DType::kF32,
                               {i % 7, 3}});
  }
  absl::StatusOr<Layout> layout = PlanFile(specs, {{"format", "pt"}});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<Header> h = ParseHeader(layout->prefix, layout->file_size(), "many");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), specs.size());
  // Well under a second in practice; the bound only catches quadratic behaviour.
  EXPECT_LT(seconds, 10.0);
}

// ----------------------------------------------------------------------------------------------
// Malformed files: one test per rule, each with its own message.

TEST(SafetensorsMalformedTest, FileShorterThanEightBytes) {
  EXPECT_REJECTED(std::string(), "is 0 bytes", "shorter than the 8-byte header length");
  EXPECT_REJECTED(std::string("\x02\x00\x00\x00\x00", 5), "is 5 bytes",
                  "shorter than the 8-byte header length");
}

TEST(SafetensorsMalformedTest, HeaderLengthBeyondTheFile) {
  EXPECT_REJECTED(Le64(100) + "{}", "header length 100 runs past the end of the file",
                  "8 + 100 > file size 10");
  EXPECT_REJECTED(Le64(~uint64_t{0}) + "{}", "header length 18446744073709551615");
  // Exactly one byte short.
  EXPECT_REJECTED(Le64(3) + "{}", "header length 3 runs past the end", "file size 10");
}

TEST(SafetensorsMalformedTest, HeaderLengthAboveTheMaximum) {
  const std::string prefix = Le64(kMaxHeaderSize + 1);
  absl::StatusOr<Header> h = ParseHeader(prefix, uint64_t{1} << 40, "huge.safetensors");
  EXPECT_STATUS(h.status(), absl::StatusCode::kDataLoss, "huge.safetensors",
                "header length 100000001 exceeds the maximum of 100000000 bytes");
  // The maximum itself passes that check (and then fails on the missing bytes).
  h = ParseHeader(Le64(kMaxHeaderSize), uint64_t{1} << 40, "max.safetensors");
  EXPECT_STATUS(h.status(), absl::StatusCode::kDataLoss, "only 0 of the 100000000 header bytes");
  // From disk, with a sparse file large enough that only the maximum is violated.
  ScratchDir dir;
  const std::string path = dir / "huge.safetensors";
  WriteFileOrDie(path, prefix + "{}");
  ASSERT_EQ(::truncate(path.c_str(), off_t{200'000'000}), 0);
  EXPECT_STATUS(ReadHeader(path).status(), absl::StatusCode::kDataLoss, path,
                "exceeds the maximum");
}

TEST(SafetensorsMalformedTest, HeaderNotValidUtf8ReportsTheByteOffset) {
  struct Case {
    std::string bad;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"\xff", "invalid lead byte"},
      {"\x80", "unexpected continuation byte"},
      {"\xc0\x80", "overlong encoding"},          // overlong NUL
      {"\xc1\xbf", "overlong encoding"},          // overlong U+007F
      {"\xe0\x80\xaf", "overlong encoding"},      // overlong '/'
      {"\xf0\x8f\xbf\xbf", "overlong encoding"},  // overlong U+FFFF
      {"\xed\xa0\x80", "surrogate"},              // U+D800
      {"\xed\xbf\xbf", "surrogate"},              // U+DFFF
      {"\xf4\x90\x80\x80", "above U+10FFFF"},     // U+110000
      {"\xf5\x80\x80\x80", "above U+10FFFF"},
      {"\xc3(", "missing continuation byte"},
      {"\xe2\x82(", "missing continuation byte"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.reason);
    // The bad sequence starts at header byte 5, file offset 13.
    const std::string header =
        "{\"abc" + c.bad + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})";
    EXPECT_REJECTED(MakeFile(header), "not valid UTF-8 at header byte 5 (file offset 13", c.reason);
  }
  // A sequence cut off by the end of the header.
  EXPECT_REJECTED(MakeFile("{}  \xe2\x82"), "at header byte 4 (file offset 12",
                  "truncated multi-byte sequence");
}

TEST(SafetensorsMalformedTest, HeaderNotStartingWithABrace) {
  EXPECT_REJECTED(MakeFile(" {}"), "header does not start with '{'", "first byte is 0x20");
  EXPECT_REJECTED(MakeFile("[]"), "header does not start with '{'", "0x5b");
  EXPECT_REJECTED(MakeFile("\"x\""), "header does not start with '{'");
  EXPECT_REJECTED(MakeFile(""), "header does not start with '{'", "the header is empty");
}

TEST(SafetensorsMalformedTest, HeaderNotValidJson) {
  EXPECT_REJECTED(MakeFile(R"({"a":})"), "header is not valid JSON");
  EXPECT_REJECTED(MakeFile("{"), "header is not valid JSON", "1-byte header");
  EXPECT_REJECTED(MakeFile("{}x"), "header is not valid JSON");
  EXPECT_REJECTED(MakeFile("{} {}"), "header is not valid JSON");
  // nlohmann's lexer stops at a NUL byte; the parser must not ignore what follows.
  EXPECT_REJECTED(MakeFile(std::string("{}\0\0", 4)), "header is not valid JSON",
                  "raw NUL byte at header byte 2 (file offset 10)");
  EXPECT_REJECTED(MakeFile(std::string("{}\0{\"x\":1}", 10)), "raw NUL byte at header byte 2");
  EXPECT_REJECTED(MakeFile(std::string("{\"a\0b\":{}}", 10)), "raw NUL byte at header byte 3");
  EXPECT_REJECTED(MakeFile(R"({"a":1e999})"), "header is not valid JSON");
  EXPECT_REJECTED(MakeFile(R"({"a\ud800":1})"), "header is not valid JSON");  // lone surrogate
  // A syntax error wins over an earlier semantic one.
  EXPECT_REJECTED(MakeFile(R"({"a":1,"b":)"), "header is not valid JSON");
}

TEST(SafetensorsMalformedTest, DuplicateTensorNames) {
  const std::string header = R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                             R"("v":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},)"
                             R"("w":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})";
  EXPECT_REJECTED(MakeFile(header, Zeros(12)), "duplicate tensor name 'w'");
  // Same name spelled differently in JSON.
  const std::string escaped = R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)"
                              R"("\u0077":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})";
  EXPECT_REJECTED(MakeFile(escaped), "duplicate tensor name 'w'");
  EXPECT_REJECTED(MakeFile(R"({"__metadata__":{},"__metadata__":{}})"),
                  "duplicate key \"__metadata__\"");
  EXPECT_REJECTED(MakeFile(R"({"__metadata__":{"k":"1","k":"2"}})"),
                  "\"__metadata__\" has a duplicate key 'k'");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","dtype":"I8","shape":[0],"data_offsets":[0,0]}})"),
                  "tensor 'w' has a duplicate field \"dtype\"");
}

TEST(SafetensorsMalformedTest, MissingFields) {
  EXPECT_REJECTED(MakeFile(R"({"w":{"shape":[4],"data_offsets":[0,4]}})", Zeros(4)),
                  "tensor 'w' is missing field \"dtype\"");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","data_offsets":[0,4]}})", Zeros(4)),
                  "tensor 'w' is missing field \"shape\"");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[4]}})", Zeros(4)),
                  "tensor 'w' is missing field \"data_offsets\"");
  EXPECT_REJECTED(MakeFile(R"({"w":{}})"), "tensor 'w' is missing field \"dtype\"");
}

TEST(SafetensorsMalformedTest, IllTypedFields) {
  EXPECT_REJECTED(MakeFile(R"({"w":[1,2]})"), "tensor 'w' is an array, expected an object");
  EXPECT_REJECTED(MakeFile(R"({"w":"U8"})"), "tensor 'w' is a string, expected an object");
  EXPECT_REJECTED(MakeFile(R"({"w":null})"), "tensor 'w' is null, expected an object");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":5,"shape":[4],"data_offsets":[0,4]}})", Zeros(4)),
                  "tensor 'w' field \"dtype\" is an integer, expected a string");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":["U8"],"shape":[4],"data_offsets":[0,4]}})", Zeros(4)),
                  "tensor 'w' field \"dtype\" is an array, expected a string");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":4,"data_offsets":[0,4]}})", Zeros(4)),
                  "tensor 'w' field \"shape\" is an integer, expected an array of integers");
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"U8","shape":{"0":4},"data_offsets":[0,4]}})", Zeros(4)),
      "tensor 'w' field \"shape\" is an object");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":"0,4"}})", Zeros(4)),
                  "tensor 'w' field \"data_offsets\" is a string, expected [begin, end]");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[4]}})", Zeros(4)),
                  "tensor 'w' field \"data_offsets\" has 1 elements, expected two");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4,4]}})", Zeros(4)),
                  "field \"data_offsets\" has 3 elements");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[-4,0]}})"),
                  "tensor 'w' field \"data_offsets\" holds -4 at index 0, expected two "
                  "non-negative integers");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,"4"]}})", Zeros(4)),
                  "field \"data_offsets\" holds \"4\" at index 1");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4.0]}})", Zeros(4)),
                  "field \"data_offsets\" holds 4.0 at index 1");
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,18446744073709551616]}})"),
      "field \"data_offsets\" holds 18446744073709551616 at index 1");
}

// The limits of types.hpp, each at the limit (accepted) and one past it (refused, naming the
// limit and the value found).
TEST(SafetensorsMalformedTest, NameLengthRankAndTensorCountLimits) {
  const std::string long_name(kMaxTensorNameBytes + 1, 'n');
  EXPECT_REJECTED(
      MakeFile("{\"" + long_name + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})"),
      absl::StrFormat("tensor name '%s'... is 4097 bytes long, more than the limit of 4096",
                      std::string(64, 'n')));
  ParseOk(MakeFile("{\"" + long_name.substr(1) +
                   R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})"));

  auto ones = [](size_t rank) {
    std::string dims;
    for (size_t d = 0; d < rank; ++d) dims += d == 0 ? "1" : ",1";
    return dims;
  };
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[)" + ones(kMaxRank + 1) +
                               R"(],"data_offsets":[0,1]}})",
                           Zeros(1)),
                  "tensor 'w' has a shape of rank 65, more than the limit of 64");
  // A shape of a million dimensions is refused without holding them.
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"U8","shape":[)" + ones(1'000'000) + R"(],"data_offsets":[0,1]}})",
               Zeros(1)),
      "tensor 'w' has a shape of rank 1000000, more than the limit of 64");
  ParseOk(
      MakeFile(R"({"w":{"dtype":"U8","shape":[)" + ones(kMaxRank) + R"(],"data_offsets":[0,1]}})",
               Zeros(1)));

  std::string header = "{";
  for (size_t i = 0; i <= kMaxTensors; ++i) {
    absl::StrAppend(&header, i == 0 ? "" : ",", "\"", i, R"(":{"dtype":"U8","shape":[0],)",
                    R"("data_offsets":[0,0]})");
  }
  header += "}";
  const std::string file = MakeFile(header);
  EXPECT_STATUS(ParseFile(file, "many.safetensors").status(), absl::StatusCode::kDataLoss,
                "safetensors file many.safetensors: header declares more than 1048576 tensors, "
                "the limit");
  // The writer refuses what the reader would.
  std::vector<TensorSpec> specs(kMaxTensors + 1, TensorSpec{"t", DType::kU8, {0}});
  EXPECT_STATUS(PlanFile(specs, {}).status(), absl::StatusCode::kInvalidArgument,
                "1048577 tensors, more than the limit of 1048576 per file");
  EXPECT_STATUS(PlanFile({TensorSpec{long_name, DType::kU8, {1}}}, {}).status(),
                absl::StatusCode::kInvalidArgument,
                "has a name of 4097 bytes and a shape of rank 1; the limits are 4096 bytes and "
                "rank 64");
}

// A shape whose byte size overflows 64 bits, and offsets past the end, are refused naming both
// sides (the rules behind these limits; more cases in ByteSizeDoesNotMatchShape and
// OffsetsBeyondTheDataRegion).
TEST(SafetensorsMalformedTest, ShapeProductOverflowingSixtyFourBitsNamesShapeAndSpan) {
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
               Zeros(8)),
      "tensor 'w' has dtype F32 and shape [4294967296, 4294967296], whose byte size overflows "
      "64 bits, but data_offsets [0, 8] span 8 bytes");
}

TEST(SafetensorsMalformedTest, UnknownDType) {
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"F3","shape":[4],"data_offsets":[0,2]}})", Zeros(2)),
                  "tensor 'w' has unknown dtype \"F3\"", "BF16", "F8_E8M0", "F4", "C64");
  // Names are case-sensitive.
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", Zeros(4)),
                  "unknown dtype \"f32\"");
}

TEST(SafetensorsMalformedTest, NegativeDimension) {
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"F32","shape":[2,-3],"data_offsets":[0,0]}})"),
                  "tensor 'w' has a negative dimension -3 at index 1 of shape [2, -3]");
}

TEST(SafetensorsMalformedTest, NonIntegerDimension) {
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"F32","shape":[2,2.5],"data_offsets":[0,20]}})", Zeros(20)),
      "tensor 'w' has a non-integer dimension 2.5 at index 1");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", Zeros(8)),
                  "non-integer dimension \"2\" at index 0");
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", Zeros(8)),
                  "non-integer dimension [...] at index 0");
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"F32","shape":[null],"data_offsets":[0,8]}})", Zeros(8)),
      "non-integer dimension null at index 0");
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,0]}})"),
      "dimension 9223372036854775808 at index 0", "does not fit in a signed 64-bit integer");
}

TEST(SafetensorsMalformedTest, DataOffsetsBeginAfterEnd) {
  EXPECT_REJECTED(MakeFile(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[8,4]}})", Zeros(8)),
                  "tensor 'w' has data_offsets [8, 4] with begin 8 > end 4");
}

TEST(SafetensorsMalformedTest, ByteSizeDoesNotMatchShape) {
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}})", Zeros(10)),
      "bad.safetensors: tensor 'w' has dtype BF16 and shape [2, 3] = 12 bytes but "
      "data_offsets [0, 10] span 10 bytes");
  EXPECT_EQ(Msg(ParseFile(MakeFile(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}})",
                                   Zeros(10)),
                          "X")
                    .status()),
            "safetensors file X: tensor 'w' has dtype BF16 and shape [2, 3] = 12 bytes but "
            "data_offsets [0, 10] span 10 bytes");
  EXPECT_REJECTED(MakeFile(R"({"s":{"dtype":"F64","shape":[],"data_offsets":[0,4]}})", Zeros(4)),
                  "tensor 's' has dtype F64 and shape [] = 8 bytes but data_offsets [0, 4] "
                  "span 4 bytes");
  // Element count * size overflows 64 bits: never a match, however large the span.
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"F64","shape":[4611686018427387904,4],"data_offsets":[0,0]}})"),
      "tensor 'w' has dtype F64 and shape [4611686018427387904, 4], whose byte size overflows "
      "64 bits, but data_offsets [0, 0] span 0 bytes");
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"U32","shape":[9223372036854775807],"data_offsets":[0,0]}})"),
      "whose byte size overflows 64 bits");
}

TEST(SafetensorsMalformedTest, OffsetsBeyondTheDataRegion) {
  const std::string header = R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})";
  const std::string file = MakeFile(header, Zeros(4));
  EXPECT_REJECTED(file,
                  absl::StrFormat("tensor 'w' data_offsets [0, 8] extend beyond the data region "
                                  "of 4 bytes (file size %d, data region starts at %d)",
                                  file.size(), 8 + header.size()));
  // A huge end that would wrap around if added to the data start.
  EXPECT_REJECTED(
      MakeFile(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,)"
               R"(18446744073709551615]}})"),
      "data_offsets [18446744073709551615, 18446744073709551615] extend beyond the data region "
      "of 0 bytes");
}

TEST(SafetensorsMalformedTest, OverlappingOffsets) {
  EXPECT_REJECTED(MakeFile(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                           Zeros(12)),
                  "tensor 'b' data_offsets [4, 12] overlap tensor 'a' data_offsets [0, 8]");
  // Two tensors sharing the same bytes (aliasing is not allowed).
  EXPECT_REJECTED(MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})",
                           Zeros(4)),
                  "tensor 'b' data_offsets [0, 4] overlap tensor 'a' data_offsets [0, 4]");
  // A zero-size tensor strictly inside another.
  EXPECT_REJECTED(MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                           R"("z":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})",
                           Zeros(4)),
                  "tensor 'z' data_offsets [2, 2] overlap tensor 'a' data_offsets [0, 4]");
}

TEST(SafetensorsMalformedTest, HoleBetweenTensors) {
  EXPECT_REJECTED(MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})",
                           Zeros(12)),
                  "hole in the data region: bytes [4, 8) between tensor 'a' (data_offsets "
                  "[0, 4]) and tensor 'b' (data_offsets [8, 12]) belong to no tensor");
  // A hole at the start of the data region.
  EXPECT_REJECTED(MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", Zeros(8)),
                  "hole in the data region: bytes [0, 4) before tensor 'a' (data_offsets [4, 8])");
}

TEST(SafetensorsMalformedTest, BytesAfterTheLastTensor) {
  EXPECT_REJECTED(
      MakeFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", Zeros(7)),
      "3 bytes after the last tensor: tensor 'a' ends at data offset 4 but the data region "
      "holds 7 bytes");
  EXPECT_REJECTED(MakeFile("{}", "x"), "1 bytes after the last tensor",
                  "the header declares no tensors");
  // Space padding after the JSON belongs to the header, but not after the declared length.
  EXPECT_REJECTED(MakeFile("{}") + "  ", "2 bytes after the last tensor");
}

TEST(SafetensorsMalformedTest, MetadataNotAnObjectOfStrings) {
  EXPECT_REJECTED(MakeFile(R"({"__metadata__":"x"})"),
                  "\"__metadata__\" is a string, expected an object of strings");
  EXPECT_REJECTED(MakeFile(R"({"__metadata__":["a"]})"), "\"__metadata__\" is an array");
  EXPECT_REJECTED(MakeFile(R"({"__metadata__":null})"), "\"__metadata__\" is null");
  EXPECT_REJECTED(MakeFile(R"({"__metadata__":{"k":1}})"),
                  "\"__metadata__\" value of key 'k' is an integer, expected a string");
  EXPECT_REJECTED(MakeFile(R"({"__metadata__":{"a":"b","k":{"x":"y"}}})"),
                  "\"__metadata__\" value of key 'k' is an object");
  EXPECT_REJECTED(MakeFile(R"({"__metadata__":{"k":true}})"), "value of key 'k' is a boolean");
}

TEST(SafetensorsMalformedTest, MessagesEscapeControlCharactersInNames) {
  EXPECT_REJECTED(MakeFile(R"({"a\nb\u0001":{"dtype":"X","shape":[],"data_offsets":[0,0]}})"),
                  "tensor 'a\\nb\\x01' has unknown dtype \"X\"");
}

TEST(SafetensorsMalformedTest, TruncatedDataFromDiskIsDataLossNamingThePath) {
  absl::StatusOr<Layout> layout = PlanFile({TensorSpec{"w", DType::kF32, {4}}}, {});
  ASSERT_TRUE(layout.ok()) << layout.status();
  // The header promises 16 bytes of data; only 5 are there.
  EXPECT_REJECTED(layout->prefix + Zeros(5), "tensor 'w' data_offsets [0, 16] extend beyond");
}

// ----------------------------------------------------------------------------------------------
// ReadHeader and ReadFile I/O errors

TEST(SafetensorsReadTest, MissingFileIsNotFoundNamingThePath) {
  ScratchDir dir;
  const std::string path = dir / "missing.safetensors";
  EXPECT_STATUS(ReadHeader(path).status(), absl::StatusCode::kNotFound, path);
  EXPECT_STATUS(ReadFile(path).status(), absl::StatusCode::kNotFound, path);
  EXPECT_STATUS(ReadFile(dir / "no/such/dir.safetensors").status(), absl::StatusCode::kNotFound,
                "no/such/dir.safetensors");
}

TEST(SafetensorsReadTest, DirectoryIsRejectedNamingThePath) {
  ScratchDir dir;
  absl::Status s = ReadHeader(dir.path()).status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(Msg(s).find(dir.path()), std::string::npos) << s;
  EXPECT_NE(Msg(s).find("Is a directory"), std::string::npos) << s;
}

TEST(SafetensorsReadTest, ReadHeaderFromFdUsesTheGivenSize) {
  const std::string path = FixturePath("safetensors-samples/f.safetensors");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const uint64_t size = fs::file_size(path);
  absl::StatusOr<Header> h = ReadHeader(fd, size, "f-fd");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.at(0).name, "f");
  // A size claiming more data than the header declares.
  EXPECT_STATUS(ReadHeader(fd, size + 3, "f-fd").status(), absl::StatusCode::kDataLoss, "f-fd",
                "3 bytes after the last tensor");
  // A size that cuts the header.
  EXPECT_STATUS(ReadHeader(fd, 20, "f-fd").status(), absl::StatusCode::kDataLoss, "f-fd",
                "runs past the end of the file");
  EXPECT_STATUS(ReadHeader(fd, 7, "f-fd").status(), absl::StatusCode::kDataLoss, "f-fd is 7 bytes");
  ::close(fd);
  // A closed descriptor: the errno text naming the source.
  absl::Status bad = ReadHeader(fd, size, "closed-fd").status();
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(Msg(bad).find("closed-fd"), std::string::npos) << bad;
  EXPECT_NE(Msg(bad).find("Bad file descriptor"), std::string::npos) << bad;
}

// ----------------------------------------------------------------------------------------------
// PlanFile

TEST(SafetensorsPlanTest, MixedDTypesAreAlignedAndOrderedByElementSize) {
  const std::vector<TensorSpec> specs = {
      {"u8", DType::kU8, {3}},       {"f64", DType::kF64, {5}},     {"bf16", DType::kBF16, {7}},
      {"f32", DType::kF32, {1}},     {"bool", DType::kBool, {1}},   {"i64", DType::kI64, {2, 1}},
      {"fp8", DType::kF8E4M3, {9}},  {"u16", DType::kU16, {3}},     {"i32", DType::kI32, {0}},
      {"f16", DType::kF16, {}},      {"e5m2", DType::kF8E5M2, {1}}, {"u64", DType::kU64, {1}},
      {"f32b", DType::kF32, {3, 1}}, {"i8", DType::kI8, {5}},       {"u32", DType::kU32, {1}},
      {"i16", DType::kI16, {1}}};
  const Metadata metadata = {{"format", "pt"}, {"step", "7"}};
  absl::StatusOr<Layout> layout = PlanFile(specs, metadata);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->data_start, layout->prefix.size());
  EXPECT_EQ(layout->data_start % 8, 0u);
  ASSERT_EQ(layout->begin.size(), specs.size());
  uint64_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i].name);
    EXPECT_EQ(layout->begin[i] % DTypeSize(specs[i].dtype), 0u);
    EXPECT_EQ((layout->data_start + layout->begin[i]) % DTypeSize(specs[i].dtype), 0u);
    total += *ByteSize(specs[i].dtype, specs[i].shape);
  }
  EXPECT_EQ(layout->data_size, total);
  EXPECT_EQ(layout->file_size(), layout->data_start + total);

  // The prefix is a valid header: metadata first, tensors in data order, space padding.
  const std::string& p = layout->prefix;
  const uint64_t n = p.size() - 8;
  EXPECT_EQ(p.substr(0, 8), Le64(n));
  EXPECT_TRUE(absl::StartsWith(p.substr(8), R"({"__metadata__":{"format":"pt","step":"7"},"f64":)"))
      << p.substr(8, 80);
  const size_t json_end = p.find_last_of('}');
  EXPECT_EQ(p.substr(json_end + 1), std::string(p.size() - json_end - 1, ' '));
  EXPECT_LT(p.size() - json_end - 1, 8u);
  absl::StatusOr<File> file = ParseFile(p + Zeros(total), "planned");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->header.metadata, metadata);
  std::vector<std::string> names;
  for (const Entry& e : file->header.tensors) names.push_back(e.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"f64", "i64", "u64", "f32", "i32", "f32b", "u32", "bf16",
                                      "u16", "f16", "i16", "u8", "bool", "fp8", "e5m2", "i8"}));
  for (size_t i = 0; i < specs.size(); ++i) {
    const Entry* e = file->header.Find(specs[i].name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->begin, layout->begin[i]);
    EXPECT_EQ(e->dtype, specs[i].dtype);
    EXPECT_EQ(e->shape, specs[i].shape);
  }
}

TEST(SafetensorsPlanTest, RandomLayoutsAreAlignedAndParse) {
  uint64_t state = 12345;
  auto next = [&state] {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int round = 0; round < 50; ++round) {
    std::vector<TensorSpec> specs;
    const int count = static_cast<int>(next() % 20);
    for (int i = 0; i < count; ++i) {
      std::vector<int64_t> shape;
      const int rank = static_cast<int>(next() % 4);
      for (int d = 0; d < rank; ++d) shape.push_back(static_cast<int64_t>(next() % 5));
      const DType dtype = kAllDTypes[next() % kAllDTypes.size()];
      if (IsSubByte(dtype)) shape.push_back(4);  // 4 elements of 4 or 6 bits: whole bytes
      specs.push_back(TensorSpec{absl::StrFormat("t%d", i), dtype, shape});
    }
    Metadata md;
    if (next() % 2) md["round"] = absl::StrCat(round);
    absl::StatusOr<Layout> layout = PlanFile(specs, md);
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(layout->data_start % 8, 0u);
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_EQ(layout->begin[i] % DTypeSize(specs[i].dtype), 0u);
    }
    absl::StatusOr<Header> h =
        ParseHeader(layout->prefix, layout->file_size(), absl::StrCat("round ", round));
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->tensors.size(), specs.size());
    EXPECT_EQ(h->metadata, md);
  }
}

TEST(SafetensorsPlanTest, EmptyPlanIsAPaddedEmptyObject) {
  absl::StatusOr<Layout> layout = PlanFile({}, {});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->prefix, Le64(8) + "{}      ");
  EXPECT_EQ(layout->data_start, 16u);
  EXPECT_EQ(layout->data_size, 0u);
  EXPECT_TRUE(ParseFile(layout->prefix, "empty").ok());
}

TEST(SafetensorsPlanTest, InvalidSpecsAreInvalidArgument) {
  using S = std::vector<TensorSpec>;
  const auto plan = [](const S& specs, const Metadata& md = {}) {
    return PlanFile(specs, md).status();
  };
  EXPECT_STATUS(plan(S{{"a", DType::kU8, {1}}, {"", DType::kU8, {1}}}),
                absl::StatusCode::kInvalidArgument, "tensor 1 of 2 has an empty name");
  EXPECT_STATUS(plan(S{{"ok", DType::kU8, {1}}, {"bad\xff", DType::kU8, {1}}}),
                absl::StatusCode::kInvalidArgument, "tensor 1 has a name that is not valid UTF-8",
                "at byte 3");
  EXPECT_STATUS(plan(S{{"\xed\xa0\x80", DType::kU8, {1}}}), absl::StatusCode::kInvalidArgument,
                "not valid UTF-8", "surrogate");
  EXPECT_STATUS(plan(S{{"w", DType::kU8, {1}}, {"v", DType::kU8, {1}}, {"w", DType::kF32, {}}}),
                absl::StatusCode::kInvalidArgument, "duplicate tensor name 'w' (tensors 0 and 2)");
  EXPECT_STATUS(plan(S{{"__metadata__", DType::kU8, {1}}}), absl::StatusCode::kInvalidArgument,
                "\"__metadata__\"", "reserved");
  EXPECT_STATUS(plan(S{{"neg", DType::kU8, {2, -1}}}), absl::StatusCode::kInvalidArgument,
                "tensor 'neg'", "negative dimension -1");
  EXPECT_STATUS(plan(S{{"huge", DType::kF32, {int64_t{1} << 62, 4}}}),
                absl::StatusCode::kInvalidArgument, "tensor 'huge'", "2^63");
  EXPECT_STATUS(plan(S{{"huge", DType::kF64, {int64_t{1} << 62}}}),
                absl::StatusCode::kInvalidArgument, "tensor 'huge'", "overflows");
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_STATUS(
      plan(S{{"a", DType::kU8, {max}}, {"b", DType::kU8, {max}}, {"c", DType::kU8, {max}}}),
      absl::StatusCode::kInvalidArgument, "total size overflows", "'c'");
  EXPECT_STATUS(plan(S{}, Metadata{{"k\xc0", "v"}}), absl::StatusCode::kInvalidArgument,
                "metadata key", "not valid UTF-8");
  EXPECT_STATUS(plan(S{}, Metadata{{"k", "v\xe0\x80"}}), absl::StatusCode::kInvalidArgument,
                "metadata value of key 'k'", "not valid UTF-8");
  EXPECT_STATUS(plan(S{{"x", static_cast<DType>(200), {1}}}), absl::StatusCode::kInvalidArgument,
                "tensor 'x' has an invalid dtype");
}

// ----------------------------------------------------------------------------------------------
// WriteFile

TEST(SafetensorsWriteTest, NamesWithAnyCharactersRoundTrip) {
  std::vector<std::string> names = {
      "model.layers.0.self_attn.q_proj.weight",
      "a/b/c",
      "/leading/slash",
      "with space",
      " leading and trailing ",
      "quote\"d",
      "single'quote",
      "back\\slash",
      "\\u0041 literal escape",
      "new\nline",
      "tab\tcr\r",
      "ctrl\x01\x1f\x7f",
      std::string("nul\0inside", 10),
      "emoji \xf0\x9f\x98\x80",
      "\xe5\x90\x8d\xe5\x89\x8d",  // 名前
      "line sep \xe2\x80\xa8",
      "{\"dtype\":\"F32\"}",
      "[0, 4]",
      "__metadata",
      "__metadata__x",
      ".",
      "..",
      std::string(333, 'x') + ".weight",
  };
  std::string accents;
  for (int i = 0; i < 150; ++i) accents += "\xc3\xa9";  // 150 x U+00E9 = 300 bytes
  names.push_back(accents);
  std::vector<std::vector<int16_t>> data;
  std::vector<TensorView> views;
  for (size_t i = 0; i < names.size(); ++i) {
    data.push_back({static_cast<int16_t>(i), static_cast<int16_t>(-static_cast<int>(i))});
  }
  for (size_t i = 0; i < names.size(); ++i) {
    views.push_back(View(names[i], DType::kI16, {2}, data[i].data()));
  }
  const Metadata metadata = {{"key \"with\"\nstuff\\", "value \xf0\x9f\x98\x80\t\x01"},
                             {"", "empty key"}};
  ScratchDir dir;
  const std::string path = dir / "names.safetensors";
  ASSERT_TRUE(WriteFile(path, views, metadata).ok());
  absl::StatusOr<File> file = ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->header.metadata, metadata);
  ASSERT_EQ(file->header.tensors.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(file->header.tensors[i].name, names[i]);  // same dtype: input order is kept
    const Entry* e = file->header.Find(names[i]);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(BytesOf(*file, *e), RawBytes(data[i]));
  }
}

// A writer killed mid-write leaves "<path>.tmp.<host>.<pid>"; the next write removes those of
// dead processes of this host, and leaves other hosts' (a shared filesystem) and live ones.
TEST(SafetensorsWriteTest, TemporariesOfKilledWritersAreRemovedOthersKept) {
  ScratchDir dir;
  const std::string path = dir.path() + "/model.safetensors";
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof(host) - 1), 0);
  const pid_t dead = fork();
  ASSERT_GE(dead, 0);
  if (dead == 0) _exit(0);
  ASSERT_EQ(waitpid(dead, nullptr, 0), dead);
  const std::string stale = absl::StrFormat("%s.tmp.%s.%d", path, host, dead);
  const std::string live = absl::StrFormat("%s.tmp.%s.%d", path, host, getppid());
  const std::string other_host = absl::StrFormat("%s.tmp.other-host.%d", path, dead);
  const std::string other_file =
      absl::StrFormat("%s/config.json.tmp.%s.%d", dir.path(), host, dead);
  for (const std::string& p : {stale, live, other_host, other_file}) {
    std::ofstream(p) << "partial";
  }
  const std::vector<float> vec = {1.5f, -2.25f};
  ASSERT_TRUE(WriteFile(path, {View("vec", DType::kF32, {2}, vec.data())}, {}).ok());
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_TRUE(std::filesystem::exists(other_host));
  EXPECT_TRUE(std::filesystem::exists(other_file));
  auto back = ReadFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->header.tensors.size(), 1u);
}

TEST(SafetensorsWriteTest, ScalarsAndZeroSizeTensorsRoundTrip) {
  const double scalar = 3.5;
  const int8_t small = -7;
  const std::vector<float> vec = {1.5f, -2.25f};
  std::vector<TensorView> views = {
      View("empty_f32", DType::kF32, {0}, nullptr),
      View("scalar_f64", DType::kF64, {}, &scalar),
      View("empty_2d", DType::kI16, {3, 0}, nullptr),
      View("empty_lead", DType::kBF16, {0, 5}, nullptr),
      View("vec", DType::kF32, {2}, vec.data()),
      View("scalar_i8", DType::kI8, {}, &small),
      View("empty_strided", DType::kF64, {2, 0, 3}, nullptr, {0, 7, -1}),
  };
  ScratchDir dir;
  const std::string path = dir / "edge.safetensors";
  ASSERT_TRUE(WriteFile(path, views, {}).ok());
  absl::StatusOr<File> file = ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->header.metadata.empty());
  EXPECT_EQ(file->header.data_size, 8u + 8u + 1u);
  for (const TensorView& v : views) {
    SCOPED_TRACE(v.name);
    const Entry* e = file->header.Find(v.name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->dtype, v.dtype);
    EXPECT_EQ(e->shape, v.shape);
    EXPECT_EQ(e->nbytes(), *ByteSize(v.dtype, v.shape));
  }
  EXPECT_EQ(Decode(DType::kF64, file->Bytes(*file->header.Find("scalar_f64"))),
            std::vector<double>{3.5});
  EXPECT_EQ(Decode(DType::kI8, file->Bytes(*file->header.Find("scalar_i8"))),
            std::vector<double>{-7});
  EXPECT_EQ(Decode(DType::kF32, file->Bytes(*file->header.Find("vec"))),
            (std::vector<double>{1.5, -2.25}));
  const std::string raw = ReadFileOrDie(path);
  EXPECT_TRUE(absl::StartsWith(raw.substr(8), R"({"scalar_f64":{"dtype":"F64","shape":[])"))
      << raw.substr(8, 80);
}

TEST(SafetensorsWriteTest, NonContiguousViewsArePacked) {
  // Base buffers with distinct values.
  std::vector<float> f32(6);
  std::iota(f32.begin(), f32.end(), 0.0f);  // [[0,1,2],[3,4,5]]
  std::vector<int16_t> i16(10);
  std::iota(i16.begin(), i16.end(), int16_t{100});
  std::vector<double> f64(4 * 3 * 2);
  std::iota(f64.begin(), f64.end(), 0.5);
  std::vector<uint8_t> u8(4);
  std::iota(u8.begin(), u8.end(), uint8_t{7});
  std::vector<int32_t> i32(12);
  std::iota(i32.begin(), i32.end(), -6);  // 3x4

  std::vector<TensorView> views = {
      // Transpose of the 2x3 matrix: [[0,3],[1,4],[2,5]].
      View("transposed", DType::kF32, {3, 2}, f32.data(), {1, 3}),
      // Reversed: data points at the last element.
      View("reversed", DType::kI16, {10}, i16.data() + 9, {-1}),
      // Every other element, backwards, in two rows.
      View("neg_2d", DType::kI16, {2, 2}, i16.data() + 9, {-5, -2}),
      // Row broadcast: the 4-element row repeated 3 times (outer stride 0).
      View("broadcast_rows", DType::kU8, {3, 4}, u8.data(), {0, 1}),
      // Column broadcast: each element repeated along the inner dimension (inner stride 0).
      View("broadcast_cols", DType::kU8, {4, 3}, u8.data(), {1, 0}),
      // A scalar broadcast to a 2x2 (all strides 0).
      View("broadcast_all", DType::kF64, {2, 2}, f64.data() + 5, {0, 0}),
      // A 3-D permutation of a [4,3,2] array to [2,3,4].
      View("permuted", DType::kF64, {2, 3, 4}, f64.data(), {1, 2, 6}),
      // Rows flipped (negative outer stride, contiguous rows: the memcpy path).
      View("flipped_rows", DType::kI32, {3, 4}, i32.data() + 8, {-4, 1}),
      // A strided slice: every second column.
      View("sliced", DType::kI32, {3, 2}, i32.data() + 1, {4, 2}),
      // Size-1 dimensions with arbitrary strides are still contiguous.
      View("unit_dims", DType::kF32, {1, 6, 1}, f32.data(), {999, 1, -5}),
  };
  const std::map<std::string, std::vector<double>> expected = {
      {"transposed", {0, 3, 1, 4, 2, 5}},
      {"reversed", {109, 108, 107, 106, 105, 104, 103, 102, 101, 100}},
      {"neg_2d", {109, 107, 104, 102}},
      {"broadcast_rows", {7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10}},
      {"broadcast_cols", {7, 7, 7, 8, 8, 8, 9, 9, 9, 10, 10, 10}},
      {"broadcast_all", {5.5, 5.5, 5.5, 5.5}},
      {"flipped_rows", {2, 3, 4, 5, -2, -1, 0, 1, -6, -5, -4, -3}},
      {"sliced", {-5, -3, -1, 1, 3, 5}},
      {"unit_dims", {0, 1, 2, 3, 4, 5}},
  };
  ScratchDir dir;
  const std::string path = dir / "strided.safetensors";
  ASSERT_TRUE(WriteFile(path, views, {}).ok());
  absl::StatusOr<File> file = ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  for (const TensorView& v : views) {
    SCOPED_TRACE(v.name);
    const Entry* e = file->header.Find(v.name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->shape, v.shape);
    EXPECT_EQ(BytesOf(*file, *e), NaivePack(v));
    auto it = expected.find(v.name);
    if (it != expected.end()) EXPECT_EQ(Decode(v.dtype, file->Bytes(*e)), it->second);
  }
  // permuted[a][b][c] = base[c][b][a] = 0.5 + 6c + 2b + a.
  std::vector<double> permuted;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 4; ++c) permuted.push_back(0.5 + 6 * c + 2 * b + a);
  EXPECT_EQ(Decode(DType::kF64, file->Bytes(*file->header.Find("permuted"))), permuted);
}

TEST(SafetensorsWriteTest, LargeNonContiguousViewsCrossTheStagingBuffer) {
  // A 1024x1024 F32 transpose (4 MiB) and a single 600,000-element row read with stride 2
  // (2.4 MB, larger than any staging buffer), mixed with small contiguous tensors.
  const int n = 1024;
  std::vector<float> square(static_cast<size_t>(n) * n);
  for (size_t i = 0; i < square.size(); ++i) square[i] = static_cast<float>(i % 1000003);
  std::vector<float> wide(1'200'000);
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<float>(i);
  const std::vector<uint8_t> tiny = {1, 2, 3};
  std::vector<TensorView> views = {
      View("tiny", DType::kU8, {3}, tiny.data()),
      View("square_t", DType::kF32, {n, n}, square.data(), {1, n}),
      View("wide", DType::kF32, {1, 600'000}, wide.data(), {0, 2}),
      View("square", DType::kF32, {n, n}, square.data()),
  };
  ScratchDir dir;
  const std::string path = dir / "large.safetensors";
  ASSERT_TRUE(WriteFile(path, views, {{"k", "v"}}).ok());
  absl::StatusOr<File> file = ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  for (const TensorView& v : views) {
    SCOPED_TRACE(v.name);
    const Entry* e = file->header.Find(v.name);
    ASSERT_NE(e, nullptr);
    std::string want = v.strides.empty()
                           ? std::string(static_cast<const char*>(v.data), e->nbytes())
                           : NaivePack(v);
    EXPECT_TRUE(BytesOf(*file, *e) == want);
  }
  std::span<const std::byte> t = file->Bytes(*file->header.Find("square_t"));
  float x;
  std::memcpy(&x, t.data() + (3 * n + 5) * 4, 4);  // square_t[3][5] = square[5][3]
  EXPECT_EQ(x, static_cast<float>(5 * n + 3));
  std::memcpy(&x, file->Bytes(*file->header.Find("wide")).data() + 599'999 * 4, 4);
  EXPECT_EQ(x, 1'199'998.0f);
}

TEST(SafetensorsWriteTest, InvalidViewsAreInvalidArgumentAndWriteNothing) {
  ScratchDir dir;
  const std::string path = dir / "x.safetensors";
  const float data[4] = {};
  TensorView cuda = View("gpu", DType::kF32, {4}, data);
  cuda.device = Device{DeviceType::kCuda, 1};
  EXPECT_STATUS(WriteFile(path, {cuda}, {}), absl::StatusCode::kInvalidArgument, path,
                "tensor 'gpu' is not on the CPU");
  EXPECT_STATUS(WriteFile(path, {View("s", DType::kF32, {2, 2}, data, {2})}, {}),
                absl::StatusCode::kInvalidArgument, "tensor 's' has 1 strides for shape [2, 2]");
  EXPECT_STATUS(WriteFile(path, {View("null", DType::kF32, {4}, nullptr)}, {}),
                absl::StatusCode::kInvalidArgument, "tensor 'null' of shape [4] has null data");
  EXPECT_STATUS(
      WriteFile(path, {View("a", DType::kF32, {4}, data), View("a", DType::kU8, {1}, data)}, {}),
      absl::StatusCode::kInvalidArgument, path, "duplicate tensor name 'a'");
  EXPECT_STATUS(WriteFile(path, {View("", DType::kF32, {4}, data)}, {}),
                absl::StatusCode::kInvalidArgument, "empty name");
  EXPECT_STATUS(WriteFile(path, {View("n", DType::kF32, {-4}, data)}, {}),
                absl::StatusCode::kInvalidArgument, "negative dimension");
  EXPECT_TRUE(FilesIn(dir.path()).empty());
}

TEST(SafetensorsWriteTest, OverwritingReplacesThePreviousFile) {
  ScratchDir dir;
  const std::string path = dir / "w.safetensors";
  const std::vector<int32_t> first = {1, 2, 3};
  const std::vector<int32_t> second = {4, 5};
  ASSERT_TRUE(WriteFile(path, {View("w", DType::kI32, {3}, first.data())}, {{"v", "1"}}).ok());
  ASSERT_TRUE(WriteFile(path, {View("w", DType::kI32, {2}, second.data())}, {{"v", "2"}}).ok());
  absl::StatusOr<File> file = ReadFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->header.metadata, (Metadata{{"v", "2"}}));
  EXPECT_EQ(BytesOf(*file, file->header.tensors.at(0)), RawBytes(second));
  EXPECT_EQ(FilesIn(dir.path()), std::vector<std::string>{"w.safetensors"});
  // A relative path (no directory part) works too.
  const std::string cwd = fs::current_path();
  fs::current_path(dir.path());
  EXPECT_TRUE(WriteFile("rel.safetensors", {View("w", DType::kI32, {2}, second.data())}, {}).ok());
  fs::current_path(cwd);
  EXPECT_EQ(FilesIn(dir.path()), (std::vector<std::string>{"rel.safetensors", "w.safetensors"}));
}

TEST(SafetensorsWriteTest, MissingDirectoryIsNotFoundAndLeavesNothing) {
  ScratchDir dir;
  const std::string path = dir / "no/such/dir/w.safetensors";
  const float data[2] = {1, 2};
  absl::Status s = WriteFile(path, {View("w", DType::kF32, {2}, data)}, {});
  EXPECT_STATUS(s, absl::StatusCode::kNotFound, path, "No such file or directory");
  EXPECT_TRUE(FilesIn(dir.path()).empty());
}

TEST(SafetensorsWriteTest, FailedRenameRemovesTheTemporaryFile) {
  // The destination is an existing directory: everything is written, then rename(2) fails.
  ScratchDir dir;
  const std::string path = dir / "occupied";
  fs::create_directory(path);
  WriteFileOrDie(path + "/keep", "inside");
  const float data[2] = {1, 2};
  absl::Status s = WriteFile(path, {View("w", DType::kF32, {2}, data)}, {});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(Msg(s).find("rename"), std::string::npos) << s;
  EXPECT_NE(Msg(s).find(path), std::string::npos) << s;
  EXPECT_EQ(FilesIn(dir.path()), std::vector<std::string>{"occupied"});
  EXPECT_EQ(ReadFileOrDie(path + "/keep"), "inside");
}

TEST(SafetensorsWriteTest, FailedWriteKeepsThePreviousFileAndRemovesTheTemporary) {
  ScratchDir dir;
  const std::string path = dir / "model.safetensors";
  const std::vector<int32_t> old_data = {1, 2, 3, 4};
  ASSERT_TRUE(WriteFile(path, {View("w", DType::kI32, {4}, old_data.data())}, {}).ok());
  const std::string before = ReadFileOrDie(path);

  // Limit the size of files this process may write: the big write fails with EFBIG
  // (SIGXFSZ ignored), which is honest even when running as root.
  std::vector<float> big(1 << 18);  // 1 MiB
  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  struct sigaction ignore = {}, old_action;
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &old_action), 0);
  struct rlimit small = old_limit;
  small.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  absl::Status s = WriteFile(path, {View("w", DType::kF32, {1 << 18}, big.data())}, {});
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::sigaction(SIGXFSZ, &old_action, nullptr);

  EXPECT_STATUS(s, absl::StatusCode::kResourceExhausted, path, "write", "File too large");
  EXPECT_EQ(ReadFileOrDie(path), before);
  EXPECT_EQ(FilesIn(dir.path()), std::vector<std::string>{"model.safetensors"});
}

}  // namespace
}  // namespace weightbus::safetensors

namespace weightbus::safetensors {
namespace {

// Issue 10, item 14, end to end: tensors of the new dtypes published over disk:// (and through
// the delta layer) reach a subscriber bit-exact; sub-byte views must be contiguous.
std::vector<testing::OwnedTensor> NewDTypeVersion(uint64_t version) {
  std::vector<testing::OwnedTensor> out;
  for (const auto& [name, dtype, shape] :
       std::vector<std::tuple<std::string, DType, std::vector<int64_t>>>{
           {"experts.w1.blocks", DType::kF4, {64, 32}},
           {"experts.w1.scales", DType::kF8E8M0, {64, 1}},
           {"mx6.e2m3", DType::kF6E2M3, {16, 8}},
           {"mx6.e3m2", DType::kF6E3M2, {4}},
           {"rotary.freqs", DType::kC64, {7}},
           {"fp8.fnuz", DType::kF8E4M3FNUZ, {5}},
           {"fp8.e5fnuz", DType::kF8E5M2FNUZ, {3}}}) {
    testing::OwnedTensor t{name, dtype, shape, {}};
    t.bytes.resize(*ByteSize(dtype, shape));
    for (size_t i = 0; i < t.bytes.size(); ++i) {
      t.bytes[i] = static_cast<std::byte>((i * 131 + version * 7 + name.size()) & 0xff);
    }
    out.push_back(std::move(t));
  }
  return out;
}

// Every dtype crossing every transport stack is conformance_test's; here, what disk:// writes.
TEST(NewDTypesTest, DiskVersionIsASafetensorsFileNamingTheDtypes) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  const std::string uri = "disk://" + dir.path() + "/channel?fsync=false";
  auto pub = Publisher::Open(uri);
  ASSERT_TRUE(pub.ok()) << pub.status();
  const std::vector<testing::OwnedTensor> version = NewDTypeVersion(3);
  const absl::Status s = (*pub)->Publish(3, testing::Views(version), {}, absl::Seconds(30));
  ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<File> file =
      ReadFile(dir.path() + "/channel/versions/v00000000000000000003/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  for (const testing::OwnedTensor& t : version) {
    const Entry* entry = file->header.Find(t.name);
    ASSERT_NE(entry, nullptr) << t.name;
    EXPECT_EQ(entry->dtype, t.dtype) << t.name;
    EXPECT_EQ(entry->nbytes(), t.bytes.size()) << t.name;
  }
  const Entry* blocks = file->header.Find("experts.w1.blocks");
  ASSERT_NE(blocks, nullptr);
  EXPECT_EQ(DTypeName(blocks->dtype), "F4");
  EXPECT_EQ(blocks->nbytes(), 64u * 32u / 2u);
}

TEST(NewDTypesTest, StridedSubByteViewsAreUnimplementedNamingTensorAndDtype) {
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ScratchDir dir;
  auto pub = Publisher::Open("disk://" + dir.path() + "/channel?fsync=false");
  ASSERT_TRUE(pub.ok()) << pub.status();
  const std::vector<std::byte> bytes(16);
  const TensorView view{"experts.w2.blocks", DType::kF4, {4, 8}, {1, 4}, bytes.data()};
  const absl::Status s = (*pub)->Publish(1, {view}, {}, absl::Seconds(30));
  ASSERT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "experts.w2.blocks")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "F4")) << s;
  // A contiguous view of the same bytes is fine; a shape of partial bytes is InvalidArgument.
  const TensorView contiguous{"experts.w2.blocks", DType::kF4, {4, 8}, {}, bytes.data()};
  EXPECT_TRUE((*pub)->Publish(1, {contiguous}, {}, absl::Seconds(30)).ok());
  const TensorView partial{"odd", DType::kF4, {3}, {}, bytes.data()};
  const absl::Status odd = (*pub)->Publish(2, {partial}, {}, absl::Seconds(30));
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument) << odd;
  EXPECT_TRUE(absl::StrContains(odd.message(), "whole number of bytes")) << odd;
}

}  // namespace
}  // namespace weightbus::safetensors
