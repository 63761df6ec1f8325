"""The receiver and its step hook (receiver.h, step_hook.h): the engine side.

The receive runs on the library's own native thread: begin_update() validates the header, queues
it and returns; the Python interpreter is never on the receive path (a receive driven from a
Python thread was measured to stall decoding for the whole transfer). The engine thread only calls
the step hook: before_step(), with nothing pending, is one handle lookup and one atomic load in C
(plus one timestamp of the step when ReceiverConfig.decode_slowdown_budget is set).
"""

from __future__ import annotations

import ctypes
import math
from ctypes import byref, c_int, c_size_t, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Callable, NamedTuple

from ._handle import Handle
from ._library import (
    SWAP_CALLBACK,
    COMMIT_MODES,
    SWAP_STRATEGIES,
    ReceiverConfigC,
    ReceiverStatsC,
    WireRangeC,
    config_struct,
)
from .backend import Backend, Stream
from .errors import (
    STATUS_NAMES,
    InvalidArgumentError,
    NotSupportedError,
    call,
    call_array,
    call_keeping_gil,
)
from .layout import Layout, TensorInfo, UpdateHeader
from .receive_plan import ReceivePlan
from .regions import WireRange
from .transport import Transport


@dataclass
class ReceiverConfig:
    """shadowsync_receiver_config_t; None takes the library's default."""

    root_rank: int | None = None  # the sender's rank in the transport (0)
    update_deadline_ms: int | None = None  # a whole update must land within this (60000)
    bucket_deadline_ms: int | None = None  # each bucket within this of the previous (10000)
    poll_interval_us: int | None = None  # progress/error polling while receiving (200)
    # How a swap makes an update visible: "rebind" (default; live pointers flip), "copy_in" (one
    # device copy into fixed live storage, any backend), "remap" (CUDA VMM remap of a fixed
    # virtual range; CUDA backend only). docs/guides/swap-strategies.md says when to pick which.
    swap_strategy: str | None = None
    # The engine replays CUDA graphs captured over the weights: rebind is then refused.
    engine_uses_cuda_graphs: bool | None = None
    # Refuse a header without per-bucket checksums (False); one with them is verified either way.
    require_checksums: bool | None = None
    # Refuse an update with a NaN or infinity in an fp32/fp16/bf16 tensor (False).
    reject_nonfinite: bool | None = None
    # An abort of the transport that has not returned after this is reported: stderr and
    # ReceiverStats.stuck_aborts (10000).
    abort_deadline_ms: int | None = None
    # Such an abort also ends the process, exit status 70 (False).
    exit_on_stuck_abort: bool | None = None
    # "auto" (default: live at the next step) or "coordinated": held ready until commit(version),
    # which every tensor-parallel rank makes between the same two steps.
    commit_mode: str | None = None
    # Pacing (docs/guides/pacing.md): a receive shares memory bandwidth with decoding. With a budget
    # (e.g. 1.05) the step hook stamps each step's start, the receiver learns the engine's step
    # time while no update streams in, and holds its buckets back so that the mean step while
    # one streams in (what decode tokens/s sees) stays within budget x that time; the update
    # takes longer instead. Finite, at least 1.0; None (the default): no pacing, and the step
    # hook stamps nothing.
    decode_slowdown_budget: float | None = None
    # A cap on the receive rate in bytes per second (0, the default: none). With a budget too, the
    # longer hold of the two wins; neither makes an update miss update_deadline_ms. None: as 0.
    max_receive_bytes_per_second: int | None = 0
    # swap_strategy "remap" only: the engine calls Receiver.after_launch() once each step's work
    # is enqueued, before it waits for its stream; a swap then closes a gate on the engine stream
    # in before_step and remaps in after_launch once the step before has ended, while the engine
    # thread goes on (False). A watchdog opens a gate the engine has not finished
    # gate_deadline_ms after the step before ended (50), and gates stay off from then on.
    gated_swaps: bool | None = None
    gate_deadline_ms: int | None = None
    # A complete update is offered only once an engine step started after its last bucket (at
    # most 4 idle steps later), so that the swap's step is not one a bucket slowed; the step hook
    # then stamps each step's start. A budget implies it (False).
    offer_after_clean_step: bool | None = None

    def _c_fields(self) -> dict:
        """The C struct's fields; raises InvalidArgumentError naming the field and its value
        (before anything is created) for a value the library would refuse."""
        _check_pacing(self.decode_slowdown_budget, self.max_receive_bytes_per_second)
        fields = vars(self).copy()
        # The fields named by a string: their C values, or an error naming the choices.
        for name, choices in (("commit_mode", COMMIT_MODES), ("swap_strategy", SWAP_STRATEGIES)):
            value = fields[name]
            if value is None:
                continue
            if value not in choices:
                raise InvalidArgumentError(
                    f"ReceiverConfig.{name}: {value!r} is not one of "
                    f"{', '.join(map(repr, choices))}"
                )
            fields[name] = choices[value]
        return fields


