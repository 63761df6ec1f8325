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

import collections
import ctypes
import dataclasses
import functools
import time
import warnings
from typing import Any, Callable, Iterable

from shadowsync import _tensors
from shadowsync.backend import Backend, CudaBackend, HostBackend, Stream
from shadowsync.errors import InvalidArgumentError, LayoutMismatchError
from shadowsync.layout import BASE_GROUP, Layout, TensorSpec, UpdateHeader, format_shape
from shadowsync.receiver import GroupSwap, Receiver, ReceiverConfig
from shadowsync.transport import Transport, nccl_transport

from .lora_plan import is_lora_tensor, lora_layers_unwrapped, lora_receive_plan
from .post_load_trace import refuse_post_load_transforms
from .rebind import Rebinding

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
        # (first step, version) of each version made live, bounded.
        self.step_log: collections.deque = collections.deque(maxlen=1024)
        # The last begin_update and wait_applied: when each started (time.monotonic) and the
        # seconds the engine thread spent in it. Both run between two steps (collective_rpc), so
        # they add to how long generation stands still.
        self.last_begin_update = (0.0, 0.0)
        self.last_wait_applied = (0.0, 0.0)
        # Where the step hook runs: "model_runner._model_forward", "model_runner.kv_connector.
        # pre_forward" (vLLM's V2 GPU runner), "execute_model", or None (not
        # hooked: the engine calls before_step itself).
        self.step_hook_at: str | None = None

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
                like = _data(param)
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

        return torch.as_tensor(_CudaBytes(address, size), device=self.device)

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
        if not self.coordinated:
            self.step_log.append((self.steps, version))  # commit_update logs its own
        for swap in swaps:
            if self.graph_pairs is not None:  # its arena is the update's one group
                self.graph_pairs.use_slot(swap.slot)
            else:
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


# How many times the tensor-parallel ranks agree during init_weight_update_group.
_SET_UP_ROUNDS = 2


class _RefusedOnAnotherRank(Exception):
    """Another tensor-parallel rank refused init_weight_update_group."""


def _all_tensor_parallel_ranks_or_none(set_up):
    """init_weight_update_group under tensor parallelism: every rank is set up or none is, and a
    refusal is returned, not raised (vLLM's multiprocess executor ends the engine when a worker
    raises in a collective_rpc). The set-up calls its `_agree` once everything is checked and
    once it is set up; here that is an all-reduce over vLLM's TP group."""

    @functools.wraps(set_up)
    def init(self, *args, **kwargs):
        if _tensor_parallel_size(self) == 1:
            return set_up(self, *args, **kwargs)
        group_before = self._shadowsync  # an "already initialized" refusal leaves it alone
        rounds_passed = 0

        def agree() -> None:
            nonlocal rounds_passed
            if not _on_every_rank(True):
                raise _RefusedOnAnotherRank()
            rounds_passed += 1

        def take_back(detail: str) -> str:
            """Closes a group set up here; says so in `detail` if that fails too (never raises:
            a raise here would end vLLM's engine)."""
            try:
                if self._shadowsync is not group_before:
                    self.close_weight_update_group()
            except Exception as close_error:  # noqa: BLE001
                detail += f"; closing the group set up on this rank failed too: {close_error}"
            return detail

        try:
            return set_up(self, *args, _agree=agree, **kwargs)
        except _RefusedOnAnotherRank:  # set up here, maybe; another rank refused or failed
            return {"refused": take_back("init_weight_update_group: refused on another "
                                         "tensor-parallel rank (its message says why); nothing "
                                         "was set up on any rank"),
                    "error": "InvalidArgumentError"}
        except Exception as error:  # noqa: BLE001 - returned: a raise here ends vLLM's engine
            detail = take_back(getattr(error, "detail", str(error)))
            # The other ranks wait in the round this rank did not reach; a refusal ends the
            # set-up on every rank, so that round is their last.
            if rounds_passed < _SET_UP_ROUNDS:
                try:
                    _on_every_rank(False)
                except Exception as agree_error:  # noqa: BLE001
                    detail += f"; telling the other ranks failed too: {agree_error}"
            return {"refused": detail, "error": type(error).__name__}

    return init


