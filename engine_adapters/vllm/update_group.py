"""UpdateGroup: what init_weight_update_group set up on a worker (its receiver, the parameters
it swaps, how a swap reaches them, and the counters the RPCs report), kept in one attribute of
the worker; and how a swap rebinds parameters to the live slot."""

from __future__ import annotations

import collections
import ctypes
import time
from typing import Any

from shadowsync.backend import Stream
from shadowsync.errors import InvalidArgumentError
from shadowsync.layout import Layout
from shadowsync.receiver import GroupSwap, Receiver
from shadowsync.tensors import is_torch_tensor

from .rebind import Rebinding

__all__ = ["CudaBytes", "UpdateGroup", "address", "adopt", "param_data"]


class CudaBytes:
    """A device byte range in __cuda_array_interface__ form, for torch.as_tensor."""

    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class UpdateGroup:
    """What init_weight_update_group sets up on a worker; kept in one attribute of it."""

    def __init__(self, receiver: Receiver, params: dict[str, Any], kind: str, device: str):
        self.receiver = receiver
        self.params = params  # layout tensor name -> the model's parameter object
        self.kind = kind  # "numpy" or "torch"
        self.device = device
        # (group, arena address) -> the rebind of the group's parameters to views of that arena
        self.rebindings: dict[tuple[int, int], Rebinding] = {}
        self.stream: Stream | None = None  # the engine stream the swaps are enqueued on
        self.host_reads_after_copy = False
        # copy_in: the live storage is the parameters' own (Receiver.use_engine_storage): a swap
        # copies into them and nothing is rebound (CUDA graphs captured over them stay valid).
        self.engine_storage = False
        self.wire_fingerprint = receiver.wire_layout.fingerprint
        self.plan_copies = len(receiver.plan.copies) if receiver.plan is not None else 0
        self.kept_params = len(receiver.plan.kept) if receiver.plan is not None else 0
        self.swap_strategy = "rebind"  # the receiver's: what a swap does
        self.live_arena = False  # the live memory is the live-arena engine's (live_arena.py)
        # The graph-pairs engine (live_arena.GraphPairsEngine) whose arena this receiver rebinds
        # between; each swap switches vLLM to the new live slot's CUDA graphs (graph_pairs.py).
        self.graph_pairs = None
        self.last_swap_callback_s = 0.0  # the last swap's time in on_swap (weight_update_stats)
        # track_request_versions: request id -> [[version, tokens], ...] in step order.
        self.request_versions: dict[str, list[list[int]]] | None = None
        self.steps = 0  # execute_model calls since init (the hook counts them)
        self.coordinated = False  # commit_mode "coordinated": swaps come from commit_update
        # commit_mode "auto" under tensor parallelism: the step hooks commit, every rank at the
        # same step (step_agreement.py); and how many updates went live that way.
        self.step_agreement = None
        self.agreed_commits = 0
        # (first step, version) of each version made live, bounded.
        self.step_log: collections.deque = collections.deque(maxlen=1024)
        # The last begin_update and wait_applied: when each started (time.monotonic) and the
        # seconds the engine thread spent in it. Both run between two steps (collective_rpc), so
        # they add to how long generation stands still.
        self.last_begin_update = (0.0, 0.0)
        self.last_wait_applied = (0.0, 0.0)
        # The last commit_update (coordinated): the same, and of it the seconds the ranks took to
        # agree that every one holds the version ready.
        self.last_commit = (0.0, 0.0)
        self.last_commit_check_s = 0.0
        # Where the step hook runs: "model_runner._model_forward", "model_runner.kv_connector.
        # pre_forward" (vLLM's V2 GPU runner), "execute_model", or None (not
        # hooked: the engine calls before_step itself).
        self.step_hook_at: str | None = None

    def commit_at_agreed_step(self) -> int | None:
        """The step hook's part under step agreement: commits the update the receiver holds
        ready when the ranks agree that it goes live at this step; returns its version (None:
        nothing went live). One lock-free load on a rank holding nothing ready (rank 0 also
        writes its decision). Engine thread."""
        ready = self.receiver.ready_version
        if not self.step_agreement.goes_live(self.steps, ready):
            return None
        applied = self.receiver.commit(ready)
        self.committed(applied)
        self.agreed_commits += 1
        return applied

    def discard_up_to(self, version: int) -> int:
        """Drops the update the receiver holds ready if it is `version` or older, and `version`
        itself when its receive completes later (Receiver.discard); under step agreement every
        promise made so far counts for nothing. Every rank between the same two steps: what
        undoes an update ready on some ranks only. Returns the version dropped now (0: none)."""
        held = self.receiver.ready_version
        dropped = held if 0 < held <= version and self.receiver.discard(held) else 0
        if dropped != version:
            self.receiver.discard(version)  # still arriving here: dropped when it completes
        if self.step_agreement is not None:
            self.step_agreement.committed(self.steps, self.receiver.applied_version)
        return dropped

    def committed(self, version: int) -> None:
        """After a commit (commit_mode "coordinated", or the step agreement's, in a step hook or
        between two steps): logs the step it goes live at and tells the agreement."""
        self.step_log.append((self.steps, version))
        if self.step_agreement is not None:
            self.step_agreement.committed(self.steps, version)

    def group_views(self, group: int) -> list:
        """Views of every tensor of `group` in its live slot (group_rebinding's)."""
        return self.group_rebinding(group).tensors()

    def group_rebinding(self, group: int) -> Rebinding:
        """The rebind of `group`'s parameters to views of their place in its live slot; built once
        per slot (each group has two arenas, fixed for the receiver's life), so a swap only
        assigns."""
        key = (group, self.receiver.live_arena_pointer(group))
        rebinding = self.rebindings.get(key)
        if rebinding is None:
            info = self.receiver.layout.groups[group]
            arena = self._arena(key[1], info.arena_bytes)
            pairs = []
            for t in info.tensors:
                param = self.params[t.name]
                like = param_data(param)
                view = arena[t.offset : t.offset + t.bytes].view(like.dtype).reshape(t.shape)
                pairs.append((param, view))
            rebinding = self.rebindings[key] = Rebinding(pairs)
        return rebinding

    def _arena(self, address: int, size: int):
        if self.device == "cpu":
            raw = (ctypes.c_uint8 * size).from_address(address)
            raw._shadowsync_owner = self.receiver  # the memory is the receiver's
            if self.kind == "numpy":
                import numpy as np

                return np.frombuffer(raw, dtype=np.uint8)
            import torch

            return torch.frombuffer(raw, dtype=torch.uint8)
        import torch

        return torch.as_tensor(CudaBytes(address, size), device=self.device)

    def bind(self, group: int) -> None:
        """Points every parameter of `group` at its view in the live slot. Engine thread."""
        if self.engine_storage:
            return  # the parameters are the live storage
        self.group_rebinding(group).apply()

    def on_swap(self, version: int, swaps: list[GroupSwap]) -> None:
        started = time.perf_counter()
        try:
            self._swap(version, swaps)
        finally:
            self.last_swap_callback_s = time.perf_counter() - started

    def _swap(self, version: int, swaps: list[GroupSwap]) -> None:
        if not self.coordinated and self.step_agreement is None:
            # commit_update and commit_at_agreed_step log their own
            self.step_log.append((self.steps, version))
        for swap in swaps:
            if self.graph_pairs is not None:  # its arena is the update's one group
                self.graph_pairs.use_slot(swap.slot)
            else:
                self.bind(swap.group)  # copy_in, remap: the same views again (their address stays)
        if self.host_reads_after_copy:
            # copy_in enqueued the copies on the engine stream; the host itself reads host-backend
            # parameters, so the copies must have run before the step does.
            self.stream.synchronize()


def param_data(param):
    """The tensor of a parameter: a torch Parameter is one; other objects hold it in `.data`."""
    import numpy as np

    if is_torch_tensor(param):
        return param.data
    if isinstance(param, np.ndarray):
        raise InvalidArgumentError(
            "a parameter is a bare numpy array, which cannot be rebound: give objects with a "
            "settable .data (as torch parameters have)"
        )
    return param.data



def address(tensor) -> int:
    """Where a parameter's first element is (numpy or torch)."""
    if hasattr(tensor, "data_ptr"):
        return tensor.data_ptr()
    return tensor.ctypes.data


def adopt(state: UpdateGroup, layout: Layout, stream: Stream) -> None:
    """Copies the parameters' current values into the live slot, then rebinds them to it."""
    for group in layout.groups:
        for t, view in zip(group.tensors, state.group_views(group.index)):
            source = param_data(state.params[t.name])
            if state.kind == "numpy":
                view[...] = source
            else:
                view.copy_(source)  # on torch's current stream: the engine's
    if state.kind == "torch" and state.device != "cpu":
        import torch

        torch.cuda.current_stream(int(state.device.split(":")[1])).synchronize()
    for group in layout.groups:
        state.bind(group.index)
