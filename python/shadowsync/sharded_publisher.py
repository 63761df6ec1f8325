"""A trainer rank's publisher for a sharded trainer (DESIGN §14): every rank sends what it holds.

Each rank of an FSDP2 / ZeRO-3 / plain-tensor trainer makes one ``ShardedPublisher`` at set-up
and calls ``publish`` on every step. Set-up reads this rank's regions from its parameters
(``sharding.local_shards``: no collective), exchanges every rank's regions with one
``all_gather_object`` (metadata only; call it before arming ``sharding.forbid_gathers``), builds
the ``RoutingPlan`` and serves this rank's same-host pull transport on a daemon thread (serving
blocks until every engine process connected), or with ``engine_gpus`` joins one NCCL communicator
of the trainer ranks and every engine process (engines on other GPUs or hosts) there instead.
``publish`` hands the Sender each local tensor with
its region: no rank gathers, copies or holds a full tensor; the only memory added is the
Sender's packing (``staging_bytes``).

Engine-agnostic: the engine side needs ``engine_setup`` (plain data: the wire layout, every
rank's regions, the engine needs, the paths, the plan's fingerprint) and each update's
``header_bytes`` from one trainer rank (rank 0, say), by whatever channel the engine has.
``sharded_receiver`` builds an engine rank's Receiver from them; an engine with its own receive
plan (vLLM) builds the plan with ``engine_routing_plan`` instead.
"""

from __future__ import annotations

import base64
import threading
from math import prod
from typing import Any, Iterable, Sequence

from .backend import Backend, CudaBackend, HostBackend
from .errors import InvalidArgumentError, LayoutMismatchError, \
    ShadowsyncError, ShadowsyncTimeoutError
from .layout import Layout, TensorSpec, canonical_dtype, format_shape
from .receiver import Receiver, ReceiverConfig
from .regions import ELEMENTS, TensorRegion, WireRange
from .routing import RoutingPlan
from .sender import PublishHandle, Sender, SenderConfig
from .sharding import local_shards
from . import transport as _transport
from .transport import Transport, same_host_pull_engine_transport, \
    same_host_pull_trainer_transport

__all__ = ["ShardedPublisher", "check_replica", "engine_routing_plan", "sharded_receiver"]

_DEFAULT_CONNECT_TIMEOUT_MS = 60000  # the transport's own default


def _dist(process_group):
    """torch.distributed, or None for one trainer process without it (no process group given
    and none initialized: rank 0 of 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist
    if process_group is None:
        return None
    raise InvalidArgumentError(
        "ShardedPublisher.set_up: a process_group was given but torch.distributed is not "
        "initialized; call init_process_group (every trainer rank) before setting up the "
        "publisher")


def _signature(named: Sequence[tuple[str, Any]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, canonical dtype, global shape) per parameter, in order: the wire layout's specs.
    A DTensor's shape is the global one; a ZeRO-3 parameter's is its ds_shape."""
    out = []
    for name, param in named:
        shape = getattr(param, "ds_shape", None) if hasattr(param, "ds_tensor") else None
        shape = tuple(int(d) for d in (shape if shape is not None else param.shape))
        out.append((name, canonical_dtype(str(param.dtype))[0], shape))
    return out


def _check_meshes(named, world_size: int) -> None:
    for name, param in named:
        mesh = getattr(param, "device_mesh", None)
        if mesh is None or not hasattr(param, "placements"):
            continue
        size = int(prod(int(d) for d in mesh.shape))
        if size != world_size:
            raise InvalidArgumentError(
                f"parameter '{name}': its DTensor mesh has {size} ranks (shape "
                f"{list(mesh.shape)}), the process group {world_size}; give the publisher the "
                f"process group the parameters are sharded over (process_group=)")


