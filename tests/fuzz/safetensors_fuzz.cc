// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the safetensors parser (public API only). For every input, ParseFile must not
// crash or leak, must fail only with DataLoss naming the source, and when it succeeds the result
// must satisfy the format's invariants: the tensors tile the data region exactly, every byte
// size matches its dtype and shape, and re-encoding the file with PlanFile parses back equal.
// Any violation aborts, which both libFuzzer and the replay driver report as a failure.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightbus/safetensors.hpp"

namespace {

using weightbus::safetensors::Entry;
using weightbus::safetensors::File;

constexpr std::string_view kSource = "fuzz-input.safetensors";

[[noreturn]] void Die(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "safetensors_fuzz: invariant violated: %s %s\n", what, detail.c_str());
  std::fflush(stderr);
  std::abort();
}

void Check(bool ok, const char* what, const std::string& detail = "") {
  if (!ok) Die(what, detail);
}

uint64_t LoadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void CheckValidFile(std::string_view bytes, const File& file) {
  const auto& h = file.header;
  Check(bytes.size() >= 8, "accepted a file shorter than 8 bytes");
  const uint64_t n = LoadLe64(reinterpret_cast<const uint8_t*>(bytes.data()));
  Check(h.header_size == n, "header_size differs from the length prefix");
  Check(n <= weightbus::safetensors::kMaxHeaderSize, "accepted a header above the maximum");
  Check(h.data_start == 8 + n, "data_start != 8 + N");
  Check(h.data_start <= bytes.size(), "data_start beyond the file");
  Check(h.data_start + h.data_size == bytes.size(), "data region does not end at the file end");
  Check(file.data.size() == h.data_size, "data size differs from data_size");
  Check(std::string_view(file.data) == bytes.substr(h.data_start), "data is not the data region");
  Check(n > 0 && bytes[8] == '{', "accepted a header not starting with '{'");

  // The tensors tile [0, data_size) exactly.
  std::vector<size_t> order(h.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Entry& x = h.tensors[a];
    const Entry& y = h.tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  uint64_t expected = 0;
  for (size_t i : order) {
    const Entry& e = h.tensors[i];
    Check(e.begin == expected, "tensors do not tile the data region", e.name);
    Check(e.end >= e.begin, "end < begin", e.name);
    absl::StatusOr<uint64_t> size = weightbus::ByteSize(e.dtype, e.shape);
    Check(size.ok() && *size == e.nbytes(), "byte size does not match dtype and shape", e.name);
    Check(file.Bytes(e).size() == e.nbytes(), "Bytes() has the wrong size", e.name);
    expected = e.end;
  }
  Check(expected == h.data_size, "tensors do not cover the data region");
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    Check(h.Find(h.tensors[i].name) == &h.tensors[i], "duplicate tensor name accepted",
          h.tensors[i].name);
  }
}

// Re-encodes `file` with PlanFile and checks that the result parses back to the same tensors.
void CheckReencodes(const File& file) {
  std::vector<weightbus::safetensors::TensorSpec> specs;
  for (const Entry& e : file.header.tensors) specs.push_back({e.name, e.dtype, e.shape});
  absl::StatusOr<weightbus::safetensors::Layout> layout =
      weightbus::safetensors::PlanFile(specs, file.header.metadata);
  if (!layout.ok()) {
    // The parser accepts an empty tensor name (the format does not forbid it); the writer does
    // not. Nothing else the parser accepts may be refused.
    bool has_empty_name = false;
    for (const Entry& e : file.header.tensors) has_empty_name |= e.name.empty();
    Check(has_empty_name && layout.status().code() == absl::StatusCode::kInvalidArgument,
          "PlanFile refused a parsed file", std::string(layout.status().message()));
    return;
  }
  std::string out = layout->prefix;
  out.resize(layout->file_size());
  for (size_t i = 0; i < specs.size(); ++i) {
    std::span<const std::byte> src = file.Bytes(file.header.tensors[i]);
    if (!src.empty()) {
      std::memcpy(&out[layout->data_start + layout->begin[i]], src.data(), src.size());
    }
  }
  absl::StatusOr<File> again = weightbus::safetensors::ParseFile(out, "re-encoded");
  Check(again.ok(), "re-encoded file does not parse",
        again.ok() ? "" : std::string(again.status().message()));
  Check(again->header.metadata == file.header.metadata, "metadata changed in the round trip");
  Check(again->header.tensors.size() == file.header.tensors.size(), "tensor count changed");
  for (const Entry& e : file.header.tensors) {
    const Entry* f = again->header.Find(e.name);
    Check(f != nullptr, "tensor lost in the round trip", e.name);
    Check(f->dtype == e.dtype && f->shape == e.shape, "tensor changed in the round trip", e.name);
    std::span<const std::byte> a = file.Bytes(e);
    std::span<const std::byte> b = again->Bytes(*f);
    Check(a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0),
          "tensor bytes changed in the round trip", e.name);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<File> file = weightbus::safetensors::ParseFile(bytes, kSource);
  if (!file.ok()) {
    const absl::Status& s = file.status();
    Check(s.code() == absl::StatusCode::kDataLoss, "error is not DataLoss",
          std::string(s.message()));
    Check(std::string_view(s.message().data(), s.message().size()).find(kSource) !=
              std::string_view::npos,
          "error does not name the source", std::string(s.message()));
    return 0;
  }
  CheckValidFile(bytes, *file);
  CheckReencodes(*file);
  return 0;
}
