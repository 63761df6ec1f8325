"""The front end's calls: what the process that holds the ``vllm.LLM`` (or ``AsyncLLM``) runs to
set up its workers, make an update live and commit it, each one collective_rpc (or a few) to the
worker extension's methods, with the workers' refusals raised here."""

from __future__ import annotations

import time
import warnings
import weakref

from shadowsync.errors import InvalidArgumentError, LayoutMismatchError

from . import step_agreement, tensor_parallel
from .init_info import ShadowsyncInitInfo

__all__ = ["apply_update", "apply_update_async", "commit_update", "commit_update_async",
           "init_weight_update_group", "init_weight_update_group_async", "weight_update_needs",
           "weight_update_needs_async"]


def init_weight_update_group(llm, info: ShadowsyncInitInfo | dict | None = None, *,
                             transport=None, **fields) -> int:
    """Front end (the process that holds the ``vllm.LLM``): sets up every worker from `info` (a
    ShadowsyncInitInfo, a dict of its fields, or None) with `fields` on top, checked here once
    before any worker is called (``collective_rpc("init_weight_update_group")``, the info as
    plain data). `transport`: a ready transport object instead of the one `info` names (an
    in-process engine only: an object cannot reach another process's workers). Under tensor
    parallelism the workers return a refusal rather than raise it (a raise would end vLLM's
    engine); this raises it, as the error the refusing worker named, with its index. Returns the
    layout fingerprint (every worker's is the trainer's)."""
    return _fingerprint(llm.collective_rpc("init_weight_update_group",
                                           kwargs=_rpc_kwargs(info, transport, fields)))


async def init_weight_update_group_async(engine, info: ShadowsyncInitInfo | dict | None = None,
                                         *, transport=None, **fields) -> int:
    """init_weight_update_group for an ``AsyncLLM``."""
    return _fingerprint(await engine.collective_rpc("init_weight_update_group",
                                                    kwargs=_rpc_kwargs(info, transport, fields)))


def weight_update_needs(llm, info: ShadowsyncInitInfo | dict | None = None, **fields
                        ) -> list[list[list[int]]]:
    """Front end, a sharded trainer's first step (ShadowsyncInitInfo.trainer_ranks): every
    worker plans its receive from `info` (as init_weight_update_group would; nothing is set up)
    and says which bytes of the trainer's wire layout its parameters read. Returns them per
    engine rank (its tensor-parallel rank), ``[[group, begin, end], ...]`` each: the trainer
    ranks build their RoutingPlan with these as the engine ranks' needs, and
    init_weight_update_group takes them back as ``trainer_ranks["engine_needs"]`` with the
    plan's fingerprint. A worker's refusal is raised here, as the error it names."""
    return _needs(llm.collective_rpc("weight_update_needs",
                                     kwargs={"info": ShadowsyncInitInfo.coerce(info, **fields)
                                             .to_rpc()}))


async def weight_update_needs_async(engine, info: ShadowsyncInitInfo | dict | None = None,
                                    **fields) -> list[list[list[int]]]:
    """weight_update_needs for an ``AsyncLLM``."""
    return _needs(await engine.collective_rpc(
        "weight_update_needs", kwargs={"info": ShadowsyncInitInfo.coerce(info, **fields).to_rpc()}))


def _needs(results: list) -> list[list[list[int]]]:
    """The workers' answers to weight_update_needs: a refusal raised, else the needs in engine
    rank order (each rank once)."""
    for worker, result in enumerate(results):
        if "refused" in result:
            tensor_parallel.raise_refusal(result, f"worker {worker}: {result['refused']}")
    ranks = sorted(int(r["engine_rank"]) for r in results)
    if ranks != list(range(len(results))):
        raise InvalidArgumentError(
            f"weight_update_needs: the workers are engine ranks {ranks}, not 0..{len(results) - 1} "
            f"each once (pipeline or data parallelism is not supported with trainer_ranks)")
    return [r["needs"] for r in sorted(results, key=lambda r: int(r["engine_rank"]))]


def _rpc_kwargs(info, transport, fields: dict) -> dict:
    """The workers' init_weight_update_group arguments: the checked info as plain data, and a
    ready transport where one is given."""
    kwargs = {"info": ShadowsyncInitInfo.coerce(info, **fields).to_rpc()}
    if transport is not None:
        kwargs["transport"] = transport
    return kwargs


