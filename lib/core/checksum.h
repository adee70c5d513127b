// SPDX-License-Identifier: Apache-2.0
// XXH3-64 (seed 0), the checksum of every tensor (docs/FORMAT.md), computed with the widest
// vector unit the CPU has: libxxhash is built for baseline x86-64 (SSE2), and AVX2 hashes about
// twice as fast, which matters where checksums overlap copies and transfers. Results are
// identical whichever implementation runs (XXH3 is defined independently of vector width).
#pragma once

#include <cstddef>
#include <cstdint>

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

 private:
  void* state_;  // XXH3_state_t of the implementation chosen at startup
};

// "avx2" or "sse2": the implementation in use, for benchmark banners.
const char* Xxh3Implementation();

}  // namespace weightbus::internal
