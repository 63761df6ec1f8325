"""shadowsync.vllm: the vLLM worker extension (``worker_extension_cls=
"shadowsync.vllm.WorkerExtension"``), in worker_extension.py.

This folder is the subpackage ``shadowsync.vllm``: an installed package has it in place
(the wheel's build installs it there, python/CMakeLists.txt); in a source checkout ``shadowsync/__init__.py`` finds it
here. Importing it imports neither vllm nor torch."""

from .worker_extension import (
    WorkerExtension,
    apply_update,
    apply_update_async,
    commit_update,
    init_weight_update_group,
    init_weight_update_group_async,
)
from .lora_plan import scaled_lora_b

__all__ = ["WorkerExtension", "apply_update", "apply_update_async", "commit_update",
           "init_weight_update_group", "init_weight_update_group_async", "scaled_lora_b"]
