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
