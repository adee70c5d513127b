// SPDX-License-Identifier: Apache-2.0
// The core's device kernels: XXH3-64 checksums of device memory (hash_plan.h, xxh3_core.h) and
// gathering / scattering strided CUDA views (strided_core.h). Every kernel is a grid-stride loop
// over the same __host__ __device__ functions the host tests run; nothing here computes
// anything those functions do not.
#include <cuda_runtime.h>

#include <cstring>

#include "core/cuda/kernels.h"

namespace weightbus::internal::cuda_kernels {
namespace {

constexpr unsigned kThreads = 256;
constexpr uint64_t kMaxGrid = 1u << 16;  // grid-stride loops cover the rest

unsigned GridFor(uint64_t threads) {
  const uint64_t blocks = (threads + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxGrid ? (blocks > 0 ? blocks : 1) : kMaxGrid);
}

__device__ uint64_t ThreadIndex() {
  return static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ uint64_t ThreadCount() { return static_cast<uint64_t>(gridDim.x) * blockDim.x; }

// The 192-byte XXH3 secret, passed by value to each kernel and copied into shared memory, where
// every thread reads it at any offset.
struct Secret {
  uint64_t words[xxh3::kSecretSize / 8];
};

Secret MakeSecret() {
  Secret s;
  std::memcpy(s.words, xxh3::kSecret, sizeof(s.words));
  return s;
}

__device__ const uint8_t* LoadSecret(const Secret& secret, uint64_t* shared) {
  for (unsigned i = threadIdx.x; i < xxh3::kSecretSize / 8; i += blockDim.x) {
    shared[i] = secret.words[i];
  }
  __syncthreads();
  return reinterpret_cast<const uint8_t*>(shared);
}

__global__ void InitLanesKernel(uint64_t* lanes, uint64_t count) {
  for (uint64_t i = ThreadIndex(); i < count; i += ThreadCount()) {
    lanes[i] = xxh3::InitLane(static_cast<int>(i % xxh3::kLanes));
  }
}

__global__ void BlockSumsKernel(const device_hash::SumRange* ranges, size_t nranges, uint64_t begin,
                                uint64_t end, uint64_t* window, Secret secret) {
  __shared__ uint64_t shared[xxh3::kSecretSize / 8];
  const uint8_t* s = LoadSecret(secret, shared);
  const uint64_t total = (end - begin) * xxh3::kLanes;
  for (uint64_t t = ThreadIndex(); t < total; t += ThreadCount()) {
    window[t] = device_hash::SumOf(ranges, nranges, begin + t / xxh3::kLanes, s,
                                   static_cast<int>(t % xxh3::kLanes));
  }
}

__global__ void ChainKernel(const device_hash::Segment* segments, size_t nsegments, uint64_t begin,
                            uint64_t end, const uint64_t* window, uint64_t* lanes, Secret secret) {
  __shared__ uint64_t shared[xxh3::kSecretSize / 8];
  const uint8_t* s = LoadSecret(secret, shared);
  const uint64_t total = nsegments * xxh3::kLanes;
  for (uint64_t t = ThreadIndex(); t < total; t += ThreadCount()) {
    const device_hash::Segment& seg = segments[t / xxh3::kLanes];
    lanes[t] = device_hash::ChainWindow(seg, lanes[t], window, begin, end, s,
                                        static_cast<int>(t % xxh3::kLanes));
  }
}

__global__ void FinishKernel(const device_hash::Segment* segments, size_t nsegments,
                             const uint64_t* lanes, uint64_t* out, Secret secret) {
  __shared__ uint64_t shared[xxh3::kSecretSize / 8];
  const uint8_t* s = LoadSecret(secret, shared);
  for (uint64_t i = ThreadIndex(); i < nsegments; i += ThreadCount()) {
    out[i] = device_hash::FinishSegment(segments[i], lanes + i * xxh3::kLanes, s);
  }
}

// An element of 16 bytes, moved as one.
struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

template <typename T>
__global__ void GatherKernel(const T* src, strided::Layout layout, uint64_t first, uint64_t count,
                             T* dst) {
  for (uint64_t i = ThreadIndex(); i < count; i += ThreadCount()) {
    dst[i] = src[strided::ElementOffset(layout, first + i)];
  }
}

template <typename T>
__global__ void ScatterKernel(const T* src, strided::Layout layout, uint64_t first, uint64_t count,
                              T* dst) {
  for (uint64_t i = ThreadIndex(); i < count; i += ThreadCount()) {
    dst[strided::ElementOffset(layout, first + i)] = src[i];
  }
}

// Any element size or alignment: one thread per byte.
__global__ void GatherBytesKernel(const uint8_t* src, uint64_t elem, strided::Layout layout,
                                  uint64_t first, uint64_t count, uint8_t* dst) {
  const uint64_t total = count * elem;
  for (uint64_t i = ThreadIndex(); i < total; i += ThreadCount()) {
    const int64_t e = strided::ElementOffset(layout, first + i / elem);
    dst[i] = src[e * static_cast<int64_t>(elem) + static_cast<int64_t>(i % elem)];
  }
}

__global__ void ScatterBytesKernel(const uint8_t* src, uint64_t elem, strided::Layout layout,
                                   uint64_t first, uint64_t count, uint8_t* dst) {
  const uint64_t total = count * elem;
  for (uint64_t i = ThreadIndex(); i < total; i += ThreadCount()) {
    const int64_t e = strided::ElementOffset(layout, first + i / elem);
    dst[e * static_cast<int64_t>(elem) + static_cast<int64_t>(i % elem)] = src[i];
  }
}

bool Aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Launches the gather (or scatter) kernel of the element size when both pointers are aligned to
// it, else the byte kernel. Returns the launch error.
template <bool kGather>
int Move(const void* src, size_t elem, const strided::Layout& layout, uint64_t first,
         uint64_t count, void* dst, void* stream_ptr) {
  if (count == 0) return cudaSuccess;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const bool aligned = Aligned(src, elem) && Aligned(dst, elem);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    if constexpr (kGather) {
      GatherKernel<T><<<GridFor(count), kThreads, 0, stream>>>(static_cast<const T*>(src), layout,
                                                               first, count, static_cast<T*>(dst));
    } else {
      ScatterKernel<T><<<GridFor(count), kThreads, 0, stream>>>(static_cast<const T*>(src), layout,
                                                                first, count, static_cast<T*>(dst));
    }
  };
  if (aligned && elem == 1) {
    launch(uint8_t{});
  } else if (aligned && elem == 2) {
    launch(uint16_t{});
  } else if (aligned && elem == 4) {
    launch(uint32_t{});
  } else if (aligned && elem == 8) {
    launch(uint64_t{});
  } else if (aligned && elem == 16) {
    launch(Bytes16{});
  } else if (kGather) {
    GatherBytesKernel<<<GridFor(count * elem), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(src), elem, layout, first, count, static_cast<uint8_t*>(dst));
  } else {
    ScatterBytesKernel<<<GridFor(count * elem), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(src), elem, layout, first, count, static_cast<uint8_t*>(dst));
  }
  return cudaGetLastError();
}

}  // namespace

