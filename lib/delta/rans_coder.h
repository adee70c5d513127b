// SPDX-License-Identifier: Apache-2.0
// Adaptive 16-symbol models coded with interleaved rANS states and a raw bit stream: what
// the codec's "modeled-rans" method (format version 3, docs/FORMAT.md) codes its symbols with.
//
// rANS as in Fabian Giesen's ryg_rans (rans_word.h: 32-bit state in [2^16, 2^32), 16-bit
// renormalisation, at most one word per symbol) with kRansStates states interleaved in one
// stream (his "interleaved rANS" notes): each symbol uses the state its coder names, so a
// decoder's chains of symbols overlap. The models are LZNA's (Charles Bloom's "adaptive
// nibble" models): a 15-bit cumulative frequency table of 16 symbols, found by comparing the
// slot against all 16 bounds at once, and moved towards the coded symbol by a shift, with every
// symbol keeping a frequency of at least 1. One symbol of a 16-ary model replaces up to 15
// binary decisions of range_coder.h (a unary length), and the decoder has no branch per symbol.
//
// Not thread-safe; one coder per chunk. The decoder never reads outside its input: reading past
// the end yields zeros and marks the input overrun, which the caller reports.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace weightbus::internal::delta {

inline constexpr int kRansScaleBits = 15;
inline constexpr uint32_t kRansScale = 1u << kRansScaleBits;
inline constexpr uint32_t kRansLow = 1u << 16;  // states lie in [kRansLow, 2^32)
inline constexpr int kRansStates = 3;
// Models adapt by 1/2^bit_width(n + 1) after n symbols, until n reaches this.
inline constexpr uint16_t kRansSlowCount = 63;

// A 16-symbol model: symbol s has the slots [cdf[s], cdf[s + 1]) of kRansScale, each symbol at
// least one; `count` symbols coded with it so far (saturating), which sets the adaptation rate.
struct alignas(16) NibbleModel {
  uint16_t cdf[17];
  uint16_t count;

  // Starts the model with every symbol equally likely.
  void Reset() {
    for (uint32_t i = 0; i <= 16; ++i) cdf[i] = static_cast<uint16_t>(i * (kRansScale / 16));
    count = 0;
  }

  // Moves the model towards `sym`: every bound by 1/2^shift of its distance to the bounds of a
  // model that gives `sym` all slots but one per other symbol. The adaptation is fast at first
  // (half way after the first symbol, about 1/n after n) and 1/128 from the 63rd on. Bounds stay
  // strictly increasing: c + floor((t - c) / 2^shift) is non-decreasing in c and t, and both the
  // bounds minus their index and the target's are non-decreasing.
  __attribute__((always_inline)) void Update(uint32_t sym) {
    const int shift = std::bit_width(uint32_t{count} + 1u);  // 1, 2, 2, 3 x 4, ...
    count = static_cast<uint16_t>(count + (count < kRansSlowCount));
#if defined(__SSE2__)
    const __m128i s = _mm_set1_epi16(static_cast<int16_t>(sym));
    const __m128i index_lo = _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7);
    const __m128i index_hi = _mm_setr_epi16(8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i top = _mm_set1_epi16(static_cast<int16_t>(kRansScale - 16));
    const __m128i count_shift = _mm_cvtsi32_si128(shift);
    __m128i lo = _mm_load_si128(reinterpret_cast<const __m128i*>(cdf));
    __m128i hi = _mm_load_si128(reinterpret_cast<const __m128i*>(cdf + 8));
    const __m128i t_lo = _mm_add_epi16(_mm_and_si128(_mm_cmpgt_epi16(index_lo, s), top), index_lo);
    const __m128i t_hi = _mm_add_epi16(_mm_and_si128(_mm_cmpgt_epi16(index_hi, s), top), index_hi);
    lo = _mm_add_epi16(lo, _mm_sra_epi16(_mm_sub_epi16(t_lo, lo), count_shift));
    hi = _mm_add_epi16(hi, _mm_sra_epi16(_mm_sub_epi16(t_hi, hi), count_shift));
    _mm_store_si128(reinterpret_cast<__m128i*>(cdf), lo);
    _mm_store_si128(reinterpret_cast<__m128i*>(cdf + 8), hi);
#else
    for (uint32_t i = 1; i < 16; ++i) {
      const int32_t t = static_cast<int32_t>(i > sym ? kRansScale - 16 + i : i);
      const int32_t c = cdf[i];
      cdf[i] = static_cast<uint16_t>(c + ((t - c) >> shift));  // arithmetic shift (C++20)
    }
#endif
  }