class WorkerExtension:
    """Mixed into a vLLM worker (``worker_extension_cls``); see the module's doc."""

    _shadowsync: _UpdateGroup | None = None

    # --- what an engine may override ---------------------------------------------------------

    def _shadowsync_model(self):
        """The model: ``self.model_runner.model`` (vLLM's GPU and CPU workers), else
        ``self.model``. Its ``load_weights`` derives the receive plan when the trainer's tensors
        are not the model's parameters."""
        model = getattr(getattr(self, "model_runner", None), "model", None)
        if model is None:
            model = getattr(self, "model", None)
        if model is None or not hasattr(model, "named_parameters"):
            raise InvalidArgumentError(
                f"{type(self).__name__}: no model with named_parameters() at self.model_runner.model "
                f"or self.model; override _shadowsync_model()"
            )
        return model

    def _shadowsync_named_parameters(self) -> Iterable[tuple[str, Any]]:
        """The model's (name, parameter) pairs."""
        return self._shadowsync_model().named_parameters()

    # --- the methods the trainer calls through collective_rpc ------------------------------

    @_all_tensor_parallel_ranks_or_none
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
        same_host: dict | None = None,
        track_request_versions: bool = False,
        allow_partial: bool = False,
        commit_mode: str | None = None,
        decode_slowdown_budget: float | None = None,
        max_receive_bytes_per_second: int = 0,
        lora_adapter: int | None = None,
        gated_swaps: bool | None = None,
        _agree: Callable[[], None] = lambda: None,
    ) -> int:
        """Sets up the weight update group; returns the layout fingerprint (the trainer compares
        it with its own). Engine thread, before stepping; once.

        The transport: NCCL from `unique_id` (nccl_unique_id() on the trainer), this worker being
        rank ``rank_offset + self.rank`` of `world_size`; blocks until every rank joined, so the
        trainer must create its own transport concurrently (start this call asynchronously, e.g.
        a Ray ``.remote``). Or a ready `transport` (a Loopback rank in tests), or neither: install
        one later with ``self._shadowsync.receiver.replace_transport``.

        Or `same_host` (plain data: ``{"path", "token"[, "rank", "connect_timeout_ms"]}``): the
        receiver end of the trainer's same-host transport (same GPU, GPUs of one host, or CPU
        processes), rank ``rank_offset + self.rank`` unless given; blocks until the trainer
        serves on `path` and both proved the token.

        `specs`: the trainer's tensor specs (``Layout.specs`` on its side: names, dtypes, shapes,
        groups in its order). When each is a parameter of the model (same name), dtype and shape
        must match and the receive is zero-copy into the slots. Otherwise they are what the
        trainer's ``named_parameters()`` gives (HF names, unfused, unsharded) and a receive plan
        is derived from the model's own ``load_weights`` (traced without data: loader_trace): the
        slots hold the parameters it writes, in the engine's layout, and each received bucket is
        copied into them natively. A loader that computes (a dtype conversion, a concatenation),
        trainer tensors it does not take, or parameters it writes twice are refused, named.
        Engines whose parameters are not the weights they compute with (vLLM CPU's packed
        layers, empty parameters) are refused with what to do.
        None: every parameter in the model's order, grouped by `group_of` (default "base").
        Returns the fingerprint of the trainer's layout (``Layout(specs, bucket_bytes)``).

        `commit_mode`: "auto" (an update goes live at the worker's next step) or "coordinated"
        (held ready until commit_update(version), which collective_rpc brings to every worker
        between the same two steps); default coordinated when vLLM runs tensor-parallel.

        `allow_partial`: with a receive plan, parameters no trainer tensor writes are refused
        (named) unless this is set; then they keep the engine's values. With the live arena
        (swapped whole) they stay in the receiver's layout as the plan's kept tensors: their live
        bytes are copied into the shadow once, before its first receive
        (weight_update_stats()["kept_params"] counts them).

        `track_request_versions`: count each request's scheduled tokens per weight version
        (request_versions()), for the trainer's bookkeeping of which policy made which tokens.
        `adopt_current_weights`: copy the model's weights into the live slot and rebind to it, so
        its own storage is freed (two copies of the weights, not three) and a group an update does
        not carry keeps the current weights.

        `swap_strategy` and `engine_uses_cuda_graphs` set those fields of `receiver_config`: an
        engine that replays CUDA graphs (vLLM without ``enforce_eager``) gets
        ``swap_strategy="copy_in"`` and ``engine_uses_cuda_graphs=True`` by default; "remap" is
        refused there (vLLM captured its graphs over its own storage before this call; remap
        would make the receiver's memory live instead), and so is "rebind" (by the library).
        Under copy_in the parameters stay where they are, the engine's own storage is the live
        copy (Receiver.use_engine_storage: graphs captured before this call keep reading it) and
        each swap copies the shadow into them, one batched copy. With the weight-transfer backend
        "shadowsync" (the live arena) the default is "remap"; with "shadowsync_graph_pairs" it is
        "rebind" over the arena's two slots, vLLM's graphs having been captured over each
        (graph_pairs.py): a swap rebinds the parameters and switches graph sets (the receiver is
        then told engine_uses_cuda_graphs=False whatever is passed: the graphs follow the slot).

        `decode_slowdown_budget` and `max_receive_bytes_per_second` set those fields of
        `receiver_config` (pacing; None / 0: leave them as `receiver_config` has them). With a
        budget (e.g. 1.05) this worker's hooked execute_model stamps each step's start, the
        receiver learns the step time while no update streams in and holds its buckets back so
        that the mean step while one streams in stays within budget x that time; the update
        takes longer instead, never past the update deadline. The cap limits the receive rate in
        bytes per second. A budget that is not finite or below 1.0 is refused, named, before
        anything is set up. weight_update_stats()["pacing"] reports what pacing did.

        `gated_swaps` (ReceiverConfig.gated_swaps): a swap that remaps the live arena closes a gate
        on vLLM's stream right before the step's forward and remaps once the step before has
        ended, from the step's last host call (the KV connector's ``post_forward``), so that vLLM
        prepares the step, samples and hands back the previous step's tokens meanwhile, and the
        GPU stops for the remap alone (at Llama-3-8B on an H100 the clients' stop fell from
        2.3-7.5 to 1.0-2.1 ms median; docs/benchmarks.md, "Gated swaps"). None (the default): on
        wherever it can be, i.e. the remap of the live arena without a LoRA adapter, with the step
        hook on vLLM's V2 GPU runner (pre_forward and post_forward). False: off (the engine
        thread remaps after waiting for the step in flight). True: on, refused where it cannot
        be, naming why. A watchdog opens a gate vLLM has not finished 50 ms after the step before
        it ended (that step runs on the old weights; gates stay off from then on;
        weight_update_stats()["gates_abandoned"]).

        `lora_adapter`: the lora_int_id of a LoRA adapter vLLM serves (started with
        ``enable_lora=True`` and ``max_lora_rank`` = the adapter's rank; the adapter loaded once,
        by a request with its LoRARequest or add_lora) that the trainer's PEFT tensors
        (``...<module>.lora_A.weight``, ``lora_B``, in their own group, e.g. "lora") update in
        place: they land in the adapter's slot of vLLM's stacked LoRA buffers (lora_plan.py; the
        slicing and packing learned from vLLM's own set_lora), which become the live storage: the
        adapter's group is copied in at the swap (a LoRA-only update copies only the adapter).
        The base weights beside it are copied in too, or, with the live arena, swapped by remap
        at the same swap.
        The adapter is pinned in its slot. lora_B is sent as vLLM computes with it, scaled by
        lora_alpha / r (shadowsync.vllm.scaled_lora_b on the trainer's side).

        Under tensor parallelism a refusal is returned, not raised (vLLM's multiprocess executor
        ends the engine when a worker raises in a collective_rpc): every rank returns
        ``{"refused": message, "error": class name}`` and none is set up. The ranks agree over
        vLLM's TP group twice: before any transport connects (no rank waits for a peer that
        refused) and once set up (a rank set up while another failed to connect closes its group
        again). shadowsync.vllm.init_weight_update_group(llm, ...) raises the refusal on the
        front end."""
        if self._shadowsync is not None:
            raise InvalidArgumentError(
                f"init_weight_update_group: already initialized (layout "
                f"{self._shadowsync.wire_fingerprint:#018x}); close_weight_update_group first"
            )
        if decode_slowdown_budget is not None or max_receive_bytes_per_second:
            receiver_config = dataclasses.replace(receiver_config or ReceiverConfig())
            if decode_slowdown_budget is not None:
                receiver_config.decode_slowdown_budget = decode_slowdown_budget
            if max_receive_bytes_per_second:
                receiver_config.max_receive_bytes_per_second = max_receive_bytes_per_second
        if receiver_config is not None:
            # Refuses bad values (a budget below 1.0, ...) before anything is set up or connected.
            receiver_config._c_fields()
        model = self._shadowsync_model()
        params = dict(_tensors.items(self._shadowsync_named_parameters()))
        if not params:
            raise InvalidArgumentError("init_weight_update_group: the model has no parameters")
        descs = {name: _tensors.describe(name, _data(p)) for name, p in params.items()}
        kind, device = _placement(descs)
        # Before anything else reads the parameters: are they what the model computes with?
        refuse_post_load_transforms(model, _vllm_quantization(self), device.split(":")[0])
        _refuse_empty(params)

        chosen = swap_strategy if swap_strategy is not None else (
            receiver_config.swap_strategy if receiver_config is not None else None)
        live_arena = _live_arena(self)
        # Graph pairs: the arena's slots each have their own CUDA graphs, so a swap rebinds
        # between them; the plain live arena is swapped by remapping its live range.
        graph_pairs = bool(getattr(live_arena, "shadowsync_graph_pairs", False))
        arena_strategy = "rebind" if graph_pairs else "remap"
        # The live arena, when swaps may swap it (by remap, or by rebind under graph pairs): it is
        # swapped whole, so a plan for it keeps what the trainer does not send.
        arena_to_remap = live_arena if chosen in (None, arena_strategy) else None
        plan = None
        if specs is None and lora_adapter is not None:
            raise InvalidArgumentError(
                f"init_weight_update_group: lora_adapter={lora_adapter} needs specs (the "
                f"trainer's PEFT tensors, and base tensors if it sends them): without specs the "
                f"layout is the engine's own parameters, which hold no adapter")
        if specs is None:
            specs = [
                TensorSpec(n, d.dtype, d.shape, group_of(n) if group_of else BASE_GROUP)
                for n, d in descs.items()
            ]
            layout = Layout(specs, bucket_bytes)
        else:
            specs = [TensorSpec.coerce(s) for s in specs]
            if lora_adapter is not None or any(is_lora_tensor(s.name) for s in specs):
                layout, plan, params, descs = _receive_plan_with_lora(
                    self, model, specs, lora_adapter, bucket_bytes, allow_partial, arena_to_remap)
            elif _names_are_parameters(specs, descs):
                _check_specs(specs, descs)  # the engine's own layout: zero-copy receive
                layout = Layout(specs, bucket_bytes)
            else:
                layout, plan, params = _receive_plan(model, specs, bucket_bytes, allow_partial,
                                                     arena_to_remap)
                descs = {name: _tensors.describe(name, _data(p)) for name, p in params.items()}

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
        if transport is None and unique_id is not None and device == "cpu":
            raise InvalidArgumentError(
                "init_weight_update_group: NCCL needs CUDA parameters, the model's are on cpu")

        if engine_uses_cuda_graphs is None and device != "cpu":
            engine_uses_cuda_graphs = _vllm_captures_cuda_graphs(self)
        # The groups of a LoRA adapter's tensors: their live copy is the adapter's slot in vLLM's
        # stacked LoRA buffers, which can only be copied into, never rebound or remapped.
        lora_groups = {s.group for s in specs if is_lora_tensor(s.name)}
        arena_group = None  # the group swapped by remapping the live arena
        if arena_to_remap is not None:
            base = [g for g in layout.groups if g.name not in lora_groups]
            if base:
                _check_fits_live_arena(base, params, live_arena)
                arena_group = base[0].index
                swap_strategy = chosen = arena_strategy
        if arena_group is None:
            # copy_in into the arena's live range (or nothing of the arena at all: an adapter
            # only), as into any storage.
            live_arena = None
            graph_pairs = False
        if graph_pairs and lora_groups:
            raise InvalidArgumentError(
                f"init_weight_update_group: lora_adapter with the 'shadowsync_graph_pairs' "
                f"weight-transfer backend: a swap there rebinds the base weights between two "
                f"slots, and an adapter lives in vLLM's stacked LoRA buffers, which can only be "
                f"copied into; start vLLM with weight_transfer_config={{'backend': "
                f"'shadowsync'}} (remap, with the adapter copied in at the same swap), or pass "
                f"swap_strategy='copy_in' (base and adapter both copied in at each swap)")
        if graph_pairs:
            # The graphs follow the live slot (one set per slot, switched at each swap), so the
            # swap may move the live address: to the library this is an engine that rebinds.
            engine_uses_cuda_graphs = False
            # The receiver starts from the slot the arena shows; the model must read that one (a
            # close that failed before settling could have left it on the other).
            live_arena.settle()
        if lora_groups and chosen not in (None, "copy_in") and arena_group is None:
            raise InvalidArgumentError(
                f"init_weight_update_group: lora_adapter needs swap_strategy 'copy_in' (the "
                f"adapter lives in vLLM's stacked LoRA buffers), or 'remap' with the live "
                f"arena for the base weights beside it; got {chosen!r}")
        if lora_groups and arena_group is None:
            swap_strategy = chosen = "copy_in"
        if engine_uses_cuda_graphs and chosen == "remap" and live_arena is None:
            # remap keeps one virtual range live, but it is the receiver's: vLLM captured its
            # graphs at start-up over its own parameter storage and would go on reading that.
            raise InvalidArgumentError(
                "init_weight_update_group: swap_strategy 'remap' with engine_uses_cuda_graphs: "
                "vLLM captured its CUDA graphs at start-up over its own parameter storage, and "
                "remap makes the receiver's memory live instead, which those graphs never read "
                "(every step after would compute with the old weights). Start vLLM with "
                "weight_transfer_config={'backend': 'shadowsync'} (the weights move into a remap "
                "arena before the graphs are captured), or use 'copy_in' (the default under "
                "CUDA graphs: the engine's storage stays live), or start vLLM with "
                "enforce_eager=True")
        if engine_uses_cuda_graphs and chosen is None:
            swap_strategy = "copy_in"  # graphs keep their addresses: rebind would be ignored
        if commit_mode is None and (receiver_config is None or receiver_config.commit_mode is None):
            # Tensor parallelism: ranks that flipped each on its own could run one step on two
            # versions; coordinated holds updates ready until commit_update on every rank.
            commit_mode = "coordinated" if _tensor_parallel_size(self) > 1 else None
        if commit_mode is not None:
            receiver_config = dataclasses.replace(receiver_config or ReceiverConfig(),
                                                  commit_mode=commit_mode)
        if swap_strategy is not None or engine_uses_cuda_graphs is not None:
            receiver_config = dataclasses.replace(receiver_config or ReceiverConfig())
            if swap_strategy is not None:
                receiver_config.swap_strategy = swap_strategy
            if engine_uses_cuda_graphs is not None:
                receiver_config.engine_uses_cuda_graphs = engine_uses_cuda_graphs
        gate = _gated_swaps(self, gated_swaps, arena_group is not None and not lora_groups,
                            hook_execute_model)
        if gate:
            receiver_config = dataclasses.replace(receiver_config or ReceiverConfig(),
                                                  gated_swaps=True)
        _agree()  # every rank checked its part: now the transports may connect
        if transport is None and unique_id is not None:
            rank = int(rank_offset) + int(getattr(self, "rank", 0))
            transport = nccl_transport(unique_id, rank, int(world_size), int(device.split(":")[1]))
        if transport is None and same_host is not None:
            transport = _same_host_receiver(same_host, rank_offset, getattr(self, "rank", 0), backend)

        receiver = Receiver(layout, backend, transport, receiver_config, engine_stream=stream,
                            plan=plan,
                            arenas={arena_group: live_arena.arena} if live_arena else None)
        state = _UpdateGroup(receiver, {t.name: params[t.name] for g in layout.groups
                                        for t in g.tensors}, kind, device)
        state.stream = stream
        state.coordinated = receiver_config is not None and receiver_config.commit_mode == "coordinated"
        if receiver_config is not None and receiver_config.swap_strategy is not None:
            state.swap_strategy = receiver_config.swap_strategy
        state.live_arena = live_arena is not None
        copy_in = state.swap_strategy == "copy_in"
        state.host_reads_after_copy = device == "cpu" and copy_in
        if track_request_versions:
            state.request_versions = {}
        receiver.set_swap_callback(state.on_swap)
        if graph_pairs:
            # The parameters already point at the arena's live slot (bound at load, before vLLM
            # captured a graph set over each slot): a swap rebinds them and switches sets.
            state.graph_pairs = live_arena
        elif copy_in:
            # The parameters stay where the engine (and any CUDA graph it captured) reads them;
            # each swap copies the shadow into them. Two copies of the weights, none moved.
            for group in layout.groups:
                receiver.use_engine_storage(
                    group.index, [_address(_data(state.params[t.name])) for t in group.tensors])
            state.engine_storage = True
        elif live_arena is not None:
            # The parameters already live in the arena's live range (moved there at load, before
            # vLLM captured its graphs): a swap remaps it, nothing is rebound. An adapter's groups
            # beside it are copied into vLLM's LoRA slots at the same swap.
            for group in layout.groups:
                if group.index != arena_group:
                    receiver.use_engine_storage(
                        group.index, [_address(_data(state.params[t.name])) for t in group.tensors])
            state.engine_storage = True
        elif adopt_current_weights:
            _adopt(state, layout, stream)
        self._shadowsync = state
        if hook_execute_model and hasattr(self, "execute_model"):
            state.step_hook_at = _hook_execute_model(self, gated=gate)
        _agree()  # every rank is set up (one that failed to connect takes the others back)
        if lora_adapter is not None:
            # vLLM must not evict it: its slot is the live copy. Pinned once every rank is set
            # up, so a refused set-up pins nothing; it stays pinned after close (vLLM has no
            # unpin), as an adapter that is being trained would be.
            _lora_manager(self).pin_adapter(int(lora_adapter))
        return state.wire_fingerprint

    def has_weight_update_group(self) -> bool:
        """Whether init_weight_update_group set this worker up (and it was not closed since)."""
        return self._shadowsync is not None

    def begin_update(self, header_bytes: bytes, verify_matches_live: bool = False) -> int:
        """Announces an update: validates the header (BadHeaderError, LayoutMismatchError,
        StaleVersionError, ... naming the field and both values; nothing changes then), queues it
        and returns its version at once. The receive runs on the library's native thread.
        Thread-safe.

        `verify_matches_live`: the self-check, for an update of the checkpoint the engine holds
        (at set-up, say): once it landed, every parameter it wrote is compared with the engine's
        own bytes, and the first that differs fails it (nothing goes live; apply_update raises,
        naming the parameter and its first differing element). It proves that the receive plan
        writes every byte where this engine reads it."""
        state = self._require()
        started = time.monotonic()
        header_bytes = bytes(header_bytes)
        state.receiver.begin_update(header_bytes, verify_matches_live=bool(verify_matches_live))
        state.last_begin_update = (started, time.monotonic() - started)
        return UpdateHeader.from_bytes(header_bytes).version

    def before_step(self) -> int | None:
        """The step hook, before each execute_model: when an update was received, makes every
        group of it live and rebinds their parameters; returns its version (None: nothing was
        pending, one atomic load in C). Engine thread only."""
        state = self._shadowsync
        if state is None:
            return None  # no update group yet: nothing can be pending
        return state.receiver.before_step()

    def after_launch(self) -> int | None:
        """gated_swaps: the step's last host call (installed by init where the gate is used):
        finishes a swap before_step gated (waits for the step before, remaps, opens the gate) and
        returns the version the step runs on; None otherwise. Engine thread only."""
        state = self._shadowsync
        if state is None:
            return None
        return state.receiver.after_launch()

    def wait_applied(self, version: int, timeout: float | None = None) -> int:
        """For an idle engine: applies updates as they arrive until `version` is live, rebinding
        the parameters; ShadowsyncTimeoutError after `timeout` seconds. Returns the applied
        version. Engine thread only (collective_rpc runs between steps)."""
        state = self._require()
        started = time.monotonic()
        try:
            state.receiver.wait_applied(version, timeout)
        finally:
            state.last_wait_applied = (started, time.monotonic() - started)
        return state.receiver.applied_version

    def update_progress(self) -> dict:
        """``{"applied_version": v, "pending": whether a received update waits for a step,
        "coordinated": commit_mode "coordinated"}``: what apply_update_async polls. Swaps
        nothing; thread-safe."""
        state = self._require()
        stats = state.receiver.stats()
        return {"applied_version": stats.applied_version, "pending": stats.has_pending,
                "coordinated": state.coordinated}

    def ready_version(self) -> int:
        """commit_mode "coordinated": the update this worker received, checked and holds ready
        for commit_update (0: none). Thread-safe."""
        return self._require().receiver.stats().ready_version

    def commit_update(self, version: int) -> dict:
        """commit_mode "coordinated": makes the ready update `version` live now; the next step
        runs on it. Through collective_rpc every worker makes it between the same two steps.
        Returns ``{"applied_version": v}``, or ``{"refused": message, "applied_version": v}``
        when `version` is not ready on every tensor-parallel rank (checked across the TP group
        first: then no rank flips) or on this one. A refusal is returned, not raised: vLLM's
        multiprocess executor ends the engine when a worker raises in a collective_rpc.
        shadowsync.vllm.commit_update raises it on the front end. Engine thread."""
        state = self._require()
        version = int(version)
        ready = state.receiver.stats().ready_version
        if _tensor_parallel_size(self) > 1 and not _on_every_rank(ready == version):
            return {"refused": f"commit_update({version}): not ready on every tensor-parallel "
                               f"rank (this rank holds {ready or 'none'} ready, applied "
                               f"{state.receiver.applied_version}); nothing was committed on any "
                               f"rank",
                    "applied_version": state.receiver.applied_version}
        try:
            applied = state.receiver.commit(version)
        except InvalidArgumentError as error:
            return {"refused": str(error), "applied_version": state.receiver.applied_version}
        state.step_log.append((state.steps, applied))
        return {"applied_version": applied}

    def step_versions(self) -> dict:
        """What this worker ran: ``{"steps": hooked steps so far, "applied_version": ...,
        "transitions": [[first step, version], ...]}`` (the last 1024 versions made live), which
        a trainer or a test compares across tensor-parallel ranks. Thread-safe enough for a
        collective_rpc between steps."""
        state = self._require()
        return {"steps": state.steps, "applied_version": state.receiver.applied_version,
                "transitions": [list(t) for t in state.step_log]}

    def request_versions(self, request_ids: Iterable[str] | None = None, pop: bool = True) -> dict:
        """With track_request_versions: for each request id (all when None), the tokens its
        steps computed under each weight version, ``[[version, tokens], ...]`` in step order
        (prompt and generated tokens alike: vLLM's scheduled tokens). `pop` forgets them. Engine
        thread (a collective_rpc)."""
        state = self._require()
        if state.request_versions is None:
            raise InvalidArgumentError(
                "request_versions: init_weight_update_group(track_request_versions=True) first")
        ids = list(state.request_versions) if request_ids is None else list(request_ids)
        take = state.request_versions.pop if pop else state.request_versions.get
        return {i: [list(s) for s in take(i, [])] for i in ids}

    def weight_update_stats(self) -> dict:
        """The receiver's counters as a dict (plain data for collective_rpc), among them
        ``"last_transfer_s"`` (the last ready update's transfer time, seconds), ``"pacing"``
        (what pacing did to it: the fields of shadowsync.PacingReport, ``"paced"`` False without
        a budget or a cap), and what the engine thread spent on the last update, in seconds, with
        when it started on time.monotonic's clock: its swap (``"last_swap_s"``,
        ``"last_swap_started_s"``), begin_update (``"last_begin_update_s"``, ``..._started_s``)
        and wait_applied (``"last_wait_applied_s"``, ``..._started_s``); and where the step hook
        runs (``"step_hook_at"``). Thread-safe."""
        state = self._require()
        stats = vars(state.receiver.stats()).copy()
        stats["pacing"] = dataclasses.asdict(stats.pop("last_pacing"))
        stats["last_update_error"] = state.receiver.last_update_error()
        stats["wire_fingerprint"] = state.wire_fingerprint
        stats["plan_copies"] = state.plan_copies  # 0: the trainer sends the engine's own tensors
        stats["kept_params"] = state.kept_params  # parameters the plan keeps (live arena, partial)
        stats["swap_strategy"] = state.swap_strategy
        stats["live_arena"] = state.live_arena
        stats["graph_pairs"] = state.graph_pairs is not None  # swaps switch vLLM's graph sets
        stats["last_swap_callback_s"] = state.last_swap_callback_s  # of last_swap_s: Python's
        stats["step_hook_at"] = state.step_hook_at  # gated_swaps, gates_abandoned: the receiver's
        stats["last_begin_update_started_s"], stats["last_begin_update_s"] = state.last_begin_update
        stats["last_wait_applied_started_s"], stats["last_wait_applied_s"] = state.last_wait_applied
        return stats

    def memory_report(self) -> dict:
        """What vLLM sized its KV cache with, as plain data (no update group needed):
        ``"kv_cache_bytes"`` (the worker's available KV-cache memory, None before vLLM sized it
        or where the worker does not say) and ``"live_arena"`` (None without the live-arena
        engine; else its slot's bytes (it has two), the torch memory moving into it freed, and vLLM's
        ``model_memory_usage`` before and after the engine counted the weights once)."""
        engine = _live_arena(self)
        kv = getattr(self, "available_kv_cache_memory_bytes", None)
        return {"kv_cache_bytes": None if kv is None else int(kv),
                "live_arena": None if engine is None else dict(engine.memory_accounting)}

    def close_weight_update_group(self, keep_weights: bool = True) -> None:
        """Stops the receiver and frees its slots. With `keep_weights` each parameter is first
        rebound to a copy of its live value, so the model stays usable (this needs the memory of
        one more copy of the weights for a moment); without, the parameters still point into the
        freed slots and the model must not run again. Under copy_in into the engine's own storage
        (the default under CUDA graphs) the parameters never left it: they stay where they are
        either way, and the group can be initialized again. Under graph pairs they stay in the
        arena whatever `keep_weights` says (vLLM's graphs read its slots): the live bytes are
        copied into the slot the next receiver starts from, when that is the other one. Engine
        thread."""
        state, self._shadowsync = self._shadowsync, None
        if state is not None:
            if state.stream is not None:
                state.stream.synchronize()  # a swap's copy out of the shadow may still run
            # Under engine storage the parameters are the engine's own memory already (and CUDA
            # graphs read them there): nothing to keep. Under graph pairs they stay in the arena
            # (the graphs read its slots); once the receiver is gone (it may be writing the
            # other slot), the live bytes go where the next receiver starts from (settle).
            if keep_weights and not state.engine_storage and state.graph_pairs is None:
                for param in state.params.values():
                    data = _data(param)
                    param.data = data.copy() if state.kind == "numpy" else data.clone()
            _unhook_execute_model(self)
            state.receiver.close()
            if state.graph_pairs is not None:
                state.graph_pairs.settle()

    def _require(self) -> _UpdateGroup:
        if self._shadowsync is None:
            raise InvalidArgumentError(
                "the weight update group is not initialized: call init_weight_update_group first"
            )
        return self._shadowsync


