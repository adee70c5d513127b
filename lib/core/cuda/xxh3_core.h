// SPDX-License-Identifier: Apache-2.0
// XXH3-64 (seed 0, the default secret) as __host__ __device__ code, split so that a GPU computes
// exactly the value libxxhash's XXH3_64bits computes on the host, in parallel
// (docs/FORMAT.md, "Checksums of device memory"). Ported from xxHash 0.8
// (https://github.com/Cyan4973/xxHash, xxhash.h: XXH3_len_*_64b, XXH3_accumulate_512_scalar,
// XXH3_scrambleAcc_scalar, XXH3_hashLong_internal_loop, XXH3_mergeAccs); XXH3's output is
// frozen since 0.8.0.
//
// Inputs of at most 240 bytes are hashed by one thread (Short). Longer inputs run XXH3's long
// loop: 8 independent 64-bit lanes, fed 1024-byte blocks (16 stripes of 64 bytes) and
// scrambled after each full block. Within a block a lane only adds (mod 2^64) one term per
// stripe, so the block's contribution to each lane (BlockLaneSum) does not depend on the lanes'
// state: every block of an input is summed in parallel, and the state runs through the blocks
// as a short sequential chain per lane (ChainStep: add the block's sum, scramble). FinishLong
// adds the last, partial block and the last stripe and merges the lanes. Hash() composes the
// three the way the kernels do; tests/device_kernels_test.cc checks it against XXH3_64bits.
//
// Every function reads the 192-byte secret through a pointer (`secret`): the host passes
// kSecret, a kernel its copy in shared memory. Data may have any alignment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/cuda/hd.h"

namespace weightbus::internal::xxh3 {

inline constexpr uint64_t kStripeLen = 64;
inline constexpr uint64_t kBlockLen = 1024;  // 16 stripes: the bytes between two scrambles
inline constexpr uint64_t kSecretSize = 192;
inline constexpr uint64_t kMidsizeMax = 240;  // longer inputs take the long loop
inline constexpr int kLanes = 8;

// XXH3_kSecret (xxhash.h), for host code and for copying to the device. Device code never names
// it: kernels pass their own copy.
inline constexpr uint8_t kSecret[kSecretSize] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

inline constexpr uint32_t kPrime32_1 = 0x9E3779B1U;
inline constexpr uint32_t kPrime32_2 = 0x85EBCA77U;
inline constexpr uint32_t kPrime32_3 = 0xC2B2AE3DU;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;

// Little-endian loads at any alignment (x86-64 and NVIDIA GPUs are little-endian). A device
// reads aligned words with one load and falls back to narrower ones.
WB_HD uint64_t Read64(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if ((a & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  if ((a & 3) == 0) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
    return static_cast<uint64_t>(w[0]) | (static_cast<uint64_t>(w[1]) << 32);
  }
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
#else
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

WB_HD uint32_t Read32(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
#else
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

WB_HD uint64_t Swap64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  const uint32_t lo = __byte_perm(static_cast<uint32_t>(x), 0, 0x0123);
  const uint32_t hi = __byte_perm(static_cast<uint32_t>(x >> 32), 0, 0x0123);
  return (static_cast<uint64_t>(lo) << 32) | hi;
#else
  return __builtin_bswap64(x);
#endif
}

WB_HD uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// The 128-bit product of a and b, its halves XORed (XXH3_mul128_fold64).
WB_HD uint64_t Mul128Fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  __extension__ using U128 = unsigned __int128;
  const U128 p = static_cast<U128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

WB_HD uint64_t Xxh64Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  h ^= h >> 32;
  return h;
}

WB_HD uint64_t Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  h ^= h >> 32;
  return h;
}

WB_HD uint64_t Rrmxmx(uint64_t h, uint64_t len) {
  h ^= Rotl64(h, 49) ^ Rotl64(h, 24);
  h *= 0x9FB21C651E98DF25ULL;
  h ^= (h >> 35) + len;
  h *= 0x9FB21C651E98DF25ULL;
  return h ^ (h >> 28);
}

WB_HD uint64_t Mix16B(const uint8_t* in, const uint8_t* secret) {
  return Mul128Fold64(Read64(in) ^ Read64(secret), Read64(in + 8) ^ Read64(secret + 8));
}

// XXH3-64 of `len` <= 240 bytes (XXH3_len_0to16_64b, _17to128_64b, _129to240_64b, seed 0).
WB_HD uint64_t Short(const uint8_t* in, uint64_t len, const uint8_t* secret) {
  if (len <= 16) {
    if (len > 8) {
      const uint64_t lo = Read64(in) ^ (Read64(secret + 24) ^ Read64(secret + 32));
      const uint64_t hi = Read64(in + len - 8) ^ (Read64(secret + 40) ^ Read64(secret + 48));
      return Avalanche(len + Swap64(lo) + hi + Mul128Fold64(lo, hi));
    }
    if (len >= 4) {
      const uint32_t in1 = Read32(in), in2 = Read32(in + len - 4);
      const uint64_t bitflip = Read64(secret + 8) ^ Read64(secret + 16);
      const uint64_t in64 = in2 + (static_cast<uint64_t>(in1) << 32);
      return Rrmxmx(in64 ^ bitflip, len);
    }
    if (len > 0) {
      const uint32_t c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
      const uint32_t combined = (c1 << 16) | (c2 << 24) | c3 | (static_cast<uint32_t>(len) << 8);
      const uint64_t bitflip = Read32(secret) ^ Read32(secret + 4);
      return Xxh64Avalanche(static_cast<uint64_t>(combined) ^ bitflip);
    }
    return Xxh64Avalanche(Read64(secret + 56) ^ Read64(secret + 64));
  }
  uint64_t acc = len * kPrime64_1;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) {
          acc += Mix16B(in + 48, secret + 96);
          acc += Mix16B(in + len - 64, secret + 112);
        }
        acc += Mix16B(in + 32, secret + 64);
        acc += Mix16B(in + len - 48, secret + 80);
      }
      acc += Mix16B(in + 16, secret + 32);
      acc += Mix16B(in + len - 32, secret + 48);
    }
    acc += Mix16B(in, secret);
    acc += Mix16B(in + len - 16, secret + 16);
    return Avalanche(acc);
  }
  const int rounds = static_cast<int>(len / 16);
  for (int i = 0; i < 8; ++i) acc += Mix16B(in + 16 * i, secret + 16 * i);
  acc = Avalanche(acc);
  for (int i = 8; i < rounds; ++i) acc += Mix16B(in + 16 * i, secret + 16 * (i - 8) + 3);
  acc += Mix16B(in + len - 16, secret + 136 - 17);
  return Avalanche(acc);
}

