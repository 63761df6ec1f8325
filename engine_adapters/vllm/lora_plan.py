"""A receive plan for a LoRA adapter that vLLM serves: the trainer's PEFT tensors (``lora_A`` and
``lora_B`` of each adapted module, Hugging Face names) land in the adapter's slot of vLLM's
stacked LoRA buffers (``lora_a_stacked`` / ``lora_b_stacked`` of each LoRA layer: a fused layer
has one slice per packed projection; tensor parallelism shards them per rank), which vLLM's LoRA
kernels read at every step.

Where each element goes is learned from vLLM itself, without data: each LoRA layer's own
``set_lora`` runs once, on a copy of the layer whose stacked buffers are int64, with inputs that
hold the element indices of the wire tensors. Whatever slicing and packing it does, per
architecture and per rank, shows in where the indices land; each slot block is then read back
as a strided view of one wire tensor (one PlanCopy). No per-architecture table here.

vLLM computes with ``lora_B x lora_alpha / r`` (it scales B when it loads an adapter): the
trainer sends that product (``scaled_lora_b``), since a receive only copies.
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass
from typing import Any

from shadowsync import _tensors
from shadowsync.errors import InvalidArgumentError, LayoutMismatchError
from shadowsync.layout import TensorSpec, canonical_dtype
from shadowsync.receive_plan import PlanCopy

# base_model.model.<module>.lora_A[.<adapter name>].weight (PEFT's state dict and parameters).
_LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])"
                          r"(?:\.[^.]+)?\.weight$")
# A probe value: (wire tensor number + 1) << 32 | element index; 0 means "not written".
_ELEMENT_BITS = 32


def is_lora_tensor(name: str) -> bool:
    """Whether `name` is a PEFT LoRA tensor (``...<module>.lora_A.weight`` or ``lora_B``)."""
    return _LORA_TENSOR.match(name) is not None


def scaled_lora_b(tensors: dict, scaling: float) -> dict:
    """The trainer's side: `tensors` with every ``lora_B`` multiplied by `scaling` (PEFT's
    ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA): what vLLM computes with. New tensors for
    lora_B, the others as they are."""
    return {n: (t * scaling if _LORA_TENSOR.match(n) and _LORA_TENSOR.match(n)["which"] == "B"
                else t) for n, t in tensors.items()}


def is_lora_layer(module) -> bool:
    """Whether `module` is one of vLLM's LoRA wrappers (BaseLayerWithLoRA: the loaded layer as
    ``base_layer``, the adapters' slots through ``set_lora``)."""
    return hasattr(module, "base_layer") and callable(getattr(module, "set_lora", None))


@contextlib.contextmanager
def lora_layers_unwrapped(model):
    """The model as vLLM loaded it, for the duration: with enable_lora vLLM wraps layers after
    loading (``embed_tokens.weight`` becomes ``embed_tokens.base_layer.weight``), and some
    versions' load_weights (0.25's embedding) then find no parameter by the checkpoint's name.
    Each wrapper is swapped for its base layer (the same parameter objects the wrapper computes
    with) and put back on the way out, also on an error. Thread: the model's, while idle."""
    wrapped = [(name, module) for name, module in model.named_modules()
               if name and is_lora_layer(module)]
    swapped = []
    try:
        for name, module in wrapped:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attribute, module.base_layer)
            swapped.append((parent, attribute, module))
        yield model
    finally:
        for parent, attribute, module in reversed(swapped):
            setattr(parent, attribute, module)


@dataclass
class LoraPlan:
    """The copies into the adapter's slot, and the slot blocks they fill: engine tensor name ->
    a view of vLLM's stacked buffer (the live storage; a swap copies the shadow into it)."""

    copies: list[PlanCopy]
    engine_tensors: dict[str, Any]


def adapter_slot(lora_manager, adapter_id: int) -> int:
    """The slot of vLLM's stacked LoRA buffers that adapter `adapter_id` (its lora_int_id) is
    in; refused, naming what is loaded, when it is in none."""
    slots = list(lora_manager._adapter_manager.lora_index_to_id)
    if adapter_id not in slots:
        raise InvalidArgumentError(
            f"lora_adapter={adapter_id}: vLLM holds no LoRA adapter with that lora_int_id in its "
            f"slots (they hold {slots}): load it first (a request with its LoRARequest, or "
            f"add_lora), then initialize; shadowsync updates an adapter in place")
    return slots.index(adapter_id)


