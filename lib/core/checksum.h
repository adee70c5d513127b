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

// A tensor's checksums (docs/FORMAT.md): XXH3-64 of all its bytes, and, when block_bytes > 0,
// of each block of block_bytes consecutive bytes of its contiguous row-major image (the last
// block may be shorter), so that a reader of some byte ranges verifies exactly the blocks it
// read.
struct TensorChecksums {
  uint64_t xxh3 = 0;
  uint64_t block_bytes = 0;      // 0: no block checksums
  std::vector<uint64_t> blocks;  // BlockCount(nbytes, block_bytes) entries
};

// Blocks of `nbytes` bytes cut into blocks of `block_bytes` (0 when either is 0).
inline uint64_t BlockCount(uint64_t nbytes, uint64_t block_bytes) {
  return block_bytes == 0 ? 0 : (nbytes + block_bytes - 1) / block_bytes;
}

// Computes TensorChecksums from a tensor's bytes fed in order, in pieces of any size: each
// byte is read once from memory (the block hash and the whole hash both consume it while it is
// in cache). Not thread-safe; movable.
class TensorHasher {
 public:
  TensorHasher(uint64_t nbytes, uint64_t block_bytes);
  void Update(const void* data, size_t n);
  // After all nbytes bytes were fed.
  TensorChecksums Finish();

 private:
  uint64_t block_bytes_;
  uint64_t in_block_ = 0;  // bytes of the current block fed so far
  std::unique_ptr<Xxh3Stream> whole_;
  std::unique_ptr<Xxh3Stream> block_;
  TensorChecksums out_;
};

// TensorChecksums of `n` contiguous bytes at `data`.
TensorChecksums ChecksumTensor(const void* data, uint64_t n, uint64_t block_bytes);

// "avx2" or "sse2": the implementation in use, for benchmark banners.
const char* Xxh3Implementation();

}  // namespace weightbus::internal
