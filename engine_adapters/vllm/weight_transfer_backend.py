"""vLLM's weight-transfer backend "shadowsync": the one way to turn shadowsync on.

    llm = vllm.LLM(model=..., weight_transfer_config={"backend": "shadowsync"})

vLLM makes its weight-transfer engine right after it loads the model, before it profiles memory
and captures CUDA graphs: the only moment the weights can still be placed where a swap costs the
engine least. With no option given, this backend chooses the fastest swap that is right for the
engine vLLM built, and says which and why (printed once per worker; ``memory_report()["swap"]``):

* **graph pairs** (graph_pairs.py): CUDA graphs on, vLLM's V2 or V1 GPU runner, no LoRA, no
  speculative decoder, no breakable graphs (V1: no micro-batching, no multimodal encoder's
  graphs). The weights sit in a remap arena whose two slots each get their own CUDA graphs; a
  swap points the parameters at the other slot and switches graph sets. With
  ``quantization="fp8"`` too (one rank, no LoRA, no padded FP8 weight): the slots hold the
  float8 bytes and the scales.
* **the live arena** (live_arena.py): CUDA graphs on where graph pairs are not possible (bf16
  engines). A swap remaps the arena's live range onto the slot the update landed in.
* **in place**: the weights stay where vLLM loaded them. On vLLM CPU (host memory cannot be
  remapped), with ``quantization="fp8"`` where graph pairs are not possible (updates are copied
  into vLLM's FP8 storage at the swap) and with ``enforce_eager`` (the worker extension rebinds
  the parameters to the live slot, which no captured graph holds on to); under CUDA graphs where
  no arena can be made, the worker extension copies each update into vLLM's own storage
  (copy_in).

The explicit backends "shadowsync_graph_pairs" and "shadowsync_live_arena" ask for one of the
first two and are refused, naming why, where it cannot work.

vLLM's own weight-transfer calls are served without a pause (PlacedWeightsEngine): code written
against vLLM's API switches by naming the backend; the trainer side is trainer_engine.py. The
worker extension's calls (shadowsync.vllm.init_weight_update_group, begin_update, apply_update)
work beside them, for what the API cannot say (pacing, readiness, rollback, statistics).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from shadowsync.errors import InvalidArgumentError, NotSupportedError
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from . import tensor_parallel
from .init_info import ShadowsyncInitInfo
from .update_info import ShadowsyncUpdateInfo
from .vllm_worker import worker_loading

__all__ = ["PlacedWeightsEngine", "ShadowsyncEngine", "choose_placement"]

# The names under which import shadowsync.vllm registers the engines with vLLM.
BACKEND_NAME = "shadowsync"
LIVE_ARENA_BACKEND_NAME = "shadowsync_live_arena"
GRAPH_PAIRS_BACKEND_NAME = "shadowsync_graph_pairs"


# What a non-last tensor-parallel rank's parse_init_info returns when the parse failed (the last
# rank raised): that rank's init_transfer_engine then does nothing.
_REFUSED_ON_THE_LAST_RANK = object()


# The calls after whose failure vLLM's worker ends the update session on the rank that raised;
# every rank ends it, so that the ranks agree on whether a session is open.
_ENDS_THE_SESSION = ("update_weights", "finish_weight_update")


def _end_session(engine, worker) -> None:
    """What vLLM's worker does on a rank whose update_weights raised, done on every rank (after
    a failed finish_weight_update too, which vLLM would leave open on the rank that raised)."""
    if hasattr(worker, "_weight_update_active"):
        worker._weight_update_active = False
    reset = getattr(engine, "reset_weight_update_target", None)  # vLLM 0.32
    if callable(reset):
        reset()


def _raised_on_the_last_rank(method):
    """vLLM's weight-transfer calls have no return value: a refusal is raised. Under tensor
    parallelism vLLM's multiprocess executor reads the workers' replies in rank order and stops
    at the first failure, leaving the later ranks' replies queued as the answers to the next
    calls. So every rank runs the call, the ranks gather what failed where, and only the last
    rank raises, naming every rank's reason; the others return normally."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if args and args[0] is _REFUSED_ON_THE_LAST_RANK:
            return None  # parse_init_info failed: raised on the last rank, nothing to do here
        worker = self._worker
        if worker is None or tensor_parallel.size(worker) == 1:
            return method(self, *args, **kwargs)
        error = None
        result = None
        try:
            result = method(self, *args, **kwargs)
        except Exception as raised:  # noqa: BLE001 - gathered, raised once below
            error = raised
        failures, rank = tensor_parallel.gathered(
            None if error is None else (type(error).__name__, str(error)))
        failed = [(r, f) for r, f in enumerate(failures) if f is not None]
        if not failed:
            return result
        if method.__name__ in _ENDS_THE_SESSION:
            _end_session(self, worker)
        if rank != len(failures) - 1:
            return _REFUSED_ON_THE_LAST_RANK if method.__name__ == "parse_init_info" else None
        if error is not None and len(failed) == len(failures) and all(
                f == failed[0][1] for _, f in failed):
            raise error  # the same refusal on every rank
        name, _ = failed[0][1]
        reasons = "; ".join(f"rank {r}: {message}" for r, (_, message) in failed)
        tensor_parallel.raise_refusal({"error": name}, f"{method.__name__} failed on "
                                      f"{len(failed)} of {len(failures)} tensor-parallel "
                                      f"ranks: {reasons}")

    return call


