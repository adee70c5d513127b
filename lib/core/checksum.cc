// SPDX-License-Identifier: Apache-2.0
#include "core/checksum.h"

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
void FreeState(void* s);
void Update(void* s, const void* data, size_t n);
uint64_t Digest(const void* s);
}  // namespace xxh3_avx2
#endif

namespace {

struct Impl {
  uint64_t (*hash)(const void*, size_t);
  void* (*new_state)();
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
      return Impl{xxh3_avx2::Hash,   xxh3_avx2::NewState, xxh3_avx2::FreeState,
                  xxh3_avx2::Update, xxh3_avx2::Digest,   "avx2"};
    }
#endif
    return Impl{xxh3_base::Hash,   xxh3_base::NewState, xxh3_base::FreeState,
                xxh3_base::Update, xxh3_base::Digest,   "sse2"};
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

uint64_t Xxh3Stream::Digest() const { return Chosen().digest(state_); }

const char* Xxh3Implementation() { return Chosen().name; }

}  // namespace weightbus::internal
