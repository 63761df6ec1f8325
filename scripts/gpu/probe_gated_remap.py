#!/usr/bin/env python3
"""Probe (GPU machine, one GPU, torch): can the remap swap be ordered on the engine stream instead
of synchronizing it, and what does a remap leave to the step after it?

Today the remap strategy synchronizes the engine stream (the step in flight must not see its pages
go away), then unmaps the live range and maps it onto the other slot, all on the engine thread:
the engine thread waits for the previous step before it can launch the next. Ordered on the
stream instead: the engine thread enqueues "wait until a host counter opens" (cuStreamWaitValue32)
and goes on launching the next step behind it; a helper thread waits for the previous step's event,
remaps, then opens the counter. That is only possible if cuMemUnmap / cuMemMap / cuMemSetAccess do
not themselves wait for the device to go idle (the gated stream would never drain: a deadlock).

For each way (sync, gated), REPS times: step (a kernel that reads every live byte, as a decode
step reads its weights), the swap, step, step. Reported (CUDA events on the engine stream, ms
median): the GPU idle between the step before the swap and the one after it, the first step after
the swap and the next one (a remap that leaves page-table work to the GPU shows as a slower first
step), the engine thread's time in the swap, and whether the step after the swap read the new
slot's bytes (each slot holds its own value). A gated remap that does not finish within
HANG_LIMIT_S is reported as BLOCKED (the counter is then opened to let the stream go).

    python3 scripts/gpu/probe_gated_remap.py [GiB] [REPS]     (default 8 GiB, 10)

Then, each in a child process with a deadline (a hang is an answer too): while the engine stream
waits on the gate, the engine thread calls what waits for the whole device or takes the driver's
memory locks - torch.cuda.synchronize() (cudaDeviceSynchronize), cuMemFree of a fresh cuMemAlloc
(an implicit device synchronization), torch.cuda.empty_cache() (cudaFree of cached blocks), a copy
of a tensor of the gated stream into pinned memory then a stream synchronize, and `.cpu()` (a
cudaMemcpyAsync into pageable memory). A gated remap deadlocks if the remap thread's driver calls
wait for such a call that waits for the gated stream.
Needs no shadowsync: torch and the driver API through ctypes.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import sys
import threading
import time
from ctypes import byref, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p

import torch

HANG_LIMIT_S = 10.0
cuda = ctypes.CDLL("libcuda.so.1")


def fn(name, *argtypes):
    for candidate in (name + "_v2", name):
        if hasattr(cuda, candidate):
            f = getattr(cuda, candidate)
            f.argtypes = list(argtypes)
            return f
    raise RuntimeError(f"libcuda.so.1 has no {name}")


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what}: CUresult {result}")


class Location(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", Location),
                ("win32HandleMetaData", c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", c_int)]


granularity_of = fn("cuMemGetAllocationGranularity", ctypes.POINTER(c_size_t),
                    ctypes.POINTER(AllocationProp), c_int)
mem_create = fn("cuMemCreate", ctypes.POINTER(c_uint64), c_size_t, ctypes.POINTER(AllocationProp),
                c_uint64)
reserve = fn("cuMemAddressReserve", ctypes.POINTER(c_uint64), c_size_t, c_size_t, c_uint64, c_uint64)
mem_map = fn("cuMemMap", c_uint64, c_size_t, c_size_t, c_uint64, c_uint64)
mem_unmap = fn("cuMemUnmap", c_uint64, c_size_t)
set_access = fn("cuMemSetAccess", c_uint64, c_size_t, ctypes.POINTER(AccessDesc), c_size_t)
host_alloc = fn("cuMemHostAlloc", ctypes.POINTER(c_void_p), c_size_t, c_uint)
host_device_pointer = fn("cuMemHostGetDevicePointer", ctypes.POINTER(c_uint64), c_void_p, c_uint)
wait_value = fn("cuStreamWaitValue32", c_void_p, c_uint64, c_uint32, c_uint)
ctx_get = fn("cuCtxGetCurrent", ctypes.POINTER(c_void_p))
ctx_set = fn("cuCtxSetCurrent", c_void_p)
mem_alloc = fn("cuMemAlloc", ctypes.POINTER(c_uint64), c_size_t)
mem_free = fn("cuMemFree", c_uint64)
INTERFERENCE_DEADLINE_S = 30


def interfere(kind):
    """What the engine thread does while the gate is closed."""
    if kind == "device_synchronize":
        torch.cuda.synchronize()
    elif kind == "cuMemFree":
        block = c_uint64()
        check(mem_alloc(byref(block), 64 << 20), "cuMemAlloc")
        check(mem_free(block.value), "cuMemFree")
    elif kind == "empty_cache":
        torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # freed at once: cached
        torch.cuda.empty_cache()
    elif kind == "pageable_copy":  # .cpu() of a tensor on the gated stream: cudaMemcpyAsync to
        torch.ones(4, device="cuda").cpu()  # pageable memory, which waits for the stream
    elif kind == "pinned_copy":  # the same into pinned memory, then an event: what vLLM does
        out = torch.empty(4, pin_memory=True)
        out.copy_(torch.ones(4, device="cuda"), non_blocking=True)
        torch.cuda.current_stream().synchronize()
    elif kind:
        raise ValueError(kind)


class CudaBytes:
    def __init__(self, address, size):
        self.__cuda_array_interface__ = {"shape": (size // 4,), "typestr": "<f4",
                                         "data": (address, False), "version": 3, "strides": None}


class Slots:
    """Two physical slots; one live range mapped onto one of them."""

    def __init__(self, size):
        prop = AllocationProp()
        prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = Location(1, 0)  # CU_MEM_LOCATION_TYPE_DEVICE, device 0
        g = c_size_t()
        check(granularity_of(byref(g), byref(prop), 1), "granularity")
        self.size = (size + g.value - 1) // g.value * g.value
        self.handles = []
        for _ in range(2):
            h = c_uint64()
            check(mem_create(byref(h), self.size, byref(prop), 0), "cuMemCreate")
            self.handles.append(h.value)
        va = c_uint64()
        check(reserve(byref(va), self.size, g.value, 0, 0), "cuMemAddressReserve")
        self.live = va.value
        self.access = AccessDesc(Location(1, 0), 3)  # PROT_READWRITE
        check(mem_map(self.live, self.size, 0, self.handles[0], 0), "cuMemMap")
        check(set_access(self.live, self.size, byref(self.access), 1), "cuMemSetAccess")
        self.slot = 0

    def remap(self):
        other = 1 - self.slot
        check(mem_unmap(self.live, self.size), "cuMemUnmap")
        check(mem_map(self.live, self.size, 0, self.handles[other], 0), "cuMemMap")
        check(set_access(self.live, self.size, byref(self.access), 1), "cuMemSetAccess")
        self.slot = other


class Gate:
    def __init__(self):
        host = c_void_p()
        check(host_alloc(byref(host), 64, 1 | 2), "cuMemHostAlloc")
        self.value = c_uint32.from_address(host.value)
        self.value.value = 0
        device = c_uint64()
        check(host_device_pointer(byref(device), host, 0), "cuMemHostGetDevicePointer")
        self.device = device.value


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--interfere":
        return measure(2.0, 3, ("gated",), sys.argv[2])
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    measure(gib, reps, ("sync", "gated"), "")
    for kind in ("device_synchronize", "cuMemFree", "empty_cache", "pinned_copy", "pageable_copy"):
        try:
            child = subprocess.run([sys.executable, __file__, "--interfere", kind],
                                   capture_output=True, text=True, timeout=INTERFERENCE_DEADLINE_S)
            lines = [x for x in child.stdout.splitlines() if ": gated:" in x]
            print(f"[gated-remap] {kind} during the gate: exit {child.returncode}; "
                  f"{lines[-1] if lines else child.stderr[-400:]}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"[gated-remap] {kind} during the gate: DEADLOCK (no exit within "
                  f"{INTERFERENCE_DEADLINE_S} s)", flush=True)


def measure(gib, reps, ways, interference):
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    context = c_void_p()
    check(ctx_get(byref(context)), "cuCtxGetCurrent")
    slots = Slots(int(gib * (1 << 30)))
    live = torch.as_tensor(CudaBytes(slots.live, slots.size), device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    live.fill_(1.0)  # slot 0 holds 1.0, slot 1 holds 2.0
    stream.synchronize()
    slots.remap()
    live.fill_(2.0)
    stream.synchronize()
    slots.remap()
    count = live.numel()
    sums = torch.zeros(3 * reps * 2 + 8, device="cuda", dtype=torch.float64)
    gate = Gate()
    opened = [0]
    print(f"[gated-remap] {torch.cuda.get_device_name()}, live range {slots.size / 2**30:.2f} GiB, "
          f"{reps} swaps per way", flush=True)

    def step(index):
        torch.sum(live, dim=0, dtype=torch.float64, out=sums[index])

    def event():
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    results = {}
    index = 0
    for way in ways:
        idle, first, nxt, host, right = [], [], [], [], 0
        blocked = None
        for rep in range(reps + 1):  # the first is a warm-up
            before = slots.slot
            step(index)
            e1 = event()
            t0 = time.perf_counter()
            if way == "sync":
                stream.synchronize()
                slots.remap()
                t1 = time.perf_counter()
            else:
                opened[0] += 1
                check(wait_value(stream.cuda_stream, gate.device, opened[0], 0), "cuStreamWaitValue32")
                done = threading.Event()
                failure = []

                def remap_when_done(e1=e1, done=done, failure=failure, value=opened[0]):
                    try:
                        check(ctx_set(context), "cuCtxSetCurrent")
                        e1.synchronize()
                        slots.remap()
                    except Exception as exc:  # reported below
                        failure.append(exc)
                    finally:
                        gate.value.value = value
                        done.set()

                helper = threading.Thread(target=remap_when_done, daemon=True)
                helper.start()
                interfere(interference)
                t1 = time.perf_counter()
            e2 = event()
            step(index + 1)
            e3 = event()
            step(index + 2)
            e4 = event()
            if way == "gated":
                if not done.wait(HANG_LIMIT_S):
                    blocked = (f"BLOCKED: the remap did not finish within {HANG_LIMIT_S} s while the "
                               f"engine stream waited on the gate")
                    gate.value.value = opened[0]
                    done.wait(HANG_LIMIT_S)
                if failure:
                    blocked = f"FAILED: {failure[0]}"
            e4.synchronize()
            values = sums[index:index + 3].tolist()
            expect_before, expect_after = (before + 1) * count, (slots.slot + 1) * count
            ok = values[0] == expect_before and values[1] == expect_after and values[2] == expect_after
            if rep > 0:
                idle.append(e1.elapsed_time(e2))
                first.append(e2.elapsed_time(e3))
                nxt.append(e3.elapsed_time(e4))
                host.append((t1 - t0) * 1e3)
                right += ok
            index += 3
            if blocked:
                break
        med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
        results[way] = dict(idle_ms=med(idle), first_step_ms=med(first), next_step_ms=med(nxt),
                            engine_thread_ms=med(host), correct=f"{right}/{len(idle)}",
                            note=blocked or "")
        print(f"[gated-remap] {interference or 'plain'}: {way}: GPU idle across the swap {med(idle)} ms (max "
              f"{round(max(idle), 3) if idle else None}), first step after it {med(first)} ms, "
              f"the next {med(nxt)} ms, engine thread in the swap {med(host)} ms, the step after "
              f"the swap read the new slot {right}/{len(idle)} {blocked or ''}", flush=True)
    print(f"[gated-remap] result {results}", flush=True)


if __name__ == "__main__":
    main()
