"""Transports: in-process loopback ranks (tests, demos), the same-host transport between processes
of one host, its pull flavour for sharded trainers (same_host_pull_transport.h), and NCCL
(loopback_transport.h, same_host_transport.h, nccl_transport.h).

A Transport is taken by the Receiver or Sender it is given to: once that object is made, the
Transport is spent (closing it does nothing); if making it failed, the caller still owns it.
"""

from __future__ import annotations

import os
from ctypes import byref, c_char_p, c_int32, c_uint8, c_void_p, create_string_buffer
from dataclasses import dataclass

from ._handle import Handle
from ._library import NCCL_UNIQUE_ID_BYTES, SAME_HOST_MEMORY, NcclConfigC, config_struct
from .backend import Backend, CudaBackend, require_cuda
from .errors import InvalidArgumentError, call


class Transport(Handle):
    _destroy_fn = "shadowsync_transport_destroy"

    def __init__(self, value: int, description: str):
        super().__init__(value)
        self.description = description

    def __repr__(self) -> str:
        return f"Transport({self.description}{', taken' if self.closed else ''})"


class Loopback(Handle):
    """A world of `world_size` in-process ranks with broadcast semantics, on host backends.
    For tests and demos. Thread-safe. (Fault injection is a test hook of the C ABI,
    plugin/c_api/shadowsync_testing.h, built only into the test-only libshadowsync_c_testing.so;
    the package does not wrap it.)"""

    _destroy_fn = "shadowsync_loopback_destroy"

    def __init__(self, world_size: int):
        handle = c_void_p()
        call("shadowsync_loopback_create", int(world_size), byref(handle))
        super().__init__(handle.value)
        self.world_size = int(world_size)

    def transport(self, rank: int) -> Transport:
        """The transport of `rank`; each rank once. Transports live on after the Loopback closes."""
        handle = c_void_p()
        call("shadowsync_loopback_transport", self._handle, int(rank), byref(handle))
        return Transport(handle.value, f"loopback rank {rank} of {self.world_size}")


