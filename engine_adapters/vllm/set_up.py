"""Setting up a worker's update group from a ShadowsyncInitInfo: reads the model's parameters,
refuses what cannot be updated right, plans the receive (receive_planning.py), chooses how swaps
happen, connects the transport and installs the step hook.

How a swap happens is chosen from what vLLM set up at load: the live arena's remap (backend
"shadowsync" moved the weights into a remap arena before vLLM captured its CUDA graphs), graph
pairs' rebind between the arena's two slots (each with its own graph set), copy_in into the
engine's own storage under CUDA graphs set up without the arena (every graph keeps reading that
storage), else rebind (eager engines: parameters are pointed at the live slot)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shadowsync.backend import Backend, CudaBackend, HostBackend
from shadowsync.errors import InvalidArgumentError
from shadowsync.layout import BASE_GROUP, Layout, TensorSpec
from shadowsync.receive_plan import needed_ranges
from shadowsync.receiver import Receiver, ReceiverConfig
from shadowsync.tensors import describe, items
from shadowsync.transport import Transport, nccl_transport, same_host_transport

from . import step_agreement, step_hook_site, tensor_parallel, trainer_ranks, vllm_worker
from .init_info import ShadowsyncInitInfo
from .lora_plan import is_lora_tensor
from .online_fp8 import online_fp8_weights, padded
from .post_load_trace import check_post_load_transforms
from .receive_planning import (check_specs, packed_in_place_plan, placement, receive_plan,
                               receive_plan_with_lora, receives_in_place, refuse_empty)
from .update_group import UpdateGroup, address, adopt, param_data

__all__ = ["PlannedGroup", "connect_update_group", "plan_update_group", "set_up_update_group"]


@dataclasses.dataclass
class PlannedGroup:
    """What plan_update_group decided for a worker, before anything connects: the layouts, the
    receive plan and how swaps happen. connect_update_group sets the worker up from it."""

    info: ShadowsyncInitInfo
    layout: Layout  # the slots' (the engine's)
    plan: Any  # the receive plan (a ReceivePlan), or None: the trainer sends the engine's layout
    params: dict[str, Any]
    kind: str
    device: str
    backend: Backend
    stream: Any
    receiver_config: ReceiverConfig | None
    live_arena: Any
    arena_group: int | None
    graph_pairs: bool
    gate: bool
    routing: Any = None  # trainer_ranks: the RoutingPlan of the trainers' ranks
    engine_rank: int = 0  # trainer_ranks: this worker's rank in it
    step_agreed: bool = False  # commit_mode "auto" under tensor parallelism (step_agreement.py)

    @property
    def wire(self) -> Layout:
        """The layout updates arrive in (the trainer's)."""
        return self.plan.wire if self.plan is not None else self.layout


def set_up_update_group(worker, info: ShadowsyncInitInfo, transport: Transport | None,
                        agree) -> UpdateGroup:
    """Sets `worker` up as `info` says and returns its UpdateGroup (also kept as
    ``worker._shadowsync``). `transport`: a ready one (tests), else the one `info` names.
    `agree()` is called once everything is checked, before any transport connects, and once set
    up (tensor_parallel.all_ranks_or_none: every rank or none). Engine thread, before stepping."""
    planned = plan_update_group(worker, info)
    if transport is None and info.unique_id is not None and planned.device == "cpu":
        raise InvalidArgumentError(
            "init_weight_update_group: NCCL needs CUDA parameters, the model's are on cpu")
    if info.trainer_ranks is not None:
        if planned.receiver_config is not None and planned.receiver_config.require_checksums:
            raise InvalidArgumentError(
                "init_weight_update_group: trainer_ranks with receiver_config.require_checksums: "
                "routed updates carry no checksums yet; unset it")
        planned.engine_rank = tensor_parallel.rank(worker)
        planned.routing = trainer_ranks.routing_plan(
            planned.wire, info.trainer_ranks, planned.engine_rank, tensor_parallel.size(worker),
            needed_ranges(planned.layout, planned.plan))
    agree()  # every rank checked its part: now the transports may connect
    return connect_update_group(worker, planned, transport, agree)


def plan_update_group(worker, info: ShadowsyncInitInfo) -> PlannedGroup:
    """The set-up's first part, which connects nothing and changes nothing on the worker: reads
    the model's parameters, refuses what cannot be updated right, plans the receive and chooses
    how swaps happen (weight_update_needs stops here). Engine thread."""
    specs, bucket_bytes, group_of = info.specs, info.bucket_bytes, info.group_of
    allow_partial, lora_adapter = info.allow_partial, info.lora_adapter
    swap_strategy, engine_uses_cuda_graphs = info.swap_strategy, info.engine_uses_cuda_graphs
    commit_mode = info.commit_mode
    receiver_config = info.merged_receiver_config()
    model = worker._shadowsync_model()
    params = dict(items(worker._shadowsync_named_parameters()))
    if not params:
        raise InvalidArgumentError("init_weight_update_group: the model has no parameters")
    # Weights vLLM quantized while loading (quantization="fp8"): described by their float8
    # bytes in the as-loaded layout, which the receive writes.
    fp8 = online_fp8_weights(model)
    params.update({name: w.storage for name, w in fp8.items() if name in params})
    descs = {name: describe(name, param_data(p)) for name, p in params.items()}
    kind, device = placement(descs)
    # Before anything else reads the parameters: are they what the model computes with?
    # (vLLM CPU's packed experts are written in their packed order: `packed`.)
    packed = check_post_load_transforms(model, vllm_worker.quantization(worker),
                                        device.split(":")[0])
    refuse_empty(params)

    chosen = swap_strategy if swap_strategy is not None else (
        receiver_config.swap_strategy if receiver_config is not None else None)
    live_arena = vllm_worker.live_arena_engine(worker)
    # Graph pairs: the arena's slots each have their own CUDA graphs, so a swap rebinds
    # between them; the plain live arena is swapped by remapping its live range.
    graph_pairs = bool(getattr(live_arena, "shadowsync_graph_pairs", False))
    arena_strategy = "rebind" if graph_pairs else "remap"
    # The live arena, when swaps may swap it (by remap, or by rebind under graph pairs): it is
    # swapped whole, so a plan for it keeps what the trainer does not send.
    arena_to_remap = live_arena if chosen in (None, arena_strategy) else None
    if fp8:
        check_fp8_engine(specs, lora_adapter, chosen, live_arena, tensor_parallel.size(worker),
                         fp8)
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
        plan = packed_in_place_plan(layout, packed)
    else:
        specs = [TensorSpec.coerce(s) for s in specs]
        if lora_adapter is not None or any(is_lora_tensor(s.name) for s in specs):
            layout, plan, params, descs = receive_plan_with_lora(
                worker, model, specs, lora_adapter, bucket_bytes, allow_partial, arena_to_remap,
                packed)
        elif receives_in_place(specs, descs, arena_to_remap):
            check_specs(specs, descs)  # the engine's own layout: zero-copy receive
            layout = Layout(specs, bucket_bytes)
            plan = packed_in_place_plan(layout, packed)
        else:
            layout, plan, params = receive_plan(model, specs, bucket_bytes, allow_partial,
                                                 arena_to_remap, packed, fp8)
            descs = {name: describe(name, param_data(p)) for name, p in params.items()}

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

    if engine_uses_cuda_graphs is None and device != "cpu":
        engine_uses_cuda_graphs = vllm_worker.captures_cuda_graphs(worker)
    # The groups of a LoRA adapter's tensors: their live copy is the adapter's slot in vLLM's
    # stacked LoRA buffers, which can only be copied into, never rebound or remapped.
    lora_groups = {s.group for s in specs if is_lora_tensor(s.name)}
    arena_group = None  # the group swapped by remapping the live arena
    if arena_to_remap is not None:
        base = [g for g in layout.groups if g.name not in lora_groups]
        if base:
            check_fits_live_arena(base, params, live_arena)
            arena_group = base[0].index
            swap_strategy = chosen = arena_strategy
    if arena_group is None:
        # copy_in into the arena's live range (or nothing of the arena at all: an adapter
        # only), as into any storage.
        live_arena = None
        graph_pairs = False
    if graph_pairs and lora_groups:
        raise InvalidArgumentError(
            "init_weight_update_group: lora_adapter with the 'shadowsync_graph_pairs' "
            "weight-transfer backend: a swap there rebinds the base weights between two "
            "slots, and an adapter lives in vLLM's stacked LoRA buffers, which can only be "
            "copied into; start vLLM with weight_transfer_config={'backend': "
            "'shadowsync'} (remap, with the adapter copied in at the same swap), or pass "
            "swap_strategy='copy_in' (base and adapter both copied in at each swap)")
    if graph_pairs:
        # The graphs follow the live slot (one set per slot, switched at each swap), so the
        # swap may move the live address: to the library this is an engine that rebinds.
        engine_uses_cuda_graphs = False
    if lora_groups and chosen not in (None, "copy_in") and arena_group is None:
        raise InvalidArgumentError(
            f"init_weight_update_group: lora_adapter needs swap_strategy 'copy_in' (the "
            f"adapter lives in vLLM's stacked LoRA buffers), or 'remap' with the live "
            f"arena for the base weights beside it; got {chosen!r}")
    if (lora_groups or fp8) and arena_group is None:
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
        commit_mode = "coordinated" if tensor_parallel.size(worker) > 1 else None
    explicit_auto = commit_mode == "auto" or (
        commit_mode is None and receiver_config is not None and receiver_config.commit_mode == "auto")
    step_agreed = explicit_auto and tensor_parallel.size(worker) > 1
    if step_agreed and not info.hook_execute_model:
        raise InvalidArgumentError(
            "init_weight_update_group: commit_mode \"auto\" under tensor parallelism with "
            "hook_execute_model=False: the ranks agree on the step in the step hook, which numbers "
            "the steps; set hook_execute_model=True, or leave commit_mode unset (coordinated: "
            "updates go live by shadowsync.vllm.commit_update)")
    pipeline = tensor_parallel.pipeline_size(worker)
    if step_agreed and pipeline > 1:
        raise InvalidArgumentError(
            f"init_weight_update_group: commit_mode \"auto\" under tensor parallelism with "
            f"pipeline_parallel_size {pipeline}: the step hooks agree within one "
            f"tensor-parallel group, and each pipeline stage has its own; leave commit_mode "
            f"unset (coordinated: updates go live by shadowsync.vllm.commit_update, on every "
            f"stage's ranks between the same two steps)")
    if step_agreed:
        # The receivers hold each update ready and the step hooks commit it, every rank at the
        # same step (step_agreement.py).
        commit_mode = "coordinated"
    if commit_mode is not None:
        receiver_config = dataclasses.replace(receiver_config or ReceiverConfig(),
                                              commit_mode=commit_mode)
    if swap_strategy is not None or engine_uses_cuda_graphs is not None:
        receiver_config = dataclasses.replace(receiver_config or ReceiverConfig())
        if swap_strategy is not None:
            receiver_config.swap_strategy = swap_strategy
        if engine_uses_cuda_graphs is not None:
            receiver_config.engine_uses_cuda_graphs = engine_uses_cuda_graphs
    gate = step_hook_site.gated_swaps(worker, info.gated_swaps,
                                      arena_group is not None and not lora_groups,
                                      info.hook_execute_model)
    if gate:
        receiver_config = dataclasses.replace(receiver_config or ReceiverConfig(),
                                              gated_swaps=True)
    return PlannedGroup(info, layout, plan, params, kind, device, backend, stream,
                        receiver_config, live_arena, arena_group, graph_pairs, gate,
                        step_agreed=step_agreed)


def connect_update_group(worker, planned: PlannedGroup, transport: Transport | None,
                         agree) -> UpdateGroup:
    """The set-up's second part, once every rank agreed to plan_update_group's result: connects
    the transport (`transport`, a ready one, else the one the info names), creates the receiver,
    binds the parameters and installs the step hook; `agree()` once set up. Engine thread."""
    info = planned.info
    unique_id, rank_offset, world_size = info.unique_id, info.rank_offset, info.world_size
    layout, plan, params, kind, device = (planned.layout, planned.plan, planned.params,
                                          planned.kind, planned.device)
    backend, stream, receiver_config = planned.backend, planned.stream, planned.receiver_config
    live_arena, arena_group, graph_pairs = (planned.live_arena, planned.arena_group,
                                            planned.graph_pairs)
    gate, lora_adapter = planned.gate, info.lora_adapter
    track_request_versions, adopt_current_weights = (info.track_request_versions,
                                                     info.adopt_current_weights)
    if graph_pairs:
        # The receiver starts from the slot the arena shows; the model must read that one (a
        # close that failed before settling could have left it on the other).
        live_arena.settle()
    if transport is None and unique_id is not None:
        rank = int(rank_offset) + int(getattr(worker, "rank", 0))
        transport = nccl_transport(unique_id, rank, int(world_size), int(device.split(":")[1]))
    if transport is None and info.same_host is not None:
        transport = _same_host_receiver(info.same_host, rank_offset, getattr(worker, "rank", 0),
                                        backend)
    if transport is None and planned.routing is not None:
        transport = trainer_ranks.connect(
            info.trainer_ranks, planned.routing, planned.engine_rank, backend,
            None if device == "cpu" else int(device.split(":")[1]))

    receiver = Receiver(layout, backend, transport, receiver_config, engine_stream=stream,
                        plan=plan,
                        arenas={arena_group: live_arena.arena} if live_arena else None)
    if planned.routing is not None:
        # Each trainer rank's routes into this rank, moved by the pull transport: no broadcast.
        try:
            receiver.use_routing_plan(planned.routing, planned.engine_rank)
        except BaseException:
            receiver.close()
            raise
    state = UpdateGroup(receiver, {t.name: params[t.name] for g in layout.groups
                                    for t in g.tensors}, kind, device)
    state.stream = stream
    state.coordinated = (receiver_config is not None and receiver_config.commit_mode == "coordinated"
                         and not planned.step_agreed)
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
                group.index, [address(param_data(state.params[t.name])) for t in group.tensors])
        state.engine_storage = True
    elif live_arena is not None:
        # The parameters already live in the arena's live range (moved there at load, before
        # vLLM captured its graphs): a swap remaps it, nothing is rebound. An adapter's groups
        # beside it are copied into vLLM's LoRA slots at the same swap.
        for group in layout.groups:
            if group.index != arena_group:
                receiver.use_engine_storage(
                    group.index, [address(param_data(state.params[t.name])) for t in group.tensors])
        state.engine_storage = True
    elif adopt_current_weights:
        adopt(state, layout, stream)
    worker._shadowsync = state
    if info.hook_execute_model and hasattr(worker, "execute_model"):
        state.step_hook_at = step_hook_site.hook_execute_model(worker, gated=gate)
    agree()  # every rank is set up (one that failed to connect takes the others back)
    if planned.step_agreed:  # every rank is here: the page's all-gathers meet
        state.step_agreement = step_agreement.open_for_tensor_parallel_group(
            tensor_parallel.gathered)
        # The front end's view starts at the version live now (none went live through it yet).
        state.step_agreement.committed(state.steps, receiver.applied_version)
    if lora_adapter is not None:
        # vLLM must not evict it: its slot is the live copy. Pinned once every rank is set
        # up, so a refused set-up pins nothing; it stays pinned after close (vLLM has no
        # unpin), as an adapter that is being trained would be.
        vllm_worker.lora_manager(worker).pin_adapter(int(lora_adapter))
    return state


