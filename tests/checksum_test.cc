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

TEST(ChecksumTest, VectorizedXxh3MatchesLibxxhashInOneGoAndInPieces) {
  const std::vector<std::byte> bytes = testing::RandomBytes(3 << 20, 99);
  for (size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{129}, size_t{240}, size_t{241},
                   size_t{1024}, size_t{65537}, bytes.size()}) {
    const uint64_t want = testing::Xxh3(bytes.data(), n);
    EXPECT_EQ(Xxh3(bytes.data(), n), want) << n << " bytes, " << Xxh3Implementation();
    // Streamed in uneven pieces, as transfers land.
    Xxh3Stream stream;
    size_t done = 0, step = 1;
    while (done < n) {
      const size_t take = std::min(step, n - done);
      stream.Update(bytes.data() + done, take);
      done += take;
      step = step * 3 + 7;
    }
    EXPECT_EQ(stream.Digest(), want) << n << " bytes streamed";
  }
}

}  // namespace
}  // namespace weightbus::internal
