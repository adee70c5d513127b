// SPDX-License-Identifier: Apache-2.0
// The delta codec (codec.h; format in docs/FORMAT.md). Hot loops are plain C++ written so that
// the compiler vectorizes them (this file is built with -O3); zstd runs through reusable
// per-thread contexts.
#include "delta/codec.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/bytes.h"
#include "core/checksum.h"
#include "core/status.h"
#include "delta/range_coder.h"
#include "delta/rans_coder.h"
#include "zstd.h"

namespace weightbus::internal::delta {
namespace {

// The sparse form is always encoded; the XOR form too once more than 1/kXorMinDivisor of the
// elements changed, and the smaller is kept. (On the measured training streams the sparse form
// was smaller in every chunk, by 1.1x to 1.9x, even with every element changed: BENCHMARKS.md,
// "method choice". XOR wins on data whose differences are not small, such as random bytes.)
constexpr uint64_t kXorMinDivisor = 4;
// The modeled method codes a chunk only when at most 1/kModeledMaxDivisor of its elements
// changed: it costs about 100 ns per change to encode and as much to decode, which on denser
// chunks (14% changed: 10 s per 256 MiB version on 2 cores) costs far more time than the bytes
// it saves over sparse (BENCHMARKS.md, issue 16).
constexpr uint64_t kModeledMaxDivisor = 8;
// Streams shorter than this are stored: a zstd frame costs more than it could save.
constexpr size_t kMinZstdBytes = 32;
// zstd_level value for the codec's own zstd configuration (see Scratch::Compressor).
constexpr int kEntropyLevel = 0;

enum class StreamMode : uint8_t { kConstant = 0, kStored = 1, kZstd = 2 };

bool IsFloat(DType d) {
  switch (d) {
    case DType::kF16:
    case DType::kBF16:
    case DType::kF32:
    case DType::kF64:
      return true;
    case DType::kBool:
    case DType::kU8:
    case DType::kI8:
    case DType::kU16:
    case DType::kI16:
    case DType::kU32:
    case DType::kI32:
    case DType::kU64:
    case DType::kI64:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kF8E8M0:
    case DType::kF8E4M3FNUZ:
    case DType::kF8E5M2FNUZ:
    case DType::kC64:  // two F32: coded as 8-byte integers, bit-exact all the same
    case DType::kF4:   // sub-byte: coded as bytes
    case DType::kF6E2M3:
    case DType::kF6E3M2:
      return false;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Per-thread scratch: zstd contexts and buffers reused across chunks.

struct Scratch {
  ZSTD_CCtx* cctx = nullptr;
  ZSTD_DCtx* dctx = nullptr;
  int cctx_level = std::numeric_limits<int>::min();
  std::vector<uint8_t> planes[8];  // encoder planes / decoder stream buffers
  std::vector<uint8_t> gap_planes[4];
  std::vector<uint8_t> zbuf;        // compressed output
  std::vector<uint32_t> positions;  // sparse: changed element indices
  std::vector<uint8_t> values;      // sparse: zigzag differences, element-sized
  std::vector<uint8_t> groups;      // sparse: group of each change
  std::vector<uint32_t> ranks;      // sparse: rank of each change within its group
  std::vector<uint32_t> sorted_ranks;
  std::vector<uint8_t> sorted_values;
  std::vector<uint8_t> value_planes[4][8];  // sparse decoding: value streams per group
  std::vector<uint8_t> block_at_least[3];   // grouped sparse: class counts per 64-byte block
  std::vector<uint8_t> block_len;
  std::vector<std::byte*> targets;     // grouped sparse decoding: where each change goes
  std::vector<uint8_t> target_values;  // and what is added there
  std::vector<std::byte> record;       // candidate records
  std::vector<std::byte> record2;
  std::vector<std::byte> record3;
  RansEncoder rans;  // modeled-rans records
  BitWriter bits;

  ~Scratch() {
    ZSTD_freeCCtx(cctx);
    ZSTD_freeDCtx(dctx);
  }
  ZSTD_CCtx* Compressor(int level) {
    if (cctx == nullptr) cctx = ZSTD_createCCtx();
    if (level != cctx_level) {
      ZSTD_CCtx_reset(cctx, ZSTD_reset_parameters);
      ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 0);
      ZSTD_CCtx_setParameter(cctx, ZSTD_c_dictIDFlag, 0);
      ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
      if (level == kEntropyLevel) {
        // Byte planes of weights are entropy-bound: repeats are short and accidental, and
        // coding them as matches costs more than the Huffman-coded literals they replace. The
        // fastest strategy with the longest minimum match and a tiny hash table finds only long
        // runs (such as the zero runs of a sparse plane). Measured in BENCHMARKS.md.
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, 1);
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_strategy, ZSTD_fast);
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_minMatch, 7);
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_hashLog, 6);
      } else {
        ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level);
      }
      cctx_level = level;
    }
    return cctx;
  }
  ZSTD_DCtx* Decompressor() {
    if (dctx == nullptr) dctx = ZSTD_createDCtx();
    return dctx;
  }
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

template <typename V>
void Grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// ---------------------------------------------------------------------------------------------
// Streams: one byte plane, stored as a constant, verbatim, or as one zstd frame.

bool IsConstant(const uint8_t* data, size_t n) {
  if (n == 0) return true;
  const uint8_t first = data[0];
  size_t i = 0;
  if (n >= 64) {
    uint64_t pattern = 0x0101010101010101ULL * first;
    for (; i + 32 <= n; i += 32) {
      uint64_t w[4];
      std::memcpy(w, data + i, 32);
      if (((w[0] ^ pattern) | (w[1] ^ pattern) | (w[2] ^ pattern) | (w[3] ^ pattern)) != 0) {
        return false;
      }
    }
  }
  for (; i < n; ++i) {
    if (data[i] != first) return false;
  }
  return true;
}

// True when a sample of a long stream has a byte entropy so close to 8 bits that no entropy
// coder could save more than about 1% (such as the sign-and-mantissa plane of weights): zstd is
// then not even tried.
bool LooksIncompressible(const uint8_t* data, size_t n) {
  constexpr size_t kPieces = 8, kPiece = 2048;
  if (n < 64 * kPiece) return false;
  uint32_t hist[256] = {};
  for (size_t k = 0; k < kPieces; ++k) {
    const uint8_t* p = data + (n - kPiece) / (kPieces - 1) * k;
    for (size_t i = 0; i < kPiece; ++i) ++hist[p[i]];
  }
  double bits = 0;
  constexpr double kTotal = kPieces * kPiece;
  for (uint32_t h : hist) {
    if (h > 0) bits -= h * std::log2(h / kTotal);
  }
  return bits / kTotal > 7.9;
}

void PutStream(const uint8_t* data, size_t n, int level, Scratch& s, std::vector<std::byte>* out) {
  if (n == 0) return;
  if (IsConstant(data, n)) {
    ByteVectorWriter(out).U8(static_cast<uint8_t>(StreamMode::kConstant)).U8(data[0]);
    return;
  }
  if (n >= kMinZstdBytes && !LooksIncompressible(data, n)) {
    const size_t bound = ZSTD_compressBound(n);
    Grow(s.zbuf, bound);
    const size_t c = ZSTD_compress2(s.Compressor(level), s.zbuf.data(), bound, data, n);
    if (!ZSTD_isError(c) && c + VarintSize(c) < n) {
      ByteVectorWriter(out)
          .U8(static_cast<uint8_t>(StreamMode::kZstd))
          .Varint(c)
          .Bytes(s.zbuf.data(), c);
      return;
    }
  }
  ByteVectorWriter(out).U8(static_cast<uint8_t>(StreamMode::kStored)).Bytes(data, n);
}

// Reads a stream of `n` bytes; returns where its bytes are (inside the record when stored, else
// in `buffer`).
absl::StatusOr<const uint8_t*> GetStream(ByteReader& r, size_t n, std::vector<uint8_t>& buffer,
                                         Scratch& s, std::string_view what) {
  if (n == 0) return reinterpret_cast<const uint8_t*>(r.position());
  WB_ASSIGN_OR_RETURN(uint8_t mode, r.U8(what));
  switch (mode) {
    case static_cast<uint8_t>(StreamMode::kConstant): {
      WB_ASSIGN_OR_RETURN(uint8_t value, r.U8(what));
      Grow(buffer, n);
      std::memset(buffer.data(), value, n);
      return buffer.data();
    }
    case static_cast<uint8_t>(StreamMode::kStored): {
      WB_ASSIGN_OR_RETURN(const std::byte* at, r.Bytes(n, what));
      return reinterpret_cast<const uint8_t*>(at);
    }
    case static_cast<uint8_t>(StreamMode::kZstd): {
      WB_ASSIGN_OR_RETURN(uint64_t c, r.Varint(what));
      WB_ASSIGN_OR_RETURN(const std::byte* at, r.Bytes(c, what));
      const size_t frame = ZSTD_findFrameCompressedSize(at, c);
      if (ZSTD_isError(frame) || frame != c) {
        return absl::DataLossError(
            absl::StrFormat("%s: %d bytes are not one zstd frame (%s)", what, c,
                            ZSTD_isError(frame) ? ZSTD_getErrorName(frame) : "trailing bytes"));
      }
      const unsigned long long content = ZSTD_getFrameContentSize(at, c);
      if (content != n) {
        return absl::DataLossError(absl::StrFormat(
            "%s: zstd frame holds %s bytes, expected %d", what,
            content == ZSTD_CONTENTSIZE_UNKNOWN ? std::string("an unknown number of")
                                                : std::to_string(content),
            n));
      }
      Grow(buffer, n);
      const size_t d = ZSTD_decompressDCtx(s.Decompressor(), buffer.data(), n, at, c);
      if (ZSTD_isError(d) || d != n) {
        return absl::DataLossError(
            absl::StrFormat("%s: zstd frame of %d bytes is corrupt (%s)", what, c,
                            ZSTD_isError(d) ? ZSTD_getErrorName(d) : "short output"));
      }
      return buffer.data();
    }
    default:
      return absl::DataLossError(absl::StrFormat("%s: unknown stream mode %d", what, mode));
  }
}

// ---------------------------------------------------------------------------------------------
// Element transforms. Floats are rotated left by one bit, which puts the exponent in the top
// byte (exactly, for BF16 and F32) and the sign next to the noisy low mantissa bits.

template <typename T>
constexpr T RotL(T x) {
  return static_cast<T>((x << 1) | (x >> (sizeof(T) * 8 - 1)));
}
template <typename T>
constexpr T RotR(T x) {
  return static_cast<T>((x >> 1) | (x << (sizeof(T) * 8 - 1)));
}

