"""A receive plan for a LoRA adapter that vLLM serves: the trainer's PEFT tensors (``lora_A`` and
``lora_B`` of each adapted module, ``lora_embedding_A`` / ``lora_embedding_B`` of an adapted
embedding, Hugging Face names) land in the adapter's slot of vLLM's stacked LoRA buffers
(``lora_a_stacked`` / ``lora_b_stacked`` of each LoRA layer: a linear layer keeps a tuple of them,
one slice per packed projection, sharded per rank under tensor parallelism; the embedding and the
lm_head layers keep one tensor each), which vLLM's LoRA kernels read at every step.

Where each element goes is learned from vLLM itself, without data: each LoRA layer's own
``set_lora`` runs once, on a copy of the layer whose stacked buffers are int64, with inputs that
hold the element indices of the wire tensors. Whatever slicing and packing it does, per
architecture and per rank, shows in where the indices land; each slot block is then read back
as a strided view of one wire tensor (one PlanCopy; the embedding's lora_A, which vLLM keeps
transposed, is one too, copied a column at a time). No per-architecture table here.

vLLM computes with ``lora_B x lora_alpha / r`` (it scales B when it loads an adapter): the
trainer sends that product (``scaled_lora_b``), since a receive only copies.
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass
from typing import Any

from shadowsync.errors import InvalidArgumentError, LayoutMismatchError
from shadowsync.layout import TensorSpec, canonical_dtype
from shadowsync.receive_plan import PlanCopy
from shadowsync.tensors import describe

# base_model.model.<module>.lora_A[.<adapter name>].weight (PEFT's state dict and parameters); an
# adapted embedding's are bare parameters: base_model.model.<module>.lora_embedding_A[.<adapter>].
_LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_"
                          r"(?:(?P<which>[AB])(?:\.[^.]+)?\.weight"
                          r"|embedding_(?P<embedding_which>[AB])(?:\.[^.]+)?)$")
# A probe value: (wire tensor number + 1) << 32 | element index; 0 means "not written".
_ELEMENT_BITS = 32


def _lora_tensor(name: str) -> tuple[str, str] | None:
    """(module, "A" or "B") of a PEFT LoRA tensor's name, None for any other name."""
    match = _LORA_TENSOR.match(name)
    if match is None:
        return None
    return match["module"], match["which"] or match["embedding_which"]


def is_lora_tensor(name: str) -> bool:
    """Whether `name` is a PEFT LoRA tensor (``...<module>.lora_A.weight`` or ``lora_B``, or an
    embedding's ``...<module>.lora_embedding_A`` or ``lora_embedding_B``)."""
    return _lora_tensor(name) is not None


