#!/usr/bin/env python3
"""What an idle same-host link (device memory) costs the CPU: a trainer process serves, an engine
process connects, both sit idle for SECONDS; each prints the CPU seconds its process used over
that window (its progress thread's idle polling, kIdlePollNs in same_host_device.cpp; the Python
threads sleep). GPU machine only.

    SHADOWSYNC_LIBRARY=build-gpu/libshadowsync_c.so PYTHONPATH=python \\
        python3 scripts/gpu/probe_idle_link_cpu.py [SECONDS]
"""

import multiprocessing as mp
import os
import sys
import tempfile
import time


def side(role: str, path: str, token: bytes, seconds: float, out) -> None:
    import shadowsync as ss

    backend = ss.CudaBackend(0)
    if role == "trainer":
        link = ss.same_host_sender_transport(path, token, 1, backend, 1 << 20, memory="device")
    else:
        link = ss.same_host_transport(path, token, 1, backend)
    time.sleep(0.5)  # both ends up, the handshake's traffic over
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    out.put((role, cpu, wall))
    del link


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    folder = tempfile.mkdtemp(prefix="ss-idle-")
    os.chmod(folder, 0o700)
    path, token = os.path.join(folder, "link.sock"), os.urandom(32)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=side, args=(r, path, token, seconds, out))
             for r in ("trainer", "engine")]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    for role, cpu, wall in sorted(results):
        print(f"{role}: {cpu:.3f} CPU s over {wall:.2f} s idle = {100 * cpu / wall:.2f} % of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
