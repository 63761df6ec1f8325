"""shadowsync.vllm.WorkerExtension on a tiny fake vLLM worker whose "parameters" are numpy arrays
held in objects with a settable .data (as torch parameters), on the host backend. The trainer is a
Sender on rank 0 of a loopback world; the worker is rank 1."""

import contextlib
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np

import pytest
from support import BASE, DEADLINE_S, LORA, SPECS, pattern, tensors, version_of

import shadowsync as ss
from shadowsync.vllm import WorkerExtension


class Param:
    def __init__(self, data):
        self.data = data


class FakeModel:
    def __init__(self, version):
        self.params = [(s[0], Param(pattern(s[0], version))) for s in SPECS]

    def named_parameters(self):
        return iter(self.params)


class FakeWorker(WorkerExtension):
    """What vLLM's worker looks like to the extension: model_runner.model and execute_model."""

    def __init__(self):
        self.model_runner = SimpleNamespace(model=FakeModel(version=0))
        self.steps = []  # per step: the set of versions its reads saw

    def execute_model(self, batch):
        seen = {version_of(name, p.data) for name, p in self.model_runner.model.params}
        self.steps.append(seen)
        return f"output of {batch}"


class _ForwardRunner(SimpleNamespace):
    """vLLM's model runner as far as the hook cares: execute_model prepares the step's inputs,
    then calls _model_forward, which reads the weights."""

    def _model_forward(self, batch):
        self.events.append(("forward", batch))
        return {version_of(name, p.data) for name, p in self.model.params}


class ForwardHookWorker(FakeWorker):
    """A worker whose runner has vLLM's _model_forward: the step hook must run right before it,
    after the inputs were prepared, and a step without a forward swaps nothing."""

    def __init__(self):
        super().__init__()
        self.model_runner = _ForwardRunner(model=FakeModel(version=0), events=[])

    def execute_model(self, batch):
        self.model_runner.events.append(("prepare inputs", batch))
        if batch == "nothing scheduled":
            return None
        seen = self.model_runner._model_forward(batch)
        self.steps.append(seen)
        return f"output of {batch}"


class _NoOpConnector:
    """vLLM's shared no-op KV connector: the hook must not change it."""

    def pre_forward(self, scheduler_output):
        return None

    def set_disabled(self, disabled):
        self.disabled = disabled


SHARED_NO_OP_CONNECTOR = _NoOpConnector()


class _ConnectorRunner(SimpleNamespace):
    """vLLM's V2 GPU model runner as far as the hook cares: no _model_forward; execute_model
    prepares the inputs, calls kv_connector.pre_forward, then runs the forward."""

    def forward(self, batch):
        self.events.append(("forward", batch))
        return {version_of(name, p.data) for name, p in self.model.params}


class ConnectorHookWorker(FakeWorker):
    def __init__(self):
        super().__init__()
        self.model_runner = _ConnectorRunner(model=FakeModel(version=0), events=[],
                                             kv_connector=SHARED_NO_OP_CONNECTOR)

    def execute_model(self, batch):
        runner = self.model_runner
        runner.events.append(("prepare inputs", batch))
        if batch == "nothing scheduled":
            return None
        runner.kv_connector.pre_forward(batch)
        seen = runner.forward(batch)
        self.steps.append(seen)
        return f"output of {batch}"


def _trainer(specs, rank0):
    layout = ss.Layout(specs, bucket_bytes=1024)
    return layout, ss.Sender(layout, ss.HostBackend(), rank0,
                             ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)))


@pytest.fixture
def setup():
    loopback = ss.Loopback(2)
    worker = FakeWorker()
    params_before = {n: p.data for n, p in worker.model_runner.model.params}
    threads_before = threading.active_count()
    layout, sender = _trainer(SPECS, loopback.transport(0))
    # What the trainer sends through collective_rpc: plain data.
    fingerprint = worker.init_weight_update_group(specs=[tuple(vars(s).values()) for s in layout.specs],
                                                  bucket_bytes=1024, transport=loopback.transport(1))
    assert fingerprint == layout.fingerprint
    yield SimpleNamespace(worker=worker, sender=sender, layout=layout, params_before=params_before,
                          threads_before=threads_before)
    worker.close_weight_update_group()
    sender.close()


def _step_until(worker, version):
    deadline = time.monotonic() + DEADLINE_S
    while worker.steps[-1:] != [{version}]:
        assert time.monotonic() < deadline, f"version {version} not seen; last steps {worker.steps[-3:]}"
        worker.execute_model("batch")


def test_worker_takes_updates_between_steps(setup):
    worker, sender = setup.worker, setup.sender
    # Adopted: the parameters now live in the receiver's live slot, values unchanged.
    for name, param in worker.model_runner.model.params:
        assert param.data is not setup.params_before[name]
        np.testing.assert_array_equal(param.data, setup.params_before[name])
        assert param.data.ctypes.data == worker._shadowsync.receiver.live_pointer(name)
    assert worker.execute_model("b0") == "output of b0"  # the hooked method passes through
    assert worker.steps == [{0}]

    handle = sender.publish(1, tensors(BASE + LORA, 1))
    assert worker.begin_update(handle.header_bytes) == 1  # returns at once
    _step_until(worker, 1)
    handle.wait(DEADLINE_S)
    # Never a torn step: one version per step, and a whole one (-1: torn or foreign bytes).
    assert all(len(seen) == 1 and -1 not in seen for seen in worker.steps), worker.steps
    # The receive ran on the library's native thread: no Python thread was started.
    assert threading.active_count() == setup.threads_before

    # A LoRA-only update: the base parameters keep their binding and values.
    base_binding = {n: p.data for n, p in worker.model_runner.model.params if n in BASE}
    handle = sender.publish(2, tensors(LORA, 2))
    worker.begin_update(handle.header_bytes)
    before = time.monotonic()
    assert worker.wait_applied(2, DEADLINE_S) == 2  # an idle engine, without a step
    after = time.monotonic()
    params = dict(worker.model_runner.model.params)
    assert all(params[n].data is base_binding[n] for n in BASE)
    assert [version_of(n, params[n].data) for n in BASE + LORA] == [1, 1, 1, 2, 2]
    stats = worker.weight_update_stats()
    assert (stats["applied_version"], stats["updates_ready"], stats["last_update_error"]) == (2, 2, "")
    assert stats["last_transfer_s"] > 0 and stats["pacing"]["paced"] is False  # no budget
    # The engine thread's time on update 2: its swap happened inside wait_applied, on the clock
    # of time.monotonic.
    assert 0 < stats["last_wait_applied_s"] <= after - before, stats
    assert before <= stats["last_swap_started_s"] <= after, (before, stats, after)
    assert 0 < stats["last_swap_s"] <= stats["last_wait_applied_s"], stats
    assert before <= stats["last_wait_applied_started_s"] <= stats["last_swap_started_s"], stats
    assert 0 < stats["last_begin_update_started_s"] < before, stats
    assert stats["last_begin_update_s"] > 0, stats
    assert stats["step_hook_at"] == "execute_model"  # FakeWorker's runner has no _model_forward


