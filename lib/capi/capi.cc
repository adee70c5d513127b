// SPDX-License-Identifier: Apache-2.0
// The C API (include/weightbus/weightbus.h) over the C++ API. Every entry point catches
// exceptions; every status goes through SetStatus, the one conversion from absl::StatusCode.
#include "weightbus/weightbus.h"

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "weightbus/weightbus.hpp"

namespace wb = ::weightbus;

struct wb_publisher {
  std::unique_ptr<wb::Publisher> impl;
  pid_t pid = getpid();  // the creating process: a forked child may not use the handle
};

struct wb_host_memory {
  std::unique_ptr<wb::HostMemory> impl;
};

struct wb_publish_stream {
  std::unique_ptr<wb::PublishStream> impl;
  pid_t pid = getpid();
};

struct wb_subscriber {
  std::unique_ptr<wb::Subscriber> impl;
  pid_t pid = getpid();
};

namespace {

// One received tensor as the C API shows it. `shape` and `strides` back the DLTensor's arrays.
struct CTensor {
  std::string name;
  wb_dtype_t dtype = WB_DTYPE_FROM_DLPACK;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  DLTensor dl{};
};

// What a wb_update_t and every tensor exported from it share.
struct UpdateState {
  std::unique_ptr<wb::Update> update;
  std::vector<CTensor> tensors;
  std::string manifest_json;
  // Of a group version (whose manifest lists the ranks' parts) or a TP subscriber's slices: one
  // entry per tensor handed over (its shape, no shard, xxh3 0), for wb_update_tensor_info.
  std::vector<wb::TensorInfo> assembled;
};

// A DLManagedTensor exported by wb_update_export_dlpack: owns a reference to the update and
// its own copies of shape and strides. `managed` is first, so its address is this object's.
struct ExportedTensor {
  DLManagedTensor managed{};
  std::shared_ptr<const UpdateState> state;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

}  // namespace

struct wb_update {
  std::shared_ptr<const UpdateState> state;
};

namespace {

thread_local std::string last_error;

// THE conversion from absl::StatusCode to wb_status_t (docs/CONVENTIONS.md has the table).
wb_status_t ToCStatus(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return WB_OK;
    case absl::StatusCode::kDeadlineExceeded:
      return WB_DEADLINE_EXCEEDED;
    case absl::StatusCode::kUnavailable:
      return WB_UNAVAILABLE;
    case absl::StatusCode::kResourceExhausted:
      return WB_RESOURCE_EXHAUSTED;
    case absl::StatusCode::kAborted:
      return WB_ABORTED;
    case absl::StatusCode::kInvalidArgument:
      return WB_INVALID_ARGUMENT;
    case absl::StatusCode::kFailedPrecondition:
      return WB_FAILED_PRECONDITION;
    case absl::StatusCode::kNotFound:
      return WB_NOT_FOUND;
    case absl::StatusCode::kAlreadyExists:
      return WB_ALREADY_EXISTS;
    case absl::StatusCode::kPermissionDenied:
      return WB_PERMISSION_DENIED;
    case absl::StatusCode::kUnauthenticated:
      return WB_PERMISSION_DENIED;
    case absl::StatusCode::kOutOfRange:
      return WB_OUT_OF_RANGE;
    case absl::StatusCode::kUnimplemented:
      return WB_UNIMPLEMENTED;
    case absl::StatusCode::kDataLoss:
      return WB_DATA_LOSS;
    case absl::StatusCode::kCancelled:
      return WB_CANCELLED;
    case absl::StatusCode::kInternal:
      return WB_INTERNAL;
    case absl::StatusCode::kUnknown:
      return WB_UNKNOWN;
    default:
      return WB_UNKNOWN;  // absl's enum is not ours: codes added later land here
  }
}

// Records `status` as this thread's last result and returns its C code.
wb_status_t SetStatus(const absl::Status& status) {
  last_error.assign(status.message().data(), status.message().size());
  return ToCStatus(status.code());
}

// Runs `body` (returning absl::Status) with every exception turned into a status.
template <typename Body>
wb_status_t Guard(const char* function, Body&& body) {
  try {
    return SetStatus(body());
  } catch (const std::bad_alloc&) {
    return SetStatus(absl::ResourceExhaustedError(
        absl::StrFormat("%s: out of memory (std::bad_alloc)", function)));
  } catch (const std::exception& e) {
    return SetStatus(absl::InternalError(
        absl::StrFormat("%s: unexpected C++ exception: %s", function, e.what())));
  } catch (...) {
    return SetStatus(absl::InternalError(
        absl::StrFormat("%s: unexpected non-standard C++ exception", function)));
  }
}

absl::Status NullArgument(const char* function, const char* parameter) {
  return absl::InvalidArgumentError(absl::StrFormat("%s: %s is NULL", function, parameter));
}

#define WB_CHECK_ARG(function, parameter)                                  \
  do {                                                                     \
    if ((parameter) == nullptr) return NullArgument(function, #parameter); \
  } while (0)

absl::Status ForkedHandle(const char* function, const char* parameter, pid_t creator) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s: %s was created by process %d and this is process %d, a forked child: a handle "
      "cannot be used across fork(); create a new one in the child",
      function, parameter, creator, getpid()));
}

// A publisher or subscriber handle: not NULL, and created by this process.
#define WB_CHECK_HANDLE(function, handle)                                                 \
  do {                                                                                    \
    WB_CHECK_ARG(function, handle);                                                       \
    if ((handle)->pid != getpid()) return ForkedHandle(function, #handle, (handle)->pid); \
  } while (0)

// Reads a caller's parameter struct whose first member is `size_t struct_size` into `*out`
// (value-initialized: fields the caller's struct is too old to have keep their defaults).
// `in` may be NULL (every default); `first_version_size` is the size of the struct's first
// published layout, the smallest struct_size accepted.
template <typename T>
absl::Status ReadParams(const char* function, const T* in, size_t first_version_size, T* out) {
  *out = T{};
  out->struct_size = sizeof(T);
  if (in == nullptr) return absl::OkStatus();
  const size_t size = in->struct_size;
  if (size < first_version_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: params.struct_size is %d, smaller than any version of the struct (%d); initialize "
        "params with its WB_*_INIT macro",
        function, size, first_version_size));
  }
  std::memcpy(out, in, std::min(size, sizeof(T)));
  out->struct_size = sizeof(T);
  const auto* bytes = reinterpret_cast<const unsigned char*>(in);
  for (size_t i = sizeof(T); i < size; ++i) {
    if (bytes[i] != 0) {
      return absl::UnimplementedError(absl::StrFormat(
          "%s: params.struct_size is %d but this library (weightbus %s) knows %d bytes of the "
          "struct and the byte at offset %d is set: the caller uses a field this library lacks",
          function, size, WEIGHTBUS_VERSION_STRING, sizeof(T), i));
    }
  }
  return absl::OkStatus();
}

