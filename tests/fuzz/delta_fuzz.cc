// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the delta decoder (lib/delta/codec.h; input format in delta_fuzz.h). For every
// input, DecodeChunk / ParseHeader / DecodeVersion must not crash, read or write out of bounds
// (AddressSanitizer in the libFuzzer build) or fail with anything but DataLoss (Unimplemented
// for a newer format version). Any violation aborts, which both libFuzzer and the replay driver
// report as a failure.
#include "delta_fuzz.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace weightbus::delta_fuzz {

using internal::delta::ChunkOutput;
using internal::delta::TensorLayout;

namespace {

[[noreturn]] void Die(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "delta_fuzz: invariant violated: %s: %s\n", what, s.ToString().c_str());
  std::fflush(stderr);
  std::abort();
}

void CheckRefusal(const absl::Status& s, const char* what) {
  if (s.ok() || absl::IsDataLoss(s)) return;
  if (absl::IsUnimplemented(s) && s.message().find("format version") != absl::string_view::npos) {
    return;
  }
  Die(what, s);
}

uint64_t SplitMix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

DType DTypeAt(uint8_t index) { return kAllDTypes[index % kAllDTypes.size()]; }

size_t ElementBytes(DType dtype) {
  const size_t w = DTypeSize(dtype);
  return w == 0 ? 1 : w;
}

void FuzzChunk(const uint8_t* data, size_t size) {
  if (size < 6) return;
  const DType dtype = DTypeAt(data[1]);
  const bool keyframe = (data[2] & 1) != 0;
  const int spans = 1 + ((data[2] >> 1) & 3);
  const bool in_place = (data[2] & 8) != 0;
  const uint8_t seed = data[3];
  const uint64_t units = 1 + ((data[4] | (uint64_t{data[5]} << 8)) % kMaxChunkUnits);
  const uint64_t chunk_bytes = 64 * units;
  const std::vector<std::byte> record(reinterpret_cast<const std::byte*>(data) + 6,
                                      reinterpret_cast<const std::byte*>(data) + size);
  std::vector<std::byte> base = Base(chunk_bytes, seed, 0);
  std::vector<std::byte> out(chunk_bytes, std::byte{0x5a});
  if (in_place) out = base;
  std::vector<ChunkOutput> outputs;
  uint64_t at = 0;
  for (uint64_t piece : SpanSizes(chunk_bytes, spans)) {
    outputs.push_back(ChunkOutput{keyframe ? nullptr : (in_place ? out.data() : base.data()) + at,
                                  out.data() + at, piece});
    at += piece;
  }
  CheckRefusal(internal::delta::DecodeChunk(dtype, outputs, keyframe, record), "DecodeChunk");
}

// Offset of the layout checksum in a blob whose header starts as ParseHeader expects.
std::optional<size_t> ChecksumOffset(absl::Span<const std::byte> blob) {
  size_t at = 6;
  for (int field = 0; field < 5; ++field) {
    while (true) {
      if (at >= blob.size()) return std::nullopt;
      if ((static_cast<uint8_t>(blob[at++]) & 0x80) == 0) break;
    }
  }
  if (at + 8 > blob.size()) return std::nullopt;
  return at;
}

void FuzzVersion(const uint8_t* data, size_t size) {
  if (size < 2) return;
  std::vector<FuzzTensor> tensors(1 + (data[1] % kMaxTensors));
  size_t at = 2;
  for (FuzzTensor& t : tensors) {
    if (at + 3 > size) return;
    t.dtype_index = data[at];
    t.elements = static_cast<uint16_t>(data[at + 1] | (data[at + 2] << 8));
    at += 3;
  }
  if (at >= size) return;
  const uint8_t seed = data[at++];
  std::vector<std::byte> blob(reinterpret_cast<const std::byte*>(data) + at,
                              reinterpret_cast<const std::byte*>(data) + size);
  const std::vector<TensorLayout> layout = LayoutOf(tensors);
  if (std::optional<size_t> sum = ChecksumOffset(blob)) {
    const uint64_t checksum = internal::delta::LayoutChecksum(layout);
    for (int i = 0; i < 8; ++i) blob[*sum + i] = static_cast<std::byte>(checksum >> (8 * i));
  }
  absl::StatusOr<internal::delta::VersionHeader> header = internal::delta::ParseHeader(blob);
  if (!header.ok()) {
    CheckRefusal(header.status(), "ParseHeader");
    return;
  }
  std::vector<std::vector<std::byte>> base, out;
  std::vector<const std::byte*> base_ptrs;
  std::vector<std::byte*> out_ptrs;
  for (size_t t = 0; t < layout.size(); ++t) {
    base.push_back(Base(layout[t].nbytes, seed, t));
    out.emplace_back(layout[t].nbytes, std::byte{0x5a});
  }
  for (size_t t = 0; t < layout.size(); ++t) {
    base_ptrs.push_back(base[t].data());
    out_ptrs.push_back(out[t].data());
  }
  static internal::delta::Parallel* parallel = [] {
    auto p = internal::delta::Parallel::Create(1);
    if (!p.ok()) Die("Parallel::Create", p.status());
    return p->release();
  }();
  std::vector<int> done(layout.size(), 0);
  const absl::Status s = internal::delta::DecodeVersion(
      blob, header->ids, layout, base_ptrs, out_ptrs, *parallel, [&](size_t t) {
        if (t >= done.size() || ++done[t] > 1) {
          Die("on_tensor_done", absl::InternalError("called twice or out of range"));
        }
      });
  CheckRefusal(s, "DecodeVersion");
  if (s.ok()) {
    for (int d : done) {
      if (d != 1) Die("on_tensor_done", absl::InternalError("not called for every tensor"));
    }
  }
}

}  // namespace