def _check_pacing(budget, max_bytes_per_second) -> None:
    """ReceiverConfig's pacing fields, refused as the C++ ReceiverConfig check refuses them (the C
    struct cannot carry "unset" and 0 apart for the budget: 0.0 there means none)."""
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise InvalidArgumentError(
                f"ReceiverConfig.decode_slowdown_budget is {budget!r} ({type(budget).__name__}); "
                f"it must be a number (a float of at least 1.0), or None for no pacing")
        if not (math.isfinite(budget) and budget >= 1.0):
            raise InvalidArgumentError(
                f"ReceiverConfig.decode_slowdown_budget is {budget!r}; it must be a finite number "
                f"of at least 1.0 (1.05: a decode step may take 5 % longer while an update streams "
                f"in), or None for no pacing")
    if max_bytes_per_second is None:  # as 0: no cap
        return
    if (isinstance(max_bytes_per_second, bool) or not isinstance(max_bytes_per_second, int)
            or not 0 <= max_bytes_per_second < 1 << 64):
        raise InvalidArgumentError(
            f"ReceiverConfig.max_receive_bytes_per_second is {max_bytes_per_second!r}; it must be "
            f"an integer from 0 (no cap) to 2**64 - 1")


@dataclass(frozen=True)
class PacingReport:
    """What pacing did to one update that became ready (ReceiverConfig.decode_slowdown_budget,
    max_receive_bytes_per_second). Durations are host wall time in seconds. Without a budget or a
    cap `paced` is False and every other field is 0 / None, but for the clean-step wait, which
    offer_after_clean_step reports on its own."""

    paced: bool = False
    budget: float | None = None  # the budget; None: a rate cap only, or unpaced
    # The engine's mean step time while no update streamed in, the baseline the budget
    # multiplies; 0: not measured (too few steps seen outside an update yet). In both means a
    # step counts at most 4 median idle steps.
    idle_step_s: float = 0.0
    step_during_s: float = 0.0  # the mean step while this update streamed in; 0: none completed
    step_ratio: float = 0.0  # step_during_s / idle_step_s; 0 when either is unknown
    steps: int = 0  # engine steps that started while this update streamed in
    busy_s: float = 0.0  # sum over buckets: posted -> completion observed
    held_back_s: float = 0.0  # sum of the holds between buckets
    duty: float = 0.0  # busy / (busy + held back): the share of the window with a bucket in flight
    deadline_limited: bool = False  # a hold was shortened so that update_deadline_ms is met
    # With a budget or offer_after_clean_step (paced or not) the complete update is offered once
    # an engine step started after its last bucket (the step a swap delays is then not the one
    # that bucket slowed): how long it was held for that (0: the idle step was not known yet),
    # and whether none started within 4 idle steps (an idle engine: offered anyway).
    clean_step_wait_s: float = 0.0
    clean_step_missed: bool = False

    @classmethod
    def _from_c(cls, s: ReceiverStatsC) -> PacingReport:
        # The clean-step wait is not pacing: offer_after_clean_step alone (no budget, no cap; the
        # vLLM workers' default) holds a complete update for a clean step too, unpaced.
        clean_step = dict(clean_step_wait_s=s.last_clean_step_wait_ns / 1e9,
                          clean_step_missed=bool(s.last_clean_step_missed))
        if not s.last_paced:
            return cls(**clean_step)
        return cls(
            paced=True,
            budget=s.last_pacing_budget or None,
            idle_step_s=s.last_idle_step_ns / 1e9,
            step_during_s=s.last_step_during_ns / 1e9,
            step_ratio=s.last_step_ratio,
            steps=s.last_pacing_steps,
            busy_s=s.last_busy_ns / 1e9,
            held_back_s=s.last_held_back_ns / 1e9,
            duty=s.last_duty,
            deadline_limited=bool(s.last_deadline_limited),
            **clean_step,
        )


