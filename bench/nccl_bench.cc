// SPDX-License-Identifier: Apache-2.0
// weightbus-nccl-bench: nccl:// against a plain ncclBroadcast loop of the same bytes, measured in
// the same run on the same GPUs, over a bucket size sweep, with the cost of packing.
//
//   weightbus-nccl-bench [--size 1GiB] [--buckets 16MiB,64MiB,256MiB,1GiB] [--replicas N]
//                        [--reps 5] [--warmup 1] [--json FILE] (--help: every flag)
//
// The model is synthetic bf16 with Qwen2.5-0.5B's tensor names and shapes scaled to --size
// (../shared/fixtures/qwen2.5-0.5b-shapes.json), resident on GPU 0 as a trainer's would be. The
// publisher is rank 0 on GPU 0; each replica is a thread of this process with a GPU of its own
// (GPUs 1..N; NCCL refuses two ranks on one GPU), receiving into CUDA destinations bound in
// place (bind_mode=direct). Per bucket size and repetition, in this order:
//   * ncclBroadcast: the same bytes in buckets of the same size, from a buffer on GPU 0 to a
//     buffer on each replica GPU, one communicator of the same ranks (ncclCommInitAll), every
//     bucket broadcast in one group call, until every stream is idle. Its GB/s is the bytes
//     over that time, which for a broadcast is also nccl-tests' bus bandwidth (busbw = algbw).
//   * pack: copying the tensors into a bucket buffer on GPU 0 (device to device), alone.
//   * nccl://: Publisher::Publish of the version (device checksums, offer, packing overlapped
//     with the broadcasts, every replica's confirmation); a replica hands the version over only
//     verified. Publish returns once every replica has every bucket, so its wall time is the
//     time to sync every replica.
// Replicas are back in their wait before each publish (the publisher waits for them), so a
// publish measures the transport, not the replicas' previous hand-over.
//
// Output follows nccl-tests: a banner, a table whose non-data lines start with '#', a #wrong
// column (replicas whose bytes differed from the source, checked on the last version by copying
// both back), and a final "# OK" or "# FAILED: ..." line. Target: nccl:// >= 0.95x the
// ncclBroadcast loop at the default bucket size (256 MiB). With one GPU only packing and a
// one-rank pipeline are measured (say so); without a GPU it prints why and exits 2.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "process/process.h"
#include "transports/nccl/nccl_transport.h"
#include "weightbus/fatal.h"
#include "weightbus/flags.h"
#include "weightbus/synthetic_model.h"
#include "weightbus/weightbus.hpp"

namespace weightbus::tools {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(600);

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double P99(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, v.size() * 99 / 100)];
}

std::string Human(uint64_t b) {
  if (b >= (1ull << 30)) return absl::StrFormat("%.2fGiB", b / double(1ull << 30));
  return absl::StrFormat("%.0fMiB", b / double(1ull << 20));
}

void CudaOk(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Die(absl::StrFormat("%s: %s", what, cudaGetErrorString(e)));
}
void NcclOk(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) Die(absl::StrFormat("%s: %s", what, ncclGetErrorString(r)));
}

// Device memory on one GPU.
struct DeviceBuffer {
  DeviceBuffer(int device, uint64_t n) : device(device), size(n) {
    CudaOk(cudaSetDevice(device), "cudaSetDevice");
    CudaOk(cudaMalloc(&data, std::max<uint64_t>(n, 1)), "cudaMalloc");
  }
  ~DeviceBuffer() {
    cudaSetDevice(device);
    cudaFree(data);
  }
  std::byte* bytes() const { return static_cast<std::byte*>(data); }
  int device;
  uint64_t size;
  void* data = nullptr;
};

struct Flags {
  uint64_t size = 1ull << 30;
  std::vector<uint64_t> buckets = {16ull << 20, 64ull << 20, 256ull << 20, 1ull << 30};
  int replicas = -1;  // every other GPU
  int reps = 5;
  int warmup = 1;
  std::string shapes = WEIGHTBUS_SHAPES_FILE;
  std::string json;
};

