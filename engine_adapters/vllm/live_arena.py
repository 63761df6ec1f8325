"""The live arena: vLLM's weights moved into a remap arena before vLLM captures its CUDA graphs.

vLLM captures its CUDA graphs at start-up, over its parameters' storage, before any RPC can reach
the worker. A receiver set up later can then only copy the new weights into that storage at the
swap (copy_in), and the engine waits for the copy: about 22 ms per update at Llama-3-8B on an
H100. vLLM 0.25 makes its weight-transfer engine right after it loads the model, before it
profiles memory and captures graphs. This module is a weight-transfer engine that does one thing
there: it moves every parameter of the model into one shadowsync.RemapArena (a live address
range over two physical slots, laid out as a Layout of the parameters in the model's order) and
points the parameters at it. The graphs are then captured over the arena's live range, and
init_weight_update_group hands the arena to the receiver (swap strategy "remap"): a swap remaps
the live range onto the slot the update landed in, nothing is copied, and the graphs read the new
weights.

The backend "shadowsync" (weight_transfer_backend.py) makes this engine under CUDA graphs where
graph pairs are not possible; "shadowsync_live_arena" asks for it. Memory: the
arena is two copies of the weights (the live one and the shadow), allocated before vLLM sizes its
KV cache, so the KV cache is one copy of the weights smaller than without shadowsync. vLLM sizes
it from the weights' memory it measured while loading (a number kept on its model runner) plus
what the device uses beyond torch's allocator since start-up (the arena among it): the weights
would be counted twice, once as loaded and once in the arena, and the KV cache would lose a
second copy of the weights for nothing. So the engine takes the torch memory the move freed off
the model runner's `model_memory_usage`; vLLM hands the engine only the model, so the runner is
found as the caller's (Worker.load_model's) and checked to hold this very model. Where it is not
found, nothing is changed and a warning says the KV cache is that much smaller
(`memory_report()` of the worker extension shows what was counted).
"""

from __future__ import annotations

import warnings

from shadowsync.backend import CudaBackend
from shadowsync.errors import InvalidArgumentError
from shadowsync.layout import BASE_GROUP, Layout, TensorSpec
from shadowsync.remap_arena import RemapArena
from shadowsync.tensors import describe

from .graph_pairs import GraphSets
from .rebind import Rebinding
from .update_group import CudaBytes
from .vllm_worker import runner_loading
from .weight_transfer_backend import (GRAPH_PAIRS_BACKEND_NAME, LIVE_ARENA_BACKEND_NAME,
                                      PlacedWeightsEngine)

__all__ = ["GraphPairsEngine", "LiveArenaEngine"]

class LiveArenaEngine(PlacedWeightsEngine):
    """vLLM's weight-transfer engine "shadowsync_live_arena" (and what "shadowsync" makes under
    CUDA graphs where graph pairs are not possible): places the weights in a remap arena at
    load."""

    shadowsync_live_arena = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.layout, self.transposed, self.arena, freed = _move_into_arena(model)
        # What vLLM's memory profile counts for the weights, before and after (memory_report()).
        self.memory_accounting = count_weights_once(model, freed, self.arena.nbytes)
        # The parameter objects at the arena's places, in its order: what init_weight_update_group
        # matches the update's parameters against (names differ once vLLM wraps LoRA layers).
        self.params = list(dict(model.named_parameters()).values())


