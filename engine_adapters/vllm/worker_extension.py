"""vLLM integration: a worker extension the trainer drives through ``collective_rpc``.

    llm = vllm.LLM(model=..., worker_extension_cls="shadowsync.vllm.WorkerExtension")

vLLM mixes WorkerExtension into its worker class, so its methods run with the worker as ``self``
and the trainer calls them by name:

* ``init_weight_update_group(unique_id, rank_offset, world_size, specs=...)``: once. Builds the
  layout from the model's parameters (checked against the trainer's specs), allocates the shadow,
  joins the NCCL group, moves the parameters into the live slot and hooks ``execute_model``.
* ``begin_update(header_bytes)``: once per update, returns at once. The receive runs on the
  library's native receiver thread, never a Python thread, while the engine keeps generating.
* ``before_step()``: runs before every ``execute_model`` (installed by init): with nothing pending
  it is one call into C and one atomic load; when an update landed it flips every group of it
  live and rebinds each parameter (``param.data = view`` of the live slot).
* ``wait_applied(version, timeout)``: for an idle engine, applies the update without a step.

Neither vllm nor torch is imported at import time; torch is imported only when the parameters are
torch tensors. The same methods work on any object that has ``model_runner.model`` (or ``model``)
with ``named_parameters()`` and an ``execute_model`` method, which is how the CPU tests drive it
with numpy "parameters" on the host backend.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Callable, Iterable

from shadowsync import _tensors
from shadowsync.backend import Backend, CudaBackend, HostBackend, Stream
from shadowsync.errors import InvalidArgumentError, LayoutMismatchError
from shadowsync.layout import BASE_GROUP, Layout, TensorSpec, UpdateHeader, format_shape
from shadowsync.receiver import GroupSwap, Receiver, ReceiverConfig
from shadowsync.transport import Transport, nccl_transport

__all__ = ["WorkerExtension"]


class _CudaBytes:
    """A device byte range in __cuda_array_interface__ form, for torch.as_tensor."""

    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class _UpdateGroup:
    """What init_weight_update_group sets up on a worker; kept in one attribute of it."""

    def __init__(self, receiver: Receiver, params: dict[str, Any], kind: str, device: str):
        self.receiver = receiver
        self.params = params  # layout tensor name -> the model's parameter object
        self.kind = kind  # "numpy" or "torch"
        self.device = device
        self.views: dict[tuple[int, int], list] = {}  # (group, arena address) -> tensor views
        self.stream: Stream | None = None  # the engine stream the swaps are enqueued on
        self.host_reads_after_copy = False

    def group_views(self, group: int) -> list:
        """Views of every tensor of `group` in its live slot; built once per slot (each group has
        two arenas, fixed for the receiver's life), so a swap only assigns."""
        address = self.receiver.live_arena_pointer(group)
        key = (group, address)
        views = self.views.get(key)
        if views is None:
            info = self.receiver.layout.groups[group]
            arena = self._arena(address, info.arena_bytes)
            views = []
            for t in info.tensors:
                like = _data(self.params[t.name])
                views.append(arena[t.offset : t.offset + t.bytes].view(like.dtype).reshape(t.shape))
            self.views[key] = views
        return views

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

        return torch.as_tensor(_CudaBytes(address, size), device=self.device)

    def bind(self, group: int) -> None:
        """Points every parameter of `group` at its view in the live slot. Engine thread."""
        info = self.receiver.layout.groups[group]
        for t, view in zip(info.tensors, self.group_views(group)):
            self.params[t.name].data = view

    def on_swap(self, version: int, swaps: list[GroupSwap]) -> None:
        for swap in swaps:
            self.bind(swap.group)  # copy_in, remap: the same views again (their address stays)
        if self.host_reads_after_copy:
            # copy_in enqueued the copies on the engine stream; the host itself reads host-backend
            # parameters, so the copies must have run before the step does.
            self.stream.synchronize()


def _data(param):
    """The tensor of a parameter: a torch Parameter is one; other objects hold it in `.data`."""
    import numpy as np

    if _tensors.is_torch_tensor(param):
        return param.data
    if isinstance(param, np.ndarray):
        raise InvalidArgumentError(
            "a parameter is a bare numpy array, which cannot be rebound: give objects with a "
            "settable .data (as torch parameters have)"
        )
    return param.data


class WorkerExtension:
    """Mixed into a vLLM worker (``worker_extension_cls``); see the module's doc."""

    _shadowsync: _UpdateGroup | None = None

    # --- what an engine may override ---------------------------------------------------------

    def _shadowsync_named_parameters(self) -> Iterable[tuple[str, Any]]:
        """The model's (name, parameter) pairs: ``self.model_runner.model`` (vLLM's GPU worker),
        else ``self.model``."""
        model = getattr(getattr(self, "model_runner", None), "model", None)
        if model is None:
            model = getattr(self, "model", None)
        if model is None or not hasattr(model, "named_parameters"):
            raise InvalidArgumentError(
                f"{type(self).__name__}: no model with named_parameters() at self.model_runner.model "
                f"or self.model; override _shadowsync_named_parameters()"
            )
        return model.named_parameters()

    # --- the methods the trainer calls through collective_rpc ------------------------------

    def init_weight_update_group(
        self,
        unique_id: bytes | None = None,
        rank_offset: int = 1,
        world_size: int = 2,
        specs: Iterable | None = None,
        bucket_bytes: int = 0,
        group_of: Callable[[str], str] | None = None,
        adopt_current_weights: bool = True,
        receiver_config: ReceiverConfig | None = None,
        transport: Transport | None = None,
        hook_execute_model: bool = True,
        swap_strategy: str | None = None,
        engine_uses_cuda_graphs: bool | None = None,
    ) -> int:
        """Sets up the weight update group; returns the layout fingerprint (the trainer compares
        it with its own). Engine thread, before stepping; once.

        The transport: NCCL from `unique_id` (nccl_unique_id() on the trainer), this worker being
        rank ``rank_offset + self.rank`` of `world_size`; blocks until every rank joined, so the
        trainer must create its own transport concurrently (start this call asynchronously, e.g.
        a Ray ``.remote``). Or a ready `transport` (a Loopback rank in tests), or neither: install
        one later with ``self._shadowsync.receiver.replace_transport``.

        `specs`: the trainer's tensor specs (``Layout.specs`` on its side: names, dtypes, shapes,
        groups in its order); each must be a parameter of the model with that dtype and shape.
        None: every parameter in the model's order, grouped by `group_of` (default "base").
        `adopt_current_weights`: copy the model's weights into the live slot and rebind to it, so
        its own storage is freed (two copies of the weights, not three) and a group an update does
        not carry keeps the current weights.

        `swap_strategy` and `engine_uses_cuda_graphs` set those fields of `receiver_config`: an
        engine that replays CUDA graphs (vLLM without ``enforce_eager``) passes
        ``swap_strategy="copy_in"`` (or ``"remap"`` on a GPU with VMM) and
        ``engine_uses_cuda_graphs=True``; the parameters are then bound once to the live storage,
        whose addresses never change, and each swap rewrites the bytes under them."""
        if self._shadowsync is not None:
            raise InvalidArgumentError(
                f"init_weight_update_group: already initialized (layout "
                f"{self._shadowsync.receiver.layout.fingerprint:#018x})"
            )
        params = dict(_tensors.items(self._shadowsync_named_parameters()))
        descs = {name: _tensors.describe(name, _data(p)) for name, p in params.items()}
        if not descs:
            raise InvalidArgumentError("init_weight_update_group: the model has no parameters")
        kind, device = _placement(descs)

        if specs is None:
            specs = [
                TensorSpec(n, d.dtype, d.shape, group_of(n) if group_of else BASE_GROUP)
                for n, d in descs.items()
            ]
        else:
            specs = [TensorSpec.coerce(s) for s in specs]
            _check_specs(specs, descs)
        layout = Layout(specs, bucket_bytes)

        backend: Backend
        if device == "cpu":
            backend = HostBackend()
            stream = backend.create_stream()
        else:
            import torch

            index = int(device.split(":")[1])
            backend = CudaBackend(index)
            # The stream execute_model runs on: release events are recorded there.
            stream = backend.wrap_stream(torch.cuda.current_stream(index).cuda_stream)
        if transport is None and unique_id is not None:
            if device == "cpu":
                raise InvalidArgumentError(
                    "init_weight_update_group: NCCL needs CUDA parameters, the model's are on cpu"
                )
            rank = int(rank_offset) + int(getattr(self, "rank", 0))
            transport = nccl_transport(unique_id, rank, int(world_size), int(device.split(":")[1]))

        if swap_strategy is not None or engine_uses_cuda_graphs is not None:
            receiver_config = dataclasses.replace(receiver_config or ReceiverConfig())
            if swap_strategy is not None:
                receiver_config.swap_strategy = swap_strategy
            if engine_uses_cuda_graphs is not None:
                receiver_config.engine_uses_cuda_graphs = engine_uses_cuda_graphs
        receiver = Receiver(layout, backend, transport, receiver_config, engine_stream=stream)
        state = _UpdateGroup(receiver, {s.name: params[s.name] for s in specs}, kind, device)
        state.stream = stream
        state.host_reads_after_copy = device == "cpu" and (
            receiver_config is not None and receiver_config.swap_strategy == "copy_in"
        )
        receiver.set_swap_callback(state.on_swap)
        if adopt_current_weights:
            _adopt(state, layout, stream)
        self._shadowsync = state
        if hook_execute_model and hasattr(self, "execute_model"):
            _hook_execute_model(self)
        return layout.fingerprint

    def begin_update(self, header_bytes: bytes) -> int:
        """Announces an update: validates the header (BadHeaderError, LayoutMismatchError,
        StaleVersionError, ... naming the field and both values; nothing changes then), queues it
        and returns its version at once. The receive runs on the library's native thread.
        Thread-safe."""
        state = self._require()
        header_bytes = bytes(header_bytes)
        state.receiver.begin_update(header_bytes)
        return UpdateHeader.from_bytes(header_bytes).version

    def before_step(self) -> int | None:
        """The step hook, before each execute_model: when an update was received, makes every
        group of it live and rebinds their parameters; returns its version (None: nothing was
        pending, one atomic load in C). Engine thread only."""
        state = self._shadowsync
        if state is None:
            return None  # no update group yet: nothing can be pending
        return state.receiver.before_step()

    def wait_applied(self, version: int, timeout: float | None = None) -> int:
        """For an idle engine: applies updates as they arrive until `version` is live, rebinding
        the parameters; ShadowsyncTimeoutError after `timeout` seconds. Returns the applied
        version. Engine thread only (collective_rpc runs between steps)."""
        state = self._require()
        state.receiver.wait_applied(version, timeout)
        return state.receiver.applied_version

    def weight_update_stats(self) -> dict:
        """The receiver's counters as a dict (plain data for collective_rpc). Thread-safe."""
        stats = vars(self._require().receiver.stats()).copy()
        stats["last_update_error"] = self._shadowsync.receiver.last_update_error()
        return stats

    def close_weight_update_group(self, keep_weights: bool = True) -> None:
        """Stops the receiver and frees its slots. With `keep_weights` each parameter is first
        rebound to a copy of its live value, so the model stays usable (this needs the memory of
        one more copy of the weights for a moment); without, the parameters still point into the
        freed slots and the model must not run again. Engine thread."""
        state, self._shadowsync = self._shadowsync, None
        if state is not None:
            if keep_weights:
                for param in state.params.values():
                    data = _data(param)
                    param.data = data.copy() if state.kind == "numpy" else data.clone()
            if self.__dict__.pop("_shadowsync_original_execute_model", None) is not None:
                del self.__dict__["execute_model"]  # the class's method again
            state.receiver.close()

    def _require(self) -> _UpdateGroup:
        if self._shadowsync is None:
            raise InvalidArgumentError(
                "the weight update group is not initialized: call init_weight_update_group first"
            )
        return self._shadowsync


def _placement(descs: dict[str, _tensors.TensorDesc]) -> tuple[str, str]:
    """(kind, device) shared by all parameters; one backend serves one device."""
    first_name, first = next(iter(descs.items()))
    for name, d in descs.items():
        if (d.kind, d.device) != (first.kind, first.device):
            raise InvalidArgumentError(
                f"parameter '{name}' is a {d.kind} tensor on {d.device} but '{first_name}' is a "
                f"{first.kind} tensor on {first.device}: all must be on one device"
            )
        if not d.contiguous:
            raise InvalidArgumentError(
                f"parameter '{name}': not contiguous (strides {format_shape(d.strides)})"
            )
    if first.device not in ("cpu",) and not first.device.startswith("cuda:"):
        raise InvalidArgumentError(f"parameter '{first_name}': device {first.device} is not supported")
    return first.kind, first.device


def _check_specs(specs: list[TensorSpec], descs: dict[str, _tensors.TensorDesc]) -> None:
    """Each of the trainer's specs must be a parameter of this model, exactly."""
    from shadowsync.layout import canonical_dtype

    for s in specs:
        d = descs.get(s.name)
        if d is None:
            raise LayoutMismatchError(
                f"tensor '{s.name}' of the trainer's layout is not a parameter of the worker "
                f"({len(descs)} parameters)"
            )
        dtype = canonical_dtype(s.dtype)[0]
        if dtype != d.dtype:
            raise LayoutMismatchError(
                f"tensor '{s.name}': dtype {dtype} of the trainer's layout does not match the "
                f"worker's {d.dtype}"
            )
        if tuple(s.shape) != d.shape:
            raise LayoutMismatchError(
                f"tensor '{s.name}': shape {format_shape(s.shape)} of the trainer's layout does not "
                f"match the worker's {format_shape(d.shape)}"
            )


def _adopt(state: _UpdateGroup, layout: Layout, stream: Stream) -> None:
    """Copies the parameters' current values into the live slot, then rebinds them to it."""
    for group in layout.groups:
        for t, view in zip(group.tensors, state.group_views(group.index)):
            source = _data(state.params[t.name])
            if state.kind == "numpy":
                view[...] = source
            else:
                view.copy_(source)  # on torch's current stream: the engine's
    if state.kind == "torch" and state.device != "cpu":
        import torch

        torch.cuda.current_stream(int(state.device.split(":")[1])).synchronize()
    for group in layout.groups:
        state.bind(group.index)


def _hook_execute_model(worker: WorkerExtension) -> None:
    """Runs before_step() before every execute_model, by shadowing the method on the instance
    (vLLM looks execute_model up on the worker object for each step)."""
    original = worker.execute_model
    worker.__dict__["_shadowsync_original_execute_model"] = original

    def execute_model(*args, **kwargs):
        worker.before_step()
        return original(*args, **kwargs)

    worker.execute_model = execute_model
