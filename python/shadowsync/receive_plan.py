"""Receive plans (receive_plan.h): how the trainer's tensors (the *wire* layout, as its
``named_parameters()`` gives them) land in the engine's own parameters (the *engine* layout: fused,
sharded, renamed) while the engine keeps generating.

A plan is a list of PlanCopy: one strided copy from a view of a wire tensor into a view of an
engine tensor, in elements. The receiver splits them per wire bucket once, at set-up, and runs
them natively on its stream as each bucket lands.
"""

from __future__ import annotations

from dataclasses import dataclass


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