class GraphPairsEngine(LiveArenaEngine):
    """vLLM's weight-transfer engine "shadowsync_graph_pairs" (graph_pairs.py): the weights in a
    remap arena as under LiveArenaEngine, but read through each slot's own mapping, with vLLM's
    CUDA graphs captured over both slots. A receiver swaps by rebind over the arena's two slots
    (no remap) and the swap switches vLLM to that slot's graphs."""

    shadowsync_graph_pairs = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        runner = runner_loading(model)
        if runner is None:
            raise InvalidArgumentError(
                f"the '{GRAPH_PAIRS_BACKEND_NAME}' weight-transfer backend: vLLM's model runner "
                f"was not found among the callers, so its CUDA graphs cannot be captured over "
                f"both weight slots; use the backend '{LIVE_ARENA_BACKEND_NAME}' (swapped by "
                f"remap)")
        # Each parameter paired with its view in each slot, built once: a swap only assigns.
        self._rebindings = [Rebinding(zip(self.params, self._slot_views(slot, device)))
                            for slot in (0, 1)]
        self.slot = -1
        self.bind(self.arena.live_slot)  # the same bytes as the live range, at their own address
        self.graph_sets = GraphSets(runner, self.bind, self.slot)
        self.graph_sets.install()

    def _slot_views(self, slot: int, device) -> list:
        """Every parameter's place in `slot`, as tensors of its dtype and shape (an FP8 weight
        as the transposed view vLLM reads, over its rows in the slot)."""
        import torch

        raw = torch.as_tensor(CudaBytes(self.arena.slot_address(slot),
                                        self.layout.groups[0].arena_bytes), device=device)
        return arena_views(raw, self.layout, self.params, self.transposed)

    def bind(self, slot: int) -> None:
        """Points every parameter at its place in `slot`. Engine thread (or vLLM's start-up),
        between two steps."""
        self._rebindings[slot].apply()
        self.slot = slot

    def use_slot(self, slot: int) -> None:
        """What a swap does: the parameters and vLLM's CUDA graphs move to `slot`."""
        self.bind(slot)
        self.graph_sets.use(slot)

    def settle(self) -> None:
        """Makes the arena's live slot (what the next receiver starts from) the one the model
        reads: when a receiver left the other slot live, its bytes are copied into the arena's
        live slot (in stream order after the steps that read them) and the parameters and graphs
        follow. Engine thread, between two steps, with no receiver."""
        target = self.arena.live_slot
        if self.slot == target:
            return
        import torch

        with torch.no_grad():
            sources = self._rebindings[self.slot].tensors()
            targets = self._rebindings[target].tensors()
            for src, dst in zip(sources, targets):
                dst.copy_(src)
        # A later receiver starts with no release events: the copy must be done before it may
        # write the slot the copy reads.
        torch.cuda.synchronize(targets[0].device)
        self.use_slot(target)


def count_weights_once(model, freed_bytes: int, slot_bytes: int) -> dict:
    """Takes `freed_bytes` (the torch memory the move into the arena freed) off the weights'
    memory vLLM measured at load, on the model runner that loaded `model`, so that vLLM's KV-cache
    sizing counts the weights once (in the arena). Returns what was counted, for memory_report().
    The runner is looked for among the callers' `self` (vLLM 0.25: Worker.load_model makes this
    engine with `self.model_runner.get_model()`) and used only if it returns this very model."""
    runner = runner_loading(model)
    report = {"slot_bytes": int(slot_bytes), "freed_torch_bytes": int(freed_bytes),
              "model_memory_usage_before": None, "model_memory_usage_after": None,
              "corrected": False}
    if runner is None:
        warnings.warn(
            f"shadowsync live arena: vLLM's model runner was not found among the callers, so its "
            f"KV-cache sizing counts the weights twice (as loaded and in the arena) and the KV "
            f"cache is {freed_bytes / 2**30:.2f} GiB smaller than the memory left allows; raise "
            f"gpu_memory_utilization or set kv_cache_memory_bytes to use it", stacklevel=2)
        return report
    before = int(runner.model_memory_usage)
    runner.model_memory_usage = max(0, before - int(freed_bytes))
    report.update(model_memory_usage_before=before,
                  model_memory_usage_after=int(runner.model_memory_usage), corrected=True)
    return report