@dataclass(frozen=True)
class NcclLibrary:
    """The NCCL library the NCCL transport uses: its path and ncclGetVersion's code (22809 for
    NCCL 2.28.9)."""

    path: str
    version_code: int

    @property
    def version(self) -> tuple[int, int, int]:
        """(major, minor, patch), as torch.cuda.nccl.version() reports it."""
        code = self.version_code
        return (code // 10000, code % 10000 // 100, code % 100)


def nccl_library() -> NcclLibrary:
    """Loads NCCL if no call did yet and says which library and version the NCCL transport uses.
    The search: an NCCL the process already has (torch's), the nvidia-nccl-cu* package next to
    torch, the system's; SHADOWSYNC_NCCL_LIBRARY=<path> chooses one. TransportError lists every
    place looked at when none is usable; NotSupportedError without CUDA. Thread-safe."""
    require_cuda("nccl_library()")
    path = create_string_buffer(4096)
    version = c_int32()
    call("shadowsync_nccl_library", path, len(path), byref(version))
    return NcclLibrary(path.value.decode(), version.value)


def make_token() -> str:
    """A new shared token for the same-host transport and the control channel: "ssk1-" and 256
    random bits as 64 hex digits (the kernel's random source). Tokens that are plainly not random
    ("aaaaaaaaaaaaaaaa", "password12345678", a run of 8 equal or consecutive characters, fewer
    than 64 bits by their character frequencies) are refused wherever a token is taken."""
    buffer = create_string_buffer(TOKEN_BYTES)
    call("shadowsync_make_token", buffer, TOKEN_BYTES)
    return buffer.value.decode()


TOKEN_BYTES = 70  # SHADOWSYNC_TOKEN_BYTES


def nccl_unique_id() -> bytes:
    """A new NCCL unique id (ncclGetUniqueId), to hand to every rank. NotSupportedError without
    CUDA."""
    require_cuda("nccl_unique_id()")
    buffer = (c_uint8 * NCCL_UNIQUE_ID_BYTES)()
    call("shadowsync_nccl_unique_id", buffer)
    return bytes(buffer)


@dataclass
class NcclConfig:
    """shadowsync_nccl_config_t; None takes the library's default."""

    max_ctas: int | None = None
    min_ctas: int | None = None
    cga_cluster_size: int | None = None
    init_timeout_ms: int | None = None
    enqueue_timeout_ms: int | None = None
    finalize_timeout_ms: int | None = None

    def _to_c(self) -> NcclConfigC:
        return config_struct(NcclConfigC, **vars(self))


def _unique_id_buffer(unique_id: bytes, prefix: str):
    """NCCL's unique id as the C ABI takes it; InvalidArgumentError ("PREFIXNCCL unique id: 3
    bytes, expected 128") for another length."""
    unique_id = bytes(unique_id)
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise InvalidArgumentError(
            f"{prefix}NCCL unique id: {len(unique_id)} bytes, expected {NCCL_UNIQUE_ID_BYTES}"
        )
    return (c_uint8 * NCCL_UNIQUE_ID_BYTES).from_buffer_copy(unique_id)


def nccl_transport(
    unique_id: bytes, rank: int, world_size: int, device: int, config: NcclConfig | None = None
) -> Transport:
    """NcclTransport::create: blocks until all `world_size` ranks joined (init_timeout_ms).
    NotSupportedError when the library has no CUDA."""
    require_cuda(f"nccl_transport(rank={rank}, world_size={world_size}, device={device})")
    id_buffer = _unique_id_buffer(unique_id, "")
    c_config = None
    if config is not None:
        c_config = config._to_c()
    handle = c_void_p()
    call(
        "shadowsync_nccl_transport_create",
        id_buffer,
        int(rank),
        int(world_size),
        int(device),
        byref(c_config) if c_config is not None else None,
        byref(handle),
    )
    return Transport(handle.value, f"nccl rank {rank} of {world_size} on cuda:{device}")


def nccl_routed_transport(
    unique_id: bytes,
    plan,
    rank: int,
    device: int,
    backend: Backend,
    gpus,
    config: NcclConfig | None = None,
    replicas: int = 1,
) -> Transport:
    """A sharded trainer's routes over NCCL point-to-point (DESIGN §14): communicator rank `rank`
    of the routing plan's M trainer ranks and N engine ranks in each of `replicas` (R) data-parallel
    replicas of the engine, trainer ranks first (rank < M: trainer rank `rank`, give it to that
    rank's Sender with the plan; else engine rank (rank - M) % N of replica (rank - M) // N, give
    it to its Receiver with the plan), on CUDA device `device`. Every rank calls it with the same
    `unique_id`, plan and `replicas`; it blocks until all M + R x N joined (init_timeout_ms).
    Each trainer rank sends every route once, to replica 0; each replica's engine rank forwards
    what it landed to the next replica's, so the trainer's traffic does not grow with R.

    `gpus`: M + R x N names, one per communicator rank in that order, each unique to its GPU
    across the hosts (``gpu_name(device)`` gives the host name and the device's UUID): two ranks on
    one GPU are refused, naming both (NCCL cannot connect them; the same-host pull transport
    serves a trainer rank and an engine rank on one GPU). An engine rank allocates its landing
    buffer (the plan's largest bucket of routes into it) from `backend`. NotSupportedError
    without CUDA."""
    what = f"nccl_routed_transport(rank={rank!r}, device={device!r})"
    plan = _routing_plan_arg(plan, what)
    replicas = _int_arg(replicas, "replicas", what, 1, 65536)
    world = plan.trainer_count + replicas * plan.engine_count
    rank = _int_arg(rank, "rank", what, 0, world - 1)
    device = _int_arg(device, "device", what, 0, 65535)
    if isinstance(gpus, (str, bytes)) or not hasattr(gpus, "__len__"):
        raise InvalidArgumentError(
            f"{what}: gpus must be a list of {world} GPU names (one per communicator rank, "
            f"trainer ranks first), not {gpus!r:.100}"
        )
    names = [str(g).encode() for g in gpus]
    if len(names) != world:
        per_replica = f" in each of {replicas} replicas" if replicas > 1 else ""
        raise InvalidArgumentError(
            f"{what}: gpus holds {len(names)} names, but the plan's communicator has {world} "
            f"ranks ({plan.trainer_count} trainer and {plan.engine_count} engine "
            f"ranks{per_replica}): name the GPU of every rank, trainer ranks first"
        )
    require_cuda(what)
    id_buffer = _unique_id_buffer(unique_id, f"{what}: ")
    c_config = config._to_c() if config is not None else None
    c_gpus = (c_char_p * len(names))(*names)
    handle = c_void_p()
    call(
        "shadowsync_nccl_routed_transport_create_replicated",
        id_buffer,
        rank,
        device,
        plan.handle,
        backend.handle,
        c_gpus,
        len(names),
        replicas,
        byref(c_config) if c_config is not None else None,
        byref(handle),
    )
    if rank < plan.trainer_count:
        role = f"trainer rank {rank}"
    else:
        engine, replica = (rank - plan.trainer_count) % plan.engine_count, \
            (rank - plan.trainer_count) // plan.engine_count
        role = f"engine rank {engine}" + (f" of replica {replica}" if replicas > 1 else "")
    return Transport(handle.value, f"nccl routes, {role} on cuda:{device}")


def nccl_engine_comm_rank(plan, engine_rank: int, replica: int = 0) -> int:
    """The communicator rank of engine rank `engine_rank` of replica `replica` in
    nccl_routed_transport's communicator: M + replica x N + engine_rank."""
    return plan.trainer_count + replica * plan.engine_count + engine_rank


def gpu_name(device: int) -> str:
    """A name unique to CUDA device `device` across hosts, for nccl_routed_transport's `gpus`:
    the host name and the device's UUID (through torch, which must be installed)."""
    import socket

    import torch

    return f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}"