def _first_difference(ours, theirs) -> str | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return (f"parameter {i} is '{a[0]}' {a[1]} {format_shape(a[2])} on this rank and "
                    f"'{b[0]}' {b[1]} {format_shape(b[2])} there")
    if len(ours) != len(theirs):
        longer, count = (ours, len(theirs)) if len(ours) > len(theirs) else (theirs, len(ours))
        where = "this rank" if longer is ours else "there"
        return (f"{len(ours)} parameters on this rank, {len(theirs)} there (first extra, "
                f"{where}: '{longer[count][0]}')")
    return None


def _region_data(region: TensorRegion) -> list:
    if region.kind == ELEMENTS:
        return [region.tensor, ELEMENTS, region.first, region.count]
    return [region.tensor, region.kind, list(region.begin), list(region.end)]


def _region_from(data) -> TensorRegion:
    tensor, kind, a, b = data
    if kind == ELEMENTS:
        return TensorRegion.elements(tensor, a, b)
    return TensorRegion.box(tensor, a, b)


def _check_transport_args(path, token, engine_gpus) -> None:
    """One transport: `path` and `token` (the same-host pull transport) or `engine_gpus` (NCCL
    routes)."""
    if engine_gpus is None:
        if path is None or token is None:
            raise InvalidArgumentError(
                "ShardedPublisher.set_up: give path and token (engines on this host: the "
                "same-host pull transport) or engine_gpus (engines on other GPUs or hosts: NCCL "
                "routes)")
        return
    if path is not None or token is not None:
        raise InvalidArgumentError(
            "ShardedPublisher.set_up: engine_gpus (NCCL routes) and path/token (the same-host "
            "pull transport) are both given; the trainer ranks serve one transport")
    if isinstance(engine_gpus, (str, bytes)) or not hasattr(engine_gpus, "__len__"):
        raise InvalidArgumentError(
            f"ShardedPublisher.set_up: engine_gpus must be a list of GPU names (gpu_name(device) "
            f"of each engine process), not {engine_gpus!r:.100}")


def _backend_for(shards) -> Backend:
    """The backend of the memory this rank's shards are in: a CudaBackend of their GPU, else a
    HostBackend (no shard, or host tensors)."""
    for shard in shards:
        device = getattr(shard.tensor, "device", None)
        if getattr(device, "type", "cpu") == "cuda":
            return CudaBackend(device.index if device.index is not None else 0)
    return HostBackend()


