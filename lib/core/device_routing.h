// SPDX-License-Identifier: Apache-2.0
// The core's choices for CUDA memory, made from what the transport stack declares
// (TransportCapabilities::publish_memory / fetch_memory, core/transport.h), never from its name:
// docs/TRANSPORTS.md, "Device memory". Pure functions, so the choices are tested without a GPU
// (tests/device_memory_test.cc); publisher.cc and subscriber.cc carry them out.
#pragma once

#include "core/transport.h"
#include "weightbus/types.hpp"

namespace weightbus::internal {

// How Publish hands a CUDA tensor to the stack.
enum class CudaTensorRoute {
  kInPlace,         // its own device pointer (publish_memory has kCudaMemory; contiguous)
  kPackOnDevice,    // gathered into device memory on its device, handed over there (strided)
  kCopyToPinned,    // copied into pinned host memory, handed over as a host tensor (host-only)
  kGatherToPinned,  // gathered on its device a chunk at a time into pinned host memory (strided)
};
CudaTensorRoute RouteCudaTensor(const TransportCapabilities& stack, const TensorView& view);

// Where a bound CUDA destination receives a tensor.
enum class CudaDestinationRoute {
  kInPlace,        // a Fetch target itself (fetch_memory has kCudaMemory, bind_mode=direct,
                   // contiguous)
  kDeviceStaging,  // a Fetch target in device memory on its device, verified there, then copied
                   // (scattered when strided) into it (kCudaMemory; bind_mode=staged or strided)
  kHostStaging,    // received and verified in host memory, then copied to the device (a
                   // host-only stack; and subscribers with placements, which read host memory)
};
CudaDestinationRoute RouteCudaDestination(const TransportCapabilities& stack, bool staged,
                                          const std::vector<int64_t>& shape,
                                          const Destination& dest, bool placements);

const char* RouteName(CudaTensorRoute route);
const char* RouteName(CudaDestinationRoute route);

}  // namespace weightbus::internal