// Fills the fields of a caller's output struct (stats, infos) that fit in its struct_size.
// `parameter` names the struct in messages ("stats", "info").
template <typename T>
absl::Status WriteOutput(const char* function, const T& value, T* out, size_t first_version_size,
                         const char* parameter = "stats") {
  const size_t size = out->struct_size;
  if (size < first_version_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s.struct_size is %d, smaller than any version of the struct (%d); initialize "
        "it with its WB_*_INIT macro",
        function, parameter, size, first_version_size));
  }
  const size_t n = std::min(size, sizeof(T));
  std::memcpy(reinterpret_cast<char*>(out) + sizeof(size_t),
              reinterpret_cast<const char*>(&value) + sizeof(size_t), n - sizeof(size_t));
  return absl::OkStatus();
}

// Sizes of the first published layouts (these never change).
constexpr size_t kOpenParamsV1 = sizeof(wb_open_params_t);
constexpr size_t kPublishParamsV1 = offsetof(wb_publish_params_t, shards);  // before `shards`
constexpr size_t kBindParamsV1 = sizeof(wb_bind_params_t);
constexpr size_t kStreamAddParamsV1 = sizeof(wb_stream_add_params_t);
constexpr size_t kPublishStatsV1 = offsetof(wb_publish_stats_t, flags);    // before `flags`
constexpr size_t kUpdateStatsV1 = offsetof(wb_update_stats_t, decode_ns);  // before `decode_ns`
constexpr size_t kSettingInfoV1 = sizeof(wb_setting_info_t);
constexpr size_t kPlacementsV1 = offsetof(wb_placements_t, experts);  // before `experts`
constexpr size_t kTensorInfoV1 = sizeof(wb_tensor_info_t);

absl::Duration Timeout(int64_t timeout_ms) {
  return timeout_ms < 0 ? absl::InfiniteDuration() : absl::Milliseconds(timeout_ms);
}

absl::StatusOr<wb::Options> ReadOptions(const char* function, const char* what,
                                        const wb_option_t* options, size_t n) {
  wb::Options out;
  if (n > 0 && options == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s is NULL but its count is %d", function, what, n));
  }
  for (size_t i = 0; i < n; ++i) {
    if (options[i].key == nullptr || options[i].value == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s[%d] has a NULL key or value", function, what, i));
    }
    if (!out.emplace(options[i].key, options[i].value).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s names \"%s\" twice", function, what, options[i].key));
    }
  }
  return out;
}

// A wb_dtype_t as the integer it is stored as. C lets a caller's wb_dtype_t hold any value of
// that integer type, C++ only values in its enumerators' range (0..31), and reading any other
// as the enum is undefined behaviour (UBSan: "load of value 42, which is not a valid value for
// type 'wb_dtype'"): so the C API reads callers' dtypes as the integer, and checks it before it
// becomes a wb::DType.
using CDType = std::underlying_type_t<wb_dtype_t>;
CDType RawDType(const wb_dtype_t& dtype) {
  CDType raw;
  std::memcpy(&raw, &dtype, sizeof raw);
  return raw;
}

// wb_dtype_t (as its integer) <-> weightbus::DType (exhaustive both ways).
absl::StatusOr<wb::DType> FromCDType(CDType dtype) {
  switch (dtype) {
    case WB_DTYPE_BOOL:
      return wb::DType::kBool;
    case WB_DTYPE_U8:
      return wb::DType::kU8;
    case WB_DTYPE_I8:
      return wb::DType::kI8;
    case WB_DTYPE_U16:
      return wb::DType::kU16;
    case WB_DTYPE_I16:
      return wb::DType::kI16;
    case WB_DTYPE_F16:
      return wb::DType::kF16;
    case WB_DTYPE_BF16:
      return wb::DType::kBF16;
    case WB_DTYPE_U32:
      return wb::DType::kU32;
    case WB_DTYPE_I32:
      return wb::DType::kI32;
    case WB_DTYPE_F32:
      return wb::DType::kF32;
    case WB_DTYPE_U64:
      return wb::DType::kU64;
    case WB_DTYPE_I64:
      return wb::DType::kI64;
    case WB_DTYPE_F64:
      return wb::DType::kF64;
    case WB_DTYPE_F8_E4M3:
      return wb::DType::kF8E4M3;
    case WB_DTYPE_F8_E5M2:
      return wb::DType::kF8E5M2;
    case WB_DTYPE_F8_E8M0:
      return wb::DType::kF8E8M0;
    case WB_DTYPE_F8_E4M3FNUZ:
      return wb::DType::kF8E4M3FNUZ;
    case WB_DTYPE_F8_E5M2FNUZ:
      return wb::DType::kF8E5M2FNUZ;
    case WB_DTYPE_C64:
      return wb::DType::kC64;
    case WB_DTYPE_F4:
      return wb::DType::kF4;
    case WB_DTYPE_F6_E2M3:
      return wb::DType::kF6E2M3;
    case WB_DTYPE_F6_E3M2:
      return wb::DType::kF6E3M2;
    case WB_DTYPE_FROM_DLPACK:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("%d is not a wb_dtype_t element type", static_cast<int64_t>(dtype)));
}

wb_dtype_t ToCDType(wb::DType dtype) {
  switch (dtype) {
    case wb::DType::kBool:
      return WB_DTYPE_BOOL;
    case wb::DType::kU8:
      return WB_DTYPE_U8;
    case wb::DType::kI8:
      return WB_DTYPE_I8;
    case wb::DType::kU16:
      return WB_DTYPE_U16;
    case wb::DType::kI16:
      return WB_DTYPE_I16;
    case wb::DType::kF16:
      return WB_DTYPE_F16;
    case wb::DType::kBF16:
      return WB_DTYPE_BF16;
    case wb::DType::kU32:
      return WB_DTYPE_U32;
    case wb::DType::kI32:
      return WB_DTYPE_I32;
    case wb::DType::kF32:
      return WB_DTYPE_F32;
    case wb::DType::kU64:
      return WB_DTYPE_U64;
    case wb::DType::kI64:
      return WB_DTYPE_I64;
    case wb::DType::kF64:
      return WB_DTYPE_F64;
    case wb::DType::kF8E4M3:
      return WB_DTYPE_F8_E4M3;
    case wb::DType::kF8E5M2:
      return WB_DTYPE_F8_E5M2;
    case wb::DType::kF8E8M0:
      return WB_DTYPE_F8_E8M0;
    case wb::DType::kF8E4M3FNUZ:
      return WB_DTYPE_F8_E4M3FNUZ;
    case wb::DType::kF8E5M2FNUZ:
      return WB_DTYPE_F8_E5M2FNUZ;
    case wb::DType::kC64:
      return WB_DTYPE_C64;
    case wb::DType::kF4:
      return WB_DTYPE_F4;
    case wb::DType::kF6E2M3:
      return WB_DTYPE_F6_E2M3;
    case wb::DType::kF6E3M2:
      return WB_DTYPE_F6_E3M2;
  }
  return WB_DTYPE_FROM_DLPACK;
}

