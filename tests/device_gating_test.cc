// SPDX-License-Identifier: Apache-2.0
// core/cuda/device.cc as a build without CUDA support compiles it (this test compiles that file
// itself, without WEIGHTBUS_CORE_CUDA, whatever the library was built with): every call that
// would touch a device answers Unimplemented naming the capability (cuda_tensors) and the build
// option, so a CUDA tensor given to such a build is refused with that message wherever it
// enters the core (tensor_pack.cc ValidateView and ValidateDestination call NotBuilt).
#include <string>

#include "core/cuda/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace weightbus::internal::cuda {
namespace {

using ::testing::HasSubstr;

void ExpectNotBuilt(const absl::Status& s, const std::string& what) {
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), HasSubstr(what));
  EXPECT_THAT(s.message(), HasSubstr("capability cuda_tensors"));
  EXPECT_THAT(s.message(), HasSubstr("WEIGHTBUS_WITH_CUDA"));
}

TEST(DeviceGatingTest, WithoutCudaEveryDeviceCallIsUnimplementedNamingTheCapability) {
  EXPECT_FALSE(Built());
  ExpectNotBuilt(NotBuilt("tensor \"w\" on CUDA device 0"), "tensor \"w\" on CUDA device 0");
  ExpectNotBuilt(CheckDevice(0, "tensor \"w\""), "tensor \"w\"");
  int x = 0;
  ExpectNotBuilt(CheckDevicePointer(&x, 0, "destination for tensor \"d\""),
                 "destination for tensor \"d\"");
  ExpectNotBuilt(Stream::Create(1).status(), "CUDA device 1");
  ExpectNotBuilt(DeviceBuffer::Allocate(64, 2).status(), "CUDA device 2");
  ExpectNotBuilt(RegisterHost(&x, sizeof(x)), "pinning host memory");
  const DeviceBytes bytes{reinterpret_cast<const std::byte*>(&x), sizeof(x)};
  ExpectNotBuilt(Checksum({&bytes, 1}, 0, 3).status(), "CUDA device 3");
  ExpectNotBuilt(SynchronizeCallerStream(nullptr, 0, "waiting"), "waiting");
}

}  // namespace
}  // namespace weightbus::internal::cuda