def _fingerprint(results: list) -> int:
    """The workers' answers to init_weight_update_group: a refusal raised, else the fingerprint."""
    refusals = [(i, r) for i, r in enumerate(results) if isinstance(r, dict)]
    if refusals:
        # The rank that refused for a reason of its own; the others say another rank refused.
        own = [(i, r) for i, r in refusals
               if "on another tensor-parallel rank" not in r["refused"]] or refusals
        worker, refusal = own[0]
        tensor_parallel.raise_refusal(refusal, f"worker {worker}: {refusal['refused']}")
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
    engine flips at the same step either way. Under tensor parallelism with commit_mode "auto"
    (the step hooks agree on the step) an RPC costs more (a round trip to every rank), and this
    reads rank 0's page of shared memory instead (step_agreement.LiveWatch), from the first poll
    that names it on: no RPC while the engine steps; only an engine that stopped stepping is
    asked."""
    import asyncio

    from shadowsync.errors import ShadowsyncTimeoutError

    _check_poll_s("apply_update_async", version, poll_s)
    version = int(version)
    started = time.monotonic()
    pending_since = None
    watch = _live_watches.get(engine)
    step_seen, stepped_at = None, started  # of rank 0, on the watch
    while True:
        now = time.monotonic()
        left = None if timeout is None else max(0.0, timeout - (now - started))  # of the timeout
        if watch is not None:
            seen = watch.read()
            if seen is None:  # the group was closed; a new one names its own page
                _live_watches.forget(engine)
                watch = None
            else:
                applied, step = seen
                if applied >= version:
                    break
                if step != step_seen:
                    step_seen, stepped_at = step, now
                if now - stepped_at < _IDLE_AFTER_S and left != 0.0:
                    await asyncio.sleep(poll_s if left is None else min(poll_s, left))
                    continue
                # Rank 0 stopped stepping (an idle engine, where an RPC costs no decode), or the
                # timeout: the workers say what they hold.
        progress = await engine.collective_rpc("update_progress")
        if any(p.get("coordinated") for p in progress):  # no step takes an update by itself
            raise InvalidArgumentError(
                f"apply_update_async({version}): the workers' commit_mode is \"coordinated\" "
                f"(tensor parallelism): an update goes live by shadowsync.vllm.commit_update, "
                f"not by waiting")
        if watch is None:
            watch = _live_watches.open(engine, progress)
        applied = min(int(p["applied_version"]) for p in progress)
        if applied >= version:
            break
        now = time.monotonic()
        left = None if timeout is None else max(0.0, timeout - (now - started))  # of the timeout
        if timeout is not None and now - started > timeout:
            # Under the step agreement an update ready on some ranks only never goes live.
            dropped = _partly_ready([int(p.get("ready_version", 0)) for p in progress], version)
            if dropped:
                _discarded(await engine.collective_rpc("discard_ready_update", args=(version,)))
            raise ShadowsyncTimeoutError(
                f"apply_update_async: version {version} not live after {timeout} s (workers' "
                f"applied versions {[p['applied_version'] for p in progress]}, an update pending "
                f"on {[p['pending'] for p in progress]}, held ready "
                f"{[p.get('ready_version', 0) or 'none' for p in progress]})"
                + (f"; {_DROPPED}" if dropped else ""))
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


class _LiveWatches:
    """The LiveWatch of each engine whose workers named one (weakly keyed by the engine)."""

    def __init__(self):
        self._by_engine = weakref.WeakKeyDictionary()

    def get(self, engine):
        try:
            return self._by_engine.get(engine)
        except TypeError:  # an engine object that takes no weak reference: none kept
            return None

    def open(self, engine, progress: list):
        """The page a worker's answer names (rank 0's under step agreement), opened and kept for
        `engine`; None where none is named or it cannot be opened."""
        reader = next((p["live_watch"] for p in progress if p.get("live_watch")), None)
        watch = step_agreement.LiveWatch.open(reader)
        if watch is not None:
            try:
                self._by_engine[engine] = watch
            except TypeError:
                pass
        return watch

    def forget(self, engine) -> None:
        watch = self._by_engine.pop(engine, None)
        if watch is not None:
            watch.close()


_live_watches = _LiveWatches()


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


def _seen_ready(ready: list[int], version: int) -> bool | None:
    """What the workers' ready_version answers allow: True, every one holds `version` ready
    (the commit may skip the ranks' agreement); False, every one answers `version` or later (a
    newer update held, or under commit_mode "auto" with tensor parallelism one the step hooks made
    live already: the commit goes ahead and the ranks agree, refusing on every rank or answering
    that it is live); None: wait."""
    if all(v == version for v in ready):
        return True
    if all(v >= version for v in ready):
        return False
    return None


def _partly_ready(ready: list[int], version: int) -> bool:
    """Some workers hold `version` ready and the others an older one or none (it failed there,
    or is late): no commit can come, and the workers that hold it would take no newer update."""
    return version in ready and any(v < version for v in ready)


# What a timeout says when the update was ready on some workers only (discard_ready_update).
_DROPPED = ("it was dropped on every worker (the late ones drop it when it completes), so the "
            "next update lands on every rank alike: send a newer one")


def _discarded(results: list) -> None:
    """The workers' answers to discard_ready_update: a refusal raised."""
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        raise InvalidArgumentError(refused[0])