// The DLPack 0.6 type a tensor of `dtype` is exposed as: BOOL and the F8 types, which DLPack
// 0.6 cannot name, as 8-bit unsigned integers.
DLDataType ToDLDataType(wb::DType dtype) {
  auto make = [](DLDataTypeCode code, int bits) {
    return DLDataType{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  };
  switch (dtype) {
    case wb::DType::kBool:
      return make(kDLUInt, 8);
    case wb::DType::kU8:
      return make(kDLUInt, 8);
    case wb::DType::kI8:
      return make(kDLInt, 8);
    case wb::DType::kU16:
      return make(kDLUInt, 16);
    case wb::DType::kI16:
      return make(kDLInt, 16);
    case wb::DType::kF16:
      return make(kDLFloat, 16);
    case wb::DType::kBF16:
      return make(kDLBfloat, 16);
    case wb::DType::kU32:
      return make(kDLUInt, 32);
    case wb::DType::kI32:
      return make(kDLInt, 32);
    case wb::DType::kF32:
      return make(kDLFloat, 32);
    case wb::DType::kU64:
      return make(kDLUInt, 64);
    case wb::DType::kI64:
      return make(kDLInt, 64);
    case wb::DType::kF64:
      return make(kDLFloat, 64);
    case wb::DType::kF8E4M3:
      return make(kDLUInt, 8);
    case wb::DType::kF8E5M2:
    case wb::DType::kF8E8M0:
    case wb::DType::kF8E4M3FNUZ:
    case wb::DType::kF8E5M2FNUZ:
      return make(kDLUInt, 8);
    case wb::DType::kC64:
      return make(kDLComplex, 64);
    case wb::DType::kF4:  // never exposed (SubByteUnimplemented); the packed bytes
    case wb::DType::kF6E2M3:
    case wb::DType::kF6E3M2:
      return make(kDLUInt, 8);
  }
  return make(kDLUInt, 8);
}

std::string DLDataTypeString(DLDataType t) {
  const char* code = "code?";
  switch (t.code) {
    case kDLInt:
      code = "int";
      break;
    case kDLUInt:
      code = "uint";
      break;
    case kDLFloat:
      code = "float";
      break;
    case kDLBfloat:
      code = "bfloat";
      break;
    case kDLOpaqueHandle:
      code = "opaque";
      break;
    case kDLComplex:
      code = "complex";
      break;
    default:
      break;
  }
  return t.lanes == 1 ? absl::StrFormat("%s%d", code, t.bits)
                      : absl::StrFormat("%s%dx%d", code, t.bits, t.lanes);
}

// Tensors of 4- and 6-bit elements cannot be described by a DLPack 0.6 DLTensor (its shape
// counts elements of a whole number of bytes).
absl::Status SubByteUnimplemented(std::string_view name, wb::DType dtype) {
  return absl::UnimplementedError(absl::StrFormat(
      "tensor \"%s\" has dtype %s (%d-bit elements, packed), which a DLPack 0.6 tensor cannot "
      "describe; the C API does not support sub-byte dtypes (the C++ API does)",
      name, wb::DTypeName(dtype), wb::DTypeBits(dtype)));
}

// The weightbus element type of a DLTensor, applying `override` (FROM_DLPACK: none).
absl::StatusOr<wb::DType> DTypeOf(std::string_view name, DLDataType t, CDType override) {
  std::optional<wb::DType> native;
  if (t.lanes == 1) {
    switch (t.code) {
      case kDLInt:
        if (t.bits == 8) native = wb::DType::kI8;
        if (t.bits == 16) native = wb::DType::kI16;
        if (t.bits == 32) native = wb::DType::kI32;
        if (t.bits == 64) native = wb::DType::kI64;
        break;
      case kDLUInt:
        if (t.bits == 8) native = wb::DType::kU8;
        if (t.bits == 16) native = wb::DType::kU16;
        if (t.bits == 32) native = wb::DType::kU32;
        if (t.bits == 64) native = wb::DType::kU64;
        break;
      case kDLFloat:
        if (t.bits == 16) native = wb::DType::kF16;
        if (t.bits == 32) native = wb::DType::kF32;
        if (t.bits == 64) native = wb::DType::kF64;
        break;
      case kDLBfloat:
        if (t.bits == 16) native = wb::DType::kBF16;
        break;
      case kDLComplex:
        if (t.bits == 64) native = wb::DType::kC64;
        break;
      default:
        break;
    }
  }
  if (override == WB_DTYPE_FROM_DLPACK) {
    if (!native) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor \"%s\": DLPack type %s (code %d, bits %d, lanes %d) has no safetensors "
          "element type; pass an 8/16/32/64-bit int, uint or float, or bfloat16, with lanes 1, "
          "or name the type in a wb_dtype_t override",
          name, DLDataTypeString(t), t.code, t.bits, t.lanes));
    }
    return *native;
  }
  absl::StatusOr<wb::DType> dtype = FromCDType(override);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor \"%s\": dtype override %s", name, dtype.status().message()));
  }
  if (wb::IsSubByte(*dtype)) return SubByteUnimplemented(name, *dtype);
  if (t.lanes != 1 || t.bits % 8 != 0 || t.bits / 8 != wb::DTypeSize(*dtype)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor \"%s\": dtype override %s (%d-byte elements) does not match the DLTensor's "
        "element type %s",
        name, wb::DTypeName(*dtype), wb::DTypeSize(*dtype), DLDataTypeString(t)));
  }
  return *dtype;
}

absl::StatusOr<wb::Device> DeviceOf(std::string_view name, DLDevice d) {
  switch (d.device_type) {
    case kDLCPU:
    case kDLCUDAHost:     // pinned host memory
    case kDLCUDAManaged:  // unified memory: accessible from the CPU
      return wb::Device{wb::DeviceType::kCpu, 0};
    case kDLCUDA:
      return wb::Device{wb::DeviceType::kCuda, d.device_id};
    default:
      break;
  }
  return absl::UnimplementedError(
      absl::StrFormat("tensor \"%s\": DLPack device type %d is not supported (kDLCPU, kDLCUDAHost, "
                      "kDLCUDAManaged and kDLCUDA are)",
                      name, static_cast<int>(d.device_type)));
}

// The parts of a DLTensor that TensorView and Destination share.
struct Layout {
  wb::DType dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  void* data;
  wb::Device device;
};

absl::StatusOr<Layout> LayoutOf(std::string_view name, const DLTensor& t, CDType override) {
  if (t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor \"%s\": DLTensor has ndim %d and %s shape", name, t.ndim,
                        t.shape == nullptr ? "a NULL" : "a"));
  }
  absl::StatusOr<wb::DType> dtype = DTypeOf(name, t.dtype, override);
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<wb::Device> device = DeviceOf(name, t.device);
  if (!device.ok()) return device.status();
  Layout out{*dtype, std::vector<int64_t>(t.shape, t.shape + t.ndim), {}, nullptr, *device};
  if (t.strides != nullptr) out.strides.assign(t.strides, t.strides + t.ndim);
  out.data = t.data == nullptr ? nullptr : static_cast<char*>(t.data) + t.byte_offset;
  return out;
}

// The shard of tensor `index` (`shard` NULL: published whole). The core checks the rank and
// bounds against the tensor's shape (tensor_pack.cc); here only what C adds: pointers.
absl::StatusOr<std::optional<wb::Shard>> ShardOf(std::string_view name, size_t index,
                                                 const wb_shard_t* shard) {
  if (shard == nullptr) return std::nullopt;
  if (shard->ndim < 0 ||
      (shard->ndim > 0 && (shard->global_shape == nullptr || shard->offsets == nullptr))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor \"%s\": params.shards[%d] has ndim %d and %s global_shape and %s offsets", name,
        index, shard->ndim, shard->global_shape == nullptr ? "a NULL" : "a",
        shard->offsets == nullptr ? "NULL" : "non-NULL"));
  }
  wb::Shard out;
  out.global_shape.assign(shard->global_shape, shard->global_shape + shard->ndim);
  out.offsets.assign(shard->offsets, shard->offsets + shard->ndim);
  return out;
}