def lora_receive_plan(lora_manager, adapter_id: int, specs: list[TensorSpec]) -> LoraPlan:
    """The plan that puts the trainer's LoRA tensors `specs` into adapter `adapter_id`'s slot.
    Refused, named: a tensor that is not a PEFT LoRA tensor, a module vLLM has no LoRA layer for,
    two tensors for one slot, lora_A without its lora_B, shapes vLLM's set_lora does not take (a
    rank above max_lora_rank, ...), a rank below it, a dtype other than the slot's, a placement
    that is not a strided view, a tensor that lands nowhere, an embedding or lm_head layer."""
    import torch

    manager = lora_manager._adapter_manager
    index = adapter_slot(lora_manager, adapter_id)
    # Which LoRA layer (and which slice of it) each Hugging Face module goes to.
    owner: dict[str, tuple[str, int]] = {}
    for fused, parts in manager.packed_modules.items():
        for i, part in enumerate(parts):
            owner[part] = (fused, i)
    per_layer: dict[str, dict[tuple[int, str], int]] = {}  # layer -> (slice, A|B) -> wire number
    for number, spec in enumerate(specs):
        match = _LORA_TENSOR.match(spec.name)
        if match is None:
            raise LayoutMismatchError(f"tensor '{spec.name}' is not a LoRA tensor "
                                      f"('<module>.lora_A.weight' or 'lora_B')")
        module = match["module"]
        layer, part = owner.get(module, (module, 0))
        if layer not in manager.modules:
            raise LayoutMismatchError(
                f"tensor '{spec.name}': module '{module}' has no LoRA layer in vLLM (its LoRA "
                f"layers: {', '.join(list(manager.modules)[:4])}, ...)")
        wires = per_layer.setdefault(layer, {})
        if (part, match["which"]) in wires:
            raise LayoutMismatchError(
                f"tensors '{specs[wires[(part, match['which'])]].name}' and '{spec.name}' both "
                f"go to lora_{match['which']} of slice {part} of vLLM's LoRA layer '{layer}'")
        wires[(part, match["which"])] = number

    copies: list[PlanCopy] = []
    engine_tensors: dict[str, Any] = {}
    for layer_name, wires in per_layer.items():
        layer = manager.modules[layer_name]
        if not isinstance(layer.lora_a_stacked, tuple):
            raise LayoutMismatchError(
                f"vLLM's LoRA layer '{layer_name}' ({type(layer).__name__}) keeps its slots in "
                f"another form (an embedding or lm_head adapter): not supported")
        slices = len(layer.lora_a_stacked)
        for (part, which), number in wires.items():
            if (part, "B" if which == "A" else "A") not in wires:
                other = "lora_B" if which == "A" else "lora_A"
                raise LayoutMismatchError(f"tensor '{specs[number].name}' comes without its "
                                          f"{other}: vLLM sets a LoRA layer's A and B together")
        beyond = [specs[n].name for (part, _), n in wires.items() if part >= slices]
        if beyond:
            raise LayoutMismatchError(f"tensor '{beyond[0]}' goes to a slice vLLM's LoRA layer "
                                      f"'{layer_name}' does not have ({slices} slices)")
        try:
            probe = _probe(layer, index, slices, wires, specs, torch)
        except (RuntimeError, ValueError, TypeError, AssertionError, IndexError) as e:
            # vLLM's own set_lora refused the shapes (a rank above max_lora_rank, another
            # in_features): its message names the sizes.
            shapes = ", ".join(f"'{specs[n].name}' {list(specs[n].shape)}"
                               for n in wires.values())
            raise LayoutMismatchError(
                f"vLLM's LoRA layer '{layer_name}' does not take the trainer's tensors ({shapes}): "
                f"its set_lora raised {type(e).__name__}: {e}; check the adapter's rank against "
                f"vLLM's max_lora_rank and the shapes against the model") from e
        for which, stacked, probed in (("a", layer.lora_a_stacked, probe.lora_a_stacked),
                                       ("b", layer.lora_b_stacked, probe.lora_b_stacked)):
            for s in range(slices):
                block = probed[s][index, 0]
                if not bool(block.any()):
                    continue  # a projection this adapter does not adapt: vLLM keeps it zero
                name = f"{layer_name}.lora_{which}.{s}"
                live = stacked[s][index, 0]
                copies.append(_copy_of(name, block, specs, live, torch))
                engine_tensors[name] = live
    placed = {c.wire for c in copies}
    unplaced = [s.name for s in specs if s.name not in placed]
    if unplaced:
        raise LayoutMismatchError(
            f"{len(unplaced)} of the trainer's LoRA tensors land nowhere in vLLM's slots "
            f"(e.g. '{unplaced[0]}'): an update would not change what they describe")
    return LoraPlan(copies, engine_tensors)