def test_pacing_a_bad_budget_is_refused_before_setup_a_good_one_is_reported():
    loopback = ss.Loopback(2)
    worker = FakeWorker()
    layout, sender = _trainer(SPECS, loopback.transport(0))
    transport = loopback.transport(1)
    specs = [tuple(vars(s).values()) for s in layout.specs]
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"ReceiverConfig\.decode_slowdown_budget is 0\.5; it must be a finite "
                             r"number of at least 1\.0"):
        worker.init_weight_update_group(specs=specs, bucket_bytes=1024, transport=transport,
                                        decode_slowdown_budget=0.5)
    # Nothing was set up: no group, execute_model not hooked, the transport still the caller's.
    assert worker._shadowsync is None and "execute_model" not in vars(worker)
    worker.init_weight_update_group(specs=specs, bucket_bytes=1024, transport=transport,
                                    decode_slowdown_budget=1.5, max_receive_bytes_per_second=10**9)
    try:
        for _ in range(8):  # idle steps: the hooked execute_model stamps each one
            worker.execute_model("idle")
        handle = sender.publish(1, tensors(BASE + LORA, 1))
        worker.begin_update(handle.header_bytes)
        _step_until(worker, 1)
        handle.wait(DEADLINE_S)
        stats = worker.weight_update_stats()
    finally:
        worker.close_weight_update_group()
        sender.close()
    pacing = stats["pacing"]
    assert type(pacing) is dict and "last_pacing" not in stats  # plain data for collective_rpc
    assert pacing["paced"] is True and pacing["budget"] == 1.5
    assert pacing["idle_step_s"] > 0  # learned from the stamps of the hooked steps
    assert stats["last_transfer_s"] > 0


def test_versions_increase_and_bad_headers_change_nothing(setup):
    worker, sender = setup.worker, setup.sender
    for version in (1, 2):
        handle = sender.publish(version, tensors(BASE + LORA, version))
        worker.begin_update(handle.header_bytes)
        _step_until(worker, version)
    with pytest.raises(ss.StaleVersionError):
        worker.begin_update(handle.header_bytes)
    with pytest.raises(ss.BadHeaderError):
        worker.begin_update(b"not a header")
    with pytest.raises(ss.BadHeaderError, match="not base64"):
        worker.begin_update("not base64!")
    with pytest.raises(ss.BadHeaderError, match="a float"):
        worker.begin_update(1.5)
    worker.execute_model("b")
    assert worker.steps[-1] == {2}
    assert worker.weight_update_stats()["last_accepted_version"] == 2
    # Where the RPC carries JSON (vLLM's /collective_rpc): the header as base64 text or a list of
    # ints is the same header.
    for version, as_json in ((3, lambda h: h.header_base64), (4, lambda h: list(h.header_bytes))):
        handle = sender.publish(version, tensors(BASE + LORA, version))
        assert worker.begin_update(as_json(handle)) == version
        _step_until(worker, version)


def test_trainer_specs_that_do_not_match_the_model_are_refused():
    for specs, message in (
        ([("embed", "fp32", (300, 5))] + SPECS[1:],
         r"tensor 'embed': shape \[300, 5\] of the trainer's layout does not match the worker's \[300, 4\]"),
        ([("embed", "bf16", (300, 4))] + SPECS[1:],
         r"tensor 'embed': dtype bf16 of the trainer's layout does not match the worker's fp32"),
        (SPECS + [("lm_head", "fp32", (4,))],
         r"tensor 'lm_head' of the trainer's layout is not a parameter of the worker \(5 parameters; "
         r"1 of the trainer's tensors are not\), and FakeModel has no load_weights"),
    ):
        worker = FakeWorker()
        with pytest.raises(ss.LayoutMismatchError, match=message):
            worker.init_weight_update_group(specs=specs, transport=ss.Loopback(2).transport(1))
        assert worker._shadowsync is None  # nothing was set up
        assert "execute_model" not in vars(worker)


def test_calls_before_init_and_twice_are_refused():
    worker = FakeWorker()
    assert worker.before_step() is None  # no update group: nothing can be pending
    with pytest.raises(ss.InvalidArgumentError, match="call init_weight_update_group first"):
        worker.begin_update(b"")
    worker.init_weight_update_group(transport=ss.Loopback(2).transport(1))
    with pytest.raises(ss.InvalidArgumentError, match="already initialized"):
        worker.init_weight_update_group(transport=ss.Loopback(2).transport(1))
    worker.close_weight_update_group()


def test_importing_the_extension_imports_neither_vllm_nor_torch():
    code = ("import sys, shadowsync.vllm; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env={"PYTHONPATH": str(__import__("pathlib").Path(
                                ss.__file__).resolve().parent.parent)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_close_gives_the_worker_its_own_weights_and_execute_model_back():
    worker = FakeWorker()
    worker.init_weight_update_group(transport=ss.Loopback(2).transport(1))
    receiver = worker._shadowsync.receiver
    assert "execute_model" in vars(worker)
    worker.close_weight_update_group()
    assert "execute_model" not in vars(worker)
    for name, param in worker.model_runner.model.params:  # copies, not views of freed slots
        assert param.data.flags.owndata
        np.testing.assert_array_equal(param.data, pattern(name, 0))
    with pytest.raises(ss.InvalidHandleError):
        receiver.stats()
    assert worker.execute_model("b") == "output of b"
    assert worker.steps == [{0}]
    assert worker.before_step() is None


class _FakeFrontEnd:
    """A vllm.LLM / AsyncLLM to apply_update: wait_applied answers the version; the prefix cache
    reset answers `reset` (vLLM refuses, False, while requests hold KV blocks)."""

    def __init__(self, reset):
        self.reset = reset
        self.calls = []

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return [args[0]]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return self.reset


class _AsyncFakeFrontEnd(_FakeFrontEnd):
    """An AsyncLLM to apply_update_async: update_progress answers from `progress` (one answer
    per poll, the last one repeated); wait_applied answers the version asked for."""

    def __init__(self, reset, progress=({"applied_version": 0, "pending": False},)):
        super().__init__(reset)
        self.progress = list(progress)

    async def collective_rpc(self, method, args=()):
        if method == "update_progress":
            self.calls.append(method)
            return [self.progress.pop(0) if len(self.progress) > 1 else self.progress[0]]
        return _FakeFrontEnd.collective_rpc(self, method, args)

    async def reset_prefix_cache(self):
        return _FakeFrontEnd.reset_prefix_cache(self)


