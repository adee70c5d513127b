# SPDX-License-Identifier: Apache-2.0
"""ctypes declarations of the C API (include/weightbus/weightbus.h) and the library loader.

The library is found, in this order, at: $LIBWEIGHTBUS_PATH (a file); the path recorded at
install time (_install_paths.py); the build tree of a source checkout (<repo>/build/lib); the
dynamic linker's search path (libweightbus.so.0). The variable is not called WEIGHTBUS_*: that
prefix is the library's settings (an unknown one is logged as a warning naming the closest).

ctypes.CDLL releases the GIL for the duration of every foreign call, so blocking calls
(wb_subscriber_wait, wb_publisher_publish) never stall other Python threads.
"""
import ctypes
import ctypes.util
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char_p, c_int, c_int64, c_size_t,
                    c_uint8, c_uint16, c_uint32, c_uint64, c_void_p)
from pathlib import Path

# The C API version these bindings were written against (WEIGHTBUS_VERSION of 0.1.0).
BINDINGS_VERSION_NUMBER = 100

# DLPack 0.6 (dlpack/dlpack.h).
kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13
kDLInt, kDLUInt, kDLFloat, kDLOpaqueHandle, kDLBfloat, kDLComplex = 0, 1, 2, 3, 4, 5


class DLDevice(Structure):
    _fields_ = [("device_type", c_int), ("device_id", c_int)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int),
                ("dtype", DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(Structure):
    pass


DLManagedTensorDeleter = CFUNCTYPE(None, POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p),
                            ("deleter", DLManagedTensorDeleter)]

# weightbus.h
WB_TIMEOUT_INFINITE = -1


class wb_option_t(Structure):
    _fields_ = [("key", c_char_p), ("value", c_char_p)]


class wb_open_params_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("options", POINTER(wb_option_t)),
                ("num_options", c_size_t)]


class wb_shard_t(Structure):
    _fields_ = [("ndim", c_int), ("global_shape", POINTER(c_int64)),
                ("offsets", POINTER(c_int64))]


class wb_placement_rule_t(Structure):
    _fields_ = [("pattern", c_char_p), ("kind", c_int), ("dim", c_int),
                ("num_heads", c_int64), ("num_kv_heads", c_int64), ("head_size", c_int64),
                ("fused", c_char_p), ("parts", POINTER(c_char_p)), ("num_parts", c_size_t),
                ("expert_order", c_int)]


class wb_placement_experts_t(Structure):
    _fields_ = [("num_experts", c_int64), ("ep_size", c_int), ("ep_rank", c_int),
                ("expert_tp_size", c_int), ("expert_tp_rank", c_int), ("expert_tp_dim", c_int)]


class wb_placements_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("rules", POINTER(wb_placement_rule_t)),
                ("num_rules", c_size_t), ("tp_size", c_int), ("tp_rank", c_int),
                ("tensors", POINTER(c_char_p)), ("num_tensors", c_size_t),
                ("experts", POINTER(wb_placement_experts_t)), ("skip_absent", c_int)]


class wb_publish_params_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("metadata", POINTER(wb_option_t)),
                ("num_metadata", c_size_t), ("dtypes", POINTER(c_int)),
                ("shards", POINTER(POINTER(wb_shard_t))), ("cuda_stream", c_void_p)]


class wb_stream_add_params_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("dtype", c_int), ("shard", POINTER(wb_shard_t)),
                ("cuda_stream", c_void_p)]


class wb_bind_params_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("dtype", c_int)]


class wb_publish_stats_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("version", c_uint64), ("bytes", c_uint64),
                ("stall_ns", c_int64), ("pack_ns", c_int64), ("checksum_wait_ns", c_int64),
                ("transport_ns", c_int64), ("flags", c_uint64), ("encode_ns", c_int64),
                ("wire_bytes", c_uint64), ("encoding", c_char_p)]


WB_PUBLISH_UNCHANGED = 1


class wb_update_stats_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("bytes", c_uint64), ("wait_ns", c_int64),
                ("allocate_ns", c_int64), ("fetch_ns", c_int64), ("verify_wait_ns", c_int64),
                ("copy_out_ns", c_int64), ("ready_unix_ns", c_int64), ("decode_ns", c_int64),
                ("wire_bytes", c_uint64), ("encoding", c_char_p)]


