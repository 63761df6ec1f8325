"""What vLLM does to a model's weights after loading them, traced while it does it.

After ``load_weights`` vLLM runs its post-load step (``process_weights_after_loading``: every
layer's quant method, the attention layers, the model's own hook). It may repack a weight in place
(vLLM CPU's MoE experts: same shape, other order), replace it (an empty parameter and a packed
copy: vLLM CPU's linears), quantize it, transpose it, or derive a copy the forward reads while the
parameter stays as loaded (vLLM CPU's embeddings used as the lm_head). A receive plan traced from
``load_weights`` writes the checkpoint's layout into the parameters; after any of these the engine
would compute with something else — silently wrong.

So the post-load step itself is traced, not guessed per architecture: ``install()`` wraps vLLM's
``process_weights_after_loading`` so that, around the real call at load time, every module's
parameters (shape, strides, dtype and a position-sensitive digest of their bytes) and attributes
(its own and its quant method's) are taken before and after. What changed is kept on the model
(``PostLoadRecord``). At set-up, ``check_post_load_transforms(model, ...)`` accepts the one
transform an update is written through (vLLM CPU's expert packing: a reordering the plan writes
into, expert_packing.py) and the MoE kernel vLLM sets up over a layer's own experts, and refuses
an engine where the step otherwise changed a parameter or set something that is not a plain
value (a tensor, a function, a kernel object), naming the layer, its quant method and what the
step did. One check
decides by running the layer, not by its class: a layer that gained such an attribute but still
computes from its parameter (a lookup embedding beside its unused packed copy) passes, shown by
calling its quant method on a copy of the layer with other weights, in each role the model gives
it (a lookup; a matmul where the model's ``compute_logits`` calls it, which is observed).

Tracing runs at load, never again: vLLM's post-load step is not idempotent (a second run takes its
"weight update" branch), so re-running it on a copy would not show what the first run did.

Thread: the loading thread (vLLM's worker), then the set-up's. torch and vllm are imported inside
the functions only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from shadowsync.errors import LayoutMismatchError
from shadowsync.layout import format_shape

from .import_hook import when_imported

__all__ = ["PostLoadChange", "PostLoadRecord", "check_post_load_transforms", "install",
           "install_when_vllm_loads"]

RECORD_ATTR = "_shadowsync_post_load"
_LOADER_UTILS = "vllm.model_executor.model_loader.utils"  # where vLLM defines the step
_PATCHED_FLAG = "_shadowsync_traced"
_MAX_LISTED = 12
# 32-bit words hashed per torch call: bounds the digest's temporaries (16 MiB each).
_DIGEST_CHUNK = 1 << 22


@dataclass(frozen=True)
class PostLoadChange:
    """One thing the post-load step did to a layer: ``kind`` "parameter" or "attribute"."""

    layer: str
    method: str  # the class of the layer's quant method, or "no quant method"
    kind: str
    name: str
    what: str


@dataclass
class PostLoadRecord:
    changes: list[PostLoadChange] = field(default_factory=list)
    failure: str | None = None  # the trace itself failed (the step ran regardless)


# --- installing the trace -------------------------------------------------------------------------

def install(utils=None) -> bool:
    """Wraps vLLM's ``process_weights_after_loading`` (in every loaded module that holds it) with
    the trace. Idempotent; False where vLLM has no such function (nothing to trace there).
    `utils`: vLLM's module that defines it, when the caller has it (while it is being
    imported)."""
    if utils is None:
        try:
            import importlib

            utils = importlib.import_module(_LOADER_UTILS)
        except ImportError:
            return False
    original = getattr(utils, "process_weights_after_loading", None)
    if original is None:
        return False
    if getattr(original, _PATCHED_FLAG, False):
        traced = original
        original = traced.__wrapped__
    else:
        traced = _traced(original)
    # base_loader (and others) imported it by name: patch each copy of the reference.
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.startswith("vllm") and getattr(module, "process_weights_after_loading",
                                               None) is original:
            module.process_weights_after_loading = traced
    return True


def install_when_vllm_loads() -> None:
    """Installs the trace now if vLLM's loader utilities are imported, else right after they are
    (whatever the order of ``import shadowsync.vllm`` and ``import vllm``)."""
    when_imported(_LOADER_UTILS, install)


def _traced(original):
    def process_weights_after_loading(model, *args, **kwargs):
        from .unpacked import unpack_unconfigured_layers

        # Before the trace's first look: the layers it unpacks are then as vLLM would load them
        # with the quantization config, not something the step changed.
        model_config = args[0] if args else kwargs.get("model_config")
        unpack_unconfigured_layers(model, model_config)
        before = None
        try:
            before = _snapshot(model)
        except Exception as e:  # noqa: BLE001 - the trace must never break vLLM's load
            failure = f"{type(e).__name__}: {e}"
        result = original(model, *args, **kwargs)
        # A later run (a reload of the weights) adds to what the first one did, never clears it:
        # a second run may skip a repacking whose layout the weights still have.
        record = getattr(model, RECORD_ATTR, None) or PostLoadRecord()
        if before is None:
            record.failure = record.failure or failure
        else:
            try:
                seen = set(record.changes)
                record.changes += [c for c in _diff(before, _snapshot(model)) if c not in seen]
            except Exception as e:  # noqa: BLE001
                record.failure = record.failure or f"{type(e).__name__}: {e}"
        object.__setattr__(model, RECORD_ATTR, record)
        return result

    process_weights_after_loading.__wrapped__ = original
    setattr(process_weights_after_loading, _PATCHED_FLAG, True)
    return process_weights_after_loading


# --- what a snapshot holds ------------------------------------------------------------------------

def _digest(torch, t) -> int | None:
    """A position-sensitive digest of t's bytes (a permutation changes it), or None without
    storage: per chunk, the sum of its 32-bit words times fixed odd multipliers (int32 products
    wrap, the sum is int64: exact, so the same bytes give the same digest), the chunks chained in
    order. Two passes over the bytes on the tensor's device."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw.to(torch.int32)
    weights = _digest_weights(torch, min(words.numel(), _DIGEST_CHUNK), words.device)
    total = 0
    for start in range(0, words.numel(), _DIGEST_CHUNK):
        chunk = words[start:start + _DIGEST_CHUNK]
        part = int(torch.mul(chunk, weights[:chunk.numel()]).sum())
        total = (total * 0x100000001B3 + part) & ((1 << 64) - 1)
    return total


