# SPDX-License-Identifier: Apache-2.0
"""weightbus: versioned weight sync from RL trainers to inference replicas.

    import weightbus
    pub = weightbus.Publisher("disk:///mnt/shared/policy", retention=3)
    pub.publish(step, model.state_dict())

    sub = weightbus.Subscriber("disk:///mnt/shared/policy")
    update = sub.wait(min_version=step, timeout=30)
    model.load_weights(list(update))             # (name, torch.Tensor) zero-copy views

Built on the C API (libweightbus, include/weightbus/weightbus.h) through ctypes; torch and
numpy are optional and imported only when used. Errors raise a subclass of WeightbusError, one
per status (weightbus.errors). weightbus.vllm integrates with vLLM.
"""
from . import _lib
from ._api import (Placement, Publisher, PublishStats, PublishStream, SettingInfo, Shard,
                   Subscriber, TensorInfo, Update, UpdateStats, settings,
                   supports_cuda_tensors, transports)
from .errors import (AbortedError, AlreadyExistsError, CancelledError, DataLossError,
                     DeadlineExceededError, FailedPreconditionError, InternalError,
                     InvalidArgumentError, NotFoundError, OutOfRangeError, PermissionDeniedError,
                     ResourceExhaustedError, UnavailableError, UnimplementedError, UnknownError,
                     WeightbusError, check as _check)

# The loaded library must serve the C API these bindings were written against.
try:
    _check(_lib.lib.wb_check_version(_lib.BINDINGS_VERSION_NUMBER))
except WeightbusError as e:
    raise ImportError(f"weightbus: {_lib.library_path}: {e}") from e

__version__ = _lib.lib.wb_version().decode()
library_path = _lib.library_path
DTYPES = tuple(_lib.DTYPES)

__all__ = [
    "Placement", "Publisher", "PublishStream", "Subscriber", "Update", "PublishStats",
    "UpdateStats", "Shard", "TensorInfo", "SettingInfo", "transports", "settings",
    "supports_cuda_tensors", "DTYPES",
    "WeightbusError", "DeadlineExceededError", "UnavailableError", "ResourceExhaustedError",
    "AbortedError", "InvalidArgumentError", "FailedPreconditionError", "NotFoundError",
    "AlreadyExistsError", "PermissionDeniedError", "OutOfRangeError", "UnimplementedError",
    "DataLossError", "CancelledError", "InternalError", "UnknownError",
]
