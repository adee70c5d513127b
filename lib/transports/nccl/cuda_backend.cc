// SPDX-License-Identifier: Apache-2.0
// device.h over NCCL and the CUDA runtime: the transport's one real path. Every call sets the
// device it works on first (the caller's thread may have another current device), so any thread
// may drive a Device or Communicator (one at a time).
#include <cuda_runtime.h>
#include <nccl.h>

#include <unistd.h>

#include <cstring>
#include <mutex>

#include "absl/strings/str_format.h"
#include "transports/nccl/device.h"

namespace weightbus::internal::nccl {
namespace {

absl::Status CudaError(cudaError_t err, std::string_view what) {
  const absl::StatusCode code = err == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code,
                      absl::StrFormat("%s: CUDA error %d (%s: %s)", what, static_cast<int>(err),
                                      cudaGetErrorName(err), cudaGetErrorString(err)));
}

// A failed NCCL call or communicator: Unavailable for what a peer or the network did (the
// communicator must be aborted and rebuilt), Internal otherwise.
absl::Status NcclError(ncclResult_t r, ncclComm_t comm, std::string_view what) {
  const absl::StatusCode code =
      r == ncclRemoteError || r == ncclSystemError        ? absl::StatusCode::kUnavailable
      : r == ncclInvalidArgument || r == ncclInvalidUsage ? absl::StatusCode::kInvalidArgument
                                                          : absl::StatusCode::kInternal;
  const char* last = ncclGetLastError(comm);
  return absl::Status(
      code, absl::StrFormat("%s: NCCL error %d (%s)%s%s", what, static_cast<int>(r),
                            ncclGetErrorString(r), last != nullptr && *last != 0 ? ": " : "",
                            last != nullptr ? last : ""));
}

class CudaDevice final : public Device {
 public:
  static absl::StatusOr<std::unique_ptr<Device>> Open(int ordinal, int nstreams) {
    int count = 0;
    if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess || count == 0) {
      (void)cudaGetLastError();  // clear the sticky error of a failed first call
      return absl::FailedPreconditionError(
          absl::StrFormat("no CUDA GPU is visible to this process (cudaGetDeviceCount: %s)",
                          err == cudaSuccess ? "0 devices" : cudaGetErrorString(err)));
    }
    if (ordinal < 0) {
      if (cudaError_t err = cudaGetDevice(&ordinal); err != cudaSuccess) {
        return CudaError(err, "cudaGetDevice");
      }
    }
    if (ordinal >= count) {
      return absl::FailedPreconditionError(
          absl::StrFormat("cuda_device=%d, but this process sees %d GPU(s) (CUDA_VISIBLE_DEVICES)",
                          ordinal, count));
    }
    auto d = std::unique_ptr<CudaDevice>(new CudaDevice(ordinal));
    if (cudaError_t err = cudaSetDevice(ordinal); err != cudaSuccess) {
      return CudaError(err, absl::StrFormat("cudaSetDevice(%d)", ordinal));
    }
    cudaDeviceProp prop{};
    if (cudaError_t err = cudaGetDeviceProperties(&prop, ordinal); err != cudaSuccess) {
      return CudaError(err, "cudaGetDeviceProperties");
    }
    d->describe_ = absl::StrFormat("GPU %d (%s, PCI %04x:%02x:%02x.0)", ordinal, prop.name,
                                   prop.pciDomainID, prop.pciBusID, prop.pciDeviceID);
    const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
    d->uuid_ = absl::StrFormat(
        "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
        u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    for (int s = 0; s < nstreams; ++s) {
      cudaStream_t stream = nullptr;
      if (cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
          err != cudaSuccess) {
        return CudaError(err, "cudaStreamCreateWithFlags");
      }
      d->streams_.push_back(stream);
      cudaEvent_t event = nullptr;
      if (cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
          err != cudaSuccess) {
        return CudaError(err, "cudaEventCreateWithFlags");
      }
      d->events_.push_back(event);
    }
    return std::unique_ptr<Device>(std::move(d));
  }