// The library-wide lists of wb_transport_* and wb_setting_*: built once, on first use
// (thread-safe), and never freed, so that their strings stay valid until the library is
// unloaded (also during other libraries' static destructors).
const std::vector<std::string>& TransportList() {
  static const auto* list = new std::vector<std::string>(wb::Transports());
  return *list;
}

const std::vector<wb::SettingInfo>& SettingList() {
  static const auto* list = new std::vector<wb::SettingInfo>(wb::DescribeSettings());
  return *list;
}

absl::Status IndexPastEnd(const char* function, const char* what, size_t index, size_t count) {
  return absl::OutOfRangeError(
      absl::StrFormat("%s: index %d is past the end of the %d %s", function, index, count, what));
}

// The published tensor `index` named `name`: its layout with the dtype `override` and its
// shard. Errors name the tensor, prefixed with `where` ("<uri> version 7").
absl::StatusOr<wb::TensorView> ViewOf(const char* name, size_t index, const DLTensor& tensor,
                                      CDType override, const wb_shard_t* shard_in,
                                      std::string_view where) {
  absl::StatusOr<Layout> layout = LayoutOf(name, tensor, override);
  absl::StatusOr<std::optional<wb::Shard>> shard =
      layout.ok() ? ShardOf(name, index, shard_in)
                  : absl::StatusOr<std::optional<wb::Shard>>(layout.status());
  if (!shard.ok()) {
    return absl::Status(shard.status().code(),
                        absl::StrFormat("%s: %s", where, shard.status().message()));
  }
  return wb::TensorView{
      name,         layout->dtype,  std::move(layout->shape), std::move(layout->strides),
      layout->data, layout->device, std::move(*shard)};
}

absl::Status Publish(wb_publisher_t* publisher, uint64_t version, const char* const* names,
                     const DLTensor* tensors, size_t num_tensors,
                     const wb_publish_params_t* params_in, int64_t timeout_ms) {
  constexpr const char* kFn = "wb_publisher_publish";
  WB_CHECK_HANDLE(kFn, publisher);
  if (num_tensors > 0) {
    WB_CHECK_ARG(kFn, names);
    WB_CHECK_ARG(kFn, tensors);
  }
  wb_publish_params_t params;
  if (absl::Status s = ReadParams(kFn, params_in, kPublishParamsV1, &params); !s.ok()) return s;
  absl::StatusOr<wb::Metadata> metadata =
      ReadOptions(kFn, "params.metadata", params.metadata, params.num_metadata);
  if (!metadata.ok()) return metadata.status();
  std::vector<wb::TensorView> views;
  views.reserve(num_tensors);
  for (size_t i = 0; i < num_tensors; ++i) {
    if (names[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: %s version %d: names[%d] is NULL", kFn,
                                                        publisher->impl->uri(), version, i));
    }
    absl::StatusOr<wb::TensorView> view =
        ViewOf(names[i], i, tensors[i],
               params.dtypes ? RawDType(params.dtypes[i]) : CDType{WB_DTYPE_FROM_DLPACK},
               params.shards ? params.shards[i] : nullptr,
               absl::StrFormat("%s version %d", publisher->impl->uri(), version));
    if (!view.ok()) return view.status();
    views.push_back(*std::move(view));
  }
  return publisher->impl->Publish(version, views, *metadata, Timeout(timeout_ms),
                                  params.cuda_stream);
}

// Hands a received version (or, polling, none) to the caller as *update.
absl::Status HandOver(absl::StatusOr<std::unique_ptr<wb::Update>> received, wb_update_t** update);

// wb_subscriber_wait and, with `poll`, wb_subscriber_poll.
// `receive_timeout_ms` >= 0: wb_subscriber_wait_then_receive (timeout_ms finds, it receives).
absl::Status Wait(const char* function, wb_subscriber_t* subscriber, uint64_t min_version,
                  int64_t timeout_ms, bool poll, wb_update_t** update,
                  std::optional<int64_t> receive_timeout_ms = std::nullopt) {
  WB_CHECK_HANDLE(function, subscriber);
  WB_CHECK_ARG(function, update);
  absl::StatusOr<std::unique_ptr<wb::Update>> received =
      poll                 ? subscriber->impl->Poll(min_version, Timeout(timeout_ms))
      : receive_timeout_ms ? subscriber->impl->WaitForVersion(min_version, Timeout(timeout_ms),
                                                              Timeout(*receive_timeout_ms))
                           : subscriber->impl->WaitForVersion(min_version, Timeout(timeout_ms));
  return HandOver(std::move(received), update);
}

absl::Status HandOver(absl::StatusOr<std::unique_ptr<wb::Update>> received, wb_update_t** update) {
  if (!received.ok()) return received.status();
  if (*received == nullptr) {  // polling, and nothing new enough
    *update = nullptr;
    return absl::OkStatus();
  }
  auto state = std::make_shared<UpdateState>();
  state->update = std::move(*received);
  const absl::Span<const wb::TensorView> views = state->update->tensors();
  state->tensors.resize(views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    const wb::TensorView& v = views[i];
    CTensor& c = state->tensors[i];
    c.name = v.name;
    c.dtype = ToCDType(v.dtype);
    c.shape = v.shape;
    c.strides = v.strides;
    c.dl.data = const_cast<void*>(v.data);
    c.dl.device = v.device.type == wb::DeviceType::kCuda ? DLDevice{kDLCUDA, v.device.index}
                                                         : DLDevice{kDLCPU, 0};
    c.dl.ndim = static_cast<int>(c.shape.size());
    c.dl.dtype = ToDLDataType(v.dtype);
    c.dl.shape = c.shape.empty() ? nullptr : c.shape.data();
    c.dl.strides = c.strides.empty() ? nullptr : c.strides.data();
    c.dl.byte_offset = 0;
  }
  state->manifest_json = state->update->manifest().ToJson();
  // Handed over otherwise than published: a group version's tensors assembled, or a TP
  // subscriber's slices (SubscribePlacements).
  const wb::Manifest& m = state->update->manifest();
  bool as_published = !m.group && views.size() == m.tensors.size();
  for (size_t i = 0; as_published && i < views.size(); ++i) {
    as_published = views[i].name == m.tensors[i].name && views[i].shape == m.tensors[i].shape;
  }
  if (!as_published) {
    for (const wb::TensorView& v : views) {
      state->assembled.push_back(wb::TensorInfo{v.name, v.dtype, v.shape, std::nullopt,
                                                wb::ByteSize(v.dtype, v.shape).value_or(0), 0, 0});
    }
  }
  *update = new wb_update{std::move(state)};
  return absl::OkStatus();
}

