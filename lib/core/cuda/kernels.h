// SPDX-License-Identifier: Apache-2.0
// Launchers of the device kernels (core/cuda/kernels.cu, compiled by nvcc when the build has
// CUDA). Each enqueues its kernel on `stream` (a cudaStream_t of the current device) and returns
// the launch's cudaError_t as an int (0: cudaSuccess); completion is the stream's. Every pointer
// named `*_dev` and every data pointer is device memory (or host memory the device can read:
// mapped pinned memory). The core calls them through core/cuda/device.h, never directly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cuda/hash_plan.h"
#include "core/cuda/strided_core.h"

namespace weightbus::internal::cuda_kernels {

// Sets lanes_dev[s * 8 + l] to XXH3's initial lane l, for `segments` segments.
int InitLanes(uint64_t* lanes_dev, size_t segments, void* stream);
// Lane sums of XXH3 blocks [begin, end) of `ranges_dev` (device_hash::SumOf) into
// window_dev[(g - begin) * 8 + lane].
int BlockSums(const device_hash::SumRange* ranges_dev, size_t ranges, uint64_t begin, uint64_t end,
              uint64_t* window_dev, void* stream);
// Advances each segment's lanes through the sums of window [begin, end)
// (device_hash::ChainWindow).
int Chain(const device_hash::Segment* segments_dev, size_t segments, uint64_t begin, uint64_t end,
          const uint64_t* window_dev, uint64_t* lanes_dev, void* stream);
// out_dev[s] = the checksum of segment s (device_hash::FinishSegment).
int Finish(const device_hash::Segment* segments_dev, size_t segments, const uint64_t* lanes_dev,
           uint64_t* out_dev, void* stream);

// Elements [first, first + count) of the row-major walk of the view at `src` (element
// [0, ..., 0]; `layout` from strided::MakeLayout; `elem` bytes each) to dst[0, count): a gather.
int Gather(const void* src, size_t elem, const strided::Layout& layout, uint64_t first,
           uint64_t count, void* dst, void* stream);
// The inverse: src[0, count) to elements [first, first + count) of the view at `dst` (a layout
// whose elements do not overlap).
int Scatter(const void* src, size_t elem, const strided::Layout& layout, uint64_t first,
            uint64_t count, void* dst, void* stream);

}  // namespace weightbus::internal::cuda_kernels