template <typename T>
T Load(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// planes[b][offset + i] = byte b of transform(target[i] ^ base[i]) (base optional).
// Returns how many elements differ from the base (all of them without a base).
template <typename T, bool kRotate, bool kXor>
uint64_t SplitPlanes(const std::byte* base, const std::byte* target, size_t n,
                     uint8_t* const* planes, size_t offset) {
  constexpr size_t w = sizeof(T);
  uint8_t* p[w];
  for (size_t b = 0; b < w; ++b) p[b] = planes[b] + offset;
  uint64_t changed = 0;
  for (size_t i = 0; i < n; ++i) {
    T x = Load<T>(target + i * w);
    if constexpr (kXor) {
      x ^= Load<T>(base + i * w);
      changed += x != 0;
    }
    if constexpr (kRotate) x = RotL(x);
    for (size_t b = 0; b < w; ++b) p[b][i] = static_cast<uint8_t>(x >> (8 * b));
  }
  return kXor ? changed : n;
}

// out[i] = inverse transform of the planes, XORed with base[i] when kXor. `base` and `out` may
// be the same array; they are accessed at the same index only.
template <typename T, bool kRotate, bool kXor>
void MergePlanes(const uint8_t* const* planes, size_t offset, const std::byte* base, std::byte* out,
                 size_t n) {
  constexpr size_t w = sizeof(T);
  const uint8_t* p[w];
  for (size_t b = 0; b < w; ++b) p[b] = planes[b] + offset;
  for (size_t i = 0; i < n; ++i) {
    T x = 0;
    for (size_t b = 0; b < w; ++b) x |= static_cast<T>(static_cast<T>(p[b][i]) << (8 * b));
    if constexpr (kRotate) x = RotR(x);
    if constexpr (kXor) x ^= Load<T>(base + i * w);
    std::memcpy(out + i * w, &x, w);
  }
}

template <typename T>
T ZigZag(T d) {
  using S = std::make_signed_t<T>;
  return static_cast<T>(static_cast<T>(d << 1) ^
                        static_cast<T>(static_cast<S>(d) >> (sizeof(T) * 8 - 1)));
}
template <typename T>
T UnZigZag(T z) {
  return static_cast<T>((z >> 1) ^ static_cast<T>(0 - (z & 1)));
}

// Bit k set when lane k (an element of type T) of the 64-bit word `x` is non-zero.
template <typename T>
uint64_t LaneMask(uint64_t x) {
  if constexpr (sizeof(T) == 8) {
    return x != 0;
  } else {
    // Every bit of each lane but its top one.
    constexpr uint64_t kSeven = sizeof(T) == 1   ? 0x7f7f7f7f7f7f7f7fULL
                                : sizeof(T) == 2 ? 0x7fff7fff7fff7fffULL
                                                 : 0x7fffffff7fffffffULL;
    constexpr uint64_t kTop = ~kSeven;
    // The top bit of each lane is set exactly when the lane is non-zero.
    const uint64_t t = (((x & kSeven) + kSeven) | x) & kTop;
    if constexpr (sizeof(T) == 1) {
      return ((t >> 7) * 0x0102040810204080ULL) >> 56;
    } else if constexpr (sizeof(T) == 2) {
      return (((t >> 15) * 0x0000200040008001ULL) >> 45) & 0xf;
    } else {
      return ((t >> 31) & 1) | ((t >> 62) & 2);
    }
  }
}

// Appends the changed elements of one span to positions/values (values are zigzag(new - base)
// as T). Returns false when more than `cap` elements changed (positions then incomplete).
template <typename T>
bool ScanChanges(const std::byte* base, const std::byte* target, size_t n, uint64_t first_index,
                 size_t cap, uint32_t* positions, T* values, size_t* count) {
  constexpr size_t w = sizeof(T);
  constexpr size_t kBlock = 64 / w;   // elements per 64-byte block
  constexpr size_t kPerWord = 8 / w;  // elements per 64-bit word
  size_t c = *count;
  auto record = [&](size_t k) {
    const T a = Load<T>(base + k * w), b = Load<T>(target + k * w);
    positions[c] = static_cast<uint32_t>(first_index + k);
    values[c] = ZigZag(static_cast<T>(b - a));
    ++c;
  };
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const std::byte* pa = base + i * w;
    const std::byte* pb = target + i * w;
    uint64_t x[8];
    uint64_t any = 0;
    for (size_t k = 0; k < 8; ++k) {
      x[k] = Load<uint64_t>(pa + 8 * k) ^ Load<uint64_t>(pb + 8 * k);
      any |= x[k];
    }
    if (any == 0) continue;
    uint64_t mask = 0;
    for (size_t k = 0; k < 8; ++k) mask |= LaneMask<T>(x[k]) << (k * kPerWord);
    while (mask != 0) {
      if (c == cap) {
        *count = c;
        return false;
      }
      record(i + static_cast<size_t>(std::countr_zero(mask)));
      mask &= mask - 1;
    }
  }
  for (; i < n; ++i) {
    if (Load<T>(base + i * w) == Load<T>(target + i * w)) continue;
    if (c == cap) {
      *count = c;
      return false;
    }
    record(i);
  }
  *count = c;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Dispatch over element sizes.

template <typename F>
auto WithElement(size_t w, F&& f) {
  switch (w) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    default:
      return f(uint64_t{});
  }
}

template <typename T>
uint64_t SplitAll(absl::Span<const ChunkInput> spans, bool rotate, bool xor_base,
                  uint8_t* const* planes) {
  uint64_t changed = 0;
  size_t off = 0;
  for (const ChunkInput& s : spans) {
    const size_t n = s.bytes / sizeof(T);
    if (rotate) {
      changed += xor_base ? SplitPlanes<T, true, true>(s.base, s.target, n, planes, off)
                          : SplitPlanes<T, true, false>(nullptr, s.target, n, planes, off);
    } else {
      changed += xor_base ? SplitPlanes<T, false, true>(s.base, s.target, n, planes, off)
                          : SplitPlanes<T, false, false>(nullptr, s.target, n, planes, off);
    }
    off += n;
  }
  return changed;
}

template <typename T>
void MergeAll(absl::Span<const ChunkOutput> spans, bool rotate, bool xor_base,
              const uint8_t* const* planes) {
  size_t off = 0;
  for (const ChunkOutput& s : spans) {
    const size_t n = s.bytes / sizeof(T);
    if (rotate) {
      xor_base ? MergePlanes<T, true, true>(planes, off, s.base, s.out, n)
               : MergePlanes<T, true, false>(planes, off, nullptr, s.out, n);
    } else {
      xor_base ? MergePlanes<T, false, true>(planes, off, s.base, s.out, n)
               : MergePlanes<T, false, false>(planes, off, nullptr, s.out, n);
    }
    off += n;
  }
}

// Appends the record of the planes/xor methods: one stream per plane.
void EncodePlanesRecord(Method method, size_t w, size_t n, int level, Scratch& s,
                        std::vector<std::byte>* out, bool* all_stored) {
  ByteVectorWriter(out).U8(static_cast<uint8_t>(method));
  *all_stored = true;
  for (size_t b = 0; b < w; ++b) {
    const size_t before = out->size();
    PutStream(s.planes[b].data(), n, level, s, out);
    if (n > 0 &&
        static_cast<uint8_t>((*out)[before]) != static_cast<uint8_t>(StreamMode::kStored)) {
      *all_stored = false;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The sparse method.
//
// Changes are identified by position and coded as gaps. For floats, the changed elements are
// first split into up to kMaxGroups groups by the magnitude class of their base value (ClassOf:
// the exponent for BF16 and F32), with class thresholds chosen per chunk; within a group a change
// is identified by its rank among the group's elements, which the decoder counts from the base.
// In training, small weights change far more often than large ones (Adam's step is about the
// same size for all while bf16's rounding step grows with the magnitude), so this turns one
// mixed stream of gaps into a few nearly uniform ones that the entropy coder handles well.

constexpr int kMaxGroups = 4;
// Estimated cost of one more group (the headers and entropy tables of its streams), in bits.
constexpr double kGroupOverheadBits = 8 * 64;
// Chunks with fewer changes are not grouped (the streams' fixed costs would dominate).
constexpr size_t kMinChangesToGroup = 128;
// The encoder estimates class sizes from one 64-byte block in every kClassSampleStride.
constexpr size_t kClassSampleStride = 64;

struct Grouping {
  int groups = 1;
  uint8_t threshold[kMaxGroups - 1] = {};  // strictly increasing; group = #{j : class >= t[j]}
};

// The magnitude class of a float element: the top byte of its rotated bit pattern.
template <typename T>
uint8_t ClassOf(T x) {
  return static_cast<uint8_t>(RotL(x) >> (8 * sizeof(T) - 8));
}

template <int K>
int GroupOf(uint8_t c, const uint8_t* threshold) {
  int g = 0;
  for (int j = 0; j < K - 1; ++j) g += c >= threshold[j];
  return g;
}

// Picks thresholds minimizing the estimated cost of the change masks: for each group of n
// elements with c changes, n * H(c / n) bits, plus kGroupOverheadBits per extra group.
// `sizes[c]` (estimated elements of class c) and `changes[c]` are per class.
Grouping ChooseGrouping(const uint64_t* sizes, const uint64_t* changes, int max_groups) {
  std::vector<int> cls;
  for (int c = 0; c < 256; ++c) {
    if (sizes[c] > 0 || changes[c] > 0) cls.push_back(c);
  }
  const size_t m = cls.size();
  Grouping best;
  if (m < 2) return best;
  std::vector<double> pn(m + 1, 0), pc(m + 1, 0);
  for (size_t i = 0; i < m; ++i) {
    const double c = static_cast<double>(changes[cls[i]]);
    pn[i + 1] = pn[i] + std::max(static_cast<double>(sizes[cls[i]]), c);
    pc[i + 1] = pc[i] + c;
  }
  auto cost = [&](size_t a, size_t b) {  // classes [a, b)
    const double n = pn[b] - pn[a], c = pc[b] - pc[a];
    if (c <= 0 || c >= n) return 0.0;
    const double p = c / n;
    return -n * (p * std::log2(p) + (1 - p) * std::log2(1 - p));
  };
  // dp[k][j]: cheapest split of classes [0, j) into k + 1 groups; cut[k][j]: where the last starts.
  std::vector<std::vector<double>> dp(kMaxGroups, std::vector<double>(m + 1, 1e300));
  std::vector<std::vector<size_t>> cut(kMaxGroups, std::vector<size_t>(m + 1, 0));
  for (size_t j = 1; j <= m; ++j) dp[0][j] = cost(0, j);
  for (int k = 1; k < kMaxGroups; ++k) {
    for (size_t j = k + 1; j <= m; ++j) {
      for (size_t i = k; i < j; ++i) {
        const double v = dp[k - 1][i] + cost(i, j);
        if (v < dp[k][j]) {
          dp[k][j] = v;
          cut[k][j] = i;
        }
      }
    }
  }
  int best_k = 0;
  for (int k = 1; k < max_groups && static_cast<size_t>(k) < m; ++k) {
    if (dp[k][m] + k * kGroupOverheadBits < dp[best_k][m] + best_k * kGroupOverheadBits) {
      best_k = k;
    }
  }
  best.groups = best_k + 1;
  size_t j = m;
  for (int k = best_k; k > 0; --k) {
    j = cut[k][j];
    best.threshold[k - 1] = static_cast<uint8_t>(cls[j]);
  }
  return best;
}

// Writes one group's changes: gaps between ranks (narrowed, with escapes) and values.
template <typename T>
void PutGroup(const uint32_t* ranks, const T* values, size_t count, int level, Scratch& s,
              std::vector<std::byte>* out) {
  ByteVectorWriter(out).Varint(count);
  if (count == 0) return;
  // Gap width: the narrowest total with escapes (an entry of all ones adds its value and
  // continues), ties to the narrower width.
  uint64_t entries[3] = {0, 0, 0};
  constexpr uint64_t kMax[3] = {0xff, 0xffff, 0xffffffff};
  constexpr size_t kWidth[3] = {1, 2, 4};
  int64_t prev = -1;
  for (size_t k = 0; k < count; ++k) {
    const uint64_t gap = static_cast<uint64_t>(static_cast<int64_t>(ranks[k]) - prev - 1);
    prev = ranks[k];
    for (int j = 0; j < 3; ++j) entries[j] += 1 + gap / kMax[j];
  }
  int best = 0;
  for (int j = 1; j < 3; ++j) {
    if (entries[j] * kWidth[j] < entries[best] * kWidth[best]) best = j;
  }
  const size_t gw = kWidth[best];
  const uint64_t e = entries[best];
  const uint64_t escape = kMax[best];
  ByteVectorWriter(out).U8(static_cast<uint8_t>(gw)).Varint(e);
  for (size_t b = 0; b < gw; ++b) Grow(s.gap_planes[b], e);
  size_t at = 0;
  prev = -1;
  for (size_t k = 0; k < count; ++k) {
    uint64_t gap = static_cast<uint64_t>(static_cast<int64_t>(ranks[k]) - prev - 1);
    prev = ranks[k];
    while (gap >= escape) {
      for (size_t b = 0; b < gw; ++b) s.gap_planes[b][at] = static_cast<uint8_t>(escape >> (8 * b));
      ++at;
      gap -= escape;
    }
    for (size_t b = 0; b < gw; ++b) s.gap_planes[b][at] = static_cast<uint8_t>(gap >> (8 * b));
    ++at;
  }
  for (size_t b = 0; b < gw; ++b) PutStream(s.gap_planes[b].data(), e, level, s, out);
  constexpr size_t w = sizeof(T);
  for (size_t b = 0; b < w; ++b) {
    Grow(s.planes[b], count);
    for (size_t k = 0; k < count; ++k) s.planes[b][k] = static_cast<uint8_t>(values[k] >> (8 * b));
    PutStream(s.planes[b].data(), count, level, s, out);
  }
}

// Population count without relying on a POPCNT instruction the baseline x86-64 lacks (GCC's
// std::popcount then calls libgcc).
inline uint32_t PopCount(uint64_t x) {
  x = x - ((x >> 1) & 0x5555555555555555ULL);
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
  return static_cast<uint32_t>((x * 0x0101010101010101ULL) >> 56);
}

// Position of the r-th (from 0) set bit of x; r must be below the number of set bits. Branch-free
// (broadword selection after Vigna, "Broadword implementation of rank/select queries", 2008):
// cumulative byte counts find the byte, a table the bit within it.
struct SelectTable {
  uint8_t bit[256][8];
  constexpr SelectTable() : bit() {
    for (int b = 0; b < 256; ++b) {
      int k = 0;
      for (int i = 0; i < 8; ++i) {
        if (b & (1 << i)) bit[b][k++] = static_cast<uint8_t>(i);
      }
    }
  }
};
constexpr SelectTable kSelect;

// Byte k: the set bits of x in bytes 0..k (the top byte: all of them).
inline __attribute__((always_inline)) uint64_t CumulativeByteCounts(uint64_t x) {
  uint64_t c = x - ((x >> 1) & 0x5555555555555555ULL);
  c = (c & 0x3333333333333333ULL) + ((c >> 2) & 0x3333333333333333ULL);
  c = (c + (c >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
  return c * 0x0101010101010101ULL;
}

// Select with the CumulativeByteCounts of x.
inline __attribute__((always_inline)) uint32_t SelectWith(uint64_t x, uint64_t cumulative,
                                                          uint32_t r) {
  constexpr uint64_t kOnes = 0x0101010101010101ULL, kHigh = 0x8080808080808080ULL;
  // High bit of byte k set when cumulative_k > r (every byte is at most 64).
  const uint64_t above = ((cumulative | kHigh) - kOnes * (r + 1)) & kHigh;
  const uint32_t byte = static_cast<uint32_t>(std::countr_zero(above)) / 8;
  const uint32_t before = static_cast<uint32_t>((cumulative << 8) >> (8 * byte)) & 0xff;
  return 8 * byte + kSelect.bit[(x >> (8 * byte)) & 0xff][r - before];
}

inline __attribute__((always_inline)) uint32_t Select(uint64_t x, uint32_t r) {
  return SelectWith(x, CumulativeByteCounts(x), r);
}

// at_least[j]: elements of the m (<= 64 bytes' worth) at p whose class >= t[j], j < K - 1.
template <typename T, int K>
inline __attribute__((always_inline)) void CountBlock(const std::byte* p, size_t m,
                                                      const uint8_t* t, uint32_t* at_least) {
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) {
    if (m == 32) {
      __m128i cls[4];
      for (int k = 0; k < 4; ++k) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k));
        cls[k] = _mm_and_si128(_mm_srli_epi16(v, 7), _mm_set1_epi16(0xff));  // ClassOf
      }
      const __m128i zero = _mm_setzero_si128();
      for (int j = 0; j < K - 1; ++j) {
        const __m128i thr = _mm_set1_epi16(static_cast<int16_t>(t[j] - 1));
        const __m128i lo =
            _mm_packs_epi16(_mm_cmpgt_epi16(cls[0], thr), _mm_cmpgt_epi16(cls[1], thr));
        const __m128i hi =
            _mm_packs_epi16(_mm_cmpgt_epi16(cls[2], thr), _mm_cmpgt_epi16(cls[3], thr));
        // Comparison bytes are 0 or -1: their negated sum is the count.
        const __m128i ones = _mm_add_epi8(_mm_sub_epi8(zero, lo), _mm_sub_epi8(zero, hi));
        const __m128i sad = _mm_sad_epu8(ones, zero);
        at_least[j] = static_cast<uint32_t>(_mm_cvtsi128_si32(sad) +
                                            _mm_cvtsi128_si32(_mm_unpackhi_epi64(sad, sad)));
      }
      return;
    }
  }
#endif
  uint32_t acc[K] = {};
  for (size_t i = 0; i < m; ++i) {
    const uint8_t c = ClassOf(Load<T>(p + i * sizeof(T)));
    for (int j = 0; j < K - 1; ++j) acc[j] += c >= t[j];
  }
  for (int j = 0; j < K - 1; ++j) at_least[j] = acc[j];
}

// Bit i set when element i of the m (<= 64 bytes' worth) at p is in group g.
template <typename T, int K>
inline __attribute__((always_inline)) uint64_t MembersMask(const std::byte* p, size_t m,
                                                           const uint8_t* t, int g) {
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) {
    if (m == 32) {
      // The class is in [lo, hi) for group g; the first and last groups need one comparison.
      const __m128i lo = _mm_set1_epi16(static_cast<int16_t>(g > 0 ? t[g - 1] - 1 : -1));
      const __m128i hi = _mm_set1_epi16(static_cast<int16_t>(g < K - 1 ? t[g] : 256));
      __m128i in[4];
      for (int k = 0; k < 4; ++k) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k));
        const __m128i c = _mm_and_si128(_mm_srli_epi16(v, 7), _mm_set1_epi16(0xff));
        if (g == 0) {
          in[k] = _mm_cmplt_epi16(c, hi);
        } else if (g == K - 1) {
          in[k] = _mm_cmpgt_epi16(c, lo);
        } else {
          in[k] = _mm_and_si128(_mm_cmpgt_epi16(c, lo), _mm_cmplt_epi16(c, hi));
        }
      }
      return static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(in[0], in[1]))) |
             (static_cast<uint64_t>(
                  static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(in[2], in[3]))))
              << 16);
    }
  }