// The plain ncclBroadcast loop: `bytes` in buckets of `bucket` bytes, rank 0 (GPU 0) to ranks
// 1..n, one group call per bucket, timed until every stream is idle. Seconds per repetition.
std::vector<double> NcclLoop(int nranks, uint64_t bytes, uint64_t bucket, int warmup, int reps) {
  std::vector<int> devs(nranks);
  for (int r = 0; r < nranks; ++r) devs[r] = r;
  std::vector<ncclComm_t> comms(nranks);
  NcclOk(ncclCommInitAll(comms.data(), nranks, devs.data()), "ncclCommInitAll");
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  std::vector<cudaStream_t> streams(nranks);
  for (int r = 0; r < nranks; ++r) {
    bufs.push_back(std::make_unique<DeviceBuffer>(r, bytes));
    CudaOk(cudaSetDevice(r), "cudaSetDevice");
    CudaOk(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), "cudaStreamCreate");
  }
  std::vector<double> out;
  for (int rep = 0; rep < warmup + reps; ++rep) {
    const absl::Time t0 = absl::Now();
    for (uint64_t off = 0; off < bytes; off += bucket) {
      const uint64_t n = std::min(bucket, bytes - off);
      NcclOk(ncclGroupStart(), "ncclGroupStart");
      for (int r = 0; r < nranks; ++r) {
        NcclOk(ncclBroadcast(bufs[r]->bytes() + off, bufs[r]->bytes() + off, n, ncclUint8, 0,
                             comms[r], streams[r]),
               "ncclBroadcast");
      }
      NcclOk(ncclGroupEnd(), "ncclGroupEnd");
    }
    for (int r = 0; r < nranks; ++r) {
      CudaOk(cudaSetDevice(r), "cudaSetDevice");
      CudaOk(cudaStreamSynchronize(streams[r]), "cudaStreamSynchronize");
    }
    if (rep >= warmup) out.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  for (int r = 0; r < nranks; ++r) {
    cudaSetDevice(r);
    cudaStreamDestroy(streams[r]);
    ncclCommDestroy(comms[r]);
  }
  return out;
}

