// SPDX-License-Identifier: Apache-2.0
// How the device checksums tiles that are not contiguous (docs/FORMAT.md, "Checksums of device
// memory"): a tile of several columns is `tile_rows` segments of a row each, so a band of tiles
// is first gathered into contiguous scratch in tile order (column by column, each tile's rows in
// order), where every tile is one contiguous checksum. Host code, run by the CUDA driver
// (core/cuda/device.cc, with the pack kernels doing the gathers) and by the host tests
// (tests/device_kernels_test.cc, with strided::ElementOffset) against ChecksumTensor.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tiles.h"

namespace weightbus::internal::tile_gather {

// The size of each tile of `g` where its tiles are contiguous in the tensor's bytes (a single
// row: 1-D blocks; or whole rows: one column), the last one shorter; 0 where they are not (or
// `g` has no tiles).
inline uint64_t ContiguousTileBytes(const TileGrid& g) {
  if (!g.has_tiles() || g.rows == 0) return 0;
  if (g.rows == 1) return g.tile_bytes;
  if (g.columns() == 1) return g.tile_rows * g.row_bytes;
  return 0;
}

// One gather of a strided view of the tensor's bytes: elements of `elem` bytes, from byte
// `src_offset` of the tensor, `shape` and `strides` in elements, into `bytes` contiguous bytes.
struct Gather {
  uint64_t src_offset = 0;
  uint64_t elem = 1;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  uint64_t bytes = 0;
};

// The bytes of band `band` of `g` (rows times row_bytes).
inline uint64_t BandBytes(const TileGrid& g, uint64_t band) {
  const TileGrid::Extent e = g.tile(g.index(band, 0));
  return (e.row_end - e.row_begin) * g.row_bytes;
}

// The gathers that put band `band` of `g` in tile order: its full-width columns in one 3-D view
// [columns, rows, tile_bytes], then the shorter last column (if any) in a 2-D one; the widest
// element (8, 4, 2 or 1 bytes) that divides the tile and row widths. Tile (band, c) is then
// bytes [c * rows * tile_bytes, + its size) of the gathered band.
inline std::vector<Gather> BandGathers(const TileGrid& g, uint64_t band) {
  const TileGrid::Extent e = g.tile(g.index(band, 0));
  const auto rows = static_cast<int64_t>(e.row_end - e.row_begin);
  const uint64_t full = g.row_bytes / g.tile_bytes, last = g.row_bytes % g.tile_bytes;
  uint64_t elem = 8;
  while (elem > 1 && (g.tile_bytes % elem != 0 || g.row_bytes % elem != 0)) elem /= 2;
  const auto tb = static_cast<int64_t>(g.tile_bytes / elem);
  const auto rb = static_cast<int64_t>(g.row_bytes / elem);
  const uint64_t at = e.row_begin * g.row_bytes;
  std::vector<Gather> out;
  if (full > 0) {
    out.push_back(Gather{at,
                         elem,
                         {static_cast<int64_t>(full), rows, tb},
                         {tb, rb, 1},
                         full * static_cast<uint64_t>(rows) * g.tile_bytes});
  }
  if (last > 0) {
    out.push_back(Gather{at + full * g.tile_bytes,
                         elem,
                         {rows, static_cast<int64_t>(last / elem)},
                         {rb, 1},
                         static_cast<uint64_t>(rows) * last});
  }
  return out;
}

// The sizes of band `band`'s tiles in the gathered band, in column order.
inline std::vector<uint64_t> GatheredTileBytes(const TileGrid& g, uint64_t band) {
  std::vector<uint64_t> out;
  for (uint64_t c = 0; c < g.columns(); ++c) out.push_back(g.tile(g.index(band, c)).size());
  return out;
}

}  // namespace weightbus::internal::tile_gather
