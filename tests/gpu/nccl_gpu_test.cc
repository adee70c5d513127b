// SPDX-License-Identifier: Apache-2.0
// nccl:// on real GPUs, NCCL and CUDA (label gpu; every case skips cleanly, saying why, where the
// GPUs it needs are not there). tests/gpu/run.sh runs it.
//
// One GPU: a one-rank NCCL communicator, created non-blocking, drives the transport's bucket
// pipeline both ways through the real backend (cuda_backend.cc): the root packs host and device
// tensors into device buckets and broadcasts them with ncclBroadcast, and the replica's side
// receives each bucket with ncclBroadcast and unpacks it into host and device destinations, both
// checked bit-exact. Then versions end to end through nccl:// to two replicas on the publisher's
// GPU (a thread of this process and a forked process, reading the publisher's buckets through
// CUDA IPC) with the publisher's one-rank communicator, into CUDA destinations, bit-exact. NCCL
// refuses two ranks on one GPU, so versions to replicas on other GPUs (threads of this process,
// one GPU each), a late joiner's rebuild and a replica killed mid-broadcast (a forked process)
// need two or more GPUs and skip with that message otherwise.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_support.h"
#include "transports/nccl/device.h"
#include "transports/nccl/nccl_transport.h"
#include "transports/nccl/pipeline.h"
#include "transports/nccl/plan.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::internal::nccl {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::weightbus::testing::RandomBytes;

constexpr absl::Duration kTimeout = absl::Seconds(60);

int Gpus() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

#define NEED_GPUS(n)                                                                           \
  do {                                                                                         \
    const int have = Gpus();                                                                   \
    if (have < (n)) {                                                                          \
      GTEST_SKIP() << (have == 0 ? std::string("no CUDA device (cudaGetDeviceCount)")          \
                                 : absl::StrFormat("needs %d GPUs, this machine has %d: NCCL " \
                                                   "refuses two ranks on one GPU, so a "       \
                                                   "multi-rank broadcast needs one GPU each",  \
                                                   (n), have));                                \
    }                                                                                          \
  } while (0)