def _on_every_rank(flag: bool) -> bool:
    """True when `flag` holds on every rank of vLLM's tensor-parallel group (an all-reduce over
    its CPU group: every worker runs the same collective_rpc, so all of them take part)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return bool(value.item())


def _tensor_parallel_size(worker) -> int:
    """vLLM's tensor_parallel_size for this worker; 1 when it is not vLLM's."""
    parallel = getattr(worker, "parallel_config", None)
    if parallel is None:
        parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def _address(tensor) -> int:
    """Where a parameter's first element is (numpy or torch)."""
    if hasattr(tensor, "data_ptr"):
        return tensor.data_ptr()
    return tensor.ctypes.data


def _live_arena(worker):
    """The live-arena weight-transfer engine vLLM made for this worker at load (live_arena.py:
    the weights sit in its remap arena), or None."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine if getattr(engine, "shadowsync_live_arena", False) else None


def _check_fits_live_arena(base: list, params: dict[str, Any], live_arena) -> None:
    """The groups of the update that are not a LoRA adapter's (`base`) must be laid out as the
    live arena is: one group holding the model's parameters, each the very parameter the arena
    holds at that place, in the arena's order (then the offsets are the same). Compared by
    object, not by name: with LoRA on, the receive plan knows a parameter by its checkpoint name
    and the arena by its name in the wrapped model."""
    arena_tensors = live_arena.layout.groups[0].tensors
    if len(base) != 1:
        raise InvalidArgumentError(
            f"init_weight_update_group: the live arena holds the model's parameters as one "
            f"group, but the update has {len(base)} groups of them "
            f"({', '.join(repr(g.name) for g in base)}); send every parameter in one "
            f"group, or use swap_strategy='copy_in'")
    tensors = base[0].tensors
    for i, (have, want) in enumerate(zip(tensors, arena_tensors)):
        same = (params[have.name] is live_arena.params[i] and have.dtype == want.dtype
                and tuple(have.shape) == tuple(want.shape))
        if not same:
            raise InvalidArgumentError(
                f"init_weight_update_group: the update's parameter {i} is {have.name!r} "
                f"({have.dtype}, {list(have.shape)}), but the live arena holds {want.name!r} "
                f"({want.dtype}, {list(want.shape)}) there: the trainer's tensors must write "
                f"every parameter of the model, in the model's order, to swap by remap; or use "
                f"swap_strategy='copy_in'")
    if len(tensors) != len(arena_tensors):
        raise InvalidArgumentError(
            f"init_weight_update_group: the update writes {len(tensors)} parameters, the live "
            f"arena holds {len(arena_tensors)}: to swap by remap the trainer's tensors must write "
            f"every parameter of the model, or, with a receive plan and allow_partial=True, the "
            f"ones they do not write are kept; or use swap_strategy='copy_in'")


def _model_config(worker):
    """vLLM's model config of the worker (None when the worker is not vLLM's)."""
    model_config = getattr(worker, "model_config", None)
    if model_config is None:
        model_config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    return model_config


def _vllm_captures_cuda_graphs(worker) -> bool | None:
    """Whether vLLM replays CUDA graphs over the weights (its default): not enforce_eager.
    None when the worker is not vLLM's."""
    enforce_eager = getattr(_model_config(worker), "enforce_eager", None)
    return None if enforce_eager is None else not enforce_eager


