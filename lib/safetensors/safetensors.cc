// SPDX-License-Identifier: Apache-2.0
// The safetensors reader and writer. The header is parsed with nlohmann's SAX interface straight
// into entries (no DOM), so that duplicate keys can be detected (a DOM silently keeps the last
// one), the header's key order is kept, and huge headers cost memory only for what is kept.
#include "weightbus/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/bytes.h"
#include "core/status.h"
#include "core/system.h"
#include "core/tensor_pack.h"
#include "core/utf8.h"
#include "nlohmann/json.hpp"

namespace weightbus::safetensors {
namespace {

using internal::FindInvalidUtf8;
using internal::Utf8Error;
using nlohmann::json;

constexpr uint64_t kLengthBytes = 8;
constexpr std::string_view kMetadataKey = "__metadata__";
// Staging buffer of the writer: small pieces are coalesced into it, non-contiguous tensors are
// packed through it.
constexpr size_t kWriteBufferBytes = size_t{1} << 20;
// Largest single read(2)/write(2): Linux transfers at most 0x7ffff000 bytes per call anyway.
constexpr size_t kMaxIoBytes = size_t{1} << 30;

// A name as shown in messages: single-quoted, control characters escaped (so that a name with
// a newline cannot break a log line), everything else verbatim.
std::string Quoted(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('\'');
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u != 0x7f) {
      out.push_back(c);
      continue;
    }
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        absl::StrAppendFormat(&out, "\\x%02x", u);
        break;
    }
  }
  out.push_back('\'');
  return out;
}

std::string OffsetsString(uint64_t begin, uint64_t end) {
  return absl::StrFormat("[%d, %d]", begin, end);
}

// ---------------------------------------------------------------------------------------------
// Header parsing

// Describes a JSON value's type for messages ("a string", "an array", ...).
enum class Kind : uint8_t { kNull, kBool, kInteger, kFloat, kString, kBinary, kArray, kObject };

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kNull:
      return "null";
    case Kind::kBool:
      return "a boolean";
    case Kind::kInteger:
      return "an integer";
    case Kind::kFloat:
      return "a non-integer number";
    case Kind::kString:
      return "a string";
    case Kind::kBinary:
      return "binary";
    case Kind::kArray:
      return "an array";
    case Kind::kObject:
      return "an object";
  }
  return "?";
}

// One JSON value as seen by the SAX handler. `text` renders a scalar for messages.
struct Value {
  Kind kind = Kind::kNull;
  int64_t i = 0;   // kInteger, when !is_unsigned
  uint64_t u = 0;  // kInteger, when is_unsigned
  bool is_unsigned = false;
  std::string* str = nullptr;  // kString (may be moved from)
  std::string text;
};

// A tensor entry as written in the header, before validation.
struct RawTensor {
  std::string name;
  bool has_dtype = false;
  bool has_shape = false;
  bool has_offsets = false;
  std::string dtype;
  std::optional<Kind> dtype_bad_kind;    // "dtype" is not a string
  std::optional<Kind> shape_bad_kind;    // "shape" is not an array
  std::optional<Kind> offsets_bad_kind;  // "data_offsets" is not an array
  std::vector<int64_t> shape;            // at most kMaxRank dimensions are kept
  size_t rank = 0;                       // dimensions in the header
  // First dimension that is not an int64 integer: index, and its rendering.
  std::optional<std::pair<size_t, std::string>> bad_dim;
  bool bad_dim_too_large = false;
  std::vector<uint64_t> offsets;  // the first two are kept
  size_t offsets_count = 0;
  // First element of "data_offsets" that is not a non-negative integer.
  std::optional<std::pair<size_t, std::string>> bad_offset;
};

class HeaderSax final : public nlohmann::json_sax<json> {
 public:
  HeaderSax(std::string_view source, uint64_t header_size, Header* out)
      : source_(source), header_size_(header_size), out_(out) {}

  // The first semantic or syntax error, or OK.
  const absl::Status& status() const { return status_; }

  bool null() override { return Scalar(Value{Kind::kNull, 0, 0, false, nullptr, "null"}); }
  bool boolean(bool v) override {
    return Scalar(Value{Kind::kBool, 0, 0, false, nullptr, v ? "true" : "false"});
  }
  bool number_integer(number_integer_t v) override {
    return Scalar(Value{Kind::kInteger, v, 0, false, nullptr, absl::StrCat(v)});
  }
  bool number_unsigned(number_unsigned_t v) override {
    return Scalar(Value{Kind::kInteger, 0, v, true, nullptr, absl::StrCat(v)});
  }
  bool number_float(number_float_t, const string_t& s) override {
    return Scalar(Value{Kind::kFloat, 0, 0, false, nullptr, s});
  }
  bool string(string_t& s) override { return Scalar(Value{Kind::kString, 0, 0, false, &s, ""}); }
  bool binary(binary_t&) override {
    return Scalar(Value{Kind::kBinary, 0, 0, false, nullptr, "binary"});
  }
  bool start_object(std::size_t) override { return StartContainer(Kind::kObject); }
  bool start_array(std::size_t) override { return StartContainer(Kind::kArray); }
  bool end_object() override { return EndContainer(); }
  bool end_array() override { return EndContainer(); }
  bool key(string_t& k) override;

