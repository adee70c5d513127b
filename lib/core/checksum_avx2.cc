// SPDX-License-Identifier: Apache-2.0
// XXH3 compiled for AVX2 (this file only is built with -mavx2); used when the CPU has AVX2.
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

namespace weightbus::internal::xxh3_avx2 {
#include "core/checksum_impl.inc"
}  // namespace weightbus::internal::xxh3_avx2
