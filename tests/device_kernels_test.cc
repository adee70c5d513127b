// SPDX-License-Identifier: Apache-2.0
// The device kernels' code, run on the host (no GPU needed): the __host__ __device__ XXH3-64
// core (core/cuda/xxh3_core.h) against libxxhash's XXH3_64bits for every size up to 4 KiB and
// many larger ones at every alignment; the checksum plan (core/cuda/hash_plan.h) run window by
// window the way the kernels run it against ChecksumTensor; and the strided index arithmetic
// (core/cuda/strided_core.h) the packing kernels use against PackStrided / UnpackStrided. The
// kernels themselves are run against the host by tests/gpu/device_gpu_test.cc.
#include <xxhash.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/checksum.h"
#include "core/cuda/hash_plan.h"
#include "core/cuda/strided_core.h"
#include "core/cuda/tile_gather.h"
#include "core/cuda/xxh3_core.h"
#include "core/tensor_pack.h"
#include "core/tiles.h"
#include "gtest/gtest.h"

namespace weightbus::internal {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<size_t>(8, n - i));
  }
  return out;
}

uint64_t DeviceCoreHash(const uint8_t* p, uint64_t n) { return xxh3::Hash(p, n, xxh3::kSecret); }

TEST(DeviceXxh3Test, EverySizeUpTo4KiBAtEveryAlignmentEqualsLibxxhash) {
  const std::vector<uint8_t> data = RandomBytes(4096 + 16, 1);
  for (size_t n = 0; n <= 4096; ++n) {
    for (size_t align = 0; align < 8; ++align) {
      const uint8_t* p = data.data() + align;
      ASSERT_EQ(DeviceCoreHash(p, n), XXH3_64bits(p, n)) << "size " << n << " alignment " << align;
    }
  }
}

TEST(DeviceXxh3Test, LargeSizesAroundBlockAndStripeEdgesEqualLibxxhash) {
  const std::vector<uint8_t> data = RandomBytes((3 << 20) + 64, 2);
  std::vector<uint64_t> sizes;
  for (uint64_t blocks : {1, 2, 15, 16, 17, 255, 256, 1024, 3071}) {
    for (int64_t delta : {-65, -64, -63, -1, 0, 1, 63, 64, 65}) {
      sizes.push_back(blocks * 1024 + delta);
    }
  }
  sizes.push_back(3 << 20);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 40; ++i) sizes.push_back(rng() % (3 << 20));
  for (uint64_t n : sizes) {
    for (size_t align : {0, 1, 3, 4, 8, 13}) {
      const uint8_t* p = data.data() + align;
      ASSERT_EQ(DeviceCoreHash(p, n), XXH3_64bits(p, n)) << "size " << n << " alignment " << align;
    }
  }
}

TEST(DeviceXxh3Test, AllZeroAndAllOnesInputsEqualLibxxhash) {
  for (uint8_t fill : {uint8_t{0}, uint8_t{0xff}}) {
    const std::vector<uint8_t> data(70000, fill);
    for (uint64_t n : {0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 1025, 70000}) {
      EXPECT_EQ(DeviceCoreHash(data.data(), n), XXH3_64bits(data.data(), n)) << n;
    }
  }
}

