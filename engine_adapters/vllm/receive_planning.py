"""Receive planning: which of the engine's parameters an update writes, and how the trainer's
tensors reach them.

When the trainer sends the engine's own parameters (same names, dtypes and shapes) they are
received zero-copy into the slots. Otherwise its tensors are what its ``named_parameters()``
gives (HF names, unfused, unsharded) and the plan is derived from the model's own
``load_weights``, traced without data (loader_trace.py); a LoRA adapter's tensors go into its
slot of vLLM's stacked LoRA buffers (lora_plan.py)."""

from __future__ import annotations

from typing import Any

from shadowsync.errors import InvalidArgumentError, LayoutMismatchError
from shadowsync.layout import Layout, TensorSpec, canonical_dtype, format_shape
from shadowsync.tensors import TensorDesc, contiguous_strides, describe

from . import vllm_worker
from .lora_plan import is_lora_tensor, lora_layers_unwrapped, lora_receive_plan
from .update_group import param_data


def names_of(names: list[str], shown: int = 8) -> str:
    """'a', 'b', ... for an error message: the first `shown` names."""
    return ", ".join(f"'{n}'" for n in names[:shown]) + (", ..." if len(names) > shown else "")


def refuse_empty(params: dict[str, Any]) -> None:
    """Parameters without elements are not the weights the engine computes with (prepacked,
    quantized elsewhere, never allocated): refused, all named."""
    empty = [n for n, p in params.items() if 0 in tuple(getattr(param_data(p), "shape", (1,)))]
    if empty:
        raise LayoutMismatchError(
            f"{len(empty)} parameter(s) of the model are empty: {names_of(empty)}; the engine prepacked or "
            f"quantized these weights, so its parameters are not the weights it computes with. On "
            f"vLLM's CPU backend start it with quantization=\"shadowsync_unpacked\""
        )


def receives_in_place(specs: list[TensorSpec], descs: dict, live_arena=None) -> bool:
    """The trainer sends the engine's own tensors (by name and shape), so the receive needs no
    plan (zero-copy). A tensor named as a parameter but of another shape goes through the
    model's loader (its traced plan): GPT-2's Hugging Face Conv1D weights are [in, out], and
    vLLM's loader transposes them into its [out, in] layers. With a live arena (swapped whole, its
    layout the parameters in the model's order) only when they are laid out as the arena is:
    every parameter, in its order, one group. A trainer whose fused tensors come in another order
    (Phi-3 in Hugging Face's order: o_proj before qkv_proj) gets a plan that copies them into the
    arena's places instead."""
    if not all(s.name in descs and tuple(s.shape) == tuple(descs[s.name].shape) for s in specs):
        return False
    if live_arena is None:
        return True
    arena = live_arena.layout.groups[0].tensors
    return len(specs) == len(arena) and len({s.group for s in specs}) == 1 and all(
        s.name == t.name and canonical_dtype(s.dtype)[0] == t.dtype
        and tuple(s.shape) == tuple(t.shape) for s, t in zip(specs, arena))


def packed_in_place_plan(layout: Layout, packed: dict):
    """A plan for a trainer that sends the engine's own parameters (`layout`) when vLLM keeps
    some of them packed (`packed`: {name: PackedOrder}, expert_packing.py): each tensor copied
    whole, into its packed order where it has one. None when none of them is packed (the receive
    is zero-copy)."""
    from shadowsync.receive_plan import PlanCopy, ReceivePlan

    from .expert_packing import compose_all

    tensors = [t for g in layout.groups for t in g.tensors]
    if not any(t.name in packed for t in tensors):
        return None
    copies = []
    for s in tensors:
        strides = contiguous_strides(tuple(s.shape))
        copies.append(PlanCopy(s.name, s.name, tuple(s.shape), 0, strides, 0, strides))
    return ReceivePlan(layout, compose_all(copies, packed))