def _not_ready_error(caller: str, version: int, timeout: float, ready: list[int],
                     dropped: bool):
    """commit_update's timeout: names the workers that do not hold `version` ready, and whether
    it was dropped on every worker."""
    from shadowsync.errors import ShadowsyncTimeoutError

    late = [f"worker {i}: {'none' if v == 0 else v}" for i, v in enumerate(ready) if v != version]
    return ShadowsyncTimeoutError(
        f"{caller}({version}): not ready on every worker after {timeout} s "
        f"({', '.join(late)} ready); nothing was committed" + (f"; {_DROPPED}" if dropped else ""))


def _check_poll_s(caller: str, version: int, poll_s) -> None:
    if (isinstance(poll_s, bool) or not isinstance(poll_s, (int, float))
            or not 0 < poll_s < float("inf")):
        raise InvalidArgumentError(f"{caller}({version}): poll_s must be a positive, finite "
                                   f"number of seconds, got {poll_s!r}")


def _committed(results: list) -> int:
    """The applied version after a commit_update collective_rpc; a refusal (returned by the
    workers, not raised: vLLM's TP executor ends the engine on a raise) raised here."""
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        raise InvalidArgumentError(refused[0])
    return min(int(r["applied_version"]) for r in results)


def commit_update(llm, version: int, timeout: float = 60.0, reset_prefix_cache: bool = True,
                  preempt_running: bool = False, poll_s: float = 0.02) -> int:
    """Front end, commit_mode "coordinated" (tensor parallelism): waits until every worker holds
    `version` ready (collective_rpc("ready_version"), polled every `poll_s` seconds), then
    commits it on all of them in one collective_rpc — vLLM brings it to every worker between the
    same two steps, so no step runs with two ranks on different versions, and a commit never
    waits on a receive (having seen every worker hold it ready, it spares them their own
    agreement: WorkerExtension.commit_update's `seen_ready_on_every_rank`). Then asks vLLM to
    reset its prefix cache (as apply_update, `preempt_running` too). Raises
    ShadowsyncTimeoutError naming the workers not ready after `timeout` seconds (nothing was
    committed then). Where some workers held `version` ready and others did not (it failed
    there, or is late), every worker drops it first (discard_ready_update): `version` goes live
    on every rank or on none, and the next update lands on every rank alike. Returns `version`.
    For an ``AsyncLLM``: commit_update_async.

    Each poll is an RPC that vLLM's engine thread serves between two steps, as each of
    apply_update_async's (see there for what a short `poll_s` adds to the engine stop)."""
    _check_poll_s("commit_update", version, poll_s)
    version = int(version)
    deadline = time.monotonic() + timeout
    while True:
        ready = [int(v) for v in llm.collective_rpc("ready_version")]
        seen = _seen_ready(ready, version)
        if seen is not None:
            break
        left = deadline - time.monotonic()
        if left < 0:
            dropped = _partly_ready(ready, version)
            if dropped:
                _discarded(llm.collective_rpc("discard_ready_update", args=(version,)))
            raise _not_ready_error("commit_update", version, timeout, ready, dropped)
        time.sleep(min(poll_s, left))
    applied = _committed(llm.collective_rpc("commit_update", args=(version, seen)))
    if reset_prefix_cache:
        _reset_prefix_cache(llm, version, "commit_update", preempt_running)
    return applied


async def commit_update_async(engine, version: int, timeout: float = 60.0,
                              reset_prefix_cache: bool = True, preempt_running: bool = False,
                              poll_s: float = 0.02) -> int:
    """commit_update for an ``AsyncLLM`` (see there): polls ``ready_version`` every `poll_s`
    seconds without blocking the event loop, then one ``commit_update`` collective_rpc makes
    `version` live on every worker between the same two steps."""
    import asyncio

    _check_poll_s("commit_update_async", version, poll_s)
    version = int(version)
    deadline = time.monotonic() + timeout
    while True:
        ready = [int(v) for v in await engine.collective_rpc("ready_version")]
        seen = _seen_ready(ready, version)
        if seen is not None:
            break
        left = deadline - time.monotonic()
        if left < 0:
            dropped = _partly_ready(ready, version)
            if dropped:
                _discarded(await engine.collective_rpc("discard_ready_update", args=(version,)))
            raise _not_ready_error("commit_update_async", version, timeout, ready, dropped)
        await asyncio.sleep(min(poll_s, left))
    applied = _committed(await engine.collective_rpc("commit_update", args=(version, seen)))
    if reset_prefix_cache:
        await _reset_prefix_cache_async(engine, version, "commit_update_async", preempt_running)
    return applied
