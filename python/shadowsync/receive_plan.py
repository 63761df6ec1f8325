"""Receive plans (receive_plan.h): how the trainer's tensors (the *wire* layout, as its
``named_parameters()`` gives them) land in the engine's own parameters (the *engine* layout: fused,
sharded, renamed) while the engine keeps generating.

A plan is a list of PlanCopy: one strided copy from a view of a wire tensor into a view of an
engine tensor, in elements. The receiver splits them per wire bucket once, at set-up, and runs
them natively on its stream as each bucket lands. ``needed_ranges`` says which wire bytes a plan
reads (an engine rank's needs for a RoutingPlan) without a receiver.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._library import WireRangeC
from .errors import call_array
from .regions import WireRange


@dataclass(frozen=True)
class PlanCopy:
    """Copy `shape` elements from wire tensor `wire` (element offset `src_offset`, element
    strides `src_strides`) into engine tensor `engine` (`dst_offset`, `dst_strides`). Both tensors
    have the same dtype; offsets and strides count elements of it from the tensor's first one."""

    wire: str
    engine: str
    shape: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]


@dataclass(frozen=True)
class PlanQuantization:
    """Engine tensor `engine` (fp8_e4m3) holds the FP8 quantization of what the copies into it
    write, as vLLM's quantization="fp8" computes it after loading, in `parts` equal consecutive
    parts (1: a layer; a MoE layer's experts: one each) with their float32 scales in engine tensor
    `scale` (`parts` elements). The copies land in the receiver's staging memory in their wire
    dtype; the receiver quantizes them into the shadow once the last of them landed."""

    engine: str
    scale: str
    parts: int = 1


class ReceivePlan:
    """The trainer's layout (`wire`, a Layout of its tensors as it sends them) and the copies
    that put them into the engine's layout. Given to Receiver(plan=...), which checks it against
    the engine's layout (bounds, dtypes, groups, every engine byte written exactly once, or the
    tensor named in `kept`) and raises LayoutMismatchError or InvalidArgumentError naming the
    tensors otherwise."""

    def __init__(self, wire, copies, kept=(), quantized=()):
        self.wire = wire
        self.copies = [c if isinstance(c, PlanCopy) else PlanCopy(*c) for c in copies]
        self.quantized = [q if isinstance(q, PlanQuantization) else PlanQuantization(*q)
                          for q in quantized]
        # Engine tensors no copy writes (frozen weights): the receiver copies their live bytes
        # into each slot once, before its first receive, so every swap shows them unchanged.
        self.kept = [str(name) for name in kept]
        if not self.copies:
            from .errors import InvalidArgumentError

            raise InvalidArgumentError("a receive plan needs at least one copy")

    def _c_array(self):
        """The copies as a shadowsync_plan_copy_t array, and what keeps its memory alive."""
        import ctypes

        from ._library import PlanCopyC

        keep = []
        array = (PlanCopyC * (len(self.copies) + len(self.kept)))()
        for entry, c in zip(array, self.copies):
            dims = []
            for values in (c.shape, c.src_strides, c.dst_strides):
                block = (ctypes.c_int64 * max(len(values), 1))(*values)
                dims.append(block)
            names = (c.wire.encode(), c.engine.encode())
            keep.extend(dims)
            keep.extend(names)
            entry.wire, entry.engine = names
            entry.ndim = len(c.shape)
            entry.shape, entry.src_strides, entry.dst_strides = (
                ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims
            )
            entry.src_offset = c.src_offset
            entry.dst_offset = c.dst_offset
        for entry, name in zip(array[len(self.copies):], self.kept):
            engine = name.encode()  # wire NULL: a kept tensor
            keep.append(engine)
            entry.engine = engine
        return array, keep

    def _c_quantized(self):
        """The quantized tensors as a shadowsync_plan_quantization_t array (None without any),
        and what keeps its memory alive."""
        from ._library import PlanQuantizationC

        if not self.quantized:
            return None, []
        array = (PlanQuantizationC * len(self.quantized))()
        keep = []
        for entry, q in zip(array, self.quantized):
            names = (q.engine.encode(), q.scale.encode())
            keep.extend(names)
            entry.engine, entry.scale = names
            entry.parts = int(q.parts)
        return array, keep


def needed_ranges(layout, plan: ReceivePlan | None = None) -> list[WireRange]:
    """The bytes of the wire layout that a receiver of `layout` (the engine's) with receive plan
    `plan` reads of each update, sorted and merged per group: what the plan's copies read, or
    without a plan every tensor of `layout`, a range each. What that receiver's
    ``Receiver.needed_ranges()`` returns, asked without making one (which would allocate both
    slots for a question): an engine rank's needs for a RoutingPlan, before it connects. The
    plan is checked as ``Receiver(layout, ..., plan=plan)`` checks it, and refused alike
    (LayoutMismatchError, InvalidArgumentError naming the tensors). One implementation with the
    receiver's: shadowsync_receive_plan_needed_ranges. Thread-safe."""
    if plan is None:
        ranges = call_array("shadowsync_receive_plan_needed_ranges", WireRangeC, layout.handle,
                            None, None, 0, None, 0)
    else:
        copies, _keep = plan._c_array()
        quantized, _keep_names = plan._c_quantized()
        ranges = call_array("shadowsync_receive_plan_needed_ranges", WireRangeC, layout.handle,
                            plan.wire.handle, copies, len(copies), quantized, len(plan.quantized))
    return [WireRange(r.group, r.begin, r.end) for r in ranges]