def _probe(layer, index: int, slices: int, wires: dict, specs: list[TensorSpec], torch):
    """A copy of `layer` with int64 stacked buffers after its own set_lora ran on the element
    indices of the wire tensors."""
    probe = copy.copy(layer)  # shares the layer's settings (tp rank, sizes); own buffers below
    probe.lora_a_stacked = tuple(torch.zeros(t.shape, dtype=torch.int64)
                                 for t in layer.lora_a_stacked)
    probe.lora_b_stacked = tuple(torch.zeros(t.shape, dtype=torch.int64)
                                 for t in layer.lora_b_stacked)

    def indices(number: int):
        spec = specs[number]
        count = 1
        for d in spec.shape:
            count *= int(d)
        return (((number + 1) << _ELEMENT_BITS) + torch.arange(count, dtype=torch.int64)
                ).reshape(tuple(int(d) for d in spec.shape))

    a = [indices(wires[(s, "A")]) if (s, "A") in wires else None for s in range(slices)]
    b = [indices(wires[(s, "B")]) if (s, "B") in wires else None for s in range(slices)]
    if slices == 1:
        probe.set_lora(index, a[0], b[0])
    else:
        probe.set_lora(index, a, b)
    return probe


def _copy_of(engine: str, block, specs: list[TensorSpec], live, torch) -> PlanCopy:
    """The block as one strided view of one wire tensor (or refused, named)."""
    values = block.reshape(block.shape[0], -1)
    numbers = torch.unique(values >> _ELEMENT_BITS)
    if bool((values == 0).any()):
        written = int((values != 0).sum())
        raise LayoutMismatchError(
            f"LoRA slot block '{engine}' {list(block.shape)}: the trainer's tensors fill "
            f"{written} of its {values.numel()} elements; vLLM's max_lora_rank must equal the "
            f"adapter's rank (start vLLM with max_lora_rank=<the adapter's r>)")
    if numbers.numel() != 1:
        raise LayoutMismatchError(f"LoRA slot block '{engine}': vLLM fills it from "
                                  f"{numbers.numel()} tensors; one strided view is supported")
    spec = specs[int(numbers[0]) - 1]
    wire_dtype = canonical_dtype(spec.dtype)[0]
    slot_dtype = _tensors.describe(engine, live).dtype
    if wire_dtype != slot_dtype:
        raise LayoutMismatchError(
            f"tensor '{spec.name}': dtype {wire_dtype} of the trainer's layout does not match "
            f"{slot_dtype} of vLLM's LoRA slot '{engine}'")
    elements = values & ((1 << _ELEMENT_BITS) - 1)
    rows, cols = elements.shape
    offset = int(elements[0, 0])
    row_stride = int(elements[1, 0]) - offset if rows > 1 else cols
    col_stride = int(elements[0, 1]) - offset if cols > 1 else 1
    expected = (offset + torch.arange(rows).reshape(-1, 1) * row_stride
                + torch.arange(cols).reshape(1, -1) * col_stride)
    if not bool((elements == expected).all()):
        raise LayoutMismatchError(f"LoRA slot block '{engine}': vLLM places tensor "
                                  f"'{spec.name}' in it in a way that is not a strided view")
    return PlanCopy(wire=spec.name, engine=engine, shape=(rows, cols), src_offset=offset,
                    src_strides=(row_stride, col_stride), dst_offset=0, dst_strides=(cols, 1))

