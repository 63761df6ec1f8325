"""RemapArena and Receiver(arenas=...) through the Python package on the host backend: the host
backend cannot remap (NotSupportedError naming why), and an arena for a group the layout lacks is
refused in Python, naming the key and the layout's groups, before any C call; a handle the
library never made is refused by the C call, naming its index.

Checked to fail without their behaviour (each broken by hand once, then restored): the 0-bytes
check of shadowsync_remap_arena_create, and _arena_array's group check."""

import ctypes

import pytest
from support import BUCKET_BYTES, SPECS

import shadowsync as ss


class _StandIn:
    """Something with a handle: _arena_array reads only `.handle`, and refuses before."""

    handle = None


def test_a_remap_arena_on_the_host_backend_is_not_supported():
    with pytest.raises(ss.NotSupportedError,
                       match=r"a remap arena of 4096 bytes on backend 'host': .*"
                             r"no virtual memory remapping"):
        ss.RemapArena(ss.HostBackend(), 4096)


def test_a_remap_arena_of_no_bytes_is_an_invalid_argument():
    with pytest.raises(ss.InvalidArgumentError, match="'bytes' is 0"):
        ss.RemapArena(ss.HostBackend(), 0)


@pytest.mark.parametrize("key", ["nope", 7, -1])
def test_an_arena_for_a_group_the_layout_lacks_is_refused_naming_the_groups(key):
    layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
    groups = [g.name for g in layout.groups]
    assert groups == ["base", "lora"]
    with pytest.raises(ss.InvalidArgumentError) as info:
        ss.Receiver(layout, ss.HostBackend(), None,
                    ss.ReceiverConfig(swap_strategy="remap"), arenas={key: _StandIn()})
    message = str(info.value)
    assert f"arenas: {key!r} is not a group of the layout" in message
    assert "(groups: 'base', 'lora')" in message


def test_an_arena_handle_the_library_never_made_is_refused_naming_its_index():
    # No real arena can be made on the host backend: a handle the library never gave out reaches
    # the C call (a known group) and is refused there as a handle, never followed.
    layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)

    class Foreign:
        handle = ctypes.c_void_p(0x55aa0000deadbeef)

    with pytest.raises(ss.InvalidHandleError, match=r"'arenas\[1\]'"):
        ss.Receiver(layout, ss.HostBackend(), None,
                    ss.ReceiverConfig(swap_strategy="copy_in"), arenas={"lora": Foreign()})
