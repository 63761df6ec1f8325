"""shadowsync.vllm: shadowsync inside vLLM.

    llm = vllm.LLM(model=..., worker_extension_cls="shadowsync.vllm.WorkerExtension",
                   weight_transfer_config={"backend": "shadowsync"})
    shadowsync.vllm.init_weight_update_group(llm, ShadowsyncInitInfo(unique_id=..., specs=...))

One job per module: the worker extension's RPC surface (worker_extension.py), its typed
configuration (init_info.py), set-up and receive planning (set_up.py, receive_planning.py), the
step-hook site (step_hook_site.py), tensor-parallel agreement (tensor_parallel.py), the front
end's calls (front_end.py), the weight-transfer backends that place the weights at load
(live_arena.py, graph_pairs.py) and the traces of vLLM's loader and post-load step
(loader_trace.py, post_load_trace.py).

Importing it imports neither vllm nor torch; in a process that has imported vllm (its workers,
which import the worker extension before they load the model) it registers the weight-transfer
backends with vLLM, and traces what vLLM's post-load step does to the weights, which the set-up
checks."""

import sys as _sys

from .front_end import (
    apply_update,
    apply_update_async,
    commit_update,
    commit_update_async,
    init_weight_update_group,
    init_weight_update_group_async,
)
from .init_info import ShadowsyncInitInfo
from .lora_plan import scaled_lora_b
from .worker_extension import WorkerExtension

__all__ = ["ShadowsyncInitInfo", "WorkerExtension", "apply_update", "apply_update_async",
           "commit_update", "commit_update_async", "init_weight_update_group",
           "init_weight_update_group_async", "scaled_lora_b"]


def _register_backends_with_vllm() -> None:
    """Registers the weight-transfer backends with vLLM (weight_transfer_backend.py): "shadowsync"
    (chooses the placement), "shadowsync_live_arena" and "shadowsync_graph_pairs" (ask for one);
    lazily: vLLM imports the module only when an engine asks for that backend. Only where vLLM is
    already imported, and only a vLLM with weight-transfer engines (0.25 and later)."""
    if "vllm" not in _sys.modules:
        return
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    for name, module, cls in (
            ("shadowsync", "weight_transfer_backend", "ShadowsyncEngine"),
            ("shadowsync_live_arena", "live_arena", "LiveArenaEngine"),
            ("shadowsync_graph_pairs", "live_arena", "GraphPairsEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, f"shadowsync.vllm.{module}", cls)
        except ValueError:
            pass  # registered already (this module imported again under another name)


_register_backends_with_vllm()
# Before any engine loads, whichever of vllm and this package is imported first: its post-load
# step must be traced (post_load_trace.py).
from .post_load_trace import install_when_vllm_loads as _trace_post_load  # noqa: E402

_trace_post_load()
