"""shadowsync.vllm: the vLLM worker extension (``worker_extension_cls=
"shadowsync.vllm.WorkerExtension"``), in worker_extension.py.

This folder is the subpackage ``shadowsync.vllm``: an installed package has it in place
(the wheel's build installs it there, python/CMakeLists.txt); in a source checkout ``shadowsync/__init__.py`` finds it
here. Importing it imports neither vllm nor torch; in a process that has imported vllm (its
workers, which import the worker extension before they load the model) it registers the
"shadowsync" (live arena) and "shadowsync_graph_pairs" weight-transfer backends (live_arena.py,
graph_pairs.py) with vLLM, and traces what vLLM's post-load step does to the weights
(post_load_trace.py), which the set-up checks."""

import sys as _sys


from .worker_extension import (
    WorkerExtension,
    apply_update,
    apply_update_async,
    commit_update,
    commit_update_async,
    init_weight_update_group,
    init_weight_update_group_async,
)
from .lora_plan import scaled_lora_b

__all__ = ["WorkerExtension", "apply_update", "apply_update_async", "commit_update",
           "commit_update_async",
           "init_weight_update_group", "init_weight_update_group_async", "scaled_lora_b"]


def _register_live_arena_with_vllm() -> None:
    """Registers live_arena.LiveArenaEngine as vLLM's weight-transfer backend "shadowsync" and
    live_arena.GraphPairsEngine as "shadowsync_graph_pairs" (lazily: vLLM imports the module
    only when an engine asks for that backend). Only where vLLM is already imported, and only a
    vLLM with weight-transfer engines (0.25 and later)."""
    if "vllm" not in _sys.modules:
        return
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    for name, cls in (("shadowsync", "LiveArenaEngine"),
                      ("shadowsync_graph_pairs", "GraphPairsEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, "shadowsync.vllm.live_arena", cls)
        except ValueError:
            pass  # registered already (this module imported again under another name)


_register_live_arena_with_vllm()
# Before any engine loads, whichever of vllm and this package is imported first: its post-load
# step must be traced (post_load_trace.py).
from .post_load_trace import install_when_vllm_loads as _trace_post_load  # noqa: E402

_trace_post_load()
