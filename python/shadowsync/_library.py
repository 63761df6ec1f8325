"""Finding and loading libshadowsync_c, and the ctypes declarations of its C ABI.

Everything here mirrors include/shadowsync/shadowsync.h; that header is the reference. The library
is loaded on first use, not at import, so that ``import shadowsync`` (and vLLM resolving
``worker_extension_cls``) works on a machine where it is not built yet; the first call that needs
it raises :class:`LibraryNotFoundError` naming every place it looked.

Search order (the first hit wins):

1. ``SHADOWSYNC_LIBRARY``: the path of the .so. When set, nothing else is tried, so that a typo
   cannot silently load another build.
2. Next to this package: ``shadowsync/libshadowsync_c.so`` (where ``pip install .``
   puts it).
3. The CMake build trees of the source checkout this package sits in (``python/`` of the repo):
   ``<repo>/build/`` (what ``scripts/test.sh`` and ``scripts/demo.sh`` build), then
   ``<repo>/build-release/``.
4. The system loader: ``libshadowsync_c.so`` through dlopen's own search (``LD_LIBRARY_PATH``,
   the ld.so cache: where ``cmake --install`` put it).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_double,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path

LIBRARY_FILE = "libshadowsync_c.so"
ENV_VAR = "SHADOWSYNC_LIBRARY"
C_API_VERSION = 2  # SHADOWSYNC_C_API_VERSION this package was written against

# The CMake build directories searched in a source checkout, relative to the repository root.
BUILD_DIRS = ("build", "build-release")

CONFIG_MAGIC = 0x53534346
CONFIG_VERSION = 1
CONFIG_UNDEF_INT = -(2**31)
CONFIG_UNDEF_INT64 = -(2**63)
UPDATE_HEADER_STRUCT_VERSION = 1
MAX_HEADER_GROUPS = 256
MAX_HEADER_BYTES = 36 + 4 * MAX_HEADER_GROUPS
NCCL_UNIQUE_ID_BYTES = 128
# shadowsync_same_host_memory_t by name (where the same-host transport's staging slots live).
SAME_HOST_MEMORY = {"host": 0, "device": 1}


class LibraryNotFoundError(OSError):
    """libshadowsync_c could not be found or loaded; the message lists where it looked."""


# --- C structs ------------------------------------------------------------------------------


class TensorSpecC(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("dtype", c_char_p),
        ("shape", POINTER(c_int64)),
        ("ndim", c_size_t),
        ("group", c_char_p),
    ]


class GroupInfoC(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("tensor_count", c_size_t),
        ("arena_bytes", c_size_t),
        ("bucket_bytes", c_size_t),
        ("bucket_count", c_size_t),
    ]


class TensorInfoC(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("dtype", c_char_p),
        ("shape", POINTER(c_int64)),
        ("ndim", c_size_t),
        ("offset", c_size_t),
        ("bytes", c_size_t),
    ]


class UpdateHeaderC(Structure):
    """shadowsync_update_header_t. A new one is initialized as SHADOWSYNC_UPDATE_HEADER_INITIALIZER
    does (size, struct_magic, struct_version set), for reading and for writing alike."""

    _fields_ = [
        ("size", c_size_t),
        ("struct_magic", c_uint32),
        ("struct_version", c_uint32),
        ("magic", c_uint32),
        ("protocol_version", c_uint32),
        ("version", c_uint64),
        ("layout_fingerprint", c_uint64),
        ("group_count", c_uint32),
        ("groups", c_uint32 * MAX_HEADER_GROUPS),
        ("bucket_count", c_uint64),
    ]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.size = ctypes.sizeof(UpdateHeaderC)
        self.struct_magic = CONFIG_MAGIC
        self.struct_version = UPDATE_HEADER_STRUCT_VERSION


class ReceiverConfigC(Structure):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint32),
        ("version", c_uint32),
        ("root_rank", c_int32),
        ("update_deadline_ms", c_int64),
        ("bucket_deadline_ms", c_int64),
        ("poll_interval_us", c_int64),
        ("swap_strategy", c_int32),  # SWAP_STRATEGIES
        ("engine_uses_cuda_graphs", c_int32),
        ("require_checksums", c_int32),
        ("reject_nonfinite", c_int32),
        ("abort_deadline_ms", c_int64),
        ("exit_on_stuck_abort", c_int32),
        ("commit_mode", c_int32),  # COMMIT_MODES
        ("decode_slowdown_budget", c_double),  # 0: no pacing
        ("max_receive_bytes_per_second", c_uint64),  # 0: no cap
        ("gated_swaps", c_int32),
        ("gate_deadline_ms", c_int64),
        ("offer_after_clean_step", c_int32),
    ]


# shadowsync_swap_strategy_t by name (ReceiverConfig.swap_strategy).
SWAP_STRATEGIES = {"rebind": 0, "copy_in": 1, "remap": 2}
COMMIT_MODES = {"auto": 0, "coordinated": 1}


class SenderConfigC(Structure):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint32),
        ("version", c_uint32),
        ("root_rank", c_int32),
        ("update_deadline_ms", c_int64),
        ("poll_interval_us", c_int64),
        ("checksums", c_int32),
    ]


class NcclConfigC(Structure):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint32),
        ("version", c_uint32),
        ("max_ctas", c_int32),
        ("min_ctas", c_int32),
        ("cga_cluster_size", c_int32),
        ("init_timeout_ms", c_int64),
        ("enqueue_timeout_ms", c_int64),
        ("finalize_timeout_ms", c_int64),
    ]


class ReceiverStatsC(Structure):
    _fields_ = [
        ("size", c_size_t),
        ("updates_ready", c_uint64),
        ("updates_failed", c_uint64),
        ("updates_superseded", c_uint64),
        ("bytes_received", c_uint64),
        ("last_accepted_version", c_uint64),
        ("applied_version", c_uint64),
        ("needs_transport", c_int32),
        ("has_pending", c_int32),
        ("stuck_aborts", c_uint64),
        ("last_failed_version", c_uint64),
        ("last_failure_status", c_int32),
        ("last_failed_group", c_int32),
        ("last_failed_bucket", c_int64),
        ("last_failed_tensor", c_int64),
        ("ready_version", c_uint64),
        ("last_transfer_ns", c_int64),
        ("last_paced", c_int32),
        ("last_deadline_limited", c_int32),
        ("last_pacing_budget", c_double),
        ("last_idle_step_ns", c_int64),
        ("last_step_during_ns", c_int64),
        ("last_step_ratio", c_double),
        ("last_pacing_steps", c_uint64),
        ("last_busy_ns", c_int64),
        ("last_held_back_ns", c_int64),
        ("last_duty", c_double),
        ("last_swap_ns", c_int64),
        ("last_swap_started_ns", c_int64),
        ("gated_swaps", c_uint64),
        ("gates_abandoned", c_uint64),
        ("last_clean_step_wait_ns", c_int64),
        ("last_clean_step_missed", c_int32),
        ("plan_pieces", c_uint64),
        ("plan_staging_bytes", c_uint64),
        ("routed_bytes", c_uint64),
        ("trainer_count", c_int32),
        ("routing_fingerprint", c_uint64),
        ("routed_in_place_bytes", c_uint64),
    ]


class GroupSwapC(Structure):
    _fields_ = [("group", c_size_t), ("slot", c_int32), ("content_version", c_uint64)]


class SourceTensorC(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("data", c_void_p),
        ("dtype", c_char_p),
        ("shape", POINTER(c_int64)),
        ("ndim", c_size_t),
    ]


class PlanQuantizationC(Structure):
    _fields_ = [("engine", c_char_p), ("scale", c_char_p), ("parts", c_int64)]


class PlanCopyC(Structure):
    _fields_ = [
        ("wire", c_char_p),
        ("engine", c_char_p),
        ("ndim", c_size_t),
        ("shape", POINTER(c_int64)),
        ("src_offset", c_int64),
        ("src_strides", POINTER(c_int64)),
        ("dst_offset", c_int64),
        ("dst_strides", POINTER(c_int64)),
    ]


class WireRangeC(Structure):
    _fields_ = [("group", c_uint32), ("reserved", c_uint32), ("begin", c_uint64), ("end", c_uint64)]


# shadowsync_tensor_region_t's kinds.
REGION_BOX = 0
REGION_ELEMENTS = 1


class TensorRegionC(Structure):
    _fields_ = [
        ("tensor", c_char_p),
        ("kind", c_int32),
        ("ndim", c_size_t),
        ("begin", POINTER(c_int64)),
        ("end", POINTER(c_int64)),
        ("first", c_int64),
        ("count", c_int64),
    ]


class SourceShardC(Structure):
    _fields_ = [("region", TensorRegionC), ("data", c_void_p), ("dtype", c_char_p)]


class RankRangesC(Structure):
    _fields_ = [("rank", c_int32), ("ranges", POINTER(WireRangeC)), ("count", c_size_t)]


class RouteC(Structure):
    _fields_ = [
        ("trainer", c_int32),
        ("engine", c_int32),
        ("group", c_uint32),
        ("reserved", c_uint32),
        ("bucket", c_uint64),
        ("wire_offset", c_uint64),
        ("source_offset", c_uint64),
        ("bytes", c_uint64),
    ]


class RoutingPlanInfoC(Structure):
    _fields_ = [
        ("size", c_size_t),
        ("trainer_count", c_int32),
        ("engine_count", c_int32),
        ("fingerprint", c_uint64),
        ("route_count", c_uint64),
    ]


SWAP_CALLBACK = CFUNCTYPE(None, c_void_p, c_uint64, POINTER(GroupSwapC), c_size_t)

# --- function prototypes --------------------------------------------------------------------

_P = POINTER
_H = c_void_p  # every handle type is an opaque pointer-sized token

# name: (restype, argtypes). A restype of c_int is a shadowsync_status_t.
_PROTOTYPES = {
    "shadowsync_get_error_string": (c_char_p, [c_int]),
    "shadowsync_get_last_error": (c_char_p, []),
    "shadowsync_get_c_api_version": (c_int, []),
    "shadowsync_has_cuda": (c_int, []),
    "shadowsync_dtype_info": (c_int, [c_char_p, _P(c_char_p), _P(c_size_t)]),
    # layout
    "shadowsync_layout_create": (c_int, [_P(TensorSpecC), c_size_t, c_size_t, _P(_H)]),
    "shadowsync_layout_destroy": (c_int, [_H]),
    "shadowsync_layout_fingerprint": (c_int, [_H, _P(c_uint64)]),
    "shadowsync_layout_group_count": (c_int, [_H, _P(c_size_t)]),
    "shadowsync_layout_group_info": (c_int, [_H, c_size_t, _P(GroupInfoC)]),
    "shadowsync_layout_tensor_info": (c_int, [_H, c_size_t, c_size_t, _P(TensorInfoC)]),
    "shadowsync_layout_find_tensor": (c_int, [_H, c_char_p, _P(c_size_t), _P(c_size_t)]),
    "shadowsync_layout_find_group": (c_int, [_H, c_char_p, _P(c_size_t)]),
    # headers
    "shadowsync_header_serialize": (c_int, [_P(UpdateHeaderC), c_void_p, c_size_t, _P(c_size_t)]),
    "shadowsync_header_parse": (c_int, [c_void_p, c_size_t, _P(UpdateHeaderC)]),
    # backends and streams
    "shadowsync_host_backend_create": (c_int, [_P(_H)]),
    "shadowsync_cuda_backend_create": (c_int, [c_int, _P(_H)]),
    "shadowsync_backend_destroy": (c_int, [_H]),
    "shadowsync_backend_name": (c_int, [_H, _P(c_char_p)]),
    "shadowsync_stream_create": (c_int, [_H, c_int, _P(_H)]),
    "shadowsync_stream_wrap_cuda": (c_int, [_H, c_void_p, _P(_H)]),
    "shadowsync_stream_synchronize": (c_int, [_H]),
    "shadowsync_stream_destroy": (c_int, [_H]),
    # transports
    "shadowsync_loopback_create": (c_int, [c_int, _P(_H)]),
    "shadowsync_loopback_transport": (c_int, [_H, c_int, _P(_H)]),
    "shadowsync_loopback_destroy": (c_int, [_H]),
    "shadowsync_nccl_unique_id": (c_int, [_P(c_uint8)]),
    "shadowsync_nccl_transport_create": (
        c_int,
        [_P(c_uint8), c_int, c_int, c_int, _P(NcclConfigC), _P(_H)],
    ),
    "shadowsync_nccl_routed_transport_create_replicated": (
        c_int,
        [_P(c_uint8), c_int, c_int, _H, _H, _P(c_char_p), c_size_t, c_int, _P(NcclConfigC),
         _P(_H)],
    ),
    "shadowsync_nccl_library": (c_int, [c_char_p, c_size_t, _P(c_int32)]),
    "shadowsync_nccl_add_python_path": (c_int, [c_char_p]),
    "shadowsync_same_host_transport_serve": (
        c_int,
        [c_char_p, c_char_p, c_size_t, c_int, _H, c_int, c_size_t, c_int64, _P(_H)],
    ),
    "shadowsync_same_host_transport_connect": (
        c_int,
        [c_char_p, c_char_p, c_size_t, c_int, _H, c_int64, _P(_H)],
    ),
    "shadowsync_same_host_pull_serve": (
        c_int,
        [c_char_p, c_char_p, c_size_t, _H, c_int32, c_int32, _H, c_int, c_int64, _P(_H)],
    ),
    "shadowsync_same_host_pull_connect_replica": (
        c_int,
        [_P(c_char_p), c_size_t, c_char_p, c_size_t, _H, c_int32, c_int32, _H, c_int64, _P(_H)],
    ),
    "shadowsync_transport_destroy": (c_int, [_H]),
    # receiver
    "shadowsync_receiver_create": (c_int, [_H, _H, _H, _P(ReceiverConfigC), _P(_H)]),
    "shadowsync_receiver_commit": (c_int, [_H, _H, c_uint64, _P(c_uint64)]),
    "shadowsync_receiver_use_engine_storage": (c_int, [_H, c_size_t, _P(c_void_p), c_size_t]),
    "shadowsync_remap_arena_create": (c_int, [_H, c_size_t, _P(_H)]),
    "shadowsync_remap_arena_info": (c_int, [_H, c_void_p]),
    "shadowsync_remap_arena_destroy": (c_int, [_H]),
    "shadowsync_receiver_create_with_arenas": (
        c_int,
        [_H, _H, _P(PlanCopyC), c_size_t, _P(_H), c_size_t, _H, _H, _P(ReceiverConfigC), _P(_H)],
    ),
    "shadowsync_receiver_create_with_quantized_plan": (
        c_int,
        [_H, _H, _P(PlanCopyC), c_size_t, _P(PlanQuantizationC), c_size_t, _P(_H), c_size_t, _H,
         _H, _P(ReceiverConfigC), _P(_H)],
    ),
    "shadowsync_receiver_create_with_plan": (
        c_int,
        [_H, _H, _P(PlanCopyC), c_size_t, _H, _H, _P(ReceiverConfigC), _P(_H)],
    ),
    "shadowsync_receiver_destroy": (c_int, [_H]),
    "shadowsync_receiver_begin_update": (c_int, [_H, _P(UpdateHeaderC)]),
    "shadowsync_receiver_begin_update_bytes": (c_int, [_H, c_void_p, c_size_t]),
    "shadowsync_receiver_begin_update_checked": (c_int, [_H, c_void_p, c_size_t, c_uint32]),
    "shadowsync_make_token": (c_int, [c_char_p, c_size_t]),
    "shadowsync_receiver_abort_update": (c_int, [_H]),
    "shadowsync_receiver_replace_transport": (c_int, [_H, _H]),
    "shadowsync_receiver_drain": (c_int, [_H]),
    "shadowsync_receiver_before_step": (c_int, [_H, _H, _P(c_uint64)]),
    "shadowsync_receiver_apply_pending_now": (c_int, [_H, _H, _P(c_uint64)]),
    "shadowsync_receiver_after_launch": (c_int, [_H, _H, _P(c_uint64)]),
    "shadowsync_receiver_wait_applied": (c_int, [_H, c_uint64, c_int64, _H]),
    "shadowsync_receiver_applied_version": (c_int, [_H, _P(c_uint64)]),
    "shadowsync_receiver_ready_version": (c_int, [_H, _P(c_uint64)]),
    "shadowsync_receiver_discard": (c_int, [_H, c_uint64, _P(c_int)]),
    "shadowsync_receiver_live_tensor": (c_int, [_H, c_size_t, c_size_t, _P(c_void_p)]),
    "shadowsync_receiver_live_tensor_by_name": (c_int, [_H, c_char_p, _P(c_void_p)]),
    "shadowsync_receiver_live_arena": (c_int, [_H, c_size_t, _P(c_void_p)]),
    "shadowsync_receiver_live_content_version": (c_int, [_H, c_size_t, _P(c_uint64)]),
    "shadowsync_receiver_set_swap_callback": (c_int, [_H, SWAP_CALLBACK, c_void_p]),
    "shadowsync_receiver_rollback": (c_int, [_H, _H, _P(c_uint64)]),
    "shadowsync_receiver_stats": (c_int, [_H, _P(ReceiverStatsC)]),
    "shadowsync_receiver_last_update_error": (c_int, [_H, _P(c_char), c_size_t, _P(c_size_t)]),
    # sender
    "shadowsync_sender_create": (c_int, [_H, _H, _H, _P(SenderConfigC), _P(_H)]),
    "shadowsync_sender_destroy": (c_int, [_H]),
    "shadowsync_sender_replace_transport": (c_int, [_H, _H]),
    "shadowsync_sender_publish": (
        c_int,
        [_H, c_uint64, _P(c_char_p), c_size_t, _P(SourceTensorC), c_size_t, _P(_H)],
    ),
    "shadowsync_sender_publish_streamed": (c_int, [_H, c_uint64, _P(c_char_p), c_size_t, _P(_H)]),
    "shadowsync_publish_supply": (c_int, [_H, _P(SourceTensorC), c_size_t]),
    "shadowsync_publish_next_tensor": (c_int, [_H, _P(c_size_t), _P(c_size_t), _P(c_size_t)]),
    "shadowsync_publish_header": (c_int, [_H, _P(UpdateHeaderC)]),
    "shadowsync_publish_header_bytes": (c_int, [_H, c_void_p, c_size_t, _P(c_size_t)]),
    "shadowsync_publish_wait": (c_int, [_H, c_int64]),
    "shadowsync_publish_done": (c_int, [_H, _P(c_int)]),
    "shadowsync_publish_destroy": (c_int, [_H]),
    # routing plans
    "shadowsync_layout_region_ranges": (
        c_int,
        [_H, _P(TensorRegionC), _P(WireRangeC), c_size_t, _P(c_size_t)],
    ),
    "shadowsync_receiver_needed_ranges": (c_int, [_H, _P(WireRangeC), c_size_t, _P(c_size_t)]),
    "shadowsync_receive_plan_needed_ranges": (
        c_int,
        [_H, _H, _P(PlanCopyC), c_size_t, _P(PlanQuantizationC), c_size_t, _P(WireRangeC),
         c_size_t, _P(c_size_t)],
    ),
    "shadowsync_routing_plan_create": (
        c_int,
        [_H, _P(RankRangesC), c_size_t, _P(RankRangesC), c_size_t, _P(_H)],
    ),
    "shadowsync_routing_plan_destroy": (c_int, [_H]),
    "shadowsync_routing_plan_info": (c_int, [_H, _P(RoutingPlanInfoC)]),
    "shadowsync_routing_plan_bytes_to_engine": (c_int, [_H, c_int32, _P(c_uint64)]),
    "shadowsync_routing_plan_bytes_from_trainer": (c_int, [_H, c_int32, _P(c_uint64)]),
    "shadowsync_routing_plan_packed_range": (
        c_int,
        [_H, c_int32, c_size_t, c_size_t, _P(c_uint64), _P(c_uint64)],
    ),
    "shadowsync_routing_plan_max_packed_bytes": (c_int, [_H, c_int32, _P(c_uint64)]),
    "shadowsync_routing_plan_routes": (
        c_int,
        [_H, c_size_t, c_size_t, _P(RouteC), c_size_t, _P(c_size_t)],
    ),
    "shadowsync_sender_create_for_trainer_rank": (
        c_int,
        [_H, _H, c_int32, _H, _H, _P(SenderConfigC), _P(_H)],
    ),
    "shadowsync_sender_publish_shards": (
        c_int,
        [_H, c_uint64, _P(c_char_p), c_size_t, _P(SourceShardC), c_size_t, _P(_H)],
    ),
    "shadowsync_sender_staging_bytes": (c_int, [_H, _P(c_uint64)]),
    "shadowsync_sender_routes_in_place": (c_int, [_H, _P(c_int32), c_char_p, c_size_t,
                                                  _P(c_size_t)]),
    "shadowsync_receiver_use_routing_plan": (c_int, [_H, _H, c_int32]),
}


# --- locating and loading -------------------------------------------------------------------


def _repo_root() -> Path | None:
    """The source checkout this package lies in (python/shadowsync/ of the repo), if any."""
    root = Path(__file__).resolve().parent.parent.parent
    if (root / "include" / "shadowsync" / "shadowsync.h").is_file():
        return root
    return None


def candidates(environ=None) -> tuple[list[str], list[str]]:
    """The paths to try in order, and a description of each place looked, for the error."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(ENV_VAR)
    if explicit:
        return [explicit], [f"{ENV_VAR}={explicit}"]
    paths = [str(Path(__file__).resolve().parent / LIBRARY_FILE)]
    root = _repo_root()
    if root is not None:
        paths += [str(root / d / LIBRARY_FILE) for d in BUILD_DIRS]
    places = [f"{ENV_VAR} (unset)"] + paths
    return paths, places