// Device memory on GPU `device`, freed on destruction.
class DeviceBytes {
 public:
  DeviceBytes(int device, size_t n) : device_(device), size_(n) {
    cudaSetDevice(device);
    if (cudaMalloc(&data_, std::max<size_t>(n, 1)) != cudaSuccess) data_ = nullptr;
  }
  ~DeviceBytes() {
    if (data_ != nullptr) {
      cudaSetDevice(device_);
      cudaFree(data_);
    }
  }
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  void Upload(const std::vector<std::byte>& host) {
    cudaSetDevice(device_);
    ASSERT_EQ(cudaMemcpy(data_, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<std::byte> Download() const {
    std::vector<std::byte> out(size_);
    cudaSetDevice(device_);
    EXPECT_EQ(cudaMemcpy(out.data(), data_, size_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  int device_;
  size_t size_;
  void* data_ = nullptr;
};

// The GPUs a child process sees (this process's CUDA runtime stays uninitialized, so that it may
// still fork children that use CUDA).
int GpusInAChild() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(std::min(Gpus(), 100));
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
}

// No replica: a one-rank communicator's root has delivered a bucket once its broadcast is done.
class NoReplicas final : public ReplicaProgress {
 public:
  absl::Status Check() override { return absl::OkStatus(); }
  bool AllReceived(size_t) override { return true; }
  std::vector<std::string> Behind(size_t) override { return {}; }
};

class Quiet final : public Watch {
 public:
  absl::Status Check() override { return absl::OkStatus(); }
};

// The real communicator, with each broadcast's bucket copied out to the host after it (root) or
// the root's bytes put into the bucket before it (a replica of a one-rank communicator, whose
// ncclBroadcast from itself leaves the buffer as it is).
class Tap final : public Communicator {
 public:
  Tap(Communicator& comm, Device& device) : comm_(comm), device_(device) {}
  absl::StatusOr<bool> Poll() override { return comm_.Poll(); }
  absl::Status Broadcast(void* buffer, uint64_t bytes, int root, int stream) override {
    const size_t k = posted_++;
    if (!inject.empty()) {
      if (absl::Status s = device_.Copy(buffer, inject[k].data(), bytes, stream); !s.ok()) return s;
    }
    if (absl::Status s = comm_.Broadcast(buffer, bytes, root, stream); !s.ok()) return s;
    if (record) {
      recorded.emplace_back(bytes);
      return device_.Copy(recorded.back().data(), buffer, bytes, stream);
    }
    return absl::OkStatus();
  }
  void Abort() override { comm_.Abort(); }
  int rank() const override { return comm_.rank(); }
  int nranks() const override { return comm_.nranks(); }

  bool record = false;
  std::deque<std::vector<std::byte>> recorded;  // stable addresses while copies are in flight
  std::vector<std::vector<std::byte>> inject;

 private:
  Communicator& comm_;
  Device& device_;
  size_t posted_ = 0;
};

TEST(NcclGpuTest, AOneRankCommunicatorMovesHostAndDeviceTensorsThroughBucketsBitExact) {
  NEED_GPUS(1);
  std::shared_ptr<Backend> backend = CudaBackend();
  absl::StatusOr<std::unique_ptr<Device>> device = backend->OpenDevice(0, 2);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_THAT((*device)->Uuid(), HasSubstr("GPU-"));
  absl::StatusOr<UniqueId> id = backend->NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      backend->StartCommunicator(**device, *id, 1, 0);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Quiet quiet;
  ASSERT_TRUE(WaitReady(RealClock(), absl::Now() + kTimeout, **comm, &quiet, [] {
                return std::string("the one-rank communicator did not initialize");
              }).ok());

  // Tensors: split over buckets, zero bytes, tiny, exactly a bucket; odd ones on the device.
  constexpr uint64_t kBucket = 1 << 20;
  const std::vector<uint64_t> sizes = {1000, 3 * kBucket + 77, 0, 3, kBucket, 12345};
  std::vector<std::vector<std::byte>> host;
  for (size_t i = 0; i < sizes.size(); ++i) host.push_back(RandomBytes(sizes[i], 40 + i));
  std::vector<std::unique_ptr<DeviceBytes>> on_device(sizes.size());
  std::vector<const std::byte*> sources;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i % 2 == 1) {
      on_device[i] = std::make_unique<DeviceBytes>(0, sizes[i]);
      on_device[i]->Upload(host[i]);
      sources.push_back(on_device[i]->data());
      EXPECT_TRUE((*device)->IsDeviceMemory(sources.back()));
    } else {
      sources.push_back(host[i].data());
    }
  }
  const BucketPlan plan = *PlanBuckets(sizes, kBucket);
  ASSERT_GE(plan.buckets.size(), 5u);
  std::vector<std::shared_ptr<void>> slots;
  for (int s = 0; s < 2; ++s) slots.push_back(*(*device)->Allocate(kBucket));

  // The root: pack and broadcast; every bucket as broadcast, unpacked by the plan, is the tensors.
  Tap root(**comm, **device);
  root.record = true;
  NoReplicas none;
  BroadcastStats stats;
  absl::Status sent = BroadcastBuckets(**device, root, RealClock(), none, plan, sources, slots,
                                       absl::Now() + kTimeout, "gpu test version 1", &stats);
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_EQ(root.recorded.size(), plan.buckets.size());
  std::vector<std::vector<std::byte>> unpacked;
  for (uint64_t n : sizes) unpacked.emplace_back(n);
  for (size_t k = 0; k < plan.buckets.size(); ++k) {
    for (const Piece& p : plan.buckets[k].pieces) {
      std::memcpy(unpacked[p.tensor].data() + p.tensor_offset,
                  root.recorded[k].data() + p.bucket_offset, p.length);
    }
  }
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(unpacked[i], host[i]) << "tensor " << i;
  EXPECT_EQ(stats.wire_bytes, plan.WireBytes());

  // A replica's side: each bucket arrives (injected: a one-rank broadcast moves nothing), then is
  // unpacked into host and device destinations.
  Tap replica(**comm, **device);
  for (const auto& bucket : root.recorded)
    replica.inject.emplace_back(bucket.begin(), bucket.end());
  std::vector<std::vector<std::byte>> host_targets;
  std::vector<std::unique_ptr<DeviceBytes>> device_targets(sizes.size());
  std::vector<std::byte*> targets;
  for (size_t i = 0; i < sizes.size(); ++i) {
    host_targets.emplace_back(sizes[i], std::byte{0});
    if (i % 3 != 0) {
      device_targets[i] = std::make_unique<DeviceBytes>(0, sizes[i]);
      targets.push_back(device_targets[i]->data());
    } else {
      targets.push_back(host_targets[i].data());
    }
  }
  size_t reported = 0;
  absl::Status received = ReceiveBuckets(
      **device, replica, RealClock(), quiet, plan, targets, slots,
      [&](size_t k) {
        EXPECT_EQ(k, reported++);
        return absl::OkStatus();
      },
      absl::Now() + kTimeout, "gpu test version 1");
  ASSERT_TRUE(received.ok()) << received;
  EXPECT_EQ(reported, plan.buckets.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::vector<std::byte> got =
        device_targets[i] ? device_targets[i]->Download() : host_targets[i];
    EXPECT_EQ(got, host[i]) << "tensor " << i;
  }
  EXPECT_TRUE((*comm)->Poll().ok());
  (*comm)->Abort();  // ncclCommAbort returns; the streams are idle
  (*device)->Synchronize();
}

std::vector<std::vector<std::byte>> VersionBytes(uint64_t v) {
  return {RandomBytes(3 << 20, v), RandomBytes(5000, 100 + v), RandomBytes(0, 1),
          RandomBytes((1 << 20) + 3, 200 + v)};
}

// Publishes version v: tensors 0 and 2 from host memory, 1 and 3 from GPU 0.
absl::Status PublishOnGpu0(Publisher& p, uint64_t v) {
  const auto bytes = VersionBytes(v);
  std::vector<std::unique_ptr<DeviceBytes>> device;
  std::vector<TensorView> views;
  for (size_t i = 0; i < bytes.size(); ++i) {
    TensorView t{absl::StrFormat("t%d", i), DType::kU8, {static_cast<int64_t>(bytes[i].size())}};
    if (i % 2 == 1) {
      device.push_back(std::make_unique<DeviceBytes>(0, bytes[i].size()));
      device.back()->Upload(bytes[i]);
      t.data = device.back()->data();
      t.device = weightbus::Device{DeviceType::kCuda, 0};
    } else {
      t.data = bytes[i].data();
    }
    views.push_back(std::move(t));
  }
  return p.Publish(v, views, {}, kTimeout, nullptr);
}

// A replica on GPU `gpu` receiving versions first..last: tensor 1 into a CUDA destination bound
// on its GPU, the rest into library memory; each checked bit-exact.
void Replica(const std::string& uri, int gpu, uint64_t first, uint64_t last, std::atomic<int>* ok) {
  auto sub = Subscriber::Open(uri, {{"cuda_device", absl::StrCat(gpu)}});
  ASSERT_TRUE(sub.ok()) << sub.status();
  DeviceBytes dest(gpu, 5000);
  ASSERT_TRUE(
      (*sub)
          ->Bind(
              "t1",
              Destination{
                  DType::kU8, {5000}, {}, dest.data(), weightbus::Device{DeviceType::kCuda, gpu}})
          .ok());
  for (uint64_t v = first; v <= last; ++v) {
    auto u = (*sub)->WaitForVersion(v, kTimeout);
    ASSERT_TRUE(u.ok()) << "GPU " << gpu << ": " << u.status();
    const auto want = VersionBytes(v);
    for (size_t i : {0, 2, 3}) {
      const TensorView* t = (*u)->Find(absl::StrFormat("t%d", i));
      ASSERT_NE(t, nullptr);
      ASSERT_EQ(std::memcmp(t->data, want[i].data(), want[i].size()), 0) << "t" << i;
    }
    ASSERT_EQ(dest.Download(), want[1]) << "t1 on GPU " << gpu;
    ++*ok;
  }
}

TEST(NcclGpuTest, OnOneGpuReplicasOnThePublishersGpuReceiveThroughNcclUriBitExact) {
  // The replica process is forked before this process touches CUDA; it reads the publisher's
  // buckets through CUDA IPC, a thread of this process through the pointers themselves.
  if (GpusInAChild() < 1) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount)";
  const int port = testing::FreePort();
  const std::string uri =
      absl::StrFormat("nccl://127.0.0.1:%d/policy?bucket_size=1MiB&connect_timeout=60s", port);
  const pid_t child = ::fork();
  if (child == 0) {
    std::atomic<int> ok{0};
    Replica(uri, 0, 1, 2, &ok);
    ::_exit(ok.load() == 2 && !::testing::Test::HasFailure() ? 0 : 1);
  }
  const absl::Status far =
      Publisher::Open(absl::StrFormat("nccl://127.0.0.1:%d/x", port), {{"cuda_device", "1000"}})
          .status();
  EXPECT_TRUE(absl::IsFailedPrecondition(far)) << far;
  auto pub = Publisher::Open(uri, {{"cuda_device", "0"}, {"min_replicas", "2"}});
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::atomic<int> ok{0};
  std::thread in_process(Replica, uri, 0, 1, 2, &ok);
  for (uint64_t v = 1; v <= 2; ++v) {
    absl::Status s = PublishOnGpu0(**pub, v);
    ASSERT_TRUE(s.ok()) << s;
  }
  in_process.join();
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the replica process: " << status;
  EXPECT_EQ(ok.load(), 2);
  const auto c = ChannelCounters(absl::StrFormat("nccl://127.0.0.1:%d/policy", port));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->epochs, 1u);  // one communicator: the publisher's one rank
  EXPECT_EQ(c->last_replicas, 2u);
}

TEST(NcclGpuTest, VersionsReachReplicasOnOtherGpusBitExactAndALateJoinerRebuilds) {
  NEED_GPUS(2);
  const int port = testing::FreePort();
  const std::string uri = absl::StrFormat("nccl://127.0.0.1:%d/policy?bucket_size=1MiB", port);
  auto pub = Publisher::Open(uri, {{"cuda_device", "0"}, {"min_replicas", "1"}});
  ASSERT_TRUE(pub.ok()) << pub.status();
  std::atomic<int> ok{0};
  std::thread first(Replica, uri, 1, 1, 3, &ok);
  for (uint64_t v = 1; v <= 2; ++v) {
    absl::Status s = PublishOnGpu0(**pub, v);
    ASSERT_TRUE(s.ok()) << s;
  }
  std::thread late;
  const int replicas = std::min(Gpus() - 1, 2);
  if (replicas == 2) {
    late = std::thread(Replica, uri, 2, 3, 3, &ok);
    ASSERT_TRUE(testing::WaitUntil(
        [&] {
          return ChannelCounters(absl::StrFormat("nccl://127.0.0.1:%d/policy", port))->replicas ==
                 2;
        },
        kTimeout));
  }
  absl::Status s = PublishOnGpu0(**pub, 3);
  ASSERT_TRUE(s.ok()) << s;
  first.join();
  if (late.joinable()) late.join();
  EXPECT_EQ(ok.load(), 3 + (replicas == 2 ? 1 : 0));
  const auto c = ChannelCounters(absl::StrFormat("nccl://127.0.0.1:%d/policy", port));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->epochs, replicas == 2 ? 2u : 1u);
  std::printf(
      "[ nccl     ] %d replica(s): last version %d bytes in %d buckets, broadcast %s, "
      "pack %s, offer %s\n",
      static_cast<int>(c->last_replicas), static_cast<int>(c->last_wire_bytes),
      static_cast<int>(c->last_buckets), absl::FormatDuration(c->last_broadcast).c_str(),
      absl::FormatDuration(c->last_pack).c_str(), absl::FormatDuration(c->last_offer).c_str());
}