def check_fp8_engine(specs, lora_adapter, chosen, live_arena, tensor_parallel_size: int = 1,
                     fp8: dict | None = None) -> None:
    """An engine vLLM quantized to FP8 while loading takes updates as the trainer's tensors
    (bf16/fp16, quantized by the receiver into the shadow). Swapped in by copy_in (into vLLM's
    own storage) or, under graph pairs, by rebinding its parameters to the other slot, which
    holds the float8 bytes and the scales like any weight (their holders in vLLM's kernels hold
    the parameters themselves). Not by the plain live arena's remap, which no run has shown. One
    rank only: under tensor parallelism a rank's scale is taken over its own shard by some vLLM
    versions and over every rank's by others, and no run has shown which one the receiver
    matches. `fp8`: online_fp8_weights of the engine."""
    graph_pairs = bool(getattr(live_arena, "shadowsync_graph_pairs", False))
    if tensor_parallel_size > 1:
        raise InvalidArgumentError(
            f"init_weight_update_group: an FP8 engine (quantization=\"fp8\") with "
            f"tensor_parallel_size {tensor_parallel_size}: not supported yet (vLLM versions "
            f"differ in the shard a rank's per-tensor scale is taken over); serve it with "
            f"tensor_parallel_size 1, or in bf16 under tensor parallelism")
    if specs is None:
        raise InvalidArgumentError(
            "init_weight_update_group: vLLM quantized this engine's weights to FP8 while loading "
            "them; pass specs (the trainer's tensors, e.g. named_parameters() in bf16): the "
            "receiver quantizes them as vLLM does")
    if lora_adapter is not None:
        raise InvalidArgumentError(
            f"init_weight_update_group: lora_adapter={lora_adapter} with an FP8 engine "
            f"(quantization=\"fp8\"): not supported; serve the adapter from a bf16 engine")
    if live_arena is not None and not graph_pairs:
        raise InvalidArgumentError(
            "init_weight_update_group: an FP8 engine (quantization=\"fp8\") with its weights "
            "in a live arena ('shadowsync_live_arena'): not supported (its remap has not been "
            "shown with FP8 weights); start vLLM with weight_transfer_config={'backend': "
            "'shadowsync'}, which chooses graph pairs or leaves FP8 weights in place")
    held_padded = padded(fp8 or {})
    if graph_pairs and held_padded and chosen in (None, "rebind"):
        name = held_padded[0]
        w = fp8[name]
        raise InvalidArgumentError(
            f"init_weight_update_group: FP8 weight '{name}' is held padded by vLLM's kernel "
            f"({w.storage.shape[0] + w.padded_rows} rows for the {w.storage.shape[0]} loaded; "
            f"{len(held_padded)} weight(s) so), which graph pairs cannot swap; start vLLM with "
            f"weight_transfer_config={{'backend': 'shadowsync'}} (it then leaves the weights in "
            f"place), or pass swap_strategy='copy_in'")
    allowed = (None, "copy_in", "rebind") if graph_pairs else (None, "copy_in")
    if chosen not in allowed:
        raise InvalidArgumentError(
            f"init_weight_update_group: swap_strategy {chosen!r} with an FP8 engine "
            f"(quantization=\"fp8\"): its updates are copied into vLLM's storage at each swap"
            f"{', or rebound under graph pairs' if graph_pairs else ''}; leave swap_strategy "
            f"unset or pass {' or '.join(repr(a) for a in allowed[1:])}")