#endif
  const int lo = g > 0 ? t[g - 1] : 0, hi = g < K - 1 ? t[g] : 256;
  uint64_t mask = 0;
  for (size_t i = 0; i < m; ++i) {
    const int c = ClassOf(Load<T>(p + i * sizeof(T)));
    mask |= static_cast<uint64_t>(c >= lo && c < hi) << i;
  }
  return mask;
}

// The base values of a chunk cut into blocks of 64 bytes, span by span (a span's last block may
// be shorter), with the number of elements of each class range per block: what grouped sparse
// coding needs to turn ranks within a group into positions and back.
template <typename T, int K>
class BlockIndex {
 public:
  static constexpr size_t kBlock = 64 / sizeof(T);

  // `spans` gives each span's base values and element count.
  BlockIndex(absl::Span<const std::pair<const std::byte*, uint64_t>> spans,
             const Grouping& grouping, Scratch& s)
      : s_(s) {
    for (int j = 0; j < K - 1; ++j) t_[j] = grouping.threshold[j];
    size_t blocks = 0;
    for (const auto& [base, n] : spans) blocks += (n + kBlock - 1) / kBlock;
    for (int j = 0; j < K - 1; ++j) Grow(s.block_at_least[j], blocks);
    Grow(s.block_len, blocks);
    size_t b = 0;
    uint64_t element = 0;
    for (const auto& [base, n] : spans) {
      spans_.push_back(SpanInfo{base, element, n, b});
      for (uint64_t i = 0; i < n; i += kBlock, ++b) {
        const size_t m = static_cast<size_t>(std::min<uint64_t>(kBlock, n - i));
        s.block_len[b] = static_cast<uint8_t>(m);
        uint32_t at_least[K];
        CountBlock<T, K>(base + i * sizeof(T), m, t_, at_least);
        for (int j = 0; j < K - 1; ++j) {
          s.block_at_least[j][b] = static_cast<uint8_t>(at_least[j]);
          total_at_least_[j] += at_least[j];
        }
      }
      element += n;
    }
    blocks_ = b;
    elements_ = element;
  }

  // Elements of group g in all blocks.
  uint64_t Total(int g) const {
    const uint64_t above = g == 0 ? elements_ : total_at_least_[g - 1];
    const uint64_t below = g == K - 1 ? 0 : total_at_least_[g];
    return above - below;
  }

  size_t blocks() const { return blocks_; }
  size_t spans() const { return spans_.size(); }
  uint64_t span_first_element(size_t span) const { return spans_[span].first_element; }
  uint64_t span_elements(size_t span) const { return spans_[span].elements; }
  size_t span_first_block(size_t span) const { return spans_[span].first_block; }

  // Elements of group g in block b.
  uint32_t Count(size_t b, int g) const {
    const uint32_t above = g == 0 ? s_.block_len[b] : s_.block_at_least[g - 1][b];
    const uint32_t below = g == K - 1 ? 0 : s_.block_at_least[g][b];
    return above - below;
  }

  // Bit i set when element i of block `block` (of span `span`) is in group g.
  uint64_t Members(size_t span, size_t block, int g) const {
    const SpanInfo& si = spans_[span];
    const uint64_t first = (block - si.first_block) * kBlock;
    const std::byte* p = si.base + first * sizeof(T);
    const size_t m = static_cast<size_t>(std::min<uint64_t>(kBlock, si.elements - first));
    return MembersMask<T, K>(p, m, t_, g);
  }

 private:
  struct SpanInfo {
    const std::byte* base;
    uint64_t first_element;
    uint64_t elements;
    size_t first_block;
  };

  Scratch& s_;
  uint8_t t_[K] = {};
  absl::InlinedVector<SpanInfo, 4> spans_;
  size_t blocks_ = 0;
  uint64_t elements_ = 0;
  uint64_t total_at_least_[K] = {};
};

// Bit k set when element k of the len (<= 64 bytes' worth) at a and b differ.
template <typename T>
inline __attribute__((always_inline)) uint64_t ChangedMask(const std::byte* a, const std::byte* b,
                                                           size_t len) {
  constexpr size_t w = sizeof(T);
  constexpr size_t kBlock = 64 / w;
  uint64_t changed = 0;
  if (len != kBlock) {
    for (size_t k = 0; k < len; ++k) {
      changed |= static_cast<uint64_t>(Load<T>(a + k * w) != Load<T>(b + k * w)) << k;
    }
    return changed;
  }
#if defined(__SSE2__)
  if constexpr (w == 2) {
    __m128i eq[4];
    for (int k = 0; k < 4; ++k) {
      eq[k] = _mm_cmpeq_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * k)),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * k)));
    }
    const uint32_t same =
        static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(eq[0], eq[1]))) |
        (static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(eq[2], eq[3]))) << 16);
    return ~same & 0xffffffffULL;
  }
#endif
  constexpr size_t kPerWord = 8 / w;
  uint64_t x[8];
  uint64_t any = 0;
  for (size_t k = 0; k < 8; ++k) {
    x[k] = Load<uint64_t>(a + 8 * k) ^ Load<uint64_t>(b + 8 * k);
    any |= x[k];
  }
  if (any == 0) return 0;
  for (size_t k = 0; k < 8; ++k) changed |= LaneMask<T>(x[k]) << (k * kPerWord);
  return changed;
}

// Chooses the groups from a sample of the chunk (one 64-byte block in kClassSampleStride, all of
// them in small chunks): class sizes from the base, change counts from base against target.
template <typename T>
Grouping SampleGrouping(absl::Span<const ChunkInput> spans, size_t n, int max_groups) {
  constexpr size_t w = sizeof(T);
  constexpr size_t kBlock = 64 / w;
  const size_t stride = n >= 64 * kBlock * kClassSampleStride ? kClassSampleStride : 1;
  uint64_t sizes[256] = {}, changes[256] = {};
  uint64_t changed = 0, block = 0;
  for (const ChunkInput& span : spans) {
    const size_t m = span.bytes / w;
    for (size_t i = 0; i < m; i += kBlock, ++block) {
      if (block % stride != 0) continue;
      for (size_t k = i; k < std::min(m, i + kBlock); ++k) {
        const T a = Load<T>(span.base + k * w);
        const uint8_t c = ClassOf(a);
        sizes[c] += stride;
        if (a != Load<T>(span.target + k * w)) {
          changes[c] += stride;
          changed += stride;
        }
      }
    }
  }
  if (changed < kMinChangesToGroup) return Grouping{};
  return ChooseGrouping(sizes, changes, max_groups);
}

// Finds the changed elements in one pass over base and target, each with its group (s.groups),
// its rank within the group (s.ranks) and zigzag(new - base) (s.values), in position order.
template <typename T, int K>
size_t ScanRanked(absl::Span<const ChunkInput> spans, const Grouping& grouping, Scratch& s) {
  constexpr size_t w = sizeof(T);
  constexpr size_t kBlock = 64 / w;
  const uint8_t* t = grouping.threshold;
  T* values = reinterpret_cast<T*>(s.values.data());
  uint64_t before[K] = {};  // members of each group before the current block
  size_t c = 0;
  for (const ChunkInput& span : spans) {
    const size_t m = span.bytes / w;
    for (size_t i = 0; i < m; i += kBlock) {
      const size_t len = std::min(kBlock, m - i);
      const std::byte* pa = span.base + i * w;
      const std::byte* pb = span.target + i * w;
      uint64_t changed = ChangedMask<T>(pa, pb, len);  // bit k: element k differs
      uint32_t at_least[K];
      CountBlock<T, K>(pa, len, t, at_least);
      while (changed != 0) {
        const size_t k = static_cast<size_t>(std::countr_zero(changed));
        changed &= changed - 1;
        const T a = Load<T>(pa + k * w), b = Load<T>(pb + k * w);
        const int g = GroupOf<K>(ClassOf(a), t);
        const uint64_t below = MembersMask<T, K>(pa, len, t, g) & ((uint64_t{1} << k) - 1);
        s.groups[c] = static_cast<uint8_t>(g);
        s.ranks[c] = static_cast<uint32_t>(before[g] + PopCount(below));
        values[c] = ZigZag(static_cast<T>(b - a));
        ++c;
      }
      uint64_t above = len;
      for (int g = 0; g < K; ++g) {
        const uint64_t next_above = g < K - 1 ? at_least[g] : 0;
        before[g] += above - next_above;
        above = next_above;
      }
    }
  }
  return c;
}

