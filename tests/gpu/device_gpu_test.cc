// SPDX-License-Identifier: Apache-2.0
// CUDA memory through the core on a GPU (label gpu; every case skips cleanly without one): the
// checksum kernels against the host's XXH3-64 (core/checksum.h), the packing kernels against
// PackStrided / UnpackStrided, and CUDA tensors published from and received into CUDA
// destinations over a transport that declares device memory (mem:// with cuda_memory=true: the
// transport is handed the device pointers themselves) and over host-only ones (mem://, disk://,
// ucx://, which stage through pinned host memory; ucx:// receives into device memory in place
// where its UCX has CUDA support). tests/gpu/run.sh runs it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/channel_setup.h"
#include "core/checksum.h"
#include "core/cuda/device.h"
#include "core/tensor_pack.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mem_transport.h"
#include "test_support.h"
#include "weightbus/weightbus.hpp"

namespace weightbus {
namespace {

using ::testing::HasSubstr;
using testing::mem::MemChannel;
using testing::mem::Seen;

constexpr absl::Duration kTimeout = absl::Seconds(60);

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define SKIP_WITHOUT_GPU()                                                 \
  do {                                                                     \
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount)"; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

using testing::RandomBytes;

// Device memory of device 0 (cudaMalloc), freed on destruction.
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : size_(n) {
    if (cudaMalloc(&data_, std::max<size_t>(n, 1)) != cudaSuccess) data_ = nullptr;
  }
  ~DeviceArray() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  size_t size() const { return size_; }
  void Upload(const std::vector<std::byte>& host, size_t at = 0) {
    ASSERT_EQ(cudaMemcpy(data() + at, host.data(), host.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<std::byte> Download(size_t at, size_t n) const {
    std::vector<std::byte> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), data() + at, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  void* data_ = nullptr;
  size_t size_;
};

TEST(DeviceChecksumGpuTest, KernelsEqualTheHostForManySizesAlignmentsAndBlocks) {
  SKIP_WITHOUT_GPU();
  // 300 MiB: more than one window of block sums (256 MiB of data per window).
  const size_t total = (300u << 20) + 64;
  const std::vector<std::byte> host = RandomBytes(total, 1);
  DeviceArray dev(total);
  ASSERT_NE(dev.data(), nullptr);
  dev.Upload(host);
  std::vector<uint64_t> sizes = {0,      1,   3,    8,    16,   17,   128,   129,
                                 240,    241, 1023, 1024, 1025, 4099, 65536, (1u << 20) + 5,
                                 3000017};
  std::mt19937_64 rng(2);
  for (int i = 0; i < 20; ++i) sizes.push_back(rng() % (8u << 20));
  for (uint64_t block : {uint64_t{0}, uint64_t{1} << 20, uint64_t{5000}}) {
    // One batch of every size at alignments 0, 1, 4 and 8, as Publish checksums a version.
    std::vector<internal::cuda::DeviceBytes> batch;
    std::vector<size_t> offsets;
    size_t at = 0;
    for (uint64_t n : sizes) {
      for (size_t align : {0, 1, 4, 8}) {
        at = (at + 63) / 64 * 64 + align;
        batch.push_back({dev.data() + at, n});
        offsets.push_back(at);
        at += n;
      }
    }
    ASSERT_LE(at, total);
    absl::StatusOr<std::vector<internal::TensorChecksums>> got =
        internal::cuda::Checksum(batch, block, 0);
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t i = 0; i < batch.size(); ++i) {
      const internal::TensorChecksums want =
          internal::ChecksumTensor(host.data() + offsets[i], batch[i].size, block);
      ASSERT_EQ((*got)[i].xxh3, want.xxh3)
          << "size " << batch[i].size << " at " << offsets[i] << " block " << block;
      ASSERT_EQ((*got)[i].blocks, want.blocks) << "size " << batch[i].size << " block " << block;
    }
  }
  // One tensor of 300 MiB alone (its chain crosses two windows).
  const internal::cuda::DeviceBytes whole{dev.data() + 64, 300u << 20};
  absl::StatusOr<std::vector<internal::TensorChecksums>> big =
      internal::cuda::Checksum({&whole, 1}, 1 << 20, 0);
  ASSERT_TRUE(big.ok()) << big.status();
  const internal::TensorChecksums want =
      internal::ChecksumTensor(host.data() + 64, 300u << 20, 1 << 20);
  EXPECT_EQ((*big)[0].xxh3, want.xxh3);
  EXPECT_EQ((*big)[0].blocks, want.blocks);
}

struct ViewCase {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  int64_t origin;
  bool overlapping;
};

TEST(DevicePackingGpuTest, GatherAndScatterKernelsEqualPackAndUnpack) {
  SKIP_WITHOUT_GPU();
  const std::vector<ViewCase> cases = {
      {{}, {}, 0, false},
      {{1000}, {}, 0, false},
      {{0, 5}, {5, 1}, 0, false},
      {{300, 200}, {1, 300}, 0, false},
      {{3, 1, 500}, {1000, 7, 2}, 0, false},
      {{50, 40}, {-40, 1}, 49 * 40, false},
      {{40, 50}, {1, -40}, 49 * 40, false},
      {{30, 40}, {0, 1}, 0, true},
      {{8, 6, 10, 4}, {1, 8, 192, 48}, 0, false},
  };
  auto stream = internal::cuda::Stream::Create(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (const ViewCase& c : cases) {
    for (size_t elem : {size_t{1}, size_t{2}, size_t{4}, size_t{8}, size_t{16}, size_t{6}}) {
      uint64_t count = 1;
      for (int64_t d : c.shape) count *= static_cast<uint64_t>(d);
      const size_t backing = 2100 * elem;
      const std::vector<std::byte> raw = RandomBytes(backing, 3 + elem);
      DeviceArray src(backing), packed(std::max<size_t>(count * elem, 1));
      src.Upload(raw);
      std::vector<std::byte> want(count * elem);
      internal::PackStrided(raw.data() + c.origin * elem, elem, c.shape, c.strides, want.data());
      // Gathered in chunks of 7 elements and in one, and at an odd byte offset (byte kernel).
      for (uint64_t chunk : {uint64_t{7}, std::max<uint64_t>(count, 1)}) {
        for (uint64_t first = 0; first < count; first += chunk) {
          const uint64_t n = std::min(chunk, count - first);
          ASSERT_TRUE(internal::cuda::Gather(src.data() + c.origin * elem, elem, c.shape, c.strides,
                                             first, n, packed.data() + first * elem, **stream)
                          .ok());
        }
        ASSERT_TRUE((*stream)->Synchronize("gather").ok());
        ASSERT_EQ(packed.Download(0, count * elem), want)
            << ShapeString(c.shape) << " elem " << elem << " chunk " << chunk;
      }
      if (c.overlapping) continue;
      std::vector<std::byte> unpacked(backing, std::byte{0});
      internal::UnpackStrided(want.data(), elem, c.shape, c.strides,
                              unpacked.data() + c.origin * elem);
      DeviceArray dst(backing);
      CUDA_OK(cudaMemset(dst.data(), 0, backing));
      packed.Upload(want);
      ASSERT_TRUE(internal::cuda::Scatter(packed.data(), elem, c.shape, c.strides, 0, count,
                                          dst.data() + c.origin * elem, **stream)
                      .ok());
      ASSERT_TRUE((*stream)->Synchronize("scatter").ok());
      EXPECT_EQ(dst.Download(0, backing), unpacked) << ShapeString(c.shape) << " elem " << elem;
    }
  }
}

// A version of three tensors: "a" contiguous on the GPU, "t" a transposed (strided) view on the
// GPU, "h" on the host; with the host bytes each is expected to arrive as.
struct GpuVersion {
  static constexpr int64_t kRows = 256, kCols = 128;
  std::vector<std::byte> a_host = RandomBytes(1u << 20, 11);  // 256 Ki floats
  std::vector<std::byte> m_host = RandomBytes(kRows * kCols * 4, 12);
  std::vector<float> h = {1, 2, 3, 4, 5};
  DeviceArray a{a_host.size()};
  DeviceArray m{m_host.size()};
  std::vector<std::byte> t_packed;  // the transposed view's row-major bytes

  GpuVersion() {
    a.Upload(a_host);
    m.Upload(m_host);
    t_packed.resize(m_host.size());
    internal::PackStrided(m_host.data(), 4, {kCols, kRows}, {1, kCols}, t_packed.data());
  }
  std::vector<TensorView> Views() const {
    TensorView va{"a", DType::kF32, {int64_t(a_host.size() / 4)}, {}, a.data()};
    va.device = Device{DeviceType::kCuda, 0};
    TensorView vt{"t", DType::kF32, {kCols, kRows}, {1, kCols}, m.data()};
    vt.device = Device{DeviceType::kCuda, 0};
    return {va, vt, TensorView{"h", DType::kF32, {5}, {}, h.data()}};
  }
};

const Seen* Find(const std::vector<Seen>& seen, const std::string& name) {
  for (const Seen& s : seen) {
    if (s.tensor == name) return &s;
  }
  return nullptr;
}

Destination CudaDest(std::vector<int64_t> shape, std::vector<int64_t> strides, void* data) {
  Destination d{DType::kF32, std::move(shape), std::move(strides), data};
  d.device = Device{DeviceType::kCuda, 0};
  return d;
}

TEST(DeviceMemoryGpuTest, ATransportThatMovesDeviceMemoryGetsTheDevicePointersThemselves) {
  SKIP_WITHOUT_GPU();
  GpuVersion v;
  MemChannel channel("gpu-device");
  auto pub = Publisher::Open("mem:///gpu-device?cuda_memory=true");
  ASSERT_TRUE(pub.ok()) << pub.status();
  ASSERT_TRUE((*pub)->Publish(1, v.Views(), {}, kTimeout).ok());
  const std::vector<Seen> from = channel.PublishedFrom();
  ASSERT_NE(Find(from, "a"), nullptr);
  EXPECT_EQ(Find(from, "a")->data, v.a.data());  // no copy
  EXPECT_EQ(Find(from, "a")->device, (Device{DeviceType::kCuda, 0}));
  EXPECT_EQ(Find(from, "t")->device, (Device{DeviceType::kCuda, 0}));  // packed on the device
  EXPECT_NE(Find(from, "t")->data, v.m.data());
  EXPECT_EQ(Find(from, "h")->device, Device{});
  // The device's checksums are the host's for the same bytes, blocks included.
  const Manifest m = channel.ManifestOf(1);
  const internal::TensorChecksums a =
      internal::ChecksumTensor(v.a_host.data(), v.a_host.size(), m.tensors[0].block_bytes);
  EXPECT_EQ(m.tensors[0].xxh3, a.xxh3);
  EXPECT_EQ(m.tensors[0].block_xxh3, a.blocks);
  EXPECT_EQ(m.tensors[1].xxh3, internal::Xxh3(v.t_packed.data(), v.t_packed.size()));

  // bind_mode=direct: the contiguous destination is the Fetch target itself; the strided one
  // is staged on the device and scattered after verification.
  auto sub = Subscriber::Open("mem:///gpu-device?cuda_memory=true&bind_mode=direct");
  ASSERT_TRUE(sub.ok()) << sub.status();
  DeviceArray a_dest(v.a_host.size()), t_dest(v.m_host.size());
  ASSERT_TRUE((*sub)->Bind("a", CudaDest({int64_t(v.a_host.size() / 4)}, {}, a_dest.data())).ok());
  // "t" ([128, 256]) into a column-major destination: strides {1, 128}.
  ASSERT_TRUE((*sub)
                  ->Bind("t", CudaDest({GpuVersion::kCols, GpuVersion::kRows},
                                       {1, GpuVersion::kCols}, t_dest.data()))
                  .ok());
  auto update = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(update.ok()) << update.status();
  const std::vector<Seen> into = channel.FetchedInto();
  EXPECT_EQ(Find(into, "a")->data, a_dest.data());
  EXPECT_EQ(Find(into, "a")->device, (Device{DeviceType::kCuda, 0}));
  EXPECT_EQ(Find(into, "t")->device, (Device{DeviceType::kCuda, 0}));
  EXPECT_NE(Find(into, "t")->data, t_dest.data());
  EXPECT_EQ(a_dest.Download(0, v.a_host.size()), v.a_host);
  // Column-major [128, 256] of the transposed view is the original row-major [256, 128].
  EXPECT_EQ(t_dest.Download(0, v.m_host.size()), v.m_host);
  EXPECT_EQ((*update)->Find("a")->device, (Device{DeviceType::kCuda, 0}));
  EXPECT_EQ((*update)->Find("a")->data, a_dest.data());

  // bind_mode=staged: device staging, and a corrupted version never touches the destination.
  auto staged = Subscriber::Open("mem:///gpu-device?cuda_memory=true");
  ASSERT_TRUE(staged.ok());
  DeviceArray a2(v.a_host.size());
  ASSERT_TRUE((*staged)->Bind("a", CudaDest({int64_t(v.a_host.size() / 4)}, {}, a2.data())).ok());
  ASSERT_TRUE((*staged)->WaitForVersion(1, kTimeout).ok());
  EXPECT_NE(Find(channel.FetchedInto(), "a")->data, a2.data());
  EXPECT_EQ(a2.Download(0, v.a_host.size()), v.a_host);
  std::vector<std::byte> next = RandomBytes(v.a_host.size(), 13);
  v.a.Upload(next);
  ASSERT_TRUE((*pub)->Publish(2, v.Views(), {}, kTimeout).ok());
  channel.CorruptByte(2, 0, 12345);
  auto bad = (*staged)->WaitForVersion(2, kTimeout);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("\"a\""));
  EXPECT_EQ(a2.Download(0, v.a_host.size()), v.a_host);  // untouched
  EXPECT_EQ((*staged)->current_version(), 1u);
}

// A host-only stack: CUDA tensors reach the transport as pinned host copies, CUDA destinations
// are received and verified on the host, then copied to the device.
void HostOnlyRoundTrip(const std::string& pub_uri, const std::string& sub_uri,
                       const std::string& bind_mode) {
  GpuVersion v;
  auto pub = Publisher::Open(pub_uri);
  ASSERT_TRUE(pub.ok()) << pub_uri << ": " << pub.status();
  auto sub = Subscriber::Open(sub_uri, {{"bind_mode", bind_mode}});
  ASSERT_TRUE(sub.ok()) << sub.status();
  DeviceArray a_dest(v.a_host.size()), t_dest(v.m_host.size());
  ASSERT_TRUE((*sub)->Bind("a", CudaDest({int64_t(v.a_host.size() / 4)}, {}, a_dest.data())).ok());
  ASSERT_TRUE((*sub)
                  ->Bind("t", CudaDest({GpuVersion::kCols, GpuVersion::kRows},
                                       {1, GpuVersion::kCols}, t_dest.data()))
                  .ok());
  ASSERT_TRUE((*pub)->Publish(1, v.Views(), {}, kTimeout).ok());
  auto update = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(update.ok()) << pub_uri << " " << bind_mode << ": " << update.status();
  EXPECT_EQ(a_dest.Download(0, v.a_host.size()), v.a_host) << pub_uri << " " << bind_mode;
  EXPECT_EQ(t_dest.Download(0, v.m_host.size()), v.m_host) << pub_uri << " " << bind_mode;
  EXPECT_EQ(std::memcmp((*update)->Find("h")->data, v.h.data(), 20), 0);
}

TEST(DeviceMemoryGpuTest, HostOnlyMemStagesThroughPinnedHostMemory) {
  SKIP_WITHOUT_GPU();
  for (const std::string mode : {"staged", "direct"}) {
    const std::string name = "gpu-host-" + mode;
    HostOnlyRoundTrip("mem:///" + name, "mem:///" + name, mode);
    MemChannel channel(name);
    EXPECT_EQ(Find(channel.PublishedFrom(), "a")->device, Device{});
    EXPECT_EQ(Find(channel.FetchedInto(), "a")->device, Device{});
  }
}

TEST(DeviceMemoryGpuTest, DiskRoundTripsCudaTensorsIntoCudaDestinations) {
  SKIP_WITHOUT_GPU();
  if (const std::string why = testing::MissingTransports({"disk"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  testing::ScratchDir dir;
  for (const std::string mode : {"staged", "direct"}) {
    const std::string uri = "disk://" + dir.path() + "/" + mode;
    HostOnlyRoundTrip(uri, uri, mode);
  }
}

TEST(DeviceMemoryGpuTest, UcxReceivesCudaTensorsIntoCudaDestinations) {
  SKIP_WITHOUT_GPU();
  if (const std::string why = testing::MissingTransports({"ucx"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  absl::StatusOr<internal::ChannelSetup> setup = internal::SetUpChannel("ucx://127.0.0.1:1/x", {});
  ASSERT_TRUE(setup.ok());
  const bool device =
      (setup->capabilities.fetch_memory & internal::TransportCapabilities::kCudaMemory) != 0;
  RecordProperty("ucx_cuda_fetch",
                 device ? "yes (UCX with CUDA: gets into device memory)" : "no (host staging)");
  std::cout << "ucx:// fetch_memory: " << (device ? "host and CUDA" : "host only") << "\n";
  for (const std::string mode : {"direct", "staged"}) {
    const std::string uri = absl::StrFormat("ucx://127.0.0.1:%d/gpu", testing::FreePort());
    HostOnlyRoundTrip(uri, uri, mode);
  }
}

TEST(DeviceMemoryGpuTest, PublishWaitsForTheCallersStream) {
  SKIP_WITHOUT_GPU();
  const size_t n = 64u << 20;
  DeviceArray a(n);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const std::string uri : {"mem:///gpu-stream?cuda_memory=true", "mem:///gpu-stream-h"}) {
    auto pub = Publisher::Open(uri);
    ASSERT_TRUE(pub.ok());
    auto sub = Subscriber::Open(uri);
    ASSERT_TRUE(sub.ok());
    CUDA_OK(cudaMemsetAsync(a.data(), 0x5a, n, stream));  // still running when Publish starts
    TensorView view{"a", DType::kU8, {int64_t(n)}, {}, a.data()};
    view.device = Device{DeviceType::kCuda, 0};
    ASSERT_TRUE((*pub)->Publish(1, {view}, {}, kTimeout, stream).ok());
    auto update = (*sub)->WaitForVersion(1, kTimeout);
    ASSERT_TRUE(update.ok()) << update.status();
    const auto* got = static_cast<const unsigned char*>((*update)->Find("a")->data);
    EXPECT_EQ(std::count(got, got + n, 0x5a), static_cast<std::ptrdiff_t>(n)) << uri;
  }
  cudaStreamDestroy(stream);
}

TEST(DeviceMemoryGpuTest, TensorParallelSlicesLandInCudaDestinations) {
  SKIP_WITHOUT_GPU();
  GpuVersion v;
  auto pub = Publisher::Open("mem:///gpu-tp");
  ASSERT_TRUE(pub.ok());
  SubscribePlacements placements;
  placements.rules = {PlacementRule{"t", Placement::Shard(0)}};
  placements.rank = TensorParallelRank{2, 1};
  auto sub = Subscriber::Open("mem:///gpu-tp", {}, placements);
  ASSERT_TRUE(sub.ok()) << sub.status();
  // Rank 1 of 2 gets rows [64, 128) of "t" ([128, 256]): 64 x 256 floats, row-major.
  DeviceArray slice(64 * GpuVersion::kRows * 4);
  ASSERT_TRUE((*sub)->Bind("t", CudaDest({64, GpuVersion::kRows}, {}, slice.data())).ok());
  ASSERT_TRUE((*pub)->Publish(1, v.Views(), {}, kTimeout).ok());
  auto update = (*sub)->WaitForVersion(1, kTimeout);
  ASSERT_TRUE(update.ok()) << update.status();
  const std::vector<std::byte> want(v.t_packed.begin() + 64 * GpuVersion::kRows * 4,
                                    v.t_packed.end());
  EXPECT_EQ(slice.Download(0, want.size()), want);
}

}  // namespace
}  // namespace weightbus