  bool parse_error(std::size_t position, const std::string& last_token,
                   const nlohmann::detail::exception& ex) override {
    // A syntax error is more fundamental than any semantic one found before it.
    status_ = absl::DataLossError(absl::StrFormat(
        "safetensors file %s: header is not valid JSON (%d-byte header, error near header byte "
        "%d): %s",
        source_, header_size_, position, ex.what()));
    failed_ = true;
    return false;
  }

 private:
  enum class Ctx : uint8_t { kTop, kTensor, kMetadata, kShape, kOffsets, kSkip };
  enum class Field : uint8_t { kDType, kShape, kOffsets, kOther };

  template <typename... Args>
  bool Fail(const absl::FormatSpec<std::string_view, Args...>& format, const Args&... args) {
    if (!failed_) {
      status_ = absl::DataLossError(absl::StrFormat(format, source_, args...));
      failed_ = true;
    }
    // Keep parsing: a later syntax error takes precedence over this one.
    return true;
  }

  bool Scalar(const Value& v) {
    if (failed_) return true;
    OnValue(v);
    return true;
  }
  bool StartContainer(Kind kind) {
    if (failed_) return true;
    Value v;
    v.kind = kind;
    v.text = kind == Kind::kArray ? "[...]" : "{...}";
    ctx_.push_back(OnValue(v));
    return true;
  }
  bool EndContainer() {
    if (failed_) return true;
    const Ctx ctx = ctx_.back();
    ctx_.pop_back();
    if (ctx == Ctx::kTensor) FinishTensor();
    return true;
  }

  // Handles a scalar value or the start of a container; for a container, returns the context
  // of its contents.
  Ctx OnValue(const Value& v);
  void FinishTensor();

  std::string_view source_;
  uint64_t header_size_;
  Header* out_;
  absl::Status status_;
  bool failed_ = false;

  std::vector<Ctx> ctx_;
  absl::flat_hash_set<std::string> names_;  // top-level keys seen
  size_t tensor_keys_ = 0;                  // top-level keys other than "__metadata__"
  bool pending_metadata_ = false;           // the top-level key just read is "__metadata__"
  std::string pending_name_;                // the top-level key just read (a tensor name)
  Field pending_field_ = Field::kOther;
  std::string pending_metadata_key_;
  RawTensor raw_;
};

bool HeaderSax::key(string_t& k) {
  if (failed_) return true;
  switch (ctx_.back()) {
    case Ctx::kTop:
      if (!names_.insert(k).second) {
        if (k == kMetadataKey) return Fail("safetensors file %s: duplicate key \"__metadata__\"");
        return Fail("safetensors file %s: duplicate tensor name %s", Quoted(k));
      }
      pending_metadata_ = k == kMetadataKey;
      if (!pending_metadata_ && ++tensor_keys_ > kMaxTensors) {
        return Fail("safetensors file %s: header declares more than %d tensors, the limit",
                    kMaxTensors);
      }
      if (k.size() > kMaxTensorNameBytes) {
        return Fail(
            "safetensors file %s: tensor name %s... is %d bytes long, more than the limit of %d",
            Quoted(std::string_view(k).substr(0, 64)), k.size(), kMaxTensorNameBytes);
      }
      if (!pending_metadata_) pending_name_ = std::move(k);
      return true;
    case Ctx::kTensor: {
      bool* seen = nullptr;
      if (k == "dtype") {
        pending_field_ = Field::kDType;
        seen = &raw_.has_dtype;
      } else if (k == "shape") {
        pending_field_ = Field::kShape;
        seen = &raw_.has_shape;
      } else if (k == "data_offsets") {
        pending_field_ = Field::kOffsets;
        seen = &raw_.has_offsets;
      } else {
        pending_field_ = Field::kOther;  // unknown fields are ignored
        return true;
      }
      if (*seen) {
        return Fail("safetensors file %s: tensor %s has a duplicate field \"%s\"",
                    Quoted(raw_.name), k);
      }
      *seen = true;
      return true;
    }
    case Ctx::kMetadata:
      if (out_->metadata.count(k) != 0) {
        return Fail("safetensors file %s: \"__metadata__\" has a duplicate key %s", Quoted(k));
      }
      pending_metadata_key_ = std::move(k);
      return true;
    default:
      return true;  // inside an ignored value
  }
}