// The kernels' work, run on the host in the same order: BlockSums and Chain per window of
// `window` sums (every thread of a kernel is one (index, lane) call), then Finish.
std::vector<TensorChecksums> RunPlanOnHost(const std::vector<const uint8_t*>& data,
                                           const std::vector<uint64_t>& len, uint64_t block_bytes,
                                           uint64_t window) {
  const device_hash::Plan plan = device_hash::MakePlan(data, len, block_bytes);
  std::vector<uint64_t> lanes(plan.segments.size() * xxh3::kLanes);
  for (size_t i = 0; i < lanes.size(); ++i) lanes[i] = xxh3::InitLane(i % xxh3::kLanes);
  std::vector<uint64_t> sums(std::max<uint64_t>(1, std::min(plan.sums, window)) * xxh3::kLanes);
  for (uint64_t begin = 0; begin < plan.sums; begin += window) {
    const uint64_t end = std::min(plan.sums, begin + window);
    for (uint64_t t = 0; t < (end - begin) * xxh3::kLanes; ++t) {
      sums[t] = device_hash::SumOf(plan.ranges.data(), plan.ranges.size(), begin + t / xxh3::kLanes,
                                   xxh3::kSecret, static_cast<int>(t % xxh3::kLanes));
    }
    for (uint64_t t = 0; t < lanes.size(); ++t) {
      lanes[t] =
          device_hash::ChainWindow(plan.segments[t / xxh3::kLanes], lanes[t], sums.data(), begin,
                                   end, xxh3::kSecret, static_cast<int>(t % xxh3::kLanes));
    }
  }
  std::vector<uint64_t> out(plan.segments.size());
  for (size_t s = 0; s < out.size(); ++s) {
    out[s] = device_hash::FinishSegment(plan.segments[s], lanes.data() + s * xxh3::kLanes,
                                        xxh3::kSecret);
  }
  std::vector<TensorChecksums> result(data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    result[i].xxh3 = out[plan.whole[i]];
    result[i].grid = LinearBlocks(len[i], block_bytes);
    result[i].blocks.assign(out.begin() + plan.first_block[i],
                            out.begin() + plan.first_block[i] + plan.blocks[i]);
  }
  return result;
}

TEST(DeviceChecksumPlanTest, WindowsAndSharedBlockSumsEqualChecksumTensor) {
  const std::vector<uint8_t> bytes = RandomBytes(8 << 20, 4);
  // Tensors of awkward sizes and alignments, back to back, some empty or short.
  const std::vector<uint64_t> sizes = {
      0, 1, 240, 241, 4096, 4097, 1 << 20, (1 << 20) + 1, (2 << 20) - 7, 12345, 3000000 - 17};
  std::vector<const uint8_t*> data;
  uint64_t at = 1;
  for (uint64_t n : sizes) {
    data.push_back(bytes.data() + at);
    at += n + 3;
  }
  ASSERT_LE(at, bytes.size());
  // Blocks that share the tensors' sums (multiples of 1024), that do not, and none; windows
  // from one sum to more than all of them.
  for (uint64_t block : {uint64_t{0}, uint64_t{4096}, uint64_t{1} << 20, uint64_t{5000}}) {
    for (uint64_t window : {uint64_t{1}, uint64_t{7}, uint64_t{1000}, uint64_t{1} << 18}) {
      const std::vector<TensorChecksums> got = RunPlanOnHost(data, sizes, block, window);
      for (size_t i = 0; i < sizes.size(); ++i) {
        const TensorChecksums want =
            ChecksumTensor(data[i], sizes[i], LinearBlocks(sizes[i], block));
        EXPECT_EQ(got[i].xxh3, want.xxh3)
            << "tensor " << i << " block " << block << " window " << window;
        EXPECT_EQ(got[i].grid, want.grid);
        EXPECT_EQ(got[i].blocks, want.blocks) << "tensor " << i << " block " << block;
      }
    }
  }
}

TEST(DeviceChecksumPlanTest, SharedSumsAreComputedOncePerTensor) {
  // 1 MiB blocks over a 4 MiB tensor share the tensor's 4095 block sums; 5000-byte blocks
  // need their own.
  const std::vector<uint8_t> bytes = RandomBytes(4 << 20, 5);
  const device_hash::Plan shared = device_hash::MakePlan({bytes.data()}, {4 << 20}, 1 << 20);
  EXPECT_EQ(shared.sums, (uint64_t{4} << 20) / 1024 - 1);
  EXPECT_EQ(shared.ranges.size(), 1u);
  EXPECT_EQ(shared.segments.size(), 5u);  // the whole and 4 blocks
  const device_hash::Plan own = device_hash::MakePlan({bytes.data()}, {4 << 20}, 5000);
  EXPECT_GT(own.ranges.size(), 800u);
}