// `dlpack`: the caller wants the tensor as a DLTensor, which a sub-byte dtype cannot be (its
// name and dtype are still available).
absl::Status CheckIndex(const char* function, const wb_update_t* update, size_t index,
                        bool dlpack = true) {
  if (index >= update->state->tensors.size()) {
    return absl::OutOfRangeError(
        absl::StrFormat("%s: tensor index %d is past the end of version %d (%d tensors)", function,
                        index, update->state->update->version(), update->state->tensors.size()));
  }
  const wb::TensorView& v = update->state->update->tensors()[index];
  if (dlpack && wb::IsSubByte(v.dtype)) return SubByteUnimplemented(v.name, v.dtype);
  return absl::OkStatus();
}

void DeleteExported(DLManagedTensor* self) { delete reinterpret_cast<ExportedTensor*>(self); }

}  // namespace

extern "C" {

const char* wb_status_string(wb_status_t status) {
  switch (status) {
    case WB_OK:
      return "WB_OK: success";
    case WB_DEADLINE_EXCEEDED:
      return "WB_DEADLINE_EXCEEDED: the timeout passed first (retryable)";
    case WB_UNAVAILABLE:
      return "WB_UNAVAILABLE: a peer is gone or not reachable yet (retryable)";
    case WB_RESOURCE_EXHAUSTED:
      return "WB_RESOURCE_EXHAUSTED: out of disk space or memory (retryable after freeing some)";
    case WB_ABORTED:
      return "WB_ABORTED: interrupted by a concurrent operation (retryable)";
    case WB_INVALID_ARGUMENT:
      return "WB_INVALID_ARGUMENT: the caller's input is wrong (tensor, URI, setting, binding)";
    case WB_FAILED_PRECONDITION:
      return "WB_FAILED_PRECONDITION: the call conflicts with the channel's state";
    case WB_NOT_FOUND:
      return "WB_NOT_FOUND: a named file, tensor or channel does not exist";
    case WB_ALREADY_EXISTS:
      return "WB_ALREADY_EXISTS: something to be created exists already";
    case WB_PERMISSION_DENIED:
      return "WB_PERMISSION_DENIED: the system refused access";
    case WB_OUT_OF_RANGE:
      return "WB_OUT_OF_RANGE: an index or value past the valid range";
    case WB_UNIMPLEMENTED:
      return "WB_UNIMPLEMENTED: the feature, transport, device or field is not built in";
    case WB_DATA_LOSS:
      return "WB_DATA_LOSS: stored or received bytes are malformed or fail their checksum";
    case WB_CANCELLED:
      return "WB_CANCELLED: the operation was cancelled";
    case WB_INTERNAL:
      return "WB_INTERNAL: unexpected system error";
    case WB_UNKNOWN:
      return "WB_UNKNOWN: unclassified error";
  }
  return "not a wb_status_t value";
}

const char* wb_last_error_message(void) { return last_error.c_str(); }

const char* wb_version(void) { return WEIGHTBUS_VERSION_STRING; }

uint32_t wb_version_number(void) { return WEIGHTBUS_VERSION; }

wb_status_t wb_check_version(uint32_t compiled_version) {
  return Guard("wb_check_version", [&]() -> absl::Status {
    const uint32_t library = WEIGHTBUS_VERSION;
    if (compiled_version / 10000 == library / 10000 && compiled_version <= library) {
      return absl::OkStatus();
    }
    auto text = [](uint32_t v) {
      return absl::StrFormat("%d.%d.%d", v / 10000, v / 100 % 100, v % 100);
    };
    return absl::FailedPreconditionError(absl::StrFormat(
        "the program was compiled against weightbus %s but the loaded library is %s: %s",
        text(compiled_version), text(library),
        compiled_version / 10000 != library / 10000
            ? "major versions differ"
            : "the library is older than the headers (functions or fields may be missing)"));
  });
}

wb_status_t wb_transport_count(size_t* count) {
  constexpr const char* kFn = "wb_transport_count";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, count);
    *count = TransportList().size();
    return absl::OkStatus();
  });
}

wb_status_t wb_transport_scheme(size_t index, const char** scheme) {
  constexpr const char* kFn = "wb_transport_scheme";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, scheme);
    const std::vector<std::string>& list = TransportList();
    if (index >= list.size()) return IndexPastEnd(kFn, "transports", index, list.size());
    *scheme = list[index].c_str();
    return absl::OkStatus();
  });
}

wb_status_t wb_setting_count(size_t* count) {
  constexpr const char* kFn = "wb_setting_count";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, count);
    *count = SettingList().size();
    return absl::OkStatus();
  });
}

wb_status_t wb_setting_info(size_t index, wb_setting_info_t* info) {
  constexpr const char* kFn = "wb_setting_info";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, info);
    const std::vector<wb::SettingInfo>& list = SettingList();
    if (index >= list.size()) return IndexPastEnd(kFn, "settings", index, list.size());
    const wb::SettingInfo& s = list[index];
    const wb_setting_info_t value{
        sizeof(wb_setting_info_t), s.scope.c_str(), s.name.c_str(), s.type.c_str(),
        s.default_value.c_str(),   s.env.c_str(),   s.doc.c_str()};
    return WriteOutput(kFn, value, info, kSettingInfoV1, "info");
  });
}

const char* wb_dtype_name(wb_dtype_t dtype) {
  const CDType raw = RawDType(dtype);
  if (raw == WB_DTYPE_FROM_DLPACK) return "FROM_DLPACK";
  absl::StatusOr<wb::DType> d = FromCDType(raw);
  return d.ok() ? wb::DTypeName(*d).data() : "?";  // DTypeName views string literals
}

wb_status_t wb_publisher_create(const char* uri, const wb_open_params_t* params_in,
                                wb_publisher_t** publisher) {
  constexpr const char* kFn = "wb_publisher_create";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, uri);
    WB_CHECK_ARG(kFn, publisher);
    wb_open_params_t params;
    if (absl::Status s = ReadParams(kFn, params_in, kOpenParamsV1, &params); !s.ok()) return s;
    absl::StatusOr<wb::Options> options =
        ReadOptions(kFn, "params.options", params.options, params.num_options);
    if (!options.ok()) return options.status();
    absl::StatusOr<std::unique_ptr<wb::Publisher>> p = wb::Publisher::Open(uri, *options);
    if (!p.ok()) return p.status();
    *publisher = new wb_publisher{std::move(*p)};
    return absl::OkStatus();
  });
}

void wb_publisher_destroy(wb_publisher_t* publisher) {
  try {
    delete publisher;
  } catch (...) {  // destructors do not throw; nothing may cross the boundary regardless
  }
}

wb_status_t wb_publisher_cancel(wb_publisher_t* publisher) {
  constexpr const char* kFn = "wb_publisher_cancel";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, publisher);
    publisher->impl->Cancel();
    return absl::OkStatus();
  });
}

wb_status_t wb_publisher_publish(wb_publisher_t* publisher, uint64_t version,
                                 const char* const* names, const DLTensor* tensors,
                                 size_t num_tensors, const wb_publish_params_t* params,
                                 int64_t timeout_ms) {
  return Guard("wb_publisher_publish", [&] {
    return Publish(publisher, version, names, tensors, num_tensors, params, timeout_ms);
  });
}

