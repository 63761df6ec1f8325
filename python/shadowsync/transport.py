"""Transports: in-process loopback ranks (tests, demos) and NCCL (loopback_transport.h,
nccl_transport.h).

A Transport is taken by the Receiver or Sender it is given to: once that object is made, the
Transport is spent (closing it does nothing); if making it failed, the caller still owns it.
"""

from __future__ import annotations

from ctypes import byref, c_int32, c_uint8, c_void_p, create_string_buffer
from dataclasses import dataclass

from ._handle import Handle
from ._library import NCCL_UNIQUE_ID_BYTES, NcclConfigC, config_struct
from .backend import require_cuda
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
    plugin/c_api/shadowsync_testing.h; the package does not wrap it.)"""

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


def nccl_transport(
    unique_id: bytes, rank: int, world_size: int, device: int, config: NcclConfig | None = None
) -> Transport:
    """NcclTransport::create: blocks until all `world_size` ranks joined (init_timeout_ms).
    NotSupportedError when the library has no CUDA."""
    require_cuda(f"nccl_transport(rank={rank}, world_size={world_size}, device={device})")
    unique_id = bytes(unique_id)
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise InvalidArgumentError(
            f"NCCL unique id: {len(unique_id)} bytes, expected {NCCL_UNIQUE_ID_BYTES}"
        )
    id_buffer = (c_uint8 * NCCL_UNIQUE_ID_BYTES).from_buffer_copy(unique_id)
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