class wb_setting_info_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("scope", c_char_p), ("name", c_char_p),
                ("type", c_char_p), ("default_value", c_char_p), ("env", c_char_p),
                ("doc", c_char_p)]


class wb_tensor_info_t(Structure):
    _fields_ = [("struct_size", c_size_t), ("name", c_char_p), ("dtype", c_int), ("ndim", c_int),
                ("shape", POINTER(c_int64)), ("nbytes", c_uint64), ("xxh3", c_uint64),
                ("has_shard", c_bool), ("shard_global_shape", POINTER(c_int64)),
                ("shard_offsets", POINTER(c_int64))]


def new_params(struct_type):
    """A params/stats struct with struct_size set (the WB_*_INIT macros)."""
    value = struct_type()
    value.struct_size = ctypes.sizeof(struct_type)
    return value


# wb_dtype_t: safetensors names <-> enum values.
# wb_placement_kind_t
PLACEMENT_KINDS = {"REPLICATE": 0, "SHARD": 1, "QKV": 2, "MERGED": 3, "EXPERTS": 4}
DTYPE_FROM_DLPACK = 0
DTYPES = {"BOOL": 1, "U8": 2, "I8": 3, "U16": 4, "I16": 5, "F16": 6, "BF16": 7, "U32": 8,
          "I32": 9, "F32": 10, "U64": 11, "I64": 12, "F64": 13, "F8_E4M3": 14, "F8_E5M2": 15,
          "F8_E8M0": 16, "F8_E4M3FNUZ": 17, "F8_E5M2FNUZ": 18, "C64": 19,
          # sub-byte: WB_UNIMPLEMENTED through the C API (include/weightbus/weightbus.h)
          "F4": 20, "F6_E2M3": 21, "F6_E3M2": 22}
DTYPE_NAMES = {value: name for name, value in DTYPES.items()}


def _candidates():
    env = os.environ.get("LIBWEIGHTBUS_PATH")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    try:
        from . import _install_paths  # written by `cmake --install`
        yield (here / _install_paths.LIBRARY_RELATIVE_PATH).resolve()
    except ImportError:
        pass
    # A source checkout: <repo>/bindings/python/weightbus -> <repo>/build/lib/libweightbus.so.
    yield here.parents[2] / "build" / "lib" / "libweightbus.so"
    found = ctypes.util.find_library("weightbus")
    yield Path(found) if found else Path("libweightbus.so.0")


def _load():
    tried = []
    for candidate in _candidates():
        if candidate.is_absolute() and not candidate.exists():
            tried.append(f"{candidate} (missing)")
            continue
        try:
            return ctypes.CDLL(str(candidate)), str(candidate)
        except OSError as e:
            tried.append(f"{candidate} ({e})")
    raise ImportError("weightbus: cannot load libweightbus; tried " + "; ".join(tried) +
                      ". Set LIBWEIGHTBUS_PATH to the library file.")


lib, library_path = _load()

