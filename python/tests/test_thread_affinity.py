"""The library's threads leave a one-CPU binding they inherited (core/thread_affinity.h).

vLLM's CPU workers bind each of their threads to one core; threads the library starts from such
a thread inherit that core and would wait behind the engine's. In a child process whose main
thread is bound to one CPU, a Receiver and a Sender (host backend, loopback) take an update; then
every thread they started must run on every CPU the process may use, and the move is said once
on stderr. With SHADOWSYNC_THREAD_AFFINITY=inherit every one keeps the one CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from support import Pair, SPECS          # numpy, shadowsync and their threads first

def allowed(tid):
    with open(f"/proc/self/task/{tid}/status") as status:
        for line in status:
            if line.startswith("Cpus_allowed_list:"):
                cpus = set()
                for part in line.split(":")[1].strip().split(","):
                    first, _, last = part.partition("-")
                    cpus.update(range(int(first), int(last or first) + 1))
                return sorted(cpus)

cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})           # this thread: the library's threads start from it
before = set(os.listdir("/proc/self/task"))
pair = Pair()
pair.update(1, [s[0] for s in SPECS])    # every thread has run
threads = {tid: allowed(tid) for tid in set(os.listdir("/proc/self/task")) - before}
pair.close()
print(json.dumps({"cpu": cpu, "threads": threads}))
"""


def run_child(**env) -> tuple[dict, str]:
    import shadowsync

    package_dir = str(Path(shadowsync.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [package_dir, os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(TESTS)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=path, **env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a process with 2 CPUs")
def test_library_threads_leave_an_inherited_single_cpu():
    cpus = sorted(os.sched_getaffinity(0))
    result, stderr = run_child()
    threads = result["threads"]
    assert len(threads) >= 2, threads  # at least the receiver's and the sender's
    assert all(allowed == cpus for allowed in threads.values()), (cpus, threads)
    told = [line for line in stderr.splitlines() if "binds its threads to one CPU each" in line]
    assert len(told) == 1, stderr
    assert f"(CPU {result['cpu']} here;" in told[0] and "SHADOWSYNC_THREAD_AFFINITY=inherit" \
        in told[0], told


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a process with 2 CPUs")
def test_an_inherited_single_cpu_is_kept_when_asked():
    result, stderr = run_child(SHADOWSYNC_THREAD_AFFINITY="inherit")
    threads = result["threads"]
    assert len(threads) >= 2, threads
    assert all(allowed == [result["cpu"]] for allowed in threads.values()), threads
    assert "binds its threads to one CPU each" not in stderr
