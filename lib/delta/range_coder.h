// SPDX-License-Identifier: Apache-2.0
// An adaptive binary range coder (the carry-less coder of LZMA: 32-bit range, 12-bit
// probabilities): what the codec's "modeled" method (docs/FORMAT.md) codes its decisions with.
// Each context's probability adapts to the decisions coded with it, fast at first (half the
// distance after the first decision, about 1/(n + 2) after n) and by 1/16 from the 8th on, so a
// context model costs no table in the stream and a rarely used context learns quickly.
//
// Not thread-safe; one coder per chunk. The decoder never reads outside its input: reading
// past the end yields zero bytes and marks the input overrun, which the caller reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace weightbus::internal::delta {

// A context: the probability that its next decision is 0 in units of 2^-kProbBits (top 12
// bits) and how many decisions it has seen, saturating at 15 (low 4 bits).
using Prob = uint16_t;
inline constexpr int kProbBits = 12;
inline constexpr Prob kProbHalf = Prob{1} << (kProbBits - 1) << 4;

// The context after coding `bit` with it.
inline __attribute__((always_inline)) Prob Adapt(Prob p, uint32_t bit) {
  // Shift of the adaptation step after n decisions.
  static constexpr uint8_t kShift[16] = {1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4};
  const uint32_t n = p & 15u, q = p >> 4, shift = kShift[n];
  const uint32_t next = bit ? q - (q >> shift) : q + (((1u << kProbBits) - q) >> shift);
  return static_cast<Prob>((next << 4) | (n + (n < 15)));
}

class RangeEncoder {
 public:
  explicit RangeEncoder(std::vector<std::byte>* out) : out_(out) {}

  // Branch-free but for the renormalization: the decisions of a context model are hard to
  // predict.
  __attribute__((always_inline)) void Bit(Prob& p, uint32_t bit) {
    const uint32_t bound = (range_ >> kProbBits) * (p >> 4);
    const uint32_t one = 0u - bit;  // all ones for a 1
    low_ += bound & one;
    range_ = (bound & ~one) | ((range_ - bound) & one);
    p = Adapt(p, bit);
    Normalize();
  }

  // `count` (<= 32) bits of `value`, most significant first, each with probability 1/2.
  void Direct(uint32_t value, int count) {
    for (int i = count - 1; i >= 0; --i) {
      range_ >>= 1;
      if ((value >> i) & 1) low_ += range_;
      Normalize();
    }
  }

  // Writes what is still buffered; the coder must not be used afterwards.
  void Finish() {
    for (int i = 0; i < 5; ++i) ShiftLow();
  }

 private:
  __attribute__((always_inline)) void Normalize() {
    while (range_ < (1u << 24)) {
      range_ <<= 8;
      ShiftLow();
    }
  }
  void ShiftLow() {
    if (static_cast<uint32_t>(low_) < 0xff000000u || (low_ >> 32) != 0) {
      const uint8_t carry = static_cast<uint8_t>(low_ >> 32);
      uint8_t byte = cache_;
      do {
        out_->push_back(static_cast<std::byte>(static_cast<uint8_t>(byte + carry)));
        byte = 0xff;
      } while (--pending_ != 0);
      cache_ = static_cast<uint8_t>(static_cast<uint32_t>(low_) >> 24);
    }
    ++pending_;
    low_ = (low_ & 0x00ffffffu) << 8;
  }

  std::vector<std::byte>* out_;
  uint64_t low_ = 0;
  uint32_t range_ = 0xffffffffu;
  uint8_t cache_ = 0;
  uint64_t pending_ = 1;
};

class RangeDecoder {
 public:
  RangeDecoder(const std::byte* data, size_t size) : at_(data), end_(data + size) {
    for (int i = 0; i < 5; ++i) code_ = (code_ << 8) | Next();
  }

  __attribute__((always_inline)) uint32_t Bit(Prob& p) {
    const uint32_t bound = (range_ >> kProbBits) * (p >> 4);
    const uint32_t bit = code_ >= bound;
    const uint32_t one = 0u - bit;
    code_ -= bound & one;
    range_ = (bound & ~one) | ((range_ - bound) & one);
    p = Adapt(p, bit);
    Normalize();
    return bit;
  }

  uint32_t Direct(int count) {
    uint32_t value = 0;
    for (int i = 0; i < count; ++i) {
      range_ >>= 1;
      const uint32_t bit = code_ >= range_;
      code_ -= range_ & (0u - bit);
      value = (value << 1) | bit;
      Normalize();
    }
    return value;
  }

  // True when the decoder asked for bytes beyond its input.
  bool overrun() const { return overrun_; }
  // Input bytes not consumed (an encoder's whole output is consumed exactly).
  size_t remaining() const { return static_cast<size_t>(end_ - at_); }

 private:
  __attribute__((always_inline)) uint32_t Next() {
    if (at_ == end_) {
      overrun_ = true;
      return 0;
    }
    return static_cast<uint8_t>(*at_++);
  }
  __attribute__((always_inline)) void Normalize() {
    while (range_ < (1u << 24)) {
      range_ <<= 8;
      code_ = (code_ << 8) | Next();
    }
  }

  const std::byte* at_;
  const std::byte* end_;
  uint32_t code_ = 0;
  uint32_t range_ = 0xffffffffu;
  bool overrun_ = false;
};

}  // namespace weightbus::internal::delta
