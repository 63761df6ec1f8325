"""The C ABI's test hooks (plugin/c_api/shadowsync_testing.h) through ctypes: fault
injection into a loopback world, loopback routes of a routing plan, and an engine arena in host
memory. They are not part of the
shadowsync package's API, nor of the product library libshadowsync_c.so: a CMake build with the
tests makes libshadowsync_c_testing.so, the same library plus the hooks (shadowsync_testing_*),
and the tests that call them need the package to load that one (SHADOWSYNC_LIBRARY=<build>/
libshadowsync_c_testing.so, as scripts/test.sh's python step sets it): a hook takes handles made by
its own library instance. Where the loaded library has no hooks (an installed wheel, or
SHADOWSYNC_LIBRARY at libshadowsync_c.so) those tests skip, saying so."""

from __future__ import annotations

from ctypes import byref, c_int, c_int64, c_size_t, c_uint64, c_void_p

import pytest

import shadowsync as ss
from shadowsync import _library
from shadowsync._handle import Handle
from shadowsync.errors import call

# name: (restype, argtypes), as in shadowsync_testing.h.
_PROTOTYPES = {
    "shadowsync_testing_loopback_inject_delay": (c_int, [c_void_p, c_int, c_uint64, c_int64]),
    "shadowsync_testing_loopback_inject_drop": (c_int, [c_void_p, c_int, c_uint64]),
    "shadowsync_testing_loopback_inject_flip": (c_int, [c_void_p, c_int, c_uint64, c_size_t]),
    "shadowsync_testing_host_arena_create": (c_int, [c_void_p, c_size_t, c_int, c_void_p]),
    "shadowsync_testing_route_loopback_create": (
        c_int, [c_void_p, c_void_p, c_size_t, c_void_p, c_size_t]),
}


# The start of the skip reason; scripts/test.sh's python step fails when a test skipped with it.
NO_HOOKS = "the loaded library has no test hooks"


def _declare() -> None:
    lib = _library.load()
    if not all(hasattr(lib, name) for name in _PROTOTYPES):
        pytest.skip(f"{NO_HOOKS} (shadowsync_testing_*, {_library.library_path()}): they are in "
                    f"the test-only libshadowsync_c_testing.so of a CMake build with the tests; "
                    f"set SHADOWSYNC_LIBRARY to it")
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


def route_loopback(plan: ss.RoutingPlan) -> tuple[list[ss.Transport], list[ss.Transport]]:
    """One in-process communicator of `plan`'s trainer and engine ranks, moving routes on host
    streams (shadowsync_testing_route_loopback_create): the transports of trainer ranks 0..M-1
    (for Sender(..., routing_plan=plan, trainer_rank=t)) and of engine ranks 0..N-1 (for a
    Receiver given use_routing_plan(plan, e))."""
    _declare()
    trainers = (c_void_p * plan.trainer_count)()
    engines = (c_void_p * plan.engine_count)()
    call("shadowsync_testing_route_loopback_create", plan.handle, trainers, plan.trainer_count,
         engines, plan.engine_count)
    return ([ss.Transport(trainers[t], f"loopback routes, trainer rank {t}")
             for t in range(plan.trainer_count)],
            [ss.Transport(engines[e], f"loopback routes, engine rank {e}")
             for e in range(plan.engine_count)])


class HostArena(ss.RemapArena):
    """An engine arena in host memory on the host backend (shadowsync_testing_host_arena_create):
    two zero-filled slots, `live_slot` the one it shows; for receivers that rebind over it. It
    cannot remap."""

    def __init__(self, backend: ss.HostBackend, nbytes: int, live_slot: int = 0):
        _declare()
        handle = c_void_p()
        call("shadowsync_testing_host_arena_create", backend.handle, int(nbytes), int(live_slot),
             byref(handle))
        Handle.__init__(self, handle.value)  # not RemapArena's: the arena exists already
        self.backend = backend
