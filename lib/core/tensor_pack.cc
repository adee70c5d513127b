// SPDX-License-Identifier: Apache-2.0
#include "core/tensor_pack.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "core/cuda/device.h"
#include "core/utf8.h"

namespace weightbus::internal {
namespace {

// Walks every index of `shape` except the innermost dimension, calling fn(outer element offset)
// with the element offset of index [i0, ..., i_{n-2}, 0] under `strides`.
template <typename Fn>
void ForEachRow(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, Fn fn) {
  const size_t rank = shape.size();
  std::vector<int64_t> index(rank > 0 ? rank - 1 : 0, 0);
  int64_t offset = 0;
  while (true) {
    fn(offset);
    // Increment the (rank-1)-digit counter.
    size_t d = index.size();
    while (d > 0) {
      --d;
      if (++index[d] < shape[d]) {
        offset += strides[d];
        break;
      }
      offset -= strides[d] * (shape[d] - 1);
      index[d] = 0;
      if (d == 0) return;
    }
    if (index.empty()) return;
  }
}

template <typename Copy>
void Strided(size_t elem_size, const std::vector<int64_t>& shape,
             const std::vector<int64_t>& strides_in, Copy copy_row) {
  for (int64_t dim : shape) {
    if (dim == 0) return;
  }
  if (shape.empty()) {
    copy_row(0, 0, 1, 1);
    return;
  }
  std::vector<int64_t> strides = strides_in;
  if (strides.empty()) {
    strides.resize(shape.size());
    int64_t s = 1;
    for (size_t i = shape.size(); i-- > 0;) {
      strides[i] = s;
      s *= shape[i];
    }
  }
  const int64_t inner = shape.back();
  const int64_t inner_stride = strides.back();
  int64_t packed = 0;
  ForEachRow(shape, strides, [&](int64_t offset) {
    copy_row(offset, packed, inner, inner_stride);
    packed += inner;
  });
}

}  // namespace

static absl::Status CheckLayout(std::string_view name, const std::vector<int64_t>& shape,
                                const std::vector<int64_t>& strides, const void* data,
                                uint64_t nbytes, Device device) {
  if (!strides.empty() && strides.size() != shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor \"%s\": %d strides for a shape %s of rank %d", name, strides.size(),
                        ShapeString(shape), shape.size()));
  }
  if (data == nullptr && nbytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor \"%s\": data is null but shape %s holds %d bytes", name,
                        ShapeString(shape), nbytes));
  }
  if (device.type == DeviceType::kCuda) {
    if (!cuda::Built()) {
      return cuda::NotBuilt(absl::StrFormat("tensor \"%s\" on CUDA device %d", name, device.index));
    }
    if (device.index < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor \"%s\": CUDA device index %d is negative", name, device.index));
    }
  }
  return absl::OkStatus();
}

