"""shadowsync.vllm: the vLLM worker extension (``worker_extension_cls=
"shadowsync.vllm.WorkerExtension"``), in worker_extension.py.

This folder is the subpackage ``shadowsync.vllm``: an installed package has it in place
(python/pyproject.toml maps it there); in a source checkout ``shadowsync/__init__.py`` finds it
here. Importing it imports neither vllm nor torch."""

from .worker_extension import WorkerExtension

__all__ = ["WorkerExtension"]