def receive_plan(model, specs: list[TensorSpec], bucket_bytes: int, allow_partial: bool,
                  live_arena=None, packed: dict | None = None, fp8: dict | None = None):
    """(engine layout, ReceivePlan, {engine parameter name: parameter}) from the model's own
    load_weights, traced without data (loader_trace). The engine layout holds the parameters the
    plan writes, each in the group of the trainer's tensors that write it; copies into a
    parameter vLLM keeps packed (`packed`, expert_packing.py) go to its packed positions, and
    into one it keeps quantized (`fp8`: {name: online_fp8.Fp8Weight}) to its as-loaded
    positions, quantized by the receiver into its float8 bytes and its scale (which follows it
    in the layout). With `live_arena`
    (the live-arena engine the receiver will swap by remap) and allow_partial, it holds every
    parameter in the model's order, as the arena does: the ones no trainer tensor writes are the
    plan's kept tensors (the receiver copies their live bytes into each slot once)."""
    from shadowsync.receive_plan import PlanQuantization, ReceivePlan

    from .expert_packing import compose_all
    from .loader_trace import trace_load_weights
    from .online_fp8 import as_loaded

    fp8 = fp8 or {}

    if not callable(getattr(model, "load_weights", None)):
        known = dict(model.named_parameters())
        foreign = [s.name for s in specs if s.name not in known]
        if not foreign:  # every name is a parameter: a shape or a dtype differs, named here
            check_specs(specs, {n: describe(n, param_data(p)) for n, p in known.items()})
            raise LayoutMismatchError(
                f"the trainer's tensors are parameters of the worker, but not laid out as its "
                f"live arena ({len(specs)} tensors), and {type(model).__name__} has no "
                f"load_weights to derive a receive plan from")
        raise LayoutMismatchError(
            f"tensor '{foreign[0]}' of the trainer's layout is not a parameter of the worker "
            f"({len(known)} parameters; {len(foreign)} of the trainer's tensors are not), and "
            f"{type(model).__name__} has no load_weights to derive a receive plan from"
        )
    with lora_layers_unwrapped(model):  # checkpoint names, as load_weights knows them
        with as_loaded(fp8):
            trace = trace_load_weights(model, specs)
        every = dict(model.named_parameters())
    # Scales are written by the quantization, not by copies.
    scales = {w.scale_name for w in fp8.values()}
    trace.unwritten_params = [n for n in trace.unwritten_params if n not in scales]
    if trace.unwritten_params and not allow_partial:
        missing = trace.unwritten_params
        raise LayoutMismatchError(
            f"{len(missing)} parameter(s) of the model are written by none of the trainer's "
            f"tensors: {names_of(missing)}; after an update they would keep the engine's current values while "
            f"the rest changes (a model no checkpoint of the trainer describes). Send them, or pass "
            f"allow_partial=True to keep them deliberately (frozen weights)"
        )
    wire = Layout(specs, bucket_bytes)
    wire_group = {s.name: s.group for s in specs}
    group_of: dict[str, str] = {}
    for c in trace.copies:
        group = group_of.setdefault(c.engine, wire_group[c.wire])
        if group != wire_group[c.wire]:
            raise LayoutMismatchError(
                f"parameter '{c.engine}' is written from tensors of two groups ('{group}' and, "
                f"through '{c.wire}', '{wire_group[c.wire]}'): a parameter belongs to one group"
            )
    engine_params, kept = trace.engine_params, []
    if trace.unwritten_params and live_arena is not None and len(set(group_of.values())) == 1:
        # The arena's slots are swapped whole: they must hold the unwritten parameters too.
        kept = list(trace.unwritten_params)
        group_of.update({n: next(iter(group_of.values())) for n in kept})
        engine_params = every
    order = {g.name: i for i, g in enumerate(wire.groups)}
    # A scale is placed after its weight below, wherever the model holds it.
    names = sorted((n for n in engine_params if n not in scales),
                   key=lambda n: order[group_of[n]])  # stable: model order
    params = {n: engine_params[n] for n in names}
    # A weight vLLM keeps quantized: the copies write its float8 bytes (in the layout as
    # loaded), the receiver quantizes them, and its scale follows it in the layout. One the
    # trainer does not send (kept) keeps its float8 bytes and its scale as they are.
    unsent = set(kept)
    quantized = [PlanQuantization(n, fp8[n].scale_name, fp8[n].parts)
                 for n in names if n in fp8 and n not in unsent]
    for n in (n for n in names if n in fp8):
        params[n] = fp8[n].storage
        params[fp8[n].scale_name] = fp8[n].scale
        group_of[fp8[n].scale_name] = group_of[n]
        if n in unsent:
            kept.append(fp8[n].scale_name)
    names = [m for n in names for m in ((n, fp8[n].scale_name) if n in fp8 else (n,))]
    if live_arena is not None:
        # The arena holds the parameters in the model's order (an FP8 scale where the model
        # registers it, not after its weight): the layout must be the arena's, place for place.
        place = {id(p): i for i, p in enumerate(live_arena.params)}
        held = {n: fp8[n].parameter if n in fp8 else params[n] for n in names}
        names.sort(key=lambda n: place.get(id(held[n]), len(place)))
    # Described here: with LoRA on, a parameter's name in the trace (the checkpoint's) is not its
    # name among the wrapped model's parameters.
    descs = {n: describe(n, param_data(p)) for n, p in params.items()}
    engine = Layout([TensorSpec(n, descs[n].dtype, descs[n].shape, group_of[n]) for n in names])
    return engine, ReceivePlan(wire, compose_all(trace.copies, packed or {}), kept,
                               quantized=quantized), params


