// SPDX-License-Identifier: Apache-2.0
// The delta codec: lossless encoding of one version of a set of tensors, either whole (a
// keyframe) or against the previous version (a delta). The wire format is specified in
// docs/FORMAT.md ("The delta format"); this header is its only implementation.
//
// A version's tensors are grouped by dtype and each group, taken as one byte string in manifest
// order, is cut into chunks of `chunk_size` bytes (PlanChunks), so small tensors share a chunk and
// large ones span several. Each chunk is encoded independently (in parallel) with whichever
// method is smallest:
//
//   same    the chunk equals the base (deltas only): no payload
//   stored  the new bytes verbatim (incompressible data)
//   planes  the new values, floats rotated left by one bit (exponent in the top byte, sign at the
//           bottom), split into byte planes, each plane zstd-compressed (or stored/constant)
//   xor     the same for the bitwise XOR of base and new values (deltas only)
//   sparse  the positions of changed elements as gaps between them (narrowed to 1, 2 or 4 bytes
//           with escapes), plus the changes as zigzag-coded wrapping differences new - base,
//           both split into byte planes and zstd-compressed (deltas only)
//   modeled the same changes as decisions of an adaptive binary range coder in contexts of the
//           base element's magnitude class: each change's class, how many elements of that
//           class precede it since the previous change, and new - base (deltas only; format
//           version 2: 1.2-1.4x smaller than sparse on training deltas, decoding 8-15x slower)
//   modeled-rans the same changes as three symbols of adaptive 16-symbol models coded with
//           interleaved rANS states (deltas only; format version 3, the default: 1-2.5% larger
//           than modeled, decoding 1.5x faster)
//
// Everything is bit-exact for any dtype: differences wrap, XOR is its own inverse, planes only
// reorder bytes. Elements are DTypeSize bytes wide; sub-byte dtypes (F4, F6_*) are coded as
// bytes (and their "elements" in ChunkResult::changed are bytes). Decoding never trusts the input:
// every size, count and position is checked and a malformed version is a DataLoss error naming the
// chunk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/worker_pool.h"
#include "weightbus/types.hpp"

namespace weightbus::internal::delta {

// Version of the encoded format (the byte after the magic) that encoders write. Decoders read
// versions kMinFormatVersion..kFormatVersion and refuse newer ones. Version 2 added the
// modeled method, version 3 the modeled-rans method (which its encoders use instead).
inline constexpr uint8_t kFormatVersion = 3;
inline constexpr uint8_t kMinFormatVersion = 1;
// First four bytes of every encoded version.
inline constexpr char kMagic[4] = {'W', 'B', 'D', 'L'};

// Chunk size limits: chunks are a multiple of 64 bytes so that every element size divides them,
// and positions inside a chunk fit in 32 bits.
inline constexpr uint64_t kMinChunkSize = 64;
inline constexpr uint64_t kMaxChunkSize = uint64_t{1} << 30;

enum class Method : uint8_t {
  kSame = 0,
  kStored = 1,
  kPlanes = 2,
  kXor = 3,
  kSparse = 4,
  kModeled = 5,
  kModeledRans = 6,
};
std::string_view MethodName(Method method);

// What the codec needs to know about one tensor.
struct TensorLayout {
  DType dtype = DType::kU8;
  uint64_t nbytes = 0;
  friend bool operator==(const TensorLayout&, const TensorLayout&) = default;
};

// A byte range of one tensor that belongs to a chunk.
struct Piece {
  uint32_t tensor = 0;  // index into the layout
  uint64_t offset = 0;  // bytes from the tensor's start
  uint64_t bytes = 0;
};

struct Chunk {
  DType dtype = DType::kU8;
  uint64_t bytes = 0;         // sum of the pieces
  std::vector<Piece> pieces;  // in order; consecutive pieces are consecutive tensors of the dtype
};

// The deterministic chunk plan of docs/FORMAT.md: for each dtype in the order of
// weightbus::kAllDTypes, the non-empty tensors of that dtype in layout order, concatenated and
// cut every `chunk_size` bytes. `chunk_size` must be a multiple of 64 in
// [kMinChunkSize, kMaxChunkSize] (checked by the caller).
std::vector<Chunk> PlanChunks(absl::Span<const TensorLayout> layout, uint64_t chunk_size);

// XXH3-64 of each tensor's dtype name, a NUL byte and its size (8 bytes, little-endian), in order:
// the header carries it so that a version is never decoded against other tensors.
uint64_t LayoutChecksum(absl::Span<const TensorLayout> layout);

// Runs loops over chunks on a worker pool and the calling thread.
class Parallel {
 public:
  // `threads` counts the calling thread: 1 runs everything on the caller. 0 picks one per
  // hardware thread, at most 8. Errors: as WorkerPool::Create.
  static absl::StatusOr<std::unique_ptr<Parallel>> Create(int threads);
  int threads() const { return pool_ ? pool_->size() + 1 : 1; }
  // Calls fn(i) once for every i in [0, n), concurrently; returns when all calls have returned.
  void For(size_t n, const std::function<void(size_t)>& fn);

