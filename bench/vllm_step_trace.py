"""Bench-only (bench_vllm_update.py --trace-steps): what each of a vLLM worker's forward calls
cost, to see where the time around a swap goes. Installed in vLLM's engine process with
``collective_rpc(install)`` (a callable: VLLM_ALLOW_INSECURE_SERIALIZATION=1, and this folder on
the engine process's path); nothing of it is in the library.

It wraps the model runner's ``execute_model`` (V1 and V2 runners alike; the shadowsync step hook
runs inside it, right before the forward, so the swap happens inside the traced call) and keeps,
per call: the host time it started (time.monotonic), the host seconds the call took (input
preparation, the swap's wait and remap, the forward's launch), two CUDA events on the current
stream around it, and the version live after it. From the events: the GPU time from the call's
start to the end of its forward (for the swap's step: the remap's idle GPU and the forward) and
the GPU time between the end of the previous call's work and this call's start (the previous
step's sampling and whatever else ran, idle time included)."""

from __future__ import annotations

import collections
import time


def install(worker, capacity: int = 8192) -> bool:
    import torch

    runner = worker.model_runner
    inner = runner.execute_model
    ring = collections.deque(maxlen=capacity)
    gpu = torch.cuda.is_available()  # vLLM's CPU build: host times only

    def traced(*args, **kwargs):
        start = torch.cuda.Event(enable_timing=True) if gpu else None
        end = torch.cuda.Event(enable_timing=True) if gpu else None
        began = time.monotonic()
        if gpu:
            start.record()
        out = inner(*args, **kwargs)
        if gpu:
            end.record()
        took = time.monotonic() - began
        state = getattr(worker, "_shadowsync", None)
        ring.append((began, took, start, end, state.receiver.applied_version if state else -1))
        return out

    runner.execute_model = traced
    worker._bench_step_trace = (ring, inner)
    return True


def collect(worker, since: float, until: float) -> list[list]:
    """``[host start, host ms in the call, GPU ms start→end, GPU ms previous end→start,
    version]`` for the calls that started in [since, until] (time.monotonic) and completed
    (without a GPU the two GPU times are None)."""
    ring, _ = worker._bench_step_trace
    rows = []
    previous_end = None
    for began, took, start, end, version in list(ring):
        if since <= began <= until and (end is None or end.query()):
            gpu_ms = round(start.elapsed_time(end), 3) if end is not None else None
            before = (round(previous_end.elapsed_time(start), 3)
                      if previous_end is not None and previous_end.query() else None)
            rows.append([began, round(took * 1e3, 3), gpu_ms, before, version])
        previous_end = end
    return rows


def remove(worker) -> bool:
    ring, inner = worker.__dict__.pop("_bench_step_trace", (None, None))
    if inner is not None:
        del worker.model_runner.__dict__["execute_model"]
    return True
