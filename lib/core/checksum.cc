// SPDX-License-Identifier: Apache-2.0
#include "core/checksum.h"

#include <algorithm>
#include <cstring>
#include <new>

// Headers xxhash.h includes, included here first so that none lands inside the namespace.
#include <assert.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace weightbus::internal {

namespace xxh3_base {
#include "core/checksum_impl.inc"
}  // namespace xxh3_base

#ifdef WEIGHTBUS_HAVE_AVX2_XXH3
namespace xxh3_avx2 {
uint64_t Hash(const void* data, size_t n);
void* NewState();
void ResetState(void* s);
void FreeState(void* s);
void Update(void* s, const void* data, size_t n);
uint64_t Digest(const void* s);
}  // namespace xxh3_avx2
#endif

namespace {

struct Impl {
  uint64_t (*hash)(const void*, size_t);
  void* (*new_state)();
  void (*reset_state)(void*);
  void (*free_state)(void*);
  void (*update)(void*, const void*, size_t);
  uint64_t (*digest)(const void*);
  const char* name;
};

const Impl& Chosen() {
  static const Impl impl = [] {
#ifdef WEIGHTBUS_HAVE_AVX2_XXH3
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
      return Impl{xxh3_avx2::Hash,
                  xxh3_avx2::NewState,
                  xxh3_avx2::ResetState,
                  xxh3_avx2::FreeState,
                  xxh3_avx2::Update,
                  xxh3_avx2::Digest,
                  "avx2"};
    }
#endif
    return Impl{xxh3_base::Hash,
                xxh3_base::NewState,
                xxh3_base::ResetState,
                xxh3_base::FreeState,
                xxh3_base::Update,
                xxh3_base::Digest,
                "sse2"};
  }();
  return impl;
}

}  // namespace

uint64_t Xxh3(const void* data, size_t n) { return Chosen().hash(data, n); }

Xxh3Stream::Xxh3Stream() : state_(Chosen().new_state()) {
  if (state_ == nullptr) throw std::bad_alloc();
}

Xxh3Stream::~Xxh3Stream() { Chosen().free_state(state_); }

void Xxh3Stream::Update(const void* data, size_t n) { Chosen().update(state_, data, n); }

void Xxh3Stream::Reset() { Chosen().reset_state(state_); }

uint64_t Xxh3Stream::Digest() const { return Chosen().digest(state_); }

const char* Xxh3Implementation() { return Chosen().name; }

namespace {

// Segments narrower than this are gathered before they are hashed: XXH3's streaming update
// costs about as much per call as hashing 256 bytes, so a tile of 224-byte rows hashed segment
// by segment runs at about half the speed of one gathered (docs/FORMAT.md, "Block checksums").
constexpr size_t kNarrow = 4096;
constexpr size_t kGather = 16384;

}  // namespace

uint64_t Xxh3Strided(const void* first, uint64_t rows, uint64_t width, uint64_t stride) {
  const auto* p = static_cast<const std::byte*>(first);
  if (rows <= 1 || width == stride) return Xxh3(p, rows * width);
  Xxh3Stream stream;
  if (width >= kNarrow) {
    for (uint64_t r = 0; r < rows; ++r) stream.Update(p + r * stride, width);
    return stream.Digest();
  }
  std::byte buffer[kGather];
  size_t fill = 0;
  for (uint64_t r = 0; r < rows; ++r) {
    if (fill + width > kGather) {
      stream.Update(buffer, fill);
      fill = 0;
    }
    std::memcpy(buffer + fill, p + r * stride, width);
    fill += width;
  }
  stream.Update(buffer, fill);
  return stream.Digest();
}

TileGrid LinearBlocks(uint64_t nbytes, uint64_t block_bytes) {
  TileGrid g;
  g.rows = nbytes > 0 ? 1 : 0;
  g.row_bytes = nbytes;
  if (block_bytes > 0) {
    g.tile_rows = 1;
    g.tile_bytes = block_bytes;
  }
  return g;
}

TensorHasher::TensorHasher(uint64_t nbytes, const TileGrid& grid)
    : grid_(grid), whole_(std::make_unique<Xxh3Stream>()) {
  out_.grid = grid;
  if (!grid_.has_tiles() || nbytes == 0) return;
  out_.blocks.reserve(grid_.count());
  // One column at a time is open when tiles are one row high; else every column of a band.
  const uint64_t slots = grid_.tile_rows == 1 ? 1 : grid_.columns();
  for (uint64_t c = 0; c < slots; ++c) streams_.push_back(std::make_unique<Xxh3Stream>());
  if (grid_.tile_bytes < kNarrow) {
    gather_.resize(slots);
    for (std::vector<std::byte>& g : gather_) g.reserve(kGather);
  }
}

void TensorHasher::Feed(uint64_t column, const std::byte* p, size_t n) {
  const uint64_t slot = grid_.tile_rows == 1 ? 0 : column;
  if (gather_.empty()) {
    streams_[slot]->Update(p, n);
    return;
  }
  std::vector<std::byte>& g = gather_[slot];
  if (g.size() + n > kGather) Flush(column);
  if (n >= kGather) {
    streams_[slot]->Update(p, n);
  } else {
    g.insert(g.end(), p, p + n);
  }
}

void TensorHasher::Flush(uint64_t column) {
  const uint64_t slot = grid_.tile_rows == 1 ? 0 : column;
  if (gather_.empty() || gather_[slot].empty()) return;
  streams_[slot]->Update(gather_[slot].data(), gather_[slot].size());
  gather_[slot].clear();
}

void TensorHasher::Update(const void* data, size_t n) {
  const auto* p = static_cast<const std::byte*>(data);
  if (streams_.empty()) {
    whole_->Update(p, n);
    return;
  }
  // Pieces of at most 64 KiB, so the tiles' hashes read from L2 what the whole hash just read.
  constexpr size_t kPiece = 64 * 1024;
  while (n > 0) {
    const size_t piece = std::min(n, kPiece);
    whole_->Update(p, piece);
    Walk(p, piece);
    p += piece;
    n -= piece;
  }
}

void TensorHasher::Walk(const std::byte* p, size_t n) {
  while (n > 0) {
    const uint64_t column = at_ / grid_.tile_bytes;
    const uint64_t column_end = std::min(grid_.row_bytes, (column + 1) * grid_.tile_bytes);
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, column_end - at_));
    Feed(column, p, take);
    p += take;
    n -= take;
    at_ += take;
    if (at_ < column_end) continue;
    // The column's segment of this row is complete; on the band's last row, so is its tile.
    const bool last_row = (row_ + 1) % grid_.tile_rows == 0 || row_ + 1 == grid_.rows;
    if (last_row) {
      Flush(column);
      const uint64_t slot = grid_.tile_rows == 1 ? 0 : column;
      out_.blocks.push_back(streams_[slot]->Digest());
      streams_[slot]->Reset();
    }
    if (at_ == grid_.row_bytes) {
      at_ = 0;
      ++row_;
    }
  }
}

TensorChecksums TensorHasher::Finish() {
  out_.xxh3 = whole_->Digest();
  return std::move(out_);
}

TensorChecksums ChecksumTensor(const void* data, uint64_t n, const TileGrid& grid) {
  if (!grid.has_tiles() || n == 0) return TensorChecksums{Xxh3(data, n), grid, {}};
  TensorHasher h(n, grid);
  h.Update(data, n);
  return h.Finish();
}

}  // namespace weightbus::internal