// Packing alone: every tensor copied into a bucket buffer on GPU 0 (device to device).
std::vector<double> PackOnly(const std::vector<TensorView>& views, uint64_t bucket, int warmup,
                             int reps) {
  DeviceBuffer slot(0, bucket);
  cudaStream_t s;
  CudaOk(cudaSetDevice(0), "cudaSetDevice");
  CudaOk(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<double> out;
  for (int rep = 0; rep < warmup + reps; ++rep) {
    const absl::Time t0 = absl::Now();
    uint64_t at = 0;
    for (const TensorView& t : views) {
      uint64_t n = DTypeSize(t.dtype);
      for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
      for (uint64_t done = 0; done < n;) {
        if (at >= bucket) at = 0;
        const uint64_t len = std::min(n - done, bucket - at);
        CudaOk(cudaMemcpyAsync(slot.bytes() + at, static_cast<const std::byte*>(t.data) + done, len,
                               cudaMemcpyDeviceToDevice, s),
               "cudaMemcpyAsync");
        at = (at + len + 255) / 256 * 256;
        done += len;
      }
    }
    CudaOk(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    if (rep >= warmup) out.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  cudaStreamDestroy(s);
  return out;
}

struct Row {
  uint64_t bucket = 0;
  size_t buckets = 0;
  double wb_s = 0, wb_p99 = 0, nccl_s = 0, pack_s = 0, pack_in_publish_s = 0;
  uint64_t bytes = 0;
  int wrong = 0;
};

int Main(int argc, char** argv) {
  SetFatalErrorPolicy({"weightbus-nccl-bench", 1, nullptr});
  Flags flags;
  Command cmd("weightbus-nccl-bench",
              "nccl:// against a plain ncclBroadcast loop of the same bytes (bucket size sweep, "
              "packing overhead)");
  cmd.AddSize("size", &flags.size, "model bytes (Qwen2.5-0.5B shapes scaled to it)");
  cmd.AddSizeList("buckets", &flags.buckets, "bucket sizes to sweep (multiples of 256 bytes)");
  cmd.Add("replicas", &flags.replicas, "replica GPUs (default -1: every GPU but the publisher's)")
      .InRange(-1, 1024);
  cmd.Add("reps", &flags.reps, "measured repetitions per bucket size").InRange(1, 1000);
  cmd.Add("warmup", &flags.warmup, "unmeasured repetitions first").InRange(0, 100);
  cmd.Add("shapes", &flags.shapes, "tensor shapes file").TypeName("PATH");
  cmd.Add("json", &flags.json, "write the results as JSON to this file").TypeName("FILE");
  if (std::optional<int> exit = cmd.Parse(argc, argv)) return *exit;

  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf(
        "# weightbus-nccl-bench: no CUDA GPU is visible (cudaGetDeviceCount): nothing to "
        "measure\n# SKIPPED\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CudaOk(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  const int replicas = flags.replicas < 0 ? gpus - 1 : flags.replicas;
  if (replicas > gpus - 1) {
    Die(absl::StrFormat("--replicas %d: this machine has %d GPU(s), one is the publisher's",
                        replicas, gpus));
  }
  for (uint64_t b : flags.buckets) {
    if (b == 0 || b % 256 != 0) Die(absl::StrFormat("--buckets: %d is not a multiple of 256", b));
  }

  // The model, uploaded to GPU 0.
  const std::vector<ShapeSpec> base = OrDie(ReadShapes(flags.shapes));
  uint64_t base_bytes = 0;
  for (const ShapeSpec& s : base) {
    uint64_t n = 2;
    for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
    base_bytes += n;
  }
  const std::vector<OwnedTensor> host = OrDie(
      MakeSyntheticModel(ScaleShapes(base, double(flags.size) / base_bytes), DType::kBF16, 15));
  uint64_t bytes = 0;
  std::vector<std::unique_ptr<DeviceBuffer>> on_gpu;
  std::vector<TensorView> views;
  for (const OwnedTensor& t : host) {
    on_gpu.push_back(std::make_unique<DeviceBuffer>(0, t.bytes.size()));
    CudaOk(cudaMemcpy(on_gpu.back()->data, t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice),
           "upload");
    TensorView v = t.view();
    v.data = on_gpu.back()->data;
    v.device = Device{DeviceType::kCuda, 0};
    views.push_back(std::move(v));
    bytes += t.bytes.size();
  }

  std::printf(
      "# weightbus-nccl-bench: nccl:// against a plain ncclBroadcast loop of the same "
      "bytes\n");
  std::printf("# GPUs: %d x %s; NCCL %d.%d.%d; publisher on GPU 0, %d replica(s) on GPUs 1..%d\n",
              gpus, prop.name, nccl_version / 10000, nccl_version / 100 % 100, nccl_version % 100,
              replicas, replicas);
  std::printf("# model: %zu bf16 tensors, %llu bytes (%s), on GPU 0; reps %d after %d warm-up\n",
              views.size(), static_cast<unsigned long long>(bytes), Human(bytes).c_str(),
              flags.reps, flags.warmup);
  if (replicas == 0) {
    std::printf(
        "# one GPU: NCCL refuses two ranks on one GPU, so no broadcast between a "
        "publisher and a replica can run here; packing and a one-rank ncclBroadcast "
        "loop only\n");
  }
  std::fflush(stdout);

  std::vector<Row> rows;
  std::vector<std::string> failures;
  for (const uint64_t bucket : flags.buckets) {
    Row row;
    row.bucket = bucket;
    row.bytes = bytes;
    row.buckets = (bytes + bucket - 1) / bucket;
    row.nccl_s = Median(NcclLoop(replicas + 1, bytes, bucket, flags.warmup, flags.reps));
    row.pack_s = Median(PackOnly(views, bucket, flags.warmup, flags.reps));
    if (replicas > 0) {
      const int port = weightbus::process::FreePort();
      const std::string uri =
          absl::StrFormat("nccl://127.0.0.1:%d/bench?bucket_size=%d", port, bucket);
      auto pub = OrDie(
          Publisher::Open(uri, {{"cuda_device", "0"}, {"min_replicas", std::to_string(replicas)}}));
      const int versions = flags.warmup + flags.reps;
      absl::Mutex mu;
      int handed = 0;  // replica hand-overs of the current version
      std::atomic<int> wrong{0};
      std::vector<std::thread> threads;
      for (int r = 1; r <= replicas; ++r) {
        threads.emplace_back([&, r] {
          auto sub = OrDie(
              Subscriber::Open(uri, {{"cuda_device", std::to_string(r)}, {"bind_mode", "direct"}}));
          std::vector<std::unique_ptr<DeviceBuffer>> dest;
          for (const TensorView& t : views) {
            dest.push_back(std::make_unique<DeviceBuffer>(r, on_gpu[dest.size()]->size));
            OrDie(sub->Bind(
                t.name,
                Destination{
                    t.dtype, t.shape, {}, dest.back()->data, Device{DeviceType::kCuda, r}}));
          }
          for (int v = 1; v <= versions; ++v) {
            std::unique_ptr<Update> u = OrDie(sub->WaitForVersion(v, kTimeout));
            if (v == versions) {  // the last version, byte for byte against the source
              for (size_t i = 0; i < dest.size(); ++i) {
                std::vector<std::byte> got(dest[i]->size);
                CudaOk(cudaSetDevice(r), "cudaSetDevice");
                CudaOk(cudaMemcpy(got.data(), dest[i]->data, got.size(), cudaMemcpyDeviceToHost),
                       "download");
                if (std::memcmp(got.data(), host[i].bytes.data(), got.size()) != 0) {
                  ++wrong;
                  break;
                }
              }
            }
            absl::MutexLock lock(&mu);
            ++handed;
          }
        });
      }
      std::vector<double> publish_s, pack_in_publish;
      for (int v = 1; v <= versions; ++v) {
        {
          // Every replica handed the previous version over (and is waiting again, give or take
          // the microseconds between its hand-over and its next wait).
          struct Enough {
            const int* handed;
            int want;
          } enough{&handed, (v - 1) * replicas};
          absl::MutexLock lock(&mu);
          mu.Await(absl::Condition(
              +[](Enough* e) { return *e->handed >= e->want; }, &enough));
        }
        const absl::Time t0 = absl::Now();
        OrDie(pub->Publish(v, views, {}, kTimeout, nullptr));
        const double s = absl::ToDoubleSeconds(absl::Now() - t0);
        if (v > flags.warmup) {
          publish_s.push_back(s);
          const auto c =
              internal::nccl::ChannelCounters(absl::StrFormat("nccl://127.0.0.1:%d/bench", port));
          if (c) pack_in_publish.push_back(absl::ToDoubleSeconds(c->last_pack));
        }
      }
      for (std::thread& t : threads) t.join();
      row.wb_s = Median(publish_s);
      row.wb_p99 = P99(publish_s);
      row.pack_in_publish_s = Median(pack_in_publish);
      row.wrong = wrong.load();
      if (row.wrong > 0) {
        failures.push_back(absl::StrFormat("bucket %s: %d replica(s) received other bytes",
                                           Human(bucket), row.wrong));
      }
    }
    rows.push_back(row);
    std::printf("#   bucket %s done\n", Human(bucket).c_str());
    std::fflush(stdout);
  }

  std::printf("#\n# %9s %7s %10s %9s %8s %10s %9s %7s %9s %8s %6s\n", "bucket", "buckets",
              "nccl://", "p99", "nccl://", "ncclBcast", "ncclBcast", "ratio", "pack", "pack",
              "#wrong");
  std::printf("# %9s %7s %10s %9s %8s %10s %9s %7s %9s %8s %6s\n", "", "", "(ms)", "(ms)", "(GB/s)",
              "(ms)", "(GB/s)", "", "(GB/s)", "(%bcast)", "");
  for (const Row& r : rows) {
    const double wb_gbs = r.wb_s > 0 ? r.bytes / 1e9 / r.wb_s : 0;
    const double nccl_gbs = r.bytes / 1e9 / r.nccl_s;
    std::printf("  %9s %7zu %10s %9s %8s %10.3f %9.2f %7s %9.2f %8.1f %6d\n",
                Human(r.bucket).c_str(), r.buckets,
                r.wb_s > 0 ? absl::StrFormat("%.3f", r.wb_s * 1e3).c_str() : "-",
                r.wb_s > 0 ? absl::StrFormat("%.3f", r.wb_p99 * 1e3).c_str() : "-",
                r.wb_s > 0 ? absl::StrFormat("%.2f", wb_gbs).c_str() : "-", r.nccl_s * 1e3,
                nccl_gbs, r.wb_s > 0 ? absl::StrFormat("%.3f", wb_gbs / nccl_gbs).c_str() : "-",
                r.bytes / 1e9 / r.pack_s, 100 * r.pack_s / r.nccl_s, r.wrong);
    if (r.wb_s > 0 && r.bucket == (256ull << 20) && wb_gbs < 0.95 * nccl_gbs) {
      std::printf("# target missed at 256 MiB: %.3fx the ncclBroadcast loop (target 0.95x)\n",
                  wb_gbs / nccl_gbs);
    }
  }
  if (!flags.json.empty()) {
    nlohmann::ordered_json j;
    j["gpus"] = gpus;
    j["gpu"] = prop.name;
    j["nccl_version"] = nccl_version;
    j["replicas"] = replicas;
    j["bytes"] = bytes;
    j["tensors"] = views.size();
    for (const Row& r : rows) {
      j["rows"].push_back({{"bucket_size", r.bucket},
                           {"buckets", r.buckets},
                           {"nccl_uri_s", r.wb_s},
                           {"nccl_uri_p99_s", r.wb_p99},
                           {"ncclbroadcast_s", r.nccl_s},
                           {"pack_s", r.pack_s},
                           {"pack_in_publish_s", r.pack_in_publish_s},
                           {"ratio", r.wb_s > 0 ? r.nccl_s / r.wb_s : 0},
                           {"wrong", r.wrong}});
    }
    FILE* f = std::fopen(flags.json.c_str(), "w");
    if (f != nullptr) {
      std::fputs(j.dump(1).c_str(), f);
      std::fclose(f);
    }
  }
  if (failures.empty()) {
    std::printf("# OK\n");
    return 0;
  }
  std::printf("# FAILED: %s\n", absl::StrJoin(failures, "; ").c_str());
  return 1;
}

}  // namespace
}  // namespace weightbus::tools

int main(int argc, char** argv) { return weightbus::tools::Main(argc, argv); }