// Elements of sub-byte dtypes (F4, F6_*) have no byte address: only contiguous tensors of them
// can be moved (as their packed bytes).
static absl::Status CheckSubByteContiguous(std::string_view name, DType dtype,
                                           const std::vector<int64_t>& shape,
                                           const std::vector<int64_t>& strides) {
  if (IsSubByte(dtype) && !IsContiguous(shape, strides)) {
    return absl::UnimplementedError(absl::StrFormat(
        "tensor \"%s\" of %s (%d-bit elements, packed) has non-contiguous strides; only "
        "contiguous tensors of sub-byte dtypes are supported",
        name, DTypeName(dtype), DTypeBits(dtype)));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ValidateView(const TensorView& view) {
  if (view.name.empty()) {
    return absl::InvalidArgumentError("a tensor has an empty name");
  }
  if (view.name.size() > kMaxTensorNameBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor name \"%s...\" is %d bytes long, more than the limit of %d",
        absl::CHexEscape(view.name.substr(0, 64)), view.name.size(), kMaxTensorNameBytes));
  }
  if (view.shape.size() > kMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor \"%s\" has a shape of rank %d, more than the limit of %d",
                        view.name, view.shape.size(), kMaxRank));
  }
  size_t bad = 0;
  if (!IsValidUtf8(view.name, &bad)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor name \"%s\" is not valid UTF-8 (bad byte at offset %d)",
                        absl::CHexEscape(view.name), bad));
  }
  absl::StatusOr<uint64_t> nbytes = ByteSize(view.dtype, view.shape);
  if (!nbytes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor \"%s\": %s", view.name, nbytes.status().message()));
  }
  if (absl::Status s =
          CheckLayout(view.name, view.shape, view.strides, view.data, *nbytes, view.device);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSubByteContiguous(view.name, view.dtype, view.shape, view.strides);
      !s.ok()) {
    return s;
  }
  if (view.shard) {
    const Shard& sh = *view.shard;
    if (sh.global_shape.size() != view.shape.size() || sh.offsets.size() != view.shape.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor \"%s\": shard global_shape %s and offsets %s must have the rank of shape %s",
          view.name, ShapeString(sh.global_shape), ShapeString(sh.offsets),
          ShapeString(view.shape)));
    }
    for (size_t d = 0; d < view.shape.size(); ++d) {
      if (sh.offsets[d] < 0 || sh.global_shape[d] < 0 ||
          sh.offsets[d] > sh.global_shape[d] - view.shape[d]) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "tensor \"%s\": slice of shape %s at offsets %s does not fit in global shape %s "
            "(dimension %d)",
            view.name, ShapeString(view.shape), ShapeString(sh.offsets),
            ShapeString(sh.global_shape), d));
      }
    }
  }
  return *nbytes;
}

absl::StatusOr<uint64_t> ValidateDestination(std::string_view name, const Destination& dest) {
  absl::StatusOr<uint64_t> nbytes = ByteSize(dest.dtype, dest.shape);
  if (!nbytes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("destination for \"%s\": %s", name, nbytes.status().message()));
  }
  // Elements of a destination must not share memory; a zero stride on a dimension of size > 1
  // would make several received elements land on one address.
  for (size_t d = 0; d < dest.strides.size() && d < dest.shape.size(); ++d) {
    if (dest.strides[d] == 0 && dest.shape[d] > 1 && *nbytes > 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "destination for \"%s\": stride 0 on dimension %d of shape %s makes elements overlap",
          name, d, ShapeString(dest.shape)));
    }
  }
  if (absl::Status s = CheckLayout(name, dest.shape, dest.strides, dest.data, *nbytes, dest.device);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSubByteContiguous(name, dest.dtype, dest.shape, dest.strides);
      !s.ok()) {
    return s;
  }
  return *nbytes;
}

namespace {

// Copies `count` elements of `es` bytes from `in` (every `stride` elements) to `out`
// (contiguous), with fixed-size copies for the common element sizes (a memcpy call per element
// would dominate a transposed gather).
template <size_t kSize>
void GatherFixed(std::byte* out, const std::byte* in, int64_t count, int64_t stride) {
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(out + i * static_cast<int64_t>(kSize),
                in + i * stride * static_cast<int64_t>(kSize), kSize);
  }
}

void Gather(std::byte* out, const std::byte* in, int64_t count, int64_t stride, size_t es) {
  switch (es) {
    case 1:
      return GatherFixed<1>(out, in, count, stride);
    case 2:
      return GatherFixed<2>(out, in, count, stride);
    case 4:
      return GatherFixed<4>(out, in, count, stride);
    case 8:
      return GatherFixed<8>(out, in, count, stride);
    case 16:
      return GatherFixed<16>(out, in, count, stride);
    default:
      for (int64_t i = 0; i < count; ++i) {
        std::memcpy(out + i * static_cast<int64_t>(es), in + i * stride * static_cast<int64_t>(es),
                    es);
      }
  }
}

}  // namespace