  ~CudaDevice() override {
    (void)cudaSetDevice(ordinal_);
    Synchronize();
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    for (cudaStream_t s : streams_) (void)cudaStreamDestroy(s);
  }

  std::string Describe() const override { return describe_; }
  std::string Uuid() const override { return uuid_; }
  int streams() const override { return static_cast<int>(streams_.size()); }
  int ordinal() const { return ordinal_; }
  cudaStream_t stream(int s) const { return streams_[s]; }

  absl::StatusOr<std::shared_ptr<void>> Allocate(uint64_t bytes) override {
    (void)cudaSetDevice(ordinal_);
    void* p = nullptr;
    if (cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
      (void)cudaGetLastError();
      return CudaError(err, absl::StrFormat("cudaMalloc of %d bytes on %s", bytes, describe_));
    }
    const int ordinal = ordinal_;
    return std::shared_ptr<void>(p, [ordinal](void* q) {
      (void)cudaSetDevice(ordinal);
      (void)cudaFree(q);
    });
  }

  absl::Status Copy(void* dst, const void* src, uint64_t bytes, int s) override {
    (void)cudaSetDevice(ordinal_);
    if (cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, streams_[s]);
        err != cudaSuccess) {
      return CudaError(err, absl::StrFormat("cudaMemcpyAsync of %d bytes", bytes));
    }
    return absl::OkStatus();
  }

  absl::Status Record(int s) override {
    (void)cudaSetDevice(ordinal_);
    if (cudaError_t err = cudaEventRecord(events_[s], streams_[s]); err != cudaSuccess) {
      return CudaError(err, "cudaEventRecord");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Done(int s) override {
    (void)cudaSetDevice(ordinal_);
    const cudaError_t err = cudaEventQuery(events_[s]);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    return CudaError(err, "cudaEventQuery");
  }

  void Synchronize() override {
    (void)cudaSetDevice(ordinal_);
    for (cudaStream_t s : streams_) (void)cudaStreamSynchronize(s);
  }

  absl::StatusOr<std::string> ExportBuffer(const std::shared_ptr<void>& buffer) override {
    (void)cudaSetDevice(ordinal_);
    cudaIpcMemHandle_t h;
    if (cudaError_t err = cudaIpcGetMemHandle(&h, buffer.get()); err != cudaSuccess) {
      (void)cudaGetLastError();
      return CudaError(err, "cudaIpcGetMemHandle");
    }
    std::string out(4 + 8 + sizeof(h), '\0');
    const uint32_t pid = static_cast<uint32_t>(getpid());
    const uint64_t ptr = reinterpret_cast<uintptr_t>(buffer.get());
    std::memcpy(out.data(), &pid, 4);
    std::memcpy(out.data() + 4, &ptr, 8);
    std::memcpy(out.data() + 12, &h, sizeof(h));
    return out;
  }

  absl::StatusOr<std::shared_ptr<void>> ImportBuffer(const std::string& handle) override {
    cudaIpcMemHandle_t h;
    if (handle.size() != 4 + 8 + sizeof(h)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "a CUDA IPC handle of %d bytes, expected %d", handle.size(), 4 + 8 + sizeof(h)));
    }
    uint32_t pid;
    uint64_t ptr;
    std::memcpy(&pid, handle.data(), 4);
    std::memcpy(&ptr, handle.data() + 4, 8);
    std::memcpy(&h, handle.data() + 12, sizeof(h));
    if (pid == static_cast<uint32_t>(getpid())) {
      // This process's own buffer (CUDA refuses to open its own handles).
      return std::shared_ptr<void>(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)),
                                   [](void*) {});
    }
    (void)cudaSetDevice(ordinal_);
    void* p = nullptr;
    if (cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        err != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::UnavailableError(
          absl::StrFormat("cudaIpcOpenMemHandle of the publisher's bucket (process %d): %s", pid,
                          cudaGetErrorString(err)));
    }
    const int ordinal = ordinal_;
    return std::shared_ptr<void>(p, [ordinal](void* q) {
      (void)cudaSetDevice(ordinal);
      (void)cudaIpcCloseMemHandle(q);
    });
  }

  bool IsDeviceMemory(const void* p) const override {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.type == cudaMemoryTypeDevice;
  }

 private:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {}

  int ordinal_;
  std::string describe_;
  std::string uuid_;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> events_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, CudaDevice& device, int nranks, int rank)
      : comm_(comm), device_(device), nranks_(nranks), rank_(rank) {}
  ~NcclCommunicator() override { Abort(); }

  absl::StatusOr<bool> Poll() override {
    if (aborted_) return absl::UnavailableError("the communicator was aborted");
    ncclResult_t state = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
      return NcclError(r, comm_, "ncclCommGetAsyncError");
    }
    if (state == ncclInProgress) return false;
    if (state != ncclSuccess) return NcclError(state, comm_, "the communicator failed");
    return true;
  }

  absl::Status Broadcast(void* buffer, uint64_t bytes, int root, int stream) override {
    if (aborted_) return absl::UnavailableError("the communicator was aborted");
    (void)cudaSetDevice(device_.ordinal());
    const ncclResult_t r =
        ncclBroadcast(buffer, buffer, bytes, ncclUint8, root, comm_, device_.stream(stream));
    if (r != ncclSuccess && r != ncclInProgress) {
      return NcclError(r, comm_, absl::StrFormat("ncclBroadcast of %d bytes", bytes));
    }
    return absl::OkStatus();
  }

  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    (void)cudaSetDevice(device_.ordinal());
    (void)ncclCommAbort(comm_);
  }

  int rank() const override { return rank_; }
  int nranks() const override { return nranks_; }

 private:
  ncclComm_t comm_;
  CudaDevice& device_;
  int nranks_;
  int rank_;
  bool aborted_ = false;
};