def scaled_lora_b(tensors: dict, scaling: float) -> dict:
    """The trainer's side: `tensors` with every ``lora_B`` (and ``lora_embedding_B``) multiplied
    by `scaling` (PEFT's ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA): what vLLM computes
    with. New tensors for lora_B, the others as they are."""
    scaled = {}
    for name, tensor in tensors.items():
        parsed = _lora_tensor(name)
        scaled[name] = tensor * scaling if parsed is not None and parsed[1] == "B" else tensor
    return scaled


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
    rank above max_lora_rank, a vocabulary larger than the model's, ...), a rank below it (or a
    smaller vocabulary), a dtype other than the slot's, a placement that is not a strided view, a
    tensor that lands nowhere, a layer whose slots are neither tensors nor tuples of them."""
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
        parsed = _lora_tensor(spec.name)
        if parsed is None:
            raise LayoutMismatchError(f"tensor '{spec.name}' is not a LoRA tensor "
                                      f"('<module>.lora_A.weight' or 'lora_B', or an embedding's "
                                      f"'<module>.lora_embedding_A' or 'lora_embedding_B')")
        module, which = parsed
        layer, part = owner.get(module, (module, 0))
        if layer not in manager.modules:
            raise LayoutMismatchError(
                f"tensor '{spec.name}': module '{module}' has no LoRA layer in vLLM (its LoRA "
                f"layers: {', '.join(list(manager.modules)[:4])}, ...)")
        wires = per_layer.setdefault(layer, {})
        if (part, which) in wires:
            raise LayoutMismatchError(
                f"tensors '{specs[wires[(part, which)]].name}' and '{spec.name}' both "
                f"go to lora_{which} of slice {part} of vLLM's LoRA layer '{layer}'")
        wires[(part, which)] = number

    copies: list[PlanCopy] = []
    engine_tensors: dict[str, Any] = {}
    for layer_name, wires in per_layer.items():
        layer = manager.modules[layer_name]
        raw_a = getattr(layer, "lora_a_stacked", None)
        raw_b = getattr(layer, "lora_b_stacked", None)
        stacked_a, stacked_b = _slices(raw_a), _slices(raw_b)
        if (stacked_a is None or stacked_b is None or len(stacked_a) != len(stacked_b)
                or isinstance(raw_a, tuple) != isinstance(raw_b, tuple)):
            raise LayoutMismatchError(
                f"vLLM's LoRA layer '{layer_name}' ({type(layer).__name__}) keeps its slots in "
                f"another form (lora_a_stacked / lora_b_stacked are not tensors or tuples of "
                f"them, one per slice): not supported")
        slices = len(stacked_a)
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
        for which, stacked, probed in (("a", stacked_a, _slices(probe.lora_a_stacked)),
                                       ("b", stacked_b, _slices(probe.lora_b_stacked))):
            for s in range(slices):
                block = _slot(probed[s], index)
                if not bool(block.any()):
                    continue  # a projection this adapter does not adapt: vLLM keeps it zero
                name = f"{layer_name}.lora_{which}.{s}"
                live = _slot(stacked[s], index)
                copies.append(_copy_of(name, block, specs, live, torch))
                engine_tensors[name] = live
    placed = {c.wire for c in copies}
    unplaced = [s.name for s in specs if s.name not in placed]
    if unplaced:
        raise LayoutMismatchError(
            f"{len(unplaced)} of the trainer's LoRA tensors land nowhere in vLLM's slots "
            f"(e.g. '{unplaced[0]}'): an update would not change what they describe")
    return LoraPlan(copies, engine_tensors)


def _slices(stacked) -> tuple | None:
    """A LoRA layer's stacked buffer as a tuple of slices: a linear layer keeps one per packed
    projection; the embedding and the lm_head layers keep one tensor (one slice). None for any
    other form."""
    if isinstance(stacked, tuple) and stacked and all(hasattr(t, "shape") for t in stacked):
        return stacked
    return (stacked,) if hasattr(stacked, "shape") and hasattr(stacked, "dtype") else None


def _slot(buffer, index: int):
    """Slot `index` of one stacked buffer ([slots, ..., columns]) as a 2-D view of its storage:
    rows x the last dimension. Linear layers keep [slots, 1, rank, in] and [slots, 1, out, rank],
    the embedding its lora_A as [slots, vocab, rank] (vLLM stores it transposed)."""
    return buffer[index].view(-1, buffer.shape[-1])


def _probe(layer, index: int, slices: int, wires: dict, specs: list[TensorSpec], torch):
    """A copy of `layer` with int64 stacked buffers, in the layer's own form (a tuple of slices
    or one tensor), after its own set_lora ran on the element indices of the wire tensors."""
    probe = copy.copy(layer)  # shares the layer's settings (tp rank, sizes); own buffers below

    def int64_like(stacked):
        if isinstance(stacked, tuple):
            return tuple(torch.zeros(t.shape, dtype=torch.int64) for t in stacked)
        return torch.zeros(stacked.shape, dtype=torch.int64)

    probe.lora_a_stacked = int64_like(layer.lora_a_stacked)
    probe.lora_b_stacked = int64_like(layer.lora_b_stacked)

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
    numbers = torch.unique(values[values != 0] >> _ELEMENT_BITS)
    if bool((values == 0).any()):
        written = int((values != 0).sum())
        sources = ", ".join(f"'{specs[int(n) - 1].name}' {list(specs[int(n) - 1].shape)}"
                            for n in numbers)
        raise LayoutMismatchError(
            f"LoRA slot block '{engine}' {list(block.shape)}: the trainer's tensors ({sources}) "
            f"fill {written} of its {values.numel()} elements; vLLM's max_lora_rank must equal "
            f"the adapter's rank (start vLLM with max_lora_rank=<the adapter's r>), and an "
            f"embedding or lm_head adapter must span the model's vocabulary (no new tokens)")
    if numbers.numel() != 1:
        raise LayoutMismatchError(f"LoRA slot block '{engine}': vLLM fills it from "
                                  f"{numbers.numel()} tensors; one strided view is supported")
    spec = specs[int(numbers[0]) - 1]
    wire_dtype = canonical_dtype(spec.dtype)[0]
    slot_dtype = describe(engine, live).dtype
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
    # Where the block's rows are not runs of the wire tensor (vLLM keeps the embedding's lora_A
    # transposed), the plan copies it element by element.
    return PlanCopy(wire=spec.name, engine=engine, shape=(rows, cols), src_offset=offset,
                    src_strides=(row_stride, col_stride), dst_offset=0, dst_strides=(cols, 1))

