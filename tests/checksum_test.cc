// SPDX-License-Identifier: Apache-2.0
// XXH3-64 as the core computes it (vectorized where the CPU allows), in one go and streamed in
// pieces, against libxxhash.
#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

#include "core/checksum.h"
#include "test_support.h"

namespace weightbus::internal {
namespace {

// Hands `n` bytes at `data` to `update` in uneven pieces (1 byte, then each 3x + 7 the last).
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

TEST(ChecksumTest, VectorizedXxh3MatchesLibxxhashInOneGoAndInPieces) {
  const std::vector<std::byte> bytes = testing::RandomBytes(3 << 20, 99);
  for (size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{129}, size_t{240}, size_t{241},
                   size_t{1024}, size_t{65537}, bytes.size()}) {
    const uint64_t want = testing::Xxh3(bytes.data(), n);
    EXPECT_EQ(Xxh3(bytes.data(), n), want) << n << " bytes, " << Xxh3Implementation();
    // Streamed in uneven pieces, as transfers land.
    Xxh3Stream stream;
    FeedUnevenly(bytes.data(), n, [&](const std::byte* p, size_t k) { stream.Update(p, k); });
    EXPECT_EQ(stream.Digest(), want) << n << " bytes streamed";
  }
}

// 1-D block checksums (format 1, LinearBlocks) are libxxhash's XXH3-64 of each block (the last
// one shorter), however the bytes are fed, and the whole checksum is unchanged by computing them.
// Tiles are tiles_test.cc's.
TEST(ChecksumTest, TensorHasherBlocksAreXxh3OfEachBlock) {
  const std::vector<std::byte> bytes = testing::RandomBytes((1 << 20) + 4097, 7);
  for (uint64_t block :
       {uint64_t{0}, uint64_t{4096}, uint64_t{65536}, uint64_t{1} << 20, uint64_t{3} << 20}) {
    for (size_t n : {size_t{0}, size_t{4096}, size_t{4097}, bytes.size()}) {
      SCOPED_TRACE(testing::Xxh3(&block, sizeof block) ^ n);
      std::vector<uint64_t> want;
      for (uint64_t at = 0; block > 0 && at < n; at += block) {
        want.push_back(testing::Xxh3(bytes.data() + at, std::min<uint64_t>(block, n - at)));
      }
      const TensorChecksums whole = ChecksumTensor(bytes.data(), n, LinearBlocks(n, block));
      EXPECT_EQ(whole.xxh3, testing::Xxh3(bytes.data(), n)) << block << " " << n;
      EXPECT_EQ(whole.grid.tile_bytes, block);
      EXPECT_EQ(whole.blocks, want) << block << " " << n;
      EXPECT_EQ(whole.blocks.size(), BlockCount(n, block));
      TensorHasher hasher(n, LinearBlocks(n, block));
      FeedUnevenly(bytes.data(), n, [&](const std::byte* p, size_t k) { hasher.Update(p, k); });
      const TensorChecksums streamed = hasher.Finish();
      EXPECT_EQ(streamed.xxh3, whole.xxh3) << block << " " << n;
      EXPECT_EQ(streamed.blocks, want) << block << " " << n;
    }
  }
}

}  // namespace
}  // namespace weightbus::internal
