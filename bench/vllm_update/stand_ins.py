"""The vllm path's stand-ins for ray and requests: vLLM 0.25.0's ipc_engine module imports them at
load time, but the code path the benchmark drives (a callable send_mode, one GPU) never calls
them (bench_vllm_update.py's docstring, "Stand-in for ray")."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from run_report import log

from .paths import prepend_pythonpath

# The folder holding the stand-ins of this process, if any: removed when the path ends.
STAND_IN_FOLDER: list[Path] = []


STAND_IN_SOURCE = '''"""Stand-in for the {name} package (bench/bench_vllm_update.py): vLLM 0.25.0's
IPC weight-transfer module imports {name} at load time, but the path the benchmark drives (a
callable send_mode, one GPU) never calls it."""

STAND_IN = True


def is_initialized():
    return False


def __getattr__(attribute):
    raise AttributeError(
        f"{{attribute!r}}: '{name}' here is the benchmark's stand-in (the package is not "
        f"installed); the code path that asked for it needs the real package")
'''


def import_ipc_engine() -> list[str]:
    """Imports vLLM's IPC weight-transfer module; where that fails only because ray or requests
    is not installed, puts a stand-in of that name (see the module's doc) first on sys.path and
    on PYTHONPATH (vLLM's spawned engine process imports the module too) and tries again.
    Returns the names stood in for (none where the module imports as it is)."""
    import importlib

    stood_in: list[str] = []
    folder = None
    while True:
        try:
            importlib.import_module("vllm.distributed.weight_transfer.ipc_engine")
            return stood_in
        except ModuleNotFoundError as e:
            if e.name not in ("ray", "requests") or e.name in stood_in:
                raise
            if folder is None:
                folder = Path(tempfile.mkdtemp(prefix="bench-vllm-stand-ins-"))
                STAND_IN_FOLDER.append(folder)  # removed when the path ends
                sys.path.insert(0, str(folder))
                prepend_pythonpath(folder)
            (folder / f"{e.name}.py").write_text(STAND_IN_SOURCE.format(name=e.name))
            importlib.invalidate_caches()
            stood_in.append(e.name)
            log(f"vllm's ipc_engine imports '{e.name}', not installed: stand-in {folder / e.name}.py "
                f"(this path never calls it)")