void PackStrided(const void* src, size_t elem_size, const std::vector<int64_t>& shape,
                 const std::vector<int64_t>& strides, std::byte* dst) {
  const auto* base = static_cast<const std::byte*>(src);
  Strided(elem_size, shape, strides,
          [&](int64_t offset, int64_t packed, int64_t count, int64_t stride) {
            std::byte* out = dst + packed * static_cast<int64_t>(elem_size);
            const std::byte* in = base + offset * static_cast<int64_t>(elem_size);
            if (stride == 1) {
              std::memcpy(out, in, count * elem_size);
              return;
            }
            Gather(out, in, count, stride, elem_size);
          });
}

void PackStridedRange(const void* src, size_t elem_size, const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& strides_in, uint64_t first, uint64_t count,
                      std::byte* dst) {
  if (count == 0) return;
  const auto* base = static_cast<const std::byte*>(src);
  const uint64_t es = elem_size;
  if (shape.empty()) {  // 0-d: one element
    std::memcpy(dst, base + first, count);
    return;
  }
  const size_t rank = shape.size();
  std::vector<int64_t> strides = strides_in;
  if (strides.empty()) {
    strides.resize(rank);
    int64_t s = 1;
    for (size_t d = rank; d-- > 0;) {
      strides[d] = s;
      s *= shape[d];
    }
  }
  // The multi-index of the element holding byte `first`, and its offset in elements.
  std::vector<int64_t> idx(rank);
  uint64_t rem = first / es;
  for (size_t d = rank; d-- > 0;) {
    idx[d] = static_cast<int64_t>(rem % static_cast<uint64_t>(shape[d]));
    rem /= static_cast<uint64_t>(shape[d]);
  }
  int64_t off = 0;
  for (size_t d = 0; d < rank; ++d) off += idx[d] * strides[d];
  uint64_t skip = first % es;  // bytes of the first element before the range
  uint64_t left = count;
  const int64_t inner = shape.back(), stride = strides.back();
  while (left > 0) {
    while (idx.back() < inner && left > 0) {
      const std::byte* el = base + off * static_cast<int64_t>(es);
      if (skip > 0 || left < es) {  // a partial element at either end of the range
        const uint64_t n = std::min(es - skip, left);
        std::memcpy(dst, el + skip, n);
        dst += n;
        left -= n;
        skip = 0;
        ++idx.back();
        off += stride;
        continue;
      }
      const int64_t run = std::min<int64_t>(inner - idx.back(), static_cast<int64_t>(left / es));
      if (stride == 1) {
        std::memcpy(dst, el, static_cast<size_t>(run) * es);
      } else {
        Gather(dst, el, run, stride, es);
      }
      dst += static_cast<size_t>(run) * es;
      left -= static_cast<uint64_t>(run) * es;
      idx.back() += run;
      off += run * stride;
    }
    if (left == 0) break;
    // Next row: carry into the outer dimensions.
    off -= idx.back() * stride;
    idx.back() = 0;
    for (size_t d = rank - 1; d-- > 0;) {
      ++idx[d];
      off += strides[d];
      if (idx[d] < shape[d]) break;
      off -= idx[d] * strides[d];
      idx[d] = 0;
    }
  }
}

void UnpackStrided(const std::byte* src, size_t elem_size, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, void* dst) {
  auto* base = static_cast<std::byte*>(dst);
  Strided(elem_size, shape, strides,
          [&](int64_t offset, int64_t packed, int64_t count, int64_t stride) {
            const std::byte* in = src + packed * static_cast<int64_t>(elem_size);
            std::byte* out = base + offset * static_cast<int64_t>(elem_size);
            if (stride == 1) {
              std::memcpy(out, in, count * elem_size);
              return;
            }
            for (int64_t i = 0; i < count; ++i) {
              std::memcpy(out + i * stride * static_cast<int64_t>(elem_size), in + i * elem_size,
                          elem_size);
            }
          });
}

}  // namespace weightbus::internal