def locate(environ=None) -> str:
    """The path (or, for the system loader, the bare name) to load. Raises LibraryNotFoundError."""
    paths, places = candidates(environ)
    environ = os.environ if environ is None else environ
    for path in paths:
        if os.path.isfile(path):
            return path
    if environ.get(ENV_VAR):
        raise LibraryNotFoundError(
            f"{LIBRARY_FILE} not found: {ENV_VAR} is set to '{environ[ENV_VAR]}', which is not a "
            f"file. Point it at the libshadowsync_c.so of a CMake build (cmake --build <dir> "
            f"--target shadowsync_c) or unset it to search the default places."
        )
    return LIBRARY_FILE  # the system loader's turn; load() reports every place if it fails too


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None


def load() -> ctypes.CDLL:
    """The loaded library (loaded once per process). Thread-safe."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = locate()
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            if path == LIBRARY_FILE:
                _, places = candidates()
                looked = "\n  ".join(places + [f"the system loader ('{LIBRARY_FILE}': {e})"])
                raise LibraryNotFoundError(
                    f"{LIBRARY_FILE} not found. Looked in:\n  {looked}\nInstall the package with "
                    f"its library (pip install . from the repository), or build it (cmake -S . "
                    f"-B build && cmake --build build --target shadowsync_c) and set {ENV_VAR} "
                    f"to the .so, or install it where the system loader finds it."
                ) from e
            raise LibraryNotFoundError(f"{path}: cannot be loaded: {e}") from e
        try:
            _declare(lib)
        except AttributeError as e:
            raise LibraryNotFoundError(
                f"{path} is not a shadowsync C ABI library (or an older one): {e}"
            ) from e
        version = lib.shadowsync_get_c_api_version()
        if version != C_API_VERSION:
            raise LibraryNotFoundError(
                f"{path}: C ABI version {version} does not match this package's "
                f"{C_API_VERSION}; use a library and package of the same shadowsync version"
            )
        if lib.shadowsync_has_cuda():
            # Where this Python's packages are: the NCCL loader then finds the nvidia-nccl-cu*
            # package torch loads, even before torch is imported (one NCCL per process).
            lib.shadowsync_nccl_add_python_path(
                os.pathsep.join(p for p in sys.path if p and os.pathsep not in p).encode())
        _lib, _lib_path = lib, path
        return lib


_lib_keeping_gil: ctypes.PyDLL | None = None


def load_keeping_gil() -> ctypes.PyDLL:
    """The same library through ctypes.PyDLL: its calls keep the GIL instead of releasing it.
    For the step hook's calls that never block (before_step under rebind and copy_in): a CDLL
    call releases the GIL and must take it back on return, and the swap callback inside takes
    it too, each time waiting for whichever Python thread took it meanwhile (vLLM's output
    thread, say). Loaded once per process. Thread-safe."""
    global _lib_keeping_gil
    if _lib_keeping_gil is not None:
        return _lib_keeping_gil
    load()  # locates and checks the library first
    with _lock:
        if _lib_keeping_gil is None:
            lib = ctypes.PyDLL(_lib_path)
            _declare(lib)
            _lib_keeping_gil = lib
    return _lib_keeping_gil


def library_path() -> str:
    """Where the loaded library came from (loads it if needed)."""
    load()
    assert _lib_path is not None
    return _lib_path


def config_struct(cls, **fields):
    """A size/magic/version config struct (as its C _INITIALIZER macro fills it), with `fields`
    set where not None; the rest stay "undefined", i.e. the library's defaults: the sentinels
    for int32/int64 fields, 0 for double and uint64 fields (whose 0 means "none")."""
    c = cls()
    c.size = ctypes.sizeof(cls)
    c.magic = CONFIG_MAGIC
    c.version = CONFIG_VERSION
    for name, ctype in cls._fields_[3:]:
        value = fields.pop(name, None)
        if ctype is c_double:
            setattr(c, name, 0.0 if value is None else float(value))
        elif ctype is c_uint64:
            setattr(c, name, 0 if value is None else int(value))
        else:
            undefined = CONFIG_UNDEF_INT64 if ctype is c_int64 else CONFIG_UNDEF_INT
            setattr(c, name, undefined if value is None else int(value))
    if fields:
        raise TypeError(f"{cls.__name__}: unknown fields {sorted(fields)}")
    return c
