# SPDX-License-Identifier: Apache-2.0
"""One exception class per wb_status_t, each carrying the library's full message.

Every class derives from WeightbusError (attributes: status, status_name, retryable) and, where
one fits, from the matching built-in exception, so `except TimeoutError` catches a wait that
timed out and `except ValueError` catches a bad tensor or setting.
"""
from . import _lib


class WeightbusError(Exception):
    """A failed weightbus call. `str(e)` is the library's full message."""

    status = -1           # the wb_status_t value
    status_name = "?"     # e.g. "WB_DEADLINE_EXCEEDED"
    retryable = False     # WB_STATUS_IS_RETRYABLE: the same call may succeed later

    def __init__(self, message):
        super().__init__(message)
        self.message = message


class DeadlineExceededError(WeightbusError, TimeoutError):
    status, status_name, retryable = 1, "WB_DEADLINE_EXCEEDED", True


class UnavailableError(WeightbusError):
    status, status_name, retryable = 2, "WB_UNAVAILABLE", True


class ResourceExhaustedError(WeightbusError):
    status, status_name, retryable = 3, "WB_RESOURCE_EXHAUSTED", True


class AbortedError(WeightbusError):
    status, status_name, retryable = 4, "WB_ABORTED", True


class InvalidArgumentError(WeightbusError, ValueError):
    status, status_name = 100, "WB_INVALID_ARGUMENT"


class FailedPreconditionError(WeightbusError):
    status, status_name = 101, "WB_FAILED_PRECONDITION"


class NotFoundError(WeightbusError, LookupError):
    status, status_name = 102, "WB_NOT_FOUND"


class AlreadyExistsError(WeightbusError):
    status, status_name = 103, "WB_ALREADY_EXISTS"


class PermissionDeniedError(WeightbusError, PermissionError):
    status, status_name = 104, "WB_PERMISSION_DENIED"


class OutOfRangeError(WeightbusError, IndexError):
    status, status_name = 105, "WB_OUT_OF_RANGE"


class UnimplementedError(WeightbusError, NotImplementedError):
    status, status_name = 106, "WB_UNIMPLEMENTED"


class DataLossError(WeightbusError):
    status, status_name = 107, "WB_DATA_LOSS"


class CancelledError(WeightbusError):
    status, status_name = 108, "WB_CANCELLED"


class InternalError(WeightbusError):
    status, status_name = 200, "WB_INTERNAL"


class UnknownError(WeightbusError):
    status, status_name = 201, "WB_UNKNOWN"


ERRORS = {cls.status: cls for cls in (
    DeadlineExceededError, UnavailableError, ResourceExhaustedError, AbortedError,
    InvalidArgumentError, FailedPreconditionError, NotFoundError, AlreadyExistsError,
    PermissionDeniedError, OutOfRangeError, UnimplementedError, DataLossError, CancelledError,
    InternalError, UnknownError)}


def check(status):
    """Raises the exception of a non-zero wb_status_t with this thread's last message."""
    if status == 0:
        return
    message = _lib.lib.wb_last_error_message().decode("utf-8", "replace")
    cls = ERRORS.get(status, UnknownError)
    raise cls(message)
