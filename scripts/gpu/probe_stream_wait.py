#!/usr/bin/env python3
"""Probe (GPU machine, one GPU, torch): does a stream that waits on a host counter hold back
torch's work on OTHER streams of the same process?

That is the same-host receiver's situation while the sender withholds a chunk: its stream holds
cuStreamWaitValue32 ("counter >= c+1", pinned host memory that only host code writes) followed by
that chunk's cudaMemcpyAsync (copy engine), a host function (the ack) and so on for every later
chunk. If the engine's own work queues up behind that wait, an engine cannot decode while an
update is in flight, and a trainer that waits for the engine before sending its last bucket (the
mini worker test, a ZeRO-3 trainer pacing itself on the engine) deadlocks until the receiver's
bucket deadline.

For every (pending work, engine operation, engine stream): a fresh counter at 0, the pending work
enqueued on a non-blocking stream of our own (created as CudaBackend creates its streams), a
timer thread that opens the counter after HOLD_S, and the engine operation timed. An operation
that takes about HOLD_S was held by the wait ("HELD"); one that takes milliseconds was not.
Needs no shadowsync: torch for the engine's side, the driver API through ctypes for the rest.

    python3 scripts/gpu/probe_stream_wait.py            # prints one line per case and a summary
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import sys
import threading
import time
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p

import torch

HOLD_S = 1.0  # how long the pending work holds its counter closed
HELD = 0.8 * HOLD_S  # an operation slower than this waited for the counter
CHUNK_BYTES = 1 << 20
CHUNKS = 15  # "receive": as many chunks as the mini worker's update (14 buckets + checksums)
HANG_LIMIT_S = 60  # a case that never returns: dump the stacks and exit (a hang is an answer too)

CU_STREAM_NON_BLOCKING = 1
CU_STREAM_WAIT_VALUE_GEQ = 0
CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMHOSTALLOC_DEVICEMAP = 2

cuda = ctypes.CDLL("libcuda.so.1")


def _driver(*names):
    for name in names:
        try:
            return getattr(cuda, name)
        except AttributeError:
            continue
    raise RuntimeError(f"libcuda.so.1 exports none of {names}")


def _check(result: int, what: str) -> None:
    if result != 0:
        name = c_char_p()
        cuda.cuGetErrorName(result, byref(name))
        raise RuntimeError(f"{what}: CUresult {result} ({(name.value or b'?').decode()})")


cuMemHostAlloc = _driver("cuMemHostAlloc")
cuMemHostAlloc.argtypes = [ctypes.POINTER(c_void_p), c_size_t, c_uint]
cuMemHostGetDevicePointer = _driver("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
cuMemHostGetDevicePointer.argtypes = [ctypes.POINTER(c_uint64), c_void_p, c_uint]
cuStreamCreateWithPriority = _driver("cuStreamCreateWithPriority")
cuStreamCreateWithPriority.argtypes = [ctypes.POINTER(c_void_p), c_uint, c_int]
cuStreamWaitValue32 = _driver("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
cuStreamWaitValue32.argtypes = [c_void_p, c_uint64, c_uint32, c_uint]
cuMemcpyAsync = _driver("cuMemcpyAsync")
cuMemcpyAsync.argtypes = [c_uint64, c_uint64, c_size_t, c_void_p]
cuMemsetD32Async = _driver("cuMemsetD32Async")
cuMemsetD32Async.argtypes = [c_uint64, c_uint, c_size_t, c_void_p]
cuEventCreate = _driver("cuEventCreate")
cuEventCreate.argtypes = [ctypes.POINTER(c_void_p), c_uint]
cuEventRecord = _driver("cuEventRecord")
cuEventRecord.argtypes = [c_void_p, c_void_p]
cuStreamWaitEvent = _driver("cuStreamWaitEvent")
cuStreamWaitEvent.argtypes = [c_void_p, c_void_p, c_uint]
cuLaunchHostFunc = _driver("cuLaunchHostFunc")
cuLaunchHostFunc.argtypes = [c_void_p, c_void_p, c_void_p]
cuStreamSynchronize = _driver("cuStreamSynchronize")
cuStreamSynchronize.argtypes = [c_void_p]
# A host function that touches nothing of ours: libc's getpid, called with one ignored argument.
HOST_FUNCTION = ctypes.cast(ctypes.CDLL(None).getpid, c_void_p)


class Counter:
    """A fresh 32-bit counter in pinned, mapped host memory, as the transport's."""

    def __init__(self):
        host = c_void_p()
        flags = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
        _check(cuMemHostAlloc(byref(host), 64, flags), "cuMemHostAlloc")
        self.host = host.value
        self.value = c_uint32.from_address(self.host)
        self.value.value = 0
        device = c_uint64()
        _check(cuMemHostGetDevicePointer(byref(device), host, 0), "cuMemHostGetDevicePointer")
        self.device = device.value

    def open(self, value: int) -> None:
        self.value.value = value