wb_status_t wb_publisher_latest_version(wb_publisher_t* publisher, bool* has_version,
                                        uint64_t* version) {
  constexpr const char* kFn = "wb_publisher_latest_version";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, publisher);
    WB_CHECK_ARG(kFn, has_version);
    WB_CHECK_ARG(kFn, version);
    const std::optional<uint64_t> latest = publisher->impl->latest_version();
    *has_version = latest.has_value();
    *version = latest.value_or(0);
    return absl::OkStatus();
  });
}

wb_status_t wb_publisher_last_stats(wb_publisher_t* publisher, wb_publish_stats_t* stats) {
  constexpr const char* kFn = "wb_publisher_last_stats";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, publisher);
    WB_CHECK_ARG(kFn, stats);
    const wb::PublishStats s = publisher->impl->last_stats();
    wb_publish_stats_t value{sizeof(wb_publish_stats_t),
                             s.version,
                             s.bytes,
                             absl::ToInt64Nanoseconds(s.stall),
                             absl::ToInt64Nanoseconds(s.pack),
                             absl::ToInt64Nanoseconds(s.checksum_wait),
                             absl::ToInt64Nanoseconds(s.transport),
                             s.unchanged ? WB_PUBLISH_UNCHANGED : 0,
                             absl::ToInt64Nanoseconds(s.encode),
                             s.wire_bytes,
                             nullptr};
    // The text lives until this thread's next call (as wb_last_error_message's).
    thread_local std::string encoding;
    encoding = s.encoding;
    value.encoding = encoding.c_str();
    return WriteOutput(kFn, value, stats, kPublishStatsV1);
  });
}

wb_status_t wb_publisher_wait_for_receivers(wb_publisher_t* publisher, uint64_t version, int count,
                                            int64_t timeout_ms) {
  constexpr const char* kFn = "wb_publisher_wait_for_receivers";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, publisher);
    return publisher->impl->WaitForReceivers(version, count, Timeout(timeout_ms));
  });
}

wb_status_t wb_publisher_uri(wb_publisher_t* publisher, const char** uri) {
  constexpr const char* kFn = "wb_publisher_uri";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, publisher);
    WB_CHECK_ARG(kFn, uri);
    *uri = publisher->impl->uri().c_str();
    return absl::OkStatus();
  });
}

wb_status_t wb_publisher_allocate_host(wb_publisher_t* publisher, uint64_t bytes,
                                       wb_host_memory_t** memory, void** data) {
  constexpr const char* kFn = "wb_publisher_allocate_host";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, publisher);
    WB_CHECK_ARG(kFn, memory);
    WB_CHECK_ARG(kFn, data);
    absl::StatusOr<std::unique_ptr<wb::HostMemory>> m = publisher->impl->AllocateHost(bytes);
    if (!m.ok()) return m.status();
    auto handle = std::make_unique<wb_host_memory>();
    handle->impl = *std::move(m);
    *data = handle->impl->data();
    *memory = handle.release();
    return absl::OkStatus();
  });
}

void wb_host_memory_free(wb_host_memory_t* memory) { delete memory; }

wb_status_t wb_publisher_begin_publish(wb_publisher_t* publisher, uint64_t version,
                                       const wb_publish_params_t* params_in,
                                       wb_publish_stream_t** stream) {
  constexpr const char* kFn = "wb_publisher_begin_publish";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, publisher);
    WB_CHECK_ARG(kFn, stream);
    wb_publish_params_t params;
    if (absl::Status s = ReadParams(kFn, params_in, kPublishParamsV1, &params); !s.ok()) return s;
    if (params.dtypes != nullptr || params.shards != nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s version %d: params.dtypes and params.shards must be NULL (give each tensor's "
          "in its wb_stream_add_params_t)",
          kFn, publisher->impl->uri(), version));
    }
    absl::StatusOr<wb::Metadata> metadata =
        ReadOptions(kFn, "params.metadata", params.metadata, params.num_metadata);
    if (!metadata.ok()) return metadata.status();
    absl::StatusOr<std::unique_ptr<wb::PublishStream>> opened =
        publisher->impl->BeginPublish(version, *metadata);
    if (!opened.ok()) return opened.status();
    auto handle = std::make_unique<wb_publish_stream>();
    handle->impl = *std::move(opened);
    *stream = handle.release();
    return absl::OkStatus();
  });
}

wb_status_t wb_publish_stream_add(wb_publish_stream_t* stream, const char* name,
                                  const DLTensor* tensor, const wb_stream_add_params_t* params_in) {
  constexpr const char* kFn = "wb_publish_stream_add";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, stream);
    WB_CHECK_ARG(kFn, name);
    WB_CHECK_ARG(kFn, tensor);
    wb_stream_add_params_t params;
    if (absl::Status s = ReadParams(kFn, params_in, kStreamAddParamsV1, &params); !s.ok()) {
      return s;
    }
    absl::StatusOr<wb::TensorView> view =
        ViewOf(name, stream->impl->tensor_count(), *tensor, RawDType(params.dtype), params.shard,
               absl::StrFormat("%s: version %d", kFn, stream->impl->version()));
    if (!view.ok()) return view.status();
    return stream->impl->Add(*view, params.cuda_stream);
  });
}

wb_status_t wb_publish_stream_commit(wb_publish_stream_t* stream, int64_t timeout_ms) {
  constexpr const char* kFn = "wb_publish_stream_commit";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, stream);
    return stream->impl->Commit(Timeout(timeout_ms));
  });
}

wb_status_t wb_publish_stream_abort(wb_publish_stream_t* stream) {
  constexpr const char* kFn = "wb_publish_stream_abort";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, stream);
    stream->impl->Abort();
    return absl::OkStatus();
  });
}

void wb_publish_stream_destroy(wb_publish_stream_t* stream) {
  if (stream == nullptr) return;
  if (stream->pid != getpid()) {  // inherited across fork(): the parent's version, left alone
    (void)stream->impl.release();
  }
  try {
    delete stream;
  } catch (...) {  // destructors do not throw; nothing may cross the boundary regardless
  }
}

bool wb_supports_cuda_tensors(void) { return wb::SupportsCudaTensors(); }

