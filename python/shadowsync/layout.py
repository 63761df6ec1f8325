"""Layouts (layout.h) and update headers (update_header.h).

A Layout is built by the library from tensor specs; its fingerprint is what sender and receiver
compare. The Python object reads every group's and tensor's placement once at creation, so that
lookups (done per tensor on the publish path) never cross into C.
"""

from __future__ import annotations

import ctypes
from ctypes import byref, c_char_p, c_int64, c_size_t, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from . import _library
from ._handle import Handle
from ._library import MAX_HEADER_BYTES, TensorRegionC, TensorSpecC, UpdateHeaderC, WireRangeC
from .errors import InvalidArgumentError, call, call_array
from .regions import BOX, ELEMENTS, TensorRegion, WireRange

BASE_GROUP = "base"


def canonical_dtype(dtype: str) -> tuple[str, int]:
    """(canonical name, element bytes) of a dtype name or alias the library knows: "bf16",
    "torch.bfloat16", "float32", "half", ... Raises InvalidArgumentError naming it otherwise."""
    canonical = c_char_p()
    size = c_size_t()
    call("shadowsync_dtype_info", str(dtype).encode(), byref(canonical), byref(size))
    return canonical.value.decode(), size.value


def format_shape(shape: Sequence[int]) -> str:
    """As the C++ side writes shapes: [4096, 32000]."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor: name, dtype (any name the library knows), shape, group."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    group: str = BASE_GROUP

    @staticmethod
    def coerce(spec) -> "TensorSpec":
        """A TensorSpec from a TensorSpec, a (name, dtype, shape[, group]) tuple or a dict."""
        if isinstance(spec, TensorSpec):
            return spec
        if isinstance(spec, Mapping):
            return TensorSpec(
                spec["name"], str(spec["dtype"]), tuple(spec["shape"]), spec.get("group", BASE_GROUP)
            )
        spec = tuple(spec)
        if len(spec) not in (3, 4):
            raise InvalidArgumentError(
                f"tensor spec {spec!r}: expected (name, dtype, shape[, group]), got {len(spec)} "
                f"fields"
            )
        group = spec[3] if len(spec) == 4 and spec[3] is not None else BASE_GROUP
        return TensorSpec(spec[0], str(spec[1]), tuple(int(d) for d in spec[2]), group)


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lies: its group's arena, at `offset`, `bytes` long."""

    name: str
    dtype: str  # canonical
    shape: tuple[int, ...]
    offset: int
    bytes: int
    group: str
    group_index: int
    index: int  # in its group


@dataclass(frozen=True)
class GroupInfo:
    name: str
    index: int
    arena_bytes: int
    bucket_bytes: int
    bucket_count: int
    tensors: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class UpdateHeader:
    """What a trainer announces for one update (update_header.h)."""

    version: int
    layout_fingerprint: int
    groups: tuple[int, ...]
    bucket_count: int
    magic: int
    protocol_version: int

    @staticmethod
    def _from_c(c: UpdateHeaderC) -> "UpdateHeader":
        return UpdateHeader(
            version=c.version,
            layout_fingerprint=c.layout_fingerprint,
            groups=tuple(c.groups[: c.group_count]),
            bucket_count=c.bucket_count,
            magic=c.magic,
            protocol_version=c.protocol_version,
        )

    def _to_c(self) -> UpdateHeaderC:
        if not 1 <= len(self.groups) <= _library.MAX_HEADER_GROUPS:
            raise InvalidArgumentError(
                f"update header: {len(self.groups)} groups, outside 1..{_library.MAX_HEADER_GROUPS}"
            )
        c = UpdateHeaderC()
        c.magic = self.magic
        c.protocol_version = self.protocol_version
        c.version = self.version
        c.layout_fingerprint = self.layout_fingerprint
        c.group_count = len(self.groups)
        for i, g in enumerate(self.groups):
            c.groups[i] = g
        c.bucket_count = self.bucket_count
        return c

    def to_bytes(self) -> bytes:
        """The serialized header (little-endian, the control channel's field order)."""
        c = self._to_c()
        buffer = ctypes.create_string_buffer(MAX_HEADER_BYTES)
        written = c_size_t()
        call("shadowsync_header_serialize", byref(c), buffer, MAX_HEADER_BYTES, byref(written))
        return buffer.raw[: written.value]

    @staticmethod
    def from_bytes(data: bytes) -> "UpdateHeader":
        """Parses header bytes; BadHeaderError when their structure is wrong. The receiver checks
        the rest (fingerprint, version, groups) in begin_update."""
        data = bytes(data)
        c = UpdateHeaderC()
        call("shadowsync_header_parse", data, len(data), byref(c))
        return UpdateHeader._from_c(c)