def _vllm_quantization(worker) -> str | None:
    """The quantization vLLM was started with (None: none, or not vLLM's worker)."""
    quantization = getattr(_model_config(worker), "quantization", None)
    return quantization if isinstance(quantization, str) else None


def _names(names: list[str], shown: int = 8) -> str:
    """'a', 'b', ... for an error message: the first `shown` names."""
    return ", ".join(f"'{n}'" for n in names[:shown]) + (", ..." if len(names) > shown else "")


def _refuse_empty(params: dict[str, Any]) -> None:
    """Parameters without elements are not the weights the engine computes with (prepacked,
    quantized elsewhere, never allocated): refused, all named."""
    empty = [n for n, p in params.items() if 0 in tuple(getattr(_data(p), "shape", (1,)))]
    if empty:
        raise LayoutMismatchError(
            f"{len(empty)} parameter(s) of the model are empty: {_names(empty)}; the engine prepacked or "
            f"quantized these weights, so its parameters are not the weights it computes with. On "
            f"vLLM's CPU backend start it with quantization=\"shadowsync_unpacked\""
        )


def _names_are_parameters(specs: list[TensorSpec], descs: dict) -> bool:
    """The trainer sends the engine's own tensors (by name): no receive plan."""
    return all(s.name in descs for s in specs)


