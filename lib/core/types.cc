// SPDX-License-Identifier: Apache-2.0
#include "weightbus/types.hpp"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace weightbus {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return "BOOL";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kU16:
      return "U16";
    case DType::kI16:
      return "I16";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kU32:
      return "U32";
    case DType::kI32:
      return "I32";
    case DType::kF32:
      return "F32";
    case DType::kU64:
      return "U64";
    case DType::kI64:
      return "I64";
    case DType::kF64:
      return "F64";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E5M2:
      return "F8_E5M2";
    case DType::kF8E8M0:
      return "F8_E8M0";
    case DType::kF8E4M3FNUZ:
      return "F8_E4M3FNUZ";
    case DType::kF8E5M2FNUZ:
      return "F8_E5M2FNUZ";
    case DType::kC64:
      return "C64";
    case DType::kF4:
      return "F4";
    case DType::kF6E2M3:
      return "F6_E2M3";
    case DType::kF6E3M2:
      return "F6_E3M2";
  }
  return "INVALID";
}

size_t DTypeBits(DType dtype) {
  switch (dtype) {
    case DType::kF4:
      return 4;
    case DType::kF6E2M3:
    case DType::kF6E3M2:
      return 6;
    default:
      return 8 * DTypeSize(dtype);
  }
}

bool IsSubByte(DType dtype) { return DTypeBits(dtype) % 8 != 0; }

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBool:
    case DType::kU8:
    case DType::kI8:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kF8E8M0:
    case DType::kF8E4M3FNUZ:
    case DType::kF8E5M2FNUZ:
    case DType::kF4:  // sub-byte: rounded up (DTypeBits is exact)
    case DType::kF6E2M3:
    case DType::kF6E3M2:
      return 1;
    case DType::kU16:
    case DType::kI16:
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kU32:
    case DType::kI32:
    case DType::kF32:
      return 4;
    case DType::kU64:
    case DType::kI64:
    case DType::kF64:
    case DType::kC64:
      return 8;
  }
  return 0;
}

absl::StatusOr<DType> DTypeFromName(std::string_view name) {
  for (DType dtype : kAllDTypes) {
    if (DTypeName(dtype) == name) return dtype;
  }
  std::vector<std::string> names;
  for (DType dtype : kAllDTypes) names.emplace_back(DTypeName(dtype));
  return absl::InvalidArgumentError(absl::StrFormat("unknown dtype \"%s\" (expected one of %s)",
                                                    name, absl::StrJoin(names, ", ")));
}

absl::StatusOr<int64_t> NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shape %s has a negative dimension %d at index %d", ShapeString(shape), shape[d], d));
    }
    if (shape[d] != 0 && n > std::numeric_limits<int64_t>::max() / shape[d]) {
      return absl::InvalidArgumentError(
          absl::StrFormat("shape %s has more than 2^63 elements", ShapeString(shape)));
    }
    n *= shape[d];
  }
  return n;
}

absl::StatusOr<uint64_t> ByteSize(DType dtype, const std::vector<int64_t>& shape) {
  absl::StatusOr<int64_t> n = NumElements(shape);
  if (!n.ok()) return n.status();
  const uint64_t elements = static_cast<uint64_t>(*n);
  const uint64_t bits = DTypeBits(dtype);
  if (bits % 8 == 0) {
    const uint64_t elem = bits / 8;
    if (elements > std::numeric_limits<uint64_t>::max() / elem) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "shape %s of %s overflows a 64-bit byte count", ShapeString(shape), DTypeName(dtype)));
    }
    return elements * elem;
  }
  // Sub-byte (elements < 2^63, bits < 8: no overflow): whole groups of 8 elements, then the rest,
  // whose bits must make whole bytes.
  if (elements % 8 * bits % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shape %s of %s (%d-bit elements) holds %d elements, whose bits are not a whole number of "
        "bytes",
        ShapeString(shape), DTypeName(dtype), bits, elements));
  }
  return elements / 8 * bits + elements % 8 * bits / 8;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

bool IsContiguous(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  if (strides.empty()) return true;
  if (strides.size() != shape.size()) return false;
  for (int64_t dim : shape) {
    if (dim == 0) return true;
  }
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

}  // namespace weightbus