// The C placements as weightbus::SubscribePlacements.
static absl::StatusOr<wb::SubscribePlacements> ReadPlacements(const char* function,
                                                              const wb_placements_t& in) {
  wb::SubscribePlacements out;
  out.rank = {in.tp_size, in.tp_rank};
  if (in.num_rules > 0 && in.rules == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: placements.rules is NULL with num_rules %d", function, in.num_rules));
  }
  auto strings = [&](const char* const* list, size_t n,
                     const char* what) -> absl::StatusOr<std::vector<std::string>> {
    std::vector<std::string> v;
    if (n > 0 && list == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s is NULL with %d entries", function, what, n));
    }
    for (size_t i = 0; i < n; ++i) {
      if (list[i] == nullptr) {
        return absl::InvalidArgumentError(absl::StrFormat("%s: %s[%d] is NULL", function, what, i));
      }
      v.emplace_back(list[i]);
    }
    return v;
  };
  for (size_t i = 0; i < in.num_rules; ++i) {
    const wb_placement_rule_t& r = in.rules[i];
    if (r.pattern == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: placements.rules[%d].pattern is NULL", function, i));
    }
    absl::StatusOr<std::vector<std::string>> parts =
        strings(r.parts, r.num_parts, "placements.rules[].parts");
    if (!parts.ok()) return parts.status();
    const std::string fused = r.fused == nullptr ? "" : r.fused;
    wb::Placement p;
    switch (r.kind) {
      case WB_PLACEMENT_REPLICATE:
        break;
      case WB_PLACEMENT_SHARD:
        p = wb::Placement::Shard(r.dim);
        break;
      case WB_PLACEMENT_QKV:
        p = parts->empty()
                ? wb::Placement::Qkv(r.num_heads, r.num_kv_heads, r.head_size)
                : wb::Placement::Qkv(r.num_heads, r.num_kv_heads, r.head_size, fused, *parts);
        p.dim = r.dim;
        break;
      case WB_PLACEMENT_MERGED:
        p = wb::Placement::Merged(fused, *parts);
        p.dim = r.dim;
        break;
      case WB_PLACEMENT_EXPERTS:
        p = wb::Placement::ExpertsMerged(
            fused, *parts,
            r.expert_order == 1 ? wb::ExpertOrder::kRoundRobin : wb::ExpertOrder::kLinear);
        if (in.experts != nullptr) {
          const wb_placement_experts_t& e = in.experts[i];
          p.num_experts = e.num_experts;
          p.ep_size = e.ep_size;
          p.ep_rank = e.ep_rank;
          p.expert_tp_size = e.expert_tp_size;
          p.expert_tp_rank = e.expert_tp_rank;
          p.expert_tp_dim = e.expert_tp_dim;
        }
        break;
      default:
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: placements.rules[%d] (\"%s\") has kind %d, not a wb_placement_kind_t", function, i,
            r.pattern, static_cast<int>(r.kind)));
    }
    out.rules.push_back({r.pattern, std::move(p)});
  }
  absl::StatusOr<std::vector<std::string>> tensors =
      strings(in.tensors, in.num_tensors, "placements.tensors");
  if (!tensors.ok()) return tensors.status();
  out.tensors = *std::move(tensors);
  out.skip_absent = in.skip_absent != 0;
  return out;
}

static wb_status_t CreateSubscriber(const char* kFn, const char* uri,
                                    const wb_open_params_t* params_in,
                                    const wb_placements_t* placements_in,
                                    wb_subscriber_t** subscriber) {
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, uri);
    WB_CHECK_ARG(kFn, subscriber);
    wb_open_params_t params;
    if (absl::Status s = ReadParams(kFn, params_in, kOpenParamsV1, &params); !s.ok()) return s;
    absl::StatusOr<wb::Options> options =
        ReadOptions(kFn, "params.options", params.options, params.num_options);
    if (!options.ok()) return options.status();
    absl::StatusOr<std::unique_ptr<wb::Subscriber>> s;
    if (placements_in == nullptr) {
      s = wb::Subscriber::Open(uri, *options);
    } else {
      wb_placements_t placements;
      if (absl::Status r = ReadParams(kFn, placements_in, kPlacementsV1, &placements); !r.ok()) {
        return r;
      }
      absl::StatusOr<wb::SubscribePlacements> p = ReadPlacements(kFn, placements);
      if (!p.ok()) return p.status();
      s = wb::Subscriber::Open(uri, *options, *std::move(p));
    }
    if (!s.ok()) return s.status();
    *subscriber = new wb_subscriber{std::move(*s)};
    return absl::OkStatus();
  });
}

wb_status_t wb_subscriber_create(const char* uri, const wb_open_params_t* params_in,
                                 wb_subscriber_t** subscriber) {
  return CreateSubscriber("wb_subscriber_create", uri, params_in, nullptr, subscriber);
}

wb_status_t wb_subscriber_create_tp(const char* uri, const wb_open_params_t* params_in,
                                    const wb_placements_t* placements,
                                    wb_subscriber_t** subscriber) {
  constexpr const char* kFn = "wb_subscriber_create_tp";
  if (placements == nullptr) {
    return Guard(kFn, [&]() -> absl::Status {
      WB_CHECK_ARG(kFn, placements);
      return absl::OkStatus();
    });
  }
  return CreateSubscriber(kFn, uri, params_in, placements, subscriber);
}

void wb_subscriber_destroy(wb_subscriber_t* subscriber) {
  try {
    delete subscriber;
  } catch (...) {
  }
}

wb_status_t wb_subscriber_cancel(wb_subscriber_t* subscriber) {
  constexpr const char* kFn = "wb_subscriber_cancel";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, subscriber);
    subscriber->impl->Cancel();
    return absl::OkStatus();
  });
}

wb_status_t wb_subscriber_bind(wb_subscriber_t* subscriber, const char* name,
                               const DLTensor* destination, const wb_bind_params_t* params_in) {
  constexpr const char* kFn = "wb_subscriber_bind";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, subscriber);
    WB_CHECK_ARG(kFn, name);
    WB_CHECK_ARG(kFn, destination);
    wb_bind_params_t params;
    if (absl::Status s = ReadParams(kFn, params_in, kBindParamsV1, &params); !s.ok()) return s;
    absl::StatusOr<Layout> layout = LayoutOf(name, *destination, RawDType(params.dtype));
    if (!layout.ok()) {
      return absl::Status(
          layout.status().code(),
          absl::StrFormat("%s: binding %s", subscriber->impl->uri(), layout.status().message()));
    }
    return subscriber->impl->Bind(
        name, wb::Destination{layout->dtype, std::move(layout->shape), std::move(layout->strides),
                              layout->data, layout->device});
  });
}

wb_status_t wb_subscriber_unbind(wb_subscriber_t* subscriber, const char* name) {
  constexpr const char* kFn = "wb_subscriber_unbind";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, subscriber);
    WB_CHECK_ARG(kFn, name);
    subscriber->impl->Unbind(name);
    return absl::OkStatus();
  });
}

wb_status_t wb_subscriber_unbind_all(wb_subscriber_t* subscriber) {
  constexpr const char* kFn = "wb_subscriber_unbind_all";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, subscriber);
    subscriber->impl->UnbindAll();
    return absl::OkStatus();
  });
}

wb_status_t wb_subscriber_wait(wb_subscriber_t* subscriber, uint64_t min_version,
                               int64_t timeout_ms, wb_update_t** update) {
  constexpr const char* kFn = "wb_subscriber_wait";
  return Guard(kFn, [&] { return Wait(kFn, subscriber, min_version, timeout_ms, false, update); });
}

wb_status_t wb_subscriber_wait_then_receive(wb_subscriber_t* subscriber, uint64_t min_version,
                                            int64_t find_timeout_ms, int64_t receive_timeout_ms,
                                            wb_update_t** update) {
  constexpr const char* kFn = "wb_subscriber_wait_then_receive";
  return Guard(kFn, [&] {
    return Wait(kFn, subscriber, min_version, find_timeout_ms, false, update, receive_timeout_ms);
  });
}

wb_status_t wb_subscriber_receive_version(wb_subscriber_t* subscriber, uint64_t version,
                                          int64_t find_timeout_ms, int64_t receive_timeout_ms,
                                          wb_update_t** update) {
  constexpr const char* kFn = "wb_subscriber_receive_version";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, subscriber);
    WB_CHECK_ARG(kFn, update);
    return HandOver(subscriber->impl->ReceiveVersion(version, Timeout(find_timeout_ms),
                                                     Timeout(receive_timeout_ms)),
                    update);
  });
}

