"""pytest setup: this checkout's package first on sys.path, and the `pair` fixture.

The library comes from SHADOWSYNC_LIBRARY (scripts/test.sh points it at build/) or the package's
own search (a source checkout's build/)."""

import sys
from pathlib import Path

import pytest

# Test the package of this checkout, whether or not one is pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support import Pair  # noqa: E402


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()