def arena_layout(params: dict) -> tuple[Layout, list[bool]]:
    """The live arena's layout of `params` ({name: parameter}, the model's order): one "base"
    group of each parameter's bytes as they lie, and for each whether the parameter is the
    transpose of them. vLLM's CUDA FP8 linear layers (quantization="fp8") hold their weight as
    the [in, out] transposed view of row-major [out, in] float8 bytes: the arena holds the rows,
    the parameter goes on being their transpose. A one-element parameter may have no dimensions
    (a scale). Refuses (naming it) a parameter that is empty or whose bytes are neither contiguous
    nor such a float8 transpose."""
    specs, transposed = [], []
    for name, param in params.items():
        data = param.data
        turned = (data.dim() == 2 and "float8" in str(data.dtype) and not data.is_contiguous()
                  and data.t().is_contiguous())
        d = describe(name, data.t() if turned else data)
        if not d.contiguous or 0 in d.shape:
            raise InvalidArgumentError(
                f"a remap arena for the live arena or graph pairs: parameter '{name}' ({d.dtype}, "
                f"shape {list(d.shape)}, strides {list(d.strides)}) is not a non-empty contiguous "
                f"tensor, nor the transpose of float8 bytes; start vLLM without a shadowsync "
                f"weight-transfer backend (the worker extension then copies each update into "
                f"vLLM's own storage)")
        specs.append(TensorSpec(name, d.dtype, d.shape, BASE_GROUP))
        transposed.append(turned)
    return Layout(specs), transposed


def arena_views(raw, layout: Layout, params, transposed: list[bool]) -> list:
    """Each of `params` at its place in `raw` (one slot's or the live range's bytes, a uint8
    tensor) by `layout` (arena_layout's), as the parameter reads it (transposed where it is)."""
    views = []
    for t, param, turned in zip(layout.groups[0].tensors, params, transposed):
        view = raw[t.offset:t.offset + t.bytes].view(param.dtype).reshape(t.shape)
        views.append(view.t() if turned else view)
    return views


def _move_into_arena(model) -> tuple[Layout, list[bool], RemapArena, int]:
    """Copies every parameter of `model` into a new remap arena laid out by arena_layout, points
    each parameter at its place in the live range and frees the old storage; returns the layout,
    which parameters are transposed views, the arena and the torch memory freed (bytes). CUDA
    only (the host backend cannot remap: NotSupportedError)."""
    import torch

    params = dict(model.named_parameters())
    if not params:
        raise InvalidArgumentError("the live arena (weight-transfer backend 'shadowsync'): the "
                                   "model has no parameters")
    devices = {str(p.device) for p in params.values()}
    if len(devices) != 1 or not next(iter(devices)).startswith("cuda"):
        raise InvalidArgumentError(
            f"the '{LIVE_ARENA_BACKEND_NAME}' weight-transfer backend needs every parameter on one "
            f"CUDA device (a live arena is CUDA virtual memory); the model's are on "
            f"{sorted(devices)}; the backend 'shadowsync' chooses what works here")
    layout, transposed = arena_layout(params)
    group = layout.groups[0]
    device = next(iter(params.values())).device.index or 0
    arena = RemapArena(CudaBackend(device), group.arena_bytes)
    allocated_before = torch.cuda.memory_allocated(device)
    live = torch.as_tensor(CudaBytes(arena.live_address, group.arena_bytes), device=f"cuda:{device}")
    with torch.no_grad():
        views = arena_views(live, layout, params.values(), transposed)
        for param, view in zip(params.values(), views):
            view.copy_(param.data)
            param.data = view
    torch.cuda.synchronize(device)
    freed = max(0, allocated_before - torch.cuda.memory_allocated(device))
    torch.cuda.empty_cache()  # the old storage goes back to the device before vLLM profiles
    print(f"[shadowsync] live arena: {len(group.tensors)} parameters, "
          f"{group.arena_bytes / 2**30:.2f} GiB, moved into a remap arena (two slots of it) before "
          f"CUDA graph capture; {freed / 2**30:.2f} GiB of torch memory freed", flush=True)
    return layout, transposed, arena, freed
