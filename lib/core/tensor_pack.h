// SPDX-License-Identifier: Apache-2.0
// Validation of tensor views and conversion between strided layouts and packed row-major bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/utf8.h"  // IsValidUtf8, which ValidateView applies to names
#include "weightbus/types.hpp"

namespace weightbus::internal {

// Checks a view to be published: non-empty valid UTF-8 name of at most kMaxTensorNameBytes,
// valid shape of rank at most kMaxRank, strides of matching rank, data non-null unless empty,
// shard consistent with the shape. A CUDA device is accepted in builds with CUDA (whether the
// device exists is checked where its memory is used, core/cuda/device.h). Returns the packed byte
// size. Errors: InvalidArgument naming the tensor; Unimplemented for a CUDA tensor in a build
// without CUDA (cuda::NotBuilt).
absl::StatusOr<uint64_t> ValidateView(const TensorView& view);

// Checks a destination for tensor `name`, as ValidateView. Returns its packed byte size.
absl::StatusOr<uint64_t> ValidateDestination(std::string_view name, const Destination& dest);

// Copies the strided tensor at `src` (element [0..0], `strides` in elements) into `dst` as
// contiguous row-major bytes. Any strides, including zero and negative, are accepted.
void PackStrided(const void* src, size_t elem_size, const std::vector<int64_t>& shape,
                 const std::vector<int64_t>& strides, std::byte* dst);

// Bytes [first, first + count) of what PackStrided would write, written to `dst`: a window of
// the packed image, so a strided tensor can be streamed without packing it whole. The range may
// start and end inside an element; it must lie within the tensor's packed size.
void PackStridedRange(const void* src, size_t elem_size, const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& strides, uint64_t first, uint64_t count,
                      std::byte* dst);

// The inverse: scatters contiguous row-major `src` into the strided tensor at `dst`.
void UnpackStrided(const std::byte* src, size_t elem_size, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, void* dst);

}  // namespace weightbus::internal