// The sparse record of `count` changes: s.positions and s.values when not grouped, else
// s.groups, s.ranks and s.values.
template <typename T>
void EncodeSparseRecord(const Grouping& grouping, size_t count, int level, Scratch& s,
                        std::vector<std::byte>* out) {
  constexpr size_t w = sizeof(T);
  out->clear();
  ByteVectorWriter header(out);
  header.U8(static_cast<uint8_t>(Method::kSparse))
      .Varint(count)
      .U8(static_cast<uint8_t>(grouping.groups));
  for (int j = 0; j < grouping.groups - 1; ++j) header.U8(grouping.threshold[j]);
  const T* values = reinterpret_cast<const T*>(s.values.data());
  if (grouping.groups == 1) {
    PutGroup<T>(s.positions.data(), values, count, level, s, out);
    return;
  }
  // Stable partition by group: ranks ascend within each group.
  size_t start[kMaxGroups + 1] = {};
  for (size_t k = 0; k < count; ++k) ++start[s.groups[k] + 1];
  for (int g = 0; g < kMaxGroups; ++g) start[g + 1] += start[g];
  Grow(s.sorted_ranks, count);
  Grow(s.sorted_values, count * w);
  T* sorted_values = reinterpret_cast<T*>(s.sorted_values.data());
  size_t fill[kMaxGroups];
  std::copy(start, start + kMaxGroups, fill);
  for (size_t k = 0; k < count; ++k) {
    const size_t at = fill[s.groups[k]]++;
    s.sorted_ranks[at] = s.ranks[k];
    sorted_values[at] = values[k];
  }
  for (int g = 0; g < grouping.groups; ++g) {
    PutGroup<T>(s.sorted_ranks.data() + start[g], sorted_values + start[g], start[g + 1] - start[g],
                level, s, out);
  }
}

// One group of a sparse record, decoded: ranks (ascending) and value planes.
struct DecodedGroup {
  uint64_t count = 0;
  const uint32_t* ranks = nullptr;
  const uint8_t* values[8] = {};
};

// Reads group g of a sparse record over n elements into `ranks`, which has room for `room`
// ranks (the record's changes not yet claimed by earlier groups): a group claiming more is
// refused before any rank is written.
template <typename T>
absl::Status GetGroup(ByteReader& r, size_t n, int g, Scratch& s, uint32_t* ranks, uint64_t room,
                      DecodedGroup* out) {
  constexpr size_t w = sizeof(T);
  WB_ASSIGN_OR_RETURN(out->count, r.Varint("a sparse group's change count"));
  out->ranks = ranks;
  if (out->count > room) {
    return absl::DataLossError(absl::StrFormat(
        "sparse group %d claims %d changes, but only %d of the record's changes are left for it", g,
        out->count, room));
  }
  if (out->count == 0) return absl::OkStatus();
  WB_ASSIGN_OR_RETURN(uint8_t gw, r.U8("sparse gap width"));
  if (gw != 1 && gw != 2 && gw != 4) {
    return absl::DataLossError(absl::StrFormat("sparse gap width %d is not 1, 2 or 4", gw));
  }
  WB_ASSIGN_OR_RETURN(uint64_t entries, r.Varint("sparse gap entry count"));
  // Every entry but escapes ends a gap and escapes add at least 255: more entries than this
  // cannot describe ranks inside the chunk.
  if (entries < out->count || entries > out->count + n / 255 + 1) {
    return absl::DataLossError(
        absl::StrFormat("sparse group %d has %d gap entries for %d changes in %d elements", g,
                        entries, out->count, n));
  }
  const uint8_t* gaps[4];
  for (size_t b = 0; b < gw; ++b) {
    WB_ASSIGN_OR_RETURN(gaps[b], GetStream(r, entries, s.gap_planes[b], s, "sparse gap plane"));
  }
  // Every group's values stay in use until all groups are applied: each has its own buffers.
  for (size_t b = 0; b < w; ++b) {
    WB_ASSIGN_OR_RETURN(out->values[b],
                        GetStream(r, out->count, s.value_planes[g][b], s, "sparse value plane"));
  }
  const uint64_t escape = gw == 1 ? 0xff : gw == 2 ? 0xffff : 0xffffffffULL;
  uint64_t next = 0, acc = 0, k = 0;
  for (uint64_t e = 0; e < entries; ++e) {
    uint64_t gap = 0;
    for (size_t b = 0; b < gw; ++b) gap |= static_cast<uint64_t>(gaps[b][e]) << (8 * b);
    acc += gap;
    if (gap == escape) continue;
    const uint64_t rank = next + acc;
    acc = 0;
    if (rank >= n || k >= out->count) {
      return absl::DataLossError(absl::StrFormat(
          "sparse group %d: change %d at rank %d is beyond the chunk's %d elements or the "
          "group's %d changes",
          g, k, rank, n, out->count));
    }
    ranks[k++] = static_cast<uint32_t>(rank);
    next = rank + 1;
  }
  if (k != out->count || acc != 0) {
    return absl::DataLossError(
        absl::StrFormat("sparse group %d: its gaps describe %d changes%s, but it claims %d", g, k,
                        acc != 0 ? " and end in an escape" : "", out->count));
  }
  return absl::OkStatus();
}

template <typename T>
T GroupValue(const DecodedGroup& g, uint64_t k) {
  T v = 0;
  for (size_t b = 0; b < sizeof(T); ++b) {
    v |= static_cast<T>(static_cast<T>(g.values[b][k]) << (8 * b));
  }
  return UnZigZag(v);
}

template <typename T>
void AddAt(std::byte* at, T delta) {
  const T updated = static_cast<T>(Load<T>(at) + delta);
  std::memcpy(at, &updated, sizeof(T));
}

// ---------------------------------------------------------------------------------------------
// The modeled method: every change in position order as decisions of an adaptive binary range
// coder (range_coder.h) whose contexts are the magnitude class of the base element. Per change:
// its class (8 decisions down a binary tree), how many elements *of that class* lie between the
// previous change and it (an Elias-gamma code: the length in unary, then the bits below the
// leading one, the first kGapAdaptive of them adaptive, in contexts of the class), and the
// change new - base as a sign and a magnitude (the same code, kMagnitudeAdaptive adaptive bits).
// Counting only the elements of the change's class is what makes the class pay: in training,
// small weights change far more often than large ones, and a gap among the elements of one class
// follows that class's own rate. The decoder finds each change by counting elements of the class
// from the previous change on (one pass over the base in all), so no rank index is built.

constexpr int kGapAdaptive = 2;
// Classes are coded as offsets of this many bits from the chunk's smallest class of a change
// when its changes' classes fit (they span about 20 on training deltas), else as 8 bits.
constexpr int kClassWindowBits = 5;
constexpr int kMagnitudeAdaptive = 3;
constexpr int kGapLengths = 33;        // gap + 1 < 2^32: lengths 0..32
constexpr int kMagnitudeLengths = 64;  // magnitudes <= 2^63: lengths 0..63
constexpr int kMantissaLengths = 17;   // lengths with their own mantissa contexts (longer share)

// The contexts of one magnitude class, contiguous.
struct ClassContexts {
  Prob gap_len[kGapLengths];
  Prob gap_mantissa[kMantissaLengths][1 << kGapAdaptive];
  Prob sign;
  Prob magnitude_len[kMagnitudeLengths];
  Prob magnitude_mantissa[kMantissaLengths][1 << kMagnitudeAdaptive];
};
static_assert(sizeof(ClassContexts) % sizeof(Prob) == 0);

// Every context of a chunk, each starting at probability 1/2. A class's contexts are reset when
// the chunk first uses the class (chunks use a few dozen of the 256).
class ModelContexts {
 public:
  void Reset() {
    std::fill(std::begin(cls), std::end(cls), kProbHalf);
    std::fill(std::begin(used_), std::end(used_), false);
  }
  ClassContexts& Of(uint8_t c) {
    ClassContexts& k = classes_[c];
    if (!used_[c]) {
      Prob* p = reinterpret_cast<Prob*>(&k);
      std::fill(p, p + sizeof(ClassContexts) / sizeof(Prob), kProbHalf);
      used_[c] = true;
    }
    return k;
  }
  Prob cls[256];  // the binary tree of the class, node 1..255

 private:
  ClassContexts classes_[256];
  bool used_[256];
};

// This thread's contexts of type C (ModelContexts, RansContexts), reset for a new chunk.
template <typename C>
C& ThreadContexts() {
  thread_local std::unique_ptr<C> contexts = std::make_unique<C>();
  contexts->Reset();
  return *contexts;
}

// v >= 1 with lengths of at most max_len.
template <int kAdaptive, size_t kLengths>
inline __attribute__((always_inline)) void PutGamma(
    RangeEncoder& e, uint64_t v, int max_len, Prob (&len)[kLengths],
    Prob (&mantissa)[kMantissaLengths][1 << kAdaptive]) {
  const int l = static_cast<int>(std::bit_width(v)) - 1;
  for (int i = 0; i < l; ++i) e.Bit(len[i], 1);
  if (l < max_len) e.Bit(len[l], 0);
  Prob* m = mantissa[std::min(l, kMantissaLengths - 1)];
  uint32_t node = 1;
  int i = l - 1;
  for (; i >= 0 && l - 1 - i < kAdaptive; --i) {
    const uint32_t bit = static_cast<uint32_t>(v >> i) & 1;
    e.Bit(m[node], bit);
    node = node * 2 + bit;
  }
  // The rest directly, at most 32 bits at a time.
  for (; i >= 0; i -= 32) {
    const int take = std::min(i + 1, 32);
    e.Direct(static_cast<uint32_t>((v >> (i + 1 - take)) & ((uint64_t{1} << take) - 1)), take);
  }
}

template <int kAdaptive, size_t kLengths>
inline __attribute__((always_inline)) uint64_t GetGamma(
    RangeDecoder& d, int max_len, Prob (&len)[kLengths],
    Prob (&mantissa)[kMantissaLengths][1 << kAdaptive]) {
  int l = 0;
  while (l < max_len && d.Bit(len[l]) != 0) ++l;
  Prob* m = mantissa[std::min(l, kMantissaLengths - 1)];
  uint64_t v = 1;
  uint32_t node = 1;
  int i = l - 1;
  for (; i >= 0 && l - 1 - i < kAdaptive; --i) {
    const uint32_t bit = d.Bit(m[node]);
    node = node * 2 + bit;
    v = v * 2 + bit;
  }
  for (; i >= 0; i -= 32) {
    const int take = std::min(i + 1, 32);
    v = (v << take) | d.Direct(take);
  }
  return v;
}

// The base values of a chunk's spans.
struct BaseSpan {
  const std::byte* base;
  uint64_t n;  // elements
};

// Bit i set when element i of the m (<= 64 bytes' worth) at p has class c (every element of a
// non-float dtype has class 0).
template <typename T>
inline __attribute__((always_inline)) uint64_t ClassMask(const std::byte* p, size_t m, uint8_t c,
                                                         bool is_float) {
  if (!is_float) return c != 0 ? 0 : (m == 64 ? ~uint64_t{0} : (uint64_t{1} << m) - 1);
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) {
    if (m == 32) {
      // ClassOf(x) == c exactly when the 8 bits above the sign's neighbour match c << 7.
      const __m128i want = _mm_set1_epi16(static_cast<int16_t>(c << 7));
      const __m128i bits = _mm_set1_epi16(0x7f80);
      __m128i eq[4];
      for (int k = 0; k < 4; ++k) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k));
        eq[k] = _mm_cmpeq_epi16(_mm_and_si128(v, bits), want);
      }
      return static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(eq[0], eq[1]))) |
             (static_cast<uint64_t>(
                  static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(eq[2], eq[3]))))
              << 16);
    }
  }
#endif
  uint64_t mask = 0;
  for (size_t i = 0; i < m; ++i) {
    mask |= static_cast<uint64_t>(ClassOf(Load<T>(p + i * sizeof(T))) == c) << i;
  }
  return mask;
}

// A position in a chunk: span and element within it.
struct SpanCursor {
  size_t span = 0;
  uint64_t at = 0;
};

// Elements of class c from `from` up to (not including) `to`.
template <typename T>
uint64_t CountClass(absl::Span<const BaseSpan> spans, bool is_float, uint8_t c, SpanCursor from,
                    SpanCursor to) {
  constexpr size_t kBlock = 64 / sizeof(T);
  uint64_t count = 0;
  for (size_t s = from.span; s <= to.span && s < spans.size(); ++s) {
    const uint64_t end = s == to.span ? to.at : spans[s].n;
    for (uint64_t i = s == from.span ? from.at : 0; i < end;) {
      const size_t m = static_cast<size_t>(std::min<uint64_t>(kBlock, end - i));
      count += PopCount(ClassMask<T>(spans[s].base + i * sizeof(T), m, c, is_float));
      i += m;
    }
  }
  return count;
}

