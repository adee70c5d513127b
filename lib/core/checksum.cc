// SPDX-License-Identifier: Apache-2.0
#include "core/checksum.h"

#include <algorithm>
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

TensorHasher::TensorHasher(uint64_t nbytes, uint64_t block_bytes)
    : block_bytes_(block_bytes), whole_(std::make_unique<Xxh3Stream>()) {
  out_.block_bytes = block_bytes;
  out_.blocks.reserve(BlockCount(nbytes, block_bytes));
  if (block_bytes_ > 0) block_ = std::make_unique<Xxh3Stream>();
}

void TensorHasher::Update(const void* data, size_t n) {
  const auto* p = static_cast<const std::byte*>(data);
  if (block_bytes_ == 0) {
    whole_->Update(p, n);
    return;
  }
  // Pieces of at most 64 KiB, so the block hash reads from L2 what the whole hash just read.
  constexpr size_t kPiece = 64 * 1024;
  while (n > 0) {
    const size_t len = std::min({n, kPiece, static_cast<size_t>(block_bytes_ - in_block_)});
    whole_->Update(p, len);
    block_->Update(p, len);
    in_block_ += len;
    p += len;
    n -= len;
    if (in_block_ == block_bytes_) {
      out_.blocks.push_back(block_->Digest());
      block_->Reset();
      in_block_ = 0;
    }
  }
}

TensorChecksums TensorHasher::Finish() {
  if (block_bytes_ > 0 && in_block_ > 0) out_.blocks.push_back(block_->Digest());
  out_.xxh3 = whole_->Digest();
  return std::move(out_);
}

TensorChecksums ChecksumTensor(const void* data, uint64_t n, uint64_t block_bytes) {
  if (block_bytes == 0 || n == 0) {
    return TensorChecksums{Xxh3(data, n), block_bytes, {}};
  }
  TensorHasher h(n, block_bytes);
  h.Update(data, n);
  return h.Finish();
}

}  // namespace weightbus::internal
