"""pytest setup: which `shadowsync` package is tested, and the `pair` fixture.

By default the package of this checkout (python/ first on sys.path), with the library from
SHADOWSYNC_LIBRARY (scripts/test.sh points it at build/) or the package's own search (a source
checkout's build/). With SHADOWSYNC_TEST_INSTALLED=1 the pip-installed package instead, as a user
gets it (scripts/test.sh's wheel step): python/ is not put on sys.path, and importing shadowsync
from this checkout is an error."""

import os
import sys
from pathlib import Path

import pytest

# The same-host transport's device flavour waits in CUDA streams for the other process; streams
# sharing one of the device's hardware queues wait with it. More queues (the maximum; the default
# is 8) before anything starts CUDA keep the engine's streams apart from the receiver's. Spawned
# trainer processes inherit it.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# test_mini_worker's cuda case puts an NCCL trainer and an engine on two GPUs of ONE process, and
# on H200 machines its receive stalls at the first bucket its trainer holds back until the
# engine has stepped (a bucket not complete after 10 s, the trainer done sending; torch's NCCL
# 2.28.9). Without this setting it failed in every H200 run (7 of 7); with it, 2 of 3 passed (the
# eighteenth and nineteenth sessions, docs/gpu.md; NCCL_P2P_USE_CUDA_MEMCPY=1 and
# NCCL_P2P_DISABLE=1 passed too). By our reading of NCCL 2.28.9's p2p.cc it changes only a log
# label within one process, which that record does not bear out. The likely mechanism is the
# test's trainer waiting on engine steps while the NCCL receive kernels of the held-back buckets
# wait on the engine's GPU (docs/ARCHITECTURE.md, "What NCCL cannot give"); not yet shown by a
# trace (scripts/gpu/diagnose_nccl_stall.sh). Kept until a traced run settles it. NCCL reads it
# once per process, at its first communicator: set here.
os.environ.setdefault("NCCL_P2P_DIRECT_DISABLE", "1")

PYTHON_DIR = Path(__file__).resolve().parent.parent
TEST_INSTALLED = os.environ.get("SHADOWSYNC_TEST_INSTALLED") == "1"

if not TEST_INSTALLED:
    # Test the package of this checkout, whether or not one is pip-installed.
    sys.path.insert(0, str(PYTHON_DIR))
else:
    import shadowsync

    _imported = Path(shadowsync.__file__).resolve()
    if PYTHON_DIR in _imported.parents:
        raise RuntimeError(
            f"SHADOWSYNC_TEST_INSTALLED=1 but shadowsync was imported from this checkout "
            f"({_imported}), not an installed package: run pytest from a directory where python/ "
            f"is not importable")

from support import Pair  # noqa: E402


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()
