// SPDX-License-Identifier: Apache-2.0
// XXH3-64 (seed 0), the checksum of every tensor (docs/FORMAT.md), computed with the widest
// vector unit the CPU has: libxxhash is built for baseline x86-64 (SSE2), and AVX2 hashes about
// twice as fast, which matters where checksums overlap copies and transfers. Results are
// identical whichever implementation runs (XXH3 is defined independently of vector width).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/tiles.h"

namespace weightbus::internal {

// XXH3-64 of `n` bytes at `data`.
uint64_t Xxh3(const void* data, size_t n);

// The same checksum computed over several consecutive calls to Update. Not thread-safe.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void Update(const void* data, size_t n);
  uint64_t Digest() const;
  // Starts over, as if newly constructed (no allocation).
  void Reset();

 private:
  void* state_;  // XXH3_state_t of the implementation chosen at startup
};

// XXH3-64 of `rows` runs of `width` bytes, `stride` bytes apart from `first` (a tile of a
// row-major tensor: its row segments concatenated, as if they were contiguous). Contiguous runs
// are hashed in one go; others are gathered through a small buffer and streamed.
uint64_t Xxh3Strided(const void* first, uint64_t rows, uint64_t width, uint64_t stride);

// A tensor's checksums (docs/FORMAT.md): XXH3-64 of all its bytes, and, when grid.has_tiles(),
// of each tile of `grid` (core/tiles.h; the 1-D blocks of format 1 are a grid of one row), so
// that a reader of some byte ranges verifies exactly the tiles it read.
struct TensorChecksums {
  uint64_t xxh3 = 0;
  TileGrid grid;                 // no tiles: no block checksums
  std::vector<uint64_t> blocks;  // grid.count() entries, band-major
};

// Blocks of `nbytes` bytes cut into 1-D blocks of `block_bytes` (0 when either is 0).
inline uint64_t BlockCount(uint64_t nbytes, uint64_t block_bytes) {
  return block_bytes == 0 ? 0 : (nbytes + block_bytes - 1) / block_bytes;
}

// The 1-D blocks of format 1 over `nbytes` contiguous bytes (no tiles when block_bytes is 0).
TileGrid LinearBlocks(uint64_t nbytes, uint64_t block_bytes);

// Computes TensorChecksums from a tensor's bytes fed in row-major order, in pieces of any size:
// each byte is read once from memory (the tile hash and the whole hash both consume it while it
// is in cache; the segments of a tile's rows are gathered through a small buffer per column so
// that narrow tiles hash at nearly the speed of wide ones). Not thread-safe; movable.
class TensorHasher {
 public:
  // `grid` describes `nbytes` bytes (grid.rows * grid.row_bytes), or has no tiles.
  TensorHasher(uint64_t nbytes, const TileGrid& grid);
  void Update(const void* data, size_t n);
  // After all nbytes bytes were fed.
  TensorChecksums Finish();

 private:
  // Feeds `n` bytes, in order, to the tiles they belong to.
  void Walk(const std::byte* p, size_t n);
  void Feed(uint64_t column, const std::byte* p, size_t n);
  void Flush(uint64_t column);

  TileGrid grid_;
  uint64_t row_ = 0, at_ = 0;  // position: row, and byte within it
  std::unique_ptr<Xxh3Stream> whole_;
  // Per column of the current band: its stream and a gather buffer of its segments.
  std::vector<std::unique_ptr<Xxh3Stream>> streams_;
  std::vector<std::vector<std::byte>> gather_;
  TensorChecksums out_;
};

// TensorChecksums of `n` contiguous bytes at `data` cut as `grid` says (no tiles: the whole
// checksum only).
TensorChecksums ChecksumTensor(const void* data, uint64_t n, const TileGrid& grid);

// "avx2" or "sse2": the implementation in use, for benchmark banners.
const char* Xxh3Implementation();

}  // namespace weightbus::internal
