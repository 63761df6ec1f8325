"""The step-hook site: where in vLLM's step the receiver's before_step (and, with gated swaps,
after_launch) runs, installed by shadowing methods on the worker's instances and undone on
close."""

from __future__ import annotations

from shadowsync.errors import InvalidArgumentError

from . import vllm_worker
from .update_group import UpdateGroup

__all__ = ["ConnectorWithStepHook", "gated_swaps", "hook_execute_model", "step_hook_site",
           "unhook_execute_model"]


def count_request_tokens(state: UpdateGroup, scheduler_output) -> None:
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



class ConnectorWithStepHook:
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


def step_hook_site(worker) -> str:
    """Where hook_execute_model puts the step hook on this worker (its docstring says why)."""
    runner = getattr(worker, "model_runner", None)
    if runner is not None and getattr(runner, "_model_forward", None) is not None:
        return "model_runner._model_forward"
    connector = getattr(runner, "kv_connector", None) if runner is not None else None
    if callable(getattr(connector, "pre_forward", None)):
        return "model_runner.kv_connector.pre_forward"
    return "execute_model"


def gated_swaps(worker, requested: bool | None, remaps_arena: bool,
                 hooked: bool) -> bool:
    """init_weight_update_group's `gated_swaps`: whether swaps wait behind a gate on vLLM's
    stream. A gate needs a swap that only remaps (the live arena, no adapter copied beside it)
    and a step hook before the forward with a call after the step's last launch: vLLM's V2
    runner's KV connector gives both. None: on wherever that is so; False: off; True: on,
    refused where that is not so, naming why."""
    if requested is False:
        return False
    site = step_hook_site(worker) if hooked and hasattr(worker, "execute_model") else None
    why = None
    if getattr(vllm_worker.live_arena_engine(worker), "shadowsync_graph_pairs", False):
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


def hook_execute_model(worker, gated: bool = False) -> str:
    """Runs before_step() once per step, by shadowing methods on the instances (vLLM looks them up
    on the object for each step); with track_request_versions also counts each scheduled
    request's tokens under the version the step runs on.

    The step hook runs right before the step's forward, after vLLM prepared the step's inputs: a
    swap that must wait for the previous step's kernels (remap) then waits only for the GPU, and
    vLLM's input preparation still overlaps the previous step; at the start of execute_model the
    same swap also stalled that preparation. Where: vLLM's V1 model runner (the CPU's, and the
    GPU's for some models) has ``_model_forward``, its documented override point for the forward
    call; the V2 GPU runner (vLLM's default on GPUs for most models) calls its KV connector's
    ``pre_forward`` right before every forward (ConnectorWithStepHook). Without either, before
    execute_model. A step that runs no forward (nothing scheduled) swaps nothing: an idle engine
    applies an update with wait_applied. Returns where the hook runs."""
    original = worker.execute_model
    worker.__dict__["_shadowsync_original_execute_model"] = original
    runner = getattr(worker, "model_runner", None)
    forward = getattr(runner, "_model_forward", None) if runner is not None else None
    connector = getattr(runner, "kv_connector", None) if runner is not None else None
    where = step_hook_site(worker)
    pending_step = []  # this step's scheduler output, until its forward takes it
    # Gated: the version a step runs on is known once after_launch returned; its tokens are
    # counted there (or at the next step, if vLLM never called post_forward for it).
    uncounted = []

    def count_tokens(scheduler_output) -> None:
        state = worker._shadowsync
        if state is not None and state.request_versions is not None:
            count_request_tokens(state, scheduler_output)

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
        runner.kv_connector = ConnectorWithStepHook(connector, before_forward,
                                                     step_launched if gated else None)
    return where


def unhook_execute_model(worker) -> None:
    """Undoes hook_execute_model: the class's methods and the runner's own connector again."""
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