 private:
  std::unique_ptr<WorkerPool> pool_;
};

struct EncodeOptions {
  uint64_t chunk_size = uint64_t{4} << 20;
  // 0: the codec's own zstd configuration for entropy-bound planes (level 1, fastest strategy,
  // minimum match 7, hash log 6: literals are Huffman-coded, only long runs become matches);
  // 1..22: that plain zstd level.
  int zstd_level = 0;
  // Encode every applicable method of every chunk and keep the smallest (for measurements; the
  // default skips methods that cannot win at the chunk's density of changes).
  bool try_all_methods = false;
  // Most magnitude groups of the sparse method (1..4). 1: plain positions, the fastest to decode;
  // 2..4: changes located within groups of weights of similar magnitude, 15-30% fewer bytes on
  // training deltas at a third of the decoding speed (BENCHMARKS.md). Only without
  // context_model.
  int max_groups = 1;
  // Deltas code their changes with the modeled method (an adaptive context model of the base's
  // magnitudes; the smallest) instead of the sparse one (zstd byte planes; the fastest to
  // decode). XOR planes are still tried where many elements changed.
  bool context_model = true;
  // The format version written (2..kFormatVersion). 3 codes the context model with the
  // modeled-rans method (adaptive 16-symbol models, rANS: about 1.5x faster to decode and 1.5x
  // faster to encode, 1-2.5% larger; BENCHMARKS.md, issue 16); 2 with the modeled method (an
  // adaptive binary range coder) that readers of version 2 decode.
  uint8_t format_version = kFormatVersion;
};

// What happened to one chunk, for statistics and for the publisher's bookkeeping.
struct ChunkResult {
  Method method = Method::kSame;
  uint64_t raw_bytes = 0;      // chunk bytes
  uint64_t encoded_bytes = 0;  // its record
  uint64_t changed = 0;        // elements that differ from the base (all of them in a keyframe)
  // Sizes of the candidate records that were encoded (0: not tried), for measurements.
  uint64_t sparse_bytes = 0;
  uint64_t xor_bytes = 0;
  uint64_t modeled_bytes = 0;
};

// Identifies a version and what it applies to.
struct VersionIds {
  bool keyframe = true;
  uint64_t target = 0;            // the version this encodes
  uint64_t base = 0;              // the version it applies to (deltas; 0 in a keyframe)
  uint64_t keyframe_version = 0;  // the keyframe its chain starts from (== target for a keyframe)
  friend bool operator==(const VersionIds&, const VersionIds&) = default;
};

struct EncodedVersion {
  std::vector<std::byte> bytes;  // header + chunk records: what goes on the wire
  std::vector<Chunk> chunks;
  std::vector<ChunkResult> results;  // one per chunk
  uint64_t header_bytes = 0;
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
};

// Encodes `target` (one pointer per layout entry, nbytes each; null allowed for empty tensors)
// as a keyframe when ids.keyframe, else as a delta against `base` (same shape as target).
// Deterministic: the same inputs and options give the same bytes for any number of threads.
// Errors: InvalidArgument for a bad chunk size or mismatched spans.
absl::StatusOr<EncodedVersion> EncodeVersion(const VersionIds& ids,
                                             absl::Span<const TensorLayout> layout,
                                             absl::Span<const std::byte* const> base,
                                             absl::Span<const std::byte* const> target,
                                             const EncodeOptions& options, Parallel& parallel);

// The parsed header of an encoded version.
struct VersionHeader {
  VersionIds ids;
  uint64_t chunk_size = 0;
  uint64_t tensor_count = 0;
  uint64_t layout_checksum = 0;        // LayoutChecksum of the tensors it was made for
  std::vector<uint64_t> record_sizes;  // one per chunk
  uint64_t header_bytes = 0;           // where the first record starts
};

// Parses and checks the header of `bytes` (magic, format version, sizes adding up to exactly
// bytes.size()). Errors: DataLoss naming what is wrong; Unimplemented for a newer format.
absl::StatusOr<VersionHeader> ParseHeader(absl::Span<const std::byte> bytes);

// Decodes `bytes` into `out` (one pointer per layout entry). For a delta, `base` holds the base
// version's tensors; base[i] may equal out[i] (decoding in place). For a keyframe `base` may be
// empty. `on_tensor_done(i)` is called (from any thread) as soon as every chunk of tensor i is
// written, and for empty tensors right away; it may be null. The header must name `expected`
// and describe `layout` (chunk plan and tensor count); otherwise DataLoss, before any byte of
// `out` is written. A malformed chunk is DataLoss naming the chunk and its tensors; `out` then
// holds partial data.
absl::Status DecodeVersion(absl::Span<const std::byte> bytes, const VersionIds& expected,
                           absl::Span<const TensorLayout> layout,
                           absl::Span<const std::byte* const> base,
                           absl::Span<std::byte* const> out, Parallel& parallel,
                           const std::function<void(size_t)>& on_tensor_done);

// The method of each chunk of a parsed version (first byte of each record), for bookkeeping
// after a successful decode. Requires a header that ParseHeader accepted.
std::vector<Method> ChunkMethods(absl::Span<const std::byte> bytes, const VersionHeader& header);

// Lower-level: one chunk. `base` and `target` follow the chunk's pieces (their concatenation);
// `base` is empty for keyframes. Appends the record to `out`.
struct ChunkInput {
  const std::byte* base = nullptr;  // null in a keyframe
  const std::byte* target = nullptr;
  uint64_t bytes = 0;
};
ChunkResult EncodeChunk(DType dtype, absl::Span<const ChunkInput> spans, bool keyframe,
                        const EncodeOptions& options, std::vector<std::byte>* out);

struct ChunkOutput {
  const std::byte* base = nullptr;  // null in a keyframe; may equal `out`
  std::byte* out = nullptr;
  uint64_t bytes = 0;
};
// Decodes one record. Errors: DataLoss describing the problem (the caller adds which chunk).
absl::Status DecodeChunk(DType dtype, absl::Span<const ChunkOutput> spans, bool keyframe,
                         absl::Span<const std::byte> record);

// For tests: modeled records of 2-byte elements are decoded with the baseline x86-64 scan of the
// base (SSE2, no POPCNT) even where the CPU has AVX2 and POPCNT, whose scan is chosen at run
// time otherwise. Process-wide; thread-safe.
void DecodeWithBaselineScanForTesting(bool baseline);

}  // namespace weightbus::internal::delta