@dataclass(frozen=True)
class ReceiverStats:
    updates_ready: int
    updates_failed: int
    updates_superseded: int
    bytes_received: int
    last_accepted_version: int
    applied_version: int
    needs_transport: bool  # no transport now (aborted after a failure, or released): replace it
    has_pending: bool  # a received update waits for the next step
    stuck_aborts: int  # transport aborts that overran ReceiverConfig.abort_deadline_ms
    last_failure: UpdateFailure | None  # the last update that failed; None: none did
    ready_version: int = 0  # commit_mode "coordinated": received, checked, awaiting commit()
    # The last update that became ready: its transfer time in seconds (first receive posted ->
    # completion observed; 0.0: none yet) and what pacing did to it.
    last_transfer_s: float = 0.0
    last_pacing: PacingReport = PacingReport()
    # The last swap that made an update live: the engine thread's seconds in it (swap callback
    # included) and when it started, on the clock of time.monotonic(). 0.0 before the first.
    last_swap_s: float = 0.0
    last_swap_started_s: float = 0.0
    # gated_swaps: gates closed so far, and those the watchdog had to open.
    gated_swaps: int = 0
    gates_abandoned: int = 0
    # With a receive plan (0 without one): the pieces the receiver's thread issues per update
    # (one copy on its stream each) and the staging memory it holds for quantized tensors.
    plan_pieces: int = 0
    plan_staging_bytes: int = 0
    # With a routing plan (use_routing_plan; 0 without one): the bytes the last ready update's
    # routes carried into this engine rank, the plan's trainer ranks and its fingerprint.
    routed_bytes: int = 0
    trainer_count: int = 0
    routing_fingerprint: int = 0
    # Of routed_bytes, those read where the trainer ranks' shards lie (the same-host pull
    # transport with GPU memory the trainers could share: nothing packed on their side).
    routed_in_place_bytes: int = 0


@dataclass(frozen=True)
class UpdateFailure:
    """Where the last failed update failed: `status` is its shadowsync_status_t (STATUS_NAMES):
    SHADOWSYNC_TIMEOUT, SHADOWSYNC_TRANSPORT_ERROR (peer lost, aborted, or a checksum mismatch),
    SHADOWSYNC_INVALID_ARGUMENT (the non-finite guard) or SHADOWSYNC_SHUTDOWN. A check that refused
    it names the group and the bucket (checksum) or the tensor (non-finite guard); else None."""

    version: int
    status: int
    group: str | None
    bucket: int | None
    tensor: str | None

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, str(self.status))


class GroupSwap(NamedTuple):
    """One group made live by a swap: its index, the slot now live, the version its bytes hold."""

    group: int
    slot: int
    content_version: int


def _arena_array(layout: Layout, arenas: dict):
    """{group name or index: RemapArena} as the C array of handles in group order."""
    index = {g.name: g.index for g in layout.groups}
    handles = [None] * len(layout.groups)
    for key, arena in arenas.items():
        g = index.get(key) if isinstance(key, str) else key
        if g is None or not 0 <= g < len(handles):
            raise InvalidArgumentError(
                f"arenas: {key!r} is not a group of the layout (groups: "
                f"{', '.join(repr(n) for n in index)})")
        handles[g] = arena.handle
    return (c_void_p * len(handles))(*[h.value if h is not None else None for h in handles])