// Lane `lane`'s initial state (XXH3_INIT_ACC).
WB_HD uint64_t InitLane(int lane) {
  switch (lane) {
    case 0:
      return kPrime32_3;
    case 1:
      return kPrime64_1;
    case 2:
      return kPrime64_2;
    case 3:
      return kPrime64_3;
    case 4:
      return kPrime64_4;
    case 5:
      return kPrime32_2;
    case 6:
      return kPrime64_5;
    default:
      return kPrime32_1;
  }
}

// What one stripe (64 bytes at `stripe`, keyed with the secret at `key`) adds to lane `lane`:
// the data word of the neighbouring lane (XXH3 swaps adjacent lanes) plus the 32x32-bit product
// of the halves of this lane's keyed word (XXH3_accumulate_512_scalar, one lane).
WB_HD uint64_t StripeLaneTerm(const uint8_t* stripe, const uint8_t* key, int lane) {
  const uint64_t own = Read64(stripe + 8 * lane);
  const uint64_t neighbour = Read64(stripe + 8 * (lane ^ 1));
  const uint64_t keyed = own ^ Read64(key + 8 * lane);
  return neighbour + (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
}

// The sum (mod 2^64) of what the 16 stripes of the full 1024-byte block at `block` add to lane
// `lane`: independent of the state, so every block of an input is summed in parallel.
WB_HD uint64_t BlockLaneSum(const uint8_t* block, const uint8_t* secret, int lane) {
  uint64_t sum = 0;
  for (int s = 0; s < 16; ++s) sum += StripeLaneTerm(block + kStripeLen * s, secret + 8 * s, lane);
  return sum;
}

// Lane `lane`'s scramble key: its word of the last 64 bytes of the secret.
WB_HD uint64_t ScrambleKey(const uint8_t* secret, int lane) {
  return Read64(secret + kSecretSize - kStripeLen + 8 * lane);
}

// One lane's state after a full block: the block's sum added, then XXH3's scramble with the
// lane's key (ScrambleKey).
WB_HD uint64_t ChainStepKey(uint64_t acc, uint64_t block_sum, uint64_t key) {
  acc += block_sum;
  acc ^= acc >> 47;
  acc ^= key;
  return acc * kPrime32_1;
}

WB_HD uint64_t ChainStep(uint64_t acc, uint64_t block_sum, const uint8_t* secret, int lane) {
  return ChainStepKey(acc, block_sum, ScrambleKey(secret, lane));
}

// Full blocks a long input (len > 240) runs through ChainStep before FinishLong: XXH3's
// nb_blocks, (len - 1) / 1024 (the last byte always falls in the final, partial step).
WB_HD uint64_t ChainBlocks(uint64_t len) { return len > kMidsizeMax ? (len - 1) / kBlockLen : 0; }

// XXH3-64 of a long input (len > 240) from its lanes after ChainBlocks(len) chain steps:
// the stripes of the last, partial block, the input's last stripe, and the merge.
WB_HD uint64_t FinishLong(const uint64_t acc_in[kLanes], const uint8_t* in, uint64_t len,
                          const uint8_t* secret) {
  uint64_t acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = acc_in[l];
  const uint64_t done = ChainBlocks(len) * kBlockLen;
  const uint64_t stripes = ((len - 1) - done) / kStripeLen;
  for (uint64_t s = 0; s < stripes; ++s) {
    for (int l = 0; l < kLanes; ++l) {
      acc[l] += StripeLaneTerm(in + done + kStripeLen * s, secret + 8 * s, l);
    }
  }
  const uint8_t* last = in + len - kStripeLen;
  for (int l = 0; l < kLanes; ++l) {
    acc[l] += StripeLaneTerm(last, secret + kSecretSize - kStripeLen - 7, l);
  }
  uint64_t result = len * kPrime64_1;
  const uint8_t* merge = secret + 11;
  for (int i = 0; i < 4; ++i) {
    result += Mul128Fold64(acc[2 * i] ^ Read64(merge + 16 * i),
                           acc[2 * i + 1] ^ Read64(merge + 16 * i + 8));
  }
  return Avalanche(result);
}

// XXH3-64 of `len` bytes, composed as the kernels compose it (one thread; for the host tests and
// for tiny inputs).
WB_HD uint64_t Hash(const uint8_t* in, uint64_t len, const uint8_t* secret) {
  if (len <= kMidsizeMax) return Short(in, len, secret);
  uint64_t acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = InitLane(l);
  const uint64_t blocks = ChainBlocks(len);
  for (uint64_t b = 0; b < blocks; ++b) {
    for (int l = 0; l < kLanes; ++l) {
      acc[l] = ChainStep(acc[l], BlockLaneSum(in + kBlockLen * b, secret, l), secret, l);
    }
  }
  return FinishLong(acc, in, len, secret);
}

}  // namespace weightbus::internal::xxh3
