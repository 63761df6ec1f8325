"""A remap arena: live memory an engine makes before it meets a receiver.

An engine that captures CUDA graphs (vLLM) bakes its weights' addresses into them. Moving the
weights into a remap arena before the capture lets a receiver made later swap by remapping the
arena's live range onto the other slot: no copy, and the graphs read the new weights.

    arena = RemapArena(CudaBackend(0), layout.groups[0].arena_bytes)
    # copy the weights to arena.live_address (laid out as the layout's group), point the model at
    # it, capture the graphs; later:
    receiver = Receiver(layout, backend, transport, ReceiverConfig(swap_strategy="remap"),
                        arenas={"base": arena})
"""

from __future__ import annotations

from ctypes import Structure, byref, c_int, c_size_t, c_void_p

from ._handle import Handle
from .backend import Backend
from .errors import call


class RemapArenaInfoC(Structure):
    _fields_ = [("live", c_void_p), ("slot", c_void_p * 2), ("bytes", c_size_t),
                ("live_slot", c_int)]


class RemapArena(Handle):
    """`nbytes` of live memory over two physical slots on `backend` (NotSupportedError naming why
    where it cannot remap: the host backend, a device without CUDA VMM). Slot 0 is live and
    zero-filled at creation. A receiver that takes it shares it: the memory lives until both
    this object and the receiver are gone, so keep this object while the engine reads it."""

    _destroy_fn = "shadowsync_remap_arena_destroy"

    def __init__(self, backend: Backend, nbytes: int):
        handle = c_void_p()
        call("shadowsync_remap_arena_create", backend.handle, c_size_t(int(nbytes)), byref(handle))
        super().__init__(handle.value)
        self.backend = backend

    def _info(self) -> RemapArenaInfoC:
        info = RemapArenaInfoC()
        call("shadowsync_remap_arena_info", self._handle, byref(info))
        return info

    @property
    def live_address(self) -> int:
        """What the engine reads: the same for the arena's life."""
        return self._info().live

    def slot_address(self, slot: int) -> int:
        """Slot `slot`'s own mapping (0 or 1): its bytes, whatever is live."""
        if slot not in (0, 1):
            raise ValueError(f"slot must be 0 or 1, got {slot}")
        return self._info().slot[slot]

    @property
    def nbytes(self) -> int:
        return self._info().bytes

    @property
    def live_slot(self) -> int:
        """The slot the live range shows now."""
        return self._info().live_slot
