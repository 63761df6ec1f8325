"""The worker extension: the methods vLLM mixes into its worker class, which the trainer's side
calls by name through ``collective_rpc``.

    llm = vllm.LLM(model=..., worker_extension_cls="shadowsync.vllm.WorkerExtension")

* ``weight_update_needs(info)``: a sharded trainer's first question (trainer_ranks.py): the wire
  bytes this worker's parameters read, planned as the set-up plans, nothing set up.
* ``init_weight_update_group(info)``: once (set_up.py). Builds the layout from the model's
  parameters (checked against the trainer's specs), allocates the shadow, joins the transport and
  installs the step hook (step_hook_site.py).
* ``begin_update(header_bytes)``: once per update, returns at once. The receive runs on the
  library's native receiver thread, never a Python thread, while the engine keeps generating.
* ``before_step()``: the step hook, before every forward: with nothing pending it is one call into
  C and one atomic load; when an update landed it makes it live (update_group.py).
* ``wait_applied(version, timeout)``: for an idle engine, applies the update without a step.
* readiness, commit, statistics and close: the rest of the methods below.

Neither vllm nor torch is imported at import time; torch is imported only when the parameters are
torch tensors. The same methods work on any object that has ``model_runner.model`` (or ``model``)
with ``named_parameters()`` and an ``execute_model`` method, which is how the CPU tests drive it
with numpy "parameters" on the host backend.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable

from shadowsync.errors import BadHeaderError, InvalidArgumentError
from shadowsync.layout import UpdateHeader
from shadowsync.receive_plan import needed_ranges
from shadowsync.transport import Transport

from . import step_hook_site, tensor_parallel, trainer_ranks, vllm_worker
from .init_info import ShadowsyncInitInfo
from .rpc_bytes import bytes_from_rpc
from .set_up import plan_update_group, set_up_update_group
from .update_group import UpdateGroup, param_data

__all__ = ["WorkerExtension"]


class WorkerExtension:
    """Mixed into a vLLM worker (``worker_extension_cls``); see the module's doc."""

    _shadowsync: UpdateGroup | None = None

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

    @tensor_parallel.all_ranks_or_none
    def init_weight_update_group(self, info: ShadowsyncInitInfo | dict | None = None, *,
                                 transport: Transport | None = None,
                                 _agree: Callable[[], None] = lambda: None, **fields) -> int:
        """Sets up the weight update group from `info` (a ShadowsyncInitInfo, or a dict of its
        fields as shadowsync.vllm.init_weight_update_group sends it) with `fields` on top;
        returns the layout fingerprint (the trainer compares it with its own). `transport`: a
        ready one (a Loopback rank in tests) instead of the one `info` names. Engine thread,
        before stepping; once (close_weight_update_group first to set up again).

        With NCCL it blocks until every rank joined, so the trainer must create its own
        transport concurrently. Under tensor parallelism a refusal is returned, not raised
        (vLLM's multiprocess executor ends the engine when a worker raises in a collective_rpc):
        every rank returns ``{"refused": message, "error": class name}`` and none is set up
        (tensor_parallel.py); shadowsync.vllm.init_weight_update_group raises it on the front
        end."""
        if self._shadowsync is not None:
            raise InvalidArgumentError(
                f"init_weight_update_group: already initialized (layout "
                f"{self._shadowsync.wire_fingerprint:#018x}); close_weight_update_group first"
            )
        info = ShadowsyncInitInfo.coerce(info, **fields)
        return set_up_update_group(self, info, transport, _agree).wire_fingerprint

    def weight_update_needs(self, info: ShadowsyncInitInfo | dict | None = None, **fields
                            ) -> dict:
        """A sharded trainer's first question (ShadowsyncInitInfo.trainer_ranks,
        trainer_ranks.py): which bytes of the trainer's wire layout this worker's parameters
        read. Plans the receive from `info` as init_weight_update_group would (the same trace and
        checks), sets nothing up and connects nothing; returns ``{"engine_rank": its
        tensor-parallel rank, "needs": [[group, begin, end], ...]}`` (wire byte ranges, sorted and
        merged per group), which the trainer ranks' routing plan takes as this engine rank's
        needs and init_weight_update_group's ``trainer_ranks["engine_needs"]`` carries back.
        Under tensor parallelism a refusal is returned as ``{"refused": message, "error": class
        name}`` (a raise would end vLLM's engine). Engine thread (a collective_rpc)."""
        try:
            planned = plan_update_group(self, ShadowsyncInitInfo.coerce(info, **fields))
            needs = needed_ranges(planned.layout, planned.plan)
            return {"engine_rank": tensor_parallel.rank(self),
                    "needs": trainer_ranks.needs_data(needs)}
        except Exception as error:  # noqa: BLE001 - returned under TP: a raise ends vLLM's engine
            if tensor_parallel.size(self) == 1:
                raise
            return {"refused": getattr(error, "detail", str(error)),
                    "error": type(error).__name__}

    def has_weight_update_group(self) -> bool:
        """Whether init_weight_update_group set this worker up (and it was not closed since)."""
        return self._shadowsync is not None

    def begin_update(self, header_bytes: bytes | str | list, verify_matches_live: bool = False
                     ) -> int:
        """Announces an update: validates the header (BadHeaderError, LayoutMismatchError,
        StaleVersionError, ... naming the field and both values; nothing changes then), queues it
        and returns its version at once. The receive runs on the library's native thread.
        Thread-safe. `header_bytes`: the trainer's PublishHandle.header_bytes, or, where the RPC
        carries JSON, its header_base64 (a str) or the bytes as a list of ints.

        `verify_matches_live`: the self-check, for an update of the checkpoint the engine holds
        (at set-up, say): once it landed, every parameter it wrote is compared with the engine's
        own bytes, and the first that differs fails it (nothing goes live; apply_update raises,
        naming the parameter and its first differing element). It proves that the receive plan
        writes every byte where this engine reads it."""
        state = self._require()
        started = time.monotonic()
        header_bytes = _header_bytes(header_bytes)
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
        applied = state.receiver.before_step()  # never swaps under step agreement (coordinated)
        if state.step_agreement is not None:
            return state.commit_at_agreed_step()
        return applied

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
            if state.step_agreement is not None:
                self._commit_when_ready(state, int(version), timeout, started)
            else:
                state.receiver.wait_applied(version, timeout)
        finally:
            state.last_wait_applied = (started, time.monotonic() - started)
        return state.receiver.applied_version

    def _commit_when_ready(self, state, version: int, timeout: float | None,
                           started: float) -> None:
        """wait_applied under step agreement (an idle engine: no step hook runs). Every rank runs
        it between the same two steps, so the ranks go in rounds, each one all-gather of what
        every rank holds: the update every rank holds ready goes live on all of them (an older
        one first, if it was held before `version` arrived), until `version` is live. An update
        that failed on a rank at or before `version`, or rank 0's clock past `timeout`, ends it
        on every rank with the same error."""
        from shadowsync.errors import ShadowsyncTimeoutError

        while state.receiver.applied_version < version:
            stats = state.receiver.stats()
            failure = stats.last_failure
            failed = (failure is not None
                      and stats.applied_version < failure.version <= version)
            answers, _ = tensor_parallel.gathered(
                (stats.ready_version, failure.version if failed else 0,
                 state.receiver.last_update_error() if failed else "",
                 time.monotonic() - started))
            held = {answer[0] for answer in answers}
            if len(held) == 1 and 0 not in held:
                ready = held.pop()
                state.committed(state.receiver.commit(ready))  # every rank, between two steps
                continue
            failed_on = [(rank, answer) for rank, answer in enumerate(answers) if answer[1]]
            if failed_on:  # the ranks cannot come to hold one version up to `version`
                rank, (_, failed_version, error, _) = failed_on[0]
                state.discard_up_to(version)  # every rank, in this round: none keeps a part
                raise ShadowsyncTimeoutError(
                    f"wait_applied({version}): update {failed_version} failed on "
                    f"tensor-parallel rank {rank} ({error}); the ranks held "
                    f"{[a[0] or 'none' for a in answers]} ready and dropped it, so the next "
                    f"update lands on every rank alike; send a new one")
            if timeout is not None and answers[0][3] > timeout:  # rank 0's clock: all agree
                raise ShadowsyncTimeoutError(
                    f"wait_applied({version}): not live after {timeout} s; the ranks hold "
                    f"{[a[0] or 'none' for a in answers]} ready (applied "
                    f"{state.receiver.applied_version})")
            time.sleep(0.002)  # an idle engine: the receive is still running

    def discard_ready_update(self, version: int) -> dict:
        """Tensor parallelism: drops the update this worker holds ready if it is `version` or
        older, without making it live, and `version` itself if its receive completes later
        (Receiver.discard). Through collective_rpc every worker does it between the same two
        steps: what shadowsync.vllm.commit_update does when an update is ready on some ranks only
        (it failed, or is late, on the others), so that the next update lands on every rank
        alike. Returns ``{"discarded": the version dropped now (0: none), "applied_version":
        v}``, or ``{"refused": ...}`` where no update is held for a commit (one GPU, or
        commit_mode "auto" without tensor parallelism). Engine thread."""
        state = self._require()
        if not state.coordinated and state.step_agreement is None:
            return {"refused": f"discard_ready_update({version}): this worker holds no update "
                               f"for a commit (commit_mode \"auto\" on one rank: an update goes "
                               f"live at the next step)", "error": "InvalidArgumentError",
                    "applied_version": state.receiver.applied_version}
        return {"discarded": state.discard_up_to(int(version)),
                "applied_version": state.receiver.applied_version}

    def update_progress(self) -> dict:
        """``{"applied_version": v, "pending": whether a received update waits for a step,
        "coordinated": commit_mode "coordinated", "ready_version": the update held for a
        commit (0: none)}``: what apply_update_async polls. Under step agreement rank 0 adds
        ``"live_watch"``: where the front end can read the version live without asking
        (step_agreement.LiveWatch). Swaps nothing; thread-safe."""
        state = self._require()
        stats = state.receiver.stats()
        agreement = state.step_agreement
        pending = stats.has_pending or (agreement is not None and stats.ready_version != 0)
        progress = {"applied_version": stats.applied_version, "pending": pending,
                    "coordinated": state.coordinated, "ready_version": stats.ready_version}
        if agreement is not None and agreement.rank == 0:
            progress["live_watch"] = agreement.reader()
        return progress

    def ready_version(self) -> int:
        """commit_mode "coordinated": the update this worker received, checked and holds ready
        for commit_update (0: none). Under step agreement (commit_mode "auto" with tensor
        parallelism), when it holds none, the applied version: an update the step hooks made
        live counts as ready, so commit_update of it returns at once. Thread-safe."""
        state = self._require()
        ready = state.receiver.ready_version
        if ready == 0 and state.step_agreement is not None:
            return state.receiver.applied_version
        return ready

    def commit_update(self, version: int, seen_ready_on_every_rank: bool = False) -> dict:
        """commit_mode "coordinated": makes the ready update `version` live now; the next step
        runs on it. Through collective_rpc every worker makes it between the same two steps.
        Returns ``{"applied_version": v}``, or ``{"refused": message, "error":
        "InvalidArgumentError", "applied_version": v}``
        when `version` is not ready on every tensor-parallel rank (checked across the TP group
        first: then no rank flips) or on this one. Under step agreement a version the step hooks
        made live already is answered as committed. A refusal is returned, not raised: vLLM's
        multiprocess executor ends the engine when a worker raises in a collective_rpc.
        shadowsync.vllm.commit_update raises it on the front end. Engine thread.

        `seen_ready_on_every_rank`: the caller saw every worker's ready_version equal `version`
        (shadowsync.vllm.commit_update does, right before), so the ranks need not agree again:
        a ready update stays ready until a commit or a close takes it, and both reach every rank
        alike (a newer update waits for the commit, receiver_thread.cpp), so every rank finds
        the same answer. The agreement is an all-reduce over vLLM's TP CPU group, in the gap
        between two steps. Taken only as True itself, and only where the front end hears every
        worker (tensor_parallel.front_end_hears_every_worker); else the ranks agree."""
        state = self._require()
        if state.step_agreement is not None and state.receiver.applied_version >= int(version):
            # The step hooks made it live, on every rank at one step: every rank answers so.
            return {"applied_version": state.receiver.applied_version}
        started = time.monotonic()
        seen = seen_ready_on_every_rank is True and tensor_parallel.front_end_hears_every_worker(self)
        try:
            return self._commit(state, int(version), started, seen)
        finally:
            state.last_commit = (started, time.monotonic() - started)

    def _commit(self, state, version: int, started: float, seen_ready: bool) -> dict:
        """commit_update's work, timed by it."""
        ready = state.receiver.ready_version
        on_every_rank = (seen_ready or tensor_parallel.size(self) == 1
                         or tensor_parallel.on_every_rank(ready == version))
        state.last_commit_check_s = time.monotonic() - started
        if not on_every_rank:
            return {"error": "InvalidArgumentError",
                    "refused": f"commit_update({version}): not ready on every tensor-parallel "
                               f"rank (this rank holds {ready or 'none'} ready, applied "
                               f"{state.receiver.applied_version}); nothing was committed on any "
                               f"rank",
                    "applied_version": state.receiver.applied_version}
        try:
            applied = state.receiver.commit(version)
        except InvalidArgumentError as error:
            return {"error": "InvalidArgumentError", "refused": str(error),
                    "applied_version": state.receiver.applied_version}
        state.committed(applied)
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
        a budget or a cap; ``"clean_step_wait_s"`` and ``"clean_step_missed"`` are filled with
        offer_after_clean_step, the default, paced or not), and what the engine thread spent on the last update, in seconds, with
        when it started on time.monotonic's clock: its swap (``"last_swap_s"``,
        ``"last_swap_started_s"``), begin_update (``"last_begin_update_s"``, ``..._started_s``)
        and wait_applied (``"last_wait_applied_s"``, ``..._started_s``), commit_update
        (``"last_commit_s"``, ``..._started_s``, and of it ``"last_commit_check_s"``: the ranks'
        agreement); and where the step hook runs (``"step_hook_at"``). Under commit_mode
        "auto" with tensor parallelism (``"step_agreement"`` True): ``"agreed_commits"``, the
        updates the step hooks made live, and ``"agreement_wait_s"``, a follower's longest wait
        for rank 0's decision. Fed by a sharded trainer (trainer_ranks): ``"routed_bytes"``
        (the bytes the last ready update's routes brought to this rank: its own parameters'),
        ``"routed_in_place_bytes"`` (of those, the bytes read where the trainer ranks' shards
        lie: GPU memory of the trainer processes, nothing packed on their side),
        ``"trainer_count"`` and ``"routing_fingerprint"``; 0 otherwise. Thread-safe."""
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
        stats["last_commit_started_s"], stats["last_commit_s"] = state.last_commit
        stats["last_commit_check_s"] = state.last_commit_check_s  # of last_commit_s: the ranks'
        # agreement that every one holds the version ready (an all-reduce under TP)
        agreement = state.step_agreement
        stats["step_agreement"] = agreement is not None  # commit_mode "auto" under TP
        stats["agreed_commits"] = state.agreed_commits  # updates its step hooks made live
        stats["agreement_wait_s"] = agreement.waited_s if agreement is not None else 0.0
        return stats

    def memory_report(self) -> dict:
        """Where the weights were placed and what vLLM sized its KV cache with, as plain data (no
        update group needed): ``"swap"`` (``{"placement", "why"}``: what the "shadowsync"
        weight-transfer backend chose at load, weight_transfer_backend.py; None without it),
        ``"kv_cache_bytes"`` (the worker's available KV-cache memory, None before vLLM sized it
        or where the worker does not say) and ``"live_arena"`` (None without a live arena; else
        its slot's bytes (it has two), the torch memory moving into it freed, and vLLM's
        ``model_memory_usage`` before and after the engine counted the weights once, and under
        graph pairs ``"graph_sets_bytes"``, what vLLM's two graph captures took)."""
        engine = vllm_worker.live_arena_engine(self)
        choice = getattr(getattr(self, "weight_transfer_engine", None), "swap_choice", None)
        kv = getattr(self, "available_kv_cache_memory_bytes", None)
        arena = None if engine is None else dict(engine.memory_accounting)
        if arena is not None and getattr(engine, "graph_sets", None) is not None:
            arena["graph_sets_bytes"] = int(engine.graph_sets.graph_bytes)
        return {"swap": None if choice is None else {"placement": choice[0], "why": choice[1]},
                "kv_cache_bytes": None if kv is None else int(kv), "live_arena": arena}

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
                    data = param_data(param)
                    param.data = data.copy() if state.kind == "numpy" else data.clone()
            step_hook_site.unhook_execute_model(self)
            state.receiver.close()
            if state.step_agreement is not None:
                state.step_agreement.close()
            if state.graph_pairs is not None:
                state.graph_pairs.settle()

    def _require(self) -> UpdateGroup:
        if self._shadowsync is None:
            raise InvalidArgumentError(
                "the weight update group is not initialized: call init_weight_update_group first"
            )
        return self._shadowsync



def _header_bytes(header) -> bytes:
    """An update header as an RPC carried it (rpc_bytes.bytes_from_rpc), else BadHeaderError."""
    try:
        return bytes_from_rpc(header)
    except (TypeError, ValueError):
        what = (f"a str of {len(header)} characters that is not base64" if isinstance(header, str)
                else f"a {type(header).__name__}")
        raise BadHeaderError(
            f"begin_update: the header is {what}; send the trainer's PublishHandle.header_bytes, "
            f"its header_base64 or the bytes as a list of ints (0-255)") from None