def _receive_plan(model, specs: list[TensorSpec], bucket_bytes: int, allow_partial: bool,
                  live_arena=None):
    """(engine layout, ReceivePlan, {engine parameter name: parameter}) from the model's own
    load_weights, traced without data (loader_trace). The engine layout holds the parameters the
    plan writes, each in the group of the trainer's tensors that write it. With `live_arena`
    (the live-arena engine the receiver will swap by remap) and allow_partial, it holds every
    parameter in the model's order, as the arena does: the ones no trainer tensor writes are the
    plan's kept tensors (the receiver copies their live bytes into each slot once)."""
    from shadowsync.receive_plan import ReceivePlan

    from .loader_trace import trace_load_weights

    if not callable(getattr(model, "load_weights", None)):
        known = {name for name, _ in model.named_parameters()}
        foreign = [s.name for s in specs if s.name not in known]
        raise LayoutMismatchError(
            f"tensor '{foreign[0]}' of the trainer's layout is not a parameter of the worker "
            f"({len(known)} parameters; {len(foreign)} of the trainer's tensors are not), and "
            f"{type(model).__name__} has no load_weights to derive a receive plan from"
        )
    with lora_layers_unwrapped(model):  # checkpoint names, as load_weights knows them
        trace = trace_load_weights(model, specs)
        every = dict(model.named_parameters())
    if trace.unwritten_params and not allow_partial:
        missing = trace.unwritten_params
        raise LayoutMismatchError(
            f"{len(missing)} parameter(s) of the model are written by none of the trainer's "
            f"tensors: {_names(missing)}; after an update they would keep the engine's current values while "
            f"the rest changes (a model no checkpoint of the trainer describes). Send them, or pass "
            f"allow_partial=True to keep them deliberately (frozen weights)"
        )
    wire = Layout(specs, bucket_bytes)
    wire_group = {s.name: s.group for s in specs}
    group_of: dict[str, str] = {}
    for c in trace.copies:
        group = group_of.setdefault(c.engine, wire_group[c.wire])
        if group != wire_group[c.wire]:
            raise LayoutMismatchError(
                f"parameter '{c.engine}' is written from tensors of two groups ('{group}' and, "
                f"through '{c.wire}', '{wire_group[c.wire]}'): a parameter belongs to one group"
            )
    engine_params, kept = trace.engine_params, []
    if trace.unwritten_params and live_arena is not None and len(set(group_of.values())) == 1:
        # The arena's slots are swapped whole: they must hold the unwritten parameters too.
        kept = list(trace.unwritten_params)
        group_of.update({n: next(iter(group_of.values())) for n in kept})
        engine_params = every
    order = {g.name: i for i, g in enumerate(wire.groups)}
    names = sorted(engine_params, key=lambda n: order[group_of[n]])  # stable: model order
    params = {n: engine_params[n] for n in names}
    # Described here: with LoRA on, a parameter's name in the trace (the checkpoint's) is not its
    # name among the wrapped model's parameters.
    descs = {n: _tensors.describe(n, _data(p)) for n, p in params.items()}
    engine = Layout([TensorSpec(n, descs[n].dtype, descs[n].shape, group_of[n]) for n in names])
    return engine, ReceivePlan(wire, trace.copies, kept), params