def check_fits_live_arena(base: list, params: dict[str, Any], live_arena) -> None:
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
        # The parameter itself, or (an FP8 weight) the bytes it is a transposed view of.
        held = live_arena.params[i]
        here = params[have.name] is held or (
            address(param_data(params[have.name])) == address(param_data(held)))
        same = here and have.dtype == want.dtype and tuple(have.shape) == tuple(want.shape)
        if not same:
            raise InvalidArgumentError(
                f"init_weight_update_group: the update's parameter {i} is {have.name!r} "
                f"({have.dtype}, {list(have.shape)}), but the live arena holds {want.name!r} "
                f"({want.dtype}, {list(want.shape)}) there: the trainer's tensors must write "
                f"every parameter of the model, in the model's order, to swap the arena (remap, "
                f"or rebind under graph pairs); or use swap_strategy='copy_in'")
    if len(tensors) != len(arena_tensors):
        raise InvalidArgumentError(
            f"init_weight_update_group: the update writes {len(tensors)} parameters, the live "
            f"arena holds {len(arena_tensors)}: to swap the arena the trainer's tensors must write "
            f"every parameter of the model, or, with a receive plan and allow_partial=True, the "
            f"ones they do not write are kept; or use swap_strategy='copy_in'")


def _same_host_receiver(same_host: dict, rank_offset: int, worker_rank: int, backend):
    """The same-host transport's receiver end from ShadowsyncInitInfo.same_host (checked there):
    rank ``rank_offset`` + the worker's rank unless it names one."""
    rank = same_host.get("rank", int(rank_offset) + int(worker_rank))
    return same_host_transport(same_host["path"], same_host["token"], rank, backend,
                               connect_timeout_ms=same_host.get("connect_timeout_ms"))
