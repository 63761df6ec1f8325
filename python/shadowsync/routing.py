"""The routing plan of a sharded trainer (DESIGN §14; core/routing_plan.h through the C ABI).

Which bytes of the wire layout go from which trainer rank to which engine rank, so that every
byte moves once, from the rank that holds it, to each rank that needs it: no gather of a full
tensor on any rank. Every trainer and engine rank builds the same plan from the same inputs and
compares ``fingerprint``. A trainer rank holds regions of wire tensors (``TensorRegion``: FSDP2
rows, Megatron slices, ZeRO-3 flat partitions) and packs what it holds of each group in wire
order; a route's ``source_offset`` is into that packing. An engine rank needs wire ranges
(``needed_ranges(layout, plan)``, or ``Receiver.needed_ranges()``: what its receive plan reads).
No transport moves routes yet.
"""

from __future__ import annotations

from ctypes import POINTER, byref, c_uint64, c_void_p, cast, sizeof
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, Union

from ._handle import Handle
from ._library import RankRangesC, RouteC, RoutingPlanInfoC, WireRangeC
from .errors import InvalidArgumentError, call, call_array
from .layout import Layout
from .regions import TensorRegion, WireRange

__all__ = ["Route", "RoutingPlan"]


@dataclass(frozen=True)
class Route:
    """``bytes`` bytes of bucket ``bucket`` of group number ``group``, at ``wire_offset`` of the
    group's wire arena, from trainer rank ``trainer`` (at ``source_offset`` of what it holds of
    the group, packed in wire order) to engine rank ``engine``."""

    trainer: int
    engine: int
    group: int
    bucket: int
    wire_offset: int
    source_offset: int
    bytes: int


# What each rank holds or needs: by position (rank i is the i-th), or {rank: ...}.
RankLists = Union[Sequence[Iterable], Mapping[int, Iterable]]


class RoutingPlan(Handle):
    """Routes from ``trainers`` to ``engines`` over ``wire`` (the trainer's layout).

    ``trainers[r]``: what trainer rank r holds, as TensorRegions and/or WireRanges (a replicated
    tensor in one rank's list only: that rank sends it). ``engines[r]``: what engine rank r needs,
    as WireRanges (``needed_ranges(layout, plan)``); None: one engine rank needing every byte.
    Either may be a mapping {rank: ...} instead of a sequence; ranks must then be 0..M-1 (0..N-1)
    each once. Raises InvalidArgumentError naming the ranks, tensor and bytes: a rank missing,
    outside or given twice, bytes two trainer ranks both hold, bytes an engine rank needs that no
    trainer rank holds, a region outside its tensor. Immutable; thread-safe."""

    _destroy_fn = "shadowsync_routing_plan_destroy"

    def __init__(self, wire: Layout, trainers: RankLists, engines: RankLists | None = None):
        self.wire = wire
        held = [(rank, self._wire_ranges(rank, items, "trainer"))
                for rank, items in _ranked(trainers)]
        c_trainers, keep = _rank_array(held)
        c_engines, count = None, 0
        if engines is not None:
            needed = [(rank, self._wire_ranges(rank, items, "engine"))
                      for rank, items in _ranked(engines)]
            c_engines, keep_engines = _rank_array(needed)
            keep += keep_engines
            count = len(needed)
        handle = c_void_p()
        call("shadowsync_routing_plan_create", wire.handle, c_trainers, len(held), c_engines,
             count, byref(handle))
        super().__init__(handle.value)
        info = RoutingPlanInfoC()
        info.size = sizeof(RoutingPlanInfoC)
        call("shadowsync_routing_plan_info", self._handle, byref(info))
        self._info = info

    def _wire_ranges(self, rank: int, items: Iterable, side: str) -> list[WireRange]:
        out = []
        for item in items:
            if isinstance(item, WireRange):
                out.append(item)
            elif isinstance(item, TensorRegion) and side == "trainer":
                out.extend(self.wire.region_ranges(item))
            else:
                allowed = "TensorRegion or WireRange" if side == "trainer" else "WireRange"
                raise InvalidArgumentError(
                    f"{side} rank {rank}: {item!r} is not a {allowed}")
        return out

    @property
    def fingerprint(self) -> int:
        """Of the wire layout and every route: equal on every rank, or the set-up is wrong."""
        return self._info.fingerprint

    @property
    def trainer_count(self) -> int:
        return self._info.trainer_count

    @property
    def engine_count(self) -> int:
        return self._info.engine_count

    @property
    def route_count(self) -> int:
        """Routes over every group and bucket."""
        return self._info.route_count

    def bytes_to_engine(self, engine: int) -> int:
        """Bytes engine rank `engine` receives per update."""
        out = c_uint64()
        call("shadowsync_routing_plan_bytes_to_engine", self._handle, int(engine), byref(out))
        return out.value

    def bytes_from_trainer(self, trainer: int) -> int:
        """Bytes trainer rank `trainer` sends per update."""
        out = c_uint64()
        call("shadowsync_routing_plan_bytes_from_trainer", self._handle, int(trainer), byref(out))
        return out.value

    def max_packed_bytes(self, trainer: int) -> int:
        """The most trainer rank `trainer` stages for one bucket (its largest packed_range)."""
        out = c_uint64()
        call("shadowsync_routing_plan_max_packed_bytes", self._handle, int(trainer), byref(out))
        return out.value

    def packed_range(self, trainer: int, group: int | str, bucket: int) -> tuple[int, int]:
        """[begin, end) of trainer rank `trainer`'s packing of `group` that the routes of
        `bucket` from it read: what it stages for that bucket ((0, 0): none)."""
        begin, end = c_uint64(), c_uint64()
        call("shadowsync_routing_plan_packed_range", self._handle, int(trainer),
             self._group_index(group), int(bucket), byref(begin), byref(end))
        return begin.value, end.value

    def routes(self, group: int | str, bucket: int) -> list[Route]:
        """The routes of `bucket` of `group` (its index in the wire layout, or its name), by
        trainer rank, then engine rank, then wire offset."""
        routes = call_array("shadowsync_routing_plan_routes", RouteC, self._handle,
                            self._group_index(group), int(bucket))
        return [Route(r.trainer, r.engine, r.group, r.bucket, r.wire_offset, r.source_offset,
                      r.bytes) for r in routes]

    def _group_index(self, group: int | str) -> int:
        return self.wire.group(group).index if isinstance(group, str) else int(group)

    def __repr__(self) -> str:
        return (f"RoutingPlan({self.trainer_count} trainer ranks -> {self.engine_count} engine "
                f"ranks, {self.route_count} routes; fingerprint {self.fingerprint:#018x})")


def _ranked(lists: RankLists) -> list[tuple[int, Iterable]]:
    """(rank, items) pairs: a mapping's keys, or a sequence's positions."""
    if isinstance(lists, Mapping):
        return [(int(rank), items) for rank, items in lists.items()]
    return list(enumerate(lists))


def _rank_array(ranks: list[tuple[int, list[WireRange]]]):
    """The shadowsync_rank_ranges_t array of `ranks`, and the arrays it points into (which must
    outlive the call)."""
    c = (RankRangesC * max(len(ranks), 1))()
    keep = []
    for i, (rank, ranges) in enumerate(ranks):
        array = (WireRangeC * max(len(ranges), 1))(
            *[WireRangeC(r.group, 0, r.begin, r.end) for r in ranges])
        keep.append(array)
        c[i] = RankRangesC(rank, cast(array, POINTER(WireRangeC)), len(ranges))
    return c, keep