# --- same host ------------------------------------------------------------------------------

_INT64_MAX = 2**63 - 1


def _int_arg(value, name: str, what: str, minimum: int, maximum: int) -> int:
    """`value` as an int in [minimum, maximum] (bools and floats refused), else
    InvalidArgumentError naming `what`, the argument and the value."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(
            f"{what}: {name} must be an int, not {type(value).__name__} {value!r}"
        )
    if not minimum <= value <= maximum:
        raise InvalidArgumentError(f"{what}: {name} is {value}, expected {minimum}..{maximum}")
    return value


def _same_host_args(path, token, backend, connect_timeout_ms, what: str):
    """The arguments both sides share, checked and in their C form: path and token as bytes."""
    try:
        path_bytes = os.fsencode(path)
    except TypeError:
        raise InvalidArgumentError(
            f"{what}: path must be a str or os.PathLike, not {type(path).__name__} {path!r}"
        ) from None
    if not path_bytes or b"\0" in path_bytes:
        raise InvalidArgumentError(f"{what}: path {path!r} is empty or holds a NUL character")
    if isinstance(token, str):
        token_bytes = token.encode("utf-8")
    elif isinstance(token, (bytes, bytearray, memoryview)):
        token_bytes = bytes(token)
    else:
        raise InvalidArgumentError(
            f"{what}: token must be bytes or str, not {type(token).__name__}"
        )
    if not isinstance(backend, Backend):
        raise InvalidArgumentError(
            f"{what}: backend must be a HostBackend or CudaBackend, not {type(backend).__name__}"
        )
    timeout = 0 if connect_timeout_ms is None else connect_timeout_ms
    timeout = _int_arg(timeout, "connect_timeout_ms", what, 0, _INT64_MAX)
    return path_bytes, token_bytes, timeout


def same_host_transport(
    path: str | os.PathLike,
    token: bytes | str,
    rank: int,
    backend: Backend,
    *,
    connect_timeout_ms: int | None = None,
) -> Transport:
    """The receiver's side of the same-host transport (SameHostTransport::connect), for an engine
    process on the trainer's host: give it to the engine's Receiver.

    Made from plain values, so that a worker can build it from collective_rpc arguments: `path`
    is the Unix socket the trainer's sender serves on (see same_host_sender_transport), `token`
    the shared secret (bytes, or a str taken as UTF-8; at least 16 bytes: the control channel's
    token serves), `rank` this receiver's rank, 1..receivers (rank 0 is the sender). `backend` is
    the engine's backend: HostBackend when the sender shares host memory, CudaBackend for device
    memory (the sender chooses; its setup says which).

    Blocks until a sender listens on `path` (the engine may start first) and both sides proved the
    token, for up to `connect_timeout_ms` (None: the library's default, 60000), then maps the
    sender's staging memory. Raises ShadowsyncTimeoutError when no sender came,
    TransportError naming which side refused (a wrong token shows here as the sender's
    refusal), InvalidArgumentError for bad arguments (naming the argument and its value). The
    socket's directory must be the user's own, mode 0700 (it is created so when absent).
    Thread-safe."""
    what = f"same_host_transport(path={str(path)!r}, rank={rank!r})"
    path_bytes, token_bytes, timeout = _same_host_args(
        path, token, backend, connect_timeout_ms, what
    )
    rank = _int_arg(rank, "rank", what, 1, 65535)
    handle = c_void_p()
    call(
        "shadowsync_same_host_transport_connect",
        path_bytes,
        token_bytes,
        len(token_bytes),
        rank,
        backend.handle,
        timeout,
        byref(handle),
    )
    return Transport(handle.value, f"same_host rank {rank} on {os.fsdecode(path_bytes)}")


def _backend_memory(backend: Backend) -> str:
    """Where a backend's buffers live: the same-host staging slots' default memory."""
    return "device" if isinstance(backend, CudaBackend) else "host"


def same_host_sender_transport(
    path: str | os.PathLike,
    token: bytes | str,
    receivers: int,
    backend: Backend,
    slot_bytes: int,
    *,
    memory: str | None = None,
    connect_timeout_ms: int | None = None,
) -> Transport:
    """The sender's side of the same-host transport (SameHostTransport::serve), for the trainer
    process: give it to the Sender (it is rank 0, the root of every broadcast).

    Listens on the Unix socket `path` and blocks until `receivers` receivers (ranks
    1..receivers, each a same_host_transport) connected and proved `token` (bytes, or a str taken
    as UTF-8; at least 16 bytes), for up to `connect_timeout_ms` (None: the library's default,
    60000). So tell the engines `path` first (e.g. collective_rpc, or the control channel's
    same-host rendezvous), then call this. It then shares two staging slots of `slot_bytes` each
    (the layout's bucket size: ``layout.groups[0].bucket_bytes``) in `memory`: "host" (a shared
    memory file; `backend` a HostBackend) or "device" (GPU memory; `backend` a CudaBackend;
    NotSupportedError without CUDA); None (the default) takes the backend's own memory.

    A receiver with the wrong token is refused and the wait goes on (handshakes run side by side:
    a peer that connects and says nothing delays no other): ShadowsyncTimeoutError then names how
    many came and each peer that stalled or was refused, by pid and uid. The socket's directory
    must be the user's own, mode 0700 (created so when absent); the socket file is removed once
    every receiver came. Bad arguments: InvalidArgumentError naming the argument and its value.
    Thread-safe."""
    what = f"same_host_sender_transport(path={str(path)!r}, receivers={receivers!r})"
    path_bytes, token_bytes, timeout = _same_host_args(
        path, token, backend, connect_timeout_ms, what
    )
    receivers = _int_arg(receivers, "receivers", what, 1, 65535)
    slot_bytes = _int_arg(slot_bytes, "slot_bytes", what, 1, _INT64_MAX)
    if memory is None:
        memory = _backend_memory(backend)
    if memory not in SAME_HOST_MEMORY:
        raise InvalidArgumentError(
            f"{what}: memory is {memory!r}, expected one of {sorted(SAME_HOST_MEMORY)}"
        )
    handle = c_void_p()
    call(
        "shadowsync_same_host_transport_serve",
        path_bytes,
        token_bytes,
        len(token_bytes),
        receivers,
        backend.handle,
        SAME_HOST_MEMORY[memory],
        slot_bytes,
        timeout,
        byref(handle),
    )
    return Transport(
        handle.value,
        f"same_host sender on {os.fsdecode(path_bytes)} for {receivers} receivers "
        f"({memory} memory)",
    )


def _routing_plan_arg(plan, what: str):
    from .routing import RoutingPlan  # routing imports layout, which must not import transports

    if not isinstance(plan, RoutingPlan):
        raise InvalidArgumentError(
            f"{what}: plan must be a shadowsync.RoutingPlan, not {type(plan).__name__}"
        )
    return plan


def same_host_pull_trainer_transport(
    path: str | os.PathLike,
    token: bytes | str,
    plan,
    trainer_rank: int,
    engine_processes: int,
    backend: Backend,
    *,
    memory: str = "host",
    connect_timeout_ms: int | None = None,
) -> Transport:
    """Trainer rank `trainer_rank` of the routing plan `plan` (a RoutingPlan) for the same-host
    pull transport: engine ranks pull each route straight from this rank's staging. Give it to
    this rank's Sender. It moves routes only: broadcasts on it are refused.

    Listens on the Unix socket `path` (this rank's own; directory rules as
    same_host_sender_transport) and blocks until `engine_processes` engine processes (R x the
    plan's engine count, R data-parallel replicas of the engine; R = 1 without replicas)
    connected with same_host_pull_engine_transport, proved `token` and were set up with the same
    plan, for up to `connect_timeout_ms` (None: 60000); then shares two staging slots of
    ``plan.max_packed_bytes(trainer_rank)``. Each bucket is packed into them once, whatever R.
    An engine set up for another world size or plan, asking for an engine rank and replica taken
    already, or for a replica outside 0..R-1, is refused and the wait goes on:
    ShadowsyncTimeoutError then names each refusal with both sides' values. `memory`: "host"
    (the slots in a sealed memory file; `backend` a HostBackend) or "device" (the slots on
    `backend`'s GPU, a CudaBackend; each engine rank maps them for its own GPU, the same one or a
    peer GPU of the host, and pulls its routes with device copies; waits for a peer are bounded
    by 10 s). The transport keeps the plan alive. Thread-safe."""
    what = f"same_host_pull_trainer_transport(path={str(path)!r}, trainer_rank={trainer_rank!r})"
    path_bytes, token_bytes, timeout = _same_host_args(
        path, token, backend, connect_timeout_ms, what
    )
    plan = _routing_plan_arg(plan, what)
    trainer_rank = _int_arg(trainer_rank, "trainer_rank", what, 0, 65535)
    engine_processes = _int_arg(engine_processes, "engine_processes", what, 1, 65536)
    if memory not in SAME_HOST_MEMORY:
        raise InvalidArgumentError(
            f"{what}: memory is {memory!r}, expected one of {sorted(SAME_HOST_MEMORY)}"
        )
    handle = c_void_p()
    call(
        "shadowsync_same_host_pull_serve",
        path_bytes,
        token_bytes,
        len(token_bytes),
        plan.handle,
        trainer_rank,
        engine_processes,
        backend.handle,
        SAME_HOST_MEMORY[memory],
        timeout,
        byref(handle),
    )
    return Transport(
        handle.value,
        f"same_host_pull trainer rank {trainer_rank} on {os.fsdecode(path_bytes)} for "
        f"{engine_processes} engine processes",
    )


def same_host_pull_engine_transport(
    paths,
    token: bytes | str,
    plan,
    engine_rank: int,
    backend: Backend,
    *,
    connect_timeout_ms: int | None = None,
    replica: int = 0,
) -> Transport:
    """Engine rank `engine_rank` of the routing plan `plan` for the same-host pull transport:
    give it to the engine's Receiver (with the routing plan in use). `paths` holds every trainer
    rank's socket path, in trainer rank order (``paths[t]`` served by trainer rank t).
    `replica`: which data-parallel replica of the engine this process belongs to (0..R-1 where
    the trainer ranks serve R x the plan's engine ranks processes); every replica's process of
    an engine rank pulls the same routes from the same staging.

    Connects to each within `connect_timeout_ms` in all (None: 60000; ShadowsyncTimeoutError
    "trainer rank 2 (<path>) never served within 60000 ms"), proves `token` and maps each trainer
    rank's staging. Refused, naming both values: a trainer rank set up for another world size or
    an engine rank and replica taken already, a replica the trainer ranks do not serve
    (InvalidArgumentError), another routing plan
    (LayoutMismatchError), a path served by another trainer rank than its index
    (InvalidArgumentError), a wrong token (TransportError). `backend`: a HostBackend for
    trainer ranks that serve host memory, a CudaBackend of this engine rank's GPU for device
    memory. Thread-safe."""
    what = f"same_host_pull_engine_transport(engine_rank={engine_rank!r})"
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise InvalidArgumentError(
            f"{what}: paths must be a sequence of every trainer rank's path, not one path "
            f"{paths!r}"
        )
    paths = list(paths)
    if not paths:
        raise InvalidArgumentError(f"{what}: paths is empty; give every trainer rank's path")
    encoded = []
    for i, path in enumerate(paths):
        path_bytes, token_bytes, timeout = _same_host_args(
            path, token, backend, connect_timeout_ms, f"{what}, paths[{i}]"
        )
        encoded.append(path_bytes)
    plan = _routing_plan_arg(plan, what)
    engine_rank = _int_arg(engine_rank, "engine_rank", what, 0, 65535)
    replica = _int_arg(replica, "replica", what, 0, 65535)
    c_paths = (c_char_p * len(encoded))(*encoded)
    handle = c_void_p()
    call(
        "shadowsync_same_host_pull_connect_replica",
        c_paths,
        len(encoded),
        token_bytes,
        len(token_bytes),
        plan.handle,
        engine_rank,
        replica,
        backend.handle,
        timeout,
        byref(handle),
    )
    return Transport(
        handle.value,
        f"same_host_pull engine rank {engine_rank}"
        f"{f' (replica {replica})' if replica else ''} of {len(encoded)} trainer ranks",
    )