HeaderSax::Ctx HeaderSax::OnValue(const Value& v) {
  if (ctx_.empty()) {
    // The root. ParseHeader checked that the header starts with '{'.
    if (v.kind != Kind::kObject) {
      Fail("safetensors file %s: header is %s, not a JSON object", KindName(v.kind));
      return Ctx::kSkip;
    }
    return Ctx::kTop;
  }
  switch (ctx_.back()) {
    case Ctx::kTop:
      if (pending_metadata_) {
        if (v.kind != Kind::kObject) {
          Fail("safetensors file %s: \"__metadata__\" is %s, expected an object of strings",
               KindName(v.kind));
          return Ctx::kSkip;
        }
        return Ctx::kMetadata;
      }
      if (v.kind != Kind::kObject) {
        Fail(
            "safetensors file %s: tensor %s is %s, expected an object with \"dtype\", "
            "\"shape\" and \"data_offsets\"",
            Quoted(pending_name_), KindName(v.kind));
        return Ctx::kSkip;
      }
      raw_ = RawTensor();
      raw_.name = std::move(pending_name_);
      return Ctx::kTensor;

    case Ctx::kTensor:
      switch (pending_field_) {
        case Field::kDType:
          if (v.kind == Kind::kString) {
            raw_.dtype = std::move(*v.str);
          } else {
            raw_.dtype_bad_kind = v.kind;
          }
          return Ctx::kSkip;
        case Field::kShape:
          if (v.kind == Kind::kArray) return Ctx::kShape;
          raw_.shape_bad_kind = v.kind;
          return Ctx::kSkip;
        case Field::kOffsets:
          if (v.kind == Kind::kArray) return Ctx::kOffsets;
          raw_.offsets_bad_kind = v.kind;
          return Ctx::kSkip;
        case Field::kOther:
          return Ctx::kSkip;
      }
      return Ctx::kSkip;

    case Ctx::kMetadata:
      if (v.kind != Kind::kString) {
        Fail("safetensors file %s: \"__metadata__\" value of key %s is %s, expected a string",
             Quoted(pending_metadata_key_), KindName(v.kind));
        return Ctx::kSkip;
      }
      out_->metadata.emplace(std::move(pending_metadata_key_), std::move(*v.str));
      return Ctx::kSkip;

    case Ctx::kShape: {
      const size_t index = raw_.rank++;
      if (index >= kMaxRank) return Ctx::kSkip;  // reported by FinishTensor
      if (v.kind == Kind::kInteger) {
        if (!v.is_unsigned) {
          raw_.shape.push_back(v.i);  // negative: reported by FinishTensor
        } else if (v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          if (!raw_.bad_dim) {
            raw_.bad_dim.emplace(index, v.text);
            raw_.bad_dim_too_large = true;
          }
          raw_.shape.push_back(0);
        } else {
          raw_.shape.push_back(static_cast<int64_t>(v.u));
        }
      } else {
        if (!raw_.bad_dim) {
          raw_.bad_dim.emplace(
              index, v.kind == Kind::kString ? absl::StrFormat("\"%s\"", *v.str) : v.text);
        }
        raw_.shape.push_back(0);
      }
      return Ctx::kSkip;
    }

    case Ctx::kOffsets: {
      const size_t index = raw_.offsets_count++;
      if (v.kind == Kind::kInteger && (v.is_unsigned || v.i >= 0)) {
        if (index < 2) raw_.offsets.push_back(v.is_unsigned ? v.u : static_cast<uint64_t>(v.i));
      } else if (!raw_.bad_offset) {
        raw_.bad_offset.emplace(
            index, v.kind == Kind::kString ? absl::StrFormat("\"%s\"", *v.str) : v.text);
      }
      return Ctx::kSkip;
    }

    case Ctx::kSkip:
      return Ctx::kSkip;
  }
  return Ctx::kSkip;
}

