"""The sender (sender.h): the trainer side.

Sender.publish() checks every tensor against the layout in Python first (name, dtype, shape,
device, contiguity, missing or repeated tensors), so that a bad input raises before the library is
called and nothing is sent; the library then checks again and returns at once, its worker thread
broadcasting bucket by bucket. The returned PublishHandle is the only thing to wait on.

For ZeRO-3 style trainers, publish_streamed() starts an update with no tensor yet; its gather()
asks a callback for each bucket's tensors in layout order, so that only one bucket's parameters
need to be gathered at a time.
"""

from __future__ import annotations

import base64
import ctypes
import threading
from ctypes import byref, c_char_p, c_int, c_size_t, c_void_p
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from . import tensors as _tensors
from ._handle import Handle
from ._library import MAX_HEADER_BYTES, SenderConfigC, SourceShardC, UpdateHeaderC, config_struct
from .backend import Backend
from .errors import IN_PROGRESS, InvalidArgumentError, ShadowsyncTimeoutError, call, call_status
from .layout import Layout, UpdateHeader, format_shape, region_struct
from .regions import TensorRegion
from .transport import Transport


@dataclass
class SenderConfig:
    """shadowsync_sender_config_t; None takes the library's default."""

    root_rank: int | None = None  # this process's rank in the transport (0)
    update_deadline_ms: int | None = None  # whole update, a streamed publish's gathering too (60000)
    poll_interval_us: int | None = None  # (200)
    # Send a checksum per bucket; receivers verify it before the update is offered (True).
    checksums: bool | None = None


def _group_array(groups: Sequence[str]):
    encoded = [g.encode() for g in groups]
    return (c_char_p * max(len(encoded), 1))(*encoded), encoded


def _version_marks(descs) -> list[tuple[str, object, int]]:
    """(name, tensor, torch's version counter now) of each torch tensor among `descs`: what
    changed_in_flight compares (numpy arrays keep no such counter)."""
    return [(d.name, d.tensor, d.tensor._version) for d in descs
            if d.kind == "torch" and hasattr(d.tensor, "_version")]


class PublishHandle(Handle):
    """One update being sent. done() polls, wait() blocks; neither is needed for the update to
    proceed. Thread-safe."""

    _destroy_fn = "shadowsync_publish_destroy"

    def __init__(self, value: int, keepalive=None, marks=None):
        super().__init__(value)
        # The tensors the library reads until the update is done (the Sender holds the handle
        # until then, whether or not the caller keeps it).
        self._keepalive = keepalive
        # Their torch version counters at publish: a tensor changed in place (an optimizer step)
        # while the update still reads it would send a mix of old and new bytes. _changed: what
        # changed_in_flight found, kept for wait().
        self._marks = marks or []
        self._changed: str | None = None
        c = UpdateHeaderC()
        call("shadowsync_publish_header", self._handle, byref(c))
        self.header = UpdateHeader._from_c(c)
        buffer = ctypes.create_string_buffer(MAX_HEADER_BYTES)
        written = c_size_t()
        call("shadowsync_publish_header_bytes", self._handle, buffer, MAX_HEADER_BYTES, byref(written))
        self.header_bytes: bytes = buffer.raw[: written.value]

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def header_base64(self) -> str:
        """header_bytes as base64 text, for an RPC that carries JSON (vLLM's /collective_rpc):
        the vLLM worker's begin_update takes it as it takes the bytes."""
        return base64.b64encode(self.header_bytes).decode("ascii")

    def done(self) -> bool:
        """Finished, successfully or not. Never blocks."""
        flag = c_int()
        call("shadowsync_publish_done", self._handle, byref(flag))
        if flag.value:
            self._keepalive = None
            self._marks = []
        return bool(flag.value)

    def changed_in_flight(self) -> str | None:
        """Which of the update's torch tensors was seen changed in place since publish while the
        update was still being sent (its name and both version counters), else None; once seen,
        always. The library may have read part of such a tensor before the change and part
        after. A change seen only once the update was done is none of this."""
        if self._changed is None:
            for name, tensor, version in self._marks:
                now = tensor._version
                if now == version:
                    continue
                # Seen changed, and the update still not done after that: the change came first.
                if not self.done():
                    self._changed = (
                        f"tensor '{name}' was changed in place while update {self.version} was "
                        f"still being sent (torch's version counter went from {version} to "
                        f"{now}): the engines may have taken a mix of its old and new bytes")
                break
        return self._changed

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the update was sent; raises the update's error if it failed, and
        ShadowsyncTimeoutError if `timeout` seconds pass first (the update goes on). Raises
        InvalidArgumentError once it is sent if one of its torch tensors was changed in place
        while it was still being sent (an optimizer step before this wait): publish again before
        relying on the engines' weights, and wait before the parameters change."""
        self.changed_in_flight()
        timeout_ms = -1 if timeout is None else max(0, int(timeout * 1000))
        status = call_status("shadowsync_publish_wait", self._handle, timeout_ms)
        if status == IN_PROGRESS:
            raise ShadowsyncTimeoutError(
                f"update {self.version}: still being sent after {timeout} s (wait again, or poll "
                f"done())"
            )
        self._keepalive = None
        self._marks = []
        if self._changed is not None:
            raise InvalidArgumentError(
                f"{self._changed}; wait for the update (handle.wait()) before the parameters "
                f"change, and publish again to make the engines' weights whole")

    def close(self) -> None:
        """Releases the handle; the update keeps running. While the library still reads the
        tensors of a publish(), the release waits for the Sender to see the update done."""
        if self._closed:
            return
        if self._keepalive is not None and not self.done():
            self._close_when_done = True
            return
        super().close()

    _close_when_done = False


