"""Pacing from Python (ReceiverConfig.decode_slowdown_budget, max_receive_bytes_per_second): the
config reaches the library, bad values are refused naming the field and the value (in Python, and
by the library for a struct that bypasses the Python check), and ReceiverStats reports the last
ready update's transfer time and what pacing did to it (last_pacing).

The paced update runs against an engine thread that calls before_step and then works for a known
time (STEP_S) per step: the receiver learns the idle step time from the step hook's stamps. The
semantics of the controller (the budget holds under contention) are the C++ test's
(tests/integration/test_pacing.cpp); here the plumbing and the report."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import threading
import time

import pytest
from support import BASE, DEADLINE_S, LORA, SPECS, tensors
from testing_hooks import inject_delay

import shadowsync as ss
from shadowsync import _library
from shadowsync.errors import call

STEP_S = 0.005  # the simulated engine's step
BUCKET_DELAY_US = 4000  # each received bucket takes this much longer: the update spans steps


class SteppingEngine:
    """The engine thread: before_step, then STEP_S of simulated work, until stopped."""

    def __init__(self, receiver: ss.Receiver):
        self.receiver = receiver
        self.steps = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine")
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.receiver.before_step()
                time.sleep(STEP_S)  # the step's work, not a wait for a condition
                self.steps += 1
        except BaseException as error:  # noqa: BLE001 - reported by wait_for
            self.errors.append(error)

    def wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"timed out after {DEADLINE_S} s waiting for {what}"
            time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), "the engine thread did not stop"
        assert not self.errors, self.errors


def _rig(config: ss.ReceiverConfig):
    layout = ss.Layout(SPECS, bucket_bytes=1024)
    backend = ss.HostBackend()
    loopback = ss.Loopback(2)
    receiver = ss.Receiver(layout, backend, loopback.transport(1), config)
    sender = ss.Sender(layout, backend, loopback.transport(0),
                       ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)))
    return layout, loopback, receiver, sender


def _one_update_while_stepping(config: ss.ReceiverConfig, bucket_delay_us: int = 0):
    """(the receiver's stats, the update's bucket count) after one update (every tensor, version
    1) made live by an engine stepping every STEP_S; 16 idle steps first, so the receiver knows
    the idle step time (a budget's baseline, the clean-step limit). `bucket_delay_us`: delays
    each receive by that much."""
    layout, loopback, receiver, sender = _rig(config)
    engine = SteppingEngine(receiver)
    buckets = sum(g.bucket_count for g in layout.groups)
    try:
        engine.wait_for(lambda: engine.steps >= 16, "16 idle engine steps")
        if bucket_delay_us:
            for call_index in range(2 * buckets):  # every receive of this update (and more)
                inject_delay(loopback, 1, call_index, bucket_delay_us)
        handle = sender.publish(1, tensors(BASE + LORA, 1))
        receiver.begin_update(handle.header_bytes)
        engine.wait_for(lambda: receiver.applied_version == 1, "update 1 applied by the engine")
        handle.wait(DEADLINE_S)
    finally:
        engine.stop()
    stats = receiver.stats()
    receiver.close()
    sender.close()
    return stats, buckets


def test_a_paced_update_reports_the_idle_step_and_the_steps_it_spanned():
    config = ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000),
                               decode_slowdown_budget=1.05)
    stats, buckets = _one_update_while_stepping(config, bucket_delay_us=BUCKET_DELAY_US)
    pacing = stats.last_pacing

    assert stats.updates_ready == 1
    assert pacing.paced and pacing.budget == 1.05
    # A step is STEP_S of sleep plus the hook: never shorter; a loaded machine adds a little.
    assert STEP_S <= pacing.idle_step_s < 2 * STEP_S, pacing
    # The update took buckets x BUCKET_DELAY_US at least: the engine stepped meanwhile.
    assert stats.last_transfer_s >= buckets * BUCKET_DELAY_US * 1e-6, (stats.last_transfer_s, buckets)
    assert pacing.steps > 0, pacing
    assert pacing.step_during_s > 0 and pacing.step_ratio > 0, pacing
    assert pacing.busy_s > 0 and 0 < pacing.duty <= 1, pacing
    assert not pacing.deadline_limited
    # Offered once a step started after the last bucket: the stepping engine brought one within
    # 4 idle steps (the C field reaches Python).
    assert not pacing.clean_step_missed, pacing
    assert 0 < pacing.clean_step_wait_s <= 4 * pacing.idle_step_s + 0.5, pacing


def test_a_rate_cap_alone_holds_the_buckets_back_and_reports_no_budget():
    cap = 200_000  # bytes per second: the update's ~7 KB take ~35 ms
    layout, loopback, receiver, sender = _rig(
        ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000),
                          max_receive_bytes_per_second=cap))
    try:
        handle = sender.publish(1, tensors(BASE + LORA, 1))
        receiver.begin_update(handle.header_bytes)
        receiver.wait_applied(1, DEADLINE_S)
        handle.wait(DEADLINE_S)
        stats = receiver.stats()
    finally:
        receiver.close()
        sender.close()
    pacing = stats.last_pacing
    assert pacing.paced and pacing.budget is None
    assert pacing.held_back_s > 0 and pacing.duty < 1, pacing
    # Every bucket but the last is held to the cap's pace.
    last_bucket = layout.groups[-1].bucket_bytes
    assert stats.last_transfer_s >= (stats.bytes_received - last_bucket) / cap, stats
    assert pacing.idle_step_s == 0 and pacing.steps == 0  # no budget: no step stamps read


def test_offer_after_clean_step_without_a_budget_reports_the_clean_step_wait_unpaced():
    """The vLLM workers' default: offer_after_clean_step on, no budget, no cap. Nothing is paced,
    but the receiver still holds the complete update for a clean step, and the report says how
    long (or that none came) although `paced` is False."""
    config = ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000),
                               offer_after_clean_step=True)
    stats, _ = _one_update_while_stepping(config)
    pacing = stats.last_pacing

    assert stats.updates_ready == 1
    assert not pacing.paced and pacing.budget is None, pacing
    assert pacing.held_back_s == 0 and pacing.steps == 0, pacing
    # The receiver waited from the last bucket to the next step's start (a step is at least
    # STEP_S), or 4 idle steps when the engine thread was kept from stepping that long.
    assert pacing.clean_step_wait_s > 0, pacing
    if pacing.clean_step_missed:
        assert pacing.clean_step_wait_s >= 4 * STEP_S, pacing
    else:
        assert pacing.clean_step_wait_s <= 4 * 2 * STEP_S + 0.5, pacing


def test_an_unpaced_update_reports_its_transfer_time_and_paced_false(pair):
    assert pair.receiver.stats().last_transfer_s == 0.0  # none yet
    assert pair.receiver.stats().last_pacing == ss.PacingReport()
    pair.update(1, BASE)
    stats = pair.receiver.stats()
    assert stats.last_transfer_s > 0
    assert stats.last_pacing == ss.PacingReport()
    assert stats.last_pacing.paced is False and stats.last_pacing.budget is None


@pytest.mark.parametrize("budget", [math.nan, math.inf, -math.inf, 0.999, 0.5, 0, 0.0, -1])
def test_a_bad_budget_is_refused_naming_it_and_its_value_nothing_created(budget):
    loopback = ss.Loopback(2)
    layout = ss.Layout(SPECS, bucket_bytes=1024)
    backend = ss.HostBackend()
    transport = loopback.transport(1)
    with pytest.raises(ss.InvalidArgumentError,
                       match=rf"ReceiverConfig\.decode_slowdown_budget is {re_value(budget)}; it "
                             rf"must be a finite number of at least 1\.0"):
        ss.Receiver(layout, backend, transport, ss.ReceiverConfig(decode_slowdown_budget=budget))
    # Nothing was created and the transport is still the caller's: a receiver can take it.
    ss.Receiver(layout, backend, transport, ss.ReceiverConfig()).close()


def re_value(value) -> str:
    import re

    return re.escape(repr(value))


@pytest.mark.parametrize("budget", [True, "1.1", [1.1]])
def test_a_budget_that_is_not_a_number_is_refused_naming_its_type(budget):
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"ReceiverConfig\.decode_slowdown_budget is .* it must be a number"):
        ss.Receiver(ss.Layout(SPECS, bucket_bytes=1024), ss.HostBackend(), None,
                    ss.ReceiverConfig(decode_slowdown_budget=budget))


@pytest.mark.parametrize("cap", [-1, 1.5, 1 << 64, True, "100"])
def test_a_bad_rate_cap_is_refused_naming_it_and_its_value(cap):
    with pytest.raises(ss.InvalidArgumentError,
                       match=rf"ReceiverConfig\.max_receive_bytes_per_second is {re_value(cap)}; "
                             rf"it must be an integer from 0"):
        ss.Receiver(ss.Layout(SPECS, bucket_bytes=1024), ss.HostBackend(), None,
                    ss.ReceiverConfig(max_receive_bytes_per_second=cap))


@pytest.mark.parametrize("budget,shown", [(0.5, "0.5"), (math.nan, "nan"), (-2.0, "-2")])
def test_the_library_refuses_a_bad_budget_in_the_c_struct_with_its_message(budget, shown):
    """A caller of the C ABI that skips the Python check: the library's own refusal, whose
    message names the C++ field and the value."""
    layout = ss.Layout(SPECS, bucket_bytes=1024)
    backend = ss.HostBackend()
    c_config = _library.config_struct(_library.ReceiverConfigC, decode_slowdown_budget=budget)
    handle = ctypes.c_void_p()
    with pytest.raises(ss.InvalidArgumentError,
                       match=rf"ReceiverConfig::decode_slowdown_budget is {shown}; it must be a "
                             rf"finite number of at least 1\.0"):
        call("shadowsync_receiver_create", layout.handle, backend.handle, None,
             ctypes.byref(c_config), ctypes.byref(handle))
    assert handle.value is None  # nothing was created


def test_the_pacing_config_round_trips_into_the_c_struct():
    default = ss.ReceiverConfig()
    assert (default.decode_slowdown_budget, default.max_receive_bytes_per_second) == (None, 0)
    c = _library.config_struct(_library.ReceiverConfigC, **default._c_fields())
    assert (c.decode_slowdown_budget, c.max_receive_bytes_per_second) == (0.0, 0)  # none, none

    config = ss.ReceiverConfig(decode_slowdown_budget=1.05, max_receive_bytes_per_second=123)
    c = _library.config_struct(_library.ReceiverConfigC, **config._c_fields())
    assert (c.decode_slowdown_budget, c.max_receive_bytes_per_second) == (1.05, 123)
    # Untouched fields keep the library's defaults.
    assert c.update_deadline_ms == _library.CONFIG_UNDEF_INT64
    assert dataclasses.replace(config, commit_mode="coordinated").decode_slowdown_budget == 1.05

    # An integer budget is a number like any other; 1.0 (no slowdown allowed) is valid.
    for budget in (2, 1.0):
        c = _library.config_struct(_library.ReceiverConfigC,
                                   **ss.ReceiverConfig(decode_slowdown_budget=budget)._c_fields())
        assert c.decode_slowdown_budget == float(budget)
        receiver = ss.Receiver(ss.Layout(SPECS, bucket_bytes=1024), ss.HostBackend(), None,
                               ss.ReceiverConfig(decode_slowdown_budget=budget))
        receiver.close()
