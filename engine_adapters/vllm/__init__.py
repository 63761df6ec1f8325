"""shadowsync.vllm: shadowsync inside vLLM.

    llm = vllm.LLM(model=..., worker_extension_cls="shadowsync.vllm.WorkerExtension",
                   weight_transfer_config={"backend": "shadowsync"})
    shadowsync.vllm.init_weight_update_group(llm, ShadowsyncInitInfo(unique_id=..., specs=...))

One job per module: the worker extension's RPC surface (worker_extension.py), its typed
configuration (init_info.py), set-up and receive planning (set_up.py, receive_planning.py), the
step-hook site (step_hook_site.py), tensor-parallel agreement (tensor_parallel.py), the front
end's calls (front_end.py), the weight-transfer backends that place the weights at load
(live_arena.py, graph_pairs.py) and the traces of vLLM's loader and post-load step
(loader_trace.py, post_load_trace.py), and starting vLLM from a torchrun rank (torchrun_env.py).

Importing it imports neither vllm nor torch. Whichever of this package and vllm a process
imports first, it registers the weight-transfer backends with vLLM once vLLM's factory is
imported, and traces what vLLM's post-load step does to the weights, which the set-up checks
(import_hook.py)."""

from .front_end import (
    apply_update,
    apply_update_async,
    commit_update,
    commit_update_async,
    init_weight_update_group,
    init_weight_update_group_async,
    weight_update_needs,
    weight_update_needs_async,
)
from .import_hook import when_imported as _when_imported
from .init_info import ShadowsyncInitInfo
from .update_info import ShadowsyncUpdateInfo
from .lora_plan import scaled_lora_b
from .post_load_trace import install_when_vllm_loads as _trace_post_load
from .torchrun_env import outside_torchrun
from .worker_extension import WorkerExtension

__all__ = ["ShadowsyncInitInfo", "ShadowsyncUpdateInfo", "WorkerExtension", "apply_update", "apply_update_async",
           "commit_update", "commit_update_async", "init_weight_update_group",
           "init_weight_update_group_async", "outside_torchrun", "scaled_lora_b",
           "weight_update_needs", "weight_update_needs_async"]

_FACTORY = "vllm.distributed.weight_transfer.factory"  # vLLM's registry of weight-transfer engines


def _register_backends(factory) -> None:
    """Registers the weight-transfer backends with vLLM's factory (weight_transfer_backend.py):
    "shadowsync" (chooses the placement), "shadowsync_live_arena" and "shadowsync_graph_pairs"
    (ask for one), and from vLLM 0.28 on the trainer engine "shadowsync" (trainer_engine.py);
    lazily: vLLM imports the module only when an engine asks for that backend."""
    registries = [(factory.WeightTransferEngineFactory, name, module, cls) for name, module, cls in (
        ("shadowsync", "weight_transfer_backend", "ShadowsyncEngine"),
        ("shadowsync_live_arena", "live_arena", "LiveArenaEngine"),
        ("shadowsync_graph_pairs", "live_arena", "GraphPairsEngine"))]
    trainer_factory = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainer_factory is not None:
        registries.append((trainer_factory, "shadowsync", "trainer_engine",
                           "ShadowsyncTrainerEngine"))
    for registry, name, module, cls in registries:
        try:
            registry.register_engine(name, f"shadowsync.vllm.{module}", cls)
        except ValueError:
            pass  # registered already (this module imported again under another name)


# In every process that imports vLLM's weight-transfer factory (vLLM 0.25 and later), whether it
# imported this package first or vLLM: an engine names the backend before its workers load the
# model, and a spawned worker imports both again in its own order.
_when_imported(_FACTORY, _register_backends)
# Before any engine loads, whichever of vllm and this package is imported first: its post-load
# step must be traced (post_load_trace.py).
_trace_post_load()
