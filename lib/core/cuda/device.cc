// SPDX-License-Identifier: Apache-2.0
#include "core/cuda/device.h"

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "core/cuda/hash_plan.h"
#include "core/cuda/strided_core.h"
#include "core/cuda/tile_gather.h"
#include "core/status.h"

#if defined(WEIGHTBUS_CORE_CUDA)
#include <cuda_runtime_api.h>

#include "core/cuda/kernels.h"
#endif

namespace weightbus::internal::cuda {

bool Built() {
#if defined(WEIGHTBUS_CORE_CUDA)
  return true;
#else
  return false;
#endif
}

absl::Status NotBuilt(std::string_view what) {
  return absl::UnimplementedError(absl::StrFormat(
      "%s: this build of weightbus has no CUDA support (capability cuda_tensors: "
      "SupportsCudaTensors() / wb_supports_cuda_tensors() is false; it was configured with "
      "WEIGHTBUS_WITH_CUDA=OFF or without a CUDA toolkit), so it cannot read or write device "
      "memory; copy the tensor to host memory first, or use a build with CUDA",
      what));
}

#if defined(WEIGHTBUS_CORE_CUDA)

namespace {

absl::Status CudaError(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: %s (CUDA error %d)", what, cudaGetErrorString(e), static_cast<int>(e)));
  }
  return absl::InternalError(
      absl::StrFormat("%s: %s (CUDA error %d)", what, cudaGetErrorString(e), static_cast<int>(e)));
}

absl::Status KernelError(int e, std::string_view what) {
  return CudaError(static_cast<cudaError_t>(e), what);
}

// Makes `device` current until destroyed, then restores the caller's current device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = CudaError(cudaSetDevice(device), absl::StrFormat("cudaSetDevice(%d)", device));
  }
  ~DeviceScope() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

}  // namespace

absl::Status CheckDevice(int device, std::string_view what) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for later calls
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: CUDA device %d cannot be used: this process sees no CUDA device (cudaGetDeviceCount: "
        "%s, CUDA error %d)",
        what, device, cudaGetErrorString(e), static_cast<int>(e)));
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: CUDA device %d does not exist: this process sees %d CUDA device(s) (check "
        "CUDA_VISIBLE_DEVICES)",
        what, device, count));
  }
  return absl::OkStatus();
}

absl::Status CheckDevicePointer(const void* data, int device, std::string_view what) {
  WB_RETURN_IF_ERROR(CheckDevice(device, what));
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, data);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: its data %p is not memory CUDA knows (cudaPointerGetAttributes: %s)",
                        what, data, cudaGetErrorString(e)));
  }
  if (a.type == cudaMemoryTypeManaged) return absl::OkStatus();
  if (a.type == cudaMemoryTypeDevice && a.device == device) return absl::OkStatus();
  if (a.type == cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: it says CUDA device %d, but its data %p is memory of CUDA device %d",
                        what, device, data, a.device));
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: it says CUDA device %d, but its data %p is host memory (%s); describe it as a CPU "
      "tensor (kDLCPU, kDLCUDAHost)",
      what, device, data, a.type == cudaMemoryTypeHost ? "pinned" : "pageable"));
}

absl::StatusOr<std::unique_ptr<Stream>> Stream::Create(int device) {
  DeviceScope scope(device);
  if (!scope.status().ok()) return scope.status();
  cudaStream_t s = nullptr;
  if (absl::Status st = CudaError(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                  absl::StrFormat("creating a stream on CUDA device %d", device));
      !st.ok()) {
    return st;
  }
  return std::unique_ptr<Stream>(new Stream(s, device));
}

Stream::~Stream() {
  DeviceScope scope(device_);
  (void)cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status Stream::Synchronize(std::string_view what) const {
  return CudaError(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), what);
}

absl::Status SynchronizeCallerStream(void* stream, int device, std::string_view what) {
  DeviceScope scope(device);
  if (!scope.status().ok()) return scope.status();
  return CudaError(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), what);
}