def _receive_plan_with_lora(worker, model, specs: list[TensorSpec], lora_adapter: int | None,
                            bucket_bytes: int, allow_partial: bool, live_arena=None):
    """(engine layout, ReceivePlan, params, descs) for a trainer that sends a LoRA adapter's
    tensors (and maybe base weights): the base through _receive_plan, the adapter into its vLLM
    slot (lora_plan.py). Both in one plan over the trainer's layout as it sends it."""
    from shadowsync.receive_plan import ReceivePlan

    lora_specs = [s for s in specs if is_lora_tensor(s.name)]
    if lora_adapter is None:
        raise LayoutMismatchError(
            f"{len(lora_specs)} of the trainer's tensors are LoRA tensors "
            f"({_names([s.name for s in lora_specs], 2)}): pass lora_adapter=<the lora_int_id of "
            f"the vLLM adapter they update>")
    if not lora_specs:
        raise LayoutMismatchError(f"lora_adapter={lora_adapter}: none of the trainer's "
                                  f"{len(specs)} tensors is a LoRA tensor ('...lora_A.weight')")
    manager = _lora_manager(worker)
    if manager is None:
        raise InvalidArgumentError(f"lora_adapter={lora_adapter}: this vLLM serves no LoRA "
                                   f"adapters (start it with enable_lora=True)")
    lora = lora_receive_plan(manager, int(lora_adapter), lora_specs)
    copies = list(lora.copies)
    group_of = {s.name: s.group for s in specs}
    engine_specs = []
    for c in lora.copies:
        desc = _tensors.describe(c.engine, lora.engine_tensors[c.engine])
        engine_specs.append(TensorSpec(c.engine, desc.dtype, desc.shape, group_of[c.wire]))
    params: dict[str, Any] = dict(lora.engine_tensors)
    kept: list[str] = []
    base_specs = [s for s in specs if not is_lora_tensor(s.name)]
    if base_specs:
        base_layout, base_plan, base_params = _receive_plan(model, base_specs, bucket_bytes,
                                                            allow_partial, live_arena)
        copies += base_plan.copies
        kept = base_plan.kept
        engine_specs = list(base_layout.specs) + engine_specs
        params.update(base_params)
    wire = Layout(specs, bucket_bytes)
    order = {g.name: i for i, g in enumerate(wire.groups)}
    engine = Layout(sorted(engine_specs, key=lambda t: order[t.group]))
    descs = {name: _tensors.describe(name, _data(p)) for name, p in params.items()}
    return engine, ReceivePlan(wire, copies, kept), params, descs


def _lora_manager(worker):
    """vLLM's worker LoRA manager (None without enable_lora)."""
    return getattr(getattr(worker, "model_runner", None), "lora_manager", None)


def _same_host_receiver(same_host: dict, rank_offset: int, worker_rank: int, backend):
    """The same-host transport's receiver end from plain data (collective_rpc arguments):
    ``{"path": ..., "token": ..., "rank": optional (default rank_offset + the worker's rank),
    "connect_timeout_ms": optional}``."""
    from shadowsync.transport import same_host_transport

    if not isinstance(same_host, dict) or "path" not in same_host or "token" not in same_host:
        raise InvalidArgumentError(
            f"same_host: a dict with 'path' and 'token' (and optionally 'rank', "
            f"'connect_timeout_ms') is needed, got {same_host!r:.200}"
        )
    unknown = set(same_host) - {"path", "token", "rank", "connect_timeout_ms"}
    if unknown:
        raise InvalidArgumentError(f"same_host: unknown key(s) {sorted(unknown)}")
    rank = same_host.get("rank", int(rank_offset) + int(worker_rank))
    return same_host_transport(same_host["path"], same_host["token"], rank, backend,
                               connect_timeout_ms=same_host.get("connect_timeout_ms"))


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


def _count_tokens(state: _UpdateGroup, scheduler_output) -> None:
    """Adds this step's scheduled tokens of each request (vLLM's num_scheduled_tokens) to the
    version the step runs on."""
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not scheduled:
        return
    version = state.receiver.applied_version
    for request, tokens in scheduled.items():
        segments = state.request_versions.setdefault(request, [])
        if segments and segments[-1][0] == version:
            segments[-1][1] += tokens
        else:
            segments.append([version, tokens])


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


class _ConnectorWithStepHook:
    """vLLM's V2 GPU model runner calls ``kv_connector.pre_forward(scheduler_output)`` right
    before every forward (CUDA graph replay, piecewise or eager) and nowhere else: the step hook
    runs there. It calls ``kv_connector.post_forward(finished_req_ids)`` as the last host call of
    the step (the end of sample_tokens, pool, or a non-last pipeline rank's step): with gated
    swaps `after_launch` runs there. A stand-in for that runner's own connector (often vLLM's
    shared no-op one, which must not be changed), delegating everything else to it."""

    def __init__(self, connector, before_forward, after_launch=None):
        self._shadowsync_connector = connector
        self._before_forward = before_forward
        self._after_launch = after_launch

    def pre_forward(self, scheduler_output):
        self._before_forward()
        return self._shadowsync_connector.pre_forward(scheduler_output)

    def post_forward(self, *args, **kwargs):
        result = self._shadowsync_connector.post_forward(*args, **kwargs)
        if self._after_launch is not None:
            self._after_launch()
        return result

    def __getattr__(self, name):
        return getattr(self._shadowsync_connector, name)


def _step_hook_site(worker: WorkerExtension) -> str:
    """Where _hook_execute_model puts the step hook on this worker (its docstring says why)."""
    runner = getattr(worker, "model_runner", None)
    if runner is not None and getattr(runner, "_model_forward", None) is not None:
        return "model_runner._model_forward"
    connector = getattr(runner, "kv_connector", None) if runner is not None else None
    if callable(getattr(connector, "pre_forward", None)):
        return "model_runner.kv_connector.pre_forward"
    return "execute_model"


