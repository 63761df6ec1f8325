"""What a trainer rank holds of a wire tensor (DESIGN §14), in tensor coordinates.

A *box* is an index range per dimension (an FSDP2 ``Shard(d)`` slice, a Megatron column- or
row-parallel slice); *elements* is a flat range of the row-major tensor (a ZeRO-3 partition of a
flattened parameter). The routing plan turns regions into byte ranges of the wire arena
(``Layout.region_ranges``). Pure data: nothing here touches the library or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

from .errors import InvalidArgumentError

BOX = "box"
ELEMENTS = "elements"


@dataclass(frozen=True)
class TensorRegion:
    """Part of wire tensor ``tensor``: ``begin[d] <= index[d] < end[d]`` (kind "box") or
    elements ``[first, first + count)`` in row-major order (kind "elements")."""

    tensor: str
    kind: str
    begin: tuple[int, ...] = ()
    end: tuple[int, ...] = ()
    first: int = 0
    count: int = 0

    @staticmethod
    def box(tensor: str, begin: Sequence[int], end: Sequence[int]) -> "TensorRegion":
        begin, end = tuple(int(b) for b in begin), tuple(int(e) for e in end)
        if len(begin) != len(end):
            raise InvalidArgumentError(
                f"region of tensor '{tensor}': begin has {len(begin)} dimensions, end "
                f"{len(end)}; give one index per dimension to each")
        for d, (b, e) in enumerate(zip(begin, end)):
            if not 0 <= b < e:
                raise InvalidArgumentError(
                    f"region of tensor '{tensor}': dimension {d} runs {b}..{e}; a box needs "
                    f"0 <= begin < end in every dimension (a rank holding nothing of a tensor "
                    f"has no region for it)")
        return TensorRegion(tensor, BOX, begin, end)

    @staticmethod
    def elements(tensor: str, first: int, count: int) -> "TensorRegion":
        first, count = int(first), int(count)
        if first < 0 or count <= 0:
            raise InvalidArgumentError(
                f"region of tensor '{tensor}': elements from {first}, {count} of them; give "
                f"first >= 0 and count > 0 (a rank holding nothing of a tensor has no region "
                f"for it)")
        return TensorRegion(tensor, ELEMENTS, first=first, count=count)

    @staticmethod
    def whole(tensor: str, shape: Sequence[int]) -> "TensorRegion":
        """All of a tensor: the box of its shape (a 0-d tensor: its one element)."""
        shape = tuple(int(d) for d in shape)
        if not shape:
            return TensorRegion.elements(tensor, 0, 1)
        return TensorRegion.box(tensor, (0,) * len(shape), shape)

    @property
    def numel(self) -> int:
        """How many elements the region covers."""
        if self.kind == ELEMENTS:
            return self.count
        return prod(e - b for b, e in zip(self.begin, self.end))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the local shard the region describes ((count,) for elements)."""
        if self.kind == ELEMENTS:
            return (self.count,)
        return tuple(e - b for b, e in zip(self.begin, self.end))


@dataclass(frozen=True)
class WireRange:
    """Bytes ``[begin, end)`` of group number ``group``'s wire arena (the wire layout's group
    order): what an engine rank needs, or a trainer rank holds, once regions are resolved."""

    group: int
    begin: int
    end: int
