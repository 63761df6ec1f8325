"""The ctypes mirrors of the Python package against the C header they copy by hand.

tests/c_abi/abi_layout.c is compiled here with the C compiler (CC, else cc) against this checkout's
include/ and prints what the compiler laid out: each struct's size and its fields' offsets, sizes
and element types, the status values and the constants. Every ctypes struct, status name and
constant of shadowsync/_library.py and shadowsync/errors.py must match, so that a field added,
dropped, moved or retyped on one side only fails here instead of corrupting memory at run time.
Needs no libshadowsync_c."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shadowsync import _library, errors

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests" / "c_abi" / "abi_layout.c"

# C struct -> its mirror.
STRUCTS = {
    "shadowsync_tensor_spec_t": _library.TensorSpecC,
    "shadowsync_group_info_t": _library.GroupInfoC,
    "shadowsync_tensor_info_t": _library.TensorInfoC,
    "shadowsync_update_header_t": _library.UpdateHeaderC,
    "shadowsync_receiver_config_t": _library.ReceiverConfigC,
    "shadowsync_sender_config_t": _library.SenderConfigC,
    "shadowsync_nccl_config_t": _library.NcclConfigC,
    "shadowsync_receiver_stats_t": _library.ReceiverStatsC,
    "shadowsync_group_swap_t": _library.GroupSwapC,
    "shadowsync_source_tensor_t": _library.SourceTensorC,
    "shadowsync_plan_copy_t": _library.PlanCopyC,
    "shadowsync_wire_range_t": _library.WireRangeC,
    "shadowsync_tensor_region_t": _library.TensorRegionC,
    "shadowsync_source_shard_t": _library.SourceShardC,
    "shadowsync_rank_ranges_t": _library.RankRangesC,
    "shadowsync_route_t": _library.RouteC,
    "shadowsync_routing_plan_info_t": _library.RoutingPlanInfoC,
}

# C constant -> the package's copy.
CONSTANTS = {
    "SHADOWSYNC_NUM_RESULTS": len(errors.STATUS_NAMES),
    "SHADOWSYNC_C_API_VERSION": _library.C_API_VERSION,
    "SHADOWSYNC_CONFIG_MAGIC": _library.CONFIG_MAGIC,
    "SHADOWSYNC_CONFIG_VERSION": _library.CONFIG_VERSION,
    "SHADOWSYNC_CONFIG_UNDEF_INT": _library.CONFIG_UNDEF_INT,
    "SHADOWSYNC_CONFIG_UNDEF_INT64": _library.CONFIG_UNDEF_INT64,
    "SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION": _library.UPDATE_HEADER_STRUCT_VERSION,
    "SHADOWSYNC_MAX_HEADER_GROUPS": _library.MAX_HEADER_GROUPS,
    "SHADOWSYNC_MAX_HEADER_BYTES": _library.MAX_HEADER_BYTES,
    "SHADOWSYNC_NCCL_UNIQUE_ID_BYTES": _library.NCCL_UNIQUE_ID_BYTES,
    "SHADOWSYNC_SWAP_REBIND": _library.SWAP_STRATEGIES["rebind"],
    "SHADOWSYNC_SWAP_COPY_IN": _library.SWAP_STRATEGIES["copy_in"],
    "SHADOWSYNC_SWAP_REMAP": _library.SWAP_STRATEGIES["remap"],
    "SHADOWSYNC_COMMIT_AUTO": _library.COMMIT_MODES["auto"],
    "SHADOWSYNC_COMMIT_COORDINATED": _library.COMMIT_MODES["coordinated"],
    "SHADOWSYNC_SAME_HOST_MEMORY_HOST": _library.SAME_HOST_MEMORY["host"],
    "SHADOWSYNC_SAME_HOST_MEMORY_DEVICE": _library.SAME_HOST_MEMORY["device"],
    "SHADOWSYNC_REGION_BOX": _library.REGION_BOX,
    "SHADOWSYNC_REGION_ELEMENTS": _library.REGION_ELEMENTS,
}

# ctypes types by the element-type names abi_layout.c prints. c_size_t and c_uint64 are one
# class on LP64 platforms, as size_t and uint64_t are one type there.
CTYPE_NAMES = {
    ctypes.c_int32: "int32",
    ctypes.c_uint32: "uint32",
    ctypes.c_int64: "int64",
    ctypes.c_uint64: "uint64",
    ctypes.c_double: "double",
    ctypes.c_size_t: "uint64",
    ctypes.c_char_p: "char_p",
    ctypes.c_void_p: "void_p",
    ctypes.POINTER(ctypes.c_int64): "int64_p",
    ctypes.POINTER(_library.WireRangeC): "wire_range_p",
    _library.TensorRegionC: "tensor_region",
}


def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


@pytest.fixture(scope="module")
def c_abi(tmp_path_factory) -> dict:
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C compiler (CC, cc, gcc, clang) to lay out shadowsync.h with")
    binary = tmp_path_factory.mktemp("abi") / "abi_layout"
    subprocess.run(
        [compiler, "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic",
         f"-I{REPO / 'include'}", str(SOURCE), "-o", str(binary)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def _type_name(ctype) -> str:
    if issubclass(ctype, ctypes.Array):
        ctype = ctype._type_
    return CTYPE_NAMES.get(ctype, f"unmapped {ctype.__name__}")


def mirror_layout(cls) -> dict:
    """The mirror's layout in abi_layout.c's terms."""
    return {
        "size": ctypes.sizeof(cls),
        "fields": [
            {
                "name": name,
                "offset": getattr(cls, name).offset,
                "size": getattr(cls, name).size,
                "type": _type_name(ctype),
            }
            for name, ctype, *_ in cls._fields_
        ],
    }


def test_every_struct_of_the_header_has_a_mirror(c_abi):
    assert sorted(c_abi["structs"]) == sorted(STRUCTS)


@pytest.mark.parametrize("c_name", sorted(STRUCTS))
def test_struct_mirror_matches_the_header(c_abi, c_name):
    assert mirror_layout(STRUCTS[c_name]) == c_abi["structs"][c_name]


def test_status_names_and_values_match_the_header(c_abi):
    assert {name: value for value, name in errors.STATUS_NAMES.items()} == c_abi["statuses"]
    # One exception class per failure status.
    failures = set(c_abi["statuses"].values()) - {errors.SUCCESS, errors.IN_PROGRESS}
    assert {cls.status for cls in errors.ShadowsyncError.__subclasses__()} == failures
    assert errors.SUCCESS == c_abi["statuses"]["SHADOWSYNC_SUCCESS"]
    assert errors.IN_PROGRESS == c_abi["statuses"]["SHADOWSYNC_IN_PROGRESS"]


@pytest.mark.parametrize("c_name", sorted(CONSTANTS))
def test_constant_matches_the_header(c_abi, c_name):
    assert CONSTANTS[c_name] == c_abi["constants"][c_name]


def test_struct_initializers_match_the_header(c_abi):
    """UpdateHeaderC() sets what SHADOWSYNC_UPDATE_HEADER_INITIALIZER sets; config_struct()
    what the config initializers set."""
    header = _library.UpdateHeaderC()
    assert (header.size, header.struct_magic, header.struct_version) == (
        c_abi["structs"]["shadowsync_update_header_t"]["size"],
        c_abi["constants"]["SHADOWSYNC_CONFIG_MAGIC"],
        c_abi["constants"]["SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION"],
    )
    config = _library.config_struct(_library.SenderConfigC)
    assert config.size == c_abi["structs"]["shadowsync_sender_config_t"]["size"]
    assert config.root_rank == c_abi["constants"]["SHADOWSYNC_CONFIG_UNDEF_INT"]
    assert config.update_deadline_ms == c_abi["constants"]["SHADOWSYNC_CONFIG_UNDEF_INT64"]
    # The pacing fields' "none" is 0, as in SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER.
    receiver = _library.config_struct(_library.ReceiverConfigC)
    assert receiver.size == c_abi["structs"]["shadowsync_receiver_config_t"]["size"]
    assert (receiver.decode_slowdown_budget, receiver.max_receive_bytes_per_second) == (0.0, 0)
