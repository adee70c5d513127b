// SPDX-License-Identifier: Apache-2.0
// bfloat16 <-> float32 conversion.
//
// bfloat16 is the upper half of an IEEE-754 binary32: 1 sign bit, 8 exponent bits, 7 mantissa
// bits. Narrowing rounds to nearest, ties to even (as torch.Tensor.to(torch.bfloat16) and
// Eigen::bfloat16 do); widening is exact.
#pragma once

#include <bit>
#include <cstdint>

namespace weightbus::tools {

// Rounds `value` to the nearest bfloat16, ties to even, and returns its bit pattern.
// Finite values too large for bfloat16 (>= 0x1.ffp127 in magnitude after rounding, e.g.
// FLT_MAX) become +/-inf, infinities stay infinities, and a NaN stays a NaN of the same sign
// with the quiet bit set (its payload truncated to the top 7 mantissa bits), never an infinity.
inline uint16_t FloatToBf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: truncating could clear every mantissa bit
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Adding 0x7fff rounds halves down and more-than-halves up; adding the lowest kept bit as
  // well turns exact halves up exactly when that bit is odd (ties to even). A carry out of the
  // mantissa correctly increments the exponent (up to inf).
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The float32 equal to the bfloat16 bit pattern `bits` (exact).
inline float Bf16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

}  // namespace weightbus::tools
