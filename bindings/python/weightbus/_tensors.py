# SPDX-License-Identifier: Apache-2.0
"""Tensors <-> DLPack 0.6 DLTensor, zero-copy.

Outgoing (publish, bind): the binding fills a DLTensor for
  - torch.Tensor from data_ptr/shape/stride (no copy; also for bool tensors and tensors that
    require grad, which torch's own DLPack exporter refuses),
  - numpy.ndarray from its array interface (no copy; also read-only and bool arrays, which
    numpy's exporter refuses),
  - any other object with __dlpack__ through the DLPack capsule protocol.
DLPack 0.6 has no bool or float8 codes: such tensors go as uint8 with a wb_dtype_t override
(BOOL, F8_E4M3, F8_E5M2). numpy has no bfloat16: pass bf16 bits as a uint16 array with
dtypes={name: "BF16"}.

Incoming (Update): each tensor is exported by wb_update_export_dlpack as a DLManagedTensor that
holds its own reference to the update's memory, and adopted by torch.utils.dlpack.from_dlpack
(or numpy.from_dlpack): a zero-copy view whose memory lives as long as the tensor does.
"""
import ctypes
import sys

from . import _lib
from ._lib import DLDataType, DLDevice, DLTensor
from .errors import check


def _torch():
    return sys.modules.get("torch")


def _numpy():
    return sys.modules.get("numpy")


def _torch_dtypes():
    torch = _torch()
    table = {
        torch.float32: (_lib.kDLFloat, 32, 0), torch.float16: (_lib.kDLFloat, 16, 0),
        torch.float64: (_lib.kDLFloat, 64, 0), torch.bfloat16: (_lib.kDLBfloat, 16, 0),
        torch.int8: (_lib.kDLInt, 8, 0), torch.int16: (_lib.kDLInt, 16, 0),
        torch.int32: (_lib.kDLInt, 32, 0), torch.int64: (_lib.kDLInt, 64, 0),
        torch.uint8: (_lib.kDLUInt, 8, 0),
        torch.bool: (_lib.kDLUInt, 8, _lib.DTYPES["BOOL"]),
        torch.complex64: (_lib.kDLComplex, 64, 0),  # safetensors C64
    }
    # Newer torch releases: float8 and wide unsigned types.
    for attr, code in (("float8_e4m3fn", _lib.DTYPES["F8_E4M3"]),
                       ("float8_e5m2", _lib.DTYPES["F8_E5M2"])):
        if hasattr(torch, attr):
            table[getattr(torch, attr)] = (_lib.kDLUInt, 8, code)
    for attr, bits in (("uint16", 16), ("uint32", 32), ("uint64", 64)):
        if hasattr(torch, attr):
            table[getattr(torch, attr)] = (_lib.kDLUInt, bits, 0)
    return table


def is_torch_tensor(obj):
    torch = _torch()
    # While another thread is still importing torch, sys.modules holds a partly initialised
    # module without Tensor; no object can be a torch tensor yet.
    tensor_type = getattr(torch, "Tensor", None) if torch is not None else None
    return tensor_type is not None and isinstance(obj, tensor_type)


def is_numpy_array(obj):
    np = _numpy()
    array_type = getattr(np, "ndarray", None) if np is not None else None  # as for torch
    return array_type is not None and isinstance(obj, array_type)


