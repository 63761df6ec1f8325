"""Faults through the Python package: the integrity flags, where a refused update
failed (ReceiverStats.last_failure), the abort watchdog's settings, and rollback()."""

import dataclasses

import numpy as np
import pytest
from support import BASE, DEADLINE_S, LORA, SPECS, Pair, tensors

import shadowsync as ss


class CheckedPair(Pair):
    """The test pair with checksums on the sender and both checks on the receiver."""

    def __init__(self):
        self.layout = ss.Layout(SPECS, bucket_bytes=1024)
        self.backend = ss.HostBackend()
        self.loopback = ss.Loopback(2)
        deadline_ms = int(DEADLINE_S * 1000)
        self.receiver = ss.Receiver(
            self.layout,
            self.backend,
            self.loopback.transport(1),
            ss.ReceiverConfig(
                update_deadline_ms=deadline_ms, require_checksums=True, reject_nonfinite=True
            ),
        )
        self.sender = ss.Sender(
            self.layout,
            self.backend,
            self.loopback.transport(0),
            ss.SenderConfig(update_deadline_ms=deadline_ms, checksums=True),
        )


@pytest.fixture
def checked():
    p = CheckedPair()
    yield p
    p.close()


def test_watchdog_settings_reach_the_library():
    layout = ss.Layout(SPECS, bucket_bytes=1024)
    backend = ss.HostBackend()
    with pytest.raises(ss.InvalidArgumentError, match=r"abort_deadline \(ms\) must be positive, got 0"):
        ss.Receiver(layout, backend, None, ss.ReceiverConfig(abort_deadline_ms=0))
    receiver = ss.Receiver(
        layout, backend, None, ss.ReceiverConfig(abort_deadline_ms=500, exit_on_stuck_abort=True)
    )
    try:
        stats = receiver.stats()
        assert stats.stuck_aborts == 0
        assert stats.last_failure is None
    finally:
        receiver.close()


def test_checksummed_updates_apply_and_a_header_without_them_is_refused(checked):
    checked.update(1, BASE + LORA)
    assert checked.live_versions() == {s[0]: 1 for s in SPECS}
    handle = checked.sender.publish(2, tensors(BASE, 2))
    # The same update as a sender without checksums would announce it: one broadcast fewer.
    plain = dataclasses.replace(handle.header, bucket_count=handle.header.bucket_count - 1)
    with pytest.raises(ss.BadHeaderError, match="carries no checksums"):
        checked.receiver.begin_update(plain)
    checked.receiver.begin_update(handle.header_bytes)
    checked.receiver.wait_applied(2, DEADLINE_S)
    handle.wait(DEADLINE_S)
    assert checked.receiver.stats().last_failure is None


def test_a_nan_is_refused_naming_the_tensor_and_the_next_update_applies(checked):
    checked.update(1, BASE)
    bad = tensors(BASE, 2)
    bad["embed"] = bad["embed"].copy()
    bad["embed"][3, 1] = np.nan
    handle = checked.sender.publish(2, bad)
    checked.receiver.begin_update(handle.header_bytes)
    handle.wait(DEADLINE_S)  # sent fine: the receiver refuses it
    checked.receiver.drain()
    stats = checked.receiver.stats()
    assert stats.updates_failed == 1
    failure = stats.last_failure
    assert failure == ss.UpdateFailure(version=2, status=1, group="base", bucket=None, tensor="embed")
    assert failure.status_name == "SHADOWSYNC_INVALID_ARGUMENT"
    assert "tensor 'embed' of group 'base'" in checked.receiver.last_update_error()
    assert checked.receiver.before_step() is None  # the engine stays on version 1
    assert checked.live_versions()["embed"] == 1
    checked.update(3, BASE)
    assert checked.live_versions()["embed"] == 3


def test_rollback_flips_back_one_level(pair):
    with pytest.raises(ss.InvalidArgumentError, match="no update has been applied yet"):
        pair.receiver.rollback()
    swaps = []
    pair.receiver.set_swap_callback(lambda version, groups: swaps.append((version, groups)))
    pair.update(1, BASE + LORA)
    pair.update(2, BASE)
    assert pair.receiver.rollback() == 2
    # The callback sees the slot version 1 made live, live again, holding version 1.
    assert swaps[-1] == (2, [ss.GroupSwap(group=0, slot=swaps[0][1][0].slot, content_version=1)])
    assert pair.live_versions() == {s[0]: 1 for s in SPECS}
    assert pair.receiver.applied_version == 2  # versions made live only increase
    assert pair.receiver.live_content_version("base") == 1
    with pytest.raises(ss.InvalidArgumentError, match="already rolled back"):
        pair.receiver.rollback()
    pair.update(3, BASE)
    assert pair.live_versions()["embed"] == 3
