// SPDX-License-Identifier: Apache-2.0
// How the device computes a batch of tensors' checksums (docs/FORMAT.md, "Checksums of device
// memory"), as host code that both the CUDA driver (core/cuda/device.cc) and the host tests
// (tests/device_kernels_test.cc) run, so that the planning, the windows and the sharing of block
// sums are tested without a GPU.
//
// Every checksum is a Segment: a tensor's whole bytes, or one of its blocks. The 1024-byte XXH3
// blocks a segment chains through (xxh3::ChainBlocks) are summed once into a `sums` array
// (8 lanes each), from SumRanges: one per tensor, whose sums the tensor's block segments share
// when the block size is a multiple of 1024 (each block then starts on an XXH3 block of the
// tensor), else one more per block. The kernels then run, window by window of at most
// `window` sums (bounded device scratch): BlockSums (one thread per sum and lane), Chain (one
// thread per segment and lane, through the segment's sums in the window), and after the last
// window Finish (one thread per segment).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/cuda/xxh3_core.h"

namespace weightbus::internal::device_hash {

// `blocks` consecutive 1024-byte XXH3 blocks at `data`, whose lane sums go to sums
// [first, first + blocks) (times 8 lanes).
struct SumRange {
  const uint8_t* data;
  uint64_t blocks;
  uint64_t first;
};

// One checksum: XXH3-64 of `len` bytes at `data`; its ChainBlocks(len) block sums are at
// [first_sum, first_sum + ChainBlocks(len)).
struct Segment {
  const uint8_t* data;
  uint64_t len;
  uint64_t first_sum;
};

struct Plan {
  std::vector<SumRange> ranges;  // non-empty ranges, by `first`
  std::vector<Segment> segments;
  uint64_t sums = 0;  // block sums in all
  // Per tensor: the segment of its whole checksum, and of its first block checksum (the others
  // follow in order), with how many there are.
  std::vector<size_t> whole;
  std::vector<size_t> first_block;
  std::vector<uint64_t> blocks;
};

// The plan for tensors (data[i], len[i]) with blocks of `block_bytes` (0: whole checksums only).
inline Plan MakePlan(const std::vector<const uint8_t*>& data, const std::vector<uint64_t>& len,
                     uint64_t block_bytes) {
  Plan p;
  const bool shared = block_bytes > 0 && block_bytes % xxh3::kBlockLen == 0;
  auto add_range = [&p](const uint8_t* d, uint64_t blocks) {
    const uint64_t first = p.sums;
    if (blocks > 0) p.ranges.push_back(SumRange{d, blocks, first});
    p.sums += blocks;
    return first;
  };
  for (size_t i = 0; i < data.size(); ++i) {
    const uint64_t n = len[i];
    const uint64_t base = add_range(data[i], xxh3::ChainBlocks(n));
    p.whole.push_back(p.segments.size());
    p.segments.push_back(Segment{data[i], n, base});
    const uint64_t count = block_bytes == 0 ? 0 : (n + block_bytes - 1) / block_bytes;
    p.first_block.push_back(p.segments.size());
    p.blocks.push_back(count);
    for (uint64_t b = 0; b < count; ++b) {
      const uint64_t at = b * block_bytes;
      const uint64_t size = n - at < block_bytes ? n - at : block_bytes;
      const uint64_t first =
          shared ? base + at / xxh3::kBlockLen : add_range(data[i] + at, xxh3::ChainBlocks(size));
      p.segments.push_back(Segment{data[i] + at, size, first});
    }
  }
  return p;
}

// The range holding sum `g` (ranges sorted by `first`, g inside one of them).
WB_HD size_t FindRange(const SumRange* ranges, size_t count, uint64_t g) {
  size_t lo = 0, hi = count;  // the last range with first <= g
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (ranges[mid].first <= g) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The kernels' work for thread (sum g, lane): lane `lane` of the sum of XXH3 block g.
WB_HD uint64_t SumOf(const SumRange* ranges, size_t count, uint64_t g, const uint8_t* secret,
                     int lane) {
  const SumRange& r = ranges[FindRange(ranges, count, g)];
  return xxh3::BlockLaneSum(r.data + (g - r.first) * xxh3::kBlockLen, secret, lane);
}

// Sums a chain loads ahead of the step that uses them: a GPU thread issues loads in order and
// stalls at the first use of one, so the chain loads a batch while it scrambles the previous
// one (about 30 cycles a step), instead of waiting a memory latency per step.
inline constexpr int kChainBatch = 32;

// The chain of (segment, lane) through the sums of window [begin, end): `window_sums` holds
// sum g's lane l at ((g - begin) * 8 + l).
WB_HD uint64_t ChainWindow(const Segment& s, uint64_t acc, const uint64_t* window_sums,
                           uint64_t begin, uint64_t end, const uint8_t* secret, int lane) {
  const uint64_t first = s.first_sum, last = s.first_sum + xxh3::ChainBlocks(s.len);
  const uint64_t lo = first > begin ? first : begin, hi = last < end ? last : end;
  if (lo >= hi) return acc;
  const uint64_t key = xxh3::ScrambleKey(secret, lane);
  const uint64_t* sums = window_sums + (lo - begin) * xxh3::kLanes + lane;
  const uint64_t n = hi - lo;
  uint64_t ready[kChainBatch], next[kChainBatch];
  const uint64_t batches = n / kChainBatch;
  if (batches > 0) {
    WB_UNROLL
    for (int k = 0; k < kChainBatch; ++k) ready[k] = sums[k * xxh3::kLanes];
  }
  for (uint64_t b = 0; b < batches; ++b) {
    const bool more = b + 1 < batches;
    if (more) {
      const uint64_t* at = sums + (b + 1) * kChainBatch * xxh3::kLanes;
      WB_UNROLL
      for (int k = 0; k < kChainBatch; ++k) next[k] = at[k * xxh3::kLanes];
    }
    WB_UNROLL
    for (int k = 0; k < kChainBatch; ++k) acc = xxh3::ChainStepKey(acc, ready[k], key);
    if (more) {
      WB_UNROLL
      for (int k = 0; k < kChainBatch; ++k) ready[k] = next[k];
    }
  }
  for (uint64_t g = batches * kChainBatch; g < n; ++g) {
    acc = xxh3::ChainStepKey(acc, sums[g * xxh3::kLanes], key);
  }
  return acc;
}

// A segment's checksum from its lanes after every window.
WB_HD uint64_t FinishSegment(const Segment& s, const uint64_t* lanes, const uint8_t* secret) {
  if (s.len <= xxh3::kMidsizeMax) return xxh3::Short(s.data, s.len, secret);
  return xxh3::FinishLong(lanes, s.data, s.len, secret);
}

}  // namespace weightbus::internal::device_hash