class ShardedPublisher:
    """One trainer rank of a sharded trainer, publishing over the same-host pull transport.

    Make it with ``set_up`` on every rank. Not thread-safe: one thread per rank calls publish
    (the training loop's)."""

    def __init__(self, *, rank: int, world_size: int, layout: Layout, plan: RoutingPlan,
                 regions: list[list[TensorRegion]], paths: list[str], names: list[str],
                 backend: Backend, engine_needs, sender_config: SenderConfig | None,
                 connect_timeout_ms: int, engine_replicas: int = 1, nccl: dict | None = None):
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.routing_plan = plan
        self.regions = regions  # every rank's, by rank
        self.paths = paths  # every rank's socket path, by rank
        self.backend = backend
        self._names = names
        self._engine_needs = engine_needs
        self._sender_config = sender_config
        self._connect_timeout_ms = connect_timeout_ms
        self.engine_replicas = engine_replicas
        # NCCL routes: {"unique_id": bytes, "gpus": every communicator rank's GPU}; None: the
        # same-host pull transport on `paths`.
        self._nccl = nccl
        self._sender: Sender | None = None
        self._served: Transport | BaseException | None = None
        self._serving: threading.Thread | None = None
        self._closed = False

    @classmethod
    def set_up(cls, named_parameters: Iterable[tuple[str, Any]], *, path: str | None = None,
               token=None, engine_needs: Sequence[Sequence[WireRange]] | None = None,
               wire: Layout | Sequence | None = None, bucket_bytes: int = 0,
               process_group=None, backend: Backend | None = None,
               sender_config: SenderConfig | None = None,
               connect_timeout_ms: int | None = None,
               engine_replicas: int = 1,
               engine_gpus: Sequence[str] | None = None) -> "ShardedPublisher":
        """Every rank of `process_group` (default: the default group) calls this with its
        parameters (``model.named_parameters()``: DTensors, ZeRO-3 or plain tensors; the same
        names, dtypes and global shapes in the same order on every rank), its own socket `path`
        and the shared `token`. `engine_needs`: per engine rank, the WireRanges it needs
        (``Receiver.needed_ranges()``); None: one engine rank needing every byte. `wire`: the
        wire layout (a Layout or specs); default the parameters' global shapes and dtypes in
        parameter order, cut into buckets of `bucket_bytes` (0: the library's default).
        `backend`: where this rank's packing lives and what the engines pull from; default a
        CudaBackend of the GPU that holds this rank's shards (the engines pull straight from its
        memory: the device flavour of the transport), else a HostBackend (host memory).
        `engine_replicas`: data-parallel replicas of the engine (R); each engine rank then
        connects once per replica (``sharded_receiver(..., replica=r)``) and the rank serves
        R x the engine ranks processes. Each bucket is still packed once: every replica pulls it
        from this rank's staging.

        One trainer process without torch.distributed (none initialized, no `process_group`)
        is rank 0 of 1: no collective, and on a GPU the engines read its tensors where they lie,
        the one-pass path for a single trainer process too. Otherwise one collective:
        ``all_gather_object`` of every rank's regions, parameter signature and path. Refused before any serving (InvalidArgumentError naming the first difference and
        both values; every rank raises): parameter sets that differ between ranks, a DTensor
        mesh whose size is not the group's, a wire layout that does not match the parameters.
        Serving starts on a daemon thread and returns at once: the engines connect with
        ``engine_setup`` (the first publish waits for them, up to `connect_timeout_ms`, default
        60000).

        Engines on other GPUs or hosts: give `engine_gpus` instead of `path` and `token`, the
        GPU name (``gpu_name(device)``) of every engine process, replica by replica, each
        replica's engine ranks in order (R x N names). The ranks then join one NCCL
        communicator with every engine process (``nccl_routed_transport``: trainer ranks
        first; rank 0 makes the unique id and the one collective hands it over); every route
        goes once over NCCL point-to-point, and replicas forward it among themselves. Each
        rank's shards must be on its GPU (a CudaBackend). ``engine_setup["nccl"]`` carries what
        the engines join with; they join while the first publish waits for them. Refused here:
        shards not on a GPU, `path` or `token` beside `engine_gpus`, a count of names other than
        R x N; two ranks on one GPU is refused, named, before NCCL is called, by the first
        publish (``wait_for_engines``), which raises what joining raised."""
        if isinstance(engine_replicas, bool) or not isinstance(engine_replicas, int) \
                or not 1 <= engine_replicas <= 65536:
            raise InvalidArgumentError(
                f"ShardedPublisher.set_up: engine_replicas is {engine_replicas!r}; give the "
                f"number of data-parallel replicas of the engine, 1..65536 (1: no replicas)")
        nccl_routes = engine_gpus is not None
        _check_transport_args(path, token, engine_gpus)
        dist = _dist(process_group)
        rank = 0 if dist is None else dist.get_rank(process_group)
        world_size = 1 if dist is None else dist.get_world_size(process_group)
        named = list(named_parameters)
        _check_meshes(named, world_size)
        signature = _signature(named)
        shards = local_shards(named, rank=rank, world_size=world_size)
        if backend is None:
            backend = _backend_for(shards)
        mine = {"signature": signature, "path": None if nccl_routes else str(path),
                "engine_replicas": engine_replicas,
                "regions": [_region_data(s.region) for s in shards if s.region is not None]}
        if nccl_routes:
            if not isinstance(backend, CudaBackend):
                raise InvalidArgumentError(
                    f"ShardedPublisher.set_up on trainer rank {rank}: engine_gpus (NCCL routes) "
                    f"needs this rank's shards on a GPU, and they are in host memory (backend "
                    f"{backend.name!r}); move the model to the rank's GPU, or serve the engines "
                    f"of this host over the same-host pull transport (path, token)")
            mine["gpu"] = _transport.gpu_name(backend.device_index)
            if rank == 0:
                mine["unique_id"] = _transport.nccl_unique_id()
        every = [None] * world_size
        if dist is None:
            every[0] = mine
        else:
            dist.all_gather_object(every, mine, group=process_group)
        for other, theirs in enumerate(every):
            difference = _first_difference(signature, theirs["signature"])
            if difference is not None:
                raise InvalidArgumentError(
                    f"ShardedPublisher.set_up on trainer rank {rank}: the parameters differ from "
                    f"trainer rank {other}'s: {difference}; every rank must give the same model's "
                    f"named_parameters() in the same order")
            if theirs["engine_replicas"] != engine_replicas:
                raise InvalidArgumentError(
                    f"ShardedPublisher.set_up on trainer rank {rank}: engine_replicas is "
                    f"{engine_replicas} here and {theirs['engine_replicas']} on trainer rank "
                    f"{other}; every rank serves the same engine replicas")
        layout = cls._wire_layout(wire, signature, bucket_bytes)
        regions = [[_region_from(r) for r in theirs["regions"]] for theirs in every]
        needs = None if engine_needs is None else [list(n) for n in engine_needs]
        plan = RoutingPlan(layout, regions, needs)
        processes = engine_replicas * plan.engine_count
        if processes > 65536:
            raise InvalidArgumentError(
                f"ShardedPublisher.set_up on trainer rank {rank}: {engine_replicas} engine "
                f"replicas x {plan.engine_count} engine ranks is {processes} engine processes; "
                f"a trainer rank serves at most 65536")
        nccl = None
        if nccl_routes:
            engine_gpus = [str(g) for g in engine_gpus]
            if len(engine_gpus) != processes:
                raise InvalidArgumentError(
                    f"ShardedPublisher.set_up on trainer rank {rank}: engine_gpus holds "
                    f"{len(engine_gpus)} names, but {engine_replicas} engine replica(s) x "
                    f"{plan.engine_count} engine ranks are {processes} engine processes; name "
                    f"the GPU of each (gpu_name(device)), replica by replica, engine ranks in "
                    f"order")
            nccl = {"unique_id": every[0]["unique_id"],
                    "gpus": [theirs["gpu"] for theirs in every] + engine_gpus}
        publisher = cls(
            rank=rank, world_size=world_size, layout=layout, plan=plan, regions=regions,
            paths=[theirs["path"] for theirs in every], names=[s[0] for s in signature],
            backend=backend, engine_needs=needs, sender_config=sender_config,
            connect_timeout_ms=(_DEFAULT_CONNECT_TIMEOUT_MS if connect_timeout_ms is None
                                else int(connect_timeout_ms)),
            engine_replicas=engine_replicas, nccl=nccl)
        publisher._serve(token)
        return publisher

    @staticmethod
    def _wire_layout(wire, signature, bucket_bytes: int) -> Layout:
        if wire is None:
            return Layout([(n, d, s) for n, d, s in signature], bucket_bytes)
        layout = wire if isinstance(wire, Layout) else Layout(wire, bucket_bytes)
        for name, dtype, shape in signature:
            if name not in layout:
                raise InvalidArgumentError(
                    f"ShardedPublisher.set_up: parameter '{name}' is not in the wire layout "
                    f"({len(layout)} tensors); give a wire layout of the trainer's parameters")
            info = layout.tensor(name)
            if (info.dtype, tuple(info.shape)) != (dtype, shape):
                raise InvalidArgumentError(
                    f"ShardedPublisher.set_up: parameter '{name}' is {dtype} "
                    f"{format_shape(shape)} (global), the wire layout has {info.dtype} "
                    f"{format_shape(info.shape)}; the wire layout holds full tensors")
        return layout

    def _serve(self, token) -> None:
        memory = "device" if isinstance(self.backend, CudaBackend) else "host"

        def serve():
            try:
                if self._nccl is not None:
                    # Blocks until every trainer rank and engine process joined (the NCCL
                    # config's init timeout), as serving blocks until the engines connected.
                    self._served = _transport.nccl_routed_transport(
                        self._nccl["unique_id"], self.routing_plan, self.rank,
                        self.backend.device_index, self.backend, self._nccl["gpus"],
                        replicas=self.engine_replicas)
                    return
                self._served = same_host_pull_trainer_transport(
                    self.paths[self.rank], token, self.routing_plan, self.rank,
                    self.engine_replicas * self.routing_plan.engine_count, self.backend,
                    memory=memory,
                    connect_timeout_ms=self._connect_timeout_ms)
            except BaseException as error:  # handed to the first publish
                self._served = error

        self._serving = threading.Thread(target=serve, daemon=True,
                                         name=f"shadowsync-serve-rank{self.rank}")
        self._serving.start()

    # --- what the engine side needs -------------------------------------------------------------

    @property
    def engine_setup(self) -> dict:
        """Plain data (JSON-able) from which an engine rank builds the same plan and connects
        (``sharded_receiver`` / ``engine_routing_plan``); the same on every rank. The token is
        not in it: hand that over as the engine's other secrets. With NCCL routes, ``nccl``
        holds the communicator's unique id (base64 text), every rank's GPU and the replicas,
        and ``paths`` is empty."""
        nccl = None
        if self._nccl is not None:
            nccl = {"unique_id": base64.b64encode(self._nccl["unique_id"]).decode("ascii"),
                    "gpus": list(self._nccl["gpus"]), "replicas": self.engine_replicas}
        return {
            "wire": [[s.name, s.dtype, list(s.shape), s.group] for s in self.layout.specs],
            "bucket_bytes": self.layout.groups[0].bucket_bytes if self.layout.groups else 0,
            "regions": [[_region_data(r) for r in rank] for rank in self.regions],
            "engine_needs": (None if self._engine_needs is None else
                             [[[r.group, r.begin, r.end] for r in need]
                              for need in self._engine_needs]),
            "paths": [] if nccl is not None else list(self.paths),
            "fingerprint": self.routing_plan.fingerprint,
            "engine_replicas": self.engine_replicas,
            "nccl": nccl,
        }

    # --- publishing -----------------------------------------------------------------------------

    def wait_for_engines(self, timeout: float | None = None) -> None:
        """Blocks until every engine process connected to this rank's path; raises what serving
        raised (ShadowsyncTimeoutError naming the engines that never came, a refusal naming both
        values). `timeout` (seconds) defaults to the connect timeout, plus a margin."""
        if self._sender is not None:
            return
        if timeout is None:
            timeout = self._connect_timeout_ms / 1000 + 10
        self._serving.join(timeout)
        if self._serving.is_alive():
            where = ("the NCCL communicator" if self._nccl is not None
                     else self.paths[self.rank])
            raise ShadowsyncTimeoutError(
                f"trainer rank {self.rank}: the engines did not connect to {where} within "
                f"{timeout} s (still waiting)")
        served = self._served
        if isinstance(served, BaseException):
            raise served
        self._sender = Sender(self.layout, self.backend, served, self._sender_config,
                              routing_plan=self.routing_plan, trainer_rank=self.rank)

    def publish(self, version: int, named_parameters: Iterable[tuple[str, Any]]) -> PublishHandle:
        """Publishes update `version` from this rank's parameters (the same as at set-up, now
        holding the new values) and returns at once; every rank calls it with the same version.
        Hand ``handle.header_bytes`` (any rank's: they are equal) to the engines'
        begin_update, and ``handle.wait()`` before the parameters change again (the next
        optimizer step). No collective, no gather: safe inside ``forbid_gathers()``. The first
        publish waits for the engines to connect (wait_for_engines). A parameter set unlike
        set-up's, or a region that moved, raises InvalidArgumentError naming it; nothing is
        sent."""
        if self._closed:
            raise InvalidArgumentError(f"trainer rank {self.rank}: the publisher is closed")
        named = list(named_parameters)
        names = [name for name, _ in named]
        if names != self._names:
            first = next((i for i, (a, b) in enumerate(zip(names, self._names)) if a != b),
                         min(len(names), len(self._names)))
            given = names[first] if first < len(names) else "(none)"
            expected = self._names[first] if first < len(self._names) else "(none)"
            raise InvalidArgumentError(
                f"update {version}: trainer rank {self.rank}: parameter {first} is '{given}', "
                f"at set-up it was '{expected}'; publish the parameters set up with")
        shards = [s for s in local_shards(named, rank=self.rank, world_size=self.world_size)
                  if s.region is not None]
        held = self.regions[self.rank]
        triples = []
        for i in range(max(len(shards), len(held))):
            now = shards[i].region if i < len(shards) else None
            then = held[i] if i < len(held) else None
            if now != then:
                raise InvalidArgumentError(
                    f"update {version}: trainer rank {self.rank}: its region {i} is {now}, at "
                    f"set-up {then}; a resharded model needs a new publisher")
            shard = shards[i]
            tensor = shard.tensor
            if str(getattr(tensor, "device", "cpu")) != self.backend.device:
                # Shards elsewhere than the transport's memory: a copy of this rank's shard (a
                # GPU trainer with a HostBackend, say), never of a full tensor.
                tensor = tensor.to(self.backend.device)
            triples.append((shard.name, tensor, shard.region))
        self.wait_for_engines()
        return self._sender.publish_shards(version, triples)

    # --- memory ---------------------------------------------------------------------------------

    @property
    def staging_bytes(self) -> int:
        """The packing memory this rank adds: two slots of the plan's largest packed bucket slice
        of this rank (the Sender's staging)."""
        if self._sender is not None:
            return self._sender.staging_bytes
        return 2 * self.routing_plan.max_packed_bytes(self.rank)

    @property
    def routes_in_place(self) -> tuple[bool | None, str]:
        """Whether the engines read the last update where this rank's shards lie (True, ""),
        or it was packed into the staging first (False, why: host memory, memory CUDA IPC
        cannot share such as PyTorch's expandable segments); (None, "") before the first
        publish. Sender.routes_in_place."""
        if self._sender is None:
            return None, ""
        return self._sender.routes_in_place

    @property
    def held_bytes(self) -> int:
        """The parameter bytes this rank holds and sends from (its regions; a tensor every rank
        holds whole counts on its sending rank only)."""
        return sum(r.numel * canonical_dtype(self.layout.tensor(r.tensor).dtype)[1]
                   for r in self.regions[self.rank])

    @property
    def sent_bytes(self) -> int:
        """The bytes this rank sends per update: held bytes once per engine rank needing them."""
        return self.routing_plan.bytes_from_trainer(self.rank)

    def close(self) -> None:
        """Waits for the updates already published, then stops serving. A serve still waiting
        for engines keeps its daemon thread until its connect timeout."""
        if self._closed:
            return
        self._closed = True
        if self._sender is not None:
            self._sender.close()
        elif isinstance(self._served, Transport):
            self._served.close()

    def __repr__(self) -> str:
        return (f"ShardedPublisher(trainer rank {self.rank} of {self.world_size}, "
                f"{self.routing_plan.engine_count} engine ranks, {self.held_bytes} bytes held, "
                f"{self.staging_bytes} bytes staging)")


