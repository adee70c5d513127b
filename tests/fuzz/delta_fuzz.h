// SPDX-License-Identifier: Apache-2.0
// The delta decoder's fuzz target (delta_fuzz.cc) and the inputs it reads, shared with its
// replay driver (delta_fuzz_replay.cc), which builds seeds from real encoded blobs.
//
// An input is one of two kinds, told apart by its first byte:
//
//   even: one chunk record, decoded with DecodeChunk
//     [0] mode  [1] dtype (index into kAllDTypes)  [2] flags: bit 0 keyframe, bits 1-2 spans
//     minus 1, bit 3 in place (base == out)  [3] base seed  [4..5] chunk bytes / 64 - 1 (LE,
//     at most 1024: 64 KiB)  [6..] the record
//   odd: a whole encoded version, decoded with DecodeVersion
//     [0] mode  [1] tensors (1..4)  then per tensor: dtype index, element count (u16 LE)
//     then the base seed, then the blob. The blob's layout checksum is set to the layout's
//     before decoding (as the replay keeps length prefixes consistent for the safetensors
//     target) so that mutants reach the chunk decoder instead of stopping at the checksum.
//
// The base (what a delta applies to) is a deterministic function of the dtype, size and seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "delta/codec.h"

namespace weightbus::delta_fuzz {

inline constexpr uint64_t kMaxChunkUnits = 1024;  // chunk bytes / 64
inline constexpr size_t kMaxTensors = 4;

// Deterministic base bytes: splitmix64 of the seed (floats thus get every magnitude class).
std::vector<std::byte> Base(size_t bytes, uint8_t seed, size_t tensor);

// The piece sizes a chunk of `chunk_bytes` is cut into (`spans` pieces, multiples of 64).
std::vector<uint64_t> SpanSizes(uint64_t chunk_bytes, int spans);

std::string ChunkInput(uint8_t dtype_index, bool keyframe, int spans, bool in_place, uint8_t seed,
                       uint64_t chunk_bytes, const std::vector<std::byte>& record);

struct FuzzTensor {
  uint8_t dtype_index = 0;
  uint16_t elements = 0;
};
std::string VersionInput(const std::vector<FuzzTensor>& tensors, uint8_t seed,
                         const std::vector<std::byte>& blob);

// The layout an odd input's tensors describe.
std::vector<internal::delta::TensorLayout> LayoutOf(const std::vector<FuzzTensor>& tensors);

}  // namespace weightbus::delta_fuzz