absl::Status CopyAsync(void* dst, const void* src, uint64_t n, const Stream& stream,
                       std::string_view what) {
  if (n == 0) return absl::OkStatus();
  DeviceScope scope(stream.device());
  if (!scope.status().ok()) return scope.status();
  return CudaError(
      cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, static_cast<cudaStream_t>(stream.get())),
      what);
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(uint64_t size, int device) {
  if (size == 0) return std::unique_ptr<DeviceBuffer>(new DeviceBuffer(nullptr, 0, device));
  DeviceScope scope(device);
  if (!scope.status().ok()) return scope.status();
  void* p = nullptr;
  if (absl::Status s =
          CudaError(cudaMalloc(&p, size),
                    absl::StrFormat("allocating %d bytes on CUDA device %d", size, device));
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<DeviceBuffer>(new DeviceBuffer(static_cast<std::byte*>(p), size, device));
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ == nullptr) return;
  DeviceScope scope(device_);
  (void)cudaFree(data_);
}

absl::Status RegisterHost(void* data, size_t size) {
  if (size == 0) return absl::OkStatus();
  return CudaError(cudaHostRegister(data, size, cudaHostRegisterPortable),
                   absl::StrFormat("pinning %d bytes of host memory (cudaHostRegister)", size));
}

void UnregisterHost(void* data) {
  if (cudaHostUnregister(data) != cudaSuccess) (void)cudaGetLastError();
}