def _gated_swaps(worker: WorkerExtension, requested: bool | None, remaps_arena: bool,
                 hooked: bool) -> bool:
    """init_weight_update_group's `gated_swaps`: whether swaps wait behind a gate on vLLM's
    stream. A gate needs a swap that only remaps (the live arena, no adapter copied beside it)
    and a step hook before the forward with a call after the step's last launch: vLLM's V2
    runner's KV connector gives both. None: on wherever that is so; False: off; True: on,
    refused where that is not so, naming why."""
    if requested is False:
        return False
    site = _step_hook_site(worker) if hooked and hasattr(worker, "execute_model") else None
    why = None
    if getattr(_live_arena(worker), "shadowsync_graph_pairs", False):
        why = ("graph pairs swap without a remap (a rebind and a switch of vLLM's graph sets): "
               "there is nothing for a gate to hold the step back from")
    elif not remaps_arena:
        why = ("no swap only remaps: the gate serves the remap of shadowsync.vllm's live arena, "
               "without a LoRA adapter (an adapter is copied into vLLM's buffers at each swap, "
               "and a copy enqueued after the step cannot run before it)")
    elif site != "model_runner.kv_connector.pre_forward":
        why = (f"the step hook runs at {site or 'no hook (hook_execute_model=False)'}; the gate "
               f"needs vLLM's V2 GPU model runner, whose KV connector's pre_forward and "
               f"post_forward frame every step")
    if why is None:
        return True
    if requested:
        raise InvalidArgumentError(f"init_weight_update_group: gated_swaps=True, but {why}")
    return False


def _hook_execute_model(worker: WorkerExtension, gated: bool = False) -> str:
    """Runs before_step() once per step, by shadowing methods on the instances (vLLM looks them up
    on the object for each step); with track_request_versions also counts each scheduled
    request's tokens under the version the step runs on.

    The step hook runs right before the step's forward, after vLLM prepared the step's inputs: a
    swap that must wait for the previous step's kernels (remap) then waits only for the GPU, and
    vLLM's input preparation still overlaps the previous step; at the start of execute_model the
    same swap also stalled that preparation. Where: vLLM's V1 model runner (the CPU's, and the
    GPU's for some models) has ``_model_forward``, its documented override point for the forward
    call; the V2 GPU runner (vLLM's default on GPUs for most models) calls its KV connector's
    ``pre_forward`` right before every forward (_ConnectorWithStepHook). Without either, before
    execute_model. A step that runs no forward (nothing scheduled) swaps nothing: an idle engine
    applies an update with wait_applied. Returns where the hook runs."""
    original = worker.execute_model
    worker.__dict__["_shadowsync_original_execute_model"] = original
    runner = getattr(worker, "model_runner", None)
    forward = getattr(runner, "_model_forward", None) if runner is not None else None
    connector = getattr(runner, "kv_connector", None) if runner is not None else None
    where = _step_hook_site(worker)
    pending_step = []  # this step's scheduler output, until its forward takes it
    # Gated: the version a step runs on is known once after_launch returned; its tokens are
    # counted there (or at the next step, if vLLM never called post_forward for it).
    uncounted = []

    def count_tokens(scheduler_output) -> None:
        state = worker._shadowsync
        if state is not None and state.request_versions is not None:
            _count_tokens(state, scheduler_output)

    def step_starts(scheduler_output) -> None:
        worker.before_step()  # with gates: finishes a gate the last step left closed, first
        while uncounted:
            count_tokens(uncounted.pop())
        if gated:
            uncounted.append(scheduler_output)
        else:
            count_tokens(scheduler_output)

    def step_launched() -> None:
        worker.after_launch()
        while uncounted:
            count_tokens(uncounted.pop())

    def execute_model(*args, **kwargs):
        state = worker._shadowsync
        if state is not None:
            state.steps += 1
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        if where == "execute_model":
            step_starts(scheduler_output)
            return original(*args, **kwargs)
        pending_step[:] = [scheduler_output]
        return original(*args, **kwargs)

    def before_forward() -> None:
        if pending_step:  # vLLM's own dummy and warm-up forwards come with no step
            step_starts(pending_step.pop())

    def model_forward(*args, **kwargs):
        before_forward()
        return forward(*args, **kwargs)

    worker.execute_model = execute_model
    if where == "model_runner._model_forward":
        runner.__dict__["_shadowsync_original_model_forward"] = forward
        runner._model_forward = model_forward
    elif where == "model_runner.kv_connector.pre_forward":
        runner.__dict__["_shadowsync_original_kv_connector"] = connector
        runner.kv_connector = _ConnectorWithStepHook(connector, before_forward,
                                                     step_launched if gated else None)
    return where


def _unhook_execute_model(worker: WorkerExtension) -> None:
    """Undoes _hook_execute_model: the class's methods and the runner's own connector again."""
    if worker.__dict__.pop("_shadowsync_original_execute_model", None) is not None:
        del worker.__dict__["execute_model"]
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return
    if runner.__dict__.pop("_shadowsync_original_model_forward", None) is not None:
        del runner.__dict__["_model_forward"]
    connector = runner.__dict__.pop("_shadowsync_original_kv_connector", None)
    if connector is not None:
        runner.kv_connector = connector


def init_weight_update_group(llm, **kwargs) -> int:
    """Front end (the process that holds the ``vllm.LLM``): ``collective_rpc(
    "init_weight_update_group", kwargs=kwargs)`` on every worker. Under tensor parallelism the
    workers return a refusal rather than raise it (a raise would end vLLM's engine); this raises
    it, as the error the refusing worker named, with its index. Returns the layout fingerprint
    (every worker's is the trainer's)."""
    return _fingerprint(llm.collective_rpc("init_weight_update_group", kwargs=kwargs))


async def init_weight_update_group_async(engine, **kwargs) -> int:
    """init_weight_update_group for an ``AsyncLLM``."""
    return _fingerprint(await engine.collective_rpc("init_weight_update_group", kwargs=kwargs))


def _fingerprint(results: list) -> int:
    """The workers' answers to init_weight_update_group: a refusal raised, else the fingerprint."""
    import builtins

    from shadowsync import errors

    refusals = [(i, r) for i, r in enumerate(results) if isinstance(r, dict)]
    if refusals:
        # The rank that refused for a reason of its own; the others say another rank refused.
        own = [(i, r) for i, r in refusals
               if "on another tensor-parallel rank" not in r["refused"]] or refusals
        worker, refusal = own[0]
        message = f"worker {worker}: {refusal['refused']}"
        name = refusal.get("error", "")
        error = getattr(errors, name, None)
        if isinstance(error, type) and issubclass(error, errors.ShadowsyncError):
            raise error(message)
        error = getattr(builtins, name, None)
        if isinstance(error, type) and issubclass(error, Exception):
            raise error(f"{name}: {message}")
        raise RuntimeError(f"{name}: {message}")
    fingerprints = sorted({int(r) for r in results})
    if len(fingerprints) != 1:
        raise LayoutMismatchError(
            f"init_weight_update_group: the workers' layout fingerprints differ: "
            f"{', '.join(f'{f:#018x}' for f in fingerprints)}")
    return fingerprints[0]


def apply_update(llm, version: int, timeout: float | None = None,
                 reset_prefix_cache: bool = True, preempt_running: bool = False) -> int:
    """Front end (the process that holds the ``vllm.LLM``): makes `version` live on every worker
    (``collective_rpc("wait_applied")``: the flip happens between two steps, and the next step
    runs on it), then asks vLLM to reset its prefix cache so that no new request reuses KV
    computed with older weights. Returns the applied version (the lowest over the workers).

    vLLM resets the prefix cache only while no request holds KV blocks; otherwise it refuses
    (returns False) and nothing is reset: this warns then (RuntimeWarning), since new requests may
    reuse prefix KV of older weights. With a synchronous ``LLM`` between ``generate`` calls nothing
    runs and the reset succeeds. An engine that keeps generating (``AsyncLLM``) almost never is
    idle: submit each request with ``cache_salt`` set to the policy version (prefix blocks are
    then shared only within one version) and pass ``reset_prefix_cache=False``; or pass
    `preempt_running`: vLLM then first preempts the running requests (they go back to its queue
    and recompute their KV, prompt and tokens so far, with the new weights), so the reset always
    happens, at the cost of that recompute."""
    applied = llm.collective_rpc("wait_applied", args=(int(version), timeout))
    if reset_prefix_cache:
        _reset_prefix_cache(llm, version, "apply_update", preempt_running)
    return min(int(v) for v in applied)