// Finding a change's element is a scan of the base from the previous change on, 32 to 64
// bytes at a time, counting the elements of the change's class: about a third of the decoding
// time of a modeled record (BENCHMARKS.md, issue 16). Decoding out of place (a span's `out` is
// not its `base`), the scan also copies every block it reads into `out`, so the base is read
// once instead of copied whole first and scanned again; CopyRest copies what lies past the
// last change. `copied` marks how far the copies reach (blocks past a change's element may be
// copied twice, before the change is written: both copies are the base's bytes).
//
// Moves `at` to the element of class c that has k elements of class c between `at` and it;
// false when the chunk ends first. Baseline x86-64 (SSE2, no POPCNT instruction) and other
// targets.
template <typename T>
bool FindClass(absl::Span<const ChunkOutput> spans, bool is_float, uint8_t c, uint64_t k,
               SpanCursor* at, SpanCursor* copied) {
  constexpr size_t w = sizeof(T);
  constexpr size_t kBlock = 64 / w;
  for (size_t s = at->span; s < spans.size(); ++s) {
    const std::byte* base = spans[s].base;
    std::byte* out = spans[s].out;
    const bool copy = base != out;
    const uint64_t n = spans[s].bytes / w;
    for (uint64_t i = s == at->span ? at->at : 0; i < n;) {
      const size_t m = static_cast<size_t>(std::min<uint64_t>(kBlock, n - i));
      const uint64_t mask = ClassMask<T>(base + i * w, m, c, is_float);
      if (copy) std::memcpy(out + i * w, base + i * w, m * w);
      const uint64_t cumulative = CumulativeByteCounts(mask);  // one count for both
      const uint32_t in_block = static_cast<uint32_t>(cumulative >> 56);
      if (k < in_block) {
        *at = SpanCursor{s, i + SelectWith(mask, cumulative, static_cast<uint32_t>(k))};
        *copied = SpanCursor{s, i + m};
        return true;
      }
      k -= in_block;
      i += m;
    }
    *copied = SpanCursor{s + 1, 0};
  }
  return false;
}

// Copies the base into `out` from `copied` on (out of place only): what FindClass did not read.
void CopyRest(absl::Span<const ChunkOutput> spans, SpanCursor copied, size_t w) {
  for (size_t s = copied.span; s < spans.size(); ++s) {
    const uint64_t from = s == copied.span ? copied.at * w : 0;
    if (spans[s].base != spans[s].out && spans[s].bytes > from) {
      std::memcpy(spans[s].out + from, spans[s].base + from, spans[s].bytes - from);
    }
  }
}

using FindClassFn = bool (*)(absl::Span<const ChunkOutput>, bool, uint8_t, uint64_t, SpanCursor*,
                             SpanCursor*);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WB_DELTA_AVX2_SCAN 1
// FindClass for 2-byte elements on CPUs with AVX2 and POPCNT (chosen at run time, ScanChoice):
// 32 elements per block with two 32-byte compares, counted with one POPCNT. The block's mask has
// two bits per element (a byte mask of 16-bit compares), so the k-th element is the 2k-th set bit.
__attribute__((target("avx2,popcnt"))) bool FindClass16Avx2(absl::Span<const ChunkOutput> spans,
                                                            bool is_float, uint8_t c, uint64_t k,
                                                            SpanCursor* at, SpanCursor* copied) {
  constexpr uint64_t kBlock = 32;
  const __m256i bits = _mm256_set1_epi16(static_cast<int16_t>(0x7f80));
  const __m256i want = _mm256_set1_epi16(static_cast<int16_t>(c << 7));
  for (size_t s = at->span; s < spans.size(); ++s) {
    const std::byte* base = spans[s].base;
    std::byte* out = spans[s].out;
    const bool copy = base != out;
    const uint64_t n = spans[s].bytes / 2;
    uint64_t i = s == at->span ? at->at : 0;
    if (!is_float) {
      // Every element has class 0.
      if (c == 0 && k < n - std::min(i, n)) {
        if (copy) std::memcpy(out + 2 * i, base + 2 * i, 2 * (k + 1));
        *at = SpanCursor{s, i + k};
        *copied = SpanCursor{s, i + k + 1};
        return true;
      }
      if (c == 0) k -= n - std::min(i, n);
      if (copy && n > i) std::memcpy(out + 2 * i, base + 2 * i, 2 * (n - i));
      *copied = SpanCursor{s + 1, 0};
      continue;
    }
    for (; i + kBlock <= n; i += kBlock) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 2 * i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 2 * i + 32));
      if (copy) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i), a);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i + 32), b);
      }
      const uint64_t mask =
          static_cast<uint32_t>(
              _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_and_si256(a, bits), want))) |
          static_cast<uint64_t>(static_cast<uint32_t>(
              _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_and_si256(b, bits), want))))
              << 32;
      const uint64_t in_block = static_cast<uint64_t>(__builtin_popcountll(mask)) / 2;
      if (k < in_block) {
        *at = SpanCursor{s, i + Select(mask, static_cast<uint32_t>(2 * k)) / 2};
        *copied = SpanCursor{s, i + kBlock};
        return true;
      }
      k -= in_block;
    }
    if (i < n) {  // the span's last, shorter block
      const size_t m = static_cast<size_t>(n - i);
      const uint64_t mask = ClassMask<uint16_t>(base + 2 * i, m, c, true);
      if (copy) std::memcpy(out + 2 * i, base + 2 * i, 2 * m);
      const uint64_t in_block = static_cast<uint64_t>(__builtin_popcountll(mask));
      if (k < in_block) {
        *at = SpanCursor{s, i + Select(mask, static_cast<uint32_t>(k))};
        *copied = SpanCursor{s, n};
        return true;
      }
      k -= in_block;
    }
    *copied = SpanCursor{s + 1, 0};
  }
  return false;
}
#endif

// Forces the baseline scan (DecodeWithBaselineScanForTesting).
std::atomic<bool> baseline_scan_for_testing{false};

// The scan DecodeModeled and DecodeModeledRans use for elements of type T: AVX2 and POPCNT for
// 2-byte elements where the CPU has both, else the baseline.
template <typename T>
FindClassFn ChooseFindClass() {
#ifdef WB_DELTA_AVX2_SCAN
  if constexpr (sizeof(T) == 2) {
    static const bool avx2 = [] {
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    }();
    if (avx2 && !baseline_scan_for_testing.load(std::memory_order_relaxed)) {
      return &FindClass16Avx2;
    }
  }
#endif
  return &FindClass<T>;
}

// The `count` changes at s.positions (element indices in the chunk, ascending) with s.values
// (zigzag(new - base)) as a modeled record codes them: calls classes(histogram) with how many
// changes each magnitude class has, then fn(c, gap, negative, magnitude) for each change in
// order, with c its base element's class and gap the elements of class c between the previous
// change and it.
template <typename T, typename Classes, typename Fn>
void ForEachModeledChange(absl::Span<const ChunkInput> spans, bool is_float, size_t count,
                          Scratch& s, Classes&& classes, Fn&& fn) {
  constexpr size_t w = sizeof(T);
  using S = std::make_signed_t<T>;
  absl::InlinedVector<BaseSpan, 4> bases;
  for (const ChunkInput& span : spans) bases.push_back(BaseSpan{span.base, span.bytes / w});
  Grow(s.groups, count);
  uint32_t histogram[256] = {};
  {
    uint64_t first = 0;
    size_t span = 0;
    for (size_t k = 0; k < count; ++k) {
      while (s.positions[k] >= first + bases[span].n) first += bases[span++].n;
      const uint8_t c =
          is_float ? ClassOf(Load<T>(bases[span].base + (s.positions[k] - first) * w)) : 0;
      s.groups[k] = c;
      ++histogram[c];
    }
  }
  classes(histogram);
  const T* values = reinterpret_cast<const T*>(s.values.data());
  SpanCursor cursor;   // one past the previous change
  uint64_t first = 0;  // element index of bases[change.span]
  SpanCursor change;
  for (size_t k = 0; k < count; ++k) {
    const uint64_t position = s.positions[k];
    while (position >= first + bases[change.span].n) first += bases[change.span++].n;
    change.at = position - first;
    const uint8_t c = s.groups[k];
    const S d = static_cast<S>(UnZigZag(values[k]));
    const uint32_t negative = d < 0;
    const uint64_t magnitude = negative ? static_cast<T>(T{0} - static_cast<T>(d))
                                        : static_cast<uint64_t>(static_cast<T>(d));
    fn(c, CountClass<T>(bases, is_float, c, cursor, change), negative, magnitude);
    cursor = SpanCursor{change.span, change.at + 1};
  }
}

// Adds change k of a modeled record (of `method`), `magnitude` (negative or not) in class c,
// `gap` elements of class c after `cursor`, to the spans' out, found with `find` (which copies
// the base on its way: FindClass), and moves the cursor past it.
template <typename T>
inline __attribute__((always_inline)) absl::Status ApplyModeledChange(
    const char* method, FindClassFn find, absl::Span<const ChunkOutput> spans, bool is_float,
    uint64_t k, uint8_t c, uint64_t gap, uint64_t magnitude, uint32_t negative, SpanCursor* cursor,
    SpanCursor* copied) {
  constexpr size_t w = sizeof(T);
  constexpr uint64_t kHalf = uint64_t{1} << (8 * w - 1);
  if (magnitude > kHalf || (magnitude == kHalf && !negative)) [[unlikely]] {
    return absl::DataLossError(
        absl::StrFormat("%s change %d has magnitude %d, more than a %d-byte element holds", method,
                        k, magnitude, w));
  }
  if (!find(spans, is_float, c, gap, cursor, copied)) [[unlikely]] {
    return absl::DataLossError(
        absl::StrFormat("%s change %d: %d more elements of magnitude class %d are not in the chunk",
                        method, k, gap + 1, c));
  }
  const T delta =
      negative ? static_cast<T>(T{0} - static_cast<T>(magnitude)) : static_cast<T>(magnitude);
  const ChunkOutput& span = spans[cursor->span];
  const T updated = static_cast<T>(Load<T>(span.base + cursor->at * w) + delta);
  std::memcpy(span.out + cursor->at * w, &updated, w);
  ++cursor->at;
  return absl::OkStatus();
}

// The modeled record (format version 2) of `count` changes at s.positions with s.values.
template <typename T>
void EncodeModeledRecord(absl::Span<const ChunkInput> spans, bool is_float, size_t count,
                         Scratch& s, std::vector<std::byte>* out) {
  constexpr size_t w = sizeof(T);
  int class_bits = 8;
  uint8_t class_base = 0;
  ModelContexts& ctx = ThreadContexts<ModelContexts>();
  // Two coders, so that a decoder's two chains of decisions overlap: the classes (coder A, after
  // the header) and the gaps and changes (the rest of the record).
  std::vector<std::byte>& classes = s.record3;
  classes.clear();
  out->clear();
  RangeEncoder a(&classes), e(out);
  auto window = [&](const uint32_t(&histogram)[256]) {
    int lo = 0, hi = 255;
    while (histogram[lo] == 0) ++lo;
    while (histogram[hi] == 0) --hi;
    // The narrowest window of the classes.
    class_bits = hi - lo < (1 << kClassWindowBits) ? kClassWindowBits : 8;
    class_base =
        class_bits == 8 ? 0 : static_cast<uint8_t>(std::min(lo, 256 - (1 << kClassWindowBits)));
  };
  auto code = [&](uint8_t c, uint64_t gap, uint32_t negative, uint64_t magnitude) {
    const uint32_t offset = c - class_base;
    for (uint32_t node = 1, i = class_bits; i-- > 0;) {
      const uint32_t bit = (offset >> i) & 1;
      a.Bit(ctx.cls[node], bit);
      node = node * 2 + bit;
    }
    ClassContexts& k_ctx = ctx.Of(c);
    PutGamma<kGapAdaptive>(e, gap + 1, kGapLengths - 1, k_ctx.gap_len, k_ctx.gap_mantissa);
    e.Bit(k_ctx.sign, negative);
    PutGamma<kMagnitudeAdaptive>(e, magnitude, 8 * static_cast<int>(w) - 1, k_ctx.magnitude_len,
                                 k_ctx.magnitude_mantissa);
  };
  ForEachModeledChange<T>(spans, is_float, count, s, window, code);
  a.Finish();
  e.Finish();
  std::vector<std::byte> header;
  ByteVectorWriter(&header)
      .U8(static_cast<uint8_t>(Method::kModeled))
      .Varint(count)
      .U8(static_cast<uint8_t>(class_bits))
      .U8(class_base)
      .Varint(classes.size());
  header.insert(header.end(), classes.begin(), classes.end());
  out->insert(out->begin(), header.begin(), header.end());
}

// The fields both modeled records start with: the change count and the class window.
struct ModeledHeader {
  uint64_t count;
  int class_bits;
  uint8_t class_base;
};

absl::StatusOr<ModeledHeader> ReadModeledHeader(ByteReader& r, size_t n) {
  WB_ASSIGN_OR_RETURN(uint64_t count, r.Varint("modeled change count"));
  if (count == 0 || count > n) {
    return absl::DataLossError(
        absl::StrFormat("modeled record claims %d changes in %d elements", count, n));
  }
  WB_ASSIGN_OR_RETURN(uint8_t class_bits, r.U8("modeled class width"));
  WB_ASSIGN_OR_RETURN(uint8_t class_base, r.U8("modeled class base"));
  if ((class_bits != kClassWindowBits && class_bits != 8) || (class_bits == 8 && class_base != 0) ||
      class_base + (1 << class_bits) > 256) {
    return absl::DataLossError(absl::StrFormat(
        "modeled record codes classes in %d bits from %d (expected %d bits from at most %d, or 8 "
        "from 0)",
        class_bits, class_base, kClassWindowBits, 256 - (1 << kClassWindowBits)));
  }
  return ModeledHeader{count, class_bits, class_base};
}

