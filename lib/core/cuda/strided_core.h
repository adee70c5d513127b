// SPDX-License-Identifier: Apache-2.0
// The index arithmetic of strided views as __host__ __device__ code: the packing kernels
// (core/cuda/kernels.cu) gather a strided CUDA view into contiguous row-major order, and scatter
// it back, one element per thread with ElementOffset; the host tests
// (tests/device_kernels_test.cc) run the same functions against PackStrided / UnpackStrided
// (core/tensor_pack.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/cuda/hd.h"

namespace weightbus::internal::strided {

// The most dimensions a layout keeps (weightbus::kMaxRank): a kernel takes it by value.
inline constexpr int kMaxDims = 64;

// A view's shape and strides (elements) with the dimensions that do not change the row-major
// walk removed (MakeLayout): a transposed matrix stays 2-D, a contiguous tensor becomes 1-D.
struct Layout {
  int rank = 0;        // 0: one element (a 0-d tensor, or every dimension of size 1)
  uint64_t count = 1;  // elements: the product of shape
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

// Offset in elements, from element [0, ..., 0], of the element at row-major position `linear`
// (0 <= linear < count).
WB_HD int64_t ElementOffset(const Layout& layout, uint64_t linear) {
  int64_t offset = 0;
  for (int d = layout.rank - 1; d > 0; --d) {
    const uint64_t n = static_cast<uint64_t>(layout.shape[d]);
    offset += static_cast<int64_t>(linear % n) * layout.strides[d];
    linear /= n;
  }
  if (layout.rank > 0) offset += static_cast<int64_t>(linear) * layout.strides[0];
  return offset;
}

// The Layout of `shape` with `strides` (empty: row-major): dimensions of size 1 dropped, and
// neighbours merged where the outer stride is the inner one times the inner size (the pair is
// then one run). A shape with a zero dimension has count 0. Host code.
inline Layout MakeLayout(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  Layout out;
  std::vector<int64_t> full = strides;
  if (full.empty()) {
    full.resize(shape.size());
    int64_t s = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      full[d] = s;
      s *= shape[d];
    }
  }
  for (int64_t n : shape) out.count *= static_cast<uint64_t>(n);
  if (out.count == 0) return out;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (out.rank > 0 && out.strides[out.rank - 1] == full[d] * shape[d]) {
      out.shape[out.rank - 1] *= shape[d];
      out.strides[out.rank - 1] = full[d];
      continue;
    }
    out.shape[out.rank] = shape[d];
    out.strides[out.rank] = full[d];
    ++out.rank;
  }
  return out;
}

}  // namespace weightbus::internal::strided