class StreamedPublish:
    """An update whose tensors are supplied while it runs, in layout order (Sender.publish_streamed).
    Send ``header_bytes`` to the receivers first, then call gather() (or supply()) on the thread
    that gathers. ``handle`` tracks the update."""

    def __init__(self, handle: PublishHandle, sender: "Sender", groups: list[str]):
        self.handle = handle
        self._sender = sender
        self.groups = groups
        self._supplied = 0
        self._order = [t for names in sender.layout.bucket_plan(groups) for t in names]

    @property
    def header_bytes(self) -> bytes:
        return self.handle.header_bytes

    @property
    def version(self) -> int:
        return self.handle.version

    def buckets(self) -> list[list[str]]:
        """Names per bucket in supply order (Layout.bucket_plan of this update's groups)."""
        return self._sender.layout.bucket_plan(self.groups)

    def gather(self, gather_fn: Callable[[list[str], Callable], None]) -> PublishHandle:
        """Calls ``gather_fn(names, supply)`` once per bucket (see buckets()); it must call
        ``supply(tensors)`` with exactly those tensors (a mapping or (name, tensor) pairs) while
        they are gathered, e.g. inside deepspeed.zero.GatheredParameters. supply returns once
        their bytes were copied out; then they may be freed. A tensor that fails its check, a
        callback that raises or supplies too little cancels the update (the receivers discard it,
        their live weights untouched) and raises. Returns the handle; the last buckets may still
        be in flight. Runs on the calling thread (gathers are the trainer's collectives)."""
        try:
            for names in self.buckets():
                before = self._supplied
                gather_fn(list(names), self.supply)
                if self._supplied != before + len(names):
                    missing = self._order[self._supplied : before + len(names)]
                    raise InvalidArgumentError(
                        f"update {self.version}: the gather callback supplied "
                        f"{self._supplied - before} of the {len(names)} tensors of its bucket; "
                        f"missing: {missing}"
                    )
        except BaseException:
            self.cancel()
            raise
        return self.handle

    def supply(self, tensors) -> None:
        """Supplies the next tensors in layout order. Each is checked (name in order, dtype,
        shape, device, contiguity) before anything of this call is supplied; blocks until their
        bytes were copied out. One thread at a time."""
        pairs = _tensors.items(tensors)
        descs = []
        for i, (name, tensor) in enumerate(pairs):
            position = self._supplied + i
            if position >= len(self._order):
                raise InvalidArgumentError(
                    f"update {self.version}: tensor '{name}' supplied but all {len(self._order)} "
                    f"tensors were supplied already"
                )
            expected = self._order[position]
            if name != expected:
                raise InvalidArgumentError(
                    f"update {self.version}: tensor '{name}' supplied where '{expected}' (number "
                    f"{position} in layout order) is next"
                )
            desc = _tensors.describe(name, tensor)
            _tensors.check(desc, self._sender.layout.tensor(name), self._sender.backend.device)
            descs.append(desc)
        _tensors.synchronize_producers(descs)
        source = _tensors.SourceArray(descs)
        call("shadowsync_publish_supply", self.handle.handle, source.array, source.count)
        self._supplied += len(descs)

    def cancel(self) -> None:
        """Gives up on an incomplete update: it fails and the receivers discard it. Releasing
        the C handle does this (the library cancels a streamed publish whose handle goes away
        before every tensor was supplied)."""
        if self._supplied < len(self._order):
            Handle.close(self.handle)