int InitLanes(uint64_t* lanes_dev, size_t segments, void* stream) {
  const uint64_t count = static_cast<uint64_t>(segments) * xxh3::kLanes;
  if (count == 0) return cudaSuccess;
  InitLanesKernel<<<GridFor(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(lanes_dev,
                                                                                      count);
  return cudaGetLastError();
}

int BlockSums(const device_hash::SumRange* ranges_dev, size_t ranges, uint64_t begin, uint64_t end,
              uint64_t* window_dev, void* stream) {
  if (end <= begin || ranges == 0) return cudaSuccess;
  BlockSumsKernel<<<GridFor((end - begin) * xxh3::kLanes), kThreads, 0,
                    static_cast<cudaStream_t>(stream)>>>(ranges_dev, ranges, begin, end, window_dev,
                                                         MakeSecret());
  return cudaGetLastError();
}

int Chain(const device_hash::Segment* segments_dev, size_t segments, uint64_t begin, uint64_t end,
          const uint64_t* window_dev, uint64_t* lanes_dev, void* stream) {
  if (end <= begin || segments == 0) return cudaSuccess;
  ChainKernel<<<GridFor(static_cast<uint64_t>(segments) * xxh3::kLanes), kThreads, 0,
                static_cast<cudaStream_t>(stream)>>>(segments_dev, segments, begin, end, window_dev,
                                                     lanes_dev, MakeSecret());
  return cudaGetLastError();
}

int Finish(const device_hash::Segment* segments_dev, size_t segments, const uint64_t* lanes_dev,
           uint64_t* out_dev, void* stream) {
  if (segments == 0) return cudaSuccess;
  FinishKernel<<<GridFor(segments), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      segments_dev, segments, lanes_dev, out_dev, MakeSecret());
  return cudaGetLastError();
}

int Gather(const void* src, size_t elem, const strided::Layout& layout, uint64_t first,
           uint64_t count, void* dst, void* stream) {
  return Move<true>(src, elem, layout, first, count, dst, stream);
}

int Scatter(const void* src, size_t elem, const strided::Layout& layout, uint64_t first,
            uint64_t count, void* dst, void* stream) {
  return Move<false>(src, elem, layout, first, count, dst, stream);
}

}  // namespace weightbus::internal::cuda_kernels
