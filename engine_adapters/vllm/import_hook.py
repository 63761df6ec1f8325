"""when_imported(name, callback): runs `callback(module)` right after the module `name` is
imported, or at once if it already is. How shadowsync.vllm hooks into vLLM whatever the order of
``import shadowsync.vllm`` and ``import vllm`` in a user's program (an isort-ed file imports
shadowsync first), and in vLLM's spawned processes, which import both again in their own order."""

from __future__ import annotations

import importlib.util
import sys
from typing import Callable

__all__ = ["when_imported"]


def when_imported(name: str, callback: Callable) -> None:
    """`callback(module)` once `name` is imported: now if it is, else right after its code ran
    (before any other module can use it). The same (name, callback) waits only once."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if not any(isinstance(f, _AfterImport) and (f.name, f.callback) == (name, callback)
               for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport:
    """A meta path finder that lets the normal finders find `name`, then wraps its loader so that
    `callback` runs right after the module's code. Removes itself at its first use."""

    def __init__(self, name: str, callback: Callable):
        self.name = name
        self.callback = callback

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once; and find_spec below must not find this finder
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, callback = spec.loader.exec_module, self.callback

        def exec_module(module):
            run(module)
            callback(module)

        spec.loader.exec_module = exec_module
        return spec
