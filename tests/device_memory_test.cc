// SPDX-License-Identifier: Apache-2.0
// CUDA memory through the core, what needs no GPU (docs/TRANSPORTS.md, "Device memory"): the
// core's choices for CUDA tensors and destinations follow each stack's declared capabilities
// (the in-tree stacks, mem:// with and without cuda_memory, a layer over it); and the gates a
// CUDA tensor meets before any byte moves, on a machine without a GPU (this CI's): a build with
// CUDA answers FailedPrecondition naming the tensor and the device, a build without answers
// Unimplemented naming the capability, and neither publishes anything or changes a channel.
// With a GPU the same paths run for real in tests/gpu/device_gpu_test.cc.
#include <cstring>
#include <string>
#include <vector>

#include "core/channel_setup.h"
#include "core/cuda/device.h"
#include "core/device_routing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mem_transport.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using internal::CudaDestinationRoute;
using internal::CudaTensorRoute;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(20);

internal::TransportCapabilities CapabilitiesOf(const std::string& uri) {
  absl::StatusOr<internal::ChannelSetup> setup = internal::SetUpChannel(uri, {});
  EXPECT_TRUE(setup.ok()) << uri << ": " << setup.status();
  return setup.ok() ? setup->capabilities : internal::TransportCapabilities{};
}

TensorView CudaView(const std::string& name, std::vector<int64_t> shape,
                    std::vector<int64_t> strides, const void* data, int device = 0) {
  TensorView v{name, DType::kF32, std::move(shape), std::move(strides), data};
  v.device = Device{DeviceType::kCuda, device};
  return v;
}

Destination CudaDestination(std::vector<int64_t> shape, std::vector<int64_t> strides, void* data) {
  Destination d{DType::kF32, std::move(shape), std::move(strides), data};
  d.device = Device{DeviceType::kCuda, 0};
  return d;
}

TEST(DeviceRoutingTest, CudaTensorsFollowTheStacksPublishMemory) {
  const float dummy = 0;
  const TensorView contiguous = CudaView("c", {4, 8}, {}, &dummy);
  const TensorView transposed = CudaView("t", {8, 4}, {1, 8}, &dummy);
  struct Case {
    std::string uri;
    bool device_memory;  // what the stack declares
  };
  std::vector<Case> cases = {
      {"mem:///route?cuda_memory=true", true},
      {"mem:///route", false},
      // A layer encodes on the CPU: the stack under it is host memory whatever it declares.
      {"delta+mem:///route?cuda_memory=true", false},
  };
  for (const std::string& t : Transports()) {
    if (t == "disk") cases.push_back({"disk:///tmp/wb-route", false});
    // This CI's UCX (Debian's) has no CUDA support, so ucx:// declares host memory here.
    if (t == "ucx") cases.push_back({"ucx://127.0.0.1:1/route", false});
  }
  for (const Case& c : cases) {
    const internal::TransportCapabilities caps = CapabilitiesOf(c.uri);
    EXPECT_EQ((caps.publish_memory & internal::TransportCapabilities::kCudaMemory) != 0,
              c.device_memory)
        << c.uri;
    EXPECT_NE(caps.publish_memory & internal::TransportCapabilities::kHostMemory, 0u) << c.uri;
    EXPECT_NE(caps.fetch_memory & internal::TransportCapabilities::kHostMemory, 0u) << c.uri;
    EXPECT_EQ(internal::RouteCudaTensor(caps, contiguous),
              c.device_memory ? CudaTensorRoute::kInPlace : CudaTensorRoute::kCopyToPinned)
        << c.uri;
    EXPECT_EQ(internal::RouteCudaTensor(caps, transposed),
              c.device_memory ? CudaTensorRoute::kPackOnDevice : CudaTensorRoute::kGatherToPinned)
        << c.uri;
  }
}

TEST(DeviceRoutingTest, CudaDestinationsFollowTheStacksFetchMemoryAndBindMode) {
  float dummy = 0;
  const std::vector<int64_t> shape = {4, 8};
  const Destination contiguous = CudaDestination(shape, {}, &dummy);
  const Destination strided = CudaDestination(shape, {1, 4}, &dummy);
  const internal::TransportCapabilities device = CapabilitiesOf("mem:///d?cuda_memory=true");
  const internal::TransportCapabilities host = CapabilitiesOf("mem:///d");
  struct Case {
    const internal::TransportCapabilities* caps;
    bool staged;
    const Destination* dest;
    bool placements;
    CudaDestinationRoute want;
  };
  const std::vector<Case> cases = {
      {&device, false, &contiguous, false, CudaDestinationRoute::kInPlace},
      {&device, true, &contiguous, false, CudaDestinationRoute::kDeviceStaging},
      {&device, false, &strided, false, CudaDestinationRoute::kDeviceStaging},
      {&device, true, &strided, false, CudaDestinationRoute::kDeviceStaging},
      {&device, false, &contiguous, true, CudaDestinationRoute::kHostStaging},
      {&host, false, &contiguous, false, CudaDestinationRoute::kHostStaging},
      {&host, true, &strided, false, CudaDestinationRoute::kHostStaging},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(internal::RouteCudaDestination(*c.caps, c.staged, shape, *c.dest, c.placements),
              c.want)
        << "staged " << c.staged << " strided " << !c.dest->strides.empty() << " placements "
        << c.placements << ": " << internal::RouteName(c.want);
  }
}

