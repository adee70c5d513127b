// SPDX-License-Identifier: Apache-2.0
#include "core/device_routing.h"

namespace weightbus::internal {

CudaTensorRoute RouteCudaTensor(const TransportCapabilities& stack, const TensorView& view) {
  const bool contiguous = IsContiguous(view.shape, view.strides);
  if ((stack.publish_memory & TransportCapabilities::kCudaMemory) != 0) {
    return contiguous ? CudaTensorRoute::kInPlace : CudaTensorRoute::kPackOnDevice;
  }
  return contiguous ? CudaTensorRoute::kCopyToPinned : CudaTensorRoute::kGatherToPinned;
}

CudaDestinationRoute RouteCudaDestination(const TransportCapabilities& stack, bool staged,
                                          const std::vector<int64_t>& shape,
                                          const Destination& dest, bool placements) {
  if (placements || (stack.fetch_memory & TransportCapabilities::kCudaMemory) == 0) {
    return CudaDestinationRoute::kHostStaging;
  }
  if (!staged && IsContiguous(shape, dest.strides)) return CudaDestinationRoute::kInPlace;
  return CudaDestinationRoute::kDeviceStaging;
}

const char* RouteName(CudaTensorRoute route) {
  switch (route) {
    case CudaTensorRoute::kInPlace:
      return "in place";
    case CudaTensorRoute::kPackOnDevice:
      return "packed on the device";
    case CudaTensorRoute::kCopyToPinned:
      return "copied to pinned host memory";
    case CudaTensorRoute::kGatherToPinned:
      return "gathered on the device into pinned host memory";
  }
  return "?";
}

const char* RouteName(CudaDestinationRoute route) {
  switch (route) {
    case CudaDestinationRoute::kInPlace:
      return "in place";
    case CudaDestinationRoute::kDeviceStaging:
      return "device staging";
    case CudaDestinationRoute::kHostStaging:
      return "host staging";
  }
  return "?";
}

}  // namespace weightbus::internal