// The packing kernels' work on the host: element by element through ElementOffset, for
// elements [first, first + count).
void GatherOnHost(const std::byte* src, size_t elem, const strided::Layout& layout, uint64_t first,
                  uint64_t count, std::byte* dst) {
  for (uint64_t i = 0; i < count; ++i) {
    std::memcpy(dst + i * elem, src + strided::ElementOffset(layout, first + i) * int64_t(elem),
                elem);
  }
}

void ScatterOnHost(const std::byte* src, size_t elem, const strided::Layout& layout, uint64_t first,
                   uint64_t count, std::byte* dst) {
  for (uint64_t i = 0; i < count; ++i) {
    std::memcpy(dst + strided::ElementOffset(layout, first + i) * int64_t(elem), src + i * elem,
                elem);
  }
}

struct ViewCase {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements; empty: row-major
  int64_t origin;                // element [0, ..., 0] within the backing buffer
  bool overlapping;              // broadcast (stride 0): gather only
};

std::vector<ViewCase> ViewCases() {
  return {
      {{}, {}, 0, false},                      // 0-d
      {{7}, {}, 0, false},                     // contiguous
      {{0, 5}, {5, 1}, 0, false},              // empty
      {{4, 6}, {1, 4}, 0, false},              // a transpose
      {{3, 1, 5}, {10, 99, 2}, 0, false},      // a size-1 dimension with any stride, stride 2
      {{2, 3, 4}, {12, 4, 1}, 0, false},       // contiguous, 3-d: merges to 1-d
      {{2, 3, 4}, {24, 8, 1}, 0, false},       // a slice of the last dimensions
      {{5, 4}, {-4, 1}, 16, false},            // flipped rows
      {{4, 5}, {1, -4}, 16, false},            // a transpose with flipped columns
      {{3, 4}, {0, 1}, 0, true},               // broadcast rows (expand)
      {{2, 2, 3, 2}, {1, 2, 8, 4}, 0, false},  // a permutation of 4 dimensions
  };
}

TEST(DeviceStridedTest, GatherAndScatterEqualPackAndUnpackForEveryElementSizeAndChunking) {
  for (const ViewCase& c : ViewCases()) {
    for (size_t elem : {size_t{1}, size_t{2}, size_t{4}, size_t{8}, size_t{16}, size_t{3}}) {
      const strided::Layout layout = strided::MakeLayout(c.shape, c.strides);
      uint64_t count = 1;
      for (int64_t d : c.shape) count *= static_cast<uint64_t>(d);
      ASSERT_EQ(layout.count, count);
      const size_t backing = 64 * elem;
      const std::vector<uint8_t> raw = RandomBytes(backing, 6 + elem);
      const std::byte* src = reinterpret_cast<const std::byte*>(raw.data()) + c.origin * elem;
      std::vector<std::byte> want(count * elem), got(count * elem);
      PackStrided(src, elem, c.shape, c.strides, want.data());
      // In chunks of 1, 3 and all elements, as the chunked copies do.
      for (uint64_t chunk : {uint64_t{1}, uint64_t{3}, std::max<uint64_t>(count, 1)}) {
        std::fill(got.begin(), got.end(), std::byte{0});
        for (uint64_t first = 0; first < count; first += chunk) {
          const uint64_t n = std::min(chunk, count - first);
          GatherOnHost(src, elem, layout, first, n, got.data() + first * elem);
        }
        ASSERT_EQ(got, want) << "shape " << ShapeString(c.shape) << " elem " << elem << " chunk "
                             << chunk;
      }
      if (c.overlapping) continue;
      std::vector<std::byte> scattered(backing, std::byte{0}), unpacked(backing, std::byte{0});
      UnpackStrided(want.data(), elem, c.shape, c.strides, unpacked.data() + c.origin * elem);
      for (uint64_t first = 0; first < count; first += 2) {
        ScatterOnHost(want.data() + first * elem, elem, layout, first,
                      std::min<uint64_t>(2, count - first), scattered.data() + c.origin * elem);
      }
      EXPECT_EQ(scattered, unpacked) << "shape " << ShapeString(c.shape) << " elem " << elem;
    }
  }
}