class NcclBackend final : public Backend {
 public:
  BackendInfo Info() override {
    int nccl = 0, cuda = 0;
    (void)ncclGetVersion(&nccl);
    (void)cudaRuntimeGetVersion(&cuda);
    BackendInfo info;
    info.nccl_version = static_cast<uint32_t>(nccl);
    info.name = absl::StrFormat("NCCL %d.%d.%d over CUDA runtime %d.%d", nccl / 10000,
                                nccl / 100 % 100, nccl % 100, cuda / 1000, cuda / 10 % 100);
    return info;
  }

  absl::StatusOr<std::unique_ptr<Device>> OpenDevice(int ordinal, int streams) override {
    return CudaDevice::Open(ordinal, streams);
  }

  absl::StatusOr<UniqueId> NewUniqueId() override {
    ncclUniqueId id;
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return NcclError(r, nullptr, "ncclGetUniqueId");
    }
    UniqueId out;
    static_assert(sizeof(id.internal) == kUniqueIdBytes);
    std::memcpy(out.data(), id.internal, kUniqueIdBytes);
    return out;
  }

  absl::StatusOr<std::unique_ptr<Communicator>> StartCommunicator(Device& device,
                                                                  const UniqueId& id, int nranks,
                                                                  int rank) override {
    auto& cuda = static_cast<CudaDevice&>(device);
    (void)cudaSetDevice(cuda.ordinal());
    ncclUniqueId nid;
    std::memcpy(nid.internal, id.data(), kUniqueIdBytes);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call may return ncclInProgress: polled, never waited on
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, nid, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm != nullptr) (void)ncclCommAbort(comm);
      return NcclError(r, comm,
                       absl::StrFormat("ncclCommInitRankConfig (rank %d of %d)", rank, nranks));
    }
    return std::unique_ptr<Communicator>(
        std::make_unique<NcclCommunicator>(comm, cuda, nranks, rank));
  }
};

}  // namespace

std::shared_ptr<Backend> CudaBackend() {
  static auto* backend = new std::shared_ptr<Backend>(std::make_shared<NcclBackend>());
  return *backend;
}

}  // namespace weightbus::internal::nccl