def receive_plan_with_lora(worker, model, specs: list[TensorSpec], lora_adapter: int | None,
                            bucket_bytes: int, allow_partial: bool, live_arena=None,
                            packed: dict | None = None):
    """(engine layout, ReceivePlan, params, descs) for a trainer that sends a LoRA adapter's
    tensors (and maybe base weights): the base through receive_plan, the adapter into its vLLM
    slot (lora_plan.py). Both in one plan over the trainer's layout as it sends it."""
    from shadowsync.receive_plan import ReceivePlan

    lora_specs = [s for s in specs if is_lora_tensor(s.name)]
    if lora_adapter is None:
        raise LayoutMismatchError(
            f"{len(lora_specs)} of the trainer's tensors are LoRA tensors "
            f"({names_of([s.name for s in lora_specs], 2)}): pass lora_adapter=<the lora_int_id of "
            f"the vLLM adapter they update>")
    if not lora_specs:
        raise LayoutMismatchError(f"lora_adapter={lora_adapter}: none of the trainer's "
                                  f"{len(specs)} tensors is a LoRA tensor ('...lora_A.weight')")
    manager = vllm_worker.lora_manager(worker)
    if manager is None:
        raise InvalidArgumentError(f"lora_adapter={lora_adapter}: this vLLM serves no LoRA "
                                   f"adapters (start it with enable_lora=True)")
    lora = lora_receive_plan(manager, int(lora_adapter), lora_specs)
    copies = list(lora.copies)
    group_of = {s.name: s.group for s in specs}
    engine_specs = []
    for c in lora.copies:
        desc = describe(c.engine, lora.engine_tensors[c.engine])
        engine_specs.append(TensorSpec(c.engine, desc.dtype, desc.shape, group_of[c.wire]))
    params: dict[str, Any] = dict(lora.engine_tensors)
    kept: list[str] = []
    base_specs = [s for s in specs if not is_lora_tensor(s.name)]
    if base_specs:
        base_layout, base_plan, base_params = receive_plan(model, base_specs, bucket_bytes,
                                                            allow_partial, live_arena, packed)
        copies += base_plan.copies
        kept = base_plan.kept
        engine_specs = list(base_layout.specs) + engine_specs
        params.update(base_params)
    wire = Layout(specs, bucket_bytes)
    order = {g.name: i for i, g in enumerate(wire.groups)}
    engine = Layout(sorted(engine_specs, key=lambda t: order[t.group]))
    descs = {name: describe(name, param_data(p)) for name, p in params.items()}
    return engine, ReceivePlan(wire, copies, kept), params, descs


def placement(descs: dict[str, TensorDesc]) -> tuple[str, str]:
    """(kind, device) shared by all parameters; one backend serves one device."""
    first_name, first = next(iter(descs.items()))
    for name, d in descs.items():
        if (d.kind, d.device) != (first.kind, first.device):
            raise InvalidArgumentError(
                f"parameter '{name}' is a {d.kind} tensor on {d.device} but '{first_name}' is a "
                f"{first.kind} tensor on {first.device}: all must be on one device"
            )
        if not d.contiguous:
            raise InvalidArgumentError(
                f"parameter '{name}': not contiguous (strides {format_shape(d.strides)})"
            )
    if first.device not in ("cpu",) and not first.device.startswith("cuda:"):
        raise InvalidArgumentError(f"parameter '{first_name}': device {first.device} is not supported")
    return first.kind, first.device


def check_specs(specs: list[TensorSpec], descs: dict[str, TensorDesc]) -> None:
    """Each of the trainer's specs must be a parameter of this model, exactly."""
    from shadowsync.layout import canonical_dtype

    for s in specs:
        d = descs.get(s.name)
        if d is None:
            raise LayoutMismatchError(
                f"tensor '{s.name}' of the trainer's layout is not a parameter of the worker "
                f"({len(descs)} parameters)"
            )
        dtype = canonical_dtype(s.dtype)[0]
        if dtype != d.dtype:
            raise LayoutMismatchError(
                f"tensor '{s.name}': dtype {dtype} of the trainer's layout does not match the "
                f"worker's {d.dtype}"
            )
        if tuple(s.shape) != d.shape:
            raise LayoutMismatchError(
                f"tensor '{s.name}': shape {format_shape(s.shape)} of the trainer's layout does not "
                f"match the worker's {format_shape(d.shape)}"
            )
