"""What the package needs to know of a tensor, from numpy arrays and torch tensors alike.

torch is never imported here: a torch tensor is recognised by its type's module, so the package
works (and its tests run) where torch is not installed. Engine adapters (shadowsync.vllm) describe
an engine's parameters with `describe` and `items`.
"""

from __future__ import annotations

import ctypes
from ctypes import c_int64
from dataclasses import dataclass
from typing import Any, Mapping

from ._library import SourceTensorC
from .errors import InvalidArgumentError, ShadowsyncError
from .layout import TensorInfo, canonical_dtype, format_shape

__all__ = ["TensorDesc", "describe", "is_torch_tensor", "items"]


@dataclass(frozen=True)
class TensorDesc:
    name: str
    kind: str  # "numpy" or "torch"
    dtype: str  # canonical ("fp32", "bf16", ...)
    dtype_repr: str  # as the tensor's library spells it ("float32", "torch.bfloat16")
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    device: str  # "cpu" or "cuda:N"
    contiguous: bool
    data_ptr: int
    tensor: Any  # the object itself: kept alive while the library reads it


def is_torch_tensor(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "data_ptr")


def items(named_tensors) -> list[tuple[str, Any]]:
    """(name, tensor) pairs from a mapping or an iterable of pairs (``named_parameters()``)."""
    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    pairs = []
    for entry in named_tensors:
        try:
            name, tensor = entry
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"expected (name, tensor) pairs or a mapping of names to tensors, got an entry "
                f"of type {type(entry).__name__}"
            ) from None
        pairs.append((name, tensor))
    return pairs


def _canonical(name: str, dtype_repr: str) -> str:
    try:
        return canonical_dtype(dtype_repr)[0]
    except ShadowsyncError as e:
        detail = e.detail.removeprefix("shadowsync_dtype_info: ")
        raise InvalidArgumentError(f"tensor '{name}': {detail}") from None


def describe(name: str, tensor) -> TensorDesc:
    """Dtype, shape, strides, device and address of a numpy array or torch tensor."""
    if is_torch_tensor(tensor):
        device = tensor.device
        device_str = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
        dtype_repr = str(tensor.dtype)
        return TensorDesc(
            name=name,
            kind="torch",
            dtype=_canonical(name, dtype_repr),
            dtype_repr=dtype_repr,
            shape=tuple(tensor.shape),
            strides=tuple(tensor.stride()),
            device=device_str,
            contiguous=bool(tensor.is_contiguous()),
            data_ptr=int(tensor.data_ptr()),
            tensor=tensor,
        )
    import numpy as np

    if isinstance(tensor, np.ndarray):
        dtype_repr = str(tensor.dtype)
        itemsize = tensor.dtype.itemsize or 1
        return TensorDesc(
            name=name,
            kind="numpy",
            dtype=_canonical(name, dtype_repr),
            dtype_repr=dtype_repr,
            shape=tuple(int(d) for d in tensor.shape),
            strides=tuple(int(s) // itemsize for s in tensor.strides),
            device="cpu",
            contiguous=bool(tensor.flags.c_contiguous),
            data_ptr=int(tensor.ctypes.data),
            tensor=tensor,
        )
    raise InvalidArgumentError(
        f"tensor '{name}': a {type(tensor).__module__}.{type(tensor).__name__} is neither a numpy "
        f"array nor a torch tensor"
    )


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def check(desc: TensorDesc, info: TensorInfo, device: str) -> None:
    """Raises InvalidArgumentError naming the tensor and both values unless `desc` matches the
    layout's `info` and lives on `device` as one contiguous block."""
    if desc.dtype != info.dtype:
        raise InvalidArgumentError(
            f"tensor '{desc.name}': dtype {desc.dtype} ({desc.dtype_repr}) does not match layout "
            f"{info.dtype}"
        )
    if desc.shape != info.shape:
        raise InvalidArgumentError(
            f"tensor '{desc.name}': shape {format_shape(desc.shape)} does not match layout "
            f"{format_shape(info.shape)}"
        )
    if desc.device != device:
        raise InvalidArgumentError(
            f"tensor '{desc.name}': device {desc.device} does not match the backend's {device}"
        )
    if not desc.contiguous:
        raise InvalidArgumentError(
            f"tensor '{desc.name}': not contiguous: strides {format_shape(desc.strides)} (elements), "
            f"contiguous would be {format_shape(contiguous_strides(desc.shape))}; pass "
            f".contiguous() / numpy.ascontiguousarray() of it"
        )


class SourceArray:
    """The C array of shadowsync_source_tensor_t for checked tensors, and what keeps its pointers
    valid (names, shapes and the tensors themselves) for as long as this object lives."""

    def __init__(self, descs: list[TensorDesc]):
        self.count = len(descs)
        self.array = (SourceTensorC * max(self.count, 1))()
        self._keep = []
        for i, d in enumerate(descs):
            shape = (c_int64 * max(len(d.shape), 1))(*d.shape)
            name, dtype = d.name.encode(), d.dtype.encode()
            self._keep += [shape, name, dtype, d.tensor]
            self.array[i] = SourceTensorC(
                name,
                d.data_ptr,
                dtype,
                ctypes.cast(shape, ctypes.POINTER(c_int64)) if d.shape else None,
                len(d.shape),
            )


def synchronize_producers(descs: list[TensorDesc]) -> None:
    """Waits for the work that writes CUDA torch tensors on their current streams (an optimizer
    step, an all-gather): the library reads them on its own streams, which know nothing of
    torch's."""
    devices = {d.tensor.device for d in descs if d.kind == "torch" and d.device != "cpu"}
    if devices:
        import torch

        for device in devices:
            torch.cuda.current_stream(device).synchronize()
