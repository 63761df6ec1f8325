"""Where the checkout's pieces are, and how a process spawned from here (vLLM's engine, a
trainer) finds them."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PYTHON_DIR = ROOT / "python"
BENCH_DIR = ROOT / "bench"


def prepend_pythonpath(folder) -> None:
    """`folder` first on PYTHONPATH: processes spawned from here (vLLM's) import from it too."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder)] + rest)