_WEIGHTS: dict = {}


def _digest_weights(torch, n: int, device):
    """n fixed odd int32 multipliers on `device` (cached: the same for every tensor)."""
    key = (str(device), n)
    if key not in _WEIGHTS:
        index = torch.arange(n, dtype=torch.int64)
        odd = ((index * 2654435761 + 0x9E3779B1) % (1 << 31)) * 2 + 1
        _WEIGHTS.clear()  # one size at a time: a chunk's worth of memory at most
        _WEIGHTS[key] = odd.to(torch.int32).to(device)
    return _WEIGHTS[key]


def _is_plain(value, depth: int = 0) -> bool:
    """A value that cannot hold weights: None, numbers, strings, enums, dtypes, devices, and
    small containers of them."""
    import enum

    import torch

    if value is None or isinstance(value, (bool, int, float, str, bytes, enum.Enum, torch.dtype,
                                           torch.device)):
        return True
    if isinstance(value, (tuple, list, frozenset, set)) and depth < 2 and len(value) <= 64:
        return all(_is_plain(v, depth + 1) for v in value)
    return False


def _method_name(module) -> str:
    method = getattr(module, "quant_method", None)
    return type(method).__name__ if method is not None else "no quant method"


def _snapshot(model) -> dict:
    import torch

    internals = set(vars(torch.nn.Module()))
    digests: dict[tuple, int | None] = {}
    params: dict[tuple[str, str], tuple] = {}
    attrs: dict[tuple[str, str], Any] = {}
    methods: dict[str, str] = {}
    holds_weights: set[str] = set()  # modules with a parameter in their subtree
    for mname, module in model.named_modules():
        methods[mname] = _method_name(module)
        if next(module.parameters(), None) is not None:
            holds_weights.add(mname)
        for pname, p in module._parameters.items():
            if p is None:
                continue
            key = (p.device, p.data_ptr() if p.device.type != "meta" else id(p), p.dtype,
                   tuple(p.shape), tuple(p.stride()))
            if key not in digests:
                digests[key] = _digest(torch, p)
            params[(mname, pname)] = (tuple(p.shape), tuple(p.stride()), p.dtype, digests[key])
        for k, v in vars(module).items():
            if k not in internals:
                attrs[(mname, k)] = v
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "__dict__"):
            for k, v in vars(method).items():
                attrs[(mname, f"quant_method.{k}")] = v
    return dict(params=params, attrs=attrs, methods=methods, holds_weights=holds_weights)


