// SPDX-License-Identifier: Apache-2.0
// Checksum tiles (core/tiles.h), their hashing (core/checksum.h) and partial reads planned over
// them (core/tile_reads.h), against brute force written here: every tile gathered byte by byte
// and hashed with libxxhash, every range's touched tiles found byte by byte.
#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "core/checksum.h"
#include "core/tile_reads.h"
#include "core/tiles.h"
#include "test_support.h"

namespace weightbus::internal {
namespace {

// Tile k of `grid` over `bytes`, gathered row by row.
std::vector<std::byte> Gather(const std::vector<std::byte>& bytes, const TileGrid& grid,
                              uint64_t k) {
  const TileGrid::Extent e = grid.tile(k);
  std::vector<std::byte> out;
  for (uint64_t r = e.row_begin; r < e.row_end; ++r) {
    const std::byte* row = bytes.data() + r * grid.row_bytes;
    out.insert(out.end(), row + e.byte_begin, row + e.byte_end);
  }
  return out;
}

std::vector<uint64_t> BruteForceTiles(const std::vector<std::byte>& bytes, const TileGrid& grid) {
  std::vector<uint64_t> out;
  for (uint64_t k = 0; k < grid.count(); ++k) {
    const std::vector<std::byte> t = Gather(bytes, grid, k);
    out.push_back(testing::Xxh3(t.data(), t.size()));
  }
  return out;
}

// Hands `n` bytes to `update` in uneven pieces (1 byte, then each 3x + 7 the last).
template <typename F>
void FeedUnevenly(const std::byte* data, size_t n, F update) {
  size_t done = 0, step = 1;
  while (done < n) {
    const size_t take = std::min(step, n - done);
    update(data + done, take);
    done += take;
    step = step * 3 + 7;
  }
}

TEST(TilesTest, TileChecksumsAreXxh3OfEachTilesRowsConcatenatedHoweverTheBytesAreFed) {
  // Grids that divide and grids whose last band and column are shorter; narrow (gathered) and
  // wide (streamed) tiles; one row (1-D blocks) and one-row-high tiles.
  struct Case {
    uint64_t rows, row_bytes, tile_rows, tile_bytes;
  };
  for (const Case& c : std::vector<Case>{{64, 256, 16, 64},
                                         {896, 1792, 112, 224},
                                         {37, 1000, 8, 96},
                                         {5, 20000, 2, 6000},
                                         {1, 100000, 1, 4096},
                                         {300, 64, 1, 8},
                                         {3, 7, 5, 100}}) {
    const TileGrid grid{c.rows, c.row_bytes, c.tile_rows, c.tile_bytes};
    SCOPED_TRACE(::testing::Message()
                 << c.rows << "x" << c.row_bytes << " in " << c.tile_rows << "x" << c.tile_bytes);
    const std::vector<std::byte> bytes = testing::RandomBytes(c.rows * c.row_bytes, c.rows);
    const std::vector<uint64_t> want = BruteForceTiles(bytes, grid);
    ASSERT_EQ(want.size(), grid.count());
    const TensorChecksums once = ChecksumTensor(bytes.data(), bytes.size(), grid);
    EXPECT_EQ(once.xxh3, testing::Xxh3(bytes.data(), bytes.size()));
    EXPECT_EQ(once.blocks, want);
    EXPECT_EQ(once.grid, grid);
    TensorHasher hasher(bytes.size(), grid);
    FeedUnevenly(bytes.data(), bytes.size(),
                 [&](const std::byte* p, size_t n) { hasher.Update(p, n); });
    const TensorChecksums fed = hasher.Finish();
    EXPECT_EQ(fed.xxh3, once.xxh3);
    EXPECT_EQ(fed.blocks, want);
    // A reader hashes a tile it holds in place (Xxh3Strided) to the same value.
    for (uint64_t k = 0; k < grid.count(); ++k) {
      const TileGrid::Extent e = grid.tile(k);
      EXPECT_EQ(Xxh3Strided(bytes.data() + e.row_begin * c.row_bytes + e.byte_begin,
                            e.row_end - e.row_begin, e.byte_end - e.byte_begin, c.row_bytes),
                want[k])
          << "tile " << k;
    }
  }
}

TEST(TilesTest, RowViewIsTheLastDimensionsRows) {
  EXPECT_EQ(RowView(DType::kBF16, {896, 4864}, 896 * 4864 * 2),
            (std::pair<uint64_t, uint64_t>{896, 9728}));
  EXPECT_EQ(RowView(DType::kF32, {6, 64, 32}, 6 * 64 * 32 * 4),
            (std::pair<uint64_t, uint64_t>{384, 128}));
  EXPECT_EQ(RowView(DType::kF32, {4096}, 16384), (std::pair<uint64_t, uint64_t>{1, 16384}));
  EXPECT_EQ(RowView(DType::kF32, {}, 4), (std::pair<uint64_t, uint64_t>{1, 4}));
  EXPECT_EQ(RowView(DType::kF32, {0, 8}, 0), (std::pair<uint64_t, uint64_t>{0, 32}));
  // F4 rows of 3 elements are 12 bits: one row of all the bytes.
  EXPECT_EQ(RowView(DType::kF4, {4, 3}, 6), (std::pair<uint64_t, uint64_t>{1, 6}));
  EXPECT_EQ(RowView(DType::kF4, {4, 4}, 8), (std::pair<uint64_t, uint64_t>{4, 2}));
}

// Slices of TP degrees 2, 4 and 8 on either dimension of a matrix fall on tile boundaries, and
// tiles stay within the target, for the shapes of today's models.
TEST(TilesTest, ChooseTilesCutsBothDimensionsIntoEqualFractionsWithinTheTarget) {
  constexpr uint64_t kMiB = 1 << 20;
  struct Case {
    std::vector<int64_t> shape;
    DType dtype;
    uint64_t target;
  };
  for (const Case& c : std::vector<Case>{
           {{896, 896}, DType::kBF16, kMiB},     // Qwen2.5-0.5B q_proj / o_proj
           {{896, 4864}, DType::kBF16, kMiB},    // its down_proj
           {{4864, 896}, DType::kBF16, kMiB},    // gate_proj
           {{151936, 896}, DType::kBF16, kMiB},  // embed_tokens
           {{4096, 11008}, DType::kBF16, kMiB},  // Llama-2-7B down_proj
           {{11008, 4096}, DType::kBF16, 64 << 10},
           {{64, 64}, DType::kF32, 4096},          // stories260K wo, as tests publish it
           {{6, 64, 128}, DType::kF32, 64 << 10},  // stacked experts
       }) {
    const uint64_t nbytes = ByteSize(c.dtype, c.shape).value();
    const TileGrid g = ChooseTiles(c.dtype, c.shape, nbytes, c.target);
    SCOPED_TRACE(ShapeString(c.shape) + " " + std::string(DTypeName(c.dtype)) + ": tiles of " +
                 std::to_string(g.tile_rows) + " rows x " + std::to_string(g.tile_bytes) +
                 " bytes");
    ASSERT_TRUE(g.has_tiles());
    EXPECT_LE(g.tile(0).size(), c.target);
    EXPECT_GE(g.tile(0).size(), c.target / 64);
    EXPECT_EQ(g.tile_bytes % DTypeSize(c.dtype), 0u);
    for (int tp : {2, 4, 8}) {
      if (c.shape.back() % tp == 0 && g.row_bytes / tp >= g.tile_bytes) {
        EXPECT_EQ(g.row_bytes / tp % g.tile_bytes, 0u) << "columns at TP " << tp;
      }
      if (c.shape.front() % tp == 0 && g.rows / tp >= g.tile_rows) {
        EXPECT_EQ(g.rows / tp % g.tile_rows, 0u) << "rows at TP " << tp;
      }
    }
  }
  // At most 8 x 8 tiles until tiles outgrow the target: 64 for a 1.5 MiB matrix of 1 MiB tiles.
  EXPECT_EQ(ChooseTiles(DType::kBF16, {896, 896}, 896 * 896 * 2, kMiB),
            (TileGrid{896, 1792, 112, 224}));
  // A tensor of at most target / 64 bytes is one tile; no target, no tiles.
  EXPECT_EQ(ChooseTiles(DType::kF32, {64}, 256, kMiB).count(), 1u);
  EXPECT_FALSE(ChooseTiles(DType::kF32, {64, 64}, 16384, 0).has_tiles());
  // A vector is cut along its one row.
  const TileGrid v = ChooseTiles(DType::kF32, {1 << 20}, 4 << 20, kMiB);
  EXPECT_EQ(v.rows, 1u);
  EXPECT_EQ(v.columns(), 8u);
  EXPECT_EQ(v.tile_bytes, 512u << 10);
  // Sub-byte rows are cut on whole bytes.
  const TileGrid f4 = ChooseTiles(DType::kF4, {4096, 4096}, 4096 * 2048, 64 << 10);
  EXPECT_EQ(f4.row_bytes, 2048u);
  EXPECT_LE(f4.tile(0).size(), 64u << 10);
}

// Brute force: the tiles each byte of `ranges` lies in.
std::set<std::pair<size_t, uint64_t>> TouchedTiles(const std::vector<TileGrid>& grids,
                                                   const std::vector<WantedRange>& ranges) {
  std::set<std::pair<size_t, uint64_t>> out;
  for (const WantedRange& r : ranges) {
    const TileGrid& g = grids[r.part];
    for (uint64_t at = r.offset; at < r.offset + r.length; ++at) {
      const uint64_t row = at / g.row_bytes, x = at % g.row_bytes;
      out.insert({r.part, g.index(row / g.tile_rows, x / g.tile_bytes)});
    }
  }
  return out;
}

// Reads as the subscriber does (chunks into windows, each tile hashed in the window, ranges
// copied out) and checks: the tiles read are exactly those the ranges touch, each once; every
// tile hashes to its checksum; every window is within the limit; the ranges come out right.
void ReadAndCheck(const std::vector<std::vector<std::byte>>& parts,
                  const std::vector<TileGrid>& grids, const std::vector<WantedRange>& ranges,
                  uint64_t window_limit) {
  const TileReadPlan plan = PlanTileReads(grids, ranges, window_limit);
  const std::set<std::pair<size_t, uint64_t>> want = TouchedTiles(grids, ranges);
  uint64_t want_bytes = 0;
  for (const auto& [p, k] : want) want_bytes += grids[p].tile(k).size();
  EXPECT_EQ(plan.read_bytes, want_bytes);
  std::vector<std::vector<std::byte>> out(ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) out[i].assign(ranges[i].length, std::byte{0});
  std::vector<std::vector<int>> visits(ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) visits[i].assign(ranges[i].length, 0);
  std::multiset<std::pair<size_t, uint64_t>> hashed;
  const RangeCopier copier(grids, ranges);
  for (const std::vector<TileChunk>& window : plan.windows) {
    uint64_t fill = 0;
    for (const TileChunk& c : window) fill = std::max(fill, c.window_offset + c.size());
    EXPECT_LE(fill, window_limit);
    EXPECT_LE(fill, plan.window_bytes);
    std::vector<std::byte> buffer(fill);
    for (const TileChunk& c : window) {
      ForEachChunkRead(c, grids[c.part], [&](uint64_t at, uint64_t n, uint64_t to) {
        std::memcpy(buffer.data() + to, parts[c.part].data() + at, n);
      });
    }
    for (const TileChunk& c : window) {
      ForEachChunkTile(
          c, grids[c.part],
          [&](uint64_t k, uint64_t at, uint64_t rows, uint64_t width, uint64_t stride) {
            hashed.insert({c.part, k});
            const std::vector<std::byte> t = Gather(parts[c.part], grids[c.part], k);
            EXPECT_EQ(Xxh3Strided(buffer.data() + at, rows, width, stride),
                      testing::Xxh3(t.data(), t.size()))
                << "part " << c.part << " tile " << k;
          });
      copier.ForEach(c, [&](size_t q, uint64_t into, uint64_t at, uint64_t n) {
        std::memcpy(out[q].data() + into, buffer.data() + at, n);
        for (uint64_t b = 0; b < n; ++b) ++visits[q][into + b];
      });
    }
  }
  const std::set<std::pair<size_t, uint64_t>> once(hashed.begin(), hashed.end());
  EXPECT_EQ(once, want);
  EXPECT_EQ(hashed.size(), want.size()) << "a tile read twice";
  for (size_t i = 0; i < ranges.size(); ++i) {
    const WantedRange& r = ranges[i];
    EXPECT_EQ(std::memcmp(out[i].data(), parts[r.part].data() + r.offset, r.length), 0)
        << "range " << i;
    EXPECT_TRUE(std::all_of(visits[i].begin(), visits[i].end(), [](int v) { return v == 1; }))
        << "range " << i << ": a byte copied other than once";
  }
}

// A row-parallel slice (the same columns of every row) reads exactly its tiles, a
// column-parallel one its bands: the bytes of the slice when it falls on tile boundaries.
TEST(TileReadsTest, SlicesOnTileBoundariesReadExactlyTheirBytes) {
  const TileGrid g = ChooseTiles(DType::kBF16, {896, 896}, 896 * 896 * 2, 1 << 20);
  ASSERT_EQ(g, (TileGrid{896, 1792, 112, 224}));
  const std::vector<std::vector<std::byte>> parts = {testing::RandomBytes(896 * 1792, 3)};
  for (int tp : {2, 4, 8}) {
    for (int r = 0; r < tp; ++r) {
      std::vector<WantedRange> cols, rows;
      const uint64_t w = 1792 / tp;
      for (uint64_t row = 0; row < 896; ++row) {
        cols.push_back(WantedRange{0, row * 1792 + r * w, w, 0, row * w});
      }
      rows.push_back(WantedRange{0, r * (896 / tp) * 1792ull, 896 / tp * 1792ull, 0, 0});
      for (const auto& ranges : {cols, rows}) {
        const TileReadPlan plan = PlanTileReads({g}, ranges, 32 << 20);
        EXPECT_EQ(plan.read_bytes, 896ull * 1792 / tp) << "TP " << tp << " rank " << r;
        EXPECT_EQ(plan.windows.size(), 1u);
        ReadAndCheck(parts, {g}, ranges, 32 << 20);
      }
    }
  }
}

// Random ranges over several parts, grids that do not divide, windows of a few tiles.
TEST(TileReadsTest, RandomRangesReadTheirTilesOnceAndComeOutRight) {
  std::mt19937_64 rng(12);
  const std::vector<TileGrid> grids = {
      {50, 300, 7, 64}, {1, 10000, 1, 1024}, {9, 40, 3, 40}, {128, 512, 16, 128}};
  std::vector<std::vector<std::byte>> parts;
  for (size_t p = 0; p < grids.size(); ++p) {
    parts.push_back(testing::RandomBytes(grids[p].rows * grids[p].row_bytes, 100 + p));
  }
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<WantedRange> ranges;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      const size_t p = rng() % grids.size();
      const uint64_t size = parts[p].size();
      const uint64_t a = rng() % size, b = rng() % size;
      ranges.push_back(
          WantedRange{p, std::min(a, b), std::max(a, b) - std::min(a, b) + 1, size_t(i), 0});
    }
    if (trial % 3 == 0) {  // a column band of every row, as a row-parallel slice
      for (uint64_t row = 0; row < 128; ++row) ranges.push_back({3, row * 512 + 100, 90, 99, 0});
    }
    uint64_t largest = 0;
    for (const TileGrid& g : grids) largest = std::max(largest, g.tile(0).size());
    for (uint64_t limit : {largest, 3 * largest, uint64_t{1} << 20}) {
      SCOPED_TRACE(::testing::Message() << "trial " << trial << ", window " << limit);
      ReadAndCheck(parts, grids, ranges, limit);
    }
  }
}

}  // namespace
}  // namespace weightbus::internal