_P = POINTER
_status = c_int
_SIGNATURES = {
    "wb_status_string": (c_char_p, [_status]),
    "wb_last_error_message": (c_char_p, []),
    "wb_version": (c_char_p, []),
    "wb_version_number": (c_uint32, []),
    "wb_check_version": (_status, [c_uint32]),
    "wb_dtype_name": (c_char_p, [c_int]),
    "wb_transport_count": (_status, [_P(c_size_t)]),
    "wb_transport_scheme": (_status, [c_size_t, _P(c_char_p)]),
    "wb_setting_count": (_status, [_P(c_size_t)]),
    "wb_setting_info": (_status, [c_size_t, _P(wb_setting_info_t)]),
    "wb_publisher_create": (_status, [c_char_p, _P(wb_open_params_t), _P(c_void_p)]),
    "wb_publisher_destroy": (None, [c_void_p]),
    "wb_publisher_cancel": (_status, [c_void_p]),
    "wb_publisher_publish": (_status, [c_void_p, c_uint64, _P(c_char_p), _P(DLTensor), c_size_t,
                                       _P(wb_publish_params_t), c_int64]),
    "wb_publisher_latest_version": (_status, [c_void_p, _P(c_bool), _P(c_uint64)]),
    "wb_publisher_last_stats": (_status, [c_void_p, _P(wb_publish_stats_t)]),
    "wb_publisher_wait_for_receivers": (_status, [c_void_p, c_uint64, c_int, c_int64]),
    "wb_publisher_uri": (_status, [c_void_p, _P(c_char_p)]),
    "wb_publisher_begin_publish": (_status, [c_void_p, c_uint64, _P(wb_publish_params_t),
                                             _P(c_void_p)]),
    "wb_publisher_allocate_host": (_status, [c_void_p, c_uint64, _P(c_void_p), _P(c_void_p)]),
    "wb_host_memory_free": (None, [c_void_p]),
    "wb_publish_stream_add": (_status, [c_void_p, c_char_p, _P(DLTensor),
                                        _P(wb_stream_add_params_t)]),
    "wb_publish_stream_commit": (_status, [c_void_p, c_int64]),
    "wb_publish_stream_abort": (_status, [c_void_p]),
    "wb_publish_stream_destroy": (None, [c_void_p]),
    "wb_supports_cuda_tensors": (c_bool, []),
    "wb_subscriber_create": (_status, [c_char_p, _P(wb_open_params_t), _P(c_void_p)]),
    "wb_subscriber_create_tp": (_status, [c_char_p, _P(wb_open_params_t), _P(wb_placements_t),
                                          _P(c_void_p)]),
    "wb_subscriber_destroy": (None, [c_void_p]),
    "wb_subscriber_cancel": (_status, [c_void_p]),
    "wb_subscriber_bind": (_status, [c_void_p, c_char_p, _P(DLTensor), _P(wb_bind_params_t)]),
    "wb_subscriber_unbind": (_status, [c_void_p, c_char_p]),
    "wb_subscriber_unbind_all": (_status, [c_void_p]),
    "wb_subscriber_wait": (_status, [c_void_p, c_uint64, c_int64, _P(c_void_p)]),
    "wb_subscriber_wait_then_receive": (_status, [c_void_p, c_uint64, c_int64, c_int64,
                                                  _P(c_void_p)]),
    "wb_subscriber_poll": (_status, [c_void_p, c_uint64, c_int64, _P(c_void_p)]),
    "wb_subscriber_receive_version": (_status, [c_void_p, c_uint64, c_int64, c_int64,
                                                _P(c_void_p)]),
    "wb_subscriber_current_version": (_status, [c_void_p, _P(c_bool), _P(c_uint64)]),
    "wb_subscriber_uri": (_status, [c_void_p, _P(c_char_p)]),
    "wb_update_destroy": (None, [c_void_p]),
    "wb_update_version": (_status, [c_void_p, _P(c_uint64)]),
    "wb_update_num_tensors": (_status, [c_void_p, _P(c_size_t)]),
    "wb_update_tensor": (_status, [c_void_p, c_size_t, _P(c_char_p), _P(c_int),
                                   _P(_P(DLTensor))]),
    "wb_update_tensor_info": (_status, [c_void_p, c_size_t, _P(wb_tensor_info_t)]),
    "wb_update_find": (_status, [c_void_p, c_char_p, _P(c_size_t)]),
    "wb_update_manifest_json": (_status, [c_void_p, _P(c_char_p), _P(c_size_t)]),
    "wb_update_stats": (_status, [c_void_p, _P(wb_update_stats_t)]),
    "wb_update_export_dlpack": (_status, [c_void_p, c_size_t, _P(_P(DLManagedTensor))]),
}
for _name, (_restype, _argtypes) in _SIGNATURES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _restype
    _fn.argtypes = _argtypes

# Python C-API functions for DLPack capsules (the GIL is held: pythonapi is a PyDLL).
PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [c_void_p, c_char_p, c_void_p]
PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
PyCapsule_GetPointer.restype = c_void_p
PyCapsule_GetPointer.argtypes = [ctypes.py_object, c_char_p]
PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
PyCapsule_IsValid.restype = c_int
PyCapsule_IsValid.argtypes = [ctypes.py_object, c_char_p]