def test_apply_update_warns_when_vllm_refuses_the_prefix_cache_reset():
    import asyncio
    import warnings

    from shadowsync.vllm import apply_update, apply_update_async

    def apply_async(*args, **kwargs):
        return asyncio.run(apply_update_async(*args, **kwargs))

    def live(version):  # a generating engine: the step hook made it live already
        return lambda reset: _AsyncFakeFrontEnd(reset, [{"applied_version": version,
                                                         "pending": False}])

    for apply_call, front_end, apply in (
            ("wait_applied", lambda v: _FakeFrontEnd, apply_update),
            ("update_progress", live, apply_async)):
        refused = front_end(3)(reset=False)
        with pytest.warns(RuntimeWarning, match="version 3 is live, but vLLM refused to reset"):
            assert apply(refused, 3) == 3
        assert refused.calls == [apply_call, "reset_prefix_cache"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert apply(front_end(4)(reset=True), 4) == 4  # reset done: no warning
            skipped = front_end(5)(reset=False)
            assert apply(skipped, 5, reset_prefix_cache=False) == 5
            assert skipped.calls == [apply_call]


@pytest.mark.parametrize("make_worker,hook_at", [
    (ForwardHookWorker, "model_runner._model_forward"),
    (ConnectorHookWorker, "model_runner.kv_connector.pre_forward"),
])
def test_the_step_hook_swaps_after_the_inputs_are_prepared_right_before_the_forward(
        make_worker, hook_at):
    loopback = ss.Loopback(2)
    worker = make_worker()
    runner = worker.model_runner
    layout, sender = _trainer(SPECS, loopback.transport(0))
    worker.init_weight_update_group(specs=[tuple(vars(s).values()) for s in layout.specs],
                                    bucket_bytes=1024, transport=loopback.transport(1),
                                    track_request_versions=True)
    swapped_at = []
    original = worker.before_step

    def before_step():  # where in the step each swap happened
        applied = original()
        if applied is not None:
            swapped_at.append((applied, list(runner.events)))
        return applied

    worker.before_step = before_step
    try:
        handle = sender.publish(1, tensors(BASE + LORA, 1))
        worker.begin_update(handle.header_bytes)
        handle.wait(DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while not worker.update_progress()["pending"]:
            assert time.monotonic() < deadline, worker.weight_update_stats()
        # A step with nothing to run: no forward, so no swap.
        assert worker.execute_model("nothing scheduled") is None
        assert worker.update_progress() == {"applied_version": 0, "pending": True,
                                            "coordinated": False, "ready_version": 0}
        runner.events.clear()
        assert worker.execute_model(SimpleNamespace(num_scheduled_tokens={"r1": 3})) is not None
        # The swap ran inside the step, after its inputs were prepared and before its forward;
        # the forward read version 1 only, and the step's tokens count under version 1.
        assert [(v, [e for e, _ in events]) for v, events in swapped_at] == [(1, ["prepare inputs"])]
        assert worker.steps[-1] == {1}
        assert worker.request_versions() == {"r1": [[1, 3]]}
        assert worker.update_progress() == {"applied_version": 1, "pending": False,
                                            "coordinated": False, "ready_version": 0}
        assert worker.step_versions()["steps"] == 2  # both execute_model calls count as steps
        assert worker.weight_update_stats()["step_hook_at"] == hook_at
        if hook_at == "model_runner.kv_connector.pre_forward":
            # The runner's connector is a stand-in; vLLM's shared one is untouched.
            assert runner.kv_connector is not SHARED_NO_OP_CONNECTOR
            assert "pre_forward" not in vars(SHARED_NO_OP_CONNECTOR)
            runner.kv_connector.set_disabled(True)  # anything else reaches the real one
            assert SHARED_NO_OP_CONNECTOR.disabled is True
    finally:
        worker.close_weight_update_group()
        sender.close()
    if hook_at == "model_runner._model_forward":
        assert "_model_forward" not in vars(runner)  # the class's method again
        assert runner._model_forward("x") == {1}  # still the live values (kept on close)
    else:
        assert runner.kv_connector is SHARED_NO_OP_CONNECTOR  # the runner's own again
        assert runner.forward("x") == {1}


def test_apply_update_async_lets_the_step_hook_swap_and_applies_only_for_an_idle_engine(monkeypatch):
    import asyncio

    import shadowsync.vllm as ssv
    from shadowsync.vllm import front_end

    run = lambda front_end, *a, **k: asyncio.run(ssv.apply_update_async(front_end, *a, **k))  # noqa: E731
    streaming = {"applied_version": 1, "pending": False}
    # Generating: the bytes stream in, then a step's hook makes version 2 live. No call blocks
    # the engine thread (wait_applied is never called).
    generating = _AsyncFakeFrontEnd(True, [streaming, streaming, {"applied_version": 1, "pending": True},
                                           {"applied_version": 2, "pending": False}])
    assert run(generating, 2, timeout=DEADLINE_S, reset_prefix_cache=False) == 2
    assert generating.calls == ["update_progress"] * 4
    # Idle: received, but no step comes to take it; after the idle wait wait_applied applies it.
    monkeypatch.setattr(front_end, "_IDLE_AFTER_S", 0.02)
    idle = _AsyncFakeFrontEnd(True, [streaming, {"applied_version": 1, "pending": True}])
    assert run(idle, 2, timeout=DEADLINE_S, reset_prefix_cache=False) == 2
    assert idle.calls[-1] == "wait_applied" and idle.calls.count("wait_applied") == 1
    assert idle.calls[:2] == ["update_progress", "update_progress"]
    # Never received: a timeout naming what the workers hold, and no wait_applied.
    never = _AsyncFakeFrontEnd(True, [streaming])
    with pytest.raises(ss.ShadowsyncTimeoutError,
                       match=r"version 2 not live after 0\.05 s \(workers' applied versions \[1\], "
                             r"an update pending on \[False\], held ready \['none'\]\)"):
        run(never, 2, timeout=0.05)
    assert "wait_applied" not in never.calls
    # Coordinated workers (tensor parallelism) hold an update for commit_update: refused at once.
    coordinated = _AsyncFakeFrontEnd(True, [dict(streaming, coordinated=True)])
    with pytest.raises(ss.InvalidArgumentError, match=r"apply_update_async\(2\): the workers' "
                                                      r"commit_mode is \"coordinated\""):
        run(coordinated, 2, timeout=None)
    assert coordinated.calls == ["update_progress"]


def test_apply_update_async_under_step_agreement_reads_rank_0s_page_not_the_workers(
        monkeypatch, tmp_path):
    """commit_mode "auto" under tensor parallelism: after the first answer names rank 0's page,
    apply_update_async learns what went live from the page, with no RPC while rank 0 steps; an
    engine that stops stepping is asked (and applied by wait_applied), a closed page is dropped."""
    import asyncio

    import shadowsync.vllm as ssv
    from shadowsync.vllm import front_end
    from shadowsync.vllm.step_agreement import StepAgreement

    leader = StepAgreement(str(tmp_path / "steps"), 0, 2, create=True)
    leader.committed(0, 1)  # as the set-up does: the version live when the group began
    engine = _AsyncFakeFrontEnd(True, [{"applied_version": 1, "pending": False,
                                        "live_watch": leader.reader()}])
    # Each poll's sleep is one step of rank 0's hook; at step `commit_at` the hooks commit.
    rank_0 = SimpleNamespace(step=0, stepping=True, commit_at=None, version=None)
    real_sleep = asyncio.sleep

    async def a_step(seconds, *args, **kwargs):
        if rank_0.stepping:
            rank_0.step += 1
            leader.goes_live(rank_0.step, 0)
            if rank_0.step == rank_0.commit_at:
                leader.committed(rank_0.step, rank_0.version)
        await real_sleep(0 if rank_0.stepping else seconds)

    monkeypatch.setattr(asyncio, "sleep", a_step)
    run = lambda version: asyncio.run(ssv.apply_update_async(  # noqa: E731
        engine, version, timeout=DEADLINE_S, reset_prefix_cache=False))
    rank_0.commit_at, rank_0.version = 3, 2
    assert run(2) == 2
    assert engine.calls == ["update_progress"]  # the one that named the page
    assert rank_0.step == 3  # returned at the poll after the commit, not before
    rank_0.commit_at, rank_0.version = 10, 3
    assert run(3) == 3 and rank_0.step == 10
    assert engine.calls == ["update_progress"]  # no RPC at all
    # Rank 0 stops stepping (an idle engine) while update 4 is held ready: asked, then applied.
    monkeypatch.setattr(front_end, "_IDLE_AFTER_S", 0.02)
    rank_0.stepping = False
    engine.progress = [{"applied_version": 3, "pending": True, "live_watch": leader.reader()}]
    assert run(4) == 4
    assert engine.calls[1:] == ["update_progress"] * (len(engine.calls) - 2) + ["wait_applied"]
    # The group closed: its page is dropped, and the workers' answers count.
    leader.close()
    engine.calls.clear()
    engine.progress = [{"applied_version": 5, "pending": False}]
    assert run(5) == 5 and engine.calls == ["update_progress"]
    assert front_end._live_watches.get(engine) is None


def test_apply_update_async_polls_every_poll_s_and_refuses_a_poll_s_that_is_not_positive(monkeypatch):
    import asyncio

    import shadowsync.vllm as ssv

    slept = []
    real_sleep = asyncio.sleep

    async def recording_sleep(seconds, *args, **kwargs):
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    streaming = {"applied_version": 1, "pending": False}
    live = {"applied_version": 2, "pending": False}
    for kwargs, expected in (({}, 0.02), ({"poll_s": 0.005}, 0.005)):
        slept.clear()
        front_end = _AsyncFakeFrontEnd(True, [streaming, streaming, live])
        assert asyncio.run(ssv.apply_update_async(front_end, 2, timeout=DEADLINE_S,
                                                  reset_prefix_cache=False, **kwargs)) == 2
        assert slept == [expected, expected], (kwargs, slept)  # between the three polls
    # A poll_s longer than what is left of the timeout sleeps only what is left.
    slept.clear()
    with pytest.raises(ss.ShadowsyncTimeoutError, match=r"version 2 not live after 0\.05 s"):
        asyncio.run(ssv.apply_update_async(_AsyncFakeFrontEnd(True, [streaming]), 2, timeout=0.05,
                                           poll_s=30.0))
    assert slept and all(s <= 0.05 for s in slept), slept
    for bad in (0, -1.0, float("nan"), float("inf"), True, None, "0.02"):
        front_end = _AsyncFakeFrontEnd(True, [live])
        with pytest.raises(ss.InvalidArgumentError,
                           match=r"apply_update_async\(2\): poll_s must be a positive, finite "
                                 r"number of seconds, got " + re.escape(repr(bad))):
            asyncio.run(ssv.apply_update_async(front_end, 2, poll_s=bad))
        assert front_end.calls == []  # refused before any RPC


@contextlib.contextmanager
def _coordinated_worker_holding_update_1():
    """A FakeWorker in commit_mode "coordinated" that received update 1 and holds it ready (no
    step made it live); closed after."""
    loopback = ss.Loopback(2)
    worker = FakeWorker()
    layout, sender = _trainer(SPECS, loopback.transport(0))
    worker.init_weight_update_group(specs=[tuple(vars(s).values()) for s in layout.specs],
                                    bucket_bytes=1024, transport=loopback.transport(1),
                                    commit_mode="coordinated")
    try:
        handle = sender.publish(1, tensors(BASE + LORA, 1))
        worker.begin_update(handle.header_bytes)
        handle.wait(DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while worker.ready_version() != 1:
            assert time.monotonic() < deadline, worker.weight_update_stats()
            worker.execute_model("waiting")
        yield worker
    finally:
        worker.close_weight_update_group()
        sender.close()


def test_coordinated_commit_holds_an_update_until_commit_update():
    with _coordinated_worker_holding_update_1() as worker:
        worker.execute_model("held")
        assert worker.steps[-1] == {0}  # ready, not live: no step flips it by itself
        refused = worker.commit_update(2)  # returned, not raised (vLLM's TP executor dies)
        assert "commit(2): update 1 is ready" in refused["refused"], refused
        assert refused["applied_version"] == 0
        assert worker.commit_update(1) == {"applied_version": 1}
        worker.execute_model("after")
        assert worker.steps[-1] == {1}
        log = worker.step_versions()
        assert log["transitions"] == [[log["steps"] - 1, 1]]


def test_a_commit_seen_ready_everywhere_skips_the_agreement_only_where_every_worker_was_heard(
        monkeypatch):
    # commit_update(v, seen_ready_on_every_rank=True) spares the ranks their all-reduce only where
    # the front end's ready_version poll heard every worker: not with data parallelism inside one
    # engine (vLLM answers with the first replica's workers only) nor under external_launcher.
    import shadowsync.vllm.tensor_parallel as tensor_parallel

    def config(**changes):  # vLLM's parallel_config of a TP=2 engine, with `changes`
        return SimpleNamespace(**{"data_parallel_size": 1, "distributed_executor_backend": "mp",
                                  "tensor_parallel_size": 2, **changes})

    hears = tensor_parallel.front_end_hears_every_worker
    assert hears(SimpleNamespace(parallel_config=config()))
    assert not hears(SimpleNamespace(parallel_config=config(data_parallel_size=2)))
    assert not hears(SimpleNamespace(
        parallel_config=config(distributed_executor_backend="external_launcher")))
    assert not hears(SimpleNamespace())  # unknown: the ranks agree

    with _coordinated_worker_holding_update_1() as worker:
        agreements = []  # each all-reduce the commit asks for, with this rank's flag
        monkeypatch.setattr(tensor_parallel, "size", lambda w: 2)
        monkeypatch.setattr(tensor_parallel, "on_every_rank",
                            lambda flag: agreements.append(flag) or flag)
        worker.parallel_config = config(data_parallel_size=2)
        refused = worker.commit_update(2, True)  # not heard everywhere: the ranks agree, refuse
        assert agreements == [False] and "not ready on every tensor-parallel rank" in \
            refused["refused"], (agreements, refused)
        worker.parallel_config = config()
        assert worker.commit_update(1, True) == {"applied_version": 1}
        assert agreements == [False], agreements  # heard everywhere: no all-reduce


class _TwoRankFrontEnd:
    """What commit_update sees of an LLM whose two workers report `ready` (one entry per rank)."""

    def __init__(self, ready):
        self.ready = list(ready)
        self.calls = []

    def collective_rpc(self, method, args=()):
        self.calls.append((method, *args[1:]))  # commit_update: with seen_ready_on_every_rank
        if method == "ready_version":
            return list(self.ready)
        if method == "discard_ready_update":  # each worker drops what it holds up to args[0]
            dropped = [v if 0 < v <= args[0] else 0 for v in self.ready]
            self.ready = [0 if d else v for v, d in zip(self.ready, dropped)]
            return [{"discarded": d, "applied_version": 0} for d in dropped]
        assert method == "commit_update"
        return [{"applied_version": args[0]} for _ in self.ready]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True


def test_commit_update_waits_for_every_rank_and_names_the_late_one():
    from shadowsync.vllm import commit_update

    # Not ready anywhere yet: nothing committed, nothing dropped (a later commit may take it).
    early = _TwoRankFrontEnd([2, 0])
    with pytest.raises(ss.ShadowsyncTimeoutError,
                       match=r"commit_update\(3\): not ready on every worker after 0.05 s "
                             r"\(worker 0: 2, worker 1: none ready\); nothing was committed \["):
        commit_update(early, 3, timeout=0.05)
    assert {c[0] for c in early.calls} == {"ready_version"}
    # Ready on worker 0 only (it failed on worker 1, or is late there): no commit can come, and
    # worker 0 would take no newer update. Dropped on every worker, so the next lands alike.
    late = _TwoRankFrontEnd([3, 2])
    with pytest.raises(ss.ShadowsyncTimeoutError,
                       match=r"commit_update\(3\): not ready on every worker after 0.05 s "
                             r"\(worker 1: 2 ready\); nothing was committed; it was dropped on "
                             r"every worker \(the late ones drop it when it completes\), so the "
                             r"next update lands on every rank alike"):
        commit_update(late, 3, timeout=0.05)
    assert ("commit_update", True) not in late.calls
    assert late.calls[-1] == ("discard_ready_update",) and late.ready == [0, 0]
    ready = _TwoRankFrontEnd([3, 3])
    assert commit_update(ready, 3) == 3
    assert ready.calls == [("ready_version",), ("commit_update", True), "reset_prefix_cache"]
    # Every rank at the version or a later one (a newer update held, or under commit_mode "auto"
    # one the step hooks made live): the commit goes ahead at once and the ranks agree.
    later = _TwoRankFrontEnd([4, 3])
    commit_update(later, 3, timeout=DEADLINE_S)
    assert later.calls == [("ready_version",), ("commit_update", False), "reset_prefix_cache"]
    for bad in (0, -1.0, float("inf"), True, "0.02"):  # refused before any RPC
        untouched = _TwoRankFrontEnd([3, 3])
        with pytest.raises(ss.InvalidArgumentError, match=r"commit_update\(3\): poll_s must be"):
            commit_update(untouched, 3, poll_s=bad)
        assert untouched.calls == [], bad


class _AsyncTwoRankFrontEnd(_TwoRankFrontEnd):
    """The same, as an AsyncLLM; `ready` is one list per poll (the last one repeated) and a
    commit answers `commit` (default: every rank applied it)."""

    def __init__(self, polls, commit=None):
        super().__init__(polls[0])
        self.polls, self.commit = list(polls), commit

    async def collective_rpc(self, method, args=()):
        if method == "ready_version":
            self.ready = self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]
        if method == "commit_update" and self.commit is not None:
            self.calls.append(method)
            return self.commit
        return _TwoRankFrontEnd.collective_rpc(self, method, args)

    async def reset_prefix_cache(self):
        return _TwoRankFrontEnd.reset_prefix_cache(self)


def test_commit_update_async_waits_for_every_rank_without_blocking_and_raises_a_refusal():
    import asyncio

    from shadowsync.vllm import commit_update_async

    run = lambda front_end, *a, **k: asyncio.run(commit_update_async(front_end, *a, **k))  # noqa: E731

    async def commit_beside_a_ticker(front_end, version):
        """The commit, and how often another task ran meanwhile (none: it blocked the loop)."""
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        try:
            return await commit_update_async(front_end, version, timeout=DEADLINE_S), ticks
        finally:
            ticker.cancel()

    # Rank 1 gets there on the third poll: then one commit on both, then the cache reset; the
    # event loop ran other tasks while it waited.
    arriving = _AsyncTwoRankFrontEnd([[3, 2], [3, 2], [3, 3]])
    applied, ticks = asyncio.run(commit_beside_a_ticker(arriving, 3))
    assert applied == 3 and ticks >= 2, (applied, ticks)
    assert arriving.calls == [("ready_version",)] * 3 + [("commit_update", True),
                                                         "reset_prefix_cache"]
    late = _AsyncTwoRankFrontEnd([[3, 0]])
    with pytest.raises(ss.ShadowsyncTimeoutError,
                       match=r"commit_update_async\(3\): not ready on every worker after 0.05 s "
                             r"\(worker 1: none ready\); nothing was committed"):
        run(late, 3, timeout=0.05)
    assert ("commit_update", True) not in late.calls
    assert late.calls[-1] == ("discard_ready_update",)  # ready on worker 0 only: dropped
    refused = _AsyncTwoRankFrontEnd([[3, 3]], commit=[
        {"refused": "version 3 is not ready on rank 1", "applied_version": 2},
        {"refused": "version 3 is not ready on rank 1", "applied_version": 2}])
    with pytest.raises(ss.InvalidArgumentError, match="version 3 is not ready on rank 1"):
        run(refused, 3)
    assert "reset_prefix_cache" not in refused.calls


class _ThreadRanks:
    """Tensor-parallel ranks as threads: each runs a worker method at once, and the extension's
    cross-rank check (an all-reduce over vLLM's TP group) is a barrier among them."""

    def __init__(self, size, monkeypatch):
        import shadowsync.vllm.tensor_parallel as tensor_parallel

        self._barrier = threading.Barrier(size, timeout=DEADLINE_S)  # a hang fails loudly
        self._flags = []
        self._values = [None] * size
        self._rank = threading.local()
        self.rounds = 0
        monkeypatch.setattr(tensor_parallel, "size", lambda worker: size)
        monkeypatch.setattr(tensor_parallel, "on_every_rank", self._on_every_rank)
        monkeypatch.setattr(tensor_parallel, "gathered", self._gathered)

    def _gathered(self, value):
        rank = self._rank.index
        self._values[rank] = value
        self._barrier.wait()
        values = list(self._values)
        self._barrier.wait()  # every rank read them before the next round writes
        return values, rank

    def _on_every_rank(self, flag):
        self._flags.append(flag)
        self._barrier.wait()
        result = all(self._flags)
        if self._barrier.wait() == 0:
            self._flags.clear()
            self.rounds += 1
        self._barrier.wait()
        return result

    def run(self, workers, method, per_rank_kwargs):
        results = [None] * len(workers)

        def call(rank):
            self._rank.index = rank
            results[rank] = getattr(workers[rank], method)(**per_rank_kwargs[rank])

        threads = [threading.Thread(target=call, args=(r,)) for r in range(len(workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in threads), "a rank hangs in init_weight_update_group"
        return results


def _untouched(worker, params_before):
    """Nothing of a refused init stays: no group, no hook, the model's own arrays."""
    assert worker._shadowsync is None
    assert "execute_model" not in vars(worker)
    assert all(p.data is params_before[n] for n, p in worker.model_runner.model.params)


def test_under_tensor_parallelism_a_refusal_on_one_rank_sets_up_no_rank(monkeypatch):
    ranks = _ThreadRanks(2, monkeypatch)
    workers = [FakeWorker(), FakeWorker()]
    before = [{n: p.data for n, p in w.model_runner.model.params} for w in workers]
    loopback = ss.Loopback(3)
    good = [tuple(s) for s in SPECS]
    bad = [("embed", "fp32", (300, 5))] + good[1:]  # rank 1's model does not match
    results = ranks.run(workers, "init_weight_update_group",
                        [dict(specs=good, transport=loopback.transport(1)),
                         dict(specs=bad, transport=loopback.transport(2))])
    # Returned, not raised (a raise in a worker ends vLLM's multiprocess engine), on both ranks.
    assert results[1]["error"] == "LayoutMismatchError"
    assert "tensor 'embed': shape [300, 5] of the trainer's layout does not match" in results[1]["refused"]
    assert "refused on another tensor-parallel rank" in results[0]["refused"]
    assert ranks.rounds == 1  # the ranks agreed before any transport connected
    for worker, params_before in zip(workers, before):
        _untouched(worker, params_before)

    # The front end raises the refusing rank's own error, named.
    from shadowsync.vllm import init_weight_update_group

    front_end = SimpleNamespace(collective_rpc=lambda method, kwargs: results)
    with pytest.raises(ss.LayoutMismatchError, match=r"worker 1: tensor 'embed': shape \[300, 5\]"):
        init_weight_update_group(front_end, specs=bad)


def test_under_tensor_parallelism_a_rank_that_cannot_connect_takes_the_others_back(
        monkeypatch, tmp_path):
    ranks = _ThreadRanks(2, monkeypatch)
    workers = [FakeWorker(), FakeWorker()]
    before = [{n: p.data for n, p in w.model_runner.model.params} for w in workers]
    nobody = dict(path=str(tmp_path / "nobody.sock"), token="ssk1-efe31cd121235d6c8600c5dae229b11715c0e0aacc6adae5989808afa958a7d8", connect_timeout_ms=200)
    results = ranks.run(workers, "init_weight_update_group",
                        [dict(transport=ss.Loopback(2).transport(1)), dict(same_host=nobody)])
    assert "nobody.sock" in results[1]["refused"], results
    assert "refused on another tensor-parallel rank" in results[0]["refused"]
    assert ranks.rounds == 2  # rank 0 was set up, then closed its group again
    for worker, params_before in zip(workers, before):
        assert worker._shadowsync is None
        assert "execute_model" not in vars(worker)
        # A set-up rank adopted its weights into the library's slot; closing gave it copies.
        for name, param in worker.model_runner.model.params:
            np.testing.assert_array_equal(param.data, params_before[name])


def _auto_tensor_parallel_ranks(monkeypatch, tmp_path):
    """Two FakeWorker tensor-parallel ranks (threads) set up with commit_mode "auto" (the step
    agreement's page under tmp_path), on a loopback world with the trainer as rank 0."""
    from shadowsync.vllm import step_agreement

    monkeypatch.setattr(step_agreement, "_SHM_DIR", str(tmp_path))
    ranks = _ThreadRanks(2, monkeypatch)
    workers = [FakeWorker(), FakeWorker()]
    loopback = ss.Loopback(3)
    layout, sender = _trainer(SPECS, loopback.transport(0))
    specs = [tuple(vars(s).values()) for s in layout.specs]
    ranks.run(workers, "init_weight_update_group",
              [dict(specs=specs, bucket_bytes=1024, transport=loopback.transport(r + 1),
                    commit_mode="auto") for r in range(2)])
    return ranks, workers, loopback, sender


def test_under_tensor_parallelism_commit_mode_auto_goes_live_at_one_step_on_every_rank(
        monkeypatch, tmp_path):
    # commit_mode "auto" with two tensor-parallel ranks (threads): the step hooks agree on the
    # step over shared memory (step_agreement.py); an idle engine's wait_applied commits between
    # two steps; a commit_update of a live version answers at once.
    ranks, workers, loopback, sender = _auto_tensor_parallel_ranks(monkeypatch, tmp_path)
    try:
        assert list(tmp_path.iterdir()) == []  # the page's file is gone once both opened it
        assert [w.weight_update_stats()["step_agreement"] for w in workers] == [True, True]
        assert [w.update_progress()["coordinated"] for w in workers] == [False, False]
        handle = sender.publish(1, tensors(BASE + LORA, 1))
        ranks.run(workers, "begin_update", [dict(header_bytes=handle.header_bytes)] * 2)
        handle.wait(DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        step = 0
        while min(w.step_versions()["applied_version"] for w in workers) < 1:
            assert time.monotonic() < deadline, [w.weight_update_stats() for w in workers]
            step += 1
            ranks.run(workers, "execute_model", [dict(batch=step)] * 2)
        # Every step ran on one version on both ranks, and 1 went live at the same step.
        assert workers[0].steps == workers[1].steps and workers[0].steps[-1] == {1}
        assert workers[0].step_versions() == workers[1].step_versions()
        assert [w.weight_update_stats()["agreed_commits"] for w in workers] == [1, 1]
        # Idle: no step runs; wait_applied commits update 2 on both, between the same two steps.
        handle = sender.publish(2, tensors(BASE + LORA, 2))
        ranks.run(workers, "begin_update", [dict(header_bytes=handle.header_bytes)] * 2)
        handle.wait(DEADLINE_S)
        assert ranks.run(workers, "wait_applied", [dict(version=2, timeout=DEADLINE_S)] * 2) \
            == [2, 2]
        assert workers[0].step_versions() == workers[1].step_versions()
        ranks.run(workers, "execute_model", [dict(batch="after")] * 2)
        assert workers[0].steps[-1] == workers[1].steps[-1] == {2}
        # Written for the coordinated mode: a live version counts as ready, its commit as done.
        assert [w.ready_version() for w in workers] == [2, 2]
        assert ranks.run(workers, "commit_update", [dict(version=2)] * 2) == \
            [{"applied_version": 2}] * 2
    finally:
        ranks.run(workers, "close_weight_update_group", [{}] * 2)
        sender.close()


def test_under_tensor_parallelism_an_update_ready_on_one_rank_only_is_dropped_on_every_rank(
        monkeypatch, tmp_path):
    # commit_mode "auto", two ranks (threads). Update 2 fails on rank 1 (a flipped byte) while
    # rank 0 holds it ready: no step makes it live, an idle wait_applied drops it on both ranks
    # and says so, and update 3 (the adapter only) lands on both alike, on update 1's base. The
    # same once more through discard_ready_update, what commit_update sends on a timeout.
    from testing_hooks import inject_flip

    ranks, workers, loopback, sender = _auto_tensor_parallel_ranks(monkeypatch, tmp_path)
    calls = [0]  # broadcasts so far on every rank: each update's buckets and checksum block
    step = [0]

    def publish(version, names, groups, fails_on=None):
        handle = sender.publish(version, tensors(names, version), groups=groups)
        if fails_on is not None:  # its first bucket of this update arrives with a byte flipped
            inject_flip(loopback, fails_on + 1, calls[0], 3)
        calls[0] += ss.UpdateHeader.from_bytes(handle.header_bytes).bucket_count
        ranks.run(workers, "begin_update", [dict(header_bytes=handle.header_bytes)] * 2)
        handle.wait(DEADLINE_S)

    def receivers():
        return [w._shadowsync.receiver for w in workers]

    def steps_until(condition, what):
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert time.monotonic() < deadline, (what, [r.stats() for r in receivers()])
            step[0] += 1
            ranks.run(workers, "execute_model", [dict(batch=step[0])] * 2)

    def live_versions(worker):
        return {n: version_of(n, p.data) for n, p in worker.model_runner.model.params}

    def ready_on_one_rank_only(version, failed):
        holder = 1 - failed
        steps_until(lambda: receivers()[holder].ready_version == version
                    and receivers()[failed].stats().last_failure is not None
                    and receivers()[failed].stats().last_failure.version == version,
                    f"update {version} ready on rank {holder} and failed on rank {failed}")
        for _ in range(3):  # steps go on, on the old version: no rank makes it live
            steps_until(lambda: True, "a step")
            step[0] += 1
            ranks.run(workers, "execute_model", [dict(batch=step[0])] * 2)
        assert [r.applied_version for r in receivers()] == [version - 1] * 2

    def lands_alike_on_both(version, names, groups, base, adapter):
        """`version` (of `groups`) goes live on both ranks at one step; then both hold the base
        of update `base` and the adapter of update `adapter`."""
        publish(version, names, groups)
        steps_until(lambda: min(r.applied_version for r in receivers()) == version,
                    f"update {version} live")
        expected = {**{n: base for n in BASE}, **{n: adapter for n in LORA}}
        assert [live_versions(w) for w in workers] == [expected, expected]
        assert workers[0].step_versions() == workers[1].step_versions()

    try:
        publish(1, BASE + LORA, ["base", "lora"])
        steps_until(lambda: min(r.applied_version for r in receivers()) == 1, "update 1 live")
        publish(2, BASE + LORA, ["base", "lora"], fails_on=1)
        ready_on_one_rank_only(2, failed=1)
        errors = [None, None]

        def wait_applied_raising(rank):
            try:
                workers[rank].wait_applied(2, DEADLINE_S)
            except ss.ShadowsyncTimeoutError as error:
                errors[rank] = str(error)

        for w, rank in zip(workers, range(2)):
            w.wait_applied_raising = lambda rank=rank: wait_applied_raising(rank)
        ranks.run(workers, "wait_applied_raising", [{}] * 2)
        for error in errors:
            assert error is not None and "update 2 failed on tensor-parallel rank 1" in error, errors
            assert "the ranks held [2, 'none'] ready and dropped it" in error, errors
        assert [r.ready_version for r in receivers()] == [0, 0]
        lands_alike_on_both(3, LORA, ["lora"], base=1, adapter=3)
        # The front end's way (commit_update's timeout): discard_ready_update on every worker.
        # Update 4 fails on rank 1; then update 6 fails on rank 0 while rank 1 holds it ready,
        # its promise on the page: the promise counts for nothing, and update 7 goes live.
        for dropped, failed, following, base, adapter in ((4, 1, (BASE, ["base"]), 5, 3),
                                                          (6, 0, (LORA, ["lora"]), 5, 7)):
            publish(dropped, BASE + LORA, ["base", "lora"], fails_on=failed)
            ready_on_one_rank_only(dropped, failed=failed)
            answers = [{"discarded": 0 if rank == failed else dropped,
                        "applied_version": dropped - 1} for rank in range(2)]
            assert ranks.run(workers, "discard_ready_update", [dict(version=dropped)] * 2) \
                == answers
            lands_alike_on_both(dropped + 1, *following, base=base, adapter=adapter)
    finally:
        ranks.run(workers, "close_weight_update_group", [{}] * 2)
        sender.close()


def test_commit_mode_auto_under_tensor_parallelism_needs_the_step_hook_and_one_stage(
        monkeypatch):
    import shadowsync.vllm.tensor_parallel as tensor_parallel

    ranks = _ThreadRanks(2, monkeypatch)
    workers = [FakeWorker(), FakeWorker()]
    loopback = ss.Loopback(3)
    results = ranks.run(workers, "init_weight_update_group",
                        [dict(transport=loopback.transport(r + 1), commit_mode="auto",
                              hook_execute_model=False) for r in range(2)])
    assert all("commit_mode \"auto\" under tensor parallelism with hook_execute_model=False"
               in r["refused"] for r in results), results
    monkeypatch.setattr(tensor_parallel, "pipeline_size", lambda worker: 2)
    loopback = ss.Loopback(3)
    results = ranks.run(workers, "init_weight_update_group",
                        [dict(transport=loopback.transport(r + 1), commit_mode="auto")
                         for r in range(2)])
    assert all("with pipeline_parallel_size 2: the step hooks agree within one" in r["refused"]
               for r in results), results
    assert all(w._shadowsync is None for w in workers)


def test_under_tensor_parallelism_init_twice_keeps_the_group_it_has(monkeypatch):
    ranks = _ThreadRanks(2, monkeypatch)
    workers = [FakeWorker(), FakeWorker()]
    loopback = ss.Loopback(3)
    first = ranks.run(workers, "init_weight_update_group",
                      [dict(transport=loopback.transport(1)), dict(transport=loopback.transport(2))])
    assert first[0] == first[1] and isinstance(first[0], int)
    groups = [w._shadowsync for w in workers]
    again = ranks.run(workers, "init_weight_update_group",
                      [dict(transport=ss.Loopback(2).transport(1))] * 2)
    assert all("already initialized" in r["refused"] for r in again), again
    assert [w._shadowsync for w in workers] == groups  # the refusal left them alone
    from shadowsync.vllm import init_weight_update_group

    with pytest.raises(ss.InvalidArgumentError, match="worker 0: init_weight_update_group: "
                                                      "already initialized"):
        init_weight_update_group(SimpleNamespace(collective_rpc=lambda method, kwargs: again))
    for w in workers:
        w.close_weight_update_group()


def test_remap_under_cuda_graphs_is_refused_naming_the_way_out():
    # vLLM captures its graphs at start-up over its own parameters: remap would make the
    # receiver's memory live, which those graphs never read. Refused before anything is set up,
    # whether remap comes as the argument or in receiver_config.
    for kwargs in (dict(swap_strategy="remap"),
                   dict(receiver_config=ss.ReceiverConfig(swap_strategy="remap"))):
        worker = FakeWorker()
        before = {n: p.data for n, p in worker.model_runner.model.params}
        with pytest.raises(ss.InvalidArgumentError,
                           match=r"swap_strategy 'remap' with engine_uses_cuda_graphs: vLLM "
                                 r"captured its CUDA graphs.*weight_transfer_config="
                                 r"\{'backend': 'shadowsync'\}.*'copy_in'.*enforce_eager=True"):
            worker.init_weight_update_group(transport=ss.Loopback(2).transport(1),
                                            engine_uses_cuda_graphs=True, **kwargs)
        assert worker._shadowsync is None
        assert all(p.data is before[n] for n, p in worker.model_runner.model.params)


def _with_live_arena(worker: FakeWorker, specs) -> FakeWorker:
    """What vLLM's worker holds when it started with the 'shadowsync' weight-transfer backend: the
    live-arena engine, its arena laid out as `specs`, holding the worker's parameters of those
    names (a stand-in: the refusals below come before any receiver would take it)."""
    params = dict(worker.model_runner.model.params)
    worker.weight_transfer_engine = SimpleNamespace(
        shadowsync_live_arena=True, layout=ss.Layout(specs), arena=None,
        params=[params[s[0]] for s in specs])
    return worker


def test_memory_report_says_what_vllm_sized_its_kv_cache_with_without_an_update_group():
    worker = FakeWorker()
    assert worker.memory_report() == {"swap": None, "kv_cache_bytes": None, "live_arena": None}
    worker = _with_live_arena(FakeWorker(), SPECS)
    accounting = {"slot_bytes": 1 << 20, "freed_torch_bytes": 1 << 20,
                  "model_memory_usage_before": 3 << 20, "model_memory_usage_after": 2 << 20,
                  "corrected": True}
    worker.weight_transfer_engine.memory_accounting = accounting
    worker.available_kv_cache_memory_bytes = 5 << 30
    worker.weight_transfer_engine.swap_choice = ("live arena", "LoRA is on")
    report = worker.memory_report()
    assert report == {"swap": {"placement": "live arena", "why": "LoRA is on"},
                      "kv_cache_bytes": 5 << 30, "live_arena": accounting}
    assert report["live_arena"] is not accounting  # a copy: plain data for collective_rpc
    assert worker._shadowsync is None


def test_with_the_live_arena_parameters_in_another_order_are_refused_naming_both():
    # remap swaps the arena as a whole: the receiver's slots must be laid out exactly as it is.
    worker = _with_live_arena(FakeWorker(), list(reversed(SPECS)))
    before = {n: p.data for n, p in worker.model_runner.model.params}
    with pytest.raises(ss.InvalidArgumentError,
                       match=rf"the update's parameter 0 is '{SPECS[0][0]}'.*but the live arena "
                             rf"holds '(?!{SPECS[0][0]}')[^']+' .* there.*swap_strategy='copy_in'"):
        worker.init_weight_update_group(transport=ss.Loopback(2).transport(1),
                                        engine_uses_cuda_graphs=True)
    assert worker._shadowsync is None
    assert all(p.data is before[n] for n, p in worker.model_runner.model.params)


def test_with_the_live_arena_two_groups_of_parameters_are_refused():
    worker = _with_live_arena(FakeWorker(), SPECS)
    with pytest.raises(ss.InvalidArgumentError, match=r"live arena holds the model's parameters "
                                                      r"as one group, but the update has 2 "
                                                      r"groups of them \('a', 'b'\)"):
        worker.init_weight_update_group(transport=ss.Loopback(2).transport(1),
                                        group_of=lambda n: "a" if n == SPECS[0][0] else "b")
    assert worker._shadowsync is None


def test_with_the_live_arena_a_parameter_the_arena_does_not_hold_is_refused_naming_both():
    # Same names, dtypes and shapes, but not the parameters the arena holds (the arena was made
    # for another model object): compared by object, refused.
    worker = _with_live_arena(FakeWorker(), SPECS)
    worker.weight_transfer_engine.params[1] = Param(np.zeros(257, np.int32))
    with pytest.raises(ss.InvalidArgumentError, match=rf"the update's parameter 1 is "
                                                      rf"'{SPECS[1][0]}'.*but the live arena "
                                                      rf"holds '{SPECS[1][0]}'"):
        worker.init_weight_update_group(transport=ss.Loopback(2).transport(1),
                                        engine_uses_cuda_graphs=True)
    assert worker._shadowsync is None


def test_a_lora_adapter_without_specs_is_refused():
    # Without specs the layout is the engine's own parameters: an adapter would never be written.
    worker = FakeWorker()
    with pytest.raises(ss.InvalidArgumentError, match=r"lora_adapter=1 needs specs"):
        worker.init_weight_update_group(transport=ss.Loopback(2).transport(1), lora_adapter=1)
    assert worker._shadowsync is None


def test_gated_swaps_are_on_only_for_the_live_arena_on_the_v2_runner_and_refused_elsewhere():
    """init_weight_update_group(gated_swaps=...): None (the default) turns gates on only where a
    swap only remaps the live arena and the step hook is framed by the V2 runner's KV connector;
    False keeps them off; True is refused elsewhere naming why, before anything is set up."""
    from shadowsync.vllm.step_hook_site import gated_swaps

    v2 = ConnectorHookWorker()
    v1 = ForwardHookWorker()
    assert gated_swaps(v2, True, remaps_arena=True, hooked=True)
    assert gated_swaps(v2, None, remaps_arena=True, hooked=True)  # on where it can be
    assert not gated_swaps(v2, False, remaps_arena=True, hooked=True)
    assert not gated_swaps(v2, None, remaps_arena=False, hooked=True)
    assert not gated_swaps(v1, None, remaps_arena=True, hooked=True)
    assert not gated_swaps(v2, None, remaps_arena=True, hooked=False)
    with pytest.raises(ss.InvalidArgumentError, match=r"gated_swaps=True, but no swap only "
                                                      r"remaps"):
        gated_swaps(v2, True, remaps_arena=False, hooked=True)
    with pytest.raises(ss.InvalidArgumentError, match=r"gated_swaps=True, but the step hook runs "
                                                      r"at model_runner._model_forward"):
        gated_swaps(v1, True, remaps_arena=True, hooked=True)
    with pytest.raises(ss.InvalidArgumentError, match=r"runs at no hook \(hook_execute_model"):
        gated_swaps(v2, True, remaps_arena=True, hooked=False)

    # Through init: no live arena on the CPU, so True is refused and nothing is set up; the
    # default leaves the receiver ungated and the connector's post_forward unhooked.
    loopback = ss.Loopback(2)
    layout, sender = _trainer(SPECS, loopback.transport(0))
    specs = [tuple(vars(s).values()) for s in layout.specs]
    transport = loopback.transport(1)
    with pytest.raises(ss.InvalidArgumentError, match="gated_swaps=True, but no swap only remaps"):
        v2.init_weight_update_group(specs=specs, bucket_bytes=1024, transport=transport,
                                    gated_swaps=True)
    assert not v2.has_weight_update_group()
    v2.init_weight_update_group(specs=specs, bucket_bytes=1024, transport=transport)
    try:
        assert v2.weight_update_stats()["gated_swaps"] == 0
        assert v2.model_runner.kv_connector._after_launch is None
    finally:
        v2.close_weight_update_group()
        sender.close()
