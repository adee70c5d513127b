// SPDX-License-Identifier: Apache-2.0
// Tensor vocabulary shared by every weightbus API: dtypes (the safetensors set), devices, shards
// and non-owning tensor views.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "weightbus/export.h"

namespace weightbus {

// Element types, named and sized exactly as in the safetensors format
// (https://github.com/huggingface/safetensors, `Dtype` in safetensors/src/tensor.rs, which lists
// exactly these). F8_E4M3 and F8_E5M2 are the OCP FP8 formats, F8_E4M3FNUZ and F8_E5M2FNUZ
// their variants without negative zero and infinities, F8_E8M0 the OCP MX scale format (an
// exponent only), all 1 byte each. BOOL is one byte per element. C64 is a complex number of two
// F32 (real, imaginary), 8 bytes. F4 (E2M1) and F6_E2M3 / F6_E3M2 are the OCP MX sub-byte
// formats: 4 and 6 bits per element, packed without padding, so a tensor of them must hold a
// whole number of bytes (ByteSize). weightbus moves bytes and never does arithmetic on
// elements, so every dtype is carried bit-exactly; values are added at the end to keep the
// numbering stable.
enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kF16,
  kBF16,
  kU32,
  kI32,
  kF32,
  kU64,
  kI64,
  kF64,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
  kF8E4M3FNUZ,
  kF8E5M2FNUZ,
  kC64,
  kF4,
  kF6E2M3,
  kF6E3M2,
};

inline constexpr std::array<DType, 22> kAllDTypes = {
    DType::kBool,   DType::kU8,         DType::kI8,         DType::kU16,    DType::kI16,
    DType::kF16,    DType::kBF16,       DType::kU32,        DType::kI32,    DType::kF32,
    DType::kU64,    DType::kI64,        DType::kF64,        DType::kF8E4M3, DType::kF8E5M2,
    DType::kF8E8M0, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ, DType::kC64,    DType::kF4,
    DType::kF6E2M3, DType::kF6E3M2};

// The safetensors name of `dtype`, e.g. "BF16", "F8_E4M3", "F6_E2M3". Never empty.
WB_EXPORT std::string_view DTypeName(DType dtype);

// Bits of one element: 4 (F4), 6 (F6_*), 8, 16, 32 or 64 (as safetensors' Dtype::bitsize).
WB_EXPORT size_t DTypeBits(DType dtype);

// Bytes of one element, rounded up: 1, 2, 4 or 8; 1 for the sub-byte F4 and F6_* types, whose
// sizes only ByteSize (from DTypeBits) gives exactly. Use it as the element size of byte-sized
// dtypes; tensors of sub-byte dtypes have no per-element byte address (IsSubByte).
WB_EXPORT size_t DTypeSize(DType dtype);

// True for dtypes whose elements are smaller than a byte (F4, F6_E2M3, F6_E3M2): such tensors
// are moved as whole contiguous byte ranges only (strided views of them are Unimplemented).
WB_EXPORT bool IsSubByte(DType dtype);

// Parses a safetensors dtype name (case-sensitive, e.g. "F32").
// Errors: InvalidArgument naming the unknown string and listing the accepted names.
WB_EXPORT absl::StatusOr<DType> DTypeFromName(std::string_view name);

enum class DeviceType : uint8_t {
  kCpu,
  kCuda,
};

// Where a tensor's bytes live: host memory (kCpu), or the memory of a CUDA device (kCuda), which
// builds with CUDA accept on every transport (SupportsCudaTensors(); docs/TRANSPORTS.md,
// "Device memory") and builds without refuse with Unimplemented.
struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // CUDA device ordinal; 0 for CPU.
  friend bool operator==(const Device&, const Device&) = default;
};

// This rank's slice of a larger (tensor-parallel or FSDP-sharded) tensor: the slice has the
// tensor's `shape` and starts at `offsets` (elements, one per dimension) inside a tensor of
// `global_shape`. Recorded in the manifest so that a consumer can reassemble or re-shard.
// Invariant (checked at publish): same rank as the shape, 0 <= offsets[d] and
// offsets[d] + shape[d] <= global_shape[d].
struct Shard {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
  friend bool operator==(const Shard&, const Shard&) = default;
};

// A non-owning, read-only view of one named tensor.
//
// `shape` is in elements (empty for a 0-d scalar; zero-size dimensions allowed). `strides` is in
// elements as in PyTorch and DLPack; empty means C-contiguous (row-major). Any strides are
// accepted (non-contiguous, broadcast with stride 0, negative); a non-contiguous view is packed
// into contiguous row-major order before it is sent, never sent as its raw backing span.
// `data` points at element [0, ..., 0] and may be null only when the tensor has zero elements.
// The caller keeps the bytes alive and unmodified for the duration of the call that takes the
// view (e.g. Publisher::Publish); views returned by the library stay valid as long as the object
// that returned them (e.g. an Update).
struct TensorView {
  std::string name;  // UTF-8, non-empty, unique within a version; any string PyTorch can produce.
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  const void* data = nullptr;
  Device device;
  std::optional<Shard> shard;
};

// A caller-owned buffer that a subscriber writes a received tensor into (Subscriber::Bind).
// Same conventions as TensorView; the dtype and shape must equal the manifest's, and strides may
// describe any non-overlapping layout (the received row-major bytes are scattered into it).
struct Destination {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  void* data = nullptr;
  Device device;
};

// Limits that Publish and every parser of stored or received descriptions (safetensors headers,
// manifests, delta records) apply alike, so that whatever one side accepts the other does too.
// Errors name the limit and the value found.
inline constexpr size_t kMaxTensorNameBytes = 4096;     // bytes of one tensor name (UTF-8)
inline constexpr size_t kMaxRank = 64;                  // dimensions of one shape
inline constexpr size_t kMaxTensors = size_t{1} << 20;  // tensors in one version or one file
inline constexpr int kMaxWorldSize = 1 << 16;           // ranks of one publisher group

// Number of elements of `shape` (1 for a 0-d scalar), or InvalidArgument for a negative
// dimension or a product that overflows int64.
WB_EXPORT absl::StatusOr<int64_t> NumElements(const std::vector<int64_t>& shape);

// Byte size of a contiguous tensor of `dtype` and `shape`: elements * DTypeBits / 8. Errors as
// NumElements, and InvalidArgument when the bits of a sub-byte tensor are not a whole number of
// bytes (e.g. F4 of shape [3]: 12 bits), as safetensors refuses them.
WB_EXPORT absl::StatusOr<uint64_t> ByteSize(DType dtype, const std::vector<int64_t>& shape);

// Renders a shape as "[2, 3]" (and "[]" for a 0-d scalar), for messages.
WB_EXPORT std::string ShapeString(const std::vector<int64_t>& shape);

// True when `strides` (elements) describe C-contiguous row-major order for `shape`; empty
// strides are contiguous. Dimensions of size 1 may carry any stride; any zero-size shape is
// contiguous.
WB_EXPORT bool IsContiguous(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides);

}  // namespace weightbus