namespace {

// Every segment's checksum of `plan` (memory of `device`), in plan.segments' order.
absl::StatusOr<std::vector<uint64_t>> RunPlan(const device_hash::Plan& plan, int device,
                                              const std::string& where) {
  std::vector<uint64_t> out(plan.segments.size(), 0);
  if (!plan.segments.empty()) {
    constexpr uint64_t kWindow = uint64_t{1} << 18;  // sums per window: 16 MiB of scratch
    const uint64_t window = std::min(plan.sums, kWindow);
    const uint64_t ranges_bytes = plan.ranges.size() * sizeof(device_hash::SumRange);
    const uint64_t segments_bytes = plan.segments.size() * sizeof(device_hash::Segment);
    const uint64_t lanes_bytes = plan.segments.size() * xxh3::kLanes * sizeof(uint64_t);
    const uint64_t out_bytes = plan.segments.size() * sizeof(uint64_t);
    const uint64_t window_bytes = window * xxh3::kLanes * sizeof(uint64_t);
    auto align = [](uint64_t n) { return (n + 255) & ~uint64_t{255}; };
    const uint64_t total = align(ranges_bytes) + align(segments_bytes) + align(lanes_bytes) +
                           align(out_bytes) + align(window_bytes);
    absl::StatusOr<std::unique_ptr<Stream>> stream = Stream::Create(device);
    if (!stream.ok()) return stream.status();
    DeviceScope scope(device);
    if (!scope.status().ok()) return scope.status();
    // Stream-ordered scratch (no device-wide synchronization in cudaFree, which would wait for a
    // transfer running beside the checksums), or plain cudaMalloc where pools are unsupported.
    void* pooled = nullptr;
    std::unique_ptr<DeviceBuffer> plain;
    if (cudaMallocAsync(&pooled, total, static_cast<cudaStream_t>((*stream)->get())) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      pooled = nullptr;
      absl::StatusOr<std::unique_ptr<DeviceBuffer>> b = DeviceBuffer::Allocate(total, device);
      if (!b.ok()) return b.status();
      plain = *std::move(b);
    }
    absl::Cleanup free_pooled = [&] {
      if (pooled != nullptr) {
        (void)cudaFreeAsync(pooled, static_cast<cudaStream_t>((*stream)->get()));
      }
    };
    std::byte* at = pooled != nullptr ? static_cast<std::byte*>(pooled) : plain->data();
    auto carve = [&at, &align](uint64_t n) {
      std::byte* p = at;
      at += align(n);
      return p;
    };
    auto* ranges_dev = reinterpret_cast<device_hash::SumRange*>(carve(ranges_bytes));
    auto* segments_dev = reinterpret_cast<device_hash::Segment*>(carve(segments_bytes));
    auto* lanes_dev = reinterpret_cast<uint64_t*>(carve(lanes_bytes));
    auto* out_dev = reinterpret_cast<uint64_t*>(carve(out_bytes));
    auto* window_dev = reinterpret_cast<uint64_t*>(carve(window_bytes));
    const Stream& s = **stream;
    absl::Status status = CopyAsync(ranges_dev, plan.ranges.data(), ranges_bytes, s, where);
    if (status.ok())
      status = CopyAsync(segments_dev, plan.segments.data(), segments_bytes, s, where);
    if (status.ok()) {
      status =
          KernelError(cuda_kernels::InitLanes(lanes_dev, plan.segments.size(), s.get()), where);
    }
    for (uint64_t begin = 0; status.ok() && begin < plan.sums; begin += window) {
      const uint64_t end = std::min(plan.sums, begin + window);
      status = KernelError(
          cuda_kernels::BlockSums(ranges_dev, plan.ranges.size(), begin, end, window_dev, s.get()),
          where);
      if (status.ok()) {
        status = KernelError(cuda_kernels::Chain(segments_dev, plan.segments.size(), begin, end,
                                                 window_dev, lanes_dev, s.get()),
                             where);
      }
    }
    if (status.ok()) {
      status = KernelError(
          cuda_kernels::Finish(segments_dev, plan.segments.size(), lanes_dev, out_dev, s.get()),
          where);
    }
    if (status.ok()) status = CopyAsync(out.data(), out_dev, out_bytes, s, where);
    std::move(free_pooled).Invoke();  // ordered after the kernels on the stream
    // Always waited for: the stream reads the plan's host arrays and writes `out`.
    const absl::Status synced = s.Synchronize(where);
    if (!status.ok()) return status;
    if (!synced.ok()) return synced;
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<TensorChecksums>> Checksum(absl::Span<const DeviceBytes> tensors,
                                                      absl::Span<const TileGrid> grids,
                                                      int device) {
  if (grids.size() != tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("checksums on CUDA device %d: %d tile grids for %d tensors", device,
                        grids.size(), tensors.size()));
  }
  const std::string where =
      absl::StrFormat("checksums of %d tensors on CUDA device %d", tensors.size(), device);
  // Whole checksums, and the tiles that are contiguous, in place.
  std::vector<const uint8_t*> data;
  std::vector<uint64_t> len, block;
  uint64_t gathered = 0;   // the largest band of tiles to gather
  uint64_t to_gather = 0;  // the bytes of every tensor whose tiles are gathered
  for (size_t i = 0; i < tensors.size(); ++i) {
    data.push_back(reinterpret_cast<const uint8_t*>(tensors[i].data));
    len.push_back(tensors[i].size);
    block.push_back(tile_gather::ContiguousTileBytes(grids[i]));
    if (block.back() == 0 && grids[i].count() > 0) {
      to_gather += tensors[i].size;
      for (uint64_t band = 0; band < grids[i].bands(); ++band) {
        gathered = std::max(gathered, tile_gather::BandBytes(grids[i], band));
      }
    }
  }
  const device_hash::Plan plan = device_hash::MakePlan(data, len, block);
  WB_ASSIGN_OR_RETURN(std::vector<uint64_t> out, RunPlan(plan, device, where));
  std::vector<TensorChecksums> result(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TensorChecksums& c = result[i];
    c.xxh3 = out[plan.whole[i]];
    c.grid = grids[i];
    c.blocks.assign(out.begin() + plan.first_block[i],
                    out.begin() + plan.first_block[i] + plan.blocks[i]);
  }
  if (gathered == 0) return result;
  // Tiles of several columns: bands gathered in tile order into scratch, as many as fit, then
  // each tile hashed whole there.
  constexpr uint64_t kScratch = uint64_t{64} << 20;
  WB_ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceBuffer> scratch,
      DeviceBuffer::Allocate(std::max(gathered, std::min(to_gather, kScratch)), device));
  WB_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, Stream::Create(device));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TileGrid& g = grids[i];
    if (block[i] != 0 || g.count() == 0) continue;
    const std::string tiles_where = absl::StrFormat(
        "%s: gathering the %d tiles of tensor %d (%d rows of %d bytes, tiles of %d rows x %d "
        "bytes)",
        where, g.count(), i, g.rows, g.row_bytes, g.tile_rows, g.tile_bytes);
    for (uint64_t band = 0; band < g.bands();) {
      std::vector<const uint8_t*> tile_data;
      std::vector<uint64_t> tile_len;
      uint64_t fill = 0;
      while (band < g.bands() && fill + tile_gather::BandBytes(g, band) <= scratch->size()) {
        uint64_t at = fill;
        for (const tile_gather::Gather& x : tile_gather::BandGathers(g, band)) {
          const uint64_t count = x.bytes / x.elem;
          WB_RETURN_IF_ERROR(Gather(tensors[i].data + x.src_offset, x.elem, x.shape, x.strides, 0,
                                    count, scratch->data() + at, *stream));
          at += x.bytes;
        }
        for (uint64_t size : tile_gather::GatheredTileBytes(g, band)) {
          tile_data.push_back(reinterpret_cast<const uint8_t*>(scratch->data() + fill));
          tile_len.push_back(size);
          fill += size;
        }
        ++band;
      }
      WB_RETURN_IF_ERROR(stream->Synchronize(tiles_where));
      const device_hash::Plan tiles =
          device_hash::MakePlan(tile_data, tile_len, std::vector<uint64_t>(tile_data.size(), 0));
      WB_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, RunPlan(tiles, device, tiles_where));
      for (size_t k = 0; k < tile_data.size(); ++k)
        result[i].blocks.push_back(sums[tiles.whole[k]]);
    }
  }
  return result;
}