class Receiver(Handle):
    """Allocates both slots of every group of `layout` on `backend` and starts the receiver
    thread. `transport` (taken) may be None until a rendezvous: replace_transport() then.

    `plan` (a ReceivePlan): the trainer sends another layout than `layout` (the engine's, which
    the slots have); each received bucket is copied into the shadow by the plan.

    `arenas` ({group name or index: RemapArena}; swap_strategy "remap" or "rebind"): the live
    memory of those groups is the engine's arena, which holds its current weights laid out as the
    group (each exactly the group's arena_bytes), typically under CUDA graphs captured before this
    receiver existed; its other slot becomes the shadow. Under remap a swap remaps the arena's
    live range; under rebind the arena's two slot mappings are the slots and a swap flips which
    is live (live_arena_pointer moves; an engine with one graph set per slot), and the arena's
    live_slot does not follow: before a later receiver takes it, the engine must read the slot
    the arena shows (shadowsync.vllm's graph pairs copy it there at close). The receiver shares
    each arena (a later receiver may take it once this one is closed); refused, naming the group
    and both values, before anything is allocated.

    The step hook calls run on the engine's stream: `engine_stream` (a stream of `backend`),
    default a new stream of `backend`; each call may name another."""

    _destroy_fn = "shadowsync_receiver_destroy"

    def __init__(
        self,
        layout: Layout,
        backend: Backend,
        transport: Transport | None = None,
        config: ReceiverConfig | None = None,
        engine_stream: Stream | None = None,
        plan: ReceivePlan | None = None,
        arenas: dict | None = None,
    ):
        c_config = config_struct(ReceiverConfigC, **config._c_fields()) if config is not None else None
        c_config_ref = byref(c_config) if c_config is not None else None
        c_transport = transport.handle if transport is not None else None
        handle = c_void_p()
        if plan is not None and plan.quantized:
            c_arenas = _arena_array(layout, arenas) if arenas else None
            copies, _keep = plan._c_array()
            quantized, _keep_names = plan._c_quantized()
            call("shadowsync_receiver_create_with_quantized_plan", layout.handle,
                 plan.wire.handle, copies, len(copies), quantized, len(plan.quantized),
                 c_arenas, len(c_arenas) if c_arenas else 0, backend.handle, c_transport,
                 c_config_ref, byref(handle))
        elif arenas:
            c_arenas = _arena_array(layout, arenas)
            copies, _keep = plan._c_array() if plan is not None else (None, None)
            call("shadowsync_receiver_create_with_arenas", layout.handle,
                 plan.wire.handle if plan is not None else None, copies,
                 len(copies) if plan is not None else 0, c_arenas, len(c_arenas),
                 backend.handle, c_transport, c_config_ref, byref(handle))
        elif plan is None:
            call("shadowsync_receiver_create", layout.handle, backend.handle, c_transport,
                 c_config_ref, byref(handle))
        else:
            copies, _keep = plan._c_array()
            call("shadowsync_receiver_create_with_plan", layout.handle, plan.wire.handle, copies,
                 len(copies), backend.handle, c_transport, c_config_ref, byref(handle))
        super().__init__(handle.value)
        if transport is not None:
            transport._disown()
        self.layout = layout
        # The layout updates arrive in (the trainer's): the plan's, else the slots' own.
        self.wire_layout = plan.wire if plan is not None else layout
        self.plan = plan
        self.backend = backend
        self.engine_stream = engine_stream if engine_stream is not None else backend.create_stream()
        self._swap_callback = None  # the ctypes trampoline: must live while C may call it
        self._swap_error: BaseException | None = None
        # before_step never blocks under rebind and copy_in (a remap may wait for the engine's
        # stream): there it keeps the GIL (errors.call_keeping_gil), so neither it nor the swap
        # callback inside waits for another Python thread to hand the GIL back.
        strategy = config.swap_strategy if config is not None else None
        self._before_step_call = call_keeping_gil if strategy in (None, "rebind", "copy_in") else call

    # --- control plane (any thread) -----------------------------------------------------------

    def begin_update(self, header: bytes | UpdateHeader, verify_matches_live: bool = False
                     ) -> None:
        """Validates the header against the layout and the last accepted version, queues it and
        returns at once; the receive runs on the receiver's native thread. Raises (BadHeaderError,
        LayoutMismatchError, StaleVersionError, ...) naming the field and both values, and then
        nothing changed. Thread-safe.

        `verify_matches_live`: the self-check. The update must reproduce the engine's live
        weights byte for byte (the trainer sends the checkpoint the engine holds): once it landed,
        every tensor it wrote is compared with its live copy on the receiver's check stream, and
        the first that differs fails the update (LayoutMismatchError in its report, naming the
        tensor and the first differing element; nothing goes live)."""
        if verify_matches_live:
            data = header.to_bytes() if isinstance(header, UpdateHeader) else bytes(header)
            call("shadowsync_receiver_begin_update_checked", self._handle, data, len(data), 1)
            return
        if isinstance(header, UpdateHeader):
            c = header._to_c()
            call("shadowsync_receiver_begin_update", self._handle, byref(c))
            return
        data = bytes(header)
        call("shadowsync_receiver_begin_update_bytes", self._handle, data, len(data))

    def abort_update(self) -> None:
        """Aborts the update in flight, if any (and the transport with it). Thread-safe."""
        call("shadowsync_receiver_abort_update", self._handle)

    def replace_transport(self, transport: Transport) -> None:
        """Installs a transport (the first, or after a failure aborted the old one). Thread-safe."""
        call("shadowsync_receiver_replace_transport", self._handle, transport.handle)
        transport._disown()

    def use_routing_plan(self, plan, engine_rank: int) -> None:
        """Makes this receiver engine rank `engine_rank` of `plan` (a RoutingPlan over its wire
        layout; DESIGN §14): its updates are then every trainer rank's routes into it, moved by
        its transport (which must move routes of the plan for that rank, or the update fails,
        named), no longer broadcasts. Before the first update only. Raises InvalidArgumentError
        for a rank outside the plan, an update already accepted or require_checksums set
        (routed updates carry no checksums yet), LayoutMismatchError for a plan of another wire
        layout. Thread-safe."""
        call("shadowsync_receiver_use_routing_plan", self._handle, plan.handle, int(engine_rank))

    def drain(self) -> None:
        """Blocks until every queued command was processed. Thread-safe."""
        call("shadowsync_receiver_drain", self._handle)

    def stats(self) -> ReceiverStats:
        """Counters. Thread-safe."""
        s = ReceiverStatsC()
        s.size = ctypes.sizeof(ReceiverStatsC)
        call("shadowsync_receiver_stats", self._handle, byref(s))
        return ReceiverStats(
            s.updates_ready,
            s.updates_failed,
            s.updates_superseded,
            s.bytes_received,
            s.last_accepted_version,
            s.applied_version,
            bool(s.needs_transport),
            bool(s.has_pending),
            s.stuck_aborts,
            self._failure(s),
            s.ready_version,
            s.last_transfer_ns / 1e9,
            PacingReport._from_c(s),
            s.last_swap_ns / 1e9,
            s.last_swap_started_ns / 1e9,
            s.gated_swaps,
            s.gates_abandoned,
            s.plan_pieces,
            s.plan_staging_bytes,
            s.routed_bytes,
            s.trainer_count,
            s.routing_fingerprint,
            s.routed_in_place_bytes,
        )

    def _failure(self, s: ReceiverStatsC) -> UpdateFailure | None:
        if s.last_failed_version == 0:
            return None
        group = self.layout.groups[s.last_failed_group] if s.last_failed_group >= 0 else None
        tensor = group.tensors[s.last_failed_tensor].name if group and s.last_failed_tensor >= 0 else None
        return UpdateFailure(
            s.last_failed_version,
            s.last_failure_status,
            group.name if group else None,
            s.last_failed_bucket if s.last_failed_bucket >= 0 else None,
            tensor,
        )

    def last_update_error(self) -> str:
        """The last failed update's error ("" when none failed). Thread-safe."""
        length = c_size_t()
        call("shadowsync_receiver_last_update_error", self._handle, None, 0, byref(length))
        buffer = ctypes.create_string_buffer(length.value + 1)
        call("shadowsync_receiver_last_update_error", self._handle, buffer, len(buffer), None)
        return buffer.value.decode(errors="replace")

    @property
    def applied_version(self) -> int:
        """Last version made live (0 before the first). Thread-safe."""
        v = c_uint64()
        call("shadowsync_receiver_applied_version", self._handle, byref(v))
        return v.value

    @property
    def ready_version(self) -> int:
        """commit_mode "coordinated": the update held ready for commit() (0: none); the
        statistics' ready_version without their lock, cheap enough for every step. Thread-safe."""
        v = c_uint64()
        # One atomic load: keeping the GIL costs less than giving it up and taking it back.
        call_keeping_gil("shadowsync_receiver_ready_version", self._handle, byref(v))
        return v.value

    # --- step hook (engine thread only) -------------------------------------------------------

    def before_step(self, stream: Stream | None = None) -> int | None:
        """Before each engine step: makes a received update live (every group of it at once) and
        returns its version; None when nothing was pending. Engine thread only."""
        return self._applying("shadowsync_receiver_before_step", stream, self._before_step_call)

    def after_launch(self, stream: Stream | None = None) -> int | None:
        """gated_swaps: once the step's work is enqueued and before the engine waits for its
        stream. Finishes a swap before_step gated: waits for the step before the gate, remaps,
        opens it; returns the version the step just enqueued runs on (None: nothing was made
        live). Engine thread only."""
        return self._applying("shadowsync_receiver_after_launch", stream)

    def apply_pending_now(self, stream: Stream | None = None) -> int | None:
        """For an idle engine: applies a pending update now, if any. Engine thread only."""
        return self._applying("shadowsync_receiver_apply_pending_now", stream)

    def wait_applied(self, version: int, timeout: float | None, stream: Stream | None = None) -> None:
        """Applies updates as they arrive until `version` is live. Raises ShadowsyncTimeoutError
        once `timeout` seconds passed (None: no limit). Engine thread only."""
        timeout_ms = -1 if timeout is None else max(0, int(timeout * 1000))
        try:
            call(
                "shadowsync_receiver_wait_applied",
                self._handle,
                int(version),
                timeout_ms,
                (stream or self.engine_stream).handle,
            )
        finally:
            self._raise_swap_error()

    def _applying(self, function: str, stream: Stream | None, calling=call) -> int | None:
        applied = c_uint64()
        try:
            calling(function, self._handle, (stream or self.engine_stream).handle, byref(applied))
        finally:
            self._raise_swap_error()
        return applied.value or None

    def rollback(self, stream: Stream | None = None) -> int:
        """Undoes the last swap in one swap: each group it flipped reads its previous slot again
        (the swap callback runs with those slots) and returns the version undone. applied_version
        stays; live_content_version goes back. One level, and only until the next update starts
        receiving: raises InvalidArgumentError when nothing was applied or the last swap was
        already undone (or the strategy is copy_in), SupersededError naming the update that
        started writing the previous slots; nothing changes then. Engine thread only."""
        undone = c_uint64()
        try:
            call("shadowsync_receiver_rollback", self._handle, (stream or self.engine_stream).handle, byref(undone))
        finally:
            self._raise_swap_error()
        return undone.value

    def set_swap_callback(self, callback: Callable[[int, list[GroupSwap]], None] | None) -> None:
        """`callback(version, swaps)` runs on the engine thread after a swap, inside before_step
        (or apply_pending_now / wait_applied), before it returns: rebind the engine's tensors
        there. An exception it raises is re-raised by that call. It must not call back into the
        step hook. Set before the first update; None removes it."""
        if callback is None:
            call("shadowsync_receiver_set_swap_callback", self._handle, SWAP_CALLBACK(), None)
            self._swap_callback = None
            return

        def trampoline(_user_data, version, swaps, count):
            try:
                callback(int(version), [GroupSwap(s.group, s.slot, s.content_version) for s in swaps[:count]])
            except BaseException as e:  # noqa: BLE001 - an exception cannot cross into C
                self._swap_error = e

        c_callback = SWAP_CALLBACK(trampoline)
        call("shadowsync_receiver_set_swap_callback", self._handle, c_callback, None)
        self._swap_callback = c_callback

    def _raise_swap_error(self) -> None:
        error, self._swap_error = self._swap_error, None
        if error is not None:
            raise error

    def live_pointer(self, tensor: str | TensorInfo) -> int:
        """Address of a tensor in the live slot (device memory of the backend), valid until the
        next swap. Engine thread only."""
        info = tensor if isinstance(tensor, TensorInfo) else self.layout.tensor(tensor)
        data = c_void_p()
        call("shadowsync_receiver_live_tensor", self._handle, info.group_index, info.index, byref(data))
        return data.value

    def commit(self, version: int, stream: Stream | None = None) -> int:
        """commit_mode "coordinated": makes the ready update `version` live now on the engine's
        stream; the next step runs on it. Call it between two steps on every rank with the same
        version. InvalidArgumentError in auto mode or when `version` is not the ready one (naming
        the ready and applied versions); nothing changes then. Engine thread."""
        applied = c_uint64()
        try:
            call("shadowsync_receiver_commit", self._handle,
                 (stream or self.engine_stream).handle, int(version), byref(applied))
        finally:
            self._raise_swap_error()
        return applied.value

    def discard(self, version: int) -> bool:
        """commit_mode "coordinated": drops update `version` without making it live, now if it is
        the one held ready (returns True), else as soon as its receive completes (a newer
        update's header cancels that; returns False). For tensor-parallel ranks, each between the
        same two steps, when an update is ready on some of them only: the next update then lands
        on every rank alike. InvalidArgumentError in auto mode. Thread-safe."""
        was_ready = c_int()
        call("shadowsync_receiver_discard", self._handle, int(version), byref(was_ready))
        return bool(was_ready.value)

    def use_engine_storage(self, group: str | int, addresses) -> None:
        """copy_in (or remap, for a group without an engine arena: vLLM's LoRA buffers beside
        its live arena), before the first update: the live storage of `group` becomes the
        engine's own tensors (`addresses[t]`: where tensor t of the group lives, layout order), so
        CUDA graphs captured over them keep working; a swap copies the shadow into them (one
        batched copy on the engine stream). The group's live arena is freed. Engine thread."""
        index = group if isinstance(group, int) else self.layout.group(group).index
        array = (c_void_p * max(len(addresses), 1))(*addresses)
        call("shadowsync_receiver_use_engine_storage", self._handle, index, array, len(addresses))

    def live_arena_pointer(self, group: str | int) -> int:
        """Address of a group's live arena. Engine thread only."""
        index = group if isinstance(group, int) else self.layout.group(group).index
        data = c_void_p()
        call("shadowsync_receiver_live_arena", self._handle, index, byref(data))
        return data.value

    def live_array(self, tensor: str | TensorInfo, dtype=None):
        """A numpy view of a tensor in the live slot (host backend only), valid until the next
        swap: after it the slot becomes the shadow, which the next update overwrites. `dtype`
        defaults to the numpy type of the layout's dtype (bf16 and fp8 have none: pass one, e.g.
        numpy.uint16 or ml_dtypes.bfloat16). Engine thread only."""
        if self.backend.name != "host":
            raise NotSupportedError(
                f"live_array: numpy views need the host backend, this receiver's is "
                f"'{self.backend.name}' (use live_pointer, or the torch views of shadowsync.vllm)"
            )
        info = tensor if isinstance(tensor, TensorInfo) else self.layout.tensor(tensor)
        return host_view(self.live_pointer(info), info, dtype, owner=self)

    def needed_ranges(self) -> list[WireRange]:
        """The bytes of the wire layout this receiver reads of each update, sorted and merged per
        group: with a receive plan what its copies read, without one every tensor of its layout
        (shadowsync_receiver_needed_ranges). An engine rank's needs for a RoutingPlan.
        Thread-safe."""
        ranges = call_array("shadowsync_receiver_needed_ranges", WireRangeC, self._handle)
        return [WireRange(r.group, r.begin, r.end) for r in ranges]

    def live_content_version(self, group: str | int) -> int:
        """Version of the update whose bytes the group's live slot holds (0: never updated).
        Engine thread only."""
        index = group if isinstance(group, int) else self.layout.group(group).index
        v = c_uint64()
        call("shadowsync_receiver_live_content_version", self._handle, index, byref(v))
        return v.value

    def close(self) -> None:
        """Stops the receiver thread (aborting an update in flight) and frees both slots: views
        of live tensors must not be used after this."""
        super().close()


