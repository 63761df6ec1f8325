"""shadowsync: asynchronous double-buffered weight updates from an RL trainer into inference
engines, over the C ABI of libshadowsync_c (ctypes; no compiler needed).

The library is found on first use: SHADOWSYNC_LIBRARY, then next to this package (where
``pip install .`` puts it), then the CMake build tree of a source checkout (build/), then the
system loader (see shadowsync._library).
``shadowsync.vllm.WorkerExtension`` is the vLLM worker extension (engine_adapters/vllm/ of the
repository).
"""

import re as _re
from pathlib import Path as _Path

from ._library import LibraryNotFoundError
from .backend import Backend, CudaBackend, HostBackend, Stream, has_cuda
from .errors import (
    BackendError,
    BadHeaderError,
    InternalError,
    InvalidArgumentError,
    InvalidHandleError,
    LayoutMismatchError,
    NotSupportedError,
    ShadowsyncError,
    ShadowsyncTimeoutError,
    ShutdownError,
    StaleVersionError,
    SupersededError,
    TransportError,
)
from .layout import GroupInfo, Layout, TensorInfo, TensorSpec, UpdateHeader, canonical_dtype
from .receive_plan import PlanCopy, PlanQuantization, ReceivePlan, needed_ranges
from .regions import TensorRegion, WireRange
from .remap_arena import RemapArena
from .receiver import (
    GroupSwap,
    PacingReport,
    Receiver,
    ReceiverConfig,
    ReceiverStats,
    UpdateFailure,
)
from .routing import Route, RoutingPlan
from .sender import PublishHandle, Sender, SenderConfig, StreamedPublish
from .sharded_publisher import ShardedPublisher
from .transport import (
    NCCL_UNIQUE_ID_BYTES,
    Loopback,
    NcclConfig,
    NcclLibrary,
    Transport,
    gpu_name,
    make_token,
    nccl_library,
    nccl_routed_transport,
    nccl_transport,
    nccl_unique_id,
    same_host_pull_engine_transport,
    same_host_pull_trainer_transport,
    same_host_sender_transport,
    same_host_transport,
)


def _checkout_version() -> str:
    """The version of the CMake project of the source checkout this package lies in."""
    cmake_lists = _Path(__file__).resolve().parent.parent.parent / "CMakeLists.txt"
    try:
        text = cmake_lists.read_text(encoding="utf-8")
    except OSError:
        return "0+unknown"
    match = _re.search(r"project\(\s*shadowsync\s+VERSION\s+([0-9]+\.[0-9]+\.[0-9]+)", text)
    return match.group(1) if match else "0+unknown"


# One version, the CMake project's: the wheel build writes it into _version.py (pyproject.toml);
# a source checkout has no _version.py and reads it from CMakeLists.txt.
try:
    from ._version import __version__
except ImportError:
    __version__ = _checkout_version()

def library_path() -> str:
    """Where libshadowsync_c was loaded from (loads it if needed)."""
    from ._library import library_path as path

    return path()


__all__ = [
    "Backend",
    "BackendError",
    "BadHeaderError",
    "CudaBackend",
    "GroupInfo",
    "GroupSwap",
    "HostBackend",
    "InternalError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "Layout",
    "LayoutMismatchError",
    "LibraryNotFoundError",
    "Loopback",
    "NcclConfig",
    "NcclLibrary",
    "NotSupportedError",
    "PacingReport",
    "PublishHandle",
    "Receiver",
    "ReceiverConfig",
    "ReceiverStats",
    "RemapArena",
    "Route",
    "RoutingPlan",
    "Sender",
    "SenderConfig",
    "ShadowsyncError",
    "ShadowsyncTimeoutError",
    "ShardedPublisher",
    "ShutdownError",
    "StaleVersionError",
    "Stream",
    "StreamedPublish",
    "SupersededError",
    "TensorInfo",
    "TensorRegion",
    "TensorSpec",
    "Transport",
    "TransportError",
    "UpdateFailure",
    "UpdateHeader",
    "WireRange",
    "canonical_dtype",
    "gpu_name",
    "has_cuda",
    "library_path",
    "make_token",
    "nccl_library",
    "nccl_routed_transport",
    "nccl_transport",
    "nccl_unique_id",
    "needed_ranges",
    "NCCL_UNIQUE_ID_BYTES",
    "same_host_pull_engine_transport",
    "same_host_pull_trainer_transport",
    "same_host_sender_transport",
    "same_host_transport",
]
