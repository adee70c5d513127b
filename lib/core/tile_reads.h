// SPDX-License-Identifier: Apache-2.0
// Partial reads verified by checksum tiles (docs/RESHARDING.md, "Partial reads, verified"): a
// subscriber that needs some byte ranges of some tensors (a TP rank's slices of the published
// parts) reads exactly the tiles those ranges touch (core/tiles.h), window by window through
// bounded staging memory, hashes each tile it read and copies the ranges out. This module is
// the computation (which tiles, which reads, which copies); the subscriber does the I/O and
// the hashing. Pure functions, thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/types/span.h"
#include "core/tiles.h"

namespace weightbus::internal {

// `length` bytes at `offset` of part `part`'s contiguous row-major image, wanted at
// `dest_offset` of destination `dest` (the caller's numbering).
struct WantedRange {
  size_t part = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  size_t dest = 0;
  uint64_t dest_offset = 0;
};

// A rectangle of whole tiles of one part: rows [row_begin, row_end) by bytes [byte_begin,
// byte_end) of each row of its row view, held in a window row after row (width() bytes each)
// from `window_offset`.
struct TileChunk {
  size_t part = 0;
  uint64_t row_begin = 0, row_end = 0, byte_begin = 0, byte_end = 0;
  uint64_t window_offset = 0;
  uint64_t width() const { return byte_end - byte_begin; }
  uint64_t size() const { return (row_end - row_begin) * width(); }
};

struct TileReadPlan {
  // The windows in reading order; each a list of chunks packed from offset 0.
  std::vector<std::vector<TileChunk>> windows;
  uint64_t window_bytes = 0;  // the fullest window
  uint64_t read_bytes = 0;    // every tile read, all windows
};

// The tiles `ranges` touch, each read once, grouped into chunks (a run of touched columns of a
// band, and the same run of the bands after it) and packed into windows of at most
// `window_limit` bytes (which must hold the largest tile of a part read). `grids[p]` is part
// p's grid (with tiles). Ranges may overlap and come in any order.
TileReadPlan PlanTileReads(absl::Span<const TileGrid> grids, absl::Span<const WantedRange> ranges,
                           uint64_t window_limit);

// The reads that fill `chunk` from its part: one for a chunk of whole rows, else one per row.
// `read(offset in the part, length, offset in the window)`.
void ForEachChunkRead(const TileChunk& chunk, const TileGrid& grid,
                      const std::function<void(uint64_t, uint64_t, uint64_t)>& read);

// The tiles of `chunk`: `tile(index in the grid, offset of its first byte in the window, rows,
// width in bytes, stride in bytes)`, band by band, column by column.
void ForEachChunkTile(
    const TileChunk& chunk, const TileGrid& grid,
    const std::function<void(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t)>& tile);

// Copies out of read chunks. Built once over all the ranges; each call visits the pieces of the
// ranges that `chunk` holds: `copy(range index, offset into the range, offset in the window,
// length)`. Each byte of each range is visited exactly once over all the plan's chunks.
class RangeCopier {
 public:
  RangeCopier(absl::Span<const TileGrid> grids, absl::Span<const WantedRange> ranges);
  void ForEach(const TileChunk& chunk,
               const std::function<void(size_t, uint64_t, uint64_t, uint64_t)>& copy) const;

 private:
  absl::Span<const TileGrid> grids_;
  absl::Span<const WantedRange> ranges_;
  std::vector<size_t> order_;       // ranges by (part, offset)
  std::vector<uint64_t> reach_;     // the furthest end of order_[0..i]'s ranges in their part
  std::vector<size_t> part_begin_;  // first position in order_ of each part (and the end)
};

}  // namespace weightbus::internal
