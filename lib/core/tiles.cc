// SPDX-License-Identifier: Apache-2.0
#include "core/tiles.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace weightbus::internal {
namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

}  // namespace

uint64_t TileGrid::bands() const {
  return has_tiles() && rows > 0 && row_bytes > 0 ? CeilDiv(rows, tile_rows) : 0;
}

uint64_t TileGrid::columns() const {
  return has_tiles() && rows > 0 && row_bytes > 0 ? CeilDiv(row_bytes, tile_bytes) : 0;
}

TileGrid::Extent TileGrid::tile(uint64_t k) const {
  const uint64_t band = k / columns(), column = k % columns();
  Extent e;
  e.row_begin = band * tile_rows;
  e.row_end = std::min(rows, e.row_begin + tile_rows);
  e.byte_begin = column * tile_bytes;
  e.byte_end = std::min(row_bytes, e.byte_begin + tile_bytes);
  return e;
}

std::string TileGrid::Describe(uint64_t k, bool one_dimensional, std::string_view where) const {
  const Extent e = tile(k);
  if (one_dimensional) {
    return absl::StrFormat("block %d of %d (bytes [%d, %d) of its %d, blocks of %d bytes; %s)", k,
                           count(), e.byte_begin, e.byte_end, row_bytes, tile_bytes, where);
  }
  return absl::StrFormat(
      "tile %d of %d (rows [%d, %d) x bytes [%d, %d) of its %d rows of %d bytes, tiles of %d "
      "rows x %d bytes; %s)",
      k, count(), e.row_begin, e.row_end, e.byte_begin, e.byte_end, rows, row_bytes, tile_rows,
      tile_bytes, where);
}

std::pair<uint64_t, uint64_t> RowView(DType dtype, const std::vector<int64_t>& shape,
                                      uint64_t nbytes) {
  if (shape.size() >= 2 && shape.back() > 0) {
    const uint64_t bits = static_cast<uint64_t>(shape.back()) * DTypeBits(dtype);
    if (bits % 8 == 0 && bits / 8 > 0 && nbytes % (bits / 8) == 0) {
      return {nbytes / (bits / 8), bits / 8};
    }
  }
  return {nbytes > 0 ? 1 : 0, nbytes};
}

TileGrid ChooseTiles(DType dtype, const std::vector<int64_t>& shape, uint64_t nbytes,
                     uint64_t target) {
  TileGrid g;
  std::tie(g.rows, g.row_bytes) = RowView(dtype, shape, nbytes);
  // Plain variables, not structured bindings: the lambdas below capture them (Clang 14 cannot
  // capture a structured binding).
  const uint64_t rows = g.rows, row_bytes = g.row_bytes;
  if (target == 0 || nbytes == 0) return g;
  // Columns are cut on whole elements (whole bytes for sub-byte dtypes).
  const uint64_t unit = IsSubByte(dtype) ? 1 : DTypeSize(dtype);
  const uint64_t units = row_bytes / unit;
  uint64_t kc = 1, kr = 1;  // fractions of the row bytes and of the rows
  auto tile_bytes = [&](uint64_t k) { return CeilDiv(units, k) * unit; };
  auto tile_rows = [&](uint64_t k) { return CeilDiv(rows, k); };
  auto size = [&](uint64_t c, uint64_t r) { return tile_bytes(c) * tile_rows(r); };
  const uint64_t least = target / 64;
  // Up to 8 equal fractions of each dimension, alternately, while tiles stay at least
  // target / 64: a fraction that does not divide the dimension would put the boundaries of the
  // TP slices it is meant for inside tiles, so it stops there.
  for (bool progress = true; progress;) {
    progress = false;
    if (kc < 8 && units % (2 * kc) == 0 && size(2 * kc, kr) >= least) {
      kc *= 2;
      progress = true;
    }
    if (kr < 8 && rows % (2 * kr) == 0 && size(kc, 2 * kr) >= least) {
      kr *= 2;
      progress = true;
    }
  }
  // Then no tile above the target: rows first, then columns.
  while (size(kc, kr) > target) {
    if (rows >= 2 * kr) {
      kr *= 2;
    } else if (units >= 2 * kc) {
      kc *= 2;
    } else {
      break;  // one element per tile already
    }
  }
  g.tile_rows = tile_rows(kr);
  g.tile_bytes = tile_bytes(kc);
  return g;
}

TileGrid GridOf(const TensorInfo& t) {
  TileGrid g;
  if (t.block_bytes == 0) {
    std::tie(g.rows, g.row_bytes) = RowView(t.dtype, t.shape, t.nbytes);
    return g;
  }
  if (t.block_rows == 0) {  // format 1: 1-D blocks over the contiguous image
    g.rows = t.nbytes > 0 ? 1 : 0;
    g.row_bytes = t.nbytes;
    g.tile_rows = 1;
    g.tile_bytes = t.block_bytes;
    return g;
  }
  std::tie(g.rows, g.row_bytes) = RowView(t.dtype, t.shape, t.nbytes);
  g.tile_rows = t.block_rows;
  g.tile_bytes = t.block_bytes;
  return g;
}

}  // namespace weightbus::internal