std::vector<std::byte> Base(size_t bytes, uint8_t seed, size_t tensor) {
  std::vector<std::byte> out(bytes);
  uint64_t x = seed * 0x100000001b3ULL + tensor;
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t r = SplitMix(x);
    std::memcpy(out.data() + i, &r, std::min<size_t>(8, bytes - i));
  }
  return out;
}

std::vector<uint64_t> SpanSizes(uint64_t chunk_bytes, int spans) {
  std::vector<uint64_t> out;
  const uint64_t units = chunk_bytes / 64;
  uint64_t left = units;
  for (int i = 0; i < spans && left > 0; ++i) {
    const uint64_t take = i + 1 == spans ? left : std::max<uint64_t>(1, units / spans);
    out.push_back(64 * take);
    left -= take;
  }
  if (left > 0) out.back() += 64 * left;
  return out;
}

std::string ChunkInput(uint8_t dtype_index, bool keyframe, int spans, bool in_place, uint8_t seed,
                       uint64_t chunk_bytes, const std::vector<std::byte>& record) {
  std::string out;
  out.push_back(0);
  out.push_back(static_cast<char>(dtype_index));
  out.push_back(static_cast<char>((keyframe ? 1 : 0) | ((spans - 1) << 1) | (in_place ? 8 : 0)));
  out.push_back(static_cast<char>(seed));
  const uint64_t units = chunk_bytes / 64 - 1;
  out.push_back(static_cast<char>(units & 0xff));
  out.push_back(static_cast<char>(units >> 8));
  out.append(reinterpret_cast<const char*>(record.data()), record.size());
  return out;
}

std::string VersionInput(const std::vector<FuzzTensor>& tensors, uint8_t seed,
                         const std::vector<std::byte>& blob) {
  std::string out;
  out.push_back(1);
  out.push_back(static_cast<char>(tensors.size() - 1));
  for (const FuzzTensor& t : tensors) {
    out.push_back(static_cast<char>(t.dtype_index));
    out.push_back(static_cast<char>(t.elements & 0xff));
    out.push_back(static_cast<char>(t.elements >> 8));
  }
  out.push_back(static_cast<char>(seed));
  out.append(reinterpret_cast<const char*>(blob.data()), blob.size());
  return out;
}

std::vector<TensorLayout> LayoutOf(const std::vector<FuzzTensor>& tensors) {
  std::vector<TensorLayout> layout;
  for (const FuzzTensor& t : tensors) {
    const DType dtype = DTypeAt(t.dtype_index);
    layout.push_back(TensorLayout{dtype, uint64_t{t.elements} * ElementBytes(dtype)});
  }
  return layout;
}

}  // namespace weightbus::delta_fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // Each input is decoded on a fresh thread: the decoder's per-thread scratch buffers start
  // empty, as in a subscriber's first decode, so that a write past what a count sized them for
  // is a write past a heap block (which AddressSanitizer reports) instead of into capacity left
  // by an earlier input.
  std::thread([&] {
    if (data[0] % 2 == 0) {
      weightbus::delta_fuzz::FuzzChunk(data, size);
    } else {
      weightbus::delta_fuzz::FuzzVersion(data, size);
    }
  }).join();
  return 0;
}