// The two streams a modeled record ends with: a varint size and that many bytes, then the rest
// of the record.
struct TwoStreams {
  absl::Span<const std::byte> first, rest;
};

absl::StatusOr<TwoStreams> ReadTwoStreams(ByteReader& r, std::string_view first,
                                          std::string_view rest) {
  WB_ASSIGN_OR_RETURN(uint64_t first_size, r.Varint(std::string(first) + " size"));
  WB_ASSIGN_OR_RETURN(const std::byte* first_at, r.Bytes(first_size, first));
  const size_t rest_size = r.remaining();
  WB_ASSIGN_OR_RETURN(const std::byte* rest_at, r.Bytes(rest_size, rest));
  return TwoStreams{{first_at, first_size}, {rest_at, rest_size}};
}

// Applies a modeled record to the spans: out = base with the record's changes (in place when
// out is base).
template <typename T>
absl::Status DecodeModeled(ByteReader& r, absl::Span<const ChunkOutput> spans, bool is_float,
                           size_t n) {
  constexpr size_t w = sizeof(T);
  WB_ASSIGN_OR_RETURN(ModeledHeader h, ReadModeledHeader(r, n));
  const uint64_t count = h.count;
  const int class_bits = h.class_bits;
  const uint8_t class_base = h.class_base;
  const FindClassFn find = ChooseFindClass<T>();
  WB_ASSIGN_OR_RETURN(TwoStreams streams,
                      ReadTwoStreams(r, "modeled class stream", "modeled payload"));
  RangeDecoder a(streams.first.data(), streams.first.size()),
      d(streams.rest.data(), streams.rest.size());
  ModelContexts& ctx = ThreadContexts<ModelContexts>();
  const uint32_t class_top = 1u << class_bits;
  SpanCursor cursor, copied;
  for (uint64_t k = 0; k < count; ++k) {
    uint32_t node = 1;
    for (int i = 0; i < class_bits; ++i) node = node * 2 + a.Bit(ctx.cls[node]);
    const uint8_t c = static_cast<uint8_t>(class_base + (node - class_top));
    ClassContexts& k_ctx = ctx.Of(c);
    const uint64_t gap =
        GetGamma<kGapAdaptive>(d, kGapLengths - 1, k_ctx.gap_len, k_ctx.gap_mantissa) - 1;
    const uint32_t negative = d.Bit(k_ctx.sign);
    const uint64_t magnitude = GetGamma<kMagnitudeAdaptive>(
        d, 8 * static_cast<int>(w) - 1, k_ctx.magnitude_len, k_ctx.magnitude_mantissa);
    if (d.overrun() || a.overrun()) {
      return absl::DataLossError(
          absl::StrFormat("modeled record ends inside change %d of %d", k, count));
    }
    WB_RETURN_IF_ERROR(ApplyModeledChange<T>("modeled", find, spans, is_float, k, c, gap, magnitude,
                                             negative, &cursor, &copied));
  }
  if (d.remaining() != 0 || a.remaining() != 0) {
    return absl::DataLossError(
        absl::StrFormat("%d bytes left over after the modeled record's %d changes",
                        d.remaining() + a.remaining(), count));
  }
  CopyRest(spans, copied, w);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The modeled-rans method (format version 3): the modeled method's changes as three symbols of
// adaptive 16-symbol models (rans_coder.h) instead of about 20 binary decisions, each symbol in
// its own rANS state so that a decoder's three chains overlap (the next change's class does
// not wait for this change's gap or change):
//   state 0: the class c of the change's base element: c - class_base when that is below 15,
//            else 15 (an escape) and c in 8 raw bits; one model for the chunk;
//   state 1: min(L, 15) with L = floor(log2(g + 1)) and g the elements of class c between the
//            previous change and this one (as in the modeled method); a model per class;
//   state 2: sign * 8 + min(M, 7) with M = floor(log2(|d|)) of the change d; a model per class;
// then, in the raw bit stream: L - 15 in 5 bits when L >= 15, M - 7 in 6 bits when M >= 7, the
// L bits of g + 1 below its leading one and the M bits of |d| below its. The window of 15
// classes is the one that holds the most changes. The bits below a leading one are coded raw
// (the modeled method codes 2 or 3 of them in contexts): each class has two models to learn,
// which the few thousand changes of a record do quickly; on the real-gradient stream the record
// is 1-2.5% larger than the modeled one (BENCHMARKS.md, issue 16).

constexpr uint32_t kRansClassWindow = 15;

// The models of one magnitude class.
struct RansClassModels {
  NibbleModel gap;
  NibbleModel change;
};

// Every model of a chunk, each starting uniform; a class's models are reset when the chunk
// first uses the class.
class RansContexts {
 public:
  void Reset() {
    classes.Reset();
    std::fill(std::begin(used_), std::end(used_), false);
  }
  __attribute__((always_inline)) RansClassModels& Of(uint8_t c) {
    RansClassModels& k = of_[c];
    if (!used_[c]) [[unlikely]] {
      k.gap.Reset();
      k.change.Reset();
      used_[c] = true;
    }
    return k;
  }
  NibbleModel classes;

 private:
  RansClassModels of_[256];
  bool used_[256];
};

// The modeled-rans record of `count` changes at s.positions with s.values.
template <typename T>
void EncodeModeledRansRecord(absl::Span<const ChunkInput> spans, bool is_float, size_t count,
                             Scratch& s, std::vector<std::byte>* out) {
  uint32_t class_base = 0;
  RansContexts& ctx = ThreadContexts<RansContexts>();
  RansEncoder& e = s.rans;
  BitWriter& bits = s.bits;
  e.Clear();
  bits.Clear();
  auto window = [&](const uint32_t(&histogram)[256]) {
    uint32_t best = 0, in_window = 0;
    for (uint32_t c = 0; c < 256; ++c) {  // in_window: changes of classes c - 14 .. c
      in_window += histogram[c] - (c >= kRansClassWindow ? histogram[c - kRansClassWindow] : 0);
      if (in_window > best) {
        best = in_window;
        class_base = c >= kRansClassWindow - 1 ? c - (kRansClassWindow - 1) : 0;
      }
    }
    class_base = std::min(class_base, 256 - kRansClassWindow);
  };
  auto code = [&](uint8_t c, uint64_t gap, uint32_t negative, uint64_t magnitude) {
    const uint32_t offset = static_cast<uint32_t>(c) - class_base;  // wraps below the window
    e.Put(ctx.classes, std::min(offset, kRansClassWindow), 0);
    if (offset >= kRansClassWindow) bits.Put(c, 8);
    RansClassModels& m = ctx.Of(c);
    const uint64_t v = gap + 1;
    const int l = static_cast<int>(std::bit_width(v)) - 1;
    const int lm = static_cast<int>(std::bit_width(magnitude)) - 1;
    e.Put(m.gap, static_cast<uint32_t>(std::min(l, 15)), 1);
    e.Put(m.change, negative * 8 + static_cast<uint32_t>(std::min(lm, 7)), 2);
    if (l >= 15) bits.Put(static_cast<uint64_t>(l - 15), 5);
    if (lm >= 7) bits.Put(static_cast<uint64_t>(lm - 7), 6);
    bits.Put(v, l);  // l <= 32
    if (lm > 32) {
      bits.Put(magnitude, 32);
      bits.Put(magnitude >> 32, lm - 32);
    } else {
      bits.Put(magnitude, lm);
    }
  };
  ForEachModeledChange<T>(spans, is_float, count, s, window, code);
  out->clear();
  ByteVectorWriter(out)
      .U8(static_cast<uint8_t>(Method::kModeledRans))
      .Varint(count)
      .U8(static_cast<uint8_t>(class_base));
  std::vector<std::byte>& coded = s.record3;
  coded.clear();
  e.Finish(&coded);
  ByteVectorWriter(out).Varint(coded.size()).Bytes(coded.data(), coded.size());
  bits.Finish(out);
}

// Applies a modeled-rans record to the spans: out = base with the record's changes (in place
// when out is base).
template <typename T>
absl::Status DecodeModeledRans(ByteReader& r, absl::Span<const ChunkOutput> spans, bool is_float,
                               size_t n) {
  constexpr size_t w = sizeof(T);
  constexpr int kMaxMagnitudeLength = 8 * static_cast<int>(w) - 1;
  WB_ASSIGN_OR_RETURN(uint64_t count, r.Varint("modeled-rans change count"));
  if (count == 0 || count > n) {
    return absl::DataLossError(
        absl::StrFormat("modeled-rans record claims %d changes in %d elements", count, n));
  }
  WB_ASSIGN_OR_RETURN(uint8_t class_base, r.U8("modeled-rans class base"));
  if (class_base > 256 - kRansClassWindow) {
    return absl::DataLossError(absl::StrFormat(
        "modeled-rans class window starts at %d (at most %d)", class_base, 256 - kRansClassWindow));
  }
  const FindClassFn find = ChooseFindClass<T>();
  WB_ASSIGN_OR_RETURN(TwoStreams streams,
                      ReadTwoStreams(r, "modeled-rans symbol stream", "modeled-rans raw bits"));
  RansDecoder d(streams.first.data(), streams.first.size());
  BitReader bits(streams.rest.data(), streams.rest.size());
  RansContexts& ctx = ThreadContexts<RansContexts>();
  SpanCursor cursor, copied;
  for (uint64_t k = 0; k < count; ++k) {
    const uint32_t offset = d.Get<0>(ctx.classes);
    uint8_t c = static_cast<uint8_t>(class_base + offset);
    if (offset == kRansClassWindow) [[unlikely]] {
      c = static_cast<uint8_t>(bits.Get(8));
    }
    RansClassModels& m = ctx.Of(c);
    const uint32_t length_symbol = d.Get<1>(m.gap);
    const uint32_t change = d.Get<2>(m.change);
    int l = static_cast<int>(length_symbol), lm = static_cast<int>(change & 7);
    if (l == 15) [[unlikely]] {
      l += static_cast<int>(bits.Get(5));
    }
    if (lm == 7) [[unlikely]] {
      lm += static_cast<int>(bits.Get(6));
    }
    if (d.overrun() || bits.overrun()) [[unlikely]] {
      return absl::DataLossError(
          absl::StrFormat("modeled-rans record ends inside change %d of %d", k, count));
    }
    if (l > 32 || lm > kMaxMagnitudeLength) [[unlikely]] {
      return absl::DataLossError(absl::StrFormat(
          "modeled-rans change %d has a gap of %d bits or a magnitude of %d bits (at most 33 "
          "and %d)",
          k, l + 1, lm + 1, kMaxMagnitudeLength + 1));
    }
    const uint64_t gap = ((uint64_t{1} << l) | bits.Get(l)) - 1;
    uint64_t magnitude = uint64_t{1} << lm;
    if constexpr (w == 8) {
      if (lm > 32) {
        magnitude |= bits.Get(32);
        magnitude |= bits.Get(lm - 32) << 32;
      } else {
        magnitude |= bits.Get(lm);
      }
    } else {
      magnitude |= bits.Get(lm);
    }
    const uint32_t negative = change >> 3;
    if (absl::Status s = ApplyModeledChange<T>("modeled-rans", find, spans, is_float, k, c, gap,
                                               magnitude, negative, &cursor, &copied);
        !s.ok()) [[unlikely]] {
      return s;
    }
  }
  if (!d.Complete() || !bits.Complete()) {
    return absl::DataLossError(absl::StrFormat(
        "modeled-rans record's %d changes do not use its streams exactly (symbol stream of %d "
        "bytes, %d bytes of raw bits)",
        count, streams.first.size(), streams.rest.size()));
  }
  CopyRest(spans, copied, w);
  return absl::OkStatus();
}

template <typename T>
ChunkResult EncodeChunkT(DType dtype, absl::Span<const ChunkInput> spans, bool keyframe,
                         const EncodeOptions& options, std::vector<std::byte>* out) {
  const int level = options.zstd_level;
  const bool try_all = options.try_all_methods;
  constexpr size_t w = sizeof(T);
  Scratch& s = ThreadScratch();
  ChunkResult r;
  for (const ChunkInput& span : spans) r.raw_bytes += span.bytes;
  const size_t n = r.raw_bytes / w;
  const bool rotate = IsFloat(dtype);
  const size_t start = out->size();
  auto put_stored = [&] {
    out->resize(start);
    ByteVectorWriter record(out);
    record.U8(static_cast<uint8_t>(Method::kStored));
    for (const ChunkInput& span : spans) record.Bytes(span.target, span.bytes);
    r.method = Method::kStored;
  };
  auto emit = [&](Method m, const std::vector<std::byte>& record) {
    out->resize(start);
    out->insert(out->end(), record.begin(), record.end());
    r.method = m;
  };
  uint8_t* planes[8];
  auto split = [&](bool xor_base) {
    for (size_t b = 0; b < w; ++b) {
      Grow(s.planes[b], n);
      planes[b] = s.planes[b].data();
    }
    return SplitAll<T>(spans, rotate, xor_base, planes);
  };

  if (keyframe) {
    r.changed = n;
    split(false);
    bool all_stored = false;
    EncodePlanesRecord(Method::kPlanes, w, n, level, s, out, &all_stored);  // in place
    r.method = Method::kPlanes;
    if (all_stored || out->size() - start >= 1 + r.raw_bytes) put_stored();
    r.encoded_bytes = out->size() - start;
    return r;
  }

  // Delta: find the changed elements, grouped by magnitude for floats when a sample says the
  // groups differ enough.
  Grouping grouping;
  if (!options.context_model && IsFloat(dtype) && w >= 2 && options.max_groups > 1) {
    grouping = SampleGrouping<T>(spans, n, std::min(options.max_groups, kMaxGroups));
  }
  Grow(s.values, (n + 1) * w);
  size_t count = 0;
  bool complete = true;
  if (grouping.groups == 1) {
    Grow(s.positions, n + 1);
    uint64_t index = 0;
    for (const ChunkInput& span : spans) {
      ScanChanges<T>(span.base, span.target, span.bytes / w, index, n, s.positions.data(),
                     reinterpret_cast<T*>(s.values.data()), &count);
      index += span.bytes / w;
    }
  } else {
    Grow(s.groups, n + 1);
    Grow(s.ranks, n + 1);
    switch (grouping.groups) {
      case 2:
        count = ScanRanked<T, 2>(spans, grouping, s);
        break;
      case 3:
        count = ScanRanked<T, 3>(spans, grouping, s);
        break;
      default:
        count = ScanRanked<T, 4>(spans, grouping, s);
        break;
    }
  }
  if (complete && count == 0) {
    out->resize(start);
    ByteVectorWriter(out).U8(static_cast<uint8_t>(Method::kSame));
    r.method = Method::kSame;
    r.encoded_bytes = 1;
    return r;
  }
  bool have_sparse = false;
  Method sparse_method = Method::kSparse;  // of the candidate in s.record2
  if (complete) {
    r.changed = count;
    if (options.context_model && count <= n / kModeledMaxDivisor) {
      if (options.format_version >= 3) {
        EncodeModeledRansRecord<T>(spans, rotate, count, s, &s.record2);
        sparse_method = Method::kModeledRans;
      } else {
        EncodeModeledRecord<T>(spans, rotate, count, s, &s.record2);
        sparse_method = Method::kModeled;
      }
      r.modeled_bytes = s.record2.size();
      if (try_all) {
        EncodeSparseRecord<T>(grouping, count, level, s, &s.record);
        r.sparse_bytes = s.record.size();
        if (s.record.size() < s.record2.size()) {
          std::swap(s.record, s.record2);
          sparse_method = Method::kSparse;
        }
      }
    } else {
      EncodeSparseRecord<T>(grouping, count, level, s, &s.record2);
      r.sparse_bytes = s.record2.size();
    }
    have_sparse = true;
  }
  if (!complete || try_all || count > n / kXorMinDivisor) {
    const uint64_t changed = split(true);
    if (!complete) r.changed = changed;
    bool all_stored = false;
    s.record.clear();
    EncodePlanesRecord(Method::kXor, w, n, level, s, &s.record, &all_stored);
    r.xor_bytes = s.record.size();
    if (!have_sparse || s.record.size() < s.record2.size()) {
      emit(Method::kXor, s.record);
    } else {
      emit(sparse_method, s.record2);
    }
  } else {
    emit(sparse_method, s.record2);
  }
  if (out->size() - start >= 1 + r.raw_bytes) put_stored();
  r.encoded_bytes = out->size() - start;
  return r;
}

// Sparse changes are applied window by window (kWindowBytes of the chunk at a time): copy the
// window from the base (unless decoding in place), find where the window's changes go, apply
// them, so that each byte is touched while it is in the core's cache.
constexpr size_t kWindowBytes = size_t{16} << 10;

template <typename T>
void ApplyPlain(absl::Span<const ChunkOutput> spans, const DecodedGroup& g) {
  constexpr size_t w = sizeof(T);
  constexpr size_t kWindow = kWindowBytes / w;
  uint64_t k = 0;
  uint64_t first = 0;  // element index of the current span's start
  for (const ChunkOutput& span : spans) {
    const size_t n = span.bytes / w;
    for (size_t i = 0; i < n; i += kWindow) {
      const size_t m = std::min(kWindow, n - i);
      if (span.out != span.base) std::memcpy(span.out + i * w, span.base + i * w, m * w);
      const uint64_t end = first + i + m;
      for (; k < g.count && g.ranks[k] < end; ++k) {
        AddAt<T>(span.out + (g.ranks[k] - first) * w, GroupValue<T>(g, k));
      }
    }
    first += n;
  }
}

template <typename T, int K>
absl::Status ApplyGrouped(absl::Span<const ChunkOutput> spans, const Grouping& grouping,
                          const DecodedGroup* groups, Scratch& s) {
  constexpr size_t w = sizeof(T);
  constexpr size_t kBlock = BlockIndex<T, K>::kBlock;
  constexpr size_t kWindow = kWindowBytes / w;
  uint64_t before[K] = {};  // members of each group before the current window
  uint64_t next[K] = {};    // each group's next change
  Grow(s.targets, kWindow);
  Grow(s.target_values, kWindow * w);
  T* values = reinterpret_cast<T*>(s.target_values.data());
  for (const ChunkOutput& span : spans) {
    const size_t n = span.bytes / w;
    for (size_t i = 0; i < n; i += kWindow) {
      const size_t m = std::min(kWindow, n - i);
      const std::byte* base = span.base + i * w;
      std::byte* out = span.out + i * w;
      // Copy first: it streams the window into the cache, where the index then reads it.
      if (out != base) std::memcpy(out, base, m * w);
      const std::pair<const std::byte*, uint64_t> window[1] = {{base, m}};
      const BlockIndex<T, K> index(window, grouping, s);
      // Where this window's changes go: all found before any is applied, since base and out may
      // be the same array and a change can move an element to another class.
      size_t found = 0;
      for (int g = 0; g < K; ++g) {
        const uint64_t members = index.Total(g);
        uint64_t seen = before[g];  // members before block b
        size_t b = 0;
        const DecodedGroup& group = groups[g];
        for (; next[g] < group.count && group.ranks[next[g]] < before[g] + members; ++next[g]) {
          const uint64_t rank = group.ranks[next[g]];
          while (seen + index.Count(b, g) <= rank) seen += index.Count(b, g), ++b;
          const uint64_t bits = index.Members(0, b, g);
          s.targets[found] =
              out + (b * kBlock + Select(bits, static_cast<uint32_t>(rank - seen))) * w;
          values[found] = GroupValue<T>(group, next[g]);
          ++found;
        }
        before[g] += members;
      }
      for (size_t k = 0; k < found; ++k) AddAt<T>(s.targets[k], values[k]);
    }
  }
  for (int g = 0; g < K; ++g) {
    if (next[g] != groups[g].count) {
      return absl::DataLossError(
          absl::StrFormat("sparse group %d: change at rank %d is beyond the group's %d elements", g,
                          groups[g].ranks[next[g]], before[g]));
    }
  }
  return absl::OkStatus();
}

// Applies a sparse record to the spans (whose `out` already holds the base).
template <typename T>
absl::Status DecodeSparse(ByteReader& r, absl::Span<const ChunkOutput> spans, DType dtype, size_t n,
                          Scratch& s) {
  constexpr size_t w = sizeof(T);
  WB_ASSIGN_OR_RETURN(uint64_t count, r.Varint("sparse change count"));
  if (count == 0 || count > n) {
    return absl::DataLossError(
        absl::StrFormat("sparse record claims %d changes in %d elements", count, n));
  }
  WB_ASSIGN_OR_RETURN(uint8_t groups, r.U8("sparse group count"));
  if (groups < 1 || groups > kMaxGroups || (groups > 1 && !(IsFloat(dtype) && w >= 2))) {
    return absl::DataLossError(absl::StrFormat(
        "sparse record has %d groups (1..%d, more than 1 only for floats)", groups, kMaxGroups));
  }
  Grouping grouping;
  grouping.groups = groups;
  for (int j = 0; j < groups - 1; ++j) {
    WB_ASSIGN_OR_RETURN(grouping.threshold[j], r.U8("a group threshold"));
    if (j > 0 && grouping.threshold[j] <= grouping.threshold[j - 1]) {
      return absl::DataLossError("sparse group thresholds do not increase");
    }
  }
  Grow(s.ranks, count);
  DecodedGroup decoded[kMaxGroups];
  uint64_t total = 0;  // <= count: each group gets the room the earlier ones left
  for (int g = 0; g < groups; ++g) {
    WB_RETURN_IF_ERROR(GetGroup<T>(r, n, g, s, s.ranks.data() + total, count - total, &decoded[g]));
    total += decoded[g].count;
  }
  if (total != count) {
    return absl::DataLossError(
        absl::StrFormat("sparse record's groups hold %d changes, but it claims %d", total, count));
  }
  switch (groups) {
    case 1:  // ranks are positions
      ApplyPlain<T>(spans, decoded[0]);
      return absl::OkStatus();
    case 2:
      return ApplyGrouped<T, 2>(spans, grouping, decoded, s);
    case 3:
      return ApplyGrouped<T, 3>(spans, grouping, decoded, s);
    default:
      return ApplyGrouped<T, 4>(spans, grouping, decoded, s);
  }
}

template <typename T>
absl::Status DecodeChunkT(DType dtype, absl::Span<const ChunkOutput> spans, bool keyframe,
                          absl::Span<const std::byte> record) {
  constexpr size_t w = sizeof(T);
  Scratch& s = ThreadScratch();
  uint64_t total = 0;
  for (const ChunkOutput& span : spans) total += span.bytes;
  const size_t n = total / w;
  const bool rotate = IsFloat(dtype);
  ByteReader r(record.data(), record.size());
  WB_ASSIGN_OR_RETURN(uint8_t method, r.U8("chunk method"));
  if (method > static_cast<uint8_t>(Method::kModeledRans)) {
    return absl::DataLossError(absl::StrFormat("unknown chunk method %d", method));
  }
  const Method m = static_cast<Method>(method);
  if (keyframe && (m == Method::kSame || m == Method::kXor || m == Method::kSparse ||
                   m == Method::kModeled || m == Method::kModeledRans)) {
    return absl::DataLossError(
        absl::StrFormat("chunk method %s needs a base, but this is a keyframe", MethodName(m)));
  }
  auto copy_base = [&] {
    for (const ChunkOutput& span : spans) {
      if (span.base != span.out && span.bytes > 0) std::memmove(span.out, span.base, span.bytes);
    }
  };
  switch (m) {
    case Method::kSame:
      copy_base();
      break;
    case Method::kStored: {
      for (const ChunkOutput& span : spans) {
        WB_ASSIGN_OR_RETURN(const std::byte* at, r.Bytes(span.bytes, "stored chunk bytes"));
        if (span.bytes > 0) std::memcpy(span.out, at, span.bytes);
      }
      break;
    }
    case Method::kPlanes:
    case Method::kXor: {
      const uint8_t* planes[8];
      for (size_t b = 0; b < w; ++b) {
        WB_ASSIGN_OR_RETURN(planes[b], GetStream(r, n, s.planes[b], s, "byte plane"));
      }
      MergeAll<T>(spans, rotate, m == Method::kXor, planes);
      break;
    }
    case Method::kSparse:  // copies the base itself, window by window
      WB_RETURN_IF_ERROR(DecodeSparse<T>(r, spans, dtype, n, s));
      break;
    case Method::kModeled:  // these copy the base as they scan it (FindClass)
      WB_RETURN_IF_ERROR(DecodeModeled<T>(r, spans, rotate, n));
      break;
    case Method::kModeledRans:
      WB_RETURN_IF_ERROR(DecodeModeledRans<T>(r, spans, rotate, n));
      break;
  }
  if (r.remaining() != 0) {
    return absl::DataLossError(
        absl::StrFormat("%d bytes left over after a %s record", r.remaining(), MethodName(m)));
  }
  return absl::OkStatus();
}

}  // namespace