void HeaderSax::FinishTensor() {
  const RawTensor& t = raw_;
  const std::string name = Quoted(t.name);
  if (!t.has_dtype) {
    Fail("safetensors file %s: tensor %s is missing field \"dtype\"", name);
    return;
  }
  if (t.dtype_bad_kind) {
    Fail("safetensors file %s: tensor %s field \"dtype\" is %s, expected a string", name,
         KindName(*t.dtype_bad_kind));
    return;
  }
  if (!t.has_shape) {
    Fail("safetensors file %s: tensor %s is missing field \"shape\"", name);
    return;
  }
  if (t.shape_bad_kind) {
    Fail("safetensors file %s: tensor %s field \"shape\" is %s, expected an array of integers",
         name, KindName(*t.shape_bad_kind));
    return;
  }
  if (t.rank > kMaxRank) {
    Fail("safetensors file %s: tensor %s has a shape of rank %d, more than the limit of %d", name,
         t.rank, kMaxRank);
    return;
  }
  if (t.bad_dim) {
    if (t.bad_dim_too_large) {
      Fail(
          "safetensors file %s: tensor %s has dimension %s at index %d of \"shape\", which "
          "does not fit in a signed 64-bit integer",
          name, t.bad_dim->second, t.bad_dim->first);
    } else {
      Fail(
          "safetensors file %s: tensor %s has a non-integer dimension %s at index %d of "
          "\"shape\"",
          name, t.bad_dim->second, t.bad_dim->first);
    }
    return;
  }
  if (!t.has_offsets) {
    Fail("safetensors file %s: tensor %s is missing field \"data_offsets\"", name);
    return;
  }
  if (t.offsets_bad_kind) {
    Fail("safetensors file %s: tensor %s field \"data_offsets\" is %s, expected [begin, end]", name,
         KindName(*t.offsets_bad_kind));
    return;
  }
  if (t.bad_offset) {
    Fail(
        "safetensors file %s: tensor %s field \"data_offsets\" holds %s at index %d, expected "
        "two non-negative integers [begin, end]",
        name, t.bad_offset->second, t.bad_offset->first);
    return;
  }
  if (t.offsets_count != 2) {
    Fail(
        "safetensors file %s: tensor %s field \"data_offsets\" has %d elements, expected two "
        "[begin, end]",
        name, t.offsets_count);
    return;
  }
  absl::StatusOr<DType> dtype = DTypeFromName(t.dtype);
  if (!dtype.ok()) {
    Fail("safetensors file %s: tensor %s has %s", name, std::string(dtype.status().message()));
    return;
  }
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] < 0) {
      Fail("safetensors file %s: tensor %s has a negative dimension %d at index %d of shape %s",
           name, t.shape[d], d, ShapeString(t.shape));
      return;
    }
  }
  const uint64_t begin = t.offsets[0];
  const uint64_t end = t.offsets[1];
  if (begin > end) {
    Fail("safetensors file %s: tensor %s has data_offsets %s with begin %d > end %d", name,
         OffsetsString(begin, end), begin, end);
    return;
  }
  absl::StatusOr<uint64_t> nbytes = ByteSize(*dtype, t.shape);
  if (!nbytes.ok() && IsSubByte(*dtype) &&
      absl::StrContains(nbytes.status().message(), "whole number of bytes")) {
    Fail("safetensors file %s: tensor %s: %s (data_offsets %s span %d bytes)", name,
         std::string(nbytes.status().message()), OffsetsString(begin, end), end - begin);
    return;
  }
  if (!nbytes.ok()) {
    Fail(
        "safetensors file %s: tensor %s has dtype %s and shape %s, whose byte size overflows "
        "64 bits, but data_offsets %s span %d bytes",
        name, DTypeName(*dtype), ShapeString(t.shape), OffsetsString(begin, end), end - begin);
    return;
  }
  if (*nbytes != end - begin) {
    Fail(
        "safetensors file %s: tensor %s has dtype %s and shape %s = %d bytes but data_offsets "
        "%s span %d bytes",
        name, DTypeName(*dtype), ShapeString(t.shape), *nbytes, OffsetsString(begin, end),
        end - begin);
    return;
  }
  Entry e;
  e.name = std::move(raw_.name);
  e.dtype = *dtype;
  e.shape = std::move(raw_.shape);
  e.begin = begin;
  e.end = end;
  out_->tensors.push_back(std::move(e));
}

// Checks that the tensors' byte ranges tile the data region [0, region) exactly.
absl::Status CheckTiling(const Header& h, uint64_t region, uint64_t file_size,
                         std::string_view source) {
  const std::vector<Entry>& ts = h.tensors;
  for (const Entry& e : ts) {
    if (e.end > region) {
      return absl::DataLossError(absl::StrFormat(
          "safetensors file %s: tensor %s data_offsets %s extend beyond the data region of %d "
          "bytes (file size %d, data region starts at %d)",
          source, Quoted(e.name), OffsetsString(e.begin, e.end), region, file_size, h.data_start));
    }
  }
  std::vector<uint32_t> order(ts.size());
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    if (ts[a].begin != ts[b].begin) return ts[a].begin < ts[b].begin;
    if (ts[a].end != ts[b].end) return ts[a].end < ts[b].end;
    return a < b;
  });
  uint64_t expected = 0;
  const Entry* prev = nullptr;  // the tensor that ends at `expected`
  for (uint32_t i : order) {
    const Entry& e = ts[i];
    if (e.begin < expected) {
      return absl::DataLossError(absl::StrFormat(
          "safetensors file %s: tensor %s data_offsets %s overlap tensor %s data_offsets %s",
          source, Quoted(e.name), OffsetsString(e.begin, e.end), Quoted(prev->name),
          OffsetsString(prev->begin, prev->end)));
    }
    if (e.begin > expected) {
      if (prev == nullptr) {
        return absl::DataLossError(absl::StrFormat(
            "safetensors file %s: hole in the data region: bytes [%d, %d) before tensor %s "
            "(data_offsets %s) belong to no tensor",
            source, expected, e.begin, Quoted(e.name), OffsetsString(e.begin, e.end)));
      }
      return absl::DataLossError(absl::StrFormat(
          "safetensors file %s: hole in the data region: bytes [%d, %d) between tensor %s "
          "(data_offsets %s) and tensor %s (data_offsets %s) belong to no tensor",
          source, expected, e.begin, Quoted(prev->name), OffsetsString(prev->begin, prev->end),
          Quoted(e.name), OffsetsString(e.begin, e.end)));
    }
    expected = e.end;
    prev = &e;
  }
  if (expected != region) {
    if (prev == nullptr) {
      return absl::DataLossError(absl::StrFormat(
          "safetensors file %s: %d bytes after the last tensor: the header declares no tensors "
          "but the data region holds %d bytes (file size %d, data region starts at %d)",
          source, region - expected, region, file_size, h.data_start));
    }
    return absl::DataLossError(absl::StrFormat(
        "safetensors file %s: %d bytes after the last tensor: tensor %s ends at data offset %d "
        "but the data region holds %d bytes (file size %d, data region starts at %d)",
        source, region - expected, Quoted(prev->name), expected, region, file_size, h.data_start));
  }
  return absl::OkStatus();
}

