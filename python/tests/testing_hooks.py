"""The C ABI's test hooks (plugin/c_api/shadowsync_testing.h) through ctypes: fault
injection into a loopback world. They are exported by libshadowsync_c.so under the
shadowsync_testing_ prefix and are not part of the shadowsync package's API."""

from __future__ import annotations

from ctypes import c_int, c_int64, c_size_t, c_uint64, c_void_p

import shadowsync as ss
from shadowsync import _library
from shadowsync.errors import call

# name: (restype, argtypes), as in shadowsync_testing.h.
_PROTOTYPES = {
    "shadowsync_testing_loopback_inject_delay": (c_int, [c_void_p, c_int, c_uint64, c_int64]),
    "shadowsync_testing_loopback_inject_drop": (c_int, [c_void_p, c_int, c_uint64]),
    "shadowsync_testing_loopback_inject_flip": (c_int, [c_void_p, c_int, c_uint64, c_size_t]),
}


def _declare() -> None:
    lib = _library.load()
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def inject_delay(loopback: ss.Loopback, rank: int, call_index: int, delay_us: int) -> None:
    """Delays `rank`'s broadcast number `call_index` (counted from 0) by `delay_us`."""
    _declare()
    call("shadowsync_testing_loopback_inject_delay", loopback.handle, int(rank), int(call_index),
         int(delay_us))


def inject_drop(loopback: ss.Loopback, rank: int, call_index: int) -> None:
    """`rank` never joins its broadcast number `call_index` nor any later one (a dead process)."""
    _declare()
    call("shadowsync_testing_loopback_inject_drop", loopback.handle, int(rank), int(call_index))


def inject_flip(loopback: ss.Loopback, rank: int, call_index: int, offset: int) -> None:
    """Flips the byte at `offset` of `rank`'s buffer after its broadcast number `call_index`."""
    _declare()
    call("shadowsync_testing_loopback_inject_flip", loopback.handle, int(rank), int(call_index),
         int(offset))