def _describe_param(old: tuple, new: tuple | None) -> str | None:
    if new is None:
        return "removed it"
    (oshape, ostride, odtype, odigest), (nshape, nstride, ndtype, ndigest) = old, new
    if 0 in nshape and 0 not in oshape:
        return (f"emptied it (shape {format_shape(oshape)} -> {format_shape(nshape)}): the layer "
                f"computes from another copy")
    if ndtype != odtype:
        return f"converted it from {odtype} to {ndtype} (quantized)"
    if nshape != oshape:
        if sorted(nshape) == sorted(oshape):
            return f"transposed it (shape {format_shape(oshape)} -> {format_shape(nshape)})"
        return f"reshaped it (shape {format_shape(oshape)} -> {format_shape(nshape)})"
    if nstride != ostride:
        return (f"changed its memory layout (strides {format_shape(ostride)} -> "
                f"{format_shape(nstride)})")
    if ndigest != odigest:
        return ("rewrote its values in place (same shape, dtype and strides: a repacked, "
                "reordered or rescaled layout)")
    return None


def _diff(before: dict, after: dict) -> list[PostLoadChange]:
    changes = []
    methods = {**before["methods"], **after["methods"]}
    for (mname, pname), old in before["params"].items():
        what = _describe_param(old, after["params"].get((mname, pname)))
        if what:
            changes.append(PostLoadChange(mname, methods[mname], "parameter", pname, what))
    for (mname, pname), new in after["params"].items():
        if (mname, pname) not in before["params"]:
            changes.append(PostLoadChange(mname, methods[mname], "parameter", pname,
                                          f"added it (shape {format_shape(new[0])}, {new[2]})"))
    missing = object()
    for (mname, aname), new in after["attrs"].items():
        old = before["attrs"].get((mname, aname), missing)
        # A layer without weights below it (an attention backend's state) derives none.
        if old is new or _is_plain(new) or mname not in before["holds_weights"]:
            continue
        what = "set it to" if old is missing else "replaced it with"
        changes.append(PostLoadChange(mname, methods[mname], "attribute", aname,
                                      f"{what} a {type(new).__name__}"))
    return changes


# --- the set-up's check ---------------------------------------------------------------------------

def _logits_layers(model, layers: dict[str, Any]) -> set[str] | None:
    """Which of `layers` the model's logits computation calls (``compute_logits``, run once on
    one hidden row while each layer's quant method ``apply`` is watched): the layers that act as
    the lm_head, tied or not. None when that cannot be observed (no compute_logits, or it
    raised): then every layer counts as one."""
    import torch

    compute = getattr(model, "compute_logits", None)
    if not callable(compute) or not layers:
        return None
    called: set[str] = set()
    watched = []
    for name, module in layers.items():
        method = getattr(module, "quant_method", None)
        apply = getattr(method, "apply", None)
        if apply is None:
            continue

        def watching(*args, _apply=apply, _name=name, **kwargs):
            called.add(_name)
            return _apply(*args, **kwargs)

        method.apply = watching  # an instance attribute over the class's method, removed below
        watched.append(method)
    weight = next(iter(layers.values()))._parameters["weight"]
    try:
        with torch.no_grad():
            compute(torch.zeros((1, weight.shape[1]), dtype=weight.dtype, device=weight.device))
    except Exception:  # noqa: BLE001 - not observable: the caller assumes every layer
        return None
    finally:
        for method in watched:
            del method.apply
    return called