def region_struct(region: TensorRegion) -> tuple[TensorRegionC, list]:
    """`region` as shadowsync_tensor_region_t, and what keeps its pointers valid."""
    c = TensorRegionC()
    tensor = str(region.tensor).encode()
    c.tensor = tensor
    keep: list = [tensor]
    if region.kind == BOX:
        c.kind = _library.REGION_BOX
        c.ndim = len(region.begin)
        begin = (c_int64 * max(len(region.begin), 1))(*region.begin)
        end = (c_int64 * max(len(region.end), 1))(*region.end)
        c.begin = ctypes.cast(begin, ctypes.POINTER(c_int64))
        c.end = ctypes.cast(end, ctypes.POINTER(c_int64))
        keep += [begin, end]
    elif region.kind == ELEMENTS:
        c.kind = _library.REGION_ELEMENTS
        c.first, c.count = region.first, region.count
    else:
        raise InvalidArgumentError(
            f"region of tensor '{region.tensor}': kind '{region.kind}' is not '{BOX}' or "
            f"'{ELEMENTS}'")
    return c, keep

class Layout(Handle):
    """The ordered tensor specs of every group, placed in one arena per group (Layout::build).

    ``bucket_bytes`` 0 takes the library's default (512 MiB); otherwise a positive multiple of
    256. Receivers and senders made from a layout keep their own copy. Thread-safe."""

    _destroy_fn = "shadowsync_layout_destroy"

    def __init__(self, specs: Iterable, bucket_bytes: int = 0):
        specs = [TensorSpec.coerce(s) for s in specs]
        c_specs = (TensorSpecC * max(len(specs), 1))()
        keep = []  # the shape arrays must outlive the call
        for i, s in enumerate(specs):
            shape = (c_int64 * max(len(s.shape), 1))(*s.shape)
            keep.append(shape)
            c_specs[i] = TensorSpecC(
                str(s.name).encode(),
                str(s.dtype).encode(),
                ctypes.cast(shape, ctypes.POINTER(c_int64)) if s.shape else None,
                len(s.shape),
                str(s.group).encode() if s.group is not None else None,
            )
        handle = c_void_p()
        call("shadowsync_layout_create", c_specs, len(specs), int(bucket_bytes), byref(handle))
        super().__init__(handle.value)
        self._read_placements()

    @classmethod
    def from_named_tensors(cls, named_tensors, group_of=None, bucket_bytes: int = 0) -> "Layout":
        """A layout of the tensors as they are (numpy arrays or torch tensors, e.g. a model's
        ``named_parameters()``), in their order; ``group_of(name)`` names each one's group
        (default "base")."""
        from .tensors import describe, items

        specs = []
        for name, tensor in items(named_tensors):
            t = describe(name, tensor)
            group = group_of(name) if group_of is not None else BASE_GROUP
            specs.append(TensorSpec(name, t.dtype, t.shape, group))
        return cls(specs, bucket_bytes)

    def _read_placements(self) -> None:
        fingerprint = c_uint64()
        call("shadowsync_layout_fingerprint", self._handle, byref(fingerprint))
        self._fingerprint = fingerprint.value
        count = c_size_t()
        call("shadowsync_layout_group_count", self._handle, byref(count))
        groups = []
        for g in range(count.value):
            gi = _library.GroupInfoC()
            call("shadowsync_layout_group_info", self._handle, g, byref(gi))
            group_name = gi.name.decode()
            tensors = []
            for t in range(gi.tensor_count):
                ti = _library.TensorInfoC()
                call("shadowsync_layout_tensor_info", self._handle, g, t, byref(ti))
                tensors.append(
                    TensorInfo(
                        name=ti.name.decode(),
                        dtype=ti.dtype.decode(),
                        shape=tuple(ti.shape[d] for d in range(ti.ndim)),
                        offset=ti.offset,
                        bytes=ti.bytes,
                        group=group_name,
                        group_index=g,
                        index=t,
                    )
                )
            groups.append(
                GroupInfo(
                    group_name, g, gi.arena_bytes, gi.bucket_bytes, gi.bucket_count, tuple(tensors)
                )
            )
        self._groups = tuple(groups)
        self._by_name = {t.name: t for g in groups for t in g.tensors}
        self._group_by_name = {g.name: g for g in groups}

    @property
    def fingerprint(self) -> int:
        """64-bit hash of the canonical layout; sender and receiver must agree."""
        return self._fingerprint

    @property
    def groups(self) -> tuple[GroupInfo, ...]:
        """Groups in layout order: "base" first, then adapters in order of first appearance."""
        return self._groups

    @property
    def specs(self) -> list[TensorSpec]:
        """The specs in layout order with canonical dtypes: plain data to send to the engines
        (e.g. through collective_rpc), which rebuild the same layout from them."""
        return [TensorSpec(t.name, t.dtype, t.shape, t.group) for g in self._groups for t in g.tensors]

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidArgumentError(
                f"tensor '{name}' is not in the layout ({len(self._by_name)} tensors in groups "
                f"{[g.name for g in self._groups]})"
            ) from None

    def group(self, name: str) -> GroupInfo:
        try:
            return self._group_by_name[name]
        except KeyError:
            raise InvalidArgumentError(
                f"group '{name}' is not in the layout (groups: {[g.name for g in self._groups]})"
            ) from None

    def bucket_plan(self, groups: Sequence[str]) -> list[list[str]]:
        """The order a streamed publish of `groups` takes its tensors in, cut per bucket: one
        list of names per (group, bucket) that some tensor starts in. Groups in layout order,
        tensors in spec order. Every trainer rank runs its ZeRO-3 gathers in this order."""
        selected = sorted({self.group(g).index for g in groups})
        plan = []
        for g in selected:
            group = self._groups[g]
            current_bucket, names = None, []
            for t in group.tensors:
                bucket = t.offset // group.bucket_bytes
                if bucket != current_bucket and names:
                    plan.append(names)
                    names = []
                current_bucket = bucket
                names.append(t.name)
            if names:
                plan.append(names)
        return plan

    def region_ranges(self, region: TensorRegion) -> list[WireRange]:
        """The bytes of this layout's arenas that `region` of a tensor covers, sorted and merged
        (shadowsync_layout_region_ranges): a box of whole rows is one range, a box of part rows
        (a Megatron row-parallel slice, FSDP2 Shard(1)) one range per row. Raises
        InvalidArgumentError naming the tensor and the box or elements when they are empty or
        outside its shape, LayoutMismatchError for a tensor the layout does not have. Thread-safe."""
        c, _keep = region_struct(region)
        ranges = call_array("shadowsync_layout_region_ranges", WireRangeC, self._handle, byref(c))
        return [WireRange(r.group, r.begin, r.end) for r in ranges]

    def __repr__(self) -> str:
        groups = ", ".join(f"{g.name}: {len(g.tensors)} tensors" for g in self._groups)
        return f"Layout({groups}; fingerprint {self._fingerprint:#018x})"
