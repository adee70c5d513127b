// SPDX-License-Identifier: Apache-2.0
// Partial decoding for subscribers that read only some byte ranges of a version (a TP rank's
// slices; README.md, "Partial reads"): an encoded version's chunks decode independently
// (docs/FORMAT.md, "Chunks"), so such a subscriber decodes, and keeps as its base for the next
// delta, only the chunks its ranges meet. A ChunkStore holds those chunks' bytes, each chunk's
// pieces concatenated as the codec cuts them, in one buffer of their total size: never the
// version's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/buffer.h"
#include "delta/codec.h"

namespace weightbus::internal::delta {

// A byte range of a tensor of a version (index into its layout).
struct TensorRange {
  size_t tensor = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

class ChunkStore {
 public:
  // A store for the chunks `wanted` (one flag per chunk of PlanChunks(layout, chunk_size)) of a
  // version of `layout`; their bytes are uninitialised until decoded.
  // Errors: ResourceExhausted/Internal from the allocation.
  static absl::StatusOr<ChunkStore> Create(absl::Span<const TensorLayout> layout,
                                           uint64_t chunk_size, std::vector<bool> wanted);
  ChunkStore() = default;

  uint64_t chunk_size() const { return chunk_size_; }
  const std::vector<Chunk>& chunks() const { return chunks_; }
  const std::vector<TensorLayout>& layout() const { return layout_; }
  bool Has(size_t chunk) const { return chunk < held_.size() && held_[chunk]; }
  // Whether every chunk `wanted` flags is held (same chunk plan).
  bool HasAll(const std::vector<bool>& wanted) const;
  // Chunk c's bytes (its pieces concatenated); only for a held chunk.
  std::byte* chunk(size_t c) const { return buffer_->data() + offsets_[c]; }
  // Bytes of the buffer (the held chunks').
  uint64_t bytes() const { return buffer_ ? buffer_->size() : 0; }

  // Copies `r` out, from the held chunks it lies in. Errors: Internal when a chunk it needs is
  // not held (a caller's bookkeeping error).
  absl::Status CopyOut(const TensorRange& r, std::byte* dst) const;

 private:
  std::vector<TensorLayout> layout_;
  uint64_t chunk_size_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<bool> held_;
  std::vector<uint64_t> offsets_;  // of each held chunk in buffer_
  std::unique_ptr<HostBuffer> buffer_;
  // Per tensor, its pieces in offset order: (offset in the tensor, chunk, offset in the chunk).
  struct At {
    uint64_t offset;
    size_t chunk;
    uint64_t in_chunk;
    uint64_t bytes;
  };
  std::vector<std::vector<At>> index_;
};

// The chunks of PlanChunks(layout, chunk_size) that `ranges` meet, one flag per chunk.
std::vector<bool> ChunksMeeting(absl::Span<const TensorLayout> layout, uint64_t chunk_size,
                                absl::Span<const TensorRange> ranges);

// Decodes the chunks `out` holds of encoded version `bytes`, which must be `expected` and made
// for `layout` with `out`'s chunk size (checked as DecodeVersion checks them: DataLoss otherwise,
// before any byte is written); a delta from `base`, which must hold every one of them. A
// malformed chunk is DataLoss naming it. Chunks run on `parallel`.
absl::Status DecodeChunks(absl::Span<const std::byte> bytes, const VersionIds& expected,
                          const ChunkStore* base, ChunkStore& out, Parallel& parallel);

}  // namespace weightbus::internal::delta
