// SPDX-License-Identifier: Apache-2.0
// Checksum tiles (docs/FORMAT.md, "Block checksums"): how a tensor's bytes are cut into the
// pieces its manifest gives one XXH3-64 each, so that a reader of some of its bytes (a TP worker
// reading its slices) verifies exactly what it read. Pure geometry, no hashing (core/checksum.h
// hashes); every function may run on any thread.
//
// A tensor is seen as `rows` rows of `row_bytes` bytes (its row view: the rows of its last
// dimension) and cut into tiles of `tile_rows` rows by `tile_bytes` bytes of each row, the last
// band of rows and the last column of bytes shorter where they do not divide. A TP slice of a
// matrix [out, in] is a set of rows (column-parallel, dimension 0) or the same byte range of
// every row (row-parallel, dimension 1): either way it meets whole tiles when its boundaries fall
// on the tiles', which is why tiles cut both dimensions into equal fractions (ChooseTiles).
// The 1-D blocks of checksum format 1 (manifests written before tiles) are the grid of a single
// row: rows 1, row_bytes nbytes, tile_rows 1, tile_bytes block_bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "weightbus/manifest.hpp"
#include "weightbus/types.hpp"

namespace weightbus::internal {

struct TileGrid {
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
  uint64_t tile_rows = 0;   // 0: no checksums beyond the whole tensor's
  uint64_t tile_bytes = 0;  // 0: no checksums beyond the whole tensor's

  // A tile's rows [row_begin, row_end) and the bytes [byte_begin, byte_end) of each of them.
  struct Extent {
    uint64_t row_begin = 0, row_end = 0, byte_begin = 0, byte_end = 0;
    uint64_t size() const { return (row_end - row_begin) * (byte_end - byte_begin); }
  };

  bool has_tiles() const { return tile_rows > 0 && tile_bytes > 0; }
  // Bands of rows, columns of bytes and tiles (0 for an empty tensor or without tiles). Tile k is
  // band k / columns(), column k % columns().
  uint64_t bands() const;
  uint64_t columns() const;
  uint64_t count() const { return bands() * columns(); }
  Extent tile(uint64_t k) const;
  // The tiles' checksum order is band-major: this is tile (band, column)'s index.
  uint64_t index(uint64_t band, uint64_t column) const { return band * columns() + column; }
  // Names tile k in messages, with `where` its bytes come from: "tile 5 of 64 (rows [112, 224)
  // x bytes [448, 672) of its 896 rows of 1792 bytes, tiles of 112 rows x 224 bytes; <where>)"
  // or, for the 1-D blocks of format 1, "block 4 of 6 (bytes [16384, 20480) of its 22016,
  // blocks of 4096 bytes; <where>)".
  std::string Describe(uint64_t k, bool one_dimensional, std::string_view where) const;

  friend bool operator==(const TileGrid&, const TileGrid&) = default;
};

// The row view of a tensor of `dtype` and `shape` (`nbytes` bytes): the rows of its last
// dimension when it has at least 2 dimensions and a row is a whole number of bytes, else one row
// of all its bytes (0-d and 1-D tensors, sub-byte rows). {rows, row_bytes}.
std::pair<uint64_t, uint64_t> RowView(DType dtype, const std::vector<int64_t>& shape,
                                      uint64_t nbytes);

// The tiles a publisher records for a tensor (setting checksum_block = `target` bytes; 0: none,
// an empty grid). Each dimension of the row view is cut into a power-of-two number of
// fractions: first into up to 8 equal ones, alternately columns (bytes of a row) then rows,
// while the fraction divides the dimension and a tile stays at least `target` / 64 bytes, so
// that the slices of TP degrees 2, 4 and 8 on either dimension meet whole tiles wherever the
// dimension divides; then further, rows first, while a tile is larger than `target` (rounded up
// to whole elements, the last band or column shorter). A tensor of less than `target` / 32
// bytes is one tile. Column cuts fall on whole elements (whole bytes for sub-byte dtypes).
TileGrid ChooseTiles(DType dtype, const std::vector<int64_t>& shape, uint64_t nbytes,
                     uint64_t target);

// The grid of the checksums `t` carries: its tiles (block_rows > 0), its 1-D blocks (format 1:
// block_rows 0, block_bytes > 0), or none (both 0).
TileGrid GridOf(const TensorInfo& t);

}  // namespace weightbus::internal