void DecodeWithBaselineScanForTesting(bool baseline) {
  baseline_scan_for_testing.store(baseline, std::memory_order_relaxed);
}

std::string_view MethodName(Method method) {
  switch (method) {
    case Method::kSame:
      return "same";
    case Method::kStored:
      return "stored";
    case Method::kPlanes:
      return "planes";
    case Method::kXor:
      return "xor";
    case Method::kSparse:
      return "sparse";
    case Method::kModeled:
      return "modeled";
    case Method::kModeledRans:
      return "modeled-rans";
  }
  return "?";
}

uint64_t LayoutChecksum(absl::Span<const TensorLayout> layout) {
  std::vector<std::byte> text;
  for (const TensorLayout& t : layout) {
    const std::string_view name = DTypeName(t.dtype);
    ByteVectorWriter(&text).Bytes(name).U8(0).U64(t.nbytes);
  }
  return Xxh3(text.data(), text.size());
}

std::vector<Chunk> PlanChunks(absl::Span<const TensorLayout> layout, uint64_t chunk_size) {
  std::vector<Chunk> chunks;
  for (DType dtype : kAllDTypes) {
    Chunk current;
    current.dtype = dtype;
    for (size_t t = 0; t < layout.size(); ++t) {
      if (layout[t].dtype != dtype) continue;
      uint64_t offset = 0;
      while (offset < layout[t].nbytes) {
        const uint64_t take = std::min(layout[t].nbytes - offset, chunk_size - current.bytes);
        current.pieces.push_back(Piece{static_cast<uint32_t>(t), offset, take});
        current.bytes += take;
        offset += take;
        if (current.bytes == chunk_size) {
          chunks.push_back(std::move(current));
          current = Chunk{};
          current.dtype = dtype;
        }
      }
    }
    if (current.bytes > 0) chunks.push_back(std::move(current));
  }
  return chunks;
}