absl::Status Gather(const void* src, size_t elem, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, uint64_t first, uint64_t count, void* dst,
                    const Stream& stream) {
  DeviceScope scope(stream.device());
  if (!scope.status().ok()) return scope.status();
  return KernelError(cuda_kernels::Gather(src, elem, strided::MakeLayout(shape, strides), first,
                                          count, dst, stream.get()),
                     absl::StrFormat("gathering %d elements of a strided view on CUDA device %d",
                                     count, stream.device()));
}

absl::Status Scatter(const void* src, size_t elem, const std::vector<int64_t>& shape,
                     const std::vector<int64_t>& strides, uint64_t first, uint64_t count, void* dst,
                     const Stream& stream) {
  DeviceScope scope(stream.device());
  if (!scope.status().ok()) return scope.status();
  return KernelError(cuda_kernels::Scatter(src, elem, strided::MakeLayout(shape, strides), first,
                                           count, dst, stream.get()),
                     absl::StrFormat("scattering %d elements into a strided view on CUDA device %d",
                                     count, stream.device()));
}

#else  // no CUDA support: every call that would touch a device is NotBuilt.

absl::Status CheckDevice(int device, std::string_view what) { return NotBuilt(what); }

absl::Status CheckDevicePointer(const void*, int, std::string_view what) { return NotBuilt(what); }

absl::StatusOr<std::unique_ptr<Stream>> Stream::Create(int device) {
  return NotBuilt(absl::StrFormat("a stream on CUDA device %d", device));
}
Stream::~Stream() = default;
absl::Status Stream::Synchronize(std::string_view what) const { return NotBuilt(what); }

absl::Status SynchronizeCallerStream(void*, int, std::string_view what) { return NotBuilt(what); }

absl::Status CopyAsync(void*, const void*, uint64_t, const Stream&, std::string_view what) {
  return NotBuilt(what);
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> DeviceBuffer::Allocate(uint64_t size, int device) {
  return NotBuilt(absl::StrFormat("%d bytes of CUDA device %d", size, device));
}
DeviceBuffer::~DeviceBuffer() = default;

absl::Status RegisterHost(void*, size_t) { return NotBuilt("pinning host memory"); }
void UnregisterHost(void*) {}

absl::StatusOr<std::vector<TensorChecksums>> Checksum(absl::Span<const DeviceBytes> tensors,
                                                      absl::Span<const TileGrid>, int device) {
  return NotBuilt(
      absl::StrFormat("checksums of %d tensors on CUDA device %d", tensors.size(), device));
}

absl::Status Gather(const void*, size_t, const std::vector<int64_t>&, const std::vector<int64_t>&,
                    uint64_t, uint64_t, void*, const Stream& stream) {
  return NotBuilt("gathering a strided CUDA view");
}

absl::Status Scatter(const void*, size_t, const std::vector<int64_t>&, const std::vector<int64_t>&,
                     uint64_t, uint64_t, void*, const Stream&) {
  return NotBuilt("scattering into a strided CUDA view");
}

#endif

}  // namespace weightbus::internal::cuda