# --- engine side ------------------------------------------------------------------------------


def engine_routing_plan(setup: dict, *, wire: Layout | None = None,
                        what: str = "engine_setup") -> tuple[Layout, RoutingPlan]:
    """The wire layout and routing plan of a publisher's ``engine_setup``, rebuilt on the engine
    side and checked against the trainers' fingerprint: the one rebuild every engine uses
    (``sharded_receiver``; shadowsync.vllm's workers from ``ShadowsyncInitInfo.trainer_ranks``,
    which carries the same keys). `setup` is plain data: ``regions`` (each trainer rank's, as
    ``[tensor, "box", begin, end]`` / ``[tensor, "elements", first, count]``), ``engine_needs``
    (each engine rank's ``[[group, begin, end], ...]``; None: one engine rank needing every
    byte), ``fingerprint``, and unless `wire` (the engine's Layout of the trainer's tensors) is
    given, ``wire`` (specs) and ``bucket_bytes``. Refused, prefixed with `what`: a plan the
    library refuses (regions that overlap, bytes no trainer rank holds, a region outside its
    tensor: the library's error class), a fingerprint that differs from the trainers'
    (LayoutMismatchError naming both: another wire layout, regions, needs or shadowsync)."""
    if wire is None:
        wire = Layout([TensorSpec(n, d, tuple(s), g) for n, d, s, g in setup["wire"]],
                      setup["bucket_bytes"])
    needs = setup["engine_needs"]
    try:
        plan = RoutingPlan(wire, [[_region_from(r) for r in rank] for rank in setup["regions"]],
                           None if needs is None else
                           [[WireRange(g, b, e) for g, b, e in need] for need in needs])
    except ShadowsyncError as error:
        raise type(error)(f"{what}: the routing plan is refused: {error.detail}") from None
    fingerprint = setup["fingerprint"]
    if plan.fingerprint != fingerprint:
        raise LayoutMismatchError(
            f"{what}: this engine rank's routing plan (fingerprint {plan.fingerprint:#018x}, "
            f"{plan.trainer_count} trainer ranks -> {plan.engine_count} engine ranks, "
            f"{plan.route_count} routes) differs from the trainers' ({fingerprint:#018x}): build "
            f"both sides from the same wire layout (specs, bucket_bytes), regions and "
            f"engine_needs, with the same shadowsync")
    return wire, plan