class Outgoing:
    """DLTensors for a batch of tensors, with everything they point at kept alive."""

    def __init__(self, count):
        self.tensors = (DLTensor * max(count, 1))()
        self.overrides = (ctypes.c_int * max(count, 1))()
        self._keep = []

    def _arrays(self, shape, strides):
        shape_array = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self._keep.append(shape_array)
        strides_array = None
        if strides is not None:
            strides_array = (ctypes.c_int64 * max(len(strides), 1))(*strides)
            self._keep.append(strides_array)
        return shape_array, strides_array

    def set(self, i, name, obj, override=None):
        """Describes `obj` in slot i. `override` is a safetensors dtype name or None."""
        t = self.tensors[i]
        code = bits = 0
        implied = 0
        if is_torch_tensor(obj):
            table = _torch_dtypes()
            if obj.dtype not in table:
                raise TypeError(f"tensor {name!r}: torch dtype {obj.dtype} has no safetensors "
                                f"element type")
            code, bits, implied = table[obj.dtype]
            if obj.device.type == "cuda":
                device = DLDevice(_lib.kDLCUDA, obj.device.index or 0)
            elif obj.device.type == "cpu":
                device = DLDevice(_lib.kDLCPU, 0)
            else:
                raise TypeError(f"tensor {name!r}: torch device {obj.device} is not supported")
            shape, strides = list(obj.shape), list(obj.stride())
            data = obj.data_ptr() if obj.numel() > 0 else None
            self._keep.append(obj)
        elif is_numpy_array(obj):
            kind, itemsize = obj.dtype.kind, obj.dtype.itemsize
            if kind == "b":
                code, bits, implied = _lib.kDLUInt, 8, _lib.DTYPES["BOOL"]
            elif kind in "iufc":
                code = {"i": _lib.kDLInt, "u": _lib.kDLUInt, "f": _lib.kDLFloat,
                        "c": _lib.kDLComplex}[kind]
                bits = itemsize * 8
            else:
                raise TypeError(f"array {name!r}: numpy dtype {obj.dtype} has no safetensors "
                                f"element type")
            if not obj.dtype.isnative:
                raise TypeError(f"array {name!r}: numpy dtype {obj.dtype} is not in native byte "
                                f"order; use .astype(dtype.newbyteorder('='))")
            if any(s % itemsize for s in obj.strides):
                raise ValueError(f"array {name!r}: strides {obj.strides} are not multiples of "
                                 f"the element size {itemsize}")
            device = DLDevice(_lib.kDLCPU, 0)
            shape = list(obj.shape)
            strides = [s // itemsize for s in obj.strides]
            data = obj.__array_interface__["data"][0] if obj.size > 0 else None
            self._keep.append(obj)
        elif hasattr(obj, "__dlpack__"):
            capsule = obj.__dlpack__()
            pointer = _lib.PyCapsule_GetPointer(capsule, b"dltensor")
            managed = _lib.DLManagedTensor.from_address(pointer)
            self.tensors[i] = managed.dl_tensor  # a copy; the capsule keeps what it points at
            self._keep.append(capsule)           # alive (its destructor calls the deleter)
            self.overrides[i] = _lib.DTYPES[override] if override else 0
            return
        else:
            raise TypeError(f"tensor {name!r}: expected a torch.Tensor, a numpy.ndarray or an "
                            f"object with __dlpack__, got {type(obj).__name__}")
        shape_array, strides_array = self._arrays(shape, strides)
        t.data = data
        t.device = device
        t.ndim = len(shape)
        t.dtype = DLDataType(code, bits, 1)
        t.shape = shape_array
        t.strides = strides_array
        t.byte_offset = 0
        if override is not None:
            if override not in _lib.DTYPES:
                raise ValueError(f"tensor {name!r}: dtype override {override!r} is not one of "
                                 f"{', '.join(_lib.DTYPES)}")
            self.overrides[i] = _lib.DTYPES[override]
        else:
            self.overrides[i] = implied


def export_torch(update_handle, index, dtype_name):
    """Tensor `index` of an update as a zero-copy torch.Tensor."""
    import torch
    from torch.utils import dlpack
    managed = ctypes.POINTER(_lib.DLManagedTensor)()
    check(_lib.lib.wb_update_export_dlpack(update_handle, index, ctypes.byref(managed)))
    capsule = _lib.PyCapsule_New(ctypes.cast(managed, ctypes.c_void_p), b"dltensor", None)
    try:
        tensor = dlpack.from_dlpack(capsule)
    except BaseException:
        if _lib.PyCapsule_IsValid(capsule, b"dltensor"):  # not consumed: release it ourselves
            managed.contents.deleter(managed)
        raise
    if dtype_name == "BOOL":
        tensor = tensor.view(torch.bool)
    elif dtype_name == "F8_E4M3" and hasattr(torch, "float8_e4m3fn"):
        tensor = tensor.view(torch.float8_e4m3fn)
    elif dtype_name == "F8_E5M2" and hasattr(torch, "float8_e5m2"):
        tensor = tensor.view(torch.float8_e5m2)
    return tensor


class _Capsule:
    """The DLPack protocol around one exported DLManagedTensor, for numpy.from_dlpack."""

    def __init__(self, managed):
        self._managed = managed
        self.capsules = []

    def __dlpack__(self, stream=None):
        capsule = _lib.PyCapsule_New(ctypes.cast(self._managed, ctypes.c_void_p), b"dltensor",
                                     None)
        self.capsules.append(capsule)
        return capsule

    def __dlpack_device__(self):
        return (_lib.kDLCPU, 0)


def export_numpy(update_handle, index, dtype_name):
    """Tensor `index` of an update as a zero-copy numpy array (BF16 as uint16 bits, BOOL as
    bool, F8 as uint8 bits)."""
    import numpy as np
    managed = ctypes.POINTER(_lib.DLManagedTensor)()
    check(_lib.lib.wb_update_export_dlpack(update_handle, index, ctypes.byref(managed)))
    dl_dtype = managed.contents.dl_tensor.dtype
    if dl_dtype.code == _lib.kDLBfloat:  # numpy has no bfloat16: expose the bits
        managed.contents.dl_tensor.dtype = DLDataType(_lib.kDLUInt, 16, 1)
    holder = _Capsule(managed)
    try:
        array = np.from_dlpack(holder)
    except BaseException:
        if all(_lib.PyCapsule_IsValid(c, b"dltensor") for c in holder.capsules):
            managed.contents.deleter(managed)  # numpy failed before adopting it
        raise
    if dtype_name == "BOOL":
        array = array.view(np.bool_)
    return array