# apply_update_async: how long a received update may wait for a step before the engine counts
# as idle (then wait_applied applies it between two steps).
_IDLE_AFTER_S = 0.2


async def apply_update_async(engine, version: int, timeout: float | None = None,
                             reset_prefix_cache: bool = True, preempt_running: bool = False,
                             poll_s: float = 0.02) -> int:
    """apply_update for an ``AsyncLLM`` (see there: under load vLLM refuses the prefix cache
    reset; use ``cache_salt`` and ``reset_prefix_cache=False``, or `preempt_running`).

    Returns once `version` is live on every worker. While the engine generates, the step hook
    makes it live right before a step's forward, and this only polls (``update_progress``, a
    thread-safe call that swaps nothing) every `poll_s` seconds: no RPC blocks the engine thread
    while the last bytes arrive, and the swap is not moved ahead of vLLM's input preparation.
    When a received update has waited ``_IDLE_AFTER_S`` for a step (an idle engine),
    ``wait_applied`` applies it. ShadowsyncTimeoutError after `timeout` seconds (None: no limit)
    names the versions seen.

    Each poll is an RPC that vLLM's engine thread serves between two steps, and the polls
    cluster around the swap: at 1 ms they added to the engine stop (Llama-3-8B on one H200,
    graph pairs, paced to 1.08: 1.07 ms median at 1 ms, 0.84 ms at 20 ms; docs/benchmarks.md,
    "11."). The price of the 20 ms default: the caller learns of the flip up to 20 ms later; the
    engine flips at the same step either way."""
    import asyncio

    from shadowsync.errors import ShadowsyncTimeoutError

    if (isinstance(poll_s, bool) or not isinstance(poll_s, (int, float))
            or not 0 < poll_s < float("inf")):
        raise InvalidArgumentError(f"apply_update_async({version}): poll_s must be a positive, "
                                   f"finite number of seconds, got {poll_s!r}")
    version = int(version)
    started = time.monotonic()
    pending_since = None
    while True:
        progress = await engine.collective_rpc("update_progress")
        if any(p.get("coordinated") for p in progress):  # no step takes an update by itself
            raise InvalidArgumentError(
                f"apply_update_async({version}): the workers' commit_mode is \"coordinated\" "
                f"(tensor parallelism): an update goes live by shadowsync.vllm.commit_update, "
                f"not by waiting")
        applied = min(int(p["applied_version"]) for p in progress)
        if applied >= version:
            break
        now = time.monotonic()
        left = None if timeout is None else max(0.0, timeout - (now - started))  # of the timeout
        if timeout is not None and now - started > timeout:
            raise ShadowsyncTimeoutError(
                f"apply_update_async: version {version} not live after {timeout} s (workers' "
                f"applied versions {[p['applied_version'] for p in progress]}, an update pending "
                f"on {[p['pending'] for p in progress]})")
        if all(p["pending"] or p["applied_version"] >= version for p in progress):
            pending_since = now if pending_since is None else pending_since
            if now - pending_since >= _IDLE_AFTER_S:  # no step took it: an idle engine
                applied = min(int(v) for v in await engine.collective_rpc(
                    "wait_applied", args=(version, left)))
                break
        # A poll_s longer than what is left of the timeout does not overrun it.
        await asyncio.sleep(poll_s if left is None else min(poll_s, left))
    if reset_prefix_cache:
        await _reset_prefix_cache_async(engine, version, "apply_update_async", preempt_running)
    return applied


def _reset_prefix_cache(llm, version: int, caller: str, preempt_running: bool) -> None:
    """vLLM's prefix cache reset after `version` went live. With `preempt_running` vLLM preempts
    the running requests first, so that no block is held and the reset cannot be refused (vLLM
    raises if it still fails)."""
    if preempt_running:
        llm.reset_prefix_cache(reset_running_requests=True)
    else:
        _check_reset(llm.reset_prefix_cache(), version, caller)


async def _reset_prefix_cache_async(engine, version: int, caller: str,
                                    preempt_running: bool) -> None:
    """_reset_prefix_cache for an ``AsyncLLM``."""
    if preempt_running:
        await engine.reset_prefix_cache(reset_running_requests=True)
    else:
        _check_reset(await engine.reset_prefix_cache(), version, caller)


def _check_reset(result, version: int, caller: str) -> None:
    """vLLM's reset_prefix_cache returns False when running requests hold KV blocks."""
    if result is False:
        warnings.warn(
            f"{caller}: version {version} is live, but vLLM refused to reset its prefix cache "
            f"(running requests hold KV blocks), so new requests may reuse prefix KV computed "
            f"with older weights; submit requests with cache_salt set to the policy version and "
            f"pass reset_prefix_cache=False, or pass preempt_running=True",
            RuntimeWarning, stacklevel=3)


def _not_ready_error(caller: str, version: int, timeout: float, ready: list[int]):
    """commit_update's timeout: names the workers that do not hold `version` ready."""
    from shadowsync.errors import ShadowsyncTimeoutError

    late = [f"worker {i}: {'none' if v == 0 else v}" for i, v in enumerate(ready) if v != version]
    return ShadowsyncTimeoutError(
        f"{caller}({version}): not ready on every worker after {timeout} s "
        f"({', '.join(late)} ready); nothing was committed")


def _committed(results: list) -> int:
    """The applied version after a commit_update collective_rpc; a refusal (returned by the
    workers, not raised: vLLM's TP executor ends the engine on a raise) raised here."""
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        raise InvalidArgumentError(refused[0])
    return min(int(r["applied_version"]) for r in results)


def commit_update(llm, version: int, timeout: float = 60.0, reset_prefix_cache: bool = True,
                  preempt_running: bool = False) -> int:
    """Front end, commit_mode "coordinated" (tensor parallelism): waits until every worker holds
    `version` ready (collective_rpc("ready_version"), polled), then commits it on all of them in
    one collective_rpc — vLLM brings it to every worker between the same two steps, so no step
    runs with two ranks on different versions, and a commit never waits on a receive. Then asks
    vLLM to reset its prefix cache (as apply_update, `preempt_running` too). Raises
    ShadowsyncTimeoutError naming the workers not ready after `timeout` seconds (nothing was
    committed then). Returns `version`. For an ``AsyncLLM``: commit_update_async."""
    version = int(version)
    deadline = time.monotonic() + timeout
    while True:
        ready = [int(v) for v in llm.collective_rpc("ready_version")]
        if all(v == version for v in ready):
            break
        if time.monotonic() > deadline:
            raise _not_ready_error("commit_update", version, timeout, ready)
        time.sleep(0.002)
    applied = _committed(llm.collective_rpc("commit_update", args=(version,)))
    if reset_prefix_cache:
        _reset_prefix_cache(llm, version, "commit_update", preempt_running)
    return applied


async def commit_update_async(engine, version: int, timeout: float = 60.0,
                              reset_prefix_cache: bool = True, preempt_running: bool = False) -> int:
    """commit_update for an ``AsyncLLM`` (see there): polls ``ready_version`` without blocking
    the event loop, then one ``commit_update`` collective_rpc makes `version` live on every
    worker between the same two steps."""
    import asyncio

    version = int(version)
    deadline = time.monotonic() + timeout
    while True:
        ready = [int(v) for v in await engine.collective_rpc("ready_version")]
        if all(v == version for v in ready):
            break
        if time.monotonic() > deadline:
            raise _not_ready_error("commit_update_async", version, timeout, ready)
        await asyncio.sleep(0.002)
    applied = _committed(await engine.collective_rpc("commit_update", args=(version,)))
    if reset_prefix_cache:
        await _reset_prefix_cache_async(engine, version, "commit_update_async", preempt_running)
    return applied