// Checks the 8-byte length against the file size and the maximum; returns N.
absl::StatusOr<uint64_t> CheckLength(std::string_view prefix, uint64_t file_size,
                                     std::string_view source) {
  if (file_size < kLengthBytes) {
    return absl::DataLossError(
        absl::StrFormat("safetensors file %s is %d bytes, shorter than the 8-byte header length",
                        source, file_size));
  }
  if (prefix.size() < kLengthBytes) {
    return absl::DataLossError(absl::StrFormat(
        "safetensors file %s: only %d bytes of the file were given, fewer than the 8-byte "
        "header length",
        source, prefix.size()));
  }
  const uint64_t n = internal::LoadLe<uint64_t>(prefix.data());
  if (n > kMaxHeaderSize) {
    return absl::DataLossError(
        absl::StrFormat("safetensors file %s: header length %d exceeds the maximum of %d bytes",
                        source, n, kMaxHeaderSize));
  }
  if (n > file_size - kLengthBytes) {
    return absl::DataLossError(absl::StrFormat(
        "safetensors file %s: header length %d runs past the end of the file (8 + %d > file "
        "size %d)",
        source, n, n, file_size));
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// Files

// Closes a file descriptor on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now and reports close(2)'s error (it can carry a deferred write error).
  int Close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

// Reads exactly n bytes at `offset` (handling EINTR and short reads).
absl::Status PreadAll(int fd, char* buf, uint64_t n, uint64_t offset, std::string_view source) {
  uint64_t done = 0;
  while (done < n) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(n - done, kMaxIoBytes));
    const ssize_t got = ::pread(fd, buf + done, want, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return internal::ErrnoStatus(
          errno, absl::StrFormat("safetensors file %s: pread of %d bytes at offset %d", source,
                                 want, offset + done));
    }
    if (got == 0) {
      return absl::DataLossError(absl::StrFormat(
          "safetensors file %s: unexpected end of file at offset %d while reading %d bytes at "
          "offset %d (did the file shrink?)",
          source, offset + done, n, offset));
    }
    done += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> OpenForRead(const std::string& path, std::unique_ptr<Fd>* fd) {
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) return internal::ErrnoStatus(errno, absl::StrFormat("open %s", path));
  *fd = std::make_unique<Fd>(raw);
  struct stat st;
  if (::fstat(raw, &st) != 0) {
    return internal::ErrnoStatus(errno, absl::StrFormat("fstat %s", path));
  }
  if (S_ISDIR(st.st_mode)) return internal::ErrnoStatus(EISDIR, absl::StrFormat("open %s", path));
  return static_cast<uint64_t>(st.st_size);
}

// Writes through a staging buffer; large pieces go straight to the file.
class BufferedWriter {
 public:
  BufferedWriter(int fd, const std::string& what)
      : fd_(fd), what_(what), buf_(new char[kWriteBufferBytes]) {}

  absl::Status Append(const char* p, size_t n) {
    if (n >= kWriteBufferBytes / 2) {
      WB_RETURN_IF_ERROR(Flush());
      return WriteAll(p, n);
    }
    if (used_ + n > kWriteBufferBytes) WB_RETURN_IF_ERROR(Flush());
    std::memcpy(buf_.get() + used_, p, n);
    used_ += n;
    return absl::OkStatus();
  }

  // Room for n <= kWriteBufferBytes bytes, to be filled and then Commit()ed.
  absl::StatusOr<char*> Reserve(size_t n) {
    if (used_ + n > kWriteBufferBytes) WB_RETURN_IF_ERROR(Flush());
    return buf_.get() + used_;
  }
  void Commit(size_t n) { used_ += n; }

  absl::Status Flush() {
    const size_t n = used_;
    used_ = 0;
    return WriteAll(buf_.get(), n);
  }

 private:
  absl::Status WriteAll(const char* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min(n, kMaxIoBytes));
      if (w < 0) {
        if (errno == EINTR) continue;
        return internal::ErrnoStatus(errno, absl::StrFormat("write %s", what_));
      }
      if (w == 0) {
        return internal::ErrnoStatus(ENOSPC, absl::StrFormat("write %s (wrote 0 bytes)", what_));
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }

  int fd_;
  const std::string& what_;
  std::unique_ptr<char[]> buf_;
  size_t used_ = 0;
};

// Writes the C-contiguous (row-major) bytes of a strided view (strides in elements, any sign,
// `data` at element [0, ..., 0]) through the staging buffer, one buffer-sized window of the
// packed image at a time.
absl::Status WritePacked(const TensorView& v, BufferedWriter& w) {
  const uint64_t nbytes = *ByteSize(v.dtype, v.shape);
  for (uint64_t done = 0; done < nbytes;) {
    const uint64_t n = std::min<uint64_t>(nbytes - done, kWriteBufferBytes);
    absl::StatusOr<char*> dst = w.Reserve(n);
    if (!dst.ok()) return dst.status();
    internal::PackStridedRange(v.data, DTypeSize(v.dtype), v.shape, v.strides, done, n,
                               reinterpret_cast<std::byte*>(*dst));
    w.Commit(n);
    done += n;
  }
  return absl::OkStatus();
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void AppendJsonString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (u < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", u);
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

}  // namespace

// -----------------------------------------------------------------------------------------------

const Entry* Header::Find(std::string_view name) const {
  for (const Entry& e : tensors) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::StatusOr<Header> ParseHeader(std::string_view prefix, uint64_t file_size,
                                   std::string_view source) {
  absl::StatusOr<uint64_t> length = CheckLength(prefix, file_size, source);
  if (!length.ok()) return length.status();
  const uint64_t n = *length;
  if (prefix.size() - kLengthBytes < n) {
    return absl::DataLossError(
        absl::StrFormat("safetensors file %s: only %d of the %d header bytes were given", source,
                        prefix.size() - kLengthBytes, n));
  }
  const std::string_view text = prefix.substr(kLengthBytes, n);
  if (std::optional<Utf8Error> bad = FindInvalidUtf8(text)) {
    return absl::DataLossError(absl::StrFormat(
        "safetensors file %s: header is not valid UTF-8 at header byte %d (file offset %d, "
        "byte 0x%02x): %s",
        source, bad->offset, kLengthBytes + bad->offset,
        static_cast<unsigned char>(text[bad->offset]), bad->reason));
  }
  if (text.empty() || text[0] != '{') {
    return absl::DataLossError(absl::StrFormat(
        "safetensors file %s: header does not start with '{' (it must be a JSON object; %s)",
        source,
        text.empty()
            ? std::string("the header is empty")
            : absl::StrFormat("first byte is 0x%02x", static_cast<unsigned char>(text[0]))));
  }

  // nlohmann's lexer takes a NUL byte for the end of the input and would ignore whatever
  // follows it; no valid JSON text holds a raw NUL (in strings it must be escaped).
  if (const void* nul = std::memchr(text.data(), '\0', text.size())) {
    const size_t at = static_cast<size_t>(static_cast<const char*>(nul) - text.data());
    return absl::DataLossError(absl::StrFormat(
        "safetensors file %s: header is not valid JSON (%d-byte header): raw NUL byte at header "
        "byte %d (file offset %d)",
        source, n, at, kLengthBytes + at));
  }

  Header header;
  header.header_size = n;
  header.data_start = kLengthBytes + n;
  HeaderSax sax(source, n, &header);
  try {
    json::sax_parse(text.data(), text.data() + text.size(), &sax);
  } catch (const std::exception& e) {
    return absl::DataLossError(
        absl::StrFormat("safetensors file %s: header is not valid JSON: %s", source, e.what()));
  }
  if (!sax.status().ok()) return sax.status();

  const uint64_t region = file_size - header.data_start;
  WB_RETURN_IF_ERROR(CheckTiling(header, region, file_size, source));
  header.data_size = region;
  return header;
}

absl::StatusOr<Header> ReadHeader(int fd, uint64_t file_size, std::string_view source) {
  if (file_size < kLengthBytes) return ParseHeader({}, file_size, source);
  std::string buf(kLengthBytes, '\0');
  WB_RETURN_IF_ERROR(PreadAll(fd, buf.data(), kLengthBytes, 0, source));
  absl::StatusOr<uint64_t> n = CheckLength(buf, file_size, source);
  if (!n.ok()) return n.status();
  buf.resize(kLengthBytes + *n);
  WB_RETURN_IF_ERROR(PreadAll(fd, buf.data() + kLengthBytes, *n, kLengthBytes, source));
  return ParseHeader(buf, file_size, source);
}

absl::StatusOr<Header> ReadHeader(const std::string& path) {
  std::unique_ptr<Fd> fd;
  absl::StatusOr<uint64_t> size = OpenForRead(path, &fd);
  if (!size.ok()) return size.status();
  return ReadHeader(fd->get(), *size, path);
}

std::span<const std::byte> File::Bytes(const Entry& entry) const {
  if (entry.begin > entry.end || entry.end > data.size()) return {};
  return {reinterpret_cast<const std::byte*>(data.data()) + entry.begin, entry.nbytes()};
}

absl::StatusOr<File> ReadFile(const std::string& path) {
  std::unique_ptr<Fd> fd;
  absl::StatusOr<uint64_t> size = OpenForRead(path, &fd);
  if (!size.ok()) return size.status();
  absl::StatusOr<Header> header = ReadHeader(fd->get(), *size, path);
  if (!header.ok()) return header.status();
  File file;
  file.header = *std::move(header);
  file.data.resize(file.header.data_size);
  WB_RETURN_IF_ERROR(
      PreadAll(fd->get(), file.data.data(), file.header.data_size, file.header.data_start, path));
  return file;
}

absl::StatusOr<File> ParseFile(std::string_view bytes, std::string_view source) {
  absl::StatusOr<Header> header = ParseHeader(bytes, bytes.size(), source);
  if (!header.ok()) return header.status();
  File file;
  file.header = *std::move(header);
  file.data.assign(bytes.substr(file.header.data_start, file.header.data_size));
  return file;
}

absl::StatusOr<Layout> PlanFile(absl::Span<const TensorSpec> tensors, const Metadata& metadata) {
  const size_t count = tensors.size();
  if (count > kMaxTensors) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d tensors, more than the limit of %d per file", count, kMaxTensors));
  }
  std::vector<uint64_t> nbytes(count);
  std::unordered_map<std::string_view, size_t> seen;
  seen.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const TensorSpec& t = tensors[i];
    if (t.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor %d of %d has an empty name", i, count));
    }
    if (std::optional<Utf8Error> bad = FindInvalidUtf8(t.name)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor %d has a name that is not valid UTF-8 at byte %d (%s): %s", i,
                          bad->offset, bad->reason, Quoted(t.name)));
    }
    if (t.name.size() > kMaxTensorNameBytes || t.shape.size() > kMaxRank) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor %d (%s...) has a name of %d bytes and a shape of rank %d; the limits are %d "
          "bytes and rank %d",
          i, Quoted(std::string_view(t.name).substr(0, 64)), t.name.size(), t.shape.size(),
          kMaxTensorNameBytes, kMaxRank));
    }
    if (t.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor %d is named \"__metadata__\", a name reserved by the safetensors format", i));
    }
    auto [it, inserted] = seen.emplace(t.name, i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "duplicate tensor name %s (tensors %d and %d)", Quoted(t.name), it->second, i));
    }
    if (DTypeName(t.dtype) == "INVALID") {
      return absl::InvalidArgumentError(absl::StrFormat("tensor %s has an invalid dtype (%d)",
                                                        Quoted(t.name), static_cast<int>(t.dtype)));
    }
    absl::StatusOr<uint64_t> size = ByteSize(t.dtype, t.shape);
    if (!size.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor %s: %s", Quoted(t.name), std::string(size.status().message())));
    }
    nbytes[i] = *size;
  }
  for (const auto& [k, v] : metadata) {
    if (std::optional<Utf8Error> bad = FindInvalidUtf8(k)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("metadata key %s is not valid UTF-8 at byte %d (%s)", Quoted(k),
                          bad->offset, bad->reason));
    }
    if (std::optional<Utf8Error> bad = FindInvalidUtf8(v)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("metadata value of key %s is not valid UTF-8 at byte %d (%s)", Quoted(k),
                          bad->offset, bad->reason));
    }
  }

  std::vector<size_t> order(count);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(tensors[a].dtype) > DTypeSize(tensors[b].dtype);
  });

  Layout layout;
  layout.begin.resize(count);
  uint64_t offset = 0;
  for (size_t i : order) {
    if (nbytes[i] > std::numeric_limits<uint64_t>::max() - offset) {
      return absl::InvalidArgumentError(
          absl::StrFormat("the tensors' total size overflows a 64-bit byte count (at tensor %s)",
                          Quoted(tensors[i].name)));
    }
    layout.begin[i] = offset;
    offset += nbytes[i];
  }
  layout.data_size = offset;

  std::string& out = layout.prefix;
  out.assign(kLengthBytes, '\0');
  out.push_back('{');
  bool first = true;
  if (!metadata.empty()) {
    out += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (!first) out.push_back(',');
      first = false;
      AppendJsonString(k, &out);
      out.push_back(':');
      AppendJsonString(v, &out);
    }
    out.push_back('}');
    first = false;
  }
  for (size_t i : order) {
    const TensorSpec& t = tensors[i];
    if (!first) out.push_back(',');
    first = false;
    AppendJsonString(t.name, &out);
    absl::StrAppend(&out, ":{\"dtype\":\"", std::string(DTypeName(t.dtype)), "\",\"shape\":[",
                    absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", layout.begin[i], ",",
                    layout.begin[i] + nbytes[i], "]}");
  }
  out.push_back('}');
  // Pad with spaces so that the data region (and with it every tensor, given the ordering by
  // element size) starts 8-byte aligned.
  out.append((kLengthBytes - out.size() % kLengthBytes) % kLengthBytes, ' ');
  const uint64_t n = out.size() - kLengthBytes;
  if (n > kMaxHeaderSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the header would be %d bytes, more than the format's maximum of %d", n, kMaxHeaderSize));
  }
  internal::StoreLe(n, out.data());
  layout.data_start = out.size();
  return layout;
}