TEST(DeviceRoutingTest, DescribeCapabilitiesNamesDeviceMemory) {
  EXPECT_THAT(internal::DescribeCapabilities(CapabilitiesOf("mem:///n?cuda_memory=true")),
              HasSubstr("cuda_publish, cuda_fetch"));
  EXPECT_THAT(internal::DescribeCapabilities(CapabilitiesOf("mem:///n")),
              ::testing::Not(HasSubstr("cuda")));
}

// The gates, on a machine without a usable GPU (skipped where there is one: tests/gpu has the
// real paths). `data` is any non-null pointer: no byte of it is read.
class DeviceGateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (SupportsCudaTensors() && internal::cuda::CheckDevice(0, "probe").ok()) {
      GTEST_SKIP() << "a CUDA device is present: tests/gpu/device_gpu_test.cc runs the real paths";
    }
  }
  // The error a CUDA tensor gets here: Unimplemented naming the capability in a build without
  // CUDA, FailedPrecondition naming the device in one with CUDA and no GPU.
  static void ExpectRefused(const absl::Status& s, const std::string& tensor) {
    if (!SupportsCudaTensors()) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
      EXPECT_THAT(s.message(), HasSubstr("cuda_tensors")) << s;
      EXPECT_THAT(s.message(), HasSubstr("WEIGHTBUS_WITH_CUDA")) << s;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_THAT(s.message(), HasSubstr("CUDA device 0")) << s;
    }
    EXPECT_THAT(s.message(), HasSubstr("\"" + tensor + "\"")) << s;
  }
  float data_[32] = {};
};

TEST_F(DeviceGateTest, PublishRefusesACudaTensorBeforeAnythingIsPublished) {
  for (const std::string uri : {"mem:///gate-pub?cuda_memory=true", "mem:///gate-pub-host"}) {
    testing::mem::MemChannel channel(uri.substr(7, uri.find('?') - 7));
    absl::StatusOr<std::unique_ptr<Publisher>> pub = Publisher::Open(uri);
    ASSERT_TRUE(pub.ok()) << pub.status();
    const float host[4] = {1, 2, 3, 4};
    const std::vector<TensorView> tensors = {TensorView{"host", DType::kF32, {4}, {}, host},
                                             CudaView("weights", {4, 8}, {1, 4}, data_)};
    ExpectRefused((*pub)->Publish(1, tensors, {}, kTimeout), "weights");
    EXPECT_TRUE(channel.Versions().empty()) << uri;
    // The publisher is unharmed: the host tensor alone publishes as version 1.
    ASSERT_TRUE((*pub)->Publish(1, {tensors[0]}, {}, kTimeout).ok()) << uri;
    EXPECT_EQ(channel.Versions(), std::vector<uint64_t>{1}) << uri;
  }
}

TEST_F(DeviceGateTest, PublishStreamRefusesACudaTensorAndStaysOpen) {
  absl::StatusOr<std::unique_ptr<Publisher>> pub = Publisher::Open("mem:///gate-stream");
  ASSERT_TRUE(pub.ok()) << pub.status();
  absl::StatusOr<std::unique_ptr<PublishStream>> stream = (*pub)->BeginPublish(1);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ExpectRefused((*stream)->Add(CudaView("w", {32}, {}, data_)), "w");
  const float host[2] = {5, 6};
  ASSERT_TRUE((*stream)->Add(TensorView{"w", DType::kF32, {2}, {}, host}).ok());
  ASSERT_TRUE((*stream)->Commit(kTimeout).ok());
  EXPECT_EQ((*pub)->latest_version(), 1u);
}

TEST_F(DeviceGateTest, BindRefusesACudaDestinationAndKeepsEarlierBindings) {
  absl::StatusOr<std::unique_ptr<Publisher>> pub = Publisher::Open("mem:///gate-bind");
  ASSERT_TRUE(pub.ok());
  absl::StatusOr<std::unique_ptr<Subscriber>> sub =
      Subscriber::Open("mem:///gate-bind?cuda_memory=true");
  ASSERT_TRUE(sub.ok()) << sub.status();
  float host_dest[4] = {};
  ASSERT_TRUE((*sub)->Bind("a", Destination{DType::kF32, {4}, {}, host_dest}).ok());
  ExpectRefused((*sub)->Bind("weights", CudaDestination({4, 8}, {}, data_)), "weights");
  const float a[4] = {1, 2, 3, 4};
  ASSERT_TRUE((*pub)->Publish(1, {TensorView{"a", DType::kF32, {4}, {}, a}}, {}, kTimeout).ok());
  absl::StatusOr<std::unique_ptr<Update>> update = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(update.ok()) << update.status();
  EXPECT_EQ(std::memcmp(host_dest, a, sizeof(a)), 0);
  EXPECT_EQ((*update)->Find("a")->device, Device{});
}

TEST_F(DeviceGateTest, ANegativeDeviceIndexIsInvalidArgument) {
  if (!SupportsCudaTensors()) GTEST_SKIP() << "a build without CUDA refuses every CUDA tensor";
  absl::StatusOr<std::unique_ptr<Publisher>> pub = Publisher::Open("mem:///gate-index");
  ASSERT_TRUE(pub.ok());
  const absl::Status s = (*pub)->Publish(1, {CudaView("w", {4}, {}, data_, -1)}, {}, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("CUDA device index -1"));
}

}  // namespace
}  // namespace weightbus