def _computes_from_its_weight(model, layer_name: str, logits_layers: set[str] | None
                              ) -> bool | None:
    """Whether the layer computes from its ``weight`` parameter in every role the model gives it
    (None: a layer this cannot be shown for — no 2-D floating weight, or its quant method cannot be
    called so):
    its quant method called on a copy of the layer whose weight holds other values (anything the
    post-load step derived from the loaded weight still holds the old ones), as the model calls
    it — a lookup for an embedding, a matmul where it computes logits (``logits_layers``) or is a
    linear layer."""
    import copy

    import torch
    import torch.nn.functional as F

    try:
        module = model.get_submodule(layer_name) if layer_name else model
    except AttributeError:
        return None
    method = getattr(module, "quant_method", None)
    weight = module._parameters.get("weight")
    if method is None or weight is None or weight.dim() != 2 or weight.numel() == 0:
        return None
    if not weight.is_floating_point():
        return None
    generator = torch.Generator().manual_seed(0)
    other = torch.randn(tuple(weight.shape), generator=generator).to(weight.dtype).to(
        weight.device)
    twin = copy.copy(module)
    parameters = dict(module._parameters)
    parameters["weight"] = torch.nn.Parameter(other, requires_grad=False)
    object.__setattr__(twin, "_parameters", parameters)
    bias = parameters.get("bias")
    lookup = hasattr(method, "embedding")
    matmul = not lookup or logits_layers is None or layer_name in logits_layers
    try:
        with torch.no_grad():
            if lookup:
                ids = torch.arange(min(8, other.shape[0]), device=other.device)
                if not _close(torch, method.embedding(twin, ids), other[ids]):
                    return False
            if matmul:
                x = torch.randn((2, other.shape[1]), generator=generator).to(other.dtype).to(
                    other.device)
                if not _close(torch, method.apply(twin, x), F.linear(x, other, bias)):
                    return False
    except Exception:  # noqa: BLE001 - a layer that cannot be called this way is not shown
        return None
    return True


