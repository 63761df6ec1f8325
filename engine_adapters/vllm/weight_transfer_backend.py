"""vLLM's weight-transfer backend "shadowsync": the one way to turn shadowsync on.

    llm = vllm.LLM(model=..., worker_extension_cls="shadowsync.vllm.WorkerExtension",
                   weight_transfer_config={"backend": "shadowsync"})

vLLM makes its weight-transfer engine right after it loads the model, before it profiles memory
and captures CUDA graphs: the only moment the weights can still be placed where a swap costs the
engine least. With no option given, this backend chooses the fastest swap that is right for the
engine vLLM built, and says which and why (printed once per worker; ``memory_report()["swap"]``):

* **graph pairs** (graph_pairs.py): CUDA graphs on, vLLM's V2 GPU runner, no LoRA, no speculative
  decoder, no breakable graphs. The weights sit in a remap arena whose two slots each get their own
  CUDA graphs; a swap points the parameters at the other slot and switches graph sets.
* **the live arena** (live_arena.py): CUDA graphs on where graph pairs are not possible. A swap
  remaps the arena's live range onto the slot the update landed in.
* **in place**: the weights stay where vLLM loaded them. On vLLM CPU (host memory cannot be
  remapped) and with ``enforce_eager`` (the worker extension rebinds the parameters to the live
  slot, which no captured graph holds on to); under CUDA graphs where no arena can be made, the
  worker extension copies each update into vLLM's own storage (copy_in).

The explicit backends "shadowsync_graph_pairs" and "shadowsync_live_arena" ask for one of the
first two and are refused, naming why, where it cannot work.

vLLM's own weight-transfer calls (init_weight_transfer_engine, update_weights, ...) are refused
for now: updates go through the worker extension (shadowsync.vllm.init_weight_update_group, then
begin_update and apply_update).
"""

from __future__ import annotations

from typing import Any

from shadowsync.errors import InvalidArgumentError, NotSupportedError
from vllm.distributed.weight_transfer.base import WeightTransferEngine

__all__ = ["PlacedWeightsEngine", "ShadowsyncEngine", "choose_placement"]

# The names under which import shadowsync.vllm registers the engines with vLLM.
BACKEND_NAME = "shadowsync"
LIVE_ARENA_BACKEND_NAME = "shadowsync_live_arena"
GRAPH_PAIRS_BACKEND_NAME = "shadowsync_graph_pairs"


class PlacedWeightsEngine(WeightTransferEngine):
    """What every shadowsync weight-transfer engine is: it places vLLM's weights at load (here:
    leaves them in place) and refuses vLLM's own transfer calls."""

    init_info_cls = dict
    update_info_cls = dict
    # What the worker extension looks for on vLLM's weight_transfer_engine (it imports no vLLM).
    shadowsync_live_arena = False
    shadowsync_graph_pairs = False
    # (placement, why): set by ShadowsyncEngine when it chose; memory_report()["swap"].
    swap_choice: tuple[str, str] | None = None
    memory_accounting: dict | None = None

    def _refuse(self, call: str):
        raise InvalidArgumentError(
            f"{call}: the shadowsync weight-transfer backends place vLLM's weights at load for the "
            f"fastest swap; updates go through the worker extension "
            f"(shadowsync.vllm.init_weight_update_group, then apply_update or begin_update)")

    def init_transfer_engine(self, init_info: Any) -> None:
        self._refuse("init_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._refuse("start_weight_update")

    def finish_weight_update(self) -> None:
        self._refuse("finish_weight_update")

    def receive_weights(self, update_info: Any) -> None:
        self._refuse("update_weights")

    def shutdown(self) -> None:
        pass  # an arena lives as long as the model reads it: freed with this object

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        raise InvalidArgumentError(
            "trainer_send_weights: the shadowsync weight-transfer backends have no sender of "
            "vLLM's kind; the trainer sends with shadowsync (a Sender over NCCL or the same-host "
            "transport)")


class ShadowsyncEngine(PlacedWeightsEngine):
    """vLLM's weight-transfer engine "shadowsync": makes the engine choose_placement chose (a
    GraphPairsEngine, a LiveArenaEngine or this class itself, weights in place)."""

    def __new__(cls, config, vllm_config, device, model):
        from .live_arena import GraphPairsEngine, LiveArenaEngine

        placement, why = choose_placement(vllm_config, device, model)
        engine = None
        if placement in ("graph pairs", "live arena"):
            engine_cls = GraphPairsEngine if placement == "graph pairs" else LiveArenaEngine
            try:
                engine = engine_cls(config, vllm_config, device, model)
            except NotSupportedError as error:  # refused before any weight moved
                placement, why = "in place", (f"no remap arena can be made here ({error}): each "
                                              f"update is copied into vLLM's own storage "
                                              f"(copy_in)")
        if engine is None:
            engine = super().__new__(cls)
            PlacedWeightsEngine.__init__(engine, config, vllm_config, device, model)
        engine.swap_choice = (placement, why)
        print(f"[shadowsync] weight-transfer backend '{BACKEND_NAME}': {placement}, because "
              f"{why}", flush=True)
        return engine

    def __init__(self, *args, **kwargs) -> None:
        pass  # __new__ made the engine it returns


def choose_placement(vllm_config, device, model) -> tuple[str, str]:
    """("graph pairs" | "live arena" | "in place", why) for the engine vLLM built."""
    from .graph_pairs import why_unswitchable
    from .live_arena import runner_loading

    if getattr(device, "type", str(device)) != "cuda":
        return "in place", ("the weights are in host memory (vLLM CPU), which cannot be remapped: "
                            "a swap rebinds the parameters or copies into them")
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enforce_eager", False):
        return "in place", ("vLLM runs eagerly (enforce_eager=True): a swap rebinds the "
                            "parameters to the new slot, which no captured CUDA graph holds on to")
    parallel = getattr(vllm_config, "parallel_config", None)
    ranks = (int(getattr(parallel, "tensor_parallel_size", 1) or 1)
             * int(getattr(parallel, "pipeline_parallel_size", 1) or 1))
    if ranks > 1:
        return "in place", (f"vLLM runs {ranks} ranks: under tensor or pipeline parallelism "
                            f"updates are shown copied into vLLM's own storage (copy_in); name "
                            f"the backend 'shadowsync_graph_pairs' or 'shadowsync_live_arena' to "
                            f"use those, which are not shown there")
    if getattr(vllm_config, "lora_config", None) is not None:
        return "live arena", ("LoRA is on: an adapter is copied into vLLM's LoRA buffers at the "
                              "swap, which graph pairs cannot do beside a rebind")
    runner = runner_loading(model, depth=12)
    why = why_unswitchable(runner) if runner is not None else (
        "vLLM's model runner was not found among the callers")
    if why is not None:
        return "live arena", f"graph pairs are not possible here: {why}"
    return "graph pairs", ("CUDA graphs are on and vLLM's V2 runner can switch graph sets: a swap "
                           "rebinds the parameters and switches sets, nothing is copied or "
                           "remapped")
