#!/usr/bin/env python3
"""Probe (GPU machine, one GPU, torch): where the remap swap's ~1 ms at Llama-3-8B goes, and
whether another layout of the same VMM memory makes it cheaper.

The remap swap (plugin/backends/cuda/vmm_slots.cpp) unmaps the live range, maps it onto the other
slot and sets its access: three driver calls over one 16 GB handle. While they run the GPU must not
read the live range, so their time is the GPU's stop at the swap. For each layout below, REPS
remaps of an idle GPU, each call timed on the host (µs, median / max):

* `one`            one handle per slot (what the library does);
* `chunks K`       K handles per slot mapped side by side, remapped one after another, the access
                   set once over the whole range (or per chunk where the driver refuses that);
* `threads K`      the same K chunks, each remapped by its own thread, all at once;
* `aligned A`      one handle, the live range reserved at A-byte alignment (larger pages?).

After every layout a kernel reads the whole live range and checks it read the slot just mapped
(each slot holds its own value): a faster remap that reads the wrong bytes is no answer.

    python3 scripts/gpu/probe_remap_cost.py [GiB] [REPS] [LAYOUTS]   (default 16 GiB, 20, all;
        LAYOUTS e.g. "one,aligned 1024,chunks 8"; aligned in MiB)

Needs no shadowsync: torch and the driver API through ctypes (probe_gated_remap.py's bindings).
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time
from ctypes import byref, c_size_t, c_uint64

import torch

from probe_gated_remap import (AccessDesc, AllocationProp, CudaBytes, Location, check, fn,
                               granularity_of, mem_create, mem_map, mem_unmap, reserve, set_access)

address_free = fn("cuMemAddressFree", c_uint64, c_size_t)
mem_release = fn("cuMemRelease", c_uint64)


class ChunkedSlots:
    """Two slots of `chunks` handles each, one live range; remap by `threads` threads."""

    def __init__(self, size, chunks, alignment=0):
        prop = AllocationProp()
        prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = Location(1, 0)  # CU_MEM_LOCATION_TYPE_DEVICE, device 0
        g = c_size_t()
        check(granularity_of(byref(g), byref(prop), 1), "granularity")
        self.chunk = (size // chunks + g.value - 1) // g.value * g.value
        self.size = self.chunk * chunks
        self.chunks = chunks
        self.handles = [[], []]
        for slot in range(2):
            for _ in range(chunks):
                h = c_uint64()
                check(mem_create(byref(h), self.chunk, byref(prop), 0), "cuMemCreate")
                self.handles[slot].append(h.value)
        va = c_uint64()
        check(reserve(byref(va), self.size, alignment or g.value, 0, 0), "cuMemAddressReserve")
        self.live = va.value
        self.access = AccessDesc(Location(1, 0), 3)  # PROT_READWRITE
        for i in range(chunks):
            check(mem_map(self.live + i * self.chunk, self.chunk, 0, self.handles[0][i], 0), "cuMemMap")
        self.access_whole = set_access(self.live, self.size, byref(self.access), 1) == 0
        if not self.access_whole:
            for i in range(chunks):
                check(set_access(self.live + i * self.chunk, self.chunk, byref(self.access), 1),
                      "cuMemSetAccess")
        self.slot = 0

    def release(self):
        for i in range(self.chunks):
            check(mem_unmap(self.live + i * self.chunk, self.chunk), "cuMemUnmap")
        check(address_free(self.live, self.size), "cuMemAddressFree")
        for handle in self.handles[0] + self.handles[1]:
            check(mem_release(handle), "cuMemRelease")

    def remap_chunk(self, i, other, times):
        at = self.live + i * self.chunk
        t0 = time.perf_counter()
        check(mem_unmap(at, self.chunk), "cuMemUnmap")
        t1 = time.perf_counter()
        check(mem_map(at, self.chunk, 0, self.handles[other][i], 0), "cuMemMap")
        t2 = time.perf_counter()
        if times is not None:
            times["unmap"] += t1 - t0
            times["map"] += t2 - t1

    def remap(self, threads):
        other = 1 - self.slot
        times = {"unmap": 0.0, "map": 0.0, "access": 0.0}
        t0 = time.perf_counter()
        if threads > 1:
            def work(first):
                for i in range(first, self.chunks, threads):
                    self.remap_chunk(i, other, None)
                    if not self.access_whole:
                        at = self.live + i * self.chunk
                        check(set_access(at, self.chunk, byref(self.access), 1), "cuMemSetAccess")
            pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            if self.access_whole:
                t1 = time.perf_counter()
                check(set_access(self.live, self.size, byref(self.access), 1), "cuMemSetAccess")
                times["access"] = time.perf_counter() - t1
        else:
            for i in range(self.chunks):
                self.remap_chunk(i, other, times)
            t1 = time.perf_counter()
            if self.access_whole:
                check(set_access(self.live, self.size, byref(self.access), 1), "cuMemSetAccess")
            else:
                for i in range(self.chunks):
                    check(set_access(self.live + i * self.chunk, self.chunk, byref(self.access), 1),
                          "cuMemSetAccess")
            times["access"] = time.perf_counter() - t1
        times["total"] = time.perf_counter() - t0
        self.slot = other
        return times


def measure(name, gib, reps, chunks, threads, alignment=0):
    slots = ChunkedSlots(int(gib * (1 << 30)), chunks, alignment)
    live = torch.as_tensor(CudaBytes(slots.live, slots.size), device="cuda")
    live.fill_(1.0)  # slot 0 holds 1.0
    torch.cuda.synchronize()
    slots.remap(threads)
    live.fill_(2.0)  # slot 1 holds 2.0
    torch.cuda.synchronize()
    rows, wrong = [], 0
    for _ in range(reps):
        torch.cuda.synchronize()
        rows.append(slots.remap(threads))
        expected = 1.0 + slots.slot
        if not bool((live == expected).all()):
            wrong += 1
    del live
    torch.cuda.synchronize()
    slots.release()

    def us(key):
        values = [r[key] * 1e6 for r in rows]
        return f"{statistics.median(values):8.1f} / {max(values):8.1f}"

    print(f"[remap-cost] {name:<14} {slots.size / 1e9:6.2f} GB  total {us('total')}  "
          f"unmap {us('unmap')}  map {us('map')}  access {us('access')}  (µs median / max, "
          f"{reps} remaps; access over the whole range: {slots.access_whole}; "
          f"wrong reads after the remap: {wrong})", flush=True)
    return wrong


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    torch.zeros(1, device="cuda")
    print(f"[remap-cost] {torch.cuda.get_device_name()}, {gib} GiB per slot, {reps} remaps each; "
          f"threads' rows time only the whole remap and the final access", flush=True)
    layouts = sys.argv[3].split(",") if len(sys.argv) > 3 else [
        "one", "chunks 2", "chunks 8", "chunks 32", "threads 2", "threads 4", "threads 8",
        "aligned 1024", "aligned 16384", "one"]
    wrong = 0
    for layout in layouts:
        kind, _, n = layout.partition(" ")
        if kind == "one":
            wrong += measure(layout, gib, reps, 1, 1)
        elif kind == "chunks":
            wrong += measure(layout, gib, reps, int(n), 1)
        elif kind == "threads":
            wrong += measure(layout, gib, reps, 8, int(n))
        elif kind == "aligned":  # n in MiB
            wrong += measure(layout + "M", gib, reps, 1, 1, int(n) << 20)
        else:
            raise SystemExit(f"unknown layout {layout!r} (one, chunks K, threads K, aligned MiB)")
    print(f"[remap-cost] wrong reads in all: {wrong}", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