_NUMPY_DTYPES = {
    "fp32": "float32",
    "fp16": "float16",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
}


def host_view(address: int, info: TensorInfo, dtype=None, owner=None):
    """A numpy array over `info.bytes` of host memory at `address`, shaped as `info`. `owner` is
    kept alive by the array (through its base)."""
    import numpy as np

    if dtype is None:
        if info.dtype not in _NUMPY_DTYPES:
            raise NotSupportedError(
                f"tensor '{info.name}': dtype {info.dtype} has no numpy type; pass dtype= "
                f"(e.g. numpy.uint16, or ml_dtypes.bfloat16)"
            )
        dtype = _NUMPY_DTYPES[info.dtype]
    dtype = np.dtype(dtype)
    if dtype.itemsize * _count(info.shape) != info.bytes:
        raise NotSupportedError(
            f"tensor '{info.name}': numpy dtype {dtype} ({dtype.itemsize} bytes) does not fit "
            f"layout dtype {info.dtype} ({info.bytes} bytes for shape {list(info.shape)})"
        )
    raw = (ctypes.c_uint8 * info.bytes).from_address(address)
    raw._shadowsync_owner = owner  # the memory is the owner's: keep it alive with the view
    return np.frombuffer(raw, dtype=dtype).reshape(info.shape)


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