wb_status_t wb_subscriber_poll(wb_subscriber_t* subscriber, uint64_t min_version,
                               int64_t receive_timeout_ms, wb_update_t** update) {
  constexpr const char* kFn = "wb_subscriber_poll";
  return Guard(
      kFn, [&] { return Wait(kFn, subscriber, min_version, receive_timeout_ms, true, update); });
}

wb_status_t wb_subscriber_current_version(wb_subscriber_t* subscriber, bool* has_version,
                                          uint64_t* version) {
  constexpr const char* kFn = "wb_subscriber_current_version";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, subscriber);
    WB_CHECK_ARG(kFn, has_version);
    WB_CHECK_ARG(kFn, version);
    const std::optional<uint64_t> current = subscriber->impl->current_version();
    *has_version = current.has_value();
    *version = current.value_or(0);
    return absl::OkStatus();
  });
}

wb_status_t wb_subscriber_uri(wb_subscriber_t* subscriber, const char** uri) {
  constexpr const char* kFn = "wb_subscriber_uri";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_HANDLE(kFn, subscriber);
    WB_CHECK_ARG(kFn, uri);
    *uri = subscriber->impl->uri().c_str();
    return absl::OkStatus();
  });
}

void wb_update_destroy(wb_update_t* update) {
  try {
    delete update;
  } catch (...) {
  }
}

wb_status_t wb_update_version(const wb_update_t* update, uint64_t* version) {
  constexpr const char* kFn = "wb_update_version";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, update);
    WB_CHECK_ARG(kFn, version);
    *version = update->state->update->version();
    return absl::OkStatus();
  });
}

wb_status_t wb_update_num_tensors(const wb_update_t* update, size_t* num_tensors) {
  constexpr const char* kFn = "wb_update_num_tensors";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, update);
    WB_CHECK_ARG(kFn, num_tensors);
    *num_tensors = update->state->tensors.size();
    return absl::OkStatus();
  });
}

wb_status_t wb_update_tensor(const wb_update_t* update, size_t index, const char** name,
                             wb_dtype_t* dtype, const DLTensor** tensor) {
  constexpr const char* kFn = "wb_update_tensor";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, update);
    if (absl::Status s = CheckIndex(kFn, update, index, /*dlpack=*/tensor != nullptr); !s.ok()) {
      return s;
    }
    const CTensor& t = update->state->tensors[index];
    if (name != nullptr) *name = t.name.c_str();
    if (dtype != nullptr) *dtype = t.dtype;
    if (tensor != nullptr) *tensor = &t.dl;
    return absl::OkStatus();
  });
}

wb_status_t wb_update_tensor_info(const wb_update_t* update, size_t index, wb_tensor_info_t* info) {
  constexpr const char* kFn = "wb_update_tensor_info";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, update);
    WB_CHECK_ARG(kFn, info);
    if (absl::Status s = CheckIndex(kFn, update, index, /*dlpack=*/false); !s.ok()) return s;
    const wb::Manifest& manifest = update->state->update->manifest();
    // A group version's manifest lists the ranks' parts; its tensors are handed over whole (or
    // as a TP subscriber's slices).
    const wb::TensorInfo& t = !update->state->assembled.empty() ? update->state->assembled[index]
                                                                : manifest.tensors[index];
    auto data = [](const std::vector<int64_t>& v) { return v.empty() ? nullptr : v.data(); };
    const wb_tensor_info_t value{sizeof(wb_tensor_info_t),
                                 t.name.c_str(),
                                 ToCDType(t.dtype),
                                 static_cast<int>(t.shape.size()),
                                 data(t.shape),
                                 t.nbytes,
                                 t.xxh3,
                                 t.shard.has_value(),
                                 t.shard ? data(t.shard->global_shape) : nullptr,
                                 t.shard ? data(t.shard->offsets) : nullptr};
    return WriteOutput(kFn, value, info, kTensorInfoV1, "info");
  });
}

wb_status_t wb_update_find(const wb_update_t* update, const char* name, size_t* index) {
  constexpr const char* kFn = "wb_update_find";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, update);
    WB_CHECK_ARG(kFn, name);
    WB_CHECK_ARG(kFn, index);
    const wb::TensorView* view = update->state->update->Find(name);
    if (view == nullptr) {
      return absl::NotFoundError(absl::StrFormat("%s: version %d has no tensor named \"%s\"", kFn,
                                                 update->state->update->version(), name));
    }
    *index = static_cast<size_t>(view - update->state->update->tensors().data());
    return absl::OkStatus();
  });
}

wb_status_t wb_update_manifest_json(const wb_update_t* update, const char** json, size_t* length) {
  constexpr const char* kFn = "wb_update_manifest_json";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, update);
    WB_CHECK_ARG(kFn, json);
    *json = update->state->manifest_json.c_str();
    if (length != nullptr) *length = update->state->manifest_json.size();
    return absl::OkStatus();
  });
}

wb_status_t wb_update_stats(const wb_update_t* update, wb_update_stats_t* stats) {
  constexpr const char* kFn = "wb_update_stats";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, update);
    WB_CHECK_ARG(kFn, stats);
    const wb::UpdateStats& s = update->state->update->stats();
    wb_update_stats_t value{sizeof(wb_update_stats_t),
                            s.bytes,
                            absl::ToInt64Nanoseconds(s.wait),
                            absl::ToInt64Nanoseconds(s.allocate),
                            absl::ToInt64Nanoseconds(s.fetch),
                            absl::ToInt64Nanoseconds(s.verify_wait),
                            absl::ToInt64Nanoseconds(s.copy_out),
                            s.ready_unix_ns,
                            absl::ToInt64Nanoseconds(s.decode),
                            s.wire_bytes,
                            s.encoding.c_str()};  // the update's own: valid while it lives
    return WriteOutput(kFn, value, stats, kUpdateStatsV1);
  });
}

wb_status_t wb_update_export_dlpack(const wb_update_t* update, size_t index,
                                    DLManagedTensor** managed) {
  constexpr const char* kFn = "wb_update_export_dlpack";
  return Guard(kFn, [&]() -> absl::Status {
    WB_CHECK_ARG(kFn, update);
    WB_CHECK_ARG(kFn, managed);
    if (absl::Status s = CheckIndex(kFn, update, index); !s.ok()) return s;
    const CTensor& t = update->state->tensors[index];
    auto exported = std::make_unique<ExportedTensor>();
    exported->state = update->state;
    exported->shape = t.shape;
    exported->strides = t.strides;
    exported->managed.dl_tensor = t.dl;
    exported->managed.dl_tensor.shape = exported->shape.empty() ? nullptr : exported->shape.data();
    exported->managed.dl_tensor.strides =
        exported->strides.empty() ? nullptr : exported->strides.data();
    exported->managed.manager_ctx = exported.get();
    exported->managed.deleter = &DeleteExported;
    *managed = &exported.release()->managed;
    return absl::OkStatus();
  });
}

}  // extern "C"
