"""Exceptions: one class per shadowsync_status_t, and the check every C call goes through.

A failing C call becomes the exception of its status, carrying the library's thread-local last
error (which call, which thing, both values). The Python layer's own checks (tensors against the
layout, before anything is sent) raise the same classes, so a caller catches one hierarchy.
"""

from __future__ import annotations

import ctypes as _ctypes

from . import _library
from ._library import LibraryNotFoundError

__all__ = [
    "ShadowsyncError",
    "InvalidArgumentError",
    "LayoutMismatchError",
    "BadHeaderError",
    "StaleVersionError",
    "ShadowsyncTimeoutError",
    "TransportError",
    "BackendError",
    "ShutdownError",
    "SupersededError",
    "InternalError",
    "InvalidHandleError",
    "NotSupportedError",
    "LibraryNotFoundError",
]

SUCCESS = 0
IN_PROGRESS = 13

STATUS_NAMES = {
    0: "SHADOWSYNC_SUCCESS",
    1: "SHADOWSYNC_INVALID_ARGUMENT",
    2: "SHADOWSYNC_LAYOUT_MISMATCH",
    3: "SHADOWSYNC_BAD_HEADER",
    4: "SHADOWSYNC_STALE_VERSION",
    5: "SHADOWSYNC_TIMEOUT",
    6: "SHADOWSYNC_TRANSPORT_ERROR",
    7: "SHADOWSYNC_BACKEND_ERROR",
    8: "SHADOWSYNC_SHUTDOWN",
    9: "SHADOWSYNC_SUPERSEDED",
    10: "SHADOWSYNC_INTERNAL_ERROR",
    11: "SHADOWSYNC_INVALID_HANDLE",
    12: "SHADOWSYNC_NOT_SUPPORTED",
    13: "SHADOWSYNC_IN_PROGRESS",
}


class ShadowsyncError(RuntimeError):
    """A shadowsync call failed. ``status`` is the shadowsync_status_t value, ``detail`` the
    library's message (or the Python layer's), ``hint`` the status's description."""

    status = -1

    def __init__(self, detail: str, hint: str = ""):
        super().__init__(f"{detail} [{STATUS_NAMES.get(self.status, self.status)}]")
        self.detail = detail
        self.hint = hint


class InvalidArgumentError(ShadowsyncError, ValueError):
    status = 1


class LayoutMismatchError(ShadowsyncError, ValueError):
    status = 2


class BadHeaderError(ShadowsyncError, ValueError):
    status = 3


class StaleVersionError(ShadowsyncError, ValueError):
    status = 4


class ShadowsyncTimeoutError(ShadowsyncError, TimeoutError):
    status = 5


class TransportError(ShadowsyncError):
    status = 6


class BackendError(ShadowsyncError):
    status = 7


class ShutdownError(ShadowsyncError):
    status = 8


class SupersededError(ShadowsyncError):
    status = 9


class InternalError(ShadowsyncError):
    status = 10


class InvalidHandleError(ShadowsyncError):
    status = 11


class NotSupportedError(ShadowsyncError, NotImplementedError):
    status = 12


_BY_STATUS = {
    cls.status: cls
    for cls in (
        InvalidArgumentError,
        LayoutMismatchError,
        BadHeaderError,
        StaleVersionError,
        ShadowsyncTimeoutError,
        TransportError,
        BackendError,
        ShutdownError,
        SupersededError,
        InternalError,
        InvalidHandleError,
        NotSupportedError,
    )
}


def error_for(status: int, detail: str | None = None) -> ShadowsyncError:
    """The exception of a non-success status; ``detail`` defaults to the thread's last error."""
    lib = _library.load()
    hint = (lib.shadowsync_get_error_string(status) or b"").decode(errors="replace")
    if detail is None:
        detail = (lib.shadowsync_get_last_error() or b"").decode(errors="replace") or hint
    cls = _BY_STATUS.get(status)
    if cls is None:  # a status this package does not know: a newer library
        err = InternalError(f"{detail} (unknown status {status})", hint)
        return err
    return cls(detail, hint)


def call(name: str, *args) -> None:
    """Calls the C function `name`; raises its status's exception unless it succeeded.

    The last error is read on the same thread right after the call: it is thread-local in C, and
    a ctypes call runs on the calling OS thread."""
    status = getattr(_library.load(), name)(*args)
    if status != SUCCESS:
        raise error_for(status)


def call_keeping_gil(name: str, *args) -> None:
    """As call(), holding the GIL through the call (_library.load_keeping_gil): only for calls
    that never block."""
    status = getattr(_library.load_keeping_gil(), name)(*args)
    if status != SUCCESS:
        raise error_for(status)


def call_array(name: str, ctype, *args) -> list:
    """Calls the C function `name` that fills an array of `ctype` by capacity and count (its last
    three arguments, after `args`): asks again with the count it says when the first guess was
    too small. The entries, as ctypes structs."""
    capacity = 64
    while True:
        out = (ctype * capacity)()
        count = _ctypes.c_size_t()
        status = getattr(_library.load(), name)(*args, out, capacity, _ctypes.byref(count))
        if status == SUCCESS:
            return list(out[: count.value])
        if status != InvalidArgumentError.status or count.value <= capacity:
            raise error_for(status)
        capacity = count.value


def call_status(name: str, *args) -> int:
    """As call(), but SHADOWSYNC_IN_PROGRESS is returned instead of raised."""
    status = getattr(_library.load(), name)(*args)
    if status not in (SUCCESS, IN_PROGRESS):
        raise error_for(status)
    return status