  // The symbol whose slots hold `slot` (< kRansScale).
  __attribute__((always_inline)) uint32_t Find(uint32_t slot) const {
#if defined(__SSE2__)
    const __m128i v = _mm_set1_epi16(static_cast<int16_t>(slot));
    const __m128i lo = _mm_load_si128(reinterpret_cast<const __m128i*>(cdf));
    const __m128i hi = _mm_load_si128(reinterpret_cast<const __m128i*>(cdf + 8));
    const uint32_t above = static_cast<uint32_t>(
        _mm_movemask_epi8(_mm_packs_epi16(_mm_cmpgt_epi16(lo, v), _mm_cmpgt_epi16(hi, v))));
    // The bounds above the slot are a suffix (bounds increase): the symbol is the last lane
    // before it. (countr_zero is one instruction on baseline x86-64, popcount is not.)
    return static_cast<uint32_t>(std::countr_zero(above | 0x10000u)) - 1;
#else
    uint32_t s = 0;
    while (s < 15 && cdf[s + 1] <= slot) ++s;
    return s;
#endif
  }
};

// Encodes symbols in order; they are coded in reverse at Finish (rANS is last in, first out).
class RansEncoder {
 public:
  // Codes `sym` (< 16) with `m` in state `state` (< kRansStates) and adapts `m`.
  __attribute__((always_inline)) void Put(NibbleModel& m, uint32_t sym, uint32_t state) {
    const uint32_t start = m.cdf[sym];
    symbols_.push_back(Entry{static_cast<uint16_t>(start),
                             static_cast<uint16_t>(m.cdf[sym + 1] - start - 1),
                             static_cast<uint8_t>(state)});
    m.Update(sym);
  }

  // Appends the coded stream to `out`: the final states (32-bit little-endian, state 0
  // first), then the 16-bit little-endian words in the order the decoder reads them.
  void Finish(std::vector<std::byte>* out) {
    uint32_t x[kRansStates];
    std::fill(std::begin(x), std::end(x), kRansLow);
    words_.clear();
    for (size_t k = symbols_.size(); k-- > 0;) {
      const Entry& e = symbols_[k];
      const uint32_t freq = uint32_t{e.freq_minus_1} + 1;
      uint32_t& s = x[e.state];
      if (s >= (freq << (32 - kRansScaleBits))) {  // ((kRansLow >> scale) << 16) * freq
        words_.push_back(static_cast<uint16_t>(s));
        s >>= 16;
      }
      s = ((s / freq) << kRansScaleBits) + s % freq + e.start;
    }
    const size_t at = out->size();
    out->resize(at + 4 * kRansStates + 2 * words_.size());
    std::byte* p = out->data() + at;
    for (int i = 0; i < kRansStates; ++i) {
      for (int b = 0; b < 4; ++b) *p++ = static_cast<std::byte>(x[i] >> (8 * b));
    }
    for (size_t k = words_.size(); k-- > 0;) {
      *p++ = static_cast<std::byte>(words_[k]);
      *p++ = static_cast<std::byte>(words_[k] >> 8);
    }
    symbols_.clear();
  }

  void Clear() { symbols_.clear(); }

 private:
  struct Entry {
    uint16_t start, freq_minus_1;
    uint8_t state;
  };
  std::vector<Entry> symbols_;
  std::vector<uint16_t> words_;
};

class RansDecoder {
 public:
  RansDecoder(const std::byte* data, size_t size) : at_(data), end_(data + size) {
    for (uint32_t& s : x_) {
      s = Word();
      s |= Word() << 16;
    }
  }

