"""The base of every object that owns a C handle."""

from __future__ import annotations

from ctypes import c_void_p

from .errors import call


class Handle:
    """Owns one C handle; close() (or the with-statement, or garbage collection) destroys it.

    After close() the handle value is still passed to the library, which refuses it with
    SHADOWSYNC_INVALID_HANDLE: a closed object raises InvalidHandleError, it never dereferences
    freed memory (handles are registry tokens in C, never reused)."""

    _destroy_fn = ""  # the C function that destroys this kind of handle

    def __init__(self, value: int | None):
        self._handle = c_void_p(value)
        self._closed = False

    @property
    def handle(self) -> c_void_p:
        """The raw C handle, for calls this package does not wrap."""
        return self._handle

    def close(self) -> None:
        """Destroys the C object. Idempotent."""
        if self._closed:
            return
        self._closed = True
        call(self._destroy_fn, self._handle)

    def _disown(self) -> None:
        """The C object now belongs to another (a transport taken by a receiver or sender)."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Best effort: at interpreter exit the library or this module may already be gone.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing useful to do with it in a finalizer
            pass
