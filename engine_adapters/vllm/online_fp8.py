"""vLLM's ``quantization="fp8"`` engines: weights the engine quantizes while it loads them, and the
receive that does the same in the shadow.

Started with ``quantization="fp8"`` on a bf16/fp16 checkpoint, vLLM quantizes online, layer by
layer, while ``load_weights`` runs: each linear layer's fused weight ([out, in], as its loader
assembles it) becomes float8_e4m3fn with one float32 ``weight_scale`` (the absolute maximum over
the whole fused weight / 448), held transposed ([in, out], a view of the row-major [out, in]
bytes); a MoE layer's ``w13_weight`` and ``w2_weight`` become float8 with a scale per expert
(``w13_weight_scale``, ``w2_weight_scale``). The parameters the loader wrote no longer exist.

So the receive plan is traced against the layers *as loaded*: vLLM keeps, for its own weight
reloads, the parameters each layer had before loading (meta tensors with their loaders); while
the trace runs they stand in for the quantized ones (``as_loaded``), and the plan's copies land in
the receiver's staging memory in the wire dtype. A native step on the receiver's stream then
quantizes each fused weight (per expert for MoE) into the shadow's float8 bytes and scale, as
vLLM computes them (plugin/core/fp8_quantize.h), before the update is offered: the quantization
is part of the receive, hidden behind decoding like the transfer.

The swap: under graph pairs (live_arena.py) both slots hold the float8 bytes and the scales like
any weight, and a swap rebinds the parameters; otherwise the float8 bytes and scales are copied
into vLLM's storage (copy_in). A weight the kernel holds with rows of padding after it
(``padded_rows``; the padding is not the receive's) keeps copy_in.

Served: per-tensor online FP8 (``Fp8PerTensorOnlineLinearMethod``, ``Fp8PerTensorOnlineMoEMethod``
with an expert kernel that keeps vLLM's layout). Refused, named: any other online quantization
(per block, per channel, MXFP8, INT8), kernels that pad a weight's input dimension or shuffle
the quantized weights.

Thread: the set-up's (engine thread, before stepping). torch and vllm are imported inside the
functions only."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from shadowsync.errors import LayoutMismatchError
from shadowsync.layout import format_shape

from .loader_trace import STAND_IN_FLAG

__all__ = ["Fp8Weight", "as_loaded", "online_fp8_weights", "padded"]

LINEAR_METHOD = "Fp8PerTensorOnlineLinearMethod"
MOE_METHOD = "Fp8PerTensorOnlineMoEMethod"
# vLLM's FP8 expert kernels that compute from w13_weight/w2_weight as quantized (others shuffle
# or repack them for their kernel: refused).
_MOE_BACKENDS_AS_QUANTIZED = frozenset({"TRITON", "BATCHED_TRITON", "VLLM_CUTLASS",
                                        "BATCHED_VLLM_CUTLASS"})
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_SANITIZE = "vllm.model_executor.model_loader.reload.sanitize"


@dataclass
class Fp8Weight:
    """One parameter vLLM keeps quantized (online_fp8_weights keys it by its name in the model):
    ``storage`` (its float8 bytes as a contiguous tensor of the as-loaded shape: what the receive
    writes), ``scale_name``/``scale`` (its float32 scales, ``parts`` of them: 1 for a linear
    layer, one per expert), ``layer``/``attribute`` (where the parameter is registered) and
    ``as_loaded`` (the meta parameter vLLM loaded into, whose loader the trace runs)."""

    storage: Any
    scale_name: str
    scale: Any
    parts: int
    layer: Any
    attribute: str
    as_loaded: Any
    padded_rows: int = 0  # rows of zeros vLLM's kernel keeps after the loaded ones

    @property
    def parameter(self):
        """The parameter vLLM computes with (the float8 bytes, or their transposed view)."""
        return self.layer._parameters[self.attribute]


def _refuse(layer: str, method: str, what: str) -> LayoutMismatchError:
    return LayoutMismatchError(
        f"layer '{layer}' ({method}): {what}; supported FP8 is vLLM's quantization=\"fp8\" on a "
        f"bf16/fp16 checkpoint (per-tensor scales), with expert kernels that keep the quantized "
        f"layout ({', '.join(sorted(_MOE_BACKENDS_AS_QUANTIZED))}). Nothing was set up")


def _as_loaded_metadata(layer, layer_name: str, method: str) -> dict:
    """{attribute: meta parameter} of `layer` as vLLM created it before loading."""
    import importlib

    try:
        layerwise = importlib.import_module(_LAYERWISE)
        info = layerwise.LAYERWISE_INFO.get(layer)
    except (ImportError, AttributeError):
        info = None
    if info is None or not info.restore_metadata or not info.restore_metadata[0]:
        raise _refuse(layer_name, method, "this vLLM keeps no record of the layer's parameters "
                      "as loaded (vLLM's layerwise reload metadata), so no receive plan can be "
                      "traced for its quantized weights")
    return info.restore_metadata[0]


def _stand_in(torch, meta, layer):
    """A meta parameter like `meta` (vLLM's record of an as-loaded parameter: its class and
    attributes) with its own storage, its loader bound to `layer` again (vLLM's record holds it
    bound to a placeholder) and unwrapped from vLLM's online-processing wrapper (which would
    buffer the load and then quantize the real layer)."""
    import importlib

    stand = torch.empty_strided(tuple(meta.shape), tuple(meta.stride()), dtype=meta.dtype,
                                device="meta")
    stand.__class__ = type(meta)
    stand.__dict__ = dict(meta.__dict__)
    importlib.import_module(_SANITIZE).restore_layer_refs(stand, layer)
    loader = getattr(stand, "weight_loader", None)
    while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    if loader is not None:
        stand.weight_loader = loader
    setattr(stand, STAND_IN_FLAG, True)
    return stand


def _scale(torch, layer, layer_name: str, method: str, name: str, parts: int):
    scale = layer._parameters.get(name)
    if scale is None or scale.dtype != torch.float32 or scale.numel() != parts:
        got = ("none" if scale is None
               else f"{scale.dtype}, shape {format_shape(tuple(scale.shape))}")
        raise _refuse(layer_name, method, f"its scale '{name}' is {got}, not {parts} float32 "
                      f"value(s) as vLLM's per-tensor FP8 keeps")
    return scale


def online_fp8_weights(model) -> dict[str, Fp8Weight]:
    """{parameter name: Fp8Weight} for every weight vLLM quantized online in `model`; empty when
    none. Raises LayoutMismatchError naming the layer for online quantization it cannot take."""
    named = model.named_modules() if callable(getattr(model, "named_modules", None)) else ()
    online = [(n, m) for n, m in named
              if getattr(getattr(m, "quant_method", None), "uses_meta_device", False)]
    if not online:
        return {}  # (torch is imported only for an engine that has such layers)
    import torch

    fp8 = getattr(torch, "float8_e4m3fn", None)
    found: dict[str, Fp8Weight] = {}
    for layer_name, layer in online:
        method = layer.quant_method
        kind = type(method).__name__
        if kind not in (LINEAR_METHOD, MOE_METHOD):
            raise _refuse(layer_name, kind, "this online quantization is not served")
        metadata = _as_loaded_metadata(layer, layer_name, kind)
        if kind == LINEAR_METHOD:
            weight = layer._parameters.get("weight")
            loaded = metadata.get("weight")
            out_in = tuple(loaded.shape) if loaded is not None else ()
            # Row-major [out, in] float8 bytes, held as they are (vLLM CPU) or as their
            # transposed view (CUDA's scaled-mm kernels take [in, out]; CUTLASS pads out to a
            # multiple of 16 with rows of zeros after them, which no update changes).
            storage, padded = None, 0
            if (weight is not None and weight.dtype == fp8 and weight.dim() == 2
                    and len(out_in) == 2):
                rows = weight.data if weight.is_contiguous() else weight.data.t()
                if (rows.is_contiguous() and rows.shape[0] >= out_in[0]
                        and rows.shape[1] == out_in[1]):
                    storage, padded = rows[:out_in[0]], rows.shape[0] - out_in[0]
            if storage is None:
                got = "none" if weight is None else (
                    f"{weight.dtype}, shape {format_shape(tuple(weight.shape))}, strides "
                    f"{format_shape(tuple(weight.stride()))}")
                raise _refuse(layer_name, kind, f"its weight is {got}, not the float8 bytes of "
                              f"the loaded {format_shape(out_in)} in their order (a kernel that "
                              f"pads or repacks them)")
            entries = [("weight", storage, "weight_scale", 1, padded)]
        else:
            backend = getattr(getattr(method, "fp8_backend", None), "value", None)
            if backend not in _MOE_BACKENDS_AS_QUANTIZED:
                raise _refuse(layer_name, kind, f"vLLM's FP8 expert kernel {backend} rearranges "
                              f"the quantized experts")
            entries = []
            for attribute in ("w13_weight", "w2_weight"):
                weight = layer._parameters.get(attribute)
                loaded = metadata.get(attribute)
                if (weight is None or loaded is None or weight.dtype != fp8
                        or tuple(weight.shape) != tuple(loaded.shape)
                        or not weight.is_contiguous()):
                    raise _refuse(layer_name, kind, f"its {attribute} is not the float8 of the "
                                  f"loaded experts, in their layout")
                entries.append((attribute, weight.data, f"{attribute}_scale", weight.shape[0], 0))
        prefix = f"{layer_name}." if layer_name else ""
        for attribute, storage, scale_name, parts, padded in entries:
            found[prefix + attribute] = Fp8Weight(
                storage=storage, scale_name=prefix + scale_name,
                scale=_scale(torch, layer, layer_name, kind, scale_name, parts), parts=int(parts),
                layer=layer, attribute=attribute, as_loaded=metadata[attribute],
                padded_rows=int(padded))
    return found


def padded(weights: dict[str, Fp8Weight]) -> list[str]:
    """The names of `weights` that vLLM's kernel holds with rows of padding after them (the
    receive does not write those rows: graph pairs cannot hold such a weight)."""
    return [name for name, w in weights.items() if w.padded_rows]


@contextlib.contextmanager
def as_loaded(weights: dict[str, Fp8Weight]):
    """While it is entered, each quantized parameter of `weights` is replaced in its layer by a
    meta stand-in of the parameter vLLM loaded into (its shape, dtype, class and loader): the
    model's ``load_weights`` then writes the layout it loads, which the trace records. The
    quantized parameters are put back on leaving, whatever happened."""
    import torch

    swapped = []
    try:
        for w in weights.values():
            stand = _stand_in(torch, w.as_loaded, w.layer)
            swapped.append((w.layer, w.attribute, w.layer._parameters[w.attribute]))
            w.layer._parameters[w.attribute] = stand
        yield
    finally:
        for layer, attribute, original in reversed(swapped):
            layer._parameters[attribute] = original