class PlacedWeightsEngine(WeightTransferEngine):
    """What every shadowsync weight-transfer engine is: it places vLLM's weights at load (here:
    leaves them in place) and serves vLLM's weight-transfer calls without a pause:

    * ``init_weight_transfer_engine(init_info)``: the fields of ShadowsyncInitInfo as plain data;
      sets the worker up as the worker extension's init_weight_update_group does, with
      commit_mode "coordinated" (the commit is finish_weight_update).
    * ``start_weight_update()``: opens the update; nothing moves.
    * ``update_weights(update_info)``: ShadowsyncUpdateInfo (the trainer's header) announces the
      update and returns at once: the receive runs on the library's own thread while the engine
      keeps stepping (no device synchronization, unlike vLLM's base engine).
    * ``finish_weight_update()``: waits for the update to land and be checked, then makes it live
      between two steps, on every tensor-parallel rank together.

    vLLM's worker class gets shadowsync's worker extension mixed in (as ``worker_extension_cls``
    would), so its statistics, per-request versions and rollback stay reachable through
    collective_rpc."""

    init_info_cls = ShadowsyncInitInfo
    update_info_cls = ShadowsyncUpdateInfo
    defers_processing = True  # update_weights returns before the weights landed (vLLM 0.28+)
    supports_draft_weight_update = False
    # What the worker extension looks for on vLLM's weight_transfer_engine (it imports no vLLM).
    shadowsync_live_arena = False
    shadowsync_graph_pairs = False
    # (placement, why): set by ShadowsyncEngine when it chose; memory_report()["swap"].
    swap_choice: tuple[str, str] | None = None
    memory_accounting: dict | None = None
    # The worker that loaded the model (found at load) and the update update_weights announced.
    _worker = None
    _announced: ShadowsyncUpdateInfo | None = None
    _announced_version: int | None = None

    def __init__(self, config, vllm_config, device, model) -> None:
        from .worker_extension import WorkerExtension

        super().__init__(config, vllm_config, device, model)
        self._worker = worker_loading(model)
        if self._worker is not None and not isinstance(self._worker, WorkerExtension):
            _mix_in(type(self._worker), WorkerExtension)

    @_raised_on_the_last_rank
    def parse_init_info(self, init_dict: dict[str, Any]) -> ShadowsyncInitInfo:
        return ShadowsyncInitInfo.coerce(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> ShadowsyncUpdateInfo:
        return ShadowsyncUpdateInfo.coerce(update_dict)

    @_raised_on_the_last_rank
    def init_transfer_engine(self, init_info: ShadowsyncInitInfo) -> None:
        if init_info.commit_mode == "auto":
            raise InvalidArgumentError(
                "init_weight_transfer_engine: commit_mode 'auto' would make an update live at "
                "the next step, before finish_weight_update; through vLLM's weight-transfer API "
                "finish_weight_update is the commit: leave commit_mode unset")
        worker = self._loading_worker()
        if worker.has_weight_update_group():
            worker.close_weight_update_group()  # a trainer joining again replaces the last
        # The commit is finish_weight_update, which holds the engine between two steps while it
        # runs. With offer_after_clean_step (the default) and the trainer's checksums (its
        # default), the receiver takes the update's last broadcast, the checksum block, only
        # after a step no bucket slowed: the trainer's send returns after that step, and a
        # finish_weight_update called then swaps at a clean step rather than in the step the
        # last bucket slowed.
        info = ShadowsyncInitInfo.coerce(init_info, commit_mode="coordinated")
        _raise_refusal("init_weight_transfer_engine", worker.init_weight_update_group(info))

    def start_weight_update(self) -> None:
        # Never raises: vLLM's worker marks the session open on the ranks that returned, so a
        # refusal here would leave the ranks disagreeing. update_weights refuses instead.
        self._announced = self._announced_version = None

    @_raised_on_the_last_rank
    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Not vLLM's base update_weights: that synchronizes the device after the receive, which
        # here runs on in the background.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShadowsyncUpdateInfo) -> None:
        if self._announced is not None:
            raise InvalidArgumentError(
                f"update_weights: update {self._announced_version} was announced in this "
                f"start_weight_update already; one header holds a whole update: call "
                f"finish_weight_update, then start the next")
        worker = self._loading_worker()
        self._announced_version = worker.begin_update(update_info.header,
                                                      update_info.verify_matches_live)
        self._announced = update_info

    @_raised_on_the_last_rank
    def finish_weight_update(self) -> None:
        announced, version = self._announced, self._announced_version
        self._announced = self._announced_version = None
        if announced is None:
            raise InvalidArgumentError(
                "finish_weight_update: no update_weights since start_weight_update; send the "
                "trainer's header with update_weights first")
        worker = self._loading_worker()
        started = time.monotonic()
        _wait_ready(worker, version, announced.finish_timeout_s)
        # The engine thread's wait for the update, as wait_applied's (weight_update_stats).
        worker._require().last_wait_applied = (started, time.monotonic() - started)
        # Every rank commits (or refuses) together: commit_update checks readiness across the
        # tensor-parallel group first.
        result = worker.commit_update(version)
        why = worker._require().receiver.last_update_error()
        if "refused" in result and why:  # the update failed here: say why, not only "not ready"
            result["refused"] += f"; this rank's last failed update: {why}"
        _raise_refusal("finish_weight_update", result)

    @_raised_on_the_last_rank
    def drain_pending(self) -> None:
        # vLLM 0.28+: a caller that finishes an update itself (its own layerwise reload) calls
        # this expecting the weights in the model; here an update goes live only in
        # finish_weight_update, between two steps on every rank together.
        if self._announced is not None:
            raise InvalidArgumentError(
                f"drain_pending: update {self._announced_version} is received in the background "
                f"and goes live only in finish_weight_update (between two steps, on every rank "
                f"together); there is no layerwise reload to finish: call finish_weight_update")

    def shutdown(self) -> None:
        # Releases the trainer's connection (vLLM's shutdown_weight_transfer_engine, and at
        # exit); the weights stay usable. An arena lives as long as the model reads it.
        worker = self._worker
        if worker is not None and getattr(worker, "_shadowsync", None) is not None:
            worker.close_weight_update_group()

    def _loading_worker(self):
        """The worker (its class has shadowsync's worker extension: mixed in at load)."""
        if self._worker is None:
            raise InvalidArgumentError(
                f"{type(self).__name__}: the vLLM worker that loaded the model was not found "
                f"among the callers at load; use the worker extension "
                f"(worker_extension_cls=\"shadowsync.vllm.WorkerExtension\") and its calls")
        return self._worker

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """vLLM 0.25's trainer side (a static method of the worker engine's class):
        trainer_engine.send_weights_025 sends `iterator`'s tensors with the shadowsync Sender in
        `trainer_args`."""
        from .trainer_engine import send_weights_025

        send_weights_025(iterator, trainer_args)


def _mix_in(worker_class, extension) -> None:
    """`extension`'s methods added to `worker_class`, as vLLM does for ``worker_extension_cls``
    (a name both define is refused, naming it)."""
    clashes = sorted(a for a in vars(extension) if not a.startswith("__")
                     and hasattr(worker_class, a))
    if clashes:
        raise InvalidArgumentError(
            f"the shadowsync weight-transfer backend: vLLM's worker class "
            f"{worker_class.__name__} already has {clashes}, which shadowsync's worker "
            f"extension defines; pass worker_extension_cls=\"shadowsync.vllm.WorkerExtension\"")
    worker_class.__bases__ = worker_class.__bases__ + (extension,)


def _wait_ready(worker, version: int, timeout_s: float) -> None:
    """Until this worker holds `version` received and checked, or it failed, or `timeout_s`
    passed: finish_weight_update's commit then goes ahead or refuses on every rank together."""
    receiver = worker._require().receiver
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = receiver.stats()
        failed = stats.last_failure is not None and stats.last_failure.version == version
        if stats.ready_version == version or failed:
            return
        time.sleep(0.0005)


def _raise_refusal(call: str, result) -> None:
    """A refusal the worker extension returned (under tensor parallelism it returns them: a raise
    there ends vLLM's engine), raised: the weight-transfer API has no other way to say it."""
    if isinstance(result, dict) and "refused" in result:
        tensor_parallel.raise_refusal(result, f"{call}: {result['refused']}")


class ShadowsyncEngine(PlacedWeightsEngine):
    """vLLM's weight-transfer engine "shadowsync": makes the engine choose_placement chose (a
    GraphPairsEngine, a LiveArenaEngine or this class itself, weights in place)."""

    def __new__(cls, config, vllm_config, device, model):
        from .live_arena import GraphPairsEngine, LiveArenaEngine

        placement, why = choose_placement(vllm_config, device, model)
        engine = None
        if placement in ("graph pairs", "live arena"):
            engine_cls = GraphPairsEngine if placement == "graph pairs" else LiveArenaEngine
            try:
                engine = engine_cls(config, vllm_config, device, model)
            except NotSupportedError as error:  # refused before any weight moved
                placement, why = "in place", (f"no remap arena can be made here ({error}): each "
                                              f"update is copied into vLLM's own storage "
                                              f"(copy_in)")
        if engine is None:
            engine = super().__new__(cls)
            PlacedWeightsEngine.__init__(engine, config, vllm_config, device, model)
        engine.swap_choice = (placement, why)
        print(f"[shadowsync] weight-transfer backend '{BACKEND_NAME}': {placement}, because "
              f"{why}", flush=True)
        return engine

    def __init__(self, *args, **kwargs) -> None:
        pass  # __new__ made the engine it returns


def choose_placement(vllm_config, device, model) -> tuple[str, str]:
    """("graph pairs" | "live arena" | "in place", why) for the engine vLLM built."""
    from .graph_pairs import why_unswitchable
    from .vllm_worker import runner_loading

    if getattr(device, "type", str(device)) != "cuda":
        return "in place", ("the weights are in host memory (vLLM CPU), which cannot be remapped: "
                            "a swap rebinds the parameters or copies into them")
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enforce_eager", False):
        return "in place", ("vLLM runs eagerly (enforce_eager=True): a swap rebinds the "
                            "parameters to the new slot, which no captured CUDA graph holds on to")
    parallel = getattr(vllm_config, "parallel_config", None)
    ranks = (int(getattr(parallel, "tensor_parallel_size", 1) or 1)
             * int(getattr(parallel, "pipeline_parallel_size", 1) or 1))
    fp8 = getattr(model_config, "quantization", None) == "fp8"
    if fp8:
        why_not = fp8_why_not_graph_pairs(
            model, ranks, getattr(vllm_config, "lora_config", None) is not None)
        if why_not is not None:
            return "in place", (f'vLLM quantizes the weights to FP8 while loading (quantization='
                                f'"fp8") and {why_not}: the receiver quantizes each update in the '
                                f'shadow and the swap copies it into vLLM\'s own storage '
                                f'(copy_in)')
    if ranks > 1:
        return "in place", (f"vLLM runs {ranks} ranks: under tensor or pipeline parallelism "
                            f"updates are shown copied into vLLM's own storage (copy_in); name "
                            f"the backend 'shadowsync_graph_pairs' or 'shadowsync_live_arena' to "
                            f"use those, which are not shown there")
    if getattr(vllm_config, "lora_config", None) is not None:
        return "live arena", ("LoRA is on: an adapter is copied into vLLM's LoRA buffers at the "
                              "swap, which graph pairs cannot do beside a rebind")
    runner = runner_loading(model, depth=12)
    why = why_unswitchable(runner) if runner is not None else (
        "vLLM's model runner was not found among the callers")
    if why is not None and fp8:
        return "in place", (f'vLLM quantizes the weights to FP8 while loading (quantization='
                            f'"fp8") and graph pairs are not possible here ({why}); the live '
                            f'arena has not been shown with FP8 weights: the swap copies each '
                            f'update into vLLM\'s own storage (copy_in)')
    if why is not None:
        return "live arena", f"graph pairs are not possible here: {why}"
    return "graph pairs", ("CUDA graphs are on and vLLM's runner can switch graph sets: a swap "
                           "rebinds the parameters (FP8 weights and scales included) and "
                           "switches sets, nothing is copied or remapped")


def fp8_why_not_graph_pairs(model, ranks: int, lora: bool) -> str | None:
    """Why graph pairs cannot hold this FP8 engine's weights (then they stay in place), or
    None. The set-up refuses FP8 with several ranks or LoRA anyway, naming why."""
    from shadowsync.errors import LayoutMismatchError

    from .online_fp8 import online_fp8_weights, padded

    if ranks > 1:
        return f"runs {ranks} ranks (an FP8 engine takes updates on one rank)"
    if lora:
        return "serves LoRA adapters"
    try:
        weights = online_fp8_weights(model) if model is not None else {}
    except LayoutMismatchError as error:  # init_weight_update_group refuses it, naming why
        return f"its FP8 layers are not served ({str(error).removesuffix(' Nothing was set up')})"
    if not weights:
        return ("no layer was quantized while loading (a checkpoint already in FP8 is not "
                "served; init_weight_update_group refuses it)")
    held_padded = padded(weights)
    if held_padded:
        return (f"vLLM's kernel holds {len(held_padded)} FP8 weight(s) padded (first "
                f"'{held_padded[0]}'), which graph pairs cannot swap")
    return None