absl::StatusOr<std::unique_ptr<Parallel>> Parallel::Create(int threads) {
  auto p = std::unique_ptr<Parallel>(new Parallel());
  const int total = WorkerPool::DefaultThreads(threads);
  if (total > 1) {
    WB_ASSIGN_OR_RETURN(p->pool_, WorkerPool::Create(total - 1));
  }
  return p;
}

void Parallel::For(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (!pool_ || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  TaskCounter helpers;
  const int extra = static_cast<int>(std::min<size_t>(pool_->size(), n - 1));
  auto run = [&] {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
  };
  helpers.Add(extra);
  for (int k = 0; k < extra; ++k) {
    pool_->Submit([&] {
      run();
      helpers.Done();
    });
  }
  run();
  helpers.WaitUntilZero(absl::InfiniteFuture());
}

ChunkResult EncodeChunk(DType dtype, absl::Span<const ChunkInput> spans, bool keyframe,
                        const EncodeOptions& options, std::vector<std::byte>* out) {
  return WithElement(DTypeSize(dtype), [&](auto t) {
    return EncodeChunkT<decltype(t)>(dtype, spans, keyframe, options, out);
  });
}

absl::Status DecodeChunk(DType dtype, absl::Span<const ChunkOutput> spans, bool keyframe,
                         absl::Span<const std::byte> record) {
  return WithElement(DTypeSize(dtype), [&](auto t) {
    return DecodeChunkT<decltype(t)>(dtype, spans, keyframe, record);
  });
}

namespace {

absl::Status CheckChunkSize(uint64_t chunk_size) {
  if (chunk_size < kMinChunkSize || chunk_size > kMaxChunkSize || chunk_size % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("delta chunk size %d is not a multiple of 64 in [%d, %d]", chunk_size,
                        kMinChunkSize, kMaxChunkSize));
  }
  return absl::OkStatus();
}

std::string DescribeChunk(const Chunk& c, size_t index) {
  return absl::StrFormat("chunk %d (%s, %d bytes of tensors %d..%d)", index, DTypeName(c.dtype),
                         c.bytes, c.pieces.front().tensor, c.pieces.back().tensor);
}

}  // namespace

absl::StatusOr<EncodedVersion> EncodeVersion(const VersionIds& ids,
                                             absl::Span<const TensorLayout> layout,
                                             absl::Span<const std::byte* const> base,
                                             absl::Span<const std::byte* const> target,
                                             const EncodeOptions& options, Parallel& parallel) {
  WB_RETURN_IF_ERROR(CheckChunkSize(options.chunk_size));
  if (options.format_version < 2 || options.format_version > kFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("delta encode: format version %d is not one this library writes (2..%d)",
                        options.format_version, kFormatVersion));
  }
  if (target.size() != layout.size() || (!ids.keyframe && base.size() != layout.size())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("delta encode: %d tensors in the layout, %d targets, %d bases",
                        layout.size(), target.size(), base.size()));
  }
  EncodedVersion v;
  v.chunks = PlanChunks(layout, options.chunk_size);
  v.results.resize(v.chunks.size());
  std::vector<std::vector<std::byte>> records(v.chunks.size());
  parallel.For(v.chunks.size(), [&](size_t c) {
    const Chunk& chunk = v.chunks[c];
    absl::InlinedVector<ChunkInput, 4> spans;
    for (const Piece& p : chunk.pieces) {
      spans.push_back(ChunkInput{ids.keyframe ? nullptr : base[p.tensor] + p.offset,
                                 target[p.tensor] + p.offset, p.bytes});
    }
    v.results[c] = EncodeChunk(chunk.dtype, spans, ids.keyframe, options, &records[c]);
  });
  std::vector<std::byte>& out = v.bytes;
  ByteVectorWriter w(&out);
  w.Bytes(kMagic, 4)
      .U8(options.format_version)
      .U8(ids.keyframe ? 0 : 1)
      .Varint(ids.target)
      .Varint(ids.base)
      .Varint(ids.keyframe_version)
      .Varint(options.chunk_size)
      .Varint(layout.size())
      .U64(LayoutChecksum(layout))
      .Varint(v.chunks.size());
  uint64_t total = 0;
  for (const std::vector<std::byte>& r : records) {
    w.Varint(r.size());
    total += r.size();
  }
  v.header_bytes = out.size();
  const uint64_t at = out.size() + total;
  out.reserve(at);
  for (std::vector<std::byte>& r : records) {
    out.insert(out.end(), r.begin(), r.end());
    std::vector<std::byte>().swap(r);  // keyframes: give each record's memory back at once
  }
  for (const ChunkResult& r : v.results) v.changed_elements += r.changed;
  for (const TensorLayout& t : layout) {
    const uint64_t bits = DTypeBits(t.dtype);  // elements of sub-byte dtypes too
    v.total_elements += t.nbytes / bits * 8 + t.nbytes % bits * 8 / bits;
  }
  return v;
}

absl::StatusOr<VersionHeader> ParseHeader(absl::Span<const std::byte> bytes) {
  ByteReader r(bytes.data(), bytes.size());
  WB_ASSIGN_OR_RETURN(const std::byte* magic, r.Bytes(4, "the magic"));
  if (std::memcmp(magic, kMagic, 4) != 0) {
    return absl::DataLossError("not an encoded weightbus delta version (bad magic)");
  }
  WB_ASSIGN_OR_RETURN(uint8_t format, r.U8("the format version"));
  if (format < kMinFormatVersion || format > kFormatVersion) {
    return absl::UnimplementedError(absl::StrFormat(
        "delta format version %d is not supported (this library reads versions %d..%d)", format,
        kMinFormatVersion, kFormatVersion));
  }
  VersionHeader h;
  WB_ASSIGN_OR_RETURN(uint8_t kind, r.U8("the kind"));
  if (kind > 1) return absl::DataLossError(absl::StrFormat("unknown version kind %d", kind));
  h.ids.keyframe = kind == 0;
  WB_ASSIGN_OR_RETURN(h.ids.target, r.Varint("the target version"));
  WB_ASSIGN_OR_RETURN(h.ids.base, r.Varint("the base version"));
  WB_ASSIGN_OR_RETURN(h.ids.keyframe_version, r.Varint("the keyframe version"));
  WB_ASSIGN_OR_RETURN(h.chunk_size, r.Varint("the chunk size"));
  if (absl::Status s = CheckChunkSize(h.chunk_size); !s.ok()) {
    return absl::DataLossError(s.message());
  }
  WB_ASSIGN_OR_RETURN(h.tensor_count, r.Varint("the tensor count"));
  WB_ASSIGN_OR_RETURN(const std::byte* sum, r.Bytes(8, "the layout checksum"));
  h.layout_checksum = LoadLe<uint64_t>(sum);
  WB_ASSIGN_OR_RETURN(uint64_t chunks, r.Varint("the chunk count"));
  if (chunks > bytes.size()) {  // every record has at least one byte
    return absl::DataLossError(
        absl::StrFormat("header claims %d chunks in %d bytes", chunks, bytes.size()));
  }
  h.record_sizes.resize(chunks);
  uint64_t total = 0;
  for (uint64_t& size : h.record_sizes) {
    WB_ASSIGN_OR_RETURN(size, r.Varint("a record size"));
    if (size == 0 || size > bytes.size() - total) {  // total <= bytes.size(): no wrap
      return absl::DataLossError(absl::StrFormat("record size %d is impossible", size));
    }
    total += size;
  }
  h.header_bytes = bytes.size() - r.remaining();
  if (total != r.remaining()) {
    return absl::DataLossError(absl::StrFormat(
        "the header's records add up to %d bytes but %d follow it", total, r.remaining()));
  }
  return h;
}

std::vector<Method> ChunkMethods(absl::Span<const std::byte> bytes, const VersionHeader& header) {
  std::vector<Method> out;
  out.reserve(header.record_sizes.size());
  uint64_t at = header.header_bytes;
  for (uint64_t size : header.record_sizes) {
    out.push_back(static_cast<Method>(static_cast<uint8_t>(bytes[at])));
    at += size;
  }
  return out;
}

absl::Status DecodeVersion(absl::Span<const std::byte> bytes, const VersionIds& expected,
                           absl::Span<const TensorLayout> layout,
                           absl::Span<const std::byte* const> base,
                           absl::Span<std::byte* const> out, Parallel& parallel,
                           const std::function<void(size_t)>& on_tensor_done) {
  WB_ASSIGN_OR_RETURN(VersionHeader h, ParseHeader(bytes));
  if (h.ids != expected) {
    return absl::DataLossError(absl::StrFormat(
        "encoded version says %s %d (base %d, keyframe %d) but %s %d (base %d, keyframe %d) was "
        "expected",
        h.ids.keyframe ? "keyframe" : "delta", h.ids.target, h.ids.base, h.ids.keyframe_version,
        expected.keyframe ? "keyframe" : "delta", expected.target, expected.base,
        expected.keyframe_version));
  }
  if (h.tensor_count != layout.size() || out.size() != layout.size() ||
      (!h.ids.keyframe && base.size() != layout.size())) {
    return absl::DataLossError(absl::StrFormat(
        "encoded version has %d tensors but its manifest lists %d", h.tensor_count, layout.size()));
  }
  if (h.layout_checksum != LayoutChecksum(layout)) {
    return absl::DataLossError(absl::StrFormat(
        "encoded version was made for other tensor dtypes or sizes than its manifest's (layout "
        "checksum %016x, manifest's %016x)",
        h.layout_checksum, LayoutChecksum(layout)));
  }
  const std::vector<Chunk> chunks = PlanChunks(layout, h.chunk_size);
  if (chunks.size() != h.record_sizes.size()) {
    return absl::DataLossError(absl::StrFormat(
        "encoded version has %d chunks but its manifest's tensors make %d chunks of %d bytes",
        h.record_sizes.size(), chunks.size(), h.chunk_size));
  }
  std::vector<uint64_t> offsets(chunks.size());
  uint64_t at = h.header_bytes;
  for (size_t c = 0; c < chunks.size(); ++c) {
    offsets[c] = at;
    at += h.record_sizes[c];
  }
  // Chunks per tensor, counted down as chunks finish.
  std::vector<std::atomic<uint32_t>> remaining(layout.size());
  for (const Chunk& c : chunks) {
    for (const Piece& p : c.pieces) remaining[p.tensor].fetch_add(1, std::memory_order_relaxed);
  }
  if (on_tensor_done) {
    for (size_t t = 0; t < layout.size(); ++t) {
      if (remaining[t].load(std::memory_order_relaxed) == 0) on_tensor_done(t);
    }
  }
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  size_t first_bad = chunks.size();
  absl::Status first_error;
  parallel.For(chunks.size(), [&](size_t c) {
    if (failed.load(std::memory_order_relaxed)) return;
    const Chunk& chunk = chunks[c];
    absl::InlinedVector<ChunkOutput, 4> spans;
    for (const Piece& p : chunk.pieces) {
      spans.push_back(ChunkOutput{h.ids.keyframe ? nullptr : base[p.tensor] + p.offset,
                                  out[p.tensor] + p.offset, p.bytes});
    }
    absl::Status s = DecodeChunk(chunk.dtype, spans, h.ids.keyframe,
                                 bytes.subspan(offsets[c], h.record_sizes[c]));
    if (!s.ok()) {
      failed.store(true);
      absl::MutexLock lock(&mu);
      if (c < first_bad) {
        first_bad = c;
        first_error =
            absl::DataLossError(absl::StrFormat("%s: %s", DescribeChunk(chunk, c), s.message()));
      }
      return;
    }
    for (const Piece& p : chunk.pieces) {
      if (remaining[p.tensor].fetch_sub(1, std::memory_order_acq_rel) == 1 && on_tensor_done) {
        on_tensor_done(p.tensor);
      }
    }
  });
  return first_error;
}

}  // namespace weightbus::internal::delta