def check_replica(setup: dict, replica, what: str) -> None:
    """Refuses (InvalidArgumentError prefixed `what`, naming both) a `replica` outside the
    0..R-1 of a publisher's ``engine_setup`` (``engine_replicas``: R, 1 when absent)."""
    replicas = setup.get("engine_replicas", 1)
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
        raise InvalidArgumentError(
            f"{what}: replica {replica!r} is outside the {replicas} engine replica(s) the "
            f"trainer ranks serve (engine_setup['engine_replicas']: 0..{replicas - 1}); set "
            f"ShardedPublisher.set_up(engine_replicas=...) to the number of engine replicas")


def sharded_receiver(setup: dict, token, engine_rank: int, *, backend: Backend | None = None,
                     config: ReceiverConfig | None = None,
                     connect_timeout_ms: int | None = None, replica: int = 0) -> Receiver:
    """Engine rank `engine_rank`'s Receiver of a publisher's ``engine_setup``: slots laid out as
    the wire layout (no receive plan), connected to every trainer rank's path, the routing plan
    in use. Blocks until every trainer rank served (connect_timeout_ms, default 60000). Its
    ``stats().routed_bytes`` is what the routes carried into it per update. `replica`: which of
    the publisher's ``engine_replicas`` this engine is (0..R-1); a replica outside them is
    refused here, naming both, before anything connects."""
    check_replica(setup, replica, "sharded_receiver")
    layout, plan = engine_routing_plan(setup)
    nccl = setup.get("nccl")
    if nccl is not None:
        if not isinstance(backend, CudaBackend):
            raise InvalidArgumentError(
                f"sharded_receiver: the trainer ranks send over NCCL (engine_setup['nccl']); "
                f"give backend=CudaBackend(device) of this engine rank's GPU, not {backend!r}")
        transport = _transport.nccl_routed_transport(
            base64.b64decode(nccl["unique_id"]), plan,
            _transport.nccl_engine_comm_rank(plan, engine_rank, replica), backend.device_index,
            backend,
            nccl["gpus"], replicas=nccl.get("replicas", 1))
    else:
        backend = backend if backend is not None else HostBackend()
        transport = same_host_pull_engine_transport(setup["paths"], token, plan, engine_rank,
                                                    backend,
                                                    connect_timeout_ms=connect_timeout_ms,
                                                    replica=replica)
    receiver = Receiver(layout, backend, transport, config)
    receiver.use_routing_plan(plan, engine_rank)
    receiver.routing_plan = plan
    return receiver