class _ShardArray:
    """The C array of shadowsync_source_shard_t for checked shards, and what keeps its pointers
    valid (names, regions and the tensors themselves) for as long as this object lives."""

    def __init__(self, shards: list[tuple[_tensors.TensorDesc, TensorRegion]]):
        self.count = len(shards)
        self.array = (SourceShardC * max(self.count, 1))()
        self._keep = []
        for i, (desc, region) in enumerate(shards):
            c_region, keep = region_struct(region)
            dtype = desc.dtype.encode()
            self._keep += [keep, dtype, desc.tensor]
            self.array[i] = SourceShardC(c_region, desc.data_ptr, dtype)


class Sender(Handle):
    """The trainer side: the broadcast root of `transport` (taken), or with `routing_plan` and
    `trainer_rank` one trainer rank of a sharded trainer (DESIGN §14), which publishes only its
    shards (publish_shards) through a transport that moves the plan's routes for that rank.
    Thread-safe."""

    _destroy_fn = "shadowsync_sender_destroy"

    def __init__(
        self,
        layout: Layout,
        backend: Backend,
        transport: Transport,
        config: SenderConfig | None = None,
        *,
        routing_plan=None,
        trainer_rank: int | None = None,
    ):
        if (routing_plan is None) != (trainer_rank is None):
            raise InvalidArgumentError(
                f"Sender: routing_plan and trainer_rank go together (a trainer rank of a routing "
                f"plan), got routing_plan {'set' if routing_plan is not None else 'None'} and "
                f"trainer_rank {trainer_rank}")
        c_config = config_struct(SenderConfigC, **vars(config)) if config is not None else None
        handle = c_void_p()
        if routing_plan is None:
            call(
                "shadowsync_sender_create",
                layout.handle,
                backend.handle,
                transport.handle,
                byref(c_config) if c_config is not None else None,
                byref(handle),
            )
        else:
            # Routed updates carry no checksums yet: the library's default here is off.
            call(
                "shadowsync_sender_create_for_trainer_rank",
                layout.handle,
                routing_plan.handle,
                int(trainer_rank),
                backend.handle,
                transport.handle,
                byref(c_config) if c_config is not None else None,
                byref(handle),
            )
        super().__init__(handle.value)
        transport._disown()
        self.layout = layout
        self.backend = backend
        self.routing_plan = routing_plan
        self.trainer_rank = trainer_rank
        self._inflight: list[PublishHandle] = []
        self._inflight_lock = threading.Lock()

    @property
    def routes_in_place(self) -> tuple[bool | None, str]:
        """A trainer rank of a routing plan, its last update: (True, "") when the engines read
        its routes where its shards lie (GPU memory shared over CUDA IPC: nothing packed on this
        rank), (False, why) when they were packed into the staging (host memory, memory CUDA IPC
        cannot share such as PyTorch's expandable segments, a transport that cannot), (None, "")
        before the first routed update. Thread-safe."""
        in_place = ctypes.c_int32()
        length = c_size_t()
        call("shadowsync_sender_routes_in_place", self._handle, byref(in_place), None, 0,
             byref(length))
        buffer = ctypes.create_string_buffer(length.value + 1)
        call("shadowsync_sender_routes_in_place", self._handle, byref(in_place), buffer,
             len(buffer), None)
        state = None if in_place.value < 0 else bool(in_place.value)
        return state, buffer.value.decode(errors="replace")

    @property
    def staging_bytes(self) -> int:
        """The staging memory the sender packs into: two buckets, or for a trainer rank of a
        routing plan two slots of the plan's max_packed_bytes of its rank. Thread-safe."""
        out = ctypes.c_uint64()
        call("shadowsync_sender_staging_bytes", self._handle, byref(out))
        return out.value

    def publish_shards(self, version: int, shards, groups: Iterable[str] | None = None
                       ) -> PublishHandle:
        """A trainer rank of a routing plan: publishes `groups` (default: every group of the
        layout, which every rank then publishes alike) at `version` from this rank's shards and
        returns at once. `shards`: (name, tensor, TensorRegion) triples, the tensor (a numpy array
        or a torch tensor on the backend's device, contiguous) holding `region` of wire tensor
        `name` in the region's row-major order. Every tensor the plan has this rank hold must be
        given, with its spec's dtype and the region the plan was built with; others are ignored.
        Anything else raises InvalidArgumentError naming the tensor, the rank and both values;
        nothing is sent. The shards must stay unchanged until the handle is done; the Sender
        keeps them alive until then."""
        selected = ([self.layout.group(g).name for g in groups] if groups is not None
                    else [g.name for g in self.layout.groups])
        checked = []
        for entry in shards:
            try:
                name, tensor, region = entry
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"update {version}: expected (name, tensor, TensorRegion) triples, got an "
                    f"entry of type {type(entry).__name__}") from None
            if not isinstance(region, TensorRegion) or region.tensor != name:
                raise InvalidArgumentError(
                    f"update {version}: the shard of tensor '{name}' comes with region {region!r}; "
                    f"give a TensorRegion of that tensor")
            info = self.layout.tensor(name)  # raises naming an unknown tensor
            desc = _tensors.describe(name, tensor)
            if desc.dtype != info.dtype:
                raise InvalidArgumentError(
                    f"update {version}: trainer rank {self.trainer_rank}: the shard of tensor "
                    f"'{name}' has dtype {desc.dtype_repr}, the layout {info.dtype}")
            if not desc.contiguous:
                raise InvalidArgumentError(
                    f"update {version}: trainer rank {self.trainer_rank}: the shard of tensor "
                    f"'{name}' is not contiguous (strides {desc.strides}); pass a contiguous copy")
            if desc.device != self.backend.device:
                raise InvalidArgumentError(
                    f"update {version}: trainer rank {self.trainer_rank}: the shard of tensor "
                    f"'{name}' is on {desc.device}, the sender's backend on {self.backend.device}")
            numel = 1
            for d in desc.shape:
                numel *= d
            if numel != region.numel:
                raise InvalidArgumentError(
                    f"update {version}: trainer rank {self.trainer_rank}: the shard of tensor "
                    f"'{name}' has {numel} elements (shape {format_shape(desc.shape)}), its "
                    f"region {region.numel} (shape {format_shape(region.shape)})")
            checked.append((desc, region))
        self._refuse_changed_in_flight(version)
        _tensors.synchronize_producers([desc for desc, _ in checked])
        return self._start_publish("shadowsync_sender_publish_shards", version, selected,
                                   _ShardArray(checked), [desc for desc, _ in checked])

    def publish(self, version: int, tensors, groups: Iterable[str] | None = None) -> PublishHandle:
        """Publishes `groups` at `version` from `tensors` (a mapping of names to tensors, or
        (name, tensor) pairs such as ``model.named_parameters()``: numpy arrays, or torch tensors
        on the backend's device) and returns at once.

        `groups` defaults to the groups the given tensors belong to (pass only a LoRA adapter's
        tensors for a LoRA-only update). Every tensor of those groups must be given, with its
        spec's dtype and shape, contiguous, on the backend's device; tensors of other groups are
        ignored. Anything else raises InvalidArgumentError naming the tensor and both values, and
        nothing is sent. The tensors must stay unchanged until the handle is done; the Sender
        keeps them alive until then."""
        pairs = _tensors.items(tensors)
        descs = self._check(version, pairs, groups)
        selected = self._selected_groups(pairs, groups)
        wanted = {t.name for g in selected for t in self.layout.group(g).tensors}
        descs = [d for d in descs if d.name in wanted]
        self._refuse_changed_in_flight(version)
        _tensors.synchronize_producers(descs)
        return self._start_publish("shadowsync_sender_publish", version, selected,
                                   _tensors.SourceArray(descs), descs)

    def publish_streamed(self, version: int, groups: Iterable[str]) -> StreamedPublish:
        """Starts publishing `groups` at `version` with no tensor yet and returns at once: send
        its header_bytes to the receivers, then supply the tensors with gather() or supply()."""
        groups = [self.layout.group(g).name for g in groups]
        group_array, _keep = _group_array(groups)
        handle = c_void_p()
        call(
            "shadowsync_sender_publish_streamed",
            self._handle,
            int(version),
            group_array,
            len(groups),
            byref(handle),
        )
        return StreamedPublish(PublishHandle(handle.value), self, groups)

    def replace_transport(self, transport: Transport) -> None:
        """Installs a new transport after a failure aborted the old one."""
        call("shadowsync_sender_replace_transport", self._handle, transport.handle)
        transport._disown()

    def close(self) -> None:
        """Waits for the updates already published (each bounded by its deadline), then stops."""
        if self._closed:
            return
        super().close()
        with self._inflight_lock:
            finished, self._inflight = self._inflight, []
        for p in finished:
            p._keepalive = None  # the library is done with every tensor
            if p._close_when_done:
                p.close()

    # --- checks ---------------------------------------------------------------------------------

    def _selected_groups(self, pairs, groups) -> list[str]:
        if groups is not None:
            return [self.layout.group(g).name for g in groups]
        present = {self.layout.tensor(name).group_index for name, _ in pairs}
        return [g.name for g in self.layout.groups if g.index in present]

    def _check(self, version, pairs, groups) -> list[_tensors.TensorDesc]:
        """Every check the library makes, in Python and first, with the tensor-side detail the
        library cannot see (device, strides)."""
        if not pairs and groups is None:
            raise InvalidArgumentError(f"update {version}: no tensors given and no groups named")
        seen = set()
        descs = []
        selected = set(self._selected_groups(pairs, groups))
        if not selected:
            raise InvalidArgumentError(f"update {version}: no groups to publish")
        for name, tensor in pairs:
            if name in seen:
                raise InvalidArgumentError(f"update {version}: tensor '{name}' given twice")
            seen.add(name)
            info = self.layout.tensor(name)  # raises naming an unknown tensor
            if info.group not in selected:
                continue
            desc = _tensors.describe(name, tensor)
            _tensors.check(desc, info, self.backend.device)
            descs.append(desc)
        for g in self.layout.groups:
            if g.name not in selected:
                continue
            for t in g.tensors:
                if t.name not in seen:
                    raise InvalidArgumentError(
                        f"update {version}: tensor '{t.name}' of group '{g.name}' (dtype {t.dtype}, "
                        f"shape {format_shape(t.shape)}) is missing"
                    )
        return descs

    def _refuse_changed_in_flight(self, version: int) -> None:
        """An earlier update still being sent whose torch tensors were changed in place since its
        publish (the parameters changed before its wait): raises InvalidArgumentError naming
        it, before update `version` is sent."""
        with self._inflight_lock:
            inflight = list(self._inflight)
        for p in inflight:
            if p.closed or p.done():
                continue
            changed = p.changed_in_flight()
            if changed is not None:
                raise InvalidArgumentError(
                    f"update {version} not sent: {changed}; wait for each update "
                    f"(handle.wait()) before the parameters change, then publish again")

    def _start_publish(self, function: str, version: int, selected: Sequence[str],
                       source, descs) -> PublishHandle:
        # One publish through the C call `function` (shadowsync_sender_publish or _publish_shards)
        # from `source` (an array of sources with .array and .count), which the handle keeps
        # alive, made of `descs`.
        group_array, _keep = _group_array(selected)
        handle = c_void_p()
        call(
            function,
            self._handle,
            int(version),
            group_array,
            len(selected),
            source.array,
            source.count,
            byref(handle),
        )
        publish = PublishHandle(handle.value, keepalive=source, marks=_version_marks(descs))
        self._track(publish)
        return publish

    def _track(self, publish: PublishHandle) -> None:
        # Keeps each publish (and through it the tensors it reads) alive until it is done, even
        # when the caller drops the handle at once.
        with self._inflight_lock:
            running = []
            for p in self._inflight:
                if p.closed:
                    continue  # the caller closed it once it was done: nothing left to keep
                if not p.done():
                    running.append(p)
                elif p._close_when_done:
                    p.close()
            self._inflight = running + [publish]