  // The next symbol of `m` in state `state`; adapts `m`.
  template <int kState>
  __attribute__((always_inline)) uint32_t Get(NibbleModel& m) {
    uint32_t& s = x_[kState];
    const uint32_t slot = s & (kRansScale - 1);
    const uint32_t sym = m.Find(slot);
    const uint32_t start = m.cdf[sym];
    s = (m.cdf[sym + 1] - start) * (s >> kRansScaleBits) + slot - start;
    // Branch-free renormalisation: at most one word (s >= 2 after decoding).
    const uint32_t need = s < kRansLow;
    uint32_t word = 0;
    if (end_ - at_ >= 2) {
      std::memcpy(&word, at_, 2);  // little-endian hosts (the codec's byte order)
    } else if (need) {
      overrun_ = true;
    }
    s = need ? (s << 16) | word : s;
    at_ += 2 * need;
    m.Update(sym);
    return sym;
  }

  bool overrun() const { return overrun_; }
  // True when every word was read and every state is back where the encoder started it: the
  // decoder read exactly what the encoder coded.
  bool Complete() const {
    return !overrun_ && at_ == end_ &&
           std::all_of(std::begin(x_), std::end(x_), [](uint32_t s) { return s == kRansLow; });
  }

 private:
  uint32_t Word() {
    if (end_ - at_ < 2) {
      overrun_ = true;
      at_ = end_;
      return 0;
    }
    const uint32_t w = static_cast<uint32_t>(static_cast<uint8_t>(at_[0])) |
                       static_cast<uint32_t>(static_cast<uint8_t>(at_[1])) << 8;
    at_ += 2;
    return w;
  }

  const std::byte* at_;
  const std::byte* end_;
  uint32_t x_[kRansStates] = {};
  bool overrun_ = false;
};

// Raw bits, least significant first, packed from the low bit of each byte.
class BitWriter {
 public:
  // The low `count` (<= 32) bits of `value`.
  void Put(uint64_t value, int count) {
    acc_ |= (value & ((uint64_t{1} << count) - 1)) << fill_;
    fill_ += count;
    while (fill_ >= 8) {
      bytes_.push_back(static_cast<std::byte>(acc_));
      acc_ >>= 8;
      fill_ -= 8;
    }
  }
  // Appends the bits to `out` (the last byte padded with zeros) and starts over.
  void Finish(std::vector<std::byte>* out) {
    if (fill_ > 0) bytes_.push_back(static_cast<std::byte>(acc_));
    out->insert(out->end(), bytes_.begin(), bytes_.end());
    Clear();
  }
  void Clear() {
    bytes_.clear();
    acc_ = 0;
    fill_ = 0;
  }

 private:
  std::vector<std::byte> bytes_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

class BitReader {
 public:
  BitReader(const std::byte* data, size_t size) : data_(data), size_(size) {}

  // The next `count` (<= 32) bits.
  __attribute__((always_inline)) uint64_t Get(int count) {
    const size_t byte = bit_ >> 3;
    uint64_t word = 0;
    if (byte + 8 <= size_) {
      std::memcpy(&word, data_ + byte, 8);  // little-endian hosts
    } else if (byte < size_) {
      for (size_t i = byte; i < size_; ++i) {
        word |= uint64_t{static_cast<uint8_t>(data_[i])} << (8 * (i - byte));
      }
    }
    const uint64_t value = (word >> (bit_ & 7)) & ((uint64_t{1} << count) - 1);
    bit_ += static_cast<uint64_t>(count);
    return value;
  }
  bool overrun() const { return bit_ > 8 * uint64_t{size_}; }
  // True when the bits read end in the input's last byte and its padding is zero.
  bool Complete() const {
    if (overrun() || (bit_ + 7) / 8 != size_) return false;
    return size_ == 0 || (bit_ & 7) == 0 ||
           (static_cast<uint8_t>(data_[size_ - 1]) >> (bit_ & 7)) == 0;
  }

 private:
  const std::byte* data_;
  size_t size_;
  uint64_t bit_ = 0;
};

}  // namespace weightbus::internal::delta