namespace {

// "<path>.tmp.<host>.<pid>": the temporary file of WriteFile in this process.
std::string TemporaryName(const std::string& path, const std::string& host, pid_t pid) {
  return absl::StrFormat("%s.tmp.%s.%d", path, host, static_cast<int>(pid));
}

// Removes temporaries of `path` that processes of this host left when they were killed while
// writing (their pid is gone). Those of other hosts (a shared filesystem) are left alone.
void RemoveStaleTemporaries(const std::string& path, const std::string& host) {
  std::error_code ec;
  const std::filesystem::path p(path);
  const std::string prefix = p.filename().string() + ".tmp." + host + ".";
  std::filesystem::directory_iterator it(p.has_parent_path() ? p.parent_path() : ".", ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    int pid = 0;
    if (!absl::SimpleAtoi(name.substr(prefix.size()), &pid) || pid <= 0) continue;
    if (::kill(pid, 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      std::filesystem::remove(it->path(), ignored);
    }
  }
}

}  // namespace

absl::Status WriteFile(const std::string& path, absl::Span<const TensorView> tensors,
                       const Metadata& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& v = tensors[i];
    if (v.device.type != DeviceType::kCpu) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "WriteFile %s: tensor %s is not on the CPU (device type %d, index %d); only CPU "
          "tensors can be written",
          path, Quoted(v.name), static_cast<int>(v.device.type), v.device.index));
    }
    if (!v.strides.empty() && v.strides.size() != v.shape.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("WriteFile %s: tensor %s has %d strides for shape %s of rank %d", path,
                          Quoted(v.name), v.strides.size(), ShapeString(v.shape), v.shape.size()));
    }
    if (IsSubByte(v.dtype) && !IsContiguous(v.shape, v.strides)) {
      return absl::UnimplementedError(absl::StrFormat(
          "WriteFile %s: tensor %s of %s (%d-bit elements, packed) has non-contiguous strides; "
          "only contiguous tensors of sub-byte dtypes can be written",
          path, Quoted(v.name), DTypeName(v.dtype), DTypeBits(v.dtype)));
    }
    specs.push_back(TensorSpec{v.name, v.dtype, v.shape});
  }
  absl::StatusOr<Layout> layout = PlanFile(specs, metadata);
  if (!layout.ok()) {
    return internal::Annotate(layout.status(), absl::StrFormat("WriteFile %s", path));
  }
  for (const TensorView& v : tensors) {
    // PlanFile validated the shape, so the element count is known to be fine.
    if (v.data == nullptr && *NumElements(v.shape) != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("WriteFile %s: tensor %s of shape %s has null data", path, Quoted(v.name),
                          ShapeString(v.shape)));
    }
  }

  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return layout->begin[a] < layout->begin[b]; });

  const std::string host = internal::HostName();
  RemoveStaleTemporaries(path, host);
  const std::string tmp = TemporaryName(path, host, ::getpid());
  const int raw = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (raw < 0) {
    return internal::ErrnoStatus(
        errno, absl::StrFormat("WriteFile %s: create temporary file %s", path, tmp));
  }
  Fd fd(raw);
  bool renamed = false;
  absl::Cleanup remove_tmp = [&] {
    if (!renamed) ::unlink(tmp.c_str());
  };

  BufferedWriter writer(fd.get(), tmp);
  WB_RETURN_IF_ERROR(writer.Append(layout->prefix.data(), layout->prefix.size()));
  for (size_t i : order) {
    const TensorView& v = tensors[i];
    if (IsContiguous(v.shape, v.strides)) {
      const uint64_t n = *ByteSize(v.dtype, v.shape);
      if (n > 0) WB_RETURN_IF_ERROR(writer.Append(static_cast<const char*>(v.data), n));
    } else {
      WB_RETURN_IF_ERROR(WritePacked(v, writer));
    }
  }
  WB_RETURN_IF_ERROR(writer.Flush());
  if (::fsync(fd.get()) != 0) {
    return internal::ErrnoStatus(errno, absl::StrFormat("WriteFile %s: fsync %s", path, tmp));
  }
  if (fd.Close() != 0) {
    return internal::ErrnoStatus(errno, absl::StrFormat("WriteFile %s: close %s", path, tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return internal::ErrnoStatus(errno,
                                 absl::StrFormat("WriteFile %s: rename %s into place", path, tmp));
  }
  renamed = true;

  // Make the rename durable.
  const std::string dir = DirName(path);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    return internal::ErrnoStatus(errno,
                                 absl::StrFormat("WriteFile %s: open directory %s", path, dir));
  }
  Fd dir_closer(dir_fd);
  if (::fsync(dir_fd) != 0 && errno != EINVAL) {
    return internal::ErrnoStatus(errno,
                                 absl::StrFormat("WriteFile %s: fsync directory %s", path, dir));
  }
  return absl::OkStatus();
}

}  // namespace weightbus::safetensors