def _close(torch, got, want) -> bool:
    return tuple(got.shape) == tuple(want.shape) and bool(
        torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


# What vLLM changes on a MoE layer when it sets up its expert kernel after loading, and on vLLM CPU
# when its grouped GEMM repacks the experts (expert_packing.py).
_MOE_KERNEL_ATTRIBUTES = {"quant_method.moe_quant_config", "quant_method.moe_kernel"}
_PACKED_EXPERTS = {"w13_weight", "w2_weight"}


def _moe_kernel_set_up(model, layer: str, changes: list[PostLoadChange]) -> dict | None:
    """{parameter: PackedOrder} (empty when nothing is packed) when what the step did to `layer`
    is vLLM setting up its MoE kernel, maybe with vLLM CPU's expert packing; None otherwise.
    The kernel is called with the layer's w13_weight and w2_weight at every step, so an update
    of them takes effect. Layers with expert biases are not accepted: the kernel's config holds
    those tensors themselves."""
    from .expert_packing import cpu_expert_packing

    module = model.get_submodule(layer)
    if any(name.endswith("_bias") for name in module._parameters):
        return None
    if not any(c.kind == "attribute" and c.name in _MOE_KERNEL_ATTRIBUTES for c in changes):
        return None
    repacked = False
    for c in changes:
        if c.kind == "attribute" and c.name not in _MOE_KERNEL_ATTRIBUTES:
            return None
        if c.kind == "parameter":
            if c.name not in _PACKED_EXPERTS or not c.what.startswith("rewrote its values"):
                return None
            repacked = True
    if not repacked:
        return {}
    return cpu_expert_packing(module, layer)


def _kv_cache_scales(changes: list[PostLoadChange]) -> bool:
    """Whether all the step did to a layer is vLLM's KV-cache quantization (quantization="fp8"
    gives attention layers a KV-cache method) turning the checkpoint's activation scales
    (q_scale, k_scale, v_scale, prob_scale) into constants: they are no trained weights, no
    trainer sends them, and no receive plan writes them."""
    return all(c.method.endswith("KVCacheMethod") and c.kind == "parameter"
               and c.name.endswith("_scale") and c.what == "removed it" for c in changes)


def _advice(changes: list[PostLoadChange], quantization: str | None, device: str) -> str:
    from .unpacked import NAME as UNPACKED

    supported = ("supported are weights vLLM computes with as loaded, the expert packing of "
                 f"vLLM CPU's MoE layers (quantization=\"{UNPACKED}\" on vLLM CPU; unquantized "
                 "weights on CUDA), and FP8 as vLLM's quantization=\"fp8\" computes it while "
                 "loading a bf16/fp16 checkpoint (CUDA); other post-load transforms are not")
    if device == "cpu" and quantization is None and any(
            c.method.startswith("Unquantized") for c in changes):
        return (f"start vLLM with quantization=\"{UNPACKED}\" (vLLM's unquantized weights "
                f"without the CPU repacking); {supported}")
    return supported


def check_post_load_transforms(model, quantization: str | None = None,
                               device: str = "cpu") -> dict:
    """What vLLM's post-load step did to the weights, checked. Returns {parameter name:
    PackedOrder} for the one transform an update is written through (vLLM CPU's expert packing,
    expert_packing.py: a reordering the plan writes into directly). A MoE kernel vLLM sets up
    over the layer's own experts passes. Raises LayoutMismatchError, naming every layer, its
    quant method and what the step did, when the step changed a weight in any other way or
    derived something from one that the layer computes with. Empty when it left every weight as
    loaded. A vLLM model whose post-load step was not traced (shadowsync.vllm
    imported only after the engine loaded) is refused too; a model without quant methods (not
    vLLM's) passes."""
    record = getattr(model, RECORD_ATTR, None)
    if record is None:
        modules = model.modules() if callable(getattr(model, "modules", None)) else ()
        vllm_layers = any(hasattr(getattr(m, "quant_method", None), "process_weights_after_loading")
                          for m in modules)
        if vllm_layers:
            raise LayoutMismatchError(
                "vLLM's post-load step (process_weights_after_loading) ran before shadowsync "
                "could trace it, so nothing shows that the parameters are the weights the model "
                "computes with: import shadowsync.vllm in the process that creates the engine "
                "before it loads (vLLM's workers do so through worker_extension_cls), or install "
                "the package (its vLLM plugin traces every process)")
        return {}
    if record.failure:
        raise LayoutMismatchError(
            f"tracing vLLM's post-load step failed ({record.failure}), so nothing shows that the "
            f"parameters are the weights the model computes with; refused")
    by_layer: dict[str, list[PostLoadChange]] = {}
    for change in record.changes:
        by_layer.setdefault(change.layer, []).append(change)
    # Layers that only gained attributes may still compute from their parameters: shown by
    # calling them in each role the model gives them.
    probed = {layer: model.get_submodule(layer) for layer, changes in by_layer.items()
              if layer and all(c.kind == "attribute" for c in changes)}
    logits_layers = _logits_layers(model, {n: m for n, m in probed.items()
                                           if "weight" in m._parameters})
    refused, packed = [], {}
    for layer, changes in by_layer.items():
        if _kv_cache_scales(changes):
            continue
        orders = _moe_kernel_set_up(model, layer, changes) if layer else None
        if orders is not None:
            packed.update(orders)
            continue
        if layer in probed:
            follows = _computes_from_its_weight(model, layer, logits_layers)
            if follows:
                continue  # it derived something, but computes from the parameter an update writes
            changes = changes + [PostLoadChange(
                layer, changes[0].method, "probe", "weight",
                "the layer computes from what the step derived, not from its parameter (called "
                "on a copy with other weights, it gave the old weights' result)" if follows is False
                else "nothing shows that the layer computes from its parameters rather than from "
                     "what the step set (only embeddings and linear layers can be probed)")]
        refused.extend(changes)
    if not refused:
        return packed
    layers = []
    for layer in dict.fromkeys(c.layer for c in refused):
        mine = [c for c in refused if c.layer == layer]
        things = "; ".join(f"{c.kind} '{c.name}': {c.what}" for c in mine[:4])
        if len(mine) > 4:
            things += f"; ... and {len(mine) - 4} more"
        layers.append(f"layer '{layer or '<model>'}' ({mine[0].method}): {things}")
    shown = " | ".join(layers[:_MAX_LISTED])
    if len(layers) > _MAX_LISTED:
        shown += f" | ... and {len(layers) - _MAX_LISTED} more layers"
    raise LayoutMismatchError(
        f"vLLM's post-load step (process_weights_after_loading) transforms {len(layers)} "
        f"layer(s) after loading, so an update written into their parameters in the trainer's "
        f"layout would not be what they compute with: {shown}. Nothing was set up; "
        f"{_advice(refused, quantization, device)}")