class Pending:
    """Receive-like work, each kind held by a counter; `enqueue` returns the opening value."""

    KINDS = ("none", "wait", "wait+memcpy", "wait+kernel", "wait+hostfunc", "wait+memset",
             "event->memset", "receive", "receive(kernel copy)")

    def __init__(self, device):
        self.streams = []
        for _ in range(2):  # the receive stream and a second one, as the receiver's checks
            stream = c_void_p()
            _check(cuStreamCreateWithPriority(byref(stream), CU_STREAM_NON_BLOCKING, 0),
                   "cuStreamCreateWithPriority")
            self.streams.append(stream.value)
        event = c_void_p()
        _check(cuEventCreate(byref(event), 2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        self.event = event.value
        self.src = torch.ones(CHUNK_BYTES // 4, device=device)
        self.dst = torch.empty_like(self.src)
        self.word = torch.zeros(2, dtype=torch.int32, device=device)

    def _wait(self, counter, value):
        _check(cuStreamWaitValue32(self.streams[0], counter.device, value,
                                   CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def _memcpy(self):
        _check(cuMemcpyAsync(self.dst.data_ptr(), self.src.data_ptr(), CHUNK_BYTES,
                             self.streams[0]), "cuMemcpyAsync")

    def _kernel(self, stream):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.add(self.src, 0, out=self.dst)  # an elementwise kernel: SMs, no copy engine

    def _host_function(self):
        _check(cuLaunchHostFunc(self.streams[0], HOST_FUNCTION, None), "cuLaunchHostFunc")

    def enqueue(self, kind: str, counter: Counter) -> int:
        if kind == "none":
            return 0
        if kind in ("receive", "receive(kernel copy)"):  # a whole update, every chunk withheld
            for chunk in range(CHUNKS):
                self._wait(counter, chunk + 1)
                if kind == "receive":
                    self._memcpy()
                else:
                    self._kernel(self.streams[0])
                self._host_function()
            return CHUNKS
        self._wait(counter, 1)
        if kind == "wait+memcpy":
            self._memcpy()
        elif kind == "wait+kernel":
            self._kernel(self.streams[0])
        elif kind == "wait+hostfunc":
            self._host_function()
        elif kind == "wait+memset":
            _check(cuMemsetD32Async(self.word.data_ptr(), 0, 2, self.streams[0]), "memset")
        elif kind == "event->memset":  # the checks stream: waits for a bucket, zeroes a result
            _check(cuEventRecord(self.event, self.streams[0]), "cuEventRecord")
            _check(cuStreamWaitEvent(self.streams[1], self.event, 0), "cuStreamWaitEvent")
            _check(cuMemsetD32Async(self.word.data_ptr(), 0, 2, self.streams[1]), "memset")
            self._kernel(self.streams[1])
        elif kind != "wait":
            raise ValueError(kind)
        return 1

    def drain(self):
        for stream in self.streams:
            _check(cuStreamSynchronize(stream), "cuStreamSynchronize(pending stream)")


def engine_operations(device):
    """The engine's work, each returning once it completed: what a decode step does."""
    x = torch.randn(2, 16, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    big = torch.randn(1 << 18, device=device)
    big_out = torch.empty_like(big)
    host = torch.randn(1 << 18)

    def sync():
        torch.cuda.current_stream(device).synchronize()

    return {
        "kernel": lambda: (torch.mul(x, 2, out=y), sync()),
        "matmul+.cpu()": lambda: (x @ w).float().cpu(),  # the mini worker's logits
        "D2H pageable": lambda: big.cpu(),
        "H2D pageable": lambda: (host.to(device), sync()),
        "D2D copy_": lambda: (big_out.copy_(big), sync()),
    }


def measure(kind, operation, engine_stream, pending):
    counter = Counter()
    opening = pending.enqueue(kind, counter)
    timer = threading.Timer(HOLD_S, counter.open, args=(opening,)) if opening else None
    if timer is not None:
        timer.start()
    faulthandler.dump_traceback_later(HANG_LIMIT_S, exit=True)
    start = time.monotonic()
    with torch.cuda.stream(engine_stream):
        operation()
    elapsed = time.monotonic() - start
    faulthandler.cancel_dump_traceback_later()
    if timer is not None:
        timer.cancel()
        counter.open(opening)
    pending.drain()
    return elapsed


def main() -> int:
    if not torch.cuda.is_available():
        print("probe: no CUDA device")
        return 2
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # the primary context, current on this thread
    print(f"probe: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}, "
          f"hold {HOLD_S} s", flush=True)
    pending = Pending(device)
    operations = engine_operations(device)
    streams = {"legacy default": torch.cuda.default_stream(device),
               "torch side stream": torch.cuda.Stream(device)}
    for operation in operations.values():  # warm up (cuBLAS handles, pinned pools, ...)
        for stream in streams.values():
            with torch.cuda.stream(stream):
                operation()
    torch.cuda.synchronize(device)

    held = []
    for kind in Pending.KINDS:
        for op_name, operation in operations.items():
            for stream_name, stream in streams.items():
                elapsed = measure(kind, operation, stream, pending)
                verdict = "HELD" if elapsed >= HELD else "free"
                if verdict == "HELD":
                    held.append((kind, op_name, stream_name))
                print(f"probe: pending={kind:<20} engine={op_name:<14} on {stream_name:<17} "
                      f"{elapsed * 1000:8.1f} ms  {verdict}", flush=True)
    listed = "; ".join(f"{k} / {o} / {s}" for k, o, s in held)
    print("probe summary: " + (f"{len(held)} held: {listed}" if held else
                               "nothing was held by a pending wait"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