TEST(NcclGpuTest, AReplicaKilledMidBroadcastFailsThePublishInsteadOfHanging) {
  // Forked before this process touches CUDA (a child cannot use a CUDA runtime its parent
  // initialized).
  if (const int have = GpusInAChild(); have < 2) {
    GTEST_SKIP() << (have == 0 ? std::string("no CUDA device (cudaGetDeviceCount)")
                               : absl::StrFormat("needs 2 GPUs, this machine has %d: NCCL refuses "
                                                 "two ranks on one GPU",
                                                 have));
  }
  const int port = testing::FreePort();
  const std::string uri = absl::StrFormat("nccl://127.0.0.1:%d/policy?bucket_size=1MiB", port);
  // The replica is a process of its own on GPU 1, killed after its third bucket (SIGKILL).
  const pid_t child = ::fork();
  if (child == 0) {
    ::setenv("WEIGHTBUS_FAILPOINTS", "nccl.replica_bucket=kill@3", 1);
    auto sub = Subscriber::Open(uri, {{"cuda_device", "1"}});
    if (!sub.ok()) ::_exit(2);
    (void)(*sub)->WaitForVersion(1, kTimeout);
    ::_exit(3);
  }
  auto pub = Publisher::Open(uri, {{"cuda_device", "0"}, {"min_replicas", "1"}});
  ASSERT_TRUE(pub.ok()) << pub.status();
  const absl::Time start = absl::Now();
  const absl::Status s = PublishOnGpu0(**pub, 1);
  const absl::Duration took = absl::Now() - start;
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr(absl::StrFormat("pid %d", child)), HasSubstr("bucket")));
  EXPECT_LT(took, absl::Seconds(30)) << "the peer's death should be seen, not waited out";
}

}  // namespace
}  // namespace weightbus::internal::nccl