TEST(DeviceStridedTest, LayoutsDropUnitDimensionsAndMergeRuns) {
  const strided::Layout contiguous = strided::MakeLayout({2, 3, 4}, {});
  EXPECT_EQ(contiguous.rank, 1);
  EXPECT_EQ(contiguous.shape[0], 24);
  const strided::Layout transposed = strided::MakeLayout({4, 1, 6}, {1, 7, 4});
  EXPECT_EQ(transposed.rank, 2);
  EXPECT_EQ(transposed.strides[0], 1);
  EXPECT_EQ(transposed.strides[1], 4);
  const strided::Layout scalar = strided::MakeLayout({1, 1}, {5, 9});
  EXPECT_EQ(scalar.rank, 0);
  EXPECT_EQ(scalar.count, 1u);
  EXPECT_EQ(strided::ElementOffset(scalar, 0), 0);
  EXPECT_EQ(strided::MakeLayout({3, 0}, {}).count, 0u);
}

// What cuda::Checksum does with a tile grid, on the host: contiguous tiles (1-D blocks, whole
// rows) through the plan in place, tiles of several columns gathered band by band in tile order
// (tile_gather.h, the gathers run through ElementOffset as the pack kernels run them) and each
// hashed whole; against ChecksumTensor with the same grid.
TEST(DeviceTileChecksumTest, GatheredAndContiguousTilesEqualChecksumTensor) {
  struct Case {
    const char* what;
    TileGrid grid;
  };
  const std::vector<Case> cases = {
      {"o_proj-like 8 x 8 tiles (ChooseTiles)",
       ChooseTiles(DType::kBF16, {896, 896}, 896 * 896 * 2, 64 << 10)},
      {"odd: last band and last column shorter, 2-byte elements", {37, 302, 8, 64}},
      {"odd widths: 1-byte elements", {13, 301, 4, 75}},
      {"8-byte elements, one band", {5, 512, 8, 128}},
      {"whole rows (one column)", {100, 256, 7, 4096}},
      {"a single row (1-D blocks)", LinearBlocks(10000, 4096)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const uint64_t n = c.grid.rows * c.grid.row_bytes;
    const std::vector<uint8_t> bytes = RandomBytes(n + 3, 11);
    const uint8_t* data = bytes.data() + 3;  // unaligned: the byte kernel's case
    const TensorChecksums want = ChecksumTensor(data, n, c.grid);
    ASSERT_EQ(want.blocks.size(), c.grid.count());
    std::vector<uint64_t> got;
    const uint64_t contiguous = tile_gather::ContiguousTileBytes(c.grid);
    if (contiguous > 0) {
      got = RunPlanOnHost({data}, {n}, contiguous, 1 << 18)[0].blocks;
    } else {
      for (uint64_t band = 0; band < c.grid.bands(); ++band) {
        std::vector<std::byte> gathered(tile_gather::BandBytes(c.grid, band));
        uint64_t at = 0;
        for (const tile_gather::Gather& g : tile_gather::BandGathers(c.grid, band)) {
          ASSERT_EQ(g.bytes % g.elem, 0u);
          GatherOnHost(reinterpret_cast<const std::byte*>(data) + g.src_offset, g.elem,
                       strided::MakeLayout(g.shape, g.strides), 0, g.bytes / g.elem,
                       gathered.data() + at);
          at += g.bytes;
        }
        ASSERT_EQ(at, gathered.size());
        at = 0;
        for (uint64_t size : tile_gather::GatheredTileBytes(c.grid, band)) {
          got.push_back(
              DeviceCoreHash(reinterpret_cast<const uint8_t*>(gathered.data()) + at, size));
          at += size;
        }
      }
    }
    EXPECT_EQ(got, want.blocks);
  }
}

}  // namespace
}  // namespace weightbus::internal
